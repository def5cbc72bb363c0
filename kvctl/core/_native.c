/* The loops Python cannot make cheap: reading a prompt's token ids out of its JSON, reading an engine event's
 * ids and hashes out of its msgpack, and hashing blocks.
 *
 * u32_from_json: POST /v1/route carries ~2k token ids per request. Decoding them into a list of Python ints,
 * checking each against the u32 range and packing them again took half the route's server time; this reads
 * the digits once and writes the u32s straight into the result. Errors say what msgspec would have said for
 * `list[int]` with bounds [0, 2^32 - 1], so a bad token id reads the same as any other invalid field.
 *
 * engine_batch_msgpack: an engine's KV event batch read in one pass, its token ids and hashes packed as they are
 * read, without an int object per element (see its comment).
 *
 * xxh3_blocks and xxh3_chain: a prompt's local and sequence hashes, with the same xxHash release the
 * `xxhash` package wraps (vendor/xxhash.h), without a Python call and a bytes object per block.
 *
 * bind_run: the index points a stored run's engine hashes at their node in the worker's lookup. Checking the
 * run against the lookup first and inserting it after cost two probes of a large dict per block, each a cache
 * miss; this inserts as it checks, one probe, and stops where a key is bound elsewhere (rare: Python decides).
 *
 * U64Map (u64_map.h): the index's engine hash -> node map, a u64 in a slot instead of an int object in a dict.
 *
 * u64s_distinct: whether a stored run repeats a hash, asked of every store. A set of the run's int objects cost
 * a tenth of a store; the run is packed anyway (the edge keeps it so), and sorting a copy of it takes no object.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "vendor/xxhash.h"

#define U32_MAX_VALUE 4294967295ULL

#include "u64_map.h"

static int is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static int is_digit(unsigned char c) { return c >= '0' && c <= '9'; }

/* The JSON type a value starting with `c` has, in msgspec's words. */
static const char *json_type(unsigned char c) {
    switch (c) {
    case '"': return "str";
    case '[': return "array";
    case '{': return "object";
    case 't': case 'f': return "bool";
    case 'n': return "null";
    default: return NULL;
    }
}

static PyObject *invalid_json(Py_ssize_t at) {
    PyErr_Format(PyExc_ValueError, "JSON is malformed at byte %zd of `$.token_ids`", at);
    return NULL;
}

/* Parse the JSON array of u32s at s[i] (just past its '['), writing them to ids; the index just past its ']', or
 * -1 with a ValueError set. ids must have room for every element (n / 2 + 1 is a bound). */
static Py_ssize_t parse_u32_array(const unsigned char *s, const Py_ssize_t n, Py_ssize_t i, uint32_t *ids,
                                  Py_ssize_t *count_out) {
    Py_ssize_t count = 0;
    while (i < n && is_ws(s[i])) i++;
    if (i < n && s[i] == ']') { *count_out = 0; return i + 1; }
    for (;;) {
        while (i < n && is_ws(s[i])) i++;
#if PY_LITTLE_ENDIAN
        /* The usual element, 1 to 7 digits and then ',' or ']', read from 8 bytes at once: no branch per digit,
         * whose exit the CPU mispredicts at every id (token ids have 1 to 6 digits, at random). Anything else,
         * and the last few bytes, go the general way below. */
        if (n - i >= 8) {
            uint64_t x;
            memcpy(&x, s + i, 8);
            const uint64_t d = x - 0x3030303030303030ULL; /* borrows run only past the first non-digit */
            const uint64_t nondigit = (d | (d + 0x7676767676767676ULL)) & 0x8080808080808080ULL;
            const int len = nondigit ? __builtin_ctzll(nondigit) >> 3 : 8;
            if (len > 0 && len < 8 && (len == 1 || s[i] != '0') && (s[i + len] == ',' || s[i + len] == ']')) {
                uint64_t v = d << (64 - 8 * len); /* the digits, right-aligned behind leading zeros */
                v = (v * 2561) >> 8 & 0x00FF00FF00FF00FFULL;
                v = (v * 6553601) >> 16 & 0x0000FFFF0000FFFFULL;
                ids[count++] = (uint32_t)((v * 42949672960001ULL) >> 32);
                i += len;
                if (s[i++] == ']') { *count_out = count; return i; }
                continue;
            }
        }
#endif
        if (i == n) { invalid_json(i); return -1; }
        const Py_ssize_t start = i;
        int negative = 0;
        if (s[i] == '-') { negative = 1; i++; }
        if (i == n || !is_digit(s[i])) {
            const char *type = negative ? NULL : json_type(s[start]);
            if (type == NULL) invalid_json(start);
            else PyErr_Format(PyExc_ValueError, "Expected `int`, got `%s` - at `$.token_ids[%zd]`", type, count);
            return -1;
        }
        unsigned long long value = 0;
        int too_big = 0;
        if (s[i] == '0') {
            i++;
        } else {
            for (; i < n && is_digit(s[i]); i++) {
                value = value * 10 + (unsigned long long)(s[i] - '0');
                if (value > U32_MAX_VALUE) { too_big = 1; value = U32_MAX_VALUE + 1; }
            }
        }
        int fractional = 0;
        if (i < n && s[i] == '.') {
            i++;
            if (i == n || !is_digit(s[i])) { invalid_json(i); return -1; }
            while (i < n && is_digit(s[i])) i++;
            fractional = 1;
        }
        if (i < n && (s[i] == 'e' || s[i] == 'E')) {
            i++;
            if (i < n && (s[i] == '+' || s[i] == '-')) i++;
            if (i == n || !is_digit(s[i])) { invalid_json(i); return -1; }
            while (i < n && is_digit(s[i])) i++;
            fractional = 1;
        }
        if (i < n && is_digit(s[i])) { invalid_json(i); return -1; } /* a leading zero: 01 */
        if (fractional) {
            PyErr_Format(PyExc_ValueError, "Expected `int`, got `float` - at `$.token_ids[%zd]`", count);
            return -1;
        }
        if (negative && value != 0) {
            PyErr_Format(PyExc_ValueError, "Expected `int` >= 0 - at `$.token_ids[%zd]`", count);
            return -1;
        }
        if (too_big) {
            PyErr_Format(PyExc_ValueError, "Expected `int` <= 4294967295 - at `$.token_ids[%zd]`", count);
            return -1;
        }
        ids[count++] = (uint32_t)value;
        while (i < n && is_ws(s[i])) i++;
        if (i == n) { invalid_json(i); return -1; }
        if (s[i] == ']') { *count_out = count; return i + 1; }
        if (s[i] != ',') { invalid_json(i); return -1; }
        i++;
    }
}

/* A bytes object with room for the u32s of any array within n bytes of JSON. */
static PyObject *u32_buffer(Py_ssize_t n) {
    return PyBytes_FromStringAndSize(NULL, (n / 2 + 1) * (Py_ssize_t)sizeof(uint32_t));
}

static PyObject *u32_from_json(PyObject *module, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *s = view.buf;
    const Py_ssize_t n = view.len;
    PyObject *out = NULL;
    Py_ssize_t i = 0, count = 0;

    while (i < n && is_ws(s[i])) i++;
    if (i == n) { invalid_json(i); goto done; }
    if (s[i] != '[') {
        const char *type = json_type(s[i]);
        if (type == NULL) type = (is_digit(s[i]) || s[i] == '-') ? "number" : NULL;
        if (type == NULL) invalid_json(i);
        else PyErr_Format(PyExc_ValueError, "Expected `array`, got `%s` - at `$.token_ids`", type);
        goto done;
    }
    out = u32_buffer(n);
    if (out == NULL) goto done;
    i = parse_u32_array(s, n, i + 1, (uint32_t *)PyBytes_AS_STRING(out), &count);
    if (i < 0) goto fail;
    while (i < n && is_ws(s[i])) i++;
    if (i != n) { invalid_json(i); goto fail; }
    if (_PyBytes_Resize(&out, count * (Py_ssize_t)sizeof(uint32_t)) < 0) out = NULL;
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyBuffer_Release(&view);
    return out;
}

static const char TOKEN_IDS_KEY[] = "\"token_ids\"";

/* A route body that opens with its token ids, read in one pass: (u32 bytes, offset of what follows), where
 * what follows is the next member's opening quote or the closing brace; None for any other body, or one
 * whose array is not sound (the caller's general path then reads it, and words its error). */
static PyObject *u32_head_of_object(PyObject *module, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *s = view.buf;
    const Py_ssize_t n = view.len;
    const Py_ssize_t key = (Py_ssize_t)(sizeof TOKEN_IDS_KEY - 1);
    PyObject *result = NULL, *out = NULL;
    Py_ssize_t i = 0, count = 0;

    while (i < n && is_ws(s[i])) i++;
    if (i == n || s[i] != '{') goto other;
    i++;
    while (i < n && is_ws(s[i])) i++;
    if (n - i < key || memcmp(s + i, TOKEN_IDS_KEY, (size_t)key) != 0) goto other;
    i += key;
    while (i < n && is_ws(s[i])) i++;
    if (i == n || s[i] != ':') goto other;
    i++;
    while (i < n && is_ws(s[i])) i++;
    if (i == n || s[i] != '[') goto other;
    out = u32_buffer(n);
    if (out == NULL) goto done;
    i = parse_u32_array(s, n, i + 1, (uint32_t *)PyBytes_AS_STRING(out), &count);
    if (i < 0) { PyErr_Clear(); goto other; }
    while (i < n && is_ws(s[i])) i++;
    if (i < n && s[i] == ',') {
        i++;
        while (i < n && is_ws(s[i])) i++;
        if (i == n || s[i] != '"') goto other; /* a trailing comma, or worse */
    } else if (i == n || s[i] != '}') {
        goto other;
    }
    if (_PyBytes_Resize(&out, count * (Py_ssize_t)sizeof(uint32_t)) < 0) { out = NULL; goto done; }
    result = Py_BuildValue("(Nn)", out, i);
    out = NULL;
    goto done;
other:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(out);
    PyBuffer_Release(&view);
    return result;
}

/* Big-endian unsigned integer of `size` bytes at s. */
static uint64_t be_uint(const unsigned char *s, int size) {
    uint64_t v = 0;
    for (int k = 0; k < size; k++) v = v << 8 | s[k];
    return v;
}

/* The element count of the msgpack array at s[*i], moving *i past its header; -1 when there is none. */
static Py_ssize_t array_header(const unsigned char *s, const Py_ssize_t n, Py_ssize_t *i) {
    Py_ssize_t count;
    if (n - *i >= 1 && (s[*i] & 0xf0) == 0x90) {
        count = s[*i] & 0x0f;
        *i += 1;
    } else if (n - *i >= 3 && s[*i] == 0xdc) {
        count = (Py_ssize_t)be_uint(s + *i + 1, 2);
        *i += 3;
    } else if (n - *i >= 5 && s[*i] == 0xdd) {
        count = (Py_ssize_t)be_uint(s + *i + 1, 4);
        *i += 5;
    } else {
        return -1;
    }
    return count > n - *i ? -1 : count; /* every element takes at least a byte */
}

/* The msgpack unsigned int (any int encoding, not negative) at s[*i], moving *i past it; 0 when there is none.
 * Each encoding's width is a constant here: every token id and hash of an event passes through it. */
static inline int read_uint(const unsigned char *s, const Py_ssize_t n, Py_ssize_t *i, uint64_t *v) {
    const Py_ssize_t at = *i;
    if (at >= n) return 0;
    const unsigned char c = s[at];
    const Py_ssize_t left = n - at - 1;
    if (c <= 0x7f) { /* positive fixint */
        *v = c;
        *i = at + 1;
        return 1;
    }
    switch (c) {
    case 0xcc: case 0xd0: /* uint 8, int 8 */
        if (left < 1 || (c == 0xd0 && s[at + 1] & 0x80)) return 0;
        *v = s[at + 1];
        *i = at + 2;
        return 1;
    case 0xcd: case 0xd1: /* 16 */
        if (left < 2 || (c == 0xd1 && s[at + 1] & 0x80)) return 0;
        *v = (uint64_t)s[at + 1] << 8 | s[at + 2];
        *i = at + 3;
        return 1;
    case 0xce: case 0xd2: /* 32 */
        if (left < 4 || (c == 0xd2 && s[at + 1] & 0x80)) return 0;
        *v = be_uint(s + at + 1, 4);
        *i = at + 5;
        return 1;
    case 0xcf: case 0xd3: /* 64: an int 64 only when the value is not negative */
        if (left < 8 || (c == 0xd3 && s[at + 1] & 0x80)) return 0;
        *v = be_uint(s + at + 1, 8);
        *i = at + 9;
        return 1;
    default:
        return 0;
    }
}

/* read_uint with the encodings of token ids first (a fixint, a uint 16): a store's ids are read by the hundred. */
static inline int read_token(const unsigned char *s, const Py_ssize_t n, Py_ssize_t *i, uint64_t *v) {
    const Py_ssize_t at = *i;
    if (at < n - 2 && s[at] == 0xcd) {
        *v = (uint64_t)s[at + 1] << 8 | s[at + 2];
        *i = at + 3;
        return 1;
    }
    return read_uint(s, n, i, v);
}

static inline void put_u32le(unsigned char *dst, uint64_t v) {
#if PY_LITTLE_ENDIAN
    const uint32_t word = (uint32_t)v;
    memcpy(dst, &word, 4); /* one store */
#else
    for (int b = 0; b < 4; b++) dst[b] = (unsigned char)(v >> (8 * b));
#endif
}

/* ----- engine_batch_msgpack: an engine's KV event batch read in one pass ---------------------------------------
 *
 * The typed decoding pass took the batch through msgspec with the token ids and hashes left raw, then read those
 * again in C: every id was walked twice, and an EAGLE store's [t, t+1] pairs cost msgspec a skip of 3 elements per
 * token (1.4x the plain store). This reads the batch once, as the twin (`_native_py.engine_batch_msgpack`, the
 * same msgspec types) reads it: `[ts, events, dp_rank?]`, each event a map tagged by `type` (BlockStored,
 * BlockRemoved, AllBlocksCleared) with only the fields vLLM 0.34 and SGLang 0.5.23 send. Anything else (an unknown
 * field or tag, a value of the wrong type, an ext, nesting deeper than MAX_DEPTH, bad UTF-8, trailing bytes) is a
 * ValueError without detail: the caller then walks the batch the general way, which says what is wrong. */

#define MAX_DEPTH 32

enum { F_BLOCK_HASHES, F_TOKEN_IDS, F_PARENT, F_BLOCK_SIZE, F_LORA_NAME, F_MEDIUM, F_LORA_ID, F_EXTRA_KEYS,
       F_GROUP_IDX, F_SPEC_KIND, F_SPEC_WINDOW, F_LOCALITY, F_OWNERSHIP, F_SESSION_ID, F_CACHE_SALT, F_LOOKAHEAD,
       N_FIELDS };
static const char *const FIELD_NAMES[N_FIELDS] = {
    "block_hashes", "token_ids", "parent_block_hash", "block_size", "lora_name", "medium", "lora_id", "extra_keys",
    "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
    "cache_salt", "lookahead_token_ids"};
/* The fields each kind may have (bit i: FIELD_NAMES[i]), and those it must. */
#define BIT(f) (1u << (f))
static const unsigned ALLOWED[3] = {
    (1u << N_FIELDS) - 1,
    BIT(F_BLOCK_HASHES) | BIT(F_MEDIUM) | BIT(F_GROUP_IDX) | BIT(F_SPEC_KIND) | BIT(F_LOCALITY) | BIT(F_OWNERSHIP),
    BIT(F_GROUP_IDX) | BIT(F_LOCALITY) | BIT(F_OWNERSHIP)};
static const unsigned REQUIRED[3] = {BIT(F_BLOCK_HASHES) | BIT(F_TOKEN_IDS), BIT(F_BLOCK_HASHES), 0};
static const char *const KINDS[3] = {"BlockStored", "BlockRemoved", "AllBlocksCleared"};

typedef struct {
    const unsigned char *s;
    Py_ssize_t n, i;
} Reader;

/* The length of the str at the reader (moving past its header), -1 when the value is no str or is cut short. */
static Py_ssize_t str_header(Reader *r) {
    const unsigned char *s = r->s;
    const Py_ssize_t n = r->n, i = r->i;
    Py_ssize_t len, head;
    if (i >= n) return -1;
    if ((s[i] & 0xe0) == 0xa0) {
        len = s[i] & 0x1f;
        head = 1;
    } else if (s[i] >= 0xd9 && s[i] <= 0xdb) {
        head = 1 + (1 << (s[i] - 0xd9));
        if (n - i < head) return -1;
        len = (Py_ssize_t)be_uint(s + i + 1, (int)head - 1);
    } else {
        return -1;
    }
    if (len > n - i - head) return -1;
    r->i += head;
    return len;
}

/* The count of the map at the reader (moving past its header), -1 when the value is no map. */
static Py_ssize_t map_header(Reader *r) {
    const unsigned char *s = r->s;
    const Py_ssize_t n = r->n, i = r->i;
    Py_ssize_t count;
    if (i < n && (s[i] & 0xf0) == 0x80) {
        count = s[i] & 0x0f;
        r->i += 1;
    } else if (n - i >= 3 && s[i] == 0xde) {
        count = (Py_ssize_t)be_uint(s + i + 1, 2);
        r->i += 3;
    } else if (n - i >= 5 && s[i] == 0xdf) {
        count = (Py_ssize_t)be_uint(s + i + 1, 4);
        r->i += 5;
    } else {
        return -1;
    }
    return count > (n - r->i) / 2 ? -1 : count; /* a key and a value take a byte each at least */
}

/* The int at the reader as a Python int (any int encoding, signed or not); NULL, without an error set, when the
 * value is no int. */
static PyObject *read_int(Reader *r) {
    uint64_t v;
    const Py_ssize_t at = r->i;
    if (read_uint(r->s, r->n, &r->i, &v)) return PyLong_FromUnsignedLongLong(v);
    if (at >= r->n) return NULL;
    const unsigned char c = r->s[at];
    if (c >= 0xe0) { /* negative fixint */
        r->i += 1;
        return PyLong_FromLong((long)(int8_t)c);
    }
    if (c >= 0xd0 && c <= 0xd3) { /* a negative int 8, 16, 32 or 64 (read_uint took the others) */
        const int size = 1 << (c - 0xd0);
        if (r->n - at - 1 < size) return NULL;
        uint64_t bits = be_uint(r->s + at + 1, size);
        if (size < 8) bits |= ~0ULL << (8 * size); /* sign-extended */
        r->i += 1 + size;
        return PyLong_FromLongLong((long long)bits);
    }
    return NULL;
}

/* The msgpack value at the reader as Python objects (what msgspec makes of a field typed Any); NULL with an
 * error set when it cannot be read. */
static PyObject *read_any(Reader *r, int depth) {
    if (depth > MAX_DEPTH || r->i >= r->n) goto bad;
    const unsigned char *s = r->s;
    const unsigned char c = s[r->i];
    if (c <= 0x7f || c >= 0xe0 || (c >= 0xcc && c <= 0xd3)) {
        PyObject *v = read_int(r);
        if (v == NULL && !PyErr_Occurred()) goto bad;
        return v;
    }
    if (c == 0xc0 || c == 0xc2 || c == 0xc3) {
        r->i += 1;
        return Py_NewRef(c == 0xc0 ? Py_None : c == 0xc3 ? Py_True : Py_False);
    }
    if (c == 0xca || c == 0xcb) {
        const int size = c == 0xca ? 4 : 8;
        if (r->n - r->i - 1 < size) goto bad;
        const uint64_t bits = be_uint(s + r->i + 1, size);
        double d;
        if (size == 4) {
            uint32_t b32 = (uint32_t)bits;
            float f;
            memcpy(&f, &b32, 4);
            d = f;
        } else {
            memcpy(&d, &bits, 8);
        }
        r->i += 1 + size;
        return PyFloat_FromDouble(d);
    }
    if ((c & 0xe0) == 0xa0 || (c >= 0xd9 && c <= 0xdb)) {
        const Py_ssize_t len = str_header(r);
        if (len < 0) goto bad;
        PyObject *v = PyUnicode_DecodeUTF8((const char *)s + r->i, len, NULL);
        r->i += len;
        return v;
    }
    if (c >= 0xc4 && c <= 0xc6) { /* bin 8, 16, 32 */
        const int head = 1 + (1 << (c - 0xc4));
        if (r->n - r->i < head) goto bad;
        const Py_ssize_t len = (Py_ssize_t)be_uint(s + r->i + 1, head - 1);
        if (len > r->n - r->i - head) goto bad;
        r->i += head + len;
        return PyBytes_FromStringAndSize((const char *)s + r->i - len, len);
    }
    if ((c & 0xf0) == 0x90 || c == 0xdc || c == 0xdd) {
        const Py_ssize_t count = array_header(s, r->n, &r->i);
        if (count < 0) goto bad;
        PyObject *list = PyList_New(count);
        if (list == NULL) return NULL;
        for (Py_ssize_t k = 0; k < count; k++) {
            PyObject *item = read_any(r, depth + 1);
            if (item == NULL) {
                Py_DECREF(list);
                return NULL;
            }
            PyList_SET_ITEM(list, k, item);
        }
        return list;
    }
    if ((c & 0xf0) == 0x80 || c == 0xde || c == 0xdf) {
        const Py_ssize_t count = map_header(r);
        if (count < 0) goto bad;
        PyObject *dict = PyDict_New();
        if (dict == NULL) return NULL;
        for (Py_ssize_t k = 0; k < count; k++) {
            PyObject *key = read_any(r, depth + 1);
            PyObject *value = key == NULL ? NULL : read_any(r, depth + 1);
            if (value == NULL || PyDict_SetItem(dict, key, value) < 0) { /* an unhashable key: a TypeError */
                Py_XDECREF(key);
                Py_XDECREF(value);
                Py_DECREF(dict);
                return NULL;
            }
            Py_DECREF(key);
            Py_DECREF(value);
        }
        return dict;
    }
bad: /* an ext, the unused 0xc1, nesting too deep, or a value cut short */
    PyErr_SetString(PyExc_ValueError, "not msgpack the typed pass reads");
    return NULL;
}

/* Moves the reader past one value, checking that it is whole: what msgspec checks of a field it keeps raw, at any
 * depth. With `strict`, for a field it only checks (lookahead_token_ids: arrays of ids), also what the general
 * walk's decode checks (strings are UTF-8) and more (no map, no ext, MAX_DEPTH levels at most, as read_any). A count
 * of the values still to pass (at each level, strict) stands in for recursion. 0 when the value fails. */
static int skip_value(Reader *r, int strict) {
    const unsigned char *s = r->s;
    const Py_ssize_t n = r->n;
    Py_ssize_t left[MAX_DEPTH + 1] = {1}, pending = 1; /* strict: per level; else: in all */
    int depth = 0;
    while (strict ? depth >= 0 : pending > 0) {
        if (strict && left[depth] == 0) {
            depth -= 1;
            continue;
        }
        if (r->i >= n) return 0;
        const unsigned char c = s[r->i];
        Py_ssize_t size = -1, count = -1;
        if (strict) left[depth] -= 1;
        else pending -= 1;
        if (c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3) size = 1;
        else if (c >= 0xcc && c <= 0xd3) size = 1 + (1 << ((c - 0xcc) & 3));
        else if (c == 0xca) size = 5;
        else if (c == 0xcb) size = 9;
        else if (c >= 0xd4 && c <= 0xd8 && !strict) size = 2 + (1 << (c - 0xd4)); /* fixext 1-16: type, data */
        else if ((c & 0xe0) == 0xa0 || (c >= 0xd9 && c <= 0xdb)) {
            const Py_ssize_t len = str_header(r);
            if (len < 0) return 0;
            if (strict) {
                PyObject *text = PyUnicode_DecodeUTF8((const char *)s + r->i, len, NULL);
                if (text == NULL) return 0; /* the caller turns the UnicodeDecodeError into its ValueError */
                Py_DECREF(text);
            }
            size = len;
        } else if ((c >= 0xc4 && c <= 0xc6) || (c >= 0xc7 && c <= 0xc9 && !strict)) { /* bin, ext (a type byte) */
            const int ext = c >= 0xc7, head = 1 + (1 << (c - (ext ? 0xc7 : 0xc4)));
            if (n - r->i < head) return 0;
            size = head + ext + (Py_ssize_t)be_uint(s + r->i + 1, head - 1);
        } else if ((c & 0xf0) == 0x90 || c == 0xdc || c == 0xdd) {
            count = array_header(s, n, &r->i);
        } else if (((c & 0xf0) == 0x80 || c == 0xde || c == 0xdf) && !strict) {
            count = map_header(r);
            count = count < 0 ? -1 : 2 * count;
        } else {
            return 0; /* 0xc1 (never used), or what strict refuses */
        }
        if (size >= 0) {
            if (size > n - r->i) return 0;
            r->i += size;
        } else if (count < 0) {
            return 0;
        } else if (!strict) {
            pending += count;
        } else if (count > 0) {
            if (depth + 1 >= MAX_DEPTH) return 0; /* its items would be deeper than read_any reads */
            left[++depth] = count;
        }
    }
    return 1;
}

/* Block hashes: an array of ints, signed ones (SGLang's) taken mod 2^64, as native-endian u64 bytes. */
static PyObject *read_hashes(Reader *r) {
    const unsigned char *s = r->s;
    const Py_ssize_t n = r->n;
    Py_ssize_t i = r->i;
    const Py_ssize_t count = array_header(s, n, &i);
    if (count < 0) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, count * 8);
    if (out == NULL) return NULL;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t k = 0; k < count; k++) {
        uint64_t v;
        if (!read_uint(s, n, &i, &v)) {
            const unsigned char c = i < n ? s[i] : 0;
            if (c >= 0xe0) { /* negative fixint */
                v = (uint64_t)(int64_t)(int8_t)c;
                i += 1;
            } else if (c >= 0xd0 && c <= 0xd3 && n - i - 1 >= (1 << (c - 0xd0))) { /* negative int 8-64 */
                const int size = 1 << (c - 0xd0);
                v = be_uint(s + i + 1, size);
                if (size < 8) v |= ~0ULL << (8 * size); /* sign-extended */
                i += 1 + size;
            } else {
                Py_DECREF(out);
                return NULL;
            }
        }
        memcpy(dst + 8 * k, &v, 8);
    }
    r->i = i;
    return out;
}

/* Token ids: an array of ints in [0, 2^32), or SGLang's EAGLE [t, t+1] pairs (each pair's first, then the last
 * pair's second), as little-endian u32 bytes; with whether they were pairs. The reader's place is kept in a local:
 * the stores into the output (char pointers) would otherwise make the compiler load it again at every token. */
static PyObject *read_tokens(Reader *r) {
    const unsigned char *s = r->s;
    const Py_ssize_t n = r->n;
    Py_ssize_t i = r->i;
    const Py_ssize_t count = array_header(s, n, &i);
    if (count < 0) return NULL;
    Py_ssize_t probe = i;
    const int pairs = count > 0 && array_header(s, n, &probe) >= 0;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (count + pairs) * 4);
    if (out == NULL) return NULL;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    uint64_t first, second = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        if (pairs) {
            if (i < n && s[i] == 0x92) {
                i += 1;
            } else if (array_header(s, n, &i) != 2) {
                goto bad;
            }
        }
        if (!read_token(s, n, &i, &first) || first > U32_MAX_VALUE) goto bad;
        if (pairs && (!read_token(s, n, &i, &second) || second > U32_MAX_VALUE)) goto bad;
        put_u32le(dst + 4 * k, first);
    }
    if (pairs) put_u32le(dst + 4 * count, second);
    r->i = i;
    return Py_BuildValue("(NO)", out, pairs ? Py_True : Py_False);
bad:
    Py_DECREF(out);
    return NULL;
}

/* One event: (kind, fields), the fields a tuple in FIELD_NAMES' order, None where absent; NULL (no error set when
 * the event is not one the typed pass reads). */
static PyObject *read_event(Reader *r) {
    PyObject *fields[N_FIELDS] = {NULL};
    PyObject *out = NULL;
    unsigned seen = 0;
    int kind = -1;
    const Py_ssize_t count = map_header(r);
    if (count < 0) return NULL;
    for (Py_ssize_t k = 0; k < count; k++) {
        const Py_ssize_t len = str_header(r);
        if (len < 0) goto done;
        const char *key = (const char *)r->s + r->i;
        r->i += len;
        if (len == 4 && memcmp(key, "type", 4) == 0) {
            const Py_ssize_t tag = str_header(r);
            if (tag < 0) goto done;
            int named = -1;
            for (int t = 0; t < 3; t++)
                if ((Py_ssize_t)strlen(KINDS[t]) == tag && memcmp(r->s + r->i, KINDS[t], tag) == 0) named = t;
            r->i += tag;
            if (named < 0 || (kind >= 0 && named != kind)) goto done; /* a second tag must agree, as msgspec's */
            kind = named;
            continue;
        }
        int f = 0;
        while (f < N_FIELDS && !((Py_ssize_t)strlen(FIELD_NAMES[f]) == len && memcmp(key, FIELD_NAMES[f], len) == 0))
            f++;
        if (f == N_FIELDS) goto done;
        PyObject *value;
        if (f == F_BLOCK_HASHES) {
            value = read_hashes(r);
        } else if (f == F_TOKEN_IDS) {
            value = read_tokens(r);
        } else if (f == F_EXTRA_KEYS) {
            const Py_ssize_t at = r->i;
            value = skip_value(r, 0) ? PyBytes_FromStringAndSize((const char *)r->s + at, r->i - at) : NULL;
        } else if (f == F_LOOKAHEAD) { /* Dynamo 1.6.1 hashes a block's own tokens only: checked, not built */
            value = skip_value(r, 1) ? Py_NewRef(Py_None) : NULL;
        } else if (f == F_PARENT) {
            value = r->i < r->n && r->s[r->i] == 0xc0 ? (r->i += 1, Py_NewRef(Py_None)) : read_int(r);
        } else {
            value = read_any(r, 1);
        }
        if (value == NULL) goto done;
        Py_XSETREF(fields[f], value); /* a key given twice: the last one counts, as in a map */
        seen |= BIT(f);
    }
    if (kind < 0 || (seen & ~ALLOWED[kind]) || (seen & REQUIRED[kind]) != REQUIRED[kind]) goto done;
    PyObject *tuple = PyTuple_New(N_FIELDS);
    if (tuple == NULL) goto done;
    for (int f = 0; f < N_FIELDS; f++) {
        PyTuple_SET_ITEM(tuple, f, fields[f] != NULL ? fields[f] : Py_NewRef(Py_None));
        fields[f] = NULL;
    }
    out = Py_BuildValue("(iN)", kind, tuple);
done:
    for (int f = 0; f < N_FIELDS; f++) Py_XDECREF(fields[f]);
    return out;
}

static PyObject *engine_batch_msgpack(PyObject *module, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    Reader r = {view.buf, view.len, 0};
    PyObject *ts = NULL, *events = NULL, *dp_rank = NULL, *out = NULL;
    const Py_ssize_t parts = array_header(r.s, r.n, &r.i);
    if (parts != 2 && parts != 3) goto bad;
    if (r.i < r.n && (r.s[r.i] == 0xca || r.s[r.i] == 0xcb)) {
        ts = read_any(&r, 1);
    } else {
        ts = read_int(&r);
    }
    if (ts == NULL) goto bad;
    const Py_ssize_t count = array_header(r.s, r.n, &r.i);
    if (count < 0 || (events = PyList_New(count)) == NULL) goto bad;
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *event = read_event(&r);
        if (event == NULL) goto bad;
        PyList_SET_ITEM(events, k, event);
    }
    if (parts == 3 && r.i < r.n && r.s[r.i] != 0xc0) {
        uint64_t rank;
        if (!read_uint(r.s, r.n, &r.i, &rank) || rank > U32_MAX_VALUE) goto bad;
        dp_rank = PyLong_FromUnsignedLongLong(rank);
        if (dp_rank == NULL) goto bad;
    } else {
        r.i += parts == 3;
        dp_rank = Py_NewRef(Py_None);
    }
    if (r.i != r.n) goto bad;
    out = PyTuple_Pack(3, ts, dp_rank, events);
    goto done;
bad:
    if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_MemoryError)) PyErr_Clear();
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "not an engine batch the typed pass reads");
done:
    Py_XDECREF(ts);
    Py_XDECREF(events);
    Py_XDECREF(dp_rank);
    PyBuffer_Release(&view);
    return out;
}

static PyObject *xxh3_blocks(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer view;
    Py_ssize_t stride, window;
    unsigned long long seed;
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "xxh3_blocks(data, stride, seed, window=stride) takes 3 or 4 arguments");
        return NULL;
    }
    stride = PyLong_AsSsize_t(args[1]);
    if (stride == -1 && PyErr_Occurred()) return NULL;
    if (stride <= 0) {
        PyErr_SetString(PyExc_ValueError, "stride must be positive");
        return NULL;
    }
    seed = PyLong_AsUnsignedLongLong(args[2]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    window = stride;
    if (nargs == 4) {
        window = PyLong_AsSsize_t(args[3]);
        if (window == -1 && PyErr_Occurred()) return NULL;
        if (window < stride) {
            PyErr_SetString(PyExc_ValueError, "window must be at least stride");
            return NULL;
        }
    }
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    const Py_ssize_t blocks = view.len < window ? 0 : (view.len - window) / stride + 1;
    PyObject *out = PyBytes_FromStringAndSize(NULL, blocks * (Py_ssize_t)sizeof(uint64_t));
    if (out != NULL) {
        uint64_t *hashes = (uint64_t *)PyBytes_AS_STRING(out);
        for (Py_ssize_t b = 0; b < blocks; b++)
            hashes[b] = XXH3_64bits_withSeed((const char *)view.buf + b * stride, (size_t)window, seed);
    }
    PyBuffer_Release(&view);
    return out;
}

static PyObject *xxh3_chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "xxh3_chain(hashes, seed) takes 2 arguments");
        return NULL;
    }
    const unsigned long long seed = PyLong_AsUnsignedLongLong(args[1]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    PyObject *seq = PySequence_Fast(args[0], "xxh3_chain needs a sequence of u64 hashes");
    if (seq == NULL) return NULL;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    uint64_t pair[2] = {0, 0}; /* the previous sequence hash and this block's local hash, as u64 LE */
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        const unsigned long long local = PyLong_AsUnsignedLongLong(items[i]);
        if (local == (unsigned long long)-1 && PyErr_Occurred()) { Py_CLEAR(out); break; }
        if (i == 0) {
            pair[0] = local; /* the first block's sequence hash is its local hash, not rehashed */
        } else {
            pair[1] = local;
            unsigned char bytes[16];
            for (int k = 0; k < 8; k++) {
                bytes[k] = (unsigned char)(pair[0] >> (8 * k));
                bytes[8 + k] = (unsigned char)(pair[1] >> (8 * k));
            }
            pair[0] = XXH3_64bits_withSeed(bytes, sizeof bytes, seed);
        }
        PyObject *hash = PyLong_FromUnsignedLongLong(pair[0]);
        if (hash == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, hash);
    }
    Py_DECREF(seq);
    return out;
}

/* The values of `children` (a dict keyed by u64 local hashes) keyed by the sequence hash each key's block chains to
 * from sequence hash `previous`: XXH3-64(le64(previous) || le64(key), seed). A branch point of the tree: a prompt
 * shared by thousands of requests has thousands of children, each hashed once, without a Python object per key. */
static PyObject *by_sequence(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "by_sequence(children, previous, seed) takes 3 arguments");
        return NULL;
    }
    if (!PyDict_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "by_sequence needs a dict keyed by u64 local hashes");
        return NULL;
    }
    const unsigned long long previous = PyLong_AsUnsignedLongLong(args[1]);
    if (previous == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    const unsigned long long seed = PyLong_AsUnsignedLongLong(args[2]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    U64Map *out = (U64Map *)U64MapType.tp_alloc(&U64MapType, 0);
    if (out == NULL) return NULL;
    unsigned char bytes[16];
    for (int k = 0; k < 8; k++) bytes[k] = (unsigned char)(previous >> (8 * k));
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(args[0], &pos, &key, &value)) {
        const unsigned long long local = PyLong_AsUnsignedLongLong(key);
        if (local == (unsigned long long)-1 && PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        for (int k = 0; k < 8; k++) bytes[8 + k] = (unsigned char)(local >> (8 * k));
        if (map_put(out, XXH3_64bits_withSeed(bytes, sizeof bytes, seed), Py_NewRef(value)) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return (PyObject *)out;
}

static PyObject *bind_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "bind_run(lookup, keys, value, replaceable) takes 4 arguments");
        return NULL;
    }
    PyObject *lookup = args[0], *value = args[2], *replaceable = args[3];
    if (!PyDict_CheckExact(lookup)) {
        PyErr_SetString(PyExc_TypeError, "bind_run needs a dict");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "bind_run needs a sequence of keys");
    if (seq == NULL) return NULL;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **keys = PySequence_Fast_ITEMS(seq);
    Py_ssize_t i = 0;
    for (; i < n; i++) {
        PyObject *held = PyDict_SetDefault(lookup, keys[i], value); /* borrowed */
        if (held == NULL) { Py_DECREF(seq); return NULL; }
        if (held == value) continue;
        if (replaceable == Py_None || held != replaceable) break;
        if (PyDict_SetItem(lookup, keys[i], value) < 0) { Py_DECREF(seq); return NULL; }
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(i);
}

static int cmp_u64(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* `arg`'s buffer as native-endian u64s (their count in *n), released by the caller; -1 with an error set. */
static int open_u64s(PyObject *arg, Py_buffer *view, Py_ssize_t *n) {
    if (PyObject_GetBuffer(arg, view, PyBUF_SIMPLE) < 0) return -1;
    if (view->len % (Py_ssize_t)sizeof(uint64_t)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "not a whole number of u64s");
        return -1;
    }
    *n = view->len / (Py_ssize_t)sizeof(uint64_t);
    return 0;
}

static PyObject *u64s_distinct(PyObject *module, PyObject *arg) {
    Py_buffer view;
    Py_ssize_t n;
    if (open_u64s(arg, &view, &n) < 0) return NULL;
    uint64_t local[256];
    uint64_t *sorted = n <= 256 ? local : PyMem_Malloc((size_t)view.len);
    if (sorted == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    memcpy(sorted, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    qsort(sorted, (size_t)n, sizeof(uint64_t), cmp_u64);
    int distinct = 1;
    for (Py_ssize_t i = 1; i < n && distinct; i++) distinct = sorted[i] != sorted[i - 1];
    if (sorted != local) PyMem_Free(sorted);
    return PyBool_FromLong(distinct);
}

/* How many times each u64 of `data` occurs: (value, count) native-endian u64 pairs, in the order each value first
 * occurs (a Counter's). `tree stats` counts its runs so, hundreds of thousands of them at 10M pairs and a few thousand
 * distinct (prompt and tail lengths): a table of the distinct values, probed from a seeded mix (see u64_map.h). */
static PyObject *u64_counts(PyObject *module, PyObject *arg) {
    Py_buffer view;
    Py_ssize_t n;
    if (open_u64s(arg, &view, &n) < 0) return NULL;
    const uint64_t *values = view.buf;
    Py_ssize_t cap = 64, used = 0; /* table slots (a power of two), distinct values */
    Py_ssize_t *table = PyMem_Malloc((size_t)cap * sizeof(Py_ssize_t));
    uint64_t *pairs = PyMem_Malloc((size_t)cap * 2 * sizeof(uint64_t)); /* room for cap / 2 pairs at least */
    PyObject *result = NULL;
    if (table == NULL || pairs == NULL) goto done;
    for (Py_ssize_t j = 0; j < cap; j++) table[j] = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v;
        memcpy(&v, values + i, sizeof v);
        Py_ssize_t at = (Py_ssize_t)(seeded_mix(v) & (uint64_t)(cap - 1));
        while (table[at] >= 0 && pairs[2 * table[at]] != v) at = (at + 1) & (cap - 1);
        if (table[at] >= 0) {
            pairs[2 * table[at] + 1]++;
            continue;
        }
        if ((used + 1) * 2 > cap) { /* at most half full: grow, and find v's place again */
            const Py_ssize_t grown_cap = 2 * cap;
            Py_ssize_t *grown = PyMem_Realloc(table, (size_t)grown_cap * sizeof(Py_ssize_t));
            if (grown == NULL) goto done;
            table = grown;
            uint64_t *more = PyMem_Realloc(pairs, (size_t)grown_cap * 2 * sizeof(uint64_t));
            if (more == NULL) goto done;
            pairs = more;
            cap = grown_cap;
            for (Py_ssize_t j = 0; j < cap; j++) table[j] = -1;
            for (Py_ssize_t e = 0; e < used; e++) {
                Py_ssize_t to = (Py_ssize_t)(seeded_mix(pairs[2 * e]) & (uint64_t)(cap - 1));
                while (table[to] >= 0) to = (to + 1) & (cap - 1);
                table[to] = e;
            }
            at = (Py_ssize_t)(seeded_mix(v) & (uint64_t)(cap - 1));
            while (table[at] >= 0) at = (at + 1) & (cap - 1);
        }
        table[at] = used;
        pairs[2 * used] = v;
        pairs[2 * used + 1] = 1;
        used++;
    }
    result = PyBytes_FromStringAndSize((const char *)pairs, used * 2 * (Py_ssize_t)sizeof(uint64_t));
done:
    if (result == NULL && !PyErr_Occurred()) PyErr_NoMemory();
    PyBuffer_Release(&view);
    PyMem_Free(table);
    PyMem_Free(pairs);
    return result;
}

/* `tree stats` over the radix tree (`core/index/node.py`'s Node: `full`, `cutoffs`, `children`, `packed`): of a
 * node's children, those one worker holds whole and no other in part, with all they lead to, counted in C as runs of
 * blocks, (blocks above) << 32 | (blocks held); the others handed back to Python in order. Those runs are nine in
 * ten nodes of a fleet's tree (each request's tail): this spares each a Python frame. A Node's slots are read
 * where its type keeps them (its member descriptors' offsets), children walked in their dict, a holder's bit tested
 * in a machine word: no attribute lookup, list or int made per node (~500 ns a node before, at 10M pairs). */
typedef struct { PyObject *children; Py_ssize_t pos; unsigned long long above; } Frame;
typedef struct { uint64_t *runs; Py_ssize_t size, cap; } Runs;

static PyObject *s_full, *s_cutoffs, *s_children, *s_packed;

/* Where the Node type seen last keeps each slot (-1: look it up by name); other types go by name. */
static struct { PyTypeObject *type; Py_ssize_t full, cutoffs, children, packed; } node_layout;

static Py_ssize_t slot_offset(PyTypeObject *type, PyObject *name) {
    PyObject *d = PyObject_GetAttr((PyObject *)type, name);
    if (d == NULL) {
        PyErr_Clear();
        return -1;
    }
    Py_ssize_t offset = -1;
    if (Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        const PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type == T_OBJECT_EX && !(m->flags & READ_RESTRICTED)) offset = m->offset;
    }
    Py_DECREF(d);
    return offset;
}

/* Learn where a node's type keeps its slots, unless it keeps none (a stand-in, read by name). */
static void learn_layout(PyObject *node) {
    PyTypeObject *type = Py_TYPE(node);
    if (type == node_layout.type) return;
    const Py_ssize_t full = slot_offset(type, s_full);
    if (full < 0) return;
    Py_XDECREF(node_layout.type);
    node_layout.type = (PyTypeObject *)Py_NewRef(type);
    node_layout.full = full;
    node_layout.cutoffs = slot_offset(type, s_cutoffs);
    node_layout.children = slot_offset(type, s_children);
    node_layout.packed = slot_offset(type, s_packed);
}

/* node.<name> (a new reference), read at `offset` for the Node type learned. */
static PyObject *node_get(PyObject *node, PyObject *name, Py_ssize_t offset) {
    if (offset >= 0 && Py_TYPE(node) == node_layout.type) {
        PyObject *value = *(PyObject **)((char *)node + offset);
        if (value != NULL) return Py_NewRef(value);
    }
    return PyObject_GetAttr(node, name);
}

static int add_run(Runs *out, unsigned long long above, Py_ssize_t held) {
    if (out->size == out->cap) {
        Py_ssize_t cap = out->cap ? 2 * out->cap : 256;
        uint64_t *grown = PyMem_Realloc(out->runs, cap * sizeof(uint64_t));
        if (grown == NULL) { PyErr_NoMemory(); return -1; }
        out->runs = grown;
        out->cap = cap;
    }
    out->runs[out->size++] = above << 32 | (unsigned long long)held;
    return 0;
}

static Py_ssize_t edge_length(PyObject *node) {
    PyObject *packed = node_get(node, s_packed, node_layout.packed);
    if (packed == NULL) return -1;
    Py_ssize_t len = PyObject_Size(packed);
    Py_DECREF(packed);
    return len;
}

/* The children dict of `node` (a new reference), or NULL for none (None or empty); -1 with an error set. */
static int children_of(PyObject *node, PyObject **children) {
    *children = NULL;
    PyObject *value = node_get(node, s_children, node_layout.children);
    if (value == NULL) return -1;
    if (PyDict_Check(value) && PyDict_GET_SIZE(value)) *children = value;
    else Py_DECREF(value);
    return 0;
}

/* Whether the worker of slot `bit_at` (`bit` = 1 << bit_at) holds the whole edge of `node`: 1, 0, or -1. */
static int holds_whole(PyObject *node, PyObject *bit, long bit_at) {
    PyObject *full = node_get(node, s_full, node_layout.full);
    if (full == NULL) return -1;
    int whole;
    if (bit_at < 64 && PyLong_CheckExact(full)) {
        whole = (int)(PyLong_AsUnsignedLongLongMask(full) >> bit_at & 1);
    } else {
        PyObject *both = PyNumber_And(full, bit);
        whole = both == NULL ? -1 : PyObject_IsTrue(both);
        Py_XDECREF(both);
    }
    Py_DECREF(full);
    return whole;
}

/* Everything below `children` (a dict, stolen) that the worker with bit `bit` (slot `slot`) holds, as runs. */
static int walk_solo(PyObject *children, PyObject *bit, PyObject *slot, unsigned long long above, Runs *out,
                     Py_ssize_t *visited) {
    const long bit_at = PyLong_AsLong(slot);
    if (bit_at == -1 && PyErr_Occurred()) { Py_DECREF(children); return -1; }
    Py_ssize_t cap = 16, depth = 0;
    Frame *frames = PyMem_Malloc(cap * sizeof(Frame));
    if (frames == NULL) { Py_DECREF(children); PyErr_NoMemory(); return -1; }
    frames[depth++] = (Frame){children, 0, above};
    int rc = 0;
    while (depth) {
        Frame *top = &frames[depth - 1];
        PyObject *node;
        if (!PyDict_Next(top->children, &top->pos, NULL, &node)) { Py_DECREF(top->children); depth--; continue; }
        const unsigned long long at = top->above;
        ++*visited;
        const Py_ssize_t len = edge_length(node);
        if (len < 0) { rc = -1; break; }
        const int whole = holds_whole(node, bit, bit_at);
        if (whole < 0) { rc = -1; break; }
        Py_ssize_t held = whole ? len : 0;
        if (!whole) {
            PyObject *cutoffs = node_get(node, s_cutoffs, node_layout.cutoffs);
            if (cutoffs == NULL) { rc = -1; break; }
            PyObject *cut = PyDict_Check(cutoffs) ? PyDict_GetItemWithError(cutoffs, slot) : NULL; /* borrowed */
            if (cut != NULL) held = PyLong_AsSsize_t(cut);
            Py_DECREF(cutoffs);
            if (PyErr_Occurred()) { rc = -1; break; }
        }
        if (held <= 0) continue;
        if (add_run(out, at, held) < 0) { rc = -1; break; }
        if (!whole) continue;
        PyObject *below;
        if (children_of(node, &below) < 0) { rc = -1; break; }
        if (below == NULL) continue;
        if (depth == cap) {
            Frame *grown = PyMem_Realloc(frames, 2 * cap * sizeof(Frame));
            if (grown == NULL) { Py_DECREF(below); PyErr_NoMemory(); rc = -1; break; }
            frames = grown;
            cap *= 2;
        }
        frames[depth++] = (Frame){below, 0, at + (unsigned long long)len};
    }
    while (depth) Py_DECREF(frames[--depth].children);
    PyMem_Free(frames);
    return rc;
}

/* The bit set in `mask` when exactly one is (its slot in *slot, a new reference); 0 when none or several; -1. */
static int single_bit(PyObject *mask, PyObject **slot) {
    *slot = NULL;
    const unsigned long long v = PyLong_AsUnsignedLongLong(mask);
    if (!(v == (unsigned long long)-1 && PyErr_Occurred())) {
        if (v == 0 || v & (v - 1)) return 0;
        *slot = PyLong_FromLong(__builtin_ctzll(v));
        return *slot == NULL ? -1 : 1;
    }
    if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
    PyErr_Clear(); /* a mask past 64 workers: as Python does it */
    PyObject *one = PyLong_FromLong(1), *less = one ? PyNumber_Subtract(mask, one) : NULL;
    PyObject *both = less ? PyNumber_And(mask, less) : NULL;
    Py_XDECREF(one);
    Py_XDECREF(less);
    if (both == NULL) return -1;
    const int several = PyObject_IsTrue(both);
    Py_DECREF(both);
    if (several) return several < 0 ? -1 : 0;
    PyObject *length = PyObject_CallMethod(mask, "bit_length", NULL);
    if (length == NULL) return -1;
    const Py_ssize_t bits = PyLong_AsSsize_t(length);
    Py_DECREF(length);
    if (bits < 0) return -1;
    *slot = PyLong_FromSsize_t(bits - 1);
    return *slot == NULL ? -1 : 1;
}

static PyObject *solo_split(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "solo_split(children, allowed, above) takes 3 arguments");
        return NULL;
    }
    if (s_full == NULL && ((s_full = PyUnicode_InternFromString("full")) == NULL ||
                           (s_cutoffs = PyUnicode_InternFromString("cutoffs")) == NULL ||
                           (s_children = PyUnicode_InternFromString("children")) == NULL ||
                           (s_packed = PyUnicode_InternFromString("packed")) == NULL)) return NULL;
    PyObject *allowed = args[1];
    const unsigned long long above = PyLong_AsUnsignedLongLong(args[2]);
    if (above == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    PyObject *children = PySequence_List(args[0]);
    if (children == NULL) return NULL;
    PyObject *rest = PyList_New(0), *result = NULL;
    Runs out = {NULL, 0, 0};
    Py_ssize_t visited = 0;
    if (rest == NULL) goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(children); i++) {
        PyObject *node = PyList_GET_ITEM(children, i);
        learn_layout(node);
        PyObject *full = node_get(node, s_full, node_layout.full);
        if (full == NULL) goto done;
        PyObject *mask = PyNumber_And(full, allowed);
        Py_DECREF(full);
        if (mask == NULL) goto done;
        PyObject *slot;
        const int solo = single_bit(mask, &slot);
        if (solo < 0) { Py_DECREF(mask); goto done; }
        int partial = 0;
        if (solo) {
            PyObject *cutoffs = node_get(node, s_cutoffs, node_layout.cutoffs);
            if (cutoffs == NULL) { Py_DECREF(mask); Py_DECREF(slot); goto done; }
            partial = PyObject_IsTrue(cutoffs);
            Py_DECREF(cutoffs);
            if (partial < 0) { Py_DECREF(mask); Py_DECREF(slot); goto done; }
        }
        if (!solo || partial) {
            Py_DECREF(mask);
            Py_XDECREF(slot);
            if (PyList_Append(rest, node) < 0) goto done;
            continue;
        }
        visited++;
        const Py_ssize_t len = edge_length(node);
        PyObject *below = NULL;
        int rc = len < 0 ? -1 : add_run(&out, above, len);
        if (rc == 0) rc = children_of(node, &below);
        if (rc == 0 && below != NULL) rc = walk_solo(below, mask, slot, above + (unsigned long long)len, &out, &visited);
        Py_DECREF(mask);
        Py_DECREF(slot);
        if (rc < 0) goto done;
    }
    {
        PyObject *packed = PyBytes_FromStringAndSize((const char *)out.runs, out.size * (Py_ssize_t)sizeof(uint64_t));
        if (packed != NULL) result = Py_BuildValue("(NOn)", packed, rest, visited);
    }
done:
    Py_DECREF(children);
    Py_XDECREF(rest);
    PyMem_Free(out.runs);
    return result;
}

static PyMethodDef methods[] = {
    {"by_sequence", (PyCFunction)(void (*)(void))by_sequence, METH_FASTCALL,
     "by_sequence(children: dict, previous: int, seed: int) -> U64Map\n\nThe values of `children` (keyed by u64 "
     "local hashes) keyed by the sequence hash each key's block chains to from sequence hash `previous`."},
    {"solo_split", (PyCFunction)(void (*)(void))solo_split, METH_FASTCALL,
     "solo_split(children: Iterable[Node], allowed: int, above: int) -> tuple[bytes, list[Node], int]\n\nOf radix "
     "tree nodes `above` blocks deep, those one worker of `allowed` holds whole and no other in part, and all "
     "below them that worker holds, as runs (above << 32 | held, native-endian u64s); the other nodes in order; "
     "the nodes counted."},
    {"u64_counts", u64_counts, METH_O,
     "u64_counts(data: bytes-like) -> bytes\n\nHow many times each native-endian u64 of `data` occurs: (value, count) "
     "u64 pairs in the order each value first occurs; ValueError for a length that is not a multiple of 8."},
    {"u64s_distinct", u64s_distinct, METH_O,
     "u64s_distinct(packed: bytes-like) -> bool\n\nWhether no native-endian u64 of `packed` repeats; ValueError "
     "for a length that is not a multiple of 8."},
    {"bind_run", (PyCFunction)(void (*)(void))bind_run, METH_FASTCALL,
     "bind_run(lookup: dict, keys: Sequence, value, replaceable) -> int\n\nBinds keys to `value` in order, where "
     "a key is unbound, bound to `value` or to `replaceable` (not None); stops at the first bound to anything else. "
     "Returns how many keys it went past (len(keys) when all)."},
    {"xxh3_chain", (PyCFunction)(void (*)(void))xxh3_chain, METH_FASTCALL,
     "xxh3_chain(local_hashes: Sequence[int], seed: int) -> list[int]\n\nDynamo's sequence hashes: the first "
     "is the first local hash, then XXH3-64(le64(previous) || le64(local), seed)."},
    {"xxh3_blocks", (PyCFunction)(void (*)(void))xxh3_blocks, METH_FASTCALL,
     "xxh3_blocks(data: bytes-like, stride: int, seed: int, window: int = stride) -> bytes\n\nXXH3-64 (seeded) "
     "of the `window` bytes at each multiple of `stride` that has them whole, as native-endian u64s (a window "
     "wider than the stride overlaps the next block: EAGLE's)."},
    {"engine_batch_msgpack", engine_batch_msgpack, METH_O,
     "engine_batch_msgpack(payload: bytes-like) -> tuple[int | float, int | None, list[tuple[int, tuple]]]\n\nAn "
     "engine's KV event batch as the typed decoding pass reads it: (ts, dp_rank, [(kind, fields)]), kind 0 stored, "
     "1 removed, 2 cleared, the fields in ENGINE_FIELDS' order (None where absent): block hashes as native u64 bytes "
     "(signed ones mod 2^64), token ids as (little-endian u32 bytes, were they EAGLE pairs), extra_keys as its "
     "msgpack, the rest as msgspec decodes Any. ValueError for anything else."},
    {"u32_from_json", u32_from_json, METH_O,
     "u32_from_json(json: bytes-like) -> bytes\n\nA JSON array of integers in [0, 2^32) as native-endian u32 bytes; "
     "ValueError, worded like msgspec's, for anything else."},
    {"u32_head_of_object", u32_head_of_object, METH_O,
     "u32_head_of_object(json: bytes-like) -> tuple[bytes, int] | None\n\nFor an object that opens with a "
     "sound `\"token_ids\"` array of u32s: those (as u32_from_json gives them) and the offset of what follows the "
     "array and its comma (the next member's quote, or the closing brace). None for anything else."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, 0, methods};

PyMODINIT_FUNC PyInit__native(void) {
    if (map_seed_init() < 0 || PyType_Ready(&U64MapType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "U64Map", (PyObject *)&U64MapType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

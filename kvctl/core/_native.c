/* The loops Python cannot make cheap: reading a prompt's token ids out of its JSON, reading an engine event's
 * ids and hashes out of its msgpack, and hashing blocks.
 *
 * u32_from_json: POST /v1/route carries ~2k token ids per request. Decoding them into a list of Python ints,
 * checking each against the u32 range and packing them again took half the route's server time; this reads
 * the digits once and writes the u32s straight into the result. Errors say what msgspec would have said for
 * `list[int]` with bounds [0, 2^32 - 1], so a bad token id reads the same as any other invalid field.
 *
 * u32le_from_msgpack and u64_from_msgpack: a stored event's token ids and a removal's block hashes, packed
 * without an int object per element (see uints_from_msgpack).
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

/* The msgpack unsigned int (any int encoding, not negative) at s[*i], moving *i past it; 0 when there is none. */
static int read_uint(const unsigned char *s, const Py_ssize_t n, Py_ssize_t *i, uint64_t *v) {
    if (*i >= n) return 0;
    const unsigned char c = s[*i];
    int size;
    if (c <= 0x7f) { /* positive fixint */
        *v = c;
        size = 0;
    } else if (c >= 0xcc && c <= 0xcf) { /* uint 8, 16, 32, 64 */
        size = 1 << (c - 0xcc);
        if (n - *i - 1 < size) return 0;
        *v = be_uint(s + *i + 1, size);
    } else if (c >= 0xd0 && c <= 0xd3) { /* int 8, 16, 32, 64: fine when the value is not negative */
        size = 1 << (c - 0xd0);
        if (n - *i - 1 < size || s[*i + 1] & 0x80) return 0;
        *v = be_uint(s + *i + 1, size);
    } else {
        return 0;
    }
    *i += 1 + size;
    return 1;
}

static void put_u32le(unsigned char *dst, uint64_t v) {
    for (int b = 0; b < 4; b++) dst[b] = (unsigned char)(v >> (8 * b));
}

/* A msgpack array of ints straight into packed unsigned ints: `width` 4 (little-endian u32s, in [0, 2^32): a
 * stored event's token ids, which the block hashes are taken over) or 8 (native u64s: a removal's block
 * hashes). The typed decoding pass hands these over raw, where msgspec would build an int per element, and
 * packing them took as long again. Anything else (a negative, a bool, a float, too large, not an array)
 * raises ValueError without detail: the caller then decodes the batch the general way, which words the
 * error. */
static PyObject *uints_from_msgpack(PyObject *arg, const int width) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *s = view.buf;
    const Py_ssize_t n = view.len;
    const uint64_t max = width == 4 ? U32_MAX_VALUE : UINT64_MAX;
    PyObject *out = NULL;
    Py_ssize_t i = 0;
    const Py_ssize_t count = array_header(s, n, &i);
    if (count < 0) goto bad;
    out = PyBytes_FromStringAndSize(NULL, count * width);
    if (out == NULL) goto done;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t k = 0; k < count; k++) {
        uint64_t v;
        if (!read_uint(s, n, &i, &v) || v > max) goto bad;
        if (width == 8) {
            memcpy(dst + 8 * k, &v, 8);
        } else {
            put_u32le(dst + 4 * k, v);
        }
    }
    if (i != n) goto bad;
    goto done;
bad:
    Py_CLEAR(out);
    PyErr_SetString(PyExc_ValueError, "not a msgpack array of unsigned ints in range");
done:
    PyBuffer_Release(&view);
    return out;
}

/* SGLang's EAGLE token ids, a msgpack array of [t_i, t_i+1] pairs (ints in [0, 2^32)), as the tokens Dynamo
 * hashes: each pair's first, then the last pair's second, little-endian u32s. ValueError without detail for
 * anything else (an empty array included: it is no pair store). */
static PyObject *u32le_pairs_from_msgpack(PyObject *module, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *s = view.buf;
    const Py_ssize_t n = view.len;
    PyObject *out = NULL;
    Py_ssize_t i = 0;
    const Py_ssize_t count = array_header(s, n, &i);
    if (count <= 0) goto bad;
    out = PyBytes_FromStringAndSize(NULL, (count + 1) * 4);
    if (out == NULL) goto done;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    uint64_t first, second = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        if (i >= n || s[i] != 0x92) goto bad; /* a fixarray of two */
        i += 1;
        if (!read_uint(s, n, &i, &first) || first > U32_MAX_VALUE) goto bad;
        if (!read_uint(s, n, &i, &second) || second > U32_MAX_VALUE) goto bad;
        put_u32le(dst + 4 * k, first);
    }
    put_u32le(dst + 4 * count, second);
    if (i != n) goto bad;
    goto done;
bad:
    Py_CLEAR(out);
    PyErr_SetString(PyExc_ValueError, "not a msgpack array of pairs of unsigned ints in range");
done:
    PyBuffer_Release(&view);
    return out;
}

static PyObject *u32le_from_msgpack(PyObject *module, PyObject *arg) { return uints_from_msgpack(arg, 4); }

static PyObject *u64_from_msgpack(PyObject *module, PyObject *arg) { return uints_from_msgpack(arg, 8); }

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
    {"u32le_pairs_from_msgpack", u32le_pairs_from_msgpack, METH_O,
     "u32le_pairs_from_msgpack(msgpack: bytes-like) -> bytes\n\nA msgpack array of [a, b] pairs of ints in "
     "[0, 2^32) as little-endian u32 bytes: each a, then the last b; ValueError for anything else."},
    {"u32le_from_msgpack", u32le_from_msgpack, METH_O,
     "u32le_from_msgpack(msgpack: bytes-like) -> bytes\n\nA msgpack array of ints in [0, 2^32) as little-endian u32 "
     "bytes; ValueError for anything else."},
    {"u64_from_msgpack", u64_from_msgpack, METH_O,
     "u64_from_msgpack(msgpack: bytes-like) -> bytes\n\nA msgpack array of ints in [0, 2^64) as native-endian u64 "
     "bytes; ValueError for anything else."},
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

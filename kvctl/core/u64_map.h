/* U64Map: the index's one engine hash -> node map (kvctl/core/index/block_map.py), included by _native.c.
 *
 * A dict keyed by the hashes' int objects cost, per unique block of a 10M-pair index, ~40 B of table and a 40 B
 * int object that the edge's list of hashes kept alive, and three cache misses a probe (index, entry, key object).
 * This keeps the u64 itself in a 16 B slot: linear probing, one miss a probe, edges keep their hashes packed only.
 *
 * The slot of a key is a seeded mix of it (per process), so engine hashes chosen to collide cannot find one
 * another's slots without the seed. Deletion shifts the probe run back instead of leaving tombstones. The map is
 * not tracked by the cyclic collector: its values (index nodes) never reference it, so it is never in a cycle,
 * and a full collection need not walk millions of slots. Values are compared by identity, as the index does.
 */

typedef struct {
    uint64_t key;
    PyObject *value; /* NULL: an empty slot */
} MapSlot;

typedef struct {
    PyObject_HEAD
    MapSlot *slots; /* NULL while the map has never held anything, or was emptied */
    Py_ssize_t mask; /* capacity - 1, the capacity a power of two */
    Py_ssize_t used;
    Py_ssize_t pop_from; /* where popitem looks first */
} U64Map;

#define MAP_MIN_CAPACITY 8

static uint64_t map_seed;

/* murmur3's finaliser of the seeded key: every bit of the key moves every bit of the result. */
static inline uint64_t seeded_mix(uint64_t k) {
    k ^= map_seed;
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

static inline Py_ssize_t map_home(const U64Map *m, uint64_t k) {
    return (Py_ssize_t)(seeded_mix(k) & (uint64_t)m->mask);
}

/* Keys a run operation asks the memory for ahead of the one it probes: at 10M pairs nearly every probe misses
 * the cache, and a run's keys are known up front, so their misses overlap instead of following one another. */
#define MAP_AHEAD 8

/* Before probing key n of a run: the slots of keys n+1 .. n+MAP_AHEAD requested (all of them at n = 0, then one
 * more a key). A resize since only makes a request useless, never wrong: a prefetch is a hint. */
static inline void map_ahead(const U64Map *m, const uint64_t *keys, Py_ssize_t count, Py_ssize_t n) {
#if defined(__GNUC__)
    if (m->slots == NULL) return;
    for (Py_ssize_t j = n == 0 ? 1 : n + MAP_AHEAD; j <= n + MAP_AHEAD && j < count; j++)
        __builtin_prefetch(&m->slots[map_home(m, keys[j])]);
#else
    (void)m, (void)keys, (void)count, (void)n;
#endif
}

/* 1 with *k set for an int in [0, 2^64); 0 for anything else, which no key equals; -1 with an error set. */
static int map_key(PyObject *o, uint64_t *k) {
    if (!PyLong_Check(o)) return 0;
    const unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear();
        return 0;
    }
    *k = (uint64_t)v;
    return 1;
}

/* map_key for a key about to be stored: anything but an int in [0, 2^64) is an error. */
static int map_key_strict(PyObject *o, uint64_t *k) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "U64Map keys are ints in [0, 2^64), not %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    const unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *k = (uint64_t)v;
    return 0;
}

/* The slot holding k, or -1. */
static Py_ssize_t map_find(const U64Map *m, uint64_t k) {
    if (m->slots == NULL) return -1;
    for (Py_ssize_t i = map_home(m, k);; i = (i + 1) & m->mask) {
        const MapSlot *s = &m->slots[i];
        if (s->value == NULL) return -1;
        if (s->key == k) return i;
    }
}

static int map_resize(U64Map *m, Py_ssize_t capacity) {
    MapSlot *slots = PyMem_Calloc((size_t)capacity, sizeof(MapSlot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    MapSlot *old = m->slots;
    const Py_ssize_t old_capacity = old == NULL ? 0 : m->mask + 1;
    m->slots = slots;
    m->mask = capacity - 1;
    m->pop_from = 0;
    for (Py_ssize_t j = 0; j < old_capacity; j++) {
        if (old[j].value == NULL) continue;
        Py_ssize_t i = map_home(m, old[j].key);
        while (slots[i].value != NULL) i = (i + 1) & m->mask;
        slots[i] = old[j];
    }
    PyMem_Free(old);
    return 0;
}

/* Room for one more entry: at most 3/4 full after it. A map that lost most of its entries is made smaller here,
 * as a dict is when it next grows, so an index that let go of workers gives their memory back. */
static int map_room_for_one(U64Map *m) {
    const Py_ssize_t capacity = m->slots == NULL ? 0 : m->mask + 1;
    const Py_ssize_t want = m->used + 1;
    if (want * 4 <= capacity * 3 && (capacity <= 1024 || want * 8 >= capacity)) return 0;
    Py_ssize_t fit = MAP_MIN_CAPACITY;
    while (fit < want * 2 && fit < PY_SSIZE_T_MAX / 4) fit *= 2; /* at most half full once resized */
    return map_resize(m, fit);
}

/* After map_room_for_one: the slot holding k, or the empty one where it goes. */
static Py_ssize_t map_slot_for(const U64Map *m, uint64_t k) {
    Py_ssize_t i = map_home(m, k);
    while (m->slots[i].value != NULL && m->slots[i].key != k) i = (i + 1) & m->mask;
    return i;
}

/* Store value (a new reference, stolen) at k; the old value, if any, is released after the map is whole again. */
static int map_put(U64Map *m, uint64_t k, PyObject *value) {
    if (map_room_for_one(m) < 0) {
        Py_DECREF(value);
        return -1;
    }
    const Py_ssize_t i = map_slot_for(m, k);
    PyObject *old = m->slots[i].value;
    m->slots[i].key = k;
    m->slots[i].value = value;
    if (old == NULL) m->used++;
    Py_XDECREF(old);
    return 0;
}

/* Empty slot i, moving back the entries of its probe run that may take its place; returns its value (a reference
 * the caller owns). An emptied map lets go of its slots. */
static PyObject *map_take(U64Map *m, Py_ssize_t i) {
    PyObject *value = m->slots[i].value;
    for (Py_ssize_t j = (i + 1) & m->mask;; j = (j + 1) & m->mask) {
        const MapSlot s = m->slots[j];
        if (s.value == NULL) break;
        /* s may move to the hole at i when its home is not in (i, j], going round the table */
        if (((j - map_home(m, s.key)) & m->mask) >= ((j - i) & m->mask)) {
            m->slots[i] = s;
            i = j;
        }
    }
    m->slots[i].value = NULL;
    if (--m->used == 0) {
        PyMem_Free(m->slots);
        m->slots = NULL;
        m->mask = m->pop_from = 0;
    }
    return value;
}

/* Keys as a buffer of native u64s (array('Q'), the index's edges), or any sequence of ints, copied. */
typedef struct {
    Py_buffer view;
    int has_view;
    uint64_t *copy;
    const uint64_t *keys;
    Py_ssize_t n;
} MapKeys;

static int map_keys_open(PyObject *obj, MapKeys *out) {
    out->has_view = 0;
    out->copy = NULL;
    if (PyObject_CheckBuffer(obj)) {
        if (PyObject_GetBuffer(obj, &out->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
        out->has_view = 1;
        const char *f = out->view.format;
        if (out->view.itemsize != 8 || f == NULL || (strcmp(f, "Q") != 0 && strcmp(f, "L") != 0)) {
            PyBuffer_Release(&out->view);
            PyErr_SetString(PyExc_TypeError, "U64Map keys: a buffer of u64s (format 'Q'), or a sequence of ints");
            return -1;
        }
        out->keys = out->view.buf;
        out->n = out->view.len / 8;
        return 0;
    }
    PyObject *seq = PySequence_Fast(obj, "U64Map keys: a buffer of u64s (format 'Q'), or a sequence of ints");
    if (seq == NULL) return -1;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    out->copy = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (out->copy == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (map_key_strict(PySequence_Fast_GET_ITEM(seq, i), &out->copy[i]) < 0) {
            Py_DECREF(seq);
            PyMem_Free(out->copy);
            return -1;
        }
    }
    Py_DECREF(seq);
    out->keys = out->copy;
    out->n = n;
    return 0;
}

static void map_keys_close(MapKeys *k) {
    if (k->has_view) PyBuffer_Release(&k->view);
    PyMem_Free(k->copy);
}

static PyTypeObject U64MapType;

static PyObject *map_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs != NULL && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "U64Map() takes no arguments");
        return NULL;
    }
    U64Map *m = (U64Map *)type->tp_alloc(type, 0);
    if (m == NULL) return NULL;
    m->slots = NULL;
    m->mask = m->used = m->pop_from = 0;
    return (PyObject *)m;
}

/* Let go of every value, each after the map is whole again (a value's finaliser may read the map). */
static void map_drop_all(U64Map *m) {
    MapSlot *slots = m->slots;
    const Py_ssize_t capacity = slots == NULL ? 0 : m->mask + 1;
    m->slots = NULL;
    m->mask = m->used = m->pop_from = 0;
    for (Py_ssize_t i = 0; i < capacity; i++) Py_XDECREF(slots[i].value);
    PyMem_Free(slots);
}

static void map_dealloc(U64Map *m) {
    map_drop_all(m);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static Py_ssize_t map_length(U64Map *m) { return m->used; }

static PyObject *map_subscript(U64Map *m, PyObject *key) {
    uint64_t k;
    const int ok = map_key(key, &k);
    if (ok < 0) return NULL;
    const Py_ssize_t i = ok ? map_find(m, k) : -1;
    if (i < 0) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return Py_NewRef(m->slots[i].value);
}

static int map_ass_subscript(U64Map *m, PyObject *key, PyObject *value) {
    uint64_t k;
    if (value != NULL) {
        if (map_key_strict(key, &k) < 0) return -1;
        return map_put(m, k, Py_NewRef(value));
    }
    const int ok = map_key(key, &k);
    if (ok < 0) return -1;
    const Py_ssize_t i = ok ? map_find(m, k) : -1;
    if (i < 0) {
        PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    Py_DECREF(map_take(m, i));
    return 0;
}

static int map_contains(U64Map *m, PyObject *key) {
    uint64_t k;
    const int ok = map_key(key, &k);
    if (ok <= 0) return ok;
    return map_find(m, k) >= 0;
}

static PyObject *map_get(U64Map *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None) takes 1 or 2 arguments");
        return NULL;
    }
    uint64_t k;
    const int ok = map_key(args[0], &k);
    if (ok < 0) return NULL;
    const Py_ssize_t i = ok ? map_find(m, k) : -1;
    if (i >= 0) return Py_NewRef(m->slots[i].value);
    return Py_NewRef(nargs == 2 ? args[1] : Py_None);
}

static PyObject *map_pop(U64Map *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default]) takes 1 or 2 arguments");
        return NULL;
    }
    uint64_t k;
    const int ok = map_key(args[0], &k);
    if (ok < 0) return NULL;
    const Py_ssize_t i = ok ? map_find(m, k) : -1;
    if (i >= 0) return map_take(m, i);
    if (nargs == 2) return Py_NewRef(args[1]);
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

static PyObject *map_popitem(U64Map *m, PyObject *Py_UNUSED(ignored)) {
    if (m->used == 0) {
        PyErr_SetString(PyExc_KeyError, "popitem(): the map is empty");
        return NULL;
    }
    /* From where the last one was taken: a hole's shift moves entries back into it, rarely round to the start. */
    Py_ssize_t i = m->pop_from;
    while (m->slots[i].value == NULL) i = (i + 1) & m->mask;
    PyObject *key = PyLong_FromUnsignedLongLong(m->slots[i].key);
    if (key == NULL) return NULL;
    m->pop_from = i;
    PyObject *value = map_take(m, i);
    return Py_BuildValue("(NN)", key, value);
}

static PyObject *map_items(U64Map *m, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(m->used);
    if (out == NULL) return NULL;
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; m->slots != NULL && i <= m->mask; i++) {
        const MapSlot s = m->slots[i];
        if (s.value == NULL) continue;
        PyObject *item = Py_BuildValue("(KO)", (unsigned long long)s.key, s.value);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, n++, item);
    }
    return out;
}

static PyObject *map_clear(U64Map *m, PyObject *Py_UNUSED(ignored)) {
    map_drop_all(m);
    Py_RETURN_NONE;
}

static PyObject *map_sizeof(U64Map *m, PyObject *Py_UNUSED(ignored)) {
    const Py_ssize_t capacity = m->slots == NULL ? 0 : m->mask + 1;
    return PyLong_FromSsize_t((Py_ssize_t)sizeof(U64Map) + capacity * (Py_ssize_t)sizeof(MapSlot));
}

static PyObject *map_bind_run(U64Map *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "bind_run(keys, value, replaceable) takes 3 arguments");
        return NULL;
    }
    PyObject *value = args[1], *replaceable = args[2];
    MapKeys keys;
    if (map_keys_open(args[0], &keys) < 0) return NULL;
    Py_ssize_t n = 0;
    for (; n < keys.n; n++) { /* one probe a key: where it is, or where it goes */
        map_ahead(m, keys.keys, keys.n, n);
        if (map_room_for_one(m) < 0) {
            map_keys_close(&keys);
            return NULL;
        }
        const Py_ssize_t i = map_slot_for(m, keys.keys[n]);
        PyObject *held = m->slots[i].value;
        if (held == value) continue;
        if (held != NULL && (replaceable == Py_None || held != replaceable)) break;
        m->slots[i].key = keys.keys[n];
        m->slots[i].value = Py_NewRef(value);
        if (held == NULL) m->used++;
        Py_XDECREF(held);
    }
    map_keys_close(&keys);
    return PyLong_FromSsize_t(n);
}

static PyObject *map_repoint(U64Map *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "repoint(keys, old, new) takes 3 arguments");
        return NULL;
    }
    PyObject *old = args[1], *new = args[2];
    MapKeys keys;
    if (map_keys_open(args[0], &keys) < 0) return NULL;
    Py_ssize_t changed = 0;
    for (Py_ssize_t n = 0; n < keys.n; n++) {
        map_ahead(m, keys.keys, keys.n, n);
        const Py_ssize_t i = map_find(m, keys.keys[n]);
        if (i < 0 || m->slots[i].value != old) continue;
        changed++;
        if (new == Py_None) {
            Py_DECREF(map_take(m, i));
        } else {
            m->slots[i].value = Py_NewRef(new);
            Py_DECREF(old);
        }
    }
    map_keys_close(&keys);
    return PyLong_FromSsize_t(changed);
}

static PyObject *map_fill(U64Map *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "fill(keys, value) takes 2 arguments");
        return NULL;
    }
    MapKeys keys;
    if (map_keys_open(args[0], &keys) < 0) return NULL;
    for (Py_ssize_t n = 0; n < keys.n; n++) {
        map_ahead(m, keys.keys, keys.n, n);
        if (map_put(m, keys.keys[n], Py_NewRef(args[1])) < 0) {
            map_keys_close(&keys);
            return NULL;
        }
    }
    map_keys_close(&keys);
    Py_RETURN_NONE;
}

static PyMappingMethods map_as_mapping = {
    .mp_length = (lenfunc)map_length,
    .mp_subscript = (binaryfunc)map_subscript,
    .mp_ass_subscript = (objobjargproc)map_ass_subscript,
};

static PySequenceMethods map_as_sequence = {.sq_contains = (objobjproc)map_contains};

static PyMethodDef map_methods[] = {
    {"get", (PyCFunction)(void (*)(void))map_get, METH_FASTCALL, "get(key, default=None): as dict.get."},
    {"pop", (PyCFunction)(void (*)(void))map_pop, METH_FASTCALL, "pop(key[, default]): as dict.pop."},
    {"popitem", (PyCFunction)map_popitem, METH_NOARGS, "popitem() -> (key, value): some entry, taken out."},
    {"items", (PyCFunction)map_items, METH_NOARGS, "items() -> list[tuple[int, Any]]"},
    {"clear", (PyCFunction)map_clear, METH_NOARGS, "clear(): every entry taken out."},
    {"__sizeof__", (PyCFunction)map_sizeof, METH_NOARGS, "The map's bytes, its slots included."},
    {"bind_run", (PyCFunction)(void (*)(void))map_bind_run, METH_FASTCALL,
     "bind_run(keys, value, replaceable) -> int\n\nBinds keys to `value` in order, where a key is unbound, bound to "
     "`value` or to `replaceable` (not None); stops at the first bound to anything else. Returns how many keys it "
     "went past (len(keys) when all)."},
    {"repoint", (PyCFunction)(void (*)(void))map_repoint, METH_FASTCALL,
     "repoint(keys, old, new) -> int\n\nThe keys bound to `old` (by identity) bound to `new` instead, or taken out "
     "where `new` is None. Returns how many were."},
    {"fill", (PyCFunction)(void (*)(void))map_fill, METH_FASTCALL,
     "fill(keys, value)\n\nEvery key bound to `value`, as dict.update with the pairs would."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject U64MapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvctl.core._native.U64Map",
    .tp_doc = "U64Map()\n\nA dict of u64 keys (ints in [0, 2^64)) to objects, each key in a 16 B slot.",
    .tp_basicsize = sizeof(U64Map),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = map_new,
    .tp_dealloc = (destructor)map_dealloc,
    .tp_as_mapping = &map_as_mapping,
    .tp_as_sequence = &map_as_sequence,
    .tp_methods = map_methods,
};

/* The per-process seed of map_home, from os.urandom. */
static int map_seed_init(void) {
    PyObject *os = PyImport_ImportModule("os");
    if (os == NULL) return -1;
    PyObject *raw = PyObject_CallMethod(os, "urandom", "i", 8);
    Py_DECREF(os);
    if (raw == NULL) return -1;
    if (!PyBytes_Check(raw) || PyBytes_GET_SIZE(raw) != 8) {
        Py_DECREF(raw);
        PyErr_SetString(PyExc_RuntimeError, "os.urandom(8) gave no 8 bytes");
        return -1;
    }
    memcpy(&map_seed, PyBytes_AS_STRING(raw), 8);
    Py_DECREF(raw);
    return 0;
}

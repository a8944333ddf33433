/* Optional native accelerator for the kvatlas index core (plain C against the CPython API).
 *
 * The pure-Python core (indexer/hashing.py, indexer/core/ modules) is the reference; everything here is
 * a faster twin of one piece of it and must agree bit for bit (tests run both):
 *  - block digests / chained content keys straight from a msgpack int array (a msgspec.Raw
 *    `token_ids`), a list of ints or an integer buffer, without creating Python ints per token;
 *  - U64Map: a dict-like open-addressing map whose u64 keys and non-negative int values (any width:
 *    residency words grow as worker slots are added) are stored inline; other keys (bytes engine
 *    hashes, key 0) live in a side dict, so it is a drop-in for the dicts of the Python core;
 *  - attach / remove: the per-block loops of a store or remove event over those maps.
 * Functions return None where they cannot decide (odd input): the caller then takes the Python path,
 * which judges the input exactly as the reference does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if PY_BIG_ENDIAN
#error "kvnative assumes a little-endian host (residency words are little-endian byte strings)"
#endif

#define P_MUL 0x9E3779B97F4A7C15ULL
#define K1 0xBF58476D1CE4E5B9ULL
#define K2 0x94D049BB133111EBULL
#define K3 0xD6E8FEB86659FD93ULL
#define EXTRA_SALT 0xA0761D6478BD642FULL

/* ---------------------------------------------------------------- hashing (twin of hashing.py) */

static inline uint64_t col_const(uint64_t i) { return (((i + 1) * K3) ^ (i * P_MUL)) | 1ULL; }

static inline uint64_t block_digest(const uint64_t *t, Py_ssize_t bs, uint64_t extra, const uint64_t *cols) {
    uint64_t acc = 0;
    for (Py_ssize_t i = 0; i < bs; i++) {
        uint64_t x = t[i] * K1 + cols[i];
        x ^= x >> 31;
        acc += x * K2;
    }
    acc ^= extra * EXTRA_SALT;
    acc ^= acc >> 29;
    acc *= K3;
    acc ^= acc >> 32;
    return acc;
}

/* Reads a msgpack array of ints. Returns token count, or -1 if `buf` is not exactly one such array. */
static Py_ssize_t msgpack_int_array(const unsigned char *p, Py_ssize_t len, uint64_t **out) {
    Py_ssize_t pos = 0, n;
    if (len < 1) return -1;
    unsigned char h = p[0];
    if ((h & 0xF0) == 0x90) { n = h & 0x0F; pos = 1; }
    else if (h == 0xDC) { if (len < 3) return -1; n = ((Py_ssize_t)p[1] << 8) | p[2]; pos = 3; }
    else if (h == 0xDD) {
        if (len < 5) return -1;
        n = ((Py_ssize_t)p[1] << 24) | ((Py_ssize_t)p[2] << 16) | ((Py_ssize_t)p[3] << 8) | p[4];
        pos = 5;
    } else return -1;
    if (n > len) return -1; /* every element takes at least one byte */
    uint64_t *t = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (!t) { PyErr_NoMemory(); return -2; }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (pos >= len) goto bad;
        unsigned char c = p[pos++];
        uint64_t v;
        int nb;
        if (c <= 0x7F) { t[i] = c; continue; }
        if (c >= 0xE0) { t[i] = (uint64_t)(int64_t)(int8_t)c; continue; }
        switch (c) {
            case 0xCC: case 0xD0: nb = 1; break;
            case 0xCD: case 0xD1: nb = 2; break;
            case 0xCE: case 0xD2: nb = 4; break;
            case 0xCF: case 0xD3: nb = 8; break;
            default: goto bad; /* not an int: the full decoder judges it */
        }
        if (pos + nb > len) goto bad;
        v = 0;
        for (int k = 0; k < nb; k++) v = (v << 8) | p[pos + k];
        pos += nb;
        if (c >= 0xD0 && nb < 8) { /* sign-extend signed ints */
            int sh = 64 - 8 * nb;
            v = (uint64_t)(((int64_t)(v << sh)) >> sh);
        }
        t[i] = v;
    }
    if (pos != len) goto bad;
    *out = t;
    return n;
bad:
    PyMem_Free(t);
    return -1;
}

/* Tokens from a list/tuple of ints or an integer buffer, as u64 (value mod 2^64, int64/u64 range only).
 * Returns count, -1 when the input is not something we handle (caller falls back), -2 on error. */
static Py_ssize_t tokens_u64(PyObject *obj, uint64_t **out) {
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
        PyObject **items = PySequence_Fast_ITEMS(obj);
        uint64_t *t = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
        if (!t) { PyErr_NoMemory(); return -2; }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *o = items[i];
            if (!PyLong_Check(o)) { PyMem_Free(t); return -1; }
            int ovf = 0;
            long long v = PyLong_AsLongLongAndOverflow(o, &ovf);
            if (ovf || (v == -1 && PyErr_Occurred())) { PyErr_Clear(); PyMem_Free(t); return -1; }
            t[i] = (uint64_t)v;
        }
        *out = t;
        return n;
    }
    if (!PyObject_CheckBuffer(obj)) return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) { PyErr_Clear(); return -1; }
    const char *f = view.format ? view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    char code = f[0];
    if (f[0] == 0 || f[1] != 0 || view.ndim != 1) { PyBuffer_Release(&view); return -1; }
    Py_ssize_t n = view.itemsize ? view.len / view.itemsize : 0;
    uint64_t *t = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (!t) { PyBuffer_Release(&view); PyErr_NoMemory(); return -2; }
    const char *b = view.buf;
    int ok = 1;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        const char *q = b + i * view.itemsize;
        switch (code) {
            case 'b': t[i] = (uint64_t)(int64_t)*(const int8_t *)q; break;
            case 'B': t[i] = *(const uint8_t *)q; break;
            case 'h': { int16_t v; memcpy(&v, q, 2); t[i] = (uint64_t)(int64_t)v; break; }
            case 'H': { uint16_t v; memcpy(&v, q, 2); t[i] = v; break; }
            case 'i': { int32_t v; memcpy(&v, q, 4); t[i] = (uint64_t)(int64_t)v; break; }
            case 'I': { uint32_t v; memcpy(&v, q, 4); t[i] = v; break; }
            case 'l': case 'q':
                if (view.itemsize != 8) { ok = 0; break; }
                { int64_t v; memcpy(&v, q, 8); t[i] = (uint64_t)v; break; }
            case 'L': case 'Q':
                if (view.itemsize != 8) { ok = 0; break; }
                { uint64_t v; memcpy(&v, q, 8); t[i] = v; break; }
            default: ok = 0;
        }
    }
    PyBuffer_Release(&view);
    if (!ok) { PyMem_Free(t); return -1; }
    *out = t;
    return n;
}

/* extras: None or a list of ints (u64 digests); missing entries count as 0. 0 ok, -1 fallback. */
static int extra_at(PyObject *extras, Py_ssize_t j, uint64_t *out) {
    *out = 0;
    if (extras == Py_None) return 0;
    if (!PyList_Check(extras)) return -1;
    if (j >= PyList_GET_SIZE(extras)) return 0;
    PyObject *o = PyList_GET_ITEM(extras, j);
    if (!PyLong_Check(o)) return -1;
    uint64_t v = PyLong_AsUnsignedLongLongMask(o);
    if (v == (uint64_t)-1 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
    *out = v;
    return 0;
}

/* Digests (or chained keys) of `nblocks` blocks: a list of ints, or with `as_bytes` a bytes object of
 * little-endian u64 (no int object per block; `attach` reads it directly). */
static PyObject *digest_list(const uint64_t *t, Py_ssize_t nblocks, Py_ssize_t bs, PyObject *extras,
                             int chained, uint64_t state, int as_bytes) {
    uint64_t *cols = PyMem_Malloc((size_t)bs * sizeof(uint64_t));
    if (!cols) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < bs; i++) cols[i] = col_const((uint64_t)i);
    PyObject *res = as_bytes ? PyBytes_FromStringAndSize(NULL, nblocks * 8) : PyList_New(nblocks);
    if (!res) { PyMem_Free(cols); return NULL; }
    uint64_t *raw = as_bytes ? (uint64_t *)PyBytes_AS_STRING(res) : NULL;
    for (Py_ssize_t j = 0; j < nblocks; j++) {
        uint64_t ex;
        if (extra_at(extras, j, &ex) < 0) { Py_DECREF(res); PyMem_Free(cols); Py_RETURN_NONE; }
        uint64_t d = block_digest(t + j * bs, bs, ex, cols);
        if (chained) { state = state * P_MUL + d; d = state; }
        if (raw) { memcpy(raw + j, &d, 8); continue; }
        PyObject *v = PyLong_FromUnsignedLongLong(d);
        if (!v) { Py_DECREF(res); PyMem_Free(cols); return NULL; }
        PyList_SET_ITEM(res, j, v);
    }
    PyMem_Free(cols);
    return res;
}

/* digest_msgpack(raw, block_size, max_blocks, extras) -> (ntokens, [digest per full block]) | None */
static PyObject *py_digest_msgpack(PyObject *self, PyObject *args) {
    PyObject *raw, *extras;
    Py_ssize_t bs, maxb;
    if (!PyArg_ParseTuple(args, "OnnO", &raw, &bs, &maxb, &extras)) return NULL;
    if (bs <= 0) Py_RETURN_NONE;
    Py_buffer view;
    if (PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE) < 0) { PyErr_Clear(); Py_RETURN_NONE; }
    uint64_t *t = NULL;
    Py_ssize_t n = msgpack_int_array(view.buf, view.len, &t);
    PyBuffer_Release(&view);
    if (n == -2) return NULL;
    if (n < 0) Py_RETURN_NONE;
    Py_ssize_t nb = n / bs;
    if (nb > maxb) nb = maxb < 0 ? 0 : maxb;
    PyObject *d = digest_list(t, nb, bs, extras, 0, 0, 1);
    PyMem_Free(t);
    if (!d || d == Py_None) return d;
    PyObject *out = Py_BuildValue("(nN)", n, d);
    return out;
}

/* digest_tokens(tokens, block_size, max_blocks, extras) -> [digest per full block] | None */
static PyObject *py_digest_tokens(PyObject *self, PyObject *args) {
    PyObject *seq, *extras;
    Py_ssize_t bs, maxb;
    if (!PyArg_ParseTuple(args, "OnnO", &seq, &bs, &maxb, &extras)) return NULL;
    if (bs <= 0) Py_RETURN_NONE;
    uint64_t *t = NULL;
    Py_ssize_t n = tokens_u64(seq, &t);
    if (n == -2) return NULL;
    if (n < 0) Py_RETURN_NONE;
    Py_ssize_t nb = n / bs;
    if (nb > maxb) nb = maxb < 0 ? 0 : maxb;
    PyObject *d = digest_list(t, nb, bs, extras, 0, 0, 1);
    PyMem_Free(t);
    return d;
}

/* chain_keys(tokens, block_size, seed, extras) -> [chained key per full block] | None */
static PyObject *py_chain_keys(PyObject *self, PyObject *args) {
    PyObject *seq, *extras, *seedo;
    Py_ssize_t bs;
    if (!PyArg_ParseTuple(args, "OnOO", &seq, &bs, &seedo, &extras)) return NULL;
    if (bs <= 0) Py_RETURN_NONE;
    uint64_t seed = PyLong_AsUnsignedLongLongMask(seedo);
    if (seed == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    uint64_t *t = NULL;
    Py_ssize_t n = tokens_u64(seq, &t);
    if (n == -2) return NULL;
    if (n < 0) Py_RETURN_NONE;
    PyObject *d = digest_list(t, n / bs, bs, extras, 1, seed, 0);
    PyMem_Free(t);
    return d;
}

/* ---------------------------------------------------------------- U64Map */

typedef struct {
    PyObject_HEAD
    uint64_t *tab; /* cap entries of (key, width value words); key 0 = empty slot. One array so a
                      lookup touches one cache line, not two. Values are little-endian words. */
    Py_ssize_t cap, used;
    int width;
    PyObject *other; /* dict for keys that are not ints in [1, 2^64) */
} U64Map;

static PyTypeObject U64MapType;
#define MIN_CAP 8

/* Home slot: multiply-high maps the mixed key onto [0, cap) for any cap, so the table can grow by
 * 1.5x (not 2x) and average load stays higher: bytes per entry is one of the targets. */
static inline Py_ssize_t slot_of(const U64Map *m, uint64_t k) {
    return (Py_ssize_t)(((unsigned __int128)(k * P_MUL) * (uint64_t)m->cap) >> 64);
}

#define KEY(m, i) ((m)->tab[(size_t)(i) * (1 + (m)->width)])
#define VALS(m, i) ((m)->tab + (size_t)(i) * (1 + (m)->width) + 1)

static int map_alloc(U64Map *m, Py_ssize_t cap, int width) {
    uint64_t *t = PyMem_Calloc((size_t)cap * (1 + width), sizeof(uint64_t));
    if (!t) { PyErr_NoMemory(); return -1; }
    m->tab = t; m->cap = cap; m->width = width; m->used = 0;
    return 0;
}

/* Find slot of k, or the empty slot where it would go. */
static inline Py_ssize_t find(const U64Map *m, uint64_t k, int *found) {
    Py_ssize_t cap = m->cap, i = slot_of(m, k);
    for (;;) {
        uint64_t c = KEY(m, i);
        if (c == k) { *found = 1; return i; }
        if (c == 0) { *found = 0; return i; }
        if (++i == cap) i = 0;
    }
}

static int rehash(U64Map *m, Py_ssize_t ncap, int width) {
    uint64_t *ot = m->tab;
    Py_ssize_t ocap = m->cap, used = m->used;
    int ow = m->width;
    if (map_alloc(m, ncap, width) < 0) { m->tab = ot; m->cap = ocap; m->width = ow; m->used = used; return -1; }
    for (Py_ssize_t i = 0; i < ocap; i++) {
        const uint64_t *e = ot + (size_t)i * (1 + ow);
        if (!e[0]) continue;
        int f;
        Py_ssize_t j = find(m, e[0], &f);
        KEY(m, j) = e[0];
        memcpy(VALS(m, j), e + 1, sizeof(uint64_t) * (ow < width ? ow : width));
    }
    m->used = used;
    PyMem_Free(ot);
    return 0;
}

/* Slot for k, inserting it (value zero) when absent. -1 on memory error. */
static Py_ssize_t find_or_insert(U64Map *m, uint64_t k, int *found) {
    Py_ssize_t i = find(m, k, found);
    if (*found) return i;
    if ((m->used + 1) * 20 > m->cap * 17) { /* max load 0.85: linear probing stays short, memory stays near 16-24 B/entry */
        if (rehash(m, m->cap + m->cap / 2, m->width) < 0) return -1;
        i = find(m, k, found);
    }
    KEY(m, i) = k;
    memset(VALS(m, i), 0, sizeof(uint64_t) * m->width);
    m->used++;
    return i;
}

/* Backward-shift delete (linear probing without tombstones). */
static void erase(U64Map *m, Py_ssize_t i) {
    Py_ssize_t cap = m->cap, j = i;
    int w = m->width;
    for (;;) {
        if (++j == cap) j = 0;
        uint64_t k = KEY(m, j);
        if (!k) break;
        Py_ssize_t home = slot_of(m, k);
        Py_ssize_t dh = j >= home ? j - home : j + cap - home, di = j >= i ? j - i : j + cap - i;
        if (dh >= di) {
            KEY(m, i) = k;
            memcpy(VALS(m, i), VALS(m, j), sizeof(uint64_t) * w);
            i = j;
        }
    }
    KEY(m, i) = 0;
    m->used--;
}

/* 1: native key, 0: side-dict key, -1: error */
static inline int key_u64(PyObject *o, uint64_t *k) {
    if (!PyLong_Check(o)) return 0;
    if (_PyLong_Sign(o) <= 0) return 0;
    uint64_t v = PyLong_AsUnsignedLongLong(o);
    if (v == (uint64_t)-1 && PyErr_Occurred()) { PyErr_Clear(); return 0; }
    *k = v;
    return 1;
}

static PyObject *val_obj(const U64Map *m, Py_ssize_t i) {
    const uint64_t *v = VALS(m, i);
    int hi = m->width;
    while (hi > 1 && v[hi - 1] == 0) hi--;
    if (hi == 1) return PyLong_FromUnsignedLongLong(v[0]);
    return _PyLong_FromByteArray((const unsigned char *)v, 8 * (size_t)hi, 1, 0);
}

static int widen(U64Map *m, int width) {
    if (width <= m->width) return 0;
    return rehash(m, m->cap, width);
}

/* Store a non-negative int value into slot i (widening as needed; the slot index may change). */
static int set_val(U64Map *m, uint64_t k, PyObject *v) {
    if (!PyLong_Check(v)) { PyErr_SetString(PyExc_TypeError, "U64Map values must be ints"); return -1; }
    if (_PyLong_Sign(v) < 0) { PyErr_SetString(PyExc_ValueError, "U64Map values must be non-negative"); return -1; }
    size_t nbits = _PyLong_NumBits(v);
    if (nbits == (size_t)-1 && PyErr_Occurred()) return -1;
    int words = nbits ? (int)((nbits + 63) / 64) : 1;
    if (widen(m, words) < 0) return -1;
    int f;
    Py_ssize_t i = find_or_insert(m, k, &f);
    if (i < 0) return -1;
    uint64_t *dst = VALS(m, i);
    if (words == 1) {
        uint64_t x = PyLong_AsUnsignedLongLong(v);
        if (x == (uint64_t)-1 && PyErr_Occurred()) return -1;
        memset(dst, 0, sizeof(uint64_t) * m->width);
        dst[0] = x;
        return 0;
    }
#if PY_VERSION_HEX >= 0x030D0000
    return _PyLong_AsByteArray((PyLongObject *)v, (unsigned char *)dst, 8 * (size_t)m->width, 1, 0, 1);
#else
    return _PyLong_AsByteArray((PyLongObject *)v, (unsigned char *)dst, 8 * (size_t)m->width, 1, 0);
#endif
}

static PyObject *U64Map_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if ((args && PyTuple_GET_SIZE(args)) || (kw && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "U64Map() takes no arguments");
        return NULL;
    }
    U64Map *m = (U64Map *)type->tp_alloc(type, 0);
    if (!m) return NULL;
    m->other = PyDict_New();
    if (!m->other || map_alloc(m, MIN_CAP, 1) < 0) { Py_DECREF(m); return NULL; }
    return (PyObject *)m;
}

static void U64Map_dealloc(U64Map *m) {
    PyMem_Free(m->tab);
    Py_XDECREF(m->other);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static Py_ssize_t U64Map_len(U64Map *m) { return m->used + PyDict_GET_SIZE(m->other); }

/* Lookup: new reference, NULL with no error set when absent. */
static PyObject *lookup(U64Map *m, PyObject *key) {
    uint64_t k;
    if (key_u64(key, &k)) {
        int f;
        Py_ssize_t i = find(m, k, &f);
        return f ? val_obj(m, i) : NULL;
    }
    PyObject *v = PyDict_GetItemWithError(m->other, key);
    Py_XINCREF(v);
    return v;
}

static PyObject *U64Map_subscript(U64Map *m, PyObject *key) {
    PyObject *v = lookup(m, key);
    if (!v && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
    return v;
}

static int U64Map_ass(U64Map *m, PyObject *key, PyObject *v) {
    uint64_t k;
    if (key_u64(key, &k)) {
        if (v) return set_val(m, k, v);
        int f;
        Py_ssize_t i = find(m, k, &f);
        if (!f) { PyErr_SetObject(PyExc_KeyError, key); return -1; }
        erase(m, i);
        return 0;
    }
    if (v) {
        if (!PyLong_Check(v) || _PyLong_Sign(v) < 0) {
            PyErr_SetString(PyExc_TypeError, "U64Map values must be non-negative ints");
            return -1;
        }
        return PyDict_SetItem(m->other, key, v);
    }
    return PyDict_DelItem(m->other, key);
}

static int U64Map_contains(U64Map *m, PyObject *key) {
    uint64_t k;
    if (key_u64(key, &k)) { int f; find(m, k, &f); return f; }
    return PyDict_Contains(m->other, key);
}

static PyObject *U64Map_get(U64Map *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) { PyErr_SetString(PyExc_TypeError, "get(key, default=None)"); return NULL; }
    PyObject *v = lookup(m, args[0]);
    if (v || PyErr_Occurred()) return v;
    PyObject *d = nargs == 2 ? args[1] : Py_None;
    Py_INCREF(d);
    return d;
}

/* what: 0 keys, 1 values, 2 items */
static PyObject *collect(U64Map *m, int what) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < m->cap; i++) {
        if (!KEY(m, i)) continue;
        PyObject *k = NULL, *v = NULL, *e;
        if (what != 1 && !(k = PyLong_FromUnsignedLongLong(KEY(m, i)))) goto fail;
        if (what != 0 && !(v = val_obj(m, i))) { Py_XDECREF(k); goto fail; }
        e = what == 0 ? k : what == 1 ? v : PyTuple_Pack(2, k, v);
        if (what == 2) { Py_DECREF(k); Py_DECREF(v); }
        if (!e || PyList_Append(out, e) < 0) { Py_XDECREF(e); goto fail; }
        Py_DECREF(e);
    }
    PyObject *src = what == 0 ? PyDict_Keys(m->other) : what == 1 ? PyDict_Values(m->other) : PyDict_Items(m->other);
    if (!src) goto fail;
    Py_ssize_t n = PyList_GET_SIZE(out);
    int r = PyList_SetSlice(out, n, n, src);
    Py_DECREF(src);
    if (r < 0) goto fail;
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *U64Map_keys(U64Map *m, PyObject *u) { return collect(m, 0); }
static PyObject *U64Map_values(U64Map *m, PyObject *u) { return collect(m, 1); }
static PyObject *U64Map_items(U64Map *m, PyObject *u) { return collect(m, 2); }

static PyObject *U64Map_iter(U64Map *m) {
    PyObject *k = collect(m, 0);
    if (!k) return NULL;
    PyObject *it = PyObject_GetIter(k);
    Py_DECREF(k);
    return it;
}

static PyObject *U64Map_clear(U64Map *m, PyObject *u) {
    uint64_t *ot = m->tab;
    Py_ssize_t ocap = m->cap, used = m->used;
    int ow = m->width;
    if (map_alloc(m, MIN_CAP, 1) < 0) { m->tab = ot; m->cap = ocap; m->width = ow; m->used = used; return NULL; }
    PyMem_Free(ot);
    PyDict_Clear(m->other);
    Py_RETURN_NONE;
}

static PyObject *U64Map_nbytes(U64Map *m, void *c) {
    return PyLong_FromSsize_t(sizeof(U64Map) + m->cap * (Py_ssize_t)sizeof(uint64_t) * (1 + m->width));
}
static PyObject *U64Map_width(U64Map *m, void *c) { return PyLong_FromLong(m->width); }

/* ---------------------------------------------------------------- event loops over maps */

/* ext-style lookup (values fit u64): 1 found, 0 absent, -1 error */
static int get_u64(U64Map *m, PyObject *key, uint64_t *out) {
    uint64_t k;
    if (key_u64(key, &k)) {
        int f;
        Py_ssize_t i = find(m, k, &f);
        if (f) *out = VALS(m, i)[0];
        return f;
    }
    PyObject *v = PyDict_GetItemWithError(m->other, key);
    if (!v) return PyErr_Occurred() ? -1 : 0;
    *out = PyLong_AsUnsignedLongLongMask(v);
    return (*out == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 1;
}

static int set_u64(U64Map *m, PyObject *key, uint64_t val) {
    uint64_t k;
    if (key_u64(key, &k)) { /* inline: no int object */
        int f;
        Py_ssize_t i = find_or_insert(m, k, &f);
        if (i < 0) return -1;
        uint64_t *dst = VALS(m, i);
        memset(dst, 0, sizeof(uint64_t) * m->width);
        dst[0] = val;
        return 0;
    }
    PyObject *v = PyLong_FromUnsignedLongLong(val);
    if (!v) return -1;
    int r = U64Map_ass(m, key, v);
    Py_DECREF(v);
    return r;
}

/* Residency bit `pos` of node `key`: read (op 0), set (op 1), clear (op 2). Returns the bit before
 * the op, -1 on error. Clearing may leave a node all-zero; `node_zero` / `node_drop` handle that. */
static int node_bit(U64Map *m, uint64_t key, int pos, int op) {
    int word = pos >> 6;
    uint64_t b = 1ULL << (pos & 63);
    if (key == 0) { /* rare: content key 0 lives in the side dict */
        PyObject *ko = PyLong_FromUnsignedLongLong(0), *bit = NULL, *cur = NULL, *nv = NULL;
        int was = -1;
        if (!ko) return -1;
        cur = PyDict_GetItemWithError(m->other, ko);
        if (!cur && PyErr_Occurred()) goto out0;
        {
            PyObject *one = PyLong_FromLong(1), *po = PyLong_FromLong(pos);
            bit = (one && po) ? PyNumber_Lshift(one, po) : NULL;
            Py_XDECREF(one); Py_XDECREF(po);
        }
        if (!bit) goto out0;
        PyObject *andv = cur ? PyNumber_And(cur, bit) : PyLong_FromLong(0);
        if (!andv) goto out0;
        was = PyObject_IsTrue(andv);
        Py_DECREF(andv);
        if (op == 1 && !was) { nv = cur ? PyNumber_Or(cur, bit) : (Py_INCREF(bit), bit); if (!nv || PyDict_SetItem(m->other, ko, nv) < 0) was = -1; }
        if (op == 2 && was == 1) { nv = PyNumber_Xor(cur, bit); if (!nv || PyDict_SetItem(m->other, ko, nv) < 0) was = -1; }
    out0:
        Py_XDECREF(nv); Py_XDECREF(bit); Py_DECREF(ko);
        return was;
    }
    int f;
    Py_ssize_t i;
    if (op == 1) {
        if (word >= m->width && widen(m, word + 1) < 0) return -1;
        i = find_or_insert(m, key, &f);
        if (i < 0) return -1;
    } else {
        i = find(m, key, &f);
        if (!f || word >= m->width) return 0;
    }
    uint64_t *v = VALS(m, i) + word;
    int was = (*v & b) != 0;
    if (op == 1) *v |= b;
    else if (op == 2) *v &= ~b;
    return was;
}

/* Worker nibble (4 bits at `shift`) of a node, and whether the node has any bit left. */
static int node_nibble(U64Map *m, uint64_t key, int shift, int *any) {
    if (key == 0) {
        PyObject *ko = PyLong_FromUnsignedLongLong(0);
        if (!ko) return -1;
        PyObject *cur = PyDict_GetItemWithError(m->other, ko);
        Py_DECREF(ko);
        if (!cur) { *any = 0; return PyErr_Occurred() ? -1 : 0; }
        *any = PyObject_IsTrue(cur);
        PyObject *s = PyLong_FromLong(shift);
        PyObject *r = s ? PyNumber_Rshift(cur, s) : NULL;
        Py_XDECREF(s);
        if (!r) return -1;
        long nib = (long)(PyLong_AsUnsignedLongLongMask(r) & 0xF);
        Py_DECREF(r);
        return (int)nib;
    }
    int f;
    Py_ssize_t i = find(m, key, &f);
    if (!f) { *any = 0; return 0; }
    uint64_t *v = VALS(m, i);
    *any = 0;
    for (int w = 0; w < m->width; w++) if (v[w]) { *any = 1; break; }
    int word = shift >> 6;
    return word < m->width ? (int)((v[word] >> (shift & 63)) & 0xF) : 0;
}

static int node_drop(U64Map *m, uint64_t key) {
    if (key == 0) {
        PyObject *ko = PyLong_FromUnsignedLongLong(0);
        if (!ko) return -1;
        int r = PyDict_Contains(m->other, ko);
        if (r == 1) r = PyDict_DelItem(m->other, ko);
        Py_DECREF(ko);
        return r < 0 ? -1 : 0;
    }
    int f;
    Py_ssize_t i = find(m, key, &f);
    if (f) erase(m, i);
    return 0;
}

/* attach(ext, nodes, known|None, hashes, state, digests|callable|None, pos, cancelled|None, known_limit)
 *   -> (new, duplicate, tier_added) | None  (None: digests were needed and the callable gave None)
 * Twin of indexer.core.apply._attach: `pos` = 4*slot + tier. */
static PyObject *py_attach(PyObject *self, PyObject *args) {
    U64Map *ext, *nodes;
    PyObject *knowno, *hashes, *stateo, *digests, *cancelled;
    int pos;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "O!O!OO!OOiOn", &U64MapType, &ext, &U64MapType, &nodes, &knowno,
                          &PyList_Type, &hashes, &stateo, &digests, &pos, &cancelled, &limit))
        return NULL;
    U64Map *known = NULL;
    if (knowno != Py_None) {
        if (!PyObject_TypeCheck(knowno, &U64MapType)) { PyErr_SetString(PyExc_TypeError, "known must be U64Map"); return NULL; }
        known = (U64Map *)knowno;
    }
    uint64_t state = PyLong_AsUnsignedLongLongMask(stateo);
    if (state == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    PyObject *dl = NULL; /* owned list/bytes of digests once resolved */
    if (PyList_Check(digests) || PyBytes_Check(digests)) { dl = digests; Py_INCREF(dl); }
    Py_ssize_t n = PyList_GET_SIZE(hashes), newc = 0, dup = 0, added = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *h = PyList_GET_ITEM(hashes, j);
        uint64_t key;
        int r = get_u64(ext, h, &key);
        if (r < 0) goto fail;
        int is_new = !r;
        if (is_new) {
            r = known ? get_u64(known, h, &key) : 0;
            if (r < 0) goto fail;
            if (!r) {
                if (!dl) {
                    if (digests == Py_None) { PyErr_SetString(PyExc_RuntimeError, "attach needs digests"); goto fail; }
                    dl = PyObject_CallNoArgs(digests);
                    if (!dl) goto fail;
                    if (dl == Py_None) { Py_DECREF(dl); Py_RETURN_NONE; }
                    if (!PyList_Check(dl) && !PyBytes_Check(dl)) { PyErr_SetString(PyExc_TypeError, "digests must be a list"); goto fail; }
                }
                uint64_t d;
                if (PyBytes_Check(dl)) {
                    if (j >= PyBytes_GET_SIZE(dl) / 8) { PyErr_SetString(PyExc_IndexError, "too few digests"); goto fail; }
                    memcpy(&d, PyBytes_AS_STRING(dl) + 8 * j, 8);
                } else {
                    if (j >= PyList_GET_SIZE(dl)) { PyErr_SetString(PyExc_IndexError, "too few digests"); goto fail; }
                    d = PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(dl, j));
                    if (d == (uint64_t)-1 && PyErr_Occurred()) goto fail;
                }
                key = state * P_MUL + d;
                if (known) {
                    if (U64Map_len(known) >= limit) { /* bounded trust cache: start afresh */
                        PyObject *cr = U64Map_clear(known, NULL);
                        if (!cr) goto fail;
                        Py_DECREF(cr);
                    }
                    if (set_u64(known, h, key) < 0) goto fail;
                }
            }
        }
        state = key;
        if (cancelled != Py_None) {
            int c = PySet_Contains(cancelled, h);
            if (c < 0) goto fail;
            if (c) continue; /* stored and removed again while it waited for its parent */
        }
        if (is_new && set_u64(ext, h, key) < 0) goto fail;
        int was = node_bit(nodes, key, pos, 1);
        if (was < 0) goto fail;
        if (was) dup++;
        else if (is_new) newc++;
        else added++;
    }
    Py_XDECREF(dl);
    return Py_BuildValue("(nnn)", newc, dup, added);
fail:
    Py_XDECREF(dl);
    return NULL;
}

/* remove(ext, nodes, hashes, shift, tier) -> (removed, absent, [hashes the worker does not map])
 * Twin of the mapped part of indexer.core.apply._remove. */
static PyObject *py_remove(PyObject *self, PyObject *args) {
    U64Map *ext, *nodes;
    PyObject *hashes;
    int shift, tier;
    if (!PyArg_ParseTuple(args, "O!O!O!ii", &U64MapType, &ext, &U64MapType, &nodes, &PyList_Type, &hashes, &shift, &tier))
        return NULL;
    PyObject *missing = PyList_New(0);
    if (!missing) return NULL;
    Py_ssize_t removed = 0, absent = 0, n = PyList_GET_SIZE(hashes);
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *h = PyList_GET_ITEM(hashes, j);
        uint64_t key;
        int r = get_u64(ext, h, &key);
        if (r < 0) goto fail;
        if (!r) { if (PyList_Append(missing, h) < 0) goto fail; continue; }
        int was = node_bit(nodes, key, shift + tier, 2);
        if (was < 0) goto fail;
        if (was) removed++; else absent++;
        int any;
        int nib = node_nibble(nodes, key, shift, &any);
        if (nib < 0) goto fail;
        if (!nib && U64Map_ass(ext, h, NULL) < 0) goto fail;
        if (!any && node_drop(nodes, key) < 0) goto fail;
    }
    return Py_BuildValue("(nnN)", removed, absent, missing);
fail:
    Py_DECREF(missing);
    return NULL;
}

/* prefix_values(nodes, keys, start, stop) -> values of keys[start:stop] up to the first absent one */
static PyObject *py_prefix_values(PyObject *self, PyObject *args) {
    U64Map *m;
    PyObject *keys;
    Py_ssize_t start, stop;
    if (!PyArg_ParseTuple(args, "O!O!nn", &U64MapType, &m, &PyList_Type, &keys, &start, &stop)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (stop > n) stop = n;
    if (start < 0) start = 0;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (Py_ssize_t j = start; j < stop; j++) {
        PyObject *v = lookup(m, PyList_GET_ITEM(keys, j));
        if (!v) { if (PyErr_Occurred()) { Py_DECREF(out); return NULL; } break; }
        int r = PyList_Append(out, v);
        Py_DECREF(v);
        if (r < 0) { Py_DECREF(out); return NULL; }
    }
    return out;
}

/* walk(nodes, keys, slots) -> [(device, cached, gpu, host, disk, shared) per slot] | None
 * Twin of indexer.core.scoring.walk for the listed worker slots (None: a key needs the Python path). */
static PyObject *py_walk(PyObject *self, PyObject *args) {
    U64Map *m;
    PyObject *keys, *slotso;
    if (!PyArg_ParseTuple(args, "O!O!O!", &U64MapType, &m, &PyList_Type, &keys, &PyList_Type, &slotso)) return NULL;
    Py_ssize_t ns = PyList_GET_SIZE(slotso), nk = PyList_GET_SIZE(keys);
    /* per slot: slot, alive_c, alive_d, cur tier, device, cached, split[4] */
    Py_ssize_t *slot = PyMem_Calloc((size_t)(ns ? ns : 1), sizeof(Py_ssize_t) * 10);
    uint64_t *prev = PyMem_Calloc((size_t)m->width, sizeof(uint64_t));
    PyObject *out = NULL;
    if (!slot || !prev) { PyErr_NoMemory(); goto done; }
    Py_ssize_t *ac = slot + ns, *ad = slot + 2 * ns, *ct = slot + 3 * ns, *dev = slot + 4 * ns,
               *cach = slot + 5 * ns, *sp = slot + 6 * ns;
    for (Py_ssize_t s = 0; s < ns; s++) {
        slot[s] = PyLong_AsSsize_t(PyList_GET_ITEM(slotso, s));
        if (slot[s] < 0) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad slot"); goto done; }
        ac[s] = ad[s] = 1;
    }
    Py_ssize_t nalive = ns, depth = 0, run = 0;
    int W = m->width, have_prev = 0;
    for (Py_ssize_t j = 0; j < nk && nalive; j++) {
        uint64_t k;
        if (!key_u64(PyList_GET_ITEM(keys, j), &k)) { out = Py_None; Py_INCREF(out); goto done; }
        int f;
        Py_ssize_t i = find(m, k, &f);
        if (!f) break;
        const uint64_t *v = VALS(m, i);
        if (have_prev && memcmp(v, prev, sizeof(uint64_t) * W) == 0) { run++; continue; }
        for (Py_ssize_t s = 0; s < ns; s++) if (ac[s]) sp[4 * s + ct[s]] += run;
        depth += run;
        run = 0;
        int pool = 0;
        for (int w = 0; w < W; w++) if (v[w] & 0x8888888888888888ULL) { pool = 1; break; }
        for (Py_ssize_t s = 0; s < ns; s++) {
            if (!ac[s]) continue;
            Py_ssize_t word = slot[s] >> 4;
            int nib = word < W ? (int)((v[word] >> (4 * (slot[s] & 15))) & 0xF) : 0;
            if (ad[s] && !(nib & 1)) { dev[s] = depth; ad[s] = 0; }
            if (!(nib & 7) && !pool) { cach[s] = depth; ac[s] = 0; nalive--; continue; }
            ct[s] = (nib & 1) ? 0 : (nib & 2) ? 1 : (nib & 4) ? 2 : 3;
        }
        memcpy(prev, v, sizeof(uint64_t) * W);
        have_prev = 1;
        run = 1;
    }
    for (Py_ssize_t s = 0; s < ns; s++) if (ac[s]) sp[4 * s + ct[s]] += run;
    depth += run;
    out = PyList_New(ns);
    if (!out) goto done;
    for (Py_ssize_t s = 0; s < ns; s++) {
        PyObject *t = Py_BuildValue("(nnnnnn)", ad[s] ? depth : dev[s], ac[s] ? depth : cach[s],
                                    sp[4 * s], sp[4 * s + 1], sp[4 * s + 2], sp[4 * s + 3]);
        if (!t) { Py_CLEAR(out); goto done; }
        PyList_SET_ITEM(out, s, t);
    }
done:
    PyMem_Free(slot);
    PyMem_Free(prev);
    return out;
}

/* norm_hashes(list) -> the list (ints made unsigned u64) | None when the wire decoder would reject
 * it (int outside int64/u64, empty bytes). Twin of schemas.codec's hash checks. */
static PyObject *py_norm_hashes(PyObject *self, PyObject *lst) {
    if (!PyList_Check(lst)) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(lst);
    int neg = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyList_GET_ITEM(lst, i);
        if (PyLong_CheckExact(h)) {
            int ovf = 0;
            long long v = PyLong_AsLongLongAndOverflow(h, &ovf);
            if (ovf < 0) Py_RETURN_NONE;
            if (ovf > 0) {
                PyLong_AsUnsignedLongLong(h);
                if (PyErr_Occurred()) { PyErr_Clear(); Py_RETURN_NONE; }
            } else if (v < 0) neg = 1;
        } else if (PyBytes_CheckExact(h)) {
            if (PyBytes_GET_SIZE(h) == 0) Py_RETURN_NONE;
        } else Py_RETURN_NONE;
    }
    if (!neg) { Py_INCREF(lst); return lst; }
    PyObject *out = PyList_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyList_GET_ITEM(lst, i), *x;
        if (PyLong_CheckExact(h) && _PyLong_Sign(h) < 0) x = PyLong_FromUnsignedLongLong(PyLong_AsUnsignedLongLongMask(h));
        else { x = h; Py_INCREF(x); }
        if (!x) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, i, x);
    }
    return out;
}

/* prepare_raw(events, RawStored, block_size) -> {index: (ntokens, digests bytes)} | None
 * One call per batch for the fast payload path: normalises engine hashes (and parents) in place like
 * schemas.codec, and digests every RawStored's token array. None: something only the Python path
 * judges (bad hash or token array, extra keys to digest) — it then redoes the batch from scratch. */
static PyObject *py_prepare_raw(PyObject *self, PyObject *args) {
    PyObject *events, *stored_t;
    Py_ssize_t bs;
    if (!PyArg_ParseTuple(args, "O!On", &PyList_Type, &events, &stored_t, &bs)) return NULL;
    PyObject *out = PyDict_New();
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(events); i++) {
        PyObject *ev = PyList_GET_ITEM(events, i), *tmp;
        int is_store = (PyObject *)Py_TYPE(ev) == stored_t;
        PyObject *hashes = PyObject_GetAttrString(ev, "block_hashes");
        if (!hashes) { PyErr_Clear(); continue; } /* AllBlocksCleared */
        PyObject *norm = py_norm_hashes(NULL, hashes);
        Py_DECREF(hashes);
        if (!norm) goto fail;
        if (norm == Py_None) { Py_DECREF(norm); goto none; }
        int r = norm != hashes ? PyObject_SetAttrString(ev, "block_hashes", norm) : 0;
        Py_ssize_t nh = PyList_GET_SIZE(norm);
        Py_DECREF(norm);
        if (r < 0) goto fail;
        if (!is_store) continue;
        PyObject *parent = PyObject_GetAttrString(ev, "parent_block_hash");
        if (!parent) goto fail;
        if (PyLong_CheckExact(parent)) {
            int ovf = 0;
            long long v = PyLong_AsLongLongAndOverflow(parent, &ovf);
            if (ovf > 0) { PyLong_AsUnsignedLongLong(parent); if (PyErr_Occurred()) { PyErr_Clear(); ovf = -1; } }
            if (ovf < 0) { Py_DECREF(parent); goto none; }
            if (!ovf && v < 0) {
                PyObject *u = PyLong_FromUnsignedLongLong((uint64_t)v);
                r = u ? PyObject_SetAttrString(ev, "parent_block_hash", u) : -1;
                Py_XDECREF(u);
                if (r < 0) { Py_DECREF(parent); goto fail; }
            }
        }
        Py_DECREF(parent);
        PyObject *xk = PyObject_GetAttrString(ev, "extra_keys");
        if (!xk) goto fail;
        int has_extra = PyObject_IsTrue(xk);
        Py_DECREF(xk);
        if (has_extra) goto none; /* extra-key digests are computed in Python */
        PyObject *raw = PyObject_GetAttrString(ev, "token_ids");
        if (!raw) goto fail;
        PyObject *targs = Py_BuildValue("(OnnO)", raw, bs, nh, Py_None);
        Py_DECREF(raw);
        if (!targs) goto fail;
        tmp = py_digest_msgpack(NULL, targs);
        Py_DECREF(targs);
        if (!tmp) goto fail;
        if (tmp == Py_None) { Py_DECREF(tmp); goto none; }
        PyObject *key = PyLong_FromSsize_t(i);
        r = key ? PyDict_SetItem(out, key, tmp) : -1;
        Py_XDECREF(key);
        Py_DECREF(tmp);
        if (r < 0) goto fail;
    }
    return out;
none:
    Py_DECREF(out);
    Py_RETURN_NONE;
fail:
    Py_DECREF(out);
    return NULL;
}

/* all_in(map, hashes) -> True when every hash is a key (placeholder stores need it) */
static PyObject *py_all_in(PyObject *self, PyObject *args) {
    U64Map *m;
    PyObject *hashes;
    if (!PyArg_ParseTuple(args, "O!O!", &U64MapType, &m, &PyList_Type, &hashes)) return NULL;
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(hashes); j++) {
        int r = U64Map_contains(m, PyList_GET_ITEM(hashes, j));
        if (r < 0) return NULL;
        if (!r) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef U64Map_methods[] = {
    {"get", (PyCFunction)(void (*)(void))U64Map_get, METH_FASTCALL, "get(key, default=None)"},
    {"keys", (PyCFunction)U64Map_keys, METH_NOARGS, "list of keys"},
    {"values", (PyCFunction)U64Map_values, METH_NOARGS, "list of values"},
    {"items", (PyCFunction)U64Map_items, METH_NOARGS, "list of (key, value)"},
    {"clear", (PyCFunction)U64Map_clear, METH_NOARGS, "remove everything"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef U64Map_getset[] = {
    {"nbytes", (getter)U64Map_nbytes, NULL, "bytes held by the inline table (side dict excluded)", NULL},
    {"width", (getter)U64Map_width, NULL, "64-bit words per value", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMappingMethods U64Map_mapping = {(lenfunc)U64Map_len, (binaryfunc)U64Map_subscript, (objobjargproc)U64Map_ass};
static PySequenceMethods U64Map_seq = {.sq_contains = (objobjproc)U64Map_contains};

static PyTypeObject U64MapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "indexer._native._kvnative.U64Map",
    .tp_basicsize = sizeof(U64Map),
    .tp_dealloc = (destructor)U64Map_dealloc,
    .tp_as_mapping = &U64Map_mapping,
    .tp_as_sequence = &U64Map_seq,
    .tp_iter = (getiterfunc)U64Map_iter,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "dict-like map with u64 keys and non-negative int values stored inline",
    .tp_methods = U64Map_methods,
    .tp_getset = U64Map_getset,
    .tp_new = U64Map_new,
};

static PyMethodDef module_methods[] = {
    {"digest_msgpack", py_digest_msgpack, METH_VARARGS, "block digests from a msgpack int array"},
    {"digest_tokens", py_digest_tokens, METH_VARARGS, "block digests from a list/buffer of ints"},
    {"chain_keys", py_chain_keys, METH_VARARGS, "chained content keys of every full block"},
    {"attach", py_attach, METH_VARARGS, "store a chain of blocks for one worker"},
    {"remove", py_remove, METH_VARARGS, "remove blocks of one worker on one tier"},
    {"prefix_values", py_prefix_values, METH_VARARGS, "node values up to the first absent key"},
    {"walk", py_walk, METH_VARARGS, "per-slot prefix match of chained keys"},
    {"norm_hashes", py_norm_hashes, METH_O, "validate and normalise engine hashes"},
    {"all_in", py_all_in, METH_VARARGS, "every hash is a key of the map"},
    {"prepare_raw", py_prepare_raw, METH_VARARGS, "normalise a raw-decoded batch and digest its stores"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_kvnative", "kvatlas index accelerator", -1, module_methods};

PyMODINIT_FUNC PyInit__kvnative(void) {
    if (PyType_Ready(&U64MapType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&U64MapType);
    if (PyModule_AddObject(m, "U64Map", (PyObject *)&U64MapType) < 0) { Py_DECREF(&U64MapType); Py_DECREF(m); return NULL; }
    return m;
}

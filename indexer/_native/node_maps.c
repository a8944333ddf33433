/* Event loops over the maps: ext-style u64 access, residency bits and nibbles of nodes,
 * tier_counts, node_drop; included by kvnative.c (one translation unit). */

/* ---------------------------------------------------------------- event loops over maps */

/* ext-style lookup (values fit u64): 1 found, 0 absent, -1 error */
static int get_u64(U64Map *m, PyObject *key, uint64_t *out) {
    uint64_t k;
    int kind = key_u64(key, &k);
    if (kind < 0) return -1;
    if (kind) {
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
    int kind = key_u64(key, &k);
    if (kind < 0) return -1;
    if (kind) return set_word(m, k, val); /* inline: no int object */
    PyObject *v = PyLong_FromUnsignedLongLong(val);
    if (!v) return -1;
    int r = U64Map_ass(m, key, v);
    Py_DECREF(v);
    return r;
}

static int node_bit(U64Map *m, uint64_t key, int pos, int op);

/* node_bit over a holder-list value: the bit before, -1 on memory error. */
static int hl_bit(U64Map *m, uint64_t *v, int pos, int op) {
    int slot = pos >> 2, b = 1 << (pos & 3), nib = hl_nib(v, slot), was = (nib & b) != 0;
    if (op == 1 && !was) {
        if ((pos & 3) == 3) m->pool = 1;
        if (hl_put(v, slot, nib | b) < 0) return -1;
    }
    if (op == 2 && was && hl_put(v, slot, nib & ~b) < 0) return -1;
    return was;
}

/* Set residency bit `pos` of node `key` (node_bit's op 1), inline: the per-block call of every
 * store. Returns the bit before, -1 on error. */
static inline int node_set(U64Map *m, uint64_t key, int pos) {
    if (!key) return node_bit(m, key, pos, 1); /* rare: the side dict */
    int word = pos >> 6, f;
    if (word >= m->width && widen(m, word + 1) < 0) return -1;
    Py_ssize_t i = find_or_insert(m, key, &f);
    if (i < 0) return -1;
    if (m->hl) return hl_bit(m, VALS(m, i), pos, 1);
    uint64_t *v = VALS(m, i) + word, b = 1ULL << (pos & 63);
    int was = (*v & b) != 0;
    *v |= b;
    if ((pos & 3) == 3) m->pool = 1;
    return was;
}

/* Residency bit `pos` of node `key`: read (op 0), set (op 1), clear (op 2). Returns the bit before
 * the op, -1 on error. Clearing may leave a node all-zero; `node_zero` / `node_drop` handle that. */
static int node_bit(U64Map *m, uint64_t key, int pos, int op) {
    int word = pos >> 6;
    uint64_t b = 1ULL << (pos & 63);
    if (key == 0) { /* rare: content key 0 lives in the side dict */
        gil_need();
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
    if (op == 1) return node_set(m, key, pos);
    int f;
    Py_ssize_t i = find(m, key, &f);
    if (f && m->hl) return hl_bit(m, VALS(m, i), pos, op);
    if (!f || word >= m->width) return 0;
    uint64_t *v = VALS(m, i) + word;
    int was = (*v & b) != 0;
    if (op == 2) *v &= ~b;
    return was;
}

/* Worker nibble (4 bits at `shift`) of a node, and whether the node has any bit left. */
static int node_nibble(U64Map *m, uint64_t key, int shift, int *any) {
    if (key == 0) {
        gil_need();
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
    if (m->hl) { *any = hl_any(v); return hl_nib(v, shift >> 2); }
    *any = 0;
    for (int w = 0; w < m->width; w++) if (v[w]) { *any = 1; break; }
    int word = shift >> 6;
    return word < m->width ? (int)((v[word] >> (shift & 63)) & 0xF) : 0;
}

/* tier_counts(ext, nodes, shift) -> (gpu, host, disk, shared) | None
 * Twin of ModelState.tier_counts: over the distinct content keys one worker maps (ext's values),
 * how many hold each of the 4 tier bits at `shift` in nodes. None when the maps hold what only the
 * Python core reads (multi-word ext values, a non-int value, content key 0 in nodes' side dict).
 * Why: /workers, /stats and /metrics count every worker's blocks under the index lock — ~100 ms
 * for 180k blocks in Python, a stall of ingestion and /score (docs/service.md). */
static PyObject *py_tier_counts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyObject_TypeCheck(args[0], &U64MapType) || !PyObject_TypeCheck(args[1], &U64MapType)) {
        PyErr_SetString(PyExc_TypeError, "tier_counts(ext: U64Map, nodes: U64Map, shift: int)");
        return NULL;
    }
    U64Map *ext = (U64Map *)args[0], *nodes = (U64Map *)args[1];
    long shift = PyLong_AsLong(args[2]);
    if (shift == -1 && PyErr_Occurred()) return NULL;
    if (shift < 0 || shift % 4 || ext->width != 1 || PyDict_GET_SIZE(nodes->other)) Py_RETURN_NONE;
    Py_ssize_t n = ext->used + PyDict_GET_SIZE(ext->other), k = 0;
    uint64_t *keys = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (!keys) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < ext->cap; i++)
        if (KEY(ext, i)) keys[k++] = VALS(ext, i)[0];
    Py_ssize_t pos = 0;
    PyObject *dk, *dv;
    while (PyDict_Next(ext->other, &pos, &dk, &dv)) {
        uint64_t v;
        int r = int_u64(dv, &v);
        if (r < 0) { PyMem_RawFree(keys); return NULL; }
        if (!r || k >= n) { PyMem_RawFree(keys); Py_RETURN_NONE; } /* 0 or not a u64: the Python core counts it */
        keys[k++] = v;
    }
    /* distinct keys (two engine hashes may name one block): a set at load <= 1/2, then compacted */
    size_t scap = 16;
    while (scap < 2 * (size_t)k) scap <<= 1;
    uint64_t *seen = PyMem_RawCalloc(scap, sizeof(uint64_t));
    if (!seen) { PyMem_RawFree(keys); return PyErr_NoMemory(); }
    Py_ssize_t u = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        uint64_t key = keys[j];
        if (!key) continue; /* content key 0 would live in nodes' side dict, which is empty here */
        size_t s = (size_t)((key * P_MUL) >> 32) & (scap - 1);
        while (seen[s] && seen[s] != key) s = (s + 1) & (scap - 1);
        if (!seen[s]) { seen[s] = key; keys[u++] = key; }
    }
    PyMem_RawFree(seen);
    Py_ssize_t counts[4] = {0, 0, 0, 0};
    int word = (int)(shift >> 6), bit = (int)(shift & 63);
    for (Py_ssize_t j = 0; j < u && (nodes->hl || word < nodes->width); j++) {
        if (j + 8 < u) pf_slot(nodes, keys[j + 8]); /* random probes: overlap their misses */
        int f;
        Py_ssize_t i = find(nodes, keys[j], &f);
        if (!f) continue;
        uint64_t nib = nodes->hl ? (uint64_t)hl_nib(VALS(nodes, i), shift >> 2) : (VALS(nodes, i)[word] >> bit) & 0xF;
        for (int t = 0; t < 4; t++) counts[t] += (nib >> t) & 1;
    }
    PyMem_RawFree(keys);
    return Py_BuildValue("(nnnn)", counts[0], counts[1], counts[2], counts[3]);
}

static int node_drop(U64Map *m, uint64_t key) {
    if (key == 0) {
        gil_need();
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

/* ---------------------------------------------------------------- one worker's nibble (clear, move) */

/* nodes.clear_nibble(keys, shift) / nodes.move_nibble(keys, old, new) -> the keys left to the caller.
 * Twins of indexer/core/state.py clear_bits / move_bits over inline keys: one worker's nibble off
 * every node it holds (a node left with no bit leaves the table), or moved to its new slot's free
 * nibble. The work is that worker's keys: a value is never read or written as a whole int (a holder
 * list's int is as wide as the fleet: at 10k workers each get / set of the Python loop was ~5 KB of
 * int). Keys that are not inline (content key 0, bytes) are returned for the Python loop. */
static PyObject *nibble_op(U64Map *m, PyObject *keys, long old, long new, int move) {
    long lim = (long)(m->holders ? HL_MAX_SLOT : MAX_SLOT) * 4;
    if (old < 0 || old % 4 || old >= lim || (move && (new < 0 || new % 4 || new >= lim))) {
        PyErr_SetString(PyExc_ValueError, "nibble shift out of range");
        return NULL;
    }
    PyObject *it = PyObject_GetIter(keys);
    if (!it) return NULL;
    PyObject *rest = PyList_New(0), *o;
    if (!rest) { Py_DECREF(it); return NULL; }
    if (move && !m->hl && (new >> 6) >= m->width && widen(m, (int)(new >> 6) + 1) < 0) goto fail;
    while ((o = PyIter_Next(it))) {
        uint64_t k;
        int kind = key_u64(o, &k);
        if (kind <= 0) {
            if (kind < 0 || PyList_Append(rest, o) < 0) { Py_DECREF(o); goto fail; }
            Py_DECREF(o);
            continue;
        }
        Py_DECREF(o);
        m->work++;
        int f;
        Py_ssize_t i = find(m, k, &f);
        if (!f) continue;
        uint64_t *v = VALS(m, i);
        if (m->hl) {
            int nib = hl_nib(v, (Py_ssize_t)(old >> 2));
            if (nib && hl_put(v, (Py_ssize_t)(old >> 2), 0) < 0) goto fail;
            if (move) {
                if (nib && hl_put(v, (Py_ssize_t)(new >> 2), hl_nib(v, (Py_ssize_t)(new >> 2)) | nib) < 0) goto fail;
                if (nib & 8) m->pool = 1;
            } else if (!hl_any(v)) erase(m, i);
            continue;
        }
        int ow = (int)(old >> 6);
        uint64_t nib = ow < m->width ? (v[ow] >> (old & 63)) & 0xF : 0;
        if (ow < m->width) v[ow] &= ~(0xFULL << (old & 63));
        if (move) {
            v[new >> 6] |= nib << (new & 63);
            if (nib & 8) m->pool = 1;
            continue;
        }
        int any = 0;
        for (int w = 0; w < m->width; w++) if (v[w]) { any = 1; break; }
        if (!any) erase(m, i);
    }
    if (PyErr_Occurred()) goto fail;
    Py_DECREF(it);
    return rest;
fail:
    Py_DECREF(it);
    Py_DECREF(rest);
    return NULL;
}

static PyObject *U64Map_clear_nibble(U64Map *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "clear_nibble(keys, shift)"); return NULL; }
    long sh = PyLong_AsLong(args[1]);
    if (sh == -1 && PyErr_Occurred()) return NULL;
    return nibble_op(m, args[0], sh, 0, 0);
}

static PyObject *U64Map_move_nibble(U64Map *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "move_nibble(keys, old, new)"); return NULL; }
    long old = PyLong_AsLong(args[1]);
    if (old == -1 && PyErr_Occurred()) return NULL;
    long new = PyLong_AsLong(args[2]);
    if (new == -1 && PyErr_Occurred()) return NULL;
    return nibble_op(m, args[0], old, new, 1);
}

/* ---------------------------------------------------------------- restore (nodes.load) */

/* A dump's content key: 1 when `o` is an exact int in [0, 2^64) (`type(key) is int`: no bools or
 * subclasses), *k set; 0 when the entry is skipped. */
static inline int dump_key(PyObject *o, uint64_t *k) {
    if (!PyLong_CheckExact(o)) return 0;
    if (int_u64(o, k)) return 1;
    *k = 0;
    return int_sign(o) == 0; /* 0 is a key (the side dict's); negative or >= 2^64 is not */
}

/* One store's (ext, hashes, keys, pos) when the C loop takes it: a U64Map, exact lists of one length
 * whose hashes are exact ints or bytes (so no map write can fail on a key type or run Python code),
 * a bit position in range. 1 taken, 0 not (the Python loop judges it), -1 error. */
static int load_args(PyObject *st, U64Map **ext, PyObject **hs, PyObject **ks, int *pos) {
    if (!PyTuple_CheckExact(st) || PyTuple_GET_SIZE(st) != 4 || !PyObject_TypeCheck(PyTuple_GET_ITEM(st, 0), &U64MapType))
        return 0;
    *ext = (U64Map *)PyTuple_GET_ITEM(st, 0);
    *hs = PyTuple_GET_ITEM(st, 1);
    *ks = PyTuple_GET_ITEM(st, 2);
    if (!PyList_CheckExact(*hs) || !PyList_CheckExact(*ks) || PyList_GET_SIZE(*hs) != PyList_GET_SIZE(*ks)) return 0;
    PyObject *po = PyTuple_GET_ITEM(st, 3);
    if (!PyLong_CheckExact(po)) return 0;
    long p = PyLong_AsLong(po);
    if (p == -1 && PyErr_Occurred()) return -1;
    if (p < 0 || p >= 4 * MAX_SLOT) return 0;
    *pos = (int)p;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(*hs); i++) {
        PyObject *h = PyList_GET_ITEM(*hs, i);
        if (!PyLong_CheckExact(h) && !PyBytes_CheckExact(h)) return 0;
    }
    return 1;
}

/* Random probes dominate a load: the slot of the key LOAD_AHEAD entries on is fetched meanwhile. */
#ifndef LOAD_AHEAD
#define LOAD_AHEAD 8
#endif
#ifndef LOAD_KEYS_FIRST
#define LOAD_KEYS_FIRST 16 /* words (256 worker slots); bench/bench_restore.py */
#endif
static inline void load_prefetch(const U64Map *nodes, PyObject *keys, Py_ssize_t j) {
    uint64_t k;
    if (LOAD_AHEAD && j < PyList_GET_SIZE(keys) && dump_key(PyList_GET_ITEM(keys, j), &k)) pf_slot(nodes, k);
}

/* nodes.load(stores) -> int | None
 * Twin of indexer/core/dump.py `put_entries` over a list of stores (ext, hashes, keys, pos), in
 * order: each pair whose key is a u64 maps the hash to it in `ext` and sets residency bit `pos` of
 * its node. Returns the pairs loaded; None (nothing touched) when a store is not one `load_args`
 * takes. Why: restore ran that loop per entry over Python ints as wide as the fleet, and each new
 * word of slots re-laid the whole table (43 s for 320k entries at 10k workers, docs/scaling.md).
 * Here the keys go in first at the table's current width, the table is re-laid once at the width
 * the loaded bits need (the width and capacity the Python loop ends with), then the bits are set. */
static PyObject *U64Map_load(U64Map *nodes, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "load(stores: list[tuple[U64Map, list, list, int]])");
        return NULL;
    }
    PyObject *stores = args[0];
    U64Map *ext;
    PyObject *hs, *ks;
    int pos, words = 0;
    for (Py_ssize_t s = 0; s < PyList_GET_SIZE(stores); s++) {
        int r = load_args(PyList_GET_ITEM(stores, s), &ext, &hs, &ks, &pos);
        if (r <= 0) { if (r < 0) return NULL; Py_RETURN_NONE; }
    }
    /* the width the loaded bits need: each store's position, if one of its keys goes in the table */
    for (Py_ssize_t s = 0; s < PyList_GET_SIZE(stores); s++) {
        load_args(PyList_GET_ITEM(stores, s), &ext, &hs, &ks, &pos);
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ks) && (pos >> 6) + 1 > words; i++) {
            uint64_t k;
            if (dump_key(PyList_GET_ITEM(ks, i), &k) && k) words = (pos >> 6) + 1; /* key 0: side dict */
        }
    }
    /* A wide table goes in keys first, while it is narrow (growth moves 1 + width words a slot),
     * then is re-laid once; a narrow one is laid out at its width at once (a second pass of random
     * probes costs more than its growth moves). */
    if (words > LOAD_KEYS_FIRST)
        for (Py_ssize_t s = 0; s < PyList_GET_SIZE(stores); s++) {
            load_args(PyList_GET_ITEM(stores, s), &ext, &hs, &ks, &pos);
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ks); i++) {
                uint64_t k;
                load_prefetch(nodes, ks, i + LOAD_AHEAD);
                if (!dump_key(PyList_GET_ITEM(ks, i), &k) || !k) continue;
                int f;
                if (find_or_insert(nodes, k, &f) < 0) return NULL;
            }
        }
    if (widen(nodes, words) < 0) return NULL;
    Py_ssize_t loaded = 0;
    for (Py_ssize_t s = 0; s < PyList_GET_SIZE(stores); s++) {
        load_args(PyList_GET_ITEM(stores, s), &ext, &hs, &ks, &pos);
        if (reserve(ext, ext->used + PyList_GET_SIZE(hs)) < 0) return NULL; /* hashes in slot order */
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ks); i++) {
            uint64_t k;
            load_prefetch(nodes, ks, i + LOAD_AHEAD);
            if (!dump_key(PyList_GET_ITEM(ks, i), &k)) continue;
            if (!k) nodes->pool = 1; /* as a store into the side dict marks it (U64Map_ass) */
            if (set_u64(ext, PyList_GET_ITEM(hs, i), k) < 0 || node_bit(nodes, k, pos, 1) < 0) return NULL;
            loaded++;
        }
    }
    return PyLong_FromSsize_t(loaded);
}

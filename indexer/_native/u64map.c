/* U64Map: the dict-like open-addressing map with inline u64 keys and int values, and its type
 * object; included by kvnative.c (one translation unit) after u64map.h, which declares what it
 * shares with holders.c. */

/* ---------------------------------------------------------------- U64Map */


#define MIN_CAP 8
/* Max load LOAD_NUM/LOAD_DEN (linear probing stays short), growth 1 + 1/GROW_DIV = 1.5x: multiply-high
 * slots allow any capacity, so the step is a trade — each entry is moved ~1/(g-1) times over a table's
 * life (rehash was 36% of the apply at 1.33x), while the load right after a step is max/g (bytes per
 * entry, a target too; 2x measured ~40% faster and up to 1.6x the table bytes: docs/service.md). */
#ifndef LOAD_NUM
#define LOAD_NUM 17
#define LOAD_DEN 20
#endif
#ifndef GROW_DIV
#define GROW_DIV 2
#endif

/* Home slot: multiply-high maps the mixed key onto [0, cap) for any cap, so the table can grow by
 * 1.5x (not 2x) and average load stays higher: bytes per entry is one of the targets. */
static inline Py_ssize_t slot_of(const U64Map *m, uint64_t k) {
    return (Py_ssize_t)(((unsigned __int128)(k * P_MUL) * (uint64_t)m->cap) >> 64);
}


/* Big tables get their own mapping: freed tables go back to the OS at once (no heap fragments
 * inflating RSS), and huge pages cut TLB misses on random probes. */
#define BIG_TABLE ((size_t)1 << 21)
static inline size_t big_len(size_t bytes) { return (bytes + BIG_TABLE - 1) & ~(BIG_TABLE - 1); }
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14; older kernels refuse it (EINVAL) and we touch pages */
#endif

/* Tables are written before first use. Fresh zeroed memory (calloc's new pages, a new mapping) is
 * read first by the probes, which maps the shared zero page; the first store then takes a second,
 * copy-on-write fault whose TLB flush interrupts every core running one of our threads (an IPI:
 * ~20% of the ingest thread's time, under rehash, in perf; docs/service.md). One write per page
 * up front takes a single ordinary fault. */
static uint64_t *tab_alloc(Py_ssize_t cap, int width) {
    size_t bytes = (size_t)cap * (1 + width) * sizeof(uint64_t);
    if (bytes < BIG_TABLE) {
        uint64_t *t = PyMem_RawMalloc(bytes);
        if (t) memset(t, 0, bytes);
        return t;
    }
    /* Whole huge pages, aligned: a huge page is only given to an aligned 2 MB range inside the
     * mapping, so an unaligned one (or its tail) stays in 4 KB pages, and a /score walk's probes of
     * those each paid a page walk on top of the cache miss. Cost: at most 2 MB more per big table. */
    size_t len = big_len(bytes);
    char *raw = mmap(NULL, len + BIG_TABLE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    char *p = (char *)(((uintptr_t)raw + BIG_TABLE - 1) & ~(uintptr_t)(BIG_TABLE - 1));
    if (p > raw) munmap(raw, (size_t)(p - raw));
    if (raw + BIG_TABLE > p) munmap(p + len, (size_t)(raw + BIG_TABLE - p));
#ifdef MADV_HUGEPAGE
    madvise(p, len, MADV_HUGEPAGE); /* advice only: fine if refused */
#endif
    if (madvise(p, len, MADV_POPULATE_WRITE) != 0) {
        volatile char *c = p; /* zero already: a store of 0 per page only faults it in */
        for (size_t o = 0; o < len; o += 4096) c[o] = 0;
    }
    return (uint64_t *)p;
}

static void tab_free(uint64_t *t, Py_ssize_t cap, int width) {
    size_t bytes = (size_t)cap * (1 + width) * sizeof(uint64_t);
    if (bytes < BIG_TABLE) PyMem_RawFree(t);
    else munmap(t, big_len(bytes));
}

static int map_alloc(U64Map *m, Py_ssize_t cap, int width) {
    uint64_t *t = tab_alloc(cap, width);
    if (!t) { gil_need(); PyErr_NoMemory(); return -1; }
    m->tab = t; m->cap = cap; m->width = width; m->used = 0;
    return 0;
}

/* Slot of k, or the empty slot where it would go. */
static inline Py_ssize_t find(const U64Map *m, uint64_t k, int *found) {
    Py_ssize_t cap = m->cap, i = slot_of(m, k);
    for (;;) {
        uint64_t c = KEY(m, i);
        if (c == k) { *found = 1; return i; }
        if (c == 0) { *found = 0; return i; }
        if (++i == cap) i = 0;
    }
}

/* Put absent key k at empty slot i, value zeroed (a loop: width is 1-3 words, a memset call costs more). */
static inline void place_at(U64Map *m, Py_ssize_t i, uint64_t k) {
    KEY(m, i) = k;
    uint64_t *v = VALS(m, i);
    for (int w = 0; w < m->width; w++) v[w] = 0;
}

/* Memory latency dominates the map updates: the slots an event will touch are prefetched first.
 * always_inline: left to itself GCC (12, -O1 and up) kept it out of line, judged it pure (it models no
 * effect of a prefetch) and deleted every call, so no build had a prefetch instruction until this. */
static inline __attribute__((always_inline)) void pf_slot(const U64Map *m, uint64_t k) {
    if (k) __builtin_prefetch(&KEY(m, slot_of(m, k)));
}

static int rehash(U64Map *m, Py_ssize_t ncap, int width) {
    uint64_t *ot = m->tab;
    Py_ssize_t ocap = m->cap, used = m->used;
    int ow = m->width;
    if (map_alloc(m, ncap, width) < 0) return -1; /* (m untouched) */
    m->work += ocap;
    /* keys are distinct: each goes to the first empty slot from its home, no comparisons; the new
     * table is zeroed, so only the words both widths have are copied */
    int cw = ow < width ? ow : width;
    /* Homes come in (almost) ascending order (multiply-high is monotonic in the mixed key and the old
     * table is read in slot order), so a key whose home lies in [home, j] of the previous placement
     * starts probing at j + 1: every slot in between is taken (linear probing's invariant). */
    Py_ssize_t ph = ncap, pj = -1;
    for (Py_ssize_t i = 0; i < ocap; i++) {
        const uint64_t *e = ot + (size_t)i * (1 + ow);
        if (!e[0]) continue;
        Py_ssize_t h = slot_of(m, e[0]);
        Py_ssize_t in = -(Py_ssize_t)((h >= ph) & (h <= pj)); /* a mask, not a branch: either way is common */
        Py_ssize_t j = (h & ~in) | ((pj + 1) & in);
        if (j == ncap) j = 0;
        while (KEY(m, j)) if (++j == ncap) j = 0;
        if (j >= h) { ph = h; pj = j; } else ph = ncap; /* wrapped: no run to reuse */
        KEY(m, j) = e[0];
        uint64_t *v = VALS(m, j);
        if (cw == 1) v[0] = e[1]; /* the common widths, without a loop */
        else if (cw == 2) { v[0] = e[1]; v[1] = e[2]; }
        else for (int w = 0; w < cw; w++) v[w] = e[1 + w];
    }
    m->used = used;
    tab_free(ot, ocap, ow);
    return 0;
}

/* The capacity a full table grows to: one step of 1 + 1/GROW_DIV, or FAST_STEPS of them at once while
 * the table has FAST_FROM to FAST_TO slots. Every worker map and group map starts at MIN_CAP, and the
 * entries moved by the steps of a table's growth were most of a fresh index's rehash work (9-12% of
 * a hybrid stream's apply). Two steps at once (x2.25) move about half as many; a table that stops
 * growing right after a jump has at most 1.5x the room single steps leave it (7,749 slots at most),
 * and past FAST_TO the capacities are exactly those of single steps (large tables' bytes per entry
 * do not change). Four at once moved fewer still but left up to ~5x the room (17,434 slots). */
#ifndef FAST_FROM
#define FAST_FROM 128
#define FAST_TO 4096
#endif
#ifndef FAST_STEPS
#define FAST_STEPS 2
#endif
static inline Py_ssize_t grown_cap(Py_ssize_t cap) {
    int steps = cap >= FAST_FROM && cap < FAST_TO ? FAST_STEPS : 1;
    while (steps--) cap += cap / GROW_DIV;
    return cap;
}

/* A sparse map (U64Map.sparse) is kept a third full while it is small; from SPARSE_UNTIL slots on, two
 * thirds: a big one holds many blocks (a group whose blocks stay resident), and its bytes should follow
 * them (at a third full a sliding-window or Mamba group's tables took 2.5x the main tree's bytes per
 * entry), while a probe's miss still walks ~5 slots, not the default load's ~20. */
#ifndef SPARSE_UNTIL
#define SPARSE_UNTIL 4096
#endif

/* n entries in cap slots exceed the map's load. */
static inline int over_load(const U64Map *m, Py_ssize_t n, Py_ssize_t cap) {
    if (m->load_num * 3 == m->load_den && cap >= SPARSE_UNTIL) return n * 3 > cap * 2;
    return n * m->load_den > cap * m->load_num;
}

/* Insert absent key k whose empty slot `find` gave as i (value zero); the slot it ends at (the table
 * may grow first). -1 on memory error. Lets a caller probe once for "get, else compute and insert". */
static Py_ssize_t insert_at(U64Map *m, Py_ssize_t i, uint64_t k) {
    if (over_load(m, m->used + 1, m->cap)) {
        int f;
        if (rehash(m, grown_cap(m->cap), m->width) < 0) return -1;
        i = find(m, k, &f);
    }
    place_at(m, i, k);
    m->used++;
    return i;
}

/* Grow the table now to the capacity `n` entries would grow it to one insert at a time. Keys that
 * come in the order of their home slots (a dump lists a worker's blocks in its map's slot order)
 * would otherwise all land in the first part of a smaller table: one long run, probed per insert. */
static int reserve(U64Map *m, Py_ssize_t n) {
    Py_ssize_t cap = m->cap;
    while (over_load(m, n, cap)) cap = grown_cap(cap);
    return cap == m->cap ? 0 : rehash(m, cap, m->width);
}

/* Slot for k, inserting it (value zero) when absent. -1 on memory error. */
static Py_ssize_t find_or_insert(U64Map *m, uint64_t k, int *found) {
    Py_ssize_t i = find(m, k, found);
    return *found ? i : insert_at(m, i, k);
}

/* Backward-shift delete (linear probing without tombstones). */
static void erase(U64Map *m, Py_ssize_t i) {
    Py_ssize_t cap = m->cap, j = i;
    int w = m->width;
    if (m->hl) hl_release(VALS(m, i));
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

/* An int (subclasses too: reading one runs no Python code) in [1, 2^64) as u64: 1, else 0. Public API
 * only (no _PyLong_Sign): the overflow flag gives the sign of ints beyond long long. */
static inline int int_u64(PyObject *o, uint64_t *k) {
    int ovf = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &ovf);
    if (!ovf) { if (v <= 0) { if (v == -1) PyErr_Clear(); return 0; } *k = (uint64_t)v; return 1; }
    if (ovf < 0) return 0;
    uint64_t u = PyLong_AsUnsignedLongLong(o);
    if (u == (uint64_t)-1 && PyErr_Occurred()) { PyErr_Clear(); return 0; } /* >= 2^64 */
    *k = u;
    return 1;
}

/* -1, 0 or 1 for an int, without the private _PyLong_Sign. */
static inline int int_sign(PyObject *o) {
    int ovf = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &ovf);
    if (ovf) return ovf;
    if (v == -1) PyErr_Clear();
    return v > 0 ? 1 : v < 0 ? -1 : 0;
}

/* Keys are exact ints or bytes: hashing and comparing those never runs Python code, so no lookup can
 * change a map (or anything else) under a walk in progress. 1: native key, 0: side-dict key, -1: error. */
static inline int key_u64(PyObject *o, uint64_t *k) {
    if (PyLong_CheckExact(o)) return int_u64(o, k);
    if (PyBytes_CheckExact(o)) return 0;
    PyErr_Format(PyExc_TypeError, "U64Map keys must be int or bytes, not %.100s", Py_TYPE(o)->tp_name);
    return -1;
}

/* int.from_bytes / int.to_bytes / int.bit_length (unbound, so an int subclass cannot override them):
 * the public way to move values wider than 64 bits in and out. Set at module init. */
static PyObject *INT_FROM_BYTES, *INT_TO_BYTES, *INT_BIT_LENGTH, *STR_LITTLE;

static PyObject *val_obj(U64Map *m, Py_ssize_t i) {
    const uint64_t *v = VALS(m, i);
    if (m->hl) { /* the same int as the dense form */
        Py_ssize_t words = hl_need_words(v);
        m->work += words;
        if (words <= 1) {
            uint64_t x;
            hl_to_dense(v, &x, 1);
            return PyLong_FromUnsignedLongLong(words ? x : 0);
        }
        uint64_t *d = PyMem_Malloc((size_t)words * 8);
        if (!d) return PyErr_NoMemory();
        hl_to_dense(v, d, words);
        PyObject *b = PyBytes_FromStringAndSize((const char *)d, 8 * words);
        PyMem_Free(d);
        if (!b) return NULL;
        PyObject *r = PyObject_CallFunctionObjArgs(INT_FROM_BYTES, b, STR_LITTLE, NULL);
        Py_DECREF(b);
        return r;
    }
    int hi = m->width;
    m->work += hi;
    while (hi > 1 && v[hi - 1] == 0) hi--;
    if (hi == 1) return PyLong_FromUnsignedLongLong(v[0]);
    PyObject *b = PyBytes_FromStringAndSize((const char *)v, 8 * (Py_ssize_t)hi);
    if (!b) return NULL;
    PyObject *r = PyObject_CallFunctionObjArgs(INT_FROM_BYTES, b, STR_LITTLE, NULL);
    Py_DECREF(b);
    return r;
}

/* Widths past LADDER_FROM words come from a fixed ladder (each step 1/LADDER_DIV wider, rounded up),
 * not the exact need: a fleet's new worker slots open one word (16 slots) at a time, and each exact
 * step re-laid the whole table — at 10k workers 625 re-lays of a table up to 663 MB, ~5 ms of CPU per
 * new worker (docs/scaling.md). On the ladder the re-lays are ~log(width) in all and the table is at
 * most 1/LADDER_DIV wider than its widest value. A fixed ladder (not "1.25x the current width") so a
 * restore, laid out once, ends at the width that growing one slot at a time reaches. */
#define LADDER_FROM 8
#define LADDER_DIV 4
static int ladder_width(int need) {
    if (need <= LADDER_FROM) return need;
    int w = LADDER_FROM;
    while (w < need) w += (w + LADDER_DIV - 1) / LADDER_DIV;
    return w < MAX_WIDTH ? w : MAX_WIDTH;
}

/* Room for values `width` words wide. A holders map past HL_DENSE words turns to holder lists
 * instead (any width from then on). */
static int widen(U64Map *m, int width) {
    if (m->hl || width <= m->width) return 0;
    if (m->holders && width > HL_DENSE) return hl_switch(m, 1, 2);
    return rehash(m, m->cap, ladder_width(width));
}

/* Store the one-word value x under inline key k (inserted when absent; the upper words zeroed). */
static inline int set_word(U64Map *m, uint64_t k, uint64_t x) {
    int f;
    Py_ssize_t i = find_or_insert(m, k, &f);
    if (i < 0) return -1;
    uint64_t *dst = VALS(m, i);
    if (x & POOL_BITS) m->pool = 1;
    if (m->hl) return hl_from_dense(dst, &x, 1);
    memset(dst, 0, sizeof(uint64_t) * m->width);
    dst[0] = x;
    return 0;
}

/* Store a non-negative int value into slot i (widening as needed; the slot index may change). */
static int set_val(U64Map *m, uint64_t k, PyObject *v) {
    if (!PyLong_Check(v)) { PyErr_SetString(PyExc_TypeError, "U64Map values must be ints"); return -1; }
    if (int_sign(v) < 0) { PyErr_SetString(PyExc_ValueError, "U64Map values must be non-negative"); return -1; }
    uint64_t x = PyLong_AsUnsignedLongLong(v);
    if (!(x == (uint64_t)-1 && PyErr_Occurred())) return set_word(m, k, x); /* the common case: one word */
    if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
    PyErr_Clear();
    PyObject *bl = PyObject_CallOneArg(INT_BIT_LENGTH, v);
    if (!bl) return -1;
    Py_ssize_t nbits = PyLong_AsSsize_t(bl);
    Py_DECREF(bl);
    if (nbits < 0) return -1;
    Py_ssize_t words = (nbits + 63) / 64; /* Py_ssize_t: never narrowed before the bound check */
    if (words > (m->holders ? HL_MAX_SLOT / 16 : MAX_WIDTH)) { /* holder lists: their own bound */
        PyErr_SetString(PyExc_OverflowError, "U64Map value wider than its bound");
        return -1;
    }
    if (widen(m, (int)words) < 0) return -1;
    Py_ssize_t nb = m->hl ? words : m->width; /* holder lists: the int's own words */
    m->work += nb;
    PyObject *b = PyObject_CallFunction(INT_TO_BYTES, "OnO", v, (Py_ssize_t)8 * nb, STR_LITTLE);
    if (!b) return -1;
    if (!PyBytes_Check(b) || PyBytes_GET_SIZE(b) != (Py_ssize_t)8 * nb) {
        Py_DECREF(b);
        PyErr_SetString(PyExc_SystemError, "int.to_bytes gave an unexpected result");
        return -1;
    }
    int f;
    Py_ssize_t i = find_or_insert(m, k, &f);
    if (i < 0) { Py_DECREF(b); return -1; }
    if (m->hl) {
        const uint64_t *d = (const uint64_t *)PyBytes_AS_STRING(b);
        for (Py_ssize_t w = 0; w < nb; w++) if (d[w] & POOL_BITS) m->pool = 1;
        int r = hl_from_dense(VALS(m, i), d, nb);
        Py_DECREF(b);
        return r;
    }
    memcpy(VALS(m, i), PyBytes_AS_STRING(b), sizeof(uint64_t) * m->width);
    Py_DECREF(b);
    for (int w = 0; w < m->width; w++) if (VALS(m, i)[w] & POOL_BITS) m->pool = 1;
    return 0;
}

static PyObject *U64Map_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    if ((args && PyTuple_GET_SIZE(args)) || (kw && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "U64Map() takes no arguments");
        return NULL;
    }
    U64Map *m = (U64Map *)type->tp_alloc(type, 0);
    if (!m) return NULL;
    m->load_num = LOAD_NUM;
    m->load_den = LOAD_DEN;
    m->other = PyDict_New();
    if (!m->other || map_alloc(m, MIN_CAP, 1) < 0) { Py_DECREF(m); return NULL; }
    return (PyObject *)m;
}

static void U64Map_dealloc(U64Map *m) {
    if (m->tab) { hl_release_all(m); tab_free(m->tab, m->cap, m->width); }
    Py_XDECREF(m->other);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static Py_ssize_t U64Map_len(U64Map *m) { return m->used + PyDict_GET_SIZE(m->other); }

/* Lookup: new reference, NULL with no error set when absent. */
static PyObject *lookup(U64Map *m, PyObject *key) {
    uint64_t k;
    int kind = key_u64(key, &k);
    if (kind < 0) return NULL;
    if (kind) {
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
    int kind = key_u64(key, &k);
    if (kind < 0) return -1;
    if (kind) {
        if (v) return set_val(m, k, v);
        int f;
        Py_ssize_t i = find(m, k, &f);
        if (!f) { PyErr_SetObject(PyExc_KeyError, key); return -1; }
        erase(m, i);
        return 0;
    }
    if (v) {
        if (!PyLong_Check(v) || int_sign(v) < 0) {
            PyErr_SetString(PyExc_TypeError, "U64Map values must be non-negative ints");
            return -1;
        }
        m->pool = 1; /* (key 0's node: rare; not worth reading the int) */
        return PyDict_SetItem(m->other, key, v);
    }
    return PyDict_DelItem(m->other, key);
}

static int U64Map_contains(U64Map *m, PyObject *key) {
    uint64_t k;
    int kind = key_u64(key, &k);
    if (kind < 0) return -1;
    if (kind) { int f; find(m, k, &f); return f; }
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
    if (m->hl) { /* the old table's blocks, then dense words again */
        U64Map old = *m;
        old.tab = ot; old.cap = ocap; old.width = ow;
        hl_release_all(&old);
        m->hl = 0;
    }
    tab_free(ot, ocap, ow);
    PyDict_Clear(m->other);
    Py_RETURN_NONE;
}

/* narrow(words=None) -> width: drop the value words no entry uses any more (residency words shrink
 * again when the workers of high slots go, docs/index-core.md). `words`: a bound the caller knows
 * (the slots still allocated): when even values that wide would keep the present width or form,
 * nothing is scanned, so a worker's removal costs its own blocks, not a pass over the table. */
static PyObject *U64Map_narrow(U64Map *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 1) { PyErr_SetString(PyExc_TypeError, "narrow(words=None)"); return NULL; }
    if (nargs && args[0] != Py_None) {
        Py_ssize_t bound = PyLong_AsSsize_t(args[0]);
        if (bound == -1 && PyErr_Occurred()) return NULL;
        if (bound < 1) bound = 1;
        if (m->hl ? bound > HL_DENSE : (bound > MAX_WIDTH || ladder_width((int)bound) >= m->width))
            return PyLong_FromLong(m->width);
    }
    int need = 1;
    if (m->hl) { /* holder lists: back to dense words when what is held fits HL_DENSE words */
        Py_ssize_t top = 1;
        for (Py_ssize_t i = 0; i < m->cap && top <= HL_DENSE; i++, m->work++)
            if (KEY(m, i)) { Py_ssize_t w = hl_need_words(VALS(m, i)); if (w > top) top = w; }
        if (top <= HL_DENSE && hl_switch(m, 0, ladder_width((int)top)) < 0) return NULL;
        return PyLong_FromLong(m->width);
    }
    for (Py_ssize_t i = 0; i < m->cap && need < m->width; i++, m->work++) {
        if (!KEY(m, i)) continue;
        const uint64_t *v = VALS(m, i);
        for (int w = m->width - 1; w >= need; w--) if (v[w]) { need = w + 1; break; }
    }
    need = ladder_width(need);
    if (need < m->width && rehash(m, m->cap, need) < 0) return NULL;
    return PyLong_FromLong(m->width);
}

static PyObject *U64Map_nbytes(U64Map *m, void *c) {
    Py_ssize_t n = sizeof(U64Map) + m->cap * (Py_ssize_t)sizeof(uint64_t) * (1 + m->width);
    if (m->hl)
        for (Py_ssize_t i = 0; i < m->cap; i++)
            if (KEY(m, i) && hl_spilled(VALS(m, i))) {
                HBlock *b = hl_block(VALS(m, i));
                n += (Py_ssize_t)sizeof(HBlock) + (b->words ? (Py_ssize_t)b->words * 8 : (Py_ssize_t)b->cap * 4);
            }
    return PyLong_FromSsize_t(n);
}
/* "dense" or "lists" (a holders map past HL_DENSE words) */
static PyObject *U64Map_form(U64Map *m, void *c) { return PyUnicode_FromString(m->hl ? "lists" : "dense"); }
static PyObject *U64Map_width(U64Map *m, void *c) { return PyLong_FromLong(m->width); }
static PyObject *U64Map_work(U64Map *m, void *c) { return PyLong_FromSsize_t(m->work); }

/* U64Map.sparse() -> a map kept at most a third full while small, two thirds from SPARSE_UNTIL slots
 * (over_load). For the maps of sliding-window and Mamba groups (indexer/core/groups.py): a window's
 * blocks come and go with every chunk, and at the default load a linear probe's miss and a
 * backward-shift delete walk ~20 slots; at 1/3, under 2 (a hybrid stream's apply ran ~2-4% faster than
 * at 1/2, bench_index.py --hybrid-only). A big table is a group whose blocks stay resident (vLLM keeps
 * freed window blocks hittable): its bytes follow them. */
static PyObject *U64Map_sparse(PyObject *cls, PyObject *u) {
    U64Map *m = (U64Map *)U64Map_new((PyTypeObject *)cls, NULL, NULL);
    if (m) { m->load_num = 1; m->load_den = 3; }
    return (PyObject *)m;
}

/* U64Map.holders() -> the map of a model's main tree (ModelState.nodes): dense words while its values
 * fit HL_DENSE words, holder lists past that (holders.c), so a node costs what its holders cost. */
static PyObject *U64Map_holders(PyObject *cls, PyObject *u) {
    U64Map *m = (U64Map *)U64Map_new((PyTypeObject *)cls, NULL, NULL);
    if (m) m->holders = 1;
    return (PyObject *)m;
}

/* node_maps.c */
static PyObject *U64Map_load(U64Map *m, PyObject *const *args, Py_ssize_t nargs);
static PyObject *U64Map_clear_nibble(U64Map *m, PyObject *const *args, Py_ssize_t nargs);
static PyObject *U64Map_move_nibble(U64Map *m, PyObject *const *args, Py_ssize_t nargs);

static PyMethodDef U64Map_methods[] = {
    {"sparse", (PyCFunction)U64Map_sparse, METH_CLASS | METH_NOARGS,
     "a map kept at most a third full while small, two thirds when big (churning group maps)"},
    {"holders", (PyCFunction)U64Map_holders, METH_CLASS | METH_NOARGS, "a main tree's map: holder lists past 128 worker slots"},
    {"get", (PyCFunction)(void (*)(void))U64Map_get, METH_FASTCALL, "get(key, default=None)"},
    {"keys", (PyCFunction)U64Map_keys, METH_NOARGS, "list of keys"},
    {"values", (PyCFunction)U64Map_values, METH_NOARGS, "list of values"},
    {"items", (PyCFunction)U64Map_items, METH_NOARGS, "list of (key, value)"},
    {"clear", (PyCFunction)U64Map_clear, METH_NOARGS, "remove everything"},
    {"narrow", (PyCFunction)(void (*)(void))U64Map_narrow, METH_FASTCALL,
     "narrow(words=None): drop unused value words (nothing scanned when values `words` wide keep the width); "
     "returns the width"},
    {"clear_nibble", (PyCFunction)(void (*)(void))U64Map_clear_nibble, METH_FASTCALL,
     "clear_nibble(keys, shift) -> keys left to the caller: one worker's nibble off those nodes (state.clear_bits)"},
    {"move_nibble", (PyCFunction)(void (*)(void))U64Map_move_nibble, METH_FASTCALL,
     "move_nibble(keys, old, new) -> keys left to the caller: one worker's nibble moved (state.move_bits)"},
    {"load", (PyCFunction)(void (*)(void))U64Map_load, METH_FASTCALL,
     "load(stores) -> entries | None: dump stores (ext, hashes, keys, pos) in one call (indexer/core/dump.py)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef U64Map_getset[] = {
    {"nbytes", (getter)U64Map_nbytes, NULL, "bytes held by the inline table (side dict excluded)", NULL},
    {"width", (getter)U64Map_width, NULL, "64-bit words per value", NULL},
    {"form", (getter)U64Map_form, NULL, "dense words or holder lists", NULL},
    {"work", (getter)U64Map_work, NULL, "slots and words visited by whole-table passes and whole values, keys of nibble ops", NULL},
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

/* Usable-prefix rows of workers with a hybrid layout (twin of indexer/core/groupscore.py), included
 * by kvnative.c. The rule, held to the pure core by the hybrid, isolation and sharded suites:
 * for a depth L every full-attention group of the worker's layout (its main tree included) holds
 * blocks [0, L), every sliding-window group the last `span` blocks before L (all of them without a
 * window), every Mamba group a state at block L - 1; L = 0 always. device = usable on the GPU alone,
 * cached = usable with any tier (the shared pool included); kv = the main tree's own match; each block
 * of the cached prefix costs the most expensive of the cheapest tiers of the groups that need it.
 *
 * hybrid_rows(main, keys|None, tokens|None, seed, block_size, groups, layouts, slots)
 *   -> (query blocks, [(dev, cached, kv, gpu, host, disk, shared), ...]), or None: the pure core judges
 *   main: a U64Map or a tuple of them (a worker-sharded index: slot s is shard s % n's worker s / n);
 *   keys: the query's chained keys (ints in [1, 2^64)), or None and the tokens hashed here from seed
 *         as score_rows hashes them;
 *   groups: [(kind 0 full / 1 sliding / 2 mamba, span or -1 for none, nodes as main: an empty dict
 *           standing for a shard without the group)];
 *   layouts: per worker a tuple of indices into groups; slots: per worker its slot.
 *   A worker whose layout is empty is a plain (full-attention only) one: its row is score_rows' (the
 *   main tree's prefix, no group) and its kv_blocks -1 (None), so a fleet mixing both kinds is hashed
 *   and walked once.
 * hybrid_rows(..., slots, weights, row_type, tier_names, worker_ids, ranks) -> (query blocks, [row_type
 *   best first]): the rows weighted, ranked and built as score_rows builds them (kv_blocks set, None for
 *   plain workers), the workers given in (worker_id, dp_rank) order; None for weights that are not
 *   finite floats. With row_type None: (query blocks, packed PRow rows as score_rows packs them, kv) with
 *   kv an int64 per worker position (-1: None), for write_answer.
 * The tables are only read, with the GIL held throughout (nothing can change them meanwhile). */

enum { HK_FULL = 0, HK_SWA = 1, HK_MAMBA = 2, H_ABSENT = 4 };

typedef struct {
    int kind;
    Py_ssize_t span;               /* -1: every block before L */
    const uint64_t **v;            /* [block * nm + shard]: that shard's value, or NULL */
    int *width;                    /* [shard]: its table's width */
    unsigned char *pool;           /* [block]: some shard's value holds a shared-pool bit */
    Py_ssize_t *run;               /* [block]: runs of equal values (every shard's, so every worker's code
                                    * is the same along one), not past the read that filled block i: a
                                    * Mamba group's the start of block i's run (its search goes down),
                                    * the others' the end (theirs go up) */
    unsigned char *rd;             /* [block >> cs]: that read done */
    U64Map **ms;                   /* [shard]: its table (NULL: the shard lacks the group) */
    const uint64_t *keys;
    Py_ssize_t nm, n;
    int cs;                        /* sliding-window and Mamba groups are read as the search needs them,
                                    * in aligned reads of 1 << cs blocks; full-attention ones at once */
} HTab;

/* Read sizes (log2 blocks): a window's search judges whole windows when they are there, a Mamba
 * group's mostly one state or a short run of misses below L. */
enum { H_SWA_CS = 5, H_MAMBA_CS = 4 };

/* The tables of `o` (a U64Map, or a tuple of them / empty dicts) into ms; 0 ok, 1 not a shape we take
 * (holder lists included: a main tree that wide is scored by the pure core, indexer/core/groupscore.py). */
static int h_tables(PyObject *o, Py_ssize_t nm, U64Map **ms) {
    if (PyObject_TypeCheck(o, &U64MapType)) {
        if (nm != 1 || ((U64Map *)o)->hl) return 1;
        ms[0] = (U64Map *)o;
        return 0;
    }
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != nm) return 1;
    for (Py_ssize_t t = 0; t < nm; t++) {
        PyObject *x = PyTuple_GET_ITEM(o, t);
        if (PyObject_TypeCheck(x, &U64MapType) && !((U64Map *)x)->hl) ms[t] = (U64Map *)x;
        else if (PyDict_CheckExact(x) && PyDict_GET_SIZE(x) == 0) ms[t] = NULL;
        else return 1;
    }
    return 0;
}

/* Block i's values equal block i - 1's in every shard (NULL or not, and every word). */
static inline int h_same(const HTab *h, Py_ssize_t i) {
    const uint64_t *const *a = h->v + i * h->nm, *const *b = a - h->nm;
    for (Py_ssize_t t = 0; t < h->nm; t++) {
        if ((a[t] == NULL) != (b[t] == NULL)) return 0;
        if (a[t] && !words_eq(a[t], b[t], h->width[t])) return 0;
    }
    return 1;
}

enum { H_WALK_SHARDS = 64 }; /* shards the main walk drops one by one (ServiceConfig allows 64) */

/* Read a table's values for blocks [from, to); with `walk`, stop at the first block no shard holds
 * (the main tree: no worker holds KV past it). Probes are prefetched PF_AHEAD keys ahead, as the
 * main walk's (score_walk.c); a table that never held a shared-pool bit is not read for one. Sets
 * the runs of the blocks read. Returns the end reached. */
static Py_ssize_t h_fill(HTab *h, Py_ssize_t from, Py_ssize_t to, int walk) {
    Py_ssize_t nm = h->nm, end = to;
    if (nm == 1 && h->ms[0]) { /* one table (no shards): the loop without the shard loop's reloads */
        const U64Map *m = h->ms[0];
        const uint64_t *keys = h->keys;
        const uint64_t **vs = h->v;
        unsigned char *pools = h->pool;
        int W = m->width, haspool = m->pool;
        for (Py_ssize_t i = from; i < to && i < from + PF_AHEAD; i++) pf_slot(m, keys[i]);
        for (Py_ssize_t i = from; i < to; i++) {
            if (i + PF_AHEAD < to) pf_slot(m, keys[i + PF_AHEAD]);
            int f, pool = 0;
            Py_ssize_t j = find(m, keys[i], &f);
            const uint64_t *v = f ? VALS(m, j) : NULL;
            if (walk && !v) { end = i; break; }
            if (v && haspool) for (int w = 0; w < W; w++) if (v[w] & POOL_BITS) pool = 1;
            vs[i] = v;
            pools[i] = (unsigned char)pool;
        }
        goto runs;
    }
    /* The main tree's walk stops reading a shard at a block it lacks where no shard holds a shared-pool
     * claim: none of its workers passes that block, so none holds KV past it — unless its table ever
     * held a shared-pool claim, which counts for every shard's workers (such a shard is read on). A
     * miss probe of a full table is its longest, and after the first blocks most shards hold none of
     * a deep query. */
    U64Map *ms[H_WALK_SHARDS];
    int skip = walk && nm <= H_WALK_SHARDS;
    if (skip) memcpy(ms, h->ms, (size_t)nm * sizeof *ms);
    U64Map *const *tabs = skip ? ms : h->ms;
    for (Py_ssize_t i = from; i < to && i < from + PF_AHEAD; i++)
        for (Py_ssize_t t = 0; t < nm; t++) if (tabs[t]) pf_slot(tabs[t], h->keys[i]);
    for (Py_ssize_t i = from; i < to; i++) {
        int pool = 0, any = 0, missed = 0;
        for (Py_ssize_t t = 0; t < nm; t++) {
            const uint64_t *v = NULL;
            U64Map *m = tabs[t];
            if (m) {
                if (i + PF_AHEAD < to) pf_slot(m, h->keys[i + PF_AHEAD]);
                int f;
                Py_ssize_t j = find(m, h->keys[i], &f);
                if (f) {
                    v = VALS(m, j);
                    any = 1;
                    if (m->pool) for (int w = 0; w < m->width; w++) if (v[w] & POOL_BITS) pool = 1;
                } else {
                    missed = 1;
                }
            }
            h->v[i * nm + t] = v;
        }
        if (walk && !any) { end = i; break; }
        h->pool[i] = (unsigned char)pool;
        if (skip && missed && !pool) /* the shards that lack block i are done */
            for (Py_ssize_t t = 0; t < nm; t++) if (ms[t] && !ms[t]->pool && !h->v[i * nm + t]) ms[t] = NULL;
    }
runs:
    if (h->kind != HK_MAMBA) { /* run ends, from the top of this read down */
        for (Py_ssize_t i = end - 1; i >= from; i--)
            h->run[i] = i + 1 < end && h_same(h, i + 1) ? h->run[i + 1] : i + 1;
    } else { /* run starts, from the bottom of this read up */
        for (Py_ssize_t i = from; i < end; i++)
            h->run[i] = i > from && h_same(h, i) ? h->run[i - 1] : i;
    }
    return end;
}

/* Read block i's aligned read of a sliding-window or Mamba group. */
static void h_read(HTab *h, Py_ssize_t i) {
    Py_ssize_t c = i >> h->cs, from = c << h->cs, to = from + ((Py_ssize_t)1 << h->cs);
    h_fill(h, from, to < h->n ? to : h->n, 0);
    h->rd[c] = 1;
}

/* A worker's place in the tables: its slot s is shard s % nm's worker l = s / nm, whose nibble is
 * word l / 16 at bit 4 * (l % 16) (divisions done once per worker, not per block). */
typedef struct { Py_ssize_t nm, t, word; int sh; } HSlot;

static inline HSlot h_slot(Py_ssize_t nm, Py_ssize_t s) {
    Py_ssize_t l = s / nm;
    HSlot q = {nm, s % nm, l >> 4, (int)(4 * (l & 15))};
    return q;
}

/* The cheapest tier (0 gpu .. 3 shared pool) of block i for the worker at q, H_ABSENT if none. */
static inline int h_code(HTab *h, const HSlot *q, Py_ssize_t i) {
    if (!h->rd[i >> h->cs]) h_read(h, i);
    const uint64_t *v = h->v[i * q->nm + q->t];
    int nib = v && q->word < h->width[q->t] ? (int)((v[q->word] >> q->sh) & 0x7) : 0;
    if (nib) return (nib & 1) ? 0 : (nib & 2) ? 1 : 2;
    return h->pool[i] ? 3 : H_ABSENT;
}

/* Largest L <= top at which every sliding-window / Mamba group of the layout validates an end with
 * tiers <= limit (groupscore._usable: each group judges each block at most once; good[] is scratch).
 * A block's code holds along its run, so a search steps a run at a time. A window is judged from
 * its bottom up: the lowest block j of [L - span, L) it lacks rules out every end in (j, j + span],
 * so L drops to j at once, and [L - span, j) is known good for the ends below (a top-down scan stops
 * at the highest such block instead: one end per probe where the window is gone below L, as after a
 * request's out-of-window removes). */
static Py_ssize_t h_usable(Py_ssize_t top, HTab *tabs, const Py_ssize_t *parts, Py_ssize_t np,
                           const HSlot *q, int limit, Py_ssize_t *good) {
    for (Py_ssize_t k = 0; k < np; k++) good[k] = top;
    Py_ssize_t L = top;
    int moved = 1;
    while (moved && L > 0) {
        moved = 0;
        for (Py_ssize_t k = 0; k < np; k++) {
            HTab *h = &tabs[parts[k]];
            if (h->kind == HK_MAMBA) {
                Py_ssize_t j = L - 1;
                while (j >= 0 && h_code(h, q, j) > limit) j = h->run[j] - 1;
                if (j + 1 < L) { L = j + 1; moved = 1; if (!L) return 0; }
                continue;
            }
            /* [g, L) is known good; [lo, g) is judged */
            Py_ssize_t lo = h->span < 0 ? 0 : (L - h->span > 0 ? L - h->span : 0);
            Py_ssize_t g = good[k] < L ? good[k] : L, j = lo;
            if (g <= lo) { good[k] = g; continue; }
            while (j < g && h_code(h, q, j) <= limit) j = h->run[j];
            good[k] = lo;
            if (j < g) { L = j; moved = 1; if (!L) return 0; }
        }
    }
    return L;
}

static PyObject *py_hybrid_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8 && nargs != 13) { PyErr_SetString(PyExc_TypeError, "hybrid_rows takes 8 or 13 positional arguments"); return NULL; }
    int built = nargs == 13; /* ranked row objects, not tuples */
    double wt[4];
    if (built) {
        PyObject *wto = args[8], *names = args[10];
        if (!PyTuple_Check(wto) || PyTuple_GET_SIZE(wto) != 4 || !PyTuple_Check(names) || PyTuple_GET_SIZE(names) != 4 ||
            !PyList_Check(args[11]) || !PyList_Check(args[12]) || PyList_GET_SIZE(args[11]) != PyList_GET_SIZE(args[7]) ||
            PyList_GET_SIZE(args[12]) != PyList_GET_SIZE(args[7]))
            Py_RETURN_NONE;
        for (int t = 0; t < 4; t++) {
            PyObject *o = PyTuple_GET_ITEM(wto, t);
            if (!PyFloat_CheckExact(o) || !isfinite(PyFloat_AS_DOUBLE(o))) Py_RETURN_NONE; /* NaN has no order */
            if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(names, t))) Py_RETURN_NONE; /* the tiers dict runs no Python code */
            wt[t] = PyFloat_AS_DOUBLE(o);
        }
    }
    PyObject *maino = args[0], *keys = args[1], *toks = args[2], *seedo = args[3], *groupso = args[5],
             *layouts = args[6], *slotso = args[7];
    Py_ssize_t bs = PyLong_CheckExact(args[4]) ? PyLong_AsSsize_t(args[4]) : -1;
    if (bs == -1 && PyErr_Occurred()) PyErr_Clear();
    if ((keys != Py_None && !PyList_Check(keys)) || (keys == Py_None && (toks == Py_None || bs <= 0 || !PyLong_Check(seedo))) ||
        !PyList_Check(groupso) || !PyList_Check(layouts) || !PyList_Check(slotso) ||
        PyList_GET_SIZE(layouts) != PyList_GET_SIZE(slotso))
        Py_RETURN_NONE;
    Py_ssize_t nm = PyTuple_Check(maino) ? PyTuple_GET_SIZE(maino) : 1;
    Py_ssize_t ng = PyList_GET_SIZE(groupso) + 1, nw = PyList_GET_SIZE(slotso); /* table 0: the main tree */
    if (nm < 1 || nm > MAX_SLOT) Py_RETURN_NONE;
    PyObject *out = NULL, *widt = NULL, *rankt = NULL;
    uint64_t *k = NULL;
    Py_ssize_t *slot = NULL, *good = NULL, *parts = NULL, *fulls = NULL, *kvs = NULL;
    WRow *wrows = NULL;
    unsigned char *tier = NULL;
    U64Map **ms = PyMem_RawCalloc((size_t)nm, sizeof(U64Map *));
    HTab *tabs = PyMem_RawCalloc((size_t)ng, sizeof(HTab));
    if (!ms || !tabs) { PyErr_NoMemory(); goto done; }
    Py_ssize_t nk = 0;
    int rc = keys != Py_None ? keys_u64(keys, &k) : tokens_keys(toks, seedo, bs, &k, &nk);
    if (rc) { if (rc > 0) { out = Py_None; Py_INCREF(out); } goto done; }
    if (keys != Py_None) nk = PyList_GET_SIZE(keys);
    if (slots_of(slotso, &slot) < 0) goto done;
    if (h_tables(maino, nm, ms)) { out = Py_None; Py_INCREF(out); goto done; }
    Py_ssize_t n = nk, cap = nk ? nk : 1; /* table 0 (the main tree) sets n: its walk's length */
    for (Py_ssize_t g = 0; g < ng; g++) {
        HTab *h = &tabs[g];
        h->v = PyMem_RawMalloc((size_t)(cap * nm) * sizeof(uint64_t *));
        h->width = PyMem_RawCalloc((size_t)nm, sizeof(int));
        h->pool = PyMem_RawMalloc((size_t)cap);
        h->run = PyMem_RawMalloc((size_t)cap * sizeof(Py_ssize_t));
        h->rd = PyMem_RawCalloc((size_t)cap, 1);
        h->ms = PyMem_RawCalloc((size_t)nm, sizeof(U64Map *));
        if (!h->v || !h->width || !h->pool || !h->run || !h->rd || !h->ms) { PyErr_NoMemory(); goto done; }
        if (g) {
            PyObject *e = PyList_GET_ITEM(groupso, g - 1);
            if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 3 || !PyLong_CheckExact(PyTuple_GET_ITEM(e, 0)) ||
                !PyLong_CheckExact(PyTuple_GET_ITEM(e, 1)) || h_tables(PyTuple_GET_ITEM(e, 2), nm, ms)) {
                out = Py_None; Py_INCREF(out); goto done;
            }
            long kind = PyLong_AsLong(PyTuple_GET_ITEM(e, 0));
            Py_ssize_t span = PyLong_AsSsize_t(PyTuple_GET_ITEM(e, 1));
            if (PyErr_Occurred()) { PyErr_Clear(); out = Py_None; Py_INCREF(out); goto done; }
            if (kind < HK_FULL || kind > HK_MAMBA || span < -1) { out = Py_None; Py_INCREF(out); goto done; }
            h->kind = (int)kind;
            h->span = span;
        } else {
            h->kind = HK_FULL;
            h->span = -1;
        }
        for (Py_ssize_t t = 0; t < nm; t++) { h->ms[t] = ms[t]; h->width[t] = ms[t] ? ms[t]->width : 0; }
        h->keys = k;
        h->nm = nm;
        if (h->kind == HK_FULL) { /* read upwards in full: the main tree's read sets n */
            Py_ssize_t got = h_fill(h, 0, n, g == 0);
            if (g == 0) n = got;
            h->cs = 0;
            memset(h->rd, 1, (size_t)cap);
        } else {
            h->cs = h->kind == HK_MAMBA ? H_MAMBA_CS : H_SWA_CS; /* read on demand */
        }
        h->n = n;
    }
    good = PyMem_RawMalloc((size_t)ng * sizeof(Py_ssize_t));
    parts = PyMem_RawMalloc((size_t)ng * sizeof(Py_ssize_t));
    fulls = PyMem_RawMalloc((size_t)ng * sizeof(Py_ssize_t));
    tier = PyMem_RawMalloc((size_t)cap);
    wrows = PyMem_RawMalloc(sizeof(WRow) * (size_t)(nw ? nw : 1));
    kvs = PyMem_RawMalloc(sizeof(Py_ssize_t) * (size_t)(nw ? nw : 1));
    PyObject *lst = PyList_New(built ? 0 : nw);
    if (!good || !parts || !fulls || !tier || !wrows || !kvs || !lst) { Py_XDECREF(lst); if (!PyErr_Occurred()) PyErr_NoMemory(); goto done; }
    for (Py_ssize_t w = 0; w < nw; w++) {
        PyObject *lay = PyList_GET_ITEM(layouts, w);
        if (!PyTuple_Check(lay)) { Py_DECREF(lst); out = Py_None; Py_INCREF(out); goto done; }
        Py_ssize_t nf = 1, np = 0;
        HSlot q = h_slot(nm, slot[w]);
        fulls[0] = 0;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(lay); j++) {
            PyObject *gi = PyTuple_GET_ITEM(lay, j);
            Py_ssize_t g = PyLong_CheckExact(gi) ? PyLong_AsSsize_t(gi) + 1 : -1;
            if (g < 1 || g >= ng || nf + np >= ng) { PyErr_Clear(); Py_DECREF(lst); out = Py_None; Py_INCREF(out); goto done; }
            if (tabs[g].kind == HK_FULL) fulls[nf++] = g;
            else parts[np++] = g;
        }
        /* every full-attention group's tier per block (the most expensive of their cheapest), the
         * full prefix, the first block not all on the GPU, and the main tree's own match */
        Py_ssize_t full = n, dev_top = -1, kv = n;
        for (Py_ssize_t i = 0, e; i < n; i = e) { /* a run of every full group at a time */
            int c = 0;
            e = n;
            for (Py_ssize_t f = 0; f < nf; f++) {
                HTab *h = &tabs[fulls[f]];
                int x = h_code(h, &q, i);
                if (x > c) c = x;
                if (h->run[i] < e) e = h->run[i];
            }
            if (c == H_ABSENT) { full = i; break; }
            if (c && dev_top < 0) dev_top = i;
            memset(tier + i, c, (size_t)(e - i));
        }
        for (Py_ssize_t i = full; i < n; i = tabs[0].run[i]) /* below full the main tree holds every block */
            if (h_code(&tabs[0], &q, i) == H_ABSENT) { kv = i; break; }
        Py_ssize_t dev = h_usable(dev_top < 0 ? full : dev_top, tabs, parts, np, &q, 0, good);
        Py_ssize_t cached = h_usable(full, tabs, parts, np, &q, 3, good);
        for (Py_ssize_t pi = 0; pi < np && cached; pi++) { /* the blocks a group needs at `cached` */
            HTab *h = &tabs[parts[pi]];
            Py_ssize_t lo = h->kind == HK_MAMBA ? cached - 1 : h->span < 0 ? 0 : (cached - h->span > 0 ? cached - h->span : 0);
            for (Py_ssize_t i = lo, e; i < cached; i = e) { /* a run at a time (Mamba: one block) */
                int x = h_code(h, &q, i);
                e = h->kind == HK_MAMBA || h->run[i] > cached ? cached : h->run[i];
                for (Py_ssize_t u = i; u < e; u++) if (x > tier[u]) tier[u] = (unsigned char)x;
            }
        }
        Py_ssize_t sp[4] = {0, 0, 0, 0}, n1 = 0, n2 = 0, n3 = 0; /* counted by compares: the loop vectorises */
        for (Py_ssize_t i = 0; i < cached; i++) { n1 += tier[i] == 1; n2 += tier[i] == 2; n3 += tier[i] == 3; }
        sp[0] = cached - n1 - n2 - n3; sp[1] = n1; sp[2] = n2; sp[3] = n3;
        if (built) {
            WRow *r = wrows + w;
            r->dev = dev; r->cach = cached;
            for (int t = 0; t < 4; t++) r->sp[t] = sp[t];
            kvs[w] = PyTuple_GET_SIZE(lay) ? kv : -1; /* a plain worker's row has no kv_blocks */
            continue;
        }
        PyObject *row = Py_BuildValue("(nnnnnnn)", dev, cached, kv, sp[0], sp[1], sp[2], sp[3]);
        if (!row) { Py_DECREF(lst); goto done; }
        PyList_SET_ITEM(lst, w, row);
    }
    if (built) { /* the row type's constructor is Python code: ids and ranks from tuples of our own */
        Py_DECREF(lst);
        widt = PyList_AsTuple(args[11]);
        rankt = widt ? PyList_AsTuple(args[12]) : NULL;
        if (!rankt) goto done;
        if (PyTuple_GET_SIZE(widt) != nw || PyTuple_GET_SIZE(rankt) != nw) { out = Py_None; Py_INCREF(out); goto done; }
        if (args[9] == Py_None) { /* packed rows and the kv column (write_answer) */
            PyObject *kvb = PyBytes_FromStringAndSize(NULL, nw * 8);
            lst = kvb ? pack_rows(wrows, nw, wt, bs) : NULL;
            if (!lst) { Py_XDECREF(kvb); goto done; }
            for (Py_ssize_t w = 0; w < nw; w++) {
                int64_t x = kvs[w];
                memcpy(PyBytes_AS_STRING(kvb) + 8 * w, &x, 8);
            }
            out = Py_BuildValue("(nNN)", nk, lst, kvb);
            goto done;
        }
        lst = build_rows(wrows, nw, widt, rankt, wt, bs, args[9], args[10], kvs);
        if (!lst) goto done;
    }
    out = Py_BuildValue("(nN)", nk, lst);
done:
    Py_XDECREF(widt);
    Py_XDECREF(rankt);
    PyMem_RawFree(wrows);
    PyMem_RawFree(kvs);
    if (tabs) for (Py_ssize_t g = 0; g < ng; g++) {
        PyMem_RawFree(tabs[g].v); PyMem_RawFree(tabs[g].width); PyMem_RawFree(tabs[g].pool); PyMem_RawFree(tabs[g].run); PyMem_RawFree(tabs[g].rd);
        PyMem_RawFree(tabs[g].ms);
    }
    PyMem_RawFree(tabs); PyMem_RawFree(ms); PyMem_RawFree(k); PyMem_RawFree(slot);
    PyMem_RawFree(good); PyMem_RawFree(parts); PyMem_RawFree(fulls); PyMem_RawFree(tier);
    return out;
}

/* The prefix walk (twin of indexer.core.scoring.walk) and the whole native score down to ranked rows
 * (score_rows); included by kvnative.c (one translation unit), after hashing.c and node_maps.c. */

/* Per-slot prefix match of chained keys (twin of indexer.core.scoring.walk). `slot[s]` are the worker
 * slots to score; fills per slot device / cached depth and the per-tier split of the cached blocks.
 * Returns 0, or -1 on memory error. */
typedef struct { Py_ssize_t dev, cach, sp[4]; } WRow;

/* The workers still in a walk are a list of row indices, not a flag per row: after the first node
 * only its holders are left (plus everyone while a shared-pool bit holds them in), so each later
 * node costs what its holders cost, not the fleet's width. `ad` / `ct` per row: still on device,
 * current tier. */
typedef struct { Py_ssize_t *live, n; unsigned char *ad, *ct; } Alive;

static int alive_init(Alive *a, Py_ssize_t ns) {
    a->live = PyMem_RawMalloc(sizeof(Py_ssize_t) * (size_t)(ns ? ns : 1));
    a->ad = PyMem_RawMalloc((size_t)(ns ? ns : 1) * 2);
    if (!a->live || !a->ad) { PyMem_RawFree(a->live); PyMem_RawFree(a->ad); PyErr_NoMemory(); return -1; }
    a->ct = a->ad + ns;
    for (Py_ssize_t s = 0; s < ns; s++) { a->live[s] = s; a->ad[s] = 1; a->ct[s] = 0; }
    a->n = ns;
    return 0;
}

static void alive_free(Alive *a) { PyMem_RawFree(a->live); PyMem_RawFree(a->ad); }

/* A run of equal nodes ends: its length counts for the workers still in the walk. */
static inline void add_run(WRow *rows, const Alive *a, Py_ssize_t run) {
    if (run) for (Py_ssize_t i = 0; i < a->n; i++) { Py_ssize_t s = a->live[i]; rows[s].sp[a->ct[s]] += run; }
}

/* A worker meets a node where its nibble is `nib` (pool: some worker holds the node in the shared
 * pool): 0 when it leaves the walk (cached prefix ends at `depth`). */
static inline int meet(WRow *r, Alive *a, Py_ssize_t s, int nib, int pool, Py_ssize_t depth) {
    if (a->ad[s] && !(nib & 1)) { r->dev = depth; a->ad[s] = 0; }
    if (!(nib & 7) && !pool) { r->cach = depth; return 0; }
    a->ct[s] = (nib & 1) ? 0 : (nib & 2) ? 1 : (nib & 4) ? 2 : 3;
    return 1;
}

/* The end of a walk: the last run counted for the workers still in it, whose depths it reached
 * (a worker still on device is still cached: it leaves both at once). */
static inline void finish_rows(WRow *rows, const Alive *a, Py_ssize_t run, Py_ssize_t depth) {
    add_run(rows, a, run);
    depth += run;
    for (Py_ssize_t i = 0; i < a->n; i++) {
        Py_ssize_t s = a->live[i];
        if (a->ad[s]) rows[s].dev = depth;
        rows[s].cach = depth;
    }
}

/* Equal residency values (a run goes on): inline for the common widths, a libc memcmp call per key
 * was ~13% of a hot 8k walk. */
static inline int words_eq(const uint64_t *a, const uint64_t *b, int w) {
    if (w == 1) return a[0] == b[0];
    if (w == 2) return a[0] == b[0] && a[1] == b[1];
    return memcmp(a, b, sizeof(uint64_t) * (size_t)w) == 0;
}

/* A slot's nibble and the shared-pool test of value v, either form. (Holder lists compare as their
 * two words: equal inline values are equal, two blocks only when they are one; a run split there
 * only costs one more step, the rows are the same.) */
static inline int val_nib(const U64Map *m, const uint64_t *v, Py_ssize_t slot) {
    if (m->hl) return hl_nib(v, slot);
    Py_ssize_t word = slot >> 4;
    return word < m->width ? (int)((v[word] >> (4 * (slot & 15))) & 0xF) : 0;
}
static inline int val_pool(const U64Map *m, const uint64_t *v) {
    if (m->hl) return hl_pool(v);
    for (int w = 0; w < m->width; w++) if (v[w] & POOL_BITS) return 1;
    return 0;
}

/* Probes of a deep walk are random cache misses (and, in 4 KB pages, page walks): the slots of the
 * next PF_AHEAD keys are requested ahead so that their misses overlap; the first PF_AHEAD before the
 * walk starts. Cold-cache A/B of a 512-block walk in process (docs/index-core.md): 4 ahead ~30 µs,
 * 16 ~25 µs, 24 ~23 µs, 32 ~30 µs, none ~48 µs; prefetching all 512 up front costs a query that
 * ends at its first block (~10 µs at 8k). */
enum { PF_AHEAD = 16 };

static int walk_core(U64Map *m, const uint64_t *keys, Py_ssize_t nk, const Py_ssize_t *slot, Py_ssize_t ns, WRow *rows) {
    Alive a;
    uint64_t *prev = PyMem_RawCalloc((size_t)m->width, sizeof(uint64_t));
    if (!prev) { PyErr_NoMemory(); return -1; }
    if (alive_init(&a, ns) < 0) { PyMem_RawFree(prev); return -1; }
    memset(rows, 0, sizeof(WRow) * (size_t)ns);
    Py_ssize_t depth = 0, run = 0;
    int W = m->width, have_prev = 0;
    for (Py_ssize_t j = 0; j < nk && j < PF_AHEAD; j++) pf_slot(m, keys[j]);
    for (Py_ssize_t j = 0; j < nk && a.n; j++) {
        if (j + PF_AHEAD < nk) pf_slot(m, keys[j + PF_AHEAD]);
        uint64_t k = keys[j];
        int f = 0;
        Py_ssize_t i = k ? find(m, k, &f) : 0;
        if (!f) break; /* callers never pass key 0 (it lives in the side dict): Python walks those */
        const uint64_t *v = VALS(m, i);
        if (have_prev && words_eq(v, prev, W)) { run++; continue; }
        add_run(rows, &a, run);
        depth += run;
        int pool = val_pool(m, v);
        Py_ssize_t kept = 0;
        for (Py_ssize_t x = 0; x < a.n; x++) {
            Py_ssize_t s = a.live[x];
            int nib = val_nib(m, v, slot[s]);
            if (meet(rows + s, &a, s, nib, pool, depth)) a.live[kept++] = s;
        }
        a.n = kept;
        memcpy(prev, v, sizeof(uint64_t) * W);
        have_prev = 1;
        run = 1;
    }
    finish_rows(rows, &a, run, depth);
    alive_free(&a);
    PyMem_RawFree(prev);
    return 0;
}

/* A list of ints as u64 keys; 1 when a key is not an int in [1, 2^64) (the Python walk judges it). */
/* walk_core over the node tables of a worker-sharded index (indexer/sharded.py). Shard t of nm numbers
 * its workers 0, 1, ... in its own table; the walk's slot s stands for shard s % nm's worker s / nm.
 * A key's residency for the walk is every shard's value for it (missing: all zero), a worker's nibble
 * read from its own shard's, the shared pool any shard's claim — the one-index walk over the same
 * residency. Kept apart from walk_core so the one-table walk stays as it is. */
static int walk_multi(U64Map *const *ms, Py_ssize_t nm, const uint64_t *keys, Py_ssize_t nk, const Py_ssize_t *slot,
                      Py_ssize_t ns, WRow *rows) {
    int W = 1;
    for (Py_ssize_t t = 0; t < nm; t++) if (ms[t]->width > W) W = ms[t]->width;
    Alive a;
    if (alive_init(&a, ns) < 0) return -1;
    /* per shard: this key's value (or NULL) and the previous run's (copied, found flag in pf) */
    const uint64_t **cur = PyMem_RawCalloc((size_t)nm, sizeof(uint64_t *));
    uint64_t *prev = PyMem_RawCalloc((size_t)(nm * W), sizeof(uint64_t));
    unsigned char *pf = PyMem_RawCalloc((size_t)nm, 1);
    /* A shard none of whose scored workers is still in the walk, and whose table never held a pool
     * bit, cannot change the outcome for the rest (a key only it holds ends the walk for them either
     * way): it is not probed. For one worker's document that is about one probe per key. */
    Py_ssize_t *talive = PyMem_RawCalloc((size_t)nm, sizeof(Py_ssize_t));
    if (!cur || !prev || !pf || !talive) {
        alive_free(&a); PyMem_RawFree(cur); PyMem_RawFree(prev); PyMem_RawFree(pf); PyMem_RawFree(talive);
        PyErr_NoMemory();
        return -1;
    }
    memset(rows, 0, sizeof(WRow) * (size_t)ns);
    for (Py_ssize_t s = 0; s < ns; s++) talive[slot[s] % nm]++;
    Py_ssize_t depth = 0, run = 0;
    int have_prev = 0;
    for (Py_ssize_t j = 0; j < nk && j < PF_AHEAD; j++)
        for (Py_ssize_t t = 0; t < nm; t++) if (talive[t] || ms[t]->pool) pf_slot(ms[t], keys[j]);
    for (Py_ssize_t j = 0; j < nk && a.n; j++) {
        if (j + PF_AHEAD < nk)
            for (Py_ssize_t t = 0; t < nm; t++) if (talive[t] || ms[t]->pool) pf_slot(ms[t], keys[j + PF_AHEAD]);
        uint64_t k = keys[j];
        int any = 0;
        for (Py_ssize_t t = 0; t < nm; t++) {
            cur[t] = NULL;
            if (!k || (!talive[t] && !ms[t]->pool)) continue;
            int f = 0;
            Py_ssize_t i = find(ms[t], k, &f);
            if (f) { cur[t] = VALS(ms[t], i); any = 1; }
        }
        if (!any) break; /* no shard holds it (callers never pass key 0: Python walks those) */
        int same = have_prev;
        for (Py_ssize_t t = 0; t < nm && same; t++) {
            if ((cur[t] != NULL) != pf[t]) { same = 0; break; }
            if (cur[t]) same = words_eq(cur[t], prev + t * W, ms[t]->width);
        }
        if (same) { run++; continue; }
        add_run(rows, &a, run);
        depth += run;
        int pool = 0;
        for (Py_ssize_t t = 0; t < nm && !pool; t++) if (cur[t]) pool = val_pool(ms[t], cur[t]);
        Py_ssize_t kept = 0;
        for (Py_ssize_t x = 0; x < a.n; x++) {
            Py_ssize_t s = a.live[x], t = slot[s] % nm, l = slot[s] / nm;
            int nib = cur[t] ? val_nib(ms[t], cur[t], l) : 0;
            if (meet(rows + s, &a, s, nib, pool, depth)) a.live[kept++] = s;
            else talive[t]--;
        }
        a.n = kept;
        for (Py_ssize_t t = 0; t < nm; t++) {
            pf[t] = cur[t] != NULL;
            if (cur[t]) memcpy(prev + t * W, cur[t], sizeof(uint64_t) * (size_t)ms[t]->width);
        }
        have_prev = 1;
        run = 1;
    }
    finish_rows(rows, &a, run, depth);
    alive_free(&a); PyMem_RawFree(cur); PyMem_RawFree(prev); PyMem_RawFree(pf); PyMem_RawFree(talive);
    return 0;
}

static int keys_u64(PyObject *keys, uint64_t **out) {
    Py_ssize_t nk = PyList_GET_SIZE(keys);
    uint64_t *k = PyMem_RawMalloc((size_t)(nk ? nk : 1) * sizeof(uint64_t));
    if (!k) { PyErr_NoMemory(); return -1; }
    for (Py_ssize_t j = 0; j < nk; j++) {
        PyObject *o = PyList_GET_ITEM(keys, j);
        /* not an int in [1, 2^64) (0 lives in the side dict): the Python walk judges it */
        if (!PyLong_Check(o) || !int_u64(o, &k[j])) { PyMem_RawFree(k); return 1; }
    }
    *out = k;
    return 0;
}

static int slots_of(PyObject *slotso, Py_ssize_t **out) {
    Py_ssize_t ns = PyList_GET_SIZE(slotso);
    Py_ssize_t *slot = PyMem_RawMalloc((size_t)(ns ? ns : 1) * sizeof(Py_ssize_t));
    if (!slot) { PyErr_NoMemory(); return -1; }
    for (Py_ssize_t s = 0; s < ns; s++) {
        PyObject *o = PyList_GET_ITEM(slotso, s);
        /* ints only: __index__ of anything else could run Python code and change the list */
        slot[s] = PyLong_Check(o) ? PyLong_AsSsize_t(o) : -1;
        /* (every read of a slot's nibble is bounded by its table's width: dense words end at MAX_SLOT,
         * holder lists at HL_MAX_SLOT) */
        if (slot[s] < 0 || slot[s] >= HL_MAX_SLOT) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad slot");
            PyMem_RawFree(slot);
            return -1;
        }
    }
    *out = slot;
    return 0;
}

/* Ranked result rows: score like scoring.score_keys, sort best first by (-score, -cached, rank) where
 * rank = position in the caller's (worker_id, dp_rank)-sorted list, and build the WorkerScore objects. */
typedef struct { double score; Py_ssize_t idx; } Ranked;

static int ranked_cmp(const void *a, const void *b) {
    const Ranked *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx; /* cached desc is folded into idx order below */
}

/* idx sorts by (-cached, rank): cached <= query blocks, so one integer key holds both.
 * Only rows with a block are sorted: the rows with none (most of a wide fleet's, for any one query)
 * share one score and cached 0, so they stand in idx order already (ascending s) and are merged in
 * after. The order is the full sort's (idx is unique: the comparison is a total order). */
static inline int zero_row(const WRow *w) {
    return !(w->cach | w->dev | w->sp[0] | w->sp[1] | w->sp[2] | w->sp[3]);
}

static void rank_rows(const WRow *rows, Py_ssize_t ns, const double *wt, Py_ssize_t bs, Ranked *rk) {
    Py_ssize_t maxc = 0, na = 0;
    for (Py_ssize_t s = 0; s < ns; s++) if (rows[s].cach > maxc) maxc = rows[s].cach;
    for (Py_ssize_t s = 0; s < ns; s++) {
        if (zero_row(rows + s)) continue;
        const Py_ssize_t *sp = rows[s].sp;
        double x = (double)sp[0] * wt[0] + (double)sp[1] * wt[1] + (double)sp[2] * wt[2] + (double)sp[3] * wt[3];
        rk[na].score = (double)bs * x;
        rk[na++].idx = (maxc - rows[s].cach) * ns + s;
    }
    qsort(rk, (size_t)na, sizeof(Ranked), ranked_cmp);
    /* the same expression as a row's with every count 0: 0.0, or -0.0 when every weight is negative */
    const Py_ssize_t z0 = 0;
    Ranked z = {(double)bs * ((double)z0 * wt[0] + (double)z0 * wt[1] + (double)z0 * wt[2] + (double)z0 * wt[3]), 0};
    /* merge from the back, in place: the sorted rows end at ns - 1, zero rows come by descending s */
    Py_ssize_t i = na - 1, s = ns - 1, o = ns - 1;
    for (; o > i; o--) {
        while (!zero_row(rows + s)) s--; /* o > i: a zero row is left */
        z.idx = maxc * ns + s;
        if (i >= 0 && ranked_cmp(&rk[i], &z) > 0) rk[o] = rk[i--];
        else { rk[o] = z; s--; }
    }
}

/* The ranked rows as `cls` objects; with `kv` (hybrid rows) each also gets its kv_blocks (None where < 0). */
static PyObject *build_rows(const WRow *rows, Py_ssize_t ns, PyObject *wids, PyObject *ranks, const double *wt,
                            Py_ssize_t bs, PyObject *cls, PyObject *names, const Py_ssize_t *kv) {
    Ranked *rk = PyMem_RawMalloc(sizeof(Ranked) * (size_t)(ns ? ns : 1));
    if (!rk) return PyErr_NoMemory();
    rank_rows(rows, ns, wt, bs, rk);
    PyObject *out = PyList_New(ns);
    if (!out) { PyMem_RawFree(rk); return NULL; }
    for (Py_ssize_t r = 0; r < ns; r++) {
        Py_ssize_t s = rk[r].idx % ns;
        const WRow *w = rows + s;
        PyObject *tiers = PyDict_New(), *args[7] = {NULL};
        if (!tiers) goto fail;
        for (int t = 0; t < 4; t++) {
            PyObject *v = PyLong_FromSsize_t(w->sp[t]);
            if (!v || PyDict_SetItem(tiers, PyTuple_GET_ITEM(names, t), v) < 0) { Py_XDECREF(v); Py_DECREF(tiers); goto fail; }
            Py_DECREF(v);
        }
        args[0] = PyTuple_GET_ITEM(wids, s); /* our own tuples: the constructor cannot change them */
        args[1] = PyTuple_GET_ITEM(ranks, s);
        args[2] = PyLong_FromSsize_t(w->dev);
        args[3] = PyLong_FromSsize_t(w->cach);
        args[4] = tiers;
        args[5] = PyFloat_FromDouble(rk[r].score);
        if (kv) args[6] = kv[s] >= 0 ? PyLong_FromSsize_t(kv[s]) : Py_NewRef(Py_None); /* < 0: a plain worker's */
        PyObject *o = (args[2] && args[3] && args[5] && (!kv || args[6])) ? PyObject_Vectorcall(cls, args, kv ? 7 : 6, NULL) : NULL;
        Py_XDECREF(args[2]); Py_XDECREF(args[3]); Py_XDECREF(args[5]); Py_XDECREF(args[6]); Py_DECREF(tiers);
        if (!o) goto fail;
        PyList_SET_ITEM(out, r, o);
    }
    PyMem_RawFree(rk);
    return out;
fail:
    PyMem_RawFree(rk);
    Py_DECREF(out);
    return NULL;
}

/* The ranked rows as packed PRow records (best first), read by write_answer. */
typedef struct { int64_t s, dev, cach, sp[4]; double score; } PRow;

static PyObject *pack_rows(const WRow *rows, Py_ssize_t ns, const double *wt, Py_ssize_t bs) {
    Ranked *rk = PyMem_RawMalloc(sizeof(Ranked) * (size_t)(ns ? ns : 1));
    if (!rk) return PyErr_NoMemory();
    rank_rows(rows, ns, wt, bs, rk);
    PyObject *out = PyBytes_FromStringAndSize(NULL, ns * (Py_ssize_t)sizeof(PRow));
    if (out) {
        PRow *o = (PRow *)PyBytes_AS_STRING(out);
        for (Py_ssize_t r = 0; r < ns; r++) {
            Py_ssize_t s = rk[r].idx % ns;
            const WRow *w = rows + s;
            PRow p = {s, w->dev, w->cach, {w->sp[0], w->sp[1], w->sp[2], w->sp[3]}, rk[r].score};
            memcpy(o + r, &p, sizeof p);
        }
    }
    PyMem_RawFree(rk);
    return out;
}


/* score_rows(nodes, keys|None, tokens|None, seed, block_size, slots, wids, ranks, weights, WorkerScore|None, names)
 *   -> (query_blocks, [WorkerScore best first]) | (query_blocks, packed rows: bytes) | None
 * With row type None the ranked rows come back packed (PRow, best first) for write_answer: no object per row.
 * The whole native score: chained keys (from `keys`, or hashed from `tokens` without extra keys), the
 * walk, weights, ranking and result objects. Lists are in (worker_id, dp_rank) order. None: odd input
 * (the Python path judges it). */
static PyObject *py_score_rows(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"nodes", "keys", "tokens", "seed", "block_size", "slots", "worker_ids", "ranks",
                             "weights", "row_type", "tier_names", NULL};
    U64Map *m = NULL;
    PyObject *nodeso, *keys, *toks, *seedo, *slotso, *wids, *ranks, *wto, *cls, *names;
    Py_ssize_t bs;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOnO!O!O!O!OO!", kwlist, &nodeso, &keys, &toks, &seedo, &bs,
                                     &PyList_Type, &slotso, &PyList_Type, &wids, &PyList_Type, &ranks, &PyTuple_Type,
                                     &wto, &cls, &PyTuple_Type, &names))
        return NULL;
    /* nodes: one U64Map, or a tuple of them: the shards of a worker-sharded index (indexer/sharded.py),
     * slot s then standing for shard s % n's worker s / n (walk_multi) */
    U64Map *const *ms = NULL;
    Py_ssize_t nm = 1;
    if (PyObject_TypeCheck(nodeso, &U64MapType)) m = (U64Map *)nodeso;
    else if (PyTuple_Check(nodeso) && PyTuple_GET_SIZE(nodeso) > 0) {
        nm = PyTuple_GET_SIZE(nodeso);
        for (Py_ssize_t t = 0; t < nm; t++)
            if (!PyObject_TypeCheck(PyTuple_GET_ITEM(nodeso, t), &U64MapType)) {
                PyErr_SetString(PyExc_TypeError, "score_rows: nodes must be a U64Map or a tuple of them");
                return NULL;
            }
        ms = (U64Map *const *)&PyTuple_GET_ITEM(nodeso, 0); /* the tuple's items, kept alive by the caller */
        if (nm == 1) m = ms[0];
    } else {
        PyErr_SetString(PyExc_TypeError, "score_rows: nodes must be a U64Map or a tuple of them");
        return NULL;
    }
    Py_ssize_t ns = PyList_GET_SIZE(slotso);
    if (bs <= 0 || PyList_GET_SIZE(wids) != ns || PyList_GET_SIZE(ranks) != ns || PyTuple_GET_SIZE(wto) != 4 ||
        PyTuple_GET_SIZE(names) != 4)
        Py_RETURN_NONE;
    for (int t = 0; t < 4; t++) /* exact str keys: building the tiers dict runs no Python code */
        if (!PyUnicode_CheckExact(PyTuple_GET_ITEM(names, t))) Py_RETURN_NONE;
    double wt[4];
    for (int t = 0; t < 4; t++) {
        PyObject *o = PyTuple_GET_ITEM(wto, t);
        if (!PyFloat_CheckExact(o) || !isfinite(PyFloat_AS_DOUBLE(o))) Py_RETURN_NONE; /* NaN has no order */
        wt[t] = PyFloat_AS_DOUBLE(o);
    }
    uint64_t *k = NULL;
    Py_ssize_t nk = 0, *slot = NULL;
    WRow *rows = NULL;
    PyObject *out = NULL, *lst = NULL, *widt = NULL, *rankt = NULL;
    if (keys != Py_None) {
        if (!PyList_Check(keys)) Py_RETURN_NONE;
        int rc = keys_u64(keys, &k);
        if (rc) { if (rc > 0) { out = Py_None; Py_INCREF(out); } return out; }
        nk = PyList_GET_SIZE(keys);
    } else {
        int rc = tokens_keys(toks, seedo, bs, &k, &nk);
        if (rc) { if (rc > 0) { out = Py_None; Py_INCREF(out); } goto done; }
    }
    if (slots_of(slotso, &slot) < 0) goto done;
    rows = PyMem_RawMalloc(sizeof(WRow) * (size_t)(ns ? ns : 1));
    if (!rows) { PyErr_NoMemory(); goto done; }
    if (nk && ns) { if ((m ? walk_core(m, k, nk, slot, ns, rows) : walk_multi(ms, nm, k, nk, slot, ns, rows)) < 0) goto done; }
    else memset(rows, 0, sizeof(WRow) * (size_t)(ns ? ns : 1));
    if (cls == Py_None) { /* packed: no Python code runs, ids and ranks are not read */
        lst = pack_rows(rows, ns, wt, bs);
        if (lst) out = Py_BuildValue("(nN)", nk, lst);
        goto done;
    }
    /* the row type's constructor is Python code: the rows read ids and ranks from tuples of our own,
     * never from the caller's lists (which that code could change), and ns is checked against them */
    widt = PyList_AsTuple(wids);
    rankt = widt ? PyList_AsTuple(ranks) : NULL;
    if (!rankt) goto done;
    if (PyTuple_GET_SIZE(widt) != ns || PyTuple_GET_SIZE(rankt) != ns) { out = Py_None; Py_INCREF(out); goto done; }
    lst = build_rows(rows, ns, widt, rankt, wt, bs, cls, names, NULL);
    if (lst) out = Py_BuildValue("(nN)", nk, lst);
done:
    Py_XDECREF(widt);
    Py_XDECREF(rankt);
    PyMem_RawFree(k);
    PyMem_RawFree(slot);
    PyMem_RawFree(rows);
    return out;
}

/* ---------------------------------------------------------------- the holders' answer
 * holder_rows(nodes, tokens, seed, block_size, sidx, nidx, weights, row_type|None, tier_names, worker_ids, ranks)
 *   -> (query_blocks, packed rows | [row_type]) | None
 * score_rows over every worker of a one-table model (its (worker_id, dp_rank) order: `nidx` of them),
 * keeping only the rows that are not all zero (the workers holding some of the query's prefix), ranked
 * as score_rows ranks them: the full answer's rows filtered to holders, in the same order. The walk
 * starts from the first node's holders (not the fleet): a query costs what its holders cost.
 * `sidx`: int32 per worker slot, that worker's position in the order (-1: not scored); a slot past it
 * is not scored. Packed rows name their position (PRow.s); objects are built as score_rows builds them.
 * None (the caller takes score_rows): odd input, or a first node some worker holds in the shared pool
 * (every scored worker then stays in the walk: no holders' shortcut). */
typedef struct { WRow w; Py_ssize_t s, slot; } HRow;

typedef struct { Ranked r; Py_ssize_t x; } HRank; /* a holder row's rank key, and which row */

static int hrank_cmp(const void *a, const void *b) { /* (-score, -cached, position), as ranked_cmp */
    return ranked_cmp(&((const HRank *)a)->r, &((const HRank *)b)->r);
}

/* The walk from the first node's holders: 1 done (*out / *nout: the holder rows, owned by the caller),
 * 0 the shortcut does not serve (pool at the first node), -1 error. */
static int walk_holders(U64Map *m, const uint64_t *keys, Py_ssize_t nk, const int32_t *sidx, Py_ssize_t nsidx,
                        Py_ssize_t nidx, HRow **out, Py_ssize_t *nout) {
    *out = NULL; *nout = 0;
    if (!nk) return 1;
    int f = 0;
    Py_ssize_t i0 = keys[0] ? find(m, keys[0], &f) : 0;
    if (!f) return 1; /* nothing held: no rows (callers never pass key 0) */
    const uint64_t *v0 = VALS(m, i0);
    if (val_pool(m, v0)) return 0;
    /* the first node's holders: (slot, nibble) */
    Py_ssize_t cap = 8, n = 0;
    HRow *h = PyMem_RawMalloc(sizeof(HRow) * (size_t)cap);
    if (!h) { PyErr_NoMemory(); return -1; }
#define HADD(SLOT) do { \
        Py_ssize_t sl_ = (SLOT); \
        if (sl_ < nsidx && sidx[sl_] >= 0 && sidx[sl_] < nidx) { /* a position names a worker of the order */ \
            if (n == cap) { \
                HRow *t_ = PyMem_RawRealloc(h, sizeof(HRow) * (size_t)(cap *= 2)); \
                if (!t_) { PyMem_RawFree(h); PyErr_NoMemory(); return -1; } \
                h = t_; \
            } \
            memset(&h[n].w, 0, sizeof(WRow)); h[n].s = sidx[sl_]; h[n].slot = sl_; n++; \
        } } while (0)
    if (m->hl) {
        if (!hl_spilled(v0)) {
            const uint32_t *e = (const uint32_t *)v0;
            for (int j = 0; j < HL_INLINE; j++) if (e[j]) HADD((Py_ssize_t)(e[j] >> 4));
        } else {
            HBlock *b = hl_block(v0);
            if (b->words) {
                for (uint32_t w = 0; w < b->words; w++)
                    for (uint64_t x = b->d[w]; x; ) {
                        int t = __builtin_ctzll(x) >> 2;
                        HADD((Py_ssize_t)w * 16 + t);
                        x &= ~((uint64_t)0xF << (4 * t));
                    }
            } else {
                const uint32_t *e = hl_ents(b);
                for (uint32_t j = 0; j < b->n; j++) HADD((Py_ssize_t)(e[j] >> 4));
            }
        }
    } else {
        for (int w = 0; w < m->width; w++)
            for (uint64_t x = v0[w]; x; ) {
                int t = __builtin_ctzll(x) >> 2;
                HADD((Py_ssize_t)w * 16 + t);
                x &= ~((uint64_t)0xF << (4 * t));
            }
    }
#undef HADD
    /* walk_core over the holders (the rows and the alive list are theirs, numbered 0..n) */
    WRow *rows = PyMem_RawMalloc(sizeof(WRow) * (size_t)(n ? n : 1));
    Py_ssize_t *slot = PyMem_RawMalloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    if (!rows || !slot) { PyMem_RawFree(rows); PyMem_RawFree(slot); PyMem_RawFree(h); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t x = 0; x < n; x++) slot[x] = h[x].slot;
    int rc = n ? walk_core(m, keys, nk, slot, n, rows) : 0;
    if (rc == 0) for (Py_ssize_t x = 0; x < n; x++) h[x].w = rows[x];
    PyMem_RawFree(rows);
    PyMem_RawFree(slot);
    if (rc < 0) { PyMem_RawFree(h); return -1; }
    *out = h;
    *nout = n;
    return 1;
}

static PyObject *py_holder_rows(PyObject *self, PyObject *args) {
    PyObject *nodeso, *toks, *seedo, *wto, *cls, *names, *wids, *ranks;
    Py_ssize_t bs, nidx;
    Py_buffer sb;
    if (!PyArg_ParseTuple(args, "OOOny*nO!OO!O!O!", &nodeso, &toks, &seedo, &bs, &sb, &nidx, &PyTuple_Type, &wto,
                          &cls, &PyTuple_Type, &names, &PyList_Type, &wids, &PyList_Type, &ranks))
        return NULL;
    PyObject *out = NULL;
    uint64_t *k = NULL;
    HRow *h = NULL;
    HRank *rk = NULL;
    Py_ssize_t nk = 0, n = 0;
    double wt[4];
    int ok = PyObject_TypeCheck(nodeso, &U64MapType) && bs > 0 && nidx >= 0 && sb.len % 4 == 0 &&
             PyTuple_GET_SIZE(wto) == 4 && PyTuple_GET_SIZE(names) == 4 &&
             PyList_GET_SIZE(wids) == nidx && PyList_GET_SIZE(ranks) == nidx;
    for (int t = 0; ok && t < 4; t++) {
        PyObject *o = PyTuple_GET_ITEM(wto, t);
        ok = PyUnicode_CheckExact(PyTuple_GET_ITEM(names, t)) && PyFloat_CheckExact(o) && isfinite(PyFloat_AS_DOUBLE(o));
        if (ok) wt[t] = PyFloat_AS_DOUBLE(o);
    }
    const int32_t *sidx = sb.buf;
    Py_ssize_t nsidx = sb.len / 4;
    if (!ok) goto none;
    int rc = tokens_keys(toks, seedo, bs, &k, &nk);
    if (rc < 0) goto done;
    if (rc > 0) goto none;
    rc = walk_holders((U64Map *)nodeso, k, nk, sidx, nsidx, nidx, &h, &n);
    if (rc < 0) goto done;
    if (rc == 0) goto none;
    /* rank the rows that are not all zero, as rank_rows does (cached desc folded into idx) */
    rk = PyMem_RawMalloc(sizeof(HRank) * (size_t)(n ? n : 1));
    if (!rk) { PyErr_NoMemory(); goto done; }
    Py_ssize_t maxc = 0, na = 0, span = nidx ? nidx : 1;
    for (Py_ssize_t x = 0; x < n; x++) if (h[x].w.cach > maxc) maxc = h[x].w.cach;
    for (Py_ssize_t x = 0; x < n; x++) {
        const WRow *w = &h[x].w;
        if (zero_row(w)) continue;
        const Py_ssize_t *sp = w->sp;
        double sc = (double)sp[0] * wt[0] + (double)sp[1] * wt[1] + (double)sp[2] * wt[2] + (double)sp[3] * wt[3];
        rk[na].r.score = (double)bs * sc;
        rk[na].r.idx = (maxc - w->cach) * span + h[x].s;
        rk[na++].x = x;
    }
    qsort(rk, (size_t)na, sizeof(HRank), hrank_cmp);
    if (cls == Py_None) {
        PyObject *lst = PyBytes_FromStringAndSize(NULL, na * (Py_ssize_t)sizeof(PRow));
        if (!lst) goto done;
        PRow *o = (PRow *)PyBytes_AS_STRING(lst);
        for (Py_ssize_t r = 0; r < na; r++) {
            const HRow *x = h + rk[r].x;
            PRow p = {x->s, x->w.dev, x->w.cach, {x->w.sp[0], x->w.sp[1], x->w.sp[2], x->w.sp[3]}, rk[r].r.score};
            memcpy(o + r, &p, sizeof p);
        }
        out = Py_BuildValue("(nN)", nk, lst);
        goto done;
    }
    PyObject *lst = PyList_New(na);
    if (!lst) goto done;
    for (Py_ssize_t r = 0; r < na; r++) {
        const HRow *x = h + rk[r].x;
        const WRow *w = &x->w;
        /* ids and ranks: the caller's lists read before any Python code runs (the row type's
         * constructor may); each item held across the call */
        PyObject *wid = PyList_GET_SIZE(wids) == nidx ? Py_NewRef(PyList_GET_ITEM(wids, x->s)) : NULL;
        PyObject *rank = PyList_GET_SIZE(ranks) == nidx ? Py_NewRef(PyList_GET_ITEM(ranks, x->s)) : NULL;
        PyObject *tiers = PyDict_New(), *a[6] = {wid, rank, NULL, NULL, tiers, NULL};
        int good = wid && rank && tiers;
        for (int t = 0; good && t < 4; t++) {
            PyObject *v = PyLong_FromSsize_t(w->sp[t]);
            good = v && PyDict_SetItem(tiers, PyTuple_GET_ITEM(names, t), v) == 0;
            Py_XDECREF(v);
        }
        if (good) {
            a[2] = PyLong_FromSsize_t(w->dev);
            a[3] = PyLong_FromSsize_t(w->cach);
            a[5] = PyFloat_FromDouble(rk[r].r.score);
        }
        PyObject *o = (good && a[2] && a[3] && a[5]) ? PyObject_Vectorcall(cls, a, 6, NULL) : NULL;
        for (int t = 0; t < 6; t++) Py_XDECREF(a[t]);
        if (!o) {
            if (!PyErr_Occurred()) { Py_DECREF(lst); goto none; } /* the lists changed under us */
            Py_DECREF(lst);
            goto done;
        }
        PyList_SET_ITEM(lst, r, o);
    }
    out = Py_BuildValue("(nN)", nk, lst);
    goto done;
none:
    out = Py_NewRef(Py_None);
done:
    PyMem_RawFree(k);
    PyMem_RawFree(h);
    PyMem_RawFree(rk);
    PyBuffer_Release(&sb);
    return out;
}

/* apply_msgpack / apply_msgpack_run: whole raw batches applied to the maps (twins of indexer/core/apply.py),
 * included by kvnative.c (one translation unit) after its parts wire_walk.c (the payload reader),
 * kv_apply.c (the main tree's events) and groups_apply.c (group events of a known layout, and where
 * the walk stops for the pure core). */

/* ApplyStats keys as Python objects (tuples / str), built once at import from wire_tables.h. */
static PyObject *COUNT_KEY_OBJS, *DROP_KEY_OBJS;

static int add_count(PyObject *d, PyObject *key, Py_ssize_t n) {
    if (!n) return 0;
    PyObject *v = PyLong_FromSsize_t(n);
    if (!v) return -1;
    int r = PyDict_SetItem(d, key, v);
    Py_DECREF(v);
    return r;
}

/* The parsed events of one batch applied in order; *stop = the first orphan or group event (nothing
 * of it applied; the pure core applies the batch from there), else -1. 0, or -1 on error. */
static int walk_events(FCtx *c, const FBatch *b, Py_ssize_t *stop) {
    *stop = -1;
    for (Py_ssize_t i = 0; i < b->nev; i++) {
        const FEv *e = b->ev + i;
        const GLay *g;
        if (group_event(c, e, &g)) { /* a group the layout lacks: learnt in Python, else the pure core's */
            int l = gp_learn(c, e);
            if (l < 0) return -1;
            if (!l || group_event(c, e, &g)) { *stop = i; break; }
        }
        /* no arithmetic on NULL: an event (or a whole batch) without hashes or tokens passes NULL */
        const HRef *hs = e->nh ? b->h + e->h0 : NULL;
        const uint64_t *ds = e->nt >= c->bs ? b->dg + e->d0 : NULL; /* digests: full blocks only */
        if (!g) c->kc_n = 0; /* a main-tree event: the cached keys may be stale (a store sets them anew) */
        int r = g ? (e->type == EV_STORED ? gp_store(c, g, e, hs, ds) : gp_remove(c, g, e, hs))
              : e->type == EV_STORED ? fp_store(c, e, hs, ds)
              : e->type == EV_REMOVED ? fp_remove(c, e, hs) : fp_clear(c);
        if (r < 0) return -1;
        if (r > 0) { *stop = i; break; }
    }
    return 0;
}

/* The counters of c as ApplyStats' counts and drops dicts (zeros left out). */
static int tally_dicts(const FCtx *c, PyObject *counts, PyObject *drops) {
    for (int t = 0; t < 4; t++) {
        for (int o = 0; o < 3; o++)
            if (add_count(counts, PyTuple_GET_ITEM(COUNT_KEY_OBJS, CK_STORED(t, o)), c->stored[t][o]) < 0) return -1;
        for (int o = 0; o < 2; o++)
            if (add_count(counts, PyTuple_GET_ITEM(COUNT_KEY_OBJS, CK_REMOVED(t, o)), c->removed[t][o]) < 0) return -1;
    }
    if (add_count(counts, PyTuple_GET_ITEM(COUNT_KEY_OBJS, CK_CLEARED), c->cleared) < 0) return -1;
    for (int t = 0; t < 4; t++) {
        for (int o = 0; o < 3; o++)
            if (add_count(counts, PyTuple_GET_ITEM(COUNT_KEY_OBJS, CK_GSTORED(t, o)), c->gstored[t][o]) < 0) return -1;
        for (int o = 0; o < 2; o++)
            if (add_count(counts, PyTuple_GET_ITEM(COUNT_KEY_OBJS, CK_GREMOVED(t, o)), c->gremoved[t][o]) < 0) return -1;
    }
    for (int d = 0; d < N_DROPS; d++) if (add_count(drops, PyTuple_GET_ITEM(DROP_KEY_OBJS, d), c->drops[d]) < 0) return -1;
    return 0;
}

static void add_counters(FCtx *to, const FCtx *from) {
    for (int t = 0; t < 4; t++) {
        for (int o = 0; o < 3; o++) to->stored[t][o] += from->stored[t][o];
        for (int o = 0; o < 2; o++) to->removed[t][o] += from->removed[t][o];
        for (int o = 0; o < 3; o++) to->gstored[t][o] += from->gstored[t][o];
        for (int o = 0; o < 2; o++) to->gremoved[t][o] += from->gremoved[t][o];
    }
    to->cleared += from->cleared;
    for (int d = 0; d < N_DROPS; d++) to->drops[d] += from->drops[d];
}

/* The arrays an apply_msgpack call parses into (events, hashes, tokens) and its key cache, kept
 * between calls: a hybrid batch's token array alone grows past 4k entries, and a fresh set per call
 * cost a realloc chain (~3% of a hybrid stream's apply). apply_msgpack holds the GIL throughout, and
 * the GIL guards `busy`: a call that finds the set taken (another thread's, while a learn callback
 * runs Python) allocates its own. Arrays above SCRATCH_KEEP bytes are freed, not kept. */
#define SCRATCH_KEEP ((size_t)1 << 18)
static struct { FBatch b; uint64_t *kc; Py_ssize_t kc_cap; int busy; } SCRATCH;

static int scratch_take(FBatch *b, FCtx *c) {
    if (SCRATCH.busy) return 0;
    SCRATCH.busy = 1;
    b->ev = SCRATCH.b.ev; b->cev = SCRATCH.b.cev;
    b->h = SCRATCH.b.h; b->ch = SCRATCH.b.ch;
    b->dg = SCRATCH.b.dg; b->cdg = SCRATCH.b.cdg;
    b->tb = SCRATCH.b.tb; b->ctb = SCRATCH.b.ctb;
    c->kc = SCRATCH.kc; c->kc_cap = SCRATCH.kc_cap;
    return 1;
}

#define SCRATCH_FIT(arr, cap, item) do { \
        if ((size_t)(cap) * (item) > SCRATCH_KEEP) { PyMem_RawFree(arr); (arr) = NULL; (cap) = 0; } \
    } while (0)

static void scratch_give(FBatch *b, FCtx *c) {
    SCRATCH_FIT(b->ev, b->cev, sizeof(FEv));
    SCRATCH_FIT(b->h, b->ch, sizeof(HRef));
    SCRATCH_FIT(b->dg, b->cdg, sizeof(uint64_t));
    SCRATCH_FIT(b->tb, b->ctb, sizeof(uint64_t));
    SCRATCH_FIT(c->kc, c->kc_cap, sizeof(uint64_t));
    SCRATCH.b.ev = b->ev; SCRATCH.b.cev = b->cev;
    SCRATCH.b.h = b->h; SCRATCH.b.ch = b->ch;
    SCRATCH.b.dg = b->dg; SCRATCH.b.cdg = b->cdg;
    SCRATCH.b.tb = b->tb; SCRATCH.b.ctb = b->ctb;
    SCRATCH.kc = c->kc; SCRATCH.kc_cap = c->kc_cap;
    SCRATCH.busy = 0;
}

/* apply_msgpack(payload, *, ext, nodes, known, shift, block_size, seed, known_limit, want_rank=None,
 *               default_rank=0) -> None | (stop, counts, drops, ts, rank, n_events)
 * One raw batch of one worker, applied straight to its maps (see the section comment above).
 * None: outside the fast subset, nothing was touched. Otherwise `rank` is the batch's dp_rank when
 * a non-negative int, else `default_rank`. With `want_rank` (the rank whose maps were passed) a batch
 * of another rank, or one without events, touches nothing (stop -1, empty counts); the caller
 * compares `rank` with what it passed. stop = -1 when the whole batch was applied, else the index of
 * the first event left to the Python core (an orphan: nothing of it was applied). */
static PyObject *py_apply_msgpack(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"payload", "ext", "nodes", "known", "shift", "block_size", "seed", "known_limit",
                             "want_rank", "default_rank", "groups", "learn", NULL};
    PyObject *payload, *knowno, *seedo, *wanto = Py_None, *groupso = Py_None, *learn = Py_None;
    U64Map *ext, *nodes;
    int shift;
    Py_ssize_t bs, limit, defrank = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO!O!OinOn|OnOO", kwlist, &payload, &U64MapType, &ext, &U64MapType,
                                     &nodes, &knowno, &shift, &bs, &seedo, &limit, &wanto, &defrank, &groupso, &learn))
        return NULL;
    int ranked = wanto != Py_None;
    long long want = 0;
    if (ranked) {
        want = PyLong_AsLongLong(wanto);
        if (want == -1 && PyErr_Occurred()) return NULL;
    }
    U64Map *known = NULL;
    if (knowno != Py_None) {
        if (!PyObject_TypeCheck(knowno, &U64MapType)) { PyErr_SetString(PyExc_TypeError, "known must be U64Map"); return NULL; }
        known = (U64Map *)knowno;
    }
    uint64_t seed = PyLong_AsUnsignedLongLongMask(seedo);
    if (seed == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    /* a slot position outside [0, MAX_SLOT) would shift past any word, or widen a map without bound */
    if (bs <= 0 || shift < 0 || shift % 4 || shift / 4 >= MAX_SLOT) Py_RETURN_NONE;
    if ((PyObject *)ext == (PyObject *)nodes || (known && (known == ext || known == nodes))) {
        PyErr_SetString(PyExc_ValueError, "apply_msgpack: ext, nodes and known must be distinct maps");
        return NULL;
    }
    GLay *gl = NULL;
    Py_ssize_t ngl = 0;
    int grc = glay_parse(groupso, ext, nodes, known, &gl, &ngl);
    if (grc) { if (grc < 0) return NULL; Py_RETURN_NONE; }
    Py_buffer view;
    if (PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE) < 0) { PyErr_Clear(); PyMem_RawFree(gl); Py_RETURN_NONE; }
    FBatch b;
    memset(&b, 0, sizeof(b));
    PyObject *out = NULL, *counts = PyDict_New(), *drops = PyDict_New();
    uint64_t *cols = NULL;
    FHead hd;
    FCtx c;
    memset(&c, 0, sizeof(c));
    int scr = scratch_take(&b, &c);
    Py_ssize_t stop = -1;
    if (!counts || !drops || !(cols = col_table(bs))) goto done;
    b.bs = bs; b.cols = cols; /* the walk digests the token ids as it reads them */
    int rc = parse_batch(view.buf, view.len, bs, &b, &hd);
    if (rc) { if (rc > 0) { out = Py_None; Py_INCREF(out); } goto done; }
    if (ranked && hd.rank_kind == 3) { out = Py_None; Py_INCREF(out); goto done; } /* Python keeps big ints exact */
    long long rank = hd.rank_kind == 1 ? (long long)hd.rank : (long long)defrank;
    if (ranked && (rank != want || b.nev == 0)) goto result; /* nothing to apply to these maps */
    c.ext = ext; c.nodes = nodes; c.known = known; c.shift = shift; c.bs = bs; c.limit = limit; c.seed = seed; c.cols = cols;
    c.layout = groupso != Py_None; c.gl = gl; c.ngl = ngl; c.learn = learn != Py_None ? learn : NULL;
    if (walk_events(&c, &b, &stop) < 0 || tally_dicts(&c, counts, drops) < 0) goto done;
result:
    out = Py_BuildValue("(nOOdLn)", stop, counts, drops, hd.ts, rank, b.nev);
done:
    Py_XDECREF(counts);
    Py_XDECREF(drops);
    PyMem_RawFree(cols);
    if (scr) scratch_give(&b, &c);
    else {
        PyMem_RawFree(b.ev);
        PyMem_RawFree(b.h);
        PyMem_RawFree(b.dg);
        PyMem_RawFree(b.tb);
        PyMem_RawFree(c.kc);
    }
    PyMem_RawFree(gl);
    if (c.gl_owned) PyMem_RawFree(c.gl);
    Py_XDECREF(c.gl_ref);
    PyBuffer_Release(&view);
    return out;
}

/* apply_msgpack_run(payloads, ext, nodes, known, shift, block_size, seed, known_limit, rank, default_rank,
 *                   max_payload) -> (k, counts, drops, ts, n_events, partial)
 * Consecutive batches of one worker (a list of raw payloads) applied in order to the maps of `rank`,
 * each exactly as apply_msgpack(payload, ..., want_rank=rank, default_rank=default_rank) would, with
 * their counts and drops summed. It stops before the first batch apply_msgpack would not apply
 * whole: one outside the fast subset or above max_payload bytes, of another rank, without events (a heartbeat), with a rank
 * Python must read; the caller takes payloads[k] the usual way. A batch whose walk stops at an
 * orphan was partly applied: `partial` is then apply_msgpack's own (stop, counts, drops, ts, rank,
 * n_events) for payloads[k] (the caller finishes it), else None. `ts` is the last finite ts > 0 of
 * the k whole batches (0.0 if none): the lag the batch-by-batch path would end with. Why: one call
 * per run instead of a call, two dicts and a tuple per batch (docs/index-core.md). */
/* Parse run item k into b (its arrays kept from batch to batch): parse_batch's 0 / 1 / -1, and 1 for an
 * item the one-by-one path judges (not bytes, or over the size limit). Reads only the bytes object. */
static int run_parse(PyObject *items, Py_ssize_t k, Py_ssize_t bs, Py_ssize_t max_payload, FBatch *b, FHead *hd) {
    PyObject *p = PyTuple_GET_ITEM(items, k);
    if (!PyBytes_Check(p) || PyBytes_GET_SIZE(p) > max_payload) return 1;
    b->nev = b->nh = b->ndg = 0;
    return parse_batch((const unsigned char *)PyBytes_AS_STRING(p), PyBytes_GET_SIZE(p), bs, b, hd);
}

static PyObject *py_apply_msgpack_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 11 || nargs > 13) { PyErr_SetString(PyExc_TypeError, "apply_msgpack_run takes 11 to 13 positional arguments"); return NULL; }
    PyObject *groupso = nargs >= 12 ? args[11] : Py_None, *learn = nargs == 13 && args[12] != Py_None ? args[12] : NULL;
    PyObject *payloads = args[0], *knowno = args[3];
    if (!PyList_Check(payloads)) { PyErr_SetString(PyExc_TypeError, "payloads must be a list"); return NULL; }
    if (!PyObject_TypeCheck(args[1], &U64MapType) || !PyObject_TypeCheck(args[2], &U64MapType)
        || (knowno != Py_None && !PyObject_TypeCheck(knowno, &U64MapType))) {
        PyErr_SetString(PyExc_TypeError, "apply_msgpack_run: ext, nodes and known must be U64Map (known may be None)");
        return NULL;
    }
    U64Map *ext = (U64Map *)args[1], *nodes = (U64Map *)args[2], *known = knowno == Py_None ? NULL : (U64Map *)knowno;
    if (ext == nodes || (known && (known == ext || known == nodes))) {
        PyErr_SetString(PyExc_ValueError, "apply_msgpack_run: ext, nodes and known must be distinct maps");
        return NULL;
    }
    long shiftl = PyLong_AsLong(args[4]);
    Py_ssize_t bs = PyLong_AsSsize_t(args[5]);
    uint64_t seed = PyLong_AsUnsignedLongLongMask(args[6]);
    Py_ssize_t limit = PyLong_AsSsize_t(args[7]);
    long long want = PyLong_AsLongLong(args[8]), defrank = PyLong_AsLongLong(args[9]);
    Py_ssize_t max_payload = PyLong_AsSsize_t(args[10]);
    if (PyErr_Occurred()) return NULL;
    GLay *gl = NULL;
    Py_ssize_t ngl = 0;
    int grc = glay_parse(groupso, ext, nodes, known, &gl, &ngl);
    if (grc < 0) return NULL;
    PyObject *counts = PyDict_New(), *drops = PyDict_New(), *partial = NULL, *out = NULL, *items = NULL;
    uint64_t *cols = NULL;
    FBatch b;
    memset(&b, 0, sizeof(b));
    FCtx run, c;
    memset(&run, 0, sizeof(run));
    /* the layout as the walk learns it, carried from batch to batch */
    GLay *cgl = gl;
    Py_ssize_t cngl = ngl;
    int cown = 0, clayout = groupso != Py_None;
    PyObject *cref = NULL;
    uint64_t *ckc = NULL; /* the key cache's buffer, kept from batch to batch */
    Py_ssize_t ckc_cap = 0;
    double last_ts = 0.0;
    Py_ssize_t k = 0, n = 0, nev = 0;
    /* a tuple: nobody can change what the walk reads while it runs without the GIL */
    if (!counts || !drops || !(items = PyList_AsTuple(payloads))) goto done;
    n = PyTuple_GET_SIZE(items);
    /* a slot position outside [0, MAX_SLOT) would shift past any word, or widen a map without bound */
    if (bs <= 0 || shiftl < 0 || shiftl % 4 || shiftl / 4 >= MAX_SLOT || (int)shiftl != shiftl || grc) n = 0;
    if (n) {
        if (!(cols = col_table(bs))) goto done;
        b.bs = bs; b.cols = cols; /* the walk digests the token ids as it reads them */
    }
    if (n) NOGIL = PyEval_SaveThread(); /* until the end, or until a path needs Python (gil_need) */
    for (; k < n; k++) {
        FHead hd;
        int rc = run_parse(items, k, bs, max_payload, &b, &hd);
        if (rc < 0) goto done;
        if (rc > 0 || hd.rank_kind == 3) break;
        long long rank = hd.rank_kind == 1 ? (long long)hd.rank : defrank;
        if (rank != want || b.nev == 0) break;
        memset(&c, 0, sizeof(c));
        c.ext = ext; c.nodes = nodes; c.known = known; c.shift = (int)shiftl; c.bs = bs; c.limit = limit;
        c.seed = seed; c.cols = cols; c.layout = clayout; c.gl = cgl; c.ngl = cngl; c.learn = learn;
        c.gl_owned = cown; c.gl_ref = cref; c.kc = ckc; c.kc_cap = ckc_cap;
        Py_ssize_t stop;
        int wr = walk_events(&c, &b, &stop);
        cgl = c.gl; cngl = c.ngl; cown = c.gl_owned; cref = c.gl_ref; clayout = c.layout; ckc = c.kc; ckc_cap = c.kc_cap;
        if (wr < 0) goto done;
        if (stop >= 0) { /* an orphan or a group event: this batch is the caller's to finish */
            gil_need();
            PyObject *pc = PyDict_New(), *pd = PyDict_New();
            if (pc && pd && tally_dicts(&c, pc, pd) == 0)
                partial = Py_BuildValue("(nOOdLn)", stop, pc, pd, hd.ts, rank, b.nev);
            Py_XDECREF(pc);
            Py_XDECREF(pd);
            if (!partial) goto done;
            break;
        }
        add_counters(&run, &c);
        nev += b.nev;
        if (isfinite(hd.ts) && hd.ts > 0) last_ts = hd.ts;
    }
    gil_need();
    if (tally_dicts(&run, counts, drops) < 0) goto done;
    out = Py_BuildValue("(nOOdnO)", k, counts, drops, last_ts, nev, partial ? partial : Py_None);
done:
    gil_need();
    Py_XDECREF(items);
    Py_XDECREF(counts);
    Py_XDECREF(drops);
    Py_XDECREF(partial);
    PyMem_RawFree(cols);
    PyMem_RawFree(b.ev);
    PyMem_RawFree(b.h);
    PyMem_RawFree(b.dg);
    PyMem_RawFree(b.tb);
    PyMem_RawFree(gl);
    if (cown) PyMem_RawFree(cgl);
    Py_XDECREF(cref);
    PyMem_RawFree(ckc);
    return out;
}

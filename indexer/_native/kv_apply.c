/* The main tree's events of the whole-batch walk (twins of indexer/core/apply.py's store / remove /
 * clear): map access by engine hash, the KV store (fp_attach, its look-ahead prefetches and the key
 * cache a group store of the same blocks reads), the remove and the clear. Included by kvnative.c
 * (one translation unit) after wire_walk.c, before groups_apply.c and batch_apply.c, which call it. */

/* Map access by engine hash: inline for non-zero ints, through an object otherwise. */
static PyObject *href_obj(const HRef *h) {
    return h->b ? PyBytes_FromStringAndSize((const char *)h->b, h->blen) : PyLong_FromUnsignedLongLong(h->k);
}

static int href_get(U64Map *m, const HRef *h, uint64_t *out) {
    if (!h->b && h->k) {
        int f;
        Py_ssize_t i = find(m, h->k, &f);
        if (f) *out = VALS(m, i)[0];
        return f;
    }
    if (!PyDict_GET_SIZE(m->other)) return 0;
    gil_need();
    PyObject *o = href_obj(h);
    if (!o) return -1;
    int r = get_u64(m, o, out);
    Py_DECREF(o);
    return r;
}

static int href_set(U64Map *m, const HRef *h, uint64_t val) {
    if (h->b || !h->k) gil_need();
    PyObject *o = (!h->b && h->k) ? NULL : href_obj(h);
    if (!o && (h->b || !h->k)) return -1;
    int r;
    if (o) { r = set_u64(m, o, val); Py_DECREF(o); return r; }
    int f;
    Py_ssize_t i = find_or_insert(m, h->k, &f);
    if (i < 0) return -1;
    uint64_t *dst = VALS(m, i);
    for (int w = 1; w < m->width; w++) dst[w] = 0;
    dst[0] = val;
    return 0;
}

static int href_del(U64Map *m, const HRef *h) {
    if (!h->b && h->k) {
        int f;
        Py_ssize_t i = find(m, h->k, &f);
        if (f) erase(m, i);
        return 0;
    }
    gil_need();
    PyObject *o = href_obj(h);
    if (!o) return -1;
    int r = PyDict_DelItem(m->other, o);
    Py_DECREF(o);
    return r;
}

typedef struct {
    U64Map *ext, *nodes, *known;
    int shift;
    Py_ssize_t bs, limit;
    uint64_t seed;
    const uint64_t *cols;
    int layout; /* the worker has a group layout (main tree = group 0): its clears are the pure core's */
    struct GLay_ *gl; Py_ssize_t ngl; /* that layout's groups (groups_apply.c) */
    PyObject *learn; /* groups.learn_store for this worker (or NULL): a store of a group outside the layout */
    int gl_owned; PyObject *gl_ref; /* gl came from a learn (freed by the owner of c), and its tuple */
    /* the keys of the last main-tree store (its hash array at kc_h0 in the batch, kc_n blocks), while
     * no other main-tree event came after it: a group's store of the same blocks reads them here,
     * not in ext (a probe of a big table each). Only with a layout (or one to learn). */
    uint64_t *kc; Py_ssize_t kc_cap, kc_h0, kc_n;
    Py_ssize_t stored[4][3], removed[4][2], cleared, drops[N_DROPS];
    Py_ssize_t gstored[4][3], gremoved[4][2];
} FCtx;

#ifndef FA_AHEAD
#define FA_AHEAD 8 /* 4 to 12 measured alike */
#endif
/* Warm block j's slots for fp_attach: its worker-map slot (an int hash) and the node slot of the
 * chain key `*chain` steps to with its digest. */
static inline void fa_prefetch(FCtx *c, const HRef *h, uint64_t *chain, uint64_t digest) {
    if (!h->b) pf_slot(c->ext, h->k);
    *chain = *chain * P_MUL + digest;
    pf_slot(c->nodes, *chain);
}

/* Twin of apply._attach (no cancellations: the fast path only runs with no pending orphans).
 * dg: the blocks' digests (NULL for a placeholder store: every block is mapped already). */
static int fp_attach(FCtx *c, const HRef *hs, Py_ssize_t n, uint64_t state, const uint64_t *dg, int tier, uint64_t *kout) {
    int pos = c->shift + tier;
    /* The chain of the digests is every node key when the blocks are new: the worker's map slot and
     * the node slot of the block FA_AHEAD on are warmed while this one is applied (all of an event's
     * slots before the loop measured ~3% slower on the hybrid bench stream). */
    uint64_t pfs = state;
    Py_ssize_t pfj = 0;
    if (dg) for (; pfj < n && pfj < FA_AHEAD; pfj++) fa_prefetch(c, hs + pfj, &pfs, dg[pfj]);
    int rc = -1;
    for (Py_ssize_t j = 0; j < n; j++) {
        const HRef *h = hs + j;
        uint64_t key;
        int r;
        if (dg && pfj < n) { fa_prefetch(c, hs + pfj, &pfs, dg[pfj]); pfj++; }
        Py_ssize_t ei = -1; /* an int hash's empty ext slot (one probe for get-else-insert) */
        if (!h->b && h->k) {
            ei = find(c->ext, h->k, &r);
            if (r) key = VALS(c->ext, ei)[0];
        } else if ((r = href_get(c->ext, h, &key)) < 0) goto out;
        int is_new = !r;
        if (is_new) {
            r = c->known ? href_get(c->known, h, &key) : 0;
            if (r < 0) goto out;
            if (!r) {
                if (!dg) { gil_need(); PyErr_SetString(PyExc_RuntimeError, "apply_msgpack: placeholder block without a mapping"); goto out; }
                key = state * P_MUL + dg[j];
                if (c->known) {
                    if (U64Map_len(c->known) >= c->limit) { /* bounded trust cache: start afresh */
                        gil_need();
                        PyObject *cr = U64Map_clear(c->known, NULL);
                        if (!cr) goto out;
                        Py_DECREF(cr);
                    }
                    if (href_set(c->known, h, key) < 0) goto out;
                }
            }
        }
        state = key;
        if (is_new) {
            if (ei >= 0) { /* nothing touched ext since its probe: its empty slot is still the one */
                if ((ei = insert_at(c->ext, ei, h->k)) < 0) goto out;
                VALS(c->ext, ei)[0] = key;
            } else if (href_set(c->ext, h, key) < 0) goto out;
        }
        if (kout) kout[j] = key;
        int was = node_set(c->nodes, key, pos);
        if (was < 0) goto out;
        c->stored[tier][was ? 1 : is_new ? 0 : 2]++;
    }
    rc = 0;
out:
    return rc;
}

/* The key cache for a store of n blocks at h0 (NULL when the worker has no layout, or no memory:
 * the cache is only a shortcut). */
static uint64_t *kc_for(FCtx *c, const FEv *e, Py_ssize_t n) {
    if (!c->layout && !c->learn) return NULL;
    if (n > c->kc_cap) {
        uint64_t *k = PyMem_RawRealloc(c->kc, (size_t)n * sizeof(uint64_t));
        if (!k) return NULL;
        c->kc = k;
        c->kc_cap = n;
    }
    return c->kc;
}

static int fp_attach_kc(FCtx *c, const FEv *e, const HRef *hs, Py_ssize_t n, uint64_t state, const uint64_t *dg) {
    uint64_t *kc = kc_for(c, e, n);
    int rc = fp_attach(c, hs, n, state, dg, e->tier, kc);
    if (rc == 0 && kc) { c->kc_h0 = e->h0; c->kc_n = n; }
    return rc;
}

/* Twin of apply._store (dg: the digests of its full blocks). 0 done, 1 orphan (nothing of this event
 * applied), -1 error. */
static int fp_store(FCtx *c, const FEv *e, const HRef *hs, const uint64_t *dg) {
    Py_ssize_t n = e->nh;
    if (!e->full) { c->drops[D_NON_FULL_ATTENTION] += n; return 0; }
    if (e->bsz == 0 || e->nt == 0) { /* placeholder: a new tier on blocks this worker already maps */
        for (Py_ssize_t j = 0; j < n; j++) if (!hs[j].b) pf_slot(c->ext, hs[j].k);
        for (Py_ssize_t j = 0; j < n; j++) {
            uint64_t k;
            int r = href_get(c->ext, hs + j, &k);
            if (r < 0) return -1;
            if (!r) { c->drops[D_PLACEHOLDER_UNKNOWN] += n; return 0; }
            pf_slot(c->nodes, k);
        }
        return fp_attach_kc(c, e, hs, n, 0, NULL);
    }
    if (e->bsz != 1) { c->drops[D_BLOCK_SIZE_MISMATCH] += n; return 0; }
    Py_ssize_t nfull = e->nt / c->bs < n ? e->nt / c->bs : n;
    if (nfull == 0) { c->drops[D_PARTIAL_BLOCK] += n; return 0; }
    uint64_t state = c->seed;
    if (e->has_parent) {
        int r = href_get(c->ext, &e->parent, &state);
        if (r < 0) return -1;
        if (!r) {
            r = href_get(c->ext, hs, &state);
            if (r < 0) return -1;
            if (!r) return 1; /* orphan: the Python path holds it */
            state = 0; /* the first block is already mapped: its key, not the parent, starts the chain */
        }
    }
    c->drops[D_PARTIAL_BLOCK] += n - nfull;
    return fp_attach_kc(c, e, hs, nfull, state, dg);
}

/* Twin of the no-pending part of apply._remove. */
static int fp_remove(FCtx *c, const FEv *e, const HRef *hs) {
    for (Py_ssize_t j = 0; j < e->nh; j++) if (!hs[j].b) pf_slot(c->ext, hs[j].k);
    for (Py_ssize_t j = 0; j < e->nh; j++) { /* read-only: warm the node slots */
        uint64_t key;
        if (!hs[j].b && hs[j].k) {
            int f;
            Py_ssize_t i = find(c->ext, hs[j].k, &f);
            if (f) { key = VALS(c->ext, i)[0]; pf_slot(c->nodes, key); }
        }
    }
    for (Py_ssize_t j = 0; j < e->nh; j++) {
        uint64_t key;
        int r = href_get(c->ext, hs + j, &key);
        if (r < 0) return -1;
        if (!r) { c->removed[e->tier][1]++; continue; }
        int was = node_bit(c->nodes, key, c->shift + e->tier, 2);
        if (was < 0) return -1;
        c->removed[e->tier][was ? 0 : 1]++;
        int any;
        int nib = node_nibble(c->nodes, key, c->shift, &any);
        if (nib < 0) return -1;
        if (!nib && href_del(c->ext, hs + j) < 0) return -1;
        if (!any && node_drop(c->nodes, key) < 0) return -1;
    }
    return 0;
}

/* Drop the worker's nibble from one node (deleting the node when nothing is left). */
static int clear_nibble(U64Map *nodes, uint64_t key, int shift) {
    for (int t = 0; t < 4; t++) if (node_bit(nodes, key, shift + t, 2) < 0) return -1;
    int any;
    if (node_nibble(nodes, key, shift, &any) < 0) return -1;
    return any ? 0 : node_drop(nodes, key);
}

/* Twin of ModelState.clear for the maps (the caller's pending list is already empty). */
static int fp_clear(FCtx *c) {
    gil_need(); /* rare (AllBlocksCleared): the side dicts may be walked */
    U64Map *ext = c->ext;
    for (Py_ssize_t i = 0; i < ext->cap; i++)
        if (KEY(ext, i) && clear_nibble(c->nodes, VALS(ext, i)[0], c->shift) < 0) return -1;
    Py_ssize_t it = 0;
    PyObject *k, *v;
    while (PyDict_Next(ext->other, &it, &k, &v)) {
        uint64_t key = PyLong_AsUnsignedLongLongMask(v);
        if (key == (uint64_t)-1 && PyErr_Occurred()) return -1;
        if (clear_nibble(c->nodes, key, c->shift) < 0) return -1;
    }
    PyObject *r = U64Map_clear(ext, NULL);
    if (!r) return -1;
    Py_DECREF(r);
    c->cleared++;
    return 0;
}


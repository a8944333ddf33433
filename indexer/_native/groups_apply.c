/* Group events of a worker's known layout in the whole-batch walk (twin of the steady state of
 * indexer/core/groups.py: route_store / _group_store / route_remove), included by kvnative.c.
 *
 * The caller passes the worker's layout (its main tree is group 0) as a tuple of
 * (group_idx, kind 0 full / 1 sliding / 2 mamba, has_window, window, nodes, ext) per group; a group
 * event the layout already declares the same way (index, kind, window) is applied here. Anything that
 * would change the layout (a new group, a conflicting kind or window, a non-full store in group 0, a
 * group over the cap), a remove of a group the worker does not have, and a clear of a worker with a
 * layout stop the walk *before* that event: the pure core applies the batch from there, exactly as at
 * an orphan. */

typedef struct GLay_ {
    int64_t gi, window;
    int kind, has_window; /* kind -1: never matched (a window outside [0, 2^63)) */
    U64Map *nodes, *ext;
} GLay;

/* The layout tuple into out (caller frees): 0 ok, 1 a shape we do not take (nothing applied). */
static int glay_parse(PyObject *o, const U64Map *ext, const U64Map *nodes, const U64Map *known, GLay **out, Py_ssize_t *n) {
    *out = NULL;
    *n = 0;
    if (o == Py_None) return 0;
    if (!PyTuple_Check(o)) return 1;
    Py_ssize_t ng = PyTuple_GET_SIZE(o);
    GLay *g = PyMem_RawCalloc((size_t)(ng ? ng : 1), sizeof(GLay));
    if (!g) { PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < ng; i++) {
        PyObject *e = PyTuple_GET_ITEM(o, i);
        if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 6) goto odd;
        for (int j = 0; j < 4; j++) if (!PyLong_CheckExact(PyTuple_GET_ITEM(e, j))) goto odd;
        PyObject *no = PyTuple_GET_ITEM(e, 4), *eo = PyTuple_GET_ITEM(e, 5);
        if (!PyObject_TypeCheck(no, &U64MapType) || !PyObject_TypeCheck(eo, &U64MapType) || no == eo) goto odd;
        g[i].nodes = (U64Map *)no;
        g[i].ext = (U64Map *)eo;
        for (Py_ssize_t j = 0; j < i; j++) /* no map twice: each group's maps are its own */
            if (g[j].nodes == g[i].nodes || g[j].ext == g[i].ext || g[j].nodes == g[i].ext || g[j].ext == g[i].nodes) goto odd;
        const U64Map *mine[2] = {g[i].nodes, g[i].ext};
        for (int j = 0; j < 2; j++) if (mine[j] == ext || mine[j] == nodes || (known && mine[j] == known)) goto odd;
        int ov = 0;
        long long gi = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(e, 0), &ov);
        if (ov || gi < 1) goto odd;
        long kind = PyLong_AsLong(PyTuple_GET_ITEM(e, 1));
        long hw = PyLong_AsLong(PyTuple_GET_ITEM(e, 2));
        long long win = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(e, 3), &ov);
        if (PyErr_Occurred()) { PyErr_Clear(); goto odd; }
        g[i].gi = gi;
        g[i].kind = (ov || win < 0 || kind < 0 || kind > 2) ? -1 : (int)kind;
        g[i].has_window = hw != 0;
        g[i].window = win;
    }
    *out = g;
    *n = ng;
    return 0;
odd:
    PyMem_RawFree(g);
    return 1;
}

/* The layout's group of a group event (by index; a store must also match its kind and window). */
static const GLay *glay_of(const FCtx *c, const FEv *e, int store) {
    if (e->gidx != 2 || e->gi < 0) return NULL;
    for (Py_ssize_t i = 0; i < c->ngl; i++) {
        const GLay *g = &c->gl[i];
        if (g->gi != e->gi) continue;
        if (!store) return g;
        if (g->kind != e->kcode) return NULL;
        if (g->kind == 1 && (e->odd_window || g->has_window != e->has_window || (g->has_window && g->window != e->window)))
            return NULL;
        return g;
    }
    return NULL;
}

/* Whether the walk stops before this event (the pure core's), and the layout group it names. */
static int group_event(const FCtx *c, const FEv *e, const GLay **g) {
    *g = NULL;
    if (e->type == EV_STORED) {
        if (e->kcode == 3 || e->gidx == 0) return 0; /* no group: the main path (a non-full one is dropped) */
        if (e->gidx == 1) return e->kcode != 0;      /* group 0 is the main tree; another kind declares a layout */
        return (*g = glay_of(c, e, 1)) == NULL;
    }
    if (e->type == EV_REMOVED) {
        if (e->gidx != 2) return 0;
        return (*g = glay_of(c, e, 0)) == NULL;
    }
    return c->layout;
}

/* A store of a group the worker's layout lacks: its layout step in Python (c->learn, a closure over
 * groups.learn_store returning the new layout tuple, or None when the pure core must judge the
 * event: a conflicting group is a reset, a main tree not known yet, the cap). 1 the layout was
 * re-read (the walk applies the event), 0 stop there, -1 error. */
static int gp_learn(FCtx *c, const FEv *e) {
    if (!c->learn || e->type != EV_STORED || e->gidx != 2 || e->gi < 1 || e->kcode > 2 || e->odd_window) return 0;
    gil_need();
    PyObject *win = e->kcode == 1 && e->has_window ? PyLong_FromLongLong(e->window) : Py_NewRef(Py_None);
    if (!win) return -1;
    PyObject *r = PyObject_CallFunction(c->learn, "LiO", (long long)e->gi, e->kcode, win);
    Py_DECREF(win);
    if (!r) return -1;
    GLay *ng = NULL;
    Py_ssize_t nn = 0;
    int rc = r == Py_None ? 1 : glay_parse(r, c->ext, c->nodes, c->known, &ng, &nn);
    if (rc) { Py_DECREF(r); return rc < 0 ? -1 : 0; } /* an odd tuple: the pure core, on the learnt layout */
    if (c->gl_owned) PyMem_RawFree(c->gl);
    c->gl = ng; c->ngl = nn; c->gl_owned = 1;
    Py_XDECREF(c->gl_ref);
    c->gl_ref = r; /* holds the maps the new layout points at */
    c->layout = 1;
    return 1;
}

/* A group map's lookup of h, with the slot its probe ended at (-1: a key of the side dict). */
static inline int g_get(U64Map *gx, const HRef *h, Py_ssize_t *slot, uint64_t *out) {
    if (!h->b && h->k) {
        int f;
        *slot = find(gx, h->k, &f);
        if (f) *out = VALS(gx, *slot)[0];
        return f;
    }
    *slot = -1;
    return href_get(gx, h, out);
}

#ifndef GS_AHEAD
#define GS_AHEAD 12 /* 8 to 20 measured alike */
#endif
/* gp_store when the main-tree store just before set every block's key (kv: its keys, n blocks, all
 * full): no chain to follow and no orphan, so each block is read and written in one step (the pure
 * core's read-before-write holds: a block mapped earlier in this event can only be a repeated hash,
 * whose key the main store also gave the first occurrence's key). One probe of the group's map and
 * one of its nodes per block, both prefetched GS_AHEAD blocks on. */
static int gp_store_kc(FCtx *c, const GLay *g, const FEv *e, const HRef *hs, const uint64_t *kv, Py_ssize_t n) {
    U64Map *gx = g->ext, *gn = g->nodes;
    int pos = c->shift + e->tier;
    for (Py_ssize_t j = 0; j < n && j < GS_AHEAD; j++) {
        if (!hs[j].b) pf_slot(gx, hs[j].k);
        pf_slot(gn, kv[j]);
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        if (j + GS_AHEAD < n) {
            if (!hs[j + GS_AHEAD].b) pf_slot(gx, hs[j + GS_AHEAD].k);
            pf_slot(gn, kv[j + GS_AHEAD]);
        }
        uint64_t key = kv[j];
        int seen;
        if (!hs[j].b && hs[j].k) {
            Py_ssize_t ei = find_or_insert(gx, hs[j].k, &seen); /* absent: inserted, value zeroed */
            if (ei < 0) return -1;
            if (seen) key = VALS(gx, ei)[0];
            else VALS(gx, ei)[0] = key;
        } else {
            uint64_t old;
            if ((seen = href_get(gx, hs + j, &old)) < 0) return -1;
            if (seen) key = old;
            else if (href_set(gx, hs + j, key) < 0) return -1;
        }
        int was = node_set(gn, key, pos);
        if (was < 0) return -1;
        c->gstored[e->tier][was ? 1 : seen ? 2 : 0]++;
    }
    return 0;
}

/* Twin of groups._group_store for a group of the worker's layout. 0 done, -1 error.
 * dg: the digests of its full blocks. Keys are resolved for the whole event first (the pure core reads the group's map before writing
 * it), then written. An int hash's probe of the group's map in the first pass keeps its slot: the
 * write reuses it while the table has not moved and the slot is still empty (linear probing only
 * fills slots, so the key is still absent there), one probe per block instead of two. */
static int gp_store(FCtx *c, const GLay *g, const FEv *e, const HRef *hs, const uint64_t *dg) {
    Py_ssize_t n = e->nh, nk = 0;
    if (c->kc_n && e->h0 == c->kc_h0 && e->bsz == 1 && e->nt != 0 && n <= c->kc_n && e->nt / c->bs >= n)
        return gp_store_kc(c, g, e, hs, c->kc, n); /* the KV store's blocks, all full: one step each */
    uint64_t stackbuf[128], *keys = n <= 128 ? stackbuf : PyMem_RawMalloc((size_t)n * sizeof(uint64_t));
    Py_ssize_t slotbuf[128], *slot = n <= 128 ? slotbuf : PyMem_RawMalloc((size_t)n * sizeof(Py_ssize_t));
    unsigned char hadbuf[128], *had = n <= 128 ? hadbuf : PyMem_RawMalloc((size_t)n); /* in the group's map already */
    if (!keys || !had || !slot) {
        if (keys != stackbuf) PyMem_RawFree(keys);
        if (had != hadbuf) PyMem_RawFree(had);
        if (slot != slotbuf) PyMem_RawFree(slot);
        gil_need(); PyErr_NoMemory(); return -1;
    }
    int rc = -1, r;
    U64Map *gx = g->ext;
    /* the blocks of the last main-tree store, whose keys the walk just set in ext: read from there */
    const uint64_t *kv = c->kc_n && e->h0 == c->kc_h0 ? c->kc : NULL;
    Py_ssize_t nkv = kv ? c->kc_n : 0;
#define KV_GET(j, out) ((j) < nkv ? (*(out) = kv[j], 1) : href_get(c->ext, hs + (j), (out)))
    if (e->bsz == 0 || e->nt == 0) { /* placeholder: blocks this worker maps (in this group or as KV) */
        for (Py_ssize_t j = 0; j < n; j++) {
            if ((r = g_get(gx, hs + j, slot + j, &keys[j])) < 0) goto out;
            had[j] = (unsigned char)r;
            if (!r && (r = KV_GET(j, &keys[j])) < 0) goto out;
            if (!r) { c->drops[D_PLACEHOLDER_UNKNOWN] += n; rc = 0; goto out; }
        }
        nk = n;
    } else {
        if (e->bsz != 1) { c->drops[D_BLOCK_SIZE_MISMATCH] += n; rc = 0; goto out; }
        Py_ssize_t nfull = e->nt / c->bs < n ? e->nt / c->bs : n;
        c->drops[D_PARTIAL_BLOCK] += n - nfull;
        /* The parent's key starts the chain only when block 0 is in neither map (once a block is
         * resolved its key does): looked up then, which spares a Mamba store (one block, its parent
         * in no group map) a probe of the worker's big map. The lookups only read. */
        uint64_t state = c->seed;
        int have = 1;
        for (Py_ssize_t j = 0; j < nfull && j < 8; j++) if (!hs[j].b) { pf_slot(gx, hs[j].k); if (j >= nkv) pf_slot(c->ext, hs[j].k); }
        for (Py_ssize_t j = 0; j < nfull; j++) {
            uint64_t key;
            if (j + 8 < nfull && !hs[j + 8].b) { /* random probes: overlap their misses */
                pf_slot(gx, hs[j + 8].k);
                if (j + 8 >= nkv) pf_slot(c->ext, hs[j + 8].k);
            }
            if ((r = g_get(gx, hs + j, slot + j, &key)) < 0) goto out;
            had[j] = (unsigned char)r; /* j == nk until the loop breaks */
            if (!r && (r = KV_GET(j, &key)) < 0) goto out;
            if (!r) {
                if (j == 0 && e->has_parent) {
                    if ((r = href_get(gx, &e->parent, &state)) < 0) goto out;
                    if (!r && (r = href_get(c->ext, &e->parent, &state)) < 0) goto out;
                    have = r;
                }
                if (!have) { c->drops[D_GROUP_ORPHAN] += nfull - j; break; }
                key = state * P_MUL + dg[j];
            }
            keys[nk++] = key;
            state = key;
            have = 1;
        }
    }
    int pos = c->shift + e->tier;
    for (Py_ssize_t j = 0; j < nk && j < 16; j++) pf_slot(g->nodes, keys[j]);
    const uint64_t *tab = gx->tab; /* the slots kept above hold while the table stays */
    Py_ssize_t cap = gx->cap;
    for (Py_ssize_t j = 0; j < nk; j++) {
        if (j + 16 < nk) pf_slot(g->nodes, keys[j + 16]);
        /* had[j]: mapped before this event, to keys[j] (nothing to write). Else it may have been mapped
         * by an earlier block of this event (a repeated hash): counted as mapped, and overwritten as
         * the pure core's `gext[h] = key` does. */
        int seen = had[j];
        if (!seen && slot[j] >= 0) { /* an int hash: found or inserted in one probe */
            Py_ssize_t ei;
            if (gx->tab == tab && gx->cap == cap && !KEY(gx, slot[j])) {
                if ((ei = insert_at(gx, slot[j], hs[j].k)) < 0) goto out;
            } else if ((ei = find_or_insert(gx, hs[j].k, &seen)) < 0) goto out;
            uint64_t *dst = VALS(gx, ei);
            for (int w = 1; w < gx->width; w++) dst[w] = 0;
            dst[0] = keys[j];
        } else if (!seen) {
            uint64_t old;
            if ((seen = href_get(gx, hs + j, &old)) < 0 || href_set(gx, hs + j, keys[j]) < 0) goto out;
        }
        int was = node_set(g->nodes, keys[j], pos);
        if (was < 0) goto out;
        c->gstored[e->tier][was ? 1 : seen ? 2 : 0]++;
    }
    rc = 0;
out:
#undef KV_GET
    if (keys != stackbuf) PyMem_RawFree(keys);
    if (had != hadbuf) PyMem_RawFree(had);
    if (slot != slotbuf) PyMem_RawFree(slot);
    return rc;
}

/* Take tier bit `shift + tier` off node `key` in one probe: returns whether it was set (-1 error),
 * with the worker's nibble left and whether the node holds anything (an empty node is dropped). */
static int node_unset(U64Map *m, uint64_t key, int shift, int tier, int *nib) {
    if (key == 0) { /* rare: content key 0 lives in the side dict */
        int was = node_bit(m, key, shift + tier, 2), any;
        if (was < 0 || (*nib = node_nibble(m, key, shift, &any)) < 0) return -1;
        return !any && node_drop(m, key) < 0 ? -1 : was;
    }
    int f;
    Py_ssize_t i = find(m, key, &f);
    int word = shift >> 6;
    if (!f) { *nib = 0; return 0; }
    uint64_t *v = VALS(m, i);
    int was = 0;
    if (word < m->width) {
        uint64_t b = 1ULL << ((shift + tier) & 63);
        was = (v[word] & b) != 0;
        v[word] &= ~b;
        *nib = (int)((v[word] >> (shift & 63)) & 0xF);
    } else {
        *nib = 0;
    }
    int any = 0;
    for (int w = 0; w < m->width; w++) if (v[w]) { any = 1; break; }
    if (!any) erase(m, i);
    return was;
}

/* Prefetch the group node of an int hash the group's map holds. */
static inline void pf_node(const GLay *g, const HRef *h) {
    if (h->b || !h->k) return;
    int f;
    Py_ssize_t i = find(g->ext, h->k, &f);
    if (f) pf_slot(g->nodes, VALS(g->ext, i)[0]);
}

/* Twin of groups.route_remove for a group of the worker's layout (state.unset_tier per block). */
static int gp_remove(FCtx *c, const GLay *g, const FEv *e, const HRef *hs) {
    /* two strides ahead: the map slot 16 blocks on, and the node of the block 8 on (its key read
     * from the map, whose slot is warm by then; only a prefetch, the block's own step probes again) */
    for (Py_ssize_t j = 0; j < e->nh && j < 16; j++) if (!hs[j].b) pf_slot(g->ext, hs[j].k);
    for (Py_ssize_t j = 0; j < e->nh && j < 8; j++) pf_node(g, hs + j);
    for (Py_ssize_t j = 0; j < e->nh; j++) {
        uint64_t key;
        if (j + 16 < e->nh && !hs[j + 16].b) pf_slot(g->ext, hs[j + 16].k);
        if (j + 8 < e->nh) pf_node(g, hs + j + 8);
        Py_ssize_t ei = -1; /* an int hash's slot: deleted there, no second probe (nodes is another map) */
        int r;
        if (!hs[j].b && hs[j].k) {
            ei = find(g->ext, hs[j].k, &r);
            if (r) key = VALS(g->ext, ei)[0];
        } else if ((r = href_get(g->ext, hs + j, &key)) < 0) return -1;
        if (!r) { c->gremoved[e->tier][1]++; continue; }
        int nib, was = node_unset(g->nodes, key, c->shift, e->tier, &nib);
        if (was < 0) return -1;
        c->gremoved[e->tier][was ? 0 : 1]++;
        if (!nib) {
            if (ei >= 0) erase(g->ext, ei);
            else if (href_del(g->ext, hs + j) < 0) return -1;
        }
    }
    return 0;
}

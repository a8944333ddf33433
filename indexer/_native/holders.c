/* Holder lists: the residency values of a `U64Map.holders()` map (a model's main tree) once its
 * widest value passes HL_DENSE words; included by kvnative.c after u64map.h (the map, the form's
 * constants and the block layout).
 *
 * Dense words cost 4 bits per worker slot up to the highest slot that holds a node, in a table as
 * wide as the widest value: ~W/2 bytes per node however few workers hold it (docs/scaling.md). A
 * holders map past HL_DENSE words switches, once, to a table two words wide whose values are
 *   - inline: up to HL_INLINE entries `slot << 4 | nibble` (u32, nibble != 0), sorted by slot,
 *     packed at the front, the rest 0 (an empty value is all 0);
 *   - spilled: word 0 a pointer (16-aligned: its low 4 bits are 0, where an inline value's first
 *     entry has its nonzero nibble) to an HBlock holding either the sorted entries (`words` 0) or,
 *     where a node is widely held, dense words (`words` of them) — whichever is smaller, with
 *     hysteresis so a node on the edge does not flip at every store.
 * A value with at most HL_INLINE holders is always inline, so an emptied value never holds a block.
 * Every value reads as the same int as its dense form (`val_obj`); the pure core, dumps and
 * snapshots see nothing of the form. `narrow()` goes back to dense words when the slots still held
 * fit HL_DENSE words again. */

static void hl_release(uint64_t *v) {
    if (hl_spilled(v)) free(hl_block(v));
    v[0] = v[1] = 0;
}

/* Release every spilled value of a holders map (clear, dealloc). */
static void hl_release_all(U64Map *m) {
    if (!m->hl) return;
    for (Py_ssize_t i = 0; i < m->cap; i++) if (KEY(m, i)) hl_release(VALS(m, i));
}

static int hl_nomem(void) { gil_need(); PyErr_NoMemory(); return -1; }

static HBlock *hl_alloc(uint32_t cap, uint32_t words) {
    size_t bytes = sizeof(HBlock) + (words ? (size_t)words * 8 : (size_t)cap * 4);
    HBlock *b = malloc((bytes + 15) & ~(size_t)15);
    if (!b || ((uintptr_t)b & 0xF)) { free(b); return NULL; } /* malloc is 16-aligned on every 64-bit libc */
    b->n = 0; b->cap = cap; b->words = words; b->pad = 0;
    if (words) memset(b->d, 0, (size_t)words * 8);
    return b;
}

/* Nibble of `slot` in value v. */
static inline int hl_nib(const uint64_t *v, Py_ssize_t slot) {
    if (!hl_spilled(v)) {
        const uint32_t *e = (const uint32_t *)v;
        for (int j = 0; j < HL_INLINE; j++) if ((Py_ssize_t)(e[j] >> 4) == slot) return (int)(e[j] & 0xF);
        return 0; /* an empty entry 0 "matches" slot 0 only after every real one: nibble 0 either way */
    }
    HBlock *b = hl_block(v);
    if (b->words) {
        Py_ssize_t w = slot >> 4;
        return w < (Py_ssize_t)b->words ? (int)((b->d[w] >> (4 * (slot & 15))) & 0xF) : 0;
    }
    const uint32_t *e = hl_ents(b);
    Py_ssize_t lo = 0, hi = b->n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) >> 1;
        Py_ssize_t s = e[mid] >> 4;
        if (s == slot) return (int)(e[mid] & 0xF);
        if (s < slot) lo = mid + 1; else hi = mid;
    }
    return 0;
}

/* Whether any holder has its shared-pool bit (bit 3 of a nibble). */
static inline int hl_pool(const uint64_t *v) {
    if (!hl_spilled(v)) {
        const uint32_t *e = (const uint32_t *)v;
        for (int j = 0; j < HL_INLINE; j++) if (e[j] & 8) return 1;
        return 0;
    }
    HBlock *b = hl_block(v);
    if (b->words) { for (uint32_t w = 0; w < b->words; w++) if (b->d[w] & POOL_BITS) return 1; return 0; }
    const uint32_t *e = hl_ents(b);
    for (uint32_t j = 0; j < b->n; j++) if (e[j] & 8) return 1;
    return 0;
}

/* Dense words a value needs (0 for an empty one). */
static Py_ssize_t hl_need_words(const uint64_t *v) {
    if (!hl_spilled(v)) {
        const uint32_t *e = (const uint32_t *)v;
        Py_ssize_t top = -1;
        for (int j = 0; j < HL_INLINE; j++) if (e[j]) top = e[j] >> 4;
        return top < 0 ? 0 : (top >> 4) + 1;
    }
    HBlock *b = hl_block(v);
    if (!b->words) return b->n ? (Py_ssize_t)(hl_ents(b)[b->n - 1] >> 8) + 1 : 0;
    Py_ssize_t w = b->words;
    while (w && !b->d[w - 1]) w--;
    return w;
}

/* The value's dense words into out[0..words) (zeroed first; holders past `words` are not written). */
static void hl_to_dense(const uint64_t *v, uint64_t *out, Py_ssize_t words) {
    memset(out, 0, (size_t)words * 8);
    if (hl_spilled(v) && hl_block(v)->words) {
        HBlock *b = hl_block(v);
        memcpy(out, b->d, (size_t)(words < (Py_ssize_t)b->words ? words : (Py_ssize_t)b->words) * 8);
        return;
    }
    const uint32_t *e = hl_spilled(v) ? hl_ents(hl_block(v)) : (const uint32_t *)v;
    Py_ssize_t n = hl_spilled(v) ? (Py_ssize_t)hl_block(v)->n : HL_INLINE;
    for (Py_ssize_t j = 0; j < n; j++) {
        if (!e[j]) break;
        Py_ssize_t s = e[j] >> 4;
        if ((s >> 4) < words) out[s >> 4] |= (uint64_t)(e[j] & 0xF) << (4 * (s & 15));
    }
}

/* Encode dense words (any width) as value v (v's previous block released first). -1 on memory error
 * (v is then empty). The form: inline up to HL_INLINE holders, else the smaller of list and dense. */
static int hl_from_dense(uint64_t *v, const uint64_t *d, Py_ssize_t words) {
    hl_release(v);
    while (words && !d[words - 1]) words--;
    Py_ssize_t n = 0;
    for (Py_ssize_t w = 0; w < words; w++)
        for (uint64_t x = d[w]; x; x >>= 4) n += (x & 0xF) != 0;
    if (n <= HL_INLINE) {
        uint32_t *e = (uint32_t *)v;
        int j = 0;
        for (Py_ssize_t w = 0; w < words; w++)
            for (int q = 0; q < 16; q++) {
                uint32_t nib = (uint32_t)((d[w] >> (4 * q)) & 0xF);
                if (nib) e[j++] = (uint32_t)((w * 16 + q) << 4) | nib;
            }
        return 0;
    }
    HBlock *b;
    if (n * 4 > words * 8) { /* dense is smaller */
        b = hl_alloc(0, (uint32_t)words);
        if (!b) return hl_nomem();
        memcpy(b->d, d, (size_t)words * 8);
    } else {
        b = hl_alloc((uint32_t)n, 0);
        if (!b) return hl_nomem();
        uint32_t *e = hl_ents(b), j = 0;
        for (Py_ssize_t w = 0; w < words; w++)
            for (int q = 0; q < 16; q++) {
                uint32_t nib = (uint32_t)((d[w] >> (4 * q)) & 0xF);
                if (nib) e[j++] = (uint32_t)((w * 16 + q) << 4) | nib;
            }
    }
    b->n = (uint32_t)n;
    v[0] = (uint64_t)(uintptr_t)b;
    v[1] = 0;
    return 0;
}

/* Re-encode a spilled value from its own dense words (a form change); -1 on memory error (v kept). */
static int hl_reform(uint64_t *v) {
    Py_ssize_t words = hl_need_words(v);
    uint64_t *tmp = malloc((size_t)(words ? words : 1) * 8);
    if (!tmp) return hl_nomem();
    hl_to_dense(v, tmp, words);
    uint64_t keep[2] = {v[0], v[1]};
    v[0] = v[1] = 0; /* hl_from_dense releases v's block: it is freed below instead, after the copy */
    int r = hl_from_dense(v, tmp, words);
    free(tmp);
    if (r < 0) { v[0] = keep[0]; v[1] = keep[1]; return -1; } /* (hl_from_dense set the error) */
    if (keep[0] && !(keep[0] & 0xF)) free((HBlock *)(uintptr_t)keep[0]);
    return 0;
}

/* Set `slot`'s nibble of value v to `nib` (0: the slot no longer holds it). -1 on memory error. */
static int hl_put(uint64_t *v, Py_ssize_t slot, int nib) {
    if (!hl_spilled(v)) {
        uint32_t *e = (uint32_t *)v;
        int j = 0, n = 0;
        while (n < HL_INLINE && e[n]) n++;
        while (j < n && (Py_ssize_t)(e[j] >> 4) < slot) j++;
        int here = j < n && (Py_ssize_t)(e[j] >> 4) == slot;
        uint32_t ent = (uint32_t)(slot << 4) | (uint32_t)nib;
        if (here) {
            if (nib) { e[j] = ent; return 0; }
            for (int q = j; q < n - 1; q++) e[q] = e[q + 1];
            e[n - 1] = 0;
            return 0;
        }
        if (!nib) return 0;
        if (n < HL_INLINE) {
            for (int q = n; q > j; q--) e[q] = e[q - 1];
            e[j] = ent;
            return 0;
        }
        HBlock *b = hl_alloc(2 * HL_INLINE, 0); /* a fifth holder: spill to a list */
        if (!b) return hl_nomem();
        uint32_t *be = hl_ents(b);
        for (int q = 0, o = 0; q <= n; q++) be[q] = q == j ? ent : e[o++];
        b->n = (uint32_t)n + 1;
        v[0] = (uint64_t)(uintptr_t)b;
        v[1] = 0;
        return 0;
    }
    HBlock *b = hl_block(v);
    if (b->words) {
        Py_ssize_t w = slot >> 4;
        int sh = 4 * (int)(slot & 15);
        if (w >= (Py_ssize_t)b->words) {
            if (!nib) return 0;
            uint32_t nw = (uint32_t)w + 1;
            HBlock *g = realloc(b, sizeof(HBlock) + (size_t)nw * 8);
            if (!g) return hl_nomem(); /* (a moved block is 16-aligned like a new one) */
            memset(g->d + g->words, 0, (size_t)(nw - g->words) * 8);
            g->words = nw;
            v[0] = (uint64_t)(uintptr_t)(b = g);
        }
        int old = (int)((b->d[w] >> sh) & 0xF);
        b->d[w] = (b->d[w] & ~(0xFULL << sh)) | ((uint64_t)nib << sh);
        if (!old && nib) b->n++;
        else if (old && !nib) b->n--;
        /* widely held no more: a list of n entries is under half the dense words' bytes */
        if (b->n <= HL_INLINE || (Py_ssize_t)b->n * 4 * 2 < (Py_ssize_t)b->words * 8) return hl_reform(v);
        return 0;
    }
    uint32_t *e = hl_ents(b);
    Py_ssize_t lo = 0, hi = b->n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) >> 1;
        if ((Py_ssize_t)(e[mid] >> 4) < slot) lo = mid + 1; else hi = mid;
    }
    int here = lo < (Py_ssize_t)b->n && (Py_ssize_t)(e[lo] >> 4) == slot;
    uint32_t ent = (uint32_t)(slot << 4) | (uint32_t)nib;
    if (here) {
        if (nib) { e[lo] = ent; return 0; }
        memmove(e + lo, e + lo + 1, (size_t)(b->n - lo - 1) * 4);
        b->n--;
        return b->n <= HL_INLINE ? hl_reform(v) : 0;
    }
    if (!nib) return 0;
    if (b->n == b->cap) {
        uint32_t nc = b->cap * 2;
        HBlock *g = realloc(b, sizeof(HBlock) + (size_t)nc * 4);
        if (!g) return hl_nomem();
        g->cap = nc;
        v[0] = (uint64_t)(uintptr_t)(b = g);
        e = hl_ents(b);
    }
    memmove(e + lo + 1, e + lo, (size_t)(b->n - lo) * 4);
    e[lo] = ent;
    b->n++;
    /* widely held: the dense words (to the highest slot) are smaller than the list */
    Py_ssize_t words = (Py_ssize_t)(e[b->n - 1] >> 8) + 1;
    if ((Py_ssize_t)b->n * 4 > words * 8) return hl_reform(v);
    return 0;
}

/* Whether value v holds anything. */
static inline int hl_any(const uint64_t *v) { return v[0] != 0; }

/* Undo a form switch that failed part way: the new table's blocks and table freed, the old table
 * back as it was. -1 (the error is set). */
static int hl_switch_undo(U64Map *m, const U64Map *old) {
    hl_release_all(m); /* (the values placed so far, when the new table holds lists) */
    tab_free(m->tab, m->cap, m->width);
    m->tab = old->tab; m->cap = old->cap; m->width = old->width; m->used = old->used; m->hl = old->hl;
    return -1;
}

/* Re-lay a holders map in the other form: holder lists (`lists`: a table two words wide, every value
 * re-encoded) or dense words `width` wide (narrow(), once the slots held fit HL_DENSE words again).
 * On a memory error the map is left as it was. */
static int hl_switch(U64Map *m, int lists, int width) {
    U64Map old = *m;
    if (map_alloc(m, old.cap, lists ? 2 : width) < 0) return -1; /* (m untouched) */
    m->hl = lists;
    m->work += old.cap;
    for (Py_ssize_t i = 0; i < old.cap; i++) {
        uint64_t k = KEY(&old, i);
        if (!k) continue;
        int f;
        Py_ssize_t j = find(m, k, &f);
        KEY(m, j) = k;
        m->used++;
        if (!lists) hl_to_dense(VALS(&old, i), VALS(m, j), width);
        else if (hl_from_dense(VALS(m, j), VALS(&old, i), old.width) < 0) return hl_switch_undo(m, &old);
    }
    hl_release_all(&old); /* (the old values' blocks, when it held lists) */
    tab_free(old.tab, old.cap, old.width);
    return 0;
}

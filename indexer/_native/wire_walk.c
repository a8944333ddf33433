/* ---------------------------------------------------------------- whole-batch fast path
 *
 * apply_msgpack walks the raw msgpack payload of one batch and applies the common case straight to
 * the maps: map-form BlockStored / BlockRemoved / AllBlocksCleared (tag first, known fields only),
 * int or bytes hashes, int tokens, known media, no LoRA name / cache salt / real extra keys.
 * Pass 1 validates the *whole* payload and touches nothing: anything outside that subset (which is
 * strictly narrower than what schemas.codec accepts) returns None and the caller takes the Python
 * path for the whole batch, so odd input is judged exactly as before. Pass 2 applies event by event
 * with the rules of indexer.core.apply; at a store whose parent is unknown (an orphan) it stops
 * *before* touching that event and reports its index, and the Python path applies the rest. */

typedef struct { const unsigned char *p; Py_ssize_t pos, len; } Rd;

/* 1 int read (two's complement in *v, *neg if negative), 0 next value is not an int, -1 truncated */
static inline int rd_int(Rd *r, uint64_t *v, int *neg) {
    if (r->pos >= r->len) return -1;
    unsigned char c = r->p[r->pos];
    if (c <= 0x7F) { *v = c; *neg = 0; r->pos++; return 1; }
    if (c >= 0xE0) { *v = (uint64_t)(int64_t)(int8_t)c; *neg = 1; r->pos++; return 1; }
    int nb, sgn;
    switch (c) {
        case 0xCC: nb = 1; sgn = 0; break;
        case 0xCD: nb = 2; sgn = 0; break;
        case 0xCE: nb = 4; sgn = 0; break;
        case 0xCF: nb = 8; sgn = 0; break;
        case 0xD0: nb = 1; sgn = 1; break;
        case 0xD1: nb = 2; sgn = 1; break;
        case 0xD2: nb = 4; sgn = 1; break;
        case 0xD3: nb = 8; sgn = 1; break;
        default: return 0;
    }
    if (r->pos + 1 + nb > r->len) return -1;
    const unsigned char *q = r->p + r->pos + 1;
    uint64_t x = 0;
    if (nb == 8) { memcpy(&x, q, 8); x = __builtin_bswap64(x); } /* block hashes: the common 8-byte case */
    else for (int k = 0; k < nb; k++) x = (x << 8) | q[k];
    r->pos += 1 + nb;
    if (sgn && nb < 8) { int sh = 64 - 8 * nb; x = (uint64_t)(((int64_t)(x << sh)) >> sh); }
    *neg = sgn && (int64_t)x < 0;
    *v = x;
    return 1;
}

/* One token at byte o of a 16-byte window w (little-endian: byte i of the payload is bits 8i..):
 * a positive fixint or a uint8/16/32, the widths tokenizers produce; its length, or 0 for anything
 * else (the byte-wise loop reads it). Needs o <= 11, so that the widest (5 bytes) is in the window. */
static inline unsigned tok_at(unsigned __int128 w, unsigned o, uint64_t *out) {
    uint64_t lo = (uint64_t)(w >> (8 * o));
    unsigned c = (unsigned)(lo & 0xFF);
    if (c <= 0x7F) { *out = c; return 1; }
    unsigned idx = c - 0xCC; /* uint8/16/32: no data-dependent branch between widths */
    if (idx > 2) return 0;
    unsigned nb = 1u << idx;
    *out = (__builtin_bswap64(lo) << 8) >> (64 - 8 * nb);
    return 1 + nb;
}

/* One msgpack int token at p[pos] into *t: the widths tokenizers produce inline, any other int
 * through rd_int (two's complement). Its new position, or -1 when it is not an int / truncated. */
static inline Py_ssize_t rd_token1(Rd *r, Py_ssize_t pos, uint64_t *t) {
    const unsigned char *p = r->p;
    if (pos + 8 <= r->len) {
        unsigned char c = p[pos];
        if (c <= 0x7F) { *t = c; return pos + 1; }
        unsigned idx = (unsigned)c - 0xCC; /* uint8/16/32: no data-dependent branch between widths */
        if (idx <= 2) {
            uint64_t x;
            memcpy(&x, p + pos, 8);
            x = __builtin_bswap64(x);
            int nb = 1 << idx;
            *t = (x << 8) >> (64 - 8 * nb);
            return pos + 1 + nb;
        }
    }
    int neg;
    r->pos = pos;
    if (rd_int(r, t, &neg) != 1) return -1;
    return r->pos;
}

/* n msgpack ints (a store's token ids, the bulk of a payload) read and digested block by block:
 * dg[k] = block_digest of tokens [k * bs, (k + 1) * bs) for each full block; a trailing partial
 * block is read (validated) only. Tokens are only ever used as block digests, so they never go to
 * an array of their own: each block's tokens land in `tb` (bs + 2 words, L1-resident) and are
 * digested while the next ones are read (the digest's multiplies overlap the decode's dependency
 * chain). dg NULL: read only (no full block; `bs` is then tb's size less 2, any positive value).
 * Three tokens per 16-byte load where they fit (each at most 5 bytes): the next token's position
 * then waits on register shifts, not on a load, which is what bounds a byte-wise decode. */
static int rd_token_digests(Rd *r, Py_ssize_t n, Py_ssize_t bs, const uint64_t *cols, uint64_t *tb, uint64_t *dg) {
    const unsigned char *p = r->p;
    Py_ssize_t pos = r->pos, len = r->len, j = 0, fill = 0, nb = 0;
#ifdef HAVE_AVX2_DIGESTS
    int avx2 = dg && bs >= 4 && __builtin_cpu_supports("avx2");
#define TB_DIGEST(t) (avx2 ? block_digest_avx2((t), bs, cols) : block_digest((t), bs, 0, cols))
#else
#define TB_DIGEST(t) block_digest((t), bs, 0, cols)
#endif
    while (j < n) {
        Py_ssize_t got = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        if (j + 3 <= n && pos + 16 <= len) {
            uint64_t a, b;
            memcpy(&a, p + pos, 8);
            memcpy(&b, p + pos + 8, 8);
            unsigned __int128 w = ((unsigned __int128)b << 64) | a; /* x86-64: loads are little-endian */
            unsigned l0 = tok_at(w, 0, tb + fill), l1 = 0, l2 = 0;
            if (l0 && (l1 = tok_at(w, l0, tb + fill + 1)) && (l2 = tok_at(w, l0 + l1, tb + fill + 2))) got = 3;
            else got = l0 ? (l1 ? 2 : 1) : 0;
            pos += l0 + l1 + l2;
        }
#endif
        if (!got) {
            if ((pos = rd_token1(r, pos, tb + fill)) < 0) return -1;
            got = 1;
        }
        fill += got;
        j += got;
        if (fill >= bs) { /* full blocks digested; the 0-2 tokens past them move to the front */
            Py_ssize_t o = 0;
            do {
                if (dg) dg[nb++] = TB_DIGEST(tb + o);
                o += bs;
            } while (fill - o >= bs);
            for (Py_ssize_t k = o; k < fill; k++) tb[k - o] = tb[k];
            fill -= o;
        }
    }
#undef TB_DIGEST
    r->pos = pos;
    return 0;
}

static inline int rd_nil(Rd *r) {
    if (r->pos < r->len && r->p[r->pos] == 0xC0) { r->pos++; return 1; }
    return 0;
}

static inline int rd_be_len(Rd *r, int nb, Py_ssize_t *n) {
    if (r->pos + nb > r->len) return -1;
    uint64_t x = 0;
    for (int k = 0; k < nb; k++) x = (x << 8) | r->p[r->pos + k];
    r->pos += nb;
    *n = (Py_ssize_t)x;
    return 0;
}

/* Container header (kind 0 array, 1 map): element count, or -1 when it is not one / cannot fit. */
static Py_ssize_t rd_container(Rd *r, int kind) {
    if (r->pos >= r->len) return -1;
    unsigned char c = r->p[r->pos];
    Py_ssize_t n;
    unsigned char fix = kind ? 0x80 : 0x90, b16 = kind ? 0xDE : 0xDC, b32 = kind ? 0xDF : 0xDD;
    if ((c & 0xF0) == fix) { r->pos++; n = c & 0x0F; }
    else if (c == b16) { r->pos++; if (rd_be_len(r, 2, &n) < 0) return -1; }
    else if (c == b32) { r->pos++; if (rd_be_len(r, 4, &n) < 0) return -1; }
    else return -1;
    if (n > r->len - r->pos) return -1; /* every element takes at least one byte */
    return n;
}

/* str (kind 0) or bin (kind 1): pointer and length, or -1 when it is not one. */
static int rd_bytes(Rd *r, int kind, const unsigned char **s, Py_ssize_t *n) {
    if (r->pos >= r->len) return -1;
    unsigned char c = r->p[r->pos];
    if (kind == 0 && (c & 0xE0) == 0xA0) { r->pos++; *n = c & 0x1F; }
    else if (c == (kind ? 0xC4 : 0xD9)) { r->pos++; if (rd_be_len(r, 1, n) < 0) return -1; }
    else if (c == (kind ? 0xC5 : 0xDA)) { r->pos++; if (rd_be_len(r, 2, n) < 0) return -1; }
    else if (c == (kind ? 0xC6 : 0xDB)) { r->pos++; if (rd_be_len(r, 4, n) < 0) return -1; }
    else return -1;
    if (*n > r->len - r->pos) return -1;
    *s = r->p + r->pos;
    r->pos += *n;
    return 0;
}

/* An ASCII str (so valid UTF-8, and Python's case/strip rules are the ASCII ones), or nil (*s NULL). */
static int rd_ascii_or_nil(Rd *r, const unsigned char **s, Py_ssize_t *n) {
    *s = NULL; *n = 0;
    if (rd_nil(r)) return 0;
    if (rd_bytes(r, 0, s, n) < 0) return -1;
    for (Py_ssize_t i = 0; i < *n; i++) if ((*s)[i] >= 0x80) return -1;
    return 0;
}

static int rd_int_or_nil(Rd *r) {
    if (rd_nil(r)) return 0;
    uint64_t v; int neg;
    return rd_int(r, &v, &neg) == 1 ? 0 : -1;
}

/* An engine hash: int (normalised to u64) or non-empty bytes (b points into the payload). */
typedef struct { uint64_t k; const unsigned char *b; Py_ssize_t blen; } HRef;

static int rd_hash(Rd *r, HRef *h) {
    int neg;
    h->b = NULL; h->blen = 0;
    int t = rd_int(r, &h->k, &neg);
    if (t == 1) return 0;
    if (t < 0) return -1;
    if (rd_bytes(r, 1, &h->b, &h->blen) < 0 || h->blen == 0) return -1; /* empty bytes: bad_hash */
    return 0;
}

/* Canonical tier of a wire medium (schemas.media.parse_medium for ASCII, generated MEDIA table), -1 unknown. */
static int medium_tier(const unsigned char *s, Py_ssize_t n) {
    if (!s) return 0; /* None means GPU */
    /* str.strip(): ASCII whitespace incl. the \x1c-\x1f separators */
#define WS(c) ((c) == ' ' || ((c) >= 0x09 && (c) <= 0x0D) || ((c) >= 0x1C && (c) <= 0x1F))
    while (n && WS(s[0])) { s++; n--; }
    while (n && WS(s[n - 1])) n--;
#undef WS
    char up[64];
    if (n == 0 || n >= (Py_ssize_t)sizeof(up)) return -1;
    for (Py_ssize_t i = 0; i < n; i++) up[i] = (char)((s[i] >= 'a' && s[i] <= 'z') ? s[i] - 32 : s[i]);
    for (int a = 0; a < N_MEDIA; a++)
        if ((Py_ssize_t)strlen(MEDIA[a].name) == n && memcmp(MEDIA[a].name, up, (size_t)n) == 0) return MEDIA[a].tier;
    return -1;
}

/* Does the ASCII-lowered `s` contain marker `m`? */
static int has_marker(const char *s, Py_ssize_t n, const char *m) {
    Py_ssize_t k = (Py_ssize_t)strlen(m);
    for (Py_ssize_t i = 0; i + k <= n; i++) if (memcmp(s + i, m, (size_t)k) == 0) return 1;
    return 0;
}

/* schemas.events.is_full_attention for an ASCII kind (None: full), on the generated marker tables. */
static int full_attention(const unsigned char *s, Py_ssize_t n) {
    if (!s) return 1;
    char buf[64], *low = n <= (Py_ssize_t)sizeof(buf) ? buf : PyMem_RawMalloc((size_t)n); /* every store names its kind */
    if (!low) return 0; /* treated as not full: counted, never misapplied */
    for (Py_ssize_t i = 0; i < n; i++) low[i] = (char)((s[i] >= 'A' && s[i] <= 'Z') ? s[i] + 32 : s[i]);
    int full = 0;
    for (int i = 0; i < N_FULL && !full; i++) full = has_marker(low, n, FULL_MARKERS[i]);
    for (int i = 0; i < N_NOT_FULL && full; i++) full = !has_marker(low, n, NOT_FULL_MARKERS[i]);
    if (low != buf) PyMem_RawFree(low);
    return full;
}

/* indexer.core.groups.classify for an ASCII kind: 0 full attention (None included), 1 sliding
 * window, 2 Mamba, 3 a kind not modelled (skipped as non_full_attention by the main path); -1 no memory. */
static int group_kind(const unsigned char *s, Py_ssize_t n, int full) {
    if (full) return 0;
    if (!s) return 3;
    char low[64];
    if (n >= (Py_ssize_t)sizeof(low)) { /* long kinds: lowered on the heap */
        char *big = PyMem_RawMalloc((size_t)n);
        if (!big) return -1; /* the caller declines: the pure core judges the payload */
        for (Py_ssize_t i = 0; i < n; i++) big[i] = (char)((s[i] >= 'A' && s[i] <= 'Z') ? s[i] + 32 : s[i]);
        int k = (n >= 7 && memcmp(big, "kvatlas", 7) == 0) ? 3 : has_marker(big, n, "sliding") ? 1
              : has_marker(big, n, "mamba") ? 2 : 3;
        PyMem_RawFree(big);
        return k;
    }
    for (Py_ssize_t i = 0; i < n; i++) low[i] = (char)((s[i] >= 'A' && s[i] <= 'Z') ? s[i] + 32 : s[i]);
    if (n >= 7 && memcmp(low, "kvatlas", 7) == 0) return 3;
    return has_marker(low, n, "sliding") ? 1 : has_marker(low, n, "mamba") ? 2 : 3;
}

enum { EV_STORED, EV_REMOVED, EV_CLEARED };

typedef struct {
    int type, tier, full, has_parent;
    int gidx; /* group_idx: 0 absent or nil, 1 zero, 2 another group */
    int kcode; /* kv_cache_spec_kind as groups.classify reads it: 0 full (or none), 1 sliding, 2 mamba, 3 other */
    int has_window, odd_window; /* kv_cache_spec_sliding_window given; outside [0, 2^63) */
    int64_t gi, window; /* group_idx (-1 when negative or above INT64_MAX), the window */
    int bsz; /* block_size: 0 zero, 1 equals the model's, 2 other */
    Py_ssize_t h0, nh, d0, nt; /* hashes at h0; nt token ids, digested per full block at d0 */
    HRef parent;
} FEv;

typedef struct {
    int form; /* the batch's event form so far: 0 none yet, 1 maps, 2 arrays */
    FEv *ev; Py_ssize_t nev, cev;
    HRef *h; Py_ssize_t nh, ch;
    uint64_t *dg; Py_ssize_t ndg, cdg; /* block digests of the stores' token ids (rd_token_digests) */
    uint64_t *tb; Py_ssize_t ctb; /* one block's tokens while they are read */
    Py_ssize_t bs; const uint64_t *cols; /* the model's block size and its column constants */
    /* the last token / hash array read: its bytes in the payload, and where it went in dg / h */
    const unsigned char *lt_raw; Py_ssize_t lt_len, lt_d0, lt_n;
    const unsigned char *lh_raw; Py_ssize_t lh_len, lh_h0, lh_n;
} FBatch;

static int grow(void **arr, Py_ssize_t *cap, Py_ssize_t need, size_t item) {
    if (need <= *cap) return 0;
    Py_ssize_t nc = *cap ? *cap : 64;
    while (nc < need) nc *= 2;
    void *p = PyMem_RawRealloc(*arr, (size_t)nc * item);
    if (!p) { gil_need(); PyErr_NoMemory(); return -1; }
    *arr = p; *cap = nc;
    return 0;
}

/* Why the walk declined a payload (the pure core then judges it whole): counted per reason since
 * import, read with `declines()` (docs/index-core.md, "Every wire shape"). Atomic: the run apply
 * parses without the GIL on several ingest threads at once. */
enum { DECL_MALFORMED, DECL_FIELD, DECL_MEDIUM, DECL_NAMESPACE, DECL_EXTRA_KEYS, DECL_MIXED_FORMS, N_DECL };
static const char *const DECL_NAMES[N_DECL] = {
    "malformed", "unknown_field", "unknown_medium", "lora_or_salt", "extra_keys", "mixed_forms",
};
static uint64_t DECLINES[N_DECL];
#define DECLINE(d) do { __atomic_fetch_add(&DECLINES[d], 1, __ATOMIC_RELAXED); return 1; } while (0)

/* field ids (F_*), FIELD_NAMES, ALLOWED and REQUIRED per event type: wire_tables.h. Bit i of `seen`
 * is set once field i was read. */

/* One field's value into e (and its hashes / tokens into b). 0 ok, 1 outside the fast subset
 * (counted), -1 memory error. */
static int parse_field(Rd *r, int f, Py_ssize_t bs, FEv *e, FBatch *b, Py_ssize_t *nextra) {
    const unsigned char *str;
    Py_ssize_t slen;
    switch (f) {
        case F_BLOCK_HASHES: {
            Py_ssize_t nh = rd_container(r, 0);
            if (nh < 0) DECLINE(DECL_MALFORMED);
            Py_ssize_t at = r->pos;
            /* a group's store names the KV store's blocks again: shared, like a repeated token array
             * (and the walk then knows their keys: groups_apply.c) */
            if (nh && nh == b->lh_n && b->lh_len <= r->len - at && memcmp(r->p + at, b->lh_raw, (size_t)b->lh_len) == 0) {
                e->h0 = b->lh_h0; e->nh = nh;
                r->pos = at + b->lh_len;
                break;
            }
            if (grow((void **)&b->h, &b->ch, b->nh + nh, sizeof(HRef)) < 0) return -1;
            e->h0 = b->nh; e->nh = nh;
            for (Py_ssize_t j = 0; j < nh; j++) if (rd_hash(r, b->h + b->nh + j) < 0) DECLINE(DECL_MALFORMED); /* nh > 0: b->h set */
            b->nh += nh;
            if (nh) { b->lh_raw = r->p + at; b->lh_len = r->pos - at; b->lh_h0 = e->h0; b->lh_n = nh; }
            break;
        }
        case F_PARENT_BLOCK_HASH:
            if (rd_nil(r)) break;
            if (rd_hash(r, &e->parent) < 0) DECLINE(DECL_MALFORMED);
            e->has_parent = 1;
            break;
        case F_TOKEN_IDS: {
            Py_ssize_t nt = rd_container(r, 0);
            if (nt < 0) DECLINE(DECL_MALFORMED);
            Py_ssize_t at = r->pos;
            /* A hybrid batch repeats a request's tokens once per group (vLLM sends each group's store
             * its blocks' tokens): bytes equal to the last array's decode to the same ints (msgpack is
             * prefix-free), so the store shares its digests, for a memcmp instead of a decode. */
            if (nt && nt == b->lt_n && b->lt_len <= r->len - at && memcmp(r->p + at, b->lt_raw, (size_t)b->lt_len) == 0) {
                e->d0 = b->lt_d0; e->nt = nt;
                r->pos = at + b->lt_len;
                break;
            }
            Py_ssize_t nblk = nt / bs, tbs = nblk ? bs : 32; /* no full block: read through a small buffer */
            if (grow((void **)&b->dg, &b->cdg, b->ndg + nblk, sizeof(uint64_t)) < 0
                || grow((void **)&b->tb, &b->ctb, tbs + 2, sizeof(uint64_t)) < 0) return -1;
            e->d0 = b->ndg; e->nt = nt;
            /* b->dg may be NULL when nblk == 0 */
            if (nt && rd_token_digests(r, nt, tbs, b->cols, b->tb, nblk ? b->dg + b->ndg : NULL) < 0) DECLINE(DECL_MALFORMED);
            b->ndg += nblk;
            if (nt) { b->lt_raw = r->p + at; b->lt_len = r->pos - at; b->lt_d0 = e->d0; b->lt_n = nt; }
            break;
        }
        case F_BLOCK_SIZE: {
            uint64_t v; int neg;
            if (rd_int(r, &v, &neg) != 1) DECLINE(DECL_MALFORMED);
            e->bsz = (!neg && v == 0) ? 0 : (!neg && v == (uint64_t)bs) ? 1 : 2;
            break;
        }
        case F_MEDIUM:
            if (rd_ascii_or_nil(r, &str, &slen) < 0) DECLINE(DECL_MALFORMED);
            if ((e->tier = medium_tier(str, slen)) < 0) DECLINE(DECL_MEDIUM); /* Python counts it */
            break;
        case F_LORA_NAME: case F_CACHE_SALT: /* their seeds are derived in Python */
            if (!rd_nil(r)) DECLINE(DECL_NAMESPACE);
            break;
        case F_EXTRA_KEYS: {
            if (rd_nil(r)) break;
            Py_ssize_t nx = rd_container(r, 0);
            if (nx < 0) DECLINE(DECL_EXTRA_KEYS);
            for (Py_ssize_t j = 0; j < nx; j++) if (!rd_nil(r)) DECLINE(DECL_EXTRA_KEYS); /* [None]*n hashes like no extras */
            *nextra = nx;
            break;
        }
        case F_KV_CACHE_SPEC_KIND:
            if (rd_ascii_or_nil(r, &str, &slen) < 0) DECLINE(DECL_MALFORMED);
            e->full = full_attention(str, slen);
            e->kcode = group_kind(str, slen, e->full);
            if (e->kcode < 0) DECLINE(DECL_MALFORMED);
            break;
        case F_GROUP_IDX: {
            if (rd_nil(r)) break;
            uint64_t v; int neg;
            if (rd_int(r, &v, &neg) != 1) DECLINE(DECL_MALFORMED);
            e->gidx = v ? 2 : 1;
            e->gi = (neg || v > (uint64_t)INT64_MAX) ? -1 : (int64_t)v;
            break;
        }
        case F_KV_CACHE_SPEC_SLIDING_WINDOW: {
            if (rd_nil(r)) break;
            uint64_t v; int neg;
            if (rd_int(r, &v, &neg) != 1) DECLINE(DECL_MALFORMED);
            e->has_window = 1;
            e->odd_window = neg || v > (uint64_t)INT64_MAX;
            e->window = (int64_t)v;
            break;
        }
        case F_SESSION_ID: case F_LOCALITY: case F_OWNERSHIP:
            if (rd_ascii_or_nil(r, &str, &slen) < 0) DECLINE(DECL_MALFORMED);
            break;
        default: /* lora_id */
            if (rd_int_or_nil(r) < 0) DECLINE(DECL_MALFORMED);
    }
    return 0;
}

/* Parse one event into b: a tagged map (SGLang, vLLM 0.33: tag first, known keys only) or a tagged
 * positional array (vLLM before maps, Dynamo: `["BlockStored", hashes, parent, tokens, block_size,
 * lora_id, medium, lora_name, ...]`, the fields in declaration order, trailing ones optional, extra
 * trailing elements ignored as the decoder ignores them). BlockRemoved's positions are its fields in
 * declaration order, which are BlockStored's in the same relative order (the import-time table check
 * holds `removed_fields` to schemas/). The decoder reads a batch in one form: a batch mixing the two
 * is declined. 0 ok, 1 outside the fast subset (counted), -1 memory error. */
static int parse_event(Rd *r, Py_ssize_t bs, FBatch *b) {
    if (r->pos >= r->len) DECLINE(DECL_MALFORMED);
    unsigned char c0 = r->p[r->pos];
    int arr = (c0 & 0xF0) == 0x90 || c0 == 0xDC || c0 == 0xDD;
    if (b->form && b->form != 1 + arr) DECLINE(DECL_MIXED_FORMS);
    b->form = 1 + arr;
    Py_ssize_t nel = rd_container(r, arr ? 0 : 1);
    if (nel < 1) DECLINE(DECL_MALFORMED);
    const unsigned char *s;
    Py_ssize_t n;
    if (!arr && (rd_bytes(r, 0, &s, &n) < 0 || n != 4 || memcmp(s, "type", 4) != 0)) DECLINE(DECL_MALFORMED); /* tag first */
    if (rd_bytes(r, 0, &s, &n) < 0) DECLINE(DECL_MALFORMED);
    FEv e;
    memset(&e, 0, sizeof(e));
    e.type = -1;
    for (int t = 0; t < 3; t++)
        if ((Py_ssize_t)strlen(EVENT_TAGS[t]) == n && memcmp(EVENT_TAGS[t], s, (size_t)n) == 0) e.type = t;
    if (e.type < 0) DECLINE(DECL_MALFORMED);
    unsigned seen = 0;
    Py_ssize_t nextra = 0;
    e.full = 1;
    int f = 0;
    for (Py_ssize_t k = 1; k < nel; k++) {
        if (arr) {
            while (f < F_N && !(ALLOWED[e.type] & FB(f))) f++;
            if (f == F_N) { /* past the declared fields: skipped, as the decoder skips them */
                const unsigned char *q = mp_skip(r->p + r->pos, r->p + r->len, 64);
                if (!q) DECLINE(DECL_MALFORMED);
                r->pos = q - r->p;
                continue;
            }
        } else {
            if (rd_bytes(r, 0, &s, &n) < 0) DECLINE(DECL_MALFORMED);
            f = 0;
            while (f < F_N && !((Py_ssize_t)strlen(FIELD_NAMES[f]) == n && memcmp(FIELD_NAMES[f], s, (size_t)n) == 0)) f++;
            if (f == F_N || !(ALLOWED[e.type] & FB(f)) || (seen & FB(f))) DECLINE(DECL_FIELD); /* unknown or repeated key */
        }
        int rc = parse_field(r, f, bs, &e, b, &nextra);
        if (rc) return rc;
        seen |= FB(f);
        f++;
    }
    if ((seen & REQUIRED[e.type]) != REQUIRED[e.type]) DECLINE(DECL_MALFORMED);
    if (nextra && nextra != e.nh) DECLINE(DECL_EXTRA_KEYS); /* a list not per block is digested as a whole: Python */
    if (grow((void **)&b->ev, &b->cev, b->nev + 1, sizeof(FEv)) < 0) return -1;
    b->ev[b->nev++] = e;
    return 0;
}

/* The batch's head as schemas.batchhead reads it: ts (any msgpack float or int, as a double) and
 * dp_rank (rank_kind 0 absent or nil, 1 a non-negative int in rank, 2 negative, 3 above INT64_MAX). */
typedef struct { double ts; int rank_kind; int64_t rank; } FHead;

static double be_double(const unsigned char *q) {
    uint64_t x;
    memcpy(&x, q, 8);
    x = __builtin_bswap64(x);
    double d;
    memcpy(&d, &x, 8);
    return d;
}

static double be_float(const unsigned char *q) {
    uint32_t x;
    memcpy(&x, q, 4);
    x = __builtin_bswap32(x);
    float f;
    memcpy(&f, &x, 4);
    return (double)f;
}

/* Whole payload: `[ts, [event maps], dp_rank?]`. 0 ok, 1 outside the subset, -1 error. */
static int parse_batch(const unsigned char *p, Py_ssize_t len, Py_ssize_t bs, FBatch *b, FHead *hd) {
    Rd r = {p, 0, len};
    b->form = 0;
    b->lt_raw = b->lh_raw = NULL; /* b may be reused across payloads */
    b->lt_len = b->lt_n = b->lt_d0 = b->lh_len = b->lh_n = b->lh_h0 = 0;
    Py_ssize_t top = rd_container(&r, 0);
    if (top != 2 && top != 3) DECLINE(DECL_MALFORMED);
    if (r.pos >= len) DECLINE(DECL_MALFORMED);
    unsigned char c = p[r.pos];
    if (c == 0xCB) { if (r.pos + 9 > len) DECLINE(DECL_MALFORMED); hd->ts = be_double(p + r.pos + 1); r.pos += 9; }
    else if (c == 0xCA) { if (r.pos + 5 > len) DECLINE(DECL_MALFORMED); hd->ts = be_float(p + r.pos + 1); r.pos += 5; }
    else {
        uint64_t v; int neg;
        if (rd_int(&r, &v, &neg) != 1) DECLINE(DECL_MALFORMED);
        hd->ts = neg ? (double)(int64_t)v : (double)v;
    }
    Py_ssize_t nev = rd_container(&r, 0);
    if (nev < 0) DECLINE(DECL_MALFORMED);
    for (Py_ssize_t i = 0; i < nev; i++) {
        int rc = parse_event(&r, bs, b);
        if (rc) return rc;
    }
    hd->rank_kind = 0;
    hd->rank = 0;
    if (top == 3 && !rd_nil(&r)) {
        uint64_t v; int neg;
        if (rd_int(&r, &v, &neg) != 1) DECLINE(DECL_MALFORMED);
        hd->rank_kind = neg ? 2 : v > (uint64_t)INT64_MAX ? 3 : 1;
        hd->rank = (int64_t)v;
    }
    if (r.pos != len) DECLINE(DECL_MALFORMED); /* trailing bytes: the full decoder rejects them */
    return 0;
}


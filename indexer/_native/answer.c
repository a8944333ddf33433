/* The /score answer writer (write_answer), included by kvnative.c (one translation unit), after
 * score_walk.c (it reads the packed PRow rows). */

/* ---------------------------------------------------------------- /score answer bytes
 * write_answer(msgpack, layout, prefix, query_blocks, rows, heads, wix, statuses, seqs, status_map
 *              [, pend_ints, pend_busy[, kv]]) -> bytes | None
 * The body `POST /score` answers, byte for byte what msgspec encodes for the ScoreResponse the Python
 * path builds (router_api/answer.py passes the pieces; tests/test_score_answer.py holds the two equal):
 *  - rows: packed PRow (score_rows with row type None), best first; heads[s] / wix[s] belong to the row
 *    of slot s; heads past the rows are registered pairs the index does not hold (zero rows, appended);
 *  - heads: the pre-encoded `worker_id` / `dp_rank` pairs (None or wix < 0: not registered, skipped);
 *  - wix: int32 per head, the row's worker in statuses / seqs (its liveness status and last_seq);
 *  - status_map: status str -> (encoded status, is stale); layout: the pre-encoded keys and punctuation;
 *  - optional pend_ints, pend_busy: the rows' in-flight fields per head (router_api/score_plan.py):
 *    int64 (pending_blocks, pending_requests, pending_prefill_tokens) and a double busy_until (NaN: None).
 *    Each is written after `status` when it is not its default (0 / None), as omit_defaults writes it;
 *    None for both: no in-flight fields;
 *  - optional kv: int64 per row slot (hybrid_rows' packed column), the row's kv_blocks, written after
 *    `status` where >= 0 (None: omitted, as for a full-attention model's rows);
 *  - optional nidx, limit: the index's rows (positions 0..nidx name heads 0..nidx; -1: as many as
 *    `rows`), and the answer's form: -1 every row (`rows` then holds all nidx); 0 the holders' answer:
 *    only the rows that hold something (a count or kv_blocks > 0) or have in-flight fields, `rows`
 *    holding all or only the index's rows that hold something (holder_rows), in-flight rows of the
 *    others appended in head order (where the full answer has them); K > 0: its first K rows. The
 *    holders' answer is the full one filtered, in the same order, with the same `best`.
 * Rows are ordered like the Python path: fresh before stale, each by score descending, stable.
 * None (the caller encodes with msgspec): a non-finite score or busy_until, a status or last_seq it does
 * not know. */
enum { L_ROW_OPEN, L_DEV, L_CACH, L_TIERS, L_HOST, L_DISK, L_SHARED, L_SCORE, L_STALE, L_SEQ, L_STATUS,
       L_ROW_CLOSE, L_WORKERS, L_AFTER, L_END, L_BEST_OPEN, L_BEST_CLOSE, L_SEP, L_NULL, L_TRUE, L_FALSE,
       L_PBLOCKS, L_PREQS, L_PTOKENS, L_BUSY, L_KV, L_COUNT };
#define PEND_INTS 3 /* per head in pend_ints: pending_blocks, pending_requests, pending_prefill_tokens */

/* Writers into a buffer the caller sized for the worst case (answer_bound): no checks per piece. */
static inline char *put(char *q, const char *s, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) q[i] = s[i]; /* pieces are a few bytes: cheaper than a memcpy call */
    return q + n;
}

static inline char *put_obj(char *q, PyObject *o) { return put(q, PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o)); }

#define INT_MAX_CHARS 20 /* "-9223372036854775808"; msgpack ints take at most 9 bytes */
#define DBL_MAX_CHARS 32 /* msgspec's longest spelling is 25 ("-1.2345678901234567e-308"); msgpack 9 */

static char *json_int(char *q, int64_t v) {
    char tmp[24], *e = tmp + sizeof tmp, *t = e;
    uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    do { *--t = (char)('0' + u % 10); u /= 10; } while (u);
    if (v < 0) *--t = '-';
    return put(q, t, e - t);
}

static char *mp_int(char *q, int64_t v) { /* the smallest form, as msgspec writes it */
    int n;
    uint64_t u = (uint64_t)v;
    if (v >= 0) {
        if (v < 128) { *q++ = (char)v; return q; }
        if (v < 256) { *q++ = (char)0xCC; n = 1; }
        else if (v < 65536) { *q++ = (char)0xCD; n = 2; }
        else if (v <= 0xFFFFFFFFLL) { *q++ = (char)0xCE; n = 4; }
        else { *q++ = (char)0xCF; n = 8; }
    } else {
        if (v >= -32) { *q++ = (char)(u & 0xFF); return q; }
        if (v >= -128) { *q++ = (char)0xD0; n = 1; }
        else if (v >= -32768) { *q++ = (char)0xD1; n = 2; }
        else if (v >= -2147483648LL) { *q++ = (char)0xD2; n = 4; }
        else { *q++ = (char)0xD3; n = 8; }
    }
    for (int k = n - 1; k >= 0; k--) *q++ = (char)(u >> (8 * k));
    return q;
}

/* msgspec's JSON spelling of a finite double: the shortest round-trip digits (Python's repr finds the
 * same ones) laid out as msgspec does — plain decimals for 1e-5 <= |x| < 1e16 ("16.0", "0.00001"),
 * else d[.ddd]e[-]x ("1e16", "1.25e-7"). NULL on a memory error. */
static char *json_double(char *q, double x) {
    if (x == 0.0) return signbit(x) ? put(q, "-0.0", 4) : put(q, "0.0", 3);
    if (fabs(x) < 1e15 && x == (double)(int64_t)x) /* integral: the common case, no digit search */
        return put(json_int(q, (int64_t)x), ".0", 2);
    char *r = PyOS_double_to_string(x, 'r', 0, 0, NULL);
    if (!r) return NULL;
    const char *c = r;
    char dig[40];
    int neg = 0, nd = 0, point = -1;
    if (*c == '-') { neg = 1; c++; }
    for (; *c && *c != 'e' && *c != 'E'; c++) {
        if (*c == '.') point = nd;
        else if (nd < (int)sizeof dig) dig[nd++] = *c;
    }
    long ex = (*c == 'e' || *c == 'E') ? strtol(c + 1, NULL, 10) : 0;
    PyMem_Free(r); /* PyOS_double_to_string allocates with PyMem_Malloc */
    if (point < 0) point = nd;
    int kk = point + (int)ex, st = 0, en = nd; /* value = 0.D x 10^kk */
    while (st < nd && dig[st] == '0') { st++; kk--; }
    while (en > st && dig[en - 1] == '0') en--;
    int L = en - st, k = kk - L;
    const char *D = dig + st;
    if (L < 1 || L > 17) { PyErr_SetString(PyExc_ValueError, "unexpected float repr"); return NULL; }
    if (neg) *q++ = '-';
    if (0 <= k && kk <= 16) {
        q = put(q, D, L);
        for (int i = 0; i < kk - L; i++) *q++ = '0';
        q = put(q, ".0", 2);
    } else if (0 < kk && kk <= 16) {
        q = put(q, D, kk);
        *q++ = '.';
        q = put(q, D + kk, L - kk);
    } else if (-5 < kk && kk <= 0) {
        q = put(q, "0.", 2);
        for (int i = 0; i < -kk; i++) *q++ = '0';
        q = put(q, D, L);
    } else {
        *q++ = D[0];
        if (L > 1) { *q++ = '.'; q = put(q, D + 1, L - 1); }
        *q++ = 'e';
        q = json_int(q, kk - 1);
    }
    return q;
}

static char *mp_double(char *q, double x) {
    uint64_t u;
    memcpy(&u, &x, 8);
    *q++ = (char)0xCB;
    for (int k = 7; k >= 0; k--) *q++ = (char)(u >> (8 * k));
    return q;
}

typedef struct { const PRow *p; Py_ssize_t h, w; double score; int stale; } ARow;

static PyObject *py_write_answer(PyObject *self, PyObject *args) {
    int mp;
    PyObject *layout, *prefix, *heads, *statuses, *seqs, *smap;
    Py_ssize_t qb;
    PyObject *pio = Py_None, *pbo = Py_None, *kvo = Py_None;
    Py_ssize_t nidx = -1, limit = -1;
    Py_buffer rows, wixb, pib = {0}, pbb = {0}, kvb = {0};
    if (!PyArg_ParseTuple(args, "pO!O!ny*O!y*O!O!O!|OOOnn", &mp, &PyTuple_Type, &layout, &PyBytes_Type, &prefix, &qb,
                          &rows, &PyTuple_Type, &heads, &wixb, &PyList_Type, &statuses, &PyList_Type, &seqs,
                          &PyDict_Type, &smap, &pio, &pbo, &kvo, &nidx, &limit))
        return NULL;
    /* the optional columns: None or a contiguous buffer each */
    if ((pio != Py_None && PyObject_GetBuffer(pio, &pib, PyBUF_SIMPLE) < 0) ||
        (pbo != Py_None && PyObject_GetBuffer(pbo, &pbb, PyBUF_SIMPLE) < 0) ||
        (kvo != Py_None && PyObject_GetBuffer(kvo, &kvb, PyBUF_SIMPLE) < 0)) {
        PyBuffer_Release(&rows); PyBuffer_Release(&wixb);
        PyBuffer_Release(&pib); PyBuffer_Release(&pbb); PyBuffer_Release(&kvb);
        return NULL;
    }
    PyObject *out = NULL;
    ARow *ar = NULL;
    int64_t *seq = NULL;
    PyObject **senc = NULL;
    char *stl = NULL, *seen = NULL;
    Py_ssize_t nrows = rows.len / (Py_ssize_t)sizeof(PRow), nh = PyTuple_GET_SIZE(heads);
    Py_ssize_t nw = PyList_GET_SIZE(statuses), na = 0;
    const int32_t *wix = wixb.buf;
    if (nidx < 0) nidx = nrows;
    int compact = limit >= 0;
    int ok = rows.len % (Py_ssize_t)sizeof(PRow) == 0 && PyTuple_GET_SIZE(layout) == L_COUNT && nh >= nidx &&
             nidx >= nrows && (compact || nidx == nrows) && wixb.len == nh * 4 && PyList_GET_SIZE(seqs) == nw && qb >= 0;
    for (Py_ssize_t i = 0; ok && i < L_COUNT; i++) ok = PyBytes_CheckExact(PyTuple_GET_ITEM(layout, i));
    /* the in-flight columns come together, one entry per head; a msgpack row opens with a fixmap header
     * the writer raises by the fields present (up to 4 more) */
    const char *pint = pib.buf, *pbusy = pbb.buf; /* read by memcpy: a buffer's bytes need not be aligned */
    int pend = pib.obj != NULL;
    if (ok && pend != (pbb.obj != NULL)) ok = 0;
    if (ok && pend) ok = pib.len == nh * PEND_INTS * 8 && pbb.len == nh * 8;
    const char *kvc = kvb.buf;
    int haskv = kvb.obj != NULL;
    if (ok && haskv) ok = kvb.len == nidx * 8;
    if (ok && mp) {
        PyObject *ro = PyTuple_GET_ITEM(layout, L_ROW_OPEN);
        unsigned char h0 = PyBytes_GET_SIZE(ro) == 1 ? (unsigned char)PyBytes_AS_STRING(ro)[0] : 0;
        ok = (h0 & 0xF0) == 0x80 && (h0 & 0x0F) + 4 + haskv <= 15;
    }
    if (!ok) goto none;
    ar = PyMem_RawMalloc(sizeof(ARow) * (size_t)(nh ? nh : 1));
    seq = PyMem_RawMalloc(sizeof(int64_t) * (size_t)(nw ? nw : 1));
    senc = PyMem_RawMalloc(sizeof(PyObject *) * (size_t)(nw ? nw : 1));
    stl = PyMem_RawMalloc((size_t)(nw ? nw : 1));
    seen = compact ? PyMem_RawCalloc((size_t)(nh ? nh : 1), 1) : NULL;
    if (!ar || !seq || !senc || !stl || (compact && !seen)) { PyErr_NoMemory(); goto done; }
    /* per worker, read when a row of it is written (the holders' answer reads its rows' workers only):
     * its encoded status, stale flag and last_seq (2 in stl[]: None; 4: read). Exact str keys only, so
     * the dict lookup runs no Python code; nothing below does, so the borrowed bytes stay valid. */
    memset(stl, 0, (size_t)(nw ? nw : 1));
    const PRow *pr = rows.buf;
    /* the holders' answer: after the index's rows, the in-flight rows of heads not among them */
    Py_ssize_t nloop = compact ? nrows + nh : nh;
    for (Py_ssize_t r = 0; r < nloop; r++) { /* the index's rows best first, then the pairs it does not hold */
        Py_ssize_t h = r;
        const PRow *p = NULL;
        if (r < nrows) {
            p = pr + r;
            if (p->s < 0 || p->s >= nidx) goto none;
            h = (Py_ssize_t)p->s;
        } else if (compact) {
            h = r - nrows;
            if (seen[h]) continue;
        }
        if (compact) {
            int loaded = 0;
            if (pend) {
                int64_t li[PEND_INTS];
                double lb;
                memcpy(li, pint + h * PEND_INTS * 8, sizeof li);
                memcpy(&lb, pbusy + h * 8, sizeof lb);
                loaded = li[0] || li[1] || li[2] || !isnan(lb);
            }
            if (p) {
                int64_t kv0 = -1;
                if (haskv) memcpy(&kv0, kvc + h * 8, sizeof kv0);
                int holds = p->dev || p->cach || p->sp[0] || p->sp[1] || p->sp[2] || p->sp[3] || kv0 > 0;
                if (!holds && !loaded) continue;
                if (seen[h]) goto none; /* a position twice */
                seen[h] = 1;
            } else if (!loaded) continue;
        }
        int32_t w = wix[h];
        if (w < 0) continue;
        if (w >= nw || !PyBytes_CheckExact(PyTuple_GET_ITEM(heads, h))) goto none;
        if (!(stl[w] & 4)) {
            PyObject *st = PyList_GET_ITEM(statuses, w), *sq = PyList_GET_ITEM(seqs, w);
            if (!PyUnicode_CheckExact(st)) goto none;
            PyObject *v = PyDict_GetItemWithError(smap, st);
            if (!v) { if (PyErr_Occurred()) goto done; goto none; }
            if (!PyTuple_CheckExact(v) || PyTuple_GET_SIZE(v) != 2 || !PyBytes_CheckExact(PyTuple_GET_ITEM(v, 0))) goto none;
            senc[w] = PyTuple_GET_ITEM(v, 0);
            stl[w] = (char)(4 | (PyTuple_GET_ITEM(v, 1) == Py_True));
            seq[w] = 0;
            if (sq == Py_None) stl[w] |= 2;
            else {
                if (!PyLong_CheckExact(sq)) goto none;
                int ovf = 0;
                long long x = PyLong_AsLongLongAndOverflow(sq, &ovf);
                if (ovf) goto none;
                if (x == -1 && PyErr_Occurred()) goto done;
                seq[w] = x;
            }
        }
        double sc = p ? p->score : 0.0;
        if (!isfinite(sc)) goto none;
        ARow a = {p, h, w, sc, stl[w] & 1};
        /* stable insertion: fresh before stale, score descending (the rows come nearly in order) */
        Py_ssize_t j = na;
        while (j > 0 && (ar[j - 1].stale > a.stale || (ar[j - 1].stale == a.stale && ar[j - 1].score < a.score))) {
            ar[j] = ar[j - 1];
            j--;
        }
        ar[j] = a;
        na++;
    }
    Py_ssize_t best = -1;
    for (Py_ssize_t i = 0; i < na && best < 0; i++) if (!ar[i].stale && ar[i].score > 0) best = i;
    if (limit > 0 && na > limit) na = limit; /* (best is the first fresh row, if any: within any cut) */
#define LY(i) PyTuple_GET_ITEM(layout, i)
#define LEN(i) PyBytes_GET_SIZE(LY(i))
    /* the worst case, so the writers below need no checks: every piece at its longest */
    Py_ssize_t maxhead = 0, row = 0, bound;
    for (Py_ssize_t i = 0; i < na; i++) {
        Py_ssize_t hl = PyBytes_GET_SIZE(PyTuple_GET_ITEM(heads, ar[i].h));
        if (hl > maxhead) maxhead = hl;
        row += hl + PyBytes_GET_SIZE(senc[ar[i].w]);
    }
    Py_ssize_t fixed = LEN(L_SEP) + LEN(L_ROW_OPEN) + LEN(L_DEV) + LEN(L_CACH) + LEN(L_TIERS) + LEN(L_HOST) +
                       LEN(L_DISK) + LEN(L_SHARED) + LEN(L_SCORE) + LEN(L_STALE) + LEN(L_TRUE) + LEN(L_FALSE) +
                       LEN(L_SEQ) + LEN(L_NULL) + LEN(L_STATUS) + LEN(L_ROW_CLOSE) + 7 * INT_MAX_CHARS + DBL_MAX_CHARS +
                       (haskv ? LEN(L_KV) + INT_MAX_CHARS : 0) +
                       (pend ? LEN(L_PBLOCKS) + LEN(L_PREQS) + LEN(L_PTOKENS) + LEN(L_BUSY) + PEND_INTS * INT_MAX_CHARS +
                                   DBL_MAX_CHARS : 0);
    bound = PyBytes_GET_SIZE(prefix) + INT_MAX_CHARS + LEN(L_WORKERS) + 5 + row + na * fixed + LEN(L_AFTER) +
            LEN(L_NULL) + LEN(L_BEST_OPEN) + maxhead + LEN(L_BEST_CLOSE) + LEN(L_END);
    char *buf = PyMem_RawMalloc((size_t)bound), *q = buf;
    if (!buf) { PyErr_NoMemory(); goto done; }
#define INT(v) (q = mp ? mp_int(q, (int64_t)(v)) : json_int(q, (int64_t)(v)))
    q = put_obj(q, prefix);
    INT(qb);
    q = put_obj(q, LY(L_WORKERS));
    if (mp) { /* the workers array header */
        if (na < 16) *q++ = (char)(0x90 | na);
        else if (na < 65536) { *q++ = (char)0xDC; *q++ = (char)(na >> 8); *q++ = (char)na; }
        else { *q++ = (char)0xDD; for (int k = 3; k >= 0; k--) *q++ = (char)((uint64_t)na >> (8 * k)); }
    }
    for (Py_ssize_t i = 0; i < na; i++) {
        const ARow *a = ar + i;
        const PRow *p = a->p;
        if (i) q = put_obj(q, LY(L_SEP));
        int64_t pi[PEND_INTS] = {0, 0, 0};
        double busy = NAN;
        if (pend) {
            memcpy(pi, pint + a->h * PEND_INTS * 8, sizeof pi);
            memcpy(&busy, pbusy + a->h * 8, sizeof busy);
        }
        int has_busy = !isnan(busy);
        int64_t kv = -1; /* the rows past the index's (registered pairs it does not hold) have none */
        if (haskv && a->h < nidx) memcpy(&kv, kvc + a->h * 8, sizeof kv);
        if (has_busy && !isfinite(busy)) { PyMem_RawFree(buf); goto none; } /* msgspec's JSON: null; not ours */
        q = put_obj(q, LY(L_ROW_OPEN));
        if (mp) q[-1] = (char)((unsigned char)q[-1] + (kv >= 0) + (pi[0] != 0) + (pi[1] != 0) + (pi[2] != 0) + has_busy);
        q = put_obj(q, PyTuple_GET_ITEM(heads, a->h));
        q = put_obj(q, LY(L_DEV)); INT(p ? p->dev : 0);
        q = put_obj(q, LY(L_CACH)); INT(p ? p->cach : 0);
        q = put_obj(q, LY(L_TIERS)); INT(p ? p->sp[0] : 0);
        q = put_obj(q, LY(L_HOST)); INT(p ? p->sp[1] : 0);
        q = put_obj(q, LY(L_DISK)); INT(p ? p->sp[2] : 0);
        q = put_obj(q, LY(L_SHARED)); INT(p ? p->sp[3] : 0);
        q = put_obj(q, LY(L_SCORE));
        q = mp ? mp_double(q, a->score) : json_double(q, a->score);
        if (!q) { PyMem_RawFree(buf); goto done; }
        q = put_obj(q, LY(L_STALE));
        q = put_obj(q, LY(a->stale ? L_TRUE : L_FALSE));
        q = put_obj(q, LY(L_SEQ));
        if (stl[a->w] & 2) q = put_obj(q, LY(L_NULL)); else INT(seq[a->w]);
        q = put_obj(q, LY(L_STATUS));
        q = put_obj(q, senc[a->w]);
        /* kv_blocks where set (a hybrid worker's row), then the in-flight fields, when set */
        if (kv >= 0) { q = put_obj(q, LY(L_KV)); INT(kv); }
        if (pi[0]) { q = put_obj(q, LY(L_PBLOCKS)); INT(pi[0]); }
        if (pi[1]) { q = put_obj(q, LY(L_PREQS)); INT(pi[1]); }
        if (pi[2]) { q = put_obj(q, LY(L_PTOKENS)); INT(pi[2]); }
        if (has_busy) {
            q = put_obj(q, LY(L_BUSY));
            q = mp ? mp_double(q, busy) : json_double(q, busy);
            if (!q) { PyMem_RawFree(buf); goto done; }
        }
        q = put_obj(q, LY(L_ROW_CLOSE));
    }
    q = put_obj(q, LY(L_AFTER));
    if (best < 0) q = put_obj(q, LY(L_NULL));
    else {
        q = put_obj(q, LY(L_BEST_OPEN));
        q = put_obj(q, PyTuple_GET_ITEM(heads, ar[best].h));
        q = put_obj(q, LY(L_BEST_CLOSE));
    }
    q = put_obj(q, LY(L_END));
#undef LY
#undef LEN
#undef INT
    out = PyBytes_FromStringAndSize(buf, q - buf);
    PyMem_RawFree(buf);
    goto done;
none:
    out = Py_None;
    Py_INCREF(out);
done:
    PyMem_RawFree(ar);
    PyMem_RawFree(seq);
    PyMem_RawFree(senc);
    PyMem_RawFree(stl);
    PyMem_RawFree(seen);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&wixb);
    PyBuffer_Release(&pib); /* no-ops when not passed (obj NULL) */
    PyBuffer_Release(&pbb);
    PyBuffer_Release(&kvb);
    return out;
}

/* ---------------------------------------------------------------- the rows' status column
 * status_columns(states, now, stale_after, silent_after, names) -> (statuses, seqs) | None
 * indexer/reconcile.py's `status_columns` (its twin and fallback) over slotted StreamState objects,
 * read at their slots' offsets: each /score answer carries every worker's status and last_seq, and
 * the Python loop's attribute reads were ~3 us of a warm query at 32 workers. `names`: the statuses
 * (stale, resyncing, connecting, live) as str. None (the caller takes the Python loop): a state whose
 * type does not keep the five fields in plain slots, an unset slot, or a time that is not a float. */

enum { SC_REG, SC_LAST, SC_HB, SC_RESYNC, SC_SEQ, SC_N };
static const char *const SC_NAMES[SC_N] = {"registered_at", "last_msg_at", "heartbeats", "resync_until", "last_seq"};
static PyTypeObject *SC_TYPE;  /* the type SC_OFF was read from (held: its address cannot be reused) */
static Py_ssize_t SC_OFF[SC_N];

static int sc_offsets(PyTypeObject *t) {
    Py_ssize_t off[SC_N];
    if (t->tp_getattro != PyObject_GenericGetAttr) return 0;  /* its own attribute lookup: Python reads it */
    for (int i = 0; i < SC_N; i++) {
        PyObject *name = PyUnicode_FromString(SC_NAMES[i]);
        if (!name) return -1;
        PyObject *d = _PyType_Lookup(t, name);  /* borrowed; NULL: absent (no error set) */
        Py_DECREF(name);
        if (!d || !Py_IS_TYPE(d, &PyMemberDescr_Type)) return 0;
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type != T_OBJECT_EX || (m->flags & READONLY)) return 0;
        off[i] = m->offset;
    }
    Py_XDECREF(SC_TYPE);
    Py_INCREF(t);
    SC_TYPE = t;
    memcpy(SC_OFF, off, sizeof off);
    return 1;
}

static inline PyObject *sc_slot(PyObject *s, int i) {
    return *(PyObject **)((char *)s + SC_OFF[i]);
}

static PyObject *py_status_columns(PyObject *self, PyObject *args) {
    PyObject *states, *names;
    double now, hb, silent;
    if (!PyArg_ParseTuple(args, "O!dddO!", &PyList_Type, &states, &now, &hb, &silent, &PyTuple_Type, &names))
        return NULL;
    if (PyTuple_GET_SIZE(names) != 4) { PyErr_SetString(PyExc_ValueError, "four status names"); return NULL; }
    Py_ssize_t n = PyList_GET_SIZE(states);
    PyObject *out = PyList_New(n), *seqs = PyList_New(n);
    if (!out || !seqs) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyList_GET_ITEM(states, i);
        if (Py_TYPE(s) != SC_TYPE) {
            int ok = sc_offsets(Py_TYPE(s));
            if (ok < 0) goto fail;
            if (!ok) goto decline;
        }
        PyObject *v[SC_N];
        for (int k = 0; k < SC_N; k++)
            if (!(v[k] = sc_slot(s, k))) goto decline;  /* unset: Python would raise */
        PyObject *base = v[SC_LAST] == Py_None ? v[SC_REG] : v[SC_LAST];
        if (!PyFloat_CheckExact(base) || (v[SC_RESYNC] != Py_None && !PyFloat_CheckExact(v[SC_RESYNC])))
            goto decline;
        if (!PyLong_CheckExact(v[SC_HB])) goto decline;
        int beats = PyObject_IsTrue(v[SC_HB]);
        if (beats < 0) goto fail;
        int st;
        if (now - PyFloat_AS_DOUBLE(base) > (beats ? hb : silent)) st = 0;
        else if (v[SC_RESYNC] != Py_None && now < PyFloat_AS_DOUBLE(v[SC_RESYNC])) st = 1;
        else if (v[SC_LAST] == Py_None) st = 2;
        else st = 3;
        PyList_SET_ITEM(out, i, Py_NewRef(PyTuple_GET_ITEM(names, st)));
        PyList_SET_ITEM(seqs, i, Py_NewRef(v[SC_SEQ]));
    }
    PyObject *res = PyTuple_Pack(2, out, seqs);
    Py_DECREF(out);
    Py_DECREF(seqs);
    return res;
decline:
    Py_DECREF(out);
    Py_DECREF(seqs);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(out);
    Py_XDECREF(seqs);
    return NULL;
}

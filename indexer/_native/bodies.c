/* The HTTP body codec: request bodies (JSON or msgpack) -> little-endian u32 tokens, included by
 * kvnative.c (one translation unit). The service's twin is router_api's typed msgspec decoding. */

/* ---------------------------------------------------------------- request bodies -> u32 tokens
 * json_u32_array / msgpack_u32_array(raw, max_tokens) -> bytes of little-endian u32 | None.
 * `raw` is the msgspec.Raw of a request's `token_ids`. Only the plain valid case is answered: an
 * array of non-negative integers < 2^32, at most max_tokens of them. Anything else (floats, `1e3`,
 * booleans, negatives, `-0`, leading zeros, big ints, too many, not an array) gives None and the
 * caller decodes the body with the typed msgspec decoder, so every reject is judged, and worded,
 * exactly as before. */

/* Without the GIL: a large body's scan runs with the GIL released, so the event loop thread keeps
 * serving (/health, small requests) while a worker thread parses a multi-MB body (router_api/offload.py).
 * Only where it is provably safe: the body is an exact `bytes` (immutable, and the caller's reference
 * keeps it alive), its buffer view is held, the scan writes only into memory allocated before it
 * (an output object nobody else has seen yet) or with PyMem_Raw*, and it touches no Python object,
 * raises nothing and takes no lock. Small bodies keep the GIL: the release would cost more than the scan. */
#define NOGIL_BODY_BYTES (64 * 1024)

static inline int body_nogil(PyObject *body, Py_ssize_t len) {
    return len >= NOGIL_BODY_BYTES && PyBytes_CheckExact(body);
}

static PyObject *u32_bytes(const uint64_t *t, Py_ssize_t n) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (!out) return NULL;
    uint32_t *o = (uint32_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) o[i] = (uint32_t)t[i];
    return out;
}

static inline int json_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* How many of the 8 bytes at q are ASCII digits before the first that is not (8: all of them).
 * A byte is a digit iff its high nibble is 3 and adding 6 keeps it 3 (0x30-0x39). Carries of the
 * addition only move to later bytes, from a byte that is itself no digit: the first non-digit is exact. */
static inline int digit_run8(const unsigned char *q) {
    uint64_t w;
    memcpy(&w, q, 8);
    uint64_t c = ((w & 0xF0F0F0F0F0F0F0F0ULL) ^ 0x3030303030303030ULL)
               | (((w + 0x0606060606060606ULL) & 0xF0F0F0F0F0F0F0F0ULL) ^ 0x3030303030303030ULL);
    return c ? __builtin_ctzll(c) >> 3 : 8;
}

/* The value of the k (1-7) ASCII digits at q, 8 bytes readable: the digits moved to the word's top
 * bytes (zeros, i.e. leading zero digits, below them) and combined in three multiplications. */
static inline uint32_t digits_value(const unsigned char *q, int k) {
    uint64_t v;
    memcpy(&v, q, 8);
    v = (v << (64 - 8 * k)) & 0x0F0F0F0F0F0F0F0FULL;
    v = (v * 2561) >> 8;
    v = ((v & 0x00FF00FF00FF00FFULL) * 6553601) >> 16;
    return (uint32_t)(((v & 0x0000FFFF0000FFFFULL) * 42949672960001ULL) >> 32);
}

/* The JSON array at q (whitespace before it skipped): its u32 tokens into o (at most cap of them).
 * Returns the position just past ']' with *n set, or NULL when undecided (not exactly an array of
 * plain u32 integers, or more than cap). */
static const unsigned char *json_u32_scan(const unsigned char *q, const unsigned char *end, uint32_t *o,
                                          Py_ssize_t cap, Py_ssize_t *nout) {
    Py_ssize_t n = 0;
    while (q < end && json_ws(*q)) q++;
    if (q >= end || *q != '[') return NULL;
    q++;
    while (q < end && json_ws(*q)) q++;
    if (q < end && *q == ']') { *nout = 0; return q + 1; }
    for (;;) {
        unsigned d;
        int k;
        if (end - q >= 8 && (k = digit_run8(q)) < 8) {
            /* a token of 1-7 digits with 8 bytes readable: all of it in a few word operations */
            if (k == 0) return NULL;
            if (k > 1 && *q == '0') return NULL; /* leading zero */
            if (n >= cap) return NULL;
            o[n++] = digits_value(q, k);
            q += k;
        } else {
            if (q >= end || (d = (unsigned)*q - '0') > 9) return NULL;
            q++;
            if (d == 0 && q < end && (unsigned)*q - '0' <= 9) return NULL; /* leading zero */
            uint64_t v = d;
            /* at most 10 digits fit below 2^32; a leading 0 must stand alone */
            const unsigned char *lim = end - q > 9 ? q + 9 : end;
            while (q < lim && (d = (unsigned)*q - '0') <= 9) { v = v * 10 + d; q++; }
            if (v > 0xFFFFFFFFULL || (q < end && (unsigned)*q - '0' <= 9)) return NULL; /* the typed decoder words it */
            if (n >= cap) return NULL; /* more than max tokens */
            o[n++] = (uint32_t)v;
        }
        if (q < end && *q == ',') { /* the common case first */
            q++;
            while (q < end && json_ws(*q)) q++;
            continue;
        }
        while (q < end && json_ws(*q)) q++;
        if (q >= end) return NULL;
        if (*q == ']') { *nout = n; return q + 1; }
        if (*q != ',') return NULL; /* '.', 'e', 'E' land here: a float is not a token */
        q++;
        while (q < end && json_ws(*q)) q++;
    }
}

/* Exactly-sized bytes of the first n u32 of `out` (a fresh object: no in-place resize in the public API). */
static PyObject *u32_exact(PyObject *out, Py_ssize_t n, Py_ssize_t cap) {
    if (n == cap) return out;
    PyObject *exact = PyBytes_FromStringAndSize(PyBytes_AS_STRING(out), n * 4);
    Py_DECREF(out);
    return exact;
}

static PyObject *py_json_u32_array(PyObject *self, PyObject *args) {
    PyObject *raw;
    Py_ssize_t maxn;
    if (!PyArg_ParseTuple(args, "On", &raw, &maxn)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE) < 0) { PyErr_Clear(); Py_RETURN_NONE; }
    const unsigned char *q = view.buf, *end = q + view.len;
    /* every token but the last takes >= 2 bytes ("1,"): len / 2 + 1 bounds the count */
    Py_ssize_t cap = view.len / 2 + 1, n = 0;
    if (cap > maxn) cap = maxn < 0 ? 0 : maxn;
    PyObject *out = PyBytes_FromStringAndSize(NULL, cap * 4);
    if (!out) { PyBuffer_Release(&view); return NULL; }
    uint32_t *o = (uint32_t *)PyBytes_AS_STRING(out);
    /* a msgspec.Raw of an exact bytes body is read-only too, but only bytes is checked: anything else keeps the GIL */
    int nogil = body_nogil(raw, view.len);
    PyThreadState *ts = nogil ? PyEval_SaveThread() : NULL;
    q = json_u32_scan(q, end, o, cap, &n);
    if (q) while (q < end && json_ws(*q)) q++;
    if (ts) PyEval_RestoreThread(ts);
    PyBuffer_Release(&view);
    if (q != end) { Py_DECREF(out); Py_RETURN_NONE; }
    return u32_exact(out, n, cap);
}

/* Past the JSON string opening at q ('"'), or NULL if unterminated; *esc set if it holds a backslash. */
static const unsigned char *json_skip_string(const unsigned char *q, const unsigned char *end, int *esc) {
    *esc = 0;
    for (q++; q < end; q++) {
        if (*q == '"') return q + 1;
        if (*q == '\\') { *esc = 1; q++; }
    }
    return NULL;
}

/* Past the JSON value at q, judged only as far as finding its end (msgspec judges it afterwards). */
static const unsigned char *json_skip_value(const unsigned char *q, const unsigned char *end) {
    int esc, depth = 0;
    if (q >= end) return NULL;
    if (*q == '"') return json_skip_string(q, end, &esc);
    if (*q != '[' && *q != '{') { /* a scalar: up to a delimiter */
        while (q < end && !json_ws(*q) && *q != ',' && *q != '}' && *q != ']' && *q != '"') q++;
        return q;
    }
    while (q < end) {
        unsigned char c = *q;
        if (c == '"') { q = json_skip_string(q, end, &esc); if (!q) return NULL; continue; }
        if (c == '[' || c == '{') depth++;
        else if (c == ']' || c == '}') { if (--depth == 0) return q + 1; }
        q++;
    }
    return NULL;
}

/* The scan of json_body_u32 over [base, end): pure C (no Python object, no GIL needed). Returns 1 with
 * the tokens in o[0..*n) and the array's span [*a0, *a1), or 0 when undecided. */
static int json_body_scan(const unsigned char *base, const unsigned char *end, uint32_t *o, Py_ssize_t cap,
                          Py_ssize_t *nout, const unsigned char **a0out, const unsigned char **a1out) {
    const unsigned char *q = base, *a0 = NULL, *a1 = NULL;
    Py_ssize_t n = 0;
    while (q < end && json_ws(*q)) q++;
    if (q >= end || *q != '{') return 0;
    q++;
    for (;;) {
        while (q < end && json_ws(*q)) q++;
        if (q >= end || *q != '"') return 0; /* incl. '}' of an empty object: token_ids is required */
        int esc;
        const unsigned char *k0 = q + 1, *k1 = json_skip_string(q, end, &esc);
        if (!k1 || esc) return 0; /* an escaped key could alias "token_ids": the typed decoder judges */
        int is_tokens = k1 - 1 - k0 == 9 && memcmp(k0, "token_ids", 9) == 0;
        q = k1;
        while (q < end && json_ws(*q)) q++;
        if (q >= end || *q != ':') return 0;
        q++;
        while (q < end && json_ws(*q)) q++;
        if (is_tokens) {
            if (a0) return 0; /* repeated: the typed decoder says what that means */
            a0 = q;
            q = json_u32_scan(q, end, o, cap, &n);
            if (!q) return 0;
            a1 = q;
        } else if (!(q = json_skip_value(q, end))) return 0;
        while (q < end && json_ws(*q)) q++;
        if (q < end && *q == ',') { q++; continue; }
        if (q < end && *q == '}') { q++; break; }
        return 0;
    }
    while (q < end && json_ws(*q)) q++;
    if (q != end || !a0) return 0;
    *nout = n;
    *a0out = a0;
    *a1out = a1;
    return 1;
}

/* json_body_u32(body, max_tokens) -> (u32 bytes, start, end) | None
 * One pass over a whole JSON /score or /query body: the top-level object's "token_ids" array is parsed
 * into u32 (as json_u32_array), and [start, end) is its span in the body. The caller decodes the body
 * with that span replaced by [] with its typed decoder, which judges every other field: the text outside
 * the span is unchanged, and the span held a well-formed array, so that body is valid iff this one is.
 * None when undecided: not an object, any escaped key (it could alias "token_ids"), the key absent or
 * repeated, or the array not plain u32s. */
static PyObject *py_json_body_u32(PyObject *self, PyObject *args) {
    PyObject *body;
    Py_ssize_t maxn;
    if (!PyArg_ParseTuple(args, "On", &body, &maxn)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(body, &view, PyBUF_SIMPLE) < 0) { PyErr_Clear(); Py_RETURN_NONE; }
    const unsigned char *base = view.buf, *end = base + view.len, *a0 = NULL, *a1 = NULL;
    Py_ssize_t cap = view.len / 2 + 1, n = 0;
    if (cap > maxn) cap = maxn < 0 ? 0 : maxn;
    PyObject *out = PyBytes_FromStringAndSize(NULL, cap * 4);
    if (!out) { PyBuffer_Release(&view); return NULL; }
    uint32_t *o = (uint32_t *)PyBytes_AS_STRING(out);
    PyThreadState *ts = body_nogil(body, view.len) ? PyEval_SaveThread() : NULL;
    int ok = json_body_scan(base, end, o, cap, &n, &a0, &a1);
    if (ts) PyEval_RestoreThread(ts);
    PyBuffer_Release(&view);
    if (!ok) { Py_DECREF(out); Py_RETURN_NONE; }
    out = u32_exact(out, n, cap);
    return out ? Py_BuildValue("(Nnn)", out, (Py_ssize_t)(a0 - base), (Py_ssize_t)(a1 - base)) : NULL;
}

static PyObject *py_msgpack_u32_array(PyObject *self, PyObject *args) {
    PyObject *raw;
    Py_ssize_t maxn;
    if (!PyArg_ParseTuple(args, "On", &raw, &maxn)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE) < 0) { PyErr_Clear(); Py_RETURN_NONE; }
    uint64_t *t = NULL;
    Py_ssize_t n = msgpack_int_array(view.buf, view.len, &t);
    PyBuffer_Release(&view);
    if (n == -2) return NULL;
    if (n < 0) Py_RETURN_NONE;
    int ok = n <= maxn;
    /* negatives come back sign-extended (>= 2^63), so one bound rejects both */
    for (Py_ssize_t i = 0; i < n && ok; i++) ok = t[i] <= 0xFFFFFFFFULL;
    PyObject *out = ok ? u32_bytes(t, n) : (Py_INCREF(Py_None), Py_None);
    PyMem_RawFree(t);
    return out;
}

/* msgpack_body_u32(body, max_tokens) -> (u32 bytes, start, end) | None
 * The msgpack twin of json_body_u32: one pass over a whole msgpack /score or /query body (a map with
 * str keys), its "token_ids" array parsed into u32 and [start, end) its span, so the caller decodes
 * the body with that span replaced by an empty array (0x90) with its typed decoder, which judges every
 * other field. None when undecided: not a map of str keys, the key absent or repeated, an element
 * that is not an int in [0, 2^32), more than max_tokens, trailing bytes, or anything malformed or
 * nested too deeply (the typed decoder words it). Saves msgspec's Raw pass, which walks every token. */
static inline uint64_t be_uint(const unsigned char *p, int nb) {
    uint64_t v = 0;
    for (int k = 0; k < nb; k++) v = (v << 8) | p[k];
    return v;
}

/* The end of the msgpack value at p, or NULL (malformed, truncated, or nested deeper than depth). */
static const unsigned char *mp_skip(const unsigned char *p, const unsigned char *end, int depth) {
    if (p >= end || depth <= 0) return NULL;
    unsigned char c = *p++;
    uint64_t n;
    if (c <= 0x7F || c >= 0xE0 || c == 0xC0 || c == 0xC2 || c == 0xC3) return p;
    if ((c & 0xE0) == 0xA0) { n = c & 0x1F; goto bytes; }
    if ((c & 0xF0) == 0x90) { n = c & 0x0F; goto values; }
    if ((c & 0xF0) == 0x80) { n = 2 * (uint64_t)(c & 0x0F); goto values; }
    int nb; /* width of a length / count field */
    switch (c) {
        case 0xCC: case 0xD0: n = 1; goto bytes;
        case 0xCD: case 0xD1: n = 2; goto bytes;
        case 0xCE: case 0xD2: case 0xCA: n = 4; goto bytes;
        case 0xCF: case 0xD3: case 0xCB: n = 8; goto bytes;
        case 0xD4: n = 2; goto bytes; /* fixext: type byte + data */
        case 0xD5: n = 3; goto bytes;
        case 0xD6: n = 5; goto bytes;
        case 0xD7: n = 9; goto bytes;
        case 0xD8: n = 17; goto bytes;
        case 0xD9: case 0xC4: nb = 1; break;
        case 0xDA: case 0xC5: nb = 2; break;
        case 0xDB: case 0xC6: nb = 4; break;
        case 0xC7: case 0xC8: case 0xC9: { /* ext: length, type byte, data */
            nb = c == 0xC7 ? 1 : c == 0xC8 ? 2 : 4;
            if (end - p < nb) return NULL;
            n = be_uint(p, nb) + 1;
            p += nb;
            goto bytes;
        }
        case 0xDC: case 0xDD: case 0xDE: case 0xDF: {
            nb = (c == 0xDC || c == 0xDE) ? 2 : 4;
            if (end - p < nb) return NULL;
            n = be_uint(p, nb) * (c >= 0xDE ? 2 : 1);
            p += nb;
            goto values;
        }
        default: return NULL; /* 0xC1: never used */
    }
    if (end - p < nb) return NULL; /* str / bin with a length field */
    n = be_uint(p, nb);
    p += nb;
bytes:
    if ((uint64_t)(end - p) < n) return NULL;
    return p + n;
values:
    if ((uint64_t)(end - p) < n) return NULL; /* every value takes a byte at least */
    for (uint64_t i = 0; i < n; i++) if (!(p = mp_skip(p, end, depth - 1))) return NULL;
    return p;
}

/* A msgpack str at p: its bytes in [*s, *s + *n), the end returned; NULL if p is not a str. */
static const unsigned char *mp_str(const unsigned char *p, const unsigned char *end, const unsigned char **s,
                                   Py_ssize_t *n) {
    if (p >= end) return NULL;
    unsigned char c = *p++;
    uint64_t len;
    int nb = 0;
    if ((c & 0xE0) == 0xA0) len = c & 0x1F;
    else if (c == 0xD9 || c == 0xDA || c == 0xDB) {
        nb = c == 0xD9 ? 1 : c == 0xDA ? 2 : 4;
        if (end - p < nb) return NULL;
        len = be_uint(p, nb);
        p += nb;
    } else return NULL;
    if ((uint64_t)(end - p) < len) return NULL;
    *s = p;
    *n = (Py_ssize_t)len;
    return p + len;
}

/* The scan of msgpack_body_u32 over [base, end): pure C (no Python object, no GIL needed; memory from
 * PyMem_Raw*). Returns 1 with the n tokens in *tout (the caller frees it) and the array's span [*a0, *a1),
 * 0 when undecided, -1 when out of memory (no Python error set: the caller sets it with the GIL). */
static int msgpack_body_scan(const unsigned char *base, const unsigned char *end, Py_ssize_t maxn, uint32_t **tout,
                             Py_ssize_t *nout, const unsigned char **a0out, const unsigned char **a1out) {
    const unsigned char *p = base, *a0 = NULL, *a1 = NULL;
    uint32_t *o = NULL;
    uint64_t npairs, n = 0;
    if (p >= end) return 0;
    if ((*p & 0xF0) == 0x80) npairs = *p++ & 0x0F;
    else if (*p == 0xDE || *p == 0xDF) {
        int nb = *p == 0xDE ? 2 : 4;
        if (end - p < 1 + nb) return 0;
        npairs = be_uint(p + 1, nb);
        p += 1 + nb;
    } else return 0;
    if (npairs > (uint64_t)(end - p)) return 0;
    for (uint64_t k = 0; k < npairs; k++) {
        const unsigned char *ks;
        Py_ssize_t kn;
        if (!(p = mp_str(p, end, &ks, &kn))) goto undecided;
        if (!(kn == 9 && memcmp(ks, "token_ids", 9) == 0)) {
            if (!(p = mp_skip(p, end, 64))) goto undecided;
            continue;
        }
        if (a0 || p >= end) goto undecided; /* repeated: the typed decoder says what that means */
        a0 = p;
        unsigned char c = *p++;
        if ((c & 0xF0) == 0x90) n = c & 0x0F;
        else if (c == 0xDC || c == 0xDD) {
            int nb = c == 0xDC ? 2 : 4;
            if (end - p < nb) goto undecided;
            n = be_uint(p, nb);
            p += nb;
        } else goto undecided;
        if (n > (uint64_t)(end - p) || n > (uint64_t)(maxn < 0 ? 0 : maxn)) goto undecided;
        o = PyMem_RawMalloc((size_t)(n ? n : 1) * 4);
        if (!o) return -1;
        for (uint64_t i = 0; i < n; i++) {
            if (p >= end) goto undecided;
            unsigned char t = *p++;
            uint64_t v;
            int nb;
            if (t <= 0x7F) { o[i] = t; continue; }
            switch (t) {
                case 0xCC: case 0xD0: nb = 1; break;
                case 0xCD: case 0xD1: nb = 2; break;
                case 0xCE: case 0xD2: nb = 4; break;
                case 0xCF: case 0xD3: nb = 8; break;
                default: goto undecided; /* negative fixint, not an int: the typed decoder judges it */
            }
            if (end - p < nb) goto undecided;
            v = be_uint(p, nb);
            p += nb;
            if (t >= 0xD0 && (v >> (8 * nb - 1)) & 1) goto undecided; /* a negative signed int */
            if (v > 0xFFFFFFFFULL) goto undecided;
            o[i] = (uint32_t)v;
        }
        a1 = p;
    }
    if (p != end || !a0) goto undecided;
    *tout = o;
    *nout = (Py_ssize_t)n;
    *a0out = a0;
    *a1out = a1;
    return 1;
undecided:
    PyMem_RawFree(o);
    return 0;
}

static PyObject *py_msgpack_body_u32(PyObject *self, PyObject *args) {
    PyObject *body;
    Py_ssize_t maxn;
    if (!PyArg_ParseTuple(args, "On", &body, &maxn)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(body, &view, PyBUF_SIMPLE) < 0) { PyErr_Clear(); Py_RETURN_NONE; }
    const unsigned char *base = view.buf, *a0 = NULL, *a1 = NULL;
    uint32_t *t = NULL;
    Py_ssize_t n = 0;
    PyThreadState *ts = body_nogil(body, view.len) ? PyEval_SaveThread() : NULL;
    int rc = msgpack_body_scan(base, base + view.len, maxn, &t, &n, &a0, &a1);
    if (ts) PyEval_RestoreThread(ts);
    PyBuffer_Release(&view);
    if (rc < 0) return PyErr_NoMemory();
    if (rc == 0) Py_RETURN_NONE;
    PyObject *out = PyBytes_FromStringAndSize((const char *)t, n * 4);
    PyMem_RawFree(t);
    return out ? Py_BuildValue("(Nnn)", out, (Py_ssize_t)(a0 - base), (Py_ssize_t)(a1 - base)) : NULL;
}

/* ---------------------------------------------------------------- one-read request heads
 * simple_head(data, get) -> (target, header block, content-type, accept, content-length, keep-alive,
 * end) | None: router_api/http_head.py's strict subset (its HEAD / GET_HEAD regexes and `_taken`'s
 * rules), read in one pass instead of a regex match and a scan for the fields it reads (~5 us of every
 * /score and /health there). The request line `POST <target> HTTP/1.1` (`GET` with `get`), target `/`
 * then visible ASCII; fields `name:[ \t]*value CRLF` with token-character names and values of visible
 * ASCII with inner spaces or tabs, none trailing; a CRLF ends the head. Any other byte, an unended
 * head, Transfer-Encoding / Upgrade / Expect, Connection other than close / keep-alive, a repeated or
 * non-digit Content-Length: None. tests/test_http_head.py holds it equal to the regex reading. */

static const unsigned char HTTP_TCHAR[256] = {
    ['!'] = 1, ['#'] = 1, ['$'] = 1, ['%'] = 1, ['&'] = 1, ['\''] = 1, ['*'] = 1, ['+'] = 1, ['-'] = 1,
    ['.'] = 1, ['^'] = 1, ['_'] = 1, ['`'] = 1, ['|'] = 1, ['~'] = 1,
    ['0'] = 1, ['1'] = 1, ['2'] = 1, ['3'] = 1, ['4'] = 1, ['5'] = 1, ['6'] = 1, ['7'] = 1, ['8'] = 1, ['9'] = 1,
    ['A'] = 1, ['B'] = 1, ['C'] = 1, ['D'] = 1, ['E'] = 1, ['F'] = 1, ['G'] = 1, ['H'] = 1, ['I'] = 1, ['J'] = 1,
    ['K'] = 1, ['L'] = 1, ['M'] = 1, ['N'] = 1, ['O'] = 1, ['P'] = 1, ['Q'] = 1, ['R'] = 1, ['S'] = 1, ['T'] = 1,
    ['U'] = 1, ['V'] = 1, ['W'] = 1, ['X'] = 1, ['Y'] = 1, ['Z'] = 1,
    ['a'] = 1, ['b'] = 1, ['c'] = 1, ['d'] = 1, ['e'] = 1, ['f'] = 1, ['g'] = 1, ['h'] = 1, ['i'] = 1, ['j'] = 1,
    ['k'] = 1, ['l'] = 1, ['m'] = 1, ['n'] = 1, ['o'] = 1, ['p'] = 1, ['q'] = 1, ['r'] = 1, ['s'] = 1, ['t'] = 1,
    ['u'] = 1, ['v'] = 1, ['w'] = 1, ['x'] = 1, ['y'] = 1, ['z'] = 1,
};

/* `s[0..n)` equals the lower-case `lit` ignoring ASCII case */
static int http_name_is(const unsigned char *s, Py_ssize_t n, const char *lit) {
    Py_ssize_t i = 0;
    for (; lit[i]; i++) {
        if (i >= n) return 0;
        unsigned char c = s[i];
        if (c >= 'A' && c <= 'Z') c = (unsigned char)(c + 32);
        if (c != (unsigned char)lit[i]) return 0;
    }
    return i == n;
}

enum { HF_OTHER, HF_CTYPE, HF_ACCEPT, HF_CLEN, HF_CONN, HF_REFUSE };

static int http_field_kind(const unsigned char *s, Py_ssize_t n) {
    switch (n) {
    case 6: return http_name_is(s, n, "accept") ? HF_ACCEPT : http_name_is(s, n, "expect") ? HF_REFUSE : HF_OTHER;
    case 7: return http_name_is(s, n, "upgrade") ? HF_REFUSE : HF_OTHER;
    case 10: return http_name_is(s, n, "connection") ? HF_CONN : HF_OTHER;
    case 12: return http_name_is(s, n, "content-type") ? HF_CTYPE : HF_OTHER;
    case 14: return http_name_is(s, n, "content-length") ? HF_CLEN : HF_OTHER;
    case 17: return http_name_is(s, n, "transfer-encoding") ? HF_REFUSE : HF_OTHER;
    default: return HF_OTHER;
    }
}

static PyObject *py_simple_head(PyObject *self, PyObject *args) {
    Py_buffer buf;
    int get;
    if (!PyArg_ParseTuple(args, "y*p", &buf, &get)) return NULL;
    const unsigned char *d = buf.buf;
    Py_ssize_t n = buf.len, p;
    const char *verb = get ? "GET /" : "POST /";
    Py_ssize_t vlen = get ? 5 : 6;
    /* spans into d: target, block, content-type, accept, content-length (-1: absent) */
    Py_ssize_t t0 = vlen - 1, t1, b0, ct0 = -1, ct1 = 0, ac0 = -1, ac1 = 0, cl0 = -1, cl1 = 0;
    int keep_alive = 1;
    if (n < vlen || memcmp(d, verb, (size_t)vlen) != 0) goto none;
    for (p = vlen; p < n && d[p] >= '!' && d[p] <= '~'; p++) {}
    t1 = p;
    if (n - p < 11 || memcmp(d + p, " HTTP/1.1\r\n", 11) != 0) goto none;
    p += 11;
    b0 = p;
    for (;;) {
        if (n - p >= 2 && d[p] == '\r' && d[p + 1] == '\n') break;  /* the head's end */
        Py_ssize_t k0 = p;
        while (p < n && HTTP_TCHAR[d[p]]) p++;
        if (p == k0 || p >= n || d[p] != ':') goto none;
        int kind = http_field_kind(d + k0, p - k0);
        p++;
        while (p < n && (d[p] == ' ' || d[p] == '\t')) p++;
        Py_ssize_t v0 = p;
        while (p < n && ((d[p] >= '!' && d[p] <= '~') || d[p] == ' ' || d[p] == '\t')) p++;
        Py_ssize_t v1 = p;
        if (n - p < 2 || d[p] != '\r' || d[p + 1] != '\n') goto none;
        if (v1 > v0 && (d[v1 - 1] == ' ' || d[v1 - 1] == '\t')) goto none;  /* trailing whitespace */
        p += 2;
        switch (kind) {
        case HF_CTYPE: ct0 = v0; ct1 = v1; break;
        case HF_ACCEPT: ac0 = v0; ac1 = v1; break;
        case HF_CLEN:
            if (cl0 >= 0 || v1 == v0) goto none;
            for (Py_ssize_t i = v0; i < v1; i++)
                if (d[i] < '0' || d[i] > '9') goto none;
            cl0 = v0; cl1 = v1;
            break;
        case HF_CONN:
            if (http_name_is(d + v0, v1 - v0, "close")) keep_alive = 0;
            else if (!http_name_is(d + v0, v1 - v0, "keep-alive")) goto none;
            break;
        case HF_REFUSE: goto none;
        default: break;
        }
    }
    PyObject *res = PyTuple_New(7);
    if (!res) { PyBuffer_Release(&buf); return NULL; }
    Py_ssize_t spans[5][2] = {{t0, t1}, {b0, p}, {ct0, ct1}, {ac0, ac1}, {cl0, cl1}};
    for (int i = 0; i < 5; i++) {
        PyObject *v = spans[i][0] < 0 ? Py_NewRef(Py_None)
            : PyBytes_FromStringAndSize((const char *)d + spans[i][0], spans[i][1] - spans[i][0]);
        if (!v) { Py_DECREF(res); PyBuffer_Release(&buf); return NULL; }
        PyTuple_SET_ITEM(res, i, v);
    }
    PyTuple_SET_ITEM(res, 5, PyBool_FromLong(keep_alive));
    PyObject *end = PyLong_FromSsize_t(p + 2);
    if (!end) { Py_DECREF(res); PyBuffer_Release(&buf); return NULL; }
    PyTuple_SET_ITEM(res, 6, end);
    PyBuffer_Release(&buf);
    return res;
none:
    PyBuffer_Release(&buf);
    Py_RETURN_NONE;
}

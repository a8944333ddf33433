/* Optional native accelerator for the kvatlas index core (plain C against the CPython API).
 *
 * The pure-Python core (indexer/hashing.py, indexer/core/ modules) is the reference; everything here is
 * a faster twin of one piece of it and must agree bit for bit (tests run both):
 *  - block digests / chained content keys straight from a msgpack int array (a msgspec.Raw
 *    `token_ids`), a list of ints or an integer buffer, without creating Python ints per token;
 *  - U64Map: a dict-like open-addressing map whose u64 keys and non-negative int values (any width:
 *    residency words grow as worker slots are added) are stored inline; other keys (bytes engine
 *    hashes, key 0) live in a side dict, so it is a drop-in for the dicts of the Python core;
 *  - attach / remove: the per-block loops of a store or remove event over those maps;
 *  - apply_msgpack: the common case of a whole raw batch (validated first, applied to the maps);
 *  - walk / score_rows: the prefix walk, and the whole score down to the ranked WorkerScore rows.
 * Functions return None where they cannot decide (odd input): the caller then takes the Python path,
 * which judges the input exactly as the reference does.
 *
 * Untrusted bytes (docs/index-core.md, "The C accelerator on untrusted input"): only the public
 * CPython API is used; a buffer is read only when its format code and item size agree; positions and
 * widths are bounded before any shift or allocation; no pointer arithmetic on NULL (empty batches);
 * no borrowed reference or cached length is held across a call that can run Python code (the row
 * type's constructor), and U64Map keys are exact ints or bytes only, so a map lookup never runs
 * Python code either. `make test-sanitize` runs the fuzz and differential tests on an ASan + UBSan build.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <sys/mman.h>

#if PY_BIG_ENDIAN
#error "kvnative assumes a little-endian host (residency words are little-endian byte strings)"
#endif

/* Hash constants, event tags, field names, media aliases, the full-attention rule and the ApplyStats
 * keys: generated from schemas/ and indexer/ (indexer/_native/wire.py), never written here. */
#include "wire_tables.h"

/* The run apply (`apply_msgpack_run`) walks payload bytes into the C tables without the GIL, so the
 * service's HTTP thread runs Python meanwhile (parsing and answering requests up to the index lock;
 * docs/service.md, "Session 5"). Callers serialise all access to an index's maps with their own
 * lock (the service's index lock); the GIL only guards Python objects. NOGIL holds the saved thread state while this thread runs without it;
 * `gil_need()` takes the GIL back (for the rest of the call) before anything touches a Python object:
 * side-dict keys (bytes hashes, content key 0), errors, the rare clear paths. Memory comes from the
 * PyMem_Raw* family, which needs no GIL. */
static _Thread_local PyThreadState *NOGIL;

static inline void gil_need(void) {
    if (NOGIL) {
        PyThreadState *ts = NOGIL;
        NOGIL = NULL;
        PyEval_RestoreThread(ts);
    }
}

/* Bounds on caller-supplied positions: a residency word never grows past MAX_WIDTH 64-bit words
 * (MAX_WIDTH * 16 worker slots), so `4 * slot + tier` always fits an int. */
#define MAX_WIDTH 4096
#define MAX_SLOT ((Py_ssize_t)MAX_WIDTH * 16)

/* ---------------------------------------------------------------- hashing (twin of hashing.py) */

static inline uint64_t col_const(uint64_t i) { return (((i + 1) * K3) ^ (i * P_MUL)) | 1ULL; }

/* The block's column constants, one per token position (PyMem; NULL with MemoryError set). */
static uint64_t *col_table(Py_ssize_t bs) {
    uint64_t *cols = PyMem_RawMalloc((size_t)(bs > 0 ? bs : 1) * sizeof(uint64_t));
    if (!cols) { PyErr_NoMemory(); return NULL; }
    for (Py_ssize_t i = 0; i < bs; i++) cols[i] = col_const((uint64_t)i);
    return cols;
}

static inline uint64_t block_digest(const uint64_t *t, Py_ssize_t bs, uint64_t extra, const uint64_t *cols) {
    uint64_t acc = 0;
    for (Py_ssize_t i = 0; i < bs; i++) {
        uint64_t x = t[i] * K1 + cols[i];
        x ^= x >> 31;
        acc += x * K2;
    }
    acc ^= extra * EXTRA_SALT;
    acc ^= acc >> 29;
    acc *= K3;
    acc ^= acc >> 32;
    return acc;
}

/* Reads a msgpack array of ints. Returns token count, or -1 if `buf` is not exactly one such array. */
static Py_ssize_t msgpack_int_array(const unsigned char *p, Py_ssize_t len, uint64_t **out) {
    Py_ssize_t pos = 0, n;
    if (len < 1) return -1;
    unsigned char h = p[0];
    if ((h & 0xF0) == 0x90) { n = h & 0x0F; pos = 1; }
    else if (h == 0xDC) { if (len < 3) return -1; n = ((Py_ssize_t)p[1] << 8) | p[2]; pos = 3; }
    else if (h == 0xDD) {
        if (len < 5) return -1;
        n = ((Py_ssize_t)p[1] << 24) | ((Py_ssize_t)p[2] << 16) | ((Py_ssize_t)p[3] << 8) | p[4];
        pos = 5;
    } else return -1;
    if (n > len) return -1; /* every element takes at least one byte */
    uint64_t *t = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (!t) { PyErr_NoMemory(); return -2; }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (pos >= len) goto bad;
        unsigned char c = p[pos++];
        uint64_t v;
        int nb;
        if (c <= 0x7F) { t[i] = c; continue; }
        if (c >= 0xE0) { t[i] = (uint64_t)(int64_t)(int8_t)c; continue; }
        switch (c) {
            case 0xCC: case 0xD0: nb = 1; break;
            case 0xCD: case 0xD1: nb = 2; break;
            case 0xCE: case 0xD2: nb = 4; break;
            case 0xCF: case 0xD3: nb = 8; break;
            default: goto bad; /* not an int: the full decoder judges it */
        }
        if (pos + nb > len) goto bad;
        v = 0;
        for (int k = 0; k < nb; k++) v = (v << 8) | p[pos + k];
        pos += nb;
        if (c >= 0xD0 && nb < 8) { /* sign-extend signed ints */
            int sh = 64 - 8 * nb;
            v = (uint64_t)(((int64_t)(v << sh)) >> sh);
        }
        t[i] = v;
    }
    if (pos != len) goto bad;
    *out = t;
    return n;
bad:
    PyMem_RawFree(t);
    return -1;
}

/* Tokens from a list/tuple of ints or an integer buffer, as u64 (value mod 2^64, int64/u64 range only).
 * Returns count, -1 when the input is not something we handle (caller falls back), -2 on error. */
static Py_ssize_t tokens_u64(PyObject *obj, uint64_t **out) {
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
        PyObject **items = PySequence_Fast_ITEMS(obj);
        uint64_t *t = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(uint64_t));
        if (!t) { PyErr_NoMemory(); return -2; }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *o = items[i];
            if (!PyLong_Check(o)) { PyMem_RawFree(t); return -1; }
            int ovf = 0;
            long long v = PyLong_AsLongLongAndOverflow(o, &ovf);
            if (ovf || (v == -1 && PyErr_Occurred())) { PyErr_Clear(); PyMem_RawFree(t); return -1; }
            t[i] = (uint64_t)v;
        }
        *out = t;
        return n;
    }
    if (!PyObject_CheckBuffer(obj)) return -1;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) { PyErr_Clear(); return -1; }
    const char *f = view.format ? view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    char code = f[0];
    if (f[0] == 0 || f[1] != 0 || view.ndim != 1) { PyBuffer_Release(&view); return -1; }
    Py_ssize_t n = view.itemsize ? view.len / view.itemsize : 0;
    uint64_t *t = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (!t) { PyBuffer_Release(&view); PyErr_NoMemory(); return -2; }
    const char *b = view.buf;
    /* the item size the code promises must be the buffer's, or items would be read past its end */
    Py_ssize_t want = (code == 'b' || code == 'B') ? 1 : (code == 'h' || code == 'H') ? 2
                    : (code == 'i' || code == 'I') ? 4 : (code == 'l' || code == 'L' || code == 'q' || code == 'Q') ? 8 : 0;
    int ok = want != 0 && view.itemsize == want && view.len == n * want;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        const char *q = b + i * view.itemsize;
        switch (code) {
            case 'b': t[i] = (uint64_t)(int64_t)*(const int8_t *)q; break;
            case 'B': t[i] = *(const uint8_t *)q; break;
            case 'h': { int16_t v; memcpy(&v, q, 2); t[i] = (uint64_t)(int64_t)v; break; }
            case 'H': { uint16_t v; memcpy(&v, q, 2); t[i] = v; break; }
            case 'i': { int32_t v; memcpy(&v, q, 4); t[i] = (uint64_t)(int64_t)v; break; }
            case 'I': { uint32_t v; memcpy(&v, q, 4); t[i] = v; break; }
            case 'l': case 'q': { int64_t v; memcpy(&v, q, 8); t[i] = (uint64_t)v; break; }
            case 'L': case 'Q': { uint64_t v; memcpy(&v, q, 8); t[i] = v; break; }
            default: ok = 0;
        }
    }
    PyBuffer_Release(&view);
    if (!ok) { PyMem_RawFree(t); return -1; }
    *out = t;
    return n;
}

/* ---------------------------------------------------------------- request bodies -> u32 tokens
 * json_u32_array / msgpack_u32_array(raw, max_tokens) -> bytes of little-endian u32 | None.
 * `raw` is the msgspec.Raw of a request's `token_ids`. Only the plain valid case is answered: an
 * array of non-negative integers < 2^32, at most max_tokens of them. Anything else (floats, `1e3`,
 * booleans, negatives, `-0`, leading zeros, big ints, too many, not an array) gives None and the
 * caller decodes the body with the typed msgspec decoder, so every reject is judged, and worded,
 * exactly as before. */

static PyObject *u32_bytes(const uint64_t *t, Py_ssize_t n) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (!out) return NULL;
    uint32_t *o = (uint32_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) o[i] = (uint32_t)t[i];
    return out;
}

static inline int json_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

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
    q = json_u32_scan(q, end, (uint32_t *)PyBytes_AS_STRING(out), cap, &n);
    if (q) while (q < end && json_ws(*q)) q++;
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
    const unsigned char *base = view.buf, *q = base, *end = q + view.len, *a0 = NULL, *a1 = NULL;
    Py_ssize_t cap = view.len / 2 + 1, n = 0;
    if (cap > maxn) cap = maxn < 0 ? 0 : maxn;
    PyObject *out = PyBytes_FromStringAndSize(NULL, cap * 4);
    if (!out) { PyBuffer_Release(&view); return NULL; }
    while (q < end && json_ws(*q)) q++;
    if (q >= end || *q != '{') goto undecided;
    q++;
    for (;;) {
        while (q < end && json_ws(*q)) q++;
        if (q >= end || *q != '"') goto undecided; /* incl. '}' of an empty object: token_ids is required */
        int esc;
        const unsigned char *k0 = q + 1, *k1 = json_skip_string(q, end, &esc);
        if (!k1 || esc) goto undecided; /* an escaped key could alias "token_ids": the typed decoder judges */
        int is_tokens = k1 - 1 - k0 == 9 && memcmp(k0, "token_ids", 9) == 0;
        q = k1;
        while (q < end && json_ws(*q)) q++;
        if (q >= end || *q != ':') goto undecided;
        q++;
        while (q < end && json_ws(*q)) q++;
        if (is_tokens) {
            if (a0) goto undecided; /* repeated: the typed decoder says what that means */
            a0 = q;
            q = json_u32_scan(q, end, (uint32_t *)PyBytes_AS_STRING(out), cap, &n);
            if (!q) goto undecided;
            a1 = q;
        } else if (!(q = json_skip_value(q, end))) goto undecided;
        while (q < end && json_ws(*q)) q++;
        if (q < end && *q == ',') { q++; continue; }
        if (q < end && *q == '}') { q++; break; }
        goto undecided;
    }
    while (q < end && json_ws(*q)) q++;
    if (q != end || !a0) goto undecided;
    PyBuffer_Release(&view);
    out = u32_exact(out, n, cap);
    return out ? Py_BuildValue("(Nnn)", out, (Py_ssize_t)(a0 - base), (Py_ssize_t)(a1 - base)) : NULL;
undecided:
    PyBuffer_Release(&view);
    Py_DECREF(out);
    Py_RETURN_NONE;
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

static PyObject *py_msgpack_body_u32(PyObject *self, PyObject *args) {
    PyObject *body, *out = NULL;
    Py_ssize_t maxn;
    if (!PyArg_ParseTuple(args, "On", &body, &maxn)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(body, &view, PyBUF_SIMPLE) < 0) { PyErr_Clear(); Py_RETURN_NONE; }
    const unsigned char *base = view.buf, *p = base, *end = p + view.len, *a0 = NULL, *a1 = NULL;
    uint64_t npairs;
    if (p >= end) goto undecided;
    if ((*p & 0xF0) == 0x80) npairs = *p++ & 0x0F;
    else if (*p == 0xDE || *p == 0xDF) {
        int nb = *p == 0xDE ? 2 : 4;
        if (end - p < 1 + nb) goto undecided;
        npairs = be_uint(p + 1, nb);
        p += 1 + nb;
    } else goto undecided;
    if (npairs > (uint64_t)(end - p)) goto undecided;
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
        uint64_t n;
        unsigned char c = *p++;
        if ((c & 0xF0) == 0x90) n = c & 0x0F;
        else if (c == 0xDC || c == 0xDD) {
            int nb = c == 0xDC ? 2 : 4;
            if (end - p < nb) goto undecided;
            n = be_uint(p, nb);
            p += nb;
        } else goto undecided;
        if (n > (uint64_t)(end - p) || n > (uint64_t)(maxn < 0 ? 0 : maxn)) goto undecided;
        out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n * 4);
        if (!out) { PyBuffer_Release(&view); return NULL; }
        uint32_t *o = (uint32_t *)PyBytes_AS_STRING(out);
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
    PyBuffer_Release(&view);
    return Py_BuildValue("(Nnn)", out, (Py_ssize_t)(a0 - base), (Py_ssize_t)(a1 - base));
undecided:
    PyBuffer_Release(&view);
    Py_XDECREF(out);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- U64Map */

typedef struct {
    PyObject_HEAD
    uint64_t *tab; /* cap entries of (key, width value words); key 0 = empty slot. One array so a
                      lookup touches one cache line, not two. Values are little-endian words. */
    Py_ssize_t cap, used;
    int width;
    int pool; /* a value has held a shared-pool bit (bit 3 of a nibble) since the map was made: sticky,
                 so walk_multi may skip a shard whose workers are all out of a walk only when 0 */
    PyObject *other; /* dict for keys that are not ints in [1, 2^64) */
} U64Map;

#define POOL_BITS 0x8888888888888888ULL

static PyTypeObject U64MapType;
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

#define KEY(m, i) ((m)->tab[(size_t)(i) * (1 + (m)->width)])
#define VALS(m, i) ((m)->tab + (size_t)(i) * (1 + (m)->width) + 1)

/* Big tables get their own mapping: freed tables go back to the OS at once (no heap fragments
 * inflating RSS), and huge pages cut TLB misses on random probes. */
#define BIG_TABLE ((size_t)1 << 21)
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
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE); /* advice only: fine if refused */
#endif
    if (madvise(p, bytes, MADV_POPULATE_WRITE) != 0) {
        volatile char *c = p; /* zero already: a store of 0 per page only faults it in */
        for (size_t o = 0; o < bytes; o += 4096) c[o] = 0;
    }
    return p;
}

static void tab_free(uint64_t *t, Py_ssize_t cap, int width) {
    size_t bytes = (size_t)cap * (1 + width) * sizeof(uint64_t);
    if (bytes < BIG_TABLE) PyMem_RawFree(t);
    else munmap(t, bytes);
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

/* Memory latency dominates the map updates: the slots an event will touch are prefetched first. */
static inline void pf_slot(const U64Map *m, uint64_t k) {
    if (k) __builtin_prefetch(&KEY(m, slot_of(m, k)));
}

static int rehash(U64Map *m, Py_ssize_t ncap, int width) {
    uint64_t *ot = m->tab;
    Py_ssize_t ocap = m->cap, used = m->used;
    int ow = m->width;
    if (map_alloc(m, ncap, width) < 0) { m->tab = ot; m->cap = ocap; m->width = ow; m->used = used; return -1; }
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
        Py_ssize_t h = slot_of(m, e[0]), j = h >= ph && h <= pj ? pj + 1 : h;
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

/* Insert absent key k whose empty slot `find` gave as i (value zero); the slot it ends at (the table
 * may grow first). -1 on memory error. Lets a caller probe once for "get, else compute and insert". */
static Py_ssize_t insert_at(U64Map *m, Py_ssize_t i, uint64_t k) {
    if ((m->used + 1) * LOAD_DEN > m->cap * LOAD_NUM) {
        int f;
        if (rehash(m, m->cap + m->cap / GROW_DIV, m->width) < 0) return -1;
        i = find(m, k, &f);
    }
    place_at(m, i, k);
    m->used++;
    return i;
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

static PyObject *val_obj(const U64Map *m, Py_ssize_t i) {
    const uint64_t *v = VALS(m, i);
    int hi = m->width;
    while (hi > 1 && v[hi - 1] == 0) hi--;
    if (hi == 1) return PyLong_FromUnsignedLongLong(v[0]);
    PyObject *b = PyBytes_FromStringAndSize((const char *)v, 8 * (Py_ssize_t)hi);
    if (!b) return NULL;
    PyObject *r = PyObject_CallFunctionObjArgs(INT_FROM_BYTES, b, STR_LITTLE, NULL);
    Py_DECREF(b);
    return r;
}

static int widen(U64Map *m, int width) {
    if (width <= m->width) return 0;
    return rehash(m, m->cap, width);
}

/* Store a non-negative int value into slot i (widening as needed; the slot index may change). */
static int set_val(U64Map *m, uint64_t k, PyObject *v) {
    if (!PyLong_Check(v)) { PyErr_SetString(PyExc_TypeError, "U64Map values must be ints"); return -1; }
    if (int_sign(v) < 0) { PyErr_SetString(PyExc_ValueError, "U64Map values must be non-negative"); return -1; }
    uint64_t x = PyLong_AsUnsignedLongLong(v);
    if (!(x == (uint64_t)-1 && PyErr_Occurred())) { /* the common case: one word */
        int f;
        Py_ssize_t i = find_or_insert(m, k, &f);
        if (i < 0) return -1;
        uint64_t *dst = VALS(m, i);
        memset(dst, 0, sizeof(uint64_t) * m->width);
        dst[0] = x;
        if (x & POOL_BITS) m->pool = 1;
        return 0;
    }
    if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
    PyErr_Clear();
    PyObject *bl = PyObject_CallOneArg(INT_BIT_LENGTH, v);
    if (!bl) return -1;
    Py_ssize_t nbits = PyLong_AsSsize_t(bl);
    Py_DECREF(bl);
    if (nbits < 0) return -1;
    Py_ssize_t words = (nbits + 63) / 64; /* Py_ssize_t: never narrowed before the bound check */
    if (words > MAX_WIDTH) { PyErr_SetString(PyExc_OverflowError, "U64Map value wider than its bound"); return -1; }
    if (widen(m, (int)words) < 0) return -1;
    PyObject *b = PyObject_CallFunction(INT_TO_BYTES, "OnO", v, (Py_ssize_t)8 * m->width, STR_LITTLE);
    if (!b) return -1;
    if (!PyBytes_Check(b) || PyBytes_GET_SIZE(b) != (Py_ssize_t)8 * m->width) {
        Py_DECREF(b);
        PyErr_SetString(PyExc_SystemError, "int.to_bytes gave an unexpected result");
        return -1;
    }
    int f;
    Py_ssize_t i = find_or_insert(m, k, &f);
    if (i < 0) { Py_DECREF(b); return -1; }
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
    m->other = PyDict_New();
    if (!m->other || map_alloc(m, MIN_CAP, 1) < 0) { Py_DECREF(m); return NULL; }
    return (PyObject *)m;
}

static void U64Map_dealloc(U64Map *m) {
    if (m->tab) tab_free(m->tab, m->cap, m->width);
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
    tab_free(ot, ocap, ow);
    PyDict_Clear(m->other);
    Py_RETURN_NONE;
}

/* narrow() -> width: drop the value words no entry uses any more (residency words shrink again
 * when the workers of high slots go, docs/index-core.md). */
static PyObject *U64Map_narrow(U64Map *m, PyObject *u) {
    int need = 1;
    for (Py_ssize_t i = 0; i < m->cap && need < m->width; i++) {
        if (!KEY(m, i)) continue;
        const uint64_t *v = VALS(m, i);
        for (int w = m->width - 1; w >= need; w--) if (v[w]) { need = w + 1; break; }
    }
    if (need < m->width && rehash(m, m->cap, need) < 0) return NULL;
    return PyLong_FromLong(m->width);
}

static PyObject *U64Map_nbytes(U64Map *m, void *c) {
    return PyLong_FromSsize_t(sizeof(U64Map) + m->cap * (Py_ssize_t)sizeof(uint64_t) * (1 + m->width));
}
static PyObject *U64Map_width(U64Map *m, void *c) { return PyLong_FromLong(m->width); }

/* ---------------------------------------------------------------- event loops over maps */

/* ext-style lookup (values fit u64): 1 found, 0 absent, -1 error */
static int get_u64(U64Map *m, PyObject *key, uint64_t *out) {
    uint64_t k;
    int kind = key_u64(key, &k);
    if (kind < 0) return -1;
    if (kind) {
        int f;
        Py_ssize_t i = find(m, k, &f);
        if (f) *out = VALS(m, i)[0];
        return f;
    }
    PyObject *v = PyDict_GetItemWithError(m->other, key);
    if (!v) return PyErr_Occurred() ? -1 : 0;
    *out = PyLong_AsUnsignedLongLongMask(v);
    return (*out == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 1;
}

static int set_u64(U64Map *m, PyObject *key, uint64_t val) {
    uint64_t k;
    int kind = key_u64(key, &k);
    if (kind < 0) return -1;
    if (kind) { /* inline: no int object */
        int f;
        Py_ssize_t i = find_or_insert(m, k, &f);
        if (i < 0) return -1;
        uint64_t *dst = VALS(m, i);
        memset(dst, 0, sizeof(uint64_t) * m->width);
        dst[0] = val;
        if (val & POOL_BITS) m->pool = 1;
        return 0;
    }
    PyObject *v = PyLong_FromUnsignedLongLong(val);
    if (!v) return -1;
    int r = U64Map_ass(m, key, v);
    Py_DECREF(v);
    return r;
}

/* Residency bit `pos` of node `key`: read (op 0), set (op 1), clear (op 2). Returns the bit before
 * the op, -1 on error. Clearing may leave a node all-zero; `node_zero` / `node_drop` handle that. */
static int node_bit(U64Map *m, uint64_t key, int pos, int op) {
    int word = pos >> 6;
    uint64_t b = 1ULL << (pos & 63);
    if (key == 0) { /* rare: content key 0 lives in the side dict */
        gil_need();
        PyObject *ko = PyLong_FromUnsignedLongLong(0), *bit = NULL, *cur = NULL, *nv = NULL;
        int was = -1;
        if (!ko) return -1;
        cur = PyDict_GetItemWithError(m->other, ko);
        if (!cur && PyErr_Occurred()) goto out0;
        {
            PyObject *one = PyLong_FromLong(1), *po = PyLong_FromLong(pos);
            bit = (one && po) ? PyNumber_Lshift(one, po) : NULL;
            Py_XDECREF(one); Py_XDECREF(po);
        }
        if (!bit) goto out0;
        PyObject *andv = cur ? PyNumber_And(cur, bit) : PyLong_FromLong(0);
        if (!andv) goto out0;
        was = PyObject_IsTrue(andv);
        Py_DECREF(andv);
        if (op == 1 && !was) { nv = cur ? PyNumber_Or(cur, bit) : (Py_INCREF(bit), bit); if (!nv || PyDict_SetItem(m->other, ko, nv) < 0) was = -1; }
        if (op == 2 && was == 1) { nv = PyNumber_Xor(cur, bit); if (!nv || PyDict_SetItem(m->other, ko, nv) < 0) was = -1; }
    out0:
        Py_XDECREF(nv); Py_XDECREF(bit); Py_DECREF(ko);
        return was;
    }
    int f;
    Py_ssize_t i;
    if (op == 1) {
        if (word >= m->width && widen(m, word + 1) < 0) return -1;
        i = find_or_insert(m, key, &f);
        if (i < 0) return -1;
    } else {
        i = find(m, key, &f);
        if (!f || word >= m->width) return 0;
    }
    uint64_t *v = VALS(m, i) + word;
    int was = (*v & b) != 0;
    if (op == 1) { *v |= b; if ((pos & 3) == 3) m->pool = 1; }
    else if (op == 2) *v &= ~b;
    return was;
}

/* Worker nibble (4 bits at `shift`) of a node, and whether the node has any bit left. */
static int node_nibble(U64Map *m, uint64_t key, int shift, int *any) {
    if (key == 0) {
        gil_need();
        PyObject *ko = PyLong_FromUnsignedLongLong(0);
        if (!ko) return -1;
        PyObject *cur = PyDict_GetItemWithError(m->other, ko);
        Py_DECREF(ko);
        if (!cur) { *any = 0; return PyErr_Occurred() ? -1 : 0; }
        *any = PyObject_IsTrue(cur);
        PyObject *s = PyLong_FromLong(shift);
        PyObject *r = s ? PyNumber_Rshift(cur, s) : NULL;
        Py_XDECREF(s);
        if (!r) return -1;
        long nib = (long)(PyLong_AsUnsignedLongLongMask(r) & 0xF);
        Py_DECREF(r);
        return (int)nib;
    }
    int f;
    Py_ssize_t i = find(m, key, &f);
    if (!f) { *any = 0; return 0; }
    uint64_t *v = VALS(m, i);
    *any = 0;
    for (int w = 0; w < m->width; w++) if (v[w]) { *any = 1; break; }
    int word = shift >> 6;
    return word < m->width ? (int)((v[word] >> (shift & 63)) & 0xF) : 0;
}

/* tier_counts(ext, nodes, shift) -> (gpu, host, disk, shared) | None
 * Twin of ModelState.tier_counts: over the distinct content keys one worker maps (ext's values),
 * how many hold each of the 4 tier bits at `shift` in nodes. None when the maps hold what only the
 * Python core reads (multi-word ext values, a non-int value, content key 0 in nodes' side dict).
 * Why: /workers, /stats and /metrics count every worker's blocks under the index lock — ~100 ms
 * for 180k blocks in Python, a stall of ingestion and /score (docs/service.md). */
static PyObject *py_tier_counts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyObject_TypeCheck(args[0], &U64MapType) || !PyObject_TypeCheck(args[1], &U64MapType)) {
        PyErr_SetString(PyExc_TypeError, "tier_counts(ext: U64Map, nodes: U64Map, shift: int)");
        return NULL;
    }
    U64Map *ext = (U64Map *)args[0], *nodes = (U64Map *)args[1];
    long shift = PyLong_AsLong(args[2]);
    if (shift == -1 && PyErr_Occurred()) return NULL;
    if (shift < 0 || shift % 4 || ext->width != 1 || PyDict_GET_SIZE(nodes->other)) Py_RETURN_NONE;
    Py_ssize_t n = ext->used + PyDict_GET_SIZE(ext->other), k = 0;
    uint64_t *keys = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (!keys) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < ext->cap; i++)
        if (KEY(ext, i)) keys[k++] = VALS(ext, i)[0];
    Py_ssize_t pos = 0;
    PyObject *dk, *dv;
    while (PyDict_Next(ext->other, &pos, &dk, &dv)) {
        uint64_t v;
        int r = int_u64(dv, &v);
        if (r < 0) { PyMem_RawFree(keys); return NULL; }
        if (!r || k >= n) { PyMem_RawFree(keys); Py_RETURN_NONE; } /* 0 or not a u64: the Python core counts it */
        keys[k++] = v;
    }
    /* distinct keys (two engine hashes may name one block): a set at load <= 1/2, then compacted */
    size_t scap = 16;
    while (scap < 2 * (size_t)k) scap <<= 1;
    uint64_t *seen = PyMem_RawCalloc(scap, sizeof(uint64_t));
    if (!seen) { PyMem_RawFree(keys); return PyErr_NoMemory(); }
    Py_ssize_t u = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        uint64_t key = keys[j];
        if (!key) continue; /* content key 0 would live in nodes' side dict, which is empty here */
        size_t s = (size_t)((key * P_MUL) >> 32) & (scap - 1);
        while (seen[s] && seen[s] != key) s = (s + 1) & (scap - 1);
        if (!seen[s]) { seen[s] = key; keys[u++] = key; }
    }
    PyMem_RawFree(seen);
    Py_ssize_t counts[4] = {0, 0, 0, 0};
    int word = (int)(shift >> 6), bit = (int)(shift & 63);
    for (Py_ssize_t j = 0; j < u && word < nodes->width; j++) {
        if (j + 8 < u) pf_slot(nodes, keys[j + 8]); /* random probes: overlap their misses */
        int f;
        Py_ssize_t i = find(nodes, keys[j], &f);
        if (!f) continue;
        uint64_t nib = (VALS(nodes, i)[word] >> bit) & 0xF;
        for (int t = 0; t < 4; t++) counts[t] += (nib >> t) & 1;
    }
    PyMem_RawFree(keys);
    return Py_BuildValue("(nnnn)", counts[0], counts[1], counts[2], counts[3]);
}

static int node_drop(U64Map *m, uint64_t key) {
    if (key == 0) {
        gil_need();
        PyObject *ko = PyLong_FromUnsignedLongLong(0);
        if (!ko) return -1;
        int r = PyDict_Contains(m->other, ko);
        if (r == 1) r = PyDict_DelItem(m->other, ko);
        Py_DECREF(ko);
        return r < 0 ? -1 : 0;
    }
    int f;
    Py_ssize_t i = find(m, key, &f);
    if (f) erase(m, i);
    return 0;
}

/* Per-slot prefix match of chained keys (twin of indexer.core.scoring.walk). `slot[s]` are the worker
 * slots to score; fills per slot device / cached depth and the per-tier split of the cached blocks.
 * Returns 0, or -1 on memory error. */
typedef struct { Py_ssize_t dev, cach, sp[4]; } WRow;

/* The end of a walk: the last run counted for the workers still in it, whose depths it reached. */
static inline void finish_rows(WRow *rows, Py_ssize_t ns, const unsigned char *ac, const unsigned char *ad,
                               const unsigned char *ct, Py_ssize_t run, Py_ssize_t depth) {
    for (Py_ssize_t s = 0; s < ns; s++) if (ac[s]) rows[s].sp[ct[s]] += run;
    depth += run;
    for (Py_ssize_t s = 0; s < ns; s++) {
        if (ad[s]) rows[s].dev = depth;
        if (ac[s]) rows[s].cach = depth;
    }
}

static int walk_core(U64Map *m, const uint64_t *keys, Py_ssize_t nk, const Py_ssize_t *slot, Py_ssize_t ns, WRow *rows) {
    /* per slot: alive_c, alive_d, current tier */
    unsigned char *st = PyMem_RawCalloc((size_t)(ns ? ns : 1), 3);
    uint64_t *prev = PyMem_RawCalloc((size_t)m->width, sizeof(uint64_t));
    if (!st || !prev) { PyMem_RawFree(st); PyMem_RawFree(prev); PyErr_NoMemory(); return -1; }
    unsigned char *ac = st, *ad = st + ns, *ct = st + 2 * ns;
    memset(rows, 0, sizeof(WRow) * (size_t)ns);
    for (Py_ssize_t s = 0; s < ns; s++) ac[s] = ad[s] = 1;
    Py_ssize_t nalive = ns, depth = 0, run = 0;
    int W = m->width, have_prev = 0;
    enum { PF_AHEAD = 4 }; /* 8, 16, 24 measured no better (docs/index-core.md) */
    for (Py_ssize_t j = 0; j < nk && nalive; j++) {
        if (j + PF_AHEAD < nk) pf_slot(m, keys[j + PF_AHEAD]);
        uint64_t k = keys[j];
        int f = 0;
        Py_ssize_t i = k ? find(m, k, &f) : 0;
        if (!f) break; /* callers never pass key 0 (it lives in the side dict): Python walks those */
        const uint64_t *v = VALS(m, i);
        int same = have_prev;
        for (int w = 0; w < W && same; w++) same = v[w] == prev[w]; /* a word or two: no memcmp call */
        if (same) { run++; continue; }
        for (Py_ssize_t s = 0; s < ns; s++) if (ac[s]) rows[s].sp[ct[s]] += run;
        depth += run;
        run = 0;
        int pool = 0;
        for (int w = 0; w < W; w++) if (v[w] & 0x8888888888888888ULL) { pool = 1; break; }
        for (Py_ssize_t s = 0; s < ns; s++) {
            if (!ac[s]) continue;
            Py_ssize_t word = slot[s] >> 4;
            int nib = word < W ? (int)((v[word] >> (4 * (slot[s] & 15))) & 0xF) : 0;
            if (ad[s] && !(nib & 1)) { rows[s].dev = depth; ad[s] = 0; }
            if (!(nib & 7) && !pool) { rows[s].cach = depth; ac[s] = 0; nalive--; continue; }
            ct[s] = (nib & 1) ? 0 : (nib & 2) ? 1 : (nib & 4) ? 2 : 3;
        }
        memcpy(prev, v, sizeof(uint64_t) * W);
        have_prev = 1;
        run = 1;
    }
    finish_rows(rows, ns, ac, ad, ct, run, depth);
    PyMem_RawFree(st);
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
    unsigned char *st = PyMem_RawCalloc((size_t)(ns ? ns : 1), 3);
    /* per shard: this key's value (or NULL) and the previous run's (copied, found flag in pf) */
    const uint64_t **cur = PyMem_RawCalloc((size_t)nm, sizeof(uint64_t *));
    uint64_t *prev = PyMem_RawCalloc((size_t)(nm * W), sizeof(uint64_t));
    unsigned char *pf = PyMem_RawCalloc((size_t)nm, 1);
    /* A shard none of whose scored workers is still in the walk, and whose table never held a pool
     * bit, cannot change the outcome for the rest (a key only it holds ends the walk for them either
     * way): it is not probed. For one worker's document that is about one probe per key. */
    Py_ssize_t *talive = PyMem_RawCalloc((size_t)nm, sizeof(Py_ssize_t));
    if (!st || !cur || !prev || !pf || !talive) {
        PyMem_RawFree(st); PyMem_RawFree(cur); PyMem_RawFree(prev); PyMem_RawFree(pf); PyMem_RawFree(talive);
        PyErr_NoMemory();
        return -1;
    }
    unsigned char *ac = st, *ad = st + ns, *ct = st + 2 * ns;
    memset(rows, 0, sizeof(WRow) * (size_t)ns);
    for (Py_ssize_t s = 0; s < ns; s++) { ac[s] = ad[s] = 1; talive[slot[s] % nm]++; }
    Py_ssize_t nalive = ns, depth = 0, run = 0;
    int have_prev = 0;
    enum { PF_AHEAD = 4 };
    for (Py_ssize_t j = 0; j < nk && nalive; j++) {
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
            if (cur[t]) for (int w = 0; w < ms[t]->width && same; w++) same = cur[t][w] == prev[t * W + w];
        }
        if (same) { run++; continue; }
        for (Py_ssize_t s = 0; s < ns; s++) if (ac[s]) rows[s].sp[ct[s]] += run;
        depth += run;
        run = 0;
        int pool = 0;
        for (Py_ssize_t t = 0; t < nm && !pool; t++)
            if (cur[t]) for (int w = 0; w < ms[t]->width; w++) if (cur[t][w] & POOL_BITS) { pool = 1; break; }
        for (Py_ssize_t s = 0; s < ns; s++) {
            if (!ac[s]) continue;
            Py_ssize_t t = slot[s] % nm, l = slot[s] / nm, word = l >> 4;
            int nib = cur[t] && word < ms[t]->width ? (int)((cur[t][word] >> (4 * (l & 15))) & 0xF) : 0;
            if (ad[s] && !(nib & 1)) { rows[s].dev = depth; ad[s] = 0; }
            if (!(nib & 7) && !pool) { rows[s].cach = depth; ac[s] = 0; nalive--; talive[t]--; continue; }
            ct[s] = (nib & 1) ? 0 : (nib & 2) ? 1 : (nib & 4) ? 2 : 3;
        }
        for (Py_ssize_t t = 0; t < nm; t++) {
            pf[t] = cur[t] != NULL;
            if (cur[t]) memcpy(prev + t * W, cur[t], sizeof(uint64_t) * (size_t)ms[t]->width);
        }
        have_prev = 1;
        run = 1;
    }
    finish_rows(rows, ns, ac, ad, ct, run, depth);
    PyMem_RawFree(st); PyMem_RawFree(cur); PyMem_RawFree(prev); PyMem_RawFree(pf); PyMem_RawFree(talive);
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
        if (slot[s] < 0 || slot[s] >= MAX_SLOT) {
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

/* idx sorts by (-cached, rank): cached <= query blocks, so one integer key holds both */
static void rank_rows(const WRow *rows, Py_ssize_t ns, const double *wt, Py_ssize_t bs, Ranked *rk) {
    Py_ssize_t maxc = 0;
    for (Py_ssize_t s = 0; s < ns; s++) if (rows[s].cach > maxc) maxc = rows[s].cach;
    for (Py_ssize_t s = 0; s < ns; s++) {
        const Py_ssize_t *sp = rows[s].sp;
        double x = (double)sp[0] * wt[0] + (double)sp[1] * wt[1] + (double)sp[2] * wt[2] + (double)sp[3] * wt[3];
        rk[s].score = (double)bs * x;
        rk[s].idx = (maxc - rows[s].cach) * ns + s;
    }
    qsort(rk, (size_t)ns, sizeof(Ranked), ranked_cmp);
}

static PyObject *build_rows(const WRow *rows, Py_ssize_t ns, PyObject *wids, PyObject *ranks, const double *wt,
                            Py_ssize_t bs, PyObject *cls, PyObject *names) {
    Ranked *rk = PyMem_RawMalloc(sizeof(Ranked) * (size_t)(ns ? ns : 1));
    if (!rk) return PyErr_NoMemory();
    rank_rows(rows, ns, wt, bs, rk);
    PyObject *out = PyList_New(ns);
    if (!out) { PyMem_RawFree(rk); return NULL; }
    for (Py_ssize_t r = 0; r < ns; r++) {
        Py_ssize_t s = rk[r].idx % ns;
        const WRow *w = rows + s;
        PyObject *tiers = PyDict_New(), *args[6] = {NULL};
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
        PyObject *o = (args[2] && args[3] && args[5]) ? PyObject_Vectorcall(cls, args, 6, NULL) : NULL;
        Py_XDECREF(args[2]); Py_XDECREF(args[3]); Py_XDECREF(args[5]); Py_DECREF(tiers);
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

/* Block digests of u32 tokens (block_digest of the tokens widened to u64: the same values), the
 * scalar way and, where the CPU has it, 4 tokens at a time with AVX2 (x86-64 has no 64-bit vector
 * multiply below AVX-512: each 64x64 product is built from 32x32->64 ones; sums mod 2^64 do not
 * depend on order, so the digests are bit for bit the scalar ones). */
static inline uint64_t digest_fin(uint64_t acc) {
    acc ^= acc >> 29;
    acc *= K3;
    acc ^= acc >> 32;
    return acc;
}

static inline uint64_t digest_term(uint32_t v, uint64_t col) {
    uint64_t x = (uint64_t)v * K1 + col;
    x ^= x >> 31;
    return x * K2;
}

static void digests_u32(const unsigned char *b, Py_ssize_t nk, Py_ssize_t bs, const uint64_t *cols, uint64_t *dg) {
    for (Py_ssize_t j = 0; j < nk; j++) {
        const unsigned char *blk = b + (size_t)j * (size_t)bs * 4;
        uint64_t acc = 0;
        for (Py_ssize_t i = 0; i < bs; i++) {
            uint32_t v;
            memcpy(&v, blk + 4 * i, 4);
            acc += digest_term(v, cols[i]);
        }
        dg[j] = digest_fin(acc);
    }
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_AVX2_DIGESTS 1
__attribute__((target("avx2")))
static void digests_u32_avx2(const unsigned char *b, Py_ssize_t nk, Py_ssize_t bs, const uint64_t *cols, uint64_t *dg) {
    const __m256i k1lo = _mm256_set1_epi64x((long long)(K1 & 0xFFFFFFFFULL)), k1hi = _mm256_set1_epi64x((long long)(K1 >> 32));
    const __m256i k2lo = _mm256_set1_epi64x((long long)(K2 & 0xFFFFFFFFULL)), k2hi = _mm256_set1_epi64x((long long)(K2 >> 32));
    for (Py_ssize_t j = 0; j < nk; j++) {
        const unsigned char *blk = b + (size_t)j * (size_t)bs * 4;
        __m256i acc = _mm256_setzero_si256();
        Py_ssize_t i = 0;
        for (; i + 4 <= bs; i += 4) {
            __m256i t = _mm256_cvtepu32_epi64(_mm_loadu_si128((const __m128i *)(const void *)(blk + 4 * i)));
            /* t < 2^32: t * K1 = t * K1lo + (t * K1hi << 32) */
            __m256i x = _mm256_add_epi64(_mm256_mul_epu32(t, k1lo), _mm256_slli_epi64(_mm256_mul_epu32(t, k1hi), 32));
            x = _mm256_add_epi64(x, _mm256_loadu_si256((const __m256i *)(const void *)(cols + i)));
            x = _mm256_xor_si256(x, _mm256_srli_epi64(x, 31));
            /* x * K2 mod 2^64 = xlo * K2lo + ((xhi * K2lo + xlo * K2hi) << 32) */
            __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x, 32), k2lo), _mm256_mul_epu32(x, k2hi));
            acc = _mm256_add_epi64(acc, _mm256_add_epi64(_mm256_mul_epu32(x, k2lo), _mm256_slli_epi64(cross, 32)));
        }
        uint64_t lanes[4];
        _mm256_storeu_si256((__m256i *)(void *)lanes, acc);
        uint64_t a = lanes[0] + lanes[1] + lanes[2] + lanes[3];
        for (; i < bs; i++) {
            uint32_t v;
            memcpy(&v, blk + 4 * i, 4);
            a += digest_term(v, cols[i]);
        }
        dg[j] = digest_fin(a);
    }
}
#endif

/* The chained keys of a u32 token buffer (what the /score bodies become), hashed in place: the same
 * keys as tokens_u64 + block_digest without the u64 copy. 1: done (*k allocated, *zero set when a
 * key is 0); 0: not a 1-d u32 buffer (the general path reads it); -1: memory error. */
static int u32_keys(PyObject *toks, uint64_t seed, Py_ssize_t bs, uint64_t **kout, Py_ssize_t *nkout, int *zero) {
    if (PyList_Check(toks) || PyTuple_Check(toks) || !PyObject_CheckBuffer(toks)) return 0;
    Py_buffer view;
    if (PyObject_GetBuffer(toks, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) { PyErr_Clear(); return 0; }
    const char *f = view.format ? view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (f[0] != 'I' || f[1] != 0 || view.ndim != 1 || view.itemsize != 4 || view.len % 4) {
        PyBuffer_Release(&view);
        return 0;
    }
    Py_ssize_t nk = view.len / 4 / bs;
    uint64_t *k = PyMem_RawMalloc((size_t)(nk ? nk : 1) * sizeof(uint64_t));
    uint64_t *cols = col_table(bs);
    if (!k || !cols) { PyMem_RawFree(k); PyMem_RawFree(cols); PyBuffer_Release(&view); PyErr_NoMemory(); return -1; }
#ifdef HAVE_AVX2_DIGESTS
    if (bs >= 4 && __builtin_cpu_supports("avx2")) digests_u32_avx2(view.buf, nk, bs, cols, k);
    else digests_u32(view.buf, nk, bs, cols, k);
#else
    digests_u32(view.buf, nk, bs, cols, k);
#endif
    int z = 0;
    for (Py_ssize_t j = 0; j < nk; j++) { /* chain the digests in place */
        seed = seed * P_MUL + k[j];
        k[j] = seed;
        z |= !seed;
    }
    PyMem_RawFree(cols);
    PyBuffer_Release(&view);
    *kout = k;
    *nkout = nk;
    *zero = z;
    return 1;
}

/* The chained keys of a query's tokens (a u32 buffer hashed in place, else a list / tuple / int
 * buffer): 0 ok (*kout owned by the caller), 1 a key is 0 or the tokens are not ints (the Python walk
 * judges them), -1 error. */
static int tokens_keys(PyObject *toks, PyObject *seedo, Py_ssize_t bs, uint64_t **kout, Py_ssize_t *nkout) {
    uint64_t seed = PyLong_AsUnsignedLongLongMask(seedo);
    if (seed == (uint64_t)-1 && PyErr_Occurred()) return -1;
    uint64_t *k = NULL;
    Py_ssize_t nk = 0;
    int zero = 0, rc = u32_keys(toks, seed, bs, &k, &nk, &zero);
    if (rc < 0) return -1;
    if (rc == 0) {
        uint64_t *t = NULL;
        Py_ssize_t n = tokens_u64(toks, &t);
        if (n == -2) return -1;
        if (n < 0) return 1;
        nk = n / bs;
        k = PyMem_RawMalloc((size_t)(nk ? nk : 1) * sizeof(uint64_t));
        uint64_t *cols = col_table(bs);
        if (!k || !cols) { PyMem_RawFree(k); PyMem_RawFree(t); PyMem_RawFree(cols); PyErr_NoMemory(); return -1; }
        for (Py_ssize_t j = 0; j < nk; j++) { seed = seed * P_MUL + block_digest(t + j * bs, bs, 0, cols); k[j] = seed; zero |= !seed; }
        PyMem_RawFree(t);
        PyMem_RawFree(cols);
    }
    if (zero) { PyMem_RawFree(k); return 1; } /* key 0: the Python walk judges it */
    *kout = k;
    *nkout = nk;
    return 0;
}

/* Usable-prefix rows of hybrid workers (groupscore.py's twin): groups_walk.c. */
#include "groups_walk.c"

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
    lst = build_rows(rows, ns, widt, rankt, wt, bs, cls, names);
    if (lst) out = Py_BuildValue("(nN)", nk, lst);
done:
    Py_XDECREF(widt);
    Py_XDECREF(rankt);
    PyMem_RawFree(k);
    PyMem_RawFree(slot);
    PyMem_RawFree(rows);
    return out;
}

/* ---------------------------------------------------------------- /score answer bytes
 * write_answer(msgpack, layout, prefix, query_blocks, rows, heads, wix, statuses, seqs, status_map) -> bytes | None
 * The body `POST /score` answers, byte for byte what msgspec encodes for the ScoreResponse the Python
 * path builds (router_api/answer.py passes the pieces; tests/test_score_answer.py holds the two equal):
 *  - rows: packed PRow (score_rows with row type None), best first; heads[s] / wix[s] belong to the row
 *    of slot s; heads past the rows are registered pairs the index does not hold (zero rows, appended);
 *  - heads: the pre-encoded `worker_id` / `dp_rank` pairs (None or wix < 0: not registered, skipped);
 *  - wix: int32 per head, the row's worker in statuses / seqs (its liveness status and last_seq);
 *  - status_map: status str -> (encoded status, is stale); layout: the pre-encoded keys and punctuation.
 * Rows are ordered like the Python path: fresh before stale, each by score descending, stable.
 * None (the caller encodes with msgspec): a non-finite score, a status or last_seq it does not know. */
enum { L_ROW_OPEN, L_DEV, L_CACH, L_TIERS, L_HOST, L_DISK, L_SHARED, L_SCORE, L_STALE, L_SEQ, L_STATUS,
       L_ROW_CLOSE, L_WORKERS, L_AFTER, L_END, L_BEST_OPEN, L_BEST_CLOSE, L_SEP, L_NULL, L_TRUE, L_FALSE, L_COUNT };

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
    Py_buffer rows, wixb;
    if (!PyArg_ParseTuple(args, "pO!O!ny*O!y*O!O!O!", &mp, &PyTuple_Type, &layout, &PyBytes_Type, &prefix, &qb, &rows,
                          &PyTuple_Type, &heads, &wixb, &PyList_Type, &statuses, &PyList_Type, &seqs, &PyDict_Type, &smap))
        return NULL;
    PyObject *out = NULL;
    ARow *ar = NULL;
    int64_t *seq = NULL;
    PyObject **senc = NULL;
    char *stl = NULL;
    Py_ssize_t nrows = rows.len / (Py_ssize_t)sizeof(PRow), nh = PyTuple_GET_SIZE(heads);
    Py_ssize_t nw = PyList_GET_SIZE(statuses), na = 0;
    const int32_t *wix = wixb.buf;
    int ok = rows.len % (Py_ssize_t)sizeof(PRow) == 0 && PyTuple_GET_SIZE(layout) == L_COUNT && nh >= nrows &&
             wixb.len == nh * 4 && PyList_GET_SIZE(seqs) == nw && qb >= 0;
    for (Py_ssize_t i = 0; ok && i < L_COUNT; i++) ok = PyBytes_CheckExact(PyTuple_GET_ITEM(layout, i));
    if (!ok) goto none;
    ar = PyMem_RawMalloc(sizeof(ARow) * (size_t)(nh ? nh : 1));
    seq = PyMem_RawMalloc(sizeof(int64_t) * (size_t)(nw ? nw : 1));
    senc = PyMem_RawMalloc(sizeof(PyObject *) * (size_t)(nw ? nw : 1));
    stl = PyMem_RawMalloc((size_t)(nw ? nw : 1));
    if (!ar || !seq || !senc || !stl) { PyErr_NoMemory(); goto done; }
    /* per worker: its encoded status, stale flag and last_seq (-1 in stl[]: None). Exact str keys only,
     * so the dict lookup runs no Python code; nothing below does, so the borrowed bytes stay valid. */
    for (Py_ssize_t i = 0; i < nw; i++) {
        PyObject *st = PyList_GET_ITEM(statuses, i), *sq = PyList_GET_ITEM(seqs, i);
        if (!PyUnicode_CheckExact(st)) goto none;
        PyObject *v = PyDict_GetItemWithError(smap, st);
        if (!v) { if (PyErr_Occurred()) goto done; goto none; }
        if (!PyTuple_CheckExact(v) || PyTuple_GET_SIZE(v) != 2 || !PyBytes_CheckExact(PyTuple_GET_ITEM(v, 0))) goto none;
        senc[i] = PyTuple_GET_ITEM(v, 0);
        stl[i] = (char)(PyTuple_GET_ITEM(v, 1) == Py_True);
        if (sq == Py_None) { stl[i] |= 2; seq[i] = 0; continue; }
        if (!PyLong_CheckExact(sq)) goto none;
        int ovf = 0;
        long long x = PyLong_AsLongLongAndOverflow(sq, &ovf);
        if (ovf) goto none;
        if (x == -1 && PyErr_Occurred()) goto done;
        seq[i] = x;
    }
    const PRow *pr = rows.buf;
    for (Py_ssize_t r = 0; r < nh; r++) { /* the index's rows best first, then the pairs it does not hold */
        Py_ssize_t h = r;
        const PRow *p = NULL;
        if (r < nrows) {
            p = pr + r;
            if (p->s < 0 || p->s >= nrows) goto none;
            h = (Py_ssize_t)p->s;
        }
        int32_t w = wix[h];
        if (w < 0) continue;
        if (w >= nw || !PyBytes_CheckExact(PyTuple_GET_ITEM(heads, h))) goto none;
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
                       LEN(L_SEQ) + LEN(L_NULL) + LEN(L_STATUS) + LEN(L_ROW_CLOSE) + 7 * INT_MAX_CHARS + DBL_MAX_CHARS;
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
    Py_ssize_t best = -1;
    for (Py_ssize_t i = 0; i < na; i++) {
        const ARow *a = ar + i;
        const PRow *p = a->p;
        if (best < 0 && !a->stale && a->score > 0) best = i;
        if (i) q = put_obj(q, LY(L_SEP));
        q = put_obj(q, LY(L_ROW_OPEN));
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
    PyBuffer_Release(&rows);
    PyBuffer_Release(&wixb);
    return out;
}

/* The payload reader of the whole-batch fast path (both event forms): wire_walk.c. */
#include "wire_walk.c"

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
    const struct GLay_ *gl; Py_ssize_t ngl; /* that layout's groups (groups_apply.c) */
    Py_ssize_t stored[4][3], removed[4][2], cleared, drops[N_DROPS];
    Py_ssize_t gstored[4][3], gremoved[4][2];
} FCtx;

/* Twin of apply._attach (no cancellations: the fast path only runs with no pending orphans). */
static int fp_attach(FCtx *c, const HRef *hs, Py_ssize_t n, uint64_t state, const uint64_t *toks, int tier) {
    int pos = c->shift + tier;
    uint64_t stackbuf[128], *dg = NULL;
    if (toks) {
        /* digests up front; the chain they give is every node key when the blocks are new */
        dg = n <= 128 ? stackbuf : PyMem_RawMalloc((size_t)n * sizeof(uint64_t));
        if (!dg) { gil_need(); PyErr_NoMemory(); return -1; }
        uint64_t s = state;
        for (Py_ssize_t j = 0; j < n; j++) {
            if (!hs[j].b) pf_slot(c->ext, hs[j].k);
            dg[j] = block_digest(toks + j * c->bs, c->bs, 0, c->cols);
            s = s * P_MUL + dg[j];
            pf_slot(c->nodes, s);
        }
    }
    int rc = -1;
    for (Py_ssize_t j = 0; j < n; j++) {
        const HRef *h = hs + j;
        uint64_t key;
        int r;
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
        int was = node_bit(c->nodes, key, pos, 1);
        if (was < 0) goto out;
        c->stored[tier][was ? 1 : is_new ? 0 : 2]++;
    }
    rc = 0;
out:
    if (dg && dg != stackbuf) PyMem_RawFree(dg);
    return rc;
}

/* Twin of apply._store. 0 done, 1 orphan (nothing of this event applied), -1 error. */
static int fp_store(FCtx *c, const FEv *e, const HRef *hs, const uint64_t *toks) {
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
        return fp_attach(c, hs, n, 0, NULL, e->tier);
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
    return fp_attach(c, hs, nfull, state, toks, e->tier);
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

/* Group events of a known layout, and where the walk stops for the pure core: groups_apply.c. */
#include "groups_apply.c"

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
        if (group_event(c, e, &g)) { *stop = i; break; }
        /* no arithmetic on NULL: an event (or a whole batch) without hashes or tokens passes NULL */
        const HRef *hs = e->nh ? b->h + e->h0 : NULL;
        const uint64_t *ts = e->nt ? b->t + e->t0 : NULL;
        int r = g ? (e->type == EV_STORED ? gp_store(c, g, e, hs, ts) : gp_remove(c, g, e, hs))
              : e->type == EV_STORED ? fp_store(c, e, hs, ts)
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
                             "want_rank", "default_rank", "groups", NULL};
    PyObject *payload, *knowno, *seedo, *wanto = Py_None, *groupso = Py_None;
    U64Map *ext, *nodes;
    int shift;
    Py_ssize_t bs, limit, defrank = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO!O!OinOn|OnO", kwlist, &payload, &U64MapType, &ext, &U64MapType,
                                     &nodes, &knowno, &shift, &bs, &seedo, &limit, &wanto, &defrank, &groupso))
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
    Py_ssize_t stop = -1;
    if (!counts || !drops) goto done;
    int rc = parse_batch(view.buf, view.len, bs, &b, &hd);
    if (rc) { if (rc > 0) { out = Py_None; Py_INCREF(out); } goto done; }
    if (ranked && hd.rank_kind == 3) { out = Py_None; Py_INCREF(out); goto done; } /* Python keeps big ints exact */
    long long rank = hd.rank_kind == 1 ? (long long)hd.rank : (long long)defrank;
    if (ranked && (rank != want || b.nev == 0)) goto result; /* nothing to apply to these maps */
    if (!(cols = col_table(bs))) goto done;
    c.ext = ext; c.nodes = nodes; c.known = known; c.shift = shift; c.bs = bs; c.limit = limit; c.seed = seed; c.cols = cols;
    c.layout = groupso != Py_None; c.gl = gl; c.ngl = ngl;
    if (walk_events(&c, &b, &stop) < 0 || tally_dicts(&c, counts, drops) < 0) goto done;
result:
    out = Py_BuildValue("(nOOdLn)", stop, counts, drops, hd.ts, rank, b.nev);
done:
    Py_XDECREF(counts);
    Py_XDECREF(drops);
    PyMem_RawFree(cols);
    PyMem_RawFree(b.ev);
    PyMem_RawFree(b.h);
    PyMem_RawFree(b.t);
    PyMem_RawFree(gl);
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
    b->nev = b->nh = b->nt = 0;
    return parse_batch((const unsigned char *)PyBytes_AS_STRING(p), PyBytes_GET_SIZE(p), bs, b, hd);
}

static PyObject *py_apply_msgpack_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11 && nargs != 12) { PyErr_SetString(PyExc_TypeError, "apply_msgpack_run takes 11 or 12 positional arguments"); return NULL; }
    PyObject *groupso = nargs == 12 ? args[11] : Py_None;
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
    double last_ts = 0.0;
    Py_ssize_t k = 0, n = 0, nev = 0;
    /* a tuple: nobody can change what the walk reads while it runs without the GIL */
    if (!counts || !drops || !(items = PyList_AsTuple(payloads))) goto done;
    n = PyTuple_GET_SIZE(items);
    /* a slot position outside [0, MAX_SLOT) would shift past any word, or widen a map without bound */
    if (bs <= 0 || shiftl < 0 || shiftl % 4 || shiftl / 4 >= MAX_SLOT || (int)shiftl != shiftl || grc) n = 0;
    if (n) {
        if (!(cols = col_table(bs))) goto done;
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
        c.seed = seed; c.cols = cols; c.layout = groupso != Py_None; c.gl = gl; c.ngl = ngl;
        Py_ssize_t stop;
        if (walk_events(&c, &b, &stop) < 0) goto done;
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
    PyMem_RawFree(b.t);
    PyMem_RawFree(gl);
    return out;
}

/* ---------------------------------------------------------------- tables, for the import-time check */

static PyObject *str_tuple(const char *const *xs, Py_ssize_t n) {
    PyObject *t = PyTuple_New(n);
    for (Py_ssize_t i = 0; t && i < n; i++) {
        PyObject *s = PyUnicode_FromString(xs[i]);
        if (!s) { Py_CLEAR(t); break; }
        PyTuple_SET_ITEM(t, i, s);
    }
    return t;
}

static Py_ssize_t field_count(unsigned mask) {
    Py_ssize_t n = 0;
    while (n < F_N && (mask & FB(n))) n++;
    return n;
}

/* wire_tables() -> dict, the shape of indexer._native.wire.tables() */
static PyObject *py_wire_tables(PyObject *self, PyObject *unused) {
    const char *removed[F_N];
    Py_ssize_t nr = 0;
    for (int f = 0; f < F_N; f++) if (ALLOWED[EV_REMOVED] & FB(f)) removed[nr++] = FIELD_NAMES[f];
    PyObject *media = PyTuple_New(N_MEDIA);
    for (int i = 0; media && i < N_MEDIA; i++) {
        PyObject *e = Py_BuildValue("(si)", MEDIA[i].name, MEDIA[i].tier);
        if (!e) { Py_CLEAR(media); break; }
        PyTuple_SET_ITEM(media, i, e);
    }
    if (!media) return NULL;
    return Py_BuildValue(
        "{s:N,s:N,s:n,s:N,s:n,s:N,s:N,s:N,s:N,s:(KKKKK),s:O,s:O}",
        "tags", str_tuple(EVENT_TAGS, 3),
        "stored_fields", str_tuple(FIELD_NAMES, F_N), "stored_required", field_count(REQUIRED[EV_STORED]),
        "removed_fields", str_tuple(removed, nr), "removed_required", field_count(REQUIRED[EV_REMOVED]),
        "media", media, "medium_names", str_tuple(MEDIUM_NAMES, 4),
        "full_markers", str_tuple(FULL_MARKERS, N_FULL), "not_full_markers", str_tuple(NOT_FULL_MARKERS, N_NOT_FULL),
        "hash_consts", (unsigned long long)P_MUL, (unsigned long long)K1, (unsigned long long)K2,
        (unsigned long long)K3, (unsigned long long)EXTRA_SALT,
        "count_keys", COUNT_KEY_OBJS, "drops", DROP_KEY_OBJS);
}

/* declines() -> {reason: payloads} the whole-batch walk declined since import (wire_walk.c) */
static PyObject *py_declines(PyObject *self, PyObject *unused) {
    PyObject *d = PyDict_New();
    for (int i = 0; d && i < N_DECL; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(__atomic_load_n(&DECLINES[i], __ATOMIC_RELAXED));
        if (!v || PyDict_SetItemString(d, DECL_NAMES[i], v) < 0) { Py_XDECREF(v); Py_CLEAR(d); break; }
        Py_DECREF(v);
    }
    return d;
}

static int build_key_objs(void) {
    COUNT_KEY_OBJS = PyTuple_New(N_COUNT_KEYS);
    if (!COUNT_KEY_OBJS) return -1;
    for (int i = 0; i < N_COUNT_KEYS; i++) {
        PyObject *k = str_tuple(COUNT_KEYS[i], 3);
        if (!k) return -1;
        PyTuple_SET_ITEM(COUNT_KEY_OBJS, i, k);
    }
    DROP_KEY_OBJS = str_tuple(DROP_NAMES, N_DROPS);
    return DROP_KEY_OBJS ? 0 : -1;
}

static PyMethodDef U64Map_methods[] = {
    {"get", (PyCFunction)(void (*)(void))U64Map_get, METH_FASTCALL, "get(key, default=None)"},
    {"keys", (PyCFunction)U64Map_keys, METH_NOARGS, "list of keys"},
    {"values", (PyCFunction)U64Map_values, METH_NOARGS, "list of values"},
    {"items", (PyCFunction)U64Map_items, METH_NOARGS, "list of (key, value)"},
    {"clear", (PyCFunction)U64Map_clear, METH_NOARGS, "remove everything"},
    {"narrow", (PyCFunction)U64Map_narrow, METH_NOARGS, "drop unused value words; returns the width"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef U64Map_getset[] = {
    {"nbytes", (getter)U64Map_nbytes, NULL, "bytes held by the inline table (side dict excluded)", NULL},
    {"width", (getter)U64Map_width, NULL, "64-bit words per value", NULL},
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

static PyMethodDef module_methods[] = {
    {"apply_msgpack", (PyCFunction)(void (*)(void))py_apply_msgpack, METH_VARARGS | METH_KEYWORDS,
     "apply the common case of one worker's raw batch to its maps"},
    {"tier_counts", (PyCFunction)(void (*)(void))py_tier_counts, METH_FASTCALL,
     "blocks per tier one worker holds (ModelState.tier_counts)"},
    {"apply_msgpack_run", (PyCFunction)(void (*)(void))py_apply_msgpack_run, METH_FASTCALL,
     "apply a run of one worker's raw batches, stopping before the first the common case does not cover"},
    {"score_rows", (PyCFunction)(void (*)(void))py_score_rows, METH_VARARGS | METH_KEYWORDS,
     "score, rank and build the result rows"},
    {"write_answer", py_write_answer, METH_VARARGS, "the /score answer bytes (JSON or msgpack) from packed rows"},
    {"json_u32_array", py_json_u32_array, METH_VARARGS, "u32 tokens from a raw JSON int array"},
    {"json_body_u32", py_json_body_u32, METH_VARARGS, "u32 tokens and their span from a whole JSON request body"},
    {"msgpack_body_u32", py_msgpack_body_u32, METH_VARARGS, "u32 tokens and their span from a whole msgpack request body"},
    {"msgpack_u32_array", py_msgpack_u32_array, METH_VARARGS, "u32 tokens from a raw msgpack int array"},
    {"wire_tables", py_wire_tables, METH_NOARGS, "the generated wire tables this module was built with"},
    {"hybrid_rows", (PyCFunction)(void (*)(void))py_hybrid_rows, METH_FASTCALL,
     "usable-prefix rows (dev, cached, kv, gpu, host, disk, shared) of workers with a hybrid layout"},
    {"declines", py_declines, METH_NOARGS, "payloads the whole-batch walk declined since import, per reason"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_kvnative", "kvatlas index accelerator", -1, module_methods};

static int int_helpers(void) {
    PyObject *t = (PyObject *)&PyLong_Type;
    INT_FROM_BYTES = PyObject_GetAttrString(t, "from_bytes");
    INT_TO_BYTES = INT_FROM_BYTES ? PyObject_GetAttrString(t, "to_bytes") : NULL;
    INT_BIT_LENGTH = INT_TO_BYTES ? PyObject_GetAttrString(t, "bit_length") : NULL;
    STR_LITTLE = INT_BIT_LENGTH ? PyUnicode_InternFromString("little") : NULL;
    return STR_LITTLE ? 0 : -1;
}

PyMODINIT_FUNC PyInit__kvnative(void) {
#ifdef HAVE_AVX2_DIGESTS
    __builtin_cpu_init(); /* before __builtin_cpu_supports, which may run before libgcc's constructor */
#endif
    if (PyType_Ready(&U64MapType) < 0 || build_key_objs() < 0 || int_helpers() < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&U64MapType);
    if (PyModule_AddObject(m, "U64Map", (PyObject *)&U64MapType) < 0) { Py_DECREF(&U64MapType); Py_DECREF(m); return NULL; }
    return m;
}

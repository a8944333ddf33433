/* Page-hash chains in one call per insert (docs/producer-events.md).
 *
 * Page i's digest = H(digest of page i-1 || page i's token ids as u32 little-endian); the event id
 * is the digest's first 8 bytes read big-endian as a signed int64. Identical results to the
 * pure-Python reference in producer/page_hash.py (a test compares both).
 *
 * SHA-256 is implemented here from FIPS 180-4 so the module builds with gcc and Python headers
 * only (no libssl-dev). On x86-64 with the SHA extensions the compression function uses them
 * (chosen once at import via cpuid); everywhere else the portable C version runs.
 *
 *   sha256_chain(tokens, page_size, prior=None) -> (list[bytes], list[int])
 *   sha256_chain_portable(...)                  -> same, never the SHA-extension path (tests)
 *   sha256_blob(tokens, page_size, prior=None)  -> bytes, the digests concatenated (the tree keeps this)
 *   ids_of(digests, dlen)                       -> list[int], the event ids of concatenated digests
 *   call_chain(fn, tokens, page_size, prior=None) -> same, digest = fn(prior || page) (xxh3 etc.)
 *   encode_batch(ts, records, dp_rank, store_t, removed_t, cleared_t) -> bytes, a whole batch
 *   SHA_EXTENSIONS: bool                        -> whether sha256_chain uses the CPU's SHA unit
 *
 * `tokens`: a tuple/list of ints (each must fit u32: OverflowError otherwise, TypeError for
 * non-ints) or a bytes-like object of u32 little-endian. Only whole pages are read: a partial
 * trailing page is ignored, exactly like the Python reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_X86_SHA 1
#include <cpuid.h>
#include <immintrin.h>
#endif

/* ---------------------------------------------------------------------------------------------
 * SHA-256 (FIPS 180-4)
 */

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static const uint32_t H0[8] = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
};

typedef void (*compress_fn)(uint32_t state[8], const uint8_t *data, size_t blocks);

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void compress_portable(uint32_t state[8], const uint8_t *data, size_t blocks) {
    uint32_t w[64];
    while (blocks--) {
        for (int t = 0; t < 16; t++) {
            const uint8_t *p = data + 4 * t;
            w[t] = ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
        }
        for (int t = 16; t < 64; t++) {
            uint32_t s0 = ROR(w[t - 15], 7) ^ ROR(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = ROR(w[t - 2], 17) ^ ROR(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
        uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
        for (int t = 0; t < 64; t++) {
            uint32_t t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K256[t] + w[t];
            uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g; g = f; f = e; e = d + t1;
            d = c; c = b; b = a; a = t1 + t2;
        }
        state[0] += a; state[1] += b; state[2] += c; state[3] += d;
        state[4] += e; state[5] += f; state[6] += g; state[7] += h;
        data += 64;
    }
}

#ifdef HAVE_X86_SHA
/* The same compression with the x86 SHA extensions: rnds2 does two rounds on the state held as
 * (ABEF, CDGH); msg1/msg2 compute the message schedule four words at a time. Written out in full
 * (macros, four named schedule registers) so nothing spills to memory: the chain is serial, so
 * the latency of one block is the cost. */
#define SHA_RNDS4(g, m) do {                                                    \
        __m128i k_ = _mm_add_epi32((m), _mm_loadu_si128((const __m128i *)&K256[4 * (g)])); \
        st1 = _mm_sha256rnds2_epu32(st1, st0, k_);                              \
        st0 = _mm_sha256rnds2_epu32(st0, st1, _mm_shuffle_epi32(k_, 0x0E));     \
    } while (0)
/* w[g] from w[g-4] (a, overwritten), w[g-3] (b), w[g-2] (c), w[g-1] (d). */
#define SHA_SCHED(a, b, c, d) \
    (a) = _mm_sha256msg2_epu32(_mm_add_epi32(_mm_sha256msg1_epu32((a), (b)), _mm_alignr_epi8((d), (c), 4)), (d))
#define SHA_STEP(g, a, b, c, d) do { SHA_SCHED(a, b, c, d); SHA_RNDS4(g, a); } while (0)

__attribute__((target("sha,sse4.1,ssse3")))
static void compress_shani(uint32_t state[8], const uint8_t *data, size_t blocks) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i tmp = _mm_loadu_si128((const __m128i *)&state[0]);   /* ABCD (a in the low lane) */
    __m128i st1 = _mm_loadu_si128((const __m128i *)&state[4]);   /* EFGH */
    tmp = _mm_shuffle_epi32(tmp, 0xB1);                          /* CDAB */
    st1 = _mm_shuffle_epi32(st1, 0x1B);                          /* EFGH reversed: HGFE */
    __m128i st0 = _mm_alignr_epi8(tmp, st1, 8);                  /* ABEF */
    st1 = _mm_blend_epi16(st1, tmp, 0xF0);                       /* CDGH */
    while (blocks--) {
        const __m128i save0 = st0, save1 = st1;
        __m128i m0 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 0)), bswap);
        __m128i m1 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 16)), bswap);
        __m128i m2 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 32)), bswap);
        __m128i m3 = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(data + 48)), bswap);
        SHA_RNDS4(0, m0);
        SHA_RNDS4(1, m1);
        SHA_RNDS4(2, m2);
        SHA_RNDS4(3, m3);
        SHA_STEP(4, m0, m1, m2, m3);
        SHA_STEP(5, m1, m2, m3, m0);
        SHA_STEP(6, m2, m3, m0, m1);
        SHA_STEP(7, m3, m0, m1, m2);
        SHA_STEP(8, m0, m1, m2, m3);
        SHA_STEP(9, m1, m2, m3, m0);
        SHA_STEP(10, m2, m3, m0, m1);
        SHA_STEP(11, m3, m0, m1, m2);
        SHA_STEP(12, m0, m1, m2, m3);
        SHA_STEP(13, m1, m2, m3, m0);
        SHA_STEP(14, m2, m3, m0, m1);
        SHA_STEP(15, m3, m0, m1, m2);
        st0 = _mm_add_epi32(st0, save0);
        st1 = _mm_add_epi32(st1, save1);
        data += 64;
    }
    tmp = _mm_shuffle_epi32(st0, 0x1B);                          /* FEBA */
    st1 = _mm_shuffle_epi32(st1, 0xB1);                          /* DCHG */
    st0 = _mm_blend_epi16(tmp, st1, 0xF0);                       /* DCBA */
    st1 = _mm_alignr_epi8(st1, tmp, 8);                          /* EFGH in memory order */
    _mm_storeu_si128((__m128i *)&state[0], st0);
    _mm_storeu_si128((__m128i *)&state[4], st1);
}

static int cpu_has_sha(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    if (!(c & (1u << 9)) || !(c & (1u << 19))) return 0;       /* SSSE3, SSE4.1 */
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b >> 29) & 1;                                      /* SHA */
}
#endif

/* Digest of prior || page in one go: the message is at most a few blocks, so it is laid out in a
 * stack buffer with its padding and compressed once. */
static void sha256_two(compress_fn compress, const uint8_t *prior, size_t plen, const uint8_t *page,
                       size_t len, uint8_t *out, uint8_t *scratch) {
    uint32_t st[8];
    memcpy(st, H0, sizeof st);
    size_t total = plen + len;
    size_t nblocks = (total + 9 + 63) / 64;
    if (plen) memcpy(scratch, prior, plen);
    memcpy(scratch + plen, page, len);
    memset(scratch + total, 0, nblocks * 64 - total);
    scratch[total] = 0x80;
    uint64_t bits = (uint64_t)total * 8;
    for (int i = 0; i < 8; i++) scratch[nblocks * 64 - 1 - i] = (uint8_t)(bits >> (8 * i));
    compress(st, scratch, nblocks);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(st[i] >> 24);
        out[4 * i + 1] = (uint8_t)(st[i] >> 16);
        out[4 * i + 2] = (uint8_t)(st[i] >> 8);
        out[4 * i + 3] = (uint8_t)st[i];
    }
}

/* ---------------------------------------------------------------------------------------------
 * Arguments
 */

/* The whole pages of `tokens` as u32 little-endian bytes. Sets *owned when the buffer must be
 * freed with PyMem_Free; for a bytes-like input it points into `view` (released by the caller). */
typedef struct {
    const uint8_t *data;
    Py_ssize_t npages;
    uint8_t *owned;
    Py_buffer view;
    int has_view;
} Pages;

static void pages_release(Pages *p) {
    if (p->owned) PyMem_Free(p->owned);
    if (p->has_view) PyBuffer_Release(&p->view);
}

/* A non-negative int below 2^30 read without a call (most token ids): 1 when it applied. Only
 * where the int layout is known (3.11: ob_size/ob_digit; 3.12+: the compact-value API). */
static inline int small_nonneg(PyObject *o, unsigned long *v) {
    if (!PyLong_CheckExact(o)) return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)o)) return 0;
    Py_ssize_t c = PyUnstable_Long_CompactValue((PyLongObject *)o);
    if (c < 0) return 0;
    *v = (unsigned long)c;
    return 1;
#elif PY_VERSION_HEX >= 0x030B0000 && PYLONG_BITS_IN_DIGIT == 30
    Py_ssize_t sz = Py_SIZE(o);
    if (sz == 0) { *v = 0; return 1; }
    if (sz == 1) { *v = ((PyLongObject *)o)->ob_digit[0]; return 1; }
    return 0;
#else
    return 0;
#endif
}

static int pages_from(PyObject *tokens, Py_ssize_t page_size, Pages *out) {
    memset(out, 0, sizeof *out);
    if (page_size <= 0) {
        PyErr_Format(PyExc_ValueError, "page_size must be positive, got %zd", page_size);
        return -1;
    }
    if (!PyList_Check(tokens) && !PyTuple_Check(tokens) && PyObject_CheckBuffer(tokens)) {
        if (PyObject_GetBuffer(tokens, &out->view, PyBUF_SIMPLE) < 0) return -1;
        out->has_view = 1;
        if (out->view.len % 4) {
            PyErr_SetString(PyExc_ValueError, "a token buffer must hold u32 values (length a multiple of 4)");
            pages_release(out);
            return -1;
        }
        out->npages = (out->view.len / 4) / page_size;
        out->data = out->view.buf;
        return 0;
    }
    PyObject *seq = PySequence_Fast(tokens, "tokens must be a sequence of ints or a u32 buffer");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    out->npages = n / page_size;
    Py_ssize_t nt = out->npages * page_size;
    out->owned = PyMem_Malloc(nt > 0 ? (size_t)nt * 4 : 1);
    if (out->owned == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < nt; i++) {
        PyObject *o = items[i];
        unsigned long v;
        if (small_nonneg(o, &v)) {
            /* v < 2^30: fits u32 */
        } else if (PyLong_Check(o)) {
            v = PyLong_AsUnsignedLong(o);  /* OverflowError for negatives and > ULONG_MAX */
        } else {
            PyObject *ix = PyNumber_Index(o);
            if (ix == NULL) goto fail;
            v = PyLong_AsUnsignedLong(ix);
            Py_DECREF(ix);
        }
        if (v == (unsigned long)-1 && PyErr_Occurred()) goto fail;
        if (v > 0xFFFFFFFFUL) {
            PyErr_SetString(PyExc_OverflowError, "token id is greater than the u32 maximum");
            goto fail;
        }
        uint8_t *q = out->owned + 4 * i;
        q[0] = (uint8_t)v; q[1] = (uint8_t)(v >> 8); q[2] = (uint8_t)(v >> 16); q[3] = (uint8_t)(v >> 24);
    }
    Py_DECREF(seq);
    out->data = out->owned;
    return 0;
fail:
    Py_DECREF(seq);
    pages_release(out);
    out->owned = NULL;
    return -1;
}

/* `prior` None or bytes-like; empty counts as none (the Python reference tests truthiness). */
static int prior_from(PyObject *prior, Py_buffer *view) {
    if (prior == Py_None) return 0;
    if (PyObject_GetBuffer(prior, view, PyBUF_SIMPLE) < 0) {
        PyErr_SetString(PyExc_TypeError, "prior must be bytes or None");
        return -1;
    }
    return 1;
}

/* Signed big-endian int64 of a digest's first 8 bytes: SGLang's event id. */
static PyObject *digest_id(const uint8_t *d) {
    uint64_t u = 0;
    for (int i = 0; i < 8; i++) u = (u << 8) | d[i];
    return PyLong_FromLongLong((long long)u);
}

/* (digests, ids) from n consecutive digests of `dlen` bytes. */
static PyObject *build_result(const uint8_t *digests, Py_ssize_t n, Py_ssize_t dlen) {
    PyObject *ds = PyList_New(n), *ids = PyList_New(n);
    if (ds == NULL || ids == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyBytes_FromStringAndSize((const char *)digests + i * dlen, dlen);
        if (b == NULL) goto fail;
        PyList_SET_ITEM(ds, i, b);
        PyObject *id = digest_id(digests + i * dlen);
        if (id == NULL) goto fail;
        PyList_SET_ITEM(ids, i, id);
    }
    return Py_BuildValue("(NN)", ds, ids);
fail:
    Py_XDECREF(ds);
    Py_XDECREF(ids);
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Entry points
 */

static compress_fn best_compress = compress_portable;

/* Pages at or above this count are hashed with the GIL released (another thread can run). */
#define NOGIL_PAGES 128

static PyObject *sha256_chain_impl(PyObject *args, PyObject *kwargs, compress_fn compress, int blob) {
    static char *kwlist[] = {"tokens", "page_size", "prior", NULL};
    PyObject *tokens, *prior = Py_None;
    Py_ssize_t page_size;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "On|O", kwlist, &tokens, &page_size, &prior)) return NULL;
    Pages pg;
    if (pages_from(tokens, page_size, &pg) < 0) return NULL;
    Py_buffer pv;
    int has_prior = prior_from(prior, &pv);
    if (has_prior < 0) {
        pages_release(&pg);
        return NULL;
    }
    Py_ssize_t n = pg.npages, plen = has_prior ? pv.len : 0, len = 4 * page_size;
    size_t scratch_len = (size_t)(plen > 32 ? plen : 32) + (size_t)len + 72;
    uint8_t *out = PyMem_Malloc(n > 0 ? (size_t)n * 32 : 1);
    uint8_t *scratch = PyMem_Malloc(scratch_len);
    PyObject *res = NULL;
    if (out == NULL || scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (n > 0) {
        const uint8_t *pr = has_prior ? pv.buf : NULL;
        PyThreadState *ts = n >= NOGIL_PAGES ? PyEval_SaveThread() : NULL;
        sha256_two(compress, pr, (size_t)plen, pg.data, (size_t)len, out, scratch);
        for (Py_ssize_t i = 1; i < n; i++)
            sha256_two(compress, out + 32 * (i - 1), 32, pg.data + i * len, (size_t)len, out + 32 * i, scratch);
        if (ts) PyEval_RestoreThread(ts);
    }
    res = blob ? PyBytes_FromStringAndSize((const char *)out, n * 32) : build_result(out, n, 32);
done:
    PyMem_Free(out);
    PyMem_Free(scratch);
    if (has_prior) PyBuffer_Release(&pv);
    pages_release(&pg);
    return res;
}

static PyObject *py_sha256_chain(PyObject *self, PyObject *args, PyObject *kwargs) {
    return sha256_chain_impl(args, kwargs, best_compress, 0);
}

static PyObject *py_sha256_chain_portable(PyObject *self, PyObject *args, PyObject *kwargs) {
    return sha256_chain_impl(args, kwargs, compress_portable, 0);
}

/* The digests as one bytes object (32 per page): what the radix tree keeps per node, so a node
 * holds one object instead of a digest and an int per page (docs/producer-events.md). */
static PyObject *py_sha256_blob(PyObject *self, PyObject *args, PyObject *kwargs) {
    return sha256_chain_impl(args, kwargs, best_compress, 1);
}

/* ids_of(digests, dlen) -> list[int]: the event id of every `dlen`-byte digest in `digests`. */
static PyObject *py_ids_of(PyObject *self, PyObject *args) {
    Py_buffer b;
    Py_ssize_t dlen;
    if (!PyArg_ParseTuple(args, "y*n", &b, &dlen)) return NULL;
    if (dlen < 8 || b.len % dlen) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "ids_of: digests must be whole digests of at least 8 bytes");
        return NULL;
    }
    Py_ssize_t n = b.len / dlen;
    PyObject *ids = PyList_New(n);
    if (ids != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *id = digest_id((const uint8_t *)b.buf + i * dlen);
            if (id == NULL) {
                Py_CLEAR(ids);
                break;
            }
            PyList_SET_ITEM(ids, i, id);
        }
    }
    PyBuffer_Release(&b);
    return ids;
}

/* The chain with any digest function `fn(bytes) -> bytes` (at least 8 bytes): the page buffer and
 * the prior || page concatenation happen here, one Python call per page remains. */
static PyObject *py_call_chain(PyObject *self, PyObject *args) {
    PyObject *tokens, *prior = Py_None, *fn;
    Py_ssize_t page_size;
    if (!PyArg_ParseTuple(args, "OOn|O", &fn, &tokens, &page_size, &prior)) return NULL;
    Pages pg;
    if (pages_from(tokens, page_size, &pg) < 0) return NULL;
    Py_buffer pv;
    int has_prior = prior_from(prior, &pv);
    if (has_prior < 0) {
        pages_release(&pg);
        return NULL;
    }
    Py_ssize_t n = pg.npages, len = 4 * page_size;
    PyObject *ds = PyList_New(n), *ids = PyList_New(n), *last = NULL;
    if (ds == NULL || ids == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *pp;
        Py_ssize_t plen;
        if (i == 0) {
            pp = has_prior ? pv.buf : NULL;
            plen = has_prior ? pv.len : 0;
        } else {
            pp = (const uint8_t *)PyBytes_AS_STRING(last);
            plen = PyBytes_GET_SIZE(last);
        }
        PyObject *msg = PyBytes_FromStringAndSize(NULL, plen + len);
        if (msg == NULL) goto fail;
        if (plen) memcpy(PyBytes_AS_STRING(msg), pp, (size_t)plen);
        memcpy(PyBytes_AS_STRING(msg) + plen, pg.data + i * len, (size_t)len);
        PyObject *d = PyObject_CallOneArg(fn, msg);
        Py_DECREF(msg);
        if (d == NULL) goto fail;
        if (!PyBytes_Check(d) || PyBytes_GET_SIZE(d) < 8) {
            Py_DECREF(d);
            PyErr_SetString(PyExc_TypeError, "the digest function must return bytes of at least 8 bytes");
            goto fail;
        }
        PyList_SET_ITEM(ds, i, d);  /* the list owns it; `last` borrows */
        last = d;
        PyObject *id = digest_id((const uint8_t *)PyBytes_AS_STRING(d));
        if (id == NULL) goto fail;
        PyList_SET_ITEM(ids, i, id);
    }
    if (has_prior) PyBuffer_Release(&pv);
    pages_release(&pg);
    return Py_BuildValue("(NN)", ds, ids);
fail:
    Py_XDECREF(ds);
    Py_XDECREF(ids);
    if (has_prior) PyBuffer_Release(&pv);
    pages_release(&pg);
    return NULL;
}

/* One int in msgpack's smallest form, exactly as msgspec writes it (positive fixint, uint8..64
 * for non-negatives; negative fixint, int8..64 below zero). */
static uint8_t *mp_write_u64(uint8_t *q, uint64_t x) {
    if (x < 128) { *q++ = (uint8_t)x; return q; }
    if (x < 256) { *q++ = 0xcc; *q++ = (uint8_t)x; return q; }
    if (x < 65536) { *q++ = 0xcd; *q++ = (uint8_t)(x >> 8); *q++ = (uint8_t)x; return q; }
    if (x < 4294967296ULL) {
        *q++ = 0xce;
        for (int s = 24; s >= 0; s -= 8) *q++ = (uint8_t)(x >> s);
        return q;
    }
    *q++ = 0xcf;
    for (int s = 56; s >= 0; s -= 8) *q++ = (uint8_t)(x >> s);
    return q;
}

static uint8_t *mp_write_i64(uint8_t *q, int64_t x) {
    if (x >= 0) return mp_write_u64(q, (uint64_t)x);
    if (x >= -32) { *q++ = (uint8_t)(x & 0xff); return q; }
    uint64_t u = (uint64_t)x;
    if (x >= -128) { *q++ = 0xd0; *q++ = (uint8_t)u; return q; }
    if (x >= -32768) { *q++ = 0xd1; *q++ = (uint8_t)(u >> 8); *q++ = (uint8_t)u; return q; }
    if (x >= -2147483648LL) {
        *q++ = 0xd2;
        for (int s = 24; s >= 0; s -= 8) *q++ = (uint8_t)(u >> s);
        return q;
    }
    *q++ = 0xd3;
    for (int s = 56; s >= 0; s -= 8) *q++ = (uint8_t)(u >> s);
    return q;
}

/* ---------------------------------------------------------------------------------------------
 * A whole event batch as msgpack, from the recorder's pending records (docs/producer-events.md)
 *
 * The bytes are exactly what msgspec writes for schemas.events.KVEventBatch (positional
 * [ts, events, dp_rank?]) holding BlockStored / BlockRemoved / AllBlocksCleared (tagged maps,
 * defaults omitted, fields in declaration order). Anything unexpected raises TypeError /
 * OverflowError and the recorder lets msgspec encode the events instead.
 */

typedef struct {
    uint8_t *buf;
    size_t len, cap;
} Writer;

static int w_reserve(Writer *w, size_t n) {
    if (w->len + n <= w->cap) return 0;
    size_t cap = w->cap ? w->cap : 1024;
    while (cap < w->len + n) cap *= 2;
    uint8_t *b = PyMem_Realloc(w->buf, cap);
    if (b == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    w->buf = b;
    w->cap = cap;
    return 0;
}

static int w_header(Writer *w, size_t n, uint8_t fix, uint8_t fixmax, uint8_t b16, uint8_t b32) {
    if (w_reserve(w, 5) < 0) return -1;
    uint8_t *q = w->buf + w->len;
    if (n < fixmax) {
        *q++ = (uint8_t)(fix | n);
    } else if (n < 65536) {
        *q++ = b16; *q++ = (uint8_t)(n >> 8); *q++ = (uint8_t)n;
    } else {
        *q++ = b32;
        for (int s = 24; s >= 0; s -= 8) *q++ = (uint8_t)((uint64_t)n >> s);
    }
    w->len = (size_t)(q - w->buf);
    return 0;
}

#define W_ARRAY(w, n) w_header((w), (n), 0x90, 16, 0xdc, 0xdd)
/* A struct as a map: msgspec sizes the header for the struct's most fields (tag included) and
 * patches the count in once the omitted defaults are known: BlockStored (16) always takes map16,
 * BlockRemoved (6) and AllBlocksCleared (1) a fixmap. */
#define W_MAP16(w, n) w_header((w), (n), 0x80, 0, 0xde, 0xdf)
#define W_FIXMAP(w, n) w_header((w), (n), 0x80, 16, 0xde, 0xdf)

static int w_raw(Writer *w, const void *p, size_t n) {
    if (w_reserve(w, n) < 0) return -1;
    memcpy(w->buf + w->len, p, n);
    w->len += n;
    return 0;
}

static int w_str(Writer *w, PyObject *o) {
    if (!PyUnicode_CheckExact(o)) {
        PyErr_SetString(PyExc_TypeError, "encode_batch: expected a str");
        return -1;
    }
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(o, &n);
    if (u == NULL) return -1;
    if (w_reserve(w, 5 + (size_t)n) < 0) return -1;
    uint8_t *q = w->buf + w->len;
    if (n < 32) {
        *q++ = (uint8_t)(0xa0 | n);
    } else if (n < 256) {
        *q++ = 0xd9; *q++ = (uint8_t)n;
    } else if (n < 65536) {
        *q++ = 0xda; *q++ = (uint8_t)(n >> 8); *q++ = (uint8_t)n;
    } else {
        *q++ = 0xdb;
        for (int s = 24; s >= 0; s -= 8) *q++ = (uint8_t)((uint64_t)n >> s);
    }
    memcpy(q, u, (size_t)n);
    w->len = (size_t)(q - w->buf) + (size_t)n;
    return 0;
}

/* A literal key or tag: `s` is short ASCII (fixstr). */
static int w_lit(Writer *w, const char *s) {
    size_t n = strlen(s);
    if (w_reserve(w, 1 + n) < 0) return -1;
    w->buf[w->len++] = (uint8_t)(0xa0 | n);
    memcpy(w->buf + w->len, s, n);
    w->len += n;
    return 0;
}

/* One exact int (msgspec's widths); reserve 9 bytes first. */
static int w_int_unchecked(uint8_t **qp, PyObject *o) {
    unsigned long v;
    if (small_nonneg(o, &v)) {
        *qp = mp_write_u64(*qp, v);
        return 0;
    }
    if (!PyLong_CheckExact(o)) {
        PyErr_SetString(PyExc_TypeError, "encode_batch: expected an int");
        return -1;
    }
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (overflow > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(o);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) return -1;
        *qp = mp_write_u64(*qp, u);
    } else if (overflow < 0) {
        PyErr_SetString(PyExc_OverflowError, "encode_batch: int below -2^63");
        return -1;
    } else {
        *qp = mp_write_i64(*qp, x);
    }
    return 0;
}

static int w_int(Writer *w, PyObject *o) {
    if (w_reserve(w, 9) < 0) return -1;
    uint8_t *q = w->buf + w->len;
    if (w_int_unchecked(&q, o) < 0) return -1;
    w->len = (size_t)(q - w->buf);
    return 0;
}

/* The ints of every chunk as one array (chunks: a list of tuples/lists of ints). */
static int w_int_chunks(Writer *w, PyObject *chunks) {
    if (!PyList_Check(chunks)) {
        PyErr_SetString(PyExc_TypeError, "encode_batch: chunks must be a list");
        return -1;
    }
    Py_ssize_t nc = PyList_GET_SIZE(chunks), total = 0;
    for (Py_ssize_t c = 0; c < nc; c++) {
        PyObject *ch = PyList_GET_ITEM(chunks, c);
        if (!PyTuple_Check(ch) && !PyList_Check(ch)) {
            PyErr_SetString(PyExc_TypeError, "encode_batch: a chunk must be a tuple or a list");
            return -1;
        }
        total += PySequence_Fast_GET_SIZE(ch);
    }
    if (W_ARRAY(w, (size_t)total) < 0 || w_reserve(w, 9 * (size_t)total) < 0) return -1;
    uint8_t *q = w->buf + w->len;
    for (Py_ssize_t c = 0; c < nc; c++) {
        PyObject *ch = PyList_GET_ITEM(chunks, c);
        Py_ssize_t n = PySequence_Fast_GET_SIZE(ch);
        PyObject **items = PySequence_Fast_ITEMS(ch);
        for (Py_ssize_t i = 0; i < n; i++)
            if (w_int_unchecked(&q, items[i]) < 0) return -1;
    }
    w->len = (size_t)(q - w->buf);
    return 0;
}

static int w_ints(Writer *w, PyObject *list) {
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "encode_batch: block ids must be a list");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (W_ARRAY(w, (size_t)n) < 0 || w_reserve(w, 9 * (size_t)n) < 0) return -1;
    uint8_t *q = w->buf + w->len;
    for (Py_ssize_t i = 0; i < n; i++)
        if (w_int_unchecked(&q, PyList_GET_ITEM(list, i)) < 0) return -1;
    w->len = (size_t)(q - w->buf);
    return 0;
}

/* Block ids from digest blobs (a list of bytes, `dlen` bytes per digest): each id is the signed
 * big-endian int64 of a digest's first 8 bytes, as digest_id makes it. */
static int w_blob_ids(Writer *w, PyObject *blobs, PyObject *dlen_o) {
    Py_ssize_t dlen = PyLong_AsSsize_t(dlen_o);
    if (dlen == -1 && PyErr_Occurred()) return -1;
    if (!PyList_Check(blobs) || dlen < 8) {
        PyErr_SetString(PyExc_TypeError, "encode_batch: blobs must be a list and dlen >= 8");
        return -1;
    }
    Py_ssize_t nb = PyList_GET_SIZE(blobs), total = 0;
    for (Py_ssize_t i = 0; i < nb; i++) {
        PyObject *b = PyList_GET_ITEM(blobs, i);
        if (!PyBytes_CheckExact(b) || PyBytes_GET_SIZE(b) % dlen) {
            PyErr_SetString(PyExc_TypeError, "encode_batch: a blob must be bytes of whole digests");
            return -1;
        }
        total += PyBytes_GET_SIZE(b) / dlen;
    }
    if (W_ARRAY(w, (size_t)total) < 0 || w_reserve(w, 9 * (size_t)total) < 0) return -1;
    uint8_t *q = w->buf + w->len;
    for (Py_ssize_t i = 0; i < nb; i++) {
        PyObject *b = PyList_GET_ITEM(blobs, i);
        const uint8_t *d = (const uint8_t *)PyBytes_AS_STRING(b);
        Py_ssize_t n = PyBytes_GET_SIZE(b) / dlen;
        for (Py_ssize_t k = 0; k < n; k++, d += dlen) {
            uint64_t u = 0;
            for (int j = 0; j < 8; j++) u = (u << 8) | d[j];
            q = mp_write_i64(q, (int64_t)u);
        }
    }
    w->len = (size_t)(q - w->buf);
    return 0;
}

/* A record's block ids: `blobs` (digest blobs) when set, else `ids` (a list of ints). */
static int w_record_ids(Writer *w, PyObject *ids, PyObject *blobs, PyObject *dlen) {
    return blobs != Py_None ? w_blob_ids(w, blobs, dlen) : w_ints(w, ids);
}

static PyObject *S_ids, *S_parent, *S_chunks, *S_block_size, *S_medium, *S_group_idx, *S_kind, *S_window,
    *S_blobs, *S_dlen;

/* New references to attributes `names` of `o` (n of them); -1 on error with all released. */
static int get_attrs(PyObject *o, PyObject **names, PyObject **out, int n) {
    for (int i = 0; i < n; i++) {
        out[i] = PyObject_GetAttr(o, names[i]);
        if (out[i] == NULL) {
            for (int j = 0; j < i; j++) Py_DECREF(out[j]);
            return -1;
        }
    }
    return 0;
}

static int w_store(Writer *w, PyObject *rec) {
    /* BlockStored fields in order: block_hashes, parent_block_hash, token_ids, block_size,
     * lora_id (never set by the recorder: omitted), medium, group_idx, kv_cache_spec_kind,
     * kv_cache_spec_sliding_window; None-valued optional fields are omitted. */
    PyObject *names[10] = {S_ids, S_parent, S_chunks, S_block_size, S_medium, S_group_idx, S_kind, S_window,
                           S_blobs, S_dlen};
    PyObject *a[10];
    if (get_attrs(rec, names, a, 10) < 0) return -1;
    int rc = -1;
    size_t nfields = 5;  /* type, block_hashes, parent_block_hash, token_ids, block_size */
    for (int i = 4; i < 8; i++) nfields += a[i] != Py_None;
    if (W_MAP16(w, nfields) < 0 || w_lit(w, "type") < 0 || w_lit(w, "BlockStored") < 0) goto done;
    if (w_lit(w, "block_hashes") < 0 || w_record_ids(w, a[0], a[8], a[9]) < 0) goto done;
    if (w_lit(w, "parent_block_hash") < 0) goto done;
    if (a[1] == Py_None) {
        uint8_t nil = 0xc0;
        if (w_raw(w, &nil, 1) < 0) goto done;
    } else if (w_int(w, a[1]) < 0) {
        goto done;
    }
    if (w_lit(w, "token_ids") < 0 || w_int_chunks(w, a[2]) < 0) goto done;
    if (w_lit(w, "block_size") < 0 || w_int(w, a[3]) < 0) goto done;
    if (a[4] != Py_None && (w_lit(w, "medium") < 0 || w_str(w, a[4]) < 0)) goto done;
    if (a[5] != Py_None && (w_lit(w, "group_idx") < 0 || w_int(w, a[5]) < 0)) goto done;
    if (a[6] != Py_None && (w_lit(w, "kv_cache_spec_kind") < 0 || w_str(w, a[6]) < 0)) goto done;
    if (a[7] != Py_None && (w_lit(w, "kv_cache_spec_sliding_window") < 0 || w_int(w, a[7]) < 0)) goto done;
    rc = 0;
done:
    for (int i = 0; i < 10; i++) Py_DECREF(a[i]);
    return rc;
}

static int w_removed(Writer *w, PyObject *rec) {
    PyObject *names[5] = {S_ids, S_medium, S_group_idx, S_blobs, S_dlen};
    PyObject *a[5];
    if (get_attrs(rec, names, a, 5) < 0) return -1;
    int rc = -1;
    size_t nfields = 2 + (a[1] != Py_None) + (a[2] != Py_None);
    if (W_FIXMAP(w, nfields) < 0 || w_lit(w, "type") < 0 || w_lit(w, "BlockRemoved") < 0) goto done;
    if (w_lit(w, "block_hashes") < 0 || w_record_ids(w, a[0], a[3], a[4]) < 0) goto done;
    if (a[1] != Py_None && (w_lit(w, "medium") < 0 || w_str(w, a[1]) < 0)) goto done;
    if (a[2] != Py_None && (w_lit(w, "group_idx") < 0 || w_int(w, a[2]) < 0)) goto done;
    rc = 0;
done:
    for (int i = 0; i < 5; i++) Py_DECREF(a[i]);
    return rc;
}

/* encode_batch(ts, records, dp_rank, store_type, removed_type, cleared_type) -> bytes */
static PyObject *py_encode_batch(PyObject *self, PyObject *args) {
    double ts;
    PyObject *records, *dp_rank, *store_t, *removed_t, *cleared_t;
    if (!PyArg_ParseTuple(args, "dO!OOOO", &ts, &PyList_Type, &records, &dp_rank, &store_t, &removed_t, &cleared_t))
        return NULL;
    Writer w = {NULL, 0, 0};
    Py_ssize_t n = PyList_GET_SIZE(records);
    /* msgspec writes all three positions of the array-like batch, dp_rank None as nil */
    if (W_ARRAY(&w, 3) < 0 || w_reserve(&w, 9) < 0) goto fail;
    {
        uint64_t bits;
        memcpy(&bits, &ts, 8);
        w.buf[w.len++] = 0xcb;
        for (int s = 56; s >= 0; s -= 8) w.buf[w.len++] = (uint8_t)(bits >> s);
    }
    if (W_ARRAY(&w, (size_t)n) < 0) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *rec = PyList_GET_ITEM(records, i);
        PyObject *t = (PyObject *)Py_TYPE(rec);
        if (t == store_t) {
            if (w_store(&w, rec) < 0) goto fail;
        } else if (t == removed_t) {
            if (w_removed(&w, rec) < 0) goto fail;
        } else if (t == cleared_t) {
            if (W_FIXMAP(&w, 1) < 0 || w_lit(&w, "type") < 0 || w_lit(&w, "AllBlocksCleared") < 0) goto fail;
        } else {
            PyErr_SetString(PyExc_TypeError, "encode_batch: unknown record type");
            goto fail;
        }
    }
    if (dp_rank == Py_None) {
        uint8_t nil = 0xc0;
        if (w_raw(&w, &nil, 1) < 0) goto fail;
    } else if (w_int(&w, dp_rank) < 0) {
        goto fail;
    }
    PyObject *res = PyBytes_FromStringAndSize((const char *)w.buf, (Py_ssize_t)w.len);
    PyMem_Free(w.buf);
    return res;
fail:
    PyMem_Free(w.buf);
    return NULL;
}

static PyMethodDef methods[] = {
    {"sha256_chain", (PyCFunction)(void (*)(void))py_sha256_chain, METH_VARARGS | METH_KEYWORDS,
     "sha256_chain(tokens, page_size, prior=None) -> (digests, ids) of every whole page"},
    {"sha256_blob", (PyCFunction)(void (*)(void))py_sha256_blob, METH_VARARGS | METH_KEYWORDS,
     "sha256_blob(tokens, page_size, prior=None) -> bytes: the digests of every whole page, concatenated"},
    {"ids_of", py_ids_of, METH_VARARGS, "ids_of(digests, dlen) -> list[int]: event ids of concatenated digests"},
    {"sha256_chain_portable", (PyCFunction)(void (*)(void))py_sha256_chain_portable, METH_VARARGS | METH_KEYWORDS,
     "sha256_chain without the CPU's SHA extensions (tests)"},
    {"call_chain", py_call_chain, METH_VARARGS,
     "call_chain(fn, tokens, page_size, prior=None) -> (digests, ids), digest_i = fn(digest_{i-1} || page_i)"},
    {"encode_batch", py_encode_batch, METH_VARARGS,
     "encode_batch(ts, records, dp_rank, store_type, removed_type, cleared_type) -> msgpack KVEventBatch"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_pagehash", "Page-hash chains (producer).", -1, methods};

PyMODINIT_FUNC PyInit__pagehash(void) {
    PyObject *m = PyModule_Create(&moddef);
    if (m == NULL) return NULL;
    PyObject **names[10] = {&S_ids, &S_parent, &S_chunks, &S_block_size, &S_medium, &S_group_idx, &S_kind,
                            &S_window, &S_blobs, &S_dlen};
    const char *strs[10] = {"ids", "parent", "chunks", "block_size", "medium", "group_idx", "kind", "window",
                            "blobs", "dlen"};
    for (int i = 0; i < 10; i++) {
        if (*names[i] == NULL && (*names[i] = PyUnicode_InternFromString(strs[i])) == NULL) {
            Py_DECREF(m);
            return NULL;
        }
    }
    int sha = 0;
#ifdef HAVE_X86_SHA
    if (cpu_has_sha()) {
        best_compress = compress_shani;
        sha = 1;
    }
#endif
    if (PyModule_AddObjectRef(m, "SHA_EXTENSIONS", sha ? Py_True : Py_False) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

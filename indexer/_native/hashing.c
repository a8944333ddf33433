/* Block digests and chained content keys (twin of indexer/hashing.py), included by kvnative.c (one
 * translation unit: these stay static). Tokens come from a msgpack int array, a list / tuple of ints
 * or an integer buffer (u64), or a u32 buffer hashed in place (scalar, or AVX2 where the CPU has it). */

/* ---------------------------------------------------------------- hashing (twin of hashing.py) */

static inline uint64_t col_const(uint64_t i) { return (((i + 1) * K3) ^ (i * P_MUL)) | 1ULL; }

/* The block's column constants, one per token position (PyMem; NULL with MemoryError set). */
static uint64_t *col_table(Py_ssize_t bs) {
    uint64_t *cols = PyMem_RawMalloc((size_t)(bs > 0 ? bs : 1) * sizeof(uint64_t));
    if (!cols) { PyErr_NoMemory(); return NULL; }
    for (Py_ssize_t i = 0; i < bs; i++) cols[i] = col_const((uint64_t)i);
    return cols;
}

static inline uint64_t digest_term64(uint64_t t, uint64_t col) {
    uint64_t x = t * K1 + col;
    x ^= x >> 31;
    return x * K2;
}

static inline uint64_t digest_fin(uint64_t acc) {
    acc ^= acc >> 29;
    acc *= K3;
    acc ^= acc >> 32;
    return acc;
}

static inline uint64_t block_digest(const uint64_t *t, Py_ssize_t bs, uint64_t extra, const uint64_t *cols) {
    uint64_t acc = 0;
    for (Py_ssize_t i = 0; i < bs; i++) acc += digest_term64(t[i], cols[i]);
    return digest_fin(acc ^ extra * EXTRA_SALT);
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

/* Block digests of u32 tokens (block_digest of the tokens widened to u64: the same values), the
 * scalar way and, where the CPU has it, 4 tokens at a time with AVX2 (x86-64 has no 64-bit vector
 * multiply below AVX-512: each 64x64 product is built from 32x32->64 ones; sums mod 2^64 do not
 * depend on order, so the digests are bit for bit the scalar ones). */
static inline uint64_t digest_term(uint32_t v, uint64_t col) { return digest_term64((uint64_t)v, col); }

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
/* digest_term64 after its first product, 4 lanes (x = t * K1): + col, ^= x >> 31, then x * K2 mod 2^64
 * = xlo * K2lo + ((xhi * K2lo + xlo * K2hi) << 32), added to acc. */
__attribute__((target("avx2")))
static inline __m256i digest_terms_avx2(__m256i x, const uint64_t *cols, __m256i acc, __m256i k2lo, __m256i k2hi) {
    x = _mm256_add_epi64(x, _mm256_loadu_si256((const __m256i *)(const void *)cols));
    x = _mm256_xor_si256(x, _mm256_srli_epi64(x, 31));
    __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(x, 32), k2lo), _mm256_mul_epu32(x, k2hi));
    return _mm256_add_epi64(acc, _mm256_add_epi64(_mm256_mul_epu32(x, k2lo), _mm256_slli_epi64(cross, 32)));
}

__attribute__((target("avx2")))
static inline uint64_t lanes_sum_avx2(__m256i acc) {
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)(void *)lanes, acc);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

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
            acc = digest_terms_avx2(x, cols + i, acc, k2lo, k2hi);
        }
        uint64_t a = lanes_sum_avx2(acc);
        for (; i < bs; i++) {
            uint32_t v;
            memcpy(&v, blk + 4 * i, 4);
            a += digest_term(v, cols[i]);
        }
        dg[j] = digest_fin(a);
    }
}

/* block_digest (extra 0) of u64 tokens, 4 at a time: the walk's token ids (wire_walk.c) are u64, a
 * u32 in all but odd payloads, and t * K1 mod 2^64 = tlo * K1lo + ((thi * K1lo + tlo * K1hi) << 32).
 * Sums mod 2^64 do not depend on order: bit for bit block_digest. */
__attribute__((target("avx2")))
static uint64_t block_digest_avx2(const uint64_t *t, Py_ssize_t bs, const uint64_t *cols) {
    const __m256i k1lo = _mm256_set1_epi64x((long long)(K1 & 0xFFFFFFFFULL)), k1hi = _mm256_set1_epi64x((long long)(K1 >> 32));
    const __m256i k2lo = _mm256_set1_epi64x((long long)(K2 & 0xFFFFFFFFULL)), k2hi = _mm256_set1_epi64x((long long)(K2 >> 32));
    __m256i acc = _mm256_setzero_si256();
    Py_ssize_t i = 0;
    for (; i + 4 <= bs; i += 4) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(t + i));
        __m256i hi = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(v, 32), k1lo), _mm256_mul_epu32(v, k1hi));
        __m256i x = _mm256_add_epi64(_mm256_mul_epu32(v, k1lo), _mm256_slli_epi64(hi, 32));
        acc = digest_terms_avx2(x, cols + i, acc, k2lo, k2hi);
    }
    uint64_t a = lanes_sum_avx2(acc);
    for (; i < bs; i++) a += digest_term64(t[i], cols[i]);
    return digest_fin(a);
}
#endif

/* From this many tokens up the digests run without the GIL (a 480k-token query: ~1 ms), so the event
 * loop thread serves meanwhile (router_api/offload.py). Safe: the buffer view is held (its memory can
 * be neither freed nor resized), the loop reads it and writes PyMem_Raw memory only, touching no Python
 * object. Callers hold the GIL on entry (never inside batch_apply's NOGIL section). */
#define NOGIL_HASH_TOKENS 16384

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
    PyThreadState *ts = view.len / 4 >= NOGIL_HASH_TOKENS ? PyEval_SaveThread() : NULL;
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
    if (ts) PyEval_RestoreThread(ts);
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

/* Page-hash chains in one call per insert (docs/producer-events.md).
 *
 * Page i's digest = H(digest of page i-1 || page i's token ids as u32 little-endian); the event id
 * is the digest's first 8 bytes read big-endian as a signed int64. Identical results to the
 * pure-Python reference in producer/page_hash.py (a test compares both).
 *
 * SHA-256 is implemented here from FIPS 180-4 so the module builds with gcc and Python headers
 * only (no libssl-dev). On x86-64 with the SHA extensions the compression function uses them
 * (chosen once at import via cpuid); everywhere else the portable C version runs. A chain's pages
 * after the first are hashed with the message padding laid out once, and 64-byte pages (page
 * size 16) with the whole message in registers: the chain is serial, so per-page overhead is
 * what there is to save (~110 -> ~74 ns a page on the bench machine).
 *
 *   sha256_chain(tokens, page_size, prior=None) -> (list[bytes], list[int])
 *   sha256_chain_portable(...)                  -> same, never the SHA-extension path (tests)
 *   sha256_blob(tokens, page_size, prior=None)  -> bytes, the digests concatenated (the tree keeps this)
 *   ids_of(digests, dlen)                       -> list[int], the event ids of concatenated digests
 *   call_chain(fn, tokens, page_size, prior=None) -> same, digest = fn(prior || page) (xxh3 etc.)
 *   xxh3_blob(tokens, page_size, prior=None)    -> bytes, the XXH3-128 chain's digests (built in, no call a page)
 *   xxh3_128(data)                              -> bytes, XXH3-128 of one buffer (tests)
 *   encode_batch(ts, records, dp_rank, store_t, removed_t, cleared_t) -> bytes, a whole batch
 *   Batch()                                     -> the recorder's pending events, encoded as recorded:
 *       .stored_chain(tokens, parent, spec) -> bytes: hash a new node's pages and record its store
 *       .stored_digests / .stored_ids / .removed_digests / .removed_ids / .cleared: one event each
 *       .take(ts, dp_rank) -> bytes: the msgpack KVEventBatch; len(batch): events pending
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

/* The state as (ABEF, CDGH), the form rnds2 works on, from / to eight words a..h. */
__attribute__((target("sha,sse4.1,ssse3"), always_inline))
static inline void shani_load(const uint32_t state[8], __m128i *s0, __m128i *s1) {
    __m128i tmp = _mm_loadu_si128((const __m128i *)&state[0]);   /* ABCD (a in the low lane) */
    __m128i st1 = _mm_loadu_si128((const __m128i *)&state[4]);   /* EFGH */
    tmp = _mm_shuffle_epi32(tmp, 0xB1);                          /* CDAB */
    st1 = _mm_shuffle_epi32(st1, 0x1B);                          /* EFGH reversed: HGFE */
    *s0 = _mm_alignr_epi8(tmp, st1, 8);                          /* ABEF */
    *s1 = _mm_blend_epi16(st1, tmp, 0xF0);                       /* CDGH */
}

/* (ABEF, CDGH) back to a..h in lane order: *lo = ABCD, *hi = EFGH. */
__attribute__((target("sha,sse4.1,ssse3"), always_inline))
static inline void shani_words(__m128i st0, __m128i st1, __m128i *lo, __m128i *hi) {
    __m128i tmp = _mm_shuffle_epi32(st0, 0x1B);                  /* FEBA */
    st1 = _mm_shuffle_epi32(st1, 0xB1);                          /* DCHG */
    *lo = _mm_blend_epi16(tmp, st1, 0xF0);                       /* DCBA */
    *hi = _mm_alignr_epi8(st1, tmp, 8);                          /* EFGH in memory order */
}

/* One 64-byte block given as its four message registers (words in lane order). */
__attribute__((target("sha,sse4.1,ssse3"), always_inline))
static inline void shani_block(__m128i *s0, __m128i *s1, __m128i m0, __m128i m1, __m128i m2, __m128i m3) {
    __m128i st0 = *s0, st1 = *s1;
    const __m128i save0 = st0, save1 = st1;
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
    *s0 = _mm_add_epi32(st0, save0);
    *s1 = _mm_add_epi32(st1, save1);
}

#define BSWAP32X4 _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL)
#define LOAD_BE(p) _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p)), BSWAP32X4)

__attribute__((target("sha,sse4.1,ssse3"), always_inline))
static inline void shani_blocks(__m128i *s0, __m128i *s1, const uint8_t *data, size_t blocks) {
    for (; blocks--; data += 64)
        shani_block(s0, s1, LOAD_BE(data), LOAD_BE(data + 16), LOAD_BE(data + 32), LOAD_BE(data + 48));
}

__attribute__((target("sha,sse4.1,ssse3")))
static void compress_shani(uint32_t state[8], const uint8_t *data, size_t blocks) {
    __m128i st0, st1, lo, hi;
    shani_load(state, &st0, &st1);
    shani_blocks(&st0, &st1, data, blocks);
    shani_words(st0, st1, &lo, &hi);
    _mm_storeu_si128((__m128i *)&state[0], lo);
    _mm_storeu_si128((__m128i *)&state[4], hi);
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

#ifdef HAVE_X86_SHA
/* Pages 1..n-1 of a chain whose page 0 digest is already at out[0..32): every message is
 * digest || page, the same length, so its padding is laid out once; the digest goes out with
 * one byte shuffle per half instead of a byte loop. */
__attribute__((target("sha,sse4.1,ssse3")))
static void chain_rest_shani(const uint8_t *data, Py_ssize_t n, size_t len, uint8_t *out, uint8_t *scratch) {
    const __m128i bswap = BSWAP32X4;
    size_t total = 32 + len, nblocks = (total + 9 + 63) / 64;
    memset(scratch + total, 0, nblocks * 64 - total);
    scratch[total] = 0x80;
    uint64_t bits = (uint64_t)total * 8;
    for (int i = 0; i < 8; i++) scratch[nblocks * 64 - 1 - i] = (uint8_t)(bits >> (8 * i));
    __m128i init0, init1;
    shani_load(H0, &init0, &init1);
    for (Py_ssize_t i = 1; i < n; i++) {
        memcpy(scratch, out + 32 * (i - 1), 32);
        memcpy(scratch + 32, data + (size_t)i * len, len);
        __m128i st0 = init0, st1 = init1, lo, hi;
        shani_blocks(&st0, &st1, scratch, nblocks);
        shani_words(st0, st1, &lo, &hi);
        _mm_storeu_si128((__m128i *)(out + 32 * i), _mm_shuffle_epi8(lo, bswap));
        _mm_storeu_si128((__m128i *)(out + 32 * i + 16), _mm_shuffle_epi8(hi, bswap));
    }
}
#endif

/* chain_rest_shani for 64-byte pages (page size 16, the common case): digest || page is two
 * blocks, built in registers: the previous digest's words are the first block's first half, the
 * second block ends in constant padding (96 bytes = 768 bits). Nothing goes through memory but
 * the page and the digest written out. */
__attribute__((target("sha,sse4.1,ssse3")))
static void chain_rest_shani64(const uint8_t *data, Py_ssize_t n, uint8_t *out) {
    const __m128i bswap = BSWAP32X4;
    const __m128i pad0 = _mm_set_epi32(0, 0, 0, (int)0x80000000u), pad1 = _mm_set_epi32(768, 0, 0, 0);
    __m128i init0, init1, lo = LOAD_BE(out), hi = LOAD_BE(out + 16);
    shani_load(H0, &init0, &init1);
    for (Py_ssize_t i = 1; i < n; i++) {
        const uint8_t *p = data + 64 * (size_t)i;
        __m128i st0 = init0, st1 = init1;
        shani_block(&st0, &st1, lo, hi, LOAD_BE(p), LOAD_BE(p + 16));
        shani_block(&st0, &st1, LOAD_BE(p + 32), LOAD_BE(p + 48), pad0, pad1);
        shani_words(st0, st1, &lo, &hi);
        _mm_storeu_si128((__m128i *)(out + 32 * i), _mm_shuffle_epi8(lo, bswap));
        _mm_storeu_si128((__m128i *)(out + 32 * i + 16), _mm_shuffle_epi8(hi, bswap));
    }
}

/* The same for 4-byte pages (page size 1): digest || token is one block. */
__attribute__((target("sha,sse4.1,ssse3")))
static void chain_rest_shani4(const uint8_t *data, Py_ssize_t n, uint8_t *out) {
    const __m128i bswap = BSWAP32X4, pad = _mm_set_epi32(288, 0, 0, 0);  /* 36 bytes = 288 bits */
    __m128i init0, init1, lo = LOAD_BE(out), hi = LOAD_BE(out + 16);
    shani_load(H0, &init0, &init1);
    for (Py_ssize_t i = 1; i < n; i++) {
        const uint8_t *p = data + 4 * (size_t)i;
        uint32_t w = ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
        __m128i st0 = init0, st1 = init1;
        shani_block(&st0, &st1, lo, hi, _mm_set_epi32(0, 0, (int)0x80000000u, (int)w), pad);
        shani_words(st0, st1, &lo, &hi);
        _mm_storeu_si128((__m128i *)(out + 32 * i), _mm_shuffle_epi8(lo, bswap));
        _mm_storeu_si128((__m128i *)(out + 32 * i + 16), _mm_shuffle_epi8(hi, bswap));
    }
}

/* The chain's n digests into `out` (32 bytes each): page i (len bytes at data + i * len) chained
 * on the previous digest, page 0 on `prior` (plen bytes, 0 = none). `scratch` holds
 * max(plen, 32) + len + 72 bytes. */
static void sha256_pages(compress_fn compress, const uint8_t *prior, size_t plen, const uint8_t *data, Py_ssize_t n,
                         size_t len, uint8_t *out, uint8_t *scratch) {
    if (n <= 0) return;
    sha256_two(compress, prior, plen, data, len, out, scratch);
#ifdef HAVE_X86_SHA
    if (compress == compress_shani) {
        if (len == 64)
            chain_rest_shani64(data, n, out);
        else if (len == 4)
            chain_rest_shani4(data, n, out);
        else
            chain_rest_shani(data, n, len, out, scratch);
        return;
    }
#endif
    for (Py_ssize_t i = 1; i < n; i++)
        sha256_two(compress, out + 32 * (i - 1), 32, data + (size_t)i * len, len, out + 32 * i, scratch);
}

/* ---------------------------------------------------------------------------------------------
 * XXH3-128 (seed 0, the default secret): the `xxh3` page hash without a Python call per page.
 * Written from the xxHash specification (doc/xxhash_spec.md, v0.8); every length class is here,
 * and tests compare it with the `xxhash` package's xxh3_128_digest over lengths 0..2000+. The
 * digest is the canonical form xxh3_128_digest returns: high 64 bits big-endian, then the low.
 */

static const uint8_t XXH3_SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define XP32_1 0x9E3779B1ULL
#define XP32_2 0x85EBCA77ULL
#define XP32_3 0xC2B2AE3DULL
#define XP64_1 0x9E3779B185EBCA87ULL
#define XP64_2 0xC2B2AE3D27D4EB4FULL
#define XP64_3 0x165667B19E3779F9ULL
#define XP64_4 0x85EBCA77C2B2AE63ULL
#define XP64_5 0x27D4EB2F165667C5ULL
#define XMX_1 0x165667919E3779F9ULL
#define XMX_2 0x9FB21C651E98DF25ULL

typedef struct {
    uint64_t lo, hi;
} U128;

static inline uint64_t rd64(const uint8_t *p) {  /* little-endian */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
#else
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
#endif
}

static inline uint32_t rd32(const uint8_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
#else
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
#endif
}

static inline U128 mul128(uint64_t a, uint64_t b) {
    U128 r;
#if defined(__SIZEOF_INT128__)
    unsigned __int128 p = (unsigned __int128)a * b;
    r.lo = (uint64_t)p;
    r.hi = (uint64_t)(p >> 64);
#else
    uint64_t al = a & 0xFFFFFFFFu, ah = a >> 32, bl = b & 0xFFFFFFFFu, bh = b >> 32;
    uint64_t ll = al * bl, lh = al * bh, hl = ah * bl, hh = ah * bh;
    uint64_t cross = (ll >> 32) + (hl & 0xFFFFFFFFu) + lh;
    r.lo = (cross << 32) | (ll & 0xFFFFFFFFu);
    r.hi = hh + (hl >> 32) + (cross >> 32);
#endif
    return r;
}

static inline uint64_t fold64(uint64_t a, uint64_t b) {
    U128 p = mul128(a, b);
    return p.lo ^ p.hi;
}

static inline uint64_t bswap64_(uint64_t x) {
    x = ((x & 0x00000000FFFFFFFFULL) << 32) | (x >> 32);
    x = ((x & 0x0000FFFF0000FFFFULL) << 16) | ((x >> 16) & 0x0000FFFF0000FFFFULL);
    return ((x & 0x00FF00FF00FF00FFULL) << 8) | ((x >> 8) & 0x00FF00FF00FF00FFULL);
}

static inline uint32_t bswap32_(uint32_t x) {
    return (x >> 24) | ((x >> 8) & 0xFF00u) | ((x << 8) & 0xFF0000u) | (x << 24);
}

static inline uint64_t avalanche64(uint64_t h) {  /* XXH64's */
    h ^= h >> 33;
    h *= XP64_2;
    h ^= h >> 29;
    h *= XP64_3;
    return h ^ (h >> 32);
}

static inline uint64_t avalanche3(uint64_t h) {
    h ^= h >> 37;
    h *= XMX_1;
    return h ^ (h >> 32);
}

static inline uint64_t mix16(const uint8_t *in, const uint8_t *sec) {
    return fold64(rd64(in) ^ rd64(sec), rd64(in + 8) ^ rd64(sec + 8));
}

static inline U128 mix32(U128 acc, const uint8_t *in1, const uint8_t *in2, const uint8_t *sec) {
    acc.lo += mix16(in1, sec);
    acc.lo ^= rd64(in2) + rd64(in2 + 8);
    acc.hi += mix16(in2, sec + 16);
    acc.hi ^= rd64(in1) + rd64(in1 + 8);
    return acc;
}

static U128 fold_mid(U128 acc, uint64_t n) {
    U128 h;
    h.lo = avalanche3(acc.lo + acc.hi);
    h.hi = 0 - avalanche3(acc.lo * XP64_1 + acc.hi * XP64_4 + n * XP64_2);
    return h;
}

static void xxh3_acc512(uint64_t acc[8], const uint8_t *in, const uint8_t *sec) {
    for (int i = 0; i < 8; i++) {
        uint64_t v = rd64(in + 8 * i), k = v ^ rd64(sec + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (k & 0xFFFFFFFFu) * (k >> 32);
    }
}

static uint64_t xxh3_merge(const uint64_t acc[8], const uint8_t *sec, uint64_t start) {
    uint64_t r = start;
    for (int i = 0; i < 4; i++) r += fold64(acc[2 * i] ^ rd64(sec + 16 * i), acc[2 * i + 1] ^ rd64(sec + 16 * i + 8));
    return avalanche3(r);
}

static U128 xxh3_128(const uint8_t *p, size_t n) {
    const uint8_t *s = XXH3_SECRET;
    U128 h;
    if (n == 0) {
        h.lo = avalanche64(rd64(s + 64) ^ rd64(s + 72));
        h.hi = avalanche64(rd64(s + 80) ^ rd64(s + 88));
    } else if (n <= 3) {
        uint32_t cl = ((uint32_t)p[0] << 16) | ((uint32_t)p[n >> 1] << 24) | (uint32_t)p[n - 1] | ((uint32_t)n << 8);
        uint32_t sw = bswap32_(cl), ch = (sw << 13) | (sw >> 19);
        h.lo = avalanche64((uint64_t)cl ^ (uint64_t)(rd32(s) ^ rd32(s + 4)));
        h.hi = avalanche64((uint64_t)ch ^ (uint64_t)(rd32(s + 8) ^ rd32(s + 12)));
    } else if (n <= 8) {
        uint64_t in64 = (uint64_t)rd32(p) + ((uint64_t)rd32(p + n - 4) << 32);
        U128 m = mul128(in64 ^ (rd64(s + 16) ^ rd64(s + 24)), XP64_1 + ((uint64_t)n << 2));
        m.hi += m.lo << 1;
        m.lo ^= m.hi >> 3;
        m.lo ^= m.lo >> 35;
        m.lo *= XMX_2;
        m.lo ^= m.lo >> 28;
        h.lo = m.lo;
        h.hi = avalanche3(m.hi);
    } else if (n <= 16) {
        uint64_t fl = rd64(s + 32) ^ rd64(s + 40), fh = rd64(s + 48) ^ rd64(s + 56);
        uint64_t lo = rd64(p), hi = rd64(p + n - 8);
        U128 m = mul128(lo ^ hi ^ fl, XP64_1);
        m.lo += (uint64_t)(n - 1) << 54;
        hi ^= fh;
        m.hi += hi + (hi & 0xFFFFFFFFu) * (XP32_2 - 1);
        m.lo ^= bswap64_(m.hi);
        U128 r = mul128(m.lo, XP64_2);
        r.hi += m.hi * XP64_2;
        h.lo = avalanche3(r.lo);
        h.hi = avalanche3(r.hi);
    } else if (n <= 128) {
        U128 acc = {(uint64_t)n * XP64_1, 0};
        if (n > 32) {
            if (n > 64) {
                if (n > 96) acc = mix32(acc, p + 48, p + n - 64, s + 96);
                acc = mix32(acc, p + 32, p + n - 48, s + 64);
            }
            acc = mix32(acc, p + 16, p + n - 32, s + 32);
        }
        acc = mix32(acc, p, p + n - 16, s);
        h = fold_mid(acc, n);
    } else if (n <= 240) {
        U128 acc = {(uint64_t)n * XP64_1, 0};
        for (size_t i = 32; i < 160; i += 32) acc = mix32(acc, p + i - 32, p + i - 16, s + i - 32);
        acc.lo = avalanche3(acc.lo);
        acc.hi = avalanche3(acc.hi);
        for (size_t i = 160; i <= n; i += 32) acc = mix32(acc, p + i - 32, p + i - 16, s + 3 + i - 160);
        acc = mix32(acc, p + n - 16, p + n - 32, s + 136 - 17 - 16);
        h = fold_mid(acc, n);
    } else {
        uint64_t acc[8] = {XP32_3, XP64_1, XP64_2, XP64_3, XP64_4, XP32_2, XP64_5, XP32_1};
        const size_t stripes = (sizeof XXH3_SECRET - 64) / 8, block = 64 * stripes;
        const size_t nblocks = (n - 1) / block;
        for (size_t b = 0; b < nblocks; b++) {
            for (size_t k = 0; k < stripes; k++) xxh3_acc512(acc, p + b * block + 64 * k, s + 8 * k);
            for (int i = 0; i < 8; i++) {  /* scramble */
                uint64_t v = acc[i];
                v ^= v >> 47;
                v ^= rd64(s + sizeof XXH3_SECRET - 64 + 8 * i);
                acc[i] = v * XP32_1;
            }
        }
        size_t last = ((n - 1) - block * nblocks) / 64;
        for (size_t k = 0; k < last; k++) xxh3_acc512(acc, p + nblocks * block + 64 * k, s + 8 * k);
        xxh3_acc512(acc, p + n - 64, s + sizeof XXH3_SECRET - 64 - 7);
        h.lo = xxh3_merge(acc, s + 11, (uint64_t)n * XP64_1);
        h.hi = xxh3_merge(acc, s + sizeof XXH3_SECRET - 64 - 11, ~((uint64_t)n * XP64_2));
    }
    return h;
}

/* The canonical digest: high 64 bits big-endian, then the low 64. */
static void xxh3_128_digest(const uint8_t *p, size_t n, uint8_t out[16]) {
    U128 h = xxh3_128(p, n);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t be[2] = {bswap64_(h.hi), bswap64_(h.lo)};
    memcpy(out, be, 16);
#else
    for (int i = 0; i < 8; i++) {
        out[i] = (uint8_t)(h.hi >> (56 - 8 * i));
        out[8 + i] = (uint8_t)(h.lo >> (56 - 8 * i));
    }
#endif
}

/* The xxh3 chain's n digests into `out` (16 bytes each): page 0 on `prior` (plen bytes). */
static void xxh3_pages(const uint8_t *prior, size_t plen, const uint8_t *data, Py_ssize_t n, size_t len,
                       uint8_t *out, uint8_t *scratch) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *pp = i == 0 ? prior : out + 16 * (i - 1);
        size_t pl = i == 0 ? plen : 16;
        if (pl) memcpy(scratch, pp, pl);
        memcpy(scratch + pl, data + (size_t)i * len, len);
        xxh3_128_digest(scratch, pl + len, out + 16 * i);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Arguments
 */

/* A growable byte buffer (the batch encoder's output, reusable scratch). */
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

/* `reuse` (or NULL): a buffer the u32 pages are written into instead of a fresh allocation. */
static int pages_into(PyObject *tokens, Py_ssize_t page_size, Pages *out, Writer *reuse) {
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
    uint8_t *dst;
    if (reuse != NULL) {
        reuse->len = 0;
        dst = w_reserve(reuse, (size_t)nt * 4 + 1) < 0 ? NULL : reuse->buf;
    } else {
        dst = out->owned = PyMem_Malloc(nt > 0 ? (size_t)nt * 4 : 1);
        if (dst == NULL) PyErr_NoMemory();
    }
    if (dst == NULL) {
        Py_DECREF(seq);
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t i = 0;
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30 && \
    defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    /* The common case in one tight loop: exact ints below 2^30 (one digit), read in place. The
     * first other value drops to the general loop below, which validates it. */
    for (; i < nt; i++) {
        PyObject *o = items[i];
        Py_ssize_t sz;
        if (Py_TYPE(o) != &PyLong_Type || (size_t)(sz = Py_SIZE(o)) > 1) break;
        uint32_t v = sz ? (uint32_t)((PyLongObject *)o)->ob_digit[0] : 0;
        memcpy(dst + 4 * i, &v, 4);
    }
#endif
    for (; i < nt; i++) {
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
        uint8_t *q = dst + 4 * i;
        q[0] = (uint8_t)v; q[1] = (uint8_t)(v >> 8); q[2] = (uint8_t)(v >> 16); q[3] = (uint8_t)(v >> 24);
    }
    Py_DECREF(seq);
    out->data = dst;
    return 0;
fail:
    Py_DECREF(seq);
    pages_release(out);
    out->owned = NULL;
    return -1;
}

static int pages_from(PyObject *tokens, Py_ssize_t page_size, Pages *out) {
    return pages_into(tokens, page_size, out, NULL);
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

/* The (tokens, page_size, prior=None) arguments of the chain entry points: the pages, and the prior
 * digest's buffer. Returns whether there is a prior (1: release *pv), or -1 with an exception set
 * (nothing to release). On success the caller releases *pg. */
static int chain_args(PyObject *args, PyObject *kwargs, Py_ssize_t *page_size, Pages *pg, Py_buffer *pv) {
    static char *kwlist[] = {"tokens", "page_size", "prior", NULL};
    PyObject *tokens, *prior = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "On|O", kwlist, &tokens, page_size, &prior)) return -1;
    if (pages_from(tokens, *page_size, pg) < 0) return -1;
    int has_prior = prior_from(prior, pv);
    if (has_prior < 0) pages_release(pg);
    return has_prior;
}

/* Pages at or above this count are hashed with the GIL released (another thread can run). */
#define NOGIL_PAGES 128

static PyObject *sha256_chain_impl(PyObject *args, PyObject *kwargs, compress_fn compress, int blob) {
    Py_ssize_t page_size;
    Pages pg;
    Py_buffer pv;
    int has_prior = chain_args(args, kwargs, &page_size, &pg, &pv);
    if (has_prior < 0) return NULL;
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
        sha256_pages(compress, pr, (size_t)plen, pg.data, n, (size_t)len, out, scratch);
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

/* xxh3_128(data) -> bytes: XXH3-128 of a bytes-like object, as xxhash.xxh3_128_digest gives it. */
static PyObject *py_xxh3_128(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    uint8_t d[16];
    xxh3_128_digest(b.buf, (size_t)b.len, d);
    PyBuffer_Release(&b);
    return PyBytes_FromStringAndSize((const char *)d, 16);
}

/* xxh3_blob(tokens, page_size, prior=None) -> bytes: the xxh3 chain's digests (16 a page). */
static PyObject *py_xxh3_blob(PyObject *self, PyObject *args, PyObject *kwargs) {
    Py_ssize_t page_size;
    Pages pg;
    Py_buffer pv;
    int has_prior = chain_args(args, kwargs, &page_size, &pg, &pv);
    if (has_prior < 0) return NULL;
    Py_ssize_t n = pg.npages, plen = has_prior ? pv.len : 0, len = 4 * page_size;
    PyObject *res = PyBytes_FromStringAndSize(NULL, n * 16);
    uint8_t *scratch = PyMem_Malloc((size_t)(plen > 16 ? plen : 16) + (size_t)len);
    if (res == NULL || scratch == NULL) {
        Py_CLEAR(res);
        if (!PyErr_Occurred()) PyErr_NoMemory();
    } else {
        xxh3_pages(has_prior ? pv.buf : NULL, (size_t)plen, pg.data, n, (size_t)len, (uint8_t *)PyBytes_AS_STRING(res),
                   scratch);
    }
    PyMem_Free(scratch);
    if (has_prior) PyBuffer_Release(&pv);
    pages_release(&pg);
    return res;
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

/* A block id as msgpack sees it: hi 0 for 0 <= v < 2^64, hi -1 for negatives (v = the int64's
 * bits). Two ids are equal iff both fields are. */
typedef struct {
    uint64_t v;
    int hi;
} BlockId;

static uint8_t *id_write(uint8_t *q, BlockId id) {
    return id.hi ? mp_write_i64(q, (int64_t)id.v) : mp_write_u64(q, id.v);
}

/* An exact int within [-2^63, 2^64) as a BlockId (msgspec's range); TypeError / OverflowError naming
 * `who`. */
static int int_id(PyObject *o, BlockId *out, const char *who) {
    unsigned long s;
    if (small_nonneg(o, &s)) {
        out->v = s;
        out->hi = 0;
        return 0;
    }
    if (!PyLong_CheckExact(o)) {
        PyErr_Format(PyExc_TypeError, "%s: expected an int", who);
        return -1;
    }
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (overflow > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(o);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) return -1;
        out->v = u;
        out->hi = 0;
    } else if (overflow < 0) {
        PyErr_Format(PyExc_OverflowError, "%s: int below -2^63", who);
        return -1;
    } else {
        out->v = (uint64_t)x;
        out->hi = x < 0 ? -1 : 0;
    }
    return 0;
}

/* One exact int (msgspec's widths); reserve 9 bytes first. */
static int w_int_unchecked(uint8_t **qp, PyObject *o) {
    BlockId id;
    if (int_id(o, &id, "encode_batch") < 0) return -1;
    *qp = id_write(*qp, id);
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

/* ---------------------------------------------------------------------------------------------
 * Batch: the recorder's pending events, encoded as they are recorded (docs/producer-events.md)
 *
 * Every record is validated and packed into msgpack when it is recorded, so a flush is one
 * memcpy into the payload. The last record stays open (ids, token ids and the fields after them
 * in separate buffers) so a store continuing its chain, or a removal of the same tier, coalesces
 * into it exactly as the Python records do; it is closed (written out with its headers) when a
 * record that does not coalesce arrives, or at `take`. A record the batch cannot take (a non-int,
 * an int beyond 64 bits) raises TypeError / OverflowError before anything changes, and the
 * recorder then moves the batch to its Python records (it decodes `take`'s bytes) and goes on
 * there: the bytes on the wire stay those msgspec writes.
 */

enum { OPEN_NONE = 0, OPEN_STORE = 1, OPEN_REMOVED = 2 };


typedef struct {
    PyObject_HEAD
    Writer out;                   /* closed events, each a whole msgpack map */
    Py_ssize_t nout;
    int open;
    Writer ids, toks, tail;       /* the open record: ids, token ids, encoded fields after those */
    Py_ssize_t nids, ntoks;
    size_t nfields;
    uint8_t parent[9];            /* the open store's encoded parent_block_hash */
    size_t parent_len;
    BlockId last;                 /* the open store's last id (coalescing) */
    PyObject *medium, *block_size, *group_idx, *kind;  /* the open record's keys (coalescing) */
    Writer t_ids, t_toks, t_tail; /* a record being validated, before it touches the batch */
    Writer u32, dig;              /* stored_chain's page buffer and digests (reused: no malloc a call) */
    int busy;                     /* stored_chain runs with the GIL released (big inserts) */
    Py_ssize_t t_nids, t_ntoks;
} BatchObject;

/* The batch's buffers are in use while a chain is hashed (a big one without the GIL, or calling a
 * Python digest function): another thread, or `fn` itself, using the same batch then gets an
 * error, not a buffer freed under the hash. */
#define BATCH_ENTER(b) do { if ((b)->busy) { \
        PyErr_SetString(PyExc_RuntimeError, "Batch used from two threads at once"); return NULL; } } while (0)


static inline uint64_t load_be64(const uint8_t *d) {
#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t u;
    memcpy(&u, d, 8);
    return __builtin_bswap64(u);
#else
    uint64_t u = 0;
    for (int j = 0; j < 8; j++) u = (u << 8) | d[j];
    return u;
#endif
}

static BlockId id_of_digest(const uint8_t *d) {
    uint64_t u = load_be64(d);
    BlockId id = {u, (int64_t)u < 0 ? -1 : 0};
    return id;
}

/* An exact int within [-2^63, 2^64) as a BlockId (msgspec's range); TypeError / OverflowError. */
static int id_of_obj(PyObject *o, BlockId *out) { return int_id(o, out, "Batch"); }

/* Ids of `n` digests of `dlen` bytes into t_ids; *last is the last one's. */
static int enc_blob_ids(BatchObject *b, const uint8_t *d, Py_ssize_t n, Py_ssize_t dlen, BlockId *last) {
    b->t_ids.len = 0;
    if (w_reserve(&b->t_ids, 9 * (size_t)n) < 0) return -1;
    uint8_t *q = b->t_ids.buf;
    for (Py_ssize_t k = 0; k < n; k++, d += dlen) {
        *last = id_of_digest(d);
        int64_t x = (int64_t)last->v;
        if (x >= 4294967296LL || x < -2147483648LL) {  /* nearly every hash id: the 9-byte forms */
            *q = x < 0 ? 0xd3 : 0xcf;
            memcpy(q + 1, d, 8);  /* the digest's first 8 bytes are the id, big-endian already */
            q += 9;
        } else {
            q = id_write(q, *last);
        }
    }
    b->t_ids.len = (size_t)(q - b->t_ids.buf);
    b->t_nids = n;
    return 0;
}

static int enc_int_ids(BatchObject *b, PyObject *ids, BlockId *last) {
    PyObject *seq = PySequence_Fast(ids, "Batch: block ids must be a sequence of ints");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int rc = -1;
    b->t_ids.len = 0;
    if (w_reserve(&b->t_ids, 9 * (size_t)n) < 0) goto done;
    uint8_t *q = b->t_ids.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (id_of_obj(items[i], last) < 0) goto done;
        q = id_write(q, *last);
    }
    b->t_ids.len = (size_t)(q - b->t_ids.buf);
    b->t_nids = n;
    rc = 0;
done:
    Py_DECREF(seq);
    return rc;
}

/* Token ids from a sequence of exact ints (what msgspec writes for them) into t_toks. */
static int enc_int_tokens(BatchObject *b, PyObject *tokens) {
    PyObject *seq = PySequence_Fast(tokens, "Batch: token ids must be a sequence of ints");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int rc = -1;
    b->t_toks.len = 0;
    if (w_reserve(&b->t_toks, 9 * (size_t)n) < 0) goto done;
    uint8_t *q = b->t_toks.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (w_int_unchecked(&q, items[i]) < 0) goto done;
    b->t_toks.len = (size_t)(q - b->t_toks.buf);
    b->t_ntoks = n;
    rc = 0;
done:
    Py_DECREF(seq);
    return rc;
}

/* Token ids already read as u32 little-endian (the hash's page buffer) into t_toks. */
static int enc_u32_tokens(BatchObject *b, const uint8_t *p, Py_ssize_t n) {
    b->t_toks.len = 0;
    if (w_reserve(&b->t_toks, 5 * (size_t)n + 4) < 0) return -1;  /* + 4: the widened stores below */
    uint8_t *q = b->t_toks.buf;
    for (Py_ssize_t i = 0; i < n; i++, p += 4) {
        uint32_t v = (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        /* msgspec's widths, each written with one store (most token ids take uint16: 0xcd hi lo) */
        if (v >= 256 && v < 65536) {
            uint32_t w = 0xcdu | ((v >> 8) << 8) | ((v & 0xffu) << 16);
            memcpy(q, &w, 4);
            q += 3;
        } else if (v >= 65536) {
            uint32_t be = ((v >> 24) & 0xffu) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
            q[0] = 0xce;
            memcpy(q + 1, &be, 4);
            q += 5;
        } else {
            q = mp_write_u64(q, v);
        }
#else
        q = mp_write_u64(q, v);
#endif
    }
    b->t_toks.len = (size_t)(q - b->t_toks.buf);
    b->t_ntoks = n;
    return 0;
}

static int opt_str(PyObject *o) {
    if (o != Py_None && !PyUnicode_CheckExact(o)) {
        PyErr_SetString(PyExc_TypeError, "Batch: expected a str or None");
        return -1;
    }
    return 0;
}

/* None-equal-None, else ==; -1 on error. */
static int same(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    if (a == Py_None || b == Py_None) return 0;
    return PyObject_RichCompareBool(a, b, Py_EQ);
}

static void swap_w(Writer *a, Writer *b) {
    Writer t = *a;
    *a = *b;
    *b = t;
}

static void drop_keys(BatchObject *b) {
    Py_CLEAR(b->medium);
    Py_CLEAR(b->block_size);
    Py_CLEAR(b->group_idx);
    Py_CLEAR(b->kind);
}

/* Writes the open record to `out` with its headers (only memory can fail here). */
static int close_open(BatchObject *b) {
    if (b->open == OPEN_NONE) return 0;
    Writer *w = &b->out;
    if (b->open == OPEN_STORE) {
        if (W_MAP16(w, b->nfields) < 0 || w_lit(w, "type") < 0 || w_lit(w, "BlockStored") < 0 ||
            w_lit(w, "block_hashes") < 0 || W_ARRAY(w, (size_t)b->nids) < 0 || w_raw(w, b->ids.buf, b->ids.len) < 0 ||
            w_lit(w, "parent_block_hash") < 0 || w_raw(w, b->parent, b->parent_len) < 0 ||
            w_lit(w, "token_ids") < 0 || W_ARRAY(w, (size_t)b->ntoks) < 0 || w_raw(w, b->toks.buf, b->toks.len) < 0 ||
            w_raw(w, b->tail.buf, b->tail.len) < 0)
            return -1;
    } else {
        if (W_FIXMAP(w, b->nfields) < 0 || w_lit(w, "type") < 0 || w_lit(w, "BlockRemoved") < 0 ||
            w_lit(w, "block_hashes") < 0 || W_ARRAY(w, (size_t)b->nids) < 0 || w_raw(w, b->ids.buf, b->ids.len) < 0 ||
            w_raw(w, b->tail.buf, b->tail.len) < 0)
            return -1;
    }
    b->nout++;
    b->open = OPEN_NONE;
    drop_keys(b);
    return 0;
}

/* Appends the validated t_ids (and t_toks) to the open record. */
static int extend_open(BatchObject *b, int store) {
    if (w_raw(&b->ids, b->t_ids.buf, b->t_ids.len) < 0) return -1;
    b->nids += b->t_nids;
    if (store) {
        if (w_raw(&b->toks, b->t_toks.buf, b->t_toks.len) < 0) return -1;
        b->ntoks += b->t_ntoks;
    }
    return 0;
}

/* A store whose ids are in t_ids (last id `last`) and token ids in t_toks: coalesced into the open
 * store when it continues that chain on the same tier and group (the recorder's rule), else
 * opened as a new record. `parent` NULL = none. */
static int commit_store(BatchObject *b, const BlockId *parent, BlockId last, PyObject *block_size,
                        PyObject *medium, PyObject *group_idx, PyObject *kind, PyObject *window) {
    if (b->open == OPEN_STORE && parent != NULL && parent->v == b->last.v && parent->hi == b->last.hi) {
        int eq = same(b->medium, medium);
        if (eq > 0) eq = same(b->block_size, block_size);
        if (eq > 0) eq = same(b->group_idx, group_idx);
        if (eq > 0) eq = same(b->kind, kind);
        if (eq < 0) return -1;
        if (eq) {
            if (extend_open(b, 1) < 0) return -1;
            b->last = last;
            return 0;
        }
    }
    /* the fields after token_ids, validated before the open record is closed */
    Writer *t = &b->t_tail;
    t->len = 0;
    if (opt_str(medium) < 0 || opt_str(kind) < 0) return -1;
    if (w_lit(t, "block_size") < 0 || w_int(t, block_size) < 0) return -1;
    if (medium != Py_None && (w_lit(t, "medium") < 0 || w_str(t, medium) < 0)) return -1;
    if (group_idx != Py_None && (w_lit(t, "group_idx") < 0 || w_int(t, group_idx) < 0)) return -1;
    if (kind != Py_None && (w_lit(t, "kv_cache_spec_kind") < 0 || w_str(t, kind) < 0)) return -1;
    if (window != Py_None && (w_lit(t, "kv_cache_spec_sliding_window") < 0 || w_int(t, window) < 0)) return -1;
    if (close_open(b) < 0) return -1;
    swap_w(&b->ids, &b->t_ids);
    swap_w(&b->toks, &b->t_toks);
    swap_w(&b->tail, &b->t_tail);
    b->nids = b->t_nids;
    b->ntoks = b->t_ntoks;
    b->nfields = 5 + (medium != Py_None) + (group_idx != Py_None) + (kind != Py_None) + (window != Py_None);
    if (parent == NULL) {
        b->parent[0] = 0xc0;
        b->parent_len = 1;
    } else {
        b->parent_len = (size_t)(id_write(b->parent, *parent) - b->parent);
    }
    b->last = last;
    b->open = OPEN_STORE;
    Py_INCREF(medium); b->medium = medium;
    Py_INCREF(block_size); b->block_size = block_size;
    Py_INCREF(group_idx); b->group_idx = group_idx;
    Py_INCREF(kind); b->kind = kind;
    return 0;
}

static int commit_removed(BatchObject *b, PyObject *medium, PyObject *group_idx) {
    if (b->open == OPEN_REMOVED) {
        int eq = same(b->medium, medium);
        if (eq > 0) eq = same(b->group_idx, group_idx);
        if (eq < 0) return -1;
        if (eq) return extend_open(b, 0);
    }
    Writer *t = &b->t_tail;
    t->len = 0;
    if (opt_str(medium) < 0) return -1;
    if (medium != Py_None && (w_lit(t, "medium") < 0 || w_str(t, medium) < 0)) return -1;
    if (group_idx != Py_None && (w_lit(t, "group_idx") < 0 || w_int(t, group_idx) < 0)) return -1;
    if (close_open(b) < 0) return -1;
    swap_w(&b->ids, &b->t_ids);
    swap_w(&b->tail, &b->t_tail);
    b->nids = b->t_nids;
    b->nfields = 2 + (medium != Py_None) + (group_idx != Py_None);
    b->open = OPEN_REMOVED;
    Py_INCREF(medium); b->medium = medium;
    Py_INCREF(group_idx); b->group_idx = group_idx;
    return 0;
}

/* The digests buffer `o` as n whole digests of `dlen` bytes (TypeError otherwise). */
static int digests_view(PyObject *o, Py_ssize_t dlen, Py_buffer *view, Py_ssize_t *n) {
    if (PyObject_GetBuffer(o, view, PyBUF_SIMPLE) < 0) return -1;
    if (dlen < 8 || view->len % dlen) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "Batch: digests must be bytes of whole digests of at least 8 bytes");
        return -1;
    }
    *n = view->len / dlen;
    return 0;
}

/* stored_digests(digests, dlen, parent, tokens, block_size, medium, group_idx, kind, window) */
static PyObject *Batch_stored_digests(BatchObject *b, PyObject *const *args, Py_ssize_t nargs) {
    BATCH_ENTER(b);
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "stored_digests takes 9 arguments");
        return NULL;
    }
    Py_ssize_t dlen = PyLong_AsSsize_t(args[1]), n;
    if (dlen == -1 && PyErr_Occurred()) return NULL;
    BlockId parent, last;
    if (args[2] != Py_None && id_of_obj(args[2], &parent) < 0) return NULL;
    Py_buffer view;
    if (digests_view(args[0], dlen, &view, &n) < 0) return NULL;
    int rc = n == 0 ? 0 : -1;
    if (n > 0 && enc_blob_ids(b, view.buf, n, dlen, &last) == 0 && enc_int_tokens(b, args[3]) == 0)
        rc = commit_store(b, args[2] == Py_None ? NULL : &parent, last, args[4], args[5], args[6], args[7], args[8]);
    PyBuffer_Release(&view);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* stored_ids(ids, parent, tokens, block_size, medium, group_idx, kind, window) */
static PyObject *Batch_stored_ids(BatchObject *b, PyObject *const *args, Py_ssize_t nargs) {
    BATCH_ENTER(b);
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "stored_ids takes 8 arguments");
        return NULL;
    }
    BlockId parent, last;
    if (args[1] != Py_None && id_of_obj(args[1], &parent) < 0) return NULL;
    if (enc_int_ids(b, args[0], &last) < 0) return NULL;
    if (b->t_nids == 0) Py_RETURN_NONE;
    if (enc_int_tokens(b, args[2]) < 0) return NULL;
    if (commit_store(b, args[1] == Py_None ? NULL : &parent, last, args[3], args[4], args[5], args[6], args[7]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* removed_digests(digests, dlen, medium, group_idx) */
static PyObject *Batch_removed_digests(BatchObject *b, PyObject *const *args, Py_ssize_t nargs) {
    BATCH_ENTER(b);
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "removed_digests takes 4 arguments");
        return NULL;
    }
    Py_ssize_t dlen = PyLong_AsSsize_t(args[1]), n;
    if (dlen == -1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (digests_view(args[0], dlen, &view, &n) < 0) return NULL;
    BlockId last;
    int rc = n == 0 ? 0 : enc_blob_ids(b, view.buf, n, dlen, &last);
    if (n > 0 && rc == 0) rc = commit_removed(b, args[2], args[3]);
    PyBuffer_Release(&view);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* removed_ids(ids, medium, group_idx) */
static PyObject *Batch_removed_ids(BatchObject *b, PyObject *const *args, Py_ssize_t nargs) {
    BATCH_ENTER(b);
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "removed_ids takes 3 arguments");
        return NULL;
    }
    BlockId last;
    if (enc_int_ids(b, args[0], &last) < 0) return NULL;
    if (b->t_nids > 0 && commit_removed(b, args[1], args[2]) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Batch_cleared(BatchObject *b, PyObject *unused) {
    BATCH_ENTER(b);
    if (close_open(b) < 0) return NULL;
    Writer *w = &b->out;
    if (W_FIXMAP(w, 1) < 0 || w_lit(w, "type") < 0 || w_lit(w, "AllBlocksCleared") < 0) return NULL;
    b->nout++;
    Py_RETURN_NONE;
}

/* The chain's digests (one call of `fn` per page, or SHA-256 here when fn is None) into `blob`:
 * `n` pages of `len` bytes at `data`, chained on `prior` (plen bytes, 0 = none). *dlen is set. */
static int is_xxh3(PyObject *fn) {
    return PyUnicode_Check(fn) && PyUnicode_CompareWithASCIIString(fn, "xxh3") == 0;
}

static int chain_into(PyObject *fn, const uint8_t *prior, Py_ssize_t plen, const uint8_t *data, Py_ssize_t n,
                      Py_ssize_t len, Writer *blob, Py_ssize_t *dlen) {
    blob->len = 0;
    if (is_xxh3(fn)) {
        *dlen = 16;
        size_t scratch_len = (size_t)(plen > 16 ? plen : 16) + (size_t)len;
        uint8_t stack[1024];
        uint8_t *scratch = scratch_len <= sizeof stack ? stack : PyMem_Malloc(scratch_len);
        if (scratch == NULL || w_reserve(blob, (size_t)n * 16 + 1) < 0) {
            if (scratch != stack) PyMem_Free(scratch);
            if (!PyErr_Occurred()) PyErr_NoMemory();
            return -1;
        }
        xxh3_pages(prior, (size_t)plen, data, n, (size_t)len, blob->buf, scratch);
        if (scratch != stack) PyMem_Free(scratch);
        blob->len = (size_t)n * 16;
        return 0;
    }
    if (fn == Py_None) {
        *dlen = 32;
        size_t scratch_len = (size_t)(plen > 32 ? plen : 32) + (size_t)len + 72;
        uint8_t stack[1024];  /* prior || page || padding: page sizes up to ~200 tokens fit here */
        uint8_t *scratch = scratch_len <= sizeof stack ? stack : PyMem_Malloc(scratch_len);
        if (scratch == NULL || w_reserve(blob, (size_t)n * 32) < 0) {
            if (scratch != stack) PyMem_Free(scratch);
            if (!PyErr_Occurred()) PyErr_NoMemory();
            return -1;
        }
        uint8_t *out = blob->buf;
        PyThreadState *ts = n >= NOGIL_PAGES ? PyEval_SaveThread() : NULL;
        sha256_pages(best_compress, prior, (size_t)plen, data, n, (size_t)len, out, scratch);
        if (ts) PyEval_RestoreThread(ts);
        if (scratch != stack) PyMem_Free(scratch);
        blob->len = (size_t)n * 32;
        return 0;
    }
    *dlen = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *pp = i == 0 ? prior : blob->buf + blob->len - *dlen;
        Py_ssize_t pl = i == 0 ? plen : *dlen;
        PyObject *msg = PyBytes_FromStringAndSize(NULL, pl + len);
        if (msg == NULL) return -1;
        if (pl) memcpy(PyBytes_AS_STRING(msg), pp, (size_t)pl);
        memcpy(PyBytes_AS_STRING(msg) + pl, data + i * len, (size_t)len);
        PyObject *d = PyObject_CallOneArg(fn, msg);
        Py_DECREF(msg);
        if (d == NULL) return -1;
        Py_ssize_t dl = PyBytes_Check(d) ? PyBytes_GET_SIZE(d) : -1;
        if (dl < 8 || (i > 0 && dl != *dlen)) {
            Py_DECREF(d);
            PyErr_SetString(PyExc_TypeError, "the digest function must return bytes of at least 8 bytes, always as many");
            return -1;
        }
        *dlen = dl;
        int rc = w_raw(blob, PyBytes_AS_STRING(d), (size_t)dl);
        Py_DECREF(d);
        if (rc < 0) return -1;
    }
    return 0;
}

/* stored_chain(tokens, parent, spec) -> bytes,
 *   spec = (fn, dlen, page_size, block_size, medium, group_idx, kind, window)
 *
 * A new tree node's store in one call: hashes every whole page of `tokens` (fn None = SHA-256,
 * else digest_i = fn(digest_{i-1} || page_i) as call_chain; `dlen` bytes a digest) chained on
 * the last digest of `parent` (the parent node's digests; None at the root: no parent id),
 * records the store with those ids, the parent id and the token ids packed from the same u32
 * buffer the hash read, and returns the digests concatenated (what the node keeps). `spec` is
 * one tuple a cache builds once per tier. Hashing errors are call_chain's / sha256_blob's. */
static PyObject *Batch_stored_chain(BatchObject *b, PyObject *const *args, Py_ssize_t nargs) {
    BATCH_ENTER(b);
    if (nargs != 3 || !PyTuple_Check(args[2]) || PyTuple_GET_SIZE(args[2]) != 8) {
        PyErr_SetString(PyExc_TypeError, "stored_chain(tokens, parent, spec): spec is a tuple of 8");
        return NULL;
    }
    PyObject *const *sp = &PyTuple_GET_ITEM(args[2], 0);
    PyObject *fn = sp[0];
    Py_ssize_t want = PyLong_AsSsize_t(sp[1]), page_size = PyLong_AsSsize_t(sp[2]);
    if ((want == -1 || page_size == -1) && PyErr_Occurred()) return NULL;
    if (want < 8 || (fn == Py_None && want != 32) || (is_xxh3(fn) && want != 16)) {
        PyErr_SetString(PyExc_ValueError, "stored_chain: dlen must be 32 for SHA-256, 16 for xxh3, at least 8 otherwise");
        return NULL;
    }
    Pages pg;
    if (pages_into(args[0], page_size, &pg, &b->u32) < 0) return NULL;
    Py_buffer pv;
    int has_prior = prior_from(args[1], &pv);
    if (has_prior < 0) {
        pages_release(&pg);
        return NULL;
    }
    if (has_prior && (pv.len < want || pv.len % want)) {
        PyErr_SetString(PyExc_ValueError, "stored_chain: the parent's digests must be whole digests");
        PyBuffer_Release(&pv);
        pages_release(&pg);
        return NULL;
    }
    /* the parent's last digest is the chain's prior; its first 8 bytes the parent id */
    const uint8_t *prior = has_prior ? (const uint8_t *)pv.buf + pv.len - want : NULL;
    Py_ssize_t n = pg.npages, plen = has_prior ? want : 0, dlen = 32;
    PyObject *res = NULL;
    Writer *blob = &b->dig;
    b->busy = 1;  /* the page buffer is read while the GIL may be released or `fn` runs */
    int hashed = chain_into(fn, prior, plen, pg.data, n, 4 * page_size, blob, &dlen);
    b->busy = 0;
    if (hashed < 0) goto done;
    if (n > 0 && dlen != want) {
        PyErr_SetString(PyExc_TypeError, "stored_chain: the digest function returned digests of another length");
        goto done;
    }
    res = PyBytes_FromStringAndSize((const char *)blob->buf, (Py_ssize_t)blob->len);
    if (res == NULL || n == 0) goto done;
    BlockId parent, last;
    if (prior != NULL) parent = id_of_digest(prior);
    if (enc_blob_ids(b, blob->buf, n, dlen, &last) < 0 || enc_u32_tokens(b, pg.data, n * page_size) < 0 ||
        commit_store(b, prior != NULL ? &parent : NULL, last, sp[3], sp[4], sp[5], sp[6], sp[7]) < 0)
        Py_CLEAR(res);
done:
    if (has_prior) PyBuffer_Release(&pv);
    pages_release(&pg);
    return res;
}

/* take(ts, dp_rank) -> bytes: the whole batch as msgspec writes KVEventBatch, and empty again. */
static PyObject *Batch_take(BatchObject *b, PyObject *const *args, Py_ssize_t nargs) {
    BATCH_ENTER(b);
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "take takes 2 arguments");
        return NULL;
    }
    double ts = PyFloat_AsDouble(args[0]);
    if (ts == -1.0 && PyErr_Occurred()) return NULL;
    uint8_t dp[9], *q = dp;
    if (args[1] == Py_None) *q++ = 0xc0;
    else if (w_int_unchecked(&q, args[1]) < 0) return NULL;
    if (close_open(b) < 0) return NULL;
    uint8_t head[15];
    size_t hl = 0, n = (size_t)b->nout;
    head[hl++] = 0x93;  /* [ts, events, dp_rank]: msgspec writes all three */
    uint64_t bits;
    memcpy(&bits, &ts, 8);
    head[hl++] = 0xcb;
    for (int s = 56; s >= 0; s -= 8) head[hl++] = (uint8_t)(bits >> s);
    if (n < 16) {
        head[hl++] = (uint8_t)(0x90 | n);
    } else if (n < 65536) {
        head[hl++] = 0xdc; head[hl++] = (uint8_t)(n >> 8); head[hl++] = (uint8_t)n;
    } else {
        head[hl++] = 0xdd;
        for (int s = 24; s >= 0; s -= 8) head[hl++] = (uint8_t)((uint64_t)n >> s);
    }
    size_t dl = (size_t)(q - dp);
    PyObject *res = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(hl + b->out.len + dl));
    if (res == NULL) return NULL;
    char *r = PyBytes_AS_STRING(res);
    memcpy(r, head, hl);
    if (b->out.len) memcpy(r + hl, b->out.buf, b->out.len);
    memcpy(r + hl + b->out.len, dp, dl);
    b->out.len = 0;
    b->nout = 0;
    return res;
}

static PyObject *Batch_clear(BatchObject *b, PyObject *unused) {
    BATCH_ENTER(b);
    b->out.len = 0;
    b->nout = 0;
    b->open = OPEN_NONE;
    drop_keys(b);
    Py_RETURN_NONE;
}

static Py_ssize_t Batch_len(BatchObject *b) {
    return b->nout + (b->open != OPEN_NONE);
}

static PyObject *Batch_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Batch() takes no arguments");
        return NULL;
    }
    BatchObject *b = (BatchObject *)type->tp_alloc(type, 0);  /* zeroed: empty writers, no keys */
    return (PyObject *)b;
}

static void Batch_dealloc(BatchObject *b) {
    PyTypeObject *tp = Py_TYPE(b);
    drop_keys(b);
    Writer *ws[9] = {&b->out, &b->ids, &b->toks, &b->tail, &b->t_ids, &b->t_toks, &b->t_tail, &b->u32, &b->dig};
    for (int i = 0; i < 9; i++) PyMem_Free(ws[i]->buf);
    tp->tp_free((PyObject *)b);
    Py_DECREF(tp);
}

static PyMethodDef Batch_methods[] = {
    {"stored_chain", (PyCFunction)(void (*)(void))Batch_stored_chain, METH_FASTCALL,
     "stored_chain(tokens, parent, (fn, dlen, page_size, block_size, medium, group_idx, kind, window)) -> digests"},
    {"stored_digests", (PyCFunction)(void (*)(void))Batch_stored_digests, METH_FASTCALL,
     "stored_digests(digests, dlen, parent, tokens, block_size, medium, group_idx, kind, window)"},
    {"stored_ids", (PyCFunction)(void (*)(void))Batch_stored_ids, METH_FASTCALL,
     "stored_ids(ids, parent, tokens, block_size, medium, group_idx, kind, window)"},
    {"removed_digests", (PyCFunction)(void (*)(void))Batch_removed_digests, METH_FASTCALL,
     "removed_digests(digests, dlen, medium, group_idx)"},
    {"removed_ids", (PyCFunction)(void (*)(void))Batch_removed_ids, METH_FASTCALL, "removed_ids(ids, medium, group_idx)"},
    {"cleared", (PyCFunction)Batch_cleared, METH_NOARGS, "cleared(): an AllBlocksCleared"},
    {"take", (PyCFunction)(void (*)(void))Batch_take, METH_FASTCALL,
     "take(ts, dp_rank) -> bytes: the msgpack KVEventBatch of everything recorded; the batch is empty again"},
    {"clear", (PyCFunction)Batch_clear, METH_NOARGS, "clear(): drop everything recorded"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Batch_slots[] = {
    {Py_tp_new, Batch_new},
    {Py_tp_dealloc, Batch_dealloc},
    {Py_tp_methods, Batch_methods},
    {Py_sq_length, Batch_len},
    {Py_tp_doc, "The recorder's pending events, msgpack-encoded as they are recorded (docs/producer-events.md)."},
    {0, NULL},
};

static PyType_Spec Batch_spec = {
    "producer._native._pagehash.Batch", sizeof(BatchObject), 0, Py_TPFLAGS_DEFAULT, Batch_slots,
};

static PyMethodDef methods[] = {
    {"sha256_chain", (PyCFunction)(void (*)(void))py_sha256_chain, METH_VARARGS | METH_KEYWORDS,
     "sha256_chain(tokens, page_size, prior=None) -> (digests, ids) of every whole page"},
    {"sha256_blob", (PyCFunction)(void (*)(void))py_sha256_blob, METH_VARARGS | METH_KEYWORDS,
     "sha256_blob(tokens, page_size, prior=None) -> bytes: the digests of every whole page, concatenated"},
    {"ids_of", py_ids_of, METH_VARARGS, "ids_of(digests, dlen) -> list[int]: event ids of concatenated digests"},
    {"xxh3_128", py_xxh3_128, METH_O, "xxh3_128(data) -> bytes: XXH3-128 (seed 0), as xxhash.xxh3_128_digest"},
    {"xxh3_blob", (PyCFunction)(void (*)(void))py_xxh3_blob, METH_VARARGS | METH_KEYWORDS,
     "xxh3_blob(tokens, page_size, prior=None) -> bytes: the xxh3 chain's digests of every whole page, concatenated"},
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
    PyObject *batch_t = PyType_FromSpec(&Batch_spec);
    if (batch_t == NULL || PyModule_AddObject(m, "Batch", batch_t) < 0) {
        Py_XDECREF(batch_t);
        Py_DECREF(m);
        return NULL;
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

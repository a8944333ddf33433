/* Page-hash chains in plain C (no Python objects: callable without the GIL).
 *
 * Page i's digest = H(digest of page i-1 || page i's token ids as u32 little-endian); page 0 is
 * chained on `prior` (the parent node's last digest, or nothing at the root). The chain itself is
 * ours; the hash functions are libraries':
 *
 * - SHA-256: OpenSSL's libcrypto (SHA256_Init/Update/Final per page; it picks the CPU's SHA
 *   extensions or AVX2 code itself). On x86-64 CPUs with the SHA extensions the chain instead runs
 *   in registers with the SHA instructions (below, checked once via cpuid): every message after
 *   the first is `digest || page` of one length, so its padding is laid out once, and for 64- and
 *   4-byte pages (page size 16 and 1) the whole message is built in registers. Measured per page
 *   on the bench machine (docs/producer-events.md): 72 ns against libcrypto's 98 for 16-token
 *   pages, 37 against 53 for 1-token pages, 185 against 200 for 64-token pages; the chain is
 *   serial, so per-call overhead is the cost, and that is what the library's generic
 *   Update/Final pays per page. `library` forces libcrypto (tests compare both with hashlib).
 * - XXH3-128 (seed 0, default secret): the xxHash library's single header (third_party/xxhash.h,
 *   unmodified, inlined); the digest is the canonical form xxhash.xxh3_128_digest returns.
 */
#define OPENSSL_SUPPRESS_DEPRECATED  /* the low-level SHA256_* calls: measured faster than EVP here */
#include "pagehash.h"

#include <openssl/sha.h>

#define XXH_INLINE_ALL
#include "third_party/xxhash.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_X86_SHA 1
#include <cpuid.h>
#include <immintrin.h>
#endif

int sha_extensions = 0;

/* ---------------------------------------------------------------------------------------------
 * SHA-256 with libcrypto
 */

static void sha256_library(const uint8_t *prior, size_t plen, const uint8_t *data, Py_ssize_t n, size_t len,
                           uint8_t *out) {
    for (Py_ssize_t i = 0; i < n; i++) {
        SHA256_CTX c;
        SHA256_Init(&c);
        if (i > 0) SHA256_Update(&c, out + 32 * (i - 1), 32);
        else if (plen) SHA256_Update(&c, prior, plen);
        SHA256_Update(&c, data + (size_t)i * len, len);
        SHA256_Final(out + 32 * i, &c);
    }
}

#ifdef HAVE_X86_SHA
/* ---------------------------------------------------------------------------------------------
 * The chain in registers with the x86 SHA extensions (FIPS 180-4 constants)
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

/* The compression with the x86 SHA extensions: rnds2 does two rounds on the state held as
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

static int cpu_has_sha(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    if (!(c & (1u << 9)) || !(c & (1u << 19))) return 0;       /* SSSE3, SSE4.1 */
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b >> 29) & 1;                                      /* SHA */
}

/* Digest of prior || page with the SHA unit: the message (at most a few blocks) is laid out in
 * `scratch` with its padding and compressed once. */
__attribute__((target("sha,sse4.1,ssse3")))
static void shani_two(const uint8_t *prior, size_t plen, const uint8_t *page, size_t len, uint8_t *out,
                      uint8_t *scratch) {
    const __m128i bswap = BSWAP32X4;
    size_t total = plen + len, nblocks = (total + 9 + 63) / 64;
    if (plen) memcpy(scratch, prior, plen);
    memcpy(scratch + plen, page, len);
    memset(scratch + total, 0, nblocks * 64 - total);
    scratch[total] = 0x80;
    uint64_t bits = (uint64_t)total * 8;
    for (int i = 0; i < 8; i++) scratch[nblocks * 64 - 1 - i] = (uint8_t)(bits >> (8 * i));
    __m128i st0, st1, lo, hi;
    shani_load(H0, &st0, &st1);
    shani_blocks(&st0, &st1, scratch, nblocks);
    shani_words(st0, st1, &lo, &hi);
    _mm_storeu_si128((__m128i *)out, _mm_shuffle_epi8(lo, bswap));
    _mm_storeu_si128((__m128i *)(out + 16), _mm_shuffle_epi8(hi, bswap));
}

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

#endif

void sha256_pages(const uint8_t *prior, size_t plen, const uint8_t *data, Py_ssize_t n, size_t len, uint8_t *out,
                  uint8_t *scratch, int library) {
    if (n <= 0) return;
#ifdef HAVE_X86_SHA
    if (sha_extensions && !library) {
        shani_two(prior, plen, data, len, out, scratch);
        if (len == 64)
            chain_rest_shani64(data, n, out);
        else if (len == 4)
            chain_rest_shani4(data, n, out);
        else
            chain_rest_shani(data, n, len, out, scratch);
        return;
    }
#endif
    (void)scratch;
    sha256_library(prior, plen, data, n, len, out);
}

void chains_init(void) {
#ifdef HAVE_X86_SHA
    sha_extensions = cpu_has_sha();
#endif
}

/* ---------------------------------------------------------------------------------------------
 * XXH3-128 with the xxHash library
 */

void xxh3_128_digest(const uint8_t *p, size_t n, uint8_t out[16]) {
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits(p, n));
    memcpy(out, c.digest, 16);
}

void xxh3_pages(const uint8_t *prior, size_t plen, const uint8_t *data, Py_ssize_t n, size_t len, uint8_t *out,
                uint8_t *scratch) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *pp = i == 0 ? prior : out + 16 * (i - 1);
        size_t pl = i == 0 ? plen : 16;
        if (pl) memcpy(scratch, pp, pl);
        memcpy(scratch + pl, data + (size_t)i * len, len);
        xxh3_128_digest(scratch, pl + len, out + 16 * i);
    }
}

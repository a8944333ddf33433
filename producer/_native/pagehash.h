/* Declarations shared by the C files of `producer._native._pagehash` (one extension, built from
 * module.c, chains.c, pages.c, msgpack.c, batch.c: setup.py, and the Makefile's sanitize build).
 *
 *   chains.c   page-hash chains in plain C: SHA-256 (the CPU's SHA unit in registers, else
 *              OpenSSL's libcrypto) and XXH3-128 (the xxHash library, vendored header)
 *   pages.c    the Python side of hashing: token ids -> u32 pages, the chain entry points
 *   msgpack.c  the growable buffer and msgpack writers the event encoder uses (msgspec's bytes)
 *   batch.c    `Batch`: the recorder's pending events, encoded as recorded (event_tables.h)
 *   module.c   the method table and module init
 */
#ifndef PAGEHASH_H
#define PAGEHASH_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* ---- chains.c: no Python objects, safe without the GIL ------------------------------------- */

/* Set once at init (chains_init): whether sha256_pages uses the CPU's SHA extensions. */
extern int sha_extensions;
void chains_init(void);

/* The chain's n digests into `out` (32 bytes each): page i (len bytes at data + i * len) chained
 * on the previous digest, page 0 on `prior` (plen bytes, 0 = none). `scratch` holds
 * max(plen, 32) + len + 72 bytes. `library` forces libcrypto (tests compare both paths). */
void sha256_pages(const uint8_t *prior, size_t plen, const uint8_t *data, Py_ssize_t n, size_t len, uint8_t *out,
                  uint8_t *scratch, int library);
/* The same with XXH3-128 (16-byte digests, canonical form); `scratch` holds max(plen, 16) + len. */
void xxh3_pages(const uint8_t *prior, size_t plen, const uint8_t *data, Py_ssize_t n, size_t len, uint8_t *out,
                uint8_t *scratch);
void xxh3_128_digest(const uint8_t *p, size_t n, uint8_t out[16]);

/* ---- msgpack.c ------------------------------------------------------------------------------ */

/* A growable byte buffer (encoder output, reusable scratch); zeroed = empty. */
typedef struct {
    uint8_t *buf;
    size_t len, cap;
} Writer;

/* The small writers are inline here: the encoder calls them per key and per int, from batch.c. */
int w_grow(Writer *w, size_t n);  /* room for n more bytes (MemoryError set on failure) */
static inline int w_reserve(Writer *w, size_t n) {
    return w->len + n <= w->cap ? 0 : w_grow(w, n);
}
static inline int w_raw(Writer *w, const void *p, size_t n) {
    if (n == 0) return 0;  /* an empty buffer may be NULL: memcpy must not see it */
    if (w_reserve(w, n) < 0) return -1;
    memcpy(w->buf + w->len, p, n);
    w->len += n;
    return 0;
}
/* An array / map header in msgpack's smallest form given `fixmax` (msgspec's choice). */
int w_header(Writer *w, size_t n, uint8_t fix, uint8_t fixmax, uint8_t b16, uint8_t b32);
#define W_ARRAY(w, n) w_header((w), (n), 0x90, 16, 0xdc, 0xdd)
/* A struct as a map: msgspec sizes the header for the struct's most keys (fields + tag) and
 * patches the count in once the omitted defaults are known (event_tables.h: MAP_KEYS). */
#define W_MAP(w, n, most) w_header((w), (n), 0x80, (most) < 16 ? 16 : 0, 0xde, 0xdf)
int w_str(Writer *w, PyObject *o);  /* an exact str (TypeError otherwise) */

/* A block id as msgpack sees it: hi 0 for 0 <= v < 2^64, hi -1 for negatives (v = the int64's
 * bits). Two ids are equal iff both fields are. */
typedef struct {
    uint64_t v;
    int hi;
} BlockId;

/* One int in msgpack's smallest form, exactly as msgspec writes it (positive fixint, uint8..64
 * for non-negatives; negative fixint, int8..64 below zero). */
static inline uint8_t *mp_write_u64(uint8_t *q, uint64_t x) {
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
static inline uint8_t *mp_write_i64(uint8_t *q, int64_t x) {
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
static inline uint8_t *id_write(uint8_t *q, BlockId id) {
    return id.hi ? mp_write_i64(q, (int64_t)id.v) : mp_write_u64(q, id.v);
}
/* An exact int within [-2^63, 2^64) as a BlockId (msgspec's range); TypeError / OverflowError. */
int int_id(PyObject *o, BlockId *out);
int w_int_unchecked(uint8_t **qp, PyObject *o);  /* one exact int; 9 bytes reserved first */
int w_int(Writer *w, PyObject *o);

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

/* ---- pages.c -------------------------------------------------------------------------------- */

/* The whole pages of `tokens` as u32 little-endian bytes. Sets `owned` when the buffer must be
 * freed; for a bytes-like input it points into `view` (pages_release frees either). */
typedef struct {
    const uint8_t *data;
    Py_ssize_t npages;
    uint8_t *owned;
    Py_buffer view;
    int has_view;
} Pages;

/* `reuse` (or NULL): a buffer the u32 pages are written into instead of a fresh allocation. */
int pages_into(PyObject *tokens, Py_ssize_t page_size, Pages *out, Writer *reuse);
void pages_release(Pages *p);
/* `prior` None or bytes-like: 0 (none), 1 (release *view), -1 (TypeError). */
int prior_from(PyObject *prior, Py_buffer *view);
/* The chain's digests into `blob` (fn None = SHA-256, "xxh3" = XXH3-128, else a Python digest
 * function called per page); *dlen is set. For Batch.stored_chain. */
int chain_into(PyObject *fn, const uint8_t *prior, Py_ssize_t plen, const uint8_t *data, Py_ssize_t n,
               Py_ssize_t len, Writer *blob, Py_ssize_t *dlen);
int is_xxh3(PyObject *fn);

/* Pages at or above this count are hashed with the GIL released (another thread can run). */
#define NOGIL_PAGES 128

PyObject *py_sha256_chain(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *py_sha256_chain_library(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *py_sha256_blob(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *py_xxh3_128(PyObject *self, PyObject *arg);
PyObject *py_xxh3_blob(PyObject *self, PyObject *args, PyObject *kwargs);
PyObject *py_ids_of(PyObject *self, PyObject *args);
PyObject *py_call_chain(PyObject *self, PyObject *args);

/* ---- batch.c -------------------------------------------------------------------------------- */

int batch_add_type(PyObject *module);    /* adds `Batch` */
PyObject *py_event_tables(PyObject *self, PyObject *unused);  /* the tables batch.c was built with */

#endif

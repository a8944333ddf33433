/* What u64map.c and holders.c share (each needs the other's definitions): the U64Map struct, its
 * slot layout, the holder-list form's constants and block, and the functions each calls in the
 * other. Included once, by kvnative.c, before either part (one translation unit: all static). */
#ifndef KVATLAS_U64MAP_H
#define KVATLAS_U64MAP_H

typedef struct {
    PyObject_HEAD
    uint64_t *tab; /* cap entries of (key, width value words); key 0 = empty slot. One array so a
                      lookup touches one cache line, not two. Values are little-endian words. */
    Py_ssize_t cap, used;
    int width;
    int pool; /* a value has held a shared-pool bit (bit 3 of a nibble) since the map was made: sticky,
                 so walk_multi may skip a shard whose workers are all out of a walk only when 0 */
    int load_num, load_den; /* max load: LOAD_NUM/LOAD_DEN, or 1/3 for a churning map (U64Map.sparse) */
    int holders; /* a model's main tree (U64Map.holders): values past HL_DENSE words become holder lists */
    int hl;      /* its values are holder lists now (holders.c), the table two words wide */
    PyObject *other; /* dict for keys that are not ints in [1, 2^64) */
    Py_ssize_t work; /* slots and value words visited by whole-table passes, wide values read or
                        written whole, and keys of a nibble op (U64Map.work: tests count churn's work) */
} U64Map;

#define POOL_BITS 0x8888888888888888ULL

static PyTypeObject U64MapType;

/* Slot i's key and value words: one array of cap entries of (key, width words). */
#define KEY(m, i) ((m)->tab[(size_t)(i) * (1 + (m)->width)])
#define VALS(m, i) ((m)->tab + (size_t)(i) * (1 + (m)->width) + 1)

/* ---------------------------------------------------------------- holder lists (holders.c) */

#define HL_DENSE 8  /* words (128 worker slots): the 100-worker fleet's tables stay exactly as they were */
#define HL_INLINE 4 /* entries in the two inline words */
/* Slots a holder list takes (an entry keeps 28 bits of slot): past MAX_SLOT, the bound of dense words
 * and of the C apply, a worker's stores go through the pure core (`U64Map.__setitem__`) and still fit. */
#define HL_MAX_SLOT ((Py_ssize_t)1 << 24)

typedef struct {
    uint32_t n;     /* holders (nonzero nibbles) */
    uint32_t cap;   /* entries room (list form) */
    uint32_t words; /* 0: list form; else dense words in d */
    uint32_t pad;
    uint64_t d[];   /* list form: u32 entries (cap of them); dense form: words */
} HBlock;

/* A value's form: spilled (word 0 a 16-aligned HBlock pointer) or inline. */
static inline int hl_spilled(const uint64_t *v) { return v[0] && !(v[0] & 0xF); }
static inline HBlock *hl_block(const uint64_t *v) { return (HBlock *)(uintptr_t)v[0]; }
static inline uint32_t *hl_ents(HBlock *b) { return (uint32_t *)b->d; }

/* u64map.c, for holders.c: a fresh zeroed table, a probe, freeing a table. */
static int map_alloc(U64Map *m, Py_ssize_t cap, int width);
static inline Py_ssize_t find(const U64Map *m, uint64_t k, int *found);
static void tab_free(uint64_t *t, Py_ssize_t cap, int width);

/* holders.c, for u64map.c: release, read, encode and switch the form of holder-list values. */
static void hl_release(uint64_t *v);
static void hl_release_all(U64Map *m);
static Py_ssize_t hl_need_words(const uint64_t *v);
static void hl_to_dense(const uint64_t *v, uint64_t *out, Py_ssize_t words);
static int hl_from_dense(uint64_t *v, const uint64_t *d, Py_ssize_t words);
static int hl_switch(U64Map *m, int lists, int width);

#endif

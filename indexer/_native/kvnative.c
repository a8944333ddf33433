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
#include <structmember.h>
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

/* One translation unit: each part is included once, in dependency order, so everything stays static. */
#include "u64map.h"       /* the U64Map struct and what u64map.c and holders.c share */
#include "hashing.c"      /* block digests, chained keys (twin of hashing.py) */
#include "bodies.c"       /* request bodies -> u32 tokens (the HTTP body codec) */
#include "u64map.c"       /* U64Map and its type object */
#include "holders.c"      /* holder lists: residency values whose cost follows their holders */
#include "node_maps.c"    /* residency bits / nibbles over the maps, tier_counts */
#include "score_walk.c"   /* the walk and score_rows, ranking, packed rows */
#include "groups_walk.c"  /* hybrid_rows: usable-prefix rows (groupscore.py's twin) */
#include "answer.c"       /* the /score answer writer */
#include "wire_walk.c"    /* the raw payload reader of the whole-batch walk */
#include "kv_apply.c"     /* the walk's main-tree events: store, remove, clear */
#include "groups_apply.c" /* the walk's group events of a known layout */
#include "batch_apply.c"  /* apply_msgpack(_run) */

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


static PyMethodDef module_methods[] = {
    {"apply_msgpack", (PyCFunction)(void (*)(void))py_apply_msgpack, METH_VARARGS | METH_KEYWORDS,
     "apply the common case of one worker's raw batch to its maps"},
    {"tier_counts", (PyCFunction)(void (*)(void))py_tier_counts, METH_FASTCALL,
     "blocks per tier one worker holds (ModelState.tier_counts)"},
    {"apply_msgpack_run", (PyCFunction)(void (*)(void))py_apply_msgpack_run, METH_FASTCALL,
     "apply a run of one worker's raw batches, stopping before the first the common case does not cover"},
    {"score_rows", (PyCFunction)(void (*)(void))py_score_rows, METH_VARARGS | METH_KEYWORDS,
     "score, rank and build the result rows"},
    {"holder_rows", py_holder_rows, METH_VARARGS, "score_rows of every worker, only the rows that hold something"},
    {"write_answer", py_write_answer, METH_VARARGS, "the /score answer bytes (JSON or msgpack) from packed rows"},
    {"status_columns", py_status_columns, METH_VARARGS, "the rows' status and last_seq columns (reconcile.status_columns)"},
    {"json_u32_array", py_json_u32_array, METH_VARARGS, "u32 tokens from a raw JSON int array"},
    {"json_body_u32", py_json_body_u32, METH_VARARGS, "u32 tokens and their span from a whole JSON request body"},
    {"msgpack_body_u32", py_msgpack_body_u32, METH_VARARGS, "u32 tokens and their span from a whole msgpack request body"},
    {"msgpack_u32_array", py_msgpack_u32_array, METH_VARARGS, "u32 tokens from a raw msgpack int array"},
    {"simple_head", py_simple_head, METH_VARARGS, "a one-read request head in router_api/http_head.py's strict subset"},
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
#ifdef SOURCE_DIGEST /* from setup.py: the digest of the sources compiled (schemas/c_tables.py) */
    if (PyModule_AddStringConstant(m, "SOURCE_DIGEST", SOURCE_DIGEST) < 0) { Py_DECREF(m); return NULL; }
#endif
    return m;
}

/* `producer._native._pagehash`: the producer's C helper (docs/producer-events.md) — page-hash
 * chains in one call per insert (pages.c over chains.c) and the event recorder's `Batch`, which
 * encodes events as they are recorded (batch.c over msgpack.c). This file only assembles the
 * module; pagehash.h says what each file holds.
 *
 *   SHA_EXTENSIONS: bool -> whether sha256_chain runs the chain on the CPU's SHA unit (else libcrypto)
 *   SOURCE_DIGEST: str -> the digest of the sources it was compiled from (absent without setup.py)
 */
#include "pagehash.h"

static PyMethodDef methods[] = {
    {"sha256_chain", (PyCFunction)(void (*)(void))py_sha256_chain, METH_VARARGS | METH_KEYWORDS,
     "sha256_chain(tokens, page_size, prior=None) -> (digests, ids) of every whole page"},
    {"sha256_blob", (PyCFunction)(void (*)(void))py_sha256_blob, METH_VARARGS | METH_KEYWORDS,
     "sha256_blob(tokens, page_size, prior=None) -> bytes: the digests of every whole page, concatenated"},
    {"ids_of", py_ids_of, METH_VARARGS, "ids_of(digests, dlen) -> list[int]: event ids of concatenated digests"},
    {"xxh3_128", py_xxh3_128, METH_O, "xxh3_128(data) -> bytes: XXH3-128 (seed 0), as xxhash.xxh3_128_digest"},
    {"xxh3_blob", (PyCFunction)(void (*)(void))py_xxh3_blob, METH_VARARGS | METH_KEYWORDS,
     "xxh3_blob(tokens, page_size, prior=None) -> bytes: the xxh3 chain's digests of every whole page, concatenated"},
    {"sha256_chain_library", (PyCFunction)(void (*)(void))py_sha256_chain_library, METH_VARARGS | METH_KEYWORDS,
     "sha256_chain always through libcrypto, never the SHA-extension chain (tests)"},
    {"call_chain", py_call_chain, METH_VARARGS,
     "call_chain(fn, tokens, page_size, prior=None) -> (digests, ids), digest_i = fn(digest_{i-1} || page_i)"},
    {"event_tables", py_event_tables, METH_NOARGS,
     "event_tables() -> dict: the schema tables the event encoder was built with (producer/_native/event_tables.py)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "_pagehash", "Page-hash chains and the event batch encoder (producer).", -1, methods,
};

PyMODINIT_FUNC PyInit__pagehash(void) {
    PyObject *m = PyModule_Create(&moddef);
    if (m == NULL) return NULL;
    chains_init();
    if (batch_add_type(m) < 0 ||
        PyModule_AddObjectRef(m, "SHA_EXTENSIONS", sha_extensions ? Py_True : Py_False) < 0
#ifdef SOURCE_DIGEST /* from setup.py: the digest of the sources compiled (schemas/c_tables.py) */
        || PyModule_AddStringConstant(m, "SOURCE_DIGEST", SOURCE_DIGEST) < 0
#endif
        ) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

/* The Python side of page hashing (docs/producer-events.md): token ids -> whole u32 pages, and the
 * chain entry points over chains.c.
 *
 *   sha256_chain(tokens, page_size, prior=None) -> (list[bytes], list[int])
 *   sha256_chain_library(...)                   -> same, always libcrypto (tests compare both paths)
 *   sha256_blob(tokens, page_size, prior=None)  -> bytes, the digests concatenated (the tree keeps this)
 *   xxh3_blob(tokens, page_size, prior=None)    -> bytes, the XXH3-128 chain's digests
 *   xxh3_128(data)                              -> bytes, XXH3-128 of one buffer (tests)
 *   ids_of(digests, dlen)                       -> list[int], the event ids of concatenated digests
 *   call_chain(fn, tokens, page_size, prior=None) -> same as sha256_chain, digest = fn(prior || page)
 *
 * `tokens`: a tuple/list of ints (each must fit u32: OverflowError otherwise, TypeError for
 * non-ints) or a bytes-like object of u32 little-endian. Only whole pages are read: a partial
 * trailing page is ignored, exactly like the Python reference (producer/page_hash.py). The event
 * id is a digest's first 8 bytes read big-endian as a signed int64.
 */
#include "pagehash.h"

void pages_release(Pages *p) {
    if (p->owned) PyMem_Free(p->owned);
    if (p->has_view) PyBuffer_Release(&p->view);
}

/* `reuse` (or NULL): a buffer the u32 pages are written into instead of a fresh allocation. */
int pages_into(PyObject *tokens, Py_ssize_t page_size, Pages *out, Writer *reuse) {
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

/* `prior` None or bytes-like; empty counts as none (the Python reference tests truthiness). */
int prior_from(PyObject *prior, Py_buffer *view) {
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


/* The (tokens, page_size, prior=None) arguments of the chain entry points: the pages, and the prior
 * digest's buffer. Returns whether there is a prior (1: release *pv), or -1 with an exception set
 * (nothing to release). On success the caller releases *pg. */
static int chain_args(PyObject *args, PyObject *kwargs, Py_ssize_t *page_size, Pages *pg, Py_buffer *pv) {
    static char *kwlist[] = {"tokens", "page_size", "prior", NULL};
    PyObject *tokens, *prior = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "On|O", kwlist, &tokens, page_size, &prior)) return -1;
    if (pages_into(tokens, *page_size, pg, NULL) < 0) return -1;
    int has_prior = prior_from(prior, pv);
    if (has_prior < 0) pages_release(pg);
    return has_prior;
}

enum { HASH_SHA256, HASH_SHA256_LIBRARY, HASH_XXH3 };

/* The chain entry points: the digests of every whole page by `hash`, as one bytes object (`blob`)
 * or as (digests, ids) lists. */
static PyObject *chain_impl(PyObject *args, PyObject *kwargs, int hash, int blob) {
    Py_ssize_t page_size;
    Pages pg;
    Py_buffer pv;
    int has_prior = chain_args(args, kwargs, &page_size, &pg, &pv);
    if (has_prior < 0) return NULL;
    Py_ssize_t dl = hash == HASH_XXH3 ? 16 : 32;
    Py_ssize_t n = pg.npages, plen = has_prior ? pv.len : 0, len = 4 * page_size;
    size_t scratch_len = (size_t)(plen > dl ? plen : dl) + (size_t)len + 72;  /* + SHA-256 padding */
    uint8_t *out = PyMem_Malloc(n > 0 ? (size_t)(n * dl) : 1);
    uint8_t *scratch = PyMem_Malloc(scratch_len);
    PyObject *res = NULL;
    if (out == NULL || scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (n > 0) {
        const uint8_t *pr = has_prior ? pv.buf : NULL;
        PyThreadState *ts = n >= NOGIL_PAGES ? PyEval_SaveThread() : NULL;
        if (hash == HASH_XXH3)
            xxh3_pages(pr, (size_t)plen, pg.data, n, (size_t)len, out, scratch);
        else
            sha256_pages(pr, (size_t)plen, pg.data, n, (size_t)len, out, scratch, hash == HASH_SHA256_LIBRARY);
        if (ts) PyEval_RestoreThread(ts);
    }
    res = blob ? PyBytes_FromStringAndSize((const char *)out, n * dl) : build_result(out, n, dl);
done:
    PyMem_Free(out);
    PyMem_Free(scratch);
    if (has_prior) PyBuffer_Release(&pv);
    pages_release(&pg);
    return res;
}

PyObject *py_sha256_chain(PyObject *self, PyObject *args, PyObject *kwargs) {
    return chain_impl(args, kwargs, HASH_SHA256, 0);
}

PyObject *py_sha256_chain_library(PyObject *self, PyObject *args, PyObject *kwargs) {
    return chain_impl(args, kwargs, HASH_SHA256_LIBRARY, 0);
}

/* The digests as one bytes object (32 per page): what the radix tree keeps per node, so a node
 * holds one object instead of a digest and an int per page (docs/producer-events.md). */
PyObject *py_sha256_blob(PyObject *self, PyObject *args, PyObject *kwargs) {
    return chain_impl(args, kwargs, HASH_SHA256, 1);
}

/* xxh3_blob(tokens, page_size, prior=None) -> bytes: the xxh3 chain's digests (16 a page). */
PyObject *py_xxh3_blob(PyObject *self, PyObject *args, PyObject *kwargs) {
    return chain_impl(args, kwargs, HASH_XXH3, 1);
}

/* xxh3_128(data) -> bytes: XXH3-128 of a bytes-like object, as xxhash.xxh3_128_digest gives it. */
PyObject *py_xxh3_128(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    uint8_t d[16];
    xxh3_128_digest(b.buf, (size_t)b.len, d);
    PyBuffer_Release(&b);
    return PyBytes_FromStringAndSize((const char *)d, 16);
}

/* ids_of(digests, dlen) -> list[int]: the event id of every `dlen`-byte digest in `digests`. */
PyObject *py_ids_of(PyObject *self, PyObject *args) {
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
PyObject *py_call_chain(PyObject *self, PyObject *args) {
    PyObject *tokens, *prior = Py_None, *fn;
    Py_ssize_t page_size;
    if (!PyArg_ParseTuple(args, "OOn|O", &fn, &tokens, &page_size, &prior)) return NULL;
    Pages pg;
    if (pages_into(tokens, page_size, &pg, NULL) < 0) return NULL;
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

int is_xxh3(PyObject *fn) {
    return PyUnicode_Check(fn) && PyUnicode_CompareWithASCIIString(fn, "xxh3") == 0;
}

/* The chain's digests (one call of `fn` per page, SHA-256 when fn is None, XXH3-128 for "xxh3")
 * into `blob`: `n` pages of `len` bytes at `data`, chained on `prior` (plen bytes, 0 = none). */
int chain_into(PyObject *fn, const uint8_t *prior, Py_ssize_t plen, const uint8_t *data, Py_ssize_t n,
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
        sha256_pages(prior, (size_t)plen, data, n, (size_t)len, out, scratch, 0);
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

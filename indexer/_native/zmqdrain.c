/* kvatlas: receive a run of in-order live messages from one ZeroMQ SUB socket in one C call.
 *
 * Why: through pyzmq every frame costs a Frame object, a `more` read and a bytes copy — ~30% of
 * the ingest thread's time per batch (docs/service.md, "Ingest"). Here the loop over
 * `[topic, seq, payload]` messages runs on libzmq's own message API, and only the payload becomes a
 * Python object. The loop stops at the first message that is not the next seq of a caught-up stream
 * (or is malformed) and hands that one back: what it means is decided in Python
 * (`indexer.sequencing`), never here.
 *
 * libzmq is not linked: `bind(path)` resolves the few zmq_msg_* functions from the very libzmq that
 * pyzmq loaded (its path read from /proc/self/maps by indexer/zmqfast.py), so the socket pointers
 * pyzmq hands out (`Socket.underlying`) belong to the same library. Public CPython API only.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>

/* zmq_msg_t is 64 opaque bytes, 8-aligned (zmq.h) */
typedef struct { _Alignas(8) unsigned char d[64]; } zmsg;

static int (*z_msg_init)(zmsg *);
static int (*z_msg_recv)(zmsg *, void *, int);
static int (*z_msg_close)(zmsg *);
static void *(*z_msg_data)(zmsg *);
static size_t (*z_msg_size)(const zmsg *);
static int (*z_msg_more)(const zmsg *);
static int (*z_errno)(void);
static const char *(*z_strerror)(int);

#define Z_DONTWAIT 1
#define SEQ_BYTES 8
#define FP_HEAD 48
#define FP_TAIL 16

static PyObject *py_bind(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    /* RTLD_NOLOAD: only the copy already in the process (pyzmq's), never a second libzmq */
    void *h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!h) { PyErr_Format(PyExc_OSError, "libzmq %s is not loaded: %s", path, dlerror()); return NULL; }
#define SYM(var, name) do { *(void **)(&var) = dlsym(h, name); \
        if (!var) { PyErr_Format(PyExc_OSError, "libzmq %s has no %s", path, name); return NULL; } } while (0)
    SYM(z_msg_init, "zmq_msg_init");
    SYM(z_msg_recv, "zmq_msg_recv");
    SYM(z_msg_close, "zmq_msg_close");
    SYM(z_msg_data, "zmq_msg_data");
    SYM(z_msg_size, "zmq_msg_size");
    SYM(z_msg_more, "zmq_msg_more");
    SYM(z_errno, "zmq_errno");
    SYM(z_strerror, "zmq_strerror");
#undef SYM
    Py_RETURN_NONE;
}

/* One frame; 1 received, 0 nothing ready (EAGAIN), -1 error (Python exception set). */
static int recv_frame(void *sock, zmsg *m) {
    for (;;) {
        if (z_msg_recv(m, sock, Z_DONTWAIT) >= 0) return 1;
        int e = z_errno();
        if (e == EAGAIN) return 0;
        if (e == EINTR) continue;
        PyErr_Format(PyExc_OSError, "zmq_msg_recv: %s (errno %d)", z_strerror(e), e);
        return -1;
    }
}

/* The tracker's fingerprint of a payload: hash((len(p), p[:48], p[-16:])), as
 * indexer.sequencing.fingerprint (tests/test_zmqfast.py holds the two equal). */
static int fingerprint(const char *p, Py_ssize_t n, int64_t *out) {
    Py_ssize_t hn = n < FP_HEAD ? n : FP_HEAD, tn = n < FP_TAIL ? n : FP_TAIL;
    /* built by hand: Py_BuildValue's format parsing was most of this per-message cost */
    PyObject *t = PyTuple_New(3);
    if (!t) return -1;
    PyObject *a = PyLong_FromSsize_t(n), *b = PyBytes_FromStringAndSize(p, hn),
             *c = PyBytes_FromStringAndSize(p + n - tn, tn);
    if (a) PyTuple_SET_ITEM(t, 0, a);
    if (b) PyTuple_SET_ITEM(t, 1, b);
    if (c) PyTuple_SET_ITEM(t, 2, c);
    if (!a || !b || !c) { Py_DECREF(t); return -1; } /* the tuple owns what was set (NULL slots skipped) */
    Py_hash_t h = PyObject_Hash(t);
    Py_DECREF(t);
    if (h == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)h;
    return 0;
}

static int q_buffer(PyObject *o, Py_buffer *v, Py_ssize_t window) {
    if (PyObject_GetBuffer(o, v, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) return -1;
    if (v->itemsize != 8 || !v->format || strcmp(v->format, "q") != 0 || v->len != window * 8) {
        PyBuffer_Release(v);
        PyErr_SetString(PyExc_ValueError, "recv_run: fingerprint rings must be array('q') of the window's length");
        return -1;
    }
    return 0;
}

/* recv_run(sock_addr, limit, expected, fp_seq, fp) -> (n_messages, payloads, odd)
 *
 * Receives up to `limit` messages. While each is a well-formed `[topic, seq, payload]` with
 * seq == expected (then expected + 1, ...), its payload is appended to `payloads` and its
 * fingerprint written to the rings (index seq % window). The first message that is not stops the
 * run and comes back as `odd`:
 *   (0, seq, payload)   well-formed, another seq (sequencing decides: gap, duplicate, restart)
 *   (1, n_frames, None) wrong frame count (the rest of the message was consumed)
 *   (2, seq_len, None)  seq frame not SEQ_BYTES long
 * `odd` is None when the socket had nothing more or `limit` was reached. */
static PyObject *py_recv_run(PyObject *self, PyObject *args) {
    unsigned long long addr, expected;
    Py_ssize_t limit;
    PyObject *fp_seq_o, *fp_o;
    if (!PyArg_ParseTuple(args, "KnKOO", &addr, &limit, &expected, &fp_seq_o, &fp_o)) return NULL;
    if (!z_msg_recv) { PyErr_SetString(PyExc_RuntimeError, "recv_run: call bind() first"); return NULL; }
    if (!addr) { PyErr_SetString(PyExc_ValueError, "recv_run: null socket"); return NULL; }
    void *sock = (void *)(uintptr_t)addr;
    Py_buffer vs, vf;
    if (PyObject_GetBuffer(fp_seq_o, &vs, PyBUF_WRITABLE | PyBUF_FORMAT) < 0) return NULL;
    Py_ssize_t window = vs.len / 8;
    PyBuffer_Release(&vs);
    if (window < 1) { PyErr_SetString(PyExc_ValueError, "recv_run: empty fingerprint ring"); return NULL; }
    if (q_buffer(fp_seq_o, &vs, window) < 0) return NULL;
    if (q_buffer(fp_o, &vf, window) < 0) { PyBuffer_Release(&vs); return NULL; }
    int64_t *ring_seq = vs.buf, *ring_fp = vf.buf;

    PyObject *payloads = PyList_New(0), *odd = NULL, *out = NULL;
    Py_ssize_t n = 0;
    zmsg f[3];
    int open = 0; /* frames initialised, to close on every path */
    if (!payloads) goto done;
    while (n < limit) {
        for (int i = 0; i < 3; i++) z_msg_init(&f[i]);
        open = 3;
        int r = recv_frame(sock, &f[0]);
        if (r <= 0) { if (r < 0) goto done; break; }
        n++;
        /* the frames of one message arrive together: once the first is here, the rest are */
        Py_ssize_t nframes = 1;
        int bad = 0;
        if (z_msg_more(&f[0])) {
            if ((r = recv_frame(sock, &f[1])) <= 0) goto lost;
            nframes = 2;
            if (z_msg_more(&f[1])) {
                if ((r = recv_frame(sock, &f[2])) <= 0) goto lost;
                nframes = 3;
                while (z_msg_more(&f[2])) { /* skip to the end of an oversized message */
                    z_msg_close(&f[2]);
                    z_msg_init(&f[2]);
                    if ((r = recv_frame(sock, &f[2])) <= 0) goto lost;
                    nframes++;
                }
            }
        }
        if (nframes != 3) bad = 1;
        if (bad) { odd = Py_BuildValue("(inO)", 1, nframes, Py_None); goto stop; }
        size_t sl = z_msg_size(&f[1]);
        if (sl != SEQ_BYTES) { odd = Py_BuildValue("(inO)", 2, (Py_ssize_t)sl, Py_None); goto stop; }
        const unsigned char *sb = z_msg_data(&f[1]);
        unsigned long long seq = 0;
        for (int i = 0; i < SEQ_BYTES; i++) seq = (seq << 8) | sb[i];
        const char *pb = z_msg_data(&f[2]);
        Py_ssize_t plen = (Py_ssize_t)z_msg_size(&f[2]);
        if (seq != expected) { odd = Py_BuildValue("(iKy#)", 0, seq, pb, plen); goto stop; }
        PyObject *p = PyBytes_FromStringAndSize(pb, plen);
        if (!p) goto done;
        int rc = PyList_Append(payloads, p);
        Py_DECREF(p);
        if (rc < 0) goto done;
        int64_t h;
        if (fingerprint(pb, plen, &h) < 0) goto done;
        Py_ssize_t i = (Py_ssize_t)(seq % (unsigned long long)window);
        ring_seq[i] = (int64_t)seq;
        ring_fp[i] = h;
        expected++;
        for (int k = 0; k < 3; k++) z_msg_close(&f[k]);
        open = 0;
        continue;
    lost:
        if (r < 0) goto done;
        /* cannot happen with libzmq's atomic delivery; reported like a short message */
        odd = Py_BuildValue("(inO)", 1, nframes, Py_None);
    stop:
        if (!odd) goto done;
        break;
    }
    out = Py_BuildValue("(nOO)", n, payloads, odd ? odd : Py_None);
done:
    if (open) for (int k = 0; k < 3; k++) z_msg_close(&f[k]);
    Py_XDECREF(payloads);
    Py_XDECREF(odd);
    PyBuffer_Release(&vs);
    PyBuffer_Release(&vf);
    return out;
}

static PyMethodDef methods[] = {
    {"bind", py_bind, METH_VARARGS, "bind(libzmq_path): resolve libzmq's message API from the loaded library"},
    {"recv_run", py_recv_run, METH_VARARGS, "recv_run(sock_addr, limit, expected, fp_seq, fp) -> (n, payloads, odd)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_zmqdrain", "kvatlas: in-order ZeroMQ receive runs", -1, methods};

PyMODINIT_FUNC PyInit__zmqdrain(void) { return PyModule_Create(&moduledef); }

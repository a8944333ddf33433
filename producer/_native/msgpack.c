/* The event encoder's output side: a growable buffer and msgpack writers that produce exactly
 * msgspec's bytes (its smallest-form ints, str / array / map header classes). batch.c composes
 * events from these and the keys event_tables.h holds; nothing here knows an event's shape. */
#include "pagehash.h"

int w_grow(Writer *w, size_t n) {
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

int w_header(Writer *w, size_t n, uint8_t fix, uint8_t fixmax, uint8_t b16, uint8_t b32) {
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

int w_str(Writer *w, PyObject *o) {
    if (!PyUnicode_CheckExact(o)) {
        PyErr_SetString(PyExc_TypeError, "Batch: expected a str");
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

int int_id(PyObject *o, BlockId *out) {
    unsigned long s;
    if (small_nonneg(o, &s)) {
        out->v = s;
        out->hi = 0;
        return 0;
    }
    if (!PyLong_CheckExact(o)) {
        PyErr_SetString(PyExc_TypeError, "Batch: expected an int");
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
        PyErr_SetString(PyExc_OverflowError, "Batch: int below -2^63");
        return -1;
    } else {
        out->v = (uint64_t)x;
        out->hi = x < 0 ? -1 : 0;
    }
    return 0;
}

int w_int_unchecked(uint8_t **qp, PyObject *o) {
    BlockId id;
    if (int_id(o, &id) < 0) return -1;
    *qp = id_write(*qp, id);
    return 0;
}

int w_int(Writer *w, PyObject *o) {
    if (w_reserve(w, 9) < 0) return -1;
    uint8_t *q = w->buf + w->len;
    if (w_int_unchecked(&q, o) < 0) return -1;
    w->len = (size_t)(q - w->buf);
    return 0;
}

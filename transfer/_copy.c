/* Host memcpy over a whole list of byte ranges in one call (kvcache.transfer._copy).
 *
 * A request's KV blocks are thousands of ranges (one per block, layer and tensor after
 * merging); a Python call per range would cost more than the copy. Here the caller passes three
 * int64 arrays (source addresses, destination addresses, lengths) and one C loop copies them all
 * without the GIL. A deadline (CLOCK_MONOTONIC ns, the clock of time.monotonic_ns) is checked
 * every few ranges, so a transfer never runs far past it; the return value says how many ranges
 * were copied. The addresses are trusted: KVRegion derived them from registered, checked memory.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include <time.h>

#define CHECK_EVERY_BYTES (4u << 20) /* look at the clock after at least this many bytes */
#define PREFETCH_BYTES (64 << 10)     /* how much of the next range to prefetch, a line per page */

static int64_t monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int int64_array(Py_buffer *b, const char *name, Py_ssize_t *count)
{
    if (b->len % (Py_ssize_t)sizeof(int64_t) != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be an int64 array, got %zd bytes", name, b->len);
        return -1;
    }
    *count = b->len / (Py_ssize_t)sizeof(int64_t);
    return 0;
}

PyDoc_STRVAR(copy_doc,
             "copy(src, dst, length, deadline_ns) -> int\n\n"
             "memcpy length[i] bytes from address src[i] to dst[i] for every i (int64 arrays of one size),\n"
             "in order, without the GIL. Stops early once CLOCK_MONOTONIC passes deadline_ns (0: no\n"
             "deadline); returns how many ranges were copied.");

static PyObject *copy(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer src, dst, len;
    long long deadline;
    if (!PyArg_ParseTuple(args, "y*y*y*L", &src, &dst, &len, &deadline)) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n_src, n_dst, n_len;
    if (int64_array(&src, "src", &n_src) == 0 && int64_array(&dst, "dst", &n_dst) == 0 &&
        int64_array(&len, "length", &n_len) == 0) {
        if (n_src != n_dst || n_src != n_len) {
            PyErr_Format(PyExc_ValueError, "src, dst and length must have one size, got %zd, %zd, %zd", n_src,
                         n_dst, n_len);
        } else {
            const int64_t *s = (const int64_t *)src.buf, *d = (const int64_t *)dst.buf, *l = (const int64_t *)len.buf;
            Py_ssize_t i = 0;
            Py_BEGIN_ALLOW_THREADS
            uint64_t since_check = 0;
            for (; i < n_src; i++) {
                if (deadline > 0 && since_check >= CHECK_EVERY_BYTES) {
                    if (monotonic_ns() > deadline) {
                        break;
                    }
                    since_check = 0;
                }
                /* Plain memcpy: glibc picks the copy for this CPU and size. Hand-written streaming
                 * stores were faster on a 2-core dev VM but half as fast on the H100 host's CPU. */
                if (i + 1 < n_src) {
                    /* Touch each page of the next range: its TLB walks overlap this copy. */
                    const char *ns = (const char *)(uintptr_t)s[i + 1], *nd = (const char *)(uintptr_t)d[i + 1];
                    for (int64_t off = 0; off < l[i + 1] && off < PREFETCH_BYTES; off += 4096) {
                        __builtin_prefetch(ns + off, 0, 0);
                        __builtin_prefetch(nd + off, 1, 0);
                    }
                }
                memcpy((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], (size_t)l[i]);
                since_check += (uint64_t)l[i];
            }
            Py_END_ALLOW_THREADS
            result = PyLong_FromSsize_t(i);
        }
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&len);
    return result;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS, copy_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copy", "Host memcpy over a list of byte ranges in one call.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__copy(void) { return PyModule_Create(&module); }

/* The byte ranges of a block-to-block KV copy, built and merged in one pass (kvcache.transfer._ranges).
 *
 * A request's transfer is units (a layer's tensor) x block pairs: unit u, pair i copies length[u]
 * bytes from src_base[u] + src_blocks[i] * src_stride[u] + heads[i] * unit[u] to the same on the
 * destination side. numpy builds the [units, pairs] grid and merges it in a dozen passes whose
 * fixed costs (a few microseconds each) dominate at these sizes; here it is one loop. Ranges come
 * in (unit, pair) order; a range joins the previous one when both sides continue it and both lie
 * in the same group of `group` units (a layer's tensors), so each group's ranges can be posted on
 * their own. Addresses are the caller's checked region addresses; nothing is dereferenced.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

typedef struct {
    Py_buffer view;
    const int64_t *data;
    Py_ssize_t count;
} int64s;

static int get_int64s(PyObject *obj, const char *name, int writable, int64s *out)
{
    if (PyObject_GetBuffer(obj, &out->view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) != 0) {
        return -1;
    }
    if (out->view.len % (Py_ssize_t)sizeof(int64_t) != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be an int64 array, got %zd bytes", name, out->view.len);
        PyBuffer_Release(&out->view);
        return -1;
    }
    out->data = (const int64_t *)out->view.buf;
    out->count = out->view.len / (Py_ssize_t)sizeof(int64_t);
    return 0;
}

PyDoc_STRVAR(pair_ranges_doc,
             "pair_ranges(src_base, src_stride, dst_base, dst_stride, unit, length, src_blocks, dst_blocks, heads,\n"
             "            group, out_src, out_dst, out_len, out_starts) -> int\n\n"
             "Write the merged ranges of units x pairs into out_src/out_dst/out_len (room for units * pairs each)\n"
             "and, in out_starts (units / group + 1), where each group's ranges begin; returns how many ranges.\n"
             "All arrays int64; the first six have one entry per unit, the next three one per pair.");

static PyObject *pair_ranges(PyObject *self, PyObject *args)
{
    (void)self;
    enum { N_IN = 9, N_OUT = 4 };
    PyObject *objs[N_IN + N_OUT];
    Py_ssize_t group;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOnOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          &objs[6], &objs[7], &objs[8], &group, &objs[9], &objs[10], &objs[11], &objs[12])) {
        return NULL;
    }
    static const char *names[N_IN + N_OUT] = {"src_base", "src_stride", "dst_base", "dst_stride", "unit",
                                              "length", "src_blocks", "dst_blocks", "heads", "out_src",
                                              "out_dst", "out_len", "out_starts"};
    int64s a[N_IN + N_OUT];
    int got = 0;
    PyObject *result = NULL;
    for (; got < N_IN + N_OUT; got++) {
        if (get_int64s(objs[got], names[got], got >= N_IN, &a[got]) != 0) {
            goto done;
        }
    }
    Py_ssize_t units = a[0].count, pairs = a[6].count;
    for (int k = 1; k < 6; k++) {
        if (a[k].count != units) {
            PyErr_Format(PyExc_ValueError, "%s has %zd entries, src_base %zd", names[k], a[k].count, units);
            goto done;
        }
    }
    if (a[7].count != pairs || a[8].count != pairs) {
        PyErr_Format(PyExc_ValueError, "src_blocks, dst_blocks and heads must have one size, got %zd, %zd, %zd",
                     pairs, a[7].count, a[8].count);
        goto done;
    }
    if (group < 1 || units % group != 0) {
        PyErr_Format(PyExc_ValueError, "group must divide the %zd units, got %zd", units, group);
        goto done;
    }
    if (a[9].count < units * pairs || a[10].count < units * pairs || a[11].count < units * pairs ||
        a[12].count < units / group + 1) {
        PyErr_SetString(PyExc_ValueError, "an output array is too small");
        goto done;
    }
    const int64_t *sbase = a[0].data, *sstride = a[1].data, *dbase = a[2].data, *dstride = a[3].data;
    const int64_t *unit = a[4].data, *length = a[5].data, *sb = a[6].data, *db = a[7].data, *head = a[8].data;
    int64_t *os = (int64_t *)a[9].data, *od = (int64_t *)a[10].data, *ol = (int64_t *)a[11].data;
    int64_t *starts = (int64_t *)a[12].data;
    Py_ssize_t n = 0;
    for (Py_ssize_t u = 0; u < units; u++) {
        int fresh = u % group == 0; /* a new group: never joined to the previous one */
        if (fresh) {
            starts[u / group] = n;
        }
        for (Py_ssize_t i = 0; i < pairs; i++) {
            int64_t s = sbase[u] + sb[i] * sstride[u] + head[i] * unit[u];
            int64_t d = dbase[u] + db[i] * dstride[u] + head[i] * unit[u];
            if (!fresh && n > 0 && os[n - 1] + ol[n - 1] == s && od[n - 1] + ol[n - 1] == d) {
                ol[n - 1] += length[u];
            } else {
                os[n] = s;
                od[n] = d;
                ol[n] = length[u];
                n++;
            }
            fresh = 0;
        }
    }
    starts[units / group] = n;
    result = PyLong_FromSsize_t(n);
done:
    for (int k = 0; k < got; k++) {
        PyBuffer_Release(&a[k].view);
    }
    return result;
}

static PyMethodDef methods[] = {
    {"pair_ranges", pair_ranges, METH_VARARGS, pair_ranges_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ranges", "The merged byte ranges of a block-to-block KV copy, in one pass.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ranges(void)
{
    return PyModule_Create(&module);
}

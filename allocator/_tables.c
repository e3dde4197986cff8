/* Per-request block-table writes of a whole decode step (kvcache.allocator._tables).
 *
 * Every request owns its table, an int32 [rows, capacity] numpy array. A decode step opens a new
 * block in one request of every block_size: one column to write per such request, in a different
 * array each time, which numpy cannot do in one operation and a Python loop does at ~1 us a
 * request. Here one call writes them all.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

PyDoc_STRVAR(set_columns_doc,
"set_columns(tables, cols, values) -> list[int]\n\n"
"tables[j][:, cols[j]] = values[:, j] for every j (tables: int32 C-contiguous [rows, capacity] arrays;\n"
"cols: int64 [m]; values: int32 C-contiguous [rows, m]). Returns, ascending, the j left unwritten\n"
"because cols[j] is past their table's capacity (the caller widens those tables and writes them).");

static PyObject *set_columns(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *tables;
    Py_buffer cols, values;
    if (!PyArg_ParseTuple(args, "O!y*y*", &PyList_Type, &tables, &cols, &values))
        return NULL;
    PyObject *skipped = NULL;
    const Py_ssize_t m = PyList_GET_SIZE(tables);
    const Py_ssize_t rows = m ? values.len / (Py_ssize_t)sizeof(int32_t) / m : 0;
    if (cols.len != m * (Py_ssize_t)sizeof(int64_t) || values.len != rows * m * (Py_ssize_t)sizeof(int32_t)) {
        PyErr_Format(PyExc_ValueError, "set_columns: %zd tables need %zd bytes of int64 cols and rows * %zd int32 "
                     "values, got %zd and %zd bytes", m, m * (Py_ssize_t)sizeof(int64_t), m, cols.len, values.len);
        goto done;
    }
    skipped = PyList_New(0);
    if (!skipped)
        goto done;
    const int64_t *col = cols.buf;
    const int32_t *val = values.buf;
    for (Py_ssize_t j = 0; j < m; j++) {
        Py_buffer t;
        if (PyObject_GetBuffer(PyList_GET_ITEM(tables, j), &t, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) {
            Py_CLEAR(skipped);
            goto done;
        }
        const int ok_type = t.ndim == 2 && t.itemsize == 4 && t.format && (t.format[0] == 'i' || t.format[0] == 'l')
                            && t.format[1] == '\0';
        if (!ok_type || t.shape[0] != rows || col[j] < 0) {
            PyErr_Format(PyExc_ValueError, "set_columns: tables[%zd] must be an int32 [%zd, capacity] array "
                         "and cols[%zd] >= 0", j, rows, j);
            PyBuffer_Release(&t);
            Py_CLEAR(skipped);
            goto done;
        }
        if (col[j] >= t.shape[1]) {
            PyObject *index = PyLong_FromSsize_t(j);
            int failed = !index || PyList_Append(skipped, index) < 0;
            Py_XDECREF(index);
            PyBuffer_Release(&t);
            if (failed) {
                Py_CLEAR(skipped);
                goto done;
            }
            continue;
        }
        int32_t *data = t.buf;
        const Py_ssize_t capacity = t.shape[1];
        for (Py_ssize_t r = 0; r < rows; r++)
            data[r * capacity + col[j]] = val[r * m + j];
        PyBuffer_Release(&t);
    }
done:
    PyBuffer_Release(&cols);
    PyBuffer_Release(&values);
    return skipped;
}

static PyMethodDef methods[] = {
    {"set_columns", set_columns, METH_VARARGS, set_columns_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tables", "Per-request block-table writes of a whole decode step.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__tables(void) { return PyModule_Create(&module); }

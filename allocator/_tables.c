/* Per-request block-table writes of a whole decode step (kvcache.allocator._tables).
 *
 * Every request owns its table, an int32 [rows, capacity] numpy array. A decode step opens a new
 * block in one request of every block_size: one column to write per such request, in a different
 * array each time, which numpy cannot do in one operation and a Python loop does at ~1 us a
 * request. Here one call writes them all; another runs a decode step's fast path (extends that stay
 * inside their partial last block) over the manager's slot arrays in one pass.
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

PyDoc_STRVAR(extend_fast_doc,
"extend_fast(slots, counts, tokens, num_tokens, fast_limit, next_recycle, tail, changed, stamp, keyed, salted,\n"
"            hashing) -> (bytes, bytes) | None\n\n"
"The fast path of a batch of extends, in one pass. Request i (slot slots[i], intp) gets the next counts[i]\n"
"(int64) of tokens (uint32). It is fast when num_tokens[s] < next_recycle[s] and num_tokens[s] + counts[i]\n"
"<= fast_limit[s] (int64 arrays): its tokens go to tail[s, num_tokens[s] % block_size ...] (uint32\n"
"[slots, block_size]; the limit keeps them in one block), num_tokens[s] grows and changed[s] (bool) is\n"
"cleared. Returns the other requests' i, ascending, as packed intp, and per such request whether it is a\n"
"plain decode extend (one token; with hashing no extra keys: not keyed[s], and not salted[s] unless past\n"
"block 0; without, num_tokens[s] < next_recycle[s]) as bytes of 0/1; or None, changing nothing, when a slot\n"
"is listed twice (stamp: intp scratch, one entry per slot).");

static PyObject *extend_fast(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer slots, counts, tokens, ntok, limit, recycle, tail, changed, stamp, keyed, salted;
    int hashing;
    if (!PyArg_ParseTuple(args, "y*y*y*w*y*y*w*w*w*y*y*p", &slots, &counts, &tokens, &ntok, &limit, &recycle, &tail,
                          &changed, &stamp, &keyed, &salted, &hashing))
        return NULL;
    PyObject *result = NULL, *slow_obj = NULL, *plain_obj = NULL;
    const Py_ssize_t n = slots.len / (Py_ssize_t)sizeof(Py_ssize_t);
    const Py_ssize_t cap = ntok.len / (Py_ssize_t)sizeof(int64_t);
    const Py_ssize_t bs = cap ? tail.len / (Py_ssize_t)sizeof(uint32_t) / cap : 0;
    if (counts.len != n * (Py_ssize_t)sizeof(int64_t) || limit.len != ntok.len || recycle.len != ntok.len
        || changed.len != cap || keyed.len != cap || salted.len != cap
        || stamp.len != cap * (Py_ssize_t)sizeof(Py_ssize_t)
        || (cap && tail.len != cap * bs * (Py_ssize_t)sizeof(uint32_t)) || tokens.len % sizeof(uint32_t)) {
        PyErr_SetString(PyExc_ValueError, "extend_fast: array sizes disagree");
        goto done;
    }
    const Py_ssize_t *slot = slots.buf;
    const int64_t *count = counts.buf;
    const uint32_t *tok = tokens.buf;
    const Py_ssize_t num_tok = tokens.len / (Py_ssize_t)sizeof(uint32_t);
    int64_t *nt = ntok.buf;
    const int64_t *lim = limit.buf, *rec = recycle.buf;
    uint32_t *tl = tail.buf;
    uint8_t *ch = changed.buf;
    Py_ssize_t *st = stamp.buf;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (slot[i] < 0 || slot[i] >= cap || count[i] < 0) {
            PyErr_Format(PyExc_ValueError, "extend_fast: slot %zd or count %lld out of range", slot[i],
                         (long long)count[i]);
            goto done;
        }
        st[slot[i]] = i;
        total += count[i];
    }
    if (total != num_tok) {
        PyErr_Format(PyExc_ValueError, "extend_fast: counts sum to %zd, %zd tokens given", total, num_tok);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (st[slot[i]] != i) { /* listed twice: the caller goes one by one */
            Py_INCREF(Py_None);
            result = Py_None;
            goto done;
        }
    }
    slow_obj = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(Py_ssize_t));
    plain_obj = PyBytes_FromStringAndSize(NULL, n);
    if (!slow_obj || !plain_obj)
        goto done;
    Py_ssize_t *slow = (Py_ssize_t *)PyBytes_AS_STRING(slow_obj);
    uint8_t *plain = (uint8_t *)PyBytes_AS_STRING(plain_obj);
    const uint8_t *key = keyed.buf, *salt = salted.buf;
    Py_ssize_t num_slow = 0, offset = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const Py_ssize_t s = slot[i];
        const int64_t t = nt[s], k = count[i];
        if (t < rec[s] && t + k <= lim[s]) {
            uint32_t *row = tl + s * bs + t % bs;
            for (int64_t j = 0; j < k; j++)
                row[j] = tok[offset + j];
            nt[s] = t + k;
            ch[s] = 0;
        } else {
            /* With hashing, released window blocks are cached (they go to the LRU ring) and may join a run. */
            plain[num_slow] = k == 1 && (hashing ? !key[s] && (t >= bs || !salt[s]) : t < rec[s]);
            slow[num_slow++] = i;
        }
        offset += k;
    }
    if (_PyBytes_Resize(&slow_obj, num_slow * (Py_ssize_t)sizeof(Py_ssize_t)) < 0
        || _PyBytes_Resize(&plain_obj, num_slow) < 0)
        goto done;
    result = PyTuple_Pack(2, slow_obj, plain_obj);
done:
    Py_XDECREF(slow_obj);
    Py_XDECREF(plain_obj);
    PyBuffer_Release(&keyed);
    PyBuffer_Release(&salted);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&counts);
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&ntok);
    PyBuffer_Release(&limit);
    PyBuffer_Release(&recycle);
    PyBuffer_Release(&tail);
    PyBuffer_Release(&changed);
    PyBuffer_Release(&stamp);
    return result;
}

static PyMethodDef methods[] = {
    {"extend_fast", extend_fast, METH_VARARGS, extend_fast_doc},
    {"set_columns", set_columns, METH_VARARGS, set_columns_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tables", "Per-request block-table writes of a whole decode step.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__tables(void) { return PyModule_Create(&module); }

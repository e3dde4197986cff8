/* A host tier's load plan for a one-row manager in one pass (kvcache.transfer._tier).
 *
 * An admit that hits host copies asks the tier, inside the scheduler's call, which host block
 * each newly allocated GPU block reads, pins those host blocks and marks the GPU blocks as being
 * filled. In numpy that is a dozen small passes whose fixed costs (several microseconds each
 * once the caches have gone cold between scheduler calls) made most of such an admit's extra
 * time; here it is one call.
 */
#include "../allocator/_arrays.h"
#include "../allocator/_pool.h"

PyDoc_STRVAR(load_plan_doc,
             "load_plan(ref, cached, stack, top, ring, lru_pos, head, tail, lru_count, table, start, found,\n"
             "          filling, job, out) -> int\n\n"
             "The host pool's arrays (BlockPool._c_arrays, row 0 used) first. table: int32 [1, n], the admitted\n"
             "request's; its columns [start, start + k) are the tier's (-1 = none), k = out's columns. found:\n"
             "int32 [>= k, 1], the host block holding each column's hash (-1 = none). filling: int64, the load\n"
             "filling each GPU block. out: int32 [3, k]. Writes out[0] = those table columns, out[1] = found where\n"
             "they are >= 0 (else -1) and the first m items of out[2] = those host blocks in column order; pins\n"
             "them in the pool (BlockPool.hold_row(0, ...)); sets filling[block] = job for each GPU block.\n"
             "Returns m. Raises AssertionError, changing nothing, where a column wants a block found lacks, or an\n"
             "id is out of range.");

static PyObject *load_plan(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer b[POOL_ARRAYS + 4]; /* the pool's arrays, then table, found, filling, out */
    Py_ssize_t start;
    long long job;
    if (!PyArg_ParseTuple(args, "O&O&O&O&O&O&O&O&O&O&nO&O&LO&", write_array, &b[0], write_array, &b[1],
                          write_array, &b[2], write_array, &b[3], write_array, &b[4], write_array, &b[5], write_array,
                          &b[6], write_array, &b[7], write_array, &b[8], read_array, &b[9], &start, read_array,
                          &b[10], write_array, &b[11], &job, write_array, &b[12]))
        return NULL;
    PyObject *result = NULL;
    pool_t p;
    if (open_pool(&p, b, "load_plan") < 0)
        goto done;
    const Py_ssize_t k = b[12].len / (Py_ssize_t)(3 * sizeof(int32_t));
    const Py_ssize_t width = b[9].len / (Py_ssize_t)sizeof(int32_t);
    const Py_ssize_t num_gpu = b[11].len / (Py_ssize_t)sizeof(int64_t);
    if (b[12].len != k * 3 * (Py_ssize_t)sizeof(int32_t) || start < 0 || start + k > width
        || b[10].len < k * (Py_ssize_t)sizeof(int32_t)) {
        PyErr_Format(PyExc_ValueError, "load_plan: sizes disagree (table %zd, start %zd, found %zd, out %zd bytes)",
                     b[9].len, start, b[10].len, b[12].len);
        goto done;
    }
    const int32_t *dst = (const int32_t *)b[9].buf + start, *found = b[10].buf;
    int32_t *out = b[12].buf, *src = out + k, *ids = out + 2 * k;
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        out[i] = dst[i];
        src[i] = -1;
        if (dst[i] < 0)
            continue;
        if (dst[i] >= num_gpu) {
            PyErr_Format(PyExc_AssertionError, "load_plan: GPU block %d is not in [0, %zd)", (int)dst[i], num_gpu);
            goto done;
        }
        if (found[i] < 0) {
            PyErr_SetString(PyExc_AssertionError, "the tier lost a block between held() and admitted()");
            goto done;
        }
        src[i] = found[i];
        ids[m++] = found[i];
    }
    if (pool_hold(&p, 0, ids, m) < 0)
        goto done;
    int64_t *marks = b[11].buf;
    for (Py_ssize_t i = 0; i < k; i++)
        if (dst[i] >= 0)
            marks[dst[i]] = job;
    result = PyLong_FromSsize_t(m);
done:
    release_buffers(b, POOL_ARRAYS + 4);
    return result;
}

static PyMethodDef methods[] = {
    {"load_plan", load_plan, METH_VARARGS, load_plan_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tier", "A host tier's load plan for a one-row manager in one pass.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__tier(void) { return PyModule_Create(&module); }

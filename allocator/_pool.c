/* Reference drops of whole table rows in one pass (kvcache.allocator._pool).
 *
 * Freeing a request drops one reference on each of its blocks, row by row; blocks reaching zero go
 * on their row's free stack (uncached) or to the tail of its LRU ring (cached). BlockPool keeps
 * that state in numpy arrays; numpy needs a dozen passes (gather, compare, scatter, split by
 * cached, slot arithmetic) where one loop here does it. Same arrays, same order, same results as
 * BlockPool.decref's vectorised path: releases in pair order, stack pushes and ring appends each
 * in that order; a row whose ring would overflow drops its stale entries first.
 *
 * take() is the other way: one row's allocation (a request's new blocks), popping the free stack
 * and then evicting the LRU ring's oldest live entries, as BlockPool._allocate_row does.
 */
#include "_arrays.h"
#include "_pool.h"

PyDoc_STRVAR(release_doc,
"release(ref, cached, stack, top, ring, lru_pos, head, tail, lru_count, rows, blocks, used=-1) -> int\n\n"
"BlockPool.decref(rows[:, None], blocks, unique=True) in one pass: rows int64 [k], blocks int32 [k, L]\n"
"C-contiguous (-1 = hole, skipped); the other arguments are the pool's arrays. With used >= 0 only\n"
"columns [0, used) count, released last column first (a freed request's table, tail first). Raises\n"
"AssertionError, changing nothing, if a block has no reference or an id is out of range.\n"
"Returns how many blocks became free.");

static PyObject *release(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer b[POOL_ARRAYS + 2]; /* the pool's arrays, then rows and blocks */
    Py_ssize_t used = -1;
    if (!PyArg_ParseTuple(args, "O&O&O&O&O&O&O&O&O&O&O&|n", write_array, &b[0], write_array, &b[1], write_array, &b[2],
                          write_array, &b[3], write_array, &b[4], write_array, &b[5], write_array, &b[6], write_array,
                          &b[7], write_array, &b[8], read_array, &b[9], read_array, &b[10], &used))
        return NULL;
    PyObject *result = NULL;
    pool_t p;
    if (open_pool(&p, b, "release") < 0)
        goto done;
    const Py_ssize_t k = b[9].len / (Py_ssize_t)sizeof(int64_t);
    const Py_ssize_t width = k ? b[10].len / (Py_ssize_t)sizeof(int32_t) / k : 0;
    if (b[10].len != k * width * (Py_ssize_t)sizeof(int32_t) || used > width) {
        PyErr_SetString(PyExc_ValueError, "release: the pairs have inconsistent sizes");
        goto done;
    }
    const int tail_first = used >= 0;
    const Py_ssize_t count = tail_first ? used : width; /* column q of the walk: count - 1 - q, tail first */
    const int64_t *rows = b[9].buf;
    const int32_t *blocks = b[10].buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (rows[i] < 0 || rows[i] >= p.rows) {
            PyErr_Format(PyExc_AssertionError, "decref: row %lld is not in [0, %zd)", (long long)rows[i], p.rows);
            goto done;
        }
        for (Py_ssize_t q = 0; q < count; q++) {
            const int32_t blk = blocks[i * width + (tail_first ? count - 1 - q : q)];
            if (blk == -1)
                continue;
            if (blk < -1 || blk >= p.n) {
                PyErr_Format(PyExc_AssertionError, "decref: block %d is not in [0, %zd)", (int)blk, p.n);
                goto done;
            }
            if (p.ref[rows[i] * p.n + blk] < 1) {
                PyErr_Format(PyExc_AssertionError, "decref of a free block: (row %lld, block %d) has 0 references",
                             (long long)rows[i], (int)blk);
                goto done;
            }
        }
    }
    Py_ssize_t released = 0;
    const Py_ssize_t mask = p.cap - 1;
    for (Py_ssize_t i = 0; i < k; i++) {
        const Py_ssize_t r = rows[i];
        for (Py_ssize_t q = 0; q < count; q++) {
            const int32_t blk = blocks[i * width + (tail_first ? count - 1 - q : q)];
            if (blk < 0)
                continue;
            const Py_ssize_t flat = r * p.n + blk;
            if (--p.ref[flat] > 0)
                continue;
            released++;
            if (!p.cached[flat]) {
                p.stack[r * p.n + p.top[r]++] = blk;
                continue;
            }
            if (p.lru_count[r] == 0) {  /* every entry is stale: restart at 0 */
                p.head[r] = p.tail[r] = 0;
            } else if (p.tail[r] - p.head[r] + 1 > p.cap) {
                compact(&p, r);
            }
            const Py_ssize_t g = r * p.cap + (p.tail[r] & mask);
            p.ring[g] = blk;
            p.lru_pos[flat] = g;
            p.tail[r]++;
            p.lru_count[r]++;
        }
    }
    result = PyLong_FromSsize_t(released);
done:
    release_buffers(b, POOL_ARRAYS + 2);
    return result;
}

PyDoc_STRVAR(take_doc,
"take(ref, cached, stack, top, ring, lru_pos, head, tail, lru_count, row, out, evicted, ascending) -> int\n\n"
"BlockPool.allocate(len(out), [row]) in one pass: pop row's free stack (LIFO), then evict its oldest\n"
"live LRU entries; each block gets refcount 1 and an evicted one loses its cached flag. ``out`` (int32,\n"
"C-contiguous) receives the blocks in pop order, or sorted with ``ascending``; ``evicted`` (int32, at\n"
"least as long) the evicted ids, oldest first. Returns how many were evicted, or -1, changing nothing,\n"
"when the row has fewer than len(out) allocatable blocks.");

static PyObject *take(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer b[POOL_ARRAYS + 2]; /* the pool's arrays, then out and evicted */
    Py_ssize_t r;
    int ascending;
    if (!PyArg_ParseTuple(args, "O&O&O&O&O&O&O&O&O&nO&O&p", write_array, &b[0], write_array, &b[1], write_array,
                          &b[2], write_array, &b[3], write_array, &b[4], write_array, &b[5], write_array, &b[6],
                          write_array, &b[7], write_array, &b[8], &r, write_array, &b[9], write_array, &b[10],
                          &ascending))
        return NULL;
    PyObject *result = NULL;
    pool_t p;
    if (open_pool(&p, b, "take") < 0)
        goto done;
    const Py_ssize_t want = b[9].len / (Py_ssize_t)sizeof(int32_t);
    if (b[9].len % (Py_ssize_t)sizeof(int32_t) || b[10].len < b[9].len) {
        PyErr_SetString(PyExc_ValueError, "take: out must be int32 and evicted at least as long");
        goto done;
    }
    if (r < 0 || r >= p.rows) {
        PyErr_Format(PyExc_ValueError, "take: row %zd is not in [0, %zd)", r, p.rows);
        goto done;
    }
    const Py_ssize_t evicted = pool_take(&p, r, want, b[9].buf, b[10].buf, ascending);
    if (evicted == -2)
        goto done;
    result = PyLong_FromSsize_t(evicted);
done:
    release_buffers(b, POOL_ARRAYS + 2);
    return result;
}

PyDoc_STRVAR(hold_doc,
"hold(ref, cached, stack, top, ring, lru_pos, head, tail, lru_count, row, blocks) -> int\n\n"
"BlockPool.incref([[row]], blocks[None, :], unique=True) in one pass: blocks int32 [L] C-contiguous,\n"
"distinct (-1 = hole, skipped). A cached free block leaves the LRU ring; where the revived entries are\n"
"exactly the ring's newest, its tail moves back over them. Raises AssertionError, changing nothing, if a\n"
"block is free and uncached or an id is out of range. Returns how many blocks were revived.");

static PyObject *hold(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer b[POOL_ARRAYS + 1]; /* the pool's arrays, then blocks */
    Py_ssize_t r;
    if (!PyArg_ParseTuple(args, "O&O&O&O&O&O&O&O&O&nO&", write_array, &b[0], write_array, &b[1], write_array, &b[2],
                          write_array, &b[3], write_array, &b[4], write_array, &b[5], write_array, &b[6], write_array,
                          &b[7], write_array, &b[8], &r, read_array, &b[9]))
        return NULL;
    PyObject *result = NULL;
    pool_t p;
    if (open_pool(&p, b, "hold") < 0)
        goto done;
    const Py_ssize_t width = b[9].len / (Py_ssize_t)sizeof(int32_t);
    const int32_t *blocks = b[9].buf;
    if (b[9].len % (Py_ssize_t)sizeof(int32_t)) {
        PyErr_SetString(PyExc_ValueError, "hold: blocks must be int32");
        goto done;
    }
    const Py_ssize_t revived = pool_hold(&p, r, blocks, width);
    if (revived >= 0)
        result = PyLong_FromSsize_t(revived);
done:
    release_buffers(b, POOL_ARRAYS + 1);
    return result;
}

static PyMethodDef methods[] = {
    {"release", release, METH_VARARGS, release_doc},
    {"take", take, METH_VARARGS, take_doc},
    {"hold", hold, METH_VARARGS, hold_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pool", "Reference drops of whole table rows, and one row's allocations, in one pass.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pool(void) { return PyModule_Create(&module); }

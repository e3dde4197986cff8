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
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int32_t *ref;
    uint8_t *cached;
    int32_t *stack;
    int32_t *ring;
    Py_ssize_t *lru_pos, *top, *head, *tail, *lru_count;
    Py_ssize_t rows, n, cap;
} pool_t;

/* Drop row r's stale ring entries in place: live ones (oldest first) close up behind its head. A write
 * never passes the read position in ring order, so nothing unread is overwritten. */
static void compact(pool_t *p, Py_ssize_t r)
{
    const Py_ssize_t mask = p->cap - 1, base = r * p->cap, head = p->head[r];
    Py_ssize_t k = 0;
    for (Py_ssize_t pos = head; pos < p->tail[r]; pos++) {
        const Py_ssize_t g = base + (pos & mask);
        const int32_t blk = p->ring[g];
        if (p->lru_pos[r * p->n + blk] != g)
            continue;
        const Py_ssize_t to = base + ((head + k++) & mask);
        p->ring[to] = blk;
        p->lru_pos[r * p->n + blk] = to;
    }
    p->tail[r] = head + k;
}

enum { POOL_ARRAYS = 9 }; /* ref, cached, stack, top, ring, lru_pos, head, tail, lru_count: BlockPool's arrays */

/* Point ``p`` at the pool's arrays (in that order), checking that their sizes agree; ValueError naming ``who``. */
static int open_pool(pool_t *p, Py_buffer *b, const char *who)
{
    p->rows = b[3].len / (Py_ssize_t)sizeof(Py_ssize_t);
    p->n = p->rows ? b[0].len / (Py_ssize_t)sizeof(int32_t) / p->rows : 0;
    p->cap = p->rows ? b[4].len / (Py_ssize_t)sizeof(int32_t) / p->rows : 0;
    if (p->rows < 1 || p->n < 1 || p->cap < 1 || (p->cap & (p->cap - 1)) || b[1].len != p->rows * p->n
        || b[2].len != b[0].len || b[5].len != p->rows * p->n * (Py_ssize_t)sizeof(Py_ssize_t)
        || b[6].len != b[3].len || b[7].len != b[3].len || b[8].len != b[3].len) {
        PyErr_Format(PyExc_ValueError, "%s: the pool's arrays have inconsistent sizes", who);
        return -1;
    }
    p->ref = b[0].buf;
    p->cached = b[1].buf;
    p->stack = b[2].buf;
    p->top = b[3].buf;
    p->ring = b[4].buf;
    p->lru_pos = b[5].buf;
    p->head = b[6].buf;
    p->tail = b[7].buf;
    p->lru_count = b[8].buf;
    return 0;
}

static void release_buffers(Py_buffer *b, int count)
{
    for (int i = 0; i < count; i++)
        PyBuffer_Release(&b[i]);
}

PyDoc_STRVAR(release_doc,
"release(ref, cached, stack, top, ring, lru_pos, head, tail, lru_count, rows, blocks) -> int\n\n"
"BlockPool.decref(rows[:, None], blocks, unique=True) in one pass: rows int64 [k], blocks int32 [k, L]\n"
"C-contiguous (-1 = hole, skipped); the other arguments are the pool's arrays. Raises\n"
"AssertionError, changing nothing, if a block has no reference or an id is out of range.\n"
"Returns how many blocks became free.");

static PyObject *release(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer b[POOL_ARRAYS + 2]; /* the pool's arrays, then rows and blocks */
    if (!PyArg_ParseTuple(args, "w*w*w*w*w*w*w*w*w*y*y*", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5], &b[6], &b[7],
                          &b[8], &b[9], &b[10]))
        return NULL;
    PyObject *result = NULL;
    pool_t p;
    if (open_pool(&p, b, "release") < 0)
        goto done;
    const Py_ssize_t k = b[9].len / (Py_ssize_t)sizeof(int64_t);
    const Py_ssize_t width = k ? b[10].len / (Py_ssize_t)sizeof(int32_t) / k : 0;
    if (b[10].len != k * width * (Py_ssize_t)sizeof(int32_t)) {
        PyErr_SetString(PyExc_ValueError, "release: the pairs have inconsistent sizes");
        goto done;
    }
    const int64_t *rows = b[9].buf;
    const int32_t *blocks = b[10].buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (rows[i] < 0 || rows[i] >= p.rows) {
            PyErr_Format(PyExc_AssertionError, "decref: row %lld is not in [0, %zd)", (long long)rows[i], p.rows);
            goto done;
        }
        for (Py_ssize_t j = 0; j < width; j++) {
            const int32_t blk = blocks[i * width + j];
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
        for (Py_ssize_t j = 0; j < width; j++) {
            const int32_t blk = blocks[i * width + j];
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

static int cmp_int32(const void *a, const void *b)
{
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
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
    if (!PyArg_ParseTuple(args, "w*w*w*w*w*w*w*w*w*nw*w*p", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5], &b[6], &b[7],
                          &b[8], &r, &b[9], &b[10], &ascending))
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
    int32_t *out = b[9].buf, *evicted = b[10].buf;
    const Py_ssize_t top = p.top[r];
    if (want > top + p.lru_count[r]) {
        result = PyLong_FromLong(-1);
        goto done;
    }
    const Py_ssize_t from_stack = want < top ? want : top, from_ring = want - from_stack;
    /* Oldest live entries first (an entry is live when its block still points back at it): found before
     * anything changes, so a ring that disagrees with lru_count (an owner bug) changes nothing. */
    const Py_ssize_t mask = p.cap - 1, base = r * p.cap;
    Py_ssize_t pos = p.head[r], got = 0;
    while (got < from_ring && pos < p.tail[r]) {
        const Py_ssize_t g = base + (pos++ & mask);
        const int32_t blk = p.ring[g];
        if (blk >= 0 && blk < p.n && p.lru_pos[r * p.n + blk] == g)
            evicted[got++] = blk;
    }
    if (got < from_ring) {
        PyErr_Format(PyExc_AssertionError, "LRU ring of row %zd holds fewer than %zd live entries", r, from_ring);
        goto done;
    }
    const int32_t *stack = p.stack + r * p.n;
    for (Py_ssize_t i = 0; i < from_stack; i++)
        out[i] = stack[top - 1 - i];
    p.top[r] = top - from_stack;
    for (Py_ssize_t i = 0; i < from_ring; i++) {
        const Py_ssize_t flat = r * p.n + evicted[i];
        p.lru_pos[flat] = -1;
        p.cached[flat] = 0;
        out[from_stack + i] = evicted[i];
    }
    if (from_ring) {
        p.head[r] = pos;
        p.lru_count[r] -= from_ring;
    }
    for (Py_ssize_t i = 0; i < want; i++)
        p.ref[r * p.n + out[i]] = 1;
    if (ascending && want > 1)
        qsort(out, (size_t)want, sizeof(int32_t), cmp_int32);
    result = PyLong_FromSsize_t(from_ring);
done:
    release_buffers(b, POOL_ARRAYS + 2);
    return result;
}

static PyMethodDef methods[] = {
    {"release", release, METH_VARARGS, release_doc},
    {"take", take, METH_VARARGS, take_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pool", "Reference drops of whole table rows, and one row's allocations, in one pass.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pool(void) { return PyModule_Create(&module); }

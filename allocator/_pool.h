/* The block pool's arrays as C sees them, shared by the C passes over them (kvcache.allocator._pool, _tables).
 *
 * BlockPool keeps, per row: reference counts, cached flags, a free stack (LIFO) and an LRU ring of cached free
 * blocks whose live entries are the ones their block's lru_pos points back at. Everything here is static: each
 * extension that includes it gets its own copy.
 */
#ifndef KVCACHE_POOL_H
#define KVCACHE_POOL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>

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
static inline void compact(pool_t *p, Py_ssize_t r)
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
static inline int open_pool(pool_t *p, Py_buffer *b, const char *who)
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

static inline void release_buffers(Py_buffer *b, int count)
{
    for (int i = 0; i < count; i++)
        PyBuffer_Release(&b[i]);
}

static inline int cmp_int32(const void *a, const void *b)
{
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* BlockPool.allocate(want, [r]): pop row r's free stack (LIFO), then evict its oldest live LRU entries; each
 * block gets refcount 1 and an evicted one loses its cached flag. ``out`` gets the blocks in pop order (sorted
 * with ``ascending``), ``evicted`` the evicted ids, oldest first. Returns how many were evicted, or -1 (changing
 * nothing) when the row has fewer than ``want`` allocatable blocks, or -2 with AssertionError set (changing
 * nothing) when the ring holds fewer live entries than lru_count says (an owner bug). */
static inline Py_ssize_t pool_take(pool_t *p, Py_ssize_t r, Py_ssize_t want, int32_t *out, int32_t *evicted, int ascending)
{
    const Py_ssize_t top = p->top[r];
    if (want > top + p->lru_count[r])
        return -1;
    const Py_ssize_t from_stack = want < top ? want : top, from_ring = want - from_stack;
    /* Found before anything changes, so a ring that disagrees with lru_count changes nothing. */
    const Py_ssize_t mask = p->cap - 1, base = r * p->cap;
    Py_ssize_t pos = p->head[r], got = 0;
    while (got < from_ring && pos < p->tail[r]) {
        const Py_ssize_t g = base + (pos++ & mask);
        const int32_t blk = p->ring[g];
        if (blk >= 0 && blk < p->n && p->lru_pos[r * p->n + blk] == g)
            evicted[got++] = blk;
    }
    if (got < from_ring) {
        PyErr_Format(PyExc_AssertionError, "LRU ring of row %zd holds fewer than %zd live entries", r, from_ring);
        return -2;
    }
    const int32_t *stack = p->stack + r * p->n;
    for (Py_ssize_t i = 0; i < from_stack; i++)
        out[i] = stack[top - 1 - i];
    p->top[r] = top - from_stack;
    for (Py_ssize_t i = 0; i < from_ring; i++) {
        const Py_ssize_t flat = r * p->n + evicted[i];
        p->lru_pos[flat] = -1;
        p->cached[flat] = 0;
        out[from_stack + i] = evicted[i];
    }
    if (from_ring) {
        p->head[r] = pos;
        p->lru_count[r] -= from_ring;
    }
    for (Py_ssize_t i = 0; i < want; i++)
        p->ref[r * p->n + out[i]] = 1;
    if (ascending && want > 1)
        qsort(out, (size_t)want, sizeof(int32_t), cmp_int32);
    return from_ring;
}

/* BlockPool.incref([[r]], blocks[None, :], unique=True): ``width`` distinct int32 blocks of row r (-1 = hole,
 * skipped) gain a reference; a cached free block leaves the LRU ring, and where the revived entries are exactly the
 * ring's newest, its tail moves back over them. Returns how many were revived, or -1 with AssertionError set
 * (changing nothing) for a row or block out of range or a free uncached block. */
static inline Py_ssize_t pool_hold(pool_t *p, Py_ssize_t r, const int32_t *blocks, Py_ssize_t width)
{
    if (r < 0 || r >= p->rows) {
        PyErr_Format(PyExc_AssertionError, "incref: row %zd is not in [0, %zd)", r, p->rows);
        return -1;
    }
    Py_ssize_t lost = 0, first = -1;
    for (Py_ssize_t q = 0; q < width; q++) {
        const int32_t blk = blocks[q];
        if (blk == -1)
            continue;
        if (blk < -1 || blk >= p->n) {
            PyErr_Format(PyExc_AssertionError, "incref: block %d is not in [0, %zd)", (int)blk, p->n);
            return -1;
        }
        if (p->ref[r * p->n + blk] == 0 && p->lru_pos[r * p->n + blk] < 0 && lost++ == 0)
            first = blk;
    }
    if (lost) {
        PyErr_Format(PyExc_AssertionError, "incref of %zd free uncached blocks, first (row %zd, block %zd)", lost, r,
                     first);
        return -1;
    }
    Py_ssize_t revived = 0, low = PY_SSIZE_T_MAX, high = -1;
    for (Py_ssize_t q = 0; q < width; q++) {
        const int32_t blk = blocks[q];
        if (blk < 0)
            continue;
        const Py_ssize_t flat = r * p->n + blk;
        if (p->ref[flat]++ > 0)
            continue;
        const Py_ssize_t g = p->lru_pos[flat];
        low = g < low ? g : low;
        high = g > high ? g : high;
        p->lru_pos[flat] = -1;
        revived++;
    }
    if (revived) {
        p->lru_count[r] -= revived;
        const Py_ssize_t newest = r * p->cap + ((p->tail[r] - 1) & (p->cap - 1));
        if (high == newest && high - low == revived - 1)
            p->tail[r] -= revived;
    }
    return revived;
}

#endif

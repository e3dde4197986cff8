/* Batch operations on an open-addressing table of 32-byte block hashes (kvcache.allocator._hashtable).
 *
 * The prefix index looks up, inserts and removes thousands of chained block hashes per request;
 * a Python dict costs a bytes object and a dict operation per block. Here the table is two
 * numpy arrays the caller owns (keys uint8 [cap, 32], values int32 [cap], -1 = empty slot,
 * cap a power of two) and each call walks a whole batch of packed hashes in C without the GIL.
 * Linear probing with backward-shift deletion, so there are no tombstones. The home slot mixes
 * the hash's first 8 bytes with a per-table secret seed, so inputs chosen to collide in the
 * low bits of the (public) hash do not pile up in one probe run. The caller keeps the load at
 * most one half and never calls two functions on the same arrays at once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define KEY_BYTES 32

typedef struct {
    uint8_t *keys;
    int32_t *vals;
    uint64_t mask;
    uint64_t seed;
} table_t;

static inline uint64_t home_slot(const table_t *t, const uint8_t *key)
{
    uint64_t h;
    memcpy(&h, key, sizeof h);
    h ^= t->seed;
    h *= 0x9E3779B97F4A7C15ULL;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 32;
    return h & t->mask;
}

/* Slot holding key, or the empty slot where it would go (vals[slot] == -1). */
static inline uint64_t probe(const table_t *t, const uint8_t *key)
{
    uint64_t slot = home_slot(t, key);
    while (t->vals[slot] >= 0 && memcmp(t->keys + slot * KEY_BYTES, key, KEY_BYTES) != 0) {
        slot = (slot + 1) & t->mask;
    }
    return slot;
}

/* Fill a table_t from (keys, vals) buffers, checking their sizes agree and cap is a power of two. */
static int open_table(table_t *t, Py_buffer *keys, Py_buffer *vals, unsigned long long seed)
{
    Py_ssize_t cap = vals->len / (Py_ssize_t)sizeof(int32_t);
    if (cap < 1 || (cap & (cap - 1)) != 0 || vals->len % (Py_ssize_t)sizeof(int32_t) != 0) {
        PyErr_Format(PyExc_ValueError, "vals must be int32 with a power-of-two length, got %zd bytes", vals->len);
        return -1;
    }
    if (keys->len != cap * KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "keys must hold %zd bytes (cap x 32), got %zd", cap * KEY_BYTES, keys->len);
        return -1;
    }
    t->keys = (uint8_t *)keys->buf;
    t->vals = (int32_t *)vals->buf;
    t->mask = (uint64_t)cap - 1;
    t->seed = (uint64_t)seed;
    return 0;
}

static int check_packed(Py_buffer *b, const char *name)
{
    if (b->len % KEY_BYTES != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be a multiple of 32 bytes, got %zd", name, b->len);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(find_doc,
             "find(keys, vals, seed, queries, stop_at_miss) -> bytes\n\n"
             "int32 value of each packed 32-byte query (-1 if absent). With stop_at_miss, stops at the\n"
             "first absent query and returns only the values before it.");

static PyObject *find(PyObject *self, PyObject *args)
{
    Py_buffer keys, vals, queries;
    unsigned long long seed;
    int stop_at_miss;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*Ky*p", &keys, &vals, &seed, &queries, &stop_at_miss)) {
        return NULL;
    }
    PyObject *result = NULL;
    table_t t;
    if (open_table(&t, &keys, &vals, seed) == 0 && check_packed(&queries, "queries") == 0) {
        Py_ssize_t n = queries.len / KEY_BYTES, found = n;
        result = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int32_t));
        if (result != NULL) {
            int32_t *out = (int32_t *)PyBytes_AS_STRING(result);
            const uint8_t *q = (const uint8_t *)queries.buf;
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t i = 0; i < n; i++) {
                out[i] = t.vals[probe(&t, q + i * KEY_BYTES)];
                if (out[i] < 0 && stop_at_miss) {
                    found = i;
                    break;
                }
            }
            Py_END_ALLOW_THREADS
            if (found < n) {
                _PyBytes_Resize(&result, found * (Py_ssize_t)sizeof(int32_t));
            }
        }
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&vals);
    PyBuffer_Release(&queries);
    return result;
}

PyDoc_STRVAR(insert_doc,
             "insert(keys, vals, seed, new_keys, new_vals) -> int\n\n"
             "Insert each packed key with its int32 value (>= 0) unless present; returns how many were\n"
             "inserted. The caller guarantees room (load stays at most one half).");

static PyObject *insert(PyObject *self, PyObject *args)
{
    Py_buffer keys, vals, new_keys, new_vals;
    unsigned long long seed;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*w*Ky*y*", &keys, &vals, &seed, &new_keys, &new_vals)) {
        return NULL;
    }
    PyObject *result = NULL;
    table_t t;
    if (open_table(&t, &keys, &vals, seed) == 0 && check_packed(&new_keys, "new_keys") == 0) {
        Py_ssize_t n = new_keys.len / KEY_BYTES, inserted = 0, bad = -1;
        if (new_vals.len != n * (Py_ssize_t)sizeof(int32_t)) {
            PyErr_Format(PyExc_ValueError, "new_vals must hold %zd int32, got %zd bytes", n, new_vals.len);
        } else {
            const uint8_t *k = (const uint8_t *)new_keys.buf;
            const int32_t *v = (const int32_t *)new_vals.buf;
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t i = 0; i < n; i++) {
                if (v[i] < 0) {
                    bad = i;
                    break;
                }
                uint64_t slot = probe(&t, k + i * KEY_BYTES);
                if (t.vals[slot] < 0) {
                    memcpy(t.keys + slot * KEY_BYTES, k + i * KEY_BYTES, KEY_BYTES);
                    t.vals[slot] = v[i];
                    inserted++;
                }
            }
            Py_END_ALLOW_THREADS
            if (bad >= 0) {
                PyErr_Format(PyExc_ValueError, "new_vals[%zd] is negative", bad);
            } else {
                result = PyLong_FromSsize_t(inserted);
            }
        }
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&vals);
    PyBuffer_Release(&new_keys);
    PyBuffer_Release(&new_vals);
    return result;
}

PyDoc_STRVAR(remove_doc,
             "remove(keys, vals, seed, old_keys) -> int\n\n"
             "Remove each packed key that is present; returns how many were removed.");

static PyObject *remove_keys(PyObject *self, PyObject *args)
{
    Py_buffer keys, vals, old_keys;
    unsigned long long seed;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*w*Ky*", &keys, &vals, &seed, &old_keys)) {
        return NULL;
    }
    PyObject *result = NULL;
    table_t t;
    if (open_table(&t, &keys, &vals, seed) == 0 && check_packed(&old_keys, "old_keys") == 0) {
        Py_ssize_t n = old_keys.len / KEY_BYTES, removed = 0;
        const uint8_t *k = (const uint8_t *)old_keys.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t hole = probe(&t, k + i * KEY_BYTES);
            if (t.vals[hole] < 0) {
                continue;
            }
            removed++;
            /* Backward-shift: pull later entries of the run into the hole when their home slot
             * does not lie cyclically in (hole, j]. */
            uint64_t j = hole;
            for (;;) {
                j = (j + 1) & t.mask;
                if (t.vals[j] < 0) {
                    break;
                }
                uint64_t home = home_slot(&t, t.keys + j * KEY_BYTES);
                if (((j - home) & t.mask) >= ((j - hole) & t.mask)) {
                    memcpy(t.keys + hole * KEY_BYTES, t.keys + j * KEY_BYTES, KEY_BYTES);
                    t.vals[hole] = t.vals[j];
                    hole = j;
                }
            }
            t.vals[hole] = -1;
        }
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(removed);
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&vals);
    PyBuffer_Release(&old_keys);
    return result;
}

PyDoc_STRVAR(insert_new_doc,
             "insert_new(keys, vals, seed, hashes, entries, blocks, hash_of, entry_blocks, entry_at, holders) -> int\n\n"
             "The prefix index's insert of n hashes new to it, each held by a block on every row, in one pass:\n"
             "entry entries[i] (int64) gets hash i (hash_of: 32 bytes per entry), its blocks\n"
             "blocks[i, :] (int32 [n, rows]) in entry_blocks (int32 [entries, rows]), the reverse map\n"
             "entry_at[r, b] = entry (int32 [rows, num_blocks]) and holders[entry] = rows; then the key goes\n"
             "in the table. Raises AssertionError, changing nothing, if a block is out of range or a pair\n"
             "already holds a hash. Returns the keys inserted. The caller guarantees table room.");

static PyObject *insert_new(PyObject *self, PyObject *args)
{
    Py_buffer keys, vals, hashes, entries, blocks, hash_of, entry_blocks, entry_at, holders;
    unsigned long long seed;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*w*Ky*y*y*w*w*w*w*", &keys, &vals, &seed, &hashes, &entries, &blocks, &hash_of,
                          &entry_blocks, &entry_at, &holders)) {
        return NULL;
    }
    PyObject *result = NULL;
    table_t t;
    if (open_table(&t, &keys, &vals, seed) == 0 && check_packed(&hashes, "hashes") == 0) {
        const Py_ssize_t n = hashes.len / KEY_BYTES;
        const Py_ssize_t cap = holders.len / (Py_ssize_t)sizeof(int32_t);
        const Py_ssize_t rows = cap ? entry_blocks.len / (Py_ssize_t)sizeof(int32_t) / cap : 0;
        const Py_ssize_t num_blocks = rows ? entry_at.len / (Py_ssize_t)sizeof(int32_t) / rows : 0;
        const int64_t *e = (const int64_t *)entries.buf;
        const int32_t *b = (const int32_t *)blocks.buf;
        int32_t *eb = (int32_t *)entry_blocks.buf, *at = (int32_t *)entry_at.buf, *held = (int32_t *)holders.buf;
        uint8_t *ho = (uint8_t *)hash_of.buf;
        const uint8_t *k = (const uint8_t *)hashes.buf;
        if (rows < 1 || entries.len != n * (Py_ssize_t)sizeof(int64_t)
            || blocks.len != n * rows * (Py_ssize_t)sizeof(int32_t) || hash_of.len != cap * KEY_BYTES
            || entry_blocks.len != cap * rows * (Py_ssize_t)sizeof(int32_t)
            || entry_at.len != rows * num_blocks * (Py_ssize_t)sizeof(int32_t)) {
            PyErr_Format(PyExc_ValueError, "insert_new: buffers disagree (n %zd, rows %zd, entries %zd, blocks %zd)",
                         n, rows, cap, num_blocks);
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            if (e[i] < 0 || e[i] >= cap) {
                PyErr_Format(PyExc_AssertionError, "entry %lld of hash %zd is outside [0, %zd)", (long long)e[i], i,
                             cap);
                goto done;
            }
            for (Py_ssize_t r = 0; r < rows; r++) {
                const int32_t blk = b[i * rows + r];
                if (blk < 0 || blk >= num_blocks || at[r * num_blocks + blk] >= 0) {
                    PyErr_Format(PyExc_AssertionError, "a pair already holds a hash (or is out of range): row %zd, "
                                 "block %d", r, (int)blk);
                    goto done;
                }
            }
        }
        Py_ssize_t inserted = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            const int64_t entry = e[i];
            memcpy(ho + entry * KEY_BYTES, k + i * KEY_BYTES, KEY_BYTES);
            for (Py_ssize_t r = 0; r < rows; r++) {
                const int32_t blk = b[i * rows + r];
                eb[entry * rows + r] = blk;
                at[r * num_blocks + blk] = (int32_t)entry;
            }
            held[entry] = (int32_t)rows;
            uint64_t slot = probe(&t, k + i * KEY_BYTES);
            if (t.vals[slot] < 0) {
                memcpy(t.keys + slot * KEY_BYTES, k + i * KEY_BYTES, KEY_BYTES);
                t.vals[slot] = (int32_t)entry;
                inserted++;
            }
        }
        result = PyLong_FromSsize_t(inserted);
    }
done:
    PyBuffer_Release(&keys);
    PyBuffer_Release(&vals);
    PyBuffer_Release(&hashes);
    PyBuffer_Release(&entries);
    PyBuffer_Release(&blocks);
    PyBuffer_Release(&hash_of);
    PyBuffer_Release(&entry_blocks);
    PyBuffer_Release(&entry_at);
    PyBuffer_Release(&holders);
    return result;
}

static PyMethodDef methods[] = {
    {"find", find, METH_VARARGS, find_doc},
    {"insert", insert, METH_VARARGS, insert_doc},
    {"remove", remove_keys, METH_VARARGS, remove_doc},
    {"insert_new", insert_new, METH_VARARGS, insert_new_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hashtable", "Batch operations on an open-addressing table of 32-byte hashes.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hashtable(void) { return PyModule_Create(&module); }

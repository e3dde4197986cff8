/* Batch operations on an open-addressing table of 32-byte block hashes (kvcache.allocator._hashtable).
 *
 * The prefix index looks up, inserts and removes thousands of chained block hashes per request;
 * a Python dict costs a bytes object and a dict operation per block. Here the table is one numpy
 * array of 8-byte slots the caller owns (``SLOT_DTYPE``: uint32 tag, int32 entry, -1 = empty;
 * a power-of-two count), and the keys live in the caller's entry array ``hash_of`` (32 bytes per
 * entry): a slot holds an entry id and 32 bits of its key's mixed hash, and a tag match is
 * confirmed against ``hash_of[entry]``. So a probe touches one 8-byte slot, not a 32-byte key
 * beside a separate value (a table of 2**20 slots is 8 MiB, not 36), which keeps a step's misses
 * down once the table outgrows the CPU's caches. Each call walks a whole batch of packed hashes
 * in C without the GIL. Linear probing with backward-shift deletion, so there are no tombstones.
 * The home slot mixes the hash's first 8 bytes with a per-table secret seed, so inputs chosen to
 * collide in the low bits of the (public) hash do not pile up in one probe run; the tag is the
 * mix's low 32 bits, so the home of a slot's key is ``tag & mask`` (no key read to shift one).
 * The caller keeps the load at most one half and never calls two functions on the same arrays at
 * once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define KEY_BYTES 32

typedef struct {
    uint32_t tag;  /* low 32 bits of mix(key): the home slot is tag & mask */
    int32_t entry; /* -1: empty */
} slot_t;

typedef struct {
    slot_t *slots;
    const uint8_t *keys; /* hash_of: KEY_BYTES per entry */
    int64_t num_keys;    /* entries in hash_of */
    uint64_t mask;
    uint64_t seed;
} table_t;

static inline uint32_t tag_of(const table_t *t, const uint8_t *key)
{
    uint64_t h;
    memcpy(&h, key, sizeof h);
    h ^= t->seed;
    h *= 0x9E3779B97F4A7C15ULL;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 32;
    return (uint32_t)h;
}

/* Slot holding key (tagged ``tag``), or the empty slot where it would go (entry == -1). */
static inline uint64_t probe(const table_t *t, const uint8_t *key, uint32_t tag)
{
    uint64_t slot = tag & t->mask;
    for (;;) {
        const slot_t s = t->slots[slot];
        if (s.entry < 0 || (s.tag == tag && memcmp(t->keys + (int64_t)s.entry * KEY_BYTES, key, KEY_BYTES) == 0)) {
            return slot;
        }
        slot = (slot + 1) & t->mask;
    }
}

/* Fill a table_t from (slots, hash_of) buffers, checking their sizes and that the slot count is a power of two
 * below 2**32 (the tag holds the home). */
static int open_table(table_t *t, Py_buffer *slots, Py_buffer *hash_of, unsigned long long seed)
{
    Py_ssize_t cap = slots->len / (Py_ssize_t)sizeof(slot_t);
    if (cap < 1 || (cap & (cap - 1)) != 0 || slots->len % (Py_ssize_t)sizeof(slot_t) != 0
        || (unsigned long long)cap > (1ULL << 32)) {
        PyErr_Format(PyExc_ValueError, "slots must be 8-byte (tag, entry) pairs, a power of two of them, got %zd bytes",
                     slots->len);
        return -1;
    }
    if (hash_of->len % KEY_BYTES != 0) {
        PyErr_Format(PyExc_ValueError, "hash_of must hold 32 bytes per entry, got %zd bytes", hash_of->len);
        return -1;
    }
    t->slots = (slot_t *)slots->buf;
    t->keys = (const uint8_t *)hash_of->buf;
    t->num_keys = hash_of->len / KEY_BYTES;
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
             "find(slots, hash_of, seed, queries, stop_at_miss) -> bytes\n\n"
             "int32 entry of each packed 32-byte query (-1 if absent). With stop_at_miss, stops at the\n"
             "first absent query and returns only the entries before it.");

static PyObject *find(PyObject *self, PyObject *args)
{
    Py_buffer slots, hash_of, queries;
    unsigned long long seed;
    int stop_at_miss;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*Ky*p", &slots, &hash_of, &seed, &queries, &stop_at_miss)) {
        return NULL;
    }
    PyObject *result = NULL;
    table_t t;
    if (open_table(&t, &slots, &hash_of, seed) == 0 && check_packed(&queries, "queries") == 0) {
        Py_ssize_t n = queries.len / KEY_BYTES, found = n;
        result = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int32_t));
        if (result != NULL) {
            int32_t *out = (int32_t *)PyBytes_AS_STRING(result);
            const uint8_t *q = (const uint8_t *)queries.buf;
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t i = 0; i < n; i++) {
                const uint8_t *key = q + i * KEY_BYTES;
                out[i] = t.slots[probe(&t, key, tag_of(&t, key))].entry;
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
    PyBuffer_Release(&slots);
    PyBuffer_Release(&hash_of);
    PyBuffer_Release(&queries);
    return result;
}

/* Put entry ``entry`` (whose key hash_of already holds) at its key's empty slot, or leave the table alone if the
 * key is in it; returns 1 if inserted. */
static inline int put(table_t *t, const uint8_t *key, int32_t entry)
{
    const uint32_t tag = tag_of(t, key);
    const uint64_t slot = probe(t, key, tag);
    if (t->slots[slot].entry >= 0) {
        return 0;
    }
    t->slots[slot].tag = tag;
    t->slots[slot].entry = entry;
    return 1;
}

PyDoc_STRVAR(insert_doc,
             "insert(slots, hash_of, seed, new_keys, new_entries) -> int\n\n"
             "Insert each packed key under its int32 entry unless the key is present; hash_of[entry] must\n"
             "already hold the key (the table keeps only entry ids). Returns how many were inserted. Raises\n"
             "ValueError, changing nothing, for an entry out of range or not holding its key. The caller\n"
             "guarantees room (load stays at most one half).");

static PyObject *insert(PyObject *self, PyObject *args)
{
    Py_buffer slots, hash_of, new_keys, new_entries;
    unsigned long long seed;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*Ky*y*", &slots, &hash_of, &seed, &new_keys, &new_entries)) {
        return NULL;
    }
    PyObject *result = NULL;
    table_t t;
    if (open_table(&t, &slots, &hash_of, seed) == 0 && check_packed(&new_keys, "new_keys") == 0) {
        const Py_ssize_t n = new_keys.len / KEY_BYTES;
        const uint8_t *k = (const uint8_t *)new_keys.buf;
        const int32_t *v = (const int32_t *)new_entries.buf;
        if (new_entries.len != n * (Py_ssize_t)sizeof(int32_t)) {
            PyErr_Format(PyExc_ValueError, "new_entries must hold %zd int32, got %zd bytes", n, new_entries.len);
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            if (v[i] < 0 || v[i] >= t.num_keys) {
                PyErr_Format(PyExc_ValueError, "new_entries[%zd] is %d, outside hash_of's [0, %lld)", i, (int)v[i],
                             (long long)t.num_keys);
                goto done;
            }
            if (memcmp(t.keys + (int64_t)v[i] * KEY_BYTES, k + i * KEY_BYTES, KEY_BYTES) != 0) {
                PyErr_Format(PyExc_ValueError, "new_entries[%zd]: hash_of[%d] does not hold new_keys[%zd]", i,
                             (int)v[i], i);
                goto done;
            }
        }
        Py_ssize_t inserted = 0;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            inserted += put(&t, k + i * KEY_BYTES, v[i]);
        }
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(inserted);
    }
done:
    PyBuffer_Release(&slots);
    PyBuffer_Release(&hash_of);
    PyBuffer_Release(&new_keys);
    PyBuffer_Release(&new_entries);
    return result;
}

PyDoc_STRVAR(remove_doc,
             "remove(slots, hash_of, seed, old_keys) -> int\n\n"
             "Remove each packed key that is present; returns how many were removed.");

static PyObject *remove_keys(PyObject *self, PyObject *args)
{
    Py_buffer slots, hash_of, old_keys;
    unsigned long long seed;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*Ky*", &slots, &hash_of, &seed, &old_keys)) {
        return NULL;
    }
    PyObject *result = NULL;
    table_t t;
    if (open_table(&t, &slots, &hash_of, seed) == 0 && check_packed(&old_keys, "old_keys") == 0) {
        Py_ssize_t n = old_keys.len / KEY_BYTES, removed = 0;
        const uint8_t *k = (const uint8_t *)old_keys.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            const uint8_t *key = k + i * KEY_BYTES;
            uint64_t hole = probe(&t, key, tag_of(&t, key));
            if (t.slots[hole].entry < 0) {
                continue;
            }
            removed++;
            /* Backward-shift: pull later slots of the run into the hole when their home slot does not lie
             * cyclically in (hole, j]. */
            uint64_t j = hole;
            for (;;) {
                j = (j + 1) & t.mask;
                if (t.slots[j].entry < 0) {
                    break;
                }
                const uint64_t home = t.slots[j].tag & t.mask;
                if (((j - home) & t.mask) >= ((j - hole) & t.mask)) {
                    t.slots[hole] = t.slots[j];
                    hole = j;
                }
            }
            t.slots[hole].entry = -1;
        }
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(removed);
    }
    PyBuffer_Release(&slots);
    PyBuffer_Release(&hash_of);
    PyBuffer_Release(&old_keys);
    return result;
}

PyDoc_STRVAR(insert_new_doc,
             "insert_new(slots, seed, hashes, entries, blocks, hash_of, entry_blocks, entry_at, holders) -> int\n\n"
             "The prefix index's insert of n hashes new to it, each held by a block on every row, in one pass:\n"
             "entry entries[i] (int64) gets hash i (hash_of: 32 bytes per entry), its blocks\n"
             "blocks[i, :] (int32 [n, rows]) in entry_blocks (int32 [entries, rows]), the reverse map\n"
             "entry_at[r, b] = entry (int32 [rows, num_blocks]) and holders[entry] = rows; then the entry goes\n"
             "in the table. Raises AssertionError, changing nothing, if a block is out of range or a pair\n"
             "already holds a hash. Returns the keys inserted. The caller guarantees table room. With\n"
             "fresh_only, returns -1 and changes nothing where a hash is already in the table or a block is -1\n"
             "(the caller takes the general path): the check and the insert in one call.");

static PyObject *insert_new(PyObject *self, PyObject *args)
{
    Py_buffer slots, hashes, entries, blocks, hash_of, entry_blocks, entry_at, holders;
    unsigned long long seed;
    int fresh_only = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*Ky*y*y*w*w*w*w*|p", &slots, &seed, &hashes, &entries, &blocks, &hash_of,
                          &entry_blocks, &entry_at, &holders, &fresh_only)) {
        return NULL;
    }
    PyObject *result = NULL;
    table_t t;
    if (open_table(&t, &slots, &hash_of, seed) == 0 && check_packed(&hashes, "hashes") == 0) {
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
            || entry_at.len != rows * num_blocks * (Py_ssize_t)sizeof(int32_t) || cap > INT32_MAX) {
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
            if (fresh_only && t.slots[probe(&t, k + i * KEY_BYTES, tag_of(&t, k + i * KEY_BYTES))].entry >= 0) {
                result = PyLong_FromLong(-1); /* known already: nothing written */
                goto done;
            }
            for (Py_ssize_t r = 0; r < rows; r++) {
                const int32_t blk = b[i * rows + r];
                if (fresh_only && blk == -1) {
                    result = PyLong_FromLong(-1); /* a row without a block: nothing written */
                    goto done;
                }
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
            inserted += put(&t, k + i * KEY_BYTES, (int32_t)entry);
        }
        result = PyLong_FromSsize_t(inserted);
    }
done:
    PyBuffer_Release(&slots);
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
    PyModuleDef_HEAD_INIT, "_hashtable",
    "Batch operations on an open-addressing table of 32-byte hashes kept as entry ids with 32-bit tags.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hashtable(void) { return PyModule_Create(&module); }

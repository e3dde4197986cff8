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
#include "_arrays.h"
#include "_hashtable.h"

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
    if (!PyArg_ParseTuple(args, "O&O&KO&p", read_array, &slots, read_array, &hash_of, &seed, read_array, &queries,
                          &stop_at_miss)) {
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

PyDoc_STRVAR(find_ready_doc,
             "find_ready(slots, hash_of, seed, queries, entry_blocks, ready) -> bytearray\n\n"
             "int32 [k, rows]: the block each row holds for each of the leading k packed queries where\n"
             "ready[block] is set (-1 where the row holds none or its block is not ready); k stops at the\n"
             "first query absent from the table or ready in no row. entry_blocks is int32 [entries, rows]\n"
             "(PrefixIndex's blocks), ready one byte per block. Raises AssertionError for a block past ready.\n"
             "Keeps the GIL: a prompt's lookup is shorter than a hand-over.");

static PyObject *find_ready(PyObject *self, PyObject *args)
{
    Py_buffer slots, hash_of, queries, entry_blocks, ready;
    unsigned long long seed;
    (void)self;
    if (!PyArg_ParseTuple(args, "O&O&KO&O&O&", read_array, &slots, read_array, &hash_of, &seed, read_array, &queries,
                          read_array, &entry_blocks, read_array, &ready)) {
        return NULL;
    }
    PyObject *result = NULL;
    table_t t;
    if (open_table(&t, &slots, &hash_of, seed) < 0 || check_packed(&queries, "queries") < 0)
        goto done;
    const Py_ssize_t rows = t.num_keys ? entry_blocks.len / (Py_ssize_t)sizeof(int32_t) / t.num_keys : 0;
    if (rows < 1 || entry_blocks.len != t.num_keys * rows * (Py_ssize_t)sizeof(int32_t)) {
        PyErr_Format(PyExc_ValueError, "find_ready: entry_blocks (%zd bytes) is not int32 [%lld, rows]",
                     entry_blocks.len, (long long)t.num_keys);
        goto done;
    }
    const Py_ssize_t n = queries.len / KEY_BYTES;
    result = PyByteArray_FromStringAndSize(NULL, n * rows * (Py_ssize_t)sizeof(int32_t));
    if (result == NULL)
        goto done;
    int32_t *out = (int32_t *)PyByteArray_AS_STRING(result);
    const int32_t *eb = entry_blocks.buf;
    const uint8_t *is_ready = ready.buf, *q = queries.buf;
    Py_ssize_t k = n;
    /* Called between scheduler steps, when the table has left the caches: fetch a few queries' slots ahead. */
    enum { AHEAD = 8 };
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++)
        __builtin_prefetch(&t.slots[tag_of(&t, q + i * KEY_BYTES) & t.mask]);
    for (Py_ssize_t i = 0; i < n && k == n; i++) {
        if (i + AHEAD < n)
            __builtin_prefetch(&t.slots[tag_of(&t, q + (i + AHEAD) * KEY_BYTES) & t.mask]);
        const uint8_t *key = q + i * KEY_BYTES;
        const int32_t entry = t.slots[probe(&t, key, tag_of(&t, key))].entry;
        if (entry < 0) {
            k = i;
            break;
        }
        int any = 0;
        for (Py_ssize_t r = 0; r < rows; r++) {
            const int32_t blk = eb[(Py_ssize_t)entry * rows + r];
            if (blk >= ready.len) {
                PyErr_Format(PyExc_AssertionError, "find_ready: block %d is past the %zd ready flags", (int)blk,
                             ready.len);
                Py_CLEAR(result);
                goto done;
            }
            const int ok = blk >= 0 && is_ready[blk];
            out[i * rows + r] = ok ? blk : -1;
            any |= ok;
        }
        if (!any)
            k = i;
    }
    if (k < n && PyByteArray_Resize(result, k * rows * (Py_ssize_t)sizeof(int32_t)) < 0)
        Py_CLEAR(result);
done:
    PyBuffer_Release(&slots);
    PyBuffer_Release(&hash_of);
    PyBuffer_Release(&queries);
    PyBuffer_Release(&entry_blocks);
    PyBuffer_Release(&ready);
    return result;
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
    if (!PyArg_ParseTuple(args, "O&O&KO&O&", write_array, &slots, read_array, &hash_of, &seed, read_array, &new_keys,
                          read_array, &new_entries)) {
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
    if (!PyArg_ParseTuple(args, "O&O&KO&", write_array, &slots, read_array, &hash_of, &seed, read_array, &old_keys)) {
        return NULL;
    }
    PyObject *result = NULL;
    table_t t;
    if (open_table(&t, &slots, &hash_of, seed) == 0 && check_packed(&old_keys, "old_keys") == 0) {
        Py_ssize_t n = old_keys.len / KEY_BYTES, removed = 0;
        const uint8_t *k = (const uint8_t *)old_keys.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            removed += table_remove(&t, k + i * KEY_BYTES);
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
    if (!PyArg_ParseTuple(args, "O&KO&O&O&O&O&O&O&|p", write_array, &slots, &seed, read_array, &hashes, read_array,
                          &entries, read_array, &blocks, write_array, &hash_of, write_array, &entry_blocks,
                          write_array, &entry_at, write_array, &holders, &fresh_only)) {
        return NULL;
    }
    PyObject *result = NULL;
    index_t x;
    if (open_index(&x, &slots, seed, &hash_of, &entry_blocks, &entry_at, &holders, "insert_new") == 0
        && check_packed(&hashes, "hashes") == 0) {
        const Py_ssize_t n = hashes.len / KEY_BYTES;
        if (entries.len != n * (Py_ssize_t)sizeof(int64_t) || blocks.len != n * x.rows * (Py_ssize_t)sizeof(int32_t)) {
            PyErr_Format(PyExc_ValueError, "insert_new: buffers disagree (n %zd, rows %zd, entries %zd, blocks %zd)",
                         n, x.rows, x.entries, x.num_blocks);
            goto done;
        }
        const Py_ssize_t inserted = index_insert_new(&x, hashes.buf, n, entries.buf, blocks.buf, fresh_only);
        if (inserted != -2)
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
    {"find_ready", find_ready, METH_VARARGS, find_ready_doc},
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

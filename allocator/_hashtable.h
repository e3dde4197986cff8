/* The prefix index's hash table as C sees them, shared by the C passes over it (kvcache.allocator._hashtable,
 * _tables). See _hashtable.c for the table's design. Everything here is static: each extension that includes it
 * gets its own copy.
 */
#ifndef KVCACHE_HASHTABLE_H
#define KVCACHE_HASHTABLE_H

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
static inline int open_table(table_t *t, Py_buffer *slots, Py_buffer *hash_of, unsigned long long seed)
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

static inline int check_packed(Py_buffer *b, const char *name)
{
    if (b->len % KEY_BYTES != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be a multiple of 32 bytes, got %zd", name, b->len);
        return -1;
    }
    return 0;
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

/* Remove ``key`` if present (backward-shift deletion: later slots of its run whose home does not lie cyclically
 * in (hole, j] move into the hole, so no tombstones); returns 1 if it was there. */
static inline int table_remove(table_t *t, const uint8_t *key)
{
    uint64_t hole = probe(t, key, tag_of(t, key));
    if (t->slots[hole].entry < 0)
        return 0;
    uint64_t j = hole;
    for (;;) {
        j = (j + 1) & t->mask;
        if (t->slots[j].entry < 0)
            break;
        const uint64_t home = t->slots[j].tag & t->mask;
        if (((j - home) & t->mask) >= ((j - hole) & t->mask)) {
            t->slots[hole] = t->slots[j];
            hole = j;
        }
    }
    t->slots[hole].entry = -1;
    return 1;
}

/* PrefixIndex's entry arrays beside the table: per entry its hash (hash_of), its block per row (entry_blocks)
 * and how many rows hold it (holders); per (row, block) the entry it holds (entry_at, -1: none). */
typedef struct {
    table_t t;
    uint8_t *hash_of;
    int32_t *entry_blocks, *entry_at, *holders;
    Py_ssize_t entries, rows, num_blocks;
} index_t;

/* Fill an index_t from its buffers (table slots, hash_of, entry_blocks, entry_at, holders), checking sizes;
 * ValueError naming ``who``. */
static inline int open_index(index_t *x, Py_buffer *slots, unsigned long long seed, Py_buffer *hash_of,
                             Py_buffer *entry_blocks, Py_buffer *entry_at, Py_buffer *holders, const char *who)
{
    if (open_table(&x->t, slots, hash_of, seed) < 0)
        return -1;
    x->entries = holders->len / (Py_ssize_t)sizeof(int32_t);
    x->rows = x->entries ? entry_blocks->len / (Py_ssize_t)sizeof(int32_t) / x->entries : 0;
    x->num_blocks = x->rows ? entry_at->len / (Py_ssize_t)sizeof(int32_t) / x->rows : 0;
    if (x->rows < 1 || hash_of->len != x->entries * KEY_BYTES
        || entry_blocks->len != x->entries * x->rows * (Py_ssize_t)sizeof(int32_t)
        || entry_at->len != x->rows * x->num_blocks * (Py_ssize_t)sizeof(int32_t) || x->entries > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: the index's buffers disagree (rows %zd, entries %zd, blocks %zd)", who,
                     x->rows, x->entries, x->num_blocks);
        return -1;
    }
    x->hash_of = hash_of->buf;
    x->entry_blocks = entry_blocks->buf;
    x->entry_at = entry_at->buf;
    x->holders = holders->buf;
    return 0;
}

/* PrefixIndex's insert of n packed hashes new to it, hash i held by blocks[i * rows + r] on every row r, under
 * entry ids entries[i]. Returns the keys inserted; with fresh_only -1, changing nothing, where a hash is in the
 * table already or a block is -1; -2 with AssertionError set, changing nothing, for an entry or block out of
 * range or a pair holding a hash already. The caller guarantees table room. */
static inline Py_ssize_t index_insert_new(index_t *x, const uint8_t *keys, Py_ssize_t n, const int64_t *entries,
                                          const int32_t *blocks, int fresh_only)
{
    const Py_ssize_t rows = x->rows, num_blocks = x->num_blocks;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (entries[i] < 0 || entries[i] >= x->entries) {
            PyErr_Format(PyExc_AssertionError, "entry %lld of hash %zd is outside [0, %zd)", (long long)entries[i], i,
                         x->entries);
            return -2;
        }
        const uint8_t *key = keys + i * KEY_BYTES;
        if (fresh_only && x->t.slots[probe(&x->t, key, tag_of(&x->t, key))].entry >= 0)
            return -1; /* known already: nothing written */
        for (Py_ssize_t r = 0; r < rows; r++) {
            const int32_t blk = blocks[i * rows + r];
            if (fresh_only && blk == -1)
                return -1; /* a row without a block: nothing written */
            if (blk < 0 || blk >= num_blocks || x->entry_at[r * num_blocks + blk] >= 0) {
                PyErr_Format(PyExc_AssertionError, "a pair already holds a hash (or is out of range): row %zd, "
                             "block %d", r, (int)blk);
                return -2;
            }
        }
    }
    Py_ssize_t inserted = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t entry = entries[i];
        memcpy(x->hash_of + entry * KEY_BYTES, keys + i * KEY_BYTES, KEY_BYTES);
        for (Py_ssize_t r = 0; r < rows; r++) {
            const int32_t blk = blocks[i * rows + r];
            x->entry_blocks[entry * rows + r] = blk;
            x->entry_at[r * num_blocks + blk] = (int32_t)entry;
        }
        x->holders[entry] = (int32_t)rows;
        inserted += put(&x->t, keys + i * KEY_BYTES, (int32_t)entry);
    }
    return inserted;
}

#endif

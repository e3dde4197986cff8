/* Per-request block-table writes of a whole decode step (kvcache.allocator._tables).
 *
 * Every request owns its table, an int32 [rows, capacity] numpy array. A decode step opens a new
 * block in one request of every block_size: one column to write per such request, in a different
 * array each time, which numpy cannot do in one operation and a Python loop does at ~1 us a
 * request. Here one call writes them all; another runs a decode step's fast path (extends that stay
 * inside their partial last block) over the manager's slot arrays in one pass. admit_commit is an
 * admit's whole commit (pool, prefix index, table, slot arrays) once its prefix hit is known.
 */
#include "_arrays.h"
#include "_hashtable.h"
#include "_pool.h"
#include "_tokens.h"

#include <structmember.h>

#include <stdint.h>
#include <string.h>

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
    if (!PyArg_ParseTuple(args, "O!O&O&", &PyList_Type, &tables, read_array, &cols, read_array, &values))
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

PyDoc_STRVAR(clear_columns_doc,
"clear_columns(tables, which, cols, clear, old) -> None\n\n"
"For every q: old[:, q] = tables[which[q]][:, cols[q]], then that column's rows r with clear[r] become -1\n"
"(tables: int32 C-contiguous [rows, capacity] arrays; which, cols: int64 [m], each column inside its table;\n"
"clear: uint8 [rows]; old: int32 C-contiguous [rows, m]): the blocks a decode run's window rows give back, read\n"
"and emptied. Checks everything before it writes: ValueError, changing nothing.");

static PyObject *clear_columns(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *tables;
    Py_buffer which, cols, clear, old;
    if (!PyArg_ParseTuple(args, "O!O&O&O&O&", &PyList_Type, &tables, read_array, &which, read_array, &cols,
                          read_array, &clear, write_array, &old))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t k = PyList_GET_SIZE(tables), m = cols.len / (Py_ssize_t)sizeof(int64_t), rows = clear.len;
    Py_buffer *views = PyMem_Calloc(k ? (size_t)k : 1, sizeof(Py_buffer));
    Py_ssize_t got = 0;
    if (!views) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *col = cols.buf, *of = which.buf;
    if (cols.len != m * (Py_ssize_t)sizeof(int64_t) || which.len != cols.len
        || old.len != rows * m * (Py_ssize_t)sizeof(int32_t)) {
        PyErr_SetString(PyExc_ValueError, "clear_columns: which, cols, clear and old do not fit together");
        goto done;
    }
    for (; got < k; got++) {
        Py_buffer *t = &views[got];
        if (PyObject_GetBuffer(PyList_GET_ITEM(tables, got), t, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
            goto done;
        if (t->ndim != 2 || t->itemsize != 4 || !t->format || (t->format[0] != 'i' && t->format[0] != 'l')
            || t->format[1] != '\0' || t->shape[0] != rows) {
            PyErr_Format(PyExc_ValueError, "clear_columns: tables[%zd] must be an int32 [%zd, capacity] array", got,
                         rows);
            PyBuffer_Release(t);
            goto done;
        }
    }
    for (Py_ssize_t q = 0; q < m; q++) {
        if (of[q] < 0 || of[q] >= k || col[q] < 0 || col[q] >= views[of[q]].shape[1]) {
            PyErr_Format(PyExc_ValueError, "clear_columns: entry %zd names table %lld, column %lld, not in them", q,
                         (long long)of[q], (long long)col[q]);
            goto done;
        }
    }
    const uint8_t *blank = clear.buf;
    int32_t *out = old.buf;
    for (Py_ssize_t q = 0; q < m; q++) {
        int32_t *data = views[of[q]].buf;
        const Py_ssize_t capacity = views[of[q]].shape[1];
        for (Py_ssize_t r = 0; r < rows; r++) {
            out[r * m + q] = data[r * capacity + col[q]];
            if (blank[r])
                data[r * capacity + col[q]] = -1;
        }
    }
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t j = 0; j < got; j++)
        PyBuffer_Release(&views[j]);
    PyMem_Free(views);
    PyBuffer_Release(&which);
    PyBuffer_Release(&cols);
    PyBuffer_Release(&clear);
    PyBuffer_Release(&old);
    return result;
}

/* The decode step's per-request rules, shared by extend_fast and extend_decode. Slot s's arrays:
 * num_tokens, fast_limit, next_recycle (int64), tail (uint32 [slots, block_size]), changed (bool). */

/* An extend of k tokens at t stays inside its last block and gives no block back: extend_fast's fast path. */
static inline int in_last_block(int64_t t, int64_t k, int64_t recycle, int64_t limit)
{
    return t < recycle && t + k <= limit;
}

/* The fast path's write: the k tokens into the tail at t % bs, num_tokens t + k, changed columns stale. */
static inline void write_in_block(uint32_t *tail_row, int64_t *ntok, uint8_t *changed, int64_t t, int64_t k,
                                  const uint32_t *tokens, Py_ssize_t bs)
{
    for (int64_t j = 0; j < k; j++)
        tail_row[t % bs + j] = tokens[j];
    *ntok = t + k;
    *changed = 0;
}

/* A slow extend that a decode run takes: one token, and with hashing no extra keys (LoRA or multimodal, or the
 * cache salt of block 0). */
static inline int plain_decode(int64_t k, int64_t t, Py_ssize_t bs, uint8_t keyed, uint8_t salted, int hashing)
{
    return k == 1 && (!hashing || (!keyed && (t >= bs || !salted)));
}

/* A decode run's write of its one token at t: num_tokens t + 1, changed (the one column it opens) exactly when
 * it opens a block. */
static inline void write_run_token(uint32_t *tail_row, int64_t *ntok, uint8_t *changed, int64_t t, uint32_t token,
                                   Py_ssize_t bs, int opens)
{
    tail_row[t % bs] = token;
    *ntok = t + 1;
    *changed = (uint8_t)opens;
}

/* The blocks a table of width blocks lacks once a token at t is written and lookahead positions after it are
 * covered: 1 when the decode step opens one, 0 or below with blocks reserved ahead. */
static inline int64_t blocks_short(int64_t t, int64_t lookahead, Py_ssize_t bs, int64_t width)
{
    return (t + 1 + lookahead + bs - 1) / bs - width;
}

/* fast_limit as KVCacheManager._refresh leaves it for a table of width blocks holding ntok tokens: the table's
 * end, and with hashing one short of the next block's filling token. */
static inline int64_t refreshed_limit(int64_t ntok, int64_t width, Py_ssize_t bs, int hashing)
{
    const int64_t end = width * bs, filling = (ntok / bs + 1) * bs - 1;
    return hashing && filling < end ? filling : end;
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
    if (!PyArg_ParseTuple(args, "O&O&O&O&O&O&O&O&O&O&O&p", read_array, &slots, read_array, &counts, read_array,
                          &tokens, write_array, &ntok, read_array, &limit, read_array, &recycle, write_array, &tail,
                          write_array, &changed, write_array, &stamp, read_array, &keyed, read_array, &salted,
                          &hashing))
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
        if (in_last_block(t, k, rec[s], lim[s])) {
            write_in_block(tl + s * bs, &nt[s], &ch[s], t, k, tok + offset, bs);
        } else {
            /* With hashing, released window blocks are cached (they go to the LRU ring) and may join a run. */
            plain[num_slow] = plain_decode(k, t, bs, key[s], salt[s], hashing) && (hashing || t < rec[s]);
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

PyDoc_STRVAR(mirror_step_doc,
"mirror_step(reqs, lens, index, offsets, cols, vals, views, buffers) -> list | None\n\n"
"A client's mirror update for a decode step's reply, in one pass: request reqs[j] is lens[j] columns wide\n"
"(int32 [n]); changed request index[k] (int32 [m]) gained columns cols[offsets[k]:offsets[k + 1]] (int32\n"
"[m + 1] and [total]) holding vals (int32 C-contiguous [rows, total]). views maps a request to its read-only\n"
"table view, buffers to its (writable int32 [rows, capacity] buffer, read-only alias). Applies the reply and\n"
"returns every request's view, in order, when it has the usual shape: each change is to a distinct request,\n"
"neither narrower than its view (no shrink) nor wider than its buffer, and sets columns inside its new width\n"
"(a new last column, or window columns given back, or both); every request mirrored, none refused\n"
"(lens >= 0). Otherwise returns None and changes nothing (the caller's general path handles it).");

static int32_t load_i32(const char *base, Py_ssize_t i)
{
    int32_t v; /* wire arrays can sit at any byte offset of their message */
    memcpy(&v, base + i * (Py_ssize_t)sizeof(int32_t), sizeof v);
    return v;
}

/* Columns of a 2-D buffer-protocol object (a numpy view), or -1 when it is not int32 2-D with ``rows`` rows. */
static Py_ssize_t columns_of(PyObject *obj, Py_ssize_t rows, int32_t **data, int writable)
{
    Py_buffer b;
    if (PyObject_GetBuffer(obj, &b, writable ? (PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT)
                                             : (PyBUF_STRIDES | PyBUF_FORMAT)) < 0) {
        PyErr_Clear();
        return -1;
    }
    Py_ssize_t cols = -1;
    if (b.ndim == 2 && b.itemsize == 4 && b.format && (b.format[0] == 'i' || b.format[0] == 'l')
        && b.format[1] == '\0' && b.shape[0] == rows) {
        cols = b.shape[1];
        if (data)
            *data = b.buf;
    }
    PyBuffer_Release(&b); /* the array behind it stays alive: the caller's dicts hold it */
    return cols;
}

static PyObject *mirror_step(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *reqs, *views, *buffers;
    Py_buffer lens, index, offsets, cols, vals;
    if (!PyArg_ParseTuple(args, "O!O&O&O&O&O&O!O!", &PyList_Type, &reqs, read_array, &lens, read_array, &index,
                          read_array, &offsets, read_array, &cols, read_array, &vals, &PyDict_Type, &views,
                          &PyDict_Type, &buffers))
        return NULL;
    PyObject *out = NULL, *seen = NULL, *all_cols = NULL;
    int32_t **data = NULL;
    Py_ssize_t *capacity = NULL, *old = NULL;
    const Py_ssize_t n = PyList_GET_SIZE(reqs), m = index.len / (Py_ssize_t)sizeof(int32_t);
    const Py_ssize_t total = cols.len / (Py_ssize_t)sizeof(int32_t);
    const Py_ssize_t rows = total ? vals.len / (Py_ssize_t)sizeof(int32_t) / total : 0;
    const char *len_of = lens.buf, *idx = index.buf, *off = offsets.buf, *col = cols.buf;
    int usual = lens.len == n * (Py_ssize_t)sizeof(int32_t) && index.len % sizeof(int32_t) == 0
                && offsets.len == (m + 1) * (Py_ssize_t)sizeof(int32_t) && cols.len % sizeof(int32_t) == 0
                && vals.len == rows * total * (Py_ssize_t)sizeof(int32_t) && (!total || rows > 0);
    if (!usual)
        goto unusual;
    out = PyList_New(n);
    seen = PySet_New(NULL);
    data = PyMem_Calloc(m ? m : 1, sizeof *data);
    capacity = PyMem_Calloc(m ? m : 1, sizeof *capacity);
    old = PyMem_Calloc(m ? m : 1, sizeof *old);
    if (!out || !seen || !data || !capacity || !old)
        goto fail;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *req = PyList_GET_ITEM(reqs, j);
        PyObject *view = PyDict_GetItemWithError(views, req);
        if (!view) {
            if (PyErr_Occurred())
                goto fail;
            goto unusual; /* not mirrored here (admitted by another client) */
        }
        if (load_i32(len_of, j) < 0)
            goto unusual;
        Py_INCREF(view);
        PyList_SET_ITEM(out, j, view);
    }
    /* Check every change before writing any. */
    if (load_i32(off, 0) != 0 || load_i32(off, m) != total)
        goto unusual;
    for (Py_ssize_t k = 0; k < m; k++) {
        const Py_ssize_t j = load_i32(idx, k), first = load_i32(off, k), stop = load_i32(off, k + 1);
        if (j < 0 || j >= n || stop < first || stop > total)
            goto unusual;
        const Py_ssize_t length = load_i32(len_of, j);
        PyObject *req = PyList_GET_ITEM(reqs, j);
        old[k] = columns_of(PyList_GET_ITEM(out, j), rows, NULL, 0);
        if (old[k] < 0 || old[k] > length) /* not 2-D int32 of these rows, or narrower than before */
            goto unusual;
        for (Py_ssize_t q = first; q < stop; q++) {
            const int32_t c = load_i32(col, q);
            if (c < 0 || c >= length)
                goto unusual;
        }
        const int dup = PySet_Contains(seen, req);
        if (dup < 0)
            goto fail;
        if (dup || PySet_Add(seen, req) < 0)
            goto unusual;
        PyObject *pair = PyDict_GetItemWithError(buffers, req);
        if (!pair) {
            if (PyErr_Occurred())
                goto fail;
            goto unusual;
        }
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2)
            goto unusual;
        capacity[k] = columns_of(PyTuple_GET_ITEM(pair, 0), rows, &data[k], 1);
        if (capacity[k] < length) /* not 2-D int32 (-1), or full: the caller grows it */
            goto unusual;
    }
    all_cols = PySlice_New(NULL, NULL, NULL);
    if (!all_cols)
        goto fail;
    const char *val = vals.buf;
    for (Py_ssize_t k = 0; k < m; k++) {
        const Py_ssize_t j = load_i32(idx, k), length = load_i32(len_of, j);
        for (Py_ssize_t q = load_i32(off, k), stop = load_i32(off, k + 1); q < stop; q++) {
            const Py_ssize_t c = load_i32(col, q);
            for (Py_ssize_t r = 0; r < rows; r++)
                data[k][r * capacity[k] + c] = load_i32(val, r * total + q);
        }
        if (length == old[k]) /* the same width: its view sees the buffer's new values */
            continue;
        PyObject *req = PyList_GET_ITEM(reqs, j);
        PyObject *alias = PyTuple_GET_ITEM(PyDict_GetItem(buffers, req), 1);
        PyObject *stop = PyLong_FromSsize_t(length);
        PyObject *first = stop ? PySlice_New(NULL, stop, NULL) : NULL;
        PyObject *key = first ? PyTuple_Pack(2, all_cols, first) : NULL;
        PyObject *view = key ? PyObject_GetItem(alias, key) : NULL;
        Py_XDECREF(stop);
        Py_XDECREF(first);
        Py_XDECREF(key);
        if (!view || PyDict_SetItem(views, req, view) < 0) {
            Py_XDECREF(view);
            goto fail;
        }
        PyList_SetItem(out, j, view); /* steals view, drops the old one */
    }
    goto done;
unusual:
    Py_CLEAR(out);
    Py_INCREF(Py_None);
    out = Py_None;
    goto done;
fail:
    Py_CLEAR(out);
done:
    Py_XDECREF(seen);
    Py_XDECREF(all_cols);
    PyMem_Free(data);
    PyMem_Free(capacity);
    PyMem_Free(old);
    PyBuffer_Release(&lens);
    PyBuffer_Release(&index);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&cols);
    PyBuffer_Release(&vals);
    return out;
}

/* ------------------------------------------------------------------ a decode step's block-crossing run */

static PyObject *num_blocks_name, *changed_name, *view_name, *table_name;

/* Request req's table: its capacity in columns (data in *data; a writable int32 [rows, capacity] array, which
 * the request keeps alive), or -1 with ValueError set. */
static Py_ssize_t request_table(PyObject *req, Py_ssize_t rows, int32_t **data)
{
    PyObject *table = PyObject_GetAttr(req, table_name);
    if (!table)
        return -1;
    const Py_ssize_t capacity = columns_of(table, rows, data, 1);
    Py_DECREF(table);
    if (capacity < 0)
        PyErr_Format(PyExc_ValueError, "a request's table is not an int32 [%zd, capacity] array", rows);
    return capacity;
}

/* Append position q to ``list`` (what a pass leaves to Python). 0, or -1 with an error set. */
static int append_position(PyObject *list, Py_ssize_t q)
{
    PyObject *item = PyLong_FromSsize_t(q);
    const int failed = !item || PyList_Append(list, item) < 0;
    Py_XDECREF(item);
    return failed ? -1 : 0;
}

/* The record of a request whose table gained a column: num_blocks + 1, its changed columns and cached view
 * dropped (as KVCacheManager._extend leaves them). 0, or -1 with an error set. */
static int record_opened(PyObject *req)
{
    PyObject *count = PyObject_GetAttr(req, num_blocks_name);
    const Py_ssize_t now = count ? PyLong_AsSsize_t(count) : -1;
    Py_XDECREF(count);
    PyObject *more = now >= 0 ? PyLong_FromSsize_t(now + 1) : NULL;
    const int failed = !more || PyObject_SetAttr(req, num_blocks_name, more) < 0
                       || PyObject_SetAttr(req, changed_name, Py_None) < 0
                       || PyObject_SetAttr(req, view_name, Py_None) < 0;
    Py_XDECREF(more);
    return failed ? -1 : 0;
}

PyDoc_STRVAR(lookup_ids_doc,
"lookup_ids(mapping, ids, out, exclude) -> int\n\n"
"Checks, in one pass, that every id of the list ``ids`` is an exact int or str (no bool, no float that\n"
"would compare equal), a key of the dict ``mapping`` and, unless ``exclude`` is None, not a key of that\n"
"dict. Unless ``out`` is None (else a writable intp buffer of len(ids) items), writes mapping[id], an\n"
"int, there. Returns -1 when every id passes, else the position of the first that does not (``out`` is\n"
"then partly written): the caller names that id's problem.");

/* mapping[id] (an int) into *value (unless NULL) for an id that is an exact int or str: 1; 0 for an id of another
 * type or no key of mapping; -1 with an error set. */
static int lookup_id(PyObject *mapping, PyObject *id, Py_ssize_t *value)
{
    if (!PyLong_CheckExact(id) && !PyUnicode_CheckExact(id))
        return 0;
    PyObject *found = PyDict_GetItemWithError(mapping, id);
    if (!found)
        return PyErr_Occurred() ? -1 : 0;
    if (value) {
        *value = PyNumber_AsSsize_t(found, PyExc_OverflowError); /* an int, or any integer (__index__) */
        if (*value == -1 && PyErr_Occurred())
            return -1;
    }
    return 1;
}

static PyObject *lookup_ids(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *mapping, *ids, *out_obj, *exclude;
    if (!PyArg_ParseTuple(args, "O!O!OO", &PyDict_Type, &mapping, &PyList_Type, &ids, &out_obj, &exclude))
        return NULL;
    if (exclude != Py_None && !PyDict_Check(exclude)) {
        PyErr_SetString(PyExc_TypeError, "lookup_ids: exclude must be a dict or None");
        return NULL;
    }
    const Py_ssize_t n = PyList_GET_SIZE(ids);
    Py_buffer out = {0};
    Py_ssize_t *slot = NULL;
    if (out_obj != Py_None) {
        if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
            return NULL;
        if (out.len != n * (Py_ssize_t)sizeof(Py_ssize_t)) {
            PyErr_Format(PyExc_ValueError, "lookup_ids: out needs %zd bytes (intp per id), got %zd",
                         n * (Py_ssize_t)sizeof(Py_ssize_t), out.len);
            PyBuffer_Release(&out);
            return NULL;
        }
        slot = out.buf;
    }
    PyObject *result = NULL;
    Py_ssize_t bad = -1;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *id = PyList_GET_ITEM(ids, j);
        const int found = lookup_id(mapping, id, slot ? &slot[j] : NULL);
        if (found < 0)
            goto fail;
        if (!found) {
            bad = j;
            break;
        }
        if (exclude != Py_None) {
            const int excluded = PyDict_Contains(exclude, id);
            if (excluded < 0)
                goto fail;
            if (excluded) {
                bad = j;
                break;
            }
        }
    }
    result = PyLong_FromSsize_t(bad);
fail:
    if (slot)
        PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(bounds_doc,
"bounds(values) -> (min, max, sum) | None\n\n"
"The least, greatest and total of a 1-D C-contiguous integer array (any width, signed or unsigned) in one\n"
"pass, as ints; (0, 0, 0) when it is empty. None when it is no such array, or the sum leaves int64: the\n"
"caller's numpy path answers then. What min(), max() and sum() give, without numpy's per-call cost.");

/* Least and greatest in the element type (vectorises), the total in ``acc``: int64 for types of at most 32 bits
 * (no buffer that fits in memory can overflow it), __int128 for 64-bit ones. */
#define BOUNDS_LOOP(type, acc)                                                                              \
    do {                                                                                                    \
        const type *v = (const type *)b.buf;                                                                \
        type l = v[0], h = v[0];                                                                            \
        acc t = 0;                                                                                          \
        for (Py_ssize_t i = 0; i < n; i++) {                                                                \
            l = v[i] < l ? v[i] : l;                                                                        \
            h = v[i] > h ? v[i] : h;                                                                        \
        }                                                                                                   \
        for (Py_ssize_t i = 0; i < n; i++)                                                                  \
            t += (acc)v[i];                                                                                 \
        lo = l;                                                                                             \
        hi = h;                                                                                             \
        total = t;                                                                                          \
    } while (0)

/* The integer type of a 1-D buffer's items as one of "bBhHiIqQ" (a C long, 'l'/'L', by its size), or '\0' for
 * anything else (another dimension, a float, a struct). */
static char int_kind(const Py_buffer *b)
{
    const char *f = b->format ? b->format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    if (b->ndim != 1 || f[0] == '\0' || f[1] != '\0')
        return '\0';
    const char kind = f[0] == 'l'   ? (b->itemsize == 8 ? 'q' : 'i')
                      : f[0] == 'L' ? (b->itemsize == 8 ? 'Q' : 'I')
                                    : f[0];
    return strchr("bBhHiIqQ", kind) ? kind : '\0';
}

static PyObject *bounds(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *result = NULL;
    const Py_ssize_t n = b.itemsize ? b.len / b.itemsize : 0;
    __int128 lo = 0, hi = 0, total = 0;
    const char kind = int_kind(&b);
    if (kind == '\0') {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (n == 0) {
        result = Py_BuildValue("iii", 0, 0, 0);
        goto done;
    }
    switch (kind) {
    case 'b': BOUNDS_LOOP(int8_t, int64_t); break;
    case 'B': BOUNDS_LOOP(uint8_t, int64_t); break;
    case 'h': BOUNDS_LOOP(int16_t, int64_t); break;
    case 'H': BOUNDS_LOOP(uint16_t, int64_t); break;
    case 'i': BOUNDS_LOOP(int32_t, int64_t); break;
    case 'I': BOUNDS_LOOP(uint32_t, int64_t); break;
    case 'q': BOUNDS_LOOP(int64_t, __int128); break;
    default: BOUNDS_LOOP(uint64_t, __int128); break; /* 'Q' */
    }
    if (total > INT64_MAX || total < INT64_MIN || hi > INT64_MAX) /* a uint64 above int64 too: numpy's path */
        result = Py_NewRef(Py_None);
    else
        result = Py_BuildValue("LLL", (long long)lo, (long long)hi, (long long)total);
done:
    PyBuffer_Release(&b);
    return result;
}

PyDoc_STRVAR(join_runs_doc,
"join_runs(parts) -> (bytes, bytes) | None\n\n"
"The token arrays of a run of extends back to back, and each one's length as int32 (native order):\n"
"what np.concatenate and a length per part give, in one pass over the list without numpy's per-array\n"
"cost. None, unless every part is a 1-D C-contiguous array of the first one's dtype.");

static PyObject *dtype_name;


PyDoc_STRVAR(reads_array_heads_doc,
"reads_array_heads() -> bool\n\n"
"Whether join_runs reads small arrays through numpy's array head here (the layout check at first use passed);\n"
"otherwise it exports a buffer per array, the same result more slowly.");

static PyObject *reads_array_heads(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    const int usable = array_heads_usable();
    return usable < 0 ? NULL : PyBool_FromLong(usable);
}

/* join_runs over array heads: every part an exact 1-D C-contiguous ndarray of the first's dtype (itemsize known);
 * NULL with no exception set when one is not. */
static PyObject *join_heads(PyObject *parts, Py_ssize_t itemsize)
{
    const Py_ssize_t n = PyList_GET_SIZE(parts);
    const PyObject *descr = ((const array_head *)PyList_GET_ITEM(parts, 0))->descr;
    Py_ssize_t total = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        const PyObject *part = PyList_GET_ITEM(parts, j);
        const array_head *h = (const array_head *)part;
        if ((PyObject *)Py_TYPE(part) != ndarray_type || h->nd != 1 || !(h->flags & ARRAY_C_CONTIGUOUS)
            || h->descr != descr || h->dimensions[0] > INT32_MAX)
            return NULL;
        total += h->dimensions[0];
    }
    PyObject *joined = PyBytes_FromStringAndSize(NULL, total * itemsize);
    PyObject *lengths = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int32_t));
    if (!joined || !lengths) {
        Py_XDECREF(joined);
        Py_XDECREF(lengths);
        return NULL;
    }
    char *at = PyBytes_AS_STRING(joined);
    int32_t *length = (int32_t *)PyBytes_AS_STRING(lengths);
    for (Py_ssize_t j = 0; j < n; j++) {
        const array_head *h = (const array_head *)PyList_GET_ITEM(parts, j);
        const Py_ssize_t bytes = h->dimensions[0] * itemsize;
        memcpy(at, h->data, (size_t)bytes);
        at += bytes;
        length[j] = (int32_t)h->dimensions[0];
    }
    PyObject *result = PyTuple_Pack(2, joined, lengths);
    Py_DECREF(joined);
    Py_DECREF(lengths);
    return result;
}

static PyObject *join_runs(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *parts;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &parts))
        return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(parts);
    const int heads = n > 1 ? array_heads_usable() : 0;
    if (heads < 0)
        return NULL;
    if (heads && (PyObject *)Py_TYPE(PyList_GET_ITEM(parts, 0)) == ndarray_type) {
        Py_buffer first; /* one export, for the itemsize every part of this dtype has */
        if (PyObject_GetBuffer(PyList_GET_ITEM(parts, 0), &first, PyBUF_ND) == 0) {
            const Py_ssize_t itemsize = first.itemsize;
            PyBuffer_Release(&first);
            PyObject *joined = join_heads(parts, itemsize);
            if (joined || PyErr_Occurred())
                return joined;
        } else {
            PyErr_Clear();
        }
    }
    Py_buffer *views = PyMem_Calloc(n ? n : 1, sizeof *views);
    if (!views)
        return PyErr_NoMemory();
    PyObject *result = NULL, *joined = NULL, *lengths = NULL, *first_dtype = NULL;
    Py_ssize_t got = 0, total = 0;
    if (!dtype_name && !(dtype_name = PyUnicode_InternFromString("dtype"))) {
        PyMem_Free(views);
        return NULL;
    }
    while (got < n) {
        PyObject *part = PyList_GET_ITEM(parts, got);
        if (PyObject_GetBuffer(part, &views[got], PyBUF_ND) < 0) {
            PyErr_Clear();
            goto unusual;
        }
        const Py_buffer *v = &views[got++], *first = &views[0]; /* held from here on: released at done */
        if (v->ndim != 1 || v->itemsize != first->itemsize || v->shape[0] > INT32_MAX)
            goto unusual;
        /* The same dtype as the first part (a buffer's format is costly to ask numpy for). */
        PyObject *dtype = PyObject_GetAttr(part, dtype_name);
        if (!dtype) {
            PyErr_Clear();
            goto unusual;
        }
        if (!first_dtype) {
            first_dtype = dtype;
        } else {
            const int same = dtype == first_dtype ? 1 : PyObject_RichCompareBool(dtype, first_dtype, Py_EQ);
            Py_DECREF(dtype);
            if (same != 1) {
                PyErr_Clear();
                goto unusual;
            }
        }
        total += v->len;
    }
    joined = PyBytes_FromStringAndSize(NULL, total);
    lengths = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int32_t));
    if (!joined || !lengths)
        goto done;
    char *at = PyBytes_AS_STRING(joined);
    int32_t *length = (int32_t *)PyBytes_AS_STRING(lengths);
    for (Py_ssize_t j = 0; j < n; j++) {
        memcpy(at, views[j].buf, views[j].len);
        at += views[j].len;
        length[j] = (int32_t)views[j].shape[0];
    }
    result = PyTuple_Pack(2, joined, lengths);
    goto done;
unusual:
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (Py_ssize_t j = 0; j < got; j++)
        PyBuffer_Release(&views[j]);
    PyMem_Free(views);
    Py_XDECREF(first_dtype);
    Py_XDECREF(joined);
    Py_XDECREF(lengths);
    return result;
}

/* RunCollector: the base of kvcache.client.Batch that takes a decode step's plain extends. A scheduler calls
 * batch.extend once per running request each step; as a Python method that is most of the step's client-side
 * build (about 0.2 us a call on the VM, 55 us for 256), here two list appends. */

typedef struct {
    PyObject_HEAD
    PyObject *run_reqs;   /* the plain extends' request ids since the last other op */
    PyObject *run_tokens; /* and their token arrays */
} RunCollector;


PyDoc_STRVAR(token_array_doc,
"token_array(value) -> ndarray | None\n\n"
"as_token_array's usual cases in one call: a 1-D C-contiguous numpy array of uint32 comes back as it is, one\n"
"of int32 whose ids are all >= 0 as its uint32 view (the same bits). None for anything else (another type,\n"
"dtype or layout, or a negative id): the caller's Python path converts it or names the bad value.");

static PyObject *token_array(PyObject *self, PyObject *arg)
{
    (void)self;
    if (load_numpy() < 0)
        return NULL;
    if ((PyObject *)Py_TYPE(arg) != ndarray_type)
        Py_RETURN_NONE;
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    const char kind = int_kind(&b);
    PyObject *result = NULL;
    if (kind == 'I') {
        result = Py_NewRef(arg);
    } else if (kind == 'i') {
        const int32_t *v = b.buf;
        int32_t least = 0;
        for (Py_ssize_t i = 0, n = b.len / 4; i < n; i++)
            least = v[i] < least ? v[i] : least;
        result = least < 0 ? Py_NewRef(Py_None) : PyObject_CallMethodOneArg(arg, view_name, uint32_dtype);
    } else {
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&b);
    return result;
}

PyDoc_STRVAR(token_list_doc,
"token_list(value) -> ndarray | None\n\n"
"A list of exact ints in [0, 2**32) as a new uint32 array, read in one pass in C. None for anything else\n"
"(another type, an item that is not an exact int, or an id out of range): the caller's Python path converts\n"
"it or names the bad value.");

static PyObject *token_list(PyObject *self, PyObject *arg)
{
    (void)self;
    if (!PyList_CheckExact(arg))
        Py_RETURN_NONE;
    if (load_numpy() < 0)
        return NULL;
    const Py_ssize_t n = PyList_GET_SIZE(arg);
    PyObject *arr = PyObject_CallFunction(ndarray_type, "(n)O", n, uint32_dtype);
    if (!arr)
        return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(arr, &b, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    uint32_t *out = b.buf;
    PyObject **items = ((PyListObject *)arg)->ob_item;
    int ok = PyList_GET_SIZE(arg) == n; /* nothing here runs Python code, so the list cannot change under us */
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        if (i + 16 < n)
            __builtin_prefetch(items[i + 16]); /* the int objects lie apart in memory: ask for them early */
        const int64_t v = list_token(items[i]);
        out[i] = (uint32_t)v;
        ok = v >= 0;
    }
    PyBuffer_Release(&b);
    if (!ok) {
        Py_DECREF(arr);
        Py_RETURN_NONE;
    }
    return arr;
}

static PyObject *extend_slow_name, *as_tokens_name;

/* A static type: a Python subclass's own traverse and dealloc visit and release the (heap) subclass. */
static int run_collector_traverse(RunCollector *self, visitproc visit, void *arg)
{
    Py_VISIT(self->run_reqs);
    Py_VISIT(self->run_tokens);
    return 0;
}

static int run_collector_clear(RunCollector *self)
{
    Py_CLEAR(self->run_reqs);
    Py_CLEAR(self->run_tokens);
    return 0;
}

static void run_collector_dealloc(RunCollector *self)
{
    PyObject_GC_UnTrack(self);
    run_collector_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *run_collector_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    (void)args;
    (void)kwargs;
    RunCollector *self = (RunCollector *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->run_reqs = PyList_New(0);
    self->run_tokens = PyList_New(0);
    if (!self->run_reqs || !self->run_tokens) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

PyDoc_STRVAR(run_extend_doc,
             "extend(request_id, tokens, *, num_computed_tokens=None) -> self\n\n"
             "A plain extend (two positional arguments) joins the run of extends that goes out as one\n"
             "extend_many: request_id to _run_reqs, tokens (a numpy array as given, anything else through\n"
             "self._as_tokens) to _run_tokens. Any other call goes to self._extend_slow(*args, **kwargs).");

static PyObject *run_extend(RunCollector *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (nargs != 2 || (kwnames && PyTuple_GET_SIZE(kwnames))) {
        PyObject *slow = PyObject_GetAttr((PyObject *)self, extend_slow_name);
        if (!slow)
            return NULL;
        PyObject *result = PyObject_Vectorcall(slow, args, (size_t)nargs, kwnames);
        Py_DECREF(slow);
        return result;
    }
    if (!self->run_reqs || !PyList_CheckExact(self->run_reqs) || !self->run_tokens
        || !PyList_CheckExact(self->run_tokens)) {
        PyErr_SetString(PyExc_TypeError, "_run_reqs and _run_tokens must be lists");
        return NULL;
    }
    if (load_numpy() < 0)
        return NULL;
    PyObject *tokens = args[1];
    if ((PyObject *)Py_TYPE(tokens) == ndarray_type) {
        Py_INCREF(tokens);
    } else {
        PyObject *convert = PyObject_GetAttr((PyObject *)self, as_tokens_name);
        if (!convert)
            return NULL;
        tokens = PyObject_CallOneArg(convert, tokens);
        Py_DECREF(convert);
        if (!tokens)
            return NULL;
    }
    /* Both appends or neither: a failed second append takes the first back. */
    if (PyList_Append(self->run_reqs, args[0]) < 0) {
        Py_DECREF(tokens);
        return NULL;
    }
    if (PyList_Append(self->run_tokens, tokens) < 0) {
        Py_DECREF(tokens);
        PyList_SetSlice(self->run_reqs, PyList_GET_SIZE(self->run_reqs) - 1, PyList_GET_SIZE(self->run_reqs), NULL);
        return NULL;
    }
    Py_DECREF(tokens);
    Py_INCREF(self);
    return (PyObject *)self;
}

/* PrefixIndex.remove_gone of row r's evicted blocks: each holding a hash loses it, and a hash no row holds any more
 * leaves the table, its entry going on the spare stack (in order; the caller made room). Returns the hashes that
 * left, and unless ``gone_out`` is NULL writes them there, 32 bytes each. Called row by row in row order, this
 * drops them in PrefixIndex._drop's order (which is remove_gone's order of the hashes it answers). */
static Py_ssize_t drop_evicted(index_t *x, Py_ssize_t r, const int32_t *evicted, Py_ssize_t count, Py_ssize_t *spare,
                               Py_ssize_t *num_spare, uint8_t *gone_out)
{
    Py_ssize_t gone = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        int32_t *at = &x->entry_at[r * x->num_blocks + evicted[i]];
        const int32_t entry = *at;
        if (entry < 0)
            continue;
        x->entry_blocks[(Py_ssize_t)entry * x->rows + r] = -1;
        *at = -1;
        if (--x->holders[entry] == 0) {
            const uint8_t *key = x->hash_of + (Py_ssize_t)entry * KEY_BYTES;
            if (gone_out)
                memcpy(gone_out + gone * KEY_BYTES, key, KEY_BYTES); /* kept only if the table held it */
            gone += table_remove(&x->t, key);
            spare[(*num_spare)++] = entry;
        }
    }
    return gone;
}

PyDoc_STRVAR(drop_gone_doc,
"drop_gone(slots, seed, hash_of, entry_blocks, entry_at, holders, spare, num_spare, rows, blocks, gone=None)\n"
"    -> (num_spare, keys_removed)\n\n"
"PrefixIndex's removal in one pass: each (rows[i], blocks[i]) pair (int32 [k] each) that holds a hash loses\n"
"it, row by row in row order and in pair order within a row; a hash no row holds any more leaves the table, its\n"
"entry pushed on the spare stack (the caller made room for k more) and, with ``gone`` (a writable buffer of\n"
"32 k bytes), its hash written there in that order. ValueError, changing nothing, on a row or block out of range\n"
"or buffers that disagree.");

static PyObject *drop_gone(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer b[9];
    memset(b, 0, sizeof b);
    unsigned long long seed;
    Py_ssize_t num_spare;
    /* b[0] slots, b[1] hash_of, b[2] entry_blocks, b[3] entry_at, b[4] holders, b[5] spare, b[6] rows, b[7] blocks,
     * b[8] gone (optional) */
    if (!PyArg_ParseTuple(args, "O&KO&O&O&O&O&nO&O&|O&", write_array, &b[0], &seed, read_array, &b[1], write_array,
                          &b[2], write_array, &b[3], write_array, &b[4], write_array, &b[5], &num_spare, read_array,
                          &b[6], read_array, &b[7], write_array, &b[8]))
        return NULL;
    PyObject *result = NULL;
    index_t x;
    if (open_index(&x, &b[0], seed, &b[1], &b[2], &b[3], &b[4], "drop_gone") < 0)
        goto done;
    const Py_ssize_t k = b[6].len / (Py_ssize_t)sizeof(int32_t);
    const int32_t *rows = b[6].buf, *blocks = b[7].buf;
    uint8_t *gone_out = b[8].obj || b[8].buf ? b[8].buf : NULL;
    if (b[7].len != b[6].len || num_spare < 0 || num_spare + k > b[5].len / (Py_ssize_t)sizeof(Py_ssize_t)
        || (gone_out && b[8].len < k * KEY_BYTES)) {
        PyErr_SetString(PyExc_ValueError, "drop_gone: rows, blocks, the spare stack and gone do not fit");
        goto done;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        if (rows[i] < 0 || rows[i] >= x.rows || blocks[i] < 0 || blocks[i] >= x.num_blocks) {
            PyErr_Format(PyExc_ValueError, "drop_gone: pair %zd (row %d, block %d) is outside the index", i,
                         (int)rows[i], (int)blocks[i]);
            goto done;
        }
    }
    Py_ssize_t removed = 0;
    for (Py_ssize_t r = 0; r < x.rows; r++)
        for (Py_ssize_t i = 0; i < k; i++)
            if (rows[i] == r)
                removed += drop_evicted(&x, r, &blocks[i], 1, b[5].buf, &num_spare,
                                        gone_out ? gone_out + removed * KEY_BYTES : NULL);
    result = Py_BuildValue("nn", num_spare, removed);
done:
    release_buffers(b, 9);
    return result;
}

/* Entry ids for k new hashes as PrefixIndex._take_entries hands them out: the last spare first, then fresh ones. */
static void take_entries(const Py_ssize_t *spare, Py_ssize_t *num_spare, Py_ssize_t *num_entries, Py_ssize_t k,
                         int64_t *entries)
{
    const Py_ssize_t reuse = k < *num_spare ? k : *num_spare;
    for (Py_ssize_t i = 0; i < reuse; i++)
        entries[i] = spare[*num_spare - 1 - i];
    *num_spare -= reuse;
    for (Py_ssize_t i = reuse; i < k; i++)
        entries[i] = (*num_entries)++;
}

/* PrefixIndex.insert_new of k new hashes held by ``blocks`` (int32 [k, rows]; pool rows = index rows) under entry
 * ids from take_entries, then BlockPool.mark_cached of those blocks. The spare and entry counters move only on
 * success. Returns the keys inserted, or -2 with AssertionError set and nothing written (a pair already holding a
 * hash, an id out of range: an owner bug). */
static Py_ssize_t insert_and_cache(index_t *x, pool_t *p, const uint8_t *keys, Py_ssize_t k, const int32_t *blocks,
                                   int64_t *entries, const Py_ssize_t *spare, Py_ssize_t *num_spare,
                                   Py_ssize_t *num_entries)
{
    Py_ssize_t left = *num_spare, used = *num_entries;
    take_entries(spare, &left, &used, k, entries);
    const Py_ssize_t inserted = index_insert_new(x, keys, k, entries, blocks, 0);
    if (inserted < 0)
        return inserted;
    for (Py_ssize_t i = 0; i < k; i++)
        for (Py_ssize_t r = 0; r < x->rows; r++)
            p->cached[r * p->n + blocks[i * x->rows + r]] = 1;
    *num_spare = left;
    *num_entries = used;
    return inserted;
}

/* Whether k packed keys are distinct and none is in the table: what makes one insert of them all the one-by-one
 * result (a decode run's filled blocks). */
static int keys_new_and_distinct(const table_t *t, const uint8_t *keys, Py_ssize_t k)
{
    for (Py_ssize_t i = 0; i < k; i++) {
        const uint8_t *key = keys + i * KEY_BYTES;
        if (t->slots[probe(t, key, tag_of(t, key))].entry >= 0)
            return 0;
        for (Py_ssize_t j = 0; j < i; j++)
            if (memcmp(keys + j * KEY_BYTES, key, KEY_BYTES) == 0)
                return 0;
    }
    return 1;
}

typedef int (*each_fn)(int cbor, const uint32_t *tokens, Py_ssize_t n, Py_ssize_t bs, const uint8_t *parents,
                       uint8_t *out);
static each_fn each_blocks; /* _chainhash's, from its capsule on first use */

/* ------------------------------------------------------------------ the batch both decode passes take */

/* What extend_decode and extend_rows take of a batch and of the manager's slot arrays, checked and read the same
 * way: b[0] tokens, b[1] counts, b[2] ntok, b[3] fast_limit, b[4] next_recycle, b[5] tail, b[6] changed_ok,
 * b[7] stamp, b[8] keyed, b[9] salted, b[10] last_hash, b[11] last_block, b[12] width, b[13] lens. A pass
 * declares it before its first goto with its name and rules set, the rest zero; decode_close frees what it
 * holds. */
typedef struct {
    const char *fn;                 /* the pass, naming it in its errors */
    int every_held;                 /* every slot must hold a request (else only given slots are checked) */
    int gives_back;                 /* the pass gives window blocks back (else a request due to falls back) */
    int hashing;                    /* -1 none, 0 sha256, 1 sha256_cbor */
    Py_ssize_t lookahead;           /* positions each table covers past the new token */
    Py_buffer given;                /* slots resolved beforehand, instead of the slot_of dict */
    Py_ssize_t n, cap, bs, num_tok; /* requests, slots, block size, tokens */
    int narrow;                     /* int32 counts (as the wire has them) */
    Py_ssize_t *slot;               /* each request's slot */
    Py_ssize_t *run_at, num_fill;   /* the run (decode_read): its requests' positions, ascending, and fills */
    Py_ssize_t *fill_at;            /* the positions of the run's requests whose token fills a block */
    uint8_t *run_kind;              /* per run request, RUN_OPENS | RUN_FILLS */
    int64_t *wide;                  /* int32 counts widened */
    const int64_t *count;
    const uint32_t *tok;
    int64_t *nt, *lim, *rec;
    uint32_t *tl;
    uint8_t *ch, *lh;
    Py_ssize_t *st;
    const uint8_t *key, *salt;
    int32_t *lb, *wd, *lens;
    uint32_t *blocks_tok;           /* the filled blocks' tokens, parents' hashes and hashes (decode_hash_fills) */
    uint8_t *parents, *hashes;
} decode_batch_t;

enum { RUN_OPENS = 1, RUN_FILLS = 2, IN_RUN = 4 }; /* decode_kind: opens a block, its token fills one, in the run */
enum { DECODE_FAILED = -1, DECODE_NONE = -2 }; /* decode_read: an error set; the general path takes the batch */

/* The pool's arrays and then the prefix index's, as the passes take them in a row: b[0..8] the pool (ref, cached,
 * stack, top, ring, lru_pos, head, tail_pos, lru_count), b[9] slots, b[10] hash_of, b[11] entry_blocks,
 * b[12] entry_at, b[13] holders. 0, or -1 with ValueError naming fn. */
static int open_store(pool_t *p, index_t *x, Py_buffer *b, unsigned long long seed, const char *fn)
{
    if (open_pool(p, b, fn) < 0)
        return -1;
    return open_index(x, &b[POOL_ARRAYS], seed, &b[POOL_ARRAYS + 1], &b[POOL_ARRAYS + 2], &b[POOL_ARRAYS + 3],
                      &b[POOL_ARRAYS + 4], fn);
}

/* The pass's lookahead, its slots (slot_of a dict, or the given intp slots, one per id) and its hasher: 0, or -1
 * with an error set. */
static int decode_open(decode_batch_t *d, PyObject *slot_of, PyObject *ids, int hashing, Py_ssize_t lookahead)
{
    d->n = PyList_GET_SIZE(ids);
    d->hashing = hashing;
    d->lookahead = lookahead;
    if (lookahead < 0) {
        PyErr_Format(PyExc_ValueError, "%s: lookahead must not be negative", d->fn);
        return -1;
    }
    if (!PyDict_Check(slot_of) && PyObject_GetBuffer(slot_of, &d->given, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (hashing >= 0 && !each_blocks) {
        each_blocks = (each_fn)PyCapsule_Import("kvcache.allocator._chainhash._each_api", 0);
        if (!each_blocks)
            return -1;
    }
    if (d->given.obj && d->given.len != d->n * (Py_ssize_t)sizeof(Py_ssize_t)) {
        PyErr_Format(PyExc_ValueError, "%s: the given slots must be one intp per id", d->fn);
        return -1;
    }
    return 0;
}

/* Whether b[0..13] agree with each other and with the batch, last_block holding ``groups`` blocks a slot (the
 * pass names what disagrees with the rest of its arguments); the sizes are set either way. */
static int decode_sizes_ok(decode_batch_t *d, const Py_buffer *b, Py_ssize_t groups)
{
    const Py_ssize_t n = d->n, cap = d->cap = b[2].len / (Py_ssize_t)sizeof(int64_t);
    const Py_ssize_t bs = d->bs = cap ? b[5].len / (Py_ssize_t)sizeof(uint32_t) / cap : 0;
    d->num_tok = b[0].len / (Py_ssize_t)sizeof(uint32_t);
    d->narrow = n > 0 && b[1].len == n * (Py_ssize_t)sizeof(int32_t);
    return !(b[0].len % (Py_ssize_t)sizeof(uint32_t) || (!d->narrow && b[1].len != n * (Py_ssize_t)sizeof(int64_t))
             || cap < 1 || bs < 1 || b[3].len != b[2].len || b[4].len != b[2].len
             || b[5].len != cap * bs * (Py_ssize_t)sizeof(uint32_t) || b[6].len != cap
             || b[7].len != cap * (Py_ssize_t)sizeof(Py_ssize_t) || b[8].len != cap || b[9].len != cap
             || b[10].len != cap * KEY_BYTES || b[11].len != cap * groups * (Py_ssize_t)sizeof(int32_t)
             || b[12].len != cap * (Py_ssize_t)sizeof(int32_t) || b[13].len != n * (Py_ssize_t)sizeof(int32_t));
}

/* The batch's scratch (slots, the run, widened counts) and its arrays' data, once their sizes agree: 0, or -1
 * with MemoryError. */
static int decode_arrays(decode_batch_t *d, const Py_buffer *b)
{
    const size_t m = (size_t)(d->n ? d->n : 1);
    d->slot = PyMem_Malloc(3 * m * sizeof(Py_ssize_t) + m);
    if (d->narrow)
        d->wide = PyMem_Malloc(m * sizeof(int64_t));
    if (!d->slot || (d->narrow && !d->wide)) {
        PyErr_NoMemory();
        return -1;
    }
    d->run_at = d->slot + m;
    d->fill_at = d->slot + 2 * m;
    d->run_kind = (uint8_t *)(d->slot + 3 * m);
    for (Py_ssize_t i = 0; d->narrow && i < d->n; i++)
        d->wide[i] = ((const int32_t *)b[1].buf)[i];
    d->count = d->narrow ? d->wide : b[1].buf;
    d->tok = b[0].buf;
    d->nt = b[2].buf, d->lim = b[3].buf, d->rec = b[4].buf;
    d->tl = b[5].buf;
    d->ch = b[6].buf, d->key = b[8].buf, d->salt = b[9].buf, d->lh = b[10].buf;
    d->st = b[7].buf;
    d->lb = b[11].buf, d->wd = b[12].buf, d->lens = b[13].buf;
    return 0;
}

/* Each request's slot (slot_of[id], or the given one), stamped with its position in the batch (the stamps are
 * scratch). 1; 0 where the general path takes the batch (an id not admitted or of another type, a count out of
 * range, a slot no request holds, counts not summing to the tokens); -1 with an error set. */
static int decode_slots(decode_batch_t *d, PyObject *slot_of, PyObject *ids, PyObject *by_slot)
{
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < d->n; i++) {
        const int found = d->given.obj ? (d->slot[i] = ((const Py_ssize_t *)d->given.buf)[i], 1)
                                       : lookup_id(slot_of, PyList_GET_ITEM(ids, i), &d->slot[i]);
        if (found < 0)
            return -1;
        if (!found || d->count[i] < 0 || d->count[i] > d->num_tok)
            return 0;
        const Py_ssize_t s = d->slot[i];
        if (s < 0 || s >= d->cap) {
            PyErr_Format(PyExc_ValueError, "%s: slot %zd is outside the slot arrays", d->fn, s);
            return -1;
        }
        if ((d->every_held || d->given.obj)
            && (s >= PyList_GET_SIZE(by_slot) || PyList_GET_ITEM(by_slot, s) == Py_None))
            return 0; /* a slot no request holds: the general path looks the ids up */
        d->st[s] = i;
        total += d->count[i];
    }
    return total == d->num_tok;
}

/* How request i extends: 0 inside its last block (extend_fast's write), IN_RUN with RUN_OPENS and RUN_FILLS as
 * they apply in the run; -1 where the general path takes the batch: its slot listed twice, not a plain decode
 * extend (the one-by-one order matters), window blocks due back where the pass gives none back, or a lookahead
 * that grew since the request's last extend (a second block to open). */
static inline int decode_kind(const decode_batch_t *d, Py_ssize_t i)
{
    const Py_ssize_t s = d->slot[i], bs = d->bs;
    if (d->st[s] != i) /* listed twice */
        return -1;
    const int64_t t = d->nt[s], covered = (int64_t)d->wd[s] * bs, k = d->count[i], ahead = d->lookahead;
    /* The fast path's table must also cover the lookahead positions. */
    if (in_last_block(t, k, d->rec[s], covered - ahead < d->lim[s] ? covered - ahead : d->lim[s]))
        return 0;
    if (!plain_decode(k, t, bs, d->key[s], d->salt[s], d->hashing >= 0) || (!d->gives_back && t >= d->rec[s]))
        return -1;
    const int64_t opens = blocks_short(t, ahead, bs, d->wd[s]);
    if (opens > 1)
        return -1;
    return IN_RUN | (opens == 1 ? RUN_OPENS : 0) | (d->hashing >= 0 && t % bs == bs - 1 ? RUN_FILLS : 0);
}

/* Everything a pass checks of the batch before its first write (the stamps aside): the scratch, the slots, and
 * each request's kind. The run's length (d->run_at, d->run_kind, and d->fill_at its d->num_fill filling
 * requests); DECODE_NONE where the general path takes the batch; DECODE_FAILED with an error set. */
static Py_ssize_t decode_read(decode_batch_t *d, const Py_buffer *b, PyObject *slot_of, PyObject *ids,
                              PyObject *by_slot)
{
    if (decode_arrays(d, b) < 0)
        return DECODE_FAILED;
    const int slots = decode_slots(d, slot_of, ids, by_slot);
    if (slots <= 0)
        return slots < 0 ? DECODE_FAILED : DECODE_NONE;
    Py_ssize_t m = 0;
    d->num_fill = 0;
    for (Py_ssize_t i = 0; i < d->n; i++) {
        const int kind = decode_kind(d, i);
        if (kind < 0)
            return DECODE_NONE;
        if (!kind)
            continue;
        if (kind & RUN_FILLS)
            d->fill_at[d->num_fill++] = i;
        d->run_kind[m] = (uint8_t)(kind & (RUN_OPENS | RUN_FILLS));
        d->run_at[m++] = i;
    }
    return m;
}

/* The run's filled blocks (requests d->fill_at) hashed into d->hashes: each one's tokens are its tail with the
 * token that fills it, which sits at the request's offset in tokens, and its parent the request's last hash. 0,
 * or -1 with an error set. Writes nothing of the manager's. */
static int decode_hash_fills(decode_batch_t *d)
{
    const Py_ssize_t bs = d->bs, num_fill = d->num_fill;
    if (!num_fill)
        return 0;
    d->blocks_tok = PyMem_Malloc((size_t)num_fill * (size_t)bs * sizeof(uint32_t));
    d->parents = PyMem_Malloc((size_t)num_fill * KEY_BYTES);
    d->hashes = PyMem_Malloc((size_t)num_fill * KEY_BYTES);
    if (!d->blocks_tok || !d->parents || !d->hashes) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0, f = 0, offset = 0; f < num_fill; offset += d->count[i], i++) {
        if (d->fill_at[f] != i)
            continue;
        const Py_ssize_t s = d->slot[i];
        memcpy(d->blocks_tok + f * bs, d->tl + s * bs, (size_t)bs * sizeof(uint32_t));
        d->blocks_tok[f * bs + bs - 1] = d->tok[offset];
        memcpy(d->parents + f * KEY_BYTES, d->lh + s * KEY_BYTES, KEY_BYTES);
        f++;
    }
    return each_blocks(d->hashing, d->blocks_tok, num_fill, bs, d->parents, d->hashes) < 0 ? -1 : 0;
}

/* The run's filled block f (request position i, block index block) as a pass's ``stored`` lists it: (position,
 * block index, hash, parent hash, tokens as uint32 bytes), a BlockStored's fields. */
static PyObject *stored_item(const decode_batch_t *d, Py_ssize_t f, Py_ssize_t i, int64_t block)
{
    return Py_BuildValue("nLy#y#y#", i, (long long)block, (const char *)(d->hashes + f * KEY_BYTES),
                         (Py_ssize_t)KEY_BYTES, (const char *)(d->parents + f * KEY_BYTES), (Py_ssize_t)KEY_BYTES,
                         (const char *)(d->blocks_tok + f * d->bs), d->bs * (Py_ssize_t)sizeof(uint32_t));
}

static void decode_close(decode_batch_t *d)
{
    PyBuffer_Release(&d->given);
    PyMem_Free(d->slot);
    PyMem_Free(d->wide);
    PyMem_Free(d->blocks_tok);
    PyMem_Free(d->parents);
    PyMem_Free(d->hashes);
}

PyDoc_STRVAR(extend_decode_doc,
"extend_decode(slot_of | slots_given, ids, tokens, counts, by_slot, hashing, ntok, fast_limit, next_recycle,\n"
"              tail, changed_ok,\n"
"              stamp, keyed, salted, last_hash, last_block, width, lens,\n"
"              ref, cached, stack, top, ring, lru_pos, head, tail_pos, lru_count,\n"
"              slots, seed, hash_of, entry_blocks, entry_at, holders, spare, num_spare, num_entries, events=False,\n"
"              lookahead=0)\n"
"    -> (index, cols, vals, widen, evicted, num_spare, num_entries, keys_removed, keys_added[, removed, stored])\n"
"       | None\n\n"
"KVCacheManager.extend_many_deltas in one pass, for a one-row manager (one group, no window, no tier):\n"
"request ids[i] (its slot slot_of[id], or slots_given[i]: intp slots a lookup_ids of the same ids gave) gets the\n"
"next counts[i] (int64, or int32) of tokens (uint32). Extends inside the\n"
"last block are extend_fast's; every other one must be a plain decode extend (one token, no extra hash keys),\n"
"and those go as\n"
"one run: blocks for the ones whose table does not cover the new token and lookahead positions more (at most\n"
"one block each; BlockPool.allocate, in request order, evictions dropped\n"
"from the index), the filled blocks (the last, or one behind it where blocks were reserved ahead) hashed\n"
"(hashing: -1 none, 0 sha256, 1 sha256_cbor) and indexed, every\n"
"slot array, table column and request record as KVCacheManager._extend_run writes them. lens (int32 [n]) gets each table's\n"
"width; index/cols/vals (bytes of int32) list the opened requests' positions, old widths and new blocks;\n"
"widen the positions in index whose table had no room (the caller widens and writes them). Returns None,\n"
"changing nothing, for anything else (an id not admitted or of another type, a slot listed twice, a negative\n"
"count, counts not summing to the tokens, a request that is not plain, too few blocks, a filled block's hash\n"
"repeated or indexed): the general path takes the batch. The caller made room: spare for n more ids, the\n"
"entry arrays and table for n more keys. ValueError, changing nothing, on inconsistent sizes. With events,\n"
"also what KV events need: ``removed`` packs, per eviction in order, the hash it dropped from the index (32\n"
"zero bytes: none), and ``stored`` lists each filled block as (request position, block index, hash, parent\n"
"hash, tokens as uint32 bytes), in request order.");

static PyObject *extend_decode(PyObject *self, PyObject *args)
{
    (void)self;
    enum { NB = 14 + POOL_ARRAYS + 6 };
    Py_buffer b[NB];
    memset(b, 0, sizeof b);
    PyObject *slot_of, *ids, *by_slot;
    int hashing;
    unsigned long long seed;
    Py_ssize_t num_spare, num_entries, lookahead = 0;
    /* b[0] tokens, b[1] counts, b[2] ntok, b[3] fast_limit, b[4] next_recycle, b[5] tail, b[6] changed_ok,
     * b[7] stamp, b[8] keyed, b[9] salted, b[10] last_hash, b[11] last_block, b[12] width, b[13] lens;
     * b[14..22] the pool; b[23] slots, b[24] hash_of, b[25] entry_blocks, b[26] entry_at, b[27] holders,
     * b[28] spare. */
    int events = 0;
    if (!PyArg_ParseTuple(args, "OO!O&O&O!iO&O&O&O&O&O&O&O&O&O&O&O&O&O&O&O&O&O&O&O&O&O&KO&O&O&O&O&nn|pn", &slot_of,
                          &PyList_Type, &ids, read_array, &b[0], read_array, &b[1], &PyList_Type, &by_slot, &hashing,
                          write_array, &b[2], write_array, &b[3], read_array, &b[4], write_array, &b[5], write_array,
                          &b[6], write_array, &b[7], read_array, &b[8], read_array, &b[9], write_array, &b[10],
                          write_array, &b[11], write_array, &b[12], write_array, &b[13], write_array, &b[14],
                          write_array, &b[15], write_array, &b[16], write_array, &b[17], write_array, &b[18],
                          write_array, &b[19], write_array, &b[20], write_array, &b[21], write_array, &b[22],
                          write_array, &b[23], &seed, write_array, &b[24], write_array, &b[25], write_array, &b[26],
                          write_array, &b[27], write_array, &b[28], &num_spare, &num_entries, &events,
                          &lookahead))
        return NULL;
    decode_batch_t d = {.fn = "extend_decode"}; /* slot_of's slots hold requests; no window gives back */
    PyObject *result = NULL, *index_obj = NULL, *cols_obj = NULL, *vals_obj = NULL, *widen = NULL, *removed = NULL,
             *stored = NULL;
    Py_ssize_t *need = NULL, *fill = NULL;
    int32_t *evicted = NULL, *filled = NULL;
    uint8_t *is_slow = NULL;
    int64_t *entries = NULL;
    int32_t **tables = NULL;
    Py_ssize_t *capacity = NULL;
    pool_t p;
    index_t x;
    if (decode_open(&d, slot_of, ids, hashing, lookahead) < 0 || open_store(&p, &x, &b[14], seed, d.fn) < 0)
        goto done;
    const int sizes_ok = decode_sizes_ok(&d, b, p.rows);
    const Py_ssize_t n = d.n, bs = d.bs;
    if (!sizes_ok || p.rows != 1 || x.rows != 1 || p.n != x.num_blocks || num_spare < 0 || num_entries < 0
        || num_spare + n > b[28].len / (Py_ssize_t)sizeof(Py_ssize_t) || num_entries + n > x.entries) {
        PyErr_SetString(PyExc_ValueError, "extend_decode: the slot arrays, pool, index or outputs have inconsistent "
                        "sizes (or the index has no room for n more keys)");
        goto done;
    }
    const size_t m_bytes = (size_t)(n ? n : 1);
    need = PyMem_Malloc(m_bytes * sizeof(Py_ssize_t));
    fill = PyMem_Malloc(m_bytes * sizeof(Py_ssize_t));
    evicted = PyMem_Malloc(m_bytes * sizeof(int32_t));
    filled = PyMem_Malloc(m_bytes * sizeof(int32_t));
    entries = PyMem_Malloc(m_bytes * sizeof(int64_t));
    is_slow = PyMem_Calloc(m_bytes, 1);
    if (!need || !fill || !evicted || !filled || !entries || !is_slow) {
        PyErr_NoMemory();
        goto done;
    }

    /* Everything is checked before the first write: a None leaves the general path an untouched manager. */
    const Py_ssize_t m = decode_read(&d, b, slot_of, ids, by_slot);
    if (m == DECODE_FAILED)
        goto done;
    if (m == DECODE_NONE)
        goto fallback;
    const Py_ssize_t *slow = d.run_at, num_fill = d.num_fill;
    Py_ssize_t num_need = 0;
    for (Py_ssize_t j = 0, f = 0; j < m; j++) {
        is_slow[slow[j]] = 1;
        if (d.run_kind[j] & RUN_OPENS)
            need[num_need++] = j;
        if (d.run_kind[j] & RUN_FILLS)
            fill[f++] = j;
    }
    if (num_need > p.top[0] + p.lru_count[0])
        goto fallback; /* some would get no block: the general path refuses exactly those */
    tables = PyMem_Malloc(m_bytes * sizeof(int32_t *));
    capacity = PyMem_Malloc(m_bytes * sizeof(Py_ssize_t));
    if (!tables || !capacity) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t q = 0; q < num_need; q++) { /* the tables stay put: their requests hold them, nothing runs */
        const Py_ssize_t s = d.slot[slow[need[q]]];
        PyObject *req = s < PyList_GET_SIZE(by_slot) ? PyList_GET_ITEM(by_slot, s) : Py_None;
        if (req == Py_None) {
            PyErr_Format(PyExc_ValueError, "extend_decode: slot %zd holds no request", s);
            goto done;
        }
        if ((capacity[q] = request_table(req, 1, &tables[q])) < 0)
            goto done;
    }
    if (decode_hash_fills(&d) < 0)
        goto done;
    /* A filled block behind the table's last column (blocks reserved ahead) is read from the table now; the run
     * writes only columns past the old width. -1: the block the table ends with after the run (last_block). */
    for (Py_ssize_t f = 0, q = 0; f < num_fill; f++) {
        const Py_ssize_t i = slow[fill[f]], s = d.slot[i];
        while (q < num_need && need[q] < fill[f])
            q++;
        const int64_t col = d.nt[s] / bs, width = d.wd[s] + (q < num_need && need[q] == fill[f]);
        filled[f] = -1;
        if (col < width - 1) {
            PyObject *req = s < PyList_GET_SIZE(by_slot) ? PyList_GET_ITEM(by_slot, s) : Py_None;
            int32_t *data;
            const Py_ssize_t columns = req == Py_None ? 0 : request_table(req, 1, &data);
            if (columns < 0)
                goto done;
            if (col >= columns) {
                PyErr_Format(PyExc_ValueError, "extend_decode: slot %zd's table has no column %lld", s,
                             (long long)col);
                goto done;
            }
            filled[f] = data[col];
        }
    }
    if (!keys_new_and_distinct(&x.t, d.hashes, num_fill))
        goto fallback; /* a repeated or indexed hash: the one-by-one path merges it */
    index_obj = PyBytes_FromStringAndSize(NULL, num_need * (Py_ssize_t)sizeof(int32_t));
    cols_obj = PyBytes_FromStringAndSize(NULL, num_need * (Py_ssize_t)sizeof(int32_t));
    vals_obj = PyBytes_FromStringAndSize(NULL, num_need * (Py_ssize_t)sizeof(int32_t));
    widen = PyList_New(0);
    if (!index_obj || !cols_obj || !vals_obj || !widen)
        goto done;
    int32_t *index_out = (int32_t *)PyBytes_AS_STRING(index_obj), *cols_out = (int32_t *)PyBytes_AS_STRING(cols_obj);
    int32_t *blocks = (int32_t *)PyBytes_AS_STRING(vals_obj);

    /* Commit. The pool first: -2 (a ring that disagrees with lru_count, an owner bug) changes nothing. */
    const Py_ssize_t num_evicted = pool_take(&p, 0, num_need, blocks, evicted, 0);
    if (num_evicted < 0)
        goto done;
    if (events) { /* the hash each eviction drops from the index (one row: every cached block's leaves), in order */
        removed = PyBytes_FromStringAndSize(NULL, num_evicted * KEY_BYTES);
        if (!removed)
            goto fail;
        uint8_t *out = (uint8_t *)PyBytes_AS_STRING(removed);
        for (Py_ssize_t i = 0; i < num_evicted; i++) {
            const int32_t entry = x.entry_at[evicted[i]];
            if (entry >= 0 && x.holders[entry] == 1)
                memcpy(out + i * KEY_BYTES, x.hash_of + (Py_ssize_t)entry * KEY_BYTES, KEY_BYTES);
            else
                memset(out + i * KEY_BYTES, 0, KEY_BYTES); /* left nothing: no event (caller skips zeros) */
        }
    }
    const Py_ssize_t gone = drop_evicted(&x, 0, evicted, num_evicted, b[28].buf, &num_spare, NULL);
    {
        Py_ssize_t offset = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            const Py_ssize_t s = d.slot[i];
            const int64_t t = d.nt[s], k = d.count[i];
            if (!is_slow[i])
                write_in_block(d.tl + s * bs, &d.nt[s], &d.ch[s], t, k, d.tok + offset, bs);
            else
                write_run_token(d.tl + s * bs, &d.nt[s], &d.ch[s], t, d.tok[offset], bs,
                                blocks_short(t, lookahead, bs, d.wd[s]) > 0);
            offset += k;
        }
    }
    for (Py_ssize_t q = 0; q < num_need; q++) { /* the opened blocks: the table's next column */
        const Py_ssize_t i = slow[need[q]], s = d.slot[i];
        PyObject *req = PyList_GET_ITEM(by_slot, s);
        const int32_t col = d.wd[s];
        if (col < capacity[q])
            tables[q][col] = blocks[q];
        else if (append_position(widen, q) < 0)
            goto fail;
        if (record_opened(req) < 0)
            goto fail;
        d.lb[s] = blocks[q];
        index_out[q] = (int32_t)i;
        cols_out[q] = col;
        d.wd[s] = col + 1;
    }
    for (Py_ssize_t j = 0; j < m; j++) { /* the run's fast-path limits, with the widths it leaves */
        const Py_ssize_t s = d.slot[slow[j]];
        d.lim[s] = refreshed_limit(d.nt[s], d.wd[s], bs, hashing >= 0);
    }
    for (Py_ssize_t f = 0; f < num_fill; f++) { /* the filled blocks: their hash, and the block that holds it */
        const Py_ssize_t s = d.slot[slow[fill[f]]];
        if (filled[f] < 0)
            filled[f] = d.lb[s];
        memcpy(d.lh + s * KEY_BYTES, d.hashes + f * KEY_BYTES, KEY_BYTES);
    }
    const Py_ssize_t added = insert_and_cache(&x, &p, d.hashes, num_fill, filled, entries, b[28].buf, &num_spare,
                                              &num_entries);
    if (added < 0)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++)
        d.lens[i] = d.wd[d.slot[i]];
    if (events) { /* each fill's request position, block index, hash, parent and tokens: its BlockStored */
        stored = PyList_New(num_fill);
        if (!stored)
            goto fail;
        for (Py_ssize_t f = 0; f < num_fill; f++) {
            const Py_ssize_t i = slow[fill[f]];
            PyObject *item = stored_item(&d, f, i, (d.nt[d.slot[i]] - 1) / bs);
            if (!item)
                goto fail;
            PyList_SET_ITEM(stored, f, item);
        }
        result = Py_BuildValue("OOOOnnnnnOO", index_obj, cols_obj, vals_obj, widen, num_evicted, num_spare,
                               num_entries, gone, added, removed, stored);
    } else {
        result = Py_BuildValue("OOOOnnnnn", index_obj, cols_obj, vals_obj, widen, num_evicted, num_spare,
                               num_entries, gone, added);
    }
    goto done;
fallback:
    result = Py_NewRef(Py_None);
    goto done;
fail: /* only a failed allocation, attribute write or an owner bug gets here, after the checks */
    Py_CLEAR(result);
done:
    Py_XDECREF(index_obj);
    Py_XDECREF(cols_obj);
    Py_XDECREF(vals_obj);
    Py_XDECREF(widen);
    Py_XDECREF(removed);
    Py_XDECREF(stored);
    PyMem_Free(need);
    PyMem_Free(fill);
    PyMem_Free(evicted);
    PyMem_Free(filled);
    PyMem_Free(entries);
    PyMem_Free(is_slow);
    PyMem_Free(tables);
    PyMem_Free(capacity);
    decode_close(&d);
    release_buffers(b, NB); /* zeroed ones (not parsed) have no object: skipped */
    return result;
}

/* ------------------------------------------------------------------ a decode step over row groups and windows */

static PyObject *recycled_name, *heads_name;
static PyObject *int32_descr; /* the dtype of an int32 table columns_of took by export: later ones are read off
                               * their array heads */

/* columns_of(obj, rows, data, writable) for a request's table or rows, read off the array head where it is an
 * exact C-contiguous writable 2-D numpy array of int32 (about 0.2 us less than an export: a decode run takes
 * dozens). */
static Py_ssize_t table_columns(PyObject *obj, Py_ssize_t rows, int32_t **data)
{
    const int heads = array_heads_usable();
    if (heads < 0)
        return -1;
    if (heads && int32_descr && (PyObject *)Py_TYPE(obj) == ndarray_type) {
        const array_head *h = (const array_head *)obj;
        if (h->descr == int32_descr && h->nd == 2 && (h->flags & ARRAY_C_CONTIGUOUS) && (h->flags & ARRAY_WRITEABLE)
            && h->dimensions[0] == rows) {
            *data = (int32_t *)h->data;
            return h->dimensions[1];
        }
    }
    const Py_ssize_t columns = columns_of(obj, rows, data, 1);
    if (heads && columns >= 0 && !int32_descr && (PyObject *)Py_TYPE(obj) == ndarray_type)
        int32_descr = Py_NewRef(((const array_head *)obj)->descr);
    return columns;
}

/* One request of a decode run that does more than write into its last block (extend_rows): its slot, record,
 * tables, and what its extend does. */
typedef struct {
    Py_ssize_t i, s;       /* position in the batch, slot */
    PyObject *req;         /* borrowed from by_slot */
    int32_t *table, *heads; /* int32 [groups, capacity] and [rows, capacity] (NULL: rows are the groups) */
    Py_ssize_t capacity;
    int64_t t;             /* tokens before the extend */
    int opens, fills, gives;
    Py_ssize_t lo, hi;     /* the given columns' span (gives): columns any window group empties */
    Py_ssize_t num_cols;   /* changed columns: given ones, then the opened one */
} rows_run_t;

/* recyclable_blocks(policy, t, bs).stop of a window group (windows row: group, chunk C or 0, window W, sink S). */
static inline int64_t group_stop(const int64_t *w, int64_t t, Py_ssize_t bs)
{
    if (w[1] > 0)
        return t / w[1] * w[1] / bs;
    const int64_t seen = t - w[2] + 1 > 0 ? t - w[2] + 1 : 0, sink = (w[3] + bs - 1) / bs;
    return seen / bs > sink ? seen / bs : sink;
}

/* recycle_at(policy, recycled, bs): the least first pending query at which block ``recycled`` may go back. */
static inline int64_t group_recycle_at(const int64_t *w, int64_t recycled, Py_ssize_t bs)
{
    const int64_t end = (recycled + 1) * bs;
    return w[1] > 0 ? (end + w[1] - 1) / w[1] * w[1] : end + w[2] - 1;
}

/* BlockPool.decref of one referenced pair: at zero an uncached block goes on its row's free stack, a cached one to
 * the tail of its LRU ring (a ring full of stale entries compacted first), as _pool.release does. */
static inline void pool_release_one(pool_t *p, Py_ssize_t r, int32_t blk)
{
    const Py_ssize_t flat = r * p->n + blk;
    if (--p->ref[flat] > 0)
        return;
    if (!p->cached[flat]) {
        p->stack[r * p->n + p->top[r]++] = blk;
        return;
    }
    if (p->lru_count[r] == 0)
        p->head[r] = p->tail[r] = 0;
    else if (p->tail[r] - p->head[r] + 1 > p->cap)
        compact(p, r);
    const Py_ssize_t g = r * p->cap + (p->tail[r] & (p->cap - 1));
    p->ring[g] = blk;
    p->lru_pos[flat] = g;
    p->tail[r]++;
    p->lru_count[r]++;
}

PyDoc_STRVAR(extend_rows_doc,
"extend_rows(slot_of | slots_given, ids, tokens, counts, by_slot, hashing, lookahead, events,\n"
"            ntok, fast_limit, next_recycle, tail, changed_ok, stamp, keyed, salted, last_hash, last_block, width,\n"
"            lens, row_group, windows, counted,\n"
"            ref, cached, stack, top, ring, lru_pos, head, tail_pos, lru_count,\n"
"            slots, seed, hash_of, entry_blocks, entry_at, holders, spare, num_spare, num_entries)\n"
"    -> (index, offsets, cols, vals, widen, givers, num_spare, num_entries, keys_removed, keys_added, removed,\n"
"        stored) | None\n\n"
"extend_decode for a manager of several row groups (G, the pool's and index's rows), rows expanded from them\n"
"(row_group: intp [R], each row's group) and window or chunked groups giving blocks back (windows: int64\n"
"[w, 4], per such group: its group, chunk_tokens or 0, window_tokens, sink_tokens), no tier. Extends inside\n"
"the last block are extend_fast's; every other one must be a plain decode extend, and those run request by\n"
"request in batch order exactly as KVCacheManager._extend does: the window groups' dead blocks (tail first,\n"
"group by group) released and their columns emptied (-1, in the table and the group's expanded rows), the\n"
"request's window progress (its record's ``recycled``) and next_recycle moved on (its cached view stays: a\n"
"slice of the same table, it shows the emptied columns); at most one new block per\n"
"group (BlockPool.allocate, evictions dropped from the index group by group); the filled block hashed and\n"
"indexed in every group. last_block is int32 [slots, G]; counted (int64 [2]) gains the (row, block) pairs\n"
"evicted and given back, each group's counted once per row it stands for. Returns the changed requests'\n"
"positions, offsets and columns (int32 bytes: given columns, then the opened one) with their values now\n"
"(int32 [R, total] bytes); widen, (position in index, column, its G blocks as int32 bytes) for each opened\n"
"column past its table's capacity (the caller widens the table and its rows, and writes them); givers, the\n"
"positions in index whose changed columns the caller records (the rest have theirs: a range, or the opened\n"
"column). None, changing nothing, where the general path must take the batch (as extend_decode; and where a\n"
"group has fewer allocatable blocks than the run opens, before anything it gives back). With events,\n"
"``removed`` lists each eviction's (position, group, hash) of the pairs that held one, in order, and\n"
"``stored`` each filled block as extend_decode's; else both None. The caller made room: spare for G n more\n"
"ids, the entry arrays and table for n more keys. ValueError, changing nothing, on inconsistent sizes.");

static PyObject *extend_rows(PyObject *self, PyObject *args)
{
    (void)self;
    enum { NB = 17 + POOL_ARRAYS + 6 };
    Py_buffer b[NB];
    memset(b, 0, sizeof b);
    PyObject *slot_of, *ids, *by_slot;
    int hashing, events;
    unsigned long long seed;
    Py_ssize_t num_spare, num_entries, lookahead;
    /* b[0] tokens, b[1] counts, b[2] ntok, b[3] fast_limit, b[4] next_recycle, b[5] tail, b[6] changed_ok,
     * b[7] stamp, b[8] keyed, b[9] salted, b[10] last_hash, b[11] last_block, b[12] width, b[13] lens,
     * b[14] row_group, b[15] windows, b[16] counted; b[17..25] the pool; b[26] slots, b[27] hash_of,
     * b[28] entry_blocks, b[29] entry_at, b[30] holders, b[31] spare. */
    if (!PyArg_ParseTuple(args, "OO!O&O&O!inpO&O&O&O&O&O&O&O&O&O&O&O&O&O&O&O&O&O&O&O&O&O&O&O&O&KO&O&O&O&O&nn",
                          &slot_of, &PyList_Type, &ids, read_array, &b[0], read_array, &b[1], &PyList_Type, &by_slot,
                          &hashing, &lookahead, &events, write_array, &b[2], write_array, &b[3], write_array, &b[4],
                          write_array, &b[5], write_array, &b[6], write_array, &b[7], read_array, &b[8], read_array,
                          &b[9], write_array, &b[10], write_array, &b[11], write_array, &b[12], write_array, &b[13],
                          read_array, &b[14], read_array, &b[15], write_array, &b[16], write_array, &b[17],
                          write_array, &b[18], write_array, &b[19], write_array, &b[20], write_array, &b[21],
                          write_array, &b[22], write_array, &b[23], write_array, &b[24], write_array, &b[25],
                          write_array, &b[26], &seed, write_array, &b[27], write_array, &b[28], write_array, &b[29],
                          write_array, &b[30], write_array, &b[31], &num_spare, &num_entries))
        return NULL;
    decode_batch_t d = {.fn = "extend_rows", .every_held = 1, .gives_back = 1};
    PyObject *result = NULL, *index_obj = NULL, *offsets_obj = NULL, *cols_obj = NULL, *vals_obj = NULL,
             *widen = NULL, *givers = NULL, *removed = NULL, *stored = NULL;
    Py_ssize_t *fill = NULL, *group_size = NULL;
    rows_run_t *run = NULL;
    int64_t *given_rec = NULL, *given_stop = NULL, entry;
    int32_t *filled = NULL, *fresh = NULL;
    pool_t p;
    index_t x;
    if (decode_open(&d, slot_of, ids, hashing, lookahead) < 0 || open_store(&p, &x, &b[17], seed, d.fn) < 0)
        goto done;
    const Py_ssize_t G = p.rows;
    const int sizes_ok = decode_sizes_ok(&d, b, G);
    const Py_ssize_t n = d.n, bs = d.bs;
    const Py_ssize_t R = b[14].len / (Py_ssize_t)sizeof(Py_ssize_t), W = b[15].len / (4 * (Py_ssize_t)sizeof(int64_t));
    if (!sizes_ok || R < G || b[14].len != R * (Py_ssize_t)sizeof(Py_ssize_t)
        || b[15].len != W * 4 * (Py_ssize_t)sizeof(int64_t) || b[16].len != 2 * (Py_ssize_t)sizeof(int64_t)
        || x.rows != G || p.n != x.num_blocks || num_spare < 0 || num_entries < 0
        || num_spare + G * n > b[31].len / (Py_ssize_t)sizeof(Py_ssize_t) || num_entries + n > x.entries) {
        PyErr_SetString(PyExc_ValueError, "extend_rows: the slot arrays, rows, pool, index or outputs have "
                        "inconsistent sizes (or the index has no room for n more keys)");
        goto done;
    }
    const Py_ssize_t *row_group = b[14].buf;
    const int64_t *windows = b[15].buf;
    const int expand = R != G;
    group_size = PyMem_Calloc((size_t)G, sizeof(Py_ssize_t));
    if (!group_size) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t r = 0; r < R; r++) {
        if (row_group[r] < 0 || row_group[r] >= G || (!expand && row_group[r] != r)) {
            PyErr_Format(PyExc_ValueError, "extend_rows: row %zd's group %zd is not one of the %zd", r, row_group[r],
                         G);
            goto done;
        }
        group_size[row_group[r]]++;
    }
    for (Py_ssize_t w = 0; w < W; w++) {
        const int64_t *pol = windows + 4 * w;
        if (pol[0] < 0 || pol[0] >= G || pol[1] < 0 || (pol[1] == 0 && pol[2] < 1) || pol[3] < 0
            || (pol[1] > 0 && pol[1] % bs)) {
            PyErr_Format(PyExc_ValueError, "extend_rows: window group %zd is not a window or chunk of a group", w);
            goto done;
        }
    }
    for (Py_ssize_t g = 0; g < G; g++) {
        if (!group_size[g]) {
            PyErr_Format(PyExc_ValueError, "extend_rows: group %zd stands for no row", g);
            goto done;
        }
    }
    const size_t m_bytes = (size_t)(n ? n : 1);
    fill = PyMem_Malloc(m_bytes * sizeof(Py_ssize_t));
    run = PyMem_Calloc(m_bytes, sizeof(rows_run_t));
    if (!fill || !run) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *counted = b[16].buf;

    /* Everything is checked and read before the first write: a None leaves the general path an untouched manager. */
    const Py_ssize_t m = decode_read(&d, b, slot_of, ids, by_slot), num_fill = d.num_fill;
    if (m == DECODE_FAILED)
        goto done;
    if (m == DECODE_NONE)
        goto fallback;
    Py_ssize_t num_need = 0, num_gives = 0;
    for (Py_ssize_t j = 0, f = 0; j < m; j++) {
        rows_run_t *e = &run[j];
        e->i = d.run_at[j];
        e->s = d.slot[e->i];
        e->t = d.nt[e->s];
        e->opens = (d.run_kind[j] & RUN_OPENS) != 0;
        e->fills = (d.run_kind[j] & RUN_FILLS) != 0;
        e->gives = W > 0 && e->t >= d.rec[e->s];
        num_need += e->opens;
        num_gives += e->gives;
        if (e->fills)
            fill[f++] = j;
    }
    for (Py_ssize_t g = 0; g < G; g++)
        if (num_need > p.top[g] + p.lru_count[g])
            goto fallback; /* some would get no block: the general path refuses exactly those */
    const size_t given_bytes = (size_t)(num_gives * W > 0 ? num_gives * W : 1) * sizeof(int64_t);
    given_rec = PyMem_Malloc(given_bytes);
    given_stop = PyMem_Malloc(given_bytes);
    filled = PyMem_Malloc((size_t)(num_fill ? num_fill : 1) * (size_t)G * sizeof(int32_t));
    fresh = PyMem_Malloc((size_t)G * sizeof(int32_t));
    if (!given_rec || !given_stop || !filled || !fresh) {
        PyErr_NoMemory();
        goto done;
    }
    /* The run's records and tables (they stay put: their requests hold them, and nothing here runs Python code
     * that could change them), what each window gives back, and its changed columns. */
    Py_ssize_t num_changed = 0, num_cols = 0;
    for (Py_ssize_t j = 0, k = 0; j < m; j++) {
        rows_run_t *e = &run[j];
        const int64_t col = e->t / bs;
        if (!e->opens && !e->gives && !(e->fills && col < d.wd[e->s] - 1))
            continue; /* the last column's blocks are last_block's */
        e->req = PyList_GET_ITEM(by_slot, e->s);
        PyObject *table = PyObject_GetAttr(e->req, table_name);
        if (!table)
            goto done;
        e->capacity = table_columns(table, G, &e->table);
        Py_DECREF(table);
        if (e->capacity < 0) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "extend_rows: slot %zd's table is not an int32 [%zd, capacity] array",
                             e->s, G);
            goto done;
        }
        if (expand) {
            PyObject *heads = PyObject_GetAttr(e->req, heads_name);
            if (!heads)
                goto done;
            const Py_ssize_t columns = heads == Py_None ? -1 : table_columns(heads, R, &e->heads);
            Py_DECREF(heads);
            if (columns < 0 && PyErr_Occurred())
                goto done;
            if (columns != e->capacity) {
                PyErr_Format(PyExc_ValueError, "extend_rows: slot %zd's rows are not an int32 [%zd, %zd] array",
                             e->s, R, e->capacity);
                goto done;
            }
        }
        if (d.wd[e->s] > e->capacity) {
            PyErr_Format(PyExc_ValueError, "extend_rows: slot %zd's table is narrower than its width", e->s);
            goto done;
        }
        if (e->gives) {
            PyObject *recycled = PyObject_GetAttr(e->req, recycled_name);
            if (!recycled)
                goto done;
            const int ok = PyList_Check(recycled) && PyList_GET_SIZE(recycled) == W;
            int live = 0;
            e->lo = PY_SSIZE_T_MAX;
            e->hi = 0;
            for (Py_ssize_t w = 0; ok && w < W; w++) {
                const int64_t *pol = windows + 4 * w, sink = (pol[3] + bs - 1) / bs;
                const long long was = PyLong_AsLongLong(PyList_GET_ITEM(recycled, w));
                if (was == -1 && PyErr_Occurred()) {
                    Py_DECREF(recycled);
                    goto done;
                }
                int64_t stop = group_stop(pol, e->t, bs);
                stop = stop < d.wd[e->s] ? stop : d.wd[e->s];
                given_rec[k * W + w] = was;
                given_stop[k * W + w] = stop;
                for (int64_t c = was > sink ? was : sink; c < stop; c++) {
                    const int32_t blk = e->table[pol[0] * e->capacity + c];
                    if (blk == -1)
                        continue;
                    if (blk < 0 || blk >= p.n || p.ref[pol[0] * p.n + blk] < 1) {
                        Py_DECREF(recycled);
                        PyErr_Format(PyExc_AssertionError, "extend_rows: slot %zd gives back block %d of group "
                                     "%lld, which it does not hold", e->s, (int)blk, (long long)pol[0]);
                        goto done;
                    }
                    live = 1;
                }
                if (was < stop) {
                    e->lo = was < e->lo ? was : e->lo;
                    e->hi = stop > e->hi ? stop : e->hi;
                }
            }
            Py_DECREF(recycled);
            if (!ok) {
                PyErr_Format(PyExc_ValueError, "extend_rows: slot %zd's recycled is not a list of %zd ints", e->s, W);
                goto done;
            }
            /* 1 + its row in given_rec; a window with nothing to give keeps its marks (as _extend) */
            e->gives = live ? (int)(++k) : 0;
            if (live) {
                for (Py_ssize_t c = e->lo; c < e->hi; c++) {
                    for (Py_ssize_t w = 0; w < W; w++) {
                        if (given_rec[(k - 1) * W + w] <= c && c < given_stop[(k - 1) * W + w]) {
                            e->num_cols++;
                            break;
                        }
                    }
                }
            }
        }
        e->num_cols += e->opens;
        num_changed += e->num_cols > 0;
        num_cols += e->num_cols;
    }
    if (decode_hash_fills(&d) < 0)
        goto done;
    for (Py_ssize_t f = 0; f < num_fill; f++) { /* a block behind the table's last column: read now (-1: opened) */
        const rows_run_t *e = &run[fill[f]];
        const int64_t col = e->t / bs;
        for (Py_ssize_t g = 0; g < G; g++) {
            filled[f * G + g] = col == d.wd[e->s] - 1 ? d.lb[e->s * G + g]
                                : col < d.wd[e->s]      ? e->table[g * e->capacity + col]
                                                        : -1;
            if (col < d.wd[e->s] && filled[f * G + g] < 0)
                goto fallback; /* a hole where the token lands (not a table this manager wrote) */
        }
    }
    if (!keys_new_and_distinct(&x.t, d.hashes, num_fill))
        goto fallback; /* a repeated or indexed hash: the one-by-one path merges it */
    index_obj = PyBytes_FromStringAndSize(NULL, num_changed * (Py_ssize_t)sizeof(int32_t));
    offsets_obj = PyBytes_FromStringAndSize(NULL, (num_changed + 1) * (Py_ssize_t)sizeof(int32_t));
    cols_obj = PyBytes_FromStringAndSize(NULL, num_cols * (Py_ssize_t)sizeof(int32_t));
    vals_obj = PyBytes_FromStringAndSize(NULL, R * num_cols * (Py_ssize_t)sizeof(int32_t));
    widen = PyList_New(0);
    givers = PyList_New(0);
    removed = events ? PyList_New(0) : Py_NewRef(Py_None);
    stored = events ? PyList_New(0) : Py_NewRef(Py_None);
    if (!index_obj || !offsets_obj || !cols_obj || !vals_obj || !widen || !givers || !removed || !stored)
        goto done;
    int32_t *index_out = (int32_t *)PyBytes_AS_STRING(index_obj);
    int32_t *offsets_out = (int32_t *)PyBytes_AS_STRING(offsets_obj);
    int32_t *cols_out = (int32_t *)PyBytes_AS_STRING(cols_obj), *vals_out = (int32_t *)PyBytes_AS_STRING(vals_obj);
    offsets_out[0] = 0;

    /* Commit, request by request in batch order: what _extend does for each, in its order. */
    Py_ssize_t gone = 0, added = 0, changed_at = 0, col_at = 0;
    int64_t evicted_pairs = 0, given_pairs = 0;
    for (Py_ssize_t i = 0, j = 0, f = 0, offset = 0; i < n; offset += d.count[i], i++) {
        const Py_ssize_t s = d.slot[i];
        if (j >= m || run[j].i != i) {
            write_in_block(d.tl + s * bs, &d.nt[s], &d.ch[s], d.nt[s], d.count[i], d.tok + offset, bs);
            continue;
        }
        rows_run_t *e = &run[j++];
        const Py_ssize_t width = d.wd[s];
        if (e->gives) { /* dead window blocks back, tail first, group by group; their columns emptied */
            const int64_t *was = given_rec + (e->gives - 1) * W, *stop = given_stop + (e->gives - 1) * W;
            PyObject *recycled = PyObject_GetAttr(e->req, recycled_name);
            if (!recycled)
                goto fail;
            for (Py_ssize_t w = 0; w < W; w++) {
                const int64_t *pol = windows + 4 * w, sink = (pol[3] + bs - 1) / bs, g = pol[0];
                int32_t *row = e->table + g * e->capacity;
                for (int64_t c = stop[w] - 1; c >= (was[w] > sink ? was[w] : sink); c--) {
                    if (row[c] >= 0) {
                        pool_release_one(&p, g, row[c]);
                        given_pairs += group_size[g];
                    }
                }
                for (int64_t c = was[w]; c < stop[w]; c++) {
                    row[c] = -1;
                    if (e->heads)
                        for (Py_ssize_t r = 0; r < R; r++)
                            if (row_group[r] == g)
                                e->heads[r * e->capacity + c] = -1;
                }
                if (stop[w] > was[w]) {
                    PyObject *now = PyLong_FromLongLong(stop[w]);
                    if (!now || PyList_SetItem(recycled, w, now) < 0) {
                        Py_DECREF(recycled);
                        goto fail;
                    }
                }
            }
            int64_t next = INT64_MAX;
            for (Py_ssize_t w = 0; w < W; w++) {
                PyObject *item = PyList_GET_ITEM(recycled, w);
                const int64_t at = group_recycle_at(windows + 4 * w, PyLong_AsLongLong(item), bs);
                next = at < next ? at : next;
            }
            Py_DECREF(recycled);
            d.rec[s] = next; /* its cached view stays: a slice of the same table, which shows the columns emptied */
        }
        if (e->opens) { /* a block in every group, evictions leaving the index group by group */
            for (Py_ssize_t g = 0; g < G; g++) {
                int32_t ev;
                const Py_ssize_t took = pool_take(&p, g, 1, &fresh[g], &ev, 0);
                if (took < 0) {
                    if (took == -1) /* the room was checked: an owner bug */
                        PyErr_Format(PyExc_AssertionError, "extend_rows: group %zd ran out of blocks", g);
                    goto fail;
                }
                if (!took)
                    continue;
                evicted_pairs += group_size[g];
                if (events && (entry = x.entry_at[g * x.num_blocks + ev]) >= 0) {
                    PyObject *item = Py_BuildValue("nny#", i, g, (const char *)(x.hash_of + entry * KEY_BYTES),
                                                   (Py_ssize_t)KEY_BYTES);
                    if (!item || PyList_Append(removed, item) < 0) {
                        Py_XDECREF(item);
                        goto fail;
                    }
                    Py_DECREF(item);
                }
                gone += drop_evicted(&x, g, &ev, 1, b[31].buf, &num_spare, NULL);
            }
            if (width < e->capacity) {
                for (Py_ssize_t g = 0; g < G; g++)
                    e->table[g * e->capacity + width] = fresh[g];
                if (e->heads)
                    for (Py_ssize_t r = 0; r < R; r++)
                        e->heads[r * e->capacity + width] = fresh[row_group[r]];
            } else {
                PyObject *item = Py_BuildValue("nny#", changed_at, (Py_ssize_t)width, (const char *)fresh,
                                               G * (Py_ssize_t)sizeof(int32_t));
                if (!item || PyList_Append(widen, item) < 0) {
                    Py_XDECREF(item);
                    goto fail;
                }
                Py_DECREF(item);
            }
            if (record_opened(e->req) < 0)
                goto fail;
            memcpy(d.lb + s * G, fresh, (size_t)G * sizeof(int32_t));
            d.wd[s] = (int32_t)(width + 1);
        }
        write_run_token(d.tl + s * bs, &d.nt[s], &d.ch[s], e->t, d.tok[offset], bs, e->opens || e->gives);
        if (e->fills) { /* its filled block, in every group, indexed and cached */
            int32_t *blocks = filled + f * G;
            if (blocks[0] < 0)
                memcpy(blocks, fresh, (size_t)G * sizeof(int32_t));
            int64_t entry_id;
            const Py_ssize_t in = insert_and_cache(&x, &p, d.hashes + f * KEY_BYTES, 1, blocks, &entry_id,
                                                   b[31].buf, &num_spare, &num_entries);
            if (in < 0)
                goto fail;
            added += in;
            memcpy(d.lh + s * KEY_BYTES, d.hashes + f * KEY_BYTES, KEY_BYTES);
            if (events) {
                PyObject *item = stored_item(&d, f, i, e->t / bs);
                if (!item || PyList_Append(stored, item) < 0) {
                    Py_XDECREF(item);
                    goto fail;
                }
                Py_DECREF(item);
            }
            f++;
        }
        d.lim[s] = refreshed_limit(d.nt[s], d.wd[s], bs, hashing >= 0);
        if (!e->num_cols)
            continue;
        /* Its changed columns (given ones ascending, then the opened one) and their values in every row now. */
        const Py_ssize_t first = col_at;
        if (e->gives) {
            const int64_t *was = given_rec + (e->gives - 1) * W, *stop = given_stop + (e->gives - 1) * W;
            for (Py_ssize_t c = e->lo; c < e->hi; c++) {
                for (Py_ssize_t w = 0; w < W; w++) {
                    if (was[w] <= c && c < stop[w]) {
                        cols_out[col_at++] = (int32_t)c;
                        break;
                    }
                }
            }
        }
        if (e->opens)
            cols_out[col_at++] = (int32_t)width;
        for (Py_ssize_t q = first; q < col_at; q++) {
            const int opened = e->opens && q == col_at - 1;
            for (Py_ssize_t r = 0; r < R; r++) {
                const Py_ssize_t g = row_group[r];
                vals_out[r * num_cols + q] = opened ? fresh[g] : e->table[g * e->capacity + cols_out[q]];
            }
        }
        if (e->gives) { /* given columns in one span and nothing opened: a range; else the caller's slice */
            if (!e->opens && col_at - first == e->hi - e->lo) {
                PyObject *span = PyObject_CallFunction((PyObject *)&PyRange_Type, "nn", e->lo, e->hi);
                const int failed = !span || PyObject_SetAttr(e->req, changed_name, span) < 0;
                Py_XDECREF(span);
                if (failed)
                    goto fail;
            } else if (append_position(givers, changed_at) < 0) {
                goto fail;
            }
        }
        index_out[changed_at] = (int32_t)i;
        offsets_out[++changed_at] = (int32_t)col_at;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        d.lens[i] = d.wd[d.slot[i]];
    counted[0] += evicted_pairs;
    counted[1] += given_pairs;
    result = Py_BuildValue("OOOOOOnnnnOO", index_obj, offsets_obj, cols_obj, vals_obj, widen, givers, num_spare,
                           num_entries, gone, added, removed, stored);
    goto done;
fallback:
    result = Py_NewRef(Py_None);
    goto done;
fail: /* only a failed allocation, attribute write or an owner bug gets here, after the checks */
    Py_CLEAR(result);
done:
    Py_XDECREF(index_obj);
    Py_XDECREF(offsets_obj);
    Py_XDECREF(cols_obj);
    Py_XDECREF(vals_obj);
    Py_XDECREF(widen);
    Py_XDECREF(givers);
    Py_XDECREF(removed);
    Py_XDECREF(stored);
    PyMem_Free(fill);
    PyMem_Free(run);
    PyMem_Free(group_size);
    PyMem_Free(given_rec);
    PyMem_Free(given_stop);
    PyMem_Free(filled);
    PyMem_Free(fresh);
    decode_close(&d);
    release_buffers(b, NB);
    return result;
}

PyDoc_STRVAR(admit_commit_doc,
"admit_commit(ref, cached, stack, top, ring, lru_pos, head, tail_pos, lru_count,\n"
"             slots, seed, hash_of, entry_blocks, entry_at, holders, spare, num_spare, num_entries,\n"
"             hashes, hit, tokens, covered, table, slot, ntok, changed_ok, last_block, tail, last_hash,\n"
"             fast_limit, next_recycle, width, root, recycle_at, evicted, removed=None)\n"
"    -> (num_spare, num_entries, keys_added, keys_removed)\n"
"             | None | False\n\n"
"KVCacheManager.admit's commit in one pass, for a manager with prefix caching and without events or a tier;\n"
"pool and index rows are its groups (G). The request covers ``covered`` tokens in n = ceil(covered /\n"
"block_size) blocks per group: the h blocks of its cached prefix (``hit``, int32 [G, h], -1 where a window\n"
"group does not need one; each other gains a reference, a cached free one leaving the LRU ring as\n"
"BlockPool.incref revives it), then n - h new ones per group (BlockPool.allocate(n - h, ascending=True));\n"
"they fill table[:, :n] (int32 [G, capacity]) and -1 the rest. Evicted blocks leave the index\n"
"(PrefixIndex.remove_gone) and are counted per group in ``evicted`` (intp [G]); the hashes of full blocks\n"
"h .. k - 1 (k = covered // block_size; ``hashes`` packs blocks 0 .. k - 1, 32 bytes each) enter it under\n"
"entry ids from the spare stack, then new ones (PrefixIndex.insert_new) and are marked cached; the slot\n"
"arrays of ``slot`` are set as admit leaves them (next_recycle = ``recycle_at``). The caller made room:\n"
"``spare`` for num_spare + G n ids, the entry arrays for num_entries + k, the table for k more keys.\n"
"Returns None, changing nothing, when a group has too few allocatable blocks; False, changing nothing, when\n"
"a new block's hash is in the index already (the general path merges it). ValueError on inconsistent sizes\n"
"and AssertionError on a hit block with no reference that is not cached, both changing nothing. ``removed``\n"
"(a writable buffer of G n * 32 bytes, for KV events) receives the keys_removed hashes the evictions dropped\n"
"from the index, in PrefixIndex.remove_gone's order.");

static PyObject *admit_commit(PyObject *self, PyObject *args)
{
    (void)self;
    enum { NB = POOL_ARRAYS + 22 };
    Py_buffer b[NB];
    memset(b, 0, sizeof b);
    unsigned long long seed;
    Py_ssize_t num_spare, num_entries, covered, slot;
    long long recycle_at;
    /* b[0..8] the pool; b[9] slots, b[10] hash_of, b[11] entry_blocks, b[12] entry_at, b[13] holders, b[14] spare;
     * b[15] hashes, b[16] hit, b[17] tokens, b[18] table; b[19..26] ntok, changed_ok, last_block, tail, last_hash,
     * fast_limit, next_recycle, width; b[27] root; b[28] evicted; b[29] removed (optional). */
    PyObject *removed_obj = Py_None;
    if (!PyArg_ParseTuple(args, "O&O&O&O&O&O&O&O&O&O&KO&O&O&O&O&nnO&O&O&nO&nO&O&O&O&O&O&O&O&O&LO&|O", write_array,
                          &b[0], write_array, &b[1], write_array, &b[2], write_array, &b[3], write_array, &b[4],
                          write_array, &b[5], write_array, &b[6], write_array, &b[7], write_array, &b[8], write_array,
                          &b[9], &seed, write_array, &b[10], write_array, &b[11], write_array, &b[12], write_array,
                          &b[13], write_array, &b[14], &num_spare, &num_entries, read_array, &b[15], read_array,
                          &b[16], read_array, &b[17], &covered, write_array, &b[18], &slot, write_array, &b[19],
                          write_array, &b[20], write_array, &b[21], write_array, &b[22], write_array, &b[23],
                          write_array, &b[24], write_array, &b[25], write_array, &b[26], read_array, &b[27],
                          &recycle_at, write_array, &b[28], &removed_obj))
        return NULL;
    if (removed_obj != Py_None && PyObject_GetBuffer(removed_obj, &b[29], PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        release_buffers(b, NB);
        return NULL;
    }
    uint8_t *removed_at = removed_obj != Py_None ? b[29].buf : NULL;
    Py_ssize_t num_removed = 0;
    PyObject *result = NULL;
    int64_t *entries = NULL;
    int32_t *evicted = NULL, *fresh_blocks = NULL;
    Py_ssize_t *revived = NULL, *lowest = NULL, *highest = NULL;
    pool_t p;
    index_t x;
    if (open_store(&p, &x, b, seed, "admit_commit") < 0)
        goto done;
    const Py_ssize_t G = p.rows, slots_len = b[19].len / (Py_ssize_t)sizeof(int64_t);
    const Py_ssize_t bs = slots_len ? b[22].len / (Py_ssize_t)sizeof(uint32_t) / slots_len : 0;
    const Py_ssize_t capacity = b[18].len / (Py_ssize_t)sizeof(int32_t) / G;
    const Py_ssize_t n = bs ? (covered + bs - 1) / bs : 0, k = bs ? covered / bs : 0;
    const Py_ssize_t h = b[16].len / (Py_ssize_t)sizeof(int32_t) / G;
    const Py_ssize_t spare_cap = b[14].len / (Py_ssize_t)sizeof(Py_ssize_t);
    if (x.rows != G || p.n != x.num_blocks || bs < 1 || covered < 1 || b[16].len != G * h * 4 || h >= n || h > k
        || covered > b[17].len / (Py_ssize_t)sizeof(uint32_t) || b[15].len != k * KEY_BYTES
        || b[18].len != G * capacity * 4 || n > capacity || slot < 0 || slot >= slots_len || b[20].len != slots_len
        || b[21].len != slots_len * G * (Py_ssize_t)sizeof(int32_t)
        || b[22].len != slots_len * bs * (Py_ssize_t)sizeof(uint32_t) || b[23].len != slots_len * KEY_BYTES
        || b[24].len != b[19].len || b[25].len != b[19].len || b[26].len != slots_len * (Py_ssize_t)sizeof(int32_t)
        || b[27].len != KEY_BYTES || b[28].len != G * (Py_ssize_t)sizeof(Py_ssize_t) || num_spare < 0
        || num_spare + G * n > spare_cap || num_entries < 0 || num_entries + k > x.entries
        || (removed_at && b[29].len < G * n * KEY_BYTES)) {
        PyErr_SetString(PyExc_ValueError, "admit_commit: the pool, index, table or slot arrays have inconsistent sizes");
        goto done;
    }
    revived = PyMem_Calloc((size_t)G, sizeof *revived);
    lowest = PyMem_Calloc((size_t)G, sizeof *lowest);
    highest = PyMem_Calloc((size_t)G, sizeof *highest);
    entries = PyMem_Malloc((size_t)(k ? k : 1) * sizeof(int64_t));
    evicted = PyMem_Malloc((size_t)n * sizeof(int32_t));
    const Py_ssize_t fresh_count = (k - h) * G;
    fresh_blocks = PyMem_Malloc((size_t)(fresh_count > 0 ? fresh_count : 1) * sizeof(int32_t));
    if (!revived || !lowest || !highest || !entries || !evicted || !fresh_blocks) {
        PyErr_NoMemory();
        goto done;
    }
    /* The hit's blocks: each referenced, or cached free (live in the LRU ring) and revived. */
    const int32_t *hit = b[16].buf;
    for (Py_ssize_t r = 0; r < G; r++) {
        lowest[r] = PY_SSIZE_T_MAX;
        highest[r] = -1;
        for (Py_ssize_t i = 0; i < h; i++) {
            const int32_t blk = hit[r * h + i];
            if (blk == -1)
                continue;
            if (blk < 0 || blk >= p.n) {
                PyErr_Format(PyExc_AssertionError, "admit_commit: hit block %d is not in [0, %zd)", (int)blk, p.n);
                goto done;
            }
            if (p.ref[r * p.n + blk] > 0)
                continue;
            const Py_ssize_t g = p.lru_pos[r * p.n + blk];
            if (g < 0) {
                PyErr_Format(PyExc_AssertionError, "incref of a free uncached block: (row %zd, block %d)", r, (int)blk);
                goto done;
            }
            revived[r]++;
            lowest[r] = g < lowest[r] ? g : lowest[r];
            highest[r] = g > highest[r] ? g : highest[r];
        }
        if (n - h > p.top[r] + p.lru_count[r] - revived[r]) {
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    const uint8_t *keys = b[15].buf;
    for (Py_ssize_t i = h; i < k; i++) { /* a known hash: the general path merges it */
        if (x.t.slots[probe(&x.t, keys + i * KEY_BYTES, tag_of(&x.t, keys + i * KEY_BYTES))].entry >= 0) {
            result = Py_NewRef(Py_False);
            goto done;
        }
    }
    /* Nothing below fails (but an owner bug's AssertionError from pool_take, before it changes its row). The
     * hit first (BlockPool.incref): a row's revived entries leave its ring, which gives back its newest slots
     * when they are exactly those, so that later evictions do not scan them. */
    int32_t *table = b[18].buf;
    Py_ssize_t *spare = b[14].buf, *evicted_of = b[28].buf, keys_added = 0;
    for (Py_ssize_t r = 0; r < G; r++) {
        int32_t *row = table + r * capacity;
        const int32_t *mine = hit + r * h;
        if (revived[r]) {
            for (Py_ssize_t i = 0; i < h; i++)
                if (mine[i] >= 0 && p.ref[r * p.n + mine[i]] == 0)
                    p.lru_pos[r * p.n + mine[i]] = -1;
            p.lru_count[r] -= revived[r];
            if (highest[r] == r * p.cap + ((p.tail[r] - 1) & (p.cap - 1)) && highest[r] - lowest[r] == revived[r] - 1)
                p.tail[r] -= revived[r];
        }
        for (Py_ssize_t i = 0; i < h; i++) {
            if (mine[i] >= 0)
                p.ref[r * p.n + mine[i]]++;
            row[i] = mine[i];
        }
        const Py_ssize_t num_evicted = pool_take(&p, r, n - h, row + h, evicted, 1);
        if (num_evicted < 0) /* -1 cannot happen after the room check; -2: AssertionError set */
            goto done;
        evicted_of[r] = num_evicted;
        const Py_ssize_t dropped = drop_evicted(&x, r, evicted, num_evicted, spare, &num_spare,
                                                removed_at ? removed_at + num_removed * KEY_BYTES : NULL);
        keys_added -= dropped;
        num_removed += dropped;
        for (Py_ssize_t i = n; i < capacity; i++)
            row[i] = -1;
        for (Py_ssize_t i = h; i < k; i++)
            fresh_blocks[(i - h) * G + r] = row[i];
    }
    const Py_ssize_t inserted = insert_and_cache(&x, &p, keys + h * KEY_BYTES, k - h, fresh_blocks, entries, spare,
                                                 &num_spare, &num_entries);
    if (inserted < 0) /* a pool and index that disagree (an owner bug): AssertionError set */
        goto done;
    keys_added += inserted;
    ((int64_t *)b[19].buf)[slot] = covered;
    ((uint8_t *)b[20].buf)[slot] = 1;
    for (Py_ssize_t r = 0; r < G; r++)
        ((int32_t *)b[21].buf)[slot * G + r] = table[r * capacity + n - 1];
    const Py_ssize_t partial = covered % bs;
    memcpy((uint32_t *)b[22].buf + slot * bs, (const uint32_t *)b[17].buf + covered - partial,
           (size_t)partial * sizeof(uint32_t));
    memcpy((uint8_t *)b[23].buf + slot * KEY_BYTES, k ? keys + (k - 1) * KEY_BYTES : (const uint8_t *)b[27].buf,
           KEY_BYTES);
    const int64_t limit = (int64_t)(covered / bs + 1) * bs - 1;
    ((int64_t *)b[24].buf)[slot] = n * bs < limit ? n * bs : limit;
    ((int64_t *)b[25].buf)[slot] = recycle_at;
    ((int32_t *)b[26].buf)[slot] = (int32_t)n;
    result = Py_BuildValue("nnnn", num_spare, num_entries, keys_added, num_removed);
done:
    PyMem_Free(entries);
    PyMem_Free(evicted);
    PyMem_Free(fresh_blocks);
    PyMem_Free(revived);
    PyMem_Free(lowest);
    PyMem_Free(highest);
    release_buffers(b, NB); /* zeroed ones (not parsed) have no object: skipped */
    return result;
}

static PyMethodDef run_collector_methods[] = {
    {"extend", (PyCFunction)(void (*)(void))run_extend, METH_FASTCALL | METH_KEYWORDS, run_extend_doc},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef run_collector_members[] = {
    {"_run_reqs", T_OBJECT_EX, offsetof(RunCollector, run_reqs), 0, "request ids of the run of plain extends"},
    {"_run_tokens", T_OBJECT_EX, offsetof(RunCollector, run_tokens), 0, "token arrays of the run of plain extends"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject RunCollectorType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvcache.allocator._tables.RunCollector",
    .tp_basicsize = sizeof(RunCollector),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("Base of kvcache.client.Batch: collects a step's plain extends in C (see extend)."),
    .tp_new = run_collector_new,
    .tp_dealloc = (destructor)run_collector_dealloc,
    .tp_traverse = (traverseproc)run_collector_traverse,
    .tp_clear = (inquiry)run_collector_clear,
    .tp_methods = run_collector_methods,
    .tp_members = run_collector_members,
};

static PyMethodDef methods[] = {
    {"admit_commit", admit_commit, METH_VARARGS, admit_commit_doc},
    {"bounds", bounds, METH_O, bounds_doc},
    {"extend_decode", extend_decode, METH_VARARGS, extend_decode_doc},
    {"extend_fast", extend_fast, METH_VARARGS, extend_fast_doc},
    {"extend_rows", extend_rows, METH_VARARGS, extend_rows_doc},
    {"join_runs", join_runs, METH_VARARGS, join_runs_doc},
    {"token_array", token_array, METH_O, token_array_doc},
    {"clear_columns", clear_columns, METH_VARARGS, clear_columns_doc},
    {"drop_gone", drop_gone, METH_VARARGS, drop_gone_doc},
    {"token_list", token_list, METH_O, token_list_doc},
    {"reads_array_heads", reads_array_heads, METH_NOARGS, reads_array_heads_doc},
    {"lookup_ids", lookup_ids, METH_VARARGS, lookup_ids_doc},
    {"mirror_step", mirror_step, METH_VARARGS, mirror_step_doc},
    {"set_columns", set_columns, METH_VARARGS, set_columns_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tables", "Per-request block-table writes of a whole decode step.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__tables(void)
{
    if (!extend_slow_name && !(extend_slow_name = PyUnicode_InternFromString("_extend_slow")))
        return NULL;
    if (!as_tokens_name && !(as_tokens_name = PyUnicode_InternFromString("_as_tokens")))
        return NULL;
    if ((!num_blocks_name && !(num_blocks_name = PyUnicode_InternFromString("num_blocks")))
        || (!changed_name && !(changed_name = PyUnicode_InternFromString("changed")))
        || (!view_name && !(view_name = PyUnicode_InternFromString("view")))
        || (!table_name && !(table_name = PyUnicode_InternFromString("table")))
        || (!heads_name && !(heads_name = PyUnicode_InternFromString("heads")))
        || (!recycled_name && !(recycled_name = PyUnicode_InternFromString("recycled"))))
        return NULL;
    if (PyType_Ready(&RunCollectorType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&RunCollectorType);
    if (PyModule_AddObject(m, "RunCollector", (PyObject *)&RunCollectorType) < 0) {
        Py_DECREF(&RunCollectorType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

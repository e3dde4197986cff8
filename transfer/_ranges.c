/* The byte ranges of a block-to-block KV copy, built and merged in one pass (kvcache.transfer._ranges).
 *
 * A request's transfer is units (a layer's tensor) x block pairs: unit u, pair i copies length[u]
 * bytes from src_base[u] + src_blocks[i] * src_stride[u] + heads[i] * unit[u] to the same on the
 * destination side. numpy builds the [units, pairs] grid and merges it in a dozen passes whose
 * fixed costs (a few microseconds each) dominate at these sizes; here it is one loop. Ranges come
 * in (unit, pair) order; a range joins the previous one when both sides continue it and both lie
 * in the same group of `group` units (a layer's tensors), so each group's ranges can be posted on
 * their own. Addresses are the caller's checked region addresses; nothing is dereferenced.
 *
 * stage_plan lays a group of layers' GPU<->host ranges out in slot-sized pieces for a staged copy
 * (kvcache.transfer.staged): the same plan as the numpy reference there, in two passes over the ranges.
 *
 * copy_pairs checks, filters and orders a copy's block pairs (kvcache.transfer.regions' numpy checks
 * name what is wrong when it refuses); host_runs counts the runs a copy's host side forms; slot_table
 * places a staged plan in the ring of slots and writes the copy kernel's table.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

typedef struct {
    Py_buffer view;
    const int64_t *data;
    Py_ssize_t count;
} int64s;

static int get_int64s(PyObject *obj, const char *name, int writable, int64s *out)
{
    if (PyObject_GetBuffer(obj, &out->view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) != 0) {
        return -1;
    }
    if (out->view.len % (Py_ssize_t)sizeof(int64_t) != 0) {
        PyErr_Format(PyExc_ValueError, "%s must be an int64 array, got %zd bytes", name, out->view.len);
        PyBuffer_Release(&out->view);
        return -1;
    }
    out->data = (const int64_t *)out->view.buf;
    out->count = out->view.len / (Py_ssize_t)sizeof(int64_t);
    return 0;
}

PyDoc_STRVAR(pair_ranges_doc,
             "pair_ranges(src_base, src_stride, dst_base, dst_stride, unit, length, src_blocks, dst_blocks, heads,\n"
             "            group, out_src, out_dst, out_len, out_starts) -> int\n\n"
             "Write the merged ranges of units x pairs into out_src/out_dst/out_len (room for units * pairs each)\n"
             "and, in out_starts (units / group + 1), where each group's ranges begin; returns how many ranges.\n"
             "All arrays int64; the first six have one entry per unit, the next three one per pair.");

static PyObject *pair_ranges(PyObject *self, PyObject *args)
{
    (void)self;
    enum { N_IN = 9, N_OUT = 4 };
    PyObject *objs[N_IN + N_OUT];
    Py_ssize_t group;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOnOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          &objs[6], &objs[7], &objs[8], &group, &objs[9], &objs[10], &objs[11], &objs[12])) {
        return NULL;
    }
    static const char *names[N_IN + N_OUT] = {"src_base", "src_stride", "dst_base", "dst_stride", "unit",
                                              "length", "src_blocks", "dst_blocks", "heads", "out_src",
                                              "out_dst", "out_len", "out_starts"};
    int64s a[N_IN + N_OUT];
    int got = 0;
    PyObject *result = NULL;
    for (; got < N_IN + N_OUT; got++) {
        if (get_int64s(objs[got], names[got], got >= N_IN, &a[got]) != 0) {
            goto done;
        }
    }
    Py_ssize_t units = a[0].count, pairs = a[6].count;
    for (int k = 1; k < 6; k++) {
        if (a[k].count != units) {
            PyErr_Format(PyExc_ValueError, "%s has %zd entries, src_base %zd", names[k], a[k].count, units);
            goto done;
        }
    }
    if (a[7].count != pairs || a[8].count != pairs) {
        PyErr_Format(PyExc_ValueError, "src_blocks, dst_blocks and heads must have one size, got %zd, %zd, %zd",
                     pairs, a[7].count, a[8].count);
        goto done;
    }
    if (group < 1 || units % group != 0) {
        PyErr_Format(PyExc_ValueError, "group must divide the %zd units, got %zd", units, group);
        goto done;
    }
    if (a[9].count < units * pairs || a[10].count < units * pairs || a[11].count < units * pairs ||
        a[12].count < units / group + 1) {
        PyErr_SetString(PyExc_ValueError, "an output array is too small");
        goto done;
    }
    const int64_t *sbase = a[0].data, *sstride = a[1].data, *dbase = a[2].data, *dstride = a[3].data;
    const int64_t *unit = a[4].data, *length = a[5].data, *sb = a[6].data, *db = a[7].data, *head = a[8].data;
    int64_t *os = (int64_t *)a[9].data, *od = (int64_t *)a[10].data, *ol = (int64_t *)a[11].data;
    int64_t *starts = (int64_t *)a[12].data;
    Py_ssize_t n = 0;
    for (Py_ssize_t u = 0; u < units; u++) {
        int fresh = u % group == 0; /* a new group: never joined to the previous one */
        if (fresh) {
            starts[u / group] = n;
        }
        for (Py_ssize_t i = 0; i < pairs; i++) {
            int64_t s = sbase[u] + sb[i] * sstride[u] + head[i] * unit[u];
            int64_t d = dbase[u] + db[i] * dstride[u] + head[i] * unit[u];
            if (!fresh && n > 0 && os[n - 1] + ol[n - 1] == s && od[n - 1] + ol[n - 1] == d) {
                ol[n - 1] += length[u];
            } else {
                os[n] = s;
                od[n] = d;
                ol[n] = length[u];
                n++;
            }
            fresh = 0;
        }
    }
    starts[units / group] = n;
    result = PyLong_FromSsize_t(n);
done:
    for (int k = 0; k < got; k++) {
        PyBuffer_Release(&a[k].view);
    }
    return result;
}

/* ------------------------------------------------------------------ stage_plan */

PyDoc_STRVAR(chunked_doc,
             "chunked(length, chunk) -> int\n\n"
             "How many ranges ``length`` becomes once each is cut into pieces of at most ``chunk`` bytes (a range\n"
             "of 0 bytes stays one): the room stage_plan's outputs need.");

static PyObject *chunked(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *obj;
    long long chunk;
    if (!PyArg_ParseTuple(args, "OL", &obj, &chunk)) {
        return NULL;
    }
    if (chunk < 1) {
        PyErr_Format(PyExc_ValueError, "chunk must be at least 1, got %lld", chunk);
        return NULL;
    }
    int64s len;
    if (get_int64s(obj, "length", 0, &len) != 0) {
        return NULL;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < len.count; i++) {
        total += len.data[i] <= chunk ? 1 : (len.data[i] + chunk - 1) / chunk;
    }
    PyBuffer_Release(&len.view);
    return PyLong_FromSsize_t(total);
}

/* Stable merge sort of idx[0..n) by key[idx[i]], tmp of n entries as scratch. */
static void sort_by_key(int64_t *idx, int64_t *tmp, Py_ssize_t n, const int64_t *key)
{
    for (Py_ssize_t width = 1; width < n; width *= 2) {
        for (Py_ssize_t lo = 0; lo < n; lo += 2 * width) {
            Py_ssize_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            Py_ssize_t a = lo, b = mid, k = lo;
            while (a < mid && b < hi) {
                tmp[k++] = key[idx[b]] < key[idx[a]] ? idx[b++] : idx[a++];
            }
            while (a < mid) {
                tmp[k++] = idx[a++];
            }
            while (b < hi) {
                tmp[k++] = idx[b++];
            }
        }
        memcpy(idx, tmp, (size_t)n * sizeof(int64_t));
    }
}

PyDoc_STRVAR(stage_plan_doc,
             "stage_plan(gpu, host, length, cuts, to_host, slot, chunk, out_gpu, out_offset, out_length, out_piece,\n"
             "           out_piece_starts, out_layer_end, out_dma_host, out_dma_offset, out_dma_length, out_dma_piece,\n"
             "           out_dma_starts) -> (ranges, pieces, dmas)\n\n"
             "Lay out ranges (layer l's are [cuts[l], cuts[l + 1])) in pieces of ``slot`` bytes, ranges longer than\n"
             "``chunk`` cut first. Mirrored where every layer's host side is one span (an offload's ranges tile it,\n"
             "a load's cover at least 4/5 of it): a range sits at its host offset within its window of the span,\n"
             "one DMA a window. Else each layer's ranges sorted by host address (stably) and packed, one DMA per\n"
             "host run within a piece. Per range (room: chunked(length, chunk) + 1): gpu address, offset in its\n"
             "piece's slot, length, piece, in piece order; per piece: piece_starts (pieces + 1), dma_starts\n"
             "(pieces + 1); per DMA: host address, slot offset, length, piece; per layer: layer_end (its pieces\n"
             "end there). All arrays int64.");

/* x / d for x >= 0, a shift where d is 2 ** shift */
#define DIV(x, d, shift) ((shift) >= 0 ? (x) >> (shift) : (x) / (d))

enum { SP_GPU, SP_OFFSET, SP_LENGTH, SP_PIECE, SP_PIECE_STARTS, SP_LAYER_END, SP_DMA_HOST, SP_DMA_OFFSET,
       SP_DMA_LENGTH, SP_DMA_PIECE, SP_DMA_STARTS, SP_OUTS };

static PyObject *stage_plan(PyObject *self, PyObject *args)
{
    (void)self;
    enum { N_IN = 4 };
    PyObject *objs[N_IN + SP_OUTS];
    int to_host;
    long long slot, chunk;
    if (!PyArg_ParseTuple(args, "OOOOpLLOOOOOOOOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &to_host, &slot,
                          &chunk, &objs[4], &objs[5], &objs[6], &objs[7], &objs[8], &objs[9], &objs[10], &objs[11],
                          &objs[12], &objs[13], &objs[14])) {
        return NULL;
    }
    static const char *names[N_IN + SP_OUTS] = {"gpu", "host", "length", "cuts", "out_gpu", "out_offset",
                                                "out_length", "out_piece", "out_piece_starts", "out_layer_end",
                                                "out_dma_host", "out_dma_offset", "out_dma_length", "out_dma_piece",
                                                "out_dma_starts"};
    int64s a[N_IN + SP_OUTS];
    int got = 0;
    PyObject *result = NULL;
    int64_t *mem = NULL;
    for (; got < N_IN + SP_OUTS; got++) {
        if (get_int64s(objs[got], names[got], got >= N_IN, &a[got]) != 0) {
            goto done;
        }
    }
    if (chunk < 1 || 5 * chunk > 4 * slot) { /* then no layer has more pieces than ranges */
        PyErr_Format(PyExc_ValueError, "need 1 <= chunk <= 4/5 of slot, got chunk %lld, slot %lld", chunk, slot);
        goto done;
    }
    Py_ssize_t n_in = a[0].count, layers = a[3].count - 1;
    const int64_t *gpu_in = a[0].data, *host_in = a[1].data, *len_in = a[2].data, *cuts = a[3].data;
    if (a[1].count != n_in || a[2].count != n_in) {
        PyErr_SetString(PyExc_ValueError, "gpu, host and length must have one size");
        goto done;
    }
    if (layers < 0 || cuts[0] != 0 || cuts[layers] != n_in) {
        PyErr_Format(PyExc_ValueError, "cuts must run from 0 to the %zd ranges", n_in);
        goto done;
    }
    for (Py_ssize_t l = 0; l < layers; l++) {
        if (cuts[l + 1] < cuts[l]) {
            PyErr_SetString(PyExc_ValueError, "cuts must not decrease");
            goto done;
        }
    }
    /* slots and chunks are powers of two in practice: shifts, not divisions (which cost most of a pass) */
    int slot_shift = (slot & (slot - 1)) == 0 ? __builtin_ctzll((unsigned long long)slot) : -1;
    int chunk_shift = (chunk & (chunk - 1)) == 0 ? __builtin_ctzll((unsigned long long)chunk) : -1;
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < n_in; i++) {
        if (len_in[i] < 1) {
            PyErr_Format(PyExc_ValueError, "length: range %zd has %lld bytes", i, (long long)len_in[i]);
            goto done;
        }
        n += len_in[i] <= chunk ? 1 : DIV(len_in[i] + chunk - 1, chunk, chunk_shift);
    }
    for (int k = SP_GPU; k < SP_OUTS; k++) {
        Py_ssize_t need = k == SP_LAYER_END ? layers : (k == SP_PIECE_STARTS || k == SP_DMA_STARTS) ? n + 1 : n;
        if (a[N_IN + k].count < need) {
            PyErr_Format(PyExc_ValueError, "%s has room for %zd, needs %zd", names[N_IN + k], a[N_IN + k].count,
                         need);
            goto done;
        }
    }
    int64_t *o[SP_OUTS];
    for (int k = 0; k < SP_OUTS; k++) {
        o[k] = (int64_t *)a[N_IN + k].data;
    }
    /* scratch: piece, order, tmp; per layer ecuts (where its chunked ranges end), lo, hi, base; the chunked
     * gpu, host, length when a range was cut (else the inputs serve) */
    int cut = n != n_in;
    mem = PyMem_Malloc(sizeof(int64_t) * (size_t)((cut ? 6 : 3) * n + 4 * (layers + 1) + 2));
    if (mem == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *piece = mem, *order = piece + n, *tmp = order + n;
    int64_t *ecuts = tmp + n, *lo = ecuts + layers + 1, *hi = lo + layers + 1, *base = hi + layers + 1;
    int64_t *cg = base + layers + 1, *ch = cg + n, *cl = ch + n;
    const int64_t *g = cut ? cg : gpu_in, *h = cut ? ch : host_in, *ln = cut ? cl : len_in;
    Py_ssize_t m = 0;
    int mirrored = 1;
    ecuts[0] = 0;
    for (Py_ssize_t l = 0; l < layers; l++) {
        int64_t lmin = 0, lmax = 0, total = 0;
        for (int64_t i = cuts[l]; i < cuts[l + 1]; i++) {
            for (int64_t done_bytes = 0; cut && done_bytes < len_in[i]; done_bytes += chunk) {
                cg[m] = gpu_in[i] + done_bytes;
                ch[m] = host_in[i] + done_bytes;
                cl[m] = len_in[i] - done_bytes < chunk ? len_in[i] - done_bytes : chunk;
                m++;
            }
            int64_t end = host_in[i] + len_in[i];
            if (i == cuts[l] || host_in[i] < lmin) {
                lmin = host_in[i];
            }
            if (i == cuts[l] || end > lmax) {
                lmax = end;
            }
            total += len_in[i];
        }
        if (!cut) {
            m = cuts[l + 1];
        }
        ecuts[l + 1] = m;
        lo[l] = lmin;
        hi[l] = lmax;
        int64_t span = lmax - lmin;
        if (to_host ? span != total : 4 * span > 5 * total) {
            mirrored = 0;
        }
    }
    Py_ssize_t pieces = 0, dmas = 0;
    if (mirrored) {
        /* windows of each layer's span; each range's piece is its host offset's window */
        base[0] = 0;
        for (Py_ssize_t l = 0; l < layers; l++) {
            base[l + 1] = base[l] + DIV(hi[l] - lo[l] + slot - 1, slot, slot_shift);
        }
        pieces = base[layers];
        int64_t *over = o[SP_DMA_OFFSET]; /* what ranges starting in a window carry past its end: dma_offset later */
        int64_t *count = o[SP_PIECE_STARTS];
        memset(over, 0, sizeof(int64_t) * (size_t)pieces);
        memset(count, 0, sizeof(int64_t) * (size_t)(pieces + 1));
        for (Py_ssize_t l = 0; l < layers; l++) {
            for (int64_t i = ecuts[l]; i < ecuts[l + 1]; i++) {
                int64_t rel = h[i] - lo[l], local = DIV(rel, slot, slot_shift), p = base[l] + local;
                int64_t past = rel + ln[i] - (local + 1) * slot;
                piece[i] = p;
                if (past > over[p]) {
                    over[p] = past;
                }
                count[p + 1]++;
            }
        }
        for (Py_ssize_t p = 0; p < pieces; p++) {
            count[p + 1] += count[p];
        }
        /* DMAs: one per window; an offload's starts after what the previous window's DMA carried over */
        for (Py_ssize_t l = 0; l < layers; l++) {
            for (int64_t p = base[l]; p < base[l + 1]; p++) {
                int64_t start = lo[l] + (p - base[l]) * slot;
                int64_t head = to_host && p > base[l] ? over[p - 1] : 0;
                int64_t end = start + slot + over[p];
                o[SP_DMA_HOST][p] = start + head;
                o[SP_DMA_LENGTH][p] = (end < hi[l] ? end : hi[l]) - (start + head);
                o[SP_DMA_PIECE][p] = p;
                o[SP_DMA_STARTS][p] = p;
                tmp[p] = start; /* the window's host start */
            }
        }
        o[SP_DMA_STARTS][pieces] = pieces;
        /* ranges in piece order (a stable counting sort), at their host offsets within their windows */
        for (Py_ssize_t p = 0; p < pieces; p++) {
            order[p] = count[p];
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t at = order[piece[i]]++;
            o[SP_GPU][at] = g[i];
            o[SP_LENGTH][at] = ln[i];
            o[SP_PIECE][at] = piece[i];
            o[SP_OFFSET][at] = h[i] - tmp[piece[i]];
        }
        /* over[] lived in dma_offset: now the heads */
        for (Py_ssize_t l = 0; l < layers; l++) {
            for (int64_t p = base[l + 1] - 1; p >= base[l]; p--) {
                over[p] = to_host && p > base[l] ? over[p - 1] : 0;
            }
        }
        dmas = pieces;
    } else {
        /* each layer's ranges by host address, packed into pieces of slot bytes in that order */
        int64_t *starts = o[SP_PIECE_STARTS];
        base[0] = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            order[i] = i;
        }
        for (Py_ssize_t l = 0; l < layers; l++) {
            int64_t first = ecuts[l], count = ecuts[l + 1] - first, sorted = 1;
            for (int64_t i = first + 1; i < ecuts[l + 1] && sorted; i++) {
                sorted = h[i] >= h[i - 1];
            }
            if (!sorted) {
                sort_by_key(order + first, tmp, count, h);
            }
            int64_t within = 0, local = -1;
            for (int64_t k = first; k < ecuts[l + 1]; k++) {
                int64_t i = order[k], lp = DIV(within, slot, slot_shift), p = base[l] + lp;
                while (local < lp) {
                    starts[base[l] + ++local] = k;
                }
                o[SP_GPU][k] = g[i];
                o[SP_LENGTH][k] = ln[i];
                o[SP_PIECE][k] = p;
                o[SP_OFFSET][k] = within - lp * slot;
                /* a new DMA unless this range continues the previous one's host run within one piece */
                if (k == 0 || o[SP_PIECE][k - 1] != p || h[order[k - 1]] + ln[order[k - 1]] != h[i]) {
                    o[SP_DMA_HOST][dmas] = h[i];
                    o[SP_DMA_OFFSET][dmas] = o[SP_OFFSET][k];
                    o[SP_DMA_LENGTH][dmas] = ln[i];
                    o[SP_DMA_PIECE][dmas] = p;
                    dmas++;
                } else {
                    o[SP_DMA_LENGTH][dmas - 1] += ln[i];
                }
                within += ln[i];
            }
            base[l + 1] = base[l] + local + 1;
        }
        pieces = base[layers];
        starts[pieces] = n;
        Py_ssize_t d = 0;
        for (Py_ssize_t p = 0; p <= pieces; p++) {
            while (d < dmas && o[SP_DMA_PIECE][d] < p) {
                d++;
            }
            o[SP_DMA_STARTS][p] = d;
        }
    }
    for (Py_ssize_t l = 0; l < layers; l++) {
        o[SP_LAYER_END][l] = base[l + 1];
    }
    result = Py_BuildValue("(nnn)", n, pieces, dmas);
done:
    PyMem_Free(mem);
    for (int k = 0; k < got; k++) {
        PyBuffer_Release(&a[k].view);
    }
    return result;
}

/* ------------------------------------------------------------------ copy_pairs, host_runs */

PyDoc_STRVAR(copy_pairs_doc,
             "copy_pairs(src_block, src_row, dst_block, dst_row, width, src_limit, dst_limit, out_src_block,\n"
             "           out_src_row, out_dst_block, out_dst_row) -> int\n\n"
             "A copy's (block, row) pairs checked and in source order: the pairs where neither block is -1, sorted\n"
             "stably by src_block * width + src_row, written to the outputs (room for every pair). Returns (pairs,\n"
             "highest src block, highest dst block), -1 for none; or None, writing nothing useful, when a block id\n"
             "is below -1 or not below its side's limit, when the sides differ in size, or when two kept pairs\n"
             "write one (dst_block, dst_row): the caller's checks then say which. A row of None is all zeros. All\n"
             "arrays int64.");

static PyObject *copy_pairs(PyObject *self, PyObject *args)
{
    (void)self;
    enum { N = 8 };
    PyObject *objs[N];
    long long width, limit[2];
    if (!PyArg_ParseTuple(args, "OOOOLLLOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &width, &limit[0],
                          &limit[1], &objs[4], &objs[5], &objs[6], &objs[7])) {
        return NULL;
    }
    static const char *names[N] = {"src_block", "src_row", "dst_block", "dst_row", "out_src_block", "out_src_row",
                                   "out_dst_block", "out_dst_row"};
    int64s a[N];
    int have[N] = {0};
    PyObject *result = NULL;
    int64_t *mem = NULL;
    for (int k = 0; k < N; k++) {
        if ((k == 1 || k == 3) && objs[k] == Py_None) {
            continue;
        }
        if (get_int64s(objs[k], names[k], k >= 4, &a[k]) != 0) {
            goto done;
        }
        have[k] = 1;
    }
    if (!have[1] || !have[3]) {
        if (have[1] || have[3]) {
            PyErr_SetString(PyExc_ValueError, "src_row and dst_row: give both or neither");
            goto done;
        }
    }
    Py_ssize_t n = a[0].count;
    if (width < 1) {
        PyErr_Format(PyExc_ValueError, "width must be at least 1, got %lld", width);
        goto done;
    }
    if (a[2].count != n) { /* the caller's checks name the shapes */
        result = Py_NewRef(Py_None);
        goto done;
    }
    if ((have[1] && a[1].count != n) || (have[3] && a[3].count != n)) {
        PyErr_SetString(PyExc_ValueError, "a row array and its blocks differ in size");
        goto done;
    }
    for (int k = 4; k < N; k++) {
        if (a[k].count < n) {
            PyErr_Format(PyExc_ValueError, "%s has room for %zd, needs %zd", names[k], a[k].count, n);
            goto done;
        }
    }
    const int64_t *sb = a[0].data, *sr = have[1] ? a[1].data : NULL, *db = a[2].data, *dr = have[3] ? a[3].data : NULL;
    mem = PyMem_Malloc(sizeof(int64_t) * (size_t)(4 * n + 1));
    if (mem == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *idx = mem, *tmp = idx + n, *skey = tmp + n, *dkey = skey + n;
    Py_ssize_t m = 0;
    int sorted = 1;
    int64_t stop = -1, dtop = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (sb[i] < -1 || sb[i] >= limit[0] || db[i] < -1 || db[i] >= limit[1]) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        if (sb[i] < 0 || db[i] < 0) {
            continue;
        }
        stop = sb[i] > stop ? sb[i] : stop;
        dtop = db[i] > dtop ? db[i] : dtop;
        skey[i] = sb[i] * width + (sr ? sr[i] : 0);
        dkey[m] = db[i] * width + (dr ? dr[i] : 0);
        if (m > 0 && skey[i] < skey[idx[m - 1]]) {
            sorted = 0;
        }
        idx[m++] = i;
    }
    if (!sorted) {
        sort_by_key(idx, tmp, m, skey);
    }
    /* a destination written twice: dkey sorted (by value, through tmp as keys) has two equal neighbours */
    for (Py_ssize_t k = 0; k < m; k++) {
        tmp[k] = k;
    }
    int dsorted = 1;
    for (Py_ssize_t k = 1; k < m && dsorted; k++) {
        dsorted = dkey[k] > dkey[k - 1];
    }
    if (!dsorted) {
        int64_t *order = tmp, *scratch = skey; /* skey is no longer needed once idx is sorted */
        sort_by_key(order, scratch, m, dkey);
        for (Py_ssize_t k = 1; k < m; k++) {
            if (dkey[order[k]] == dkey[order[k - 1]]) {
                result = Py_NewRef(Py_None);
                goto done;
            }
        }
    }
    int64_t *osb = (int64_t *)a[4].data, *osr = (int64_t *)a[5].data, *odb = (int64_t *)a[6].data;
    int64_t *odr = (int64_t *)a[7].data;
    for (Py_ssize_t k = 0; k < m; k++) {
        Py_ssize_t i = idx[k];
        osb[k] = sb[i];
        osr[k] = sr ? sr[i] : 0;
        odb[k] = db[i];
        odr[k] = dr ? dr[i] : 0;
    }
    result = Py_BuildValue("(nLL)", m, (long long)stop, (long long)dtop);
done:
    PyMem_Free(mem);
    for (int k = 0; k < N; k++) {
        if (have[k]) {
            PyBuffer_Release(&a[k].view);
        }
    }
    return result;
}

PyDoc_STRVAR(host_runs_doc,
             "host_runs(addr, length) -> (runs, bytes)\n\n"
             "The ranges ordered by address (stably) and the runs they form there: a run ends where the next range\n"
             "does not start at the previous one's end. Returns (runs, total bytes); int64 arrays of one size.");

static PyObject *host_runs(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *objs[2];
    if (!PyArg_ParseTuple(args, "OO", &objs[0], &objs[1])) {
        return NULL;
    }
    int64s a[2];
    int got = 0;
    PyObject *result = NULL;
    int64_t *mem = NULL;
    for (; got < 2; got++) {
        if (get_int64s(objs[got], got ? "length" : "addr", 0, &a[got]) != 0) {
            goto done;
        }
    }
    Py_ssize_t n = a[0].count;
    const int64_t *addr = a[0].data, *len = a[1].data;
    if (a[1].count != n) {
        PyErr_SetString(PyExc_ValueError, "addr and length must have one size");
        goto done;
    }
    long long total = 0;
    int sorted = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        total += len[i];
        if (i > 0 && addr[i] < addr[i - 1]) {
            sorted = 0;
        }
    }
    Py_ssize_t runs = n > 0;
    if (sorted) {
        for (Py_ssize_t i = 1; i < n; i++) {
            runs += addr[i] != addr[i - 1] + len[i - 1];
        }
    } else {
        mem = PyMem_Malloc(sizeof(int64_t) * (size_t)(2 * n));
        if (mem == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        int64_t *idx = mem, *tmp = mem + n;
        for (Py_ssize_t i = 0; i < n; i++) {
            idx[i] = i;
        }
        sort_by_key(idx, tmp, n, addr);
        for (Py_ssize_t k = 1; k < n; k++) {
            runs += addr[idx[k]] != addr[idx[k - 1]] + len[idx[k - 1]];
        }
    }
    result = Py_BuildValue("(nL)", runs, total);
done:
    PyMem_Free(mem);
    for (int k = 0; k < got; k++) {
        PyBuffer_Release(&a[k].view);
    }
    return result;
}

/* ------------------------------------------------------------------ slot_table */

PyDoc_STRVAR(slot_table_doc,
             "slot_table(piece, offset, gpu, length, dma_piece, dma_offset, slots, stride, first, count, to_host,\n"
             "           out_table, out_dma_staged)\n\n"
             "A staged plan placed in a ring of ``count`` slots ``stride`` bytes apart from address ``slots``,\n"
             "piece p in slot (first + p) % count: out_table (3 x ranges, row after row) gets the copy kernel's\n"
             "table, source, destination and length rows (gpu -> slot with to_host, else slot -> gpu);\n"
             "out_dma_staged each DMA's address in its slot. All arrays int64.");

static PyObject *slot_table(PyObject *self, PyObject *args)
{
    (void)self;
    enum { N = 8 };
    PyObject *objs[N];
    long long slots, stride, first, count;
    int to_host;
    if (!PyArg_ParseTuple(args, "OOOOOOLLLLpOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &slots,
                          &stride, &first, &count, &to_host, &objs[6], &objs[7])) {
        return NULL;
    }
    static const char *names[N] = {"piece", "offset", "gpu", "length", "dma_piece", "dma_offset", "out_table",
                                   "out_dma_staged"};
    int64s a[N];
    int got = 0;
    PyObject *result = NULL;
    for (; got < N; got++) {
        if (get_int64s(objs[got], names[got], got >= 6, &a[got]) != 0) {
            goto done;
        }
    }
    Py_ssize_t n = a[0].count, dmas = a[4].count;
    if (a[1].count != n || a[2].count != n || a[3].count != n || a[5].count != dmas) {
        PyErr_SetString(PyExc_ValueError, "piece, offset, gpu and length must have one size, dma_piece and "
                                          "dma_offset another");
        goto done;
    }
    if (a[6].count < 3 * n || a[7].count < dmas) {
        PyErr_SetString(PyExc_ValueError, "an output array is too small");
        goto done;
    }
    if (count < 1 || first < 0) {
        PyErr_Format(PyExc_ValueError, "need count >= 1 and first >= 0, got %lld, %lld", count, first);
        goto done;
    }
    const int64_t *piece = a[0].data, *offset = a[1].data, *gpu = a[2].data, *length = a[3].data;
    int64_t *src = (int64_t *)a[6].data, *dst = src + n, *len = dst + n, *staged = (int64_t *)a[7].data;
    int64_t *gpu_row = to_host ? src : dst, *slot_row = to_host ? dst : src;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (piece[i] < 0) {
            PyErr_Format(PyExc_ValueError, "piece: range %zd has piece %lld", i, (long long)piece[i]);
            goto done;
        }
        gpu_row[i] = gpu[i];
        slot_row[i] = slots + ((first + piece[i]) % count) * stride + offset[i];
        len[i] = length[i];
    }
    for (Py_ssize_t j = 0; j < dmas; j++) {
        if (a[4].data[j] < 0) {
            PyErr_Format(PyExc_ValueError, "dma_piece: DMA %zd has piece %lld", j, (long long)a[4].data[j]);
            goto done;
        }
        staged[j] = slots + ((first + a[4].data[j]) % count) * stride + a[5].data[j];
    }
    result = Py_NewRef(Py_None);
done:
    for (int k = 0; k < got; k++) {
        PyBuffer_Release(&a[k].view);
    }
    return result;
}

static PyMethodDef methods[] = {
    {"pair_ranges", pair_ranges, METH_VARARGS, pair_ranges_doc},
    {"chunked", chunked, METH_VARARGS, chunked_doc},
    {"stage_plan", stage_plan, METH_VARARGS, stage_plan_doc},
    {"copy_pairs", copy_pairs, METH_VARARGS, copy_pairs_doc},
    {"host_runs", host_runs, METH_VARARGS, host_runs_doc},
    {"slot_table", slot_table, METH_VARARGS, slot_table_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ranges", "The merged byte ranges of a block-to-block KV copy, and a staged copy's plan, in one pass each.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ranges(void)
{
    return PyModule_Create(&module);
}

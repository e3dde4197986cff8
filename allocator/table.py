"""Block-table helpers for attention backends: TP slices, padded batches, CSR pages, varlen and slots.

A request's block table is int32 ``[num_rows, num_logical_blocks]``: one row in
uniform mode (every kv head uses the same block id), one row per global kv head
in head-wise mode; ``-1`` marks a slot whose block was recycled (sliding-window
heads) or never needed. Everything here is pure numpy over whole batches, so an
engine can build a step's kernel metadata without per-token Python work. Every
public function validates its inputs once and raises ``KVCacheError`` naming
the argument and the reason.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from kvcache.allocator.errors import KVCacheError

EMPTY = -1
"""Block id of an empty slot: recycled by a sliding window, or never needed."""

_INT32_MAX = int(np.iinfo(np.int32).max)
_INT64_MAX = int(np.iinfo(np.int64).max)


class KVIndices(NamedTuple):
    """One table row of a decode batch as CSR page lists (FlashInfer's paged-KV layout).

    Request ``b`` attends to pages ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``,
    which are its logical pages ``kv_start_page[b], kv_start_page[b]+1, ...``;
    the last listed page holds ``kv_last_page_len[b]`` tokens (0 when the
    request has no tokens). For a full-attention row ``kv_start_page`` is 0.
    """

    kv_indptr: np.ndarray
    """int32 [batch + 1]: offsets of each request's pages in ``kv_indices``."""
    kv_indices: np.ndarray
    """int32 [nnz]: physical block ids, request after request, in logical order."""
    kv_last_page_len: np.ndarray
    """int32 [batch]: tokens in each request's last page, 1..block_size (0 if seq_len is 0)."""
    kv_start_page: np.ndarray
    """int32 [batch]: logical index of each request's first listed page (first token: start * block_size)."""


class VarlenMeta(NamedTuple):
    """Metadata for a varlen (packed) prefill step whose requests may start after a cached prefix."""

    cu_seqlens_q: np.ndarray
    """int32 [batch + 1]: offsets of each request's new (query) tokens in the packed batch."""
    cu_seqlens_k: np.ndarray
    """int32 [batch + 1]: offsets of each request's keys, cached prefix included (k_len = cached + new)."""
    position_start: np.ndarray
    """int32 [batch]: absolute position of each request's first new token (= num_cached_tokens)."""
    positions: np.ndarray
    """int32 [total_q]: absolute position of every query token."""
    max_seqlen_q: int
    """Longest query length in the batch (0 for an empty batch)."""
    max_seqlen_k: int
    """Longest key length in the batch, cached prefix included (0 for an empty batch)."""


def uniform_to_headwise(table: np.ndarray, num_rows: int) -> np.ndarray:
    """Broadcast a uniform ``[1, n]`` table to a new int32 ``[num_rows, n]`` head-wise table (a copy)."""
    num_rows = _check_int(num_rows, "num_rows", minimum=1)
    arr = _block_table(table, "table")
    if arr.shape[0] != 1:
        raise KVCacheError(f"table has {arr.shape[0]} rows; a uniform table has exactly 1")
    return np.repeat(arr, num_rows, axis=0)


def headwise_to_uniform(table: np.ndarray) -> np.ndarray:
    """Collapse a head-wise table whose rows are all equal (``-1`` included) to a new int32 ``[1, n]``."""
    arr = _block_table(table, "table")
    if arr.shape[0] == 0:
        raise KVCacheError("table has 0 rows; a head-wise table has one row per kv head")
    differs = arr != arr[0]
    if differs.any():
        r, c = (int(i) for i in np.argwhere(differs)[0])
        raise KVCacheError(
            f"table row {r} differs from row 0 at block {c} ({arr[r, c]} != {arr[0, c]}); "
            "only a table whose rows are all equal is uniform"
        )
    return arr[:1].copy()


def rank_rows(num_kv_heads: int, tp_size: int, rank: int) -> slice:
    """Rows (global kv heads) of a head-wise table that TP rank ``rank`` needs.

    With H heads and tp ranks, H >= tp: rank r owns heads [r*H/tp, (r+1)*H/tp).
    H < tp: each head is replicated on tp/H ranks and rank r uses head
    r // (tp/H). Both are contiguous, so the answer is always a slice.
    """
    num_kv_heads = _check_int(num_kv_heads, "num_kv_heads", minimum=1)
    tp_size = _check_int(tp_size, "tp_size", minimum=1)
    rank = _check_int(rank, "rank", minimum=0)
    if rank >= tp_size:
        raise KVCacheError(f"rank must be in [0, tp_size={tp_size}), got {rank}")
    if num_kv_heads % tp_size == 0:
        per_rank = num_kv_heads // tp_size
        return slice(rank * per_rank, (rank + 1) * per_rank)
    if tp_size % num_kv_heads == 0:
        head = rank // (tp_size // num_kv_heads)
        return slice(head, head + 1)
    raise KVCacheError(
        f"num_kv_heads={num_kv_heads} and tp_size={tp_size}: one must divide the other "
        "to split or replicate kv heads across TP ranks"
    )


def slice_for_rank(table: np.ndarray, num_kv_heads: int, tp_size: int, rank: int) -> np.ndarray:
    """The rows of ``table`` that TP rank ``rank`` needs, as an int32 view; a uniform table passes through.

    The result shares memory with ``table`` when ``table`` is already int32:
    copy it before writing into it.
    """
    rows = rank_rows(num_kv_heads, tp_size, rank)
    arr = _block_table(table, "table")
    if arr.shape[0] == 1:
        return arr
    if arr.shape[0] != num_kv_heads:
        raise KVCacheError(
            f"table has {arr.shape[0]} rows; a head-wise table for num_kv_heads={num_kv_heads} "
            f"has {num_kv_heads} (or 1 when uniform)"
        )
    return arr[rows]


def padded_batch(tables: Sequence[np.ndarray], max_blocks: int | None = None) -> np.ndarray:
    """Stack a batch's tables into one int32 ``[batch, num_rows, max_blocks]`` array, padded with ``-1``.

    This is the dense block-table form most paged-attention kernels take.
    ``max_blocks`` defaults to the widest table; a narrower ``max_blocks``
    may cut only trailing ``-1`` slots. Every table must have the same rows.
    An empty batch gives shape ``[0, 0, max_blocks or 0]``.

        tables[0] = [[3, 7]]          out[0] = [[ 3,  7, -1]]
        tables[1] = [[5, 2, 9]]  ->   out[1] = [[ 5,  2,  9]]
    """
    cat, widths = _concat_tables(tables, "tables", row=None)
    batch, num_rows = widths.size, cat.shape[0]
    if max_blocks is None:
        max_blocks = int(widths.max()) if batch else 0
    else:
        max_blocks = _check_int(max_blocks, "max_blocks", minimum=0)
    if batch and widths.max() > max_blocks:
        col = np.arange(cat.shape[1]) - np.repeat(np.cumsum(widths) - widths, widths)
        fits = col < max_blocks
        cut = ~fits & (cat != EMPTY).any(axis=0)
        if cut.any():
            j = int(np.argmax(cut))
            b = int(np.searchsorted(np.cumsum(widths), j, side="right"))
            raise KVCacheError(
                f"max_blocks={max_blocks} would drop block {col[j]} of tables[{b}], "
                "which holds a live block id"
            )
        cat = cat[:, fits]
        widths = np.minimum(widths, max_blocks)
    # One slice copy per request: far cheaper than a boolean-mask scatter over the padded array.
    out = np.full((batch, num_rows, max_blocks), EMPTY, dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(widths)]).tolist()
    for i, width in enumerate(widths.tolist()):
        out[i, :, :width] = cat[:, starts[i]:starts[i] + width]
    return out


def padded_uniform_batch(tables: Sequence[np.ndarray], max_blocks: int | None = None) -> np.ndarray:
    """Stack a batch of uniform ``[1, n]`` tables into int32 ``[batch, max_blocks]``, padded with ``-1``.

    The squeezed form of ``padded_batch`` (vLLM's ``block_tables``); every
    table must have exactly one row.
    """
    items = _as_list(tables, "tables")
    for i, table in enumerate(items):
        if np.ndim(table) == 2 and np.shape(table)[0] != 1:
            raise KVCacheError(f"tables[{i}] has {np.shape(table)[0]} rows; a uniform table has exactly 1")
    out = padded_batch(items, max_blocks)
    return out.reshape(out.shape[0], out.shape[2])


def kv_csr(
    tables: Sequence[np.ndarray],
    seq_lens: Sequence[int] | np.ndarray,
    block_size: int,
    row: int = 0,
    sliding_window: bool = False,
) -> KVIndices:
    """CSR lists, for one table row, of the pages holding each request's ``seq_len`` tokens (split-KV decode).

    Request b needs logical pages 0 .. ceil(seq_len/block_size)-1; slots past
    them are ignored. A full-attention row (``sliding_window=False``) must
    hold a block in every needed page. A sliding-window row may have a
    leading run of recycled (-1) pages: they are skipped and
    ``kv_start_page`` says where the listed pages start, so the kernel places
    its first listed token at position ``kv_start_page * block_size``.

        block_size 4, seq_len 14, sliding row:
        tokens  0..3  4..7  8..11 12..13
        row     [-1,   -1,   6,    2,     9]   (slot 4 not needed)
        listed              ^6    ^2           kv_start_page 2, kv_last_page_len 2

    A hole after the first listed page (e.g. sink pages kept ahead of a
    recycled gap) cannot be expressed by one start page and is an error, as is
    a request with tokens whose needed pages are all -1.
    """
    block_size = _check_int(block_size, "block_size", minimum=1)
    row = _check_int(row, "row", minimum=0)
    cat, widths = _concat_tables(tables, "tables", row=row)
    flat = cat[0]
    batch = widths.size
    lens = _int_vector(seq_lens, "seq_lens")
    if lens.size != batch:
        raise KVCacheError(f"seq_lens has {lens.size} entries but tables has {batch}")
    needed = -(-lens // block_size)
    over = needed > widths
    if over.any():
        b = int(np.argmax(over))
        raise KVCacheError(
            f"seq_lens[{b}]={lens[b]} needs {needed[b]} pages of block_size {block_size} "
            f"but tables[{b}] has {widths[b]}"
        )
    req = np.repeat(np.arange(batch), needed)
    page = np.arange(int(needed.sum())) - np.repeat(np.cumsum(needed) - needed, needed)
    blocks = flat[np.repeat(np.cumsum(widths) - widths, needed) + page]
    dead = blocks == EMPTY
    start = np.zeros(batch, dtype=np.int64)
    if sliding_window:
        start = needed.copy()
        np.minimum.at(start, req[~dead], page[~dead])
        no_live = (needed > 0) & (start == needed)
        if no_live.any():
            b = int(np.argmax(no_live))
            raise KVCacheError(
                f"tables[{b}] row {row}: every page needed by seq_lens[{b}]={lens[b]} "
                f"(pages 0..{needed[b] - 1}) is -1; nothing left to attend to"
            )
    hole = dead & (page >= start[req])
    if hole.any():
        i = int(np.argmax(hole))
        b = int(req[i])
        hint = (
            "a sliding-window row may only have -1 pages before its first listed page"
            if sliding_window
            else "pass sliding_window=True for a sliding-window row"
        )
        raise KVCacheError(
            f"tables[{b}] row {row} page {page[i]} is -1 but seq_lens[{b}]={lens[b]} "
            f"needs pages {start[b]}..{needed[b] - 1}; {hint}"
        )
    counts = needed - start
    last = np.where(lens > 0, (lens - 1) % block_size + 1, 0)
    return KVIndices(
        kv_indptr=_offsets(counts, "listed pages"),
        kv_indices=blocks[page >= start[req]].astype(np.int32, copy=False),
        kv_last_page_len=last.astype(np.int32),
        kv_start_page=start.astype(np.int32),
    )


def varlen_metadata(
    num_cached_tokens: Sequence[int] | np.ndarray, num_new_tokens: Sequence[int] | np.ndarray
) -> VarlenMeta:
    """Packed-batch offsets and positions for a chunked-prefill step with prefix-cache hits.

    Each request's queries are its new tokens; its keys are the cached prefix
    plus the new tokens:

        request b:  | cached (in the KV cache) | new (queries) |
        position:     0 .. cached-1              cached .. cached+new-1
        k_len = cached + new, q_len = new
    """
    cached = _int_vector(num_cached_tokens, "num_cached_tokens")
    new = _int_vector(num_new_tokens, "num_new_tokens")
    if cached.size != new.size:
        raise KVCacheError(
            f"num_cached_tokens has {cached.size} entries but num_new_tokens has {new.size}"
        )
    k_lens = cached + new
    cu_q = _offsets(new, "num_new_tokens")
    cu_k = _offsets(k_lens, "num_cached_tokens + num_new_tokens")
    positions = np.arange(int(cu_q[-1]), dtype=np.int64) + np.repeat(cached - cu_q[:-1], new)
    return VarlenMeta(
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        position_start=cached.astype(np.int32),
        positions=positions.astype(np.int32),
        max_seqlen_q=int(new.max()) if new.size else 0,
        max_seqlen_k=int(k_lens.max()) if k_lens.size else 0,
    )


def slot_mapping(
    table_row: np.ndarray, positions: Sequence[int] | np.ndarray, block_size: int
) -> np.ndarray:
    """Flat cache slots ``block * block_size + position % block_size`` (int64) for one table row.

    This is what cache-write kernels take; a position whose block is -1 maps
    to slot -1, which those kernels skip.
    """
    block_size = _check_int(block_size, "block_size", minimum=1)
    row = np.asarray(table_row)
    if row.ndim != 1:
        raise KVCacheError(f"table_row must be 1-D, got shape {row.shape}")
    row = _checked_block_ids(row, "table_row")
    pos = _int_vector(positions, "positions", maximum=_INT64_MAX)
    page = pos // block_size
    over = page >= row.size
    if over.any():
        i = int(np.argmax(over))
        raise KVCacheError(
            f"positions[{i}]={pos[i]} falls in page {page[i]} but table_row has {row.size} pages"
        )
    return _slots(row[page], pos, block_size)


def batch_slot_mapping(
    tables: Sequence[np.ndarray],
    positions: Sequence[int] | np.ndarray,
    cu_seqlens_q: Sequence[int] | np.ndarray,
    block_size: int,
    row: int | None = 0,
) -> np.ndarray:
    """Flat cache slots (int64) for a packed batch; tokens ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` use ``tables[b]``.

    Returns ``[total_q]`` for one table row, or ``[num_rows, total_q]`` with
    ``row=None`` (head-wise tables, one slot per kv head). Slot -1 where the
    block is -1.
    """
    block_size = _check_int(block_size, "block_size", minimum=1)
    if row is not None:
        row = _check_int(row, "row", minimum=0)
    cat, widths = _concat_tables(tables, "tables", row=row)
    batch = widths.size
    pos = _int_vector(positions, "positions", maximum=_INT64_MAX)
    cu = _int_vector(cu_seqlens_q, "cu_seqlens_q", maximum=_INT64_MAX)
    if cu.size != batch + 1:
        raise KVCacheError(f"cu_seqlens_q has {cu.size} entries; a batch of {batch} needs {batch + 1}")
    if cu[0] != 0:
        raise KVCacheError(f"cu_seqlens_q[0] must be 0, got {cu[0]}")
    counts = np.diff(cu)
    if (counts < 0).any():
        b = int(np.argmax(counts < 0))
        raise KVCacheError(f"cu_seqlens_q decreases at entry {b + 1} ({cu[b]} -> {cu[b + 1]})")
    if cu[-1] != pos.size:
        raise KVCacheError(f"cu_seqlens_q ends at {cu[-1]} but positions has {pos.size} entries")
    req = np.repeat(np.arange(batch), counts)
    page = pos // block_size
    over = page >= widths[req]
    if over.any():
        i = int(np.argmax(over))
        b = int(req[i])
        raise KVCacheError(
            f"positions[{i}]={pos[i]} (request {b}) falls in page {page[i]} "
            f"but tables[{b}] has {widths[b]} pages"
        )
    cols = np.repeat(np.cumsum(widths) - widths, counts) + page
    slots = _slots(cat[:, cols], pos, block_size)
    return slots[0] if row is not None else slots


def _slots(blocks: np.ndarray, pos: np.ndarray, block_size: int) -> np.ndarray:
    """int64 ``block * block_size + pos % block_size``, -1 where the block is -1."""
    blocks = blocks.astype(np.int64)
    return np.where(blocks == EMPTY, EMPTY, blocks * block_size + pos % block_size)


def _offsets(lengths: np.ndarray, name: str) -> np.ndarray:
    """int32 ``[0, l0, l0+l1, ...]`` (``len(lengths) + 1`` entries); raises if the total overflows int32."""
    out = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    if out[-1] > _INT32_MAX:
        raise KVCacheError(f"{name} sum to {out[-1]}, past the int32 limit {_INT32_MAX}")
    return out.astype(np.int32)


def _check_int(value: object, name: str, minimum: int) -> int:
    """``value`` as an int, or KVCacheError unless it is an integer >= ``minimum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise KVCacheError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise KVCacheError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_int_dtype(arr: np.ndarray, name: str) -> None:
    """Raise unless ``arr`` holds integers (an empty array of any dtype passes)."""
    if arr.size and arr.dtype.kind not in "iu":
        raise KVCacheError(f"{name} must hold integers, got dtype {arr.dtype}")


def _int_vector(values: object, name: str, maximum: int = _INT32_MAX) -> np.ndarray:
    """``values`` as a 1-D int64 array of integers in ``[0, maximum]``, or KVCacheError naming ``name``."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise KVCacheError(f"{name} must be 1-D, got shape {arr.shape}")
    _check_int_dtype(arr, name)
    if arr.size:
        bad = (arr < 0) | (arr > maximum)
        if bad.any():
            i = int(np.argmax(bad))
            reason = "negative" if arr[i] < 0 else f"past {maximum}"
            raise KVCacheError(f"{name}[{i}]={arr[i]} is {reason}")
    return arr.astype(np.int64)


def _checked_block_ids(arr: np.ndarray, name: str) -> np.ndarray:
    """``arr`` as int32 after checking every entry is a block id (0..int32 max) or -1."""
    _check_int_dtype(arr, name)
    if arr.size:
        bad = (arr < EMPTY) | (arr > _INT32_MAX)
        if bad.any():
            where = ", ".join(str(int(i)) for i in np.argwhere(bad)[0])
            raise KVCacheError(
                f"{name}[{where}]={arr[np.nonzero(bad)][0]} is not a block id (0..{_INT32_MAX}, or -1)"
            )
    return arr.astype(np.int32, copy=False)


def _block_table(table: object, name: str) -> np.ndarray:
    """``table`` as a validated int32 ``[num_rows, num_blocks]`` array."""
    arr = np.asarray(table)
    if arr.ndim != 2:
        raise KVCacheError(f"{name} must be a 2-D block table [num_rows, num_blocks], got shape {arr.shape}")
    return _checked_block_ids(arr, name)


def _as_list(tables: object, name: str) -> list:
    """The batch's tables as a list, or KVCacheError if ``tables`` is not a sequence of tables."""
    if isinstance(tables, np.ndarray) and tables.ndim != 3:
        raise KVCacheError(f"{name} must be a sequence of 2-D tables, got an array of shape {tables.shape}")
    try:
        return list(tables)  # type: ignore[call-overload]
    except TypeError:
        raise KVCacheError(f"{name} must be a sequence of 2-D tables, got {type(tables).__name__}") from None


def _concat_tables(tables: object, name: str, row: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Validate a batch and join it along blocks: int32 ``[num_rows, sum(widths)]``, int64 widths ``[batch]``.

    ``row=None`` keeps every row (all tables must have the same rows);
    an int keeps only that row, giving ``[1, sum(widths)]``.
    """
    items = _as_list(tables, name)
    parts: list[np.ndarray] = []
    for i, table in enumerate(items):
        arr = np.asarray(table)
        if arr.ndim != 2:
            raise KVCacheError(
                f"{name}[{i}] must be a 2-D block table [num_rows, num_blocks], got shape {arr.shape}"
            )
        _check_int_dtype(arr, f"{name}[{i}]")
        if row is not None:
            if row >= arr.shape[0]:
                raise KVCacheError(
                    f"row {row} is out of range for {name}[{i}], which has {arr.shape[0]} rows"
                )
            arr = arr[row : row + 1]
        elif parts and arr.shape[0] != parts[0].shape[0]:
            raise KVCacheError(
                f"{name}[{i}] has {arr.shape[0]} rows but {name}[0] has {parts[0].shape[0]}; "
                "a batch's tables must have the same rows"
            )
        if arr.dtype == np.uint64 and arr.size and arr.max() > _INT32_MAX:
            # Checked before the int64 cast below, which would wrap 2**64 - 1 to -1.
            raise KVCacheError(f"{name}[{i}] holds {arr.max()}, which is not a block id")
        parts.append(arr)
    widths = np.array([p.shape[1] for p in parts], dtype=np.int64)
    if not parts:
        return np.empty((0 if row is None else 1, 0), dtype=np.int32), widths
    dtype = np.int32 if all(p.dtype == np.int32 for p in parts) else np.int64
    cat = np.concatenate([p.astype(dtype, copy=False) for p in parts], axis=1)
    bad = (cat < EMPTY) | (cat > _INT32_MAX)
    if bad.any():
        r, c = (int(x) for x in np.argwhere(bad)[0])
        b = int(np.searchsorted(np.cumsum(widths), c, side="right"))
        col = c - int(widths[:b].sum())
        shown_row = r if row is None else row
        raise KVCacheError(
            f"{name}[{b}][{shown_row}, {col}]={cat[r, c]} is not a block id (0..{_INT32_MAX}, or -1)"
        )
    return cat.astype(np.int32, copy=False), widths

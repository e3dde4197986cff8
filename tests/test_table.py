"""Specification of the block-table helpers (`kvcache.allocator.table`).

Hand-worked examples pin exact arrays; hypothesis properties compare each
vectorised helper with a slow plain-Python reference written below.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.table import (
    KVIndices,
    VarlenMeta,
    batch_slot_mapping,
    headwise_to_uniform,
    kv_csr,
    padded_batch,
    padded_uniform_batch,
    rank_rows,
    slice_for_rank,
    slot_mapping,
    uniform_to_headwise,
    varlen_metadata,
)


def table(*rows: list[int]) -> np.ndarray:
    """An int32 block table from its rows."""
    return np.array(rows, dtype=np.int32).reshape(len(rows), -1 if rows and rows[0] else 0)


def assert_array(actual: np.ndarray, expected: list, dtype: type) -> None:
    """``actual`` equals ``expected`` exactly: values, shape and dtype."""
    assert actual.dtype == dtype, actual.dtype
    assert actual.tolist() == expected


# ---------------------------------------------------------------- references


def ref_rank_heads(num_kv_heads: int, tp_size: int, rank: int) -> list[int]:
    """Heads rank ``rank`` needs, by asking every head which ranks hold it."""
    heads = []
    for head in range(num_kv_heads):
        if num_kv_heads >= tp_size:
            owners = [head // (num_kv_heads // tp_size)]
        else:
            replicas = tp_size // num_kv_heads
            owners = list(range(head * replicas, (head + 1) * replicas))
        if rank in owners:
            heads.append(head)
    return heads


def ref_padded(tables: list[np.ndarray], max_blocks: int) -> list:
    """Nested lists [batch][row][max_blocks], -1 past each table's end."""
    out = []
    for t in tables:
        rows = t.tolist()
        out.append([[row[j] if j < len(row) else -1 for j in range(max_blocks)] for row in rows])
    return out


def ref_kv_csr(tables: list[np.ndarray], seq_lens: list[int], block_size: int, row: int, sliding: bool):
    """(indptr, indices, last_page_len, start_page) as lists, or None where kv_csr must refuse."""
    indptr, indices, last, start = [0], [], [], []
    for t, seq_len in zip(tables, seq_lens):
        needed = math.ceil(seq_len / block_size)
        pages = t[row].tolist()
        if needed > len(pages):
            return None
        pages = pages[:needed]
        first = 0
        if sliding:
            while first < needed and pages[first] == -1:
                first += 1
            if needed > 0 and first == needed:
                return None
        if -1 in pages[first:]:
            return None
        indices.extend(pages[first:])
        indptr.append(len(indices))
        start.append(first)
        last.append(seq_len - (needed - 1) * block_size if seq_len else 0)
    return indptr, indices, last, start


def ref_varlen(cached: list[int], new: list[int]):
    """(cu_q, cu_k, positions, max_q, max_k) as lists, built token by token."""
    cu_q, cu_k, positions = [0], [0], []
    for c, n in zip(cached, new):
        for i in range(n):
            positions.append(c + i)
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + c + n)
    return cu_q, cu_k, positions, max(new, default=0), max((c + n for c, n in zip(cached, new)), default=0)


def ref_slots(row: list[int], positions: list[int], block_size: int) -> list[int]:
    """Slot of each position, one position at a time."""
    out = []
    for p in positions:
        block = row[p // block_size]
        out.append(-1 if block == -1 else block * block_size + p % block_size)
    return out


# ---------------------------------------------------------------- strategies

block_ids = st.one_of(st.just(-1), st.integers(0, 10_000))
block_sizes = st.sampled_from([1, 2, 3, 4, 16])


@st.composite
def table_batches(draw: st.DrawFn, max_batch: int = 6, max_width: int = 8) -> tuple[int, list[np.ndarray]]:
    """(num_rows, tables): random widths, random block ids with -1 holes anywhere."""
    num_rows = draw(st.integers(1, 4))
    tables = []
    for _ in range(draw(st.integers(0, max_batch))):
        width = draw(st.integers(0, max_width))
        values = draw(st.lists(block_ids, min_size=num_rows * width, max_size=num_rows * width))
        tables.append(np.array(values, dtype=np.int32).reshape(num_rows, width))
    return num_rows, tables


@st.composite
def decode_batches(draw: st.DrawFn, sliding: bool) -> tuple[list[np.ndarray], list[int], int]:
    """(tables, seq_lens, block_size) kv_csr accepts: needed pages live, SWA rows with a leading -1 run."""
    block_size = draw(block_sizes)
    tables, seq_lens = [], []
    for _ in range(draw(st.integers(0, 6))):
        width = draw(st.integers(0, 8))
        seq_len = draw(st.integers(0, width * block_size))
        needed = math.ceil(seq_len / block_size)
        recycled = draw(st.integers(0, max(needed - 1, 0))) if sliding else 0
        live = draw(st.lists(st.integers(0, 10_000), min_size=needed - recycled, max_size=needed - recycled))
        tail = draw(st.lists(block_ids, min_size=width - needed, max_size=width - needed))
        tables.append(np.array([[-1] * recycled + live + tail], dtype=np.int32))
        seq_lens.append(seq_len)
    return tables, seq_lens, block_size


# ---------------------------------------------------------------- uniform <-> head-wise


def test_uniform_to_headwise_repeats_the_row_for_every_head() -> None:
    """[1, n] -> [num_rows, n], every row the uniform row, as a new int32 array."""
    uniform = table([4, -1, 9])
    out = uniform_to_headwise(uniform, 3)
    assert_array(out, [[4, -1, 9], [4, -1, 9], [4, -1, 9]], np.int32)
    out[0, 0] = 99
    assert uniform[0, 0] == 4


def test_uniform_to_headwise_rejects_a_headwise_table() -> None:
    with pytest.raises(KVCacheError, match="table has 2 rows"):
        uniform_to_headwise(table([1], [2]), 4)


def test_uniform_to_headwise_rejects_zero_rows() -> None:
    with pytest.raises(KVCacheError, match="num_rows must be >= 1"):
        uniform_to_headwise(table([1]), 0)


def test_headwise_to_uniform_collapses_equal_rows() -> None:
    assert_array(headwise_to_uniform(table([4, -1, 9], [4, -1, 9])), [[4, -1, 9]], np.int32)


def test_headwise_to_uniform_names_the_first_row_that_differs() -> None:
    """-1 counts: a head whose block was recycled makes the table head-wise."""
    with pytest.raises(KVCacheError, match=r"row 2 differs from row 0 at block 1 \(-1 != 5\)"):
        headwise_to_uniform(table([4, 5], [4, 5], [4, -1]))


@given(st.lists(block_ids, max_size=10), st.integers(1, 8))
def test_headwise_to_uniform_inverts_uniform_to_headwise(row: list[int], num_rows: int) -> None:
    uniform = np.array([row], dtype=np.int32).reshape(1, len(row))
    np.testing.assert_array_equal(headwise_to_uniform(uniform_to_headwise(uniform, num_rows)), uniform)


# ---------------------------------------------------------------- TP ranks


@pytest.mark.parametrize(
    ("num_kv_heads", "tp_size", "rank", "rows"),
    [
        (8, 4, 1, slice(2, 4)),  # split: rank 1 owns heads 2, 3
        (8, 1, 0, slice(0, 8)),  # no TP: every head
        (4, 4, 3, slice(3, 4)),  # one head per rank
        (2, 8, 5, slice(1, 2)),  # replicated: ranks 4..7 share head 1
        (1, 4, 2, slice(0, 1)),  # MQA: every rank uses head 0
    ],
)
def test_rank_rows_splits_or_replicates_heads(num_kv_heads: int, tp_size: int, rank: int, rows: slice) -> None:
    assert rank_rows(num_kv_heads, tp_size, rank) == rows


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((8, 0, 0), "tp_size must be >= 1, got 0"),
        ((8, 4, -1), "rank must be >= 0, got -1"),
        ((8, 4, 4), r"rank must be in \[0, tp_size=4\), got 4"),
        ((6, 4, 0), "num_kv_heads=6 and tp_size=4"),
        ((0, 4, 0), "num_kv_heads must be >= 1"),
        ((8, 2.0, 0), "tp_size must be an integer"),
    ],
)
def test_rank_rows_rejects_impossible_splits(args: tuple, message: str) -> None:
    with pytest.raises(KVCacheError, match=message):
        rank_rows(*args)


@given(st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([1, 2, 4, 8, 16]), st.data())
def test_rank_rows_matches_per_head_ownership(num_kv_heads: int, tp_size: int, data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, tp_size - 1))
    heads = np.arange(num_kv_heads)[rank_rows(num_kv_heads, tp_size, rank)]
    assert heads.tolist() == ref_rank_heads(num_kv_heads, tp_size, rank)


def test_slice_for_rank_returns_the_ranks_heads() -> None:
    """4 heads, tp 2: rank 1 gets rows 2 and 3."""
    headwise = table([0, 1], [2, 3], [4, 5], [6, -1])
    assert_array(slice_for_rank(headwise, 4, 2, 1), [[4, 5], [6, -1]], np.int32)


def test_slice_for_rank_passes_a_uniform_table_through() -> None:
    uniform = table([7, 8])
    assert slice_for_rank(uniform, 4, 2, 1) is uniform


def test_slice_for_rank_rejects_rows_that_are_not_the_head_count() -> None:
    with pytest.raises(KVCacheError, match="table has 3 rows.*num_kv_heads=4"):
        slice_for_rank(table([0], [1], [2]), 4, 2, 0)


def test_slice_for_rank_validates_rank_even_for_uniform_tables() -> None:
    with pytest.raises(KVCacheError, match="rank must be in"):
        slice_for_rank(table([7]), 4, 2, 2)


# ---------------------------------------------------------------- padded batches


def test_padded_batch_pads_every_table_to_the_widest() -> None:
    """
    tables[0] = [[3, 7],       out[0] = [[3,  7, -1],
                 [4, 8]]                 [4,  8, -1]]
    tables[1] = [[5, 2, 9],    out[1] = [[5,  2,  9],
                 [6, -1, 1]]             [6, -1,  1]]
    """
    out = padded_batch([table([3, 7], [4, 8]), table([5, 2, 9], [6, -1, 1])])
    assert_array(out, [[[3, 7, -1], [4, 8, -1]], [[5, 2, 9], [6, -1, 1]]], np.int32)


def test_padded_batch_pads_to_a_wider_max_blocks() -> None:
    assert_array(padded_batch([table([3])], max_blocks=3), [[[3, -1, -1]]], np.int32)


def test_padded_batch_may_cut_only_trailing_empty_slots() -> None:
    assert_array(padded_batch([table([3, -1, -1])], max_blocks=1), [[[3]]], np.int32)
    with pytest.raises(KVCacheError, match="max_blocks=1 would drop block 2 of tables\\[1\\]"):
        padded_batch([table([3, -1]), table([3, -1, 5])], max_blocks=1)


def test_padded_batch_of_nothing_is_empty() -> None:
    assert padded_batch([]).shape == (0, 0, 0)
    assert padded_batch([], max_blocks=4).shape == (0, 0, 4)


def test_padded_batch_rejects_tables_with_different_rows() -> None:
    with pytest.raises(KVCacheError, match=r"tables\[1\] has 1 rows but tables\[0\] has 2"):
        padded_batch([table([1], [2]), table([3])])


def test_padded_uniform_batch_squeezes_the_row_axis() -> None:
    """vLLM's block_tables: [[3, 7, -1], [5, 2, 9]]."""
    out = padded_uniform_batch([table([3, 7]), table([5, 2, 9])])
    assert_array(out, [[3, 7, -1], [5, 2, 9]], np.int32)


def test_padded_uniform_batch_rejects_headwise_tables() -> None:
    with pytest.raises(KVCacheError, match=r"tables\[0\] has 2 rows; a uniform table has exactly 1"):
        padded_uniform_batch([table([1], [2])])


@given(table_batches(), st.one_of(st.none(), st.integers(0, 10)))
def test_padded_batch_matches_reference(batch: tuple[int, list[np.ndarray]], max_blocks: int | None) -> None:
    """Pads or cuts to max_blocks; refuses exactly when a cut slot holds a live block."""
    _, tables = batch
    width = max_blocks if max_blocks is not None else max((t.shape[1] for t in tables), default=0)
    if any(b != -1 for t in tables for row in t.tolist() for b in row[width:]):
        with pytest.raises(KVCacheError, match="would drop block"):
            padded_batch(tables, max_blocks)
        return
    out = padded_batch(tables, max_blocks)
    assert out.dtype == np.int32 and out.flags.c_contiguous
    assert out.shape[0] == len(tables) and out.shape[2] == width
    assert out.tolist() == ref_padded(tables, width)


# ---------------------------------------------------------------- CSR for decode


def test_kv_csr_lists_the_pages_that_hold_each_requests_tokens() -> None:
    """
    block_size 4
    req 0: seq_len 6  -> pages 0..1   row [3, 7, 5]   lists 3 7    (slot 2 not needed), last page 2 tokens
    req 1: seq_len 12 -> pages 0..2   row [9, 1, 4]   lists 9 1 4, last page 4 tokens
    req 2: seq_len 0  -> no pages     row [-1]        lists nothing, last page 0 tokens
    """
    out = kv_csr([table([3, 7, 5]), table([9, 1, 4]), table([-1])], [6, 12, 0], block_size=4)
    assert isinstance(out, KVIndices)
    assert_array(out.kv_indptr, [0, 2, 5, 5], np.int32)
    assert_array(out.kv_indices, [3, 7, 9, 1, 4], np.int32)
    assert_array(out.kv_last_page_len, [2, 4, 0], np.int32)
    assert_array(out.kv_start_page, [0, 0, 0], np.int32)


def test_kv_csr_skips_recycled_leading_pages_of_a_sliding_row() -> None:
    """
    block_size 4, seq_len 14, sliding-window row:
    tokens  0..3  4..7  8..11  12..13
    row     [-1,   -1,   6,     2,      9]   (slot 4 not needed)
    listed              6      2             kv_start_page 2, kv_last_page_len 2
    """
    out = kv_csr([table([-1, -1, 6, 2, 9]), table([4, 5])], [14, 5], 4, sliding_window=True)
    assert_array(out.kv_indptr, [0, 2, 4], np.int32)
    assert_array(out.kv_indices, [6, 2, 4, 5], np.int32)
    assert_array(out.kv_last_page_len, [2, 1], np.int32)
    assert_array(out.kv_start_page, [2, 0], np.int32)


def test_kv_csr_reads_the_requested_row_of_headwise_tables() -> None:
    """Row 1 (kv head 1) of each head-wise table."""
    out = kv_csr([table([1, 2], [-1, 8]), table([3, 4], [5, 6])], [5, 3], 4, row=1, sliding_window=True)
    assert_array(out.kv_indices, [8, 5], np.int32)
    assert_array(out.kv_start_page, [1, 0], np.int32)


def test_kv_csr_rejects_a_recycled_page_in_a_full_row() -> None:
    with pytest.raises(KVCacheError, match=r"tables\[1\] row 0 page 1 is -1 but seq_lens\[1\]=8.*sliding_window=True"):
        kv_csr([table([1, 2]), table([3, -1])], [8, 8], 4)


def test_kv_csr_ignores_empty_slots_past_the_needed_pages() -> None:
    out = kv_csr([table([3, -1, -1])], [4], 4)
    assert_array(out.kv_indices, [3], np.int32)


def test_kv_csr_rejects_a_hole_after_the_first_listed_page() -> None:
    """Sink page 0 kept ahead of a recycled gap: one start page cannot describe it."""
    with pytest.raises(KVCacheError, match=r"tables\[0\] row 0 page 1 is -1.*needs pages 0..3"):
        kv_csr([table([5, -1, 6, 7])], [16], 4, sliding_window=True)


def test_kv_csr_rejects_a_sliding_row_with_no_live_needed_page() -> None:
    with pytest.raises(KVCacheError, match=r"every page needed by seq_lens\[0\]=8 \(pages 0..1\) is -1"):
        kv_csr([table([-1, -1, 3])], [8], 4, sliding_window=True)


def test_kv_csr_rejects_seq_len_past_the_tables_capacity() -> None:
    with pytest.raises(KVCacheError, match=r"seq_lens\[0\]=9 needs 3 pages of block_size 4 but tables\[0\] has 2"):
        kv_csr([table([1, 2])], [9], 4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_lens": [4, 4]}, "seq_lens has 2 entries but tables has 1"),
        ({"seq_lens": [-1]}, r"seq_lens\[0\]=-1 is negative"),
        ({"seq_lens": [4.0]}, "seq_lens must hold integers, got dtype float64"),
        ({"seq_lens": [[4]]}, "seq_lens must be 1-D"),
        ({"block_size": 0}, "block_size must be >= 1, got 0"),
        ({"row": 1}, r"row 1 is out of range for tables\[0\], which has 1 rows"),
        ({"tables": [np.array([1, 2])]}, r"tables\[0\] must be a 2-D block table"),
        ({"tables": [np.array([[1.0, 2.0]])]}, r"tables\[0\] must hold integers"),
        ({"tables": [np.array([[1, -2]])]}, r"tables\[0\]\[0, 1\]=-2 is not a block id"),
        ({"tables": [np.array([[2**40]])]}, r"tables\[0\]\[0, 0\]=1099511627776 is not a block id"),
        ({"tables": [np.array([[2**64 - 1]], dtype=np.uint64)]}, r"tables\[0\] holds 18446744073709551615"),
        ({"tables": 5}, "tables must be a sequence of 2-D tables, got int"),
    ],
)
def test_kv_csr_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    args = {"tables": [table([1, 2])], "seq_lens": [4], "block_size": 4} | kwargs
    with pytest.raises(KVCacheError, match=message):
        kv_csr(**args)


def test_kv_csr_accepts_int64_tables_and_returns_int32() -> None:
    out = kv_csr([np.array([[1, 2]], dtype=np.int64)], np.array([5], dtype=np.uint16), 4)
    assert_array(out.kv_indices, [1, 2], np.int32)


def test_kv_csr_of_an_empty_batch_is_empty() -> None:
    out = kv_csr([], [], 16)
    assert_array(out.kv_indptr, [0], np.int32)
    assert out.kv_indices.shape == out.kv_last_page_len.shape == out.kv_start_page.shape == (0,)


@pytest.mark.parametrize("sliding", [False, True])
@given(data=st.data())
def test_kv_csr_matches_reference_on_valid_batches(sliding: bool, data: st.DataObject) -> None:
    tables, seq_lens, block_size = data.draw(decode_batches(sliding))
    out = kv_csr(tables, seq_lens, block_size, sliding_window=sliding)
    expected = ref_kv_csr(tables, seq_lens, block_size, 0, sliding)
    assert expected is not None
    assert [a.tolist() for a in out] == list(expected)
    assert all(a.dtype == np.int32 for a in out)


@pytest.mark.parametrize("sliding", [False, True])
@given(batch=table_batches(max_width=5), block_size=block_sizes, data=st.data())
def test_kv_csr_refuses_exactly_when_reference_does(
    sliding: bool, batch: tuple[int, list[np.ndarray]], block_size: int, data: st.DataObject
) -> None:
    """Random -1 holes anywhere, every row: kv_csr answers like the reference or raises where it refuses."""
    num_rows, tables = batch
    row = data.draw(st.integers(0, num_rows - 1))
    seq_lens = [data.draw(st.integers(0, (t.shape[1] + 1) * block_size)) for t in tables]
    expected = ref_kv_csr(tables, seq_lens, block_size, row, sliding)
    if expected is None:
        with pytest.raises(KVCacheError):
            kv_csr(tables, seq_lens, block_size, row=row, sliding_window=sliding)
    else:
        out = kv_csr(tables, seq_lens, block_size, row=row, sliding_window=sliding)
        assert [a.tolist() for a in out] == list(expected)


# ---------------------------------------------------------------- varlen prefill


def test_varlen_metadata_counts_the_cached_prefix_in_keys_only() -> None:
    """
    req 0: cached 3, new 2  -> q positions 3 4      k_len 5
    req 1: cached 0, new 4  -> q positions 0 1 2 3  k_len 4
    req 2: cached 5, new 0  -> no queries            k_len 5
    """
    out = varlen_metadata([3, 0, 5], [2, 4, 0])
    assert isinstance(out, VarlenMeta)
    assert_array(out.cu_seqlens_q, [0, 2, 6, 6], np.int32)
    assert_array(out.cu_seqlens_k, [0, 5, 9, 14], np.int32)
    assert_array(out.position_start, [3, 0, 5], np.int32)
    assert_array(out.positions, [3, 4, 0, 1, 2, 3], np.int32)
    assert (out.max_seqlen_q, out.max_seqlen_k) == (4, 5)


def test_varlen_metadata_of_an_empty_batch_is_empty() -> None:
    out = varlen_metadata([], [])
    assert_array(out.cu_seqlens_q, [0], np.int32)
    assert out.positions.shape == (0,)
    assert (out.max_seqlen_q, out.max_seqlen_k) == (0, 0)


@pytest.mark.parametrize(
    ("cached", "new", "message"),
    [
        ([0, 1], [1], "num_cached_tokens has 2 entries but num_new_tokens has 1"),
        ([0], [-3], r"num_new_tokens\[0\]=-3 is negative"),
        ([-1], [3], r"num_cached_tokens\[0\]=-1 is negative"),
        ([0.5], [3], "num_cached_tokens must hold integers"),
        ([2**31 - 1], [1], "num_cached_tokens \\+ num_new_tokens sum to 2147483648, past the int32 limit"),
    ],
)
def test_varlen_metadata_rejects_bad_lengths(cached: list, new: list, message: str) -> None:
    with pytest.raises(KVCacheError, match=message):
        varlen_metadata(cached, new)


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20)), max_size=8))
def test_varlen_metadata_matches_reference(lengths: list[tuple[int, int]]) -> None:
    cached = [c for c, _ in lengths]
    new = [n for _, n in lengths]
    out = varlen_metadata(cached, new)
    cu_q, cu_k, positions, max_q, max_k = ref_varlen(cached, new)
    assert out.cu_seqlens_q.tolist() == cu_q
    assert out.cu_seqlens_k.tolist() == cu_k
    assert out.positions.tolist() == positions
    assert out.position_start.tolist() == cached
    assert (out.max_seqlen_q, out.max_seqlen_k) == (max_q, max_k)


# ---------------------------------------------------------------- slot mapping


def test_slot_mapping_is_block_times_block_size_plus_offset() -> None:
    """
    block_size 4, row [3, -1, 7]
    position 0  -> block 3 offset 0 -> 12
    position 5  -> block -1         -> -1 (recycled: the write kernel skips it)
    position 9  -> block 7 offset 1 -> 29
    position 11 -> block 7 offset 3 -> 31
    """
    assert_array(slot_mapping(table([3, -1, 7])[0], [0, 5, 9, 11], 4), [12, -1, 29, 31], np.int64)


def test_slot_mapping_does_not_overflow_int32() -> None:
    big = 2**31 - 1
    assert slot_mapping(np.array([big], dtype=np.int32), [15], 16).tolist() == [big * 16 + 15]


@pytest.mark.parametrize(
    ("row", "positions", "message"),
    [
        ([3, 7], [8], r"positions\[0\]=8 falls in page 2 but table_row has 2 pages"),
        ([3, 7], [-1], r"positions\[0\]=-1 is negative"),
        ([[3, 7]], [0], "table_row must be 1-D"),
        ([3, -5], [0], r"table_row\[1\]=-5 is not a block id"),
    ],
)
def test_slot_mapping_rejects_bad_arguments(row: list, positions: list, message: str) -> None:
    with pytest.raises(KVCacheError, match=message):
        slot_mapping(np.array(row), positions, 4)


def test_batch_slot_mapping_uses_each_requests_own_table() -> None:
    """
    block_size 4, cu_seqlens_q [0, 2, 3]
    req 0 (tokens 0..1): positions 5 6 in row [3, 9]  -> 9*4+1, 9*4+2 = 37 38
    req 1 (token 2):     position 0    in row [8]     -> 32
    """
    out = batch_slot_mapping([table([3, 9]), table([8])], [5, 6, 0], [0, 2, 3], 4)
    assert_array(out, [37, 38, 32], np.int64)


def test_batch_slot_mapping_gives_every_head_its_slots_with_row_none() -> None:
    """Head-wise: [num_rows, total_q], one slot per kv head; head 0's block 1 was recycled."""
    tables = [table([3, -1], [1, 2]), table([8], [9])]
    out = batch_slot_mapping(tables, [5, 6, 0], [0, 2, 3], 4, row=None)
    assert_array(out, [[-1, -1, 32], [9, 10, 36]], np.int64)


@pytest.mark.parametrize(
    ("positions", "cu", "message"),
    [
        ([0, 1], [0, 2], "cu_seqlens_q has 2 entries; a batch of 2 needs 3"),
        ([0, 1], [1, 1, 2], r"cu_seqlens_q\[0\] must be 0, got 1"),
        ([0, 1], [0, 2, 1], "cu_seqlens_q decreases at entry 2"),
        ([0, 1], [0, 1, 3], "cu_seqlens_q ends at 3 but positions has 2 entries"),
        ([0, 4], [0, 1, 2], r"positions\[1\]=4 \(request 1\) falls in page 1 but tables\[1\] has 1 pages"),
    ],
)
def test_batch_slot_mapping_rejects_inconsistent_batches(positions: list, cu: list, message: str) -> None:
    with pytest.raises(KVCacheError, match=message):
        batch_slot_mapping([table([3, 9]), table([8])], positions, cu, 4)


@given(st.lists(block_ids, min_size=1, max_size=8), block_sizes, st.data())
def test_slot_mapping_matches_reference(row: list[int], block_size: int, data: st.DataObject) -> None:
    positions = data.draw(st.lists(st.integers(0, len(row) * block_size - 1), max_size=20))
    out = slot_mapping(np.array(row, dtype=np.int32), positions, block_size)
    assert out.dtype == np.int64
    assert out.tolist() == ref_slots(row, positions, block_size)


@settings(max_examples=200)
@given(table_batches(), block_sizes, st.data())
def test_batch_slot_mapping_matches_reference(
    batch: tuple[int, list[np.ndarray]], block_size: int, data: st.DataObject
) -> None:
    """Random prefill chunks: each request's positions drawn inside its table."""
    num_rows, tables = batch
    positions: list[int] = []
    cu = [0]
    for t in tables:
        capacity = t.shape[1] * block_size
        chunk = data.draw(st.lists(st.integers(0, capacity - 1), max_size=6)) if capacity else []
        positions.extend(chunk)
        cu.append(len(positions))
    out = batch_slot_mapping(tables, positions, cu, block_size, row=None)
    assert out.shape == (num_rows if tables else 0, len(positions))
    for r in range(num_rows if tables else 0):
        expected = []
        for b, t in enumerate(tables):
            expected.extend(ref_slots(t[r].tolist(), positions[cu[b] : cu[b + 1]], block_size))
        assert out[r].tolist() == expected
        assert batch_slot_mapping(tables, positions, cu, block_size, row=r).tolist() == expected

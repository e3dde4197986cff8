"""The C passes a host-tier copy plans with (kvcache.transfer._ranges) give what their numpy references give.

Each fast path is checked against the code it replaced: the same pairs, classes, ranges, run counts and slot
tables for valid input, and the same KVCacheError (type and message) for bad input.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache.allocator import CacheSpec, KVCacheError
from kvcache.allocator.rows import layer_classes, rows_blocks
from kvcache.transfer import _ranges, regions, staged
from kvcache.transfer.regions import CopyRanges, KVRegion

BASE = 1 << 40


def make_region(spec: CacheSpec, layer_blocks: list[int], seed: int) -> KVRegion:
    """A region over made-up addresses (nothing is read): tensors far apart, blocks dense or strided."""
    rng = np.random.default_rng(seed)
    count = spec.num_layers * len(spec.tensors())
    addrs = (BASE + rng.permutation(count) * (1 << 30)).reshape(spec.num_layers, len(spec.tensors()))
    bpb = np.array([t.bytes_per_block for t in spec.tensors()], dtype=np.int64)
    strides = bpb * int(rng.integers(1, 3))
    return KVRegion.from_addresses(spec, layer_blocks, addrs, block_strides=strides)


def outcome(fn: Any, *args: Any) -> Any:
    """What ``fn(*args)`` gives: its result, or the KVCacheError's message (a str)."""
    try:
        return fn(*args)
    except KVCacheError as exc:
        return f"KVCacheError: {exc}"


def same_pairs(a: Any, b: Any) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    return (a.per_row, a.src_top, a.dst_top) == (b.per_row, b.src_top, b.dst_top) and all(
        np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a[:4], b[:4]))


def id_arrays(data: Any, shape: tuple[int, ...], low: int, high: int) -> np.ndarray:
    values = data.draw(st.lists(st.integers(low, high), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    dtype = data.draw(st.sampled_from([np.int32, np.int64, np.int16]))
    return np.array(values, dtype=dtype).reshape(shape)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_c_pairs_are_the_numpy_pairs_and_bad_pairs_the_same_error(data) -> None:
    """``_copy_pairs`` (one C pass) keeps, orders and refuses block pairs exactly as ``_numpy_copy_pairs``: whole
    blocks or head-wise, ids -1 skipped, ids out of range, a destination written twice or shapes that differ named
    by the same error."""
    spec = CacheSpec(num_layers=2, num_kv_heads=data.draw(st.sampled_from([1, 2, 4])), head_dim=8, block_size=4)
    src = make_region(spec, [data.draw(st.integers(1, 9))] * 2, 1)
    dst = make_region(spec, [data.draw(st.integers(1, 9))] * 2, 2)
    heads = src.heads
    n = data.draw(st.integers(0, 12))
    form = data.draw(st.sampled_from(["whole", "rows", "table", "table rows", "other shapes"]))
    rows = None
    if form in ("rows", "table rows"):
        rows = data.draw(st.lists(st.integers(-1, heads), min_size=1, max_size=heads))
    low, high = (-1, 9) if data.draw(st.booleans()) else (-3, 11)
    if form in ("whole", "rows"):
        shapes = [(n,), (n,)]
    elif form == "table":
        shapes = [(heads, n), (heads, n)]
    elif form == "table rows":
        shapes = [(len(rows), n), (len(rows), n)]
    else:
        shapes = [(n,), (data.draw(st.integers(0, 12)),)]
    sb, db = (id_arrays(data, shape, low, high) for shape in shapes)
    if data.draw(st.booleans()) and db.size <= 10:  # distinct destinations: most pairs pass the duplicate check
        db = np.array(data.draw(st.permutations(range(-1, 9)))[:db.size], dtype=db.dtype).reshape(db.shape)
    fast = outcome(regions._copy_pairs, src, sb, dst, db, rows)
    reference = outcome(regions._numpy_copy_pairs, src, sb, dst, db, rows)
    assert same_pairs(fast, reference), (fast, reference)


def test_c_pairs_refuse_float_ids_as_numpy_does() -> None:
    """Block ids that are not integers are refused with the numpy path's error, the C pass never reading them."""
    spec = CacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4)
    src, dst = make_region(spec, [4], 1), make_region(spec, [4], 2)
    with pytest.raises(KVCacheError, match="src_blocks must hold integer block ids"):
        regions._copy_pairs(src, np.array([0.0, 1.0]), dst, np.array([0, 1]), None)
    with pytest.raises(KVCacheError, match="dst_blocks: 4 is not a block id"):
        regions._copy_pairs(src, np.array([0, 1]), dst, np.array([0, 4]), None)


def reference_row_pairs(src: KVRegion, src_blocks: Any, dst: KVRegion, dst_blocks: Any, cell_rows: Any,
                        layers: Any) -> list[tuple[np.ndarray, Any]]:
    """``_row_pairs`` with cell_rows as it was before the one-class path: every class through ``layer_classes``."""
    selected = regions._layer_ids(layers, src.num_layers)
    cells = np.asarray(cell_rows)
    if cells.shape != (src.num_layers, src.heads) or (cells.size and cells.dtype.kind not in "iu"):
        raise KVCacheError(f"cell_rows: must be integers [{src.num_layers} layers, {src.heads} kv heads], "
                           f"got shape {cells.shape}")
    tables = []
    for name, blocks in (("src_blocks", src_blocks), ("dst_blocks", dst_blocks)):
        arr = np.asarray(blocks)
        if arr.ndim != 2:
            raise KVCacheError(f"{name}: with cell_rows, a table [rows, n]; got shape {arr.shape}")
        tables.append(arr)
    if tables[0].shape != tables[1].shape:
        raise KVCacheError(f"src_blocks {tables[0].shape} and dst_blocks {tables[1].shape}: tables pair up one to one")
    if cells.size and (cells.min() < 0 or cells.max() >= tables[0].shape[0]):
        raise KVCacheError(f"cell_rows: names a row outside the tables' {tables[0].shape[0]} rows")
    return [(np.array(group, dtype=np.int64),
             regions._numpy_copy_pairs(src, rows_blocks(tables[0], picks), dst, rows_blocks(tables[1], picks), None))
            for picks, group in layer_classes(cells, selected.tolist()).items()]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_row_pairs_find_the_classes_and_errors_layer_classes_finds(data) -> None:
    """Where every layer reads the same rows, ``_row_pairs`` takes them as one class without ``layer_classes``: the
    same classes (layers in order), pairs and errors (a row outside the tables) as the general path."""
    spec = CacheSpec(num_layers=data.draw(st.integers(1, 5)), num_kv_heads=2, head_dim=8, block_size=4)
    src, dst = make_region(spec, [8] * spec.num_layers, 1), make_region(spec, [8] * spec.num_layers, 2)
    rows, m = data.draw(st.integers(1, 3)), data.draw(st.integers(0, 6))
    cell = st.integers(0, rows - (0 if data.draw(st.integers(0, 9)) == 0 else 1))
    if data.draw(st.booleans()):
        one = data.draw(st.lists(cell, min_size=2, max_size=2))
        cells = np.array([one] * spec.num_layers, dtype=np.int64)
    else:
        cells = np.array(data.draw(st.lists(st.lists(cell, min_size=2, max_size=2), min_size=spec.num_layers,
                                            max_size=spec.num_layers)), dtype=np.int64)
    tables = [np.array(data.draw(st.lists(st.integers(-1, 7), min_size=rows * m, max_size=rows * m)),
                       dtype=np.int32).reshape(rows, m) for _ in range(2)]
    layers = data.draw(st.sampled_from([None, [0], list(range(spec.num_layers))[::-1][:2], []]))
    fast = outcome(regions._row_pairs, src, tables[0], dst, tables[1], None, cells, layers)
    reference = outcome(reference_row_pairs, src, tables[0], dst, tables[1], cells, layers)
    if isinstance(reference, str) or isinstance(fast, str):
        assert fast == reference
        return
    assert isinstance(fast, list) and len(fast) == len(reference)
    for (group, pairs), (want_group, want_pairs) in zip(fast, reference):
        assert group.tolist() == want_group.tolist() and group.dtype == np.int64
        assert same_pairs(pairs, want_pairs)


def reference_layer_pair_ranges(src: KVRegion, dst: KVRegion, pairs: Any, layers: np.ndarray
                                ) -> tuple[CopyRanges, np.ndarray]:
    """The ranges of ``layers`` as they were worked out before ``_LayerRanges``: every array per call."""
    for region, block in ((src, pairs.src_block), (dst, pairs.dst_block)):
        regions._check_layer_blocks(region, block, layers)
    unit = np.tile(src.block_bytes // (src.heads if pairs.per_row else 1), layers.size)
    out = np.empty((3, unit.size * pairs.src_block.size), dtype=np.int64)
    starts = np.empty(layers.size + 1, dtype=np.int64)
    n = _ranges.pair_ranges(src.addrs[layers].ravel(), src.block_strides[layers].ravel(), dst.addrs[layers].ravel(),
                            dst.block_strides[layers].ravel(), unit, unit, np.ascontiguousarray(pairs.src_block),
                            np.ascontiguousarray(pairs.dst_block), np.ascontiguousarray(pairs.src_row),
                            len(src.tensors), out[0], out[1], out[2], starts)
    return CopyRanges(out[0, :n], out[1, :n], out[2, :n]), starts


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_layer_ranges_are_layer_pair_ranges_with_the_same_checks(data) -> None:
    """``_LayerRanges`` (per-copy work done once) gives the reference's ranges and layer starts for any run of
    layers (``between``) and any ascending selection of them (``layers``), and names the same layer when a windowed
    layer holds fewer blocks than an id."""
    layers = data.draw(st.integers(1, 5))
    spec = CacheSpec(num_layers=layers, num_kv_heads=data.draw(st.sampled_from([1, 2])), head_dim=8, block_size=4)
    counts = [data.draw(st.integers(3, 8)) for _ in range(2)]
    short = [[data.draw(st.integers(1, c)) if data.draw(st.integers(0, 3)) == 0 else c for _ in range(layers)]
             for c in counts]
    src, dst = make_region(spec, short[0], 1), make_region(spec, short[1], 2)
    counts = [max(c) for c in short]  # the regions' num_blocks: ids past a short layer's blocks are still ids
    n = data.draw(st.integers(0, counts[1] + 1))
    sb = np.array(data.draw(st.lists(st.integers(-1, counts[0] - 1), min_size=n, max_size=n)), dtype=np.int64)
    db = np.array(data.draw(st.permutations(range(counts[1] + 1))), dtype=np.int64)[:n] - 1
    head_wise = data.draw(st.booleans())
    if head_wise:
        sb, db = np.tile(sb, (src.heads, 1)), np.tile(db, (src.heads, 1))
    pairs = regions._copy_pairs(src, sb, dst, db, None)
    a = data.draw(st.integers(0, layers - 1))
    b = data.draw(st.integers(a + 1, layers))
    picked = np.array(sorted(data.draw(st.sets(st.integers(0, layers - 1), min_size=1))), dtype=np.int64)
    ranges = regions._LayerRanges(src, dst, pairs)
    for fast, reference in ((outcome(ranges.between, a, b),
                             outcome(reference_layer_pair_ranges, src, dst, pairs, np.arange(a, b))),
                            (outcome(ranges.layers, picked),
                             outcome(reference_layer_pair_ranges, src, dst, pairs, picked))):
        if isinstance(reference, str) or isinstance(fast, str):
            assert fast == reference
            continue
        (got, got_starts), (want, want_starts) = fast, reference
        assert got_starts.tolist() == want_starts.tolist()
        assert all(x.tolist() == y.tolist() for x, y in zip(got, want))


def numpy_runs(addr: np.ndarray, length: np.ndarray) -> tuple[int, int]:
    """``StagedCopier.suits``'s runs as numpy worked them out: sorted stably by address, a run per break."""
    order = np.argsort(addr, kind="stable")
    host, size = addr[order], length[order]
    runs = 1 + int(np.count_nonzero(host[1:] != host[:-1] + size[:-1])) if addr.size else 0
    return runs, int(length.sum())


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_host_runs_are_the_runs_of_the_sorted_ranges(data) -> None:
    """``_ranges.host_runs`` counts the runs numpy's stable argsort finds, for sorted, shuffled, touching,
    overlapping and repeated ranges."""
    n = data.draw(st.integers(0, 40))
    length = np.array(data.draw(st.lists(st.integers(1, 4), min_size=n, max_size=n)), dtype=np.int64) * 8
    if data.draw(st.booleans()):
        addr = np.cumsum(length) - length + BASE
        if data.draw(st.booleans()):
            addr = addr[np.array(data.draw(st.permutations(range(n))), dtype=np.int64)] if n else addr
            length = length  # shuffled addresses keep their own lengths' places: runs break where they break
    else:
        addr = np.array(data.draw(st.lists(st.integers(0, 30), min_size=n, max_size=n)), dtype=np.int64) * 8 + BASE
    assert _ranges.host_runs(addr, length) == numpy_runs(addr, length)


def test_suits_judges_as_before_on_the_bench_shapes() -> None:
    """A 4,096-token request's first layer (32 KiB blocks, scattered on the GPU, one host run or scattered) is judged
    staged or direct as numpy's runs judged it."""
    rng = np.random.default_rng(3)
    unit, n = 32 << 10, 512
    gpu = rng.permutation(2 * n)[:n].astype(np.int64) * unit + BASE
    length = np.full(n, unit, dtype=np.int64)
    for host in (np.arange(n, dtype=np.int64) * unit, rng.permutation(4 * n)[:n].astype(np.int64) * unit):
        runs, total = numpy_runs(host, length)
        for to_host in (True, False):
            ranges = CopyRanges(gpu, host, length) if to_host else CopyRanges(host, gpu, length)
            assert staged.StagedCopier.suits(ranges, to_host) == (total // runs >= staged.MIN_RUN_BYTES)


def numpy_slot_table(plan: Any, slots: int, stride: int, first: int, to_host: bool) -> tuple[np.ndarray, np.ndarray]:
    """The slot math ``StagedCopier._enqueue`` did in numpy before ``_ranges.slot_table``."""
    slot_of = (first + np.arange(plan.num_pieces)) % staged.SLOTS
    base = slots + slot_of.astype(np.int64) * stride
    placed = base[plan.piece] + plan.offset
    rows = (plan.gpu, placed, plan.length) if to_host else (placed, plan.gpu, plan.length)
    return np.concatenate(rows).astype(np.int64), (base[plan.dma_piece] + plan.dma_offset).astype(np.int64)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_slot_table_is_the_numpy_slot_math(data) -> None:
    """``_slot_table`` places every range and DMA of a plan in the ring as the numpy slot math did, from any slot."""
    layers = data.draw(st.integers(1, 4))
    per_layer = data.draw(st.lists(st.integers(0, 12), min_size=layers, max_size=layers))
    total = sum(per_layer)
    unit = 1 << 20
    lengths = np.array(data.draw(st.lists(st.integers(1, 3), min_size=total, max_size=total)), dtype=np.int64) * unit
    gpu = np.array(data.draw(st.permutations(range(2 * total + 1)))[:total], dtype=np.int64) * 4 * unit + BASE
    host = np.array(data.draw(st.permutations(range(2 * total + 1)))[:total], dtype=np.int64) * 4 * unit + BASE
    to_host = data.draw(st.booleans())
    ranges = CopyRanges(gpu, host, lengths) if to_host else CopyRanges(host, gpu, lengths)
    plan = staged._plan(ranges, np.concatenate(([0], np.cumsum(per_layer))).astype(np.int64), to_host)
    slots, stride, first = BASE * 2, staged.SLOT_BYTES + staged.CHUNK_BYTES, data.draw(st.integers(0, 7))
    rows, placed = staged._slot_table(plan, slots, stride, first, to_host)
    want_rows, want_placed = numpy_slot_table(plan, slots, stride, first, to_host)
    assert rows.tolist() == want_rows.tolist()
    assert placed.tolist() == want_placed.tolist()

"""KVRegion: registration checks against the CacheSpec, and byte ranges that cover exactly the listed blocks."""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.allocator import CacheSpec, KVCacheError, QuantType
from kvcache.transfer.regions import CopyRanges, KVRegion, copy_ranges, copy_ranges_by_layers, describe_tensor

from caches import random_views

LAYOUTS = ("separate", "interleaved")


def make_spec(**overrides: Any) -> CacheSpec:
    fields = dict(num_layers=2, num_kv_heads=4, head_dim=8, block_size=4, dtype="bfloat16")
    fields.update(overrides)
    return CacheSpec(**fields)


class Cache:
    """A region's numpy storage: one byte buffer, and per (layer, tensor) a view shaped as the spec says."""

    def __init__(self, spec: CacheSpec, num_blocks: int, layout: str, seed: int = 0) -> None:
        self.spec = spec
        self.buffer, self.views = random_views(spec, num_blocks, seed, layout)
        self.region = KVRegion.from_tensors(spec, self.views)

    @property
    def base(self) -> int:
        return self.buffer.ctypes.data

    def mark(self, blocks: np.ndarray, rows: np.ndarray | None, layers: range) -> np.ndarray:
        """Slow reference: a bool per byte, set for every byte numpy's own indexing says the units hold."""
        mask = np.zeros(self.buffer.size, dtype=bool)
        for layer in layers:
            for view in self.views[layer]:
                for b, r in _pairs(blocks, rows):
                    piece = view[b] if r is None else view[b, r]
                    start = piece.__array_interface__["data"][0] - self.base
                    mask[start:start + piece.nbytes] = True
        return mask


def _pairs(blocks: np.ndarray, rows: np.ndarray | None) -> list[tuple[int, int | None]]:
    """(block, row) units a selection names, -1 skipped; rows None means whole blocks."""
    if rows is None:
        return [(int(b), None) for b in blocks if b >= 0]
    if blocks.ndim == 1:
        return [(int(b), int(r)) for r in rows for b in blocks if b >= 0]
    return [(int(b), int(r)) for r, ids in zip(rows, blocks) for b in ids if b >= 0]


def coverage(ranges_addr: np.ndarray, length: np.ndarray, base: int, size: int) -> np.ndarray:
    """How many ranges cover each byte of [base, base + size)."""
    count = np.zeros(size + 1, dtype=np.int64)
    np.add.at(count, ranges_addr - base, 1)
    np.add.at(count, ranges_addr - base + length, -1)
    return np.cumsum(count)[:-1]


@st.composite
def specs(draw: st.DrawFn) -> CacheSpec:
    """Any quant type, either scale layout, 1-3 layers, small geometry."""
    quant = draw(st.sampled_from(list(QuantType)))
    layers = draw(st.integers(1, 3))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    if quant.is_mla:
        return CacheSpec(num_layers=layers, quant=quant, block_size=block_size,
                         kv_lora_rank=draw(st.sampled_from([128, 256])), qk_rope_head_dim=draw(st.sampled_from([16, 64])),
                         dtype=draw(st.sampled_from(["bfloat16", "float16"])))
    return CacheSpec(num_layers=layers, quant=quant, block_size=block_size,
                     num_kv_heads=draw(st.sampled_from([1, 2, 4])), head_dim=draw(st.sampled_from([4, 8, 16])),
                     dtype=draw(st.sampled_from(["bfloat16", "float16", "float32"])),
                     scale_layout=draw(st.sampled_from(["default", "blackwell"])))


@st.composite
def selections(draw: st.DrawFn, num_blocks: int, heads: int, unique: bool = False
               ) -> tuple[np.ndarray, np.ndarray | None]:
    """A uniform id list, the same ids for some rows, or a head-wise [rows, n] table; -1 holes included."""
    mode = draw(st.sampled_from(["uniform", "rows", "head-wise"]))
    n = draw(st.integers(0, num_blocks))
    ids = st.lists(st.integers(-1, num_blocks - 1), min_size=n, max_size=n)
    if unique:
        ids = st.permutations(list(range(num_blocks))).map(lambda p: p[:n])
    if mode == "uniform":
        return np.array(draw(ids), dtype=np.int64), None
    if mode == "rows":
        rows = draw(st.lists(st.integers(0, heads - 1), min_size=1, max_size=heads, unique=True))
        return np.array(draw(ids), dtype=np.int64), np.array(rows)
    rows = np.arange(heads)
    return np.array([draw(ids) for _ in rows], dtype=np.int64).reshape(heads, n), rows


# -- ranges cover exactly the listed blocks ---------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(data=st.data(), spec=specs(), num_blocks=st.integers(1, 12), layout=st.sampled_from(LAYOUTS))
def test_ranges_cover_exactly_the_bytes_of_the_listed_blocks_and_never_overlap(data, spec, num_blocks, layout):
    """For every quant type, both table modes and both layouts: union of ranges == reference marks, no byte twice."""
    cache = Cache(spec, num_blocks, layout)
    blocks, rows = data.draw(selections(num_blocks, cache.region.heads))
    layers = data.draw(st.sampled_from([None, [0], list(range(spec.num_layers))[::-1]]))
    got = cache.region.ranges(blocks, rows, layers)
    count = coverage(got.addr, got.length, cache.base, cache.buffer.size)
    assert count.max(initial=0) <= 1, "merged ranges overlap"
    chosen = range(spec.num_layers) if layers is None else layers
    assert np.array_equal(count == 1, cache.mark(blocks, rows, chosen))
    assert got.nbytes == int(cache.mark(blocks, rows, chosen).sum())


@settings(max_examples=100, deadline=None)
@given(data=st.data(), spec=specs(), num_blocks=st.integers(1, 12), layout=st.sampled_from(LAYOUTS))
def test_ranges_are_maximal_no_two_consecutive_ranges_touch(data, spec, num_blocks, layout):
    cache = Cache(spec, num_blocks, layout)
    blocks, rows = data.draw(selections(num_blocks, cache.region.heads))
    got = cache.region.ranges(blocks, rows)
    assert not np.any(got.addr[1:] == got.addr[:-1] + got.length[:-1])


def _copy_case(data: st.DataObject, spec: CacheSpec, num_blocks: int, layouts: tuple[str, str]) -> tuple:
    """Two caches and a copy between them: distinct destinations (or -1), any sources (or -1), maybe per head."""
    src, dst = Cache(spec, num_blocks, layouts[0], seed=1), Cache(spec, num_blocks, layouts[1], seed=2)
    dst_blocks, rows = data.draw(selections(num_blocks, src.region.heads, unique=True))
    src_blocks = np.array(data.draw(st.lists(st.integers(-1, num_blocks - 1), min_size=dst_blocks.size,
                                             max_size=dst_blocks.size)), dtype=np.int64).reshape(dst_blocks.shape)
    return src, dst, src_blocks, dst_blocks, rows


@settings(max_examples=100, deadline=None)
@given(data=st.data(), spec=specs(), num_blocks=st.integers(1, 12),
       layouts=st.tuples(st.sampled_from(LAYOUTS), st.sampled_from(LAYOUTS)))
def test_copy_ranges_move_each_listed_unit_onto_its_partner_and_nothing_else(data, spec, num_blocks, layouts):
    """A memmove over copy_ranges equals numpy's per-unit copy; destinations never overlap."""
    src, dst, src_blocks, dst_blocks, rows = _copy_case(data, spec, num_blocks, layouts)
    want = dst.buffer.copy()
    expected = [[np.ndarray(v.shape, v.dtype, buffer=want, offset=v.__array_interface__["data"][0] - dst.base,
                            strides=v.strides) for v in row] for row in dst.views]
    for layer in range(spec.num_layers):
        for sv, ev in zip(src.views[layer], expected[layer]):
            for (sb, r), (db, _) in zip(_pairs(np.where(dst_blocks >= 0, src_blocks, -1), rows),
                                        _pairs(np.where(src_blocks >= 0, dst_blocks, -1), rows)):
                if r is None:
                    ev[db] = sv[sb]
                else:
                    ev[db, r] = sv[sb, r]
    got = copy_ranges(src.region, src_blocks, dst.region, dst_blocks, rows=rows)
    count = coverage(got.dst, got.length, dst.base, dst.buffer.size)
    assert count.max(initial=0) <= 1, "destination ranges overlap"
    for s, d, n in zip(got.src.tolist(), got.dst.tolist(), got.length.tolist()):
        ctypes.memmove(d, s, n)
    assert np.array_equal(dst.buffer, want)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), spec=specs(), num_blocks=st.integers(1, 12),
       layouts=st.tuples(st.sampled_from(LAYOUTS), st.sampled_from(LAYOUTS)))
def test_copy_ranges_by_layers_gives_each_groups_copy_ranges(data, spec, num_blocks, layouts):
    """Checked and sorted once, the pairs give every layer group exactly its own copy_ranges."""
    src, dst, src_blocks, dst_blocks, rows = _copy_case(data, spec, num_blocks, layouts)
    groups = data.draw(st.lists(st.lists(st.integers(0, spec.num_layers - 1), min_size=1, max_size=3,
                                         unique=True), min_size=1, max_size=4))
    got = list(copy_ranges_by_layers(src.region, src_blocks, dst.region, dst_blocks, groups, rows=rows))
    assert len(got) == len(groups)
    for layers, ranges in zip(groups, got):
        want = copy_ranges(src.region, src_blocks, dst.region, dst_blocks, layers=layers, rows=rows)
        for a, b in zip(ranges, want):
            assert np.array_equal(a, b)


@st.composite
def layer_group_cases(draw: st.DrawFn) -> tuple:
    """A spec, each (layer, head) cell's row, layer block counts shared by a row's layers, and tables [rows, n]."""
    spec = draw(specs())
    heads = spec.kv_heads_per_rank
    num_rows = draw(st.integers(1, 4))
    cells = np.array(draw(st.lists(st.lists(st.integers(0, num_rows - 1), min_size=heads, max_size=heads),
                                   min_size=spec.num_layers, max_size=spec.num_layers)), dtype=np.int64)
    row_blocks = draw(st.lists(st.integers(1, 8), min_size=num_rows, max_size=num_rows))
    # A layer's tensors have one count: the largest of its rows' pools; its rows' ids stay below their own.
    layer_blocks = [max(row_blocks[r] for r in set(cells[layer].tolist())) for layer in range(spec.num_layers)]
    n = draw(st.integers(0, 6))
    src, dst = [], []
    for r in range(num_rows):
        src.append(draw(st.lists(st.integers(-1, row_blocks[r] - 1), min_size=n, max_size=n)))
        ids = draw(st.permutations(list(range(row_blocks[r])) + [-1] * n))[:n]
        dst.append(ids)
    return spec, cells, layer_blocks, np.array(src, dtype=np.int64).reshape(num_rows, n), \
        np.array(dst, dtype=np.int64).reshape(num_rows, n)


@settings(max_examples=100, deadline=None)
@given(case=layer_group_cases(), layouts=st.tuples(st.sampled_from(LAYOUTS), st.sampled_from(LAYOUTS)))
def test_copy_ranges_with_cell_rows_move_each_layers_heads_from_their_own_rows(case, layouts):
    """Tables whose rows are layer groups (or groups and heads): layer l's head h moves row cell_rows[l, h]'s
    blocks, in layers whose tensors hold different block counts; a memmove over the ranges equals numpy's copy."""
    spec, cells, layer_blocks, src_table, dst_table = case
    src_buf, src_views = random_views(spec, layer_blocks, 1, layouts[0])
    dst_buf, dst_views = random_views(spec, layer_blocks, 2, layouts[1])
    src = KVRegion.from_tensors(spec, src_views)
    dst = KVRegion.from_tensors(spec, dst_views)
    assert src.layer_blocks.tolist() == layer_blocks and src.num_blocks == max(layer_blocks)
    want = dst_buf.copy()
    base = dst_buf.ctypes.data
    for layer in range(spec.num_layers):
        for sv, dv in zip(src_views[layer], dst_views[layer]):
            ev = np.ndarray(dv.shape, dv.dtype, buffer=want, offset=dv.__array_interface__["data"][0] - base,
                            strides=dv.strides)
            for h in range(dv.shape[1]):
                r = cells[layer, h]
                for sb, db in zip(src_table[r].tolist(), dst_table[r].tolist()):
                    if sb >= 0 and db >= 0:
                        ev[db, h] = sv[sb, h]
    got = copy_ranges(src, src_table, dst, dst_table, cell_rows=cells)
    assert coverage(got.dst, got.length, base, dst_buf.size).max(initial=0) <= 1, "destination ranges overlap"
    for s, d, length in zip(got.src.tolist(), got.dst.tolist(), got.length.tolist()):
        ctypes.memmove(d, s, length)
    assert np.array_equal(dst_buf, want)
    groups = list(copy_ranges_by_layers(src, src_table, dst, dst_table, [[i] for i in range(spec.num_layers)],
                                        cell_rows=cells))
    assert sum(int(g.length.sum()) for g in groups) == int(got.length.sum())


def test_a_block_id_past_its_layers_pool_is_refused_by_name():
    """Layer 1 holds 2 blocks: a table row that addresses it with id 3 is an error naming the layer."""
    spec = make_spec()
    _, views = random_views(spec, [4, 2], 0)
    region = KVRegion.from_tensors(spec, views)
    table = np.array([[3], [3]])
    cells = np.array([[0] * 4, [1] * 4])
    with pytest.raises(KVCacheError, match="not a block id of layer 1, which holds 2 blocks"):
        copy_ranges(region, table, region, table[::-1].copy() * 0, cell_rows=cells)
    copy_ranges(region, np.array([[3], [1]]), region, np.array([[0], [0]]), cell_rows=cells)


def test_a_region_with_layer_counts_survives_its_description():
    spec = make_spec()
    _, views = random_views(spec, [4, 2], 0)
    region = KVRegion.from_tensors(spec, views)
    again = KVRegion.from_description(region.describe(), owner="peer")
    assert again.layer_blocks.tolist() == [4, 2] and np.array_equal(again.spans(), region.spans())
    assert int(region.extents().length.sum()) == spec.bytes_per_block_per_layer * 6


def test_copy_ranges_by_layers_checks_the_pairs_before_the_first_group():
    spec = make_spec()
    src, dst = Cache(spec, 4, "separate", seed=1), Cache(spec, 4, "separate", seed=2)
    with pytest.raises(KVCacheError, match="written twice"):
        copy_ranges_by_layers(src.region, np.array([0, 1]), dst.region, np.array([2, 2]), [[0]])
    groups = copy_ranges_by_layers(src.region, np.array([0, 1]), dst.region, np.array([2, 3]), [[0], [99]])
    next(groups)
    with pytest.raises(KVCacheError, match="layers: 99"):
        next(groups)


def test_consecutive_ids_merge_into_one_range_per_layer_and_tensor():
    spec = make_spec(quant="block_wise_fp8")
    cache = Cache(spec, 16, "separate")
    got = cache.region.ranges(np.arange(3, 9))
    assert got.length.tolist() == [6 * t.bytes_per_block for t in spec.tensors()] * spec.num_layers


def test_every_head_of_consecutive_blocks_merges_like_whole_blocks():
    """Head-wise units of all rows, same ids per row, are one range per (layer, tensor) when blocks are dense."""
    spec = make_spec()
    cache = Cache(spec, 16, "separate")
    table = np.tile(np.arange(5, 10), (4, 1))
    assert cache.region.ranges(table).length.tolist() == cache.region.ranges(np.arange(5, 10)).length.tolist()


def test_one_head_of_consecutive_blocks_is_one_range_per_block():
    """Head 2's slice of block b is contiguous only within b: 3 blocks give 3 ranges per (layer, tensor)."""
    spec = make_spec(num_layers=1)
    cache = Cache(spec, 16, "separate")
    got = cache.region.ranges([4, 5, 6], rows=[2])
    assert got.length.tolist() == [4 * 8 * 2] * 6


def test_scattered_ids_are_returned_in_address_order_and_duplicates_count_once():
    spec = make_spec(num_layers=1, quant="mla", num_kv_heads=None, head_dim=None, kv_lora_rank=128, qk_rope_head_dim=64)
    cache = Cache(spec, 16, "separate")
    bpb = spec.tensors()[0].bytes_per_block
    got = cache.region.ranges([9, 2, 3, 9, -1, 4])
    assert (got.addr - cache.base).tolist() == [2 * bpb, 9 * bpb]
    assert got.length.tolist() == [3 * bpb, bpb]


def test_copy_ranges_merge_only_where_both_sides_continue():
    spec = make_spec(num_layers=1, quant="fp8")
    src, dst = Cache(spec, 16, "separate"), Cache(spec, 16, "separate")
    bpb = spec.tensors()[0].bytes_per_block
    got = copy_ranges(src.region, [1, 2, 3, 4], dst.region, [10, 11, 0, 1])
    assert ((got.src - src.base) % (16 * bpb)).tolist() == [1 * bpb, 3 * bpb, 1 * bpb, 3 * bpb]
    assert got.length.tolist() == [2 * bpb, 2 * bpb] * 2


# -- registration ---------------------------------------------------------------------------------

def test_a_wrong_shape_names_the_layer_and_tensor():
    spec = make_spec()
    caches = {"key": [np.zeros((10, 4, 4, 8), np.uint16)] * 2,
              "value": [np.zeros((10, 4, 4, 8), np.uint16), np.zeros((10, 4, 8, 8), np.uint16)]}
    with pytest.raises(KVCacheError, match=r"layer 1 tensor 'value': shape \[10, 4, 8, 8\].*needs \[10, 4, 4, 8\]"):
        KVRegion.from_tensors(spec, caches)


def test_a_different_float_dtype_of_the_same_width_is_refused():
    spec = make_spec()
    with pytest.raises(KVCacheError, match="layer 0 tensor 'key': dtype float16, but the spec stores bfloat16"):
        KVRegion.from_tensors(spec, {n: [np.zeros((10, 4, 4, 8), np.float16)] * 2 for n in ("key", "value")})


def test_a_wrong_element_width_is_refused():
    spec = make_spec(quant="int8")
    with pytest.raises(KVCacheError, match="2-byte elements, but the spec stores int8"):
        KVRegion.from_tensors(spec, {n: [np.zeros((10, 4, 4, 8), np.uint16)] * 2 for n in ("key", "value")})


def test_a_block_that_is_not_contiguous_is_refused():
    spec = make_spec(num_layers=1)
    wide = np.zeros((10, 4, 4, 16), np.uint16)
    with pytest.raises(KVCacheError, match="layer 0 tensor 'key': each block must be C-contiguous"):
        KVRegion.from_tensors(spec, [{"key": wide[..., :8], "value": wide[..., 8:]}])


def test_missing_tensors_and_layer_counts_are_named():
    spec = make_spec(quant="block_wise_fp8")
    with pytest.raises(KVCacheError, match="the spec lists key, value, key_scale, value_scale"):
        KVRegion.from_tensors(spec, {"key": [], "value": []})
    with pytest.raises(KVCacheError, match="caches has 1 layers"):
        KVRegion.from_tensors(make_spec(), [[np.zeros((4, 4, 4, 8), np.uint16)] * 2])


def test_stacked_layer_tensors_register_per_layer():
    """{'key': [L, blocks, ...]} is split along layers; the block stride is read, not assumed."""
    spec = make_spec(num_layers=3)
    stacked = {n: np.zeros((3, 10, 4, 4, 8), np.uint16) for n in ("key", "value")}
    region = KVRegion.from_tensors(spec, stacked)
    assert region.addrs[2, 1] == stacked["value"][2].ctypes.data
    assert region.block_strides.tolist() == [[256, 256]] * 3


def test_paddle_tensors_register_with_their_dtype_checked():
    paddle = pytest.importorskip("paddle")
    spec = make_spec()
    caches = {n: [paddle.zeros([10, 4, 4, 8], dtype="bfloat16") for _ in range(2)] for n in ("key", "value")}
    region = KVRegion.from_tensors(spec, caches)
    assert region.device == "cpu" and region.num_blocks == 10
    assert region.addrs[1, 0] == caches["key"][1].data_ptr()
    assert describe_tensor(caches["key"][0]).dtype == "bfloat16"


def test_torch_tensors_register_through_dlpack():
    torch = pytest.importorskip("torch")
    spec = make_spec(quant="fp8")
    caches = {n: [torch.zeros((10, 4, 4, 8), dtype=torch.uint8) for _ in range(2)] for n in ("key", "value")}
    region = KVRegion.from_tensors(spec, caches)
    assert region.addrs[0, 1] == caches["value"][0].data_ptr()


def test_raw_addresses_and_the_wire_description_round_trip():
    spec = make_spec(quant="block_wise_fp8", scale_layout="blackwell")
    cache = Cache(spec, 6, "interleaved")
    region = KVRegion.from_description(cache.region.describe(), owner="peer-1")
    assert region.owner == "peer-1" and region.spec == spec
    assert np.array_equal(region.addrs, cache.region.addrs)
    assert np.array_equal(region.ranges([1, 4]).addr, cache.region.ranges([1, 4]).addr)


def test_extents_merge_the_interleaved_tensors_of_a_layer():
    spec = make_spec(quant="block_wise_fp8")
    cache = Cache(spec, 6, "interleaved")
    assert cache.region.extents().length.tolist() == [cache.buffer.size]


def test_block_ids_rows_and_layers_are_checked():
    region = Cache(make_spec(), 8, "separate").region
    with pytest.raises(KVCacheError, match="8 is not a block id of a region with 8 blocks"):
        region.ranges([1, 8])
    with pytest.raises(KVCacheError, match="rows: head 4 is out of range for 4 kv heads"):
        region.ranges([1], rows=[4])
    with pytest.raises(KVCacheError, match=r"a head-wise selection is \[rows, blocks\] with 4 rows"):
        region.ranges(np.zeros((3, 2), np.int64))
    with pytest.raises(KVCacheError, match="layers: 2 is out of range for 2 layers"):
        region.ranges([1], layers=[2])


def test_a_destination_written_twice_is_refused():
    a, b = Cache(make_spec(), 8, "separate").region, Cache(make_spec(), 8, "separate").region
    with pytest.raises(KVCacheError, match="dst_blocks: block 3 is written twice"):
        copy_ranges(a, [1, 2], b, [3, 3])


def test_regions_of_different_specs_cannot_be_paired():
    a = Cache(make_spec(), 8, "separate").region
    b = Cache(make_spec(quant="int8"), 8, "separate").region
    with pytest.raises(KVCacheError, match="different tensors per block"):
        copy_ranges(a, [1], b, [1])


@pytest.mark.parametrize("quant", [QuantType.NONE, QuantType.BLOCK_WISE_FP8, QuantType.MLA])
def test_a_region_over_one_buffer_lays_out_layers_then_tensors_then_blocks(quant):
    """from_buffer gives the addresses the typed views of the same buffer register with."""
    mla = dict(num_kv_heads=None, head_dim=None, kv_lora_rank=16, qk_rope_head_dim=8)
    spec = make_spec(quant=quant, **(mla if quant is QuantType.MLA else {}))
    buffer, views = random_views(spec, 5, seed=1)
    region = KVRegion.from_buffer(spec, 5, buffer.ctypes.data, keep=(buffer,))
    assert np.array_equal(region.addrs, KVRegion.from_tensors(spec, views).addrs)
    assert region.extents().nbytes == buffer.nbytes == spec.cache_bytes(5)


def test_select_keeps_each_range_whole_and_in_the_order_asked():
    r = CopyRanges(np.array([10, 20, 30]), np.array([110, 120, 130]), np.array([1, 2, 3]))
    for index, want in ((slice(1, 3), [1, 2]), (np.array([2, 0]), [2, 0]), (np.array([True, False, True]), [0, 2])):
        got = r.select(index)
        assert [list(f) for f in got] == [list(f[want]) for f in r]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), units=st.integers(1, 40), parts=st.integers(1, 4))
def test_joined_copies_move_the_same_bytes_as_their_parts_in_no_more_ranges(data, units, parts):
    """Disjoint unit-sized copies split among parts: one joined copy writes the same destination, merged."""
    from kvcache.transfer.regions import CopyRanges

    unit = 4
    src_units = data.draw(st.permutations(range(units)))
    dst_units = data.draw(st.permutations(range(units)))
    cuts = sorted(data.draw(st.lists(st.integers(0, units), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, units]
    pieces = [CopyRanges(np.array(src_units[a:b], dtype=np.int64) * unit, np.array(dst_units[a:b], dtype=np.int64) * unit,
                         np.full(b - a, unit, dtype=np.int64)) for a, b in zip(bounds, bounds[1:])]
    source = np.arange(units * unit, dtype=np.uint8)

    def apply(copies: list[CopyRanges]) -> np.ndarray:
        out = np.zeros_like(source)
        for c in copies:
            for s, d, n in zip(c.src.tolist(), c.dst.tolist(), c.length.tolist()):
                out[d:d + n] = source[s:s + n]
        return out

    joined = CopyRanges.joined(pieces)
    assert np.array_equal(apply([joined]), apply(pieces))
    assert joined.nbytes == units * unit and joined.num_ranges <= units
    if parts == 1:
        assert joined is pieces[0]
        return
    assert np.all(np.diff(joined.src) > 0)  # in source order
    if src_units == dst_units == list(range(units)):
        assert joined.num_ranges == 1  # neighbours on both sides: one range


class _DeviceTensor:
    """A CUDA tensor as a framework without DLPack shows it: the CUDA array interface plus a device object."""

    def __init__(self, device: object) -> None:
        self.device = device
        self.__cuda_array_interface__ = {"shape": (4, 8), "typestr": "<u1", "data": (0x7F0000000000, False),
                                         "version": 3, "strides": None}


class _TorchDevice:
    def __init__(self, index: int | None) -> None:
        self.type, self.index = "cuda", index


class _CupyDevice:
    def __init__(self, id: int) -> None:
        self.id = id


@pytest.mark.parametrize("device, want", [(_TorchDevice(1), "cuda:1"), (_TorchDevice(0), "cuda:0"),
                                          (_CupyDevice(3), "cuda:3")])
def test_a_cuda_array_interface_tensor_is_on_the_device_its_framework_names(device, want) -> None:
    """PyTorch names its device ``index`` and CuPy ``id``: a tensor on the second GPU is not taken for the first
    (its copies would run on the wrong GPU and fault)."""
    assert describe_tensor(_DeviceTensor(device)).device == want


def test_a_cuda_tensor_whose_device_cannot_be_read_is_refused_not_guessed() -> None:
    with pytest.raises(TypeError, match="CUDA device cannot be read"):
        describe_tensor(_DeviceTensor(_TorchDevice(None)))
    with pytest.raises(TypeError, match="CUDA device cannot be read"):
        describe_tensor(_DeviceTensor(None))


class _PlacedTensor:
    """A tensor read through ``data_ptr()`` with a Paddle-style place."""

    def __init__(self, place: str) -> None:
        self.place, self.shape, self.strides, self.dtype = place, (4, 8), None, "uint8"

    def data_ptr(self) -> int:
        return 0x7F0000000000

    def element_size(self) -> int:
        return 1


@pytest.mark.parametrize("place, device, pinned", [("Place(gpu:1)", "cuda:1", False), ("Place(gpu:0)", "cuda:0", False),
                                                   ("Place(gpu_pinned)", "cpu", True), ("Place(cpu)", "cpu", False)])
def test_a_data_ptr_tensor_is_on_the_device_its_place_names(place: str, device: str, pinned: bool) -> None:
    info = describe_tensor(_PlacedTensor(place))
    assert (info.device, info.pinned) == (device, pinned)


def test_a_data_ptr_tensor_on_a_gpu_of_no_number_is_refused_not_guessed() -> None:
    with pytest.raises(TypeError, match="CUDA device cannot be read"):
        describe_tensor(_PlacedTensor("gpu"))

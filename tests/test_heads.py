"""Head re-slicing between TP layouts: every decode (layer, tensor, block, head) byte is written exactly once, from a rank holding that head."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.allocator import CacheSpec, KVCacheError
from kvcache.allocator.layout import DTYPE_BYTES
from kvcache.transfer.heads import Route, head_routes, rank_heads, route_ranges
from kvcache.transfer.regions import KVRegion

from caches import RAW



def make_spec(heads: int, tp: int, quant: str = "none", **overrides: Any) -> CacheSpec:
    if quant == "mla":
        return CacheSpec(num_layers=2, block_size=4, quant="mla", kv_lora_rank=8, qk_rope_head_dim=4, tp_size=tp)
    fields: dict[str, Any] = dict(num_layers=2, num_kv_heads=heads, head_dim=8, block_size=4, quant=quant, tp_size=tp)
    if quant == "block_wise_fp8":
        fields["scale_layout"] = "blackwell"
    fields.update(overrides)
    return CacheSpec(**fields)


class Model:
    """Every (layer, tensor) of the whole model as one random array ``[blocks, H, ...]``: the truth ranks slice."""

    def __init__(self, spec: CacheSpec, num_blocks: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        heads = spec.num_kv_heads
        self.spec, self.num_blocks = spec, num_blocks
        self.arrays = [[rng.integers(0, 2**16, (num_blocks, heads, *t.block_shape[1:])).astype(RAW[DTYPE_BYTES[t.dtype]])
                        for t in spec.tensors()] for _ in range(spec.num_layers)]

    def rank_cache(self, tp: int, rank: int) -> list[list[np.ndarray]]:
        """What rank ``rank`` of a ``tp``-way group stores: its heads of every block."""
        rows = list(rank_heads(self.spec.num_kv_heads, tp, rank))
        return [[a[:, rows].copy() for a in layer] for layer in self.arrays]


def apply(ranges: Any, src: list[list[np.ndarray]], dst: list[list[np.ndarray]], counts: list[list[np.ndarray]]) -> None:
    """Carry out copy ranges between numpy caches by address, counting how often each destination byte is written."""
    def locate(cache: list[list[np.ndarray]], addr: int, n: int) -> tuple[int, int, int]:
        for i, layer in enumerate(cache):
            for j, a in enumerate(layer):
                base = a.ctypes.data
                if base <= addr and addr + n <= base + a.nbytes:
                    return i, j, addr - base
        raise AssertionError(f"range {addr:#x}+{n} is in no tensor")

    for s, d, n in zip(ranges.src.tolist(), ranges.dst.tolist(), ranges.length.tolist()):
        si, sj, so = locate(src, s, n)
        di, dj, do = locate(dst, d, n)
        dst[di][dj].view(np.uint8).reshape(-1)[do:do + n] = src[si][sj].view(np.uint8).reshape(-1)[so:so + n]
        counts[di][dj].reshape(-1)[do:do + n] += 1


@settings(max_examples=60, deadline=None)
@given(heads=st.sampled_from([1, 2, 4, 8]), src_tp=st.sampled_from([1, 2, 4, 8]), dst_tp=st.sampled_from([1, 2, 4, 8]),
       quant=st.sampled_from(["none", "block_wise_fp8", "int4_zp", "mla"]), data=st.data())
def test_every_decode_head_byte_is_written_exactly_once_from_a_rank_holding_it(heads, src_tp, dst_tp, quant, data):
    """Equal TP, either dividing the other, and replicated heads (H < tp): the decode caches end up as the model says."""
    if quant == "mla":
        heads = 1
    num_blocks = 6
    src_spec, dst_spec = make_spec(heads, src_tp, quant), make_spec(heads, dst_tp, quant)
    model = Model(src_spec, num_blocks, seed=data.draw(st.integers(0, 99)))
    n = data.draw(st.integers(0, num_blocks))
    src_ids = np.array(data.draw(st.permutations(range(num_blocks)))[:n], dtype=np.int64)
    dst_ids = np.array(data.draw(st.permutations(range(num_blocks)))[:n], dtype=np.int64)
    prefill = [model.rank_cache(src_tp, p) for p in range(src_tp)]
    regions_p = [KVRegion.from_tensors(src_spec, c) for c in prefill]
    decode = [[[np.zeros_like(a[:, :len(rank_heads(src_spec.num_kv_heads, dst_tp, d))]) for a in layer]
               for layer in model.arrays] for d in range(dst_tp)]
    counts = [[[np.zeros(a.nbytes, np.int64) for a in layer] for layer in cache] for cache in decode]
    regions_d = [KVRegion.from_tensors(dst_spec, c) for c in decode]
    for route in head_routes(src_spec.num_kv_heads, src_tp, dst_tp):
        assert src_spec.num_kv_heads and route.count >= 1
        r = route_ranges(regions_p[route.src], src_ids, regions_d[route.dst], dst_ids, route)
        apply(r, prefill[route.src], decode[route.dst], counts[route.dst])
    for d in range(dst_tp):
        rows = list(rank_heads(src_spec.num_kv_heads, dst_tp, d))
        for layer in range(src_spec.num_layers):
            for t, truth in enumerate(model.arrays[layer]):
                want = np.zeros_like(decode[d][layer][t])
                want[dst_ids] = truth[src_ids][:, rows]
                assert np.array_equal(decode[d][layer][t], want), (d, layer, t)
                written = np.zeros(want.shape[:2], bool)
                written[dst_ids] = True
                per_unit = counts[d][layer][t].reshape(*want.shape[:2], -1)
                assert (per_unit[written] == 1).all() and (per_unit[~written] == 0).all()


@settings(max_examples=60, deadline=None)
@given(heads=st.sampled_from([1, 2, 4, 8]), src_tp=st.sampled_from([1, 2, 4]), dst_tp=st.sampled_from([1, 2, 4]),
       quant=st.sampled_from(["none", "block_wise_fp8"]), data=st.data())
def test_head_wise_tables_write_each_heads_own_blocks_exactly_once(heads, src_tp, dst_tp, quant, data):
    """One table row per kv head, ids differing per head, -1 holes on either side: each decode (block, head) unit

    with a pair gets that head's prefill block, written once; every other unit is untouched."""
    num_blocks, n = 6, data.draw(st.integers(0, 6))
    src_spec, dst_spec = make_spec(heads, src_tp, quant), make_spec(heads, dst_tp, quant)
    model = Model(src_spec, num_blocks, seed=data.draw(st.integers(0, 99)))

    def table() -> np.ndarray:
        rows = [np.array(data.draw(st.permutations(range(num_blocks)))[:n], dtype=np.int64) for _ in range(heads)]
        out = np.stack(rows) if n else np.empty((heads, 0), dtype=np.int64)
        holes = np.array(data.draw(st.lists(st.booleans(), min_size=out.size, max_size=out.size)), dtype=bool)
        out[holes.reshape(out.shape)] = -1
        return out

    src_table, dst_table = table(), table()
    prefill = [model.rank_cache(src_tp, p) for p in range(src_tp)]
    regions_p = [KVRegion.from_tensors(src_spec, c) for c in prefill]
    decode = [[[np.zeros_like(a[:, :len(rank_heads(heads, dst_tp, d))]) for a in layer]
               for layer in model.arrays] for d in range(dst_tp)]
    counts = [[[np.zeros(a.nbytes, np.int64) for a in layer] for layer in cache] for cache in decode]
    regions_d = [KVRegion.from_tensors(dst_spec, c) for c in decode]
    for route in head_routes(heads, src_tp, dst_tp):
        g = rank_heads(heads, src_tp, route.src)[route.src_row]
        rows = slice(g, g + route.count)
        r = route_ranges(regions_p[route.src], src_table[rows], regions_d[route.dst], dst_table[rows], route)
        apply(r, prefill[route.src], decode[route.dst], counts[route.dst])
    for d in range(dst_tp):
        for layer in range(src_spec.num_layers):
            for t, truth in enumerate(model.arrays[layer]):
                want = np.zeros_like(decode[d][layer][t])
                written = np.zeros(want.shape[:2], bool)
                for local, g in enumerate(rank_heads(heads, dst_tp, d)):
                    pair = (src_table[g] >= 0) & (dst_table[g] >= 0)
                    want[dst_table[g][pair], local] = truth[src_table[g][pair], g]
                    written[dst_table[g][pair], local] = True
                assert np.array_equal(decode[d][layer][t], want), (d, layer, t)
                per_unit = counts[d][layer][t].reshape(*want.shape[:2], -1)
                assert (per_unit[written] == 1).all() and (per_unit[~written] == 0).all()


def test_head_wise_lists_of_the_wrong_shape_are_refused():
    spec = make_spec(4, 1)
    a = KVRegion.from_tensors(spec, Model(spec, 4, 0).rank_cache(1, 0))
    with pytest.raises(KVCacheError, match=r"head-wise lists are \[4 heads of the route, blocks\]"):
        route_ranges(a, np.zeros((3, 2), np.int64), a, np.zeros((3, 2), np.int64), head_routes(4, 1, 1)[0])


def test_equal_tp_routes_each_rank_to_itself_whole():
    assert head_routes(8, 2, 2) == [Route(0, 0, 0, 0, 4), Route(1, 1, 0, 0, 4)]


def test_prefill_tp2_to_decode_tp1_stacks_both_halves():
    assert head_routes(8, 2, 1) == [Route(0, 0, 0, 0, 4), Route(1, 0, 0, 4, 4)]


def test_decode_tp2_from_prefill_tp1_splits_rows():
    assert head_routes(8, 1, 2) == [Route(0, 0, 0, 0, 4), Route(0, 1, 4, 0, 4)]


def test_replicated_heads_spread_over_their_replicas():
    """2 heads on 4 prefill ranks (each head twice) to 4 decode ranks: decode ranks take turns among the replicas."""
    assert head_routes(2, 4, 4) == [Route(0, 0, 0, 0, 1), Route(1, 1, 0, 0, 1), Route(2, 2, 0, 0, 1),
                                    Route(3, 3, 0, 0, 1)]
    assert [r.src for r in head_routes(2, 4, 2)] == [0, 3]


def test_whole_blocks_with_consecutive_ids_merge_into_one_range_per_tensor_and_layer():
    spec = make_spec(4, 1)
    a = KVRegion.from_tensors(spec, Model(spec, 8, 0).rank_cache(1, 0))
    b = KVRegion.from_tensors(spec, Model(spec, 8, 1).rank_cache(1, 0))
    r = route_ranges(a, [2, 3, 4], b, [5, 6, 7], head_routes(4, 1, 1)[0], layers=[1])
    assert r.num_ranges == 2 and r.nbytes == 3 * spec.bytes_per_block_per_layer


def test_bad_layouts_and_ids_are_refused_with_the_field_named():
    with pytest.raises(KVCacheError, match="decode: 8 kv heads cannot be split over 3 ranks"):
        head_routes(8, 2, 3)
    spec = make_spec(4, 1)
    a = KVRegion.from_tensors(spec, Model(spec, 4, 0).rank_cache(1, 0))
    with pytest.raises(KVCacheError, match="dst_blocks: 9 is not a block id"):
        route_ranges(a, [0], a, [9], head_routes(4, 1, 1)[0])
    other = make_spec(4, 1, head_dim=16)
    b = KVRegion.from_tensors(other, Model(other, 4, 0).rank_cache(1, 0))
    with pytest.raises(KVCacheError, match="different tensors per head"):
        route_ranges(a, [0], b, [0], head_routes(4, 1, 1)[0])

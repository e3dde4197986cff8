"""Head re-slicing between TP layouts: which prefill rank writes which kv heads of which decode rank.

Rank r of a TP group of size ``tp`` holds global kv heads ``[r*h, (r+1)*h)`` with ``h = H // tp``
heads per rank; with fewer heads than ranks (``H < tp``, and MLA's one latent head) each rank
holds one head, ``r * H // tp``, replicated on ``tp // H`` ranks. A decode rank needs every
head it holds written exactly once: each of its heads comes from one prefill rank holding it
(replicas take turns by decode rank, so the load spreads). Routes group runs of heads that are
consecutive on both sides, so each (layer, tensor, block) of a route is one contiguous range::

    H = 8, prefill tp 2 -> decode tp 4        prefill tp 1 -> decode tp 2
    p0 [0 1 2 3] -> d0 [0 1], d1 [2 3]        p0 [0..7] -> d0 [0..3], d1 [4..7]
    p1 [4 5 6 7] -> d2 [4 5], d3 [6 7]        (rows 4..7 of p0 land on rows 0..3 of d1)

Pure functions: no I/O, nothing held.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.transfer import _ranges
from kvcache.transfer.regions import CopyRanges, KVRegion, _layer_ids

__all__ = ["Route", "RouteLayout", "head_routes", "layout_ranges", "rank_heads", "route_layout", "route_ranges"]


class Route(NamedTuple):
    """``count`` kv heads from local row ``src_row`` of prefill rank ``src`` to row ``dst_row`` of decode rank ``dst``."""

    src: int
    dst: int
    src_row: int
    dst_row: int
    count: int


def _check_layout(num_kv_heads: int, tp: int, side: str) -> None:
    if num_kv_heads < 1 or tp < 1:
        raise KVCacheError(f"{side}: num_kv_heads and tp must be positive, got {num_kv_heads} and {tp}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise KVCacheError(f"{side}: {num_kv_heads} kv heads cannot be split over {tp} ranks "
                           "(one must divide the other)")


def rank_heads(num_kv_heads: int, tp: int, rank: int) -> range:
    """The global kv heads rank ``rank`` of a ``tp``-way group holds, in its local row order."""
    _check_layout(num_kv_heads, tp, "rank_heads")
    if not 0 <= rank < tp:
        raise KVCacheError(f"rank: {rank} is outside [0, {tp})")
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    head = rank * num_kv_heads // tp
    return range(head, head + 1)


def head_routes(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[Route]:
    """Every route from a ``src_tp``-way layout to a ``dst_tp``-way one; each destination head appears once.

    Sorted by (src, dst, dst_row). Equal TP gives the identity (rank r to rank r, all rows).
    """
    _check_layout(num_kv_heads, src_tp, "prefill")
    _check_layout(num_kv_heads, dst_tp, "decode")
    src_of: list[list[int]] = [[] for _ in range(num_kv_heads)]  # global head -> prefill ranks holding it
    for p in range(src_tp):
        for g in rank_heads(num_kv_heads, src_tp, p):
            src_of[g].append(p)
    routes: list[Route] = []
    for d in range(dst_tp):
        run: list[int] | None = None  # [src, src_row, dst_row, count]
        for dst_row, g in enumerate(rank_heads(num_kv_heads, dst_tp, d)):
            holders = src_of[g]
            p = holders[d % len(holders)]
            src_row = rank_heads(num_kv_heads, src_tp, p).index(g)
            if run is not None and run[0] == p and run[1] + run[3] == src_row and run[2] + run[3] == dst_row:
                run[3] += 1
                continue
            if run is not None:
                routes.append(Route(run[0], d, run[1], run[2], run[3]))
            run = [p, src_row, dst_row, 1]
        assert run is not None, f"decode rank {d} holds no heads"
        routes.append(Route(run[0], d, run[1], run[2], run[3]))
    return sorted(routes, key=lambda r: (r.src, r.dst, r.dst_row))


def _check_pair(src: KVRegion, dst: KVRegion) -> np.ndarray:
    """Per-tensor bytes of one head of one block, the same on both sides; else a clear error."""
    if src.num_layers != dst.num_layers:
        raise KVCacheError(f"prefill has {src.num_layers} layers but decode has {dst.num_layers}")
    a, b = src.tensors, dst.tensors
    if [(t.name, t.dtype, t.block_shape[1:]) for t in a] != [(t.name, t.dtype, t.block_shape[1:]) for t in b]:
        raise KVCacheError(f"prefill and decode store different tensors per head ({a} vs {b}); "
                           "a transfer needs the same model, quant and block size on both sides")
    return src.block_bytes // src.heads


def route_ranges(src: KVRegion, src_blocks: Any, dst: KVRegion, dst_blocks: Any, route: Route,
                 layers: Any = None) -> CopyRanges:
    """Ranges writing ``route``'s heads of ``src_blocks`` onto the same heads of ``dst_blocks``.

    Block lists are 1-D (a uniform table: every head of block i lives in block i) or, for a
    head-wise table, 2-D ``[route.count, n]``: row k holds the blocks of the route's k-th head on
    its side. Position i of one list pairs with position i of the other; a pair with a ``-1``
    moves nothing (a window head's block it does not keep). Ranges come in (layer, tensor, block,
    head) order, merged where both sides continue.
    """
    return layout_ranges(route_layout(src, dst, route, layers), src_blocks, dst_blocks, per_layer=False)[0]


class RouteLayout(NamedTuple):
    """What every request's ranges along one route between two regions start from, per (layer, tensor) unit.

    Built once per route and pair of regions (``route_layout``); ``layout_ranges`` then needs only
    a request's blocks.
    """

    route: Route
    src_base: np.ndarray  # int64 [units]: the route's first head in block 0, source side
    src_stride: np.ndarray
    dst_base: np.ndarray
    dst_stride: np.ndarray
    unit: np.ndarray  # bytes of one head of one block
    tensors: int  # units per layer
    src_blocks: int  # blocks of each region, to check ids against
    dst_blocks: int


def route_layout(src: KVRegion, dst: KVRegion, route: Route, layers: Any = None) -> RouteLayout:
    """``route``'s units between ``src`` and ``dst`` for ``layers`` (default all); a clear error if they do not fit."""
    unit = _check_pair(src, dst)
    if route.src_row + route.count > src.heads or route.dst_row + route.count > dst.heads:
        raise KVCacheError(f"route {route} reaches past the {src.heads} (prefill) or {dst.heads} (decode) "
                           "heads per block")
    ids = _layer_ids(layers, src.num_layers)
    return RouteLayout(route, (src.addrs[ids] + unit * route.src_row).ravel(),
                       np.ascontiguousarray(src.block_strides[ids]).ravel(),
                       (dst.addrs[ids] + unit * route.dst_row).ravel(),
                       np.ascontiguousarray(dst.block_strides[ids]).ravel(),
                       np.tile(unit, ids.size), unit.size, int(src.layer_blocks[ids].min(initial=src.num_blocks)),
                       int(dst.layer_blocks[ids].min(initial=dst.num_blocks)))


def layout_ranges(layout: RouteLayout, src_blocks: Any, dst_blocks: Any, per_layer: bool = True
                  ) -> tuple[CopyRanges, np.ndarray]:
    """The ranges of ``layout``'s route for these block lists (as ``route_ranges`` takes them), merged in C.

    ``per_layer``: merged only within a layer, with where each layer's ranges start; else merged
    wherever both sides continue (``starts`` is then ``[0, n]``).
    """
    route = layout.route
    sb = np.asarray(src_blocks, dtype=np.int64)
    db = np.asarray(dst_blocks, dtype=np.int64)
    head_wise = sb.ndim == 2 or db.ndim == 2
    if head_wise:
        if sb.shape != db.shape or sb.ndim != 2 or sb.shape[0] != route.count:
            raise KVCacheError(f"src_blocks {sb.shape} and dst_blocks {db.shape}: head-wise lists are "
                               f"[{route.count} heads of the route, blocks] on both sides")
    else:
        sb, db = sb.ravel(), db.ravel()
        if sb.shape != db.shape:
            raise KVCacheError(f"src_blocks has {sb.size} ids but dst_blocks has {db.size}; they pair up one to one")
    for name, ids, count in (("src_blocks", sb, layout.src_blocks), ("dst_blocks", db, layout.dst_blocks)):
        bad = (ids < -1) | (ids >= count)
        if bad.any():
            raise KVCacheError(f"{name}: {int(ids[bad][0])} is not a block id of a region with "
                               f"{count} blocks (or -1)")
    keep = (sb >= 0) & (db >= 0)
    if head_wise:  # one range per (block, head), block-major so a block's neighbouring heads merge
        col, head = np.nonzero(keep.T)
        sb, db, per = sb[head, col], db[head, col], 1
        head = head.astype(np.int64)
    else:
        sb, db, head, per = sb[keep], db[keep], np.zeros(int(keep.sum()), dtype=np.int64), route.count
    units = layout.unit.size
    out = np.empty((3, units * sb.size), dtype=np.int64)
    starts = np.empty(units // layout.tensors + 1 if per_layer else 2, dtype=np.int64)
    n = _ranges.pair_ranges(layout.src_base, layout.src_stride, layout.dst_base, layout.dst_stride, layout.unit,
                            layout.unit * per, np.ascontiguousarray(sb), np.ascontiguousarray(db),
                            np.ascontiguousarray(head), layout.tensors if per_layer else max(units, 1),
                            out[0], out[1], out[2], starts)
    return CopyRanges(out[0, :n].copy(), out[1, :n].copy(), out[2, :n].copy()), starts

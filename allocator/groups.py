"""vLLM's KV cache groups for a model's rows, and the group numbers its KV events carry.

vLLM (``vllm.v1.core.kv_cache_planning.get_kv_cache_groups``, hybrid models of one page size) splits a model's
attention layers into groups of equal size: layers of one spec form a bucket, in order of first appearance; the
group size is the smallest bucket's layer count (the largest's where that is under 1.5 times the smallest); a
bucket of ``n`` layers makes ``cdiv(n, size)`` groups, group ``i`` taking the bucket's layers ``i::groups``. One
spec for every layer gives one group. Each group caches every block for itself and publishes ``group_idx`` by
that numbering, e.g. Gemma 3 4B (29 sliding layers, 5 full)::

    vLLM groups   0..5: sliding layers [0, 7, 13, ...], [1, 8, 14, ...], ...   6: full layers 5, 11, 17, 23, 29
    kvcache       row group 0: the sliding row                                 row group 1: the full row

so a kvcache row group stands for every vLLM group of its policy: ``vllm_group_numbers`` gives, per row group,
those groups' numbers, and ``kvcache.allocator.events.renumber_groups`` publishes one event under each. vLLM has
no policy per kv head; a head-wise config (FastDeploy's ``head_wise_swa_ratio``, a layer's heads of two
policies) is grouped by the same rule with each (layer, kv head) cell as a layer of one kv head.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.rows import Row
from kvcache.allocator.swa import AttentionPolicy


class KVCacheGroup(NamedTuple):
    """One of vLLM's groups: its policy and its units, ``(layer, kv head)`` pairs (kv head -1: the whole layer)."""

    policy: AttentionPolicy
    units: tuple[tuple[int, int], ...]


def units_of(layout: Sequence[Row]) -> list[tuple[tuple[int, int], AttentionPolicy]]:
    """What vLLM groups, in its order: each layer (kv head -1) with its policy where all of a layer's kv heads share
    one, else each (layer, kv head) cell; a cell held by no row or by two is an error."""
    cells: dict[tuple[int, int], AttentionPolicy] = {}
    for i, row in enumerate(layout):
        for layer in row.layers:
            for head in row.kv_heads:
                if (layer, head) in cells:
                    raise KVCacheError(f"rows[{i}]: layer {layer}, kv head {head} is held by an earlier row too")
                cells[(layer, head)] = row.policy
    if not cells:
        raise KVCacheError("rows: need at least one row with cells")
    layers = sorted({layer for layer, _ in cells})
    heads = sorted({head for _, head in cells})
    missing = [(layer, head) for layer in layers for head in heads if (layer, head) not in cells]
    if missing:
        raise KVCacheError(f"rows: no row holds layer {missing[0][0]}, kv head {missing[0][1]}")
    by_layer = [{cells[(layer, head)] for head in heads} for layer in layers]
    if all(len(policies) == 1 for policies in by_layer):
        return [((layer, -1), cells[(layer, heads[0])]) for layer in layers]
    return [((layer, head), cells[(layer, head)]) for layer in layers for head in heads]


def kv_cache_groups(layout: Sequence[Row]) -> list[KVCacheGroup]:
    """vLLM's groups for the cells of ``layout`` (the module docstring's rule), in its order."""
    buckets: dict[AttentionPolicy, list[tuple[int, int]]] = {}
    for unit, policy in units_of(layout):
        buckets.setdefault(policy, []).append(unit)
    if len(buckets) == 1:
        [(policy, units)] = buckets.items()
        return [KVCacheGroup(policy, tuple(units))]
    counts = [len(units) for units in buckets.values()]
    size = max(counts) if max(counts) < min(counts) * 1.5 else min(counts)
    groups = []
    for policy, units in buckets.items():
        n = -(-len(units) // size)
        groups += [KVCacheGroup(policy, tuple(units[i::n])) for i in range(n)]
    return groups


def vllm_group_numbers(layout: Sequence[Row], rows: Sequence[AttentionPolicy]) -> tuple[tuple[int, ...], ...]:
    """For each row group of a manager with row policies ``rows`` (equal policies make one group, numbered in
    order of first appearance, as ``KVCacheManager`` numbers them), the numbers of vLLM's groups of that policy
    for the model whose cells ``layout`` names (``CacheSpec.row_layout``)."""
    groups = kv_cache_groups(layout)
    out = []
    for policy in dict.fromkeys(rows):
        numbers = tuple(i for i, group in enumerate(groups) if group.policy == policy)
        if not numbers:
            raise KVCacheError(f"rows: policy {policy!r} holds no cell of the model's layout")
        out.append(numbers)
    return tuple(out)

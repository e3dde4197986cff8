"""Rows from a model's attention layout: which (layer, kv head) cells share one policy and one block id per block.

A row is the unit the block pool allocates for: each of its blocks holds the
keys and values of every cell of the row, and a sliding-window row gives
blocks back as the window passes. Models declare their sliding windows per
layer (Gemma 2/3, GPT-OSS, Qwen2 with ``use_sliding_window``, Mistral's
all-layer ``sliding_window``) or, FastDeploy-style, per kv head
(``head_wise_swa_ratio``: the share of each TP rank's query heads that gets the
window, its last ones; ``window_kv_heads``). Llama 4 declares chunked local
attention (``attention_chunk_size``) on its RoPE layers. ``layer_policies``
reads either from a Hugging Face ``config.json``; ``derive_rows`` groups the
cells into rows::

    by layer groups (the default): one row per distinct policy, all its layers, all kv heads
    head-wise: one row per kv head within each layer group (the product of the two)

Anything a config says about windows that cannot be read exactly is an error
naming the key, never ignored.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.swa import AttentionPolicy, Chunked, Full, Window
from kvcache.allocator.table import rank_rows

# Layer types as configs name them (transformers' ``layer_types``).
_FULL_TYPES = frozenset({"full_attention"})
_WINDOW_TYPES = frozenset({"sliding_attention"})
_CHUNKED_TYPES = frozenset({"chunked_attention"})


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """One row: its policy and the cells it holds, as the model's layers and global kv heads (ascending)."""

    policy: AttentionPolicy
    layers: tuple[int, ...]
    kv_heads: tuple[int, ...]

    @property
    def num_cells(self) -> int:
        """(layer, kv head) cells one block of this row holds."""
        return len(self.layers) * len(self.kv_heads)

    def describe(self) -> dict[str, Any]:
        """The row as plain JSON-ready values."""
        return {**describe_policy(self.policy), "layers": list(self.layers), "kv_heads": list(self.kv_heads)}

    @classmethod
    def from_description(cls, value: Any, field: str = "row") -> Row:
        """The row ``describe`` gave (as an info reply carries it); a malformed one is an error naming ``field``."""
        if not isinstance(value, Mapping):
            raise KVCacheError(f"{field}: must be a map, got {type(value).__name__}")
        kind = value.get("kind")
        if kind == "full":
            policy: AttentionPolicy = Full()
        elif kind == "window":
            window, sink = value.get("window"), value.get("sink", 0)
            if not (_is_int(window) and window > 0 and _is_int(sink) and sink >= 0):
                raise KVCacheError(f"{field}: a window needs window > 0 and sink >= 0, got {window!r}, {sink!r}")
            policy = Window(window, sink)
        elif kind == "chunk":
            chunk = value.get("chunk")
            if not (_is_int(chunk) and chunk > 0):
                raise KVCacheError(f"{field}: a chunk needs chunk > 0, got {chunk!r}")
            policy = Chunked(chunk)
        else:
            raise KVCacheError(f"{field}.kind: must be full, window or chunk, got {kind!r}")
        cells = []
        for key in ("layers", "kv_heads"):
            items = value.get(key)
            if not (isinstance(items, (list, tuple)) and items and all(_is_int(v) and v >= 0 for v in items)):
                raise KVCacheError(f"{field}.{key}: must be a non-empty list of integers >= 0")
            cells.append(tuple(sorted(set(items))))
        return cls(policy, cells[0], cells[1])


def describe_policy(policy: AttentionPolicy) -> dict[str, Any]:
    """A policy as plain JSON-ready values: ``{"kind": "full"}``, a window with its sink, or a chunk."""
    if isinstance(policy, Full):
        return {"kind": "full"}
    if isinstance(policy, Chunked):
        return {"kind": "chunk", "chunk": policy.chunk_tokens}
    return {"kind": "window", "window": policy.window_tokens, "sink": policy.sink_tokens}


def rows_of_rank(rows: Sequence[Row], num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, ...]:
    """The rows TP rank ``rank`` holds: those with a kv head among the rank's heads (``rank_rows``), ascending."""
    mine = set(range(num_kv_heads)[rank_rows(num_kv_heads, tp_size, rank)])
    return tuple(i for i, row in enumerate(rows) if mine.intersection(row.kv_heads))


def cell_rows(rows: Sequence[Row], num_layers: int, num_kv_heads: int, tp_size: int, rank: int) -> np.ndarray:
    """int32 ``[num_layers, rank's kv heads]``: for each layer and each of the rank's kv heads, the index among
    ``rows_of_rank`` of the row holding that cell; a layer's attention reads its heads' tables there."""
    heads = range(num_kv_heads)[rank_rows(num_kv_heads, tp_size, rank)]
    mine = rows_of_rank(rows, num_kv_heads, tp_size, rank)
    out = np.full((num_layers, len(heads)), -1, dtype=np.int32)
    for local, i in enumerate(mine):
        row = rows[i]
        for head in row.kv_heads:
            if head in heads:
                out[list(row.layers), heads.index(head)] = local
    if (out < 0).any():
        layer, head = (int(v) for v in np.argwhere(out < 0)[0])
        raise KVCacheError(f"rows: no row holds layer {layer}, kv head {heads[head]}")
    return out


def table_cells(rows: Sequence[Row] | None, num_table_rows: int, num_layers: int, num_kv_heads: int) -> np.ndarray:
    """int64 ``[num_layers, num_kv_heads]``: the row of a table of ``num_table_rows`` rows that each (layer, kv head)
    reads: the one row of a uniform table, the row of ``rows`` holding the cell (layer groups, and heads within
    them), or the head's own row of a head-wise table. Any other count is an error."""
    if num_table_rows == 1:
        return np.zeros((num_layers, num_kv_heads), dtype=np.int64)
    if rows is not None and len(rows) == num_table_rows:
        return cell_rows(rows, num_layers, num_kv_heads, 1, 0).astype(np.int64)
    if num_table_rows == num_kv_heads:
        return np.tile(np.arange(num_kv_heads, dtype=np.int64), (num_layers, 1))
    raise KVCacheError(f"tables of {num_table_rows} rows: need one row, one per kv head ({num_kv_heads}), or the "
                       f"rows the cache's spec names ({len(rows or ())})")


def layer_classes(cells: np.ndarray, layers: Iterable[int]) -> dict[tuple[int, ...], list[int]]:
    """``layers`` grouped by the table rows their heads read (``cells[layer]``, a row per head), in order: layers of
    one class move the same rows' blocks, so a copy takes them together."""
    classes: dict[tuple[int, ...], list[int]] = {}
    for layer in layers:
        classes.setdefault(tuple(cells[layer].tolist()), []).append(int(layer))
    return classes


def rows_blocks(table: np.ndarray, picks: tuple[int, ...]) -> np.ndarray:
    """The blocks heads read from ``table`` (``[rows, n]``), one head per entry of ``picks`` (its row): the row
    itself (whole blocks, 1-D) when every head reads one row, else one row per head (``[heads, n]``)."""
    return table[picks[0]] if len(set(picks)) == 1 else table[list(picks)]


def layer_policies(config: Mapping[str, Any], num_layers: int) -> tuple[AttentionPolicy, ...]:
    """Each layer's policy as the config declares it (all Full where it declares no window).

    Reads ``layer_types`` with ``sliding_window``; else ``sliding_window_pattern`` (every Nth layer
    full, Gemma 3), Gemma 2's alternation (even layers windowed), Qwen2's ``use_sliding_window``
    with ``max_window_layers`` (layers from there on windowed), FastDeploy's ``window_attn_skip_freq``
    (every Nth layer from 0 full), or a ``sliding_window`` alone (every layer, Mistral). A sink
    (``sink_size``) goes with every window. ``attention_chunk_size`` gives ``Chunked`` layers as
    Llama 4 does: those ``layer_types`` names ``chunked_attention``, else the RoPE layers of
    ``no_rope_layers`` (1: RoPE, chunked; 0: NoPE, full), else all but every
    ``no_rope_layer_interval``-th (default 4) layer.
    """
    window = _window(config)
    chunk = _chunk(config)
    types = config.get("layer_types")
    if types is not None:
        return _from_layer_types(types, window, num_layers, chunk)
    if chunk is not None:
        if window is not None:
            raise KVCacheError("config: sliding_window and attention_chunk_size both set without layer_types; "
                               "keep one")
        return tuple(chunk if rope else Full() for rope in _rope_layers(config, num_layers))
    if window is None:
        for key in ("sliding_window_pattern", "window_attn_skip_freq", "head_wise_swa_ratio"):
            if config.get(key):
                raise KVCacheError(f"config.{key}: set, but the config has no sliding_window")
        if config.get("use_sliding_window") is True:
            raise KVCacheError("config.use_sliding_window: true, but the config has no sliding_window")
        return (Full(),) * num_layers
    pattern = config.get("sliding_window_pattern")
    skip = config.get("window_attn_skip_freq")
    model_type = str(config.get("model_type", ""))
    if pattern is not None and skip is not None:
        raise KVCacheError("config: sliding_window_pattern and window_attn_skip_freq both set; keep one")
    if pattern is not None:
        every = _positive(pattern, "sliding_window_pattern")
        windowed = [(i + 1) % every != 0 for i in range(num_layers)]
    elif skip is not None:
        windowed = _skip_freq(skip, num_layers)
    elif model_type.startswith("gemma2"):
        windowed = [i % 2 == 0 for i in range(num_layers)]
    elif "use_sliding_window" in config:
        if not isinstance(config["use_sliding_window"], bool):
            raise KVCacheError(f"config.use_sliding_window: must be true or false, got {config['use_sliding_window']!r}")
        if not config["use_sliding_window"]:
            return (Full(),) * num_layers
        first = config.get("max_window_layers", 0)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise KVCacheError(f"config.max_window_layers: must be an integer >= 0, got {first!r}")
        windowed = [i >= first for i in range(num_layers)]
    else:
        windowed = [True] * num_layers
    return tuple(window if w else Full() for w in windowed)


def window_kv_heads(config: Mapping[str, Any], num_heads: int, num_kv_heads: int,
                    tp_size: int = 1) -> frozenset[int] | None:
    """The kv heads (global indices) that keep a windowed layer's window under FastDeploy's
    ``head_wise_swa_ratio``; None when the config sets none (every kv head keeps it).

    FastDeploy splits each TP rank's attention output by columns: its ``num_heads // tp_size`` query
    heads of ``head_dim`` columns each take the first ``int((1 - ratio) * heads * head_dim)`` columns
    from full attention and the rest from the window (``head_wise_full_hidden`` in
    ``append_attn_backend.py``, applied in ``ops/append_attention.py``). A query head with any full
    column reads the whole history, so a kv head keeps the window only if every query head of its
    group is windowed: on each rank the last kv heads do. Ratio 0 (FastDeploy's default) or 1 leaves
    no full column: every head keeps the window::

        one rank, 8 query heads, 4 kv heads, ratio 0.5:  q | F F F F w w w w |   kv | F F w w |
        2 ranks, same model:                 rank 0: q | F F w w |  kv | F w |   rank 1: | F w |
    """
    ratio = config.get("head_wise_swa_ratio")
    if ratio is None:
        return None
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise KVCacheError(f"config.head_wise_swa_ratio: must be a number in [0, 1], got {ratio!r}")
    if ratio in (0, 1):
        return frozenset(range(num_kv_heads))
    if num_heads < 1 or num_heads % tp_size or num_heads % num_kv_heads:
        raise KVCacheError(f"num_attention_heads: {num_heads} query heads must split evenly over {num_kv_heads} "
                           f"kv heads and {tp_size} TP ranks for a head-wise window")
    head_dim, hidden = config.get("head_dim"), config.get("hidden_size")
    if not head_dim and _is_int(hidden):
        head_dim = hidden // num_heads
    if not _is_int(head_dim) or head_dim < 1:
        raise KVCacheError(f"config.head_dim: a head-wise window needs the head size (head_dim, or hidden_size "
                           f"over num_attention_heads), got {head_dim!r}")
    heads = num_heads // tp_size  # one rank's query heads, as FastDeploy's model runner gives its backend
    group = heads // max(1, num_kv_heads // tp_size)
    full_hidden = int((1 - ratio) * heads * head_dim)  # FastDeploy's expression, evaluated in the same order
    full_query_heads = -(-full_hidden // head_dim)  # a partly full head reads everything
    first_window = -(-full_query_heads // group)  # a rank's first kv head whose whole group is windowed
    out: set[int] = set()
    for rank in range(tp_size):
        mine = range(num_kv_heads)[rank_rows(num_kv_heads, tp_size, rank)]
        out.update(mine[first_window:])
    return frozenset(out)


def derive_rows(policies: Sequence[AttentionPolicy], num_kv_heads: int, *, head_wise: bool = False,
                window_heads: Collection[int] | None = None) -> tuple[Row, ...]:
    """Rows for layers with ``policies`` and ``num_kv_heads`` kv heads.

    Layers with equal policies form a group. By default each group is one row over all kv heads;
    ``head_wise`` gives one row per (group, kv head). ``window_heads`` (``window_kv_heads``) keeps
    the window only on those kv heads of a windowed layer, the others attending in full: those cells
    join the full layers' rows. Rows come in the order of their first layer, then head.
    """
    if num_kv_heads < 1:
        raise KVCacheError(f"num_kv_heads: must be at least 1, got {num_kv_heads}")
    if window_heads is not None and not all(_is_int(h) and 0 <= h < num_kv_heads for h in window_heads):
        raise KVCacheError(f"window_heads: kv heads must be in [0, {num_kv_heads}), got {sorted(window_heads)}")
    cells: dict[AttentionPolicy, dict[int, list[int]]] = {}  # policy -> kv head -> layers
    for layer, policy in enumerate(policies):
        for head in range(num_kv_heads):
            own = policy if window_heads is None or head in window_heads else Full()
            cells.setdefault(own, {}).setdefault(head, []).append(layer)
    rows: list[Row] = []
    for policy, by_head in cells.items():
        if head_wise:
            rows += [Row(policy, tuple(layers), (head,)) for head, layers in sorted(by_head.items())]
            continue
        # Heads with the same layers share one row; with head-wise windows the full heads span more layers.
        by_layers: dict[tuple[int, ...], list[int]] = {}
        for head, layers in sorted(by_head.items()):
            by_layers.setdefault(tuple(layers), []).append(head)
        rows += [Row(policy, layers, tuple(heads)) for layers, heads in by_layers.items()]
    return tuple(sorted(rows, key=lambda r: (r.layers[0], r.kv_heads[0], not isinstance(r.policy, Full))))


def _window(config: Mapping[str, Any]) -> Window | None:
    """The config's window (``sliding_window`` or FastDeploy's ``window_size``) with ``sink_size``; None without."""
    value, key = config.get("sliding_window"), "sliding_window"
    if value is None and config.get("window_size") is not None:
        value, key = config["window_size"], "window_size"
    if isinstance(value, (list, tuple)):  # (left, right): a causal model's right side is 0
        if len(value) != 2 or value[1] not in (0, None):
            raise KVCacheError(f"config.{key}: a (left, right) window must have right 0, got {list(value)!r}")
        value = value[0]
    if value is None or value is False or (isinstance(value, int) and not isinstance(value, bool) and value <= 0):
        if config.get("sink_size"):
            raise KVCacheError("config.sink_size: set, but the config has no sliding window")
        return None
    window = _positive(value, key)
    sink = config.get("sink_size") or 0
    if isinstance(sink, bool) or not isinstance(sink, int) or sink < 0:
        raise KVCacheError(f"config.sink_size: must be an integer >= 0, got {sink!r}")
    return Window(window, sink)


def _chunk(config: Mapping[str, Any]) -> Chunked | None:
    """The config's ``attention_chunk_size`` as a policy; None where unset (or null)."""
    value = config.get("attention_chunk_size")
    return None if value is None else Chunked(_positive(value, "attention_chunk_size"))


def _rope_layers(config: Mapping[str, Any], num_layers: int) -> list[bool]:
    """Llama 4's RoPE layers: ``no_rope_layers`` (one 0/1 flag per layer; 1 uses RoPE) where given and non-empty,
    else every layer but each ``no_rope_layer_interval``-th (default 4), as transformers' Llama4TextConfig fills it."""
    flags = config.get("no_rope_layers")
    if flags:
        if not isinstance(flags, list) or len(flags) < num_layers or not all(v in (0, 1) for v in flags):
            raise KVCacheError(f"config.no_rope_layers: needs a 0/1 flag per layer ({num_layers}), got {flags!r}")
        return [bool(v) for v in flags[:num_layers]]
    every = _positive(config.get("no_rope_layer_interval", 4), "no_rope_layer_interval")
    return [(i + 1) % every != 0 for i in range(num_layers)]


def _from_layer_types(types: Any, window: Window | None, num_layers: int,
                      chunk: Chunked | None = None) -> tuple[AttentionPolicy, ...]:
    if not isinstance(types, Sequence) or isinstance(types, str) or len(types) != num_layers:
        count = len(types) if isinstance(types, Sequence) and not isinstance(types, str) else "no list"
        raise KVCacheError(f"config.layer_types: needs one entry per layer ({num_layers}), got {count}")
    out: list[AttentionPolicy] = []
    for i, kind in enumerate(types):
        if kind in _FULL_TYPES:
            out.append(Full())
        elif kind in _CHUNKED_TYPES:
            if chunk is None:
                raise KVCacheError(f"config.layer_types[{i}]: {kind!r}, but the config has no attention_chunk_size")
            out.append(chunk)
        elif kind in _WINDOW_TYPES:
            if window is None:
                raise KVCacheError(f"config.layer_types[{i}]: {kind!r}, but the config has no sliding_window")
            out.append(window)
        else:
            raise KVCacheError(f"config.layer_types[{i}]: unknown layer type {kind!r}; expected one of "
                               f"{', '.join(sorted(_FULL_TYPES | _WINDOW_TYPES | _CHUNKED_TYPES))}")
    return tuple(out)


def _skip_freq(skip: Any, num_layers: int) -> list[bool]:
    """FastDeploy's ``window_attn_skip_freq``: an int N windows every layer but 0, N, 2N, ...; a list flags each."""
    if isinstance(skip, list):
        if len(skip) != num_layers or not all(isinstance(v, (bool, int)) for v in skip):
            raise KVCacheError(f"config.window_attn_skip_freq: a list needs one flag per layer ({num_layers})")
        return [bool(v) for v in skip]
    every = _positive(skip, "window_attn_skip_freq")
    return [i % every != 0 for i in range(num_layers)]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KVCacheError(f"config.{key}: must be a positive integer, got {value!r}")
    return value

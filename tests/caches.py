"""Random KV caches in numpy for the transfer tests: one byte buffer and, per (layer, tensor), a view shaped as the spec says.
Random admits, extends and frees through two caches that must agree (``same_random_steps``)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kvcache.allocator import CacheSpec
from kvcache.allocator.layout import DTYPE_BYTES

RAW = {1: np.uint8, 2: np.uint16, 4: np.uint32}  # an element width's unsigned dtype: bytes compare exactly


def random_views(spec: CacheSpec, num_blocks: int | list[int], seed: int, layout: str = "separate"
                 ) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """Random bytes laid out layer-major; ``separate``: then tensor, then block (what KVRegion.from_buffer assumes);
    ``interleaved``: every tensor's block b inside one page b of all the layer's tensors. ``num_blocks`` is every
    layer's block count, or one per layer."""
    if layout not in ("separate", "interleaved"):
        raise ValueError(f"layout: 'separate' or 'interleaved', got {layout!r}")
    counts = [num_blocks] * spec.num_layers if isinstance(num_blocks, int) else list(num_blocks)
    starts = np.cumsum([0] + [spec.bytes_per_block_per_layer * n for n in counts])
    buffer = np.random.default_rng(seed).integers(0, 256, int(starts[-1]), dtype=np.uint8)
    views: list[list[np.ndarray]] = []
    for layer in range(spec.num_layers):
        row, offset, num_blocks = [], int(starts[layer]), counts[layer]
        for t in spec.tensors():
            raw = RAW[DTYPE_BYTES[t.dtype]]
            inner = np.empty(t.block_shape, dtype=raw).strides
            if layout == "separate":
                block_stride, start = t.bytes_per_block, offset
                offset += t.bytes_per_block * num_blocks
            else:  # interleaved
                block_stride, start = spec.bytes_per_block_per_layer, offset
                offset += t.bytes_per_block
            row.append(np.ndarray(t.shape(num_blocks), dtype=raw, buffer=buffer, offset=start,
                                  strides=(block_stride, *inner)))
        views.append(row)
    return buffer, views


Draw = Callable[[np.random.Generator], Any]


def same_random_steps(a: Any, b: Any, rng: np.random.Generator, steps: int, *, prompt: Draw, new_tokens: Draw,
                      lookahead: Draw | None = None) -> list[int]:
    """``steps`` random steps through two caches (a daemon's client and a library ``KVCacheManager``, or two
    clients), request ids the step numbers: admit ``prompt(rng)`` (always while none is live), extend a live
    request by ``new_tokens(rng)`` reserving ``lookahead(rng)`` positions past them (none drawn without
    ``lookahead``), or free one. Asserts both give the same admissions (hit, tokens, table) and extended tables
    (or both refuse) and, after every step, the same free blocks. Returns the requests still live."""
    live: list[int] = []
    for step in range(steps):
        action = rng.integers(3) if live else 0
        if action == 0:
            tokens = prompt(rng)
            got, want = a.admit(step, tokens), b.admit(step, tokens)
            assert (got is None) == (want is None)
            if want is not None:
                assert (got.num_cached_tokens, got.num_tokens) == (want.num_cached_tokens, want.num_tokens)
                assert np.array_equal(got.table, want.table)
                live.append(step)
        elif action == 1:
            rid = live[rng.integers(len(live))]
            new = new_tokens(rng)
            ahead = int(lookahead(rng)) if lookahead is not None else 0
            got = a.extend(rid, new, num_lookahead_tokens=ahead)
            want = b.extend(rid, new, num_lookahead_tokens=ahead)
            assert (got is None) == (want is None)
            if want is not None:
                assert np.array_equal(got, want)
        else:
            rid = live.pop(rng.integers(len(live)))
            a.free(rid)
            b.free(rid)
        assert a.num_free_blocks.tolist() == b.num_free_blocks.tolist()
    return live

"""Random KV caches in numpy for the transfer tests: one byte buffer and, per (layer, tensor), a view shaped as the spec says."""
from __future__ import annotations

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

"""The cache tensors the engine's model writes and reads by table: kvcache's blocks as Paddle tensors.

kvcache hands out block ids per table row (``CacheSpec.row_layout``: one policy over some layers and kv heads,
with a pool of blocks of its own); the engine keeps, per layer, tensors of ``layer_blocks`` blocks as
``CacheSpec.tensors()`` shapes them, and reads each (layer, kv head)'s block ids from the row ``head_rows``
names (docs/engine.md's glossary).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from kvcache.allocator import CacheSpec

from backend import paddle_backend
from model import fp8_dequantize, fp8_round_trip


def cache_spec(config: Any, *, block_size: int, head_wise: bool = False, quant: str = "none",
               scale_layout: str = "default", tp_size: int = 1) -> CacheSpec:
    """The cache of ``config`` (a ``ModelConfig``) as kvcache sees it: from its ``config.json`` fields, rows included."""
    return CacheSpec.from_hf_config(config.hf_config(), block_size=block_size, head_wise=head_wise, dtype="float32",
                                    quant=quant, scale_layout=scale_layout, tp_size=tp_size)


def layer_blocks(pool_blocks: Any, head_rows: np.ndarray) -> list[int]:
    """Each layer's block count: the largest pool of the rows its kv heads read."""
    sizes = np.asarray(pool_blocks)
    return [int(sizes[rows].max()) for rows in head_rows]


class PagedCache:
    """Every layer's cache tensors (K and V, MLA's latent, or block_wise_fp8's float8 K and V with a scale per
    token and head) as Paddle tensors shaped as ``CacheSpec.tensors()`` says, at the layer's block count."""

    def __init__(self, spec: CacheSpec, layer_blocks: list[int], dtype: str = "float32") -> None:
        """``dtype`` is what the model computes in: writes round to the cache's dtype, reads come back in it."""
        self.spec, self.dtype, self.ops = spec, dtype, paddle_backend()
        paddle = self.ops.paddle
        self.heads, self.block_size, self.layer_blocks = spec.kv_heads_per_rank, spec.block_size, list(layer_blocks)
        tensors = spec.tensors()
        self.names = [t.name for t in tensors]
        self.fp8 = self.names == ["key", "value", "key_scale", "value_scale"]
        if not (self.fp8 or self.names in (["key", "value"], ["latent"])):
            raise ValueError(f"quant: the engine writes none, block_wise_fp8 and MLA caches, not {spec.quant.value}")
        if self.fp8 and spec.scale_layout.value != "default":
            raise ValueError("scale_layout: the engine writes block_wise_fp8's per-token scales ([blocks, heads, "
                             "block]); what the blackwell layout's four values per block and head hold is not defined")
        # A scale's block shape is [heads, block_size]: one value per slot, kept as a column here.
        self.dims = [t.block_shape[2] if len(t.block_shape) == 3 else 1 for t in tensors]
        # float8 values live as their bytes (uint8), as engines keep them; a view turns them back into float8.
        self.dtypes = ["uint8" if t.dtype == "float8_e4m3fn" else "float32" for t in tensors]
        assert all(t.block_shape[:2] == (self.heads, self.block_size) for t in tensors)
        # Per layer, per tensor, flat [blocks * heads * block_size, dim]: a token's vector at slot ((block * heads
        # + head) * block_size + offset); ``views`` gives them shaped as the spec says.
        self.tensors = [[paddle.zeros([n * self.heads * self.block_size, d], dtype="float32").astype(dtype)
                         for d, dtype in zip(self.dims, self.dtypes)] for n in layer_blocks]

    def views(self, layer: int) -> dict[str, Any]:
        n = self.layer_blocks[layer]
        return {t.name: x.reshape([n, *t.block_shape]) for t, x in zip(self.spec.tensors(), self.tensors[layer])}

    def _slots(self, blocks: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Flat slots of (block, head, offset): blocks [heads, n], offsets [n] -> [heads, n]."""
        heads = np.arange(self.heads)[:, None]
        return (blocks * self.heads + heads) * self.block_size + offsets[None, :]

    def write(self, layer: int, table: np.ndarray, head_rows: np.ndarray, positions: np.ndarray,
              vectors: tuple[Any, ...]) -> None:
        """Store the vectors ([n, heads, dim] each: K and V, or the latent) of ``positions`` in the blocks each
        head's row names, quantized with their scales for a block_wise_fp8 cache."""
        blocks = table[head_rows[layer]][:, positions // self.block_size]  # [heads, n]
        if (blocks < 0).any():
            raise RuntimeError(f"layer {layer}: a token is written into a block the table does not hold")
        paddle = self.ops.paddle
        index = paddle.to_tensor(self._slots(blocks, positions % self.block_size).reshape(-1))
        flat = [x.transpose([1, 0, 2]).reshape([-1, x.shape[-1]]) for x in vectors]
        if self.fp8:
            (k, ks), (v, vs) = (fp8_round_trip(self.ops, x) for x in flat)
            flat = [k.view(paddle.uint8), v.view(paddle.uint8), ks, vs]
        else:
            flat = [x.astype("float32") for x in flat]
        for t, x in zip(self.tensors[layer], flat):
            t[index] = x

    def gather(self, layer: int, table: np.ndarray, head_rows: np.ndarray, length: int) -> tuple[Any, ...]:
        """The vectors [heads, length, dim] of tokens ``[0, length)`` by table (dequantized). In a block the table
        lacks, the first (keys, latent) read NaN and values 0; no query may see them (``attention.refuse_unheld``
        refuses the step first: Paddle's softmax on the CPU can turn a NaN score into a finite output)."""
        paddle = self.ops.paddle
        cols = -(-length // self.block_size)
        blocks = table[head_rows[layer]][:, :cols]  # [heads, cols]
        held = paddle.to_tensor(np.repeat(blocks >= 0, self.block_size, axis=1)[:, :length, None])
        offsets = np.tile(np.arange(self.block_size), cols)[:length]
        slots = self._slots(np.repeat(np.maximum(blocks, 0), self.block_size, axis=1)[:, :length], offsets)
        index = paddle.to_tensor(slots.reshape(-1))
        read = [paddle.gather(t, index) for t in self.tensors[layer]]
        if self.fp8:
            k, v, ks, vs = read
            read = [fp8_dequantize(self.ops, x.view(paddle.float8_e4m3fn), scale, self.dtype)
                    for x, scale in ((k, ks), (v, vs))]
        else:
            read = [x.astype(self.dtype) for x in read]
        out = []
        for i, x in enumerate(read):
            x = x.reshape([self.heads, length, x.shape[-1]])
            fill = paddle.full_like(x, float("nan")) if i == 0 else paddle.zeros_like(x)
            out.append(paddle.where(held, x, fill))
        return tuple(out)

"""The engine's attention on a GPU: K and V in PyTorch tensors of kvcache's layout, read by PyTorch's flex
attention through a block mask built from the tables, with no copy of the cache.

A layer's cache is ``[blocks, kv_heads, block_size, head_dim]`` (``CacheSpec.tensors()``). Flex attention reads
keys as ``[batch, heads, tokens, dim]``, so the cache is viewed as one head of ``blocks * kv_heads *
block_size`` tokens, in units of ``block_size`` rows: unit ``block * kv_heads + head`` is one kv head's part of
one block. The block mask lists, for each request and query head, the units its table names (its kv head's row,
per ``cells``); the mask function turns a unit back into the request's token positions (causal, and the window
and sink of a window head). Blocks of 16 tokens or more.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kvcache.allocator import CacheSpec

Q_TILE = 16  # query rows per block-mask row: a decode step's one query pads to this many

# Past its recompile limit dynamo would run flex attention eagerly, as a slow reference: fail instead.
if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
    torch._dynamo.config.fail_on_recompile_limit_hit = True


class FlexAttention:
    """A rank's attention over its GPU cache (all of the model's kv heads), as ``RankAttention`` on the CPU."""

    reads_tables = True

    def __init__(self, model: Any, spec: CacheSpec, layer_blocks: list[int], cells: np.ndarray, *,
                 max_batch: int, max_tokens: int) -> None:
        """Every step's block mask has the same shape (``max_batch`` requests, ``max_tokens`` queries each, a row
        of every block of the largest layer), so flex attention compiles once per layer size, not per step."""
        c = model.config
        if c.kv_lora_rank:
            raise ValueError("the GPU engine attends grouped-query models (no MLA)")
        key, value = spec.tensors()
        if spec.block_size < 16 or spec.block_size & (spec.block_size - 1):
            raise ValueError(f"block_size: flex attention needs a power of two >= 16, got {spec.block_size}")
        self.model, self.spec, self.cells = model, spec, cells
        self.heads, self.block_size, self.dim = spec.kv_heads_per_rank, spec.block_size, spec.head_dim
        self.group = c.num_q_heads // c.num_kv_heads
        device, dtype = model.ops.device, model.embed.dtype
        self.layer_blocks = list(layer_blocks)
        self.k = [torch.zeros([n, *key.block_shape], dtype=dtype, device=device) for n in layer_blocks]
        self.v = [torch.zeros([n, *value.block_shape], dtype=dtype, device=device) for n in layer_blocks]
        self.windowed = [torch.as_tensor(c.windowed(layer), device=device) for layer in range(c.num_layers)]
        self.window = torch.tensor(c.window, device=device)
        self.sink = torch.tensor(c.sink, device=device)
        self.flex = torch.compile(flex_attention, dynamic=False)
        self.device = device
        self.max_batch, self.q_len = max_batch, -(-max_tokens // Q_TILE) * Q_TILE
        self.width = max(layer_blocks)  # units one request's kv head can name: every block of a layer

    def __call__(self, layer: int, q: torch.Tensor, kv: tuple[torch.Tensor, ...], items: list[Any]) -> torch.Tensor:
        bs, heads, dim = self.block_size, self.heads, self.dim
        k_cache, v_cache = self.k[layer], self.v[layer]
        # 1. This step's K and V into the blocks each head's row names.
        flat_rows = []
        for item in items:
            blocks = item.table[self.cells[layer]][:, item.positions // bs]  # [heads, n]
            if (blocks < 0).any():
                raise RuntimeError(f"layer {layer}: a token is written into a block the table does not hold")
            flat_rows.append((blocks * heads + np.arange(heads)[:, None]) * bs + item.positions % bs)
        index = torch.as_tensor(np.concatenate(flat_rows, axis=1).reshape(-1), device=self.device)
        k, v = kv
        k_cache.view(-1, dim)[index] = k.permute(1, 0, 2).reshape(-1, dim)
        v_cache.view(-1, dim)[index] = v.permute(1, 0, 2).reshape(-1, dim)
        # 2. The block mask: each request's units, and where each unit's tokens sit in the request.
        batch, hq, q_len = self.max_batch, q.shape[1], self.q_len
        if len(items) > batch or max(len(item.positions) for item in items) > q_len:
            raise RuntimeError(f"a step of {len(items)} requests exceeds the block mask's {batch} x {q_len} queries")
        units_total = k_cache.shape[0] * heads
        units: list[list[np.ndarray]] = []
        logical = np.full((batch, units_total), -1, dtype=np.int64)
        for b, item in enumerate(items):
            cols = -(-item.stop // bs)
            per_head = []
            for h in range(heads):
                row = item.table[self.cells[layer, h], :cols]
                held = np.flatnonzero(row >= 0)
                unit = row[held].astype(np.int64) * heads + h
                logical[b, unit] = held
                per_head.append(unit)
            units.append(per_head)
        width = self.width
        kv_indices = np.zeros((batch, hq, q_len // Q_TILE, width), dtype=np.int32)
        kv_num = np.zeros((batch, hq, q_len // Q_TILE), dtype=np.int32)
        q_pos = np.full((batch, q_len), -1, dtype=np.int64)  # padding rows see nothing
        queries = torch.zeros((batch, hq, q_len, dim), dtype=q.dtype, device=self.device)
        lo = 0
        for b, item in enumerate(items):
            n = len(item.positions)
            for h in range(hq):
                unit = units[b][h // self.group]
                kv_indices[b, h, :, :unit.size] = unit
                kv_num[b, h, :] = unit.size
            q_pos[b, :n] = item.positions
            queries[b, :, :n] = q[lo:lo + n].permute(1, 0, 2)
            lo += n
        logical_t = torch.as_tensor(logical, device=self.device)
        q_pos_t = torch.as_tensor(q_pos, device=self.device)
        windowed, window, sink, group, heads_t = self.windowed[layer], self.window, self.sink, self.group, heads

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            unit = kv_idx // bs
            col = logical_t[b, unit]
            pos = col * bs + kv_idx % bs
            qp = q_pos_t[b, q_idx]
            kv_head = h // group
            seen = (col >= 0) & (unit % heads_t == kv_head) & (pos <= qp)
            near = (qp - pos < window) | (pos < sink)
            return seen & (near | ~windowed[kv_head])

        # Forward only: no query-block index (its dense transpose would span every unit of the cache).
        block_mask = BlockMask.from_kv_blocks(
            torch.as_tensor(kv_num, device=self.device), torch.as_tensor(kv_indices, device=self.device),
            BLOCK_SIZE=(Q_TILE, bs), mask_mod=mask_mod, seq_lengths=(q_len, units_total * bs), compute_q_blocks=False)
        keys = k_cache.view(1, 1, units_total * bs, dim).expand(batch, 1, units_total * bs, dim)
        values = v_cache.view(1, 1, units_total * bs, dim).expand(batch, 1, units_total * bs, dim)
        out = self.flex(queries, keys, values, block_mask=block_mask, enable_gqa=True,
                        kernel_options={"BLOCK_M": Q_TILE, "BLOCK_N": bs})
        return torch.cat([out[b, :, :len(item.positions)].permute(1, 0, 2) for b, item in enumerate(items)], dim=0)

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

from typing import Any, NamedTuple

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kvcache.allocator import CacheSpec

Q_TILE = 16  # query rows per block-mask row: a decode step's one query pads to this many

# Past its recompile limit dynamo would run flex attention eagerly, as a slow reference: fail instead. Each layer
# size and block-mask width compiles once (widths are powers of two), so allow that many.
if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
    torch._dynamo.config.fail_on_recompile_limit_hit = True
for _name in ("recompile_limit", "cache_size_limit"):
    if hasattr(torch._dynamo.config, _name):
        setattr(torch._dynamo.config, _name, 64)


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
        self._windows = [tuple(c.windowed(layer).tolist()) for layer in range(c.num_layers)]
        self._current: _Step | None = None

    def __call__(self, layer: int, q: torch.Tensor, kv: tuple[torch.Tensor, ...], items: list[Any]) -> torch.Tensor:
        bs, heads, dim = self.block_size, self.heads, self.dim
        k_cache, v_cache = self.k[layer], self.v[layer]
        step = self._step(items)
        plan = self._layer_plan(step, layer, k_cache.shape[0] * heads)
        # This step's K and V into the blocks each head's row names, then attention over the blocks by mask.
        k, v = kv
        k_cache.view(-1, dim)[plan.write] = k.permute(1, 0, 2).reshape(-1, dim)
        v_cache.view(-1, dim)[plan.write] = v.permute(1, 0, 2).reshape(-1, dim)
        queries = torch.zeros((self.max_batch, q.shape[1], self.q_len, dim), dtype=q.dtype, device=self.device)
        queries[step.batch, :, step.row] = q
        tokens = k_cache.shape[0] * heads * bs
        keys = k_cache.view(1, 1, tokens, dim).expand(self.max_batch, 1, tokens, dim)
        values = v_cache.view(1, 1, tokens, dim).expand(self.max_batch, 1, tokens, dim)
        out = self.flex(queries, keys, values, block_mask=plan.mask, enable_gqa=True,
                        kernel_options={"BLOCK_M": Q_TILE, "BLOCK_N": bs})
        return out[step.batch, :, step.row]

    def _step(self, items: list[Any]) -> _Step:
        """What every layer of this step shares: where each query row goes, and the tables side by side."""
        if self._current is not None and self._current.items is items:
            return self._current
        if len(items) > self.max_batch or max(len(item.positions) for item in items) > self.q_len:
            raise RuntimeError(f"a step of {len(items)} requests exceeds the block mask's {self.max_batch} x "
                               f"{self.q_len} queries")
        counts = np.array([len(item.positions) for item in items])
        batch = np.repeat(np.arange(len(items)), counts)
        row = np.concatenate([np.arange(n) for n in counts])
        q_pos = np.full((self.max_batch, self.q_len), -1, dtype=np.int64)  # padding rows see nothing
        q_pos[batch, row] = np.concatenate([item.positions for item in items])
        width = max(item.table.shape[1] for item in items)
        tables = np.full((len(items), items[0].table.shape[0], width), -1, dtype=np.int64)
        for b, item in enumerate(items):
            tables[b, :, :item.table.shape[1]] = item.table
        cols = np.array([-(-item.stop // self.block_size) for item in items])
        self._current = _Step(items, torch.as_tensor(batch, device=self.device),
                              torch.as_tensor(row, device=self.device), torch.as_tensor(q_pos, device=self.device),
                              tables, cols, batch, np.concatenate([item.positions for item in items]),
                              live_tiles(counts, self.q_len), {})
        return self._current

    def _layer_plan(self, step: _Step, layer: int, units_total: int) -> _LayerPlan:
        """The write rows and the block mask of a layer; layers whose heads read the same rows and hold as many
        blocks share them within a step."""
        rows = self.cells[layer]
        key = (tuple(rows.tolist()), units_total)
        masked = (key, self._windows[layer])  # layers whose heads also window alike share the block mask too
        plan = step.plans.get(masked)
        if plan is not None:
            return plan
        plan = step.plans.get(key)
        if plan is not None:
            plan = step.plans[masked] = plan._replace(mask=self._with_mask_mod(plan, layer))
            return plan
        bs, heads = self.block_size, self.heads
        by_head = step.tables[:, rows, :]  # [batch, heads, columns]
        blocks = by_head[step.token_batch, :, step.positions // bs].T  # [heads, tokens]
        if (blocks < 0).any():
            raise RuntimeError(f"layer {layer}: a token is written into a block the table does not hold")
        write = (blocks * heads + np.arange(heads)[:, None]) * bs + step.positions % bs
        n, dev = len(step.items), self.device
        valid = (by_head >= 0) & (np.arange(by_head.shape[2])[None, None, :] < step.cols[:, None, None])
        units = by_head * heads + np.arange(heads)[None, :, None]
        order = np.argsort(~valid, axis=-1, kind="stable")  # each (request, head)'s units first, in column order
        packed = np.take_along_axis(np.where(valid, units, 0), order, axis=-1)
        counts = valid.sum(axis=-1)  # [requests, heads]
        # A power of two as wide as the most units a (request, head) names: a few shapes to compile, not one a step.
        width = min(self.width, 1 << max(0, int(counts.max(initial=1)) - 1).bit_length())
        q_heads = torch.as_tensor(np.arange(self.model.config.num_q_heads) // self.group, device=dev)
        tiles = self.q_len // Q_TILE
        kv_indices = torch.zeros((self.max_batch, q_heads.numel(), tiles, width), dtype=torch.int32, device=dev)
        held = min(width, packed.shape[2])  # the units come first; a table may be narrower than the bucket
        kv_indices[:n, :, :, :held] = torch.as_tensor(packed[:, :, :held].astype(np.int32), device=dev)[:, q_heads,
                                                                                                       None, :]
        kv_num = torch.zeros((self.max_batch, q_heads.numel(), tiles), dtype=torch.int32, device=dev)
        live = torch.as_tensor(step.live_tiles, device=dev)
        kv_num[:n] = torch.as_tensor(counts.astype(np.int32), device=dev)[:, q_heads, None] * live[:, None, :]
        logical = torch.full((self.max_batch, units_total), -1, dtype=torch.int64, device=dev)
        b, h, c = np.nonzero(valid)
        logical[torch.as_tensor(b, device=dev), torch.as_tensor(units[b, h, c], device=dev)] = \
            torch.as_tensor(c, device=dev)
        plan = _LayerPlan(torch.as_tensor(write.reshape(-1), device=dev), kv_num, kv_indices, logical, units_total,
                          None)
        step.plans[key] = plan
        plan = step.plans[masked] = plan._replace(mask=self._with_mask_mod(plan, layer))
        return plan

    def _with_mask_mod(self, plan: _LayerPlan, layer: int) -> BlockMask:
        """The layer's block mask: the plan's units, and a mask function mapping a unit back to positions."""
        bs, heads_t, group = self.block_size, self.heads, self.group
        logical_t, q_pos_t = plan.logical, self._current.q_pos
        windowed, window, sink = self.windowed[layer], self.window, self.sink

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
        return BlockMask.from_kv_blocks(plan.kv_num, plan.kv_indices, BLOCK_SIZE=(Q_TILE, bs), mask_mod=mask_mod,
                                        seq_lengths=(self.q_len, plan.units * bs), compute_q_blocks=False)


class _Step(NamedTuple):
    items: list[Any]
    batch: torch.Tensor  # each query row's request, and its row there
    row: torch.Tensor
    q_pos: torch.Tensor  # [max_batch, q_len] positions, -1 for padding
    tables: np.ndarray  # [requests, table rows, columns], -1 padded
    cols: np.ndarray  # columns each request's queries may read
    token_batch: np.ndarray
    positions: np.ndarray
    live_tiles: np.ndarray  # [requests, query tiles]: 1 where the tile holds one of the request's queries
    plans: dict[Any, _LayerPlan]


def live_tiles(counts: np.ndarray, q_len: int) -> np.ndarray:
    """int32 [requests, q_len / Q_TILE]: 1 for each query tile that holds one of the request's ``counts`` queries."""
    return (np.arange(q_len // Q_TILE)[None, :] * Q_TILE < counts[:, None]).astype(np.int32)


class _LayerPlan(NamedTuple):
    write: torch.Tensor  # flat cache rows of this step's tokens, head-major
    kv_num: torch.Tensor
    kv_indices: torch.Tensor
    logical: torch.Tensor  # [max_batch, units]: a unit's column in the request, -1 where not its
    units: int
    mask: BlockMask | None


class ContiguousAttention:
    """The benchmark's limit: each request's K and V in a contiguous region of its own (``max_len`` tokens of a
    slot), read by the same flex attention with a causal mask and no table. Uniform full attention only."""

    reads_tables = False

    def __init__(self, model: Any, *, max_batch: int, max_len: int, max_tokens: int, block_size: int = 16) -> None:
        c = model.config
        self.model, self.device, self.block_size = model, model.ops.device, block_size
        shape = (max_batch, c.num_kv_heads, -(-max_len // block_size) * block_size, c.head_dim)
        self.k = [torch.zeros(shape, dtype=model.embed.dtype, device=self.device) for _ in range(c.num_layers)]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.max_batch, self.q_len = max_batch, -(-max_tokens // Q_TILE) * Q_TILE
        self.flex = torch.compile(flex_attention, dynamic=False)
        self.slots: dict[Any, int] = {}
        self._current: Any = None

    def __call__(self, layer: int, q: torch.Tensor, kv: tuple[torch.Tensor, ...], items: list[Any]) -> torch.Tensor:
        if self._current is None or self._current[0] is not items:
            self._current = (items, self._plan(items))
        slot_of_token, pos, batch, row, mask = self._current[1]
        k, v = kv
        self.k[layer][slot_of_token, :, pos] = k
        self.v[layer][slot_of_token, :, pos] = v
        queries = torch.zeros((self.max_batch, q.shape[1], self.q_len, q.shape[2]), dtype=q.dtype, device=self.device)
        queries[batch, :, row] = q
        out = self.flex(queries, self.k[layer], self.v[layer], block_mask=mask, enable_gqa=True,
                        kernel_options={"BLOCK_M": Q_TILE, "BLOCK_N": self.block_size})
        return out[batch, :, row]

    def _plan(self, items: list[Any]) -> tuple[Any, ...]:
        for item in items:
            if item.rid not in self.slots:
                if len(self.slots) >= self.max_batch:
                    raise RuntimeError("more requests than the contiguous cache has slots")
                self.slots[item.rid] = len(self.slots)
        slots = np.array([self.slots[item.rid] for item in items])
        counts = np.array([len(item.positions) for item in items])
        slot_of_token = np.repeat(slots, counts)
        row = np.concatenate([np.arange(n) for n in counts])
        pos = np.concatenate([item.positions for item in items])
        q_pos = np.full((self.max_batch, self.q_len), -1, dtype=np.int64)
        q_pos[slot_of_token, row] = pos
        bs, width = self.block_size, self.k[0].shape[2] // self.block_size
        kv_num = np.zeros((self.max_batch, 1, self.q_len // Q_TILE), dtype=np.int32)
        kv_num[slots] = np.array([-(-item.stop // bs) for item in items])[:, None, None]
        kv_num[slots] *= live_tiles(counts, self.q_len)[:, None, :]
        kv_indices = np.broadcast_to(np.arange(width, dtype=np.int32), (self.max_batch, 1, self.q_len // Q_TILE, width))
        q_pos_t = torch.as_tensor(q_pos, device=self.device)

        def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return kv_idx <= q_pos_t[b, q_idx]

        mask = BlockMask.from_kv_blocks(torch.as_tensor(kv_num, device=self.device),
                                        torch.as_tensor(np.ascontiguousarray(kv_indices), device=self.device),
                                        BLOCK_SIZE=(Q_TILE, bs), mask_mod=causal,
                                        seq_lengths=(self.q_len, width * bs), compute_q_blocks=False)
        dev = self.device
        return (torch.as_tensor(slot_of_token, device=dev), torch.as_tensor(pos, device=dev),
                torch.as_tensor(slot_of_token, device=dev), torch.as_tensor(row, device=dev), mask)

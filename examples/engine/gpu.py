"""The engine's attention on a GPU: kvcache's cache tensors in PyTorch, read by PyTorch's flex attention through a
block mask built from the tables, with no copy of the cache.

A layer's cache is ``[blocks, kv_heads, block_size, head_dim]`` (``CacheSpec.tensors()``). Flex attention reads
keys as ``[batch, heads, tokens, dim]``, so the cache is viewed as one head of ``blocks * kv_heads *
block_size`` tokens, in units of ``block_size`` slots: unit ``block * kv_heads + head`` is one kv head's part of
one block. The block mask lists, for each request, query head and tile of queries, the units its table names (its
kv head's row, per ``head_rows``): units every query of the tile sees whole (behind the tile's first query, inside
a window head's window, inside the queries' chunk on a chunked layer) as full blocks, read with no mask function,
and the rest (the diagonal, a window's edge, a chunk's start) as partial blocks, where the mask function turns a
unit back into the request's token positions. Blocks of 16 tokens or more. Llama 4's chunked layers (a query sees
only the keys of its own chunk) are one more rule in the mask function and the tile bounds; units wholly in
earlier chunks are not listed at all, so the kernel skips them.

As on the CPU (``attention.refuse_unheld``), a step whose mask lets a query see a token in a block its table no
longer holds is refused before attention reads.

MLA's cache is one latent head: queries are absorbed into the latent (``q W_uk``), attend over the latent as
keys and values, and the output is projected back (``W_uv``). A block_wise_fp8 cache keeps float8 bytes with a
float32 scale per token and head; a layer is dequantized before attention reads it.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kvcache.allocator import CacheSpec

from attention import refuse_unheld
from model import fp8_round_trip

Q_TILE = 16  # query rows per block-mask row: a decode step's one query pads to this many

# Past its recompile limit dynamo would run flex attention eagerly, as a slow reference: fail instead. Each layer
# size and pair of block-mask widths compiles once (widths are powers of two), so allow that many.
if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
    torch._dynamo.config.fail_on_recompile_limit_hit = True
for _name in ("recompile_limit", "cache_size_limit"):
    if hasattr(torch._dynamo.config, _name):
        setattr(torch._dynamo.config, _name, 64)


class FlexAttention:
    """A rank's attention over its GPU cache (its kv heads: all of the model's cache heads without TP), as
    ``RankAttention`` on the CPU."""

    reads_tables = True

    def __init__(self, model: Any, spec: CacheSpec, layer_blocks: list[int], head_rows: np.ndarray, *,
                 max_batch: int, max_tokens: int, heads: range | None = None) -> None:
        """Every step's block mask has the same shape (``max_batch`` requests, ``max_tokens`` queries each), so
        flex attention compiles once per layer size and mask width, not per step. ``heads``: the model's kv heads
        this rank holds (a TP rank's; default all), whose query heads ``q`` brings."""
        c = model.config
        tensors = spec.tensors()
        names = [t.name for t in tensors]
        self.mla, self.fp8 = names == ["latent"], names == ["key", "value", "key_scale", "value_scale"]
        if not (self.mla or self.fp8 or names == ["key", "value"]):
            raise ValueError(f"quant: the GPU engine reads none, block_wise_fp8 and MLA caches, not {spec.quant.value}")
        if self.fp8 and spec.scale_layout.value != "default":
            raise ValueError("scale_layout: the engine writes block_wise_fp8's per-token scales ([blocks, heads, "
                             "block]); what the blackwell layout's four values per block and head hold is not defined")
        if spec.block_size < 16 or spec.block_size & (spec.block_size - 1):
            raise ValueError(f"block_size: flex attention needs a power of two >= 16, got {spec.block_size}")
        self.model, self.spec, self.head_rows = model, spec, head_rows
        self.heads, self.block_size = spec.kv_heads_per_rank, spec.block_size
        self.dim = tensors[0].block_shape[2]
        self.q_per_kv = c.num_q_heads // c.num_kv_heads
        self.device = device = model.ops.device
        # Flex attention computes in the model's dtype; a float64 model (the fp8 check's) attends in float32.
        self.dtype = torch.float32 if model.embed.dtype == torch.float64 else model.embed.dtype
        self.layer_blocks = list(layer_blocks)
        # float8 values live as their bytes (uint8) as in the CPU engine; scales as the spec says (float32).
        stored = {"float8_e4m3fn": torch.uint8, "float32": torch.float32}
        self.cache = [{t.name: torch.zeros([n, *t.block_shape], device=device,
                                           dtype=stored[t.dtype] if self.fp8 else self.dtype) for t in tensors}
                      for n in layer_blocks]
        self.kv_heads = range(c.cache_heads) if heads is None else heads
        self.windowed = [torch.as_tensor(self._windowed(layer), device=device) for layer in range(c.num_layers)]
        self.window, self.sink = c.window, c.sink
        self.chunks = [c.chunk if c.chunked(layer) else 0 for layer in range(c.num_layers)]  # 0: not chunked
        self.flex = torch.compile(flex_attention, dynamic=False)
        self.max_batch, self.q_len = max_batch, -(-max_tokens // Q_TILE) * Q_TILE
        # Layers whose heads read the same rows, window and chunk alike and hold as many blocks share a step's plan.
        self._plan_keys = [(tuple(head_rows[layer].tolist()), tuple(self._windowed(layer).tolist()), self.chunks[layer],
                            layer_blocks[layer])
                           for layer in range(c.num_layers)]
        self._current: _Step | None = None

    def _windowed(self, layer: int) -> np.ndarray:
        """bool [the rank's kv heads]: which of them attend through the window in ``layer``."""
        return self.model.config.windowed(layer)[self.kv_heads.start:self.kv_heads.stop]

    def views(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's cache tensors by name, shaped as ``CacheSpec.tensors()`` says (for a host tier's region)."""
        return self.cache[layer]

    def __call__(self, layer: int, q: torch.Tensor, kv: tuple[torch.Tensor, ...], items: list[Any]) -> torch.Tensor:
        step = self._step(items)
        for load in step.loads:  # a host tier's copy back of these blocks: this layer's must have landed
            if load.wait(layer, timeout=10).value != "done":
                raise RuntimeError(f"layer {layer}: the host tier's copy did not land")
        plan = self._layer_plan(step, layer)
        self._write(layer, plan.write, kv)
        keys, values = self._read(layer)
        queries = torch.zeros((self.max_batch, q.shape[1], step.q_len, keys.shape[-1]), dtype=self.dtype,
                              device=self.device)
        queries[step.batch, :, step.row] = self._absorb(layer, q).to(self.dtype)
        tokens = self.layer_blocks[layer] * self.heads * self.block_size
        keys = keys.view(1, 1, tokens, -1).expand(self.max_batch, 1, tokens, -1)
        values = values.view(1, 1, tokens, -1).expand(self.max_batch, 1, tokens, -1)
        out = self.flex(queries, keys, values, block_mask=plan.mask, scale=self.model.softmax_scale(q.shape[-1]),
                        enable_gqa=True, kernel_options={"BLOCK_M": Q_TILE, "BLOCK_N": self.block_size})
        return self._project(layer, out[step.batch, :, step.row]).to(q.dtype)

    def _write(self, layer: int, slots: torch.Tensor, kv: tuple[torch.Tensor, ...]) -> None:
        """This step's K and V (or latent) [n, heads, dim] into the cache slots ``slots`` (head-major)."""
        cache = self.cache[layer]
        flat = [x.permute(1, 0, 2).reshape(-1, x.shape[-1]) for x in kv]
        if self.fp8:
            for x, name in zip(flat, ("key", "value")):
                values, scale = fp8_round_trip(self.model.ops, x)
                cache[name].view(-1, self.dim)[slots] = values.view(torch.uint8)
                cache[name + "_scale"].view(-1)[slots] = scale[:, 0]
            return
        for x, tensor in zip(flat, cache.values()):
            tensor.view(-1, self.dim)[slots] = x.to(self.dtype)

    def _read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values as attention reads them: in place, or dequantized from float8."""
        cache = self.cache[layer]
        if self.mla:
            return cache["latent"], cache["latent"]
        if not self.fp8:
            return cache["key"], cache["value"]
        return tuple(cache[name].view(torch.float8_e4m3fn).to(self.dtype) * cache[name + "_scale"][..., None]
                     .to(self.dtype) for name in ("key", "value"))

    def _absorb(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Queries as they meet the cache: MLA folds each head's key projection into its query (scores against
        the latent itself); other models' queries as they are."""
        if not self.mla:
            return q
        c, w = self.model.config, self.model.layers[layer]
        w_uk = w["w_uk"].reshape(c.kv_lora_rank, c.num_q_heads, c.head_dim)
        absorbed = torch.einsum("nhd,rhd->nhr", q[:, :, :c.head_dim], w_uk)
        return torch.cat([absorbed, q[:, :, c.head_dim:]], dim=-1)

    def _project(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        """MLA: attention's output over the latent (its first ``kv_lora_rank`` values) through each head's value
        projection; other models' output as it is."""
        if not self.mla:
            return out
        c, w = self.model.config, self.model.layers[layer]
        w_uv = w["w_uv"].reshape(c.kv_lora_rank, c.num_q_heads, c.head_dim)
        return torch.einsum("nhr,rhd->nhd", out[:, :, :c.kv_lora_rank].to(w_uv.dtype), w_uv)

    def _step(self, items: list[Any]) -> _Step:
        """What every layer of this step shares: where each query row goes, and the tables side by side."""
        if self._current is not None and self._current.items is items:
            return self._current
        counts = np.array([len(item.positions) for item in items])
        if len(items) > self.max_batch or counts.max() > self.q_len:
            raise RuntimeError(f"a step of {len(items)} requests exceeds the block mask's {self.max_batch} x "
                               f"{self.q_len} queries")
        q_len = Q_TILE if counts.max() <= Q_TILE else self.q_len  # decode steps: one tile of queries, not a chunk's
        batch = np.repeat(np.arange(len(items)), counts)
        row = np.concatenate([np.arange(n) for n in counts])
        q_pos = np.full((self.max_batch, q_len), -1, dtype=np.int64)  # padding rows see nothing
        q_pos[batch, row] = np.concatenate([item.positions for item in items])
        width = max(item.table.shape[1] for item in items)
        tables = np.full((len(items), items[0].table.shape[0], width), -1, dtype=np.int64)
        for b, item in enumerate(items):
            tables[b, :, :item.table.shape[1]] = item.table
        cols = np.array([-(-item.stop // self.block_size) for item in items])
        batch_t, row_t, q_pos_t = upload([batch, row, q_pos], np.int64, self.device)
        self._current = _Step(items, [item.load for item in items if item.load is not None], q_len, batch_t, row_t,
                              q_pos, q_pos_t, tables, cols, batch, np.concatenate([item.positions for item in items]),
                              {})
        return self._current

    def _layer_plan(self, step: _Step, layer: int) -> _LayerPlan:
        """The write slots and the block mask of a layer; layers whose heads read the same rows, window alike and
        hold as many blocks share them within a step."""
        key = self._plan_keys[layer]
        if key in step.plans:
            return step.plans[key]
        rows, windowed = self.head_rows[layer], self._windowed(layer)
        units_total = self.layer_blocks[layer] * self.heads
        bs, heads, dev = self.block_size, self.heads, self.device
        for item in step.items:
            refuse_unheld(self.model.config, layer, item, self.head_rows, self.kv_heads, bs)
        by_head = step.tables[:, rows, :]  # [batch, heads, columns]
        blocks = by_head[step.token_batch, :, step.positions // bs].T  # [heads, tokens]
        if (blocks < 0).any():
            raise RuntimeError(f"layer {layer}: a token is written into a block the table does not hold")
        write = (blocks * heads + np.arange(heads)[:, None]) * bs + step.positions % bs
        valid = (by_head >= 0) & (np.arange(by_head.shape[2])[None, None, :] < step.cols[:, None, None])
        units = by_head * heads + np.arange(heads)[None, :, None]
        b, h, c = np.nonzero(valid)
        write_t, b_t, unit_t, c_t = upload([write.reshape(-1), b, units[b, h, c], c], np.int64, dev)
        logical = torch.full((self.max_batch, units_total), -1, dtype=torch.int64, device=dev)
        logical[b_t, unit_t] = c_t
        tiles = TileBlocks.of(step.q_pos, units, valid, windowed, self.window, self.sink, bs, self.chunks[layer])
        parts = upload(tiles.arrays(self.max_batch, _min_width(dev, units_total)), np.int32, dev)
        # Each query head reads its kv head's units: the kv heads' lists, repeated for its query heads.
        parts = [x.repeat_interleave(self.q_per_kv, dim=1) for x in parts]
        plan = step.plans[key] = _LayerPlan(write_t, self._mask(parts, logical, layer, units_total))
        return plan

    def _mask(self, parts: tuple[torch.Tensor, ...], logical: torch.Tensor, layer: int, units: int) -> BlockMask:
        """The layer's block mask: full and partial units, and a mask function mapping a partial unit back to
        positions."""
        bs, heads_t, q_per_kv = self.block_size, self.heads, self.q_per_kv
        q_pos_t = self._current.q_pos_t
        windowed, window, sink, chunk = self.windowed[layer], self.window, self.sink, self.chunks[layer]

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            unit = kv_idx // bs
            col = logical[b, unit]
            pos = col * bs + kv_idx % bs
            qp = q_pos_t[b, q_idx]
            kv_head = h // q_per_kv
            seen = (col >= 0) & (unit % heads_t == kv_head) & (pos <= qp)
            if chunk:  # a chunked layer: only the keys of the query's own chunk
                seen = seen & (pos // chunk == qp // chunk)
            near = (qp - pos < window) | (pos < sink)
            return seen & (near | ~windowed[kv_head])

        # Forward only: no query-block index (its dense transpose would span every unit of the cache).
        return BlockMask.from_kv_blocks(*parts, BLOCK_SIZE=(Q_TILE, bs), mask_mod=mask_mod,
                                        seq_lengths=(self._current.q_len, units * bs), compute_q_blocks=False)


class TileBlocks(NamedTuple):
    """For each live tile of queries (a request's ``Q_TILE`` query rows holding at least one query) and kv head,
    the units it reads whole and those it reads in part, packed in column order."""

    batch: np.ndarray  # [tiles]: the tile's request
    tile: np.ndarray  # [tiles]: its index among the request's tiles
    tile_count: int  # tiles per request, live or not
    full: np.ndarray  # [tiles, heads, width] units, then padding
    full_count: np.ndarray  # [tiles, heads]
    partial: np.ndarray
    partial_count: np.ndarray

    @classmethod
    def of(cls, q_pos: np.ndarray, units: np.ndarray, valid: np.ndarray, windowed: np.ndarray, window: int,
           sink: int, block_size: int, chunk: int = 0) -> TileBlocks:
        """``q_pos`` [batch, queries] (-1: padding), ``units``/``valid`` [requests, heads, columns] (column c holds
        positions ``c * block_size`` on), ``windowed`` [heads]: which heads see only ``window`` tokens back and the
        first ``sink``; ``chunk`` (0: none): each query sees only the keys of its own chunk of that many tokens.
        A unit is full for a tile when every query of the tile sees all of its positions."""
        tiles_q = q_pos[:len(units)].reshape(len(units), -1, Q_TILE)
        real = tiles_q >= 0
        batch, tile = np.nonzero(real.any(axis=-1))
        q_min = np.where(real, tiles_q, np.iinfo(np.int64).max).min(axis=-1)[batch, tile][:, None]
        q_max = tiles_q.max(axis=-1)[batch, tile][:, None]
        first = np.arange(units.shape[2])[None, :] * block_size
        last = first + block_size - 1
        near_all = (first > q_max - window) | (last < sink)
        near_any = (q_min - last < window) | (first < sink)  # needed for any pair to be near: a loose bound
        w = windowed[None, :, None]
        held = valid[batch]
        full = held & (last <= q_min)[:, None, :] & (near_all[:, None, :] | ~w)
        seen = held & (first <= q_max)[:, None, :] & (near_any[:, None, :] | ~w)
        if chunk:  # whole in the last query's chunk (so in the first's too); partly in the first query's chunk
            full &= (first >= q_max // chunk * chunk)[:, None, :]
            seen &= (last >= q_min // chunk * chunk)[:, None, :]
        partial = seen & ~full
        packed = [_pack(units[batch], part) for part in (full, partial)]
        return cls(batch, tile, tiles_q.shape[1], *packed[0], *packed[1])

    def arrays(self, max_batch: int, min_width: int = 1) -> list[np.ndarray]:
        """``BlockMask.from_kv_blocks``'s partial (num, indices) and full (num, indices) per kv head:
        [max_batch, heads, tiles(, width of at least ``min_width``)], int32."""
        heads, tiles = self.partial.shape[1], int(self.tile_count)
        # One width for both: the GPU kernel finds a row of the full indices at the partial indices' strides.
        width = max(min_width, self.partial.shape[2], self.full.shape[2])
        out = []
        for units, count in ((self.partial, self.partial_count), (self.full, self.full_count)):
            num = np.zeros((max_batch, heads, tiles), dtype=np.int32)
            indices = np.zeros((max_batch, heads, tiles, width), dtype=np.int32)
            num[self.batch, :, self.tile] = count
            indices[self.batch, :, self.tile, :units.shape[2]] = units
            out += [num, indices]
        return out


def upload(arrays: list[np.ndarray], dtype: Any, device: Any) -> list[torch.Tensor]:
    """Host arrays on the device as ``dtype``, in one copy (a step's plan is many small arrays, and each copy
    costs far more than its bytes)."""
    flat = torch.as_tensor(np.concatenate([np.asarray(a, dtype=dtype).ravel() for a in arrays]), device=device)
    out, at = [], 0
    for a in arrays:
        out.append(flat[at:at + a.size].view(a.shape))
        at += a.size
    return out


def _min_width(device: Any, units: int) -> int:
    """Flex attention on the CPU wants a block mask as wide as the keys' blocks; on a GPU any width serves."""
    return units if torch.device(device).type == "cpu" else 1


def _pack(units: np.ndarray, chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The chosen units of each [..., columns] row first, in column order, in a power-of-two width (a few shapes to
    compile, not one a step); and how many each row has."""
    counts = chosen.sum(axis=-1)
    width = 1 << max(0, int(counts.max(initial=1)) - 1).bit_length()
    packed = np.zeros((*chosen.shape[:-1], width), dtype=units.dtype)
    at = np.nonzero(chosen)
    packed[(*at[:-1], (np.cumsum(chosen, axis=-1) - 1)[at])] = units[at]
    return packed, counts


class _Step(NamedTuple):
    items: list[Any]
    loads: list[Any]  # the host tier's copies these items wait for
    q_len: int  # query rows per request in this step's mask: one tile when every request decodes
    batch: torch.Tensor  # each query row's request, and its row there
    row: torch.Tensor
    q_pos: np.ndarray  # [max_batch, q_len] positions, -1 for padding
    q_pos_t: torch.Tensor
    tables: np.ndarray  # [requests, table rows, columns], -1 padded
    cols: np.ndarray  # columns each request's queries may read
    token_batch: np.ndarray
    positions: np.ndarray
    plans: dict[Any, _LayerPlan]


class _LayerPlan(NamedTuple):
    write: torch.Tensor  # flat cache slots of this step's tokens, head-major
    mask: BlockMask


class ContiguousAttention:
    """The benchmark's limit: each request's K and V in a contiguous region of its own (``max_len`` tokens of a
    slot), read by the same flex attention (full blocks behind the queries, a causal mask on the diagonal) with no
    table. Uniform full attention only."""

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
        slot_of_token, pos, row, q_len, mask = self._current[1]
        k, v = kv
        self.k[layer][slot_of_token, :, pos] = k
        self.v[layer][slot_of_token, :, pos] = v
        queries = torch.zeros((self.max_batch, q.shape[1], q_len, q.shape[2]), dtype=q.dtype, device=self.device)
        queries[slot_of_token, :, row] = q
        out = self.flex(queries, self.k[layer], self.v[layer], block_mask=mask, enable_gqa=True,
                        kernel_options={"BLOCK_M": Q_TILE, "BLOCK_N": self.block_size})
        return out[slot_of_token, :, row]

    def _plan(self, items: list[Any]) -> tuple[Any, ...]:
        for item in items:
            if item.rid not in self.slots:
                if len(self.slots) >= self.max_batch:
                    raise RuntimeError("more requests than the contiguous cache has slots")
                self.slots[item.rid] = len(self.slots)
        slots = np.array([self.slots[item.rid] for item in items])
        counts = np.array([len(item.positions) for item in items])
        q_len = Q_TILE if counts.max() <= Q_TILE else self.q_len  # as FlexAttention: decode steps, one tile
        slot_of_token = np.repeat(slots, counts)
        row = np.concatenate([np.arange(n) for n in counts])
        pos = np.concatenate([item.positions for item in items])
        q_pos = np.full((self.max_batch, q_len), -1, dtype=np.int64)
        q_pos[slot_of_token, row] = pos
        bs, width = self.block_size, self.k[0].shape[2] // self.block_size
        units = np.broadcast_to(np.arange(width), (self.max_batch, 1, width))
        valid = np.zeros((self.max_batch, 1, width), dtype=bool)
        valid[slots] = (np.arange(width)[None, :] < np.array([-(-item.stop // bs) for item in items])[:, None])[:, None]
        tiles = TileBlocks.of(q_pos, units, valid, np.zeros(1, dtype=bool), 0, 0, bs)
        parts = upload(tiles.arrays(self.max_batch, _min_width(self.device, width)), np.int32, self.device)
        slot_t, pos_t, row_t, q_pos_t = upload([slot_of_token, pos, row, q_pos], np.int64, self.device)

        def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return kv_idx <= q_pos_t[b, q_idx]

        mask = BlockMask.from_kv_blocks(*parts, BLOCK_SIZE=(Q_TILE, bs), mask_mod=causal,
                                        seq_lengths=(q_len, width * bs), compute_q_blocks=False)
        return slot_t, pos_t, row_t, q_len, mask

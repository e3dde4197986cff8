"""A continuous-batching engine whose KV lives in kvcache's paged blocks: the template an engine author copies.

Per step the scheduler (``Engine.step``) grows every decoding request by its
last sampled token (``extend_many``), continues chunked prefills
(``extend``), admits waiting requests with their prefix hits (``admit`` with
``num_tokens``), and preempts a request whose blocks run out (``free``; it
comes back later and recomputes what the prefix cache no longer holds). The
model then writes each new token's K and V into the blocks its table names
(``PagedCache.write``) and attends over the blocks by table
(``PagedCache.gather``): one table row per (layer, kv head) as the cache's
rows say (``table_cells``: uniform, per kv head, per layer group, or both).
A block a table no longer holds (-1, given back by a sliding window) reads as
NaN keys, so a block freed too early cannot go unnoticed.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import numpy as np
import paddle

from kvcache.allocator import CacheSpec, KVCacheManager
from kvcache.allocator.rows import table_cells

from model import Model, attention, visible


class PagedCache:
    """Every layer's K and V as Paddle float32 tensors shaped as ``CacheSpec.tensors()`` says, at the layer's blocks."""

    def __init__(self, spec: CacheSpec, layer_blocks: list[int]) -> None:
        self.spec = spec
        self.heads, self.block_size = spec.kv_heads_per_rank, spec.block_size
        (key, value) = spec.tensors()
        assert (key.name, value.name) == ("key", "value") and key.block_shape == (self.heads, self.block_size,
                                                                                  spec.head_dim)
        # Flat [blocks * heads * block_size, head_dim]: row ((block * heads + head) * block_size + offset).
        self.keys = [paddle.zeros([n * self.heads * self.block_size, spec.head_dim], dtype="float32")
                     for n in layer_blocks]
        self.values = [paddle.zeros_like(k) for k in self.keys]

    def _rows(self, blocks: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Flat rows of (block, head, offset): blocks [heads, n], offsets [n] -> [heads, n]."""
        heads = np.arange(self.heads)[:, None]
        return (blocks * self.heads + heads) * self.block_size + offsets[None, :]

    def write(self, layer: int, table: np.ndarray, cells: np.ndarray, positions: np.ndarray,
              k: paddle.Tensor, v: paddle.Tensor) -> None:
        """Store K and V ([n, heads, d]) of ``positions`` in the blocks each head's row of ``table`` names."""
        blocks = table[cells[layer]][:, positions // self.block_size]  # [heads, n]
        if (blocks < 0).any():
            raise RuntimeError(f"layer {layer}: a token is written into a block the table does not hold")
        index = paddle.to_tensor(self._rows(blocks, positions % self.block_size).reshape(-1))
        self.keys[layer][index] = k.transpose([1, 0, 2]).reshape([-1, self.spec.head_dim])
        self.values[layer][index] = v.transpose([1, 0, 2]).reshape([-1, self.spec.head_dim])

    def gather(self, layer: int, table: np.ndarray, cells: np.ndarray, length: int
               ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """K and V [heads, length, d] of tokens ``[0, length)`` by table; keys in blocks the table lacks are NaN."""
        cols = -(-length // self.block_size)
        blocks = table[cells[layer]][:, :cols]  # [heads, cols]
        held = np.repeat(blocks >= 0, self.block_size, axis=1)[:, :length]  # [heads, length]
        offsets = np.tile(np.arange(self.block_size), cols)[:length]
        rows = self._rows(np.repeat(np.maximum(blocks, 0), self.block_size, axis=1)[:, :length], offsets)
        index = paddle.to_tensor(rows.reshape(-1))
        d = self.spec.head_dim
        k = paddle.gather(self.keys[layer], index).reshape([self.heads, length, d])
        v = paddle.gather(self.values[layer], index).reshape([self.heads, length, d])
        held_t = paddle.to_tensor(held[:, :, None])
        k = paddle.where(held_t, k, paddle.full_like(k, float("nan")))
        v = paddle.where(held_t, v, paddle.zeros_like(v))  # masked keys weigh 0; a NaN value would poison them too
        return k, v


@dataclasses.dataclass
class Sequence:
    """A request: its tokens so far (prompt, then sampled ones) and how many of them have K and V in the cache."""

    rid: Any
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)  # what each sampled token came from
    computed: int = 0  # tokens whose K and V are written
    scheduled: int = 0  # tokens the manager's table covers (computed, or being computed this step)
    preemptions: int = 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


@dataclasses.dataclass
class StepStats:
    """What a step did: tokens computed, prefix-hit tokens, preemptions, and the cache's usage after it."""

    computed: int = 0
    hit: int = 0
    preempted: int = 0
    usage: float = 0.0


class Engine:
    """Greedy generation over a ``KVCacheManager``'s tables with a ``PagedCache``.

    ``chunk`` is the tokens a step computes at most (``max_num_batched_tokens``); a prompt longer than what is
    left of it is prefilled over several steps. ``row_blocks`` gives each cache row a pool of its own size.
    """

    def __init__(self, model: Model, *, num_blocks: int, block_size: int = 4, chunk: int = 64, max_num_seqs: int = 16,
                 head_wise: bool = False, row_blocks: list[int] | None = None) -> None:
        self.model = model
        self.spec = CacheSpec.from_hf_config(model.config.hf_config(), block_size=block_size, head_wise=head_wise,
                                             dtype="float32")
        rows = self.spec.row_layout
        self.manager = KVCacheManager(num_blocks, block_size, [r.policy for r in rows], row_blocks=row_blocks,
                                      hash_seed=b"engine")
        self.cells = table_cells(self.spec.rows, len(rows), self.spec.num_layers, self.spec.num_kv_heads)
        pools = self.manager.row_blocks
        self.cache = PagedCache(self.spec, [int(pools[self.cells[layer]].max()) for layer in range(model.config.num_layers)])
        self.chunk, self.max_num_seqs = chunk, max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished: dict[Any, Sequence] = {}
        self.stats: list[StepStats] = []
        # (request, row, column): a fault for tests; one step reads another block than the table's in that column
        self.corrupt: tuple[Any, int, int] | None = None

    # ------------------------------------------------------------------ requests

    def add(self, rid: Any, prompt: list[int], max_new_tokens: int) -> None:
        self.waiting.append(Sequence(rid, list(prompt), len(prompt), max_new_tokens))

    def generate(self, prompts: dict[Any, list[int]], max_new_tokens: int) -> dict[Any, Sequence]:
        """Run ``prompts`` to ``max_new_tokens`` sampled tokens each; the cache keeps their prefixes for later calls."""
        for rid, prompt in prompts.items():
            self.add(rid, prompt, max_new_tokens)
        while self.waiting or self.running:
            self.step()
        return {rid: self.finished.pop(rid) for rid in prompts}

    # ------------------------------------------------------------------ one step

    def step(self) -> StepStats:
        stats = StepStats()
        work: list[tuple[Sequence, int, int, np.ndarray]] = []  # (sequence, first position, stop, table)
        budget = self.chunk
        decoding = [s for s in self.running if s.scheduled == len(s.tokens) - 1 and s.computed == s.scheduled]
        if decoding:
            tables = self.manager.extend_many([s.rid for s in decoding], [s.tokens[-1] for s in decoding],
                                              [1] * len(decoding))
            for s, table in zip(decoding, tables):
                if table is None:
                    self._preempt(s, stats)
                    continue
                work.append((s, s.scheduled, s.scheduled + 1, np.array(table)))
                s.scheduled += 1
                budget -= 1
        for s in [s for s in self.running if s.scheduled < len(s.tokens)]:  # chunked prefills (decodes are ahead)
            n = min(budget, len(s.tokens) - s.scheduled)
            if n <= 0:
                continue
            table = self.manager.extend(s.rid, s.tokens[s.scheduled:s.scheduled + n])
            if table is None:
                self._preempt(s, stats)
                continue
            work.append((s, s.scheduled, s.scheduled + n, np.array(table)))
            s.scheduled += n
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            s = self.waiting[0]
            admission = self.manager.admit(s.rid, s.tokens, num_tokens=min(len(s.tokens), budget))
            if admission is None:
                if not self.running and not work:
                    raise RuntimeError(f"request {s.rid!r} of {len(s.tokens)} tokens can never fit the cache")
                break
            self.waiting.popleft()
            self.running.append(s)
            s.computed = admission.num_cached_tokens
            s.scheduled = self.manager.num_tokens(s.rid)
            stats.hit += s.computed
            work.append((s, s.computed, s.scheduled, np.array(admission.table)))
            budget -= s.scheduled - s.computed
        if work:
            self._run(work)
            stats.computed = sum(stop - start for _, start, stop, _ in work)
        stats.usage = float(self.manager.usage.max)
        self.stats.append(stats)
        return stats

    def _preempt(self, s: Sequence, stats: StepStats) -> None:
        """Out of blocks: free the request (its full blocks stay cached) and queue it to start again first."""
        self.manager.free(s.rid)
        self.running.remove(s)
        s.computed = s.scheduled = 0
        s.preemptions += 1
        stats.preempted += 1
        self.waiting.appendleft(s)

    def _run(self, work: list[tuple[Sequence, int, int, np.ndarray]]) -> None:
        """One forward over every item's new tokens; sample where an item reached the end of its tokens."""
        if self.corrupt is not None:  # once the block holds earlier steps' tokens, this step reads another one
            rid, row, col = self.corrupt
            for s, start, _, table in work:
                if s.rid == rid and start >= (col + 1) * self.spec.block_size:
                    table[row, col] = next(b for b in range(self.manager.num_blocks) if b not in table[row])
                    self.corrupt = None
                    break
        tokens = np.concatenate([np.asarray(s.tokens[a:b]) for s, a, b, _ in work])
        positions = np.concatenate([np.arange(a, b) for _, a, b, _ in work])
        bounds = np.cumsum([0] + [b - a for _, a, b, _ in work])
        config = self.model.config

        def attend(layer: int, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor) -> paddle.Tensor:
            outs = []
            for i, (s, start, stop, table) in enumerate(work):
                lo, hi = int(bounds[i]), int(bounds[i + 1])
                self.cache.write(layer, table, self.cells, positions[lo:hi], k[lo:hi], v[lo:hi])
                keys, values = self.cache.gather(layer, table, self.cells, stop)
                mask = visible(config, layer, positions[lo:hi], np.arange(stop))
                outs.append(attention(q[lo:hi], keys, values, mask))
            return paddle.concat(outs, axis=0)

        ends = [i for i, (s, _, stop, _) in enumerate(work) if stop == len(s.tokens)]
        logits = self.model.forward(tokens, positions, attend, bounds[1:][ends] - 1)
        if np.isnan(logits).any():
            raise RuntimeError("NaN logits: attention read a block the table no longer holds")
        for s, _, stop, _ in work:
            s.computed = stop
        for i, row in zip(ends, logits):
            s = work[i][0]
            s.logits.append(row)
            s.tokens.append(int(np.argmax(row)))
            if len(s.generated) >= s.max_new_tokens:
                self.manager.free(s.rid)
                self.running.remove(s)
                self.finished[s.rid] = s

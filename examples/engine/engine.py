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
A step whose mask lets a query see a token in a block its table no longer
holds (-1, given back by a sliding window) is refused before attention reads
it (``RankAttention``), so a block freed too early cannot go unnoticed.

The scheduler talks to a ``KVCacheManager`` in process (``library_engine``)
or to a ``kvcache serve`` daemon through ``CacheClient`` (``daemon_engine``):
the same method names. In daemon mode the model reads its tables the way a TP
worker does, from a ``TableSubscriber`` that follows the daemon's deltas.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, NamedTuple

import numpy as np

from kvcache.allocator import CacheSpec, Chunked, KVCacheManager, Window
from kvcache.allocator.rows import table_cells

from backend import paddle_backend
from model import Model, fp8_dequantize, fp8_round_trip, visible


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
        # A scale's block shape is [heads, block_size]: one value per row, kept as a column here.
        self.dims = [t.block_shape[2] if len(t.block_shape) == 3 else 1 for t in tensors]
        # float8 values live as their bytes (uint8), as engines keep them; a view turns them back into float8.
        self.dtypes = ["uint8" if t.dtype == "float8_e4m3fn" else "float32" for t in tensors]
        assert all(t.block_shape[:2] == (self.heads, self.block_size) for t in tensors)
        # Per layer, per tensor, flat [blocks * heads * block_size, dim]: row ((block * heads + head) * block_size
        # + offset); ``views`` gives them shaped as the spec says.
        self.tensors = [[paddle.zeros([n * self.heads * self.block_size, d], dtype="float32").astype(dtype)
                         for d, dtype in zip(self.dims, self.dtypes)] for n in layer_blocks]

    def views(self, layer: int) -> dict[str, Any]:
        n = self.layer_blocks[layer]
        return {t.name: x.reshape([n, *t.block_shape]) for t, x in zip(self.spec.tensors(), self.tensors[layer])}

    def _rows(self, blocks: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Flat rows of (block, head, offset): blocks [heads, n], offsets [n] -> [heads, n]."""
        heads = np.arange(self.heads)[:, None]
        return (blocks * self.heads + heads) * self.block_size + offsets[None, :]

    def write(self, layer: int, table: np.ndarray, cells: np.ndarray, positions: np.ndarray,
              vectors: tuple[Any, ...]) -> None:
        """Store the vectors ([n, heads, dim] each: K and V, or the latent) of ``positions`` in the blocks each
        head's row names, quantized with their scales for a block_wise_fp8 cache."""
        blocks = table[cells[layer]][:, positions // self.block_size]  # [heads, n]
        if (blocks < 0).any():
            raise RuntimeError(f"layer {layer}: a token is written into a block the table does not hold")
        paddle = self.ops.paddle
        index = paddle.to_tensor(self._rows(blocks, positions % self.block_size).reshape(-1))
        rows = [x.transpose([1, 0, 2]).reshape([-1, x.shape[-1]]) for x in vectors]
        if self.fp8:
            (k, ks), (v, vs) = (fp8_round_trip(self.ops, x) for x in rows)
            rows = [k.view(paddle.uint8), v.view(paddle.uint8), ks, vs]
        else:
            rows = [x.astype("float32") for x in rows]
        for t, x in zip(self.tensors[layer], rows):
            t[index] = x

    def gather(self, layer: int, table: np.ndarray, cells: np.ndarray, length: int) -> tuple[Any, ...]:
        """The vectors [heads, length, dim] of tokens ``[0, length)`` by table (dequantized). In a block the table
        lacks, the first (keys, latent) read NaN and values 0; no query may see them (``RankAttention`` refuses
        the step first: Paddle's softmax on the CPU can turn a NaN score into a finite output)."""
        paddle = self.ops.paddle
        cols = -(-length // self.block_size)
        blocks = table[cells[layer]][:, :cols]  # [heads, cols]
        held = paddle.to_tensor(np.repeat(blocks >= 0, self.block_size, axis=1)[:, :length, None])
        offsets = np.tile(np.arange(self.block_size), cols)[:length]
        rows = self._rows(np.repeat(np.maximum(blocks, 0), self.block_size, axis=1)[:, :length], offsets)
        index = paddle.to_tensor(rows.reshape(-1))
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


class Item(NamedTuple):
    """One request's part of a step, as attention needs it: the request, the positions computed, the tokens the
    table covers then, its table (None where each TP rank reads its own) and the host tier's copy to wait for."""

    rid: Any
    positions: np.ndarray
    stop: int
    table: np.ndarray | None
    load: Any = None


class RankAttention:
    """A TP rank's attention: it stores the step's K and V of its kv heads in its ``PagedCache`` and attends its
    query heads over the blocks each request's table names (one rank holding every head without TP)."""

    reads_tables = True  # the engine hands it each request's table (TP ranks read their own)

    def __init__(self, model: Model, paged: PagedCache, cells: np.ndarray, heads: range) -> None:
        self.model, self.paged, self.cells, self.heads = model, paged, cells, heads

    def __call__(self, layer: int, q: Any, kv: tuple[Any, ...], items: list[Item]) -> Any:
        """q [n, the rank's query heads, d] and kv (the rank's heads) of the step's items, in order."""
        outs, lo = [], 0
        for item in items:
            hi = lo + len(item.positions)
            if item.load is not None and item.load.wait(layer, timeout=10).value != "done":
                raise RuntimeError(f"layer {layer}: the host tier's copy did not land")
            self.paged.write(layer, item.table, self.cells, item.positions, tuple(x[lo:hi] for x in kv))
            cached = self.paged.gather(layer, item.table, self.cells, item.stop)
            mask = visible(self.model.config, layer, item.positions, np.arange(item.stop))
            held = item.table[self.cells[layer]][:, np.arange(item.stop) // self.paged.block_size] >= 0
            if (mask[self.heads.start:self.heads.stop] & ~held[:, None, :]).any():
                raise RuntimeError(f"layer {layer}: a query of request {item.rid!r} sees a token in a block its "
                                   "table no longer holds")
            outs.append(self.model.attention(layer, q[lo:hi], cached, mask[self.heads.start:self.heads.stop]))
            lo = hi
        return self.model.ops.cat(outs, axis=0)


@dataclasses.dataclass(eq=False)
class Sequence:
    """A request: its tokens so far (prompt, then sampled ones) and how many of them have K and V in the cache.
    Compared by identity: the engine's queues find and remove one request, never an equal one."""

    rid: Any
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    eos: int | None = None  # a token that ends the request when sampled (None: it runs to max_new_tokens)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)  # what each sampled token came from
    computed: int = 0  # tokens whose K and V are written
    scheduled: int = 0  # tokens computed, or being computed this step
    covered: int = 0  # positions the request's table covers (past ``scheduled`` with blocks reserved ahead)
    preemptions: int = 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


@dataclasses.dataclass
class StepStats:
    """What a step did: tokens computed, prefix-hit tokens, preemptions, the cache's usage after it, and whether
    the daemon's round trip overlapped the model."""

    computed: int = 0
    hit: int = 0
    preempted: int = 0
    usage: float = 0.0
    overlapped: bool = False  # the daemon extended the decoding requests while the model ran (``Batch.post``)


class Engine:
    """Greedy generation over a cache's tables with a ``PagedCache``.

    ``cache`` is a ``KVCacheManager`` or a ``CacheClient``; ``tables`` a ``TableSubscriber`` the model reads its
    tables from (else the cache's own). ``row_blocks`` is each row's pool and ``cells`` the row each (layer,
    kv head) reads. ``chunk`` is the tokens a step computes at most (``max_num_batched_tokens``); a prompt longer
    than what is left of it is prefilled over several steps.
    """

    def __init__(self, model: Model, spec: CacheSpec, cache: Any, *, row_blocks: list[int] | None = None,
                 cells: np.ndarray | None = None, tables: Any = None, chunk: int = 64, max_num_seqs: int = 16,
                 attention: Any = None, keep_logits: bool = True) -> None:
        """``attention`` (``attention(layer, q, kv, items)``) replaces this process's one-rank attention over a
        ``PagedCache`` of ``row_blocks`` read through ``cells``, e.g. by TP ranks' (``tp.TPAttention``).
        ``keep_logits`` keeps each sampled token's logits on the host (``Sequence.logits``), for comparing;
        without it only the sampled tokens leave the device."""
        self.model, self.spec, self.cache, self.tables, self.cells = model, spec, cache, tables, cells
        self.paged: PagedCache | None = None
        if attention is None:
            assert cells is not None and row_blocks is not None
            self.paged = PagedCache(spec, layer_blocks(row_blocks, cells), model.config.dtype)
            attention = RankAttention(model, self.paged, cells, range(model.config.cache_heads))
        self.attention = attention
        # PD prefill: ``handoff(sequence)`` takes a request once its prompt is computed and its first token
        # sampled (its KV goes to the decode node); ``on_step(items)`` runs before a step's layers and
        # ``on_layer(layer)`` after each layer's K and V are written (the messager's layer signal).
        self.handoff: Any = None
        self.on_step: Any = None
        self.on_layer: Any = None
        self.chunk, self.max_num_seqs, self.keep_logits = chunk, max_num_seqs, keep_logits
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished: dict[Any, Sequence] = {}
        self.stats: list[StepStats] = []
        # (request, row, column): a fault for tests; one step reads another block than the table's in that column
        self.corrupt: tuple[Any, int, int] | None = None
        self.tier: Any = None  # a host tier (TransferManager) under the cache's blocks, in library mode
        self.agent: Any = None  # the daemon's host tier: this process's TierAgent (daemon mode)
        self._windowed = any(isinstance(row.policy, (Window, Chunked)) for row in spec.row_layout)
        # What the daemon's host tier failed, taken with the last step's posted extends (None: ask it this step).
        self._tier_failed: list[Any] | None = None

    def close(self) -> None:
        """Stop what the engine started: a host tier, TP ranks, the subscriber and the client of a daemon."""
        if self.tier is not None:
            self.tier.close()
        if self.agent is not None:
            self.agent.close()
        for part in (self.attention, self.tables):
            if part is not None and hasattr(part, "close"):
                part.close()
        if hasattr(self.cache, "close"):
            self.cache.close()

    # ------------------------------------------------------------------ requests

    def add(self, rid: Any, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> None:
        self.waiting.append(Sequence(rid, list(prompt), len(prompt), max_new_tokens, eos))

    def generate(self, prompts: dict[Any, list[int]], max_new_tokens: int,
                 eos: int | None = None) -> dict[Any, Sequence]:
        """Run ``prompts`` to ``max_new_tokens`` sampled tokens each (or to ``eos``, where given); the cache keeps
        their prefixes for later calls."""
        for rid, prompt in prompts.items():
            self.add(rid, prompt, max_new_tokens, eos)
        while self.waiting or self.running:
            self.step()
        return {rid: self.finished.pop(rid) for rid in prompts}

    # ------------------------------------------------------------------ one step

    def step(self) -> StepStats:
        stats = StepStats()
        work: list[tuple[Sequence, int, int]] = []  # (sequence, first position, stop)
        budget = self.chunk
        if self.agent is not None:  # the daemon's host tier could not copy these back: start them again
            failed = self.cache.tier_failed() if self._tier_failed is None else self._tier_failed
            self._tier_failed = None
            for rid in failed:
                s = next((s for s in self.running if s.rid == rid), None)
                if s is not None:
                    self._preempt(s, stats)
        decoding = [s for s in self.running if s.scheduled == len(s.tokens) - 1]
        posted = None
        if decoding:
            ids, last, ones = [s.rid for s in decoding], [s.tokens[-1] for s in decoding], [1] * len(decoding)
            # Through a daemon each decode extend also reserves the next step's position, so that step's
            # tables are known before its tokens are: it posts its extends and runs the model meanwhile.
            ahead = 1 if hasattr(self.cache, "batch") and not self._windowed else 0
            refused = [False] * len(decoding)
            if ahead and all(s.scheduled < s.covered for s in decoding):
                batch = self.cache.batch().extend_many(ids, last, ones, num_lookahead_tokens=ahead).op("usage")
                if self.agent is not None:  # the next step's failed loads, without a round trip of their own
                    batch.op("tier_failed")
                posted = batch.post()
                stats.overlapped = True
            else:
                grown = self.cache.extend_many(ids, last, ones, num_lookahead_tokens=ahead)
                refused = [table is None for table in grown]
            for s, out_of_blocks in zip(decoding, refused):
                if out_of_blocks:
                    self._preempt(s, stats)
                    continue
                work.append((s, s.scheduled, s.scheduled + 1))
                s.scheduled += 1
                s.covered = max(s.covered, s.scheduled + (ahead if posted is None else 0))
                budget -= 1
        for s in [s for s in self.running if s.scheduled < len(s.tokens)]:  # chunked prefills (decodes are ahead)
            n = min(budget, len(s.tokens) - s.scheduled)
            if n <= 0:
                continue
            if self.cache.extend(s.rid, s.tokens[s.scheduled:s.scheduled + n]) is None:
                self._preempt(s, stats)
                continue
            work.append((s, s.scheduled, s.scheduled + n))
            s.scheduled += n
            s.covered = max(s.covered, s.scheduled)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            s = self.waiting[0]
            wanted = min(len(s.tokens), budget)
            admission = self.cache.admit(s.rid, s.tokens, num_tokens=wanted)
            if admission is None:
                if not self.running and not work:
                    raise RuntimeError(f"request {s.rid!r} of {len(s.tokens)} tokens can never fit the cache")
                break
            self.waiting.popleft()
            self.running.append(s)
            s.computed = admission.num_cached_tokens
            s.scheduled = s.covered = min(len(s.tokens), max(wanted, s.computed + 1))  # what the table covers now
            stats.hit += s.computed
            work.append((s, s.computed, s.scheduled))
            budget -= s.scheduled - s.computed
        if work:
            if self.tier is not None:
                self.tier.poll()
            self._run(work, self._tables([s.rid for s, _, _ in work]))
            stats.computed = sum(stop - start for _, start, stop in work)
        if posted is not None:
            later_calls = posted.done  # an admit or a prefill's extend took the reply: usage is theirs to give
            tables, usage, *failed = posted.results()  # extend_many's tables, usage's answer, tier_failed's ids
            if failed:
                self._tier_failed = failed[0]
            for s, table in zip(decoding, tables):
                if table is not None:
                    s.covered = s.scheduled + 1
                elif s in self.running:  # no block for its next position: the daemon kept nothing of the extend
                    self._preempt(s, stats)
            stats.usage = float(self.cache.usage.max if later_calls or stats.preempted else usage["max"])
        else:
            stats.usage = float(self.cache.usage.max)
        self.stats.append(stats)
        return stats

    def _tables(self, rids: list[Any]) -> list[np.ndarray | None]:
        """The step's tables as the model sees them: the subscriber's once it holds this step's changes, else the
        cache's; none where TP ranks read their own."""
        if not getattr(self.attention, "reads_tables", False):
            return [None] * len(rids)
        if self.tables is None:
            return [np.array(self.cache.table(rid)) for rid in rids]
        self.tables.wait_for(self.cache.last_seq, timeout=10)
        return [np.array(self.tables.table(rid)) for rid in rids]

    def _preempt(self, s: Sequence, stats: StepStats) -> None:
        """Out of blocks: free the request (its full blocks stay cached) and queue it to start again first."""
        self.cache.free(s.rid)
        self.running.remove(s)
        s.computed = s.scheduled = s.covered = 0
        s.preemptions += 1
        stats.preempted += 1
        self.waiting.appendleft(s)

    def _run(self, work: list[tuple[Sequence, int, int]], tables: list[np.ndarray]) -> None:
        """One forward over every item's new tokens; sample where an item reached the end of its tokens."""
        if self.corrupt is not None and self.paged is not None:  # once the block holds tokens, read another one
            rid, row, col = self.corrupt
            for (s, start, _), table in zip(work, tables):
                if s.rid == rid and start >= (col + 1) * self.spec.block_size:
                    table[row, col] = next(b for b in range(min(self.paged.layer_blocks)) if b not in table[row])
                    self.corrupt = None
                    break
        tokens = np.concatenate([np.asarray(s.tokens[a:b]) for s, a, b in work])
        positions = np.concatenate([np.arange(a, b) for _, a, b in work])
        bounds = np.cumsum([0] + [b - a for _, a, b in work])
        # Blocks a host tier is copying back for these requests: each layer waits for its own copy only.
        # Through the daemon every copy ordered so far is waited for, per layer (TierAgent.wait).
        loads = [self.tier.load(s.rid) if self.tier is not None else self.agent for s, _, _ in work]
        items = [Item(s.rid, positions[bounds[i]:bounds[i + 1]], stop, table, load)
                 for i, ((s, _, stop), table, load) in enumerate(zip(work, tables, loads))]

        def attend(layer: int, q: Any, kv: tuple[Any, ...]) -> Any:
            out = self.attention(layer, q, kv, items)
            if self.on_layer is not None:
                self.on_layer(layer)
            return out

        if self.on_step is not None:
            self.on_step(items)
        ends = [i for i, (s, _, stop) in enumerate(work) if stop == len(s.tokens)]
        rows = bounds[1:][ends] - 1
        if self.keep_logits:
            logits = self.model.forward(tokens, positions, attend, rows)
            if np.isnan(logits).any():
                raise RuntimeError("NaN logits: attention read a block the table no longer holds")
            sampled = logits.argmax(axis=-1)
        else:
            sampled = self.model.forward(tokens, positions, attend, rows, greedy=True)
        for s, _, stop in work:
            s.computed = stop
        for k, i in enumerate(ends):
            s = work[i][0]
            if self.keep_logits:
                s.logits.append(logits[k])
            s.tokens.append(int(sampled[k]))
            if self.handoff is not None:
                self.running.remove(s)
                self.handoff(s)
            elif len(s.generated) >= s.max_new_tokens or s.tokens[-1] == s.eos:
                self.cache.free(s.rid)
                self.running.remove(s)
                self.finished[s.rid] = s


def cache_spec(config: Any, *, block_size: int, head_wise: bool = False, quant: str = "none",
               scale_layout: str = "default", tp_size: int = 1) -> CacheSpec:
    """The cache of ``config`` (a ``ModelConfig``) as kvcache sees it: from its ``config.json`` fields, rows included."""
    return CacheSpec.from_hf_config(config.hf_config(), block_size=block_size, head_wise=head_wise, dtype="float32",
                                    quant=quant, scale_layout=scale_layout, tp_size=tp_size)


def layer_blocks(row_blocks: Any, cells: np.ndarray) -> list[int]:
    """Each layer's block count: the pool of the rows its heads read."""
    pools = np.asarray(row_blocks)
    return [int(pools[row].max()) for row in cells]


def library_engine(model: Model, *, num_blocks: int, block_size: int = 4, head_wise: bool = False,
                   row_blocks: list[int] | None = None, host_blocks: int = 0, quant: str = "none",
                   scale_layout: str = "default", attention: Any = None, **options: Any) -> Engine:
    """An engine over a ``KVCacheManager`` in this process, its rows from the model's config; with
    ``host_blocks`` a host tier under it offloads freed blocks and copies a later hit back. A model on a PyTorch
    GPU backend attends with flex attention over its cache (``gpu.FlexAttention``); ``attention`` replaces it."""
    from kvcache.transfer import HostTierConfig, KVRegion, TransferManager

    spec = cache_spec(model.config, block_size=block_size, head_wise=head_wise, quant=quant, scale_layout=scale_layout)
    rows = spec.row_layout
    manager = KVCacheManager(num_blocks, block_size, [r.policy for r in rows], row_blocks=row_blocks,
                             hash_seed=b"engine")
    cells = table_cells(spec.rows, len(rows), spec.num_layers, spec.num_kv_heads)
    if attention is None and model.ops.name == "torch":
        from gpu import FlexAttention

        attention = FlexAttention(model, spec, layer_blocks(manager.row_blocks, cells), cells,
                                  max_batch=options.get("max_num_seqs", 16), max_tokens=options.get("chunk", 64))
    if attention is not None:
        engine = Engine(model, spec, manager, attention=attention, **options)
        views = getattr(attention, "views", None)
    else:
        engine = Engine(model, spec, manager, row_blocks=manager.row_blocks.tolist(), cells=cells, **options)
        views = engine.paged.views
    if host_blocks:
        if views is None:
            raise ValueError("host_blocks: the attention given keeps no cache tensors a host tier can copy")
        region = KVRegion.from_tensors(spec, [views(layer) for layer in range(spec.num_layers)])
        engine.tier = TransferManager(manager, region, HostTierConfig(host_blocks=host_blocks))
    return engine


def daemon_engine(model: Model, endpoint: str, *, block_size: int = 4, head_wise: bool = False,
                  quant: str = "none", tp: int = 1, prefill: bool = False, **options: Any) -> Engine:
    """An engine whose scheduler talks to the daemon at ``endpoint`` (serving ``model.config.hf_config()``) and
    whose model reads the tables a ``TableSubscriber`` follows; its rows are the daemon's. With ``tp`` ranks
    (the daemon's ``--tp``) each rank's cache and attention run in a process of its own with its own subscriber
    (and with ``prefill``, on a PD prefill node, its own messager)."""
    from kvcache.client import CacheClient
    from kvcache.worker import TableSubscriber

    spec = cache_spec(model.config, block_size=block_size, head_wise=head_wise, quant=quant)
    client = CacheClient(endpoint, timeout=10)
    info = client.info()
    rows = info["rows"]
    if [(tuple(r["layers"]), tuple(r["kv_heads"])) for r in rows] != [(r.layers, r.kv_heads) for r in spec.row_layout]:
        raise RuntimeError(f"the daemon's rows {rows} are not the model's {spec.row_layout}")
    if tp > 1:
        from tp import TPAttention

        attention = TPAttention(model.config, endpoint, client, tp, block_size=block_size, head_wise=head_wise,
                                quant=quant, prefill=prefill, ops=model.ops,
                                max_batch=options.get("max_num_seqs", 16), max_tokens=options.get("chunk", 64))
        return Engine(model, spec, client, attention=attention, **options)
    tables = TableSubscriber(endpoint, rank=0, tp_size=1, max_slots=64, max_blocks=512)
    pools = [r["num_blocks"] for r in rows]
    if model.ops.name == "torch":
        from gpu import FlexAttention

        attention = FlexAttention(model, spec, layer_blocks(pools, tables.cell_rows), tables.cell_rows,
                                  max_batch=options.get("max_num_seqs", 16), max_tokens=options.get("chunk", 64))
        engine = Engine(model, spec, client, tables=tables, attention=attention, **options)
        views = attention.views
    else:
        engine = Engine(model, spec, client, tables=tables, row_blocks=pools, cells=tables.cell_rows, **options)
        views = engine.paged.views
    if info.get("host_tier"):  # the daemon keeps a host tier: this process copies its part of each block
        from kvcache.tier_agent import TierAgent
        from kvcache.transfer import KVRegion

        region = KVRegion.from_tensors(spec, [views(layer) for layer in range(spec.num_layers)])
        engine.agent = TierAgent(tables, region)
    return engine

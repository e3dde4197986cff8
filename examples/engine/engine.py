"""The engine's loop: schedule a step, read its tables, run the model, sample; and the two ways to build one.

An engine is a ``Scheduler`` (``scheduler.py``: who runs this step, through
kvcache's ``admit``/``extend``/``free``) and a ``ModelRunner``
(``model_runner.py``: one forward over the step's tokens, attention over the
paged cache by table). Between them the engine reads each request's table:
from the cache (``library_engine``: a ``KVCacheManager`` in this process), or
in daemon mode (``daemon_engine``: a ``kvcache serve`` through
``CacheClient``) from a ``TableSubscriber`` that follows the daemon's deltas,
as a TP worker does. A host tier under the cache copies a prefix hit's
blocks back while the step runs; each layer waits for its own copy.

Names (docs/engine.md's glossary): a *row* is one of the cache's table rows
(a policy over some layers and kv heads, ``CacheSpec.row_layout``) with its
*pool* of blocks (``pool_blocks``); ``head_rows[layer][kv head]`` is the row
that head reads its block ids from; ``layer_blocks[layer]`` is how many
blocks the layer's cache tensors hold.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from kvcache.allocator import CacheSpec, Chunked, KVCacheManager, Window
from kvcache.allocator.rows import table_cells

from attention import RankAttention
from model import Model
from model_runner import ModelRunner
from paged_cache import PagedCache, cache_spec, layer_blocks
from scheduler import Scheduled, Scheduler, StepStats
from sequence import Sequence

__all__ = ["Engine", "Sequence", "StepStats", "cache_spec", "daemon_engine", "library_engine"]


class Engine:
    """Greedy generation over a cache's tables.

    ``cache`` is a ``KVCacheManager`` or a ``CacheClient``; ``tables`` a ``TableSubscriber`` the model reads its
    tables from (else the cache's own). ``chunk`` is the tokens a step computes at most
    (``max_num_batched_tokens``); a prompt longer than what is left of it is prefilled over several steps.
    """

    def __init__(self, model: Model, spec: CacheSpec, cache: Any, *, pool_blocks: list[int] | None = None,
                 head_rows: np.ndarray | None = None, tables: Any = None, chunk: int = 64, max_num_seqs: int = 16,
                 attention: Any = None, keep_logits: bool = True) -> None:
        """``attention`` (``attention(layer, q, kv, items)``) replaces this process's one-rank attention over a
        ``PagedCache`` of ``pool_blocks`` read through ``head_rows``, e.g. by TP ranks' (``tp.TPAttention``) or
        flex attention's (``gpu.FlexAttention``)."""
        self.model, self.spec, self.tables, self.head_rows = model, spec, tables, head_rows
        self.paged: PagedCache | None = None
        if attention is None:
            assert head_rows is not None and pool_blocks is not None
            self.paged = PagedCache(spec, layer_blocks(pool_blocks, head_rows), model.config.dtype)
            attention = RankAttention(model, self.paged, head_rows, range(model.config.cache_heads))
        self.attention = attention
        windowed = any(isinstance(row.policy, (Window, Chunked)) for row in spec.row_layout)
        self.scheduler = Scheduler(cache, chunk=chunk, max_num_seqs=max_num_seqs, windowed=windowed)
        self.runner = ModelRunner(model, attention, keep_logits)
        self.stats: list[StepStats] = []
        self.tier: Any = None  # a host tier (TransferManager) under the cache's blocks, in library mode
        self.agent: Any = None  # the daemon's host tier: this process's TierAgent (daemon mode)

    @property
    def cache(self) -> Any:
        return self.scheduler.cache

    @property
    def waiting(self) -> Any:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def finished(self) -> dict[Any, Sequence]:
        return self.scheduler.finished

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

    def add(self, rid: Any, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> None:
        self.scheduler.add(Sequence(rid, list(prompt), len(prompt), max_new_tokens, eos))

    def generate(self, prompts: dict[Any, list[int]], max_new_tokens: int,
                 eos: int | None = None) -> dict[Any, Sequence]:
        """Run ``prompts`` to ``max_new_tokens`` sampled tokens each (or to ``eos``, where given); the cache keeps
        their prefixes for later calls."""
        for rid, prompt in prompts.items():
            self.add(rid, prompt, max_new_tokens, eos)
        while self.waiting or self.running:
            self.step()
        return {rid: self.finished.pop(rid) for rid in prompts}

    def step(self) -> StepStats:
        plan = self.scheduler.schedule()
        if plan.work:
            if self.tier is not None:
                self.tier.poll()
            self.run(plan.work, self.read_tables([w.seq.rid for w in plan.work]))
            plan.stats.computed = sum(w.stop - w.start for w in plan.work)
        self.scheduler.settle(plan)
        self.stats.append(plan.stats)
        return plan.stats

    def read_tables(self, rids: list[Any]) -> list[np.ndarray | None]:
        """The step's tables as the model sees them: the subscriber's once it holds this step's changes, else the
        cache's; none where TP ranks read their own."""
        if not getattr(self.attention, "reads_tables", False):
            return [None] * len(rids)
        if self.tables is None:
            return [np.array(self.cache.table(rid)) for rid in rids]
        self.tables.wait_for(self.cache.last_seq, timeout=10)
        return [np.array(self.tables.table(rid)) for rid in rids]

    def run(self, work: list[Scheduled], tables: list[np.ndarray | None]) -> None:
        """One forward over the step's work, each request reading its table; then what it sampled."""
        # Blocks a host tier is copying back for these requests: each layer waits for its own copy only.
        # Through the daemon every copy ordered so far is waited for, per layer (TierAgent.wait).
        loads = [self.tier.load(w.seq.rid) if self.tier is not None else self.agent for w in work]
        ends, sampled, logits = self.runner.run(work, tables, loads)
        self.scheduler.postprocess(work, ends, sampled, logits)


def library_engine(model: Model, *, num_blocks: int, block_size: int = 4, head_wise: bool = False,
                   pool_blocks: list[int] | None = None, host_blocks: int = 0, quant: str = "none",
                   scale_layout: str = "default", attention: Any = None, **options: Any) -> Engine:
    """An engine over a ``KVCacheManager`` in this process, its rows from the model's config (``pool_blocks``:
    each row's pool, default ``num_blocks`` each); with ``host_blocks`` a host tier under it offloads freed blocks
    and copies a later hit back. A model on a PyTorch GPU backend attends with flex attention over its cache
    (``gpu.FlexAttention``); ``attention`` replaces it."""
    from kvcache.transfer import HostTierConfig, KVRegion, TransferManager

    spec = cache_spec(model.config, block_size=block_size, head_wise=head_wise, quant=quant, scale_layout=scale_layout)
    rows = spec.row_layout
    manager = KVCacheManager(num_blocks, block_size, [r.policy for r in rows], row_blocks=pool_blocks,
                             hash_seed=b"engine")
    head_rows = table_cells(spec.rows, len(rows), spec.num_layers, spec.num_kv_heads)
    pool_blocks = manager.row_blocks.tolist()
    if attention is None and model.ops.name == "torch":
        from gpu import FlexAttention

        attention = FlexAttention(model, spec, layer_blocks(pool_blocks, head_rows), head_rows,
                                  max_batch=options.get("max_num_seqs", 16), max_tokens=options.get("chunk", 64))
    engine = Engine(model, spec, manager, pool_blocks=pool_blocks, head_rows=head_rows, attention=attention,
                    **options)
    views = engine.paged.views if engine.paged is not None else getattr(attention, "views", None)
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
    pool_blocks, head_rows = [r["num_blocks"] for r in rows], tables.cell_rows
    attention = None
    if model.ops.name == "torch":
        from gpu import FlexAttention

        attention = FlexAttention(model, spec, layer_blocks(pool_blocks, head_rows), head_rows,
                                  max_batch=options.get("max_num_seqs", 16), max_tokens=options.get("chunk", 64))
    engine = Engine(model, spec, client, pool_blocks=pool_blocks, head_rows=head_rows, tables=tables,
                    attention=attention, **options)
    if info.get("host_tier"):  # the daemon keeps a host tier: this process copies its part of each block
        from kvcache.tier_agent import TierAgent
        from kvcache.transfer import KVRegion

        views = engine.paged.views if engine.paged is not None else attention.views
        region = KVRegion.from_tensors(spec, [views(layer) for layer in range(spec.num_layers)])
        engine.agent = TierAgent(tables, region)
        engine.scheduler.tier_failures = True
    return engine

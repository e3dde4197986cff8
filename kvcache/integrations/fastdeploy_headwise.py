"""Head-wise tables under FastDeploy's scheduler: one block table per kv head, window heads giving blocks back,
with prefix caching.

FastDeploy's open head-wise work (``FD_HEAD_WISE_KV_CACHE=1``, a model config with ``head_wise_swa_ratio``,
``window_size`` and ``sink_size``) gives each kv head a cache of its own; on each TP rank its attention keeps the
first ``1 - head_wise_swa_ratio`` of the query heads full and slides a window over the rest, so the last kv heads
of each rank keep the window (``kvcache.allocator.rows.window_kv_heads``). Those patches refuse
``enable_prefix_caching`` in head-wise mode. ``HeadWiseCacheManager`` serves both: each request is admitted into a
head-wise ``KVCacheManager`` (or a ``kvcache serve`` daemon of the same rows), whose window rows give back the
blocks their window has passed and whose prefix index finds hits every head can use.

FastDeploy's scheduler keeps its flat ``request.block_tables``: it is the full heads' row (every full head
shares its block ids), so the scheduler counts, checks and recycles what it always did. The adapter sets
``request.block_tables_headwise`` (``[num_kv_heads][len(block_tables)]``, ``-1`` where a window head gave the
block back) each time it changes; ``block_tables_headwise(request_id)`` gives it as an int32 array::

    block_tables           | f0 | f1 | f2 | f3 | f4 |       the full heads' row (row 0 is one): the scheduler's list
    block_tables_headwise  | f0 | f1 | f2 | f3 | f4 |       each full head
                           | -1 | -1 | w2 | w3 | w4 |       each window head: blocks before the window went back

How FastDeploy's calls map: ``request_match_blocks`` admits the request (its hit, plus the block of its first
token to compute); ``allocate_gpu_blocks(n, request_id)`` extends its table by ``n`` blocks with the tokens the
scheduler has placed so far, the window rows first giving back what no query in flight can see (a step behind,
so a chunk still running keeps its window); ``update_cache_blocks`` and ``cache_output_blocks`` pass the newly
placed tokens, whose full blocks enter the prefix index; ``release_block_ids`` frees the request (every head's
blocks; cached ones stay findable), and the ``recycle_gpu_blocks`` that follows it only checks the ids it names.

Refused by name: a PD role (``splitwise_role`` other than ``mixed``), extend tables (``use_extend_tables``),
head-wise without ``enable_prefix_caching`` (the adapter learns each request's tokens from
``request_match_blocks``), blocks allocated for a request never matched (PD pre-allocation, extend tables),
``window_attn_skip_freq`` (a head full on some layers and windowed on others is no single row), a
``head_wise_swa_ratio`` that leaves no kv head full or none windowed, and ``free_block_ids`` (allocations evict).
"""
from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.manager import KVCacheManager
from kvcache.allocator.rows import describe_policy, window_kv_heads
from kvcache.allocator.swa import AttentionPolicy, Full, Window
from kvcache.integrations.fastdeploy import (
    FastDeployCacheManager,
    _check_count,
    _check_ids,
    _gpu_block_count,
    _refuse_unsupported,
    _task_mm,
    _task_tokens,
)

if TYPE_CHECKING:
    from kvcache.client import CacheClient

HEAD_WISE_ENV = "FD_HEAD_WISE_KV_CACHE"
"""The environment variable FastDeploy's head-wise patches read: ``1`` turns head-wise KV cache on."""


def head_wise_policies(config: Any) -> tuple[AttentionPolicy, ...] | None:
    """Each kv head's policy when FastDeploy's config asks for head-wise tables, else None.

    Asked for by ``FD_HEAD_WISE_KV_CACHE=1``; the model config then names the window (``window_size``, with
    ``sink_size``) and the share of each TP rank's query heads that keep it (``head_wise_swa_ratio``): the kv heads
    ``window_kv_heads`` gives for ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` and
    ``parallel_config.tensor_parallel_size``, those FastDeploy's attention windows. ``kvcache serve --model
    <config> --head-wise --tp N`` serves the same rows. Anything else about it that cannot be served exactly is an
    error naming the field.
    """
    if os.environ.get(HEAD_WISE_ENV, "0").strip() in ("", "0"):
        return None
    model = getattr(config, "model_config", None)
    heads = getattr(model, "num_key_value_heads", None)
    if isinstance(heads, bool) or not isinstance(heads, (int, np.integer)) or heads < 2:
        raise KVCacheError(f"model_config.num_key_value_heads: head-wise tables ({HEAD_WISE_ENV}=1) need an integer "
                           f">= 2, got {heads!r}")
    ratio = getattr(model, "head_wise_swa_ratio", None)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
        raise KVCacheError(f"model_config.head_wise_swa_ratio: head-wise tables ({HEAD_WISE_ENV}=1) need a number "
                           f"in (0, 1), got {ratio!r}")
    query_heads = getattr(model, "num_attention_heads", None)
    _check_count(query_heads, "model_config.num_attention_heads", least=1)
    tp = getattr(getattr(config, "parallel_config", None), "tensor_parallel_size", 1) or 1
    _check_count(tp, "parallel_config.tensor_parallel_size", least=1)
    geometry = {"head_wise_swa_ratio": float(ratio), "head_dim": getattr(model, "head_dim", None),
                "hidden_size": getattr(model, "hidden_size", None)}
    windowed = window_kv_heads(geometry, int(query_heads), int(heads), int(tp))
    assert windowed is not None, "a ratio in (0, 1) names the window heads"
    if not 0 < len(windowed) < heads:
        raise KVCacheError(f"model_config.head_wise_swa_ratio: {ratio} windows {len(windowed)} of {heads} kv heads "
                           f"at TP {tp} (a kv head keeps the window only if all its query heads do); head-wise "
                           "tables need some heads full and some windowed")
    window = getattr(model, "window_size", None)
    sink = getattr(model, "sink_size", 0) or 0
    _check_count(window, "model_config.window_size", least=1)
    _check_count(sink, "model_config.sink_size")
    if getattr(model, "window_attn_skip_freq", 0):
        raise KVCacheError(f"model_config.window_attn_skip_freq: {model.window_attn_skip_freq} makes some layers "
                           "full on every head; head-wise tables need each head's policy the same on every layer")
    return tuple(Window(int(window), int(sink)) if head in windowed else Full() for head in range(heads))


@dataclasses.dataclass(slots=True)
class _Live:
    """A request the adapter admitted: FastDeploy's record of it and how far each side has got."""

    task: Any
    listed: int  # blocks the scheduler's block_tables holds (the full heads' row up to here)
    num_tokens: int  # tokens kvcache's table holds (the scheduler has placed them)
    start: int  # the first token of the work scheduled last
    done: int  # the first token of the work scheduled before it (maybe still running): window heads keep what
    # a query from here on sees
    table: np.ndarray  # int32 [num_kv_heads, blocks], as kvcache returned it last


class HeadWiseCacheManager(FastDeployCacheManager):
    """FastDeploy's ``PrefixCacheManager`` contract over head-wise tables (see the module docstring).

    ``FastDeployCacheManager(config, ...)`` builds one when the config asks for head-wise tables
    (``head_wise_policies``); in process on a head-wise ``KVCacheManager``, or on a daemon serving the same rows
    (``kvcache serve --model <config> --head-wise --tp N``: one row per kv head, in kv head order).
    """

    def _build(self, cache_config: Any) -> None:
        """Check the config, open the head-wise cache and start empty."""
        _refuse_unsupported(cache_config)
        if not getattr(cache_config, "enable_prefix_caching", True):
            raise KVCacheError("cache_config.enable_prefix_caching: head-wise tables need it on (the adapter "
                               "learns each request's tokens from request_match_blocks)")
        if self.splitwise_role != "mixed":
            raise KVCacheError(f"splitwise_role: {self.splitwise_role!r}; head-wise tables serve a mixed engine "
                               "(PD roles pre-allocate blocks for requests never matched)")
        policies = head_wise_policies(self.config)
        assert policies is not None, "HeadWiseCacheManager built for a config that asks for no head-wise tables"
        num_blocks = _gpu_block_count(cache_config)
        block_size = getattr(cache_config, "block_size", None)
        _check_count(block_size, "cache_config.block_size", least=1)
        if self._shared is None:
            cache: KVCacheManager | CacheClient = KVCacheManager(num_blocks, block_size, policies)
        else:
            cache = self._shared
            num_blocks, served = _served_rows(cache)
            shared_size = cache.block_size if isinstance(cache, KVCacheManager) else cache.info()["block_size"]
            if block_size != shared_size:
                raise KVCacheError(f"cache_config.block_size: {block_size} differs from the shared cache's "
                                   f"{shared_size}")
            wanted = [describe_policy(p) for p in policies]
            if served != wanted:
                raise KVCacheError(f"rows: the shared cache serves {_rows_text(served)}, FastDeploy's head-wise "
                                   f"config asks for {_rows_text(wanted)} (one row per kv head, in kv head order)")
        self._cache = cache
        self.policies = policies
        self.num_kv_heads = len(policies)
        self.num_gpu_blocks = num_blocks
        self.block_size = block_size
        self._matched = {}  # the base class's; unused here
        self._live: dict[object, _Live] = {}
        self._deferred: set[object] = set()  # matched when no head had a block free: nothing held yet
        self._spare: tuple[object, int] | None = None  # (request, blocks admitted past its hit, not yet listed)
        self._released: tuple[object, list[int]] | None = None  # the last released request's list, for its recycle
        self._start_counting()

    def update_cache_config(self, cache_config: Any) -> None:
        """Take FastDeploy's final cache config and start empty; refused while a request is live."""
        with self.request_release_lock:
            if self._live:
                raise KVCacheError(f"update_cache_config: {len(self._live)} requests are live; release them first")
            self._build(cache_config)
            self.cache_config = cache_config

    # ------------------------------------------------------------------ counts (the full heads' pool)
    # gpu_free_block_list and num_free_gpu_blocks are the base class's: they count row 0, a full head.

    @property
    def num_allocatable_gpu_blocks(self) -> int:
        """Blocks ``allocate_gpu_blocks`` can give every head now (the fewest any head's pool has free)."""
        with self.request_release_lock:
            return int(np.min(self._cache.num_free_blocks))

    def can_allocate_gpu_blocks(self, num_blocks: int, try_free_gpu_blocks: bool = True) -> bool:
        """Whether every head can take ``num_blocks`` more; the request matched last counts the block its match
        holds already. ``try_free_gpu_blocks=False``: without evicting a cached prefix. Changes nothing."""
        _check_count(num_blocks, "num_blocks")
        with self.request_release_lock:
            need = num_blocks - (self._spare[1] if self._spare is not None else 0)
            free = np.asarray(self._cache.num_free_blocks, dtype=np.int64)
            if not try_free_gpu_blocks:
                free = free - np.asarray(self._cache.num_cached_free_blocks, dtype=np.int64)
            return bool(need <= 0 or free.min() >= need)

    # ------------------------------------------------------------------ a request's life

    def request_match_blocks(self, task: Any, block_size: int, *args: object) -> tuple[list[int], int, dict]:
        """Admit the request: its cached prefix (every head can use it) and the block of its first token to
        compute. Returns the prefix's full-head blocks, its tokens and FastDeploy's metrics; sets
        ``task.num_cached_blocks`` and ``task.block_tables_headwise``. When some head has no block free the
        request holds nothing yet and matches nothing (FastDeploy's next ``can_allocate_gpu_blocks`` says no)."""
        self._check_block_size(block_size)
        with self.request_release_lock:
            req_id = task.request_id
            if req_id in self._live or req_id in self._deferred:
                raise KVCacheError(f"request_id: {req_id!r} is matched already; release_block_ids first")
            if getattr(task, "use_extend_tables", False):
                raise KVCacheError(f"use_extend_tables: request {req_id!r} asks for extend tables, a second block "
                                   "list head-wise tables do not serve")
            tokens = _task_tokens(task)
            admission = self._cache.admit(req_id, tokens, mm=_task_mm(task), num_tokens=1)
            self._queries += 1
            self._queried_tokens += int(tokens.size)
            hit = 0
            if admission is None:
                self._deferred.add(req_id)
                task.block_tables_headwise = []
            else:
                hit = admission.num_cached_tokens // self.block_size
                table = np.array(admission.table, dtype=np.int32)
                start = hit * self.block_size
                self._live[req_id] = _Live(task, hit, int(admission.num_tokens), start, start, table)
                self._spare = (req_id, table.shape[1] - hit)
                self._publish(self._live[req_id])
            matched = hit * self.block_size
            self._hit_requests += hit > 0
            self._hit_tokens += matched
            self._report_hit(req_id, matched, int(tokens.size))
            task.num_cached_blocks = hit
            ids = self._live[req_id].table[0, :hit].tolist() if hit else []
            return list(ids), matched, {
                "gpu_match_token_num": matched, "cpu_match_token_num": 0, "storage_match_token_num": 0,
                "match_gpu_block_ids": list(ids), "gpu_recv_block_ids": [], "match_storage_block_ids": [],
                "cpu_cache_prepare_time": 0, "storage_cache_prepare_time": 0}

    def allocate_gpu_blocks(self, num_blocks: int, req_id: object = None) -> list[int]:
        """``num_blocks`` more blocks for a matched request, in every head; returns the full heads' ids.

        The tokens the scheduler has placed so far join the table first, and the window heads give back the
        blocks no query of the work in flight or about to run can see.
        """
        _check_count(num_blocks, "num_blocks")
        with self.request_release_lock:
            live = self._live.get(req_id)
            if live is None:
                raise KVCacheError(f"req_id: {req_id!r} was not matched (request_match_blocks) or held nothing; "
                                   "head-wise tables give blocks only to a matched request")
            if len(live.task.block_tables) != live.listed:
                raise KVCacheError(f"block_tables: request {req_id!r} lists {len(live.task.block_tables)} blocks, "
                                   f"the adapter gave it {live.listed}; head-wise tables serve one list per request")
            computed = int(getattr(live.task, "num_computed_tokens", live.start))
            live.done, live.start = min(live.start, computed), computed
            target = live.listed + num_blocks
            self._advance(live, computed, target)
            blocks = live.table[0, live.listed:target].tolist()
            live.listed = target
            if self._spare is not None and self._spare[0] == req_id:
                self._spare = None
            self._publish(live)
            self._report()
            return blocks

    def update_cache_blocks(self, task: Any, block_size: int, num_computed_tokens: int) -> None:
        """The scheduler placed the request's tokens up to ``num_computed_tokens``: they join its table and its
        full blocks enter the prefix index."""
        self._check_block_size(block_size)
        _check_count(num_computed_tokens, "num_computed_tokens")
        with self.request_release_lock:
            live = self._get_live(task.request_id)
            if num_computed_tokens > live.listed * self.block_size:
                raise KVCacheError(f"num_computed_tokens: {num_computed_tokens} exceeds the {live.listed} blocks "
                                   f"request {task.request_id!r} was given")
            self._advance(live, num_computed_tokens, live.listed)
            self._publish(live)

    def cache_output_blocks(self, task: Any, block_size: int) -> None:
        """Every token of the request so far joins its table (as far as its blocks reach) and the prefix index."""
        self._check_block_size(block_size)
        with self.request_release_lock:
            live = self._get_live(task.request_id)
            known = len(task.prompt_token_ids) + len(task.output_token_ids)
            self._advance(live, min(known, live.listed * self.block_size), live.listed)
            self._publish(live)

    def release_block_ids(self, task: Any) -> None:
        """Free the request in every head: its blocks go back, full ones stay findable until reused. The
        ``recycle_gpu_blocks`` FastDeploy sends after it for the rest of its list only checks those ids."""
        with self.request_release_lock:
            req_id = task.request_id
            if req_id in self._deferred:
                self._deferred.discard(req_id)
                self._released = (req_id, [])
                return
            live = self._get_live(req_id)
            self._cache.free(req_id)
            del self._live[req_id]
            self._released = (req_id, live.table[0, :live.listed].tolist())
            if self._spare is not None and self._spare[0] == req_id:
                self._spare = None
            task.block_tables_headwise = []
            self._report()

    def recycle_gpu_blocks(self, gpu_block_ids: int | Sequence[int], req_id: object = None) -> None:
        """Check ``gpu_block_ids`` against the request ``release_block_ids`` just freed (its blocks are back
        already); anything else is refused: head-wise blocks go back only with their request."""
        ids = [gpu_block_ids] if isinstance(gpu_block_ids, (int, np.integer)) else list(gpu_block_ids)
        _check_ids(ids, "gpu_block_ids", self.num_gpu_blocks)
        with self.request_release_lock:
            if self._released is None or self._released[0] != req_id:
                if not ids:
                    return
                raise KVCacheError(f"gpu_block_ids: request {req_id!r} was not just released; head-wise blocks go "
                                   "back only with their request (release_block_ids, then this call)")
            listed = list(self._released[1])
            for b in ids:
                if b not in listed:
                    raise KVCacheError(f"gpu_block_ids: block {b} was not in request {req_id!r}'s list")
                listed.remove(b)
            self._released = None

    def free_block_ids(self, need_block_num: int) -> int:
        """Refused: in head-wise mode cached blocks are evicted only by the allocations that need them."""
        raise KVCacheError("free_block_ids: head-wise tables evict cached blocks only as allocations need them")

    def block_tables_headwise(self, request_id: object) -> np.ndarray:
        """The request's table per kv head, int32 ``[num_kv_heads, len(block_tables)]``, ``-1`` where a window
        head gave the block back."""
        with self.request_release_lock:
            live = self._get_live(request_id)
            return live.table[:, :live.listed].copy()

    # ------------------------------------------------------------------ resets and invariants

    def reset(self, wait_for_tasks_done: bool = False) -> None:
        """Forget everything: this manager's requests are freed and every prefix forgotten (the workers' KV is
        gone); on a shared daemon other engines keep their blocks."""
        with self.request_release_lock:
            if self._shared is not None:
                for req_id in list(self._live):
                    self._cache.free(req_id)
                self._cache.reset_prefix_cache()
            self._build(self.cache_config)
            if self.metrics is not None:
                self.metrics.reset_metrics()

    def check_integrity(self, tables: Iterable[Sequence[int]] | None = None) -> None:
        """Raise AssertionError with the numbers if kvcache's pools and index disagree, a live request's
        ``block_tables`` is not its full heads' row, or ``tables`` (every list the scheduler holds) lists other
        blocks than the live requests' full rows."""
        with self.request_release_lock:
            self._cache.check_integrity()
            expected: list[int] = []
            for req_id, live in self._live.items():
                table = np.asarray(self._cache.table(req_id))
                spare = self._spare[1] if self._spare is not None and self._spare[0] == req_id else 0
                assert table.shape[1] == live.listed + spare, (f"request {req_id!r}: {table.shape[1]} blocks in "
                                                               f"kvcache, {live.listed} listed, {spare} spare")
                assert (table == live.table[:, :table.shape[1]]).all(), f"request {req_id!r}: stale table"
                listed = list(live.task.block_tables)
                assert listed == table[0, :live.listed].tolist(), (f"request {req_id!r}: block_tables {listed} is "
                                                                   f"not its full row {table[0].tolist()}")
                assert (table[self._full_heads] >= 0).all(), f"request {req_id!r}: a full head lost a block"
                expected += listed
            if tables is not None:
                given = sorted(b for table in tables for b in table)
                assert given == sorted(expected), (f"the scheduler lists {len(given)} blocks, the live requests "
                                                   f"hold {len(expected)}")

    # ------------------------------------------------------------------ internals

    @property
    def _full_heads(self) -> list[int]:
        return [head for head, p in enumerate(self.policies) if isinstance(p, Full)]

    def _get_live(self, req_id: object) -> _Live:
        live = self._live.get(req_id)
        if live is None:
            raise KVCacheError(f"request_id: {req_id!r} was not matched (request_match_blocks) or is released")
        return live

    def _advance(self, live: _Live, upto: int, blocks: int) -> None:
        """Give kvcache the request's tokens up to ``upto`` and make its table cover ``blocks`` blocks; window
        heads give back what no query from token ``live.done`` on sees. Raises (changing nothing) when a head is
        short."""
        tokens = _task_tokens(live.task)
        upto = min(upto, int(tokens.size))
        new = tokens[live.num_tokens:upto] if upto > live.num_tokens else tokens[:0]
        total = live.num_tokens + int(new.size)
        lookahead = max(0, blocks * self.block_size - total)
        if new.size == 0 and blocks <= live.table.shape[1]:
            return
        table = self._cache.extend(live.task.request_id, new, num_computed_tokens=min(live.done, live.num_tokens),
                                   num_lookahead_tokens=lookahead)
        if table is None:
            raise KVCacheError(f"num_blocks: request {live.task.request_id!r} needs {blocks} blocks in every head; "
                               f"a head has {int(np.min(self._cache.num_free_blocks))} free")
        live.table = np.array(table, dtype=np.int32)
        live.num_tokens = total

    def _publish(self, live: _Live) -> None:
        """Set ``task.block_tables_headwise``: every head's row over the scheduler's list."""
        live.task.block_tables_headwise = live.table[:, :live.listed].tolist()


def _served_rows(cache: KVCacheManager | CacheClient) -> tuple[int, list[dict[str, Any]]]:
    """A shared cache's block count and each row's policy as ``describe_policy`` gives it."""
    if isinstance(cache, KVCacheManager):
        return cache.num_blocks, [describe_policy(p) for p in cache.rows]
    info = cache.info()
    keys = ("kind", "window", "sink", "chunk")
    return info["num_blocks"], [{k: row[k] for k in keys if k in row} for row in info["rows"]]


def _rows_text(rows: list[dict[str, Any]]) -> str:
    """Rows as ``--rows`` spells them: ``full*2,window:16:4*2``."""
    words = []
    for row in rows:
        word = row["kind"] if row["kind"] == "full" else (
            f"window:{row['window']}:{row['sink']}" if row["kind"] == "window" else f"chunk:{row['chunk']}")
        if words and words[-1][0] == word:
            words[-1][1] += 1
        else:
            words.append([word, 1])
    return ",".join(w if n == 1 else f"{w}*{n}" for w, n in words)

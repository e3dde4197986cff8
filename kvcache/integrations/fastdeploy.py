"""FastDeploy's ``PrefixCacheManager`` contract on a ``KVCacheManager`` in process, or on a shared daemon.

FastDeploy's ``ResourceManagerV1`` owns each request's block list (``request.block_tables``, a flat list of
GPU block ids) and asks its cache manager four things: which cached blocks a prompt may reuse
(``request_match_blocks``), a number of blank blocks (``allocate_gpu_blocks``), to remember the blocks a
prefill chunk has filled (``update_cache_blocks``, ``cache_output_blocks``) and to take blocks back
(``release_block_ids`` for the cached part, ``recycle_gpu_blocks`` for the rest). ``FastDeployCacheManager``
answers those calls with ``KVCacheManager``'s operations for scheduler-owned block lists (``match_blocks``,
``allocate_blank``, ``commit_blocks``, ``release_blocks``; ``kvcache.allocator.owned``): FastDeploy's scheduler
hands out blank blocks before it knows their tokens, even with no request named, and later says which of its own
block ids hold which tokens. ``CacheClient`` has the same operations, so the one code path runs on a
``kvcache serve`` daemon that several engines (DP ranks) share, with its KV events. One request's blocks under both::

    block_tables   | m0 | m1 | a2 | a3 | a4 | a5 |
                   |<-matched->|<-- allocate_gpu_blocks -->|
    cached part    |<-- num_cached_blocks -->|               update_cache_blocks(num_computed_tokens=4 blocks)
    release        |<- release_block_ids --->|<-recycle_gpu_blocks(block_tables[num_cached_blocks:])->|

Every block in a request's list holds one reference of that request; a released cached block stays findable
until an allocation needs it (oldest released first, a prefix's tail before its head).

What changes against FastDeploy's radix tree:

- ``gpu_free_block_list`` keeps FastDeploy's meaning, the free blocks that hold no prefix, but
  ``can_allocate_gpu_blocks(n)`` counts cached free blocks too and evicts nothing: eviction happens inside
  ``allocate_gpu_blocks``, one block per block needed, where FastDeploy evicts ``n`` leaves as soon as
  its free list is short. Prefixes stay findable longer.
- Block ids are reused last-freed-first (FastDeploy: smallest id first); counts are the same.
- Multimodal items key a block by ``(mm_hash, offset in the block)``; FastDeploy's image placeholder token
  ``-1`` is hashed as ``2**32 - 1``.
- A block whose prefix another block already holds stays the request's own and is not indexed twice.

Refused by name (``KVCacheError``), never ignored: CPU swap space (``num_cpu_blocks > 0``), storage backends
(``kvcache_storage_backend``), the v0 scheduler's ``request_block_ids``, and FastDeploy's v1 cache manager
(``ENABLE_V1_KVCACHE_MANAGER=1``), which ``install`` cannot replace.

Head-wise tables: where FastDeploy's config asks for head-wise KV cache (``FD_HEAD_WISE_KV_CACHE=1`` with
``head_wise_swa_ratio``), ``FastDeployCacheManager(config, ...)`` builds a ``HeadWiseCacheManager``
(``kvcache.integrations.fastdeploy_headwise``): one table per kv head, window heads giving blocks back, with
prefix caching.

Daemon leases: a manager on a daemon pings it every ``keepalive`` seconds (default 5), or three times per
lease where the daemon's ``--lease-timeout`` is shorter, from a thread of its own, so the daemon keeps an idle
engine's blocks.

Thread model: FastDeploy calls these methods from its scheduler thread and from executor threads (a finished
request's release); every method takes ``request_release_lock`` (a re-entrant lock), so calls are serialised
(on a daemon, the manager's one ``CacheClient``, which is not thread-safe, is used only under that lock).

Checked against FastDeploy develop at commit c1b7c083 (2026-05-20).
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterable, Iterator, NamedTuple, Sequence

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.manager import KVCacheManager
from kvcache.allocator.prefix import MMPlaceholder, as_token_array

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from kvcache.client import CacheClient

log = logging.getLogger(__name__)

FASTDEPLOY_COMMIT = "c1b7c083"
"""The FastDeploy commit (develop, 2026-05-20) whose ``PrefixCacheManager`` contract this adapter follows."""

_UINT32 = 2**32
KEEPALIVE_SECONDS = 5.0
"""How often a manager on a daemon pings it by default: well inside any ``--lease-timeout`` worth setting."""
# The methods install() lends this class from FastDeploy's own PrefixCacheManager: they start FastDeploy's
# cache processes and read FastDeploy's config, and hold no block state.
_BORROWED = ("launch_cache_manager", "launch_cache_messager", "_get_kv_cache_shape")


class CacheStats(NamedTuple):
    """Prefix-cache counters since start or ``reset``: matches asked, matches that hit, tokens asked and hit, and
    cached blocks evicted (reused for other tokens)."""

    queries: int
    hit_requests: int
    queried_tokens: int
    hit_tokens: int
    evicted_blocks: int


class FastDeployCacheManager:
    """FastDeploy's ``PrefixCacheManager`` as ``ResourceManagerV1`` uses it, on a ``KVCacheManager`` or a daemon.

    Built by FastDeploy's ``ResourceManager`` as ``PrefixCacheManager(config, tensor_parallel_size,
    splitwise_role, local_data_parallel_id)`` once ``install()`` has run: in process (a ``KVCacheManager`` of
    FastDeploy's block count), or on a ``CacheClient`` to the ``kvcache serve`` daemon ``install(daemon=...)``
    names, so several engines (DP ranks) share one daemon's blocks, prefixes and KV events. ``cache`` gives the
    manager or client directly. A call that cannot be served (too few blocks, a block the caller does not hold)
    raises ``KVCacheError`` and changes nothing.
    """

    _daemon: str | None = None  # install(daemon=...): the endpoint every manager built afterwards connects to
    _keepalive: float = KEEPALIVE_SECONDS  # install(keepalive=...)

    def __new__(cls, config: Any = None, *args: Any, **kwargs: Any) -> FastDeployCacheManager:
        """A ``HeadWiseCacheManager`` where FastDeploy's config asks for head-wise tables (``FD_HEAD_WISE_KV_CACHE=1``
        with ``head_wise_swa_ratio``), so FastDeploy builds it through the one name ``install()`` patches."""
        if cls is FastDeployCacheManager and config is not None:
            from kvcache.integrations.fastdeploy_headwise import HeadWiseCacheManager, head_wise_policies

            if head_wise_policies(config) is not None:
                cls = HeadWiseCacheManager
        return super().__new__(cls)

    def __init__(self, config: Any, tensor_parallel_size: int = 1, splitwise_role: str = "mixed",
                 local_data_parallel_id: int = 0, *, cache: KVCacheManager | CacheClient | None = None,
                 keepalive: float | None = None) -> None:
        self.config = config
        self.cache_config = config.cache_config
        self.speculative_config = getattr(config, "speculative_config", None)
        self.tensor_parallel_size = tensor_parallel_size
        self.splitwise_role = splitwise_role
        self.enable_splitwise = int(splitwise_role != "mixed")
        self.local_data_parallel_id = local_data_parallel_id
        self.request_release_lock = threading.RLock()
        self.kvcache_storage_backend = None
        self.num_cpu_blocks = 0
        self.cpu_free_block_list: list[int] = []
        self._executor: Executor | None = None
        self.metrics = _hit_metrics()  # FastDeploy's CacheMetrics (its hit-rate gauges), None without FastDeploy
        self.daemon = self._daemon if cache is None else None  # the endpoint this manager connected to, if any
        keepalive = self._keepalive if keepalive is None else keepalive
        if isinstance(keepalive, bool) or not isinstance(keepalive, (int, float)) or keepalive < 0:
            raise KVCacheError(f"keepalive: must be a number of seconds >= 0, got {keepalive!r}")
        if self.daemon is not None:
            from kvcache.client import CacheClient

            cache = CacheClient(self.daemon, timeout=30.0)
        self._stop = threading.Event()
        if cache is not None and not isinstance(cache, KVCacheManager) and keepalive > 0:
            # The daemon frees a silent client's blocks after --lease-timeout: an idle engine must not fall silent.
            lease = float(cache.info().get("lease_timeout") or 0.0)
            interval = min(float(keepalive), lease / 3) if lease > 0 else float(keepalive)
            threading.Thread(target=_keep_lease, args=(weakref.ref(self), self._stop, interval),
                             name="kvcache-keepalive", daemon=True).start()
        self._shared = cache  # a manager or client given to us: its blocks are not ours to rebuild
        # Blank blocks (allocate_gpu_blocks) are held under this id until update_cache_blocks commits them to a
        # request: FastDeploy may allocate before it names the request. Unique per manager: engines sharing a
        # daemon each hold their own.
        self._blank = f"fastdeploy-blank-{uuid.uuid4().hex}"
        self._build(self.cache_config)

    # ------------------------------------------------------------------ setup

    def _build(self, cache_config: Any) -> None:
        """Check ``cache_config`` and start empty: every block free, nothing cached, no request."""
        _refuse_unsupported(cache_config)
        num_blocks = _gpu_block_count(cache_config)
        block_size = getattr(cache_config, "block_size", None)
        if block_size is not None:
            _check_count(block_size, "cache_config.block_size", least=1)
        if self._shared is not None:
            self._cache = self._shared
            info = self._cache.info() if not isinstance(self._cache, KVCacheManager) else None
            shared_size = info["block_size"] if info is not None else self._cache.block_size
            if block_size is not None and block_size != shared_size:
                raise KVCacheError(f"cache_config.block_size: {block_size} differs from the shared cache's "
                                   f"{shared_size}")
            block_size = shared_size
            num_blocks = info["num_blocks"] if info is not None else self._cache.num_blocks
        else:
            # FastDeploy passes the block size with every prefix call; a config without one takes the first
            # call's (the manager is rebuilt then, which only an unused one can be).
            self._cache = KVCacheManager(num_blocks, block_size or 1)
        self.num_gpu_blocks = num_blocks
        self.block_size: int | None = block_size
        self._matched: dict[object, int] = {}  # matched request -> blocks in its committed part (num_cached_blocks)
        self._start_counting()

    def _start_counting(self) -> None:
        """Zero the prefix-cache counters and tell FastDeploy's metrics the pool's size (``num_gpu_blocks``)."""
        self._queries = self._hit_requests = self._queried_tokens = self._hit_tokens = 0
        self._evicted_base = _evicted(self._cache)
        metrics = _fastdeploy_metrics()
        if metrics is not None:
            metrics.max_gpu_block_num.set(self.num_gpu_blocks)
            metrics.max_cpu_block_num.set(0)
        self._report()

    def update_cache_config(self, cache_config: Any) -> None:
        """Take FastDeploy's final cache config (its block count after profiling) and start empty.

        Refused while any block is in use: the pool cannot change size under live requests.
        """
        with self.request_release_lock:
            in_use = len(self._cache.owned_blocks(self._blank)[1]) + sum(self._matched.values())
            if in_use or self._matched:
                raise KVCacheError(f"update_cache_config: {in_use} blocks and {len(self._matched)} matched "
                                   "requests are live; release them first")
            self._build(cache_config)
            self.cache_config = cache_config

    def close(self) -> None:
        """Stop pinging the daemon and close the connection this manager opened (``install(daemon=...)``); its
        blocks stay held until the daemon's lease timeout. In process: nothing to close."""
        self._stop.set()
        if self.daemon is not None:
            with self.request_release_lock:
                self._cache.close()

    def ping(self) -> None:
        """Renew this manager's lease on its daemon (any call does; an idle manager's keepalive thread calls this).
        Skipped while another call holds the lock, which renews the lease itself; raises ``KVCacheError`` if the
        daemon does not answer within the client's timeout."""
        if isinstance(self._cache, KVCacheManager) or not self.request_release_lock.acquire(timeout=1.0):
            return
        try:
            self._cache.ping()
        finally:
            self.request_release_lock.release()

    # ------------------------------------------------------------------ counts

    @property
    def gpu_free_block_list(self) -> list[int]:
        """Free blocks holding no prefix, ascending (FastDeploy's meaning: cached free blocks are not in it)."""
        with self.request_release_lock:
            return self._cache.uncached_free_blocks().tolist()

    @property
    def num_free_gpu_blocks(self) -> int:
        """Free blocks holding no prefix: ``len(gpu_free_block_list)`` without building the list."""
        with self.request_release_lock:
            return int(self._cache.num_free_blocks[0] - self._cache.num_cached_free_blocks[0])

    @property
    def num_allocatable_gpu_blocks(self) -> int:
        """Blocks ``allocate_gpu_blocks`` can hand out now: free ones plus cached ones no request holds."""
        with self.request_release_lock:
            return int(self._cache.num_free_blocks[0])

    @property
    def available_gpu_resource(self) -> float:
        """``len(gpu_free_block_list) / num_gpu_blocks``, as FastDeploy reports it."""
        return self.num_free_gpu_blocks / self.num_gpu_blocks

    def get_required_block_num(self, input_token_num: int, block_size: int) -> int:
        """Blocks that hold ``input_token_num`` tokens."""
        return (input_token_num + block_size - 1) // block_size

    def stats(self) -> CacheStats:
        """Prefix-cache counters since start or the last ``reset``: matches are this manager's, evictions the
        cache's (all engines' on a shared daemon)."""
        with self.request_release_lock:
            return CacheStats(self._queries, self._hit_requests, self._queried_tokens, self._hit_tokens,
                              _evicted(self._cache) - self._evicted_base)

    # ------------------------------------------------------------------ blank blocks

    def can_allocate_gpu_blocks(self, num_blocks: int, try_free_gpu_blocks: bool = True) -> bool:
        """Whether ``allocate_gpu_blocks(num_blocks)`` succeeds now; with ``try_free_gpu_blocks=False``, without
        evicting a cached prefix. Changes nothing."""
        _check_count(num_blocks, "num_blocks")
        with self.request_release_lock:
            if try_free_gpu_blocks:
                return self.num_allocatable_gpu_blocks >= num_blocks
            return self.num_free_gpu_blocks >= num_blocks

    def allocate_gpu_blocks(self, num_blocks: int, req_id: object = None) -> list[int]:
        """``num_blocks`` blank blocks, one reference each, for the caller's block list.

        Free blocks first (lowest id first), then cached free ones, oldest released first, whose prefixes
        leave the index. ``req_id`` is only for messages: the caller owns the list.
        """
        _check_count(num_blocks, "num_blocks")
        if num_blocks == 0:
            return []
        with self.request_release_lock:
            blocks = self._cache.allocate_blank(self._blank, num_blocks)
            if blocks is None:
                raise KVCacheError(f"num_blocks: {num_blocks} asked for request {req_id!r}, "
                                   f"{self.num_allocatable_gpu_blocks} allocatable")
            self._report()
            return blocks.tolist()

    def recycle_gpu_blocks(self, gpu_block_ids: int | Sequence[int], req_id: object = None) -> None:
        """Drop one reference of each listed block (blocks outside a request's cached part, or anonymous ones).

        A block that no request holds any more becomes free; a cached one stays findable until reused.
        """
        ids = [gpu_block_ids] if isinstance(gpu_block_ids, (int, np.integer)) else list(gpu_block_ids)
        if not ids:
            return
        _check_ids(ids, "gpu_block_ids", self.num_gpu_blocks)
        with self.request_release_lock:
            with _field("gpu_block_ids", req_id):
                self._cache.release_blocks(self._blank, ids)
            self._report()

    # ------------------------------------------------------------------ prefixes

    def request_match_blocks(self, task: Any, block_size: int, *args: object) -> tuple[list[int], int, dict]:
        """The leading cached blocks of the request's tokens (prompt, then output), with one reference each.

        Returns ``(block_ids, matched_tokens, metrics)`` with FastDeploy's metric keys (``gpu_match_token_num``
        and ``match_gpu_block_ids`` carry the hit; CPU and storage entries are zero) and sets
        ``task.num_cached_blocks``. A whole-prompt hit is returned whole, as FastDeploy does (its scheduler then
        recomputes the last block).
        """
        self._check_block_size(block_size)
        with self.request_release_lock:
            req_id = task.request_id
            if req_id in self._matched:
                raise KVCacheError(f"request_id: {req_id!r} is matched already; release_block_ids first")
            tokens = _task_tokens(task)
            block_ids = self._cache.match_blocks(req_id, tokens, mm=_task_mm(task)).tolist()
            self._matched[req_id] = len(block_ids)
            matched = len(block_ids) * self.block_size
            self._queries += 1
            self._hit_requests += matched > 0
            self._queried_tokens += int(tokens.size)
            self._hit_tokens += matched
            self._report_hit(req_id, matched, int(tokens.size))
            task.num_cached_blocks = len(block_ids)
            metrics = {
                "gpu_match_token_num": matched,
                "cpu_match_token_num": 0,
                "storage_match_token_num": 0,
                "match_gpu_block_ids": list(block_ids),
                "gpu_recv_block_ids": [],
                "match_storage_block_ids": [],
                "cpu_cache_prepare_time": 0,
                "storage_cache_prepare_time": 0,
            }
            return list(block_ids), matched, metrics

    def update_cache_blocks(self, task: Any, block_size: int, num_computed_tokens: int) -> None:
        """Index the request's blocks that ``num_computed_tokens`` filled (after a prefill chunk is scheduled).

        The blocks come from ``task.block_tables``; each must be a blank one (``allocate_gpu_blocks``). Sets
        ``task.num_cached_blocks``.
        """
        self._check_block_size(block_size)
        _check_count(num_computed_tokens, "num_computed_tokens")
        with self.request_release_lock:
            self._cache_blocks(task, num_computed_tokens // self.block_size)

    def cache_output_blocks(self, task: Any, block_size: int) -> None:
        """Index every full block of the request's prompt and output so far (FastDeploy's output caching)."""
        self._check_block_size(block_size)
        with self.request_release_lock:
            total = len(task.prompt_token_ids) + len(task.output_token_ids)
            self._cache_blocks(task, total // self.block_size)

    def _cache_blocks(self, task: Any, num_full: int) -> None:
        """Commit blocks ``[len(cached part), num_full)`` of ``task.block_tables`` with their tokens."""
        req_id = task.request_id
        start = self._get(req_id)
        if num_full <= start:
            return
        table = task.block_tables
        if len(table) < num_full:
            raise KVCacheError(f"block_tables: request {req_id!r} holds {len(table)} blocks, "
                               f"{num_full} full blocks to cache")
        new = list(table[start:num_full])
        _check_ids(new, "block_tables", self.num_gpu_blocks)
        tokens = _task_tokens(task)
        bs = self.block_size
        if tokens.size < num_full * bs:
            raise KVCacheError(f"num_computed_tokens: {num_full * bs} exceeds request {req_id!r}'s "
                               f"{tokens.size} tokens")
        with _field("block_tables", req_id):
            self._cache.commit_blocks(req_id, new, tokens[start * bs:num_full * bs], blank_from=self._blank)
        self._matched[req_id] = num_full
        task.num_cached_blocks = num_full

    def release_block_ids(self, task: Any) -> None:
        """End the request's hold on its cached part (``block_tables[:num_cached_blocks]``), tail first.

        The caller recycles the rest with ``recycle_gpu_blocks``. Released blocks stay findable until reused.
        """
        with self.request_release_lock:
            self._get(task.request_id)
            self._cache.release_blocks(task.request_id)
            del self._matched[task.request_id]
            self._report()

    def release_block_ids_async(self, task: Any) -> Future:
        """``release_block_ids`` on a worker thread, as FastDeploy's v0 scheduler calls it."""
        with self.request_release_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcache-release")
            return self._executor.submit(self.release_block_ids, task)

    def free_block_ids(self, need_block_num: int) -> int:
        """Evict up to ``need_block_num`` cached free blocks now (oldest released first); returns how many."""
        _check_count(need_block_num, "need_block_num")
        with self.request_release_lock:
            return int(self._cache.evict_cached(need_block_num))

    def free_block_ids_async(self, need_block_num: int) -> None:
        """``free_block_ids``; it runs at once (nothing is copied off the GPU)."""
        self.free_block_ids(need_block_num)
    def write_cache_to_storage(self, request: Any) -> None:
        """Nothing to write: no storage backend is configured (one is refused at construction). FastDeploy's
        scheduler calls this for every finished request."""

    def write_cache_to_storage_decode(self, request: Any) -> None:
        """Nothing to write, as ``write_cache_to_storage`` (a decode instance's finished request)."""

    def request_block_ids(self, task: Any, block_size: int, dec_token_num: int, *args: object) -> None:
        """Refused: FastDeploy's v0 scheduler reserves a request's blocks in one call, which this adapter does not
        serve (run FastDeploy with ``ENABLE_V1_KVCACHE_SCHEDULER=1``, its default)."""
        raise KVCacheError("request_block_ids: FastDeploy's v0 scheduler (ENABLE_V1_KVCACHE_SCHEDULER=0) is not "
                           "supported by kvcache's adapter; use the v1 scheduler")

    def get_block_hash_extra_keys(self, request: Any, start_idx: int, end_idx: int,
                                  mm_idx: int) -> tuple[int, list[str]]:
        """The multimodal hashes of items overlapping tokens ``[start_idx, end_idx)``, and the item to look at
        next (FastDeploy's helper, for callers that key blocks themselves; kvcache's hashes key each item by
        its hash and offset, through ``BlockHasher``)."""
        items = _mm_items(request)
        if not items or items[-1][1] + items[-1][2] <= start_idx:
            return mm_idx, []
        keys: list[str] = []
        for i in range(mm_idx, len(items)):
            ident, offset, length = items[i]
            if offset + length <= start_idx:
                continue
            if offset >= end_idx:
                return i, keys
            keys.append(ident)
            if offset + length > end_idx:
                return i, keys
        return len(items) - 1, keys

    def is_chunked_mm_input(self, mm_inputs: dict | None, matched_token_num: int) -> tuple[bool, int]:
        """Whether ``matched_token_num`` falls inside a multimodal item (not at its edges), and which item."""
        positions = (mm_inputs or {}).get("mm_positions") or []
        for i, pos in enumerate(positions):
            offset = pos["offset"] if isinstance(pos, dict) else pos.offset
            length = pos["length"] if isinstance(pos, dict) else pos.length
            if offset < matched_token_num < offset + length:
                return True, i
            if matched_token_num < offset:
                break
        return False, 0

    # ------------------------------------------------------------------ resets

    def reset(self, wait_for_tasks_done: bool = False) -> None:
        """Forget everything: every block free, nothing cached, no request (FastDeploy's reset after its
        workers dropped the KV cache). ``wait_for_tasks_done``: there are no swap tasks to wait for.

        On a shared cache this manager's blocks go back and every prefix is forgotten (the workers' KV is gone);
        other engines keep their blocks.
        """
        with self.request_release_lock:
            if self._shared is not None:
                for req_id in list(self._matched):
                    self._cache.release_blocks(req_id)
                blank = self._cache.owned_blocks(self._blank)[1]
                if blank.size:
                    self._cache.release_blocks(self._blank, blank)
                self._cache.reset_prefix_cache()
            self._build(self.cache_config)
            if self.metrics is not None:
                self.metrics.reset_metrics()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; live requests keep their blocks. Returns the hashes dropped."""
        with self.request_release_lock:
            return int(self._cache.reset_prefix_cache())
    def clear_prefix_cache(self) -> None:
        """FastDeploy's watcher thread (``launch_cache_manager`` starts it): on the workers' ``CLEARING`` or
        ``UPDATING`` status (weights cleared or updated) reset, then report ``CLEARED`` or ``NORMAL``."""
        from fastdeploy.inter_communicator import PrefixTreeStatus

        signal = self.prefix_tree_status_signal
        while True:
            status = signal.value[0]
            if status == PrefixTreeStatus.CLEARING:
                self.reset(wait_for_tasks_done=True)
                signal.value[0] = PrefixTreeStatus.CLEARED
            elif status == PrefixTreeStatus.UPDATING:
                self.reset()
                signal.value[0] = PrefixTreeStatus.NORMAL
            time.sleep(0.01)

    # ------------------------------------------------------------------ invariants

    def check_integrity(self, tables: Iterable[Sequence[int]] | None = None) -> None:
        """Raise AssertionError with the numbers if the cache's pool, index and owners disagree.

        ``tables``: every block list the caller holds (each live request's ``block_tables``, extend tables,
        anonymous allocations); then the blocks this manager's requests and blank allocations hold must be
        exactly those listed.
        """
        with self.request_release_lock:
            self._cache.check_integrity()
            held = [self._cache.owned_blocks(self._blank)[1]]
            for req_id, count in self._matched.items():
                committed = self._cache.owned_blocks(req_id)[0]
                assert committed.size == count, (f"request {req_id!r}: {committed.size} committed blocks, "
                                                 f"{count} cached")
                held.append(committed)
            if tables is not None:
                listed = np.zeros(self.num_gpu_blocks, dtype=np.int64)
                for table in tables:
                    if len(table):
                        np.add.at(listed, np.asarray(table, dtype=np.intp), 1)
                refs = np.zeros(self.num_gpu_blocks, dtype=np.int64)
                for blocks in held:
                    np.add.at(refs, blocks.astype(np.intp), 1)
                bad = np.flatnonzero(listed != refs)
                assert bad.size == 0, (f"block {int(bad[0])} is listed {int(listed[bad[0]])} time(s) but has "
                                       f"{int(refs[bad[0]])} reference(s)" if bad.size else "")

    # ------------------------------------------------------------------ internals
    def _report_hit(self, req_id: object, matched: int, queried: int) -> None:
        """Feed FastDeploy's hit-rate gauges the way its manager does (counters restart every 10,000 requests)."""
        metrics = self.metrics
        if metrics is None or queried == 0:
            return
        metrics.req_count += 1
        metrics.hit_req_count += matched > 0
        metrics.calculate_hit_metrics(req_id, 0, matched, 0, queried)
        metrics._update_history_hit_metrics()
        if metrics.req_count % 10000 == 0:
            metrics.reset_metrics()

    def _report(self) -> None:
        """Set FastDeploy's block gauges (``free_gpu_block_num``, ``available_gpu_resource``) as its manager does."""
        metrics = _fastdeploy_metrics()
        if metrics is not None:
            free = self.num_free_gpu_blocks
            metrics.free_gpu_block_num.set(free)
            metrics.available_gpu_resource.set(free / self.num_gpu_blocks)

    def _get(self, req_id: object) -> int:
        """The matched request's committed block count."""
        count = self._matched.get(req_id)
        if count is None:
            raise KVCacheError(f"request_id: {req_id!r} was not matched (request_match_blocks) or is released")
        return count

    def _check_block_size(self, block_size: int) -> None:
        if self.block_size is None:
            _check_count(block_size, "block_size", least=1)
            with self.request_release_lock:
                if self.num_allocatable_gpu_blocks != self.num_gpu_blocks or self._matched:
                    raise KVCacheError(f"block_size: cache_config.block_size is unset and blocks were allocated "
                                       f"before the first prefix call gave {block_size}; set it in the config")
                self._cache = KVCacheManager(self.num_gpu_blocks, block_size)
                self._evicted_base = 0
                self.block_size = block_size
        elif block_size != self.block_size:
            raise KVCacheError(f"block_size: {block_size!r} differs from cache_config.block_size {self.block_size}")


def install(daemon: str | None = None, *, keepalive: float = KEEPALIVE_SECONDS) -> type[FastDeployCacheManager]:
    """Make FastDeploy build ``FastDeployCacheManager`` wherever it builds its ``PrefixCacheManager``.

    ``daemon``: the endpoint of a ``kvcache serve`` (e.g. ``ipc:///run/kvcache.sock``) every manager built
    afterwards schedules on, through a ``CacheClient``, instead of a ``KVCacheManager`` of its own: engines
    (DP ranks) installed with the same daemon share its blocks, prefixes and KV events. Each such manager pings
    the daemon every ``keepalive`` seconds from a thread of its own, so a daemon run with ``--lease-timeout``
    longer than that keeps an idle engine's blocks (0: never ping; the engine's calls alone renew its lease).

    This patches a module attribute: it sets ``fastdeploy.cache_manager.prefix_cache_manager.PrefixCacheManager``
    to ``FastDeployCacheManager`` (FastDeploy's ``ResourceManager`` imports the name from that module each time
    it is built, so managers built after ``install()`` are kvcache's; ones built before are untouched).
    FastDeploy's own files are not edited. ``launch_cache_manager``, ``launch_cache_messager`` and
    ``_get_kv_cache_shape`` (starting FastDeploy's cache processes; no block state) are taken from FastDeploy's
    class. Checked against FastDeploy develop at commit c1b7c083. Idempotent; ``uninstall()`` undoes it.
    Refused with ``ENABLE_V1_KVCACHE_MANAGER=1``, where FastDeploy builds its v1 cache manager instead.
    """
    from fastdeploy import envs
    from fastdeploy.cache_manager import prefix_cache_manager as module

    if envs.ENABLE_V1_KVCACHE_MANAGER:
        raise KVCacheError("ENABLE_V1_KVCACHE_MANAGER: FastDeploy then builds its v1 CacheManager, which kvcache "
                           "does not replace; unset it to schedule on kvcache")
    if isinstance(keepalive, bool) or not isinstance(keepalive, (int, float)) or keepalive < 0:
        raise KVCacheError(f"keepalive: must be a number of seconds >= 0, got {keepalive!r}")
    FastDeployCacheManager._daemon = daemon
    FastDeployCacheManager._keepalive = float(keepalive)
    original = module.PrefixCacheManager
    if original is not FastDeployCacheManager:
        for name in _BORROWED:
            setattr(FastDeployCacheManager, name, getattr(original, name))
        FastDeployCacheManager._fastdeploy_class = original
        module.PrefixCacheManager = FastDeployCacheManager
    return FastDeployCacheManager


def uninstall() -> None:
    """Undo ``install()``: FastDeploy builds its own ``PrefixCacheManager`` again."""
    from fastdeploy.cache_manager import prefix_cache_manager as module

    FastDeployCacheManager._daemon = None
    FastDeployCacheManager._keepalive = KEEPALIVE_SECONDS
    original = getattr(FastDeployCacheManager, "_fastdeploy_class", None)
    if original is not None and module.PrefixCacheManager is FastDeployCacheManager:
        module.PrefixCacheManager = original


# ---------------------------------------------------------------------- helpers


def _keep_lease(ref: weakref.ref, stop: threading.Event, interval: float) -> None:
    """Ping the manager's daemon every ``interval`` seconds until ``stop`` is set or the manager is gone."""
    while not stop.wait(interval):
        manager = ref()
        if manager is None:
            return
        try:
            manager.ping()
        except KVCacheError as e:  # the daemon is down or slow: the engine's next call reports it
            log.warning("kvcache keepalive ping to %s failed: %s", manager.daemon, e)
        del manager


def _refuse_unsupported(cache_config: Any) -> None:
    """One line naming the first FastDeploy cache feature the adapter does not serve."""
    if int(getattr(cache_config, "num_cpu_blocks", 0) or 0) > 0:
        raise KVCacheError(f"num_cpu_blocks: {cache_config.num_cpu_blocks} (swap_space) asks for a CPU swap tier, "
                           "which kvcache's FastDeploy adapter does not serve; set swap_space to 0")
    backend = getattr(cache_config, "kvcache_storage_backend", None)
    if backend:
        raise KVCacheError(f"kvcache_storage_backend: {backend!r} is not served by kvcache's FastDeploy adapter; "
                           "leave it unset")


def _gpu_block_count(cache_config: Any) -> int:
    """The blocks FastDeploy's scheduler manages: ``total_block_num`` (v1 scheduler) or ``prefill_kvcache_block_num``
    (v0), as its own manager reads them."""
    try:
        from fastdeploy import envs

        v1 = bool(envs.ENABLE_V1_KVCACHE_SCHEDULER)
    except ImportError:
        v1 = True
    name = "total_block_num" if v1 else "prefill_kvcache_block_num"
    count = getattr(cache_config, name, None)
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise KVCacheError(f"cache_config.{name}: must be an integer >= 1, got {count!r}")
    return int(count)


def _check_count(value: object, field: str, least: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise KVCacheError(f"{field}: must be an integer >= {least}, got {value!r}")


def _hit_metrics() -> Any:
    """A FastDeploy ``CacheMetrics`` (it sets FastDeploy's prefix hit-rate gauges), or None without FastDeploy."""
    if "fastdeploy" not in sys.modules:
        return None
    from fastdeploy.cache_manager.cache_metrics import CacheMetrics

    return CacheMetrics()


def _fastdeploy_metrics() -> Any:
    """FastDeploy's ``main_process_metrics`` as its cache manager module names it, or None without FastDeploy."""
    module = sys.modules.get("fastdeploy.cache_manager.prefix_cache_manager")
    return getattr(module, "main_process_metrics", None)


def _task_tokens(task: Any) -> np.ndarray:
    """The request's prompt then output tokens as uint32; FastDeploy's placeholder ``-1`` becomes ``2**32 - 1``."""
    prompt = np.asarray(task.prompt_token_ids, dtype=np.int64).ravel()
    output = getattr(task, "output_token_ids", None) or []
    tokens = np.concatenate([prompt, np.asarray(output, dtype=np.int64)]) if len(output) else prompt
    if tokens.size and int(tokens.min()) < 0:
        tokens = np.where((tokens < 0) & (tokens >= -_UINT32), tokens + _UINT32, tokens)
    return as_token_array(tokens, "prompt_token_ids")


def _mm_items(task: Any) -> list[tuple[str, int, int]]:
    """The request's multimodal items as ``(hash, offset, length)``; none unless it has positions and hashes."""
    mm = getattr(task, "multimodal_inputs", None)
    if not mm or not mm.get("mm_positions") or not mm.get("mm_hashes"):
        return []
    positions, hashes = mm["mm_positions"], mm["mm_hashes"]
    if len(positions) != len(hashes):
        raise KVCacheError(f"multimodal_inputs: {len(positions)} mm_positions but {len(hashes)} mm_hashes")
    items = []
    for pos, ident in zip(positions, hashes):
        offset = pos["offset"] if isinstance(pos, dict) else pos.offset
        length = pos["length"] if isinstance(pos, dict) else pos.length
        items.append((str(ident), int(offset), int(length)))
    return items


def _task_mm(task: Any) -> list[MMPlaceholder] | None:
    items = _mm_items(task)
    return [MMPlaceholder(*item) for item in items] if items else None


def _check_ids(ids: Sequence[object], field: str, num_blocks: int) -> None:
    """One line naming the first entry of ``ids`` that is not a block id."""
    for i, b in enumerate(ids):
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 0 <= b < num_blocks:
            raise KVCacheError(f"{field}[{i}]: {b!r} is not a block id in [0, {num_blocks})")


@contextlib.contextmanager
def _field(field: str, req_id: object) -> Iterator[None]:
    """Name FastDeploy's argument (and the request) in a refusal the cache words in its own terms."""
    try:
        yield
    except KVCacheError as e:
        raise KVCacheError(f"{field}: request {req_id!r}: {e}") from None


def _evicted(cache: KVCacheManager | CacheClient) -> int:
    """Cached blocks the cache has evicted since it started."""
    stats = cache.stats()
    return int(stats["evicted_blocks"] if isinstance(stats, dict) else stats.evicted_blocks)

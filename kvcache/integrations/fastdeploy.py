"""FastDeploy's ``PrefixCacheManager`` contract on kvcache's block pool and prefix index, in process.

FastDeploy's ``ResourceManagerV1`` owns each request's block list (``request.block_tables``, a flat list of
GPU block ids) and asks its cache manager four things: which cached blocks a prompt may reuse
(``request_match_blocks``), a number of blank blocks (``allocate_gpu_blocks``), to remember the blocks a
prefill chunk has filled (``update_cache_blocks``, ``cache_output_blocks``) and to take blocks back
(``release_block_ids`` for the cached part, ``recycle_gpu_blocks`` for the rest). ``FastDeployCacheManager``
answers those calls with kvcache's ``BlockPool`` (reference counts, a LIFO free stack, an LRU ring of cached
free blocks), ``PrefixIndex`` (chained block hash → block) and ``BlockHasher`` (SHA-256 chains), the parts
``KVCacheManager`` is built from. It does not go through ``KVCacheManager`` itself because the two disagree on
who owns a table: ``KVCacheManager`` makes each request's table from its tokens (admit, extend), while
FastDeploy's scheduler hands out blank blocks before it knows their tokens, even with no request named, and
later says which of its own block ids hold which tokens. One request's blocks under both::

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

Thread model: FastDeploy calls these methods from its scheduler thread and from executor threads (a finished
request's release); every method takes ``request_release_lock`` (a re-entrant lock), so calls are serialised.

Checked against FastDeploy develop at commit c1b7c083 (2026-05-20).
"""
from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple, Sequence

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.pool import BlockPool
from kvcache.allocator.prefix import HASH_BYTES, BlockHasher, MMPlaceholder, PrefixIndex, as_token_array

if TYPE_CHECKING:
    from concurrent.futures import Executor

FASTDEPLOY_COMMIT = "c1b7c083"
"""The FastDeploy commit (develop, 2026-05-20) whose ``PrefixCacheManager`` contract this adapter follows."""

_H = HASH_BYTES
_ROW0 = np.zeros(1, dtype=np.intp)  # the pool's one row: FastDeploy's tables are one block id per position
_UINT32 = 2**32
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


@dataclass(slots=True)
class _Request:
    """A matched request: the packed hashes of its known full blocks and the blocks of its cached part.

    ``blocks`` are ``block_tables[:num_cached_blocks]``: matched ones (a reference taken at match) and ones
    the request filled (its allocation's reference). ``release_block_ids`` drops one reference of each.
    """

    hashes: bytearray
    blocks: list[int] = field(default_factory=list)


class FastDeployCacheManager:
    """FastDeploy's ``PrefixCacheManager`` as ``ResourceManagerV1`` uses it, on kvcache's pool and prefix index.

    Built by FastDeploy's ``ResourceManager`` as ``PrefixCacheManager(config, tensor_parallel_size,
    splitwise_role, local_data_parallel_id)`` once ``install()`` has run. A call that cannot be served
    (too few blocks, a block the caller does not hold) raises ``KVCacheError`` and changes nothing.
    """

    def __init__(self, config: Any, tensor_parallel_size: int = 1, splitwise_role: str = "mixed",
                 local_data_parallel_id: int = 0) -> None:
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
        self._build(self.cache_config)

    # ------------------------------------------------------------------ setup

    def _build(self, cache_config: Any) -> None:
        """Check ``cache_config`` and start empty: every block free, nothing cached, no request."""
        _refuse_unsupported(cache_config)
        num_blocks = _gpu_block_count(cache_config)
        block_size = getattr(cache_config, "block_size", None)
        if block_size is not None:
            _check_count(block_size, "cache_config.block_size", least=1)
        self.num_gpu_blocks = num_blocks
        # FastDeploy passes the block size with every prefix call; a config without one takes the first call's.
        self.block_size: int | None = block_size
        self._hasher = BlockHasher(block_size) if block_size is not None else None
        self._pool = BlockPool(1, num_blocks)
        self._index = PrefixIndex(1, num_blocks)
        self._requests: dict[object, _Request] = {}
        self._queries = self._hit_requests = self._queried_tokens = self._hit_tokens = self._evicted = 0
        metrics = _fastdeploy_metrics()
        if metrics is not None:
            metrics.max_gpu_block_num.set(num_blocks)
            metrics.max_cpu_block_num.set(0)
        self._report()

    def update_cache_config(self, cache_config: Any) -> None:
        """Take FastDeploy's final cache config (its block count after profiling) and start empty.

        Refused while any block is in use: the pool cannot change size under live requests.
        """
        with self.request_release_lock:
            in_use = self.num_gpu_blocks - int(self._pool.num_free()[0])
            if in_use or self._requests:
                raise KVCacheError(f"update_cache_config: {in_use} blocks and {len(self._requests)} matched "
                                   "requests are live; release them first")
            self._build(cache_config)
            self.cache_config = cache_config

    # ------------------------------------------------------------------ counts

    @property
    def gpu_free_block_list(self) -> list[int]:
        """Free blocks holding no prefix, ascending (FastDeploy's meaning: cached free blocks are not in it)."""
        with self.request_release_lock:
            ids = np.arange(self.num_gpu_blocks)
            free = (self._pool.refcount(_ROW0, ids) == 0) & ~self._pool.is_cached(_ROW0, ids)
            return np.flatnonzero(free).tolist()

    @property
    def num_free_gpu_blocks(self) -> int:
        """Free blocks holding no prefix: ``len(gpu_free_block_list)`` without building the list."""
        with self.request_release_lock:
            return int(self._pool.num_free()[0] - self._pool.num_cached_free()[0])

    @property
    def num_allocatable_gpu_blocks(self) -> int:
        """Blocks ``allocate_gpu_blocks`` can hand out now: free ones plus cached ones no request holds."""
        with self.request_release_lock:
            return int(self._pool.num_free()[0])

    @property
    def available_gpu_resource(self) -> float:
        """``len(gpu_free_block_list) / num_gpu_blocks``, as FastDeploy reports it."""
        return self.num_free_gpu_blocks / self.num_gpu_blocks

    def get_required_block_num(self, input_token_num: int, block_size: int) -> int:
        """Blocks that hold ``input_token_num`` tokens."""
        return (input_token_num + block_size - 1) // block_size

    def stats(self) -> CacheStats:
        """Prefix-cache counters since start or the last ``reset``."""
        with self.request_release_lock:
            return CacheStats(self._queries, self._hit_requests, self._queried_tokens, self._hit_tokens, self._evicted)

    # ------------------------------------------------------------------ blank blocks

    def can_allocate_gpu_blocks(self, num_blocks: int, try_free_gpu_blocks: bool = True) -> bool:
        """Whether ``allocate_gpu_blocks(num_blocks)`` succeeds now; with ``try_free_gpu_blocks=False``, without
        evicting a cached prefix. Changes nothing."""
        _check_count(num_blocks, "num_blocks")
        with self.request_release_lock:
            if try_free_gpu_blocks:
                return bool(self._pool.can_allocate(num_blocks))
            return self.num_free_gpu_blocks >= num_blocks

    def allocate_gpu_blocks(self, num_blocks: int, req_id: object = None) -> list[int]:
        """``num_blocks`` blank blocks, one reference each, for the caller's block list.

        Free blocks first (last freed first), then cached free ones, oldest released first, whose prefixes
        leave the index. ``req_id`` is only for messages: the caller owns the list.
        """
        _check_count(num_blocks, "num_blocks")
        if num_blocks == 0:
            return []
        with self.request_release_lock:
            allocation = self._pool.allocate(num_blocks, ascending=True)
            if allocation is None:
                raise KVCacheError(f"num_blocks: {num_blocks} asked for request {req_id!r}, "
                                   f"{int(self._pool.num_free()[0])} allocatable")
            if allocation.evicted_blocks.size:
                self._index.remove_gone(allocation.evicted_rows, allocation.evicted_blocks)
                self._evicted += int(allocation.evicted_blocks.size)
            self._report()
            return allocation.blocks[0].tolist()

    def recycle_gpu_blocks(self, gpu_block_ids: int | Sequence[int], req_id: object = None) -> None:
        """Drop one reference of each listed block (blocks outside a request's cached part, or anonymous ones).

        A block that no request holds any more becomes free; a cached one stays findable until reused.
        """
        ids = [gpu_block_ids] if isinstance(gpu_block_ids, (int, np.integer)) else list(gpu_block_ids)
        if not ids:
            return
        with self.request_release_lock:
            blocks = self._held_blocks(ids, "gpu_block_ids", req_id)
            self._pool.decref(np.zeros(blocks.size, dtype=np.intp), blocks)
            self._report()

    def _held_blocks(self, ids: Sequence[object], field: str, req_id: object) -> np.ndarray:
        """``ids`` as an intp array after checking each is a block id with a reference per listing."""
        for i, b in enumerate(ids):
            if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 0 <= b < self.num_gpu_blocks:
                raise KVCacheError(f"{field}[{i}]: {b!r} is not a block id in [0, {self.num_gpu_blocks})")
        blocks = np.asarray(ids, dtype=np.intp)
        unique, counts = np.unique(blocks, return_counts=True)
        refs = self._pool.refcount(np.zeros(unique.size, dtype=np.intp), unique)
        short = np.flatnonzero(refs < counts)
        if short.size:
            b = int(unique[short[0]])
            raise KVCacheError(f"{field}: block {b} is listed {int(counts[short[0]])} time(s) for request "
                               f"{req_id!r} but holds {int(refs[short[0]])} reference(s)")
        return blocks

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
            if req_id in self._requests:
                raise KVCacheError(f"request_id: {req_id!r} is matched already; release_block_ids first")
            tokens = _task_tokens(task)
            hashes = self._hasher.hash_blocks_packed(tokens, mm=_task_mm(task))
            found = self._index.match(hashes)[:, 0]
            if found.size:
                self._pool.incref(np.zeros(found.size, dtype=np.intp), found, unique=True)
            block_ids = found.tolist()
            self._requests[req_id] = _Request(bytearray(hashes), list(block_ids))
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

        The blocks come from ``task.block_tables``; each must be one the request holds. Sets
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
        """Index blocks ``[len(cached part), num_full)`` of ``task.block_tables``."""
        req = self._get(task.request_id)
        start = len(req.blocks)
        if num_full <= start:
            return
        table = task.block_tables
        if len(table) < num_full:
            raise KVCacheError(f"block_tables: request {task.request_id!r} holds {len(table)} blocks, "
                               f"{num_full} full blocks to cache")
        new = self._held_blocks(list(table[start:num_full]), "block_tables", task.request_id)
        if np.unique(new).size != new.size:
            raise KVCacheError(f"block_tables: request {task.request_id!r} lists a block twice")
        _, indexed = self._index.hashes_at(np.zeros(new.size, dtype=np.intp), new)
        if indexed.any():
            raise KVCacheError(f"block_tables: block {int(new[indexed][0])} of request {task.request_id!r} "
                               "already holds a cached prefix")
        have = len(req.hashes) // _H
        if num_full > have:
            tokens = _task_tokens(task)
            if tokens.size < num_full * self.block_size:
                raise KVCacheError(f"num_computed_tokens: {num_full * self.block_size} exceeds request "
                                   f"{task.request_id!r}'s {tokens.size} tokens")
            req.hashes += self._hasher.hash_blocks_packed(
                tokens[have * self.block_size:num_full * self.block_size], mm=_task_mm(task),
                parent=bytes(req.hashes[-_H:]) if have else None, start_block=have)
        inserted = self._index.insert(bytes(req.hashes[start * _H:num_full * _H]), new.astype(np.int32)[:, None])
        added = inserted.added[:, 0]
        if added.any():
            self._pool.mark_cached(np.zeros(int(added.sum()), dtype=np.intp), new[added])
        req.blocks += new.tolist()
        task.num_cached_blocks = num_full

    def release_block_ids(self, task: Any) -> None:
        """End the request's hold on its cached part (``block_tables[:num_cached_blocks]``), tail first.

        The caller recycles the rest with ``recycle_gpu_blocks``. Released blocks stay findable until reused.
        """
        with self.request_release_lock:
            req = self._get(task.request_id)
            del self._requests[task.request_id]
            if req.blocks:
                blocks = np.asarray(req.blocks[::-1], dtype=np.intp)
                self._pool.decref(np.zeros(blocks.size, dtype=np.intp), blocks, unique=True)
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
            cached_free = int(self._pool.num_cached_free()[0])
            count = min(need_block_num, cached_free)
            if count == 0:
                return 0
            uncached = int(self._pool.num_free()[0]) - cached_free
            # Take every free block and the oldest cached ones, then give them all back in reverse: the free
            # stack is as it was, with the evicted blocks under it.
            allocation = self._pool.allocate(uncached + count)
            assert allocation is not None, "allocation failed after the free-block count"
            self._index.remove_gone(allocation.evicted_rows, allocation.evicted_blocks)
            self._evicted += count
            taken = allocation.blocks[0][::-1].astype(np.intp)
            self._pool.decref(np.zeros(taken.size, dtype=np.intp), taken, unique=True)
            return count

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
        workers dropped the KV cache). ``wait_for_tasks_done``: there are no swap tasks to wait for."""
        with self.request_release_lock:
            self._build(self.cache_config)
            if self.metrics is not None:
                self.metrics.reset_metrics()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; live requests keep their blocks. Returns the hashes dropped."""
        with self.request_release_lock:
            dropped = self._index.clear()
            self._pool.reset_cached()
            return dropped

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
        """Raise AssertionError with the numbers if pool, index and requests disagree.

        ``tables``: every block list the caller holds (each live request's ``block_tables``, extend tables,
        anonymous allocations); then each block's reference count must equal the times it is listed.
        """
        with self.request_release_lock:
            self._pool.check_integrity()
            self._index.check_integrity()
            ids = np.arange(self.num_gpu_blocks)
            cached = self._pool.is_cached(_ROW0, ids)
            held = np.zeros(self.num_gpu_blocks, dtype=bool)
            held[self._index.held_pairs()[1]] = True
            assert (cached == held).all(), f"{int((cached != held).sum())} blocks cached in the pool but not the index"
            refs = self._pool.refcount(_ROW0, ids)
            for req_id, req in self._requests.items():
                if req.blocks:
                    lacking = refs[np.asarray(req.blocks)] < 1
                    assert not lacking.any(), f"request {req_id!r}: cached-part block without a reference"
            if tables is not None:
                listed = np.zeros(self.num_gpu_blocks, dtype=np.int64)
                for table in tables:
                    if len(table):
                        np.add.at(listed, np.asarray(table, dtype=np.intp), 1)
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

    def _get(self, req_id: object) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            raise KVCacheError(f"request_id: {req_id!r} was not matched (request_match_blocks) or is released")
        return req

    def _check_block_size(self, block_size: int) -> None:
        if self.block_size is None:
            _check_count(block_size, "block_size", least=1)
            with self.request_release_lock:
                self._hasher = BlockHasher(block_size)
                self.block_size = block_size
        elif block_size != self.block_size:
            raise KVCacheError(f"block_size: {block_size!r} differs from cache_config.block_size {self.block_size}")


def install() -> type[FastDeployCacheManager]:
    """Make FastDeploy build ``FastDeployCacheManager`` wherever it builds its ``PrefixCacheManager``.

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

    original = getattr(FastDeployCacheManager, "_fastdeploy_class", None)
    if original is not None and module.PrefixCacheManager is FastDeployCacheManager:
        module.PrefixCacheManager = original


# ---------------------------------------------------------------------- helpers


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

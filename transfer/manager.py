"""TransferManager: a host-memory cache tier under one KVCacheManager's GPU blocks.

Write on release, read on hit::

    GPU (KVCacheManager)                                   host (this tier)
    free(req): cached blocks lose their last reference ──> offload D->H, per layer, background
                                                           findable once every layer landed
    admit(req): prefix continues past the GPU hit    <──── load H->D into newly allocated blocks,
                                                           per layer; the worker waits per layer

Blocks are copied to host when they become cached-and-unused, not when they
are evicted, so an eviction never waits for a copy: when the GPU manager is
about to hand a block to a new owner (``evicting``), a copy of it that has not
finished is dropped instead (it may have read the new owner's bytes), and a
finished one is kept. The new owner writes only after the scheduler's call
returns, so "finished" checked inside the call is safe. Host blocks live in
a ``BlockPool`` (one row; cached free blocks are the LRU) and a
``PrefixIndex`` (hash -> host block per row), the allocator's own structures.

Events: ``BlockStored(medium="CPU")`` when a host copy becomes findable,
``BlockRemoved(medium="CPU")`` when the tier drops one, queued on the
manager's event list between its GPU events.

Threads: every method belongs to the manager's owner thread except
``Load.wait``/``Load.status``, which a worker thread may call. The owner's
calls only decide and record copies (``Copy``); a submit thread of the tier's
works out their byte ranges and launches them, in the order they were decided,
so ``free`` and ``admit`` do neither.
"""
from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import mmap
import os
import pwd
import stat
import struct
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.events import BlockRemoved, BlockStored
from kvcache.allocator.pool import BlockPool
from kvcache.allocator.prefix import HASH_BYTES, PrefixIndex
from kvcache.allocator.rows import table_cells
from kvcache.transfer import _tier
from kvcache.transfer.copies import Copy, Submitter
from kvcache.transfer.copies import worst as _worst
from kvcache.transfer.engines import CUDA_METHODS, DEFAULT_TIMEOUT, LocalEngine, TransferHandle, TransferStatus
from kvcache.transfer.regions import KVRegion, copy_ranges_per_layer
from kvcache.transfer.staged import StagedCopier

if TYPE_CHECKING:
    from kvcache.allocator.layout import CacheSpec
    from kvcache.allocator.manager import KVCacheManager

__all__ = ["TIER_CUDA_METHODS", "Copy", "HostTierConfig", "Load", "TierStats", "TransferManager", "allocate_host",
           "copy_layers", "map_host_file", "staged_copier"]

log = logging.getLogger("kvcache.transfer.manager")

_H = HASH_BYTES
_EMPTY = np.empty(0, dtype=np.intp)
TIER_CUDA_METHODS = (*CUDA_METHODS, "staged")
"""How a host tier's copies touch the GPU: ``staged`` (``kvcache.transfer.staged``), or a LocalEngine method."""


@dataclasses.dataclass(frozen=True, slots=True)
class HostTierConfig:
    """The host tier's settings: its size (``host_bytes`` or ``host_blocks``, exactly one), engine and deadline.

    ``host_bytes`` is rounded down to whole blocks of the rank's spec.
    ``engine`` is ``local`` (host memory of this process; NIXL moves blocks
    between processes, not into a tier). ``pin`` allocates page-locked memory
    when the GPU cache is on a CUDA device, so copies run at full PCIe speed.
    ``cuda_method`` is one of ``TIER_CUDA_METHODS``: ``staged`` (what ``auto``
    takes where CuPy is present) gathers on the GPU and moves each piece in
    one DMA (``kvcache.transfer.staged``; 68 MiB of GPU memory for each
    direction's slots); the others are ``LocalEngine``'s.
    """

    host_bytes: int | None = None
    host_blocks: int | None = None
    engine: str = "local"
    timeout: float = DEFAULT_TIMEOUT
    cuda_method: str = "auto"
    pin: bool = True

    def __post_init__(self) -> None:
        if (self.host_bytes is None) == (self.host_blocks is None):
            raise KVCacheError("host_bytes/host_blocks: give exactly one of them (the host tier's size)")
        for name in ("host_bytes", "host_blocks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
                raise KVCacheError(f"{name}: must be a positive integer, got {value!r}")
        if self.engine != "local":
            raise KVCacheError(f"engine: the host tier copies within this process; expected 'local', got {self.engine!r}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise KVCacheError(f"timeout: must be positive seconds, got {self.timeout!r}")
        if self.cuda_method not in TIER_CUDA_METHODS:
            raise KVCacheError(f"cuda_method: unknown {self.cuda_method!r}; expected one of "
                               f"{', '.join(TIER_CUDA_METHODS)}")

    def num_blocks(self, spec: CacheSpec) -> int:
        """Host blocks this config buys for ``spec`` (one rank's blocks, every layer)."""
        if self.host_blocks is not None:
            return int(self.host_blocks)
        n = int(self.host_bytes) // spec.bytes_per_block  # type: ignore[operator]
        if n < 1:
            raise KVCacheError(f"host_bytes: {self.host_bytes:,} bytes hold no block of {spec.bytes_per_block:,} bytes")
        return n


class TierStats(NamedTuple):
    """Host-tier counters: blocks by state, and what moved since start (blocks are whole host blocks)."""

    num_blocks: int
    free_blocks: int
    cached_blocks: int  # findable copies (includes ones a load is reading)
    pending_offloads: int
    pending_loads: int
    offloaded_blocks: int  # copies that became findable
    loaded_blocks: int  # host blocks read back by loads that finished well
    dropped_blocks: int  # copies dropped: their GPU block was reused first, or the copy failed
    evicted_blocks: int  # findable copies pushed out by newer ones (LRU)
    failed_loads: int
    retired_blocks: int  # host blocks of timed-out copies, never reused (a late write may still land)
    hit_tokens: int  # tokens admitted as cached thanks to the tier


class Load:
    """Host-to-GPU copies a request (or a step) waits for, one transfer per layer per copy.

    ``wait(layer)`` before the forward pass writes or reads layer ``layer``;
    anything but DONE means the request's cached tokens are not valid: free it
    and admit it again (the tier has forgotten the bad blocks by then). A copy
    the tier's submit thread has not started yet is PENDING until it starts.
    """

    def __init__(self, copies: list[Copy]) -> None:
        self._copies = copies

    def status(self, layer: int | None = None) -> TransferStatus:
        """The worst status over the layer's transfers (every layer when None), without blocking."""
        return _worst(c.status(layer) for c in self._copies)

    def wait(self, layer: int | None = None, timeout: float | None = None) -> TransferStatus:
        """Block until the layer's blocks landed (or failed), ``timeout`` passes (PENDING), or their deadlines."""
        end = None if timeout is None else time.monotonic() + timeout
        for copy in self._copies:
            left = None if end is None else max(0.0, end - time.monotonic())
            if copy.wait(layer, left) is TransferStatus.PENDING:
                return TransferStatus.PENDING
        return self.status(layer)

    def __repr__(self) -> str:
        return f"Load({len(self._copies)} copies, {self.status().value})"


@dataclasses.dataclass(slots=True)
class _Offload:
    """One release's device-to-host copy: host ids for chain columns ``cols``, from GPU ``src`` [rows, m]."""

    copy: Copy
    host_ids: np.ndarray  # int32 [m]
    src: np.ndarray  # int32 [rows, m]: GPU blocks copied, -1 where a row is absent
    cols: np.ndarray  # intp [m]: positions in the released chain
    chain: bytes  # the released request's packed hashes (parents for events)
    tokens: np.ndarray  # the released chain's tokens
    lora: str | tuple[str, str] | None
    extra_keys: tuple[tuple | None, ...]  # per chain column, as events publish them
    dropped: np.ndarray  # bool [m]: the GPU block was reused before the copy finished


@dataclasses.dataclass(slots=True)
class _LoadJob:
    """One admit's host-to-device copy: ``host_ids`` pinned until every layer's transfer ends."""

    copy: Copy
    owner: object
    host_ids: np.ndarray  # unique int32
    dst: np.ndarray  # int32 [rows, k]: GPU blocks written, -1 where not
    nblocks: int


class HostBooks:
    """The books of a host tier under a manager's GPU blocks, shared by the tier in this process
    (``TransferManager``) and the daemon's (``kvcache.host_tier.DaemonTier``): host blocks in a ``BlockPool`` (one
    row; cached free blocks are the LRU), a ``PrefixIndex`` of the hash each row's copy holds, which copies are
    findable, and what moved. Whoever copies calls in; nothing here copies or waits."""

    def __init__(self, manager: KVCacheManager, num_blocks: int) -> None:
        self.manager = manager
        self.num_blocks = int(num_blocks)
        self._rows = manager.num_rows
        self._pool = BlockPool(1, self.num_blocks)
        self._index = PrefixIndex(self._rows, self.num_blocks)
        self._ready = np.zeros(self.num_blocks, dtype=bool)
        self._retired = 0  # host blocks of timed-out copies, never reused (a late write may still land)
        self._counts = dict(offloaded=0, loaded=0, dropped=0, evicted=0, failed=0, hit_tokens=0)
        # Requests that read a failed load's blocks, from the first column holding one: what they cache from there
        # was computed over wrong KV.
        self._tainted: dict[object, int] = {}
        self._waits: dict[object, set[int]] = {}  # a request -> the loads in flight its cached tokens need
        self._failed: list[object] = []
        self._last_held: tuple[bytes, np.ndarray] | None = None  # what ``held`` last found, for the admit's plan
        # The load filling each GPU (row, block), -1 where none: a hit on a block still being filled waits on it.
        self._filling = np.full((self._rows, manager.num_blocks), -1, dtype=np.int64)
        # The offload reading each GPU (row, block), -1 where none: a new owner's write spoils what it has not copied.
        self._reading = np.full((self._rows, manager.num_blocks), -1, dtype=np.int64)

    def take_failed(self) -> list[object]:
        """Requests whose load failed or timed out since the last call: free them and admit them again."""
        failed, self._failed = self._failed, []
        return failed

    @property
    def num_failed(self) -> int:
        """Requests ``take_failed`` would return now."""
        return len(self._failed)

    def _loads_filling(self, blocks: np.ndarray) -> set[int]:
        """The loads still filling GPU ``blocks`` [rows, k] (-1 = none): what a request reading them waits on."""
        r, c = np.nonzero(blocks >= 0)
        jobs = self._filling[r, blocks[r, c]]
        return set(np.unique(jobs[jobs >= 0]).tolist())

    @staticmethod
    def _mark(marks: np.ndarray, table: np.ndarray, job: int) -> None:
        """Give the GPU pairs of ``table`` [rows, k] (-1 = none) to copy ``job`` in ``marks`` (``_filling`` for a
        load's blocks, ``_reading`` for an offload's)."""
        if table.shape[0] == 1:
            row = table[0]
            marks[0, row[row >= 0]] = job
            return
        r, c = np.nonzero(table >= 0)
        marks[r, table[r, c]] = job

    @staticmethod
    def _unmark(marks: np.ndarray, table: np.ndarray, job: int) -> tuple[np.ndarray, np.ndarray]:
        """Copy ``job`` ended: the GPU (rows, blocks) of its ``table`` [rows, k] that ``marks`` still gives it,
        now given to none; a pair evicted meanwhile, or taken by a later copy, is not its any more."""
        r, c = np.nonzero(table >= 0)
        mine = marks[r, table[r, c]] == job
        rows, blocks = r[mine], table[r, c][mine]
        marks[rows, blocks] = -1
        return rows, blocks

    def _offloads_reading(self, rows: np.ndarray, blocks: np.ndarray) -> list[int]:
        """The offloads still reading any of the GPU (``rows``, ``blocks``) pairs."""
        jobs = self._reading[rows, blocks]
        return np.unique(jobs[jobs >= 0]).tolist()

    def _columns_taken(self, src: np.ndarray, rows: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """bool [k]: the columns of an offload's ``src`` [rows, k] that read one of the (``rows``, ``blocks``) pairs."""
        n = self.manager.num_blocks
        keys = rows.astype(np.int64) * n + blocks
        return (np.isin(np.arange(src.shape[0])[:, None] * n + src, keys) & (src >= 0)).any(axis=0)

    def _not_filling(self, blocks: np.ndarray) -> np.ndarray:
        """Released ``blocks`` [rows, n] less the columns a load is still filling (nothing certain to copy)."""
        r, c = np.nonzero(blocks >= 0)
        filling = self._filling[r, blocks[r, c]] >= 0
        if filling.any():
            blocks[:, np.unique(c[filling])] = -1
        return blocks

    def held(self, hashes: bytes) -> np.ndarray:
        """bool ``[k, rows]``: rows whose copy of each leading hash is findable; stops at the first with none."""
        blocks = self._index.match_ready(hashes, self._ready)
        # The admit that asked names the same hashes (a prefix of these) to ``admitted`` next, nothing changing in
        # between (LowerTier.held): its load plan reads the blocks found here instead of looking them up again.
        self._last_held = (hashes, blocks)
        return blocks >= 0

    def _blocks_of(self, hashes: bytes) -> np.ndarray:
        """int ``[n, rows]``: the host block each row's copy of each hash is in (-1 = none), as ``held`` saw it."""
        seen = getattr(self, "_last_held", None)
        self._last_held = None
        n = len(hashes) // _H
        if seen is not None and seen[1].shape[0] >= n and seen[0].startswith(hashes):
            return seen[1][:n]
        return self._index.blocks_of(hashes)

    def _load_plan(self, table: np.ndarray, num_gpu_blocks: int, hashes: bytes, job: int) -> tuple[np.ndarray, ...]:
        """The tier's part of a hit (the ``len(hashes) // 32`` columns after the GPU hit): host blocks ``src`` and
        GPU blocks ``dst`` [rows, k] (-1 = none), and the host blocks it reads, pinned until ``_load_ended``;
        ``dst`` is marked as being filled by load ``job``."""
        k = len(hashes) // _H
        found = self._blocks_of(hashes)
        if self._rows == 1:  # one C pass, pins included (distinct hashes are in distinct host blocks)
            out = np.empty((3, k), dtype=np.int32)
            m = _tier.load_plan(*self._pool._c_arrays(), table, num_gpu_blocks, found, self._filling, job, out)
            dst, src, host_ids = out[:1], out[1:2], out[2, :m]
        else:
            dst, src, host_ids = self._load_plan_rows(table[:, num_gpu_blocks:num_gpu_blocks + k], found, job)
            self._pool.hold_row(0, host_ids)
        self._counts["hit_tokens"] += k * self.manager.block_size
        return src, dst, host_ids

    def _load_plan_rows(self, columns: np.ndarray, found: np.ndarray, job: int) -> tuple[np.ndarray, ...]:
        """``_load_plan``'s GPU blocks ``dst``, host blocks ``src`` and distinct host blocks read, for the table's
        ``columns`` [rows, k] and the host blocks ``found`` [k, rows] of their hashes; marks ``dst`` for ``job``."""
        dst = np.array(columns, dtype=np.int32)
        wanted = dst >= 0
        src = np.where(wanted, found.T, -1).astype(np.int32, copy=False)
        assert (wanted == (src >= 0)).all(), "the tier lost a block between held() and admitted()"
        if src.shape[0] == 1:  # one row: distinct hashes are in distinct host blocks
            host_ids = src[0][wanted[0]]
        else:
            host_ids = np.unique(src[wanted]).astype(np.int32, copy=False)
        self._mark(self._filling, dst, job)
        return dst, src, host_ids

    def _offload_plan(self, hashes: bytes, blocks: np.ndarray) -> tuple[np.ndarray, ...] | None:
        """Host blocks for the released ``blocks`` [rows, n] (-1 = nothing to copy) whose hashes the host lacks,
        oldest first as far as free host blocks go (evicting the least recent findable ones): chain columns
        ``cols``, ``host_ids``, GPU ``src`` and host ``dst`` [rows, m]; indexed, not yet findable. None: nothing."""
        wanted = (blocks >= 0).any(axis=0) & ~(self._index.blocks_of(hashes) >= 0).any(axis=1)
        cols = np.flatnonzero(wanted)[: int(self._pool.num_free()[0])]
        if cols.size == 0:
            return None
        allocation = self._pool.allocate(cols.size, ascending=True)  # neighbours side by side: longer copies
        assert allocation is not None, "host allocation failed after the free-block check"
        if allocation.evicted_blocks.size:
            self._evict_host(allocation.evicted_blocks)
        host_ids = allocation.blocks[0].astype(np.int32)
        src = blocks[:, cols]
        dst = np.where(src >= 0, host_ids[None, :], -1).astype(np.int32)
        self._index.insert(np.frombuffer(hashes, dtype=f"V{_H}")[cols].tobytes(), dst.T)
        return cols, host_ids, src, dst

    def _offload_ended(self, host_ids: np.ndarray, keep: np.ndarray, *, retire: bool, chain: bytes,
                       tokens: np.ndarray, lora: Any, extra_keys: tuple, cols: np.ndarray, src: np.ndarray) -> None:
        """An offload ended: its ``keep`` blocks become findable (announced), the rest are forgotten; with
        ``retire`` (it timed out) its host blocks never serve again, else they return to the pool."""
        gone = host_ids[~keep]
        if gone.size:
            self._index.remove(np.repeat(np.arange(self._rows), gone.size), np.tile(gone, self._rows))
            self._counts["dropped"] += int(gone.size)
        kept = host_ids[keep]
        zeros = np.zeros(host_ids.size, dtype=np.intp)
        if kept.size:
            self._ready[kept] = True
            self._pool.mark_cached(zeros[: kept.size], kept)
            self._counts["offloaded"] += int(kept.size)
            self.manager.push_events(stored_events(self.manager, chain, tokens, lora, extra_keys, cols[keep],
                                                   src[:, keep]))
        if retire:
            self._retired += int(host_ids.size)
            return
        self._pool.decref(zeros, host_ids[::-1], unique=True)  # tail first: a prefix's head is evicted last

    def _load_ended(self, job: int, ok: bool, host_ids: np.ndarray, rows: np.ndarray, gpu: np.ndarray,
                    filled: np.ndarray) -> None:
        """Load ``job`` ended: its ``host_ids`` are no longer pinned by it and no request waits on it. Failed, the
        GPU (``rows``, ``gpu``) pairs it still stood for hold nothing their hashes promise, and the requests that
        waited on it (reading ``filled`` [rows, m]) fail, with what they computed over it."""
        self._pool.decref(np.zeros(host_ids.size, dtype=np.intp), host_ids, unique=True)
        if ok:
            self._counts["loaded"] += int(host_ids.size)
        else:
            self._counts["failed"] += 1
            self.manager.drop_cached(rows, gpu)
            for rid, jobs in self._waits.items():
                if job in jobs and rid not in self._failed:
                    self._failed.append(rid)
                    self._taint(rid, [filled])
        for rid in list(self._waits):
            jobs = self._waits[rid]
            jobs.discard(job)
            if not jobs:
                del self._waits[rid]

    def _taint(self, request_id: object, filled: list[np.ndarray]) -> None:
        """``request_id`` read GPU blocks a failed load was filling (``filled``, [rows, m] each): from the first
        column holding one, forget what it caches, now and when it is freed (``_untaint``)."""
        if request_id not in self.manager:
            return
        first = first_column(self.manager, request_id, filled)
        self._tainted[request_id] = min(first, self._tainted.get(request_id, first))
        drop_from(self.manager, request_id, first)

    def _untaint(self, request_id: object, blocks: np.ndarray, unsure: list[np.ndarray] = ()) -> np.ndarray:
        """At its free: the released ``blocks`` less the columns a failed load (or one not yet known good,
        ``unsure``) left wrong, whose hashes are forgotten."""
        first = self._tainted.pop(request_id, None)
        if unsure:
            later = first_column(self.manager, request_id, list(unsure))
            first = later if first is None else min(first, later)
        if first is not None:
            drop_from(self.manager, request_id, first)
            blocks[:, first:] = -1
        return blocks

    def _clear(self) -> None:
        """Forget every findable host copy (the prefix cache was reset, or the host memory is gone)."""
        self._index.clear()
        self._pool.reset_cached()
        self._ready[:] = False

    def _evict_host(self, host_ids: np.ndarray) -> None:
        """The host pool reused these findable blocks (LRU): drop their hashes, announce the ones that left."""
        rows = np.repeat(np.arange(self._rows), host_ids.size)
        removed = self._index.remove(rows, np.tile(host_ids, self._rows))
        self._ready[host_ids] = False
        self._counts["evicted"] += int(host_ids.size)
        self.manager.push_events(removed_events(self.manager, removed))


class TransferManager(HostBooks):
    """A host-memory tier under ``manager``'s GPU blocks in ``gpu``: offloads released blocks, loads host hits back.

    Attaches itself to the manager (``KVCacheManager.attach_tier``); the
    scheduler keeps calling the manager and calls ``poll`` once per step (it
    also runs inside ``admit`` and ``free``). The worker waits on
    ``load(request_id)`` (or ``pending_loads()``) layer by layer before the step.
    """

    def __init__(self, manager: KVCacheManager, gpu: KVRegion, config: HostTierConfig) -> None:
        if not isinstance(config, HostTierConfig):
            raise KVCacheError(f"config: expected a HostTierConfig, got {type(config).__name__}")
        if gpu.owner:
            raise KVCacheError(f"gpu: the region belongs to peer {gpu.owner!r}; the host tier needs this process's cache")
        if gpu.spec.block_size != manager.block_size:
            raise KVCacheError(f"gpu: block_size {gpu.spec.block_size} differs from the manager's {manager.block_size}")
        self._cells = _cell_rows(manager, gpu)
        if not manager.enable_prefix_caching:
            raise KVCacheError("manager: the host tier keys blocks by prefix hash; enable_prefix_caching is off")
        self.manager = manager
        self.config = config
        self.gpu = gpu
        self.num_blocks = config.num_blocks(gpu.spec)
        self._rows = manager.num_rows
        method = "auto" if config.cuda_method == "staged" else config.cuda_method
        self._out = LocalEngine(timeout=config.timeout, cuda_method=method)
        self._in = LocalEngine(timeout=config.timeout, cuda_method=method)  # loads never queue behind offloads
        try:
            self._staged = {id(e): staged_copier(e, gpu, config.cuda_method) for e in (self._out, self._in)}
            self.host = allocate_host(gpu.spec, self.num_blocks, pin=config.pin and gpu.is_cuda)
            if gpu.is_cuda and not self.host.pinned:
                self._out.register(self.host)
        except Exception:
            self._in.close()
            self._out.close()
            raise
        HostBooks.__init__(self, manager, self.num_blocks)
        self._offloads: dict[int, _Offload] = {}
        self._loads: dict[int, _LoadJob] = {}
        self._ids = itertools.count()
        # Works out and launches the copies the scheduler's calls decide, so those calls only record them.
        self._submitter = Submitter("kvcache-host-tier-submit")
        self._closed = False
        manager.attach_tier(self)

    # ------------------------------------------------------------------ scheduler side

    def lookup(self, prompt_tokens: Any, **keys: Any) -> tuple[int, int]:
        """(GPU-cached tokens, further host-cached tokens) ``admit`` would count now; ``keys`` as for admit."""
        return self.manager.lookup_tiers(prompt_tokens, **keys)

    def poll(self) -> None:
        """Settle copies that finished: offloads become findable, loads unpin their host blocks (never blocks)."""
        for job in list(self._offloads):
            self._settle_offload(job)
        for job in list(self._loads):
            self._settle_load(job)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for every copy in flight and settle it; True when none is left (False when ``timeout`` ran out)."""
        end = None if timeout is None else time.monotonic() + timeout
        while self._offloads or self._loads:
            for copy in [o.copy for o in self._offloads.values()] + [j.copy for j in self._loads.values()]:
                left = None if end is None else max(0.0, end - time.monotonic())
                copy.wait(None, left)
            self.poll()
            if end is not None and time.monotonic() >= end:
                break
        return not (self._offloads or self._loads)

    def load(self, request_id: object) -> Load | None:
        """The loads ``request_id`` must wait for before it runs (its own, and ones its GPU hit shares), or None."""
        jobs = self._waits.get(request_id)
        if not jobs:
            return None
        return Load([self._loads[j].copy for j in sorted(jobs) if j in self._loads])

    def pending_loads(self) -> Load:
        """Every load in flight: what a worker running the next batch waits on, layer by layer."""
        return Load([job.copy for job in self._loads.values()])

    def host_blocks_of(self, hashes: bytes) -> np.ndarray:
        """Host block (int32 ``[n, rows]``, -1 = not findable) of each packed hash: where its bytes are."""
        blocks = self._index.blocks_of(hashes)
        return np.where((blocks >= 0) & self._ready[np.maximum(blocks, 0)], blocks, -1).astype(np.int32)

    def resolved_cuda_method(self) -> str:
        """How this tier's copies touch the GPU (``staged``, else ``kernel``, ``batch`` or ``loop``; see LocalEngine)."""
        return "staged" if self._staged[id(self._out)] is not None else self._out.resolved_cuda_method()

    def stats(self) -> TierStats:
        c = self._counts
        return TierStats(
            self.num_blocks, int(self._pool.num_free()[0]), int(self._ready.sum()), len(self._offloads),
            len(self._loads), c["offloaded"], c["loaded"], c["dropped"], c["evicted"], c["failed"], self._retired,
            c["hit_tokens"],
        )

    def check_integrity(self) -> None:
        """Raise AssertionError with the numbers if host pool, host index, readiness and copies in flight disagree."""
        self._pool.check_integrity()
        self._index.check_integrity()
        n = self.num_blocks
        ids = np.arange(n)
        ref = self._pool.refcount(np.zeros(1, dtype=np.intp), ids)
        cached = self._pool.is_cached(np.zeros(1, dtype=np.intp), ids)
        pending = np.zeros(n, dtype=np.int64)
        for off in self._offloads.values():
            np.add.at(pending, off.host_ids, 1)
        pins = np.zeros(n, dtype=np.int64)
        for job in self._loads.values():
            np.add.at(pins, job.host_ids, 1)
        assert pending.max(initial=0) <= 1, f"host block {int(pending.argmax())} is the target of two copies in flight"
        assert not (pending & self._ready).any(), "a host block is findable while its copy is in flight"
        retired = ref - pending - pins
        assert (retired >= 0).all() and (retired <= 1).all(), \
            f"host block {int(np.argmax((retired < 0) | (retired > 1)))}: refcount {ref} disagrees with copies"
        assert int(retired.sum()) == self._retired, f"{int(retired.sum())} unexplained references, {self._retired} retired"
        assert np.array_equal(cached, self._ready), \
            f"{int((cached != self._ready).sum())} host blocks cached in the pool but not findable, or the reverse"
        rows, blocks = self._index.held_pairs()
        held = np.zeros(n, dtype=bool)
        held[blocks] = True
        assert not (self._ready & ~held).any(), "a findable host block holds no hash"
        assert not (held & ~(self._ready | pending.astype(bool))).any(), "an indexed host block is neither findable nor in flight"
        if blocks.size:
            hashes, _ = self._index.hashes_at(rows, blocks)
            order = np.argsort(blocks, kind="stable")
            b, h = blocks[order], hashes[order]
            same = b[1:] == b[:-1]
            assert (h[1:][same] == h[:-1][same]).all(), "a host block holds two hashes (two places at once)"
        free, used = int(self._pool.num_free()[0]), int(np.count_nonzero(ref))
        assert free + used == n, f"free {free} + used {used} != {n} host blocks"

    def close(self) -> None:
        """Wait (bounded) for copies in flight, detach from the manager, stop the engines. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self.drain(timeout=self.config.timeout):
                log.warning("host tier closing with %d offloads and %d loads unfinished",
                            len(self._offloads), len(self._loads))
        finally:
            if self.manager.tier is self:
                self.manager.attach_tier(None)
            self._submitter.close(timeout=self.config.timeout)
            for staged in self._staged.values():
                if staged is not None:
                    staged.close()
            self._in.close()
            self._out.close()

    def __enter__(self) -> TransferManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ LowerTier (called by the manager)

    def admitted(self, request_id: object, table: np.ndarray, num_gpu_blocks: int, hashes: bytes) -> None:
        """Start the loads of the tier's part of a hit; note loads in flight that the GPU part shares."""
        deps = self._loads_filling(table[:, :num_gpu_blocks]) if self._loads and num_gpu_blocks else set()
        k = len(hashes) // _H
        launch = None
        if k:
            job = next(self._ids)
            src, dst, host_ids = self._load_plan(table, num_gpu_blocks, hashes, job)
            copy, launch = self._copy(self._in, self.host, src, self.gpu, dst)
            self._loads[job] = _LoadJob(copy, request_id, host_ids, dst, k)
            deps.add(job)
        if deps:
            self._waits[request_id] = deps
        if launch is not None:  # last: the submit thread wakes and wants the interpreter
            self._submitter.put(copy, launch)

    def released(self, request_id: object, hashes: bytes, blocks: np.ndarray, tokens: np.ndarray,
                 lora: str | tuple[str, str] | None, extra_keys: tuple[tuple | None, ...]) -> None:
        """Offload the released blocks the host lacks, oldest first as far as free host blocks go."""
        self._finish_own_loads(request_id)
        self._waits.pop(request_id, None)
        blocks = self._untaint(request_id, np.array(blocks, dtype=np.int32))
        n = len(hashes) // _H
        if n == 0:
            return
        plan = self._offload_plan(hashes, self._not_filling(blocks))
        if plan is None:
            return
        cols, host_ids, src, dst = plan
        job = next(self._ids)
        copy, launch = self._copy(self._out, self.gpu, src, self.host, dst)
        self._offloads[job] = _Offload(copy, host_ids, src, cols, hashes, tokens, lora, extra_keys,
                                       np.zeros(cols.size, dtype=bool))
        self._mark(self._reading, src, job)
        self._submitter.put(copy, launch)  # last: the submit thread wakes and wants the interpreter

    def _copy(self, engine: LocalEngine, src: KVRegion, src_ids: np.ndarray, dst: KVRegion,
              dst_ids: np.ndarray) -> tuple[Copy, Callable[[float], list[TransferHandle]]]:
        """A copy of every layer (``copy_layers``) with the engine's deadline, and how the submit thread starts it."""
        cells, staged = self._cells, self._staged[id(engine)]
        return Copy(src.num_layers, time.monotonic() + engine.timeout), lambda left: copy_layers(
            engine, src, src_ids, dst, dst_ids, cells, timeout=left, staged=staged)

    def evicting(self, rows: np.ndarray, blocks: np.ndarray) -> None:
        """GPU pairs get a new owner: keep finished copies of them, drop unfinished ones, finish loads into them."""
        if not (self._offloads or self._loads):
            return
        rows = np.asarray(rows, dtype=np.intp)
        blocks = np.asarray(blocks, dtype=np.intp)
        for job in np.unique(self._filling[rows, blocks]).tolist():
            if job >= 0:
                self._settle_load(job, wait=True)
        for job in self._offloads_reading(rows, blocks):
            if not self._settle_offload(job):
                off = self._offloads[job]
                off.dropped |= self._columns_taken(off.src, rows, blocks)

    def reset(self) -> None:
        """Forget every host copy (the prefix cache was reset); copies in flight are dropped when they end."""
        for off in self._offloads.values():
            off.dropped[:] = True
        self._clear()

    # ------------------------------------------------------------------ internals

    def _settle_offload(self, job: int) -> bool:
        """If every layer of the offload ended: make its kept blocks findable, free the rest; True when settled."""
        off = self._offloads[job]
        if not off.copy.ended():
            return False
        del self._offloads[job]
        self._unmark(self._reading, off.src, job)
        worst = off.copy.status()
        keep = ~off.dropped if worst is TransferStatus.DONE else np.zeros(off.cols.size, dtype=bool)
        if worst is not TransferStatus.DONE:
            log.warning("host tier: offload of %d blocks %s: %s", off.cols.size, worst.value, off.copy.error)
        # A copy past its deadline may still be writing: its blocks never serve again.
        self._offload_ended(off.host_ids, keep, retire=worst is TransferStatus.TIMEOUT, chain=off.chain,
                            tokens=off.tokens, lora=off.lora, extra_keys=off.extra_keys, cols=off.cols, src=off.src)
        return True

    def _settle_load(self, job: int, *, wait: bool = False) -> bool:
        """If every layer of the load ended (waiting up to its deadline with ``wait``): unpin, or forget its blocks."""
        load = self._loads[job]
        if wait:
            load.copy.wait()
        if not load.copy.ended():
            return False
        del self._loads[job]
        rows, dsts = self._unmark(self._filling, load.dst, job)
        worst = load.copy.status()
        if worst is not TransferStatus.DONE:
            log.warning("host tier: load of %d blocks for %r %s: %s", load.nblocks, load.owner, worst.value,
                        load.copy.error)
        self._load_ended(job, worst is TransferStatus.DONE, load.host_ids, rows, dsts, load.dst)
        return True

    def _finish_own_loads(self, request_id: object) -> None:
        """A request freed before its loads ended (aborted): wait for them, so its blocks are not reused mid-copy."""
        for job in [j for j, load in self._loads.items() if load.owner == request_id]:
            self._settle_load(job, wait=True)


def allocate_host(spec: CacheSpec, num_blocks: int, *, pin: bool) -> KVRegion:
    """Host blocks, layer-major then tensor then block: pinned by PyTorch when asked and present, else page-aligned mmap."""
    nbytes = spec.cache_bytes(num_blocks)
    buffer: Any = None
    addr, pinned = 0, False
    torch = sys.modules.get("torch")
    if pin and torch is not None and torch.cuda.is_available():
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        addr, pinned = buffer.data_ptr(), True
    else:
        buffer = mmap.mmap(-1, max(nbytes, 1))
        addr = np.frombuffer(buffer, dtype=np.uint8).ctypes.data
    return KVRegion.from_buffer(spec, num_blocks, addr, pinned=pinned, keep=(buffer,))


_HOST_FILE_MAGIC = b"KVCHOST1"
_HOST_FILE_HEADER = struct.Struct("<8sQQQQ")  # magic, buffer id, bytes per block, blocks, layers
HOST_FILE_DATA_OFFSET = 4096
"""Bytes before the blocks in a host file: its header, padded to a page."""


def map_host_file(path: str | os.PathLike, spec: CacheSpec, num_blocks: int) -> tuple[KVRegion, int]:
    """Host blocks in a shared file (``/dev/shm/...``), and the id of the buffer it holds.

    A file already holding blocks of this geometry is mapped as it is and keeps its id, so the
    blocks survive the process that wrote them; any other file (missing, another geometry, not
    one of these) is sized and given a new random id (its blocks hold nothing yet). Not pinned:
    an engine registers it for CUDA copies. The file stays when the process ends; delete it to
    drop the blocks.

    Only this user's processes may share it (a restarted worker maps the file its previous run
    made): a missing file is created 0600, and an existing one is refused unless it is a regular
    file of this user that no other user may read or write; a symbolic link is never followed.
    """
    nbytes = spec.cache_bytes(num_blocks)
    size = HOST_FILE_DATA_OFFSET + nbytes
    fields = (spec.bytes_per_block, num_blocks, spec.num_layers)
    name = os.fspath(path)
    fd = _open_host_file(name)
    step = "read"
    try:
        header = os.pread(fd, _HOST_FILE_HEADER.size, 0)
        known = len(header) == _HOST_FILE_HEADER.size and os.fstat(fd).st_size == size
        magic, buffer_id, *geometry = _HOST_FILE_HEADER.unpack(header) if known else (b"", 0)
        if not (known and magic == _HOST_FILE_MAGIC and tuple(geometry) == fields and buffer_id):
            buffer_id = int.from_bytes(os.urandom(7), "big") or 1
            step = "size"
            os.ftruncate(fd, 0)
            os.ftruncate(fd, size)
            os.pwrite(fd, _HOST_FILE_HEADER.pack(_HOST_FILE_MAGIC, buffer_id, *fields), 0)
        # Reserve every page now: a full /dev/shm then fails here, by name, not later as a SIGBUS mid-copy.
        step = "reserve the space of"
        os.posix_fallocate(fd, 0, size)
        step = "map"
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise KVCacheError(f"host_file: cannot {step} {name!r} ({size:,} bytes): {exc.strerror}") from None
    finally:
        os.close(fd)
    addr = np.frombuffer(mapping, dtype=np.uint8).ctypes.data + HOST_FILE_DATA_OFFSET
    return KVRegion.from_buffer(spec, num_blocks, addr, keep=(mapping,)), buffer_id


def _open_host_file(name: str) -> int:
    """An fd of ``name`` read-write: created 0600 if missing, else only this user's file, private and not a link."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a FIFO put there never blocks us
    try:
        try:
            return os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            fd = os.open(name, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise KVCacheError(f"host_file: {name!r} is a symbolic link, which is never followed (another user could "
                               f"point it at a file of ours); give the path of a file of your own") from None
        raise KVCacheError(f"host_file: cannot open {name!r}: {exc.strerror}") from None
    info = os.fstat(fd)
    mode = stat.S_IMODE(info.st_mode)
    if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not mode & 0o077:
        return fd
    os.close(fd)
    try:
        owner = f"{pwd.getpwuid(info.st_uid).pw_name} (uid {info.st_uid})"
    except KeyError:
        owner = f"uid {info.st_uid}"
    kind = "" if stat.S_ISREG(info.st_mode) else "not a regular file, "
    raise KVCacheError(f"host_file: refusing {name!r} ({kind}owned by {owner}, mode {mode:04o}): another user could "
                       f"read the offloaded KV or write into its blocks; a host file must be a regular file of uid "
                       f"{os.geteuid()} with mode 0600: remove it (a new one is created 0600) or choose another path")


def copy_layers(engine: LocalEngine, src: KVRegion, src_ids: np.ndarray, dst: KVRegion, dst_ids: np.ndarray,
                cells: np.ndarray, *, timeout: float | None = None,
                staged: StagedCopier | None = None) -> list[TransferHandle]:
    """Copy blocks ``src_ids`` of ``src`` to ``dst_ids`` of ``dst`` (int32 ``[rows, m]``, -1 = none; layer l's
    kv head h reads row ``cells[l, h]``): one transfer per layer, in layer order on one engine (so layer l's is
    done when layer l+1's is), each within ``timeout`` seconds (the engine's when None).

    Layers go to the engine in groups growing fourfold (layers 0 | 1-3 | 4-15 | 16-63 ...), each
    group's ranges worked out in C (``copy_ranges_per_layer``): the first layer's copy starts once
    its own ranges are known, and each later group is planned while the groups before it copy. With
    ``staged`` (a copier over the engine's runtime, which then takes every copy between the GPU
    and host memory, to keep them in one order), a copy whose host side comes in long runs is
    staged (``StagedCopier.suits``, judged on the first layer); others go through the copy kernel
    directly.
    """
    bounds = [0]
    while bounds[-1] < src.num_layers:
        bounds.append(min(src.num_layers, 4 * bounds[-1] or 1))
    groups = copy_ranges_per_layer(src, src_ids, dst, dst_ids, bounds, cell_rows=cells)
    cuda = src if src.is_cuda else dst
    device = cuda.device if cuda.is_cuda else "cpu"
    if src.is_cuda == dst.is_cuda:
        staged = None
    direct = False
    handles: list[TransferHandle] = []
    for first, (ranges, cuts) in zip(bounds, groups):
        if staged is not None:
            direct = direct if first else not staged.suits(ranges, to_host=src.is_cuda)
            handles += staged.submit_parts(ranges, cuts, to_host=src.is_cuda, direct=direct, timeout=timeout)
        else:
            handles += engine.submit_parts(ranges, cuts, device=device, timeout=timeout)
    return handles


def staged_copier(engine: LocalEngine, gpu: KVRegion, cuda_method: str) -> StagedCopier | None:
    """The staged copier for ``engine``'s copies with the GPU cache ``gpu`` when ``cuda_method`` asks for it (``auto``:
    where CuPy is present), else None (the engine's own method)."""
    if not gpu.is_cuda or cuda_method not in ("auto", "staged"):
        return None
    if not StagedCopier.available():
        if cuda_method == "staged":
            raise KVCacheError("cuda_method: staged copies need CuPy (pip install cupy-cuda12x)")
        return None
    return StagedCopier(engine, gpu.device_index)


def first_column(manager: KVCacheManager, request_id: object, filled: list[np.ndarray]) -> int:
    """The first column of the request's table holding a GPU block of one of ``filled`` ([rows, m] each, -1 =
    none): where what a failed load left wrong starts (0 when none does: everything is suspect)."""
    table = manager.table(request_id)
    n = manager.num_blocks
    rows = np.arange(table.shape[0])[:, None]
    pairs = np.concatenate([(rows * n + f)[f >= 0] for f in filled])
    hit = np.isin(rows * n + table, pairs) & (table >= 0)
    cols = np.flatnonzero(hit.any(axis=0))
    return int(cols[0]) if cols.size else 0


def drop_from(manager: KVCacheManager, request_id: object, first: int) -> None:
    """Forget the hashes of the request's blocks from column ``first`` on: their KV was computed over blocks a
    failed load left wrong (the blocks stay the request's)."""
    table = manager.table(request_id)[:, first:]
    r, c = np.nonzero(table >= 0)
    if r.size:
        manager.drop_cached(r, table[r, c])


def group_leaders(manager: KVCacheManager) -> list[int]:
    """Each row group's first row (a group's rows hold the same blocks: its first row speaks for it)."""
    groups = manager.row_groups
    return [int(np.argmax(groups == g)) for g in range(int(groups.max()) + 1)]


def removed_events(manager: KVCacheManager, removed: Any) -> list[BlockRemoved]:
    """``BlockRemoved(medium="CPU")`` per row group for the hashes a host index removed (``PrefixIndex.remove``)."""
    return [BlockRemoved(tuple(bytes(h) for h in removed.hashes[removed.rows == row]), group=g, medium="CPU")
            for g, row in enumerate(group_leaders(manager)) if (removed.rows == row).any()]


def stored_events(manager: KVCacheManager, chain: bytes, tokens: np.ndarray, lora: Any,
                  extra_keys: tuple[tuple | None, ...], cols: np.ndarray, src: np.ndarray) -> list[BlockStored]:
    """Per row group, one ``BlockStored(medium="CPU")`` per run of consecutive chain columns ``cols`` (ascending)
    that the group's rows held (``src`` ``[rows, len(cols)]`` >= 0) and the host now holds findable."""
    bs = manager.block_size
    if cols.size == 0:
        return []
    windows = manager.group_windows
    events = []
    for g, row in enumerate(group_leaders(manager)):
        held = src[row] >= 0
        breaks = np.flatnonzero((np.diff(cols) != 1) | (held[1:] != held[:-1])) + 1
        for start, end in zip([0, *breaks.tolist()], [*breaks.tolist(), cols.size]):
            if not held[start]:
                continue
            first, last = int(cols[start]), int(cols[end - 1]) + 1
            events.append(BlockStored(
                block_hashes=tuple(chain[j * _H:(j + 1) * _H] for j in range(first, last)),
                parent_block_hash=chain[(first - 1) * _H: first * _H] if first else None,
                token_ids=tokens[first * bs: last * bs].copy(),
                block_size=bs,
                group=g,
                window=windows[g],
                lora=lora,
                extra_keys=extra_keys[first:last],
                medium="CPU",
            ))
    return events


def _cell_rows(manager: KVCacheManager, gpu: KVRegion) -> np.ndarray:
    """Which of the manager's rows each (layer, kv head) of ``gpu`` reads (``table_cells``: one row, the region's
    ``spec.rows`` where it holds every kv head, or one per head), checked against each layer's block count."""
    spec = gpu.spec
    layout = spec.rows if spec.kv_heads_per_rank == spec.num_kv_heads else None
    try:
        cells = table_cells(layout, manager.num_rows, gpu.num_layers, gpu.heads)
    except KVCacheError as exc:
        raise KVCacheError(f"gpu: the manager's {exc}") from None
    if layout is not None and len(layout) == manager.num_rows and [r.policy for r in layout] != list(manager.rows):
        raise KVCacheError("gpu: the region's rows (spec.rows) have other policies than the manager's rows")
    need = manager.row_blocks[cells].max(axis=1)
    short = np.flatnonzero(gpu.layer_blocks < need)
    if short.size:
        layer = int(short[0])
        raise KVCacheError(f"gpu: layer {layer} holds {int(gpu.layer_blocks[layer])} blocks, but its rows hand out "
                           f"{int(need[layer])}")
    return cells

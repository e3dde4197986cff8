"""The daemon's host-memory tier: which host blocks hold which prefix blocks, and the copies it orders workers to make.

The daemon decides and the workers copy. Attached to the daemon's manager as its
lower tier (``allocator/tiers.py``), ``DaemonTier`` is told inside the
scheduler's ops which GPU blocks a free releases and which an admit must fill
from host; it picks host blocks, and each decision becomes an order in the
op's table delta::

    {"job": 7, "kind": "offload", "src": GPU blocks [rows, m], "dst": host blocks [rows, m]}   (-1 = none)
    {"job": 8, "kind": "load",    "src": host blocks [rows, m], "dst": GPU blocks [rows, m]}

Each TP rank's ``TierAgent`` (``kvcache.tier_agent``) copies its kv heads' part
of the named blocks between its GPU cache and its host buffer and reports with
a ``tier_done`` op. An offloaded block becomes findable once every rank has
reported it; a rank reporting failure, or none within the deadline
(``tier_expire``, the daemon's own op, journaled like any op), drops the job's host blocks; a failed
load also drops the GPU blocks it was filling from the prefix cache and names
its requests in ``tier_failed``, so the scheduler frees and admits them again.
A report counts only from the agent attached as its rank now (the server checks
the key it attached with, ``agent_of``). A timed-out copy's blocks stay out of
use while a late copy may still write them: until every rank that had not
reported it reports it late or is attached anew (its worker restarted); then
they come back (host blocks to the free pool, GPU blocks a decode daemon held
to the GPU pool).

Workers keep the order the daemon relies on: a step at ``seq`` runs layer L only
after every copy ordered in the deltas up to ``seq`` has finished layer L
(``TierAgent.wait``), and one rank's copies run in order. So a GPU block
freed and handed to a new owner is read by its offload, or filled by its load,
before the new owner writes it: the daemon never waits for a copy.

No I/O here: the state (host pool, index, jobs) is the daemon's, journaled with
its manager, and every change comes from an op.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.manager import KVCacheManager
from kvcache.allocator.prefix import HASH_BYTES
from kvcache.transfer.manager import HostBooks

_H = HASH_BYTES
#: The daemon's host-tier ops: an agent attaching (tier_attach) and reporting a copy (tier_done), the daemon's own
#: expiry of late copies (tier_expire), and a scheduler taking the requests failed loads left invalid (tier_failed).
TIER_OPS = frozenset({"tier_attach", "tier_done", "tier_expire", "tier_failed"})


@dataclasses.dataclass
class TierJob:
    """One ordered copy: the ranks that reported it done, and what the daemon does when it ends."""

    kind: str  # "offload" or "load"
    host_ids: np.ndarray  # int32 [m] host blocks it writes (offload) or reads (load)
    gpu: np.ndarray  # int32 [rows, m] GPU blocks it reads (offload) or fills (load), -1 = none
    done: list[int]  # ranks that reported it done
    # An offload's chain, for the CPU events once it lands; ``dropped`` after a reset (it is never findable).
    cols: np.ndarray | None = None
    chain: bytes = b""
    tokens: np.ndarray | None = None
    lora: Any = None
    extra_keys: tuple = ()
    dropped: bool = False
    owner: Any = None  # a load's request
    lost: np.ndarray | None = None  # bool [m]: an offload's source block written by an unordered writer meanwhile
    held: bool = False  # a load the manager holds the GPU blocks of (its request ended first, or it failed)


class TierStats(NamedTuple):
    """The daemon's host tier: blocks by state, copies in flight, what moved since start (whole host blocks)."""

    num_blocks: int
    free_blocks: int
    cached_blocks: int  # findable copies (including ones a load is reading)
    pending_offloads: int
    pending_loads: int
    offloaded_blocks: int
    loaded_blocks: int
    dropped_blocks: int  # copies that failed, timed out or were reset before they landed
    evicted_blocks: int  # findable copies pushed out by newer ones (LRU)
    failed_loads: int
    retired_blocks: int  # host blocks of copies that timed out: a late write may still land, so never reused
    hit_tokens: int  # tokens admitted as cached thanks to the tier
    ranks: int  # ranks whose agents are attached
    held_gpu_blocks: int = 0  # GPU blocks kept out of the pool: a decode daemon's loads a rank may still run


class DaemonTier(HostBooks):
    """A host tier of ``num_blocks`` blocks per rank under ``manager``, copied by ``tp`` ranks' agents.

    Until every rank's agent is attached the tier holds nothing and orders
    nothing. A new agent on a rank is taken for a restarted worker: every copy
    in flight fails (the old agent will not report them) and the GPU blocks'
    prefixes are forgotten (the worker's cache is new); if it also brings a
    new host buffer, every host block is forgotten too. An agent whose buffer
    lives in a shared file (``TierAgent(host_file=...)``) brings the same
    buffer back, and the host blocks that were ready stay findable.
    """

    #: The daemon journals this tier with its manager (an in-process tier is memory, not state).
    journaled = True

    def __init__(self, manager: KVCacheManager, num_blocks: int, tp: int, *, unordered_writes: bool = False) -> None:
        """``unordered_writes``: a GPU block's new owner may be written without the workers' order (a PD decode
        daemon: the prefill node writes reserved blocks over NIXL), so an offload still reading an evicted block
        keeps nothing of it, and the blocks of a load whose request ends first stay out of the pool until the load
        ends (a late load would overwrite what the new owner was sent)."""
        if not manager.enable_prefix_caching:
            raise KVCacheError("host tier: it keys blocks by prefix hash; enable prefix caching")
        if num_blocks < 1:
            raise KVCacheError(f"host_blocks: must be at least 1, got {num_blocks}")
        super().__init__(manager, num_blocks)
        self.tp = int(tp)
        self.unordered_writes = unordered_writes
        self._jobs: dict[int, TierJob] = {}
        self._next_job = 0
        self._orders: list[dict[str, Any]] = []
        self._agents: dict[int, int] = {}  # rank -> its agent's id
        self._owners: dict[int, int] = {}  # rank -> the key it was claimed with (the server checks a new attach's)
        self._buffers: dict[int, int] = {}  # rank -> the id of its agent's host buffer
        # Failed loads whose GPU blocks stay held (unordered writes) until every rank is done with them:
        # job -> (rows, blocks, ranks done).
        self._lingering: dict[int, tuple[np.ndarray, np.ndarray, list[int]]] = {}
        # Timed-out copies whose blocks a late copy may still write: job -> (host blocks retired, GPU rows and blocks
        # held, ranks that may still write them). They come back once no rank may (``_settle_retired``).
        self._retiring: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        """A journal snapshot's state: everything but the manager, which holds this tier (``bind`` restores it)."""
        state = self.__dict__.copy()
        state["manager"] = None
        state["_last_held"] = None  # a lookup's leftover, not state
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A journal snapshot's state; one saved before agents named their buffers had each agent's buffer its own."""
        self.__dict__.update(state)
        self.__dict__.setdefault("_buffers", dict(self._agents))
        self.__dict__.setdefault("unordered_writes", False)
        self.__dict__.setdefault("_lingering", {})
        self.__dict__.setdefault("_owners", {})  # before: any client attached any rank
        self.__dict__.setdefault("_retiring", {})  # before: a timed-out copy's blocks stayed retired for good
        if "_reading" not in state:  # a snapshot from before the tier kept which offload reads each GPU block
            self._reading = np.full_like(self._filling, -1)
            for job_id, job in self._jobs.items():
                if job.kind == "offload":
                    self._mark(self._reading, job.gpu, job_id)

    def bind(self, manager: KVCacheManager) -> None:
        """After a journal restore: the manager this tier is attached to again."""
        if manager.tier is not self:
            raise KVCacheError("host tier: bound to a manager it is not attached to")
        self.manager = manager

    # ------------------------------------------------------------------ agents and reports

    def agent_of(self, rank: int) -> int | None:
        """The id (key) of the agent attached as ``rank`` now, or None: the only one whose reports count."""
        return self._agents.get(rank)

    def owner_of(self, rank: int) -> int | None:
        """The key rank ``rank`` was first attached with (None: none yet): only it attaches the rank again."""
        return self._owners.get(rank)

    @property
    def active(self) -> bool:
        """Whether every rank's agent is attached (else the tier holds and orders nothing)."""
        return len(self._agents) == self.tp

    def attach(self, rank: int, agent: int, buffer: int | None = None, *, key: int | None = None) -> None:
        """Rank ``rank``'s agent ``agent`` is ready with host buffer ``buffer`` (default: one of its own).

        Another agent than before on that rank (a restarted worker) fails every copy in flight and makes
        the manager forget its GPU blocks' prefixes; another buffer than before also makes the tier forget
        every host block (their bytes are gone)."""
        if not 0 <= rank < self.tp:
            raise KVCacheError(f"rank: must be in [0, {self.tp}), got {rank}")
        buffer = agent if buffer is None else buffer
        if key is not None:
            self._owners[rank] = key
        known = self._agents.get(rank)
        if known == agent:
            return
        if known is not None:
            keep = self._buffers.get(rank) == buffer
            for job_id in list(self._jobs):  # the old agent will not run them: done with them, as far as it goes
                self._end(job_id, ok=False, timed_out=False, done=[*self._jobs[job_id].done, rank])
            for job_id in list(self._lingering):
                self._linger(job_id, rank)
            for job_id in list(self._retiring):  # the old agent is gone: it writes none of them late
                self._settle_retired(job_id, rank)
            self.manager.reset_prefix_cache(keep_lower_tier=keep)
        self._agents[rank] = agent
        self._buffers[rank] = buffer

    def report(self, job_id: int, rank: int, ok: bool, error: str = "") -> None:
        """Rank ``rank`` finished its part of ``job_id`` (``ok``), or failed it; a job no longer known is ignored.

        A timed-out job's late report says that rank writes its blocks no more."""
        if job_id in self._retiring:
            self._settle_retired(job_id, rank)
            return
        if job_id in self._lingering:
            self._linger(job_id, rank)
            return
        job = self._jobs.get(job_id)
        if job is None:
            return
        if not ok:
            self._end(job_id, ok=False, timed_out=False, done=[*job.done, rank])
            return
        if rank not in job.done:
            job.done.append(rank)
        if len(job.done) == self.tp:
            self._end(job_id, ok=True, timed_out=False)

    def expire(self, job_ids: list[int]) -> None:
        """These jobs passed their deadline: their host blocks are retired, and GPU blocks held for them stay held,
        until every rank that had not reported them reports late or attaches anew (a late copy may still write)."""
        none = np.zeros(0, dtype=np.int32)
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is not None:
                self._end(job_id, ok=False, timed_out=True)
                host = job.host_ids if job.kind == "offload" else none
                r, c = np.nonzero(job.gpu >= 0) if job.kind == "load" and job.held else (none, none)
                if host.size or r.size:
                    self._retiring[job_id] = (host, r, job.gpu[r, c],
                                              [rank for rank in range(self.tp) if rank not in job.done])
            lingering = self._lingering.pop(job_id, None)
            if lingering is not None:
                rows, blocks, done = lingering
                self._retiring[job_id] = (none, rows, blocks, [rank for rank in range(self.tp) if rank not in done])

    def pending_jobs(self) -> list[int]:
        """Copies with a deadline: those in flight, and failed loads whose blocks wait for every rank."""
        return [*self._jobs, *self._lingering]

    def take_orders(self) -> list[dict[str, Any]]:
        """The copies ordered since the last call, for the delta that goes out with them."""
        orders, self._orders = self._orders, []
        return orders

    def stats(self) -> TierStats:
        c = self._counts
        offloads = sum(job.kind == "offload" for job in self._jobs.values())
        return TierStats(self.num_blocks, int(self._pool.num_free()[0]), int(self._ready.sum()), offloads,
                         len(self._jobs) - offloads, c["offloaded"], c["loaded"], c["dropped"], c["evicted"],
                         c["failed"], self._retired, c["hit_tokens"], len(self._agents), self.manager.held_blocks)

    def check_integrity(self) -> None:
        """Raise AssertionError if host pool, index, readiness and jobs disagree."""
        self._pool.check_integrity()
        self._index.check_integrity()
        n = self.num_blocks
        ref = self._pool.refcount(np.zeros(1, dtype=np.intp), np.arange(n))
        held = np.zeros(n, dtype=np.int64)
        for job in self._jobs.values():
            np.add.at(held, job.host_ids, 1)
        retired = ref - held
        assert (retired >= 0).all() and int(retired.sum()) == self._retired, \
            f"host refcounts {int(ref.sum())} disagree with {int(held.sum())} in jobs and {self._retired} retired"
        cached = self._pool.is_cached(np.zeros(1, dtype=np.intp), np.arange(n))
        assert np.array_equal(cached, self._ready), "host blocks cached in the pool but not findable, or the reverse"
        # A load's GPU pairs are marked by it, by nothing (evicted), or by a later load: a request that ends before
        # its load is reported frees the blocks uncached, and workers run the next load into them after this one.
        for job_id, job in self._jobs.items():
            if job.kind == "load":
                r, c = np.nonzero(job.gpu >= 0)
                marks = self._filling[r, job.gpu[r, c]]
                assert ((marks == job_id) | (marks == -1) | (marks > job_id)).all(), f"load {job_id}: marked earlier"
        rows, blocks = np.nonzero(self._filling >= 0)
        for row, block, job_id in zip(rows.tolist(), blocks.tolist(), self._filling[rows, blocks].tolist()):
            job = self._jobs.get(job_id)
            assert job is not None and job.kind == "load" and block in job.gpu[row], \
                f"GPU pair ({row}, {block}) marked by load {job_id}, which does not fill it"
        rows, blocks = np.nonzero(self._reading >= 0)
        for row, block, job_id in zip(rows.tolist(), blocks.tolist(), self._reading[rows, blocks].tolist()):
            job = self._jobs.get(job_id)
            assert job is not None and job.kind == "offload" and block in job.gpu[row], \
                f"GPU pair ({row}, {block}) marked by offload {job_id}, which does not read it"

    # ------------------------------------------------------------------ LowerTier (called by the manager)

    def poll(self) -> None:
        """Nothing to settle here: copies end by ops (``report``, ``expire``)."""

    def admitted(self, request_id: object, table: np.ndarray, num_gpu_blocks: int, hashes: bytes) -> None:
        """Order the load of the tier's part of a hit; note loads in flight that the GPU part of it shares."""
        deps = self._loads_filling(table[:, :num_gpu_blocks]) if num_gpu_blocks and self._jobs else set()
        if len(hashes) // _H:
            src, dst, host_ids = self._load_plan(table, num_gpu_blocks, hashes, self._next_job)
            job_id = self._order("load", src, dst, TierJob("load", host_ids, dst, [], owner=request_id))
            deps.add(job_id)
        if deps:
            self._waits[request_id] = deps

    def released(self, request_id: object, hashes: bytes, blocks: np.ndarray, tokens: np.ndarray,
                 lora: str | tuple[str, str] | None, extra_keys: tuple[tuple | None, ...]) -> None:
        """Order the offload of released blocks the host lacks, oldest first as far as free host blocks go."""
        # Loads it read and no rank has failed yet, but not every rank reported: what it computed over them is not
        # known good, so it is not kept.
        waited = [self._jobs[j] for j in self._waits.pop(request_id, ()) if j in self._jobs]
        if self.unordered_writes:  # its own loads among them: a rank may still write their blocks
            for job in waited:
                if job.owner == request_id and not job.held:
                    self._hold(job)
        unreported = [job.gpu for job in waited]
        blocks = self._untaint(request_id, np.array(blocks, dtype=np.int32), unreported)
        n = len(hashes) // _H
        if n == 0 or not self.active:
            return
        plan = self._offload_plan(hashes, self._not_filling(blocks))
        if plan is None:
            return
        cols, host_ids, src, dst = plan
        job_id = self._order("offload", src, dst, TierJob("offload", host_ids, src, [], cols.astype(np.intp),
                                                          bytes(hashes), np.array(tokens), lora, tuple(extra_keys)))
        self._mark(self._reading, src, job_id)

    def evicting(self, rows: np.ndarray, blocks: np.ndarray) -> None:
        """GPU pairs get a new owner. Workers finish earlier copies before the owner writes (the module's
        contract), so nothing waits; a load still filling them no longer stands for their hashes. With
        unordered writers (PD decode) an offload still reading them keeps nothing of those blocks."""
        if not self._jobs:
            return
        rows, blocks = np.asarray(rows, dtype=np.intp), np.asarray(blocks, dtype=np.intp)
        self._filling[rows, blocks] = -1
        if self.unordered_writes:
            for job_id in self._offloads_reading(rows, blocks):
                job = self._jobs[job_id]
                hit = self._columns_taken(job.gpu, rows, blocks)
                job.lost = hit if job.lost is None else job.lost | hit

    def reset(self) -> None:
        """``reset_prefix_cache``: forget every host copy; offloads in flight are dropped when they end."""
        for job in self._jobs.values():
            job.dropped = job.dropped or job.kind == "offload"
        self._clear()

    # ------------------------------------------------------------------ internals

    def _order(self, kind: str, src: np.ndarray, dst: np.ndarray, job: TierJob) -> int:
        job_id = self._next_job
        self._next_job += 1
        self._jobs[job_id] = job
        self._orders.append({"job": job_id, "kind": kind, "src": src, "dst": dst})
        return job_id

    def _hold(self, job: TierJob) -> None:
        """Keep a load's GPU blocks out of the pool (``KVCacheManager.hold``) until the load is done with them."""
        r, c = np.nonzero(job.gpu >= 0)
        self.manager.hold(r, job.gpu[r, c])
        job.held = True

    def _settle_retired(self, job_id: int, rank: int) -> None:
        """Rank ``rank`` writes timed-out ``job_id``'s blocks no more: once no rank may, they come back."""
        host, rows, blocks, waiting = self._retiring[job_id]
        if rank in waiting:
            waiting.remove(rank)
        if waiting:
            return
        del self._retiring[job_id]
        if host.size:
            self._retired -= int(host.size)
            self._pool.decref(np.zeros(host.size, dtype=np.intp), host[::-1], unique=True)
        if rows.size:
            self.manager.let_go(rows, blocks)

    def _linger(self, job_id: int, rank: int) -> None:
        """Rank ``rank`` is done with failed load ``job_id``: once every rank is, its held GPU blocks go back."""
        rows, blocks, done = self._lingering[job_id]
        if rank not in done:
            done.append(rank)
        if len(done) == self.tp:
            del self._lingering[job_id]
            self.manager.let_go(rows, blocks)

    def _end(self, job_id: int, *, ok: bool, timed_out: bool, done: list[int] | None = None) -> None:
        """Settle a copy: it landed on every rank (``ok``), failed (``done``: the ranks done with it), or timed out."""
        job = self._jobs.pop(job_id)
        if job.kind == "offload":
            self._unmark(self._reading, job.gpu, job_id)
            keep = np.full(job.host_ids.size, ok and not job.dropped)
            if job.lost is not None:
                keep &= ~job.lost
            # Timed out: a late copy may still write its host blocks, so they never serve again.
            self._offload_ended(job.host_ids, keep, retire=timed_out, chain=job.chain, tokens=job.tokens,
                                lora=job.lora, extra_keys=job.extra_keys, cols=job.cols, src=job.gpu)
            return
        r, c = np.nonzero(job.gpu >= 0)
        rows, gpu = self._unmark(self._filling, job.gpu, job_id)
        self._load_ended(job_id, ok, job.host_ids, rows, gpu, job.gpu)
        if self.unordered_writes and not ok and not job.held:  # its request still owns the blocks: keep them
            self._hold(job)  # out of the pool while a rank may still run the copy
        if not job.held or timed_out:  # timed out: a late copy may still write them, so they stay held
            return
        if ok:
            self.manager.let_go(r, job.gpu[r, c])
            return
        self._lingering[job_id] = (r, job.gpu[r, c], [])
        for rank in sorted(set(job.done if done is None else done)):
            self._linger(job_id, rank)

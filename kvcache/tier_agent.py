"""TierAgent: a TP rank's part of the daemon's host tier (``kvcache serve --host-memory``).

The daemon decides what moves between the GPU blocks and host memory
(``kvcache.host_tier``); each rank's agent does the copying for its own kv
heads. It keeps a host buffer of the daemon's ``num_blocks`` host blocks (pinned
when the cache is on a GPU), takes the copies the daemon orders from the table
deltas its ``TableSubscriber`` applies, runs them layer by layer on its own
engine (one queue: copies end in the order they were ordered), and reports each
to the daemon from a thread of its own::

    sub = TableSubscriber(endpoint, rank=r, tp_size=tp)
    agent = TierAgent(sub, KVRegion.from_tensors(spec, caches))
    sub.wait_for(cache.last_seq, epoch=cache.last_epoch)  # the step's tables and the copies ordered with them
    for layer in range(num_layers):
        agent.wait(layer)         # every copy ordered so far has this layer done (before it is read or written)
        ...attention...

Waiting per layer before a step writes or reads it is the contract the daemon
relies on: a block freed and handed to a new owner is copied out (or filled)
before the new owner's step writes it. A copy that fails is reported; the daemon
then drops its host blocks, or fails the requests a load was filling
(``CacheClient.tier_failed``).
"""
from __future__ import annotations

import logging
import os
import queue
import secrets
import threading
import time
from typing import Any

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.rows import table_cells
from kvcache.auth import CurveConfig
from kvcache.client import CacheClient
from kvcache.rank_keys import rank_key
from kvcache.transfer.copies import Copy, Submitter
from kvcache.transfer.engines import DEFAULT_TIMEOUT, LocalEngine, TransferStatus
from kvcache.transfer.manager import Load, allocate_host, copy_layers, map_host_file, staged_copier
from kvcache.transfer.regions import KVRegion

log = logging.getLogger("kvcache.tier_agent")

__all__ = ["TierAgent"]


class TierAgent:
    """Rank ``subscriber.rank``'s copies for the daemon's host tier, between ``region`` and a host buffer of its own.

    ``region`` is this rank's cache (its kv heads, every layer), as for
    ``TransferManager``. The agent hooks ``subscriber`` (``on_delta``): call
    ``subscriber.wait_for``/``poll`` as usual and the copies ordered in those
    deltas start: the agent records them, and a submit thread of its own works
    out their ranges and launches them in order. ``timeout`` bounds each copy
    (default 30 s). ``cuda_method``: as ``HostTierConfig.cuda_method``
    (``auto`` stages copies through 68 MiB of GPU slots where CuPy is present).

    ``host_file`` (e.g. ``/dev/shm/kvcache-host-rank0``) keeps the host blocks in
    a shared file instead of this process's memory: a worker restarted with the
    same file brings them back, and the daemon keeps serving the blocks that
    were ready (copies in flight when the old worker stopped fail). The file
    outlives the process; delete it to drop the blocks. Only this user's
    processes share it: it is created 0600, and a file of another user, one
    that others may read or write, or a symbolic link is refused.

    The first agent of a rank claims it with the rank's key (``kvcache.rank_keys.rank_key``: ``key_file``, else
    one derived from ``curve``'s certificate, else a 0600 file beside an ipc:// daemon's socket): an agent
    restarted by the same user attaches the rank again, another client cannot (``admin``, the daemon's admin key,
    takes it over). ``curve``: the CURVE keys for a tcp:// daemon that requires them.
    """

    def __init__(self, subscriber: Any, region: KVRegion, *, timeout: float = DEFAULT_TIMEOUT,
                 cuda_method: str = "auto", pin: bool = True, host_file: str | os.PathLike | None = None,
                 curve: CurveConfig | None = None, key_file: str | os.PathLike | None = None,
                 admin: int | None = None) -> None:
        if region.owner:
            raise KVCacheError(f"region: belongs to peer {region.owner!r}; the agent copies this process's cache")
        if subscriber.on_delta is not None:
            raise KVCacheError("subscriber: another agent already takes its deltas")
        self.subscriber, self.region, self.rank = subscriber, region, subscriber.rank
        # Retried (the daemon answers a retry from its kept reply): a report outlives a daemon's restart.
        key = rank_key(subscriber.endpoint, self.rank, curve=curve, key_file=key_file)
        self._client = CacheClient(subscriber.endpoint, timeout=max(5.0, subscriber.timeout), retries=3,
                                   name=f"tier-agent-{self.rank}-{os.getpid()}", curve=curve)
        try:
            tier = self._client.info().get("host_tier")
            if not tier:
                raise KVCacheError("the daemon has no host tier (start kvcache serve with --host-memory)")
            self.num_blocks = int(tier["num_blocks"])
            cells = subscriber.cell_rows
            if cells is None:  # one row for every head, or one per kv head: as the host tier reads them
                cells = table_cells(None, len(subscriber.row_ids), region.num_layers, region.heads)
            if cells.shape != (region.num_layers, region.heads):
                raise KVCacheError(f"region: {region.num_layers} layers of {region.heads} kv heads, but this rank's "
                                   f"rows hold {cells.shape[0]} layers of {cells.shape[1]}")
            self.cells = cells
            self._rows = np.asarray(subscriber.row_ids, dtype=np.intp)
            # Its key: the daemon counts a report only from the agent that attached with it (no other client sees it).
            self.agent_id = secrets.randbits(63)
            if host_file is None:
                self.host = allocate_host(region.spec, self.num_blocks, pin=pin and region.is_cuda)
                buffer = None  # the agent's own: gone with it
            else:
                self.host, buffer = map_host_file(host_file, region.spec, self.num_blocks)
            self._engine = LocalEngine(timeout=timeout, cuda_method="auto" if cuda_method == "staged" else cuda_method)
            # Every copy of this rank goes through one engine, or one staged copier over it: one order for all.
            self._staged = staged_copier(self._engine, region, cuda_method)
            if region.is_cuda and not self.host.pinned:
                self._engine.register(self.host)
            self._client.tier_attach(self.rank, self.agent_id, buffer, key=key, admin=admin)
        except BaseException:
            if hasattr(self, "_engine"):
                self._engine.close()
            self._client.close()
            raise
        # Orders in deltas up to the attach were for an earlier agent (the daemon fails any still in flight): not ours.
        self._from_seq = self._client.last_seq
        self._inflight: list[Copy] = []  # this thread's view: what wait() waits on
        self._reports: queue.Queue[tuple[int, Copy] | None] = queue.Queue()
        # Works out and launches the ordered copies, so the subscriber's thread only records them.
        self._submitter = Submitter(f"kvcache-tier-submit-{self.rank}")
        self.copied = 0  # jobs reported done
        self.failed = 0
        self._closed = False
        self._reporter = threading.Thread(target=self._report_loop, name=f"kvcache-tier-agent-{self.rank}",
                                          daemon=True)
        self._reporter.start()
        subscriber.on_delta = self._on_delta

    # ------------------------------------------------------------------ the model runner's side

    def wait(self, layer: int, timeout: float | None = None) -> TransferStatus:
        """Block until every copy ordered so far has finished ``layer`` (DONE, or its worst other status), or
        ``timeout`` passes (PENDING). Call it before a step reads or writes the layer."""
        status = Load(self._inflight).wait(layer, timeout)
        last = self.region.num_layers - 1  # one in-order engine: a copy whose last layer ended has ended
        self._inflight = [c for c in self._inflight if c.status(last) is TransferStatus.PENDING]
        return status

    def resolved_cuda_method(self) -> str:
        """How this agent's copies touch the GPU (``staged``, else the engine's method; see LocalEngine)."""
        return "staged" if self._staged is not None else self._engine.resolved_cuda_method()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every copy ordered so far has ended and been reported; False when ``timeout`` passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        for layer in range(self.region.num_layers):
            left = None if end is None else max(0.0, end - time.monotonic())
            if self.wait(layer, left) is TransferStatus.PENDING:
                return False
        done = self._reports.all_tasks_done  # notified as the reporter finishes its last report
        with done:
            while self._reports.unfinished_tasks:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                done.wait(left)
        return True

    def close(self) -> None:
        """Stop taking orders, let the copies in flight end (bounded by their deadlines), stop the reporter."""
        if self._closed:
            return
        self._closed = True
        if self.subscriber.on_delta == self._on_delta:
            self.subscriber.on_delta = None
        self._reports.put(None)
        self._reporter.join(timeout=self._engine.timeout + 10)
        self._submitter.close(timeout=self._engine.timeout)
        if self._staged is not None:
            self._staged.close()
        self._engine.close()
        self._client.close()

    def __enter__(self) -> TierAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _on_delta(self, msg: dict[str, Any]) -> None:
        """The subscriber applied a delta: record the copies it orders (this rank's rows of each) for the submit
        thread, which starts them in order; one that does not fit this rank's memory fails and is reported."""
        orders = msg.get("tier")
        if not orders or msg["seq"] <= self._from_seq or self._closed:
            return
        engine, cells, staged = self._engine, self.cells, self._staged
        for order in orders:
            job, kind = int(order["job"]), order["kind"]
            src = np.asarray(order["src"], dtype=np.int32)[self._rows]
            dst = np.asarray(order["dst"], dtype=np.int32)[self._rows]
            regions = {"offload": (self.region, self.host), "load": (self.host, self.region)}.get(kind)
            copy = Copy(self.region.num_layers, time.monotonic() + engine.timeout)
            if regions is None:
                self._submitter.put(copy, _unknown(kind))
            else:
                a, b = regions
                self._submitter.put(copy, lambda left, a=a, b=b, s=src, d=dst: copy_layers(
                    engine, a, s, b, d, cells, timeout=left, staged=staged))
            self._inflight.append(copy)
            self._reports.put((job, copy))

    def _report_loop(self) -> None:
        """Report each copy once every layer of it ended, in order (the engine ends them in order too)."""
        while True:
            item = self._reports.get()
            try:
                if item is None:
                    return
                job, copy = item
                status = copy.wait()  # bounded: the copy and its transfers have the engine's deadline
                ok = status is TransferStatus.DONE
                error = copy.error
                try:
                    self._client.tier_done(job, self.rank, self.agent_id, ok=ok, error=error)
                except KVCacheError as exc:  # the daemon will time the copy out
                    log.warning("host-tier copy %d: report failed: %s", job, exc)
                if not ok:
                    self.failed += 1
                    log.warning("host-tier copy %d failed on rank %d: %s", job, self.rank, error)
                else:
                    self.copied += 1
            finally:
                self._reports.task_done()


def _unknown(kind: str) -> Any:
    """A copy start that refuses an order of an unknown kind."""
    def launch(left: float) -> list:
        raise KVCacheError(f"unknown copy kind {kind!r}")
    return launch

"""Worker-side PD wiring: a prefill rank's CacheMessager and a decode rank's CacheReceiver, tied to their daemons.

    prefill worker rank p                          decode worker rank d
    link = PrefillLink(prefill_endpoint, region,   link = DecodeLink(decode_endpoint, region, d)
                       signal, p)                  (attaches its receiver to the decode daemon)
    step = signal.begin_step()
    link.run_step(step, reqs)
    ... write each layer, send_cache(stream, signal, layer)

A model runner whose Python holds the GIL while it launches kernels delays the link's threads: run the
messager in a process of its own with ``kvcache.pd.process.MessagerProcess`` (same arguments).

The prefill link claims its rank on its daemon before its first call there (``attach`` with no
endpoint), fetches plans there (``plans``), reports ``sent`` there, and on failure reports
``transfer_failed`` to both daemons (the decode one named in the plan). The decode link attaches its
receiver and reports ``received``; it attaches again when its daemon comes back without its journal
(a new epoch). A daemon counts a rank's reports only from the worker that attached it, by the key it
attached with:
``kvcache.rank_keys.rank_key`` gives each link its rank's key (``key_file``, else one derived from the
CURVE certificate, else a 0600 file beside an ipc:// daemon's socket), so a worker restarted by the
same user claims its rank again. ``admin`` (the daemon's admin key) takes a rank whoever owns it.
Each thread that talks to a daemon has its own CacheClient (they are not thread-safe); every call
has the client's deadline.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvcache.auth import CurveConfig
from kvcache.client import CacheClient, DaemonError
from kvcache.allocator.errors import KVCacheError
from kvcache.pd.messager import CacheMessager, CacheReceiver, TransferPlan
from kvcache.rank_keys import rank_key
from kvcache.transfer.nixl import NixlEngine
from kvcache.transfer.regions import KVRegion
from kvcache.transfer.signal import LayerSignal

log = logging.getLogger("kvcache.pd.links")


class _Clients:
    """One CacheClient per (thread, endpoint), closed together."""

    def __init__(self, timeout: float, curve: CurveConfig | None) -> None:
        self.timeout, self.curve = timeout, curve
        self._local = threading.local()
        self._all: list[CacheClient] = []
        self._lock = threading.Lock()

    def get(self, endpoint: str) -> CacheClient:
        clients = self._local.__dict__.setdefault("clients", {})
        client = clients.get(endpoint)
        if client is None:
            # Local: a report reaches a daemon on this host without ZMQ's I/O threads (the tail's last leg).
            client = clients[endpoint] = CacheClient(endpoint, timeout=self.timeout, curve=self.curve, local=True)
            with self._lock:
                self._all.append(client)
        return client

    def close(self) -> None:
        with self._lock:
            for client in self._all:
                client.close()
            self._all.clear()


class PrefillLink:
    """A prefill rank's messager, fed by and reporting to the prefill daemon at ``endpoint``.

    Without an ``engine`` it makes its own NIXL engine, whose UCX ``progress`` is driven as NixlEngine says.
    """

    def __init__(self, endpoint: str, region: KVRegion, signal: LayerSignal, rank: int, *,
                 engine: NixlEngine | None = None, timeout: float = 5.0, curve: CurveConfig | None = None,
                 progress: str = "thread", key_file: str | os.PathLike | None = None,
                 admin: int | None = None) -> None:
        self.endpoint = endpoint
        # The rank is claimed before the first plans or report (``_claimed``): the daemon need not be up yet.
        self.key: int | None = None
        self._epoch: int | None = None  # the daemon incarnation that holds the claim
        self._claim_args = (curve, key_file, admin)
        self._claim_lock = threading.Lock()
        self._clients = _Clients(timeout, curve)
        self._own_engine = engine is None
        self.engine = engine or NixlEngine(f"prefill-r{rank}-{id(self):x}", progress=progress)
        try:
            self.messager = CacheMessager(self.engine, region, signal, rank, fetch_plans=self._plans,
                                          on_sent=self._sent, on_failed=self._failed)
        except BaseException:
            if self._own_engine:
                self.engine.close()
            raise
        self.rank = rank
        self.failures: list[tuple[Any, str]] = []  # what this rank saw fail (also reported to both daemons)

    def run_step(self, step: int, reqs: Sequence[Any], plans: Mapping[Any, dict[str, Any]] | None = None) -> None:
        """Send step ``step``'s layers of ``reqs``; ``plans`` maps requests to the plan their prefill admit returned
        (``Sending.plan``, handed to the worker with the step), else the messager fetches it from the daemon."""
        given = {req: TransferPlan.from_wire(plan) for req, plan in (plans or {}).items()}
        self.messager.run_step(step, reqs, given)

    def close(self) -> None:
        self.messager.close()
        if self._own_engine:
            self.engine.close()
        self._clients.close()

    def __enter__(self) -> PrefillLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _claimed(self) -> CacheClient:
        """This thread's client of the prefill daemon, once this rank is claimed there with its key (again, when
        the client has seen another daemon incarnation than the claim's: one restarted without its journal)."""
        client = self._clients.get(self.endpoint)
        with self._claim_lock:
            if self.key is None or client.last_epoch not in (None, self._epoch):
                curve, key_file, admin = self._claim_args
                key = self.key if self.key is not None else rank_key(self.endpoint, self.rank, curve=curve,
                                                                     key_file=key_file)
                client.attach(self.rank, key=key, admin=admin)
                self.key, self._epoch = key, client.last_epoch
        return client

    def _plans(self, reqs: list[Any]) -> list[TransferPlan | None]:
        raw = self._claimed().plans(reqs)
        return [None if p is None else TransferPlan.from_wire(p) for p in raw]

    def _sent(self, req: Any) -> None:
        for attempt in range(2):
            client = self._claimed()
            try:
                client.sent(req, self.rank, key=self.key)
                return
            except DaemonError as exc:  # e.g. cancelled meanwhile and already released
                epoch = self._epoch
                try:  # a refusal carries no epoch: a restarted daemon may have forgotten the claim
                    client.ping()
                except KVCacheError:
                    pass
                if attempt or client.last_epoch == epoch:
                    log.info("prefill daemon refused sent(%r): %s", req, exc)
                    return

    def _failed(self, req: Any, error: str, plan: TransferPlan | None) -> None:
        self.failures.append((req, error))
        message = f"prefill rank {self.rank}: {error}"
        targets = [self.endpoint] + ([plan.decode] if plan is not None and plan.decode else [])
        for endpoint in targets:
            try:
                self._clients.get(endpoint).transfer_failed(req, message)
            except KVCacheError as exc:  # the daemon is gone or already released it: its deadline covers it
                log.info("could not report the failure of %r to %s: %s", req, endpoint, exc)


class DecodeLink:
    """A decode rank's receiver, attached to and reporting to the decode daemon at ``endpoint``.

    Without an ``engine`` it makes its own NIXL engine, whose UCX ``progress`` is driven as NixlEngine says.
    A daemon restarted without its journal has forgotten every receiver (and refuses ``reserve`` until each
    rank attaches again): a watcher thread pings the daemon every ``watch`` seconds (0: no watcher) and
    attaches this receiver again, with its key, once it answers with another epoch, logging both the loss and
    the new attach. ``wait_attached`` waits, with a deadline, until the daemon answering now has this receiver.
    """

    def __init__(self, endpoint: str, region: KVRegion, rank: int, *, engine: NixlEngine | None = None,
                 listen: str = "tcp://127.0.0.1:*", timeout: float = 5.0, curve: CurveConfig | None = None,
                 progress: str = "thread", key_file: str | os.PathLike | None = None,
                 admin: int | None = None, watch: float = 1.0) -> None:
        if not watch >= 0:
            raise KVCacheError(f"watch: must be >= 0 seconds (0: no watcher), got {watch!r}")
        self.endpoint = endpoint
        self.rank = rank
        self.key = rank_key(endpoint, rank, curve=curve, key_file=key_file)
        self._admin, self._timeout, self._curve, self._watch = admin, timeout, curve, watch
        self._clients = _Clients(timeout, curve)
        self._own_engine = engine is None
        self._stop = threading.Event()
        self._attached = threading.Condition()
        self._epoch: int | None = None  # the daemon incarnation holding this receiver
        self._why = "not attached yet"  # why the link is not known to be attached now ("": it is)
        self._watcher: threading.Thread | None = None
        self.engine = engine or NixlEngine(f"decode-r{rank}-{id(self):x}", progress=progress)
        try:
            self.receiver = CacheReceiver(self.engine, region, rank, on_received=self._received,
                                          on_stopped=self._stopped, endpoint=listen)
            with CacheClient(endpoint, timeout=timeout, curve=curve) as client:
                self._attach(client)
            if watch:
                self._watcher = threading.Thread(target=self._watch_loop, name=f"kvcache-decode-r{rank}-watch",
                                                 daemon=True)
                self._watcher.start()
        except BaseException:
            self.close()
            raise

    @property
    def attached(self) -> bool:
        """Whether the daemon answered the link's last call as the incarnation holding its receiver."""
        with self._attached:
            return not self._why

    def wait_attached(self, timeout: float) -> None:
        """Return once the daemon holds this receiver; KVCacheError after ``timeout`` seconds, saying why."""
        deadline = time.monotonic() + timeout
        with self._attached:
            while self._why:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    raise KVCacheError(f"decode rank {self.rank}: not attached to the decode daemon at "
                                       f"{self.endpoint} within {timeout:g} s ({self._why})")
                self._attached.wait(min(left, 0.1))

    def close(self) -> None:
        self._stop.set()
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:
            watcher.join(self._timeout + 1.0)  # at most one call in flight, which has the client's deadline
        receiver = getattr(self, "receiver", None)
        if receiver is not None:
            receiver.close()
        if self._own_engine:
            self.engine.close()
        self._clients.close()

    def __enter__(self) -> DecodeLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _attach(self, client: CacheClient) -> None:
        client.attach(self.rank, self.receiver.endpoint, key=self.key, admin=self._admin)
        with self._attached:
            self._epoch, self._why = client.last_epoch, ""
            self._attached.notify_all()

    def _unsure(self, why: str) -> None:
        with self._attached:
            self._why = why

    def _answered(self, epoch: int | None) -> bool:
        """The daemon answered as ``epoch``: True if that incarnation holds this receiver."""
        with self._attached:
            if epoch != self._epoch:
                return False
            self._why = ""
            self._attached.notify_all()
            return True

    def _watch_loop(self) -> None:
        """Ping the daemon; attach again when it answers as another incarnation (a restart without its journal)."""
        client = CacheClient(self.endpoint, timeout=self._timeout, curve=self._curve)
        silent = False  # logged that the daemon stopped answering
        refused: int | None = None  # the incarnation that refused the attach (logged once)
        try:
            while not self._stop.wait(self._watch):
                try:
                    client.ping()
                except DaemonError as exc:  # not expected of a ping: say so and go on watching
                    log.warning("decode rank %d: ping of the decode daemon at %s refused: %s", self.rank,
                                self.endpoint, exc)
                    continue
                except KVCacheError as exc:  # no answer within the client's deadline: keep trying
                    self._unsure(f"the daemon does not answer: {exc}")
                    if not silent:
                        log.warning("decode rank %d: the decode daemon at %s does not answer (%s); attaching "
                                    "again when it is back", self.rank, self.endpoint, exc)
                        silent = True
                    continue
                silent = False
                if self._answered(client.last_epoch):
                    continue
                epoch = self._epoch
                self._unsure(f"the daemon restarted without its state (epoch {client.last_epoch:#x}) and has not "
                             "taken this receiver again")
                try:
                    self._attach(client)
                except KVCacheError as exc:  # refused (another key took the rank) or gone again: retried next turn
                    if refused != client.last_epoch:
                        refused = client.last_epoch
                        log.error("decode rank %d: the decode daemon at %s restarted without its state and refused "
                                  "this receiver's attach (retrying every %g s): %s", self.rank, self.endpoint,
                                  self._watch, exc)
                    continue
                log.warning("decode rank %d: the decode daemon at %s restarted without its state (epoch %#x, "
                            "was %#x); attached receiver %s again", self.rank, self.endpoint, client.last_epoch,
                            epoch, self.receiver.endpoint)
        finally:
            client.close()

    def _received(self, reqs: list[Any]) -> None:
        """Tell the decode daemon, in one message, that these requests landed on this rank."""
        client = self._clients.get(self.endpoint)
        batch = client.batch()
        for req in reqs:
            batch.op("received", req=req, rank=self.rank, key=self.key)
        try:
            results = batch.send()
        except DaemonError:  # one no longer in transfer refuses the message: report them one by one
            results = []
            for req in reqs:
                try:
                    results.append(client.received(req, self.rank, key=self.key))
                except DaemonError as exc:
                    results.append(exc)
        for req, result in zip(reqs, results):
            if isinstance(result, DaemonError):  # cancelled or failed meanwhile
                log.info("decode daemon refused received(%r): %s", req, result)

    def _stopped(self, reqs: list[Any]) -> None:
        """These requests' writers to this rank all ended, some giving up, and none can write here any more (the
        receiver cut off those with a write on its way): fail each on the decode daemon, and report this rank's
        writers done, which releases a request the daemon holds past its deadline (``PDState.fail``)."""
        client = self._clients.get(self.endpoint)
        for req in reqs:
            batch = client.batch()
            batch.op("transfer_failed", req=req, error=f"decode rank {self.rank}: the prefill side gave the "
                                                      "transfer up")
            batch.op("received", req=req, rank=self.rank, key=self.key)
            try:
                batch.send()
            except DaemonError as exc:  # released meanwhile (its deadline, or a report from the prefill side)
                log.info("decode daemon refused the end of %r: %s", req, exc)

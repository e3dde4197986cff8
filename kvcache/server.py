"""The cache daemon: one thread owns a KVCacheManager and serves schedulers and workers over ZMQ.

``CacheServer`` puts four parts together, each a module of its own:

    kvcache.daemon_state   the state machine: validate a message (who may send each op, its fields), apply it
                           to the manager, batch slots, leases, PD transfers and host tier; no sockets or files
    kvcache.deltas         the table deltas it stages, encoded once durable and kept for replay
    kvcache.durability     the journal: recovery at start, one commit per turn, snapshots
    kvcache.endpoints      the sockets: messages in, replies and deltas out, replay (see protocol.py)

and runs the loop that drives them (``serve``), with the expiries of leases,
transfers and host-tier copies, applied as messages of the daemon's own.
Everything here and in those parts belongs to the thread that calls
``serve``; other threads only read (Prometheus HTTP) or belong to libzmq.

Every ipc socket is owner-only and locked against a second daemon on its path; with CURVE every other
socket admits only the allowed clients, re-read on ``reload_clients`` (see kvcache.listeners).

A step's reply goes out first, then its deltas, in the same turn of the loop (both only once the
journal made them durable): a scheduler that has the reply (with its ``seq``) knows the deltas follow
at once, and its round trip does not wait for their encoding. Workers wait for that ``seq``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable, Sequence

import zmq

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.manager import KVCacheManager
from kvcache.allocator.rows import Row
from kvcache.auth import HANDSHAKE_FAILURES, CurveConfig, start_authenticator
from kvcache.config import ServeConfig
from kvcache.daemon_state import DaemonState
from kvcache.durability import Durability
from kvcache.endpoints import Endpoints
from kvcache.host_tier import DaemonTier
from kvcache.keys import RELOAD_STATUS, write_reload_status
from kvcache.listeners import Listeners
from kvcache.protocol import PROTOCOL_VERSION, pack, unpack
from kvcache.rank_keys import admin_key, key_file_of

__all__ = ["CacheServer"]

log = logging.getLogger("kvcache.server")
_LEASE_CLIENT = "kvcache-lease-expiry"
_PD_CLIENT = "kvcache-transfer-expiry"
_TIER_CLIENT = "kvcache-tier-expiry"


class CacheServer:
    """The daemon: its state machine, deltas, journal and endpoints put together; ``serve`` runs the loop in the
    calling thread, which owns them all."""

    def __init__(self, config: ServeConfig, manager: KVCacheManager, *, layout: Sequence[Row] | None = None,
                 context: zmq.Context | None = None, extra_info: dict[str, Any] | None = None) -> None:
        """``layout`` names the (layer, kv head) cells of each of the manager's rows, for workers to find the
        rows of their rank and layers (``kvcache.serve.build_manager`` gives it from a model's config)."""
        self.config = config.resolved()
        self.state = DaemonState(self.config, manager, layout=layout, extra_info=extra_info)
        self.durability = Durability(self.state)
        self.endpoints: Endpoints | None = None
        self._ctx = context or zmq.Context.instance()
        self._next_lease_check = 0.0
        self._next_pd_check = 0.0
        self._next_tier_check = 0.0
        self._auth: Any = None
        self._reload_requested = False
        curve = None
        if self.config.curve_server_cert:
            if not self.config.curve_clients_dir:
                raise KVCacheError("curve_clients_dir: needed with curve_server_cert (the allowed clients' keys)")
            curve = CurveConfig.for_server(self.config.curve_server_cert, self.config.curve_clients_dir)
            self._auth = start_authenticator(self._ctx, curve.clients_dir)
            self._reloads = 0
            self._report_reload(None)
        self._listeners = Listeners(curve)
        try:  # a socket that cannot bind (or a journal that cannot load) leaves nothing open behind
            self.endpoints = Endpoints(self.config, self._ctx, self._listeners, self.state, self._answer)
            # The daemon's admin key (kvcache.rank_keys): a claim holding it takes a rank whoever owns it.
            self.state.admin_key = admin_key(self.config.endpoint, self.config.curve_server_cert or None,
                                             create=True)
            self.state.subscriber_counts = self.endpoints.subscriber_counts
            self._setup_optional()
            if self.config.journal:
                self.durability.open()
            if self.state.metrics is not None:  # served once they show this daemon's state, not a fresh one's zeros
                self.state.observe(force=True)
                self.state._next_observe = 0.0  # the state at start is no message: the first one is counted at once
                if self.config.metrics_port:
                    self.state.metrics.serve_http(self.config.metrics_port)
        except BaseException:
            self.close()
            raise
        self.endpoints.set_epoch(self.state.deltas.epoch)

    # ------------------------------------------------------------------ lifecycle

    def _setup_optional(self) -> None:
        """Metrics, subscriber counting and KV events, when their modules and settings allow."""
        try:
            from kvcache.metrics import DaemonMetrics, SubscriberCounter
        except ImportError:  # metrics are optional: prometheus-client may be absent
            DaemonMetrics = SubscriberCounter = None  # type: ignore[assignment,misc]
        endpoints = self.endpoints
        if DaemonMetrics is not None:
            self.state.metrics = DaemonMetrics(self.manager.num_rows, pd=self.config.role != "both",
                                               tier=self.tier is not None)
            # A CURVE PUB's one monitor then serves both: the count here, its handshake refusals to the log.
            report = self._auth.hand_over(endpoints.pub) if self._auth is not None else None
            endpoints.subscribers = SubscriberCounter(endpoints.pub, also=HANDSHAKE_FAILURES if report else 0,
                                                      on_event=report)
        if self.config.events:
            from kvcache.events import OLDER_ARRAY_WIRE, EventWire, KVEventPublisher

            cfg = self.config
            wire = EventWire() if cfg.events_format == "map" else OLDER_ARRAY_WIRE
            if cfg.events_hashes:
                wire = dataclasses.replace(wire, int_hashes=cfg.events_hashes == "int")
            endpoints.events = KVEventPublisher(self._ctx, cfg.events_endpoint, cfg.events_replay_endpoint,
                                                topic=cfg.events_topic, dp_rank=cfg.data_parallel_rank, wire=wire,
                                                listeners=self._listeners, buffer_bytes=cfg.replay_bytes,
                                                send_bytes=cfg.pub_bytes,
                                                group_numbers=self.state.extra_info.get("event_groups"))
            self.manager.enable_events = True
            self.state.collect_events = True

    def close(self) -> None:
        """Close every socket, remove the socket and lock files this daemon created, and release its locks."""
        if self._auth is not None:  # first: its threads read the sockets' monitors, which closing would pull away
            self._auth.stop()
            self._auth = None
        self.durability.close()
        metrics = self.state.metrics
        if metrics is not None:
            self.state.observe(force=True)
            metrics.close()
        if self.endpoints is not None:
            self.endpoints.close()
        if self.state.admin_key is not None and not self.config.curve_server_cert:
            admin_file = key_file_of(self.config.endpoint, "admin")  # a key only while this daemon holds the endpoint
            if admin_file is not None:
                admin_file.unlink(missing_ok=True)
        self._listeners.close()

    def serve(self, should_stop: Callable[[], bool] = lambda: False, poll_ms: int = 100) -> None:
        """Serve until ``should_stop()`` is true (checked at least every ``poll_ms``)."""
        endpoints, state = self.endpoints, self.state
        poller = zmq.Poller()
        handlers = endpoints.handlers()
        for sock in handlers:
            poller.register(sock, zmq.POLLIN)
        heartbeat_s = self.config.heartbeat_ms / 1000
        while not should_stop():
            if self._reload_requested:
                self._reload_requested = False
                self.reload_clients()
            for sock, _ in poller.poll(min(poll_ms, self.config.heartbeat_ms)):
                handlers[sock]()
            if time.monotonic() - endpoints.last_publish >= heartbeat_s:
                endpoints.heartbeat()
            if state.leases.timeout and time.monotonic() >= self._next_lease_check:
                self.expire_leases()
            if state.pd.transfers and time.monotonic() >= self._next_pd_check:
                self.expire_transfers()
            if state.tier_deadlines and time.monotonic() >= self._next_tier_check:
                self.expire_tier_copies()
            state.observe()  # what the last interval's messages left uncounted

    def request_reload(self) -> None:
        """Have ``serve`` call ``reload_clients`` in its next turn (safe in a signal handler: it only sets a flag)."""
        self._reload_requested = True

    def reload_clients(self) -> None:
        """Read the allowed clients' keys again; a revoked client's open connections get nothing more.

        Its messages to the ROUTERs are dropped from now on, and every subscriber
        of the PUBs is disconnected and must pass the new check to reconnect. A
        folder that fails a check keeps the keys allowed so far, logged in one line.
        """
        if self._auth is None:
            log.warning("reload: this daemon has no --curve-clients-dir; nothing to read again")
            return
        self._reloads += 1
        try:
            revoked = self._auth.reload()
        except (KVCacheError, OSError) as exc:  # OSError: the folder changed while it was read
            log.error("reload refused, the %d client key(s) allowed so far stay allowed: %s",
                      len(self._auth.allowed), exc)
            self._report_reload(str(exc))
            return
        self._report_reload(None)
        if revoked:
            self._listeners.drop_subscribers()

    def _report_reload(self, error: str | None) -> None:
        """Write the outcome of the last reading of the clients folder there, for `kvcache keys revoke` to wait on."""
        try:
            write_reload_status(self._auth.clients_dir, self._reloads, error, self._auth.allowed)
        except OSError as exc:
            log.warning("reload: cannot write %s in %s (%s); `kvcache keys revoke --pid` cannot confirm it",
                        RELOAD_STATUS, self._auth.clients_dir, exc.strerror)

    # ------------------------------------------------------------------ a turn of messages

    def handle(self, payload: bytes, *, own: bool = False) -> bytes:
        """Apply one scheduler message, make it durable, publish its deltas; returns the reply. Never raises.

        ``own``: a message of the daemon's own (``_handle_own``), which alone may hold the daemon's ops."""
        reply = self.state.process(payload, own=own)
        self.durability.commit()
        self._publish_staged()
        self.state.observe()
        return reply

    def _answer(self, outbox: list[tuple[Any, bytes]], send: Callable[[Any, bytes], None]) -> None:
        """Commit the journal, then ``send(address, reply)`` each reply, then encode and publish the messages'
        deltas and events, then count them in the metrics, whichever socket they came in on.

        The group commit's order: nothing leaves before it is durable. Replies go first, so a scheduler's
        round trip does not wait for the deltas' encoding; its workers wait for the reply's ``seq`` anyway.
        """
        self.durability.commit()
        for address, reply in outbox:
            send(address, reply)
        self._publish_staged()
        self.state.observe()

    def _publish_staged(self) -> None:
        """Publish the staged deltas (durable by now) and events; then maybe compact the journal."""
        state, endpoints = self.state, self.endpoints
        for seq, payload in state.deltas.encode_staged(state.manager.num_rows):
            endpoints.send_delta(seq, payload)
        if endpoints.events is not None and state.staged_events:
            endpoints.events.publish(state.staged_events)
            state.staged_events = []
        self.durability.compact()

    # ------------------------------------------------------------------ expiries: messages of the daemon's own

    def expire_transfers(self, now: float | None = None) -> int:
        """Fail every PD transfer past its deadline (journaled like any message); returns how many."""
        now = time.monotonic() if now is None else now
        self._next_pd_check = now + 0.05
        pd = self.state.pd
        late = pd.expired(now)
        if not late:
            return 0
        ops = [{"op": "transfer_failed", "req": r,
                "error": f"transfer timed out after {pd.transfers[r].timeout:g} s"} for r in late]
        reply = self._handle_own(_PD_CLIENT, ops)
        if not reply.get("ok"):
            log.error("transfer expiry failed: %s", reply.get("error"))
            return 0
        log.warning("%d transfer(s) timed out and were released", len(late))
        return len(late)

    def expire_tier_copies(self, now: float | None = None) -> int:
        """Fail every host-tier copy whose ranks did not all report it in time (journaled like any message)."""
        now = time.monotonic() if now is None else now
        self._next_tier_check = now + 0.05
        state, tier = self.state, self.tier
        live = set(tier.pending_jobs()) if tier is not None else set()
        state.tier_deadlines = {job: end for job, end in state.tier_deadlines.items() if job in live}
        late = [job for job, end in state.tier_deadlines.items() if end <= now]
        if not late:
            return 0
        reply = self._handle_own(_TIER_CLIENT, [{"op": "tier_expire", "jobs": late}])
        if not reply.get("ok"):
            log.error("host-tier expiry failed: %s", reply.get("error"))
            return 0
        log.warning("%d host-tier copies were not reported by every rank within %g s: failed", len(late),
                    self.config.tier_timeout)
        return len(late)

    def expire_leases(self, now: float | None = None) -> int:
        """Free every request of schedulers silent past the lease timeout, and release the blocks they own
        (``allocate_blank``, ``match_blocks``, ``commit_blocks``); returns how many requests were freed or released.

        The frees go through the normal path as a message of their own (journaled,
        published as deltas), so a restart replays them like any other.
        """
        now = time.monotonic() if now is None else now
        state = self.state
        leases = state.leases
        self._next_lease_check = now + min(1.0, leases.timeout / 4)
        freed = 0
        for client, reqs in leases.expired(now):
            # A request still in a PD transfer is cancelled instead: its blocks go once the writers stop.
            # A request that owns blocks instead of a table releases them (release_blocks).
            manager, pd = state.manager, state.pd
            owned = [r for r in reqs if r not in manager and r not in pd.transfers]
            ops = [{"op": "cancel" if r in pd.transfers else "free", "req": r} for r in reqs
                   if r in manager or r in pd.transfers]
            for r in owned:
                ops += state.release_owned_ops(r)
            reply = self._handle_own(_LEASE_CLIENT, ops)
            leases.forget(client)
            state.pd.forget_owner(client)
            if reply.get("ok"):
                freed += len(reqs)
                state.expired += len(reqs)
                log.warning("lease of scheduler %r expired after %.1f s of silence: freed %d request(s)%s", client,
                            leases.timeout, len(reqs) - len(owned),
                            f", released the owned blocks of {len(owned)}" if owned else "")
            else:
                log.error("lease expiry of %r failed: %s", client, reply.get("error"))
        return freed

    def _handle_own(self, client: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        """A message of the daemon's own (an expiry) as ``client``, applied, journaled and published like a
        scheduler's, so a restart replays it; its reply."""
        payload = pack({"v": PROTOCOL_VERSION, "client": client, "id": int.from_bytes(os.urandom(7), "big"),
                        "ops": ops})
        return unpack(self.handle(payload, own=True), 1 << 30)

    # ------------------------------------------------------------------ introspection

    @property
    def manager(self) -> KVCacheManager:
        """The manager (a journal's recovery replaces the one the daemon was built with)."""
        return self.state.manager

    @property
    def tier(self) -> DaemonTier | None:
        """The host tier (``--host-memory``), or None."""
        return self.state.tier

    @property
    def epoch(self) -> int:
        """This daemon's epoch: random per incarnation, kept by its journal (workers resync when it changes)."""
        return self.state.deltas.epoch

    @property
    def router(self) -> zmq.Socket:
        return self.endpoints.router

    @property
    def pub(self) -> zmq.Socket:
        return self.endpoints.pub

    @property
    def replay(self) -> zmq.Socket:
        return self.endpoints.replay

    @property
    def local(self) -> Any:
        """The local endpoint's socket, or None."""
        return self.endpoints.local

    def info(self) -> dict[str, Any]:
        return self.state.info()

    def stats(self) -> dict[str, Any]:
        return self.state.stats()

    def snapshot(self) -> bytes:
        """Every live table with its slot, at the current seq (for workers that fell too far behind)."""
        return self.state.snapshot()

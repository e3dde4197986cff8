"""The cache daemon: one thread owns a KVCacheManager and serves schedulers and workers over ZMQ.

``CacheServer`` holds the sockets and puts together the parts that decide and remember, each a module of its own:

    kvcache.daemon_state   the state machine: validate a message (who may send each op, its fields), apply it
                           to the manager, batch slots, leases, PD transfers and host tier; no sockets or files
    kvcache.deltas         the table deltas it stages, encoded once durable and kept for replay
    kvcache.durability     the journal: recovery at start, one commit per turn, snapshots

Sockets (see protocol.py for the messages):

    endpoint          ROUTER  schedulers and admin tools send steps of operations
    pub_endpoint      PUB     sequence-numbered table deltas for workers
    replay_endpoint   ROUTER  missed deltas by sequence number, or a snapshot
    events_endpoint   PUB     KV events in vLLM's format (with --events)
    events_replay_endpoint
                      ROUTER  missed KV events by sequence number (with --events)
    local_endpoint    Unix datagram socket: the same messages as endpoint, from same-host clients,
                      without ZMQ's I/O threads (a round trip of about 16 µs instead of 166 on a VM)

Everything here and in those parts belongs to the thread that calls ``serve``; other threads only read
(Prometheus HTTP) or belong to libzmq. Every ipc socket is owner-only and locked against a second daemon on its
path; with CURVE every other socket admits only the allowed clients, re-read on ``reload_clients`` (see
kvcache.listeners).

A step's reply goes out first, then its deltas, in the same turn of the loop (both only once the
journal made them durable): a scheduler that has the reply (with its ``seq``) knows the deltas follow
at once, and its round trip does not wait for their encoding. Workers wait for that ``seq``.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import zmq

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.manager import KVCacheManager
from kvcache.allocator.rows import Row
from kvcache.auth import HANDSHAKE_FAILURES, CurveConfig, start_authenticator
from kvcache.config import LOCAL_OFF, ServeConfig
from kvcache.daemon_state import DaemonState
from kvcache.durability import STATE_CODEC, Durability, dump_state, load_state
from kvcache.durability import check_compatible as _check_compatible
from kvcache.host_tier import DaemonTier
from kvcache.journal import Recovered
from kvcache.keys import RELOAD_STATUS, write_reload_status
from kvcache.listeners import Listeners
from kvcache.paths import remove_socket_file
from kvcache.protocol import (
    DELTA_HEAD_BYTES,
    DELTA_TOPIC,
    LOCAL_MAX_BYTES,
    LOCAL_SUBSCRIBE,
    LOCAL_UNSUBSCRIBE,
    MAX_LOCAL_SUBSCRIBERS,
    PROTOCOL_VERSION,
    ProtocolError,
    check_int,
    error_reply,
    pack,
    resend_reply,
    seq_frame,
    show,
    stamp_delta,
    unpack,
)
from kvcache.rank_keys import admin_key, key_file_of

# What other modules and the tests import from here: the daemon, and the snapshot names kvcache.durability holds.
__all__ = ["CacheServer", "STATE_CODEC", "_check_compatible", "dump_state", "load_state"]

log = logging.getLogger("kvcache.server")
_LEASE_CLIENT = "kvcache-lease-expiry"
_PD_CLIENT = "kvcache-transfer-expiry"
_TIER_CLIENT = "kvcache-tier-expiry"
_SNDMORE, _NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)  # plain ints: pyzmq's flag enums combine in Python
_SNDMORE_NOBLOCK = _SNDMORE | _NOBLOCK
# The largest delta the PUB sends as it is: the one that fits a local-endpoint datagram with its head. A larger one
# goes as a heartbeat of its seq on either path, which sends workers to the replay socket for it.
PUB_MAX_DELTA_BYTES = LOCAL_MAX_BYTES - DELTA_HEAD_BYTES
REPLAY_HWM = 4  # replies queued per replay peer


class CacheServer:
    """The daemon's state and sockets; ``serve`` runs the loop in the calling thread (the owner)."""

    def __init__(self, config: ServeConfig, manager: KVCacheManager, *, layout: Sequence[Row] | None = None,
                 context: zmq.Context | None = None, extra_info: dict[str, Any] | None = None) -> None:
        """``layout`` names the (layer, kv head) cells of each of the manager's rows, for workers to find the
        rows of their rank and layers (``kvcache.serve.build_manager`` gives it from a model's config)."""
        self.config = config.resolved()
        self.state = DaemonState(self.config, manager, layout=layout, extra_info=extra_info)
        self.durability = Durability(self.state)
        self._sockets: list[zmq.Socket] = []
        self._last_publish = 0.0
        self._events: Any = None
        self._subscribers: Any = None
        self._local_subscribers: dict[str | bytes, None] = {}  # workers taking deltas as datagrams, by address
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
        self.local: socket.socket | None = None
        try:  # a socket that cannot bind (or a journal that cannot load) leaves nothing open behind
            self.router = self._bind(zmq.ROUTER, self.config.endpoint, "endpoint")
            # A slow subscriber's queue holds at most pub_bytes: deltas past PUB_MAX_DELTA_BYTES go as their seq only.
            self.pub = self._bind(zmq.PUB, self.config.pub_endpoint, "pub_endpoint",
                                  sndhwm=max(1, self.config.pub_bytes // PUB_MAX_DELTA_BYTES))
            # A worker that asks again and again without reading holds at most a few replies (snapshots).
            self.replay = self._bind(zmq.ROUTER, self.config.replay_endpoint, "replay_endpoint", sndhwm=REPLAY_HWM)
            self._recv_step = self._listeners.receiver(self.router)
            # The daemon's admin key (kvcache.rank_keys): a claim holding it takes a rank whoever owns it.
            self.state.admin_key = admin_key(self.config.endpoint, self.config.curve_server_cert or None,
                                             create=True)
            self._recv_replay = self._listeners.receiver(self.replay)
            if self.config.local_endpoint != LOCAL_OFF:
                self.local = self._bind_local(Path(self.config.local_endpoint))
            self.state.subscriber_counts = self._subscriber_counts
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
        self._topic = DELTA_TOPIC + self.state.deltas.epoch.to_bytes(8, "big")

    # ------------------------------------------------------------------ lifecycle

    def _setup_optional(self) -> None:
        """Metrics, subscriber counting and KV events, when their modules and settings allow."""
        try:
            from kvcache.metrics import DaemonMetrics, SubscriberCounter
        except ImportError:  # metrics are optional: prometheus-client may be absent
            DaemonMetrics = SubscriberCounter = None  # type: ignore[assignment,misc]
        if DaemonMetrics is not None:
            self.state.metrics = DaemonMetrics(self.manager.num_rows, pd=self.config.role != "both",
                                               tier=self.tier is not None)
            # A CURVE PUB's one monitor then serves both: the count here, its handshake refusals to the log.
            report = self._auth.hand_over(self.pub) if self._auth is not None else None
            self._subscribers = SubscriberCounter(self.pub, also=HANDSHAKE_FAILURES if report else 0,
                                                  on_event=report)
        if self.config.events:
            from kvcache.events import OLDER_ARRAY_WIRE, EventWire, KVEventPublisher

            cfg = self.config
            wire = EventWire() if cfg.events_format == "map" else OLDER_ARRAY_WIRE
            if cfg.events_hashes:
                wire = dataclasses.replace(wire, int_hashes=cfg.events_hashes == "int")
            self._events = KVEventPublisher(self._ctx, cfg.events_endpoint, cfg.events_replay_endpoint,
                                            topic=cfg.events_topic, dp_rank=cfg.data_parallel_rank, wire=wire,
                                            listeners=self._listeners, buffer_bytes=cfg.replay_bytes,
                                            send_bytes=cfg.pub_bytes)
            self.manager.enable_events = True
            self.state.collect_events = True

    def restore_journal(self, recovered: Recovered) -> dict[str, Any]:
        """Take a journal's snapshot and replay its records as a restart does (``Durability.restore``); returns
        the settings the journal was written with."""
        return self.durability.restore(recovered)

    def close(self) -> None:
        """Close every socket, remove the socket and lock files this daemon created, and release its locks."""
        if self._auth is not None:  # first: its threads read the sockets' monitors, which closing would pull away
            self._auth.stop()
            self._auth = None
        self.durability.close()
        if self._events is not None:
            self._events.close()
        metrics = self.state.metrics
        if metrics is not None:
            self.state.observe(force=True)
            metrics.close()
        if self._subscribers is not None:
            self._subscribers.close()
        for sock in self._sockets:
            sock.close(0)
        self._sockets.clear()
        if self.local is not None:
            self.local.close()
        if self.state.admin_key is not None and not self.config.curve_server_cert:
            admin_file = key_file_of(self.config.endpoint, "admin")  # a key only while this daemon holds the endpoint
            if admin_file is not None:
                admin_file.unlink(missing_ok=True)
        self._listeners.close()

    def serve(self, should_stop: Callable[[], bool] = lambda: False, poll_ms: int = 100) -> None:
        """Serve until ``should_stop()`` is true (checked at least every ``poll_ms``)."""
        state = self.state
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.replay, zmq.POLLIN)
        handlers: dict[Any, Callable[[], None]] = {self.router: self._handle_step, self.replay: self._handle_replay}
        if self.local is not None:
            poller.register(self.local.fileno(), zmq.POLLIN)
            handlers[self.local.fileno()] = self._handle_local
        if self._events is not None and self._events.replay_socket is not None:
            poller.register(self._events.replay_socket, zmq.POLLIN)
            handlers[self._events.replay_socket] = self._events.handle_replay
        if self._subscribers is not None:
            poller.register(self._subscribers.monitor_socket, zmq.POLLIN)
            handlers[self._subscribers.monitor_socket] = self._count_subscribers
        heartbeat_s = self.config.heartbeat_ms / 1000
        while not should_stop():
            if self._reload_requested:
                self._reload_requested = False
                self.reload_clients()
            for sock, _ in poller.poll(min(poll_ms, self.config.heartbeat_ms)):
                handlers[sock]()
            if time.monotonic() - self._last_publish >= heartbeat_s:
                self._heartbeat()
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
        self._commit()
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

    def _commit(self) -> None:
        """Make the messages applied since the last commit durable (``Durability.commit``)."""
        self.durability.commit()

    def _publish_staged(self) -> None:
        """Publish the staged deltas (durable by now) and events; then maybe compact the journal."""
        state = self.state
        for seq, payload in state.deltas.encode_staged(state.manager.num_rows):
            self._send_delta(seq, payload)
        if self._events is not None and state.staged_events:
            self._events.publish(state.staged_events)
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

    # ------------------------------------------------------------------ sockets

    def _bind(self, kind: int, endpoint: str, field: str, *, sndhwm: int | None = None) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if sndhwm is not None:
            sock.setsockopt(zmq.SNDHWM, sndhwm)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
            # A frame far past the limit (8x, at least 256 MiB over) makes libzmq drop the peer instead of
            # buffering gigabytes; anything smaller is refused with an error reply naming its size.
            limit = self.config.max_message_bytes
            sock.setsockopt(zmq.MAXMSGSIZE, max(8 * limit, limit + 2**28))
        try:
            self._listeners.bind(sock, endpoint, field)
        except BaseException:
            sock.close(0)
            raise
        self._sockets.append(sock)
        return sock

    def _bind_local(self, path: Path) -> socket.socket:
        """The local endpoint: a non-blocking Unix datagram socket at ``path``, owner-only like the ipc ones."""
        sock = self._listeners.bind_datagram(path, "local_endpoint")
        sock.setblocking(False)
        self._local_folder = os.path.dirname(os.path.abspath(path))  # where subscribers' sockets must be
        # Room for replies and deltas not yet read (a Unix datagram counts against its sender's buffer until
        # read); the kernel caps it at net.core.wmem_max. A subscriber left behind catches up by replay.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        return sock

    def _heartbeat(self) -> None:
        """Tell workers the latest seq (empty payload): they catch a lost last delta or a new epoch."""
        self._last_publish = time.monotonic()
        try:
            self.pub.send_multipart([self._topic, seq_frame(self.state.deltas.seq), b""], zmq.NOBLOCK)
        except zmq.Again:
            pass
        if self._local_subscribers:
            self._fan_out(self._topic + seq_frame(self.state.deltas.seq), b"")

    def _handle_step(self) -> None:
        """Answer the scheduler messages waiting on the ROUTER (at most 256, so replay is not starved).

        Group commit: with a journal, every message is applied and journaled, then
        one fdatasync makes them all durable, and only then go their replies out.
        Without one, a reply goes as soon as its message is applied. The turn's
        deltas go after its replies; the metrics count them last.
        """
        outbox: list[tuple[list[bytes], bytes]] = []
        recv = self._recv_step
        for _ in range(256):
            try:
                frames = recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if frames is None or len(frames) < 2:  # None: a client revoked since it connected
                continue
            reply = self.state.process(frames[-1])
            if self.state.journal is None:  # nothing to make durable first: answer before looking for the next one
                self._send_reply(frames[:-1], reply)
            else:
                outbox.append((frames[:-1], reply))
        self._answer(outbox, self._send_reply)

    def _send_reply(self, envelope: list[bytes], reply: bytes) -> None:
        """A reply on the ROUTER: its envelope's frames, then the reply (send_multipart's work without its
        per-frame flag arithmetic on enums, a few us a step)."""
        send = self.router.send
        for frame in envelope:
            send(frame, _SNDMORE)
        send(reply)

    def _handle_local(self) -> None:
        """Answer the datagrams waiting on the local endpoint, as ``_handle_step`` answers the ROUTER's."""
        outbox: list[tuple[str | bytes, bytes]] = []
        for _ in range(256):
            try:
                payload, address = self.local.recvfrom(LOCAL_MAX_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                break
            if not address:  # a sender bound to no address could never get its reply: nothing is applied
                self.state.count_error("decode")
                continue
            if payload[:1] == LOCAL_SUBSCRIBE[:1]:  # not a msgpack map: a worker's (un)subscription
                self._subscription(payload, address)
                continue
            if len(payload) > LOCAL_MAX_BYTES:  # cut short by recvfrom: never decoded
                self.state.count_error("decode")
                outbox.append((address, error_reply(None, f"message: more than {LOCAL_MAX_BYTES} bytes, the "
                                                          "local endpoint's limit; send it over the ZMQ endpoint")))
                continue
            reply = self.state.process(payload)
            if self.state.journal is None:  # as _handle_step: nothing to make durable first
                self._send_local(address, reply)
            else:
                outbox.append((address, reply))
        self._answer(outbox, self._send_local)

    def _subscription(self, payload: bytes, address: str | bytes) -> None:
        """Add or drop a worker that takes the deltas as datagrams; a new one is answered with a heartbeat.

        A refused address (``_subscriber_refusal``) is answered with an error and sent nothing else.
        """
        if payload == LOCAL_UNSUBSCRIBE:
            self._local_subscribers.pop(address, None)
        elif payload != LOCAL_SUBSCRIBE:
            self.state.count_error("decode")
            return
        elif address not in self._local_subscribers and (refusal := self._subscriber_refusal(address)):
            self.state.count_error("decode")
            self._send_local(address, error_reply(None, refusal))
            return
        elif address in self._local_subscribers or len(self._local_subscribers) < MAX_LOCAL_SUBSCRIBERS:
            self._local_subscribers[address] = None
            self._fan_out(self._topic + seq_frame(self.state.deltas.seq), b"", [address])
        else:
            log.warning("local endpoint: %d workers already take deltas; refused one more", MAX_LOCAL_SUBSCRIBERS)
        self._set_subscriber_gauge()

    def _subscriber_refusal(self, address: str | bytes) -> str | None:
        """Why ``address`` may not take the deltas, or None: it must be a socket file in the local endpoint's folder.

        That folder is this user's alone (kvcache.paths checked it at bind), so nobody else can bind the
        address, even once its worker is gone; an abstract name (no permissions) anyone may take then.
        """
        folder = self._local_folder
        if not isinstance(address, str) or os.path.dirname(address) != folder:
            return (f"subscribe: the worker's address {show(address)} is not a socket file in {folder}: another "
                    "user could take it once the worker is gone; bind the worker's socket in that folder")
        try:
            info = os.lstat(address)
        except OSError as exc:
            return f"subscribe: cannot use the worker's socket {address}: {exc.strerror}"
        if not stat.S_ISSOCK(info.st_mode) or info.st_uid not in (os.geteuid(), 0):
            return f"subscribe: {address} is not a socket of this user or root"
        return None

    def _fan_out(self, head: bytes, payload: bytes | bytearray, addresses: Any = None) -> None:
        """One datagram of ``head`` and ``payload`` to every local subscriber (or to ``addresses``).

        A payload too big for a datagram goes as a heartbeat of its seq, which sends the worker to the
        replay socket; a worker whose queue is full misses this one (it sees the gap); one that is gone
        is forgotten, and the socket file a dead worker left is removed.
        """
        if DELTA_HEAD_BYTES + len(payload) > LOCAL_MAX_BYTES:
            payload = b""
        gone = []
        for address in list(self._local_subscribers) if addresses is None else addresses:
            try:
                self.local.sendmsg([head, payload], (), 0, address)
            except BlockingIOError:
                pass
            except OSError as exc:  # no such socket any more, or one no longer connected to this daemon's
                gone.append(address)
                if exc.errno == errno.ECONNREFUSED:  # a file no process has bound any more: a worker killed
                    remove_socket_file(address)
        for address in gone:
            self._local_subscribers.pop(address, None)
        if gone:
            self._set_subscriber_gauge()

    def _send_local(self, address: str | bytes, reply: bytes) -> None:
        """One reply datagram; a reply too big for one says "resend" (the same id over ZMQ gets it)."""
        if len(reply) > LOCAL_MAX_BYTES:
            reply = resend_reply(unpack(reply, len(reply)).get("id"))
        try:
            self.local.sendto(reply, address)
        except OSError:  # the client left, or its queue is full: a retry over ZMQ gets the kept reply
            pass

    def _send_delta(self, seq: int, payload: bytearray) -> None:
        """Publish a staged delta, stamping its "t" now: the lag workers measure starts at the send."""
        self._last_publish = time.monotonic()
        stamp_delta(payload, time.monotonic_ns())
        head = seq_frame(seq)
        try:
            send = self.pub.send  # a PUB queues a message's frames together or drops them all: no partial one
            send(self._topic, _SNDMORE_NOBLOCK)
            send(head, _SNDMORE_NOBLOCK)
            send(payload if len(payload) <= PUB_MAX_DELTA_BYTES else b"", _NOBLOCK)
        except zmq.Again:  # PUB drops for slow subscribers rather than block; they resync by seq
            pass
        if self._local_subscribers:
            self._fan_out(self._topic + head, payload)

    def _handle_replay(self) -> None:
        """Answer a worker that missed deltas: the buffered ones from its seq on, or a snapshot."""
        for _ in range(64):
            try:
                frames = self._recv_replay(zmq.NOBLOCK)
            except zmq.Again:
                return
            if frames is None:  # a client revoked since it connected
                continue
            envelope, payload = frames[:-1], frames[-1]
            try:
                msg = unpack(payload, 4096)
                if not isinstance(msg, dict):
                    raise ProtocolError("replay: message must be a map")
                start = check_int(msg.get("from"), "from", least=0)
            except ProtocolError as exc:
                self.replay.send_multipart([*envelope, b"E", str(exc).encode()])
                continue
            payloads = self.state.deltas.since(start)
            if payloads is None:
                self.replay.send_multipart([*envelope, b"S", self.snapshot()])
            else:  # the frames share the history's bytes
                self.replay.send_multipart([*envelope, b"D", *payloads], copy=False)

    def _count_subscribers(self) -> None:
        self._subscribers.handle()
        self._set_subscriber_gauge()

    def _set_subscriber_gauge(self) -> None:
        """Workers taking deltas: connected to the PUB, or subscribed on the local endpoint."""
        if self.state.metrics is not None:
            pub = self._subscribers.count if self._subscribers is not None else 0
            self.state.metrics.set_subscribers(pub + len(self._local_subscribers))

    def _subscriber_counts(self) -> tuple[int | None, int]:
        """Workers connected to the PUB (None when not counted) and subscribed on the local endpoint."""
        return (self._subscribers.count if self._subscribers is not None else None), len(self._local_subscribers)

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

    def info(self) -> dict[str, Any]:
        return self.state.info()

    def stats(self) -> dict[str, Any]:
        return self.state.stats()

    def snapshot(self) -> bytes:
        """Every live table with its slot, at the current seq (for workers that fell too far behind)."""
        return self.state.snapshot()

    # The parts' own names, which the tests and `kvcache journal check` reach through the server.

    @property
    def _seq(self) -> int:
        return self.state.deltas.seq

    @property
    def _history(self) -> Any:
        return self.state.deltas.history

    @property
    def _slots(self) -> Any:
        return self.state.slots

    @property
    def _pd(self) -> Any:
        return self.state.pd

    @property
    def _metrics(self) -> Any:
        return self.state.metrics

    @property
    def _next_observe(self) -> float:
        return self.state._next_observe

    @_next_observe.setter
    def _next_observe(self, when: float) -> None:
        self.state._next_observe = when

    def _process(self, payload: bytes, *, replaying: bool = False, own: bool = False) -> bytes:
        return self.state.process(payload, replaying=replaying, own=own)

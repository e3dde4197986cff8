"""The daemon's sockets: messages in, replies and deltas out, missed deltas replayed.

    endpoint          ROUTER  schedulers and admin tools send steps of operations
    pub_endpoint      PUB     sequence-numbered table deltas for workers
    replay_endpoint   ROUTER  missed deltas by sequence number, or a snapshot
    local_endpoint    Unix datagram socket: the same messages as endpoint, from same-host clients,
                      without ZMQ's I/O threads (a round trip of about 16 µs instead of 166 on a VM);
                      workers subscribe there to take the deltas as datagrams

With ``--events``, kvcache.events' publisher adds ``events_endpoint`` (PUB, KV
events in vLLM's format) and ``events_replay_endpoint`` (ROUTER, missed events);
``Endpoints`` holds it, and its replay socket is polled with the others.

Each socket is bound through kvcache.listeners (owner-only ipc folders, a lock
against a second daemon, CURVE on tcp). ``Endpoints`` decides nothing: every
message goes to the state machine (``DaemonState.process``), and the turn's
replies go back through the ``answer`` it was given (kvcache.server's, which
commits the journal first). Like the state, it belongs to the daemon's one
thread.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import zmq

from kvcache.config import LOCAL_OFF, ServeConfig
from kvcache.paths import remove_socket_file
from kvcache.protocol import (
    DELTA_HEAD_BYTES,
    DELTA_TOPIC,
    LOCAL_MAX_BYTES,
    LOCAL_SUBSCRIBE,
    LOCAL_UNSUBSCRIBE,
    MAX_LOCAL_SUBSCRIBERS,
    ProtocolError,
    check_int,
    error_reply,
    resend_reply,
    seq_frame,
    show,
    stamp_delta,
    unpack,
)

if TYPE_CHECKING:
    from kvcache.daemon_state import DaemonState
    from kvcache.listeners import Listeners

log = logging.getLogger("kvcache.server")
_SNDMORE, _NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)  # plain ints: pyzmq's flag enums combine in Python
_SNDMORE_NOBLOCK = _SNDMORE | _NOBLOCK
# The largest delta the PUB sends as it is: the one that fits a local-endpoint datagram with its head. A larger one
# goes as a heartbeat of its seq on either path, which sends workers to the replay socket for it.
PUB_MAX_DELTA_BYTES = LOCAL_MAX_BYTES - DELTA_HEAD_BYTES
REPLAY_HWM = 4  # replies queued per replay peer
# A turn's answers: (address, reply) pairs and the send that takes one of them.
Answer = Callable[[list[tuple[Any, bytes]], Callable[[Any, bytes], None]], None]


class Endpoints:
    """The daemon's ROUTER, PUB, replay ROUTER and local endpoint, bound at construction (all or none).

    ``answer(outbox, send)`` ends a turn of messages: it must ``send`` each reply of the outbox, once they may
    leave. ``events`` (a KV event publisher) and ``subscribers`` (the PUB's connection counter) are set from
    outside when those are on; ``set_epoch`` names the topic deltas go out on.
    """

    def __init__(self, config: ServeConfig, context: zmq.Context, listeners: Listeners, state: DaemonState,
                 answer: Answer) -> None:
        self.config = config
        self._ctx = context
        self._listeners = listeners
        self._state = state
        self._answer = answer
        self._sockets: list[zmq.Socket] = []
        self.local: socket.socket | None = None
        self.local_subscribers: dict[str | bytes, None] = {}  # workers taking deltas as datagrams, by address
        self.events: Any = None
        self.subscribers: Any = None
        self.last_publish = 0.0
        self._topic = b""
        try:  # a socket that cannot bind leaves nothing open behind
            self.router = self._bind(zmq.ROUTER, config.endpoint, "endpoint")
            # A slow subscriber's queue holds at most pub_bytes: deltas past PUB_MAX_DELTA_BYTES go as their seq only.
            self.pub = self._bind(zmq.PUB, config.pub_endpoint, "pub_endpoint",
                                  sndhwm=max(1, config.pub_bytes // PUB_MAX_DELTA_BYTES))
            # A worker that asks again and again without reading holds at most a few replies (snapshots).
            self.replay = self._bind(zmq.ROUTER, config.replay_endpoint, "replay_endpoint", sndhwm=REPLAY_HWM)
            self._recv_step = listeners.receiver(self.router)
            self._recv_replay = listeners.receiver(self.replay)
            if config.local_endpoint != LOCAL_OFF:
                self.local = self._bind_local(Path(config.local_endpoint))
        except BaseException:
            self.close()
            raise

    def set_epoch(self, epoch: int) -> None:
        """Send deltas and heartbeats under ``epoch``'s topic (the daemon's, once its journal is recovered)."""
        self._topic = DELTA_TOPIC + epoch.to_bytes(8, "big")

    def handlers(self) -> dict[Any, Callable[[], None]]:
        """What the serve loop polls (sockets and file descriptors) and the handler of each."""
        handlers: dict[Any, Callable[[], None]] = {self.router: self.handle_steps, self.replay: self.handle_replay}
        if self.local is not None:
            handlers[self.local.fileno()] = self.handle_local
        if self.events is not None and self.events.replay_socket is not None:
            handlers[self.events.replay_socket] = self.events.handle_replay
        if self.subscribers is not None:
            handlers[self.subscribers.monitor_socket] = self._count_subscribers
        return handlers

    def close(self) -> None:
        """Close the event publisher, the subscriber counter and every socket."""
        if self.events is not None:
            self.events.close()
        if self.subscribers is not None:
            self.subscribers.close()
        for sock in self._sockets:
            sock.close(0)
        self._sockets.clear()
        if self.local is not None:
            self.local.close()

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

    # ------------------------------------------------------------------ scheduler messages

    def handle_steps(self) -> None:
        """Answer the scheduler messages waiting on the ROUTER (at most 256, so replay is not starved).

        Group commit: with a journal, every message is applied and journaled, then
        one fdatasync makes them all durable, and only then go their replies out.
        Without one, a reply goes as soon as its message is applied. The turn's
        deltas go after its replies; the metrics count them last.
        """
        outbox: list[tuple[list[bytes], bytes]] = []
        recv, state = self._recv_step, self._state
        for _ in range(256):
            try:
                frames = recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if frames is None or len(frames) < 2:  # None: a client revoked since it connected
                continue
            reply = state.process(frames[-1])
            if state.journal is None:  # nothing to make durable first: answer before looking for the next one
                self.send_reply(frames[:-1], reply)
            else:
                outbox.append((frames[:-1], reply))
        self._answer(outbox, self.send_reply)

    def send_reply(self, envelope: list[bytes], reply: bytes) -> None:
        """A reply on the ROUTER: its envelope's frames, then the reply (send_multipart's work without its
        per-frame flag arithmetic on enums, a few us a step)."""
        send = self.router.send
        for frame in envelope:
            send(frame, _SNDMORE)
        send(reply)

    def handle_local(self) -> None:
        """Answer the datagrams waiting on the local endpoint, as ``handle_steps`` answers the ROUTER's."""
        outbox: list[tuple[str | bytes, bytes]] = []
        state = self._state
        for _ in range(256):
            try:
                payload, address = self.local.recvfrom(LOCAL_MAX_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                break
            if not address:  # a sender bound to no address could never get its reply: nothing is applied
                state.count_error("decode")
                continue
            if payload[:1] == LOCAL_SUBSCRIBE[:1]:  # not a msgpack map: a worker's (un)subscription
                self._subscription(payload, address)
                continue
            if len(payload) > LOCAL_MAX_BYTES:  # cut short by recvfrom: never decoded
                state.count_error("decode")
                outbox.append((address, error_reply(None, f"message: more than {LOCAL_MAX_BYTES} bytes, the "
                                                          "local endpoint's limit; send it over the ZMQ endpoint")))
                continue
            reply = state.process(payload)
            if state.journal is None:  # as handle_steps: nothing to make durable first
                self.send_local(address, reply)
            else:
                outbox.append((address, reply))
        self._answer(outbox, self.send_local)

    def send_local(self, address: str | bytes, reply: bytes) -> None:
        """One reply datagram; a reply too big for one says "resend" (the same id over ZMQ gets it)."""
        if len(reply) > LOCAL_MAX_BYTES:
            reply = resend_reply(unpack(reply, len(reply)).get("id"))
        try:
            self.local.sendto(reply, address)
        except OSError:  # the client left, or its queue is full: a retry over ZMQ gets the kept reply
            pass

    # ------------------------------------------------------------------ deltas to workers

    def _subscription(self, payload: bytes, address: str | bytes) -> None:
        """Add or drop a worker that takes the deltas as datagrams; a new one is answered with a heartbeat.

        A refused address (``_subscriber_refusal``) is answered with an error and sent nothing else.
        """
        if payload == LOCAL_UNSUBSCRIBE:
            self.local_subscribers.pop(address, None)
        elif payload != LOCAL_SUBSCRIBE:
            self._state.count_error("decode")
            return
        elif address not in self.local_subscribers and (refusal := self._subscriber_refusal(address)):
            self._state.count_error("decode")
            self.send_local(address, error_reply(None, refusal))
            return
        elif address in self.local_subscribers or len(self.local_subscribers) < MAX_LOCAL_SUBSCRIBERS:
            self.local_subscribers[address] = None
            self._fan_out(self._topic + seq_frame(self._state.deltas.seq), b"", [address])
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
        for address in list(self.local_subscribers) if addresses is None else addresses:
            try:
                self.local.sendmsg([head, payload], (), 0, address)
            except BlockingIOError:
                pass
            except OSError as exc:  # no such socket any more, or one no longer connected to this daemon's
                gone.append(address)
                if exc.errno == errno.ECONNREFUSED:  # a file no process has bound any more: a worker killed
                    remove_socket_file(address)
        for address in gone:
            self.local_subscribers.pop(address, None)
        if gone:
            self._set_subscriber_gauge()

    def heartbeat(self) -> None:
        """Tell workers the latest seq (empty payload): they catch a lost last delta or a new epoch."""
        self.last_publish = time.monotonic()
        seq = self._state.deltas.seq
        try:
            self.pub.send_multipart([self._topic, seq_frame(seq), b""], zmq.NOBLOCK)
        except zmq.Again:
            pass
        if self.local_subscribers:
            self._fan_out(self._topic + seq_frame(seq), b"")

    def send_delta(self, seq: int, payload: bytearray) -> None:
        """Publish an encoded delta, stamping its "t" now: the lag workers measure starts at the send."""
        self.last_publish = time.monotonic()
        stamp_delta(payload, time.monotonic_ns())
        head = seq_frame(seq)
        try:
            send = self.pub.send  # a PUB queues a message's frames together or drops them all: no partial one
            send(self._topic, _SNDMORE_NOBLOCK)
            send(head, _SNDMORE_NOBLOCK)
            send(payload if len(payload) <= PUB_MAX_DELTA_BYTES else b"", _NOBLOCK)
        except zmq.Again:  # PUB drops for slow subscribers rather than block; they resync by seq
            pass
        if self.local_subscribers:
            self._fan_out(self._topic + head, payload)

    def handle_replay(self) -> None:
        """Answer a worker that missed deltas: the kept ones from its seq on, or a snapshot of every table."""
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
            payloads = self._state.deltas.since(start)
            if payloads is None:
                self.replay.send_multipart([*envelope, b"S", self._state.snapshot()])
            else:  # the frames share the history's bytes
                self.replay.send_multipart([*envelope, b"D", *payloads], copy=False)

    # ------------------------------------------------------------------ counting subscribers

    def subscriber_counts(self) -> tuple[int | None, int]:
        """Workers connected to the PUB (None when not counted) and subscribed on the local endpoint."""
        return (self.subscribers.count if self.subscribers is not None else None), len(self.local_subscribers)

    def _count_subscribers(self) -> None:
        self.subscribers.handle()
        self._set_subscriber_gauge()

    def _set_subscriber_gauge(self) -> None:
        """Workers taking deltas: connected to the PUB, or subscribed on the local endpoint."""
        metrics = self._state.metrics
        if metrics is not None:
            pub = self.subscribers.count if self.subscribers is not None else 0
            metrics.set_subscribers(pub + len(self.local_subscribers))

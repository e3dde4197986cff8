"""KV cache events on ZeroMQ in vLLM's publisher format, so a router built for vLLM can index this daemon's cache.

Followed from vllm-project/vllm ``vllm/distributed/kv_events.py`` (``EventBatch``,
``KVCacheEvent``, ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``,
``ZmqEventPublisher``) at commit b4e69e0af33f4698e157a262cc787fe61983cd3d (all
structs ``array_like``) and at the later version whose ``KVCacheEvent`` dropped
``array_like`` (vLLM PR #42892) and whose replay replies carry the topic, with
``examples/online_serving/kv_events_subscriber.py`` at
0ef0f42653bc5a0c7c44d26ce3a161e692b07a2c and
``examples/features/kv_events/kv_events_subscriber.py`` at
1bd773f6a52899e189c8237e55473cda0074f2fb as the consumers. The structs are
msgspec ``omit_defaults=True, tag=True`` structs encoded with msgpack; we write
the same bytes with our msgpack codec (``kvcache._wire``, token ids straight from their array)::

    live (PUB)       [topic, seq (8 bytes, big-endian), payload]
    payload          [ts (float64), [event, ...], data_parallel_rank]
    event, "array"   ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                      lora_id, medium, lora_name]
                     ["BlockRemoved", block_hashes, medium]
                     ["AllBlocksCleared"]
    event, "map"     {"type": "BlockStored", "block_hashes": ..., ..., "lora_name": ...}
    replay request   a REQ or DEALER peer sends [b"", start seq (8 bytes)] to the ROUTER
    replay reply     [b"", (topic,) seq, payload] per buffered batch with seq >= start, then
                     [b"", (b"",) END_SEQ, b""]; the topic frame only with ``replay_topic``

msgspec writes every field of an ``array_like`` struct, defaults included
(``omit_defaults`` does not shorten arrays), and decoders ignore trailing
elements they do not know, so the array form stops after ``lora_name``, the
last field without a default. In the map form ``omit_defaults`` drops fields
left at their default (``extra_keys``, ``group_idx``, ``event_version``, ...);
fields without a default are written even when None.

A daemon with CURVE (``--curve-server-cert``) serves both sockets with its key
to the allowed clients only, as its other tcp:// sockets: a router then gives
its SUB and replay sockets a client key pair before connecting, e.g.
``secure_client_socket(sub, CurveConfig.for_client("NAME.key_secret", "server.key"))``
from kvcache.auth (or the same three ``curve_*`` socket options in any ZMQ binding).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np
import zmq

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcache.protocol import pack_lists

if TYPE_CHECKING:
    from kvcache.allocator.events import CacheEvent
    from kvcache.listeners import Listeners

log = logging.getLogger("kvcache.events")
LIVE_BATCH_BYTES = 1 << 20  # larger event batches are numbered and kept for replay but not sent live

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_LOW_64 = (1 << 64) - 1


@dataclasses.dataclass(frozen=True, slots=True)
class EventWire:
    """Which vLLM generation's encoding to speak: vLLM changed it, and routers decode one form or both.

    ``layout="array"`` writes each event as a tagged array (vLLM before PR
    #42892); ``"map"`` as a tagged map under ``"type"`` (vLLM after it).
    ``replay_topic`` puts the topic frame in replay replies as newer vLLM
    does. ``int_hashes`` sends each hash as the low 64 bits of its digest
    (vLLM's default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) instead of
    the 32-byte digest. Current vLLM main is
    ``EventWire(layout="map", replay_topic=True, int_hashes=True)``.
    """

    layout: str = "array"
    replay_topic: bool = False
    int_hashes: bool = False

    def __post_init__(self) -> None:
        if self.layout not in ("array", "map"):
            raise KVCacheError(f"layout: expected 'array' or 'map', got {self.layout!r}")


def encode_batch(events: Sequence[CacheEvent], *, ts: float, dp_rank: int, wire: EventWire = EventWire()) -> bytes:
    """One ``KVEventBatch`` payload: ``[ts, [event, ...], data_parallel_rank]`` as msgpack."""
    return pack_lists([float(ts), [_encode_event(e, wire) for e in events], dp_rank])


# vLLM's field names in declaration order, tag first (the map layout's keys; the array layout is the values).
_FIELDS = {
    BlockStored: ("type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name"),
    BlockRemoved: ("type", "block_hashes", "medium"),
    AllBlocksCleared: ("type",),
}


def _encode_event(event: CacheEvent, wire: EventWire) -> list[Any] | dict[str, Any]:
    """One event as vLLM's tagged struct: fields in declaration order, tag first."""
    kind = type(event)
    if kind is BlockStored:
        parent = event.parent_block_hash
        # token_ids stays an integer array: pack_lists writes it as msgpack ints
        values: list[Any] = ["BlockStored", _hashes(event.block_hashes, wire),
                             None if parent is None else _hash(parent, wire), event.token_ids, event.block_size,
                             None, event.medium, event.lora]
    elif kind is BlockRemoved:
        values = ["BlockRemoved", _hashes(event.block_hashes, wire), event.medium]
    elif kind is AllBlocksCleared:
        values = ["AllBlocksCleared"]
    else:
        raise TypeError(f"not a cache event: {type(event).__name__}")
    return values if wire.layout == "array" else dict(zip(_FIELDS[kind], values))


def _hashes(block_hashes: tuple[bytes, ...], wire: EventWire) -> tuple[bytes, ...] | list[int] | np.ndarray:
    """An event's hashes as ``_hash`` publishes each: the digests as they are (bin), or their low 64 bits, taken
    in one numpy pass for a long run of 32-byte digests (a prompt's) and packed as msgpack ints."""
    if not wire.int_hashes:
        return block_hashes
    joined = b"".join(block_hashes)
    if len(block_hashes) > 8 and len(joined) == 32 * len(block_hashes):
        return np.frombuffer(joined, dtype=">u8")[3::4].astype(np.uint64)
    return [_hash(h, wire) for h in block_hashes]


def _hash(block_hash: bytes, wire: EventWire) -> bytes | int:
    """A hash as vLLM's ``maybe_convert_block_hash`` publishes it: the digest, or its low 64 bits unsigned."""
    if wire.int_hashes:
        return int.from_bytes(block_hash, "big") & _LOW_64
    return bytes(block_hash)


class KVEventPublisher:
    """vLLM's ``ZmqEventPublisher`` without its thread: PUB for live batches, ROUTER for replay.

    The daemon's thread calls ``publish`` after each step and ``handle_replay``
    when the poller reports ``replay_socket`` readable; neither blocks.
    Sequence numbers start at 0 and grow by one per published batch; the last
    ``buffer_steps`` batches stay available for replay. A batch the PUB socket
    refuses (high-water mark) is still numbered and buffered, so subscribers
    see the gap and replay it.

    Replay streams several messages per request, as vLLM does: a DEALER peer
    receives them all; a REQ peer (vLLM's example subscriber) receives only
    the first, since a REQ socket takes one reply per request.

    ``listeners`` (the daemon's) binds both sockets as the daemon's others:
    ipc owner-only and locked, CURVE on tcp, errors naming ``events_endpoint``
    or ``events_replay_endpoint``.
    """

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        buffer_bytes: int = 256 << 20,
        dp_rank: int = 0,
        send_bytes: int = 64 << 20,
        wire: EventWire = EventWire(),
        listeners: Listeners | None = None,
    ) -> None:
        if buffer_steps < 1:
            raise KVCacheError(f"buffer_steps: must be at least 1, got {buffer_steps}")
        self.topic = topic.encode("utf-8")
        self.dp_rank = dp_rank
        self.wire = wire
        self.next_seq = 0
        self.num_dropped = 0
        self.buffer_steps, self.buffer_bytes = buffer_steps, buffer_bytes
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque()
        self._buffered_bytes = 0
        self._pub = context.socket(zmq.PUB)
        self.replay_socket: zmq.Socket | None = None
        self._recv_replay: Any = None
        bind = listeners.bind if listeners is not None else lambda sock, where, _field: sock.bind(where)
        try:
            # A slow subscriber's queue holds at most send_bytes: larger batches are only replayed.
            self._pub.setsockopt(zmq.SNDHWM, max(1, send_bytes // LIVE_BATCH_BYTES))
            bind(self._pub, endpoint, "events_endpoint")
            if replay_endpoint:
                self.replay_socket = context.socket(zmq.ROUTER)
                # Room for one whole replay, so a replay is never cut short silently (its frames share the
                # buffer's bytes); mandatory routing turns a full or vanished peer into an error we can see.
                self.replay_socket.setsockopt(zmq.SNDHWM, buffer_steps + 1)
                self.replay_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
                bind(self.replay_socket, replay_endpoint, "events_replay_endpoint")
                self._recv_replay = (listeners.receiver(self.replay_socket) if listeners is not None
                                     else self.replay_socket.recv_multipart)
        except (zmq.ZMQError, KVCacheError):
            self.close()
            raise

    def publish(self, events: Sequence[CacheEvent]) -> int:
        """Send ``events`` as one batch; returns its sequence number, or -1 when there is nothing to send."""
        if not events:
            return -1
        payload = encode_batch(events, ts=time.time(), dp_rank=self.dp_rank, wire=self.wire)
        seq = self.next_seq
        self.next_seq += 1
        buffer = self._buffer
        buffer.append((seq, payload))
        self._buffered_bytes += len(payload)
        while len(buffer) > 1 and (len(buffer) > self.buffer_steps or self._buffered_bytes > self.buffer_bytes):
            self._buffered_bytes -= len(buffer.popleft()[1])
        if len(payload) > LIVE_BATCH_BYTES:  # subscribers see the gap at the next batch and replay it
            self.num_dropped += 1
            return seq
        try:
            self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.num_dropped += 1
        return seq

    def handle_replay(self) -> None:
        """Answer one pending replay request, if any: every buffered batch from its start seq, then the end marker.

        A peer whose queue fills mid-replay gets no end marker (its request
        times out and it asks again); a malformed request gets no reply, as in vLLM.
        """
        sock = self.replay_socket
        if sock is None:
            return
        try:
            frames = self._recv_replay(zmq.NOBLOCK)
        except zmq.Again:
            return
        if frames is None:  # a client revoked since it connected
            return
        if len(frames) != 3:
            log.warning("replay: ignoring a request of %d frames (expected identity, empty, start seq)", len(frames))
            return
        client, _, start = frames
        head = [client, b"", self.topic] if self.wire.replay_topic else [client, b""]
        end = [client, b"", b"", END_SEQ, b""] if self.wire.replay_topic else [client, b"", END_SEQ, b""]
        try:
            for seq, payload in self._since(int.from_bytes(start, "big")):
                sock.send_multipart([*head, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK, copy=False)
            sock.send_multipart(end, flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("replay: peer's queue is full; replay cut short without an end marker")
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            log.info("replay: peer left before its replay was sent")

    def close(self) -> None:
        """Close both sockets at once (linger 0): unsent batches are dropped."""
        self._pub.close(linger=0)
        if self.replay_socket is not None:
            self.replay_socket.close(linger=0)

    def _since(self, start_seq: int) -> Iterator[tuple[int, bytes]]:
        """Buffered (seq, payload) pairs with seq >= ``start_seq``, oldest first (seqs in the buffer are contiguous)."""
        if not self._buffer:
            return iter(())
        skip = max(0, start_seq - self._buffer[0][0])
        return itertools.islice(self._buffer, skip, None)

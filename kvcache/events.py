"""KV cache events on ZeroMQ in vLLM's publisher format, so a router built for vLLM can index this daemon's cache.

The default encoding is vLLM 0.33's (``vllm/distributed/kv_events.py``: ``KVEventBatch``, ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``, ``ZmqEventPublisher``): msgspec structs, the batch ``array_like``, the
events tagged maps with ``omit_defaults``; tests/vectors holds batches vLLM 0.33 encoded itself, which this
module reproduces byte for byte. ``--events-format array`` speaks the generation before vLLM's events became maps (every
struct ``array_like``), as its example subscribers decode it. We write the bytes with our msgpack codec
(``kvcache._wire``, token ids straight from their array)::

    live (PUB)       [topic, seq (8 bytes, big-endian), payload]
    payload          [ts (float64), [event, ...], data_parallel_rank]
    event, map       {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                      "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                      "kv_cache_spec_sliding_window"}   (the last four left out where None)
                     {"type": "BlockRemoved", "block_hashes", "medium", "group_idx"}
                     {"type": "AllBlocksCleared"}
    event, array     ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                      lora_id, medium, lora_name]
                     ["BlockRemoved", block_hashes, medium]
                     ["AllBlocksCleared"]
    replay request   [start seq (8 bytes)] from a REQ peer (its socket adds the empty delimiter), or
                     [b"", start seq] from a DEALER peer, to the ROUTER
    replay reply     [b"", (topic,) seq, payload] per buffered batch with seq >= start, then
                     [b"", (b"",) END_SEQ, b""]; the topic frame only with ``replay_topic``

The topic (``--events-topic``) is empty by default, as vLLM's; llm-d's indexer subscribes to ``kv@`` and reads
the pod and model from ``kv@POD@MODEL``. ``data_parallel_rank`` (``--data-parallel-rank``) is the rank a router
credits the batch's blocks to: each daemon of a data-parallel engine names its own.

Events are per row group (rows sharing one policy, see kvcache.allocator.events), published under vLLM's
``group_idx`` with ``group_numbers``: a daemon serving a model (``--model``) numbers them as vLLM does when it
groups that model's layers, one event per vLLM group of the row group's policy (Gemma 3: six sliding groups 0-5, then the
full one, 6; ``kvcache.allocator.groups``), so a router keyed on ``group_idx`` sees one numbering from it and from
a vLLM worker; ``--events-groups policy`` keeps one group per policy. A store names its group's kind
(``full_attention``, ``sliding_window`` or ``chunked_local_attention``) and window, so a router tells a window
group's blocks from a full group's. ``extra_keys`` holds one entry per block, untagged as vLLM
publishes them (the LoRA's name, ``[mm identifier, offset]`` pairs, the salt), or
None for a block with none. ``lora_id`` is always None (no adapter ids here).
msgspec writes every field of an ``array_like`` struct, defaults included, and
decoders ignore trailing elements they do not know, so the array form stops
after ``lora_name``, the last field without a default.

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
from kvcache.allocator.events import AllBlocksCleared, BlockRemoved, BlockStored, renumber_groups
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

    The default is vLLM 0.33's: events as tagged maps under ``"type"`` with
    the row group's ``group_idx``, ``kv_cache_spec_kind`` and
    ``kv_cache_spec_sliding_window`` and each block's ``extra_keys``, hashes
    as the low 64 bits of the digest (vLLM's default,
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) and the topic frame in replay
    replies. ``layout="array"`` writes each event as the tagged array of vLLM
    before its events became maps (block_hashes through lora_name only), and with
    ``replay_topic=False, int_hashes=False`` it is that generation's whole
    encoding (``--events-format array``).
    """

    layout: str = "map"
    replay_topic: bool = True
    int_hashes: bool = True

    def __post_init__(self) -> None:
        if self.layout not in ("array", "map"):
            raise KVCacheError(f"layout: expected 'array' or 'map', got {self.layout!r}")


OLDER_ARRAY_WIRE = EventWire("array", replay_topic=False, int_hashes=False)  # --events-format array


def encode_batch(events: Sequence[CacheEvent], *, ts: float, dp_rank: int, wire: EventWire = EventWire()) -> bytes:
    """One ``KVEventBatch`` payload: ``[ts, [event, ...], data_parallel_rank]`` as msgpack."""
    return pack_lists([float(ts), [_encode_event(e, wire) for e in events], dp_rank], _WideMap)


class _WideMap(dict):
    """A BlockStored map: msgspec sizes a struct's map header for its tag and every field (16 for BlockStored,
    a map 16) before it leaves out the defaults, so it is written with a map 16 header however short."""


# vLLM's field names in declaration order, tag first (the map layout's keys; the array layout is the values);
# the map layout adds the optional fields after them where they are not None (msgspec's omit_defaults).
_FIELDS = {
    BlockStored: ("type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name"),
    BlockRemoved: ("type", "block_hashes", "medium"),
    AllBlocksCleared: ("type",),
}
FULL_ATTENTION, SLIDING_WINDOW = "full_attention", "sliding_window"  # vLLM's KVCacheSpecKind values
CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"


def _encode_event(event: CacheEvent, wire: EventWire) -> list[Any] | dict[str, Any]:
    """One event as vLLM's tagged struct: fields in declaration order, tag first."""
    kind = type(event)
    if kind is BlockStored:
        parent = event.parent_block_hash
        lora = event.lora if event.lora is None or isinstance(event.lora, str) else event.lora[0]
        # token_ids stays an integer array: pack_lists writes it as msgpack ints
        values: list[Any] = ["BlockStored", _hashes(event.block_hashes, wire),
                             None if parent is None else _hash(parent, wire), event.token_ids, event.block_size,
                             None, event.medium, lora]
        if wire.layout == "array":
            return values
        out = _WideMap(zip(_FIELDS[kind], values))
        if event.extra_keys is not None:
            out["extra_keys"] = event.extra_keys
        out["group_idx"] = event.group
        out["kv_cache_spec_kind"] = (SLIDING_WINDOW if event.window is not None else
                                     CHUNKED_LOCAL_ATTENTION if event.chunk is not None else FULL_ATTENTION)
        if event.window is not None:
            out["kv_cache_spec_sliding_window"] = event.window
        return out
    if kind is BlockRemoved:
        values = ["BlockRemoved", _hashes(event.block_hashes, wire), event.medium]
        if wire.layout == "array":
            return values
        return {**dict(zip(_FIELDS[kind], values)), "group_idx": event.group}
    if kind is AllBlocksCleared:
        return ["AllBlocksCleared"] if wire.layout == "array" else {"type": "AllBlocksCleared"}
    raise TypeError(f"not a cache event: {type(event).__name__}")


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
    or ``events_replay_endpoint``. ``group_numbers`` (``vllm_group_numbers``)
    publishes each row group's events once under each of its numbers; None
    publishes them under the row group's own.
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
        group_numbers: Sequence[Sequence[int]] | None = None,
    ) -> None:
        if buffer_steps < 1:
            raise KVCacheError(f"buffer_steps: must be at least 1, got {buffer_steps}")
        if group_numbers is not None and not all(group_numbers):
            raise KVCacheError("group_numbers: every row group needs at least one number")
        self.group_numbers = None if group_numbers is None else tuple(tuple(n) for n in group_numbers)
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
        if self.group_numbers is not None:
            events = renumber_groups(events, self.group_numbers)
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

"""The cache daemon: one thread owns a KVCacheManager and serves schedulers and workers over ZMQ.

Sockets (see protocol.py for the messages):

    endpoint          ROUTER  schedulers and admin tools send steps of operations
    pub_endpoint      PUB     sequence-numbered table deltas for workers
    replay_endpoint   ROUTER  missed deltas by sequence number, or a snapshot
    events_endpoint   PUB     KV events in vLLM's format (with --events)
    events_replay_endpoint
                      ROUTER  missed KV events by sequence number (with --events)
    local_endpoint    Unix datagram socket: the same messages as endpoint, from same-host clients,
                      without ZMQ's I/O threads (a round trip of about 16 µs instead of 166 on a VM)

Every ipc socket is owner-only and locked against a second daemon on its path; with CURVE every other
socket admits only the allowed clients, re-read on ``reload_clients`` (see kvcache.listeners).

A step's reply goes out first, then its deltas, in the same turn of the loop (both only once the
journal made them durable): a scheduler that has the reply (with its ``seq``) knows the deltas follow
at once, and its round trip does not wait for their encoding. Workers wait for that ``seq``.
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import heapq
import logging
import os
import socket
import stat
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import zmq

from kvcache import __version__
from kvcache.allocator import _tables
from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.manager import KVCacheManager, _Request
from kvcache.allocator.owned import _Owned
from kvcache.allocator.pool import BlockPool
from kvcache.allocator.prefix import BlockHasher, Inserted, MMPlaceholder, PrefixIndex
from kvcache.allocator.rows import Row
from kvcache.allocator.swa import Chunked, Full, Window
from kvcache.auth import HANDSHAKE_FAILURES, CurveConfig, start_authenticator
from kvcache.config import LOCAL_OFF, ServeConfig, describe_rows
from kvcache.deltas import Changes, DeltaStream
from kvcache.host_tier import TIER_OPS, DaemonTier, TierJob
from kvcache.journal import Journal, JournalFull, Recovered
from kvcache.keys import RELOAD_STATUS, write_reload_status
from kvcache.leases import Leases
from kvcache.listeners import Listeners
from kvcache.paths import remove_socket_file
from kvcache.rank_keys import admin_key, key_file_of
from kvcache.state_codec import StateCodec
from kvcache.pd.state import MUTATING as _PD_MUTATING
from kvcache.pd.state import MAX_ERROR, PD_OPS, PDState, Transfer, validate_op
from kvcache.protocol import (
    DELTA_HEAD_BYTES,
    DELTA_TOPIC,
    INT64_MAX,
    INT64_MIN,
    JOURNAL_VERSIONS,
    LOCAL_MAX_BYTES,
    LOCAL_SUBSCRIBE,
    LOCAL_UNSUBSCRIBE,
    MAX_ID_CHARS,
    MAX_LOCAL_SUBSCRIBERS,
    MAX_OPS,
    PROTOCOL_VERSION,
    ProtocolError,
    check_caller,
    check_int,
    check_lora,
    check_mm,
    check_optional_str,
    check_request_id,
    check_tokens,
    error_reply,
    header,
    pack,
    resend_reply,
    seq_frame,
    show,
    stamp_delta,
    unpack,
)

log = logging.getLogger("kvcache.server")
_SNDMORE, _NOBLOCK = int(zmq.SNDMORE), int(zmq.NOBLOCK)  # plain ints: pyzmq's flag enums combine in Python
_SNDMORE_NOBLOCK = _SNDMORE | _NOBLOCK
_REQUEST_OPS = frozenset({"admit", "reserve", "extend", "free", "table"})  # ops that name one request (op["req"])
_OWNED_OPS = frozenset({"match_blocks", "allocate_blank", "commit_blocks", "release_blocks", "owned_blocks"})
_MUTATING = (frozenset({"admit", "extend", "extend_many", "free", "reset_prefix_cache", "reclaim", "match_blocks",
                        "allocate_blank", "commit_blocks", "release_blocks", "evict_cached"}) | _PD_MUTATING
             | TIER_OPS)
_LEASE_CLIENT = "kvcache-lease-expiry"
# Settings a journal records: its records are replayed under the first three (the limits they were accepted
# with); the recovered state must fit the rest (_fit_settings).
_REPLAY_SETTINGS = ("max_tokens", "max_message_bytes", "max_slots")
_JOURNALED_SETTINGS = (*_REPLAY_SETTINGS, "role", "tp")
SNAPSHOT_RETRY_S = 10.0  # a snapshot that found the disk full is tried again after this long
# The largest delta the PUB sends as it is: the one that fits a local-endpoint datagram with its head. A larger one
# goes as a heartbeat of its seq on either path, which sends workers to the replay socket for it.
PUB_MAX_DELTA_BYTES = LOCAL_MAX_BYTES - DELTA_HEAD_BYTES
REPLAY_HWM = 4  # replies queued per replay peer
_OP_ERROR_BYTES = 2 * MAX_ID_CHARS + 512  # an op's {"error": message} result at most (a message names ids)
METRICS_INTERVAL_S = 0.05  # a busy daemon counts its messages in the metrics at most this often
_PD_CLIENT = "kvcache-transfer-expiry"
_TIER_CLIENT = "kvcache-tier-expiry"


def _check_compatible(journaled: KVCacheManager, configured: KVCacheManager, cfg: ServeConfig) -> None:
    """Refuse a journal written for another geometry or prefix hash, naming the setting that differs."""
    old_hasher, new_hasher = journaled.hasher, configured.hasher
    for name, old, new in (
        ("num_blocks", journaled.num_blocks, configured.num_blocks),
        ("block_size", journaled.block_size, configured.block_size),
        ("rows", journaled.rows, configured.rows),
        ("row_blocks", journaled.row_blocks.tolist(), configured.row_blocks.tolist()),
        ("enable_prefix_caching", journaled.enable_prefix_caching, configured.enable_prefix_caching),
        ("hash_algorithm", old_hasher and old_hasher.algorithm, new_hasher and new_hasher.algorithm),
    ):
        if old != new:
            raise KVCacheError(f"journal: {name} is {old!r} in the journal but {new!r} in this configuration")
    old_tier, new_tier = (m.tier.num_blocks if isinstance(m.tier, DaemonTier) else 0 for m in (journaled, configured))
    if old_tier != new_tier:
        raise KVCacheError(f"journal: the host tier holds {old_tier} blocks in the journal but {new_tier} in this "
                           "configuration (host_memory / host_block_budget); start with the journal's size")
    if old_hasher is not None and old_hasher.root != new_hasher.root:
        if cfg.hash_seed:
            raise KVCacheError("journal: hash_seed differs from the one the journal's cached prefixes were hashed "
                               "with; start with the same --hash-seed, or none to keep the journal's")
        # A journal from a daemon with another seed, or from before the default root was fixed: its prefixes
        # keep their hashes, so they still hit here, but a router indexing several daemons sees them apart.
        log.warning("journal: keeps the hash root its cached prefixes were hashed with, not the default one; "
                    "a router sees this daemon's block hashes differ from other daemons' until it starts with a "
                    "new journal")


@dataclass(slots=True)
class _Op:
    """One validated operation, ready to apply."""

    kind: str
    req: Any = None
    tokens: np.ndarray | None = None
    salt: str | None = None
    lora: str | tuple[str, str] | None = None  # a LoRA name, or (name, path)
    mm: list | None = None
    number: int | None = None  # num_tokens (admit, can_admit) or num_computed (extend)
    slot: int | None = None
    reqs: list | None = None  # extend_many: the requests
    counts: np.ndarray | None = None  # extend_many: tokens per request
    pd: dict[str, Any] | None = None  # PD fields: reserve's timeout, a prefill admit's dest, a PD op's own
    slots: np.ndarray | None = None  # extend_many: the requests' rows in the manager's arrays, when all were found
    ahead: int = 0  # extend, extend_many: positions the table covers past the tokens (num_lookahead_tokens)


class _RetryCache:
    """The replies to clients' recent requests, so a retried request is answered again, never applied twice.

    Bounded per client (``per_client`` replies) and in all (``max_bytes``: each reply's bytes plus
    ``ENTRY_BYTES``, each client's record ``CLIENT_BYTES``), the oldest dropped first. Each reply keeps a digest
    of its request, so a different request reusing an id is told from a retry. Beyond the replies, each client's
    answered ids are remembered as a few ranges (ids count up from a random start per client), so a retry whose
    reply was dropped is recognised and refused instead of applied again. That takes ids that count up by one per
    request (as CacheClient's do); other ids are told apart from retries only while their replies are kept.
    """

    ENTRY_BYTES = 160  # what a kept reply costs beyond its bytes (keys, tuple, dict slot)
    CLIENT_BYTES = 512  # what a client's record costs (its name, id ranges and queue)
    RANGES = 8  # id ranges kept per client, the newest: a lost request or a restarted client starts a new one

    def __init__(self, per_client: int, max_bytes: int) -> None:
        self.per_client = per_client
        self.max_bytes = max_bytes
        self.bytes = 0
        self._replies: collections.OrderedDict[tuple[str, int], tuple[int, bytes]] = collections.OrderedDict()
        self._order: dict[str, collections.deque[int]] = {}  # client -> its kept ids, oldest first
        self._answered: collections.OrderedDict[str, list[list[int]]] = collections.OrderedDict()  # id ranges

    def get(self, client: str, request_id: int) -> tuple[int, bytes] | None:
        """The kept (digest, reply) of a request, or None."""
        return self._replies.get((client, request_id))

    def answered(self, client: str, request_id: int) -> bool:
        """Whether ``request_id`` of ``client`` lies in the ids it has had answered (kept reply or not)."""
        return any(low <= request_id <= high for low, high in self._answered.get(client, ()))

    def put(self, client: str, request_id: int, digest: int, reply: bytes) -> None:
        """Remember a request's answer; drops the oldest replies (and client records) past the limits."""
        ranges = self._answered.get(client)
        if ranges is None:
            ranges = self._answered[client] = []
            self.bytes += self.CLIENT_BYTES
        else:
            self._answered.move_to_end(client)
        if ranges and ranges[-1][1] + 1 == request_id:
            ranges[-1][1] = request_id
        else:
            ranges.append([request_id, request_id])
            if len(ranges) > self.RANGES:
                del ranges[0]
        cost = len(reply) + self.ENTRY_BYTES
        if cost <= self.max_bytes and self.per_client > 0:
            self._replies[(client, request_id)] = (digest, reply)
            self._order.setdefault(client, collections.deque()).append(request_id)
            self.bytes += cost
            if len(self._order[client]) > self.per_client:
                self._drop(client, self._order[client][0])
        self._trim()

    def limit(self, per_client: int, max_bytes: int) -> None:
        """Apply new limits (a restarted daemon's settings), dropping the oldest replies past them."""
        self.per_client, self.max_bytes = per_client, max_bytes
        for client, order in list(self._order.items()):
            while len(order) > per_client:
                self._drop(client, order[0])
        self._trim()

    def _trim(self) -> None:
        while self.bytes > self.max_bytes and self._replies:
            (client, request_id), _ = next(iter(self._replies.items()))
            self._drop(client, request_id)
        while self.bytes > self.max_bytes and self._answered:  # no reply left: the quietest clients' records go
            client, _ = self._answered.popitem(last=False)
            self.bytes -= self.CLIENT_BYTES

    def _drop(self, client: str, request_id: int) -> None:
        """Forget the reply of ``client``'s oldest kept request, ``request_id`` (its id stays answered)."""
        _, reply = self._replies.pop((client, request_id))
        self.bytes -= len(reply) + self.ENTRY_BYTES
        order = self._order[client]
        assert order[0] == request_id, f"reply {request_id} of {client!r} dropped out of order"
        order.popleft()
        if not order:
            del self._order[client]


class _Slots:
    """Which batch slot each live request holds: the one the scheduler named, else the lowest free."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.of: dict[Any, int] = {}  # request -> slot
        self.owner: dict[int, Any] = {}  # slot -> request
        self._free: list[int] = []  # min-heap of released slots; may hold stale (re-taken) entries
        self._next = 0  # slots at and above this were never handed out automatically

    def available(self, wanted: int | None) -> bool:
        if wanted is not None:
            return wanted not in self.owner
        return len(self.owner) < self.limit

    def take(self, req: Any, wanted: int | None) -> int:
        if wanted is None:
            while self._free and self._free[0] in self.owner:
                heapq.heappop(self._free)
            if self._free:
                wanted = heapq.heappop(self._free)
            else:
                while self._next in self.owner:
                    self._next += 1
                wanted = self._next
                self._next += 1
        assert wanted not in self.owner and wanted < self.limit, f"slot {wanted} is not free"
        self.of[req] = wanted
        self.owner[wanted] = req
        return wanted

    def release(self, req: Any) -> None:
        slot = self.of.pop(req)
        del self.owner[slot]
        heapq.heappush(self._free, slot)


class CacheServer:
    """The daemon's state and sockets; ``serve`` runs the loop in the calling thread (the owner)."""

    def __init__(self, config: ServeConfig, manager: KVCacheManager, *, layout: Sequence[Row] | None = None,
                 context: zmq.Context | None = None, extra_info: dict[str, Any] | None = None) -> None:
        """``layout`` names the (layer, kv head) cells of each of the manager's rows, for workers to find the
        rows of their rank and layers (``kvcache.serve.build_manager`` gives it from a model's config)."""
        if layout is not None and [r.policy for r in layout] != list(manager.rows):
            raise KVCacheError(f"layout: its {len(layout)} rows' policies differ from the manager's rows")
        self.config = config.resolved()
        self.manager = manager
        self.layout = None if layout is None else tuple(layout)
        # The info reply's row cells at most: a msgpack int of a layer or head takes up to 5 bytes.
        self._cell_bytes = 5 * sum(len(r.layers) + len(r.kv_heads) for r in self.layout or ())
        self._extra_info = extra_info or {}
        self._ctx = context or zmq.Context.instance()
        self._sockets: list[zmq.Socket] = []
        self._retries = _RetryCache(self.config.dedupe_window, self.config.dedupe_bytes)
        self._slots = _Slots(self.config.max_slots)
        self._deltas = DeltaStream(self.config.replay_buffer, self.config.replay_bytes)
        self._last_publish = 0.0
        self._staged_events: list[Any] = []
        self._journal: Journal | None = None
        self._leases = Leases(self.config.lease_timeout)
        self._next_lease_check = 0.0
        self._pd = PDState(self.config.role, self.config.tp, manager.num_rows, manager.num_blocks, manager.block_size,
                           self.config.transfer_timeout)
        self._next_pd_check = 0.0
        self._tier_deadlines: dict[int, float] = {}  # host-tier copies in flight: when each counts as failed
        self._next_tier_check = 0.0
        self._expired = 0
        self._next_snapshot = 0.0  # time.monotonic() before which a snapshot that found the disk full is not retried
        self._metrics: Any = None
        self._observed: list[tuple[list[_Op], float]] = []  # answered messages whose metrics are not yet counted
        self._next_observe = 0.0
        self._events: Any = None
        self._subscribers: Any = None
        self._local_subscribers: dict[str | bytes, None] = {}  # workers taking deltas as datagrams, by address
        self._auth: Any = None
        self._admin_key: int | None = None  # set once the endpoint is bound (its folder holds the key file)
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
            self._admin_key = admin_key(self.config.endpoint, self.config.curve_server_cert or None, create=True)
            self._recv_replay = self._listeners.receiver(self.replay)
            if self.config.local_endpoint != LOCAL_OFF:
                self.local = self._bind_local(Path(self.config.local_endpoint))
            self._setup_optional()
            if self.config.journal:
                self._recover()
            if self._metrics is not None:  # served once they show this daemon's state, not a fresh one's zeros
                self._observe(force=True)
                self._next_observe = 0.0  # the state at start is no message: the first one is counted at once
                if self.config.metrics_port:
                    self._metrics.serve_http(self.config.metrics_port)
        except BaseException:
            self.close()
            raise
        self._topic = DELTA_TOPIC + self._deltas.epoch.to_bytes(8, "big")

    @property
    def epoch(self) -> int:
        """This daemon's epoch: random per incarnation, kept by its journal (workers resync when it changes)."""
        return self._deltas.epoch

    @property
    def _seq(self) -> int:
        return self._deltas.seq

    @property
    def _history(self) -> Any:
        return self._deltas.history

    # ------------------------------------------------------------------ lifecycle

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

    def _setup_optional(self) -> None:
        """Metrics, subscriber counting and KV events, when their modules and settings allow."""
        try:
            from kvcache.metrics import DaemonMetrics, SubscriberCounter
        except ImportError:  # metrics are optional: prometheus-client may be absent
            DaemonMetrics = SubscriberCounter = None  # type: ignore[assignment,misc]
        if DaemonMetrics is not None:
            self._metrics = DaemonMetrics(self.manager.num_rows, pd=self.config.role != "both",
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

    def _recover(self) -> None:
        """Open the journal: load its snapshot and replay the messages after it, or start a new one.

        A journal keeps the daemon's epoch, so workers keep their tables across
        the restart: every delta they saw was durable before it was sent. The
        messages are replayed under the limits they were accepted with; the
        recovered state must then fit this configuration, or the daemon refuses
        to start, naming the setting. Nothing acknowledged is ever dropped.
        """
        self._journal = Journal(self.config.journal)
        recovered = self._journal.open()
        if recovered.snapshot is None:
            self._journal.write_snapshot(self._state())
            log.info("journal %s: new", self.config.journal)
            return
        journaled = self.restore_journal(recovered)
        if any(journaled[name] != getattr(self.config, name) for name in _JOURNALED_SETTINGS):
            self._journal.write_snapshot(self._state())  # later records follow this configuration's limits
        if recovered.truncated_bytes:
            log.warning("journal %s: cut a torn tail of %d bytes after offset %d (a commit that was never "
                        "acknowledged)", self.config.journal, recovered.truncated_bytes, recovered.records_end)
        log.info("journal %s: recovered %d requests at seq %d (%d messages replayed)", self.config.journal,
                 len(self.manager), self._deltas.seq, len(recovered.records))

    def restore_journal(self, recovered: Recovered) -> dict[str, Any]:
        """Take a journal's snapshot and replay its records as a restart does, checking that the state is whole
        and fits this configuration; returns the settings the journal was written with.

        ``kvcache journal check`` runs this same path, so what it calls recoverable is what a restart
        recovers. A snapshot whose parts disagree (damaged, or edited by hand) is refused, naming what, before
        its records are replayed over it.
        """
        assert recovered.snapshot is not None, "no snapshot to restore"
        try:
            journaled = self._restore(load_state(recovered.snapshot), recovered.records, recovered.snapshot_lsn)
            self._fit_settings(journaled)
            self._check_recovered("after its log is replayed")
        except KVCacheError:
            raise
        except Exception as exc:  # noqa: BLE001 - a snapshot's values reach code that trusts its own state
            raise KVCacheError(f"journal: the snapshot's state is malformed ({type(exc).__name__}: {exc}); the "
                               "journal is damaged or was edited") from None
        return journaled

    def _check_recovered(self, when: str) -> None:
        """Refuse a recovered state whose parts disagree, naming the first disagreement (the integrity checks)."""
        slots, manager = self._slots, self.manager
        try:
            assert type(slots.of) is dict and type(slots.owner) is dict, "slots: not maps"
            assert all(type(slot) is int and slot >= 0 for slot in slots.owner), \
                "slots: a batch slot that is not an integer >= 0"
            assert len(slots.of) == len(slots.owner) and all(slots.of.get(req) == slot
                                                              for slot, req in slots.owner.items()), \
                "slots: the requests' slots and the slots' requests disagree"
            assert type(slots._next) is int and type(slots._free) is list and all(
                type(slot) is int and slot >= 0 for slot in slots._free), "slots: a free slot that is not an integer"
            assert len(slots.of) == len(manager) and all(req in manager for req in slots.of), \
                f"slots: {len(slots.of)} requests hold batch slots but the manager holds {len(manager)}"
            manager.check_integrity()
            self._pd.check_integrity(manager)
            if self.tier is not None:
                self.tier.check_integrity()
        except AssertionError as exc:
            raise KVCacheError(f"journal: the recovered state is inconsistent {when} ({exc}); the journal is "
                               "damaged or was edited; nothing was changed") from None

    def _restore(self, state: dict[str, Any], records: list[bytes], snapshot_lsn: int) -> dict[str, Any]:
        """Take a snapshot's state and replay the records after it, under the limits they were accepted with;
        returns the settings the journal was written with."""
        journaled = state["settings"]
        _check_compatible(state["manager"], self.manager, self.config)
        state["manager"].enable_events = self.manager.enable_events
        self.manager = state["manager"]
        if isinstance(self.manager.tier, DaemonTier):
            self.manager.tier.bind(self.manager)
        self._slots, self._deltas.seq, self._deltas.epoch = state["slots"], state["seq"], state["epoch"]
        self._retries, self._leases, self._pd = state["retries"], state["leases"], state["pd"]
        self._leases.timeout = self.config.lease_timeout
        self._check_recovered("in its snapshot")  # before any record runs over it
        configured = self.config
        self.config = dataclasses.replace(configured, **{name: journaled[name] for name in _REPLAY_SETTINGS})
        try:
            for lsn, payload in enumerate(records, snapshot_lsn + 1):
                reply = unpack(self._process(payload, replaying=True), 1 << 40)
                if not reply.get("ok"):
                    raise KVCacheError(f"journal: record {lsn} was accepted when written but is refused on replay "
                                       f"({reply.get('error')}); the journal does not fit this version of kvcache")
        finally:
            self.config = configured
        self._deltas.encode_staged(self.manager.num_rows)  # kept for replay (workers may still ask for them), never sent live
        self._staged_events.clear()
        self.manager.take_events()
        self._pd.forget_timing()
        tier = self.tier
        if tier is not None:  # copies in flight get a full deadline from now (the clock restarted with us)
            tier.take_orders()
            end = time.monotonic() + self.config.tier_timeout
            self._tier_deadlines = {job: end for job in tier.pending_jobs()}
        return journaled

    def _fit_settings(self, journaled: dict[str, Any]) -> None:
        """Check that the recovered state fits this configuration and apply its limits, or refuse to start."""
        cfg = self.config
        used = max(self._slots.owner, default=-1)
        if used >= cfg.max_slots:
            raise KVCacheError(f"max_slots: the journal's requests hold batch slot {used} (written with max_slots "
                               f"{journaled['max_slots']}), which {cfg.max_slots} does not reach; start with "
                               f"--max-slots {journaled['max_slots']}")
        self._slots.limit = cfg.max_slots
        if (cfg.role, cfg.tp) != (self._pd.role, self._pd.tp):
            name, old, new = ("role", self._pd.role, cfg.role) if cfg.role != self._pd.role else ("tp", self._pd.tp,
                                                                                                   cfg.tp)
            if self._pd.transfers:
                raise KVCacheError(f"{name}: the journal was written with {name} {old!r} and holds "
                                   f"{len(self._pd.transfers)} transfer(s) in flight, which {name} {new!r} cannot "
                                   f"carry on; start with --{name} {old} until they end")
            totals = self._pd.totals
            self._pd = PDState(cfg.role, cfg.tp, self.manager.num_rows, self.manager.num_blocks,
                               self.manager.block_size, cfg.transfer_timeout)
            self._pd.totals = totals
        self._pd.timeout = cfg.transfer_timeout
        self._retries.limit(cfg.dedupe_window, cfg.dedupe_bytes)

    def _state(self) -> list[bytes | memoryview]:
        """Everything a restart needs, for a journal snapshot (as pieces to write in turn)."""
        return dump_state({"manager": self.manager, "slots": self._slots, "seq": self._deltas.seq,
                           "epoch": self._deltas.epoch,
                           "retries": self._retries, "leases": self._leases, "pd": self._pd,
                           "settings": {name: getattr(self.config, name) for name in _JOURNALED_SETTINGS}})

    def close(self) -> None:
        """Close every socket, remove the socket and lock files this daemon created, and release its locks."""
        if self._auth is not None:  # first: its threads read the sockets' monitors, which closing would pull away
            self._auth.stop()
            self._auth = None
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        if self._events is not None:
            self._events.close()
        if self._metrics is not None:
            self._observe(force=True)
            self._metrics.close()
        if self._subscribers is not None:
            self._subscribers.close()
        for sock in self._sockets:
            sock.close(0)
        self._sockets.clear()
        if self.local is not None:
            self.local.close()
        if self._admin_key is not None and not self.config.curve_server_cert:
            admin_file = key_file_of(self.config.endpoint, "admin")  # a key only while this daemon holds the endpoint
            if admin_file is not None:
                admin_file.unlink(missing_ok=True)
        self._listeners.close()

    def serve(self, should_stop: Callable[[], bool] = lambda: False, poll_ms: int = 100) -> None:
        """Serve until ``should_stop()`` is true (checked at least every ``poll_ms``)."""
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
            if self._leases.timeout and time.monotonic() >= self._next_lease_check:
                self.expire_leases()
            if self._pd.transfers and time.monotonic() >= self._next_pd_check:
                self.expire_transfers()
            if self._tier_deadlines and time.monotonic() >= self._next_tier_check:
                self.expire_tier_copies()
            self._observe()  # what the last interval's messages left uncounted

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

    def expire_transfers(self, now: float | None = None) -> int:
        """Fail every PD transfer past its deadline (journaled like any message); returns how many."""
        now = time.monotonic() if now is None else now
        self._next_pd_check = now + 0.05
        late = self._pd.expired(now)
        if not late:
            return 0
        ops = [{"op": "transfer_failed", "req": r,
                "error": f"transfer timed out after {self._pd.transfers[r].timeout:g} s"} for r in late]
        reply = self._handle_own(_PD_CLIENT, ops)
        if not reply.get("ok"):
            log.error("transfer expiry failed: %s", reply.get("error"))
            return 0
        log.warning("%d transfer(s) timed out and were released", len(late))
        return len(late)

    @property
    def tier(self) -> DaemonTier | None:
        """The host tier (``--host-memory``), or None."""
        tier = self.manager.tier
        return tier if isinstance(tier, DaemonTier) else None

    def expire_tier_copies(self, now: float | None = None) -> int:
        """Fail every host-tier copy whose ranks did not all report it in time (journaled like any message)."""
        now = time.monotonic() if now is None else now
        self._next_tier_check = now + 0.05
        tier = self.tier
        live = set(tier.pending_jobs()) if tier is not None else set()
        self._tier_deadlines = {job: end for job, end in self._tier_deadlines.items() if job in live}
        late = [job for job, end in self._tier_deadlines.items() if end <= now]
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
        self._next_lease_check = now + min(1.0, self._leases.timeout / 4)
        freed = 0
        for client, reqs in self._leases.expired(now):
            # A request still in a PD transfer is cancelled instead: its blocks go once the writers stop.
            # A request that owns blocks instead of a table releases them (release_blocks).
            owned = [r for r in reqs if r not in self.manager and r not in self._pd.transfers]
            ops = [{"op": "cancel" if r in self._pd.transfers else "free", "req": r} for r in reqs
                   if r in self.manager or r in self._pd.transfers]
            for r in owned:
                ops += self._release_owned_ops(r)
            reply = self._handle_own(_LEASE_CLIENT, ops)
            self._leases.forget(client)
            self._pd.forget_owner(client)
            if reply.get("ok"):
                freed += len(reqs)
                self._expired += len(reqs)
                log.warning("lease of scheduler %r expired after %.1f s of silence: freed %d request(s)%s", client,
                            self._leases.timeout, len(reqs) - len(owned),
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

    def _heartbeat(self) -> None:
        """Tell workers the latest seq (empty payload): they catch a lost last delta or a new epoch."""
        self._last_publish = time.monotonic()
        try:
            self.pub.send_multipart([self._topic, seq_frame(self._deltas.seq), b""], zmq.NOBLOCK)
        except zmq.Again:
            pass
        if self._local_subscribers:
            self._fan_out(self._topic + seq_frame(self._deltas.seq), b"")

    # ------------------------------------------------------------------ scheduler steps

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
            reply = self._process(frames[-1])
            if self._journal is None:  # nothing to make durable first: answer before looking for the next one
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
                self._count_error("decode")
                continue
            if payload[:1] == LOCAL_SUBSCRIBE[:1]:  # not a msgpack map: a worker's (un)subscription
                self._subscription(payload, address)
                continue
            if len(payload) > LOCAL_MAX_BYTES:  # cut short by recvfrom: never decoded
                self._count_error("decode")
                outbox.append((address, error_reply(None, f"message: more than {LOCAL_MAX_BYTES} bytes, the "
                                                          "local endpoint's limit; send it over the ZMQ endpoint")))
                continue
            reply = self._process(payload)
            if self._journal is None:  # as _handle_step: nothing to make durable first
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
            self._count_error("decode")
            return
        elif address not in self._local_subscribers and (refusal := self._subscriber_refusal(address)):
            self._count_error("decode")
            self._send_local(address, error_reply(None, refusal))
            return
        elif address in self._local_subscribers or len(self._local_subscribers) < MAX_LOCAL_SUBSCRIBERS:
            self._local_subscribers[address] = None
            self._fan_out(self._topic + seq_frame(self._deltas.seq), b"", [address])
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

    def _answer(self, outbox: list[tuple[Any, bytes]], send: Callable[[Any, bytes], None]) -> None:
        """Commit the journal, then ``send(address, reply)`` each reply, then encode and publish the messages'
        deltas and events, then count them in the metrics, whichever socket they came in on.

        The group commit's order: nothing leaves before it is durable. Replies go first, so a scheduler's
        round trip does not wait for the deltas' encoding; its workers wait for the reply's ``seq`` anyway.
        """
        self._commit()
        for address, reply in outbox:
            send(address, reply)
        self._publish_staged()
        self._observe()

    def handle(self, payload: bytes, *, own: bool = False) -> bytes:
        """Apply one scheduler message, make it durable, publish its deltas; returns the reply. Never raises.

        ``own``: a message of the daemon's own (``_handle_own``), which alone may hold the daemon's ops."""
        reply = self._process(payload, own=own)
        self._commit()
        self._publish_staged()
        self._observe()
        return reply

    def _commit(self) -> None:
        """Make the messages applied since the last commit durable (one fdatasync; nothing without a journal).

        Space was reserved before they were applied, so this fails only on an I/O error; the daemon then stops
        without answering them, and a restart recovers what was acknowledged.
        """
        if self._journal is not None:
            try:
                self._journal.commit()
            except OSError as exc:
                log.critical("journal %s: commit failed (%s); stopping without answering the messages it held",
                             self.config.journal, exc)
                raise KVCacheError(f"journal: commit failed: {exc}") from None

    def _publish_staged(self) -> None:
        """Publish the staged deltas (durable by now) and events; then maybe compact the journal."""
        for seq, payload in self._deltas.encode_staged(self.manager.num_rows):
            self._send_delta(seq, payload)
        if self._events is not None and self._staged_events:
            self._events.publish(self._staged_events)
            self._staged_events = []
        if (self._journal is not None and self._journal.wal_bytes > self.config.snapshot_bytes
                and time.monotonic() >= self._next_snapshot):
            try:
                self._journal.write_snapshot(self._state())
            except (JournalFull, OSError) as exc:  # the log still holds everything: nothing is lost
                self._next_snapshot = time.monotonic() + SNAPSHOT_RETRY_S
                log.warning("journal %s: snapshot not written (%s); it is tried again in %g s, the log grows "
                            "meanwhile", self.config.journal, exc, SNAPSHOT_RETRY_S)

    def _process(self, payload: bytes, *, replaying: bool = False, own: bool = False) -> bytes:
        """Apply one scheduler message, journal it and stage its deltas; returns the reply. Never raises.

        An unexpected exception (a bug) is logged and answered as an internal
        error; the daemon goes on serving.
        """
        try:
            return self._process_checked(payload, replaying, own)
        except Exception as exc:  # the daemon must outlive its own bugs
            log.exception("internal error while handling a message")
            self._count_error("internal")
            try:  # the id, so that the client matches the reply to its request
                request_id = unpack(payload, self.config.max_message_bytes).get("id")
            except Exception:
                request_id = None
            return error_reply(request_id, f"internal error: {type(exc).__name__}: {exc}")

    def _process_checked(self, payload: bytes, replaying: bool, own: bool = False) -> bytes:
        start = time.perf_counter()
        request_id: Any = None
        try:
            msg = unpack(payload, self.config.max_message_bytes, max(MAX_OPS, self.config.max_tokens))
            if isinstance(msg, dict):
                request_id = msg.get("id")
            versions = JOURNAL_VERSIONS if replaying else (PROTOCOL_VERSION,)
            client, request_id, raw_ops = header(msg, versions=versions)
        except ProtocolError as exc:
            self._count_error("decode")
            return error_reply(request_id, str(exc))
        self._leases.touch(client, time.monotonic())
        digest = zlib.crc32(payload) | len(payload) << 32
        kept = self._retries.get(client, request_id)
        if kept is not None:
            if kept[0] != digest:
                self._count_error("validate")
                return error_reply(request_id, f"id: request id {request_id} of client {client!r} was answered "
                                               "before for a different request; a new request needs a new id")
            return kept[1]
        if self._retries.answered(client, request_id):
            self._count_error("validate")
            return error_reply(request_id, f"id: request id {request_id} of client {client!r} was answered before "
                                           "and its reply is no longer kept (the retry window passed); it was not "
                                           "applied again")
        try:
            # Who may send each op is checked here, once for every socket; a journal holds only messages already let
            # in (by the rules of their day), so a replay applies them as they were.
            ops = self._validate(raw_ops, trusted=own or replaying)
            bound = self._reply_bound(ops, client)
            if bound > self.config.max_reply_bytes:
                raise ProtocolError(f"reply: could take up to {bound:,} bytes, over the {self.config.max_reply_bytes:,} "
                                    "of --max-reply-bytes; ask for fewer or smaller tables per message")
        except ProtocolError as exc:
            self._count_error("validate")
            reply = error_reply(request_id, str(exc))
            self._retries.put(client, request_id, digest, reply)
            return reply
        journaled = self._journal is not None and not replaying and any(op.kind in _MUTATING for op in ops)
        if journaled:
            try:
                self._journal.reserve(len(payload))
            except JournalFull as exc:  # nothing applied; a retry once there is room is applied then
                self._count_error("journal")
                return error_reply(request_id, str(exc))
        results, deltas = self._apply(ops, client)
        stream = self._deltas
        for changes, freed, reset, orders in deltas:
            stream.stage(changes, freed, reset, orders)
        reply = pack({"v": PROTOCOL_VERSION, "id": request_id, "ok": True, "epoch": stream.epoch, "seq": stream.seq,
                      "results": results})
        if len(reply) > self.config.max_reply_bytes:
            log.warning("a reply of %d bytes passed --max-reply-bytes (%d), above its bound of %d bytes",
                        len(reply), self.config.max_reply_bytes, bound)
        self._retries.put(client, request_id, digest, reply)
        if journaled:
            self._journal.append(payload)
        if self._events is not None:
            self._staged_events.extend(self.manager.take_events())
        if self._metrics is not None and not replaying:  # a replayed message's counts reach them by difference
            self._observed.append((ops, time.perf_counter() - start))
        return reply

    def _reply_bound(self, ops: list[_Op], client: str) -> int:
        """Bytes the reply to validated ``ops`` can take at most: what ``--max-reply-bytes`` is checked against.

        A table is 4 bytes per row and block; a request has at most as many blocks
        as its tokens fill, counting every token sent in this message so far. An
        extend_many's changed columns are its requests' new blocks and the window
        blocks they push out, at most twice a request's new blocks plus two.
        """
        m = self.manager
        rows, bs = m.num_rows, m.block_size
        column = 4 * (rows + 1)  # a changed column: its index and its value in every row
        total = 256 + _OP_ERROR_BYTES * len(ops)  # any op may fail as it applies: {"error": its message}
        receivers = sum(len(e or "") + 8 for e in self._pd.receivers)
        sent = 0  # tokens sent by this message's ops so far
        for op in ops:
            kind = op.kind
            if kind == "extend_many":
                n = len(op.reqs)
                total += 16 * n + column * 2 * (op.tokens.size // bs + n * (1 + -(-op.ahead // bs)))
                sent += op.tokens.size
            elif kind in ("admit", "reserve"):
                blocks = -(-op.tokens.size // bs)
                total += 4 * rows * blocks * (3 if op.pd is not None else 1) + 64 * len(m.rows)
                if kind == "reserve":
                    total += receivers
                elif op.pd is not None:  # a prefill admit's plan: its destination's receivers and decode daemon
                    total += sum(len(e) + 8 for e in op.pd["receivers"]) + len(op.pd.get("decode") or "") + 256
                sent += op.tokens.size
            elif kind in ("extend", "table"):
                known = op.req in self._slots.of
                held = m.num_tokens(op.req) if known else 0
                if kind == "extend":
                    sent += op.tokens.size
                # Blocks reserved ahead make a table longer than its tokens fill.
                width = max(m.table(op.req).shape[1] if known else 0, -(-(held + sent + op.ahead) // bs))
                total += (column if kind == "extend" else 4 * rows) * width
            elif kind == "plans":
                reqs = (op.pd or {}).get("reqs", ())
                held = sum(m.num_tokens(r) for r in reqs if r in self._slots.of)
                total += 2 * 4 * rows * -(-(held + sent) // bs) + 1024 * len(reqs)
                total += sum(self._pd.plan_bytes(r) for r in reqs)
            elif kind == "owned":
                total += (MAX_ID_CHARS + 16) * self._leases.count(client)
            elif kind == "reclaim":
                total += (MAX_ID_CHARS + 16) * len(op.reqs or ())
            elif kind == "tier_failed" and self.tier is not None:
                total += (MAX_ID_CHARS + 16) * self.tier.num_failed
            elif kind == "pd_poll":
                total += (MAX_ID_CHARS + MAX_ERROR + 32) * self._pd.unread(client)
            elif kind in ("usage", "stats", "info"):
                total += 4096 + 128 * len(m.rows) + self._cell_bytes
            elif kind in ("match_blocks", "allocate_blank", "owned_blocks", "free_blocks"):  # block id arrays
                total += 64 + 8 * m.num_blocks
        return total

    def _observe(self, force: bool = False) -> None:
        """Count the answered messages and published deltas in the metrics, at most every ``METRICS_INTERVAL_S``
        (or now, with ``force``, gauges too when nothing came): after the replies went out, as metrics only
        observe, and in one go, so a busy daemon pays once per interval for the manager's totals and the
        Prometheus calls, not per message. The serve loop calls it at least every ``poll_ms``, so an idle
        daemon's metrics catch up."""
        if self._metrics is None or not (force or self._observed or self._deltas.totals[0]):
            return
        now = time.monotonic()
        if not force and now < self._next_observe:
            return
        self._next_observe = now + METRICS_INTERVAL_S
        kinds = collections.Counter(op.kind for ops, _ in self._observed for op in ops)
        self._metrics.observe_steps(kinds, [seconds for _, seconds in self._observed])
        self._observed.clear()
        totals = self._deltas.totals
        if totals[0]:
            self._metrics.observe_deltas(*totals)
            totals[:] = [0, 0, 0]
        self._metrics.update(self.manager)  # gauges too: this runs at most once an interval already
        if self._pd.role != "both":
            self._metrics.update_pd(self._pd)
        if self.tier is not None:
            self._metrics.update_tier(self.tier.stats())

    def _validate(self, raw_ops: list, *, trusted: bool = False) -> list[_Op]:
        """Check every op before any is applied: who may send it (``protocol.OP_CALLERS``; ``trusted``: the daemon's
        own message or a journal's), fields, and request liveness in op order.

        The usual values (an int or short str id, an admit with no optional field) pass inline checks; anything
        else goes to the protocol's checks, which name the field.
        """
        cfg = self.config
        live: dict[Any, bool] = {}  # this message's admits (True) and frees (False) so far
        admitted = self._slots.of
        slots_taken: dict[int, bool] = {}
        ops: list[_Op] = []
        pd = self._pd
        rows_stable = True  # no op so far frees a request but by an explicit free (which the ids may not name)
        for i, op in enumerate(raw_ops):
            if not isinstance(op, dict):
                raise ProtocolError(f"ops[{i}]: must be a map, got {type(op).__name__}")
            kind = op.get("op")
            if not isinstance(kind, str):
                raise ProtocolError(f"ops[{i}].op: must be a str, got {type(kind).__name__}")
            if kind in _REQUEST_OPS:
                req = op.get("req")
                if not ((type(req) is int and INT64_MIN <= req <= INT64_MAX)
                        or (type(req) is str and len(req) <= MAX_ID_CHARS)):
                    req = check_request_id(req, f"ops[{i}].req")
                is_live = live.get(req)
                if is_live is None:
                    is_live = req in admitted
                if kind == "admit" or kind == "reserve":
                    if is_live:
                        raise ProtocolError(f"ops[{i}].req: request {req!r} is already admitted")
                    tokens = check_tokens(op.get("tokens"), f"ops[{i}].tokens", cfg.max_tokens)
                    if tokens.size == 0:
                        raise ProtocolError(f"ops[{i}].tokens: must hold at least one token")
                    if kind == "admit" and len(op) == 3:  # op, req and tokens: no optional field
                        ops.append(_Op(kind, req, tokens))
                    else:
                        ops.append(self._admit_op(op, i, kind, req, tokens, slots_taken))
                    live[req] = True
                    continue
                if not is_live:
                    raise ProtocolError(f"ops[{i}].req: request {req!r} is not admitted")
                if pd.transfers and (kind == "extend" or kind == "free") and live.get(req) is None:
                    pd.check_not_in_transfer(req, f"ops[{i}]", kind)
                if kind == "extend":
                    tokens = check_tokens(op.get("tokens"), f"ops[{i}].tokens", cfg.max_tokens)
                    number = op.get("num_computed")
                    if number is not None:
                        check_int(number, f"ops[{i}].num_computed")
                        known = self._tokens_before(req, ops)
                        if known is not None and number > known:
                            raise ProtocolError(f"ops[{i}].num_computed: {number} exceeds the request's "
                                                f"{known} tokens")
                    ops.append(_Op(kind, req, tokens, number=number, ahead=self._lookahead_of(op, i)))
                else:
                    ops.append(_Op(kind, req))
                    if kind == "free":
                        live[req] = False
                        if req in admitted:
                            slots_taken[admitted[req]] = False
            elif kind == "extend_many":
                field = f"ops[{i}]"
                reqs = op.get("reqs")
                if not isinstance(reqs, list) or len(reqs) > MAX_OPS:
                    raise ProtocolError(f"{field}.reqs: must be a list of at most {MAX_OPS} request ids")
                # One pass in C: ids of the right types, all admitted before this message, none it freed (an
                # id of the live set passed check_request_id at its admit), and their rows in the manager's arrays
                # (stable until applied: the message frees none of them). Else check one by one, naming the first.
                slots = self.manager.slots_of(reqs, live or None)
                if slots is None:
                    for j, req in enumerate(reqs):
                        check_request_id(req, f"{field}.reqs[{j}]")
                        if not live.get(req, req in admitted):
                            raise ProtocolError(f"{field}.reqs[{j}]: request {req!r} is not admitted")
                tokens = check_tokens(op.get("tokens"), f"{field}.tokens", cfg.max_tokens)
                counts = op.get("counts")
                if not isinstance(counts, np.ndarray) or counts.dtype.kind not in "iu" or counts.shape != (len(reqs),):
                    raise ProtocolError(f"{field}.counts: must be an integer array with one count per request")
                # One C pass; else numpy's, each count at most the token total first, so the sum cannot wrap.
                bounds = _tables.bounds(counts)
                if bounds is not None:
                    low, high, total = bounds
                    bad = low < 0 or high > tokens.size or total != tokens.size
                else:
                    bad = counts.size > 0 and ((counts.dtype.kind == "i" and int(counts.min()) < 0)
                                               or int(counts.max()) > tokens.size or int(counts.sum()) != tokens.size)
                if bad:
                    raise ProtocolError(f"{field}.counts: must be non-negative and sum to the {tokens.size} tokens")
                ops.append(_Op(kind, tokens=tokens, reqs=reqs, counts=counts, slots=slots if rows_stable else None,
                               ahead=self._lookahead_of(op, i)))
            else:
                ops.append(self._other_op(op, i, kind, live, trusted))
                if kind in PD_OPS:  # one that ends a transfer frees its request: rows found later may not hold
                    rows_stable = False
        return ops

    def _lookahead_of(self, op: dict, i: int) -> int:
        """An extend's optional ``lookahead``: positions its table covers past the tokens, at most max_tokens."""
        ahead = op.get("lookahead")
        return 0 if ahead is None else check_int(ahead, f"ops[{i}].lookahead", most=self.config.max_tokens)

    def _admit_op(self, op: dict, i: int, kind: str, req: Any, tokens: np.ndarray, slots_taken: dict[int, bool]
                  ) -> _Op:
        """An admit's or reserve's optional fields checked (num_tokens, slot, PD fields, salt, LoRA, multimodal)."""
        cfg, field = self.config, f"ops[{i}]"
        number = op.get("num_tokens")
        if number is not None:
            check_int(number, f"{field}.num_tokens", least=1, most=int(tokens.size))
        slot = op.get("slot")
        if slot is not None:
            check_int(slot, f"{field}.slot", least=0, most=cfg.max_slots - 1)
            if slots_taken.get(slot, slot in self._slots.owner):
                raise ProtocolError(f"{field}.slot: slot {slot} is in use")
            slots_taken[slot] = True
        pd = None
        if kind == "reserve":
            self._pd.check_role(kind, field)
            if number is not None:
                raise ProtocolError(f"{field}.num_tokens: a reservation takes the whole prompt")
            if op.get("dest") is not None:
                raise ProtocolError(f"{field}.dest: a reservation takes no destination (a prefill admit does)")
            pd = {"timeout": self._pd.check_reserve(op, field)}
        elif op.get("dest") is not None:
            self._pd.check_role("sent", field)  # a destination needs --role prefill
            pd = self._pd.check_dest(op, field, int(tokens.size))
        return _Op(kind, req, tokens, check_optional_str(op, "salt", field), check_lora(op, field),
                   check_mm(op.get("mm"), f"{field}.mm"), number, slot, pd=pd)

    def _other_op(self, op: dict, i: int, kind: str, live: dict[Any, bool], trusted: bool = False) -> _Op:
        """An op that names no single admitted request (lookup, can_admit, reclaim, the admin and PD ops)."""
        cfg, field = self.config, f"ops[{i}]"
        if kind == "lookup":
            whole = op.get("whole_prompt", False)
            if not isinstance(whole, bool):
                raise ProtocolError(f"{field}.whole_prompt: must be a bool, got {show(whole)}")
            return _Op(kind, tokens=check_tokens(op.get("tokens"), f"{field}.tokens", cfg.max_tokens),
                       salt=check_optional_str(op, "salt", field), lora=check_lora(op, field),
                       mm=check_mm(op.get("mm"), f"{field}.mm"), number=int(whole))
        if kind == "can_admit":
            return _Op(kind, number=check_int(op.get("num_tokens"), f"{field}.num_tokens"))
        if kind in _OWNED_OPS or kind in ("evict_cached", "free_blocks"):
            return self._owned_op(op, kind, field)
        if kind == "reclaim":
            reqs = op.get("reqs")
            if not isinstance(reqs, list) or len(reqs) > MAX_OPS:
                raise ProtocolError(f"{field}.reqs: must be a list of at most {MAX_OPS} request ids")
            return _Op(kind, reqs=[check_request_id(r, f"{field}.reqs[{j}]") for j, r in enumerate(reqs)])
        if kind in ("usage", "stats", "info", "ping", "reset_prefix_cache", "check_integrity", "owned"):
            return _Op(kind)
        check_caller(kind, field, own=trusted)  # the ops above are any client's
        admin = self._admin_key is not None and type(op.get("admin")) is int and op["admin"] == self._admin_key
        if kind in TIER_OPS:
            return _Op(kind, pd=self._tier_fields(kind, op, field, trusted, admin))
        if kind in PD_OPS:
            fields = validate_op(self._pd, kind, op, field, trusted=trusted, admin=admin)
            if "req" in fields and live.get(fields["req"]) is False:
                raise ProtocolError(f"{field}.req: request {fields['req']!r} is not admitted")
            return _Op(kind, fields.get("req"), pd=fields)
        raise ProtocolError(f"{field}.op: unknown operation {show(kind)}")

    def _owned_op(self, op: dict, kind: str, field: str) -> _Op:
        """A scheduler-owned block op's fields, checked: its request id, block ids, tokens and counts."""
        cfg, m = self.config, self.manager
        req = None if kind in ("evict_cached", "free_blocks") else check_request_id(op.get("req"), f"{field}.req")
        if kind in ("match_blocks", "commit_blocks"):
            tokens = check_tokens(op.get("tokens"), f"{field}.tokens", cfg.max_tokens)
        else:
            tokens = None
        blocks = op.get("blocks")
        if blocks is not None or kind == "commit_blocks":
            blocks = check_tokens(blocks, f"{field}.blocks", m.num_blocks)
            if blocks.size and int(blocks.max()) >= m.num_blocks:
                raise ProtocolError(f"{field}.blocks: block {int(blocks.max())} is not in [0, {m.num_blocks})")
            blocks = blocks.astype(np.int32)
        number = None
        if kind in ("allocate_blank", "evict_cached"):
            number = check_int(op.get("num_blocks"), f"{field}.num_blocks", least=0, most=m.num_blocks)
        fields = None
        if kind == "commit_blocks" and op.get("blank_from") is not None:
            fields = {"blank_from": check_request_id(op.get("blank_from"), f"{field}.blank_from")}
        if kind == "match_blocks":
            return _Op(kind, req, tokens, check_optional_str(op, "salt", field), check_lora(op, field),
                       check_mm(op.get("mm"), f"{field}.mm"))
        return _Op(kind, req, tokens, number=number, counts=blocks, pd=fields)

    def _lease_owned(self, client: str, op: _Op) -> None:
        """Lease a request's owned blocks to the client that first gave it some (``client``), like an admitted
        request's; the lease ends once the request holds none (its lease expiry releases them)."""
        if op.kind not in ("match_blocks", "allocate_blank", "commit_blocks", "release_blocks"):
            return
        m = self.manager
        for req in (op.req, (op.pd or {}).get("blank_from")):
            if req is None:
                continue
            if m.is_matched(req) or m.owned_blocks(req)[1].size:
                if self._leases.owner(req) is None:
                    self._leases.own(client, req)
            elif req not in m:
                self._leases.release(req)

    def _release_owned_ops(self, req: Any) -> list[dict[str, Any]]:
        """The ops that release every owned block of ``req``: its committed part, then its blank blocks."""
        ops: list[dict[str, Any]] = []
        if self.manager.is_matched(req):
            ops.append({"op": "release_blocks", "req": req})
        blank = self.manager.owned_blocks(req)[1]
        if blank.size:
            ops.append({"op": "release_blocks", "req": req, "blocks": blank.tolist()})
        return ops

    def _apply_owned(self, op: _Op) -> Any:
        """A scheduler-owned block op applied to the manager (which refuses, changing nothing, what it cannot do)."""
        m = self.manager
        if op.kind == "match_blocks":
            return m.match_blocks(op.req, op.tokens, cache_salt=op.salt, lora=op.lora, mm=op.mm)
        if op.kind == "allocate_blank":
            return m.allocate_blank(op.req, op.number)
        if op.kind == "commit_blocks":
            return m.commit_blocks(op.req, op.counts, op.tokens, blank_from=(op.pd or {}).get("blank_from"))
        if op.kind == "release_blocks":
            m.release_blocks(op.req, op.counts)
            return True
        if op.kind == "evict_cached":
            return m.evict_cached(op.number)
        if op.kind == "owned_blocks":
            return list(m.owned_blocks(op.req))
        return {"free": m.num_free_blocks, "cached_free": m.num_cached_free_blocks,
                "uncached": m.uncached_free_blocks()}

    def _tier_fields(self, kind: str, op: dict, field: str, trusted: bool = False,
                     admin: bool = False) -> dict[str, Any]:
        """A host-tier op's fields, checked: an agent's rank and id, a report's job and outcome, expired jobs.

        A report counts only from the agent attached as its rank now: it names the key that agent attached with
        (``agent``), which no other client learns, so another rank's agent, a replaced one or a client that never
        attached is refused (``trusted``: a journal's message, let in before). A rank is claimed by the ``key`` of
        its first attach: another attach of it needs the same key (a restarted agent of the same user reads it again,
        ``kvcache.rank_keys``) or the daemon's admin key (``admin``)."""
        if kind == "tier_attach":
            rank = check_int(op.get("rank"), f"{field}.rank", least=0, most=self.config.tp - 1)
            key = None if op.get("key") is None else check_int(op.get("key"), f"{field}.key", least=0)
            owner = None if self.tier is None else self.tier.owner_of(rank)
            if not (trusted or admin) and owner is not None and key != owner:
                raise ProtocolError(f"{field}.key: tier_attach of rank {rank} refused: the rank is claimed by another "
                                    "agent's key; who may attach it: an agent holding the key the rank was first "
                                    "attached with (its key file) or an admin (the daemon's admin key)")
            fields = {"rank": rank, "agent": check_int(op.get("agent"), f"{field}.agent", least=0), "key": key}
            if op.get("buffer") is not None:  # absent: a buffer of the agent's own
                fields["buffer"] = check_int(op.get("buffer"), f"{field}.buffer", least=0)
            return fields
        if kind == "tier_done":
            ok, error = op.get("ok"), op.get("error") or ""
            if not isinstance(ok, bool):
                raise ProtocolError(f"{field}.ok: must be a bool, got {show(ok)}")
            if not isinstance(error, str) or len(error) > MAX_ERROR:
                raise ProtocolError(f"{field}.error: must be a str of at most {MAX_ERROR} characters")
            rank = check_int(op.get("rank"), f"{field}.rank", least=0, most=self.config.tp - 1)
            agent = op.get("agent")
            if not trusted and self.tier is not None and (type(agent) is not int or self.tier.agent_of(rank) != agent):
                raise ProtocolError(f"{field}.agent: tier_done for rank {rank} counts only from the agent attached as "
                                    f"rank {rank} now (who may send it: that agent, naming the key it attached "
                                    "with); this sender is not it")
            return {"job": check_int(op.get("job"), f"{field}.job", least=0), "rank": rank, "ok": ok, "error": error}
        if kind == "tier_expire":
            jobs = op.get("jobs")
            if not isinstance(jobs, list) or len(jobs) > MAX_OPS:
                raise ProtocolError(f"{field}.jobs: must be a list of at most {MAX_OPS} job ids")
            return {"jobs": [check_int(j, f"{field}.jobs[{i}]", least=0) for i, j in enumerate(jobs)]}
        return {}

    def _tokens_before(self, req: Any, ops: list[_Op]) -> int | None:
        """Tokens ``req`` holds after the ops validated so far in this message (None: admitted in it).

        Only asked for extends that name ``num_computed`` (rare), so a scan of the earlier ops is fine.
        """
        known: int | None = self.manager.num_tokens(req) if req in self._slots.of else None
        for op in ops:
            if op.kind == "admit" and op.req == req:
                known = None
            elif known is not None and op.kind == "extend" and op.req == req:
                known += int(op.tokens.size)
            elif known is not None and op.kind == "extend_many":
                known += sum(int(c) for r, c in zip(op.reqs, op.counts.tolist()) if r == req)
        return known

    def _apply(self, ops: list[_Op], client: str) -> tuple[list[Any], list[tuple[Changes, list[Any], bool, list]]]:
        """Run validated ops in order; an op that still fails gets an error result, the rest go on.

        Returns the results and the deltas to publish. A delta lists its frees
        before its changes, so a free of a request already changed in this
        delta starts a new one (admit-then-free keeps its order for workers).
        """
        results: list[Any] = []
        changes = Changes()
        freed: list[Any] = []
        reset = False
        deltas: list[tuple[Changes, list[Any], bool]] = []
        m = self.manager
        tier = self.tier
        for op in ops:
            if op.kind == "free" and op.req in changes.touched:
                deltas.append((changes, freed, reset, []))
                changes, freed, reset = Changes(), [], False
            try:
                if op.kind in ("admit", "reserve"):
                    if not self._slots.available(op.slot):
                        raise KVCacheError(f"slot: all {self._slots.limit} slots are in use" if op.slot is None
                                           else f"slot: slot {op.slot} is in use")
                    adm = m.admit(op.req, op.tokens, cache_salt=op.salt, lora=op.lora, mm=op.mm,
                                  num_tokens=op.number)
                    if adm is None:
                        results.append(None)
                        continue
                    slot = self._slots.take(op.req, op.slot)
                    self._leases.own(client, op.req)
                    if op.kind == "reserve":  # window rows keep only what decoding reads; the rest never arrives
                        m.shed_window(op.req, adm.num_cached_tokens // m.block_size)
                    # A copy, read-only from here on: the delta and the reply share it (a reserve's table as shed).
                    table = (m.table(op.req) if op.kind == "reserve" else adm.table).copy()
                    changes.add(op.req, slot, table.shape[1], np.arange(table.shape[1], dtype=np.int32), table)
                    result = {"cached": adm.num_cached_tokens, "num_tokens": adm.num_tokens, "table": table,
                              "slot": slot}
                    if adm.num_host_tokens:
                        result["host_cached"] = adm.num_host_tokens
                    if op.pd is not None:
                        dest = None if op.kind == "reserve" else op.pd
                        self._pd.start(op.req, client, table, adm.num_cached_tokens, op.pd["timeout"],
                                       time.monotonic(), dest)
                        if op.kind == "reserve":
                            result["receivers"] = list(self._pd.receivers)
                        else:  # the scheduler may hand it to the workers with the step: no plans round trip
                            result["plan"] = self._plans([op.req])[0]
                    results.append(result)
                elif op.kind == "extend":
                    table = m.extend(op.req, op.tokens, num_computed_tokens=op.number, num_lookahead_tokens=op.ahead)
                    if table is None:
                        results.append(None)
                        continue
                    cols = m.changed_columns(op.req)
                    vals = table[:, cols]
                    if cols.size:
                        changes.add(op.req, self._slots.of[op.req], table.shape[1], cols, vals)
                    results.append({"len": table.shape[1], "cols": cols, "vals": vals})
                elif op.kind == "extend_many":
                    results.append(self._extend_many(op, changes))
                elif op.kind == "free":
                    m.free(op.req)
                    self._slots.release(op.req)
                    self._leases.release(op.req)
                    freed.append(op.req)
                    results.append(True)
                elif op.kind == "table":
                    results.append(m.table(op.req).copy())
                elif op.kind == "lookup":
                    results.append(m.lookup(op.tokens, cache_salt=op.salt, lora=op.lora, mm=op.mm,
                                            whole_prompt=bool(op.number)))
                elif op.kind in _OWNED_OPS or op.kind in ("evict_cached", "free_blocks"):
                    results.append(self._apply_owned(op))
                    self._lease_owned(client, op)
                elif op.kind == "can_admit":
                    results.append(m.can_admit(op.number))
                elif op.kind == "usage":
                    usage = m.usage
                    results.append({"per_row": usage.per_row, "max": usage.max})
                elif op.kind == "stats":
                    self._observe(force=True)  # the metrics endpoint then shows what stats says, no interval behind
                    results.append(self.stats())
                elif op.kind == "info":
                    results.append(self.info())
                elif op.kind == "reclaim":
                    results.append(self._leases.reclaim(client, op.reqs or (), time.monotonic()))
                elif op.kind == "owned":
                    results.append(self._leases.owned(client))
                elif op.kind == "ping":
                    results.append("pong")
                elif op.kind == "check_integrity":
                    try:
                        self.manager.check_integrity()
                        self._pd.check_integrity(self.manager)
                        if tier is not None:
                            tier.check_integrity()
                        results.append(True)
                    except AssertionError as exc:
                        log.error("integrity check failed: %s", exc)
                        results.append({"error": f"integrity: {exc}"})
                elif op.kind == "reset_prefix_cache":
                    results.append(m.reset_prefix_cache())
                    reset = True
                elif op.kind in TIER_OPS:
                    results.append(self._apply_tier(op))
                elif op.kind in PD_OPS:
                    result, ends = self._apply_pd(op, client)
                    for req, discard_from in ends:
                        if req in changes.touched:
                            deltas.append((changes, freed, reset, []))
                            changes, freed, reset = Changes(), [], False
                        if discard_from is None:
                            m.free(req)
                        else:
                            m.discard(req, discard_from)
                        self._slots.release(req)
                        self._leases.release(req)
                        freed.append(req)
                    results.append(result)
            except KVCacheError as exc:
                results.append({"error": str(exc)})
        orders = tier.take_orders() if tier is not None else []
        if orders:  # with the message's last delta: workers see the tables and the copies that fill them together
            end = time.monotonic() + self.config.tier_timeout
            self._tier_deadlines.update((order["job"], end) for order in orders)
        if changes or freed or reset or orders:
            deltas.append((changes, freed, reset, orders))
        return results, deltas

    def _apply_tier(self, op: _Op) -> Any:
        """One validated host-tier op: an agent attaching or reporting, the expiry, or the failed requests."""
        tier, fields = self.tier, op.pd or {}
        if tier is None:
            raise KVCacheError(f"{op.kind}: this daemon has no host tier (start it with --host-memory)")
        if op.kind == "tier_attach":
            tier.attach(fields["rank"], fields["agent"], fields.get("buffer"), key=fields.get("key"))
            return {"num_blocks": tier.num_blocks}
        if op.kind == "tier_done":
            tier.report(fields["job"], fields["rank"], fields["ok"], fields["error"])
            if not fields["ok"]:
                log.warning("host-tier copy %d failed on rank %d: %s", fields["job"], fields["rank"], fields["error"])
            return True
        if op.kind == "tier_expire":
            tier.expire(fields["jobs"])
            return True
        return tier.take_failed()

    def _apply_pd(self, op: _Op, client: str) -> tuple[Any, list[tuple[Any, int | None]]]:
        """One validated PD op: its result and the requests it ends (discarding from a block, or None to free)."""
        pd, fields = self._pd, op.pd or {}
        if op.kind == "attach":
            return pd.attach(fields["rank"], fields["endpoint"], fields.get("key")), []
        if op.kind == "pd_poll":
            return pd.poll(client), []
        if op.kind == "plans":
            return self._plans(fields["reqs"]), []
        if op.req not in pd.transfers:  # ended earlier in this message
            return {"error": f"request {op.req!r} is no longer in transfer"}, []
        if op.kind in ("received", "sent"):
            return True, pd.report(op.req, fields["rank"], time.monotonic_ns())
        if op.kind == "cancel":
            return True, pd.cancel(op.req, fields["release"])
        log.warning("transfer of %r failed: %s", op.req, fields["error"])
        return True, pd.fail(op.req, fields["error"])

    def _plans(self, reqs: list[Any]) -> list[dict[str, Any] | None]:
        """What the prefill messagers write for each request: PDState's plans plus this node's table (the source)."""
        plans = self._pd.plans(reqs)
        for plan in plans:
            if plan is not None and not plan.get("cancelled"):
                plan["src_table"] = self.manager.table(plan["req"]).copy()
        return plans

    def _extend_many(self, op: _Op, changes: Changes) -> dict[str, Any]:
        """Apply a batch of extends; the result lists every table's length and the changed ones' deltas.

        Only changed requests get per-request work (a decode step: one in
        ``block_size``); their columns and values go out back to back, shared
        by the reply and the delta.
        """
        assert op.reqs is not None and op.counts is not None
        d = self.manager.extend_many_deltas(op.reqs, op.tokens, op.counts, slots=op.slots,
                                            num_lookahead_tokens=op.ahead)
        if d.index.size:
            reqs = [op.reqs[i] for i in d.index.tolist()]
            slot_of = self._slots.of
            changes.add_many(reqs, [slot_of[r] for r in reqs], d.lens[d.index].tolist(),
                             (d.offsets[1:] - d.offsets[:-1]).tolist(), d.cols, d.vals)
        return {"lens": d.lens, "changed": {"index": d.index, "offsets": d.offsets, "cols": d.cols, "vals": d.vals}}

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

    # ------------------------------------------------------------------ replay

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
            payloads = self._deltas.since(start)
            if payloads is None:
                self.replay.send_multipart([*envelope, b"S", self.snapshot()])
            else:  # the frames share the history's bytes
                self.replay.send_multipart([*envelope, b"D", *payloads], copy=False)

    def snapshot(self) -> bytes:
        """Every live table with its slot, at the current seq (for workers that fell too far behind)."""
        tables = [{"req": req, "slot": slot, "table": self.manager.table(req)} for req, slot in self._slots.of.items()]
        return pack({"v": PROTOCOL_VERSION, "epoch": self._deltas.epoch, "seq": self._deltas.seq,
                     "tables": tables})

    # ------------------------------------------------------------------ introspection

    def info(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "epoch": self._deltas.epoch,
            "num_blocks": self.manager.num_blocks,
            "block_size": self.manager.block_size,
            "num_rows": self.manager.num_rows,
            "rows": describe_rows(self.manager.rows, self.manager.row_blocks.tolist(), self.layout),
            "pub_endpoint": cfg.pub_endpoint,
            "replay_endpoint": cfg.replay_endpoint,
            "local_endpoint": cfg.local_endpoint if self.local is not None else None,
            "events_endpoint": cfg.events_endpoint if cfg.events else None,
            "events_replay_endpoint": cfg.events_replay_endpoint if cfg.events else None,
            "prefix_caching": self.manager.enable_prefix_caching,
            "hash_algorithm": cfg.hash_algorithm,
            "max_slots": cfg.max_slots,
            "role": cfg.role,
            "tp": cfg.tp,
            "receivers": list(self._pd.receivers) if cfg.role == "decode" else None,
            "host_tier": {"num_blocks": self.tier.num_blocks, "timeout": cfg.tier_timeout} if self.tier else None,
            **self._extra_info,
        }

    def stats(self) -> dict[str, Any]:
        out = dict(self.manager.stats()._asdict())
        out["seq"] = self._deltas.seq
        out["free_blocks"] = self.manager.num_free_blocks
        out["subscribers"] = self._subscribers.count if self._subscribers is not None else None
        out["local_subscribers"] = len(self._local_subscribers)
        out["expired_requests"] = self._expired
        out["in_transfer"] = len(self._pd.transfers)
        out["transfers"] = dict(self._pd.totals)
        if self.tier is not None:
            out["host_tier"] = self.tier.stats()._asdict()
        return out

    def _count_subscribers(self) -> None:
        self._subscribers.handle()
        self._set_subscriber_gauge()

    def _set_subscriber_gauge(self) -> None:
        """Workers taking deltas: connected to the PUB, or subscribed on the local endpoint."""
        if self._metrics is not None:
            pub = self._subscribers.count if self._subscribers is not None else 0
            self._metrics.set_subscribers(pub + len(self._local_subscribers))

    def _count_error(self, kind: str) -> None:
        if self._metrics is not None:
            self._metrics.observe_error(kind)


SNAPSHOT_FORMAT = 1
STATE_CODEC = StateCodec(  # what journal snapshots may hold
    [KVCacheManager, _Request, _Owned, BlockPool, PrefixIndex, BlockHasher, Inserted, MMPlaceholder, Full,
                     Window, Chunked, _Slots, _RetryCache, Leases, PDState, Transfer, DaemonTier, TierJob])
_STATE_TYPES = {"manager": KVCacheManager, "slots": _Slots, "retries": _RetryCache, "leases": Leases, "pd": PDState,
                "seq": int, "epoch": int, "settings": dict}


def dump_state(state: dict[str, Any]) -> list[bytes | memoryview]:
    """A daemon's state (``CacheServer._state``'s map) as journal snapshot pieces."""
    return STATE_CODEC.chunks({"format": SNAPSHOT_FORMAT, "kvcache": __version__, **state})


def load_state(data: bytearray) -> dict[str, Any]:
    """The map ``dump_state`` saved; anything else raises ``KVCacheError`` without running code from the snapshot."""
    state = STATE_CODEC.loads(data)
    if not isinstance(state, dict) or state.get("format") != SNAPSHOT_FORMAT:
        found = state.get("format") if isinstance(state, dict) else None
        raise KVCacheError(f"journal: the snapshot's format {found!r} is not {SNAPSHOT_FORMAT}, the one this "
                           f"version of kvcache reads")
    for name, kind in _STATE_TYPES.items():
        if not isinstance(state.get(name), kind):
            raise KVCacheError(f"journal: the snapshot's {name} is not a {kind.__name__}")
    missing = [name for name in _JOURNALED_SETTINGS if name not in state["settings"]]
    if missing:
        raise KVCacheError(f"journal: the snapshot lacks the settings {', '.join(missing)}")
    return state

"""The daemon's state machine: validate a scheduler's message, apply it to the manager, say what changed.

``DaemonState.process`` takes one message's bytes and returns its reply's bytes. In between, in this order:

1. decode it within the limits, and answer a retry from the kept replies (``_RetryCache``), never applying twice;
2. validate every op before any is applied (``_validate``): who may send it (``protocol.OP_CALLERS``, checked
   there and nowhere else), its fields, and request liveness in op order; a failure changes nothing;
3. reserve the message's journal space, when it changes state and there is a journal;
4. apply the ops over the manager, the batch slots (``_Slots``), leases, PD transfers and host tier;
5. stage its table changes as deltas (``kvcache.deltas``), keep the reply for retries, append it to the journal.

It owns no socket and no file: kvcache.server feeds it messages from its endpoints
(kvcache.endpoints), commits the journal (kvcache.durability) and sends what it
staged. It belongs to the daemon's one thread, like everything it holds; a test
drives it with messages and nothing else (tests/test_daemon_state.py).
"""
from __future__ import annotations

import collections
import heapq
import logging
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from kvcache import __version__
from kvcache.allocator import _tables
from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.manager import KVCacheManager
from kvcache.allocator.rows import Row
from kvcache.config import LOCAL_OFF, ServeConfig, describe_rows
from kvcache.deltas import Changes, DeltaStream
from kvcache.host_tier import TIER_OPS, DaemonTier
from kvcache.journal import JournalFull
from kvcache.leases import Leases
from kvcache.pd.state import MUTATING as _PD_MUTATING
from kvcache.pd.state import MAX_ERROR, PD_OPS, PDState, describe_layout, validate_op
from kvcache.protocol import (
    INT64_MAX,
    INT64_MIN,
    JOURNAL_VERSIONS,
    MAX_ID_CHARS,
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
    show,
    unpack,
)

if TYPE_CHECKING:
    from kvcache.journal import Journal

log = logging.getLogger("kvcache.server")
_REQUEST_OPS = frozenset({"admit", "reserve", "extend", "free", "table"})  # ops that name one request (op["req"])
_OWNED_OPS = frozenset({"match_blocks", "allocate_blank", "commit_blocks", "release_blocks", "owned_blocks"})
_MUTATING = (frozenset({"admit", "extend", "extend_many", "free", "reset_prefix_cache", "reclaim", "match_blocks",
                        "allocate_blank", "commit_blocks", "release_blocks", "evict_cached"}) | _PD_MUTATING
             | TIER_OPS)
_OP_ERROR_BYTES = 2 * MAX_ID_CHARS + 512  # an op's {"error": message} result at most (a message names ids)
METRICS_INTERVAL_S = 0.05  # a busy daemon counts its messages in the metrics at most this often


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


# Journal snapshots hold _RetryCache and _Slots under these names (kvcache.durability.STATE_CODEC): renaming one
# makes older journals unreadable.
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

    def check_integrity(self, manager: KVCacheManager) -> None:
        """Raise AssertionError naming the first disagreement: of the two maps, or with ``manager``'s requests."""
        assert type(self.of) is dict and type(self.owner) is dict, "slots: not maps"
        assert all(type(slot) is int and slot >= 0 for slot in self.owner), \
            "slots: a batch slot that is not an integer >= 0"
        assert len(self.of) == len(self.owner) and all(self.of.get(req) == slot for slot, req in self.owner.items()), \
            "slots: the requests' slots and the slots' requests disagree"
        assert type(self._next) is int and type(self._free) is list and all(
            type(slot) is int and slot >= 0 for slot in self._free), "slots: a free slot that is not an integer"
        assert len(self.of) == len(manager) and all(req in manager for req in self.of), \
            f"slots: {len(self.of)} requests hold batch slots but the manager holds {len(manager)}"


class DaemonState:
    """Everything the daemon decides with: the manager and the state around it, and the rules for changing them.

    ``config`` is the daemon's resolved configuration. Set from outside once, as the daemon starts: ``journal``
    (kvcache.durability opens it), ``admin_key`` (the key file beside the endpoint), ``metrics`` and
    ``collect_events`` (with ``--events``, the manager's KV events are gathered in ``staged_events`` for the
    endpoints to publish) and ``subscriber_counts`` (the workers taking deltas, for ``stats``).
    """

    def __init__(self, config: ServeConfig, manager: KVCacheManager, *, layout: Sequence[Row] | None = None,
                 extra_info: dict[str, Any] | None = None) -> None:
        """``layout`` names the (layer, kv head) cells of each of the manager's rows, for workers to find the
        rows of their rank and layers (``kvcache.serve.build_manager`` gives it from a model's config)."""
        if layout is not None and [r.policy for r in layout] != list(manager.rows):
            raise KVCacheError(f"layout: its {len(layout)} rows' policies differ from the manager's rows")
        self.config = config
        self.manager = manager
        self.layout = None if layout is None else tuple(layout)
        # The info reply's row cells at most: a msgpack int of a layer or head takes up to 5 bytes.
        self._cell_bytes = 5 * sum(len(r.layers) + len(r.kv_heads) for r in self.layout or ())
        # A reserve reply's rows (the decode side's), which a prefill admit's destination must match row by row.
        self.pd_rows = describe_layout(manager.rows, self.layout)
        self.extra_info = extra_info or {}  # more fields of the info reply (serve --model's plan and event groups)
        self.retries = _RetryCache(config.dedupe_window, config.dedupe_bytes)
        self.slots = _Slots(config.max_slots)
        self.deltas = DeltaStream(config.replay_buffer, config.replay_bytes)
        self.leases = Leases(config.lease_timeout)
        self.pd = PDState(config.role, config.tp, manager.num_rows, manager.num_blocks, manager.block_size,
                          config.transfer_timeout)
        self.tier_deadlines: dict[int, float] = {}  # host-tier copies in flight: when each counts as failed
        self.expired = 0  # requests freed by lease expiry
        self.journal: Journal | None = None
        self.admin_key: int | None = None
        self.metrics: Any = None
        self._observed: list[tuple[list[_Op], float]] = []  # answered messages whose metrics are not yet counted
        self._next_observe = 0.0
        self.collect_events = False
        self.staged_events: list[Any] = []
        self.subscriber_counts: Callable[[], tuple[int | None, int]] = lambda: (None, 0)

    @property
    def tier(self) -> DaemonTier | None:
        """The host tier (``--host-memory``), or None."""
        tier = self.manager.tier
        return tier if isinstance(tier, DaemonTier) else None

    def process(self, payload: bytes, *, replaying: bool = False, own: bool = False) -> bytes:
        """Apply one scheduler message, journal it and stage its deltas; returns the reply. Never raises.

        ``own``: a message of the daemon's own (an expiry), which alone may hold the daemon's ops; ``replaying``: a
        journal's record at recovery, applied as it was let in when written. An unexpected exception (a bug) is
        logged and answered as an internal error; the daemon goes on serving.
        """
        try:
            return self._process_checked(payload, replaying, own)
        except Exception as exc:  # the daemon must outlive its own bugs
            log.exception("internal error while handling a message")
            self.count_error("internal")
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
            self.count_error("decode")
            return error_reply(request_id, str(exc))
        self.leases.touch(client, time.monotonic())
        digest = zlib.crc32(payload) | len(payload) << 32
        kept = self.retries.get(client, request_id)
        if kept is not None:
            if kept[0] != digest:
                self.count_error("validate")
                return error_reply(request_id, f"id: request id {request_id} of client {client!r} was answered "
                                               "before for a different request; a new request needs a new id")
            return kept[1]
        if self.retries.answered(client, request_id):
            self.count_error("validate")
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
            self.count_error("validate")
            reply = error_reply(request_id, str(exc))
            self.retries.put(client, request_id, digest, reply)
            return reply
        journaled = self.journal is not None and not replaying and any(op.kind in _MUTATING for op in ops)
        if journaled:
            try:
                self.journal.reserve(len(payload))
            except JournalFull as exc:  # nothing applied; a retry once there is room is applied then
                self.count_error("journal")
                return error_reply(request_id, str(exc))
        results, deltas = self._apply(ops, client)
        stream = self.deltas
        for changes, freed, reset, orders in deltas:
            stream.stage(changes, freed, reset, orders)
        reply = pack({"v": PROTOCOL_VERSION, "id": request_id, "ok": True, "epoch": stream.epoch, "seq": stream.seq,
                      "results": results})
        if len(reply) > self.config.max_reply_bytes:
            log.warning("a reply of %d bytes passed --max-reply-bytes (%d), above its bound of %d bytes",
                        len(reply), self.config.max_reply_bytes, bound)
        self.retries.put(client, request_id, digest, reply)
        if journaled:
            self.journal.append(payload)
        if self.collect_events:
            self.staged_events.extend(self.manager.take_events())
        if self.metrics is not None and not replaying:  # a replayed message's counts reach them by difference
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
        receivers = sum(len(e or "") + 8 for e in self.pd.receivers)
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
                    total += receivers + self._cell_bytes + 64 * len(m.rows)
                elif op.pd is not None:  # a prefill admit's plan: its destination's receivers and decode daemon
                    total += sum(len(e) + 8 for e in op.pd["receivers"]) + len(op.pd.get("decode") or "") + 256
                sent += op.tokens.size
            elif kind in ("extend", "table"):
                known = op.req in self.slots.of
                held = m.num_tokens(op.req) if known else 0
                if kind == "extend":
                    sent += op.tokens.size
                # Blocks reserved ahead make a table longer than its tokens fill.
                width = max(m.table(op.req).shape[1] if known else 0, -(-(held + sent + op.ahead) // bs))
                total += (column if kind == "extend" else 4 * rows) * width
            elif kind == "plans":
                reqs = (op.pd or {}).get("reqs", ())
                held = sum(m.num_tokens(r) for r in reqs if r in self.slots.of)
                total += 2 * 4 * rows * -(-(held + sent) // bs) + 1024 * len(reqs)
                total += sum(self.pd.plan_bytes(r) for r in reqs)
            elif kind == "owned":
                total += (MAX_ID_CHARS + 16) * self.leases.count(client)
            elif kind == "reclaim":
                total += (MAX_ID_CHARS + 16) * len(op.reqs or ())
            elif kind == "tier_failed" and self.tier is not None:
                total += (MAX_ID_CHARS + 16) * self.tier.num_failed
            elif kind == "pd_poll":
                total += (MAX_ID_CHARS + MAX_ERROR + 32) * self.pd.unread(client)
            elif kind in ("usage", "stats", "info"):
                total += 4096 + 128 * len(m.rows) + self._cell_bytes
            elif kind in ("match_blocks", "allocate_blank", "owned_blocks", "free_blocks"):  # block id arrays
                total += 64 + 8 * m.num_blocks
        return total

    def _validate(self, raw_ops: list, *, trusted: bool = False) -> list[_Op]:
        """Check every op before any is applied: who may send it (``protocol.OP_CALLERS``; ``trusted``: the daemon's
        own message or a journal's), fields, and request liveness in op order.

        The usual values (an int or short str id, an admit with no optional field) pass inline checks; anything
        else goes to the protocol's checks, which name the field.
        """
        cfg = self.config
        live: dict[Any, bool] = {}  # this message's admits (True) and frees (False) so far
        admitted = self.slots.of
        slots_taken: dict[int, bool] = {}
        ops: list[_Op] = []
        pd = self.pd
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
                        raise ProtocolError(f"ops[{i}].req: request {req!r} is already admitted"
                                            f"{pd.held_note(req)}")
                    tokens = check_tokens(op.get("tokens"), f"ops[{i}].tokens", cfg.max_tokens)
                    if tokens.size == 0:
                        raise ProtocolError(f"ops[{i}].tokens: must hold at least one token")
                    if kind == "admit" and len(op) == 3:  # op, req and tokens: no optional field
                        ops.append(_Op(kind, req, tokens))
                    else:
                        ops.append(self._admit_op(op, i, kind, req, tokens, slots_taken, trusted))
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

    def _admit_op(self, op: dict, i: int, kind: str, req: Any, tokens: np.ndarray, slots_taken: dict[int, bool],
                  trusted: bool = False) -> _Op:
        """An admit's or reserve's optional fields checked (num_tokens, slot, PD fields, salt, LoRA, multimodal).

        ``trusted`` (a journal's): a destination's rows are not checked again (older journals' carry none)."""
        cfg, field = self.config, f"ops[{i}]"
        number = op.get("num_tokens")
        if number is not None:
            check_int(number, f"{field}.num_tokens", least=1, most=int(tokens.size))
        slot = op.get("slot")
        if slot is not None:
            check_int(slot, f"{field}.slot", least=0, most=cfg.max_slots - 1)
            if slots_taken.get(slot, slot in self.slots.owner):
                raise ProtocolError(f"{field}.slot: slot {slot} is in use")
            slots_taken[slot] = True
        pd = None
        if kind == "reserve":
            self.pd.check_role(kind, field)
            if number is not None:
                raise ProtocolError(f"{field}.num_tokens: a reservation takes the whole prompt")
            if op.get("dest") is not None:
                raise ProtocolError(f"{field}.dest: a reservation takes no destination (a prefill admit does)")
            pd = {"timeout": self.pd.check_reserve(op, field)}
        elif op.get("dest") is not None:
            self.pd.check_role("sent", field)  # a destination needs --role prefill
            pd = self.pd.check_dest(op, field, int(tokens.size), None if trusted else self.pd_rows)
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
        admin = self.admin_key is not None and type(op.get("admin")) is int and op["admin"] == self.admin_key
        if kind in TIER_OPS:
            return _Op(kind, pd=self._tier_fields(kind, op, field, trusted, admin))
        if kind in PD_OPS:
            fields = validate_op(self.pd, kind, op, field, trusted=trusted, admin=admin)
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
                if self.leases.owner(req) is None:
                    self.leases.own(client, req)
            elif req not in m:
                self.leases.release(req)

    def release_owned_ops(self, req: Any) -> list[dict[str, Any]]:
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
        known: int | None = self.manager.num_tokens(req) if req in self.slots.of else None
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
                    if not self.slots.available(op.slot):
                        raise KVCacheError(f"slot: all {self.slots.limit} slots are in use" if op.slot is None
                                           else f"slot: slot {op.slot} is in use")
                    adm = m.admit(op.req, op.tokens, cache_salt=op.salt, lora=op.lora, mm=op.mm,
                                  num_tokens=op.number)
                    if adm is None:
                        results.append(None)
                        continue
                    slot = self.slots.take(op.req, op.slot)
                    self.leases.own(client, op.req)
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
                        self.pd.start(op.req, client, table, adm.num_cached_tokens, op.pd["timeout"],
                                       time.monotonic(), dest)
                        if op.kind == "reserve":
                            result["receivers"] = list(self.pd.receivers)
                            result["rows"] = self.pd_rows
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
                        changes.add(op.req, self.slots.of[op.req], table.shape[1], cols, vals)
                    results.append({"len": table.shape[1], "cols": cols, "vals": vals})
                elif op.kind == "extend_many":
                    results.append(self._extend_many(op, changes))
                elif op.kind == "free":
                    m.free(op.req)
                    self.slots.release(op.req)
                    self.leases.release(op.req)
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
                    self.observe(force=True)  # the metrics endpoint then shows what stats says, no interval behind
                    results.append(self.stats())
                elif op.kind == "info":
                    results.append(self.info())
                elif op.kind == "reclaim":
                    results.append(self.leases.reclaim(client, op.reqs or (), time.monotonic()))
                elif op.kind == "owned":
                    results.append(self.leases.owned(client))
                elif op.kind == "ping":
                    results.append("pong")
                elif op.kind == "check_integrity":
                    try:
                        self.manager.check_integrity()
                        self.pd.check_integrity(self.manager)
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
                        self.slots.release(req)
                        self.leases.release(req)
                        freed.append(req)
                    results.append(result)
            except KVCacheError as exc:
                results.append({"error": str(exc)})
        orders = tier.take_orders() if tier is not None else []
        if orders:  # with the message's last delta: workers see the tables and the copies that fill them together
            end = time.monotonic() + self.config.tier_timeout
            self.tier_deadlines.update((order["job"], end) for order in orders)
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
        pd, fields = self.pd, op.pd or {}
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
        plans = self.pd.plans(reqs)
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
            slot_of = self.slots.of
            changes.add_many(reqs, [slot_of[r] for r in reqs], d.lens[d.index].tolist(),
                             (d.offsets[1:] - d.offsets[:-1]).tolist(), d.cols, d.vals)
        return {"lens": d.lens, "changed": {"index": d.index, "offsets": d.offsets, "cols": d.cols, "vals": d.vals}}

    def snapshot(self) -> bytes:
        """Every live table with its slot, at the current seq (for workers that fell too far behind)."""
        tables = [{"req": req, "slot": slot, "table": self.manager.table(req)} for req, slot in self.slots.of.items()]
        return pack({"v": PROTOCOL_VERSION, "epoch": self.deltas.epoch, "seq": self.deltas.seq,
                     "tables": tables})

    def info(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "epoch": self.deltas.epoch,
            "num_blocks": self.manager.num_blocks,
            "block_size": self.manager.block_size,
            "num_rows": self.manager.num_rows,
            "rows": describe_rows(self.manager.rows, self.manager.row_blocks.tolist(), self.layout),
            "pub_endpoint": cfg.pub_endpoint,
            "replay_endpoint": cfg.replay_endpoint,
            "local_endpoint": cfg.local_endpoint if cfg.local_endpoint != LOCAL_OFF else None,
            "events_endpoint": cfg.events_endpoint if cfg.events else None,
            "events_replay_endpoint": cfg.events_replay_endpoint if cfg.events else None,
            "prefix_caching": self.manager.enable_prefix_caching,
            "hash_algorithm": cfg.hash_algorithm,
            "max_slots": cfg.max_slots,
            "role": cfg.role,
            "tp": cfg.tp,
            "receivers": list(self.pd.receivers) if cfg.role == "decode" else None,
            "host_tier": {"num_blocks": self.tier.num_blocks, "timeout": cfg.tier_timeout} if self.tier else None,
            "lease_timeout": cfg.lease_timeout,
            **self.extra_info,
        }

    def stats(self) -> dict[str, Any]:
        out = dict(self.manager.stats()._asdict())
        out["seq"] = self.deltas.seq
        out["free_blocks"] = self.manager.num_free_blocks
        out["subscribers"], out["local_subscribers"] = self.subscriber_counts()
        out["expired_requests"] = self.expired
        out["in_transfer"] = len(self.pd.transfers)
        out["transfers"] = dict(self.pd.totals)
        if self.tier is not None:
            out["host_tier"] = self.tier.stats()._asdict()
        return out

    def observe(self, force: bool = False) -> None:
        """Count the answered messages and published deltas in the metrics, at most every ``METRICS_INTERVAL_S``
        (or now, with ``force``, gauges too when nothing came): after the replies went out, as metrics only
        observe, and in one go, so a busy daemon pays once per interval for the manager's totals and the
        Prometheus calls, not per message. The serve loop calls it at least every ``poll_ms``, so an idle
        daemon's metrics catch up."""
        if self.metrics is None or not (force or self._observed or self.deltas.totals[0]):
            return
        now = time.monotonic()
        if not force and now < self._next_observe:
            return
        self._next_observe = now + METRICS_INTERVAL_S
        kinds = collections.Counter(op.kind for ops, _ in self._observed for op in ops)
        self.metrics.observe_steps(kinds, [seconds for _, seconds in self._observed])
        self._observed.clear()
        totals = self.deltas.totals
        if totals[0]:
            self.metrics.observe_deltas(*totals)
            totals[:] = [0, 0, 0]
        self.metrics.update(self.manager)  # gauges too: this runs at most once an interval already
        if self.pd.role != "both":
            self.metrics.update_pd(self.pd)
        if self.tier is not None:
            self.metrics.update_tier(self.tier.stats())

    def count_error(self, kind: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_error(kind)

"""The daemon's half of PD disaggregation: decode-side reservations and prefill-side transfers, owned by the server
thread.

Pure state: no sockets, no clocks of its own; the server passes ``now`` and applies the frees this
module asks for (so deltas, slots and leases stay in one place). The flow is in ``kvcache.pd``.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.manager import Admission
from kvcache.allocator.rows import Row, describe_policy
from kvcache.allocator.swa import AttentionPolicy
from kvcache.protocol import ProtocolError, check_int, check_request_id, show

ROLES = ("both", "prefill", "decode")
DECODE_OPS = frozenset({"reserve", "received"})
PREFILL_OPS = frozenset({"plans", "sent"})
SHARED_OPS = frozenset({"attach", "transfer_failed", "cancel", "pd_poll"})  # attach: a receiver's or a messager's
PD_OPS = DECODE_OPS | PREFILL_OPS | SHARED_OPS
MUTATING = frozenset({"reserve", "attach", "received", "sent", "transfer_failed", "cancel"})
MAX_ENDPOINT = 1024
MAX_ERROR = 4096
OUTCOMES = ("started", "done", "failed", "cancelled")
MAX_DURATIONS = 4096  # done transfers' durations kept for the metrics to drain (the oldest go first)
TIMED_OUT = "transfer timed out after "
"""How the daemon's own expiry of a transfer (``CacheServer.expire_transfers``, journaled as a ``transfer_failed``)
begins its error: ``PDState.fail`` tells it from a report by what it says, so a journal replays it the same way."""


class Reservation(NamedTuple):
    """A decode daemon's ``reserve``: an admission plus each decode rank's receiver endpoint and the daemon's rows
    (each row's policy and cells: what the prefill daemon checks its own rows against)."""

    num_cached_tokens: int
    table: np.ndarray
    num_tokens: int
    receivers: tuple[str, ...]
    rows: list[dict[str, Any]] | None = None

    def dest(self, decode_endpoint: str, timeout: float | None = None) -> dict[str, Any]:
        """The ``dest`` of the prefill daemon's admit: where this reservation's blocks are."""
        out = {"receivers": list(self.receivers), "table": np.ascontiguousarray(self.table, dtype=np.int32),
               "cached": self.num_cached_tokens, "decode": decode_endpoint}
        if self.rows is not None:
            out["rows"] = self.rows
        if timeout is not None:
            out["timeout"] = timeout
        return out


class Sending(Admission):
    """A prefill daemon's admit with ``dest``: the admission, plus ``plan``, what its messagers write where.

    ``plan`` is what the ``plans`` op returns for the request. A scheduler that hands it to the
    prefill workers with the step (``PrefillLink.run_step(..., plans=...)``) saves them asking the
    daemon after the step has begun (vLLM's connector metadata travels the same way).
    """

    plan: dict[str, Any]

    def __new__(cls, num_cached_tokens: int, table: np.ndarray, num_tokens: int, plan: dict[str, Any]) -> Sending:
        self = super().__new__(cls, num_cached_tokens, table, num_tokens)
        self.plan = plan
        return self


class Outcomes(NamedTuple):
    """What ``pd_poll`` reports: requests done (CLOCK_MONOTONIC ns when the daemon saw it) and failed (why)."""

    done: dict[Any, int]
    failed: dict[Any, str]


@dataclasses.dataclass(slots=True)
class Transfer:
    """One request in flight between the nodes, as one daemon sees it."""

    req: Any
    owner: str
    first_block: int  # blocks before this are not moved (the decode side had them cached)
    own_blocks: int  # blocks this node had cached at admit: valid whatever happens to the transfer
    timeout: float
    deadline: float
    serial: int
    reported: set[int] = dataclasses.field(default_factory=set)  # ranks that reported completion
    deps: set[int] = dataclasses.field(default_factory=set)  # decode: serials of requests whose blocks it shares
    cancelled: bool = False
    dest: dict[str, Any] | None = None  # prefill: receivers, table, cached, decode
    arriving: tuple[np.ndarray, np.ndarray] | None = None  # decode: the (row, block) pairs it marked pending
    held: bool = False  # decode: failed at its deadline; its blocks wait for its writers to stop (PDState.fail)


def check_timeout(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86_400:
        raise ProtocolError(f"{field}: must be seconds in (0, 86400], got {show(value)}")
    return float(value)


def describe_layout(policies: Sequence[AttentionPolicy], layout: Sequence[Row] | None) -> list[dict[str, Any]]:
    """A daemon's rows as its reserve reply carries them: each row's policy, and its cells (``layers``,
    ``kv_heads``) where the daemon knows them (``--model``)."""
    if layout is not None:
        return [row.describe() for row in layout]
    return [describe_policy(p) for p in policies]


def check_same_rows(theirs: Any, ours: list[dict[str, Any]], field: str) -> None:
    """Refuse a destination whose rows (the decode daemon's, ``theirs``) differ from this daemon's, naming the
    first difference; None passes only where this daemon has one row."""
    if theirs is None:
        if len(ours) > 1:
            raise ProtocolError(f"{field}.rows: missing; this daemon has {len(ours)} rows, so the destination must "
                                "carry the decode daemon's (its reserve's rows, as Reservation.dest passes them)")
        return
    if not isinstance(theirs, list) or not all(isinstance(r, dict) for r in theirs):
        raise ProtocolError(f"{field}.rows: must be a list of maps (the decode daemon's reserve's rows)")
    why = row_difference(theirs, ours)
    if why:
        raise ProtocolError(f"{field}: the decode daemon's rows differ from this daemon's: {why}")


def row_difference(theirs: list[dict[str, Any]], ours: list[dict[str, Any]]) -> str:
    """The first difference between two described row layouts (``Row.describe``), ``theirs`` "there" and ``ours``
    "here", in a few words ("" when they are the same): their counts, a row's cells, or a row's policy."""
    if len(theirs) != len(ours):
        return f"{len(theirs)} rows there, {len(ours)} here"
    for i, (there, here) in enumerate(zip(theirs, ours)):
        if there == here:
            continue
        if _cells(there) != _cells(here):
            return f"row {i} holds {_cells(there)} there; {_cells(here)} here"
        policy = [{k: v for k, v in row.items() if k not in ("layers", "kv_heads")} for row in (there, here)]
        return f"row {i} is {show(policy[0])} there, {show(policy[1])} here"
    return ""


def _cells(row: dict[str, Any]) -> str:
    """A described row's cells for a message: its layers and kv heads as tuples ("unknown" where not described)."""
    def items(value: Any) -> str:
        return show(tuple(value)) if isinstance(value, list) else "unknown" if value is None else show(value)
    return f"layers {items(row.get('layers'))}, kv heads {items(row.get('kv_heads'))}"


def _check_str(value: Any, field: str, most: int) -> str:
    if not isinstance(value, str) or not value or len(value) > most:
        raise ProtocolError(f"{field}: must be a non-empty str of at most {most} characters")
    return value


class PDState:
    """The PD half of a daemon: its role, its ranks, and every request in transfer."""

    def __init__(self, role: str, tp: int, rows: int, num_blocks: int, block_size: int, timeout: float) -> None:
        if role not in ROLES:
            raise KVCacheError(f"role: {role!r} is not one of {', '.join(ROLES)}")
        self.role = role
        self.tp = tp
        self.block_size = block_size
        self.timeout = timeout
        # decode: each rank's NIXL metadata endpoint; prefill: its messager's (or ""), once attached
        self.receivers: list[str | None] = [None] * tp
        # The key each rank was attached with (None: none given): only that key attaches the rank again, and only a
        # worker naming it reports for the rank (received, sent)
        self.owners: list[int | None] = [None] * tp
        self.transfers: dict[Any, Transfer] = {}
        self._by_serial: dict[int, Any] = {}
        self._serial = 0
        self._pending = np.full((rows, num_blocks), -1, dtype=np.int64)  # decode: serial still writing each block
        self._outbox: dict[str, list[tuple[str, Any, Any]]] = {}  # owner -> ("done", req, t_ns) / ("failed", req, error)
        self.totals = dict.fromkeys(OUTCOMES, 0)  # transfers begun and ended, by outcome (kept across restarts)
        self._begun: dict[int, float] = {}  # serial -> time.monotonic() at start, for transfers begun in this process
        self.durations: collections.deque[float] = collections.deque(maxlen=MAX_DURATIONS)  # done ones' seconds

    def __setstate__(self, state: dict[str, Any]) -> None:
        """After a restart (journal snapshot) every deadline starts afresh; durations count only what this process saw."""
        for key, value in state.items():
            setattr(self, key, value)
        if "owners" not in state:  # a snapshot from before ranks had owners: an attached rank keeps its endpoint
            self.owners = [None] * self.tp
        self.forget_timing()
        now = time.monotonic()
        for t in self.transfers.values():
            t.deadline = now + t.timeout
            if not hasattr(t, "held"):  # a snapshot from before held transfers
                t.held = False

    def __getstate__(self) -> dict[str, Any]:
        """What a journal snapshot saves: no clock readings."""
        return {name: getattr(self, name) for name in ("role", "tp", "block_size", "timeout", "receivers", "owners", "transfers",
                                                       "_by_serial", "_serial", "_pending", "_outbox", "totals")}

    def forget_timing(self) -> None:
        """Drop start times and durations (after replaying a journal, whose clock readings are the replay's)."""
        self._begun = {}
        self.durations = collections.deque(maxlen=MAX_DURATIONS)

    # ------------------------------------------------------------------ validation (no state change)

    def check_role(self, kind: str, field: str) -> None:
        need = "decode" if kind in DECODE_OPS else "prefill" if kind in PREFILL_OPS else None
        if self.role == "both" or (need is not None and self.role != need):
            wanted = need or "prefill or decode"
            raise ProtocolError(f"{field}.op: {kind} needs a daemon started with --role {wanted} "
                                f"(this one is --role {self.role})")

    def check_rank(self, value: Any, field: str) -> int:
        return check_int(value, field, least=0, most=self.tp - 1)

    def check_reserve(self, op: dict, field: str) -> float:
        """The reservation's timeout; refuses while a decode rank has no receiver attached."""
        missing = [r for r, e in enumerate(self.receivers) if e is None]
        if missing:
            raise ProtocolError(f"{field}: decode rank(s) {missing} have no receiver attached yet "
                                "(start the decode workers' CacheReceiver first)")
        return self._timeout(op, field)

    def _timeout(self, op: dict, field: str) -> float:
        return self.timeout if op.get("timeout") is None else check_timeout(op["timeout"], f"{field}.timeout")

    def check_dest(self, op: dict, field: str, num_tokens: int, rows: list[dict[str, Any]] | None) -> dict[str, Any]:
        """A prefill admit's destination: the decode receivers, its table, its cached tokens, its daemon.

        ``rows`` are this daemon's rows (``describe_layout``); the decode daemon's (``dest.rows``, from its
        reserve) must be the same cells with the same policies, row by row, or the messagers would write one
        row's blocks into another's. A daemon of one row takes a destination without them (a uniform table);
        ``rows`` None (a journal's admit, let in when it was made) skips the check.
        """
        dest = op.get("dest")
        if not isinstance(dest, dict):
            raise ProtocolError(f"{field}.dest: must be a map with receivers, table, cached and decode")
        if rows is not None:
            check_same_rows(dest.get("rows"), rows, f"{field}.dest")
        receivers = dest.get("receivers")
        if not isinstance(receivers, list) or not 1 <= len(receivers) <= 1024:
            raise ProtocolError(f"{field}.dest.receivers: must be a list of 1 to 1024 endpoints (one per decode rank)")
        for i, e in enumerate(receivers):
            _check_str(e, f"{field}.dest.receivers[{i}]", MAX_ENDPOINT)
        table = dest.get("table")
        blocks = -(-num_tokens // self.block_size)
        rows = self._pending.shape[0]
        if not isinstance(table, np.ndarray) or table.dtype.kind not in "iu" or table.ndim != 2 or table.shape[0] != rows:
            raise ProtocolError(f"{field}.dest.table: must be the decode side's int table [{rows}, blocks] (one row "
                                f"per row of this daemon: both nodes must use the same --rows)")
        if table.shape[1] != blocks:
            raise ProtocolError(f"{field}.dest.table: has {table.shape[1]} blocks; {num_tokens} tokens at block size "
                                f"{self.block_size} need {blocks} (both nodes must use one block size)")
        least = -1 if rows > 1 else 0  # a head-wise table has -1 where a window head keeps no block
        if table.size and (int(table.min()) < least or int(table.max()) > 2**31 - 1):
            raise ProtocolError(f"{field}.dest.table: block ids must be in [{least}, 2**31)")
        cached = check_int(dest.get("cached"), f"{field}.dest.cached", most=max(0, num_tokens - 1))
        if cached % self.block_size:
            raise ProtocolError(f"{field}.dest.cached: {cached} is not a multiple of the block size {self.block_size}")
        decode = _check_str(dest.get("decode"), f"{field}.dest.decode", MAX_ENDPOINT)
        return {"receivers": list(receivers), "table": table.astype(np.int32), "cached": cached, "decode": decode,
                "timeout": self._timeout(dest, f"{field}.dest")}

    def check_error(self, op: dict, field: str) -> str:
        error = op.get("error")
        if not isinstance(error, str) or len(error) > MAX_ERROR:
            raise ProtocolError(f"{field}.error: must be a str of at most {MAX_ERROR} characters")
        return error

    def check_in_transfer(self, req: Any, field: str) -> None:
        if req not in self.transfers:
            raise ProtocolError(f"{field}.req: request {show(req)} is not in transfer on this daemon")

    def check_not_in_transfer(self, req: Any, field: str, kind: str) -> None:
        """free (and, on decode, extend) of a request still moving is refused: its blocks are being written or read.

        A prefill node extends a request in transfer: its next prompt chunk (chunked prefill).
        """
        if req in self.transfers and not (kind == "extend" and self.role == "prefill"):
            if self.transfers[req].held:
                raise ProtocolError(f"{field}.req: request {show(req)}{self.held_note(req)}")
            raise ProtocolError(f"{field}.req: request {show(req)} is still in transfer; {kind} it once pd_poll "
                                "reports it, or cancel it")

    def held_note(self, req: Any) -> str:
        """For a refusal naming a request held after its deadline: why its id is still taken, and until when."""
        t = self.transfers.get(req)
        if t is None or not t.held:
            return ""
        left = max(0.0, t.deadline - time.monotonic())
        return (f": it failed at its transfer deadline and its blocks are held until its writers stop (every decode "
                f"rank's received, or {left:.1f} s more); the daemon releases it then")

    # ------------------------------------------------------------------ apply (the server runs these in op order)

    def check_attach(self, rank: int, key: int | None, field: str) -> None:
        """Refuse to change the endpoint of an attached rank but for the key it was attached with."""
        if self.receivers[rank] is not None and (self.owners[rank] is None or key != self.owners[rank]):
            side = "decode" if self.role == "decode" else "prefill"
            raise ProtocolError(f"{field}.key: attach of {side} rank {rank} refused: the rank is attached already; "
                                "who may change its endpoint: the worker that attached it (the key it attached "
                                "with) or an admin (the daemon's admin key), never another client")

    def check_reporter(self, kind: str, rank: int, key: Any, field: str) -> None:
        """Refuse a report for ``rank`` but from the worker attached as that rank (naming the key it attached with)."""
        owner = self.owners[rank]
        if self.receivers[rank] is None or owner is None or type(key) is not int or key != owner:
            who = "receiver" if kind == "received" else "messager"
            raise ProtocolError(f"{field}.key: {kind} for rank {rank} counts only from the {who} attached as rank "
                                f"{rank} (who may send it: that worker, naming the key it attached with); this "
                                "sender is not it")

    def attach(self, rank: int, endpoint: str, key: int | None = None) -> bool:
        """Decode rank ``rank``'s receiver is at ``endpoint``; ``key`` claims the rank (``check_attach``)."""
        self.receivers[rank] = endpoint
        self.owners[rank] = key
        return True

    def start(self, req: Any, owner: str, table: np.ndarray, cached_tokens: int, timeout: float, now: float,
              dest: dict[str, Any] | None = None) -> Transfer:
        """A reservation (decode) or a transfer to send (prefill, with ``dest``) begins.

        ``cached_tokens`` is this node's own prefix hit: a failed transfer discards only blocks past it
        (a prefill worker computes from there). Decode notes the blocks still arriving.
        """
        self._serial += 1
        own = cached_tokens // self.block_size
        first = own if dest is None else dest["cached"] // self.block_size
        t = Transfer(req, owner, first, own, timeout, now + timeout, self._serial, dest=dest)
        self.transfers[req] = t
        self._by_serial[t.serial] = req
        self._begun[t.serial] = now
        self.totals["started"] += 1
        if self.role == "decode" and table.size:
            rows = np.broadcast_to(np.arange(table.shape[0])[:, None], table.shape)
            held = table >= 0  # a head-wise table's window heads have holes
            hit = held[:, :first]
            owners = self._pending[rows[:, :first][hit], table[:, :first][hit]]
            t.deps = {int(s) for s in np.unique(owners[owners >= 0])}
            arriving = held[:, first:]
            t.arriving = (rows[:, first:][arriving], table[:, first:][arriving].astype(np.intp))
            self._pending[t.arriving] = t.serial
        return t

    def report(self, req: Any, rank: int, now_ns: int) -> list[tuple[Any, int | None]]:
        """Rank ``rank`` finished ``req``; returns the requests to end as (req, discard_from or None to keep)."""
        t = self.transfers[req]
        t.reported.add(rank)
        return self._settle(now_ns)

    def fail(self, req: Any, error: str) -> list[tuple[Any, int | None]]:
        """``req`` failed (and whatever waits on its blocks): release them, tell their owners.

        On a decode node a request whose deadline passed (the daemon's expiry, its error beginning with
        ``TIMED_OUT``) with ranks that never reported it is *held* instead: its owner hears now, but its
        blocks leave the free pool only once every such rank reports it (``received``: its writers finished,
        or they gave up and its receiver cut them off, so nothing of theirs can land any more) or the next
        expiry, one more timeout later. A one-sided write still on its way (a TCP connection retransmitting
        once a link is back) then lands in blocks nobody has. Other reports of its failure meanwhile change
        nothing.
        """
        expired = error.startswith(TIMED_OUT)
        ends: list[tuple[Any, int | None]] = []
        queue = [req]
        while queue:
            t = self.transfers.get(queue.pop())
            if t is None:
                continue
            if t.held and not expired:
                continue  # its writers have not all stopped yet
            if self.role == "decode" and expired and not t.held and len(t.reported) < self.tp:
                t.held = True
                t.deadline = time.monotonic() + t.timeout
                self.totals["cancelled" if t.cancelled else "failed"] += 1
                if not t.cancelled:
                    self._tell(t.owner, "failed", t.req, error)
                queue += [d.req for d in self.transfers.values() if t.serial in d.deps]
                error = f"a request it shares cached blocks with failed: {error}"
                continue
            del self.transfers[t.req]
            self._forget(t)
            if t.held:  # one more timeout passed: its owner heard long ago
                ends.append((t.req, t.own_blocks))
                queue += [d.req for d in self.transfers.values() if t.serial in d.deps]
                continue
            self.totals["cancelled" if t.cancelled else "failed"] += 1
            if not t.cancelled:
                self._tell(t.owner, "failed", t.req, error)
            ends.append((t.req, t.own_blocks))
            queue += [d.req for d in self.transfers.values() if t.serial in d.deps]
            error = f"a request it shares cached blocks with failed: {error}"
        return ends

    def cancel(self, req: Any, release: bool = False) -> list[tuple[Any, int | None]]:
        """The scheduler gave up: tell it now; the blocks go once the writers stop (reports, failure or deadline).

        ``release``: the caller knows no writer has the request (its prefill admit never
        happened), so the blocks go now.
        """
        t = self.transfers[req]
        if release:
            t.reported.update(range(self.tp))
        if not t.cancelled and not t.held:
            t.cancelled = True
            self._tell(t.owner, "failed", req, "cancelled")
        return self._settle(time.monotonic_ns())

    def expired(self, now: float) -> list[Any]:
        return [t.req for t in self.transfers.values() if now >= t.deadline]

    def plans(self, reqs: list[Any]) -> list[dict[str, Any] | None]:
        """What the prefill messagers write for each request (None: not being sent; cancelled ones say so)."""
        out: list[dict[str, Any] | None] = []
        for req in reqs:
            t = self.transfers.get(req)
            if t is None or t.dest is None:
                out.append(None)
                continue
            if t.cancelled:  # the messagers tell the decode side, which then releases at once
                out.append({"req": req, "cancelled": True, "decode": t.dest["decode"]})
                continue
            out.append({"req": req, **{k: t.dest[k] for k in ("receivers", "table", "cached", "decode")},
                        "first_block": t.first_block, "deadline_s": max(0.0, t.deadline - time.monotonic())})
        return out

    def plan_bytes(self, req: Any) -> int:
        """Bytes ``plans`` may spend on ``req`` beyond its tables: its destination's receivers and decode daemon."""
        t = self.transfers.get(req)
        if t is None or t.dest is None:
            return 0
        return sum(len(e) + 8 for e in t.dest["receivers"]) + len(t.dest.get("decode") or "") + 256

    def poll(self, owner: str) -> dict[str, list]:
        """Outcomes for ``owner``'s requests since its last poll: done [req, t_ns] and failed [req, error]."""
        events = self._outbox.pop(owner, [])
        return {"done": [[req, x] for kind, req, x in events if kind == "done"],
                "failed": [[req, x] for kind, req, x in events if kind == "failed"]}

    def unread(self, owner: str) -> int:
        """How many outcomes ``owner``'s next poll returns."""
        return len(self._outbox.get(owner, ()))

    def forget_owner(self, owner: str) -> None:
        """Drop the unread outcomes of a scheduler that is gone (its lease expired)."""
        self._outbox.pop(owner, None)

    def check_integrity(self, manager: Any) -> None:
        """Raise AssertionError with the numbers if transfers, the pending-block map and the manager disagree."""
        for req, t in self.transfers.items():
            assert req in manager, f"request {req!r} is in transfer but not admitted"
            assert self._by_serial.get(t.serial) == req, f"request {req!r}: serial {t.serial} is not indexed"
            assert t.deps <= self._by_serial.keys(), f"request {req!r} waits on finished serials {t.deps}"
        live = set(np.unique(self._pending[self._pending >= 0]).tolist())
        assert live <= self._by_serial.keys(), f"blocks still marked arriving for finished serials {live - set(self._by_serial)}"
        assert len(self._by_serial) == len(self.transfers), (
            f"{len(self._by_serial)} serials indexed for {len(self.transfers)} transfers")

    # ------------------------------------------------------------------ internals

    def _settle(self, now_ns: int) -> list[tuple[Any, int | None]]:
        """Finish every transfer all ranks reported (decode: once its dependencies are ready)."""
        ends: list[tuple[Any, int | None]] = []
        progress = True
        while progress:
            progress = False
            for t in list(self.transfers.values()):
                if t.req not in self.transfers or len(t.reported) < self.tp or (
                        t.deps and not t.cancelled and not t.held):
                    continue
                if t.held:  # failed at its deadline, and now every rank's writers have stopped
                    del self.transfers[t.req]
                    self._forget(t)
                    ends.append((t.req, t.own_blocks))
                    for d in [d for d in self.transfers.values() if t.serial in d.deps]:
                        ends += self.fail(d.req, "a request it shares cached blocks with failed: it timed out")
                    progress = True
                    continue
                del self.transfers[t.req]
                begun = self._begun.get(t.serial)
                self._forget(t)
                progress = True
                self.totals["cancelled" if t.cancelled else "done"] += 1
                if begun is not None and not t.cancelled:
                    self.durations.append(max(0.0, now_ns / 1e9 - begun))
                for other in self.transfers.values():
                    other.deps.discard(t.serial)
                if t.cancelled:
                    ends.append((t.req, t.own_blocks))  # the writers stopped: release, uncached
                elif self.role == "prefill":
                    self._tell(t.owner, "done", t.req, now_ns)
                    ends.append((t.req, None))  # sent: free, its blocks stay cached
                else:
                    self._tell(t.owner, "done", t.req, now_ns)  # ready: the decode scheduler takes it over
        return ends

    def _forget(self, t: Transfer) -> None:
        self._by_serial.pop(t.serial, None)
        self._begun.pop(t.serial, None)
        if self.role == "decode" and t.arriving is not None:  # its own pairs only: O(its blocks), no scan of all
            marked = t.arriving
            mine = self._pending[marked] == t.serial
            self._pending[marked[0][mine], marked[1][mine]] = -1

    def _tell(self, owner: str, kind: str, req: Any, detail: Any) -> None:
        self._outbox.setdefault(owner, []).append((kind, req, detail))


def validate_op(pd: PDState, kind: str, op: dict, field: str, *, trusted: bool = False,
                admin: bool = False) -> dict[str, Any]:
    """A PD op's fields (reserve's are an admit's, checked by the server), checked; ProtocolError names the field.

    ``trusted``: a journal's message, let in before (an attach or a report is not checked against the rank's owner
    again); ``admin``: the message holds the daemon's admin key, which attaches a rank whoever owns it."""
    pd.check_role(kind, field)
    if kind == "attach":
        rank = pd.check_rank(op.get("rank"), f"{field}.rank")
        key = op.get("key")
        if key is not None:
            key = check_int(key, f"{field}.key")
        if not (trusted or admin):
            pd.check_attach(rank, key, field)
        if pd.role == "prefill" and op.get("endpoint", "") == "":  # a messager has no endpoint to announce
            endpoint = ""
        else:
            endpoint = _check_str(op.get("endpoint"), f"{field}.endpoint", MAX_ENDPOINT)
        return {"rank": rank, "endpoint": endpoint, "key": key}
    if kind == "pd_poll":
        return {}
    if kind == "plans":
        reqs = op.get("reqs")
        if not isinstance(reqs, list) or len(reqs) > 65_536:
            raise ProtocolError(f"{field}.reqs: must be a list of at most 65536 request ids")
        return {"reqs": [check_request_id(r, f"{field}.reqs[{j}]") for j, r in enumerate(reqs)]}
    req = check_request_id(op.get("req"), f"{field}.req")
    pd.check_in_transfer(req, field)
    out: dict[str, Any] = {"req": req}
    if kind in ("received", "sent"):
        out["rank"] = pd.check_rank(op.get("rank"), f"{field}.rank")
        if not trusted:
            pd.check_reporter(kind, out["rank"], op.get("key"), field)
    elif kind == "transfer_failed":
        out["error"] = pd.check_error(op, field)
    elif kind == "cancel":
        release = op.get("release", False)
        if not isinstance(release, bool):
            raise ProtocolError(f"{field}.release: must be true or false")
        out["release"] = release
    return out

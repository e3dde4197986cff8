"""CacheClient: KVCacheManager's methods over the daemon's socket, and a batch form for whole steps.

Switching a scheduler from the library to the daemon is one line::

    cache = KVCacheManager(num_blocks, block_size)      # in-process
    cache = CacheClient("ipc:///run/kvcache.sock")       # shared daemon

Every call has a deadline (``timeout`` seconds, default 5, per attempt; with
``retries`` the same request is sent again, which the daemon never applies
twice): a daemon that is down or stuck gives ``DaemonUnavailable`` instead of
a hang. Not thread-safe:
give each thread its own client.

With ``local=True`` a client on the daemon's host sends what fits in a datagram
to the daemon's local endpoint (a Unix datagram socket): a round trip skips
ZMQ's four I/O-thread hand-offs, about 16 µs instead of 166 on a 2-core VM.

Before it connects to an ipc:// endpoint or the local endpoint, a client checks
that only its user or root can have put the socket there (kvcache.paths) and
refuses in one line otherwise: another user could answer in the daemon's place.
"""
from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
import time
import uuid
from typing import Any, Sequence

import numpy as np
import zmq

from kvcache.allocator import _tables
from kvcache.allocator.errors import KVCacheError
from kvcache.auth import CurveConfig, secure_client_socket
from kvcache.allocator.manager import Admission
from kvcache.allocator.pool import Usage
from kvcache.paths import check_socket_path
from kvcache.pd.state import Outcomes, Reservation, Sending
from kvcache.protocol import LOCAL_MAX_BYTES, PROTOCOL_VERSION, ProtocolError, bind_private, pack, unpack
from kvcache.rank_keys import curve_rank_key

log = logging.getLogger("kvcache.client")
_MAX_REPLY_BYTES = 1 << 31
_OVER_ZMQ = object()  # a local attempt's answer: send this request over ZMQ instead


class DaemonUnavailable(KVCacheError):
    """The daemon did not answer within the deadline (down, unreachable or stuck)."""


class DaemonError(KVCacheError):
    """The daemon refused a request (its message names the field and the reason); nothing changed."""


def _refusal(raw: Any) -> DaemonError | None:
    """An op's result as the DaemonError it is when the daemon refused the op (``{"error": reason}``), else None."""
    return DaemonError(raw["error"]) if type(raw) is dict and len(raw) == 1 and "error" in raw else None


def _as_token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(tokens, np.ndarray):
        return tokens
    try:
        arr = np.array(tokens, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise KVCacheError("tokens: expected a sequence of integers") from None
    if arr.ndim != 1:
        raise KVCacheError("tokens: expected a flat sequence of integers")
    if len(tokens) and not isinstance(tokens[0], (int, np.integer)):  # np.array accepts floats
        raise KVCacheError("tokens: expected integers")
    return arr


def _capacity(columns: int) -> int:
    """Columns to allocate for a table of ``columns``: the next power of two above it, at least 8.

    Strictly above: decode grows tables by one column, so a prompt of exactly a power of two blocks
    must not need a new buffer at its first decode block.
    """
    return max(8, 1 << max(0, columns).bit_length())


def _prefix_keys(cache_salt: str | None, lora: Any, mm: Sequence[Any] | None) -> dict[str, Any]:
    """A prefix op's optional hash keys as wire fields (multimodal items as ``[identifier, offset, length]``)."""
    fields: dict[str, Any] = {}
    if cache_salt is not None:
        fields["salt"] = cache_salt
    if lora is not None:
        fields["lora"] = lora
    if mm:
        fields["mm"] = [[str(m[0]), int(m[1]), int(m[2])] for m in mm]
    return fields


def _block_array(blocks: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block ids as the int32 array the wire carries; a negative or non-integer id is refused here, in one line."""
    array = np.asarray(blocks)
    if array.size and (array.dtype.kind not in "iu" or int(array.min()) < 0 or int(array.max()) >= 2**31):
        raise KVCacheError(f"blocks: must be block ids (integers >= 0), got {array.tolist()[:8]!r}")
    return array.astype(np.int32).ravel()


class _Mirror:
    """This client's copy of the tables it admitted, updated in place from deltas.

    Hands out read-only views that later calls keep current, as the
    library's tables are; a table that outgrows its buffer moves to a
    larger one (views handed out before keep the old buffer).
    """

    def __init__(self) -> None:
        self.views: dict[Any, np.ndarray] = {}
        # int32 [rows, capacity] (the view's columns, then -1) and a read-only alias whose slices are the views
        self._buffers: dict[Any, tuple[np.ndarray, np.ndarray]] = {}

    def __contains__(self, req: Any) -> bool:
        return req in self.views

    def put(self, req: Any, table: np.ndarray) -> np.ndarray:
        """Start mirroring ``req`` at ``table`` (a whole table); returns its view."""
        width = table.shape[1]
        buf = np.empty((table.shape[0], _capacity(width)), dtype=np.int32)
        buf[:, :width] = table
        buf[:, width:] = -1
        return self._adopt(req, buf, width)

    def apply(self, req: Any, length: int, cols: np.ndarray, vals: np.ndarray) -> np.ndarray:
        """``req``'s table after a delta: ``length`` columns wide, ``cols`` set to ``vals``; returns its view."""
        (buf, ro), old = self._buffers[req], self.views[req].shape[1]
        if length > buf.shape[1]:
            grown = np.full((buf.shape[0], _capacity(length)), -1, dtype=np.int32)
            grown[:, :old] = buf[:, :old]
            grown[:, cols] = vals
            return self._adopt(req, grown, length)
        if length < old:
            buf[:, length:old] = -1
        buf[:, cols] = vals
        if length != old:
            view = self.views[req] = ro[:, :length]
            return view
        return self.views[req]

    def append_columns(self, reqs: list[Any], lengths: list[int], vals: np.ndarray) -> list[np.ndarray] | None:
        """A decode step's deltas: each of ``reqs`` (distinct) gains column ``lengths[j] - 1`` holding ``vals[:, j]``.

        One C call writes every column (no fancy indexing). Returns their views, or None
        (nothing changed) unless each delta is that shape.
        """
        views = self.views
        bufs = []
        for req, length in zip(reqs, lengths):
            view = views.get(req)
            if view is None or view.shape[1] != length - 1:
                return None
            bufs.append(self._buffers[req])
        cols = np.array(lengths, dtype=np.int64) - 1
        full = set(_tables.set_columns([buf for buf, _ in bufs], cols, np.ascontiguousarray(vals, dtype=np.int32)))
        out = []
        for j, (req, length, (_, ro)) in enumerate(zip(reqs, lengths, bufs)):
            if j in full:  # its buffer is full: grow it
                out.append(self.apply(req, length, cols[j:j + 1].astype(np.int32), vals[:, j:j + 1]))
            else:
                view = views[req] = ro[:, :length]
                out.append(view)
        return out

    def drop(self, req: Any) -> None:
        self.views.pop(req, None)
        self._buffers.pop(req, None)

    def _adopt(self, req: Any, buf: np.ndarray, length: int) -> np.ndarray:
        """Make ``buf`` ``req``'s buffer; returns its view of ``length`` columns."""
        ro = buf.view()
        ro.flags.writeable = False
        self._buffers[req] = (buf, ro)
        view = self.views[req] = ro[:, :length]
        return view


class Batch(_tables.RunCollector):
    """Operations collected for one round trip: ``client.batch()``, add ops, ``send()`` → results.

    Results come in op order with the library's types (Admission or None,
    table or None, True, ...); an op the daemon could not apply gives a
    ``DaemonError`` instance in its place. Runs of two or more plain extends
    travel as one ``extend_many`` op (a decode step's shape), which the daemon
    applies in a single pass; each extend still gets its own result.
    """

    _as_tokens = staticmethod(_as_token_array)  # RunCollector.extend's conversion of tokens that are no ndarray

    def __init__(self, client: CacheClient) -> None:
        self._client = client
        self._wire: list[dict[str, Any]] = []  # ops as they go on the wire
        self._expands: list[bool] = []  # per wire op: a run of plain extends, one result per extend
        # RunCollector's _run_reqs and _run_tokens: the plain extends since the last other op
        self._count = 0  # results of the ops on the wire

    def __len__(self) -> int:
        return self._count + len(self._run_reqs)

    def admit(self, request_id: Any, prompt_tokens: Sequence[int] | np.ndarray, *, cache_salt: str | None = None,
              lora: str | tuple[str, str] | None = None, mm: Sequence[tuple[str, int, int]] | None = None,
              num_tokens: int | None = None, slot: int | None = None, dest: dict[str, Any] | None = None) -> Batch:
        op: dict[str, Any] = {"op": "admit", "req": request_id, "tokens": _as_token_array(prompt_tokens)}
        for key, value in (("salt", cache_salt), ("lora", lora), ("num_tokens", num_tokens), ("slot", slot),
                           ("dest", dest)):
            if value is not None:
                op[key] = value
        if mm:
            op["mm"] = [list(item) for item in mm]
        return self._add(op)

    def reserve(self, request_id: Any, prompt_tokens: Sequence[int] | np.ndarray, *, cache_salt: str | None = None,
                lora: str | tuple[str, str] | None = None, slot: int | None = None, timeout: float | None = None) -> Batch:
        """A decode daemon's admit for a request whose KV a prefill node will write (``--role decode``)."""
        op: dict[str, Any] = {"op": "reserve", "req": request_id, "tokens": _as_token_array(prompt_tokens)}
        for key, value in (("salt", cache_salt), ("lora", lora), ("slot", slot), ("timeout", timeout)):
            if value is not None:
                op[key] = value
        return self._add(op)

    # extend(request_id, tokens, *, num_computed_tokens=None) is RunCollector's (C): a plain extend, called
    # once per running request each step, is two list appends there; any other call comes here.

    def _extend_slow(self, request_id: Any, tokens: Sequence[int] | np.ndarray, *,
                     num_computed_tokens: int | None = None, num_lookahead_tokens: int = 0) -> Batch:
        """``extend`` called with keywords: one with ``num_computed_tokens`` or ``num_lookahead_tokens`` goes
        alone; others join the run."""
        if num_computed_tokens is not None or num_lookahead_tokens:
            op = {"op": "extend", "req": request_id, "tokens": _as_token_array(tokens)}
            if num_computed_tokens is not None:
                op["num_computed"] = num_computed_tokens
            if num_lookahead_tokens:
                op["lookahead"] = num_lookahead_tokens
            return self._add(op)
        return self.extend(request_id, tokens)  # the plain extend's one path (RunCollector's)

    def extend_many(self, request_ids: Sequence[Any] | np.ndarray, tokens: Sequence[int] | np.ndarray,
                    counts: Sequence[int] | np.ndarray, *, num_lookahead_tokens: int = 0) -> Batch:
        """As KVCacheManager.extend_many, as one op: request i gets the next ``counts[i]`` tokens.

        Its result is the list of tables (None where blocks ran short), or a
        DaemonError for the whole op. Arrays go on the wire as they are.
        """
        reqs = request_ids.tolist() if isinstance(request_ids, np.ndarray) else list(request_ids)
        per_request = np.asarray(counts)
        if not per_request.size:  # np.asarray([]) is float64
            per_request = per_request.astype(np.int64)
        if per_request.ndim != 1 or per_request.size != len(reqs) or per_request.dtype.kind not in "iu":
            raise KVCacheError(f"counts: need one integer per request ({len(reqs)}), got {per_request.shape}")
        op = {"op": "extend_many", "reqs": reqs, "tokens": _as_token_array(tokens), "counts": per_request}
        if num_lookahead_tokens:
            op["lookahead"] = num_lookahead_tokens
        return self._add(op)

    def free(self, request_id: Any) -> Batch:
        return self._add({"op": "free", "req": request_id})

    def op(self, name: str, **fields: Any) -> Batch:
        """Any other operation by its protocol name (table, lookup, can_admit, usage, stats, info, ...)."""
        return self._add({"op": name, **fields})

    def send(self) -> list[Any]:
        """Send every op in one message; returns their results in order."""
        wire, expands = self._take()
        return _results(self._client, wire, expands, self._client._call(wire))

    def post(self) -> Posted:
        """Send every op in one message without waiting for the reply; ``results()`` on what this returns waits
        for it and gives what ``send()`` would have.

        The daemon applies the ops while the caller works on: a decode step can run its model while the daemon
        extends its requests, over tables the step before reserved (``num_lookahead_tokens``). The client's
        next call, of any kind, takes this reply first, so the daemon sees and answers calls in order.
        """
        wire, expands = self._take()
        return self._client._post(wire, expands)

    def _take(self) -> tuple[list[dict[str, Any]], list[bool]]:
        """The ops on the wire and which are runs of plain extends, leaving the batch empty."""
        self._end_run()
        wire, expands = self._wire, self._expands
        self._wire, self._expands, self._count = [], [], 0
        return wire, expands

    def _add(self, op: dict[str, Any]) -> Batch:
        self._end_run()
        self._wire.append(op)
        self._expands.append(False)
        self._count += 1
        return self

    def _end_run(self) -> None:
        """Put the pending plain extends on the wire: one extend, or one extend_many for several."""
        reqs, parts = self._run_reqs, self._run_tokens
        if not reqs:
            return
        self._run_reqs, self._run_tokens = [], []
        if len(reqs) == 1:
            self._wire.append({"op": "extend", "req": reqs[0], "tokens": parts[0]})
        else:
            joined = _tables.join_runs(parts)  # one C pass when the parts share a dtype, as a decode step's do
            if joined is not None:
                tokens, counts = np.frombuffer(joined[0], dtype=parts[0].dtype), np.frombuffer(joined[1], np.int32)
            else:
                tokens = np.concatenate(parts)
                if tokens.dtype.kind == "f" and all(part.dtype.kind in "iu" for part in parts):  # uint64 with int64
                    tokens = np.concatenate(parts, dtype=np.int64, casting="unsafe")
                counts = np.fromiter(map(len, parts), dtype=np.int32, count=len(parts))
            self._wire.append({"op": "extend_many", "reqs": reqs, "tokens": tokens, "counts": counts})
        self._expands.append(len(reqs) > 1)
        self._count += len(reqs)


def _results(client: CacheClient, wire: list[dict[str, Any]], expands: list[bool], reply: dict[str, Any]
             ) -> list[Any]:
    """A batch's results in op order, in the library's types, keeping the client's table mirror current."""
    results: list[Any] = []
    for op, expand, raw in zip(wire, expands, reply["results"]):
        if expand:
            tables = client._extend_many_results(op["reqs"], raw)
            results += [tables] * len(op["reqs"]) if isinstance(tables, DaemonError) else tables
        elif op["op"] == "extend_many":
            results.append(client._extend_many_results(op["reqs"], raw))
        else:
            results.append(client._result(op, raw))
    return results


class Posted:
    """A batch on its way to the daemon (``Batch.post``); ``results()`` gives what ``send()`` would have."""

    def __init__(self, client: CacheClient, wire: list[dict[str, Any]], expands: list[bool], request_id: int,
                 payload: bytes, sent: tuple[str | None, float]) -> None:
        self._client, self._wire, self._expands = client, wire, expands
        self._request_id, self._payload, self._sent = request_id, payload, sent
        self._results: list[Any] | None = None
        self._error: KVCacheError | None = None

    @property
    def done(self) -> bool:
        """Whether the reply was taken (by ``results()`` or by a later call of the client)."""
        return self._results is not None or self._error is not None

    def results(self) -> list[Any]:
        """The results in op order, waiting for the reply up to the client's timeout per attempt; raises what
        ``send()`` would have (DaemonUnavailable, DaemonError)."""
        if not self.done:
            self._client._settle()
        if self._error is not None:
            raise self._error
        assert self._results is not None
        return self._results

    def _settle(self) -> None:
        """Take the reply (the client's call, once)."""
        try:
            reply = self._client._exchange(self._request_id, self._payload, self._sent)
            self._results = _results(self._client, self._wire, self._expands, reply)
        except KVCacheError as exc:
            self._error = exc


class CacheClient:
    """A scheduler's connection to ``kvcache serve``, with the same methods and results as KVCacheManager.

    Tables of requests this client admitted are read-only views that its
    later calls keep current, as the library's are.
    """

    def __init__(self, endpoint: str, *, timeout: float = 5.0, retries: int = 0, name: str | None = None,
                 context: zmq.Context | None = None, curve: CurveConfig | None = None, local: bool = False) -> None:
        if timeout <= 0:
            raise KVCacheError(f"timeout: must be positive, got {timeout}")
        if retries < 0:
            raise KVCacheError(f"retries: must not be negative, got {retries}")
        self.endpoint = endpoint
        self.timeout = timeout
        self.retries = retries
        self.curve = curve  # CURVE keys for a tcp:// daemon started with --curve-server-cert
        self.name = name or f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._attach_key: int | None = None  # claims the ranks this client attaches, without CURVE (``rank_key``)
        self.last_seq = -1
        self.last_epoch: int | None = None
        self._ctx = context or zmq.Context.instance()
        # Random start: a client that reuses a name after a restart never repeats an answered id.
        self._ids = itertools.count(int.from_bytes(os.urandom(7), "big"))
        self._mirror = _Mirror()
        self._slots: dict[Any, int] = {}
        self._info: dict[str, Any] | None = None
        self._sock = self._connect()
        self._want_local = local  # found on the first call: the daemon names its local endpoint in info
        self._local: socket.socket | None = None
        self.local_endpoint: str | None = None
        self._posted: Posted | None = None  # a batch sent whose reply is not taken yet (Batch.post)

    def _connect(self) -> zmq.Socket:
        if self.endpoint.startswith("ipc://"):
            check_socket_path(self.endpoint, "endpoint")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        # A DEALER with no peer blocks in send; a daemon that refused our CURVE handshake dropped it for good.
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(self.timeout * 1000)))
        if self.curve is not None and self.endpoint.startswith("tcp://"):
            secure_client_socket(sock, self.curve)
        sock.connect(self.endpoint)
        return sock

    def close(self) -> None:
        self._sock.close(0)
        if self._local is not None:
            self._local.close()
            self._local = None

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the manager's API

    def admit(self, request_id: Any, prompt_tokens: Sequence[int] | np.ndarray, *, cache_salt: str | None = None,
              lora: str | tuple[str, str] | None = None, mm: Sequence[tuple[str, int, int]] | None = None,
              num_tokens: int | None = None, slot: int | None = None,
              dest: dict[str, Any] | None = None) -> Admission | None:
        """As KVCacheManager.admit; ``slot`` names the engine's batch slot (default: the daemon picks).

        ``dest`` (a ``--role prefill`` daemon) sends the request's KV to a decode node:
        ``Reservation.dest(decode_endpoint)`` of the decode daemon's ``reserve``; the result is then a
        ``Sending``, whose ``plan`` the prefill workers can take with the step.
        """
        return self._single(self.batch().admit(request_id, prompt_tokens, cache_salt=cache_salt, lora=lora, mm=mm,
                                               num_tokens=num_tokens, slot=slot, dest=dest))

    # ------------------------------------------------------------------ PD disaggregation (see kvcache.pd)

    def reserve(self, request_id: Any, prompt_tokens: Sequence[int] | np.ndarray, *, cache_salt: str | None = None,
                lora: str | tuple[str, str] | None = None, slot: int | None = None, timeout: float | None = None) -> Reservation | None:
        """Decode side: blocks for a request a prefill node will fill, matching this node's prefix cache first.

        None when blocks are short (nothing changes). The request is ready for decoding once
        ``pd_poll`` lists it as done; it is released and listed as failed if the transfer
        fails, is cancelled or outlasts ``timeout`` seconds (default: the daemon's).
        """
        return self._single(self.batch().reserve(request_id, prompt_tokens, cache_salt=cache_salt, lora=lora,
                                                 slot=slot, timeout=timeout))

    def pd_poll(self) -> Outcomes:
        """Transfers of this client's requests that finished (decode: ready; prefill: sent) or failed since the last poll."""
        raw = self._single(self.batch().op("pd_poll"))
        return Outcomes({req: t for req, t in raw["done"]}, {req: error for req, error in raw["failed"]})

    def cancel(self, request_id: Any, *, release: bool = False) -> None:
        """Give up a request in transfer: reported failed ("cancelled") at once, its blocks freed once writes stop.

        ``release`` frees them now: only when no writer ever got the request (its prefill admit never happened).
        """
        self._single(self.batch().op("cancel", req=request_id, release=release))

    def plans(self, request_ids: Sequence[Any]) -> list[dict[str, Any] | None]:
        """Prefill messagers: where each request's blocks go (None: not being sent)."""
        return self._single(self.batch().op("plans", reqs=list(request_ids)))

    def rank_key(self, rank: int) -> int:
        """The key this client claims rank ``rank`` with by default: derived from its CURVE secret certificate and
        the rank (a worker restarted with the same certificate claims its rank again; a client of another
        certificate cannot), else a random key of this client's. ``kvcache.rank_keys.rank_key`` also reads one from
        a key file, as the PD links and tier agents do."""
        if self.curve is not None and self.curve.client_secret is not None:
            return curve_rank_key(self.curve, rank)
        if self._attach_key is None:
            self._attach_key = secrets.randbits(63)
        return self._attach_key

    def attach(self, rank: int, endpoint: str = "", *, key: int | None = None, admin: int | None = None) -> None:
        """Decode receivers: announce rank ``rank``'s NIXL metadata endpoint to the decode daemon; prefill
        messagers: claim rank ``rank`` on the prefill daemon (no endpoint).

        The first attach of a rank claims it with ``key`` (default ``rank_key(rank)``); the daemon attaches the
        rank again, and counts its reports (``received``, ``sent``), only for the same key. ``admin``: the
        daemon's admin key (``kvcache.rank_keys.admin_key``), which takes the rank over whoever owns it."""
        key = self.rank_key(rank) if key is None else key
        fields: dict[str, Any] = {"rank": rank, "endpoint": endpoint, "key": key}
        if admin is not None:
            fields["admin"] = admin
        self._single(self.batch().op("attach", **fields))

    def received(self, request_id: Any, rank: int, *, key: int | None = None) -> None:
        """Decode receivers: every prefill rank's writes to ``rank`` for the request have landed. ``key``: the one
        rank ``rank`` was attached with (default ``rank_key(rank)``); the daemon refuses a report without it."""
        key = self.rank_key(rank) if key is None else key
        self._single(self.batch().op("received", req=request_id, rank=rank, key=key))

    def sent(self, request_id: Any, rank: int, *, key: int | None = None) -> None:
        """Prefill messagers: rank ``rank`` wrote all its blocks of the request and notified the decode side.
        ``key``: the one the messager attached rank ``rank`` with (default ``rank_key(rank)``)."""
        key = self.rank_key(rank) if key is None else key
        self._single(self.batch().op("sent", req=request_id, rank=rank, key=key))

    def transfer_failed(self, request_id: Any, error: str) -> None:
        """Either side's workers: the request's transfer failed; the daemon releases it and tells its scheduler."""
        self._single(self.batch().op("transfer_failed", req=request_id, error=error[:4096]))

    # ------------------------------------------------------------------ the host tier (see kvcache.host_tier)

    def tier_failed(self) -> list[Any]:
        """Requests whose host-tier load failed since the last call (any scheduler's): free them and admit them
        again; their cached tokens were not all copied back."""
        return self._single(self.batch().op("tier_failed"))

    def tier_attach(self, rank: int, agent: int, buffer: int | None = None, *, key: int | None = None,
                    admin: int | None = None) -> dict[str, Any]:
        """Tier agents: rank ``rank``'s agent (``agent``, its id) is ready with host buffer ``buffer`` (its id;
        default: a buffer of the agent's own); returns the tier's ``num_blocks``. The first attach of a rank claims
        it with ``key`` (default ``rank_key(rank)``): another attach of it needs the same key, or ``admin`` (the
        daemon's admin key)."""
        fields: dict[str, Any] = {"rank": rank, "agent": agent, "key": self.rank_key(rank) if key is None else key}
        if admin is not None:
            fields["admin"] = admin
        if buffer is not None:
            fields["buffer"] = buffer
        return self._single(self.batch().op("tier_attach", **fields))

    def tier_done(self, job: int, rank: int, agent: int, *, ok: bool = True, error: str = "") -> None:
        """Tier agents: rank ``rank`` finished its part of copy ``job`` (or failed it, saying why). ``agent`` is the
        id the agent attached with: the daemon counts a report only from the agent attached as that rank now."""
        self._single(self.batch().op("tier_done", job=job, rank=rank, agent=agent, ok=ok, error=error[:4096]))

    def extend(self, request_id: Any, tokens: Sequence[int] | np.ndarray, *,
               num_computed_tokens: int | None = None, num_lookahead_tokens: int = 0) -> np.ndarray | None:
        return self._single(self.batch().extend(request_id, tokens, num_computed_tokens=num_computed_tokens,
                                                num_lookahead_tokens=num_lookahead_tokens))

    def extend_many(self, request_ids: Sequence[Any] | np.ndarray, tokens: Sequence[int] | np.ndarray,
                    counts: Sequence[int] | np.ndarray, *, num_lookahead_tokens: int = 0) -> list[np.ndarray | None]:
        """As KVCacheManager.extend_many: request i gets the next ``counts[i]`` of ``tokens``; one round trip."""
        return self._single(self.batch().extend_many(request_ids, tokens, counts,
                                                     num_lookahead_tokens=num_lookahead_tokens))

    def free(self, request_id: Any) -> None:
        self._single(self.batch().free(request_id))

    def table(self, request_id: Any) -> np.ndarray:
        return self._single(self.batch().op("table", req=request_id))

    def lookup(self, prompt_tokens: Sequence[int] | np.ndarray, *, cache_salt: str | None = None,
               lora: str | tuple[str, str] | None = None, mm: Sequence[Any] | None = None,
               whole_prompt: bool = False) -> int:
        fields: dict[str, Any] = {"tokens": _as_token_array(prompt_tokens)}
        fields.update(_prefix_keys(cache_salt, lora, mm))
        if whole_prompt:
            fields["whole_prompt"] = True
        return self._single(self.batch().op("lookup", **fields))

    # Scheduler-owned block lists: KVCacheManager's match_blocks family (kvcache.allocator.owned).

    def match_blocks(self, request_id: Any, tokens: Sequence[int] | np.ndarray, *, cache_salt: str | None = None,
                     lora: str | tuple[str, str] | None = None, mm: Sequence[Any] | None = None) -> np.ndarray:
        return self._single(self.batch().op("match_blocks", req=request_id, tokens=_as_token_array(tokens),
                                            **_prefix_keys(cache_salt, lora, mm)))

    def allocate_blank(self, request_id: Any, num_blocks: int) -> np.ndarray | None:
        return self._single(self.batch().op("allocate_blank", req=request_id, num_blocks=num_blocks))

    def commit_blocks(self, request_id: Any, blocks: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray,
                      *, blank_from: Any = None) -> int:
        fields: dict[str, Any] = {"req": request_id, "blocks": _block_array(blocks), "tokens": _as_token_array(tokens)}
        if blank_from is not None:
            fields["blank_from"] = blank_from
        return self._single(self.batch().op("commit_blocks", **fields))

    def release_blocks(self, request_id: Any, blocks: Sequence[int] | np.ndarray | None = None) -> None:
        fields: dict[str, Any] = {"req": request_id}
        if blocks is not None:
            fields["blocks"] = _block_array(blocks)
        self._single(self.batch().op("release_blocks", **fields))

    def evict_cached(self, num_blocks: int) -> int:
        return self._single(self.batch().op("evict_cached", num_blocks=num_blocks))

    def owned_blocks(self, request_id: Any) -> tuple[np.ndarray, np.ndarray]:
        committed, blank = self._single(self.batch().op("owned_blocks", req=request_id))
        return committed, blank

    @property
    def num_cached_free_blocks(self) -> np.ndarray:
        return np.asarray(self._single(self.batch().op("free_blocks"))["cached_free"])

    def uncached_free_blocks(self) -> np.ndarray:
        return self._single(self.batch().op("free_blocks"))["uncached"]

    def can_admit(self, num_tokens: int) -> bool:
        return self._single(self.batch().op("can_admit", num_tokens=num_tokens))

    @property
    def usage(self) -> Usage:
        raw = self._single(self.batch().op("usage"))
        return Usage(np.asarray(raw["per_row"]), float(raw["max"]))

    @property
    def num_free_blocks(self) -> np.ndarray:
        return np.asarray(self.stats()["free_blocks"])

    def stats(self) -> dict[str, Any]:
        return self._single(self.batch().op("stats"))

    def info(self) -> dict[str, Any]:
        """The daemon's geometry and endpoints (cached after the first call)."""
        if self._info is None:
            self._info = self._single(self.batch().op("info"))
        return self._info

    def ping(self) -> bool:
        return self._single(self.batch().op("ping")) == "pong"

    def owned(self) -> list[Any]:
        """The live requests the daemon counts as this client's (by name): what a restarted scheduler resumes."""
        return self._single(self.batch().op("owned"))

    def reclaim(self, request_ids: Sequence[Any]) -> list[Any]:
        """Take over live requests (e.g. a restarted scheduler's under a new name); returns those now ours."""
        return self._single(self.batch().op("reclaim", reqs=list(request_ids)))

    def check_integrity(self) -> None:
        """Ask the daemon to verify pool, prefix index and tables agree; raises DaemonError naming the fault."""
        self._single(self.batch().op("check_integrity"))

    def reset_prefix_cache(self) -> int:
        return self._single(self.batch().op("reset_prefix_cache"))

    def slot(self, request_id: Any) -> int:
        """The batch slot the daemon gave a request this client admitted."""
        try:
            return self._slots[request_id]
        except KeyError:
            raise KVCacheError(f"request_id: {request_id!r} was not admitted by this client") from None

    def batch(self) -> Batch:
        """Collect a whole scheduling step's operations for one round trip."""
        return Batch(self)

    # ------------------------------------------------------------------ transport

    def _single(self, batch: Batch) -> Any:
        (result,) = batch.send()
        if isinstance(result, DaemonError):
            raise result
        return result

    def _call(self, ops: list[dict[str, Any]]) -> dict[str, Any]:
        """One request/reply with a deadline per attempt; replies to earlier, timed-out requests are skipped.

        A retry resends the same request id, which the daemon answers without
        applying it twice (also across a restart from its journal).
        """
        self._ready()
        request_id, payload = self._request(ops)
        return self._exchange(request_id, payload, self._send(payload))

    def _post(self, wire: list[dict[str, Any]], expands: list[bool]) -> Posted:
        """Send a batch now; its reply is taken by ``Posted.results()`` or before the client's next call."""
        self._ready()
        request_id, payload = self._request(wire)
        self._posted = Posted(self, wire, expands, request_id, payload, self._send(payload))
        return self._posted

    def _settle(self) -> None:
        """Take the reply of a batch posted and not yet answered, if any (before anything else goes out)."""
        posted, self._posted = self._posted, None
        if posted is not None:
            posted._settle()

    def _ready(self) -> None:
        """Before a request goes out: the posted one answered, and the local endpoint looked for once."""
        self._settle()
        if self._want_local:
            self._want_local = False  # the info call below goes over ZMQ
            try:
                self._open_local()
            except DaemonUnavailable:
                self._want_local = True  # look again once the daemon answers
                raise

    def _send(self, payload: bytes) -> tuple[str | None, float]:
        """Send one attempt: to the local endpoint if it fits there, else over ZMQ. Returns where it went ("local",
        "zmq", or None: no daemon took it within the timeout) and the attempt's deadline."""
        if self._local is not None and len(payload) <= LOCAL_MAX_BYTES and self._local_send(payload):
            return "local", time.monotonic() + self.timeout
        return self._send_zmq(payload)

    def _send_zmq(self, payload: bytes) -> tuple[str | None, float]:
        """``_send`` over ZMQ alone."""
        deadline = time.monotonic() + self.timeout
        try:
            self._sock.send(payload)
        except zmq.Again:  # no daemon took it within the timeout (SNDTIMEO)
            return None, deadline
        return "zmq", deadline

    def _exchange(self, request_id: int, payload: bytes, sent: tuple[str | None, float]) -> dict[str, Any]:
        """The reply to a request whose first attempt went out as ``sent`` says (``_send``), sending it again up to
        ``retries`` times; raises DaemonUnavailable after the last attempt's deadline, DaemonError on a refusal."""
        for attempt in range(self.retries + 1):
            if attempt:
                sent = self._send(payload)
            where, deadline = sent
            reply = None
            if where == "local":
                reply = self._local_receive(request_id, deadline)
                if reply is _OVER_ZMQ:  # the local endpoint cannot answer it: the same attempt over ZMQ
                    where, deadline = self._send_zmq(payload)
            if where == "zmq":
                reply = self._await(request_id, deadline)
            if reply is not None:
                break
            # A reply may still come later; a fresh socket makes sure it is never taken for another one.
            self._sock.close(0)
            self._sock = self._connect()
        else:
            raise DaemonUnavailable(f"daemon at {self.endpoint} did not answer within {self.timeout:g} s"
                                    + (f" ({self.retries + 1} attempts)" if self.retries else "")
                                    + ("; if it runs with CURVE (--curve-server-cert), this client needs keys it "
                                       "allows" if self.curve is None and self.endpoint.startswith("tcp://") else ""))
        if not reply.get("ok"):
            raise DaemonError(str(reply.get("error")))
        self.last_seq = reply["seq"]
        self.last_epoch = reply.get("epoch")
        return reply

    def _request(self, ops: list[dict[str, Any]]) -> tuple[int, bytes]:
        """A fresh request id and the packed request carrying ``ops``."""
        request_id = next(self._ids)
        return request_id, pack({"v": PROTOCOL_VERSION, "client": self.name, "id": request_id, "ops": ops})

    def _open_local(self) -> None:
        """Use the daemon's local endpoint if it has one that this host reaches and that leads to the same daemon."""
        info = self._single(self.batch().op("info"))
        path = info.get("local_endpoint")
        if not path:
            return
        check_socket_path(path, "local_endpoint")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            bind_private(sock, "client")  # where the replies come back
            sock.connect(path)
            self._local, self.local_endpoint = sock, path
            sent = self._local_send(self._request([{"op": "info"}])[1])
            pong = self._local_receive(None, time.monotonic() + self.timeout) if sent else None
        except OSError as exc:  # another host's path, or a daemon gone since
            log.debug("local endpoint %s not used: %s", path, exc)
            pong = None
        if not isinstance(pong, dict) or not pong.get("ok") or pong["results"][0].get("epoch") != info["epoch"]:
            self._local = self.local_endpoint = None  # a path reaching another daemon (or none) is not ours to use
            sock.close()

    def _local_send(self, payload: bytes) -> bool:
        """Send a request to the local endpoint; False if it cannot take it (gone, or full past the deadline)."""
        sock = self._local
        assert sock is not None
        try:
            sock.settimeout(self.timeout)
            try:
                sock.send(payload)
            except ConnectionRefusedError:  # the daemon restarted on the same path: reach the new socket
                check_socket_path(self.local_endpoint, "local_endpoint")
                sock.connect(self.local_endpoint)
                sock.send(payload)
        except OSError:
            return False
        return True

    def _local_receive(self, request_id: int | None, deadline: float) -> Any:
        """The local endpoint's reply to ``request_id``: the reply, None at the ``deadline``, or _OVER_ZMQ to send
        the request over ZMQ instead. ``request_id`` None takes the first reply (the connection check)."""
        sock = self._local
        assert sock is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            sock.settimeout(remaining)
            try:
                data = sock.recv(LOCAL_MAX_BYTES + 1)
            except TimeoutError:
                return None
            except OSError:
                return _OVER_ZMQ
            try:
                reply = unpack(data, _MAX_REPLY_BYTES)
            except ProtocolError:  # not the daemon's: anyone on this host may write to our address
                continue
            if isinstance(reply, dict) and (request_id is None or reply.get("id") == request_id):
                return _OVER_ZMQ if reply.get("resend") else reply

    def _await(self, request_id: int, deadline: float) -> dict[str, Any] | None:
        """The reply to ``request_id``, or None when the ``deadline`` (time.monotonic()) passes first."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            # A receive timeout rather than Socket.poll, which builds a Poller per call (4 us a reply).
            self._sock.setsockopt(zmq.RCVTIMEO, int(remaining * 1000) + 1)
            try:
                data = self._sock.recv()
            except zmq.Again:
                return None
            reply = unpack(data, _MAX_REPLY_BYTES)
            if isinstance(reply, dict) and reply.get("id") == request_id:
                return reply

    def _extend_many_results(self, reqs: list[Any], raw: Any) -> list[np.ndarray | None] | DaemonError:
        """The tables of one extend_many result in request order, keeping the mirror current.

        Unchanged tables are the mirror's views as they are; only the changed
        ones (one request in ``block_size`` in a decode step) are touched. A
        decode step's usual reply (each change one new last column) is applied
        in one C pass; anything else goes request by request.
        """
        refused = _refusal(raw)
        if refused is not None:
            return refused
        lens, changed = raw["lens"], raw["changed"]
        mirror = self._mirror
        views = mirror.views
        index = changed["index"]
        usual = _tables.mirror_step(reqs, lens, index, changed["offsets"], changed["cols"], changed["vals"], views,
                                    mirror._buffers)
        if usual is not None:
            return usual
        out: list[np.ndarray | None] = list(map(views.get, reqs))
        if index.size:
            offsets, cols, vals = changed["offsets"].tolist(), changed["cols"], changed["vals"]
            col_of = cols.tolist()
            for k, (j, length) in enumerate(zip(index.tolist(), lens[index].tolist())):
                req = reqs[j]
                if req in views:  # else admitted by another client: fetched whole below
                    a, b = offsets[k], offsets[k + 1]
                    # Most changes in a decode step are one new last column: the cheap path first.
                    tables = (mirror.append_columns([req], [length], vals[:, a:b])
                              if b - a == 1 and col_of[a] == length - 1 else None)
                    out[j] = tables[0] if tables else mirror.apply(req, length, cols[a:b], vals[:, a:b])
        if lens.size and int(lens.min()) < 0:
            for j in np.flatnonzero(lens < 0).tolist():
                out[j] = None
        if not all(map(views.__contains__, reqs)):
            lengths = lens.tolist()
            for j, req in enumerate(reqs):
                if out[j] is None and lengths[j] >= 0:
                    if req not in mirror:  # admitted by another client: fetch the whole table once
                        mirror.put(req, self.table(req))
                    out[j] = mirror.views[req]
        return out

    def _result(self, op: dict[str, Any], raw: Any) -> Any:
        """A raw result in the library's types, keeping this client's table mirror current."""
        refused = _refusal(raw)
        if refused is not None:
            return refused
        kind = op["op"]
        if kind in ("admit", "reserve"):
            if raw is None:
                return None
            self._slots[op["req"]] = raw["slot"]
            table = self._mirror.put(op["req"], raw["table"])
            if kind == "reserve":
                return Reservation(raw["cached"], table, raw["num_tokens"], tuple(raw["receivers"]), raw.get("rows"))
            if "plan" in raw:
                return Sending(raw["cached"], table, raw["num_tokens"], raw["plan"])
            return Admission(raw["cached"], table, raw["num_tokens"], raw.get("host_cached", 0))
        if kind == "extend":
            if raw is None:
                return None
            if op["req"] not in self._mirror:  # admitted by another client: fetch the whole table once
                return self._mirror.put(op["req"], self.table(op["req"]))
            return self._mirror.apply(op["req"], raw["len"], raw["cols"], raw["vals"])
        if kind == "free":
            self._mirror.drop(op["req"])
            self._slots.pop(op["req"], None)
            return None
        return raw

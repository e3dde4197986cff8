"""CacheClient: KVCacheManager's methods over the daemon's socket, and a batch form for whole steps.

Switching a scheduler from the library to the daemon is one line::

    cache = KVCacheManager(num_blocks, block_size)      # in-process
    cache = CacheClient("ipc:///run/kvcache.sock")       # shared daemon

Every call has a deadline (``timeout`` seconds, default 5, per attempt; with
``retries`` the same request is sent again, which the daemon never applies
twice): a daemon that is down or stuck gives ``DaemonUnavailable`` instead of
a hang. Not thread-safe:
give each thread its own client.
"""
from __future__ import annotations

import itertools
import os
import time
import uuid
from typing import Any, Sequence

import numpy as np
import zmq

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.manager import Admission
from kvcache.allocator.pool import Usage
from kvcache.protocol import PROTOCOL_VERSION, pack, unpack

_MAX_REPLY_BYTES = 1 << 31


class DaemonUnavailable(KVCacheError):
    """The daemon did not answer within the deadline (down, unreachable or stuck)."""


class DaemonError(KVCacheError):
    """The daemon refused a request (its message names the field and the reason); nothing changed."""


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


def _table_from_delta(old: np.ndarray | None, length: int, cols: np.ndarray, vals: np.ndarray) -> np.ndarray:
    """The table ``old`` after a delta: ``length`` columns, ``cols`` set to ``vals``."""
    rows = vals.shape[0] if old is None else old.shape[0]
    table = np.full((rows, length), -1, dtype=np.int32)
    if old is not None:
        keep = min(length, old.shape[1])
        table[:, :keep] = old[:, :keep]
    table[:, cols] = vals
    table.flags.writeable = False
    return table


class Batch:
    """Operations collected for one round trip: ``client.batch()``, add ops, ``send()`` → results.

    Results come in op order with the library's types (Admission or None,
    table or None, True, ...); an op the daemon could not apply gives a
    ``DaemonError`` instance in its place.
    """

    def __init__(self, client: CacheClient) -> None:
        self._client = client
        self._ops: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self._ops)

    def admit(self, request_id: Any, prompt_tokens: Sequence[int] | np.ndarray, *, cache_salt: str | None = None,
              lora: str | None = None, mm: Sequence[tuple[str, int, int]] | None = None,
              num_tokens: int | None = None, slot: int | None = None) -> Batch:
        op: dict[str, Any] = {"op": "admit", "req": request_id, "tokens": _as_token_array(prompt_tokens)}
        for key, value in (("salt", cache_salt), ("lora", lora), ("num_tokens", num_tokens), ("slot", slot)):
            if value is not None:
                op[key] = value
        if mm:
            op["mm"] = [list(item) for item in mm]
        self._ops.append(op)
        return self

    def extend(self, request_id: Any, tokens: Sequence[int] | np.ndarray, *,
               num_computed_tokens: int | None = None) -> Batch:
        op: dict[str, Any] = {"op": "extend", "req": request_id, "tokens": _as_token_array(tokens)}
        if num_computed_tokens is not None:
            op["num_computed"] = num_computed_tokens
        self._ops.append(op)
        return self

    def free(self, request_id: Any) -> Batch:
        self._ops.append({"op": "free", "req": request_id})
        return self

    def op(self, name: str, **fields: Any) -> Batch:
        """Any other operation by its protocol name (table, lookup, can_admit, usage, stats, info, ...)."""
        self._ops.append({"op": name, **fields})
        return self

    def send(self) -> list[Any]:
        """Send every op in one message; returns their results in order.

        Runs of two or more plain extends travel as one ``extend_many`` op (a
        decode step's shape), which the daemon applies in a single pass.
        """
        ops, self._ops = self._ops, []
        wire, spans = _coalesce(ops)
        reply = self._client._call(wire)
        results: list[Any] = [None] * len(ops)
        for op, span, raw in zip(wire, spans, reply["results"]):
            if op["op"] == "extend_many":
                for index, result in zip(span, self._client._extend_many_results(ops, span, raw)):
                    results[index] = result
            else:
                results[span[0]] = self._client._result(op, raw)
        return results


def _coalesce(ops: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """Wire ops for a batch: runs of plain extends become one extend_many; spans map back to the ops."""
    wire: list[dict[str, Any]] = []
    spans: list[list[int]] = []
    run: list[int] = []

    def flush() -> None:
        if len(run) == 1:
            wire.append(ops[run[0]])
            spans.append(list(run))
        elif run:
            parts = [ops[i]["tokens"] for i in run]
            wire.append({"op": "extend_many", "reqs": [ops[i]["req"] for i in run],
                         "tokens": np.concatenate(parts).astype(np.int64, copy=False),
                         "counts": np.array([len(p) for p in parts], dtype=np.int64)})
            spans.append(list(run))
        run.clear()

    for i, op in enumerate(ops):
        if op["op"] == "extend" and "num_computed" not in op:
            run.append(i)
        else:
            flush()
            wire.append(op)
            spans.append([i])
    flush()
    return wire, spans


class CacheClient:
    """A scheduler's connection to ``kvcache serve``, with the same methods and results as KVCacheManager."""

    def __init__(self, endpoint: str, *, timeout: float = 5.0, retries: int = 0, name: str | None = None,
                 context: zmq.Context | None = None) -> None:
        if timeout <= 0:
            raise KVCacheError(f"timeout: must be positive, got {timeout}")
        if retries < 0:
            raise KVCacheError(f"retries: must not be negative, got {retries}")
        self.endpoint = endpoint
        self.timeout = timeout
        self.retries = retries
        self.name = name or f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.last_seq = -1
        self.last_epoch: int | None = None
        self._ctx = context or zmq.Context.instance()
        # Random start: a client that reuses a name after a restart never repeats an answered id.
        self._ids = itertools.count(int.from_bytes(os.urandom(7), "big"))
        self._tables: dict[Any, np.ndarray] = {}
        self._slots: dict[Any, int] = {}
        self._info: dict[str, Any] | None = None
        self._sock = self._connect()

    def _connect(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(self.endpoint)
        return sock

    def close(self) -> None:
        self._sock.close(0)

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the manager's API

    def admit(self, request_id: Any, prompt_tokens: Sequence[int] | np.ndarray, *, cache_salt: str | None = None,
              lora: str | None = None, mm: Sequence[tuple[str, int, int]] | None = None,
              num_tokens: int | None = None, slot: int | None = None) -> Admission | None:
        """As KVCacheManager.admit; ``slot`` names the engine's batch slot (default: the daemon picks)."""
        return self._single(self.batch().admit(request_id, prompt_tokens, cache_salt=cache_salt, lora=lora, mm=mm,
                                               num_tokens=num_tokens, slot=slot))

    def extend(self, request_id: Any, tokens: Sequence[int] | np.ndarray, *,
               num_computed_tokens: int | None = None) -> np.ndarray | None:
        return self._single(self.batch().extend(request_id, tokens, num_computed_tokens=num_computed_tokens))

    def free(self, request_id: Any) -> None:
        self._single(self.batch().free(request_id))

    def table(self, request_id: Any) -> np.ndarray:
        return self._single(self.batch().op("table", req=request_id))

    def lookup(self, prompt_tokens: Sequence[int] | np.ndarray, *, cache_salt: str | None = None,
               lora: str | None = None) -> int:
        fields: dict[str, Any] = {"tokens": _as_token_array(prompt_tokens)}
        if cache_salt is not None:
            fields["salt"] = cache_salt
        if lora is not None:
            fields["lora"] = lora
        return self._single(self.batch().op("lookup", **fields))

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
        request_id = next(self._ids)
        payload = pack({"v": PROTOCOL_VERSION, "client": self.name, "id": request_id, "ops": ops})
        for attempt in range(self.retries + 1):
            self._sock.send(payload)
            reply = self._await(request_id)
            if reply is not None:
                break
            # A reply may still come later; a fresh socket makes sure it is never taken for another one.
            self._sock.close(0)
            self._sock = self._connect()
        else:
            raise DaemonUnavailable(f"daemon at {self.endpoint} did not answer within {self.timeout:g} s"
                                    + (f" ({self.retries + 1} attempts)" if self.retries else ""))
        if not reply.get("ok"):
            raise DaemonError(str(reply.get("error")))
        self.last_seq = reply["seq"]
        self.last_epoch = reply.get("epoch")
        return reply

    def _await(self, request_id: int) -> dict[str, Any] | None:
        """The reply to ``request_id``, or None when the deadline passes first."""
        deadline = time.monotonic() + self.timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sock.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                return None
            reply = unpack(self._sock.recv(), _MAX_REPLY_BYTES)
            if isinstance(reply, dict) and reply.get("id") == request_id:
                return reply

    def _extend_many_results(self, ops: list[dict[str, Any]], span: list[int], raw: Any) -> list[Any]:
        """Per-extend results of one extend_many reply, keeping the table mirror current."""
        if isinstance(raw, dict) and set(raw) == {"error"}:
            return [DaemonError(raw["error"])] * len(span)
        changed = {int(i): (cols, vals) for i, cols, vals in raw["changed"]}
        out: list[Any] = []
        for j, index in enumerate(span):
            req = ops[index]["req"]
            length = int(raw["lens"][j])
            if length < 0:
                out.append(None)
                continue
            if req not in self._tables:  # admitted by another client: fetch the whole table once
                self._tables[req] = self.table(req)
            elif j in changed:
                cols, vals = changed[j]
                self._tables[req] = _table_from_delta(self._tables[req], length, cols, vals)
            out.append(self._tables[req])
        return out

    def _result(self, op: dict[str, Any], raw: Any) -> Any:
        """A raw result in the library's types, keeping this client's table mirror current."""
        if isinstance(raw, dict) and set(raw) == {"error"}:
            return DaemonError(raw["error"])
        kind = op["op"]
        if kind == "admit":
            if raw is None:
                return None
            table = np.asarray(raw["table"])
            table.flags.writeable = False
            self._tables[op["req"]] = table
            self._slots[op["req"]] = raw["slot"]
            return Admission(raw["cached"], table, raw["num_tokens"])
        if kind == "extend":
            if raw is None:
                return None
            if op["req"] not in self._tables:  # admitted by another client: fetch the whole table once
                self._tables[op["req"]] = self.table(op["req"])
                return self._tables[op["req"]]
            table = _table_from_delta(self._tables[op["req"]], raw["len"], raw["cols"], raw["vals"])
            self._tables[op["req"]] = table
            return table
        if kind == "free":
            self._tables.pop(op["req"], None)
            self._slots.pop(op["req"], None)
            return None
        return raw

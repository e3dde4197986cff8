"""Hostile input: over 100,000 bad messages against a real daemon are each refused whole and change nothing.

The volume test draws every message from one seeded ``random.Random``
(``SEED``), so a failure replays exactly; valid steps from their own client
are interleaved, applied to a clean in-process KVCacheManager as they are
made, and every reply to them is predicted. A hypothesis test alongside puts
arbitrary values into each field, in-process, and shrinks whatever breaks
validation to a minimal example.
"""
from __future__ import annotations

import collections
import itertools
import os
import random
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvcache.config import ServeConfig
from kvcache.protocol import MAX_OPS, PROTOCOL_VERSION, pack, unpack
from kvcache.serve import build_manager
from kvcache.server import CacheServer

if TYPE_CHECKING:
    from kvcache.allocator.manager import KVCacheManager

SEED = 20_240_611
BAD_MESSAGES = 100_000
VALID_SHARE = 0.2  # of all messages: the valid stream whose effect the daemon must show
WINDOW = 512  # messages in flight before the replies are read
MAX_BYTES = 256 * 1024
MAX_TOKENS = 4096
MAX_SLOTS = 1024
MAX_ERROR_CHARS = 2000  # an error names the problem; it does not echo the attacker's payload back
GEOMETRY = ServeConfig(num_blocks=200, block_size=4, rows="window:8:4,full", hash_seed="fuzz",
                       max_message_bytes=MAX_BYTES, max_tokens=MAX_TOKENS, max_slots=MAX_SLOTS)
FLAGS = ("--num-blocks", "200", "--block-size", "4", "--rows", "window:8:4,full", "--hash-seed", "fuzz",
         "--max-message-bytes", str(MAX_BYTES), "--max-tokens", str(MAX_TOKENS), "--max-slots", str(MAX_SLOTS))
I64 = 2**63
U64_MAX = 2**64 - 1


# ----------------------------------------------------------------------------- building malformed messages


class Raw(bytes):
    """Bytes placed verbatim where a value goes in a message being built (a malformed value)."""


def _contains_raw(obj: Any) -> bool:
    if isinstance(obj, Raw):
        return True
    if isinstance(obj, dict):
        return any(_contains_raw(k) or _contains_raw(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_contains_raw(x) for x in obj)
    return False


def _header(fix: int, b16: int, b32: int, n: int) -> bytes:
    if n < 16:
        return bytes([fix | n])
    return bytes([b16]) + struct.pack(">H", n) if n < 65536 else bytes([b32]) + struct.pack(">I", n)


def encode(obj: Any) -> bytes:
    """msgpack of ``obj`` (numpy arrays as the protocol's exts) with any Raw values spliced in as they are."""
    if not _contains_raw(obj):
        return pack(obj)
    if isinstance(obj, Raw):
        return bytes(obj)
    if isinstance(obj, dict):
        return _header(0x80, 0xDE, 0xDF, len(obj)) + b"".join(encode(k) + encode(v) for k, v in obj.items())
    return _header(0x90, 0xDC, 0xDD, len(obj)) + b"".join(encode(x) for x in obj)


def array_ext(code: int, ndim: int, shape: list[int], data: bytes) -> Raw:
    """An array ext (type 1) built by hand: any dtype code, ndim and shape, whatever the data length."""
    return raw_ext(1, bytes([code, ndim]) + b"".join(struct.pack("<I", n) for n in shape) + data)


def raw_ext(code: int, data: bytes) -> Raw:
    """An ext32 of any type code, reserved negative ones too (msgpack.ExtType takes only 0..127)."""
    return Raw(b"\xc9" + struct.pack(">Ib", len(data), code) + data)


NOT_ID = [None, True, False, 1.5, float("nan"), b"r", [], ["r"], {}, {"r": 1}, I64, U64_MAX, "x" * 257,
          np.arange(2, dtype=np.int32), np.array([7], np.int64)]
NOT_TOKENS = [None, True, 7, 1.5, "abc", b"\x01\x02", {}, {"t": [1]}, [1.5], [True], [None], ["1"], [[1]], [1, [2]],
              [-1], [2**32], [U64_MAX], [-I64], np.zeros((2, 2), np.int32), np.array([1.5, 2.5]),
              np.array([-1], np.int32), np.array([2**32], np.uint64), np.array([-5], np.int8),
              np.zeros(MAX_TOKENS + 1, np.uint32), list(range(MAX_TOKENS + 1)), np.zeros(0, np.float64)]
NOT_OPTIONAL_COUNT = [True, False, 1.5, "1", b"1", [], {}, I64, U64_MAX, np.array([1])]
NOT_STR = [1, 1.5, True, b"s", [], {}, ["s"], "x" * 4097, np.array([1])]
NOT_MM = ["img", 1, 1.5, True, {}, b"", [1], ["img", 0, 2], [["img", 0]], [["img", 0, 2, 3]], [["img", 0, 0]],
          [["img", -1, 2]], [[1, 0, 2]], [[b"img", 0, 2]], [["x" * 1025, 0, 2]], [["img", 1.5, 2]],
          [["img", True, 2]], [["img", 0, U64_MAX]], [None], [["img", 0, 2]] * 4097, np.array([1])]
UNKNOWN_OPS = ["Admit", "admit ", " admit", "free\x00", "ADMIT", "extend-many", "extendmany", "", "evict",
               "shutdown", "__class__", None, 1, True, 1.5, [], {}, b"admit", "x" * 300, np.array([1, 2]),
               np.zeros(0, np.int32)]
NOT_VERSION = [PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, -1, U64_MAX, str(PROTOCOL_VERSION), b"\x01", None, [], {},
               PROTOCOL_VERSION + 0.5, np.array([PROTOCOL_VERSION + 1], np.int32)]
# Equal to the version under ==, but not the integer it is; an array of two breaks a bare ``!=`` test.
VERSION_LOOKALIKES = [float(PROTOCOL_VERSION), np.array([PROTOCOL_VERSION], np.int32),
                      np.array([PROTOCOL_VERSION] * 2, np.int32)] + ([True] if PROTOCOL_VERSION == 1 else [])
NOT_CLIENT = [1, None, b"c", [], {}, "x" * 257, 1.5, True, np.array([1])]
NOT_MESSAGE_ID = [None, "1", 1.5, True, [], {}, b"1", I64, U64_MAX, np.array([1])]
NOT_OPS = [None, {}, "ops", 1, b"", True, np.array([1]), {"op": "ping"}]
NOT_OP = [1, "admit", None, [], [{"op": "ping"}], b"", True, 1.5, np.array([1])]
CLAIMS = [b"\xdb", b"\xc6", b"\xdd", b"\xdf", b"\xc9"]  # str32, bin32, array32, map32, ext32 headers


def deep(depth: int, maps: bool) -> Raw:
    """A value nested ``depth`` levels deep (msgpack-python refuses past about 1,000)."""
    return Raw((b"\x81\xa1k" if maps else b"\x91") * depth + b"\xc0")


# ----------------------------------------------------------------------------- the valid stream and its model


@dataclass(slots=True)
class Expect:
    """The result the daemon owes one valid op, as the clean manager computed it."""

    kind: str
    value: Any


class ValidStream:
    """Valid steps from client ``valid``, applied to a clean manager as they are made: the replies owed."""

    CLIENT = "valid"

    def __init__(self, rng: random.Random, manager: KVCacheManager) -> None:
        self.rng = rng
        self.m = manager
        self.live: list[Any] = []
        self._ids = itertools.count()
        self._names = itertools.count()
        self._prefixes = [np.array(rng.choices(range(100), k=48), dtype=np.uint32) for _ in range(4)]

    def message(self) -> tuple[bytes, list[Expect]]:
        rng = self.rng
        ops: list[dict] = []
        expects: list[Expect] = []
        for _ in range(rng.choice((1, 1, 1, 2, 3, 4))):
            r = rng.random()
            if not self.live or (r < 0.3 and len(self.live) < 24):
                self._admit(ops, expects)
            elif r < 0.55:
                self._extend(ops, expects)
            elif r < 0.8:
                self._extend_many(ops, expects)
            else:
                self._free(ops, expects, rng.choice(self.live))
        return pack({"v": PROTOCOL_VERSION, "client": self.CLIENT, "id": next(self._ids), "ops": ops}), expects

    def tokens(self, lo: int, hi: int) -> np.ndarray:
        return np.array(self.rng.choices(range(100), k=self.rng.randrange(lo, hi)), dtype=np.uint32)

    def _admit(self, ops: list[dict], expects: list[Expect]) -> None:
        rng = self.rng
        n = next(self._names)
        req: Any = f"v{n}" if n % 2 else 10**12 + n
        tokens = np.concatenate([rng.choice(self._prefixes)[: rng.randrange(1, 48)], self.tokens(0, 12)])
        op: dict[str, Any] = {"op": "admit", "req": req, "tokens": tokens if rng.random() < 0.8 else tokens.tolist()}
        kwargs: dict[str, Any] = {}
        if rng.random() < 0.2:
            op["num_tokens"] = kwargs["num_tokens"] = rng.randrange(1, tokens.size + 1)
        if rng.random() < 0.1:
            op["salt"] = kwargs["cache_salt"] = rng.choice(("s1", "s2"))
        if rng.random() < 0.1:
            op["lora"] = kwargs["lora"] = "l1"
        if rng.random() < 0.1:
            offset, length = rng.randrange(0, 20), rng.randrange(1, 9)
            op["mm"] = [["img", offset, length]]
            kwargs["mm"] = [("img", offset, length)]
        ops.append(op)
        adm = self.m.admit(req, tokens, **kwargs)
        if adm is None:
            expects.append(Expect("admit", None))
        else:
            self.live.append(req)
            expects.append(Expect("admit", (adm.num_cached_tokens, adm.num_tokens, adm.table.copy())))

    def _extend(self, ops: list[dict], expects: list[Expect]) -> None:
        req = self.rng.choice(self.live)
        if self.m.num_tokens(req) > 160:  # keep tables short: long requests end
            self._free(ops, expects, req)
            return
        tokens = self.tokens(0, 9)
        op: dict[str, Any] = {"op": "extend", "req": req, "tokens": tokens}
        done = None
        if self.rng.random() < 0.2:
            op["num_computed"] = done = self.rng.randrange(0, self.m.num_tokens(req) + 1)
        ops.append(op)
        table = self.m.extend(req, tokens, num_computed_tokens=done)
        if table is None:
            expects.append(Expect("extend", None))
        else:
            cols = self.m.changed_columns(req).copy()
            expects.append(Expect("extend", (table.shape[1], cols, table[:, cols].copy())))

    def _extend_many(self, ops: list[dict], expects: list[Expect]) -> None:
        rng = self.rng
        reqs = rng.sample(self.live, rng.randrange(1, len(self.live) + 1))
        if rng.random() < 0.1:
            reqs.append(reqs[0])  # a request listed twice extends twice
        counts = np.array([rng.choice((0, 1, 1, 1, 2, 5)) for _ in reqs], dtype=rng.choice((np.int64, np.uint32)))
        tokens = np.array(rng.choices(range(100), k=int(counts.sum())), dtype=np.uint32)
        ops.append({"op": "extend_many", "reqs": reqs, "tokens": tokens, "counts": counts})
        columns: list[np.ndarray] = []
        tables = self.m.extend_many(reqs, tokens, counts, changes=columns)
        lens = [-1 if t is None else t.shape[1] for t in tables]
        changed = {i: (cols.copy(), t[:, cols].copy()) for i, (t, cols) in enumerate(zip(tables, columns)) if cols.size}
        expects.append(Expect("extend_many", (lens, changed)))

    def _free(self, ops: list[dict], expects: list[Expect], req: Any) -> None:
        ops.append({"op": "free", "req": req})
        self.live.remove(req)
        self.m.free(req)
        expects.append(Expect("free", True))


def check_valid_reply(reply: Any, expects: list[Expect]) -> str | None:
    """What differs between a valid message's reply and the clean manager's results, or None."""
    try:
        return _compare(reply, expects)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return f"reply of unexpected shape ({type(exc).__name__}: {exc}): {str(reply)[:300]}"


def _compare(reply: Any, expects: list[Expect]) -> str | None:
    if not isinstance(reply, dict) or reply.get("ok") is not True:
        return f"refused: {str(reply)[:300]}"
    results = reply["results"]
    if len(results) != len(expects):
        return f"{len(results)} results for {len(expects)} ops"
    for i, (want, got) in enumerate(zip(expects, results)):
        v = want.value
        if want.kind == "admit":
            same = got is None if v is None else (got is not None and got["cached"] == v[0]
                                                   and got["num_tokens"] == v[1] and np.array_equal(got["table"], v[2]))
        elif want.kind == "extend":
            same = got is None if v is None else (got is not None and got["len"] == v[0]
                                                   and np.array_equal(got["cols"], v[1])
                                                   and np.array_equal(got["vals"], v[2]))
        elif want.kind == "extend_many":  # changed: compressed rows, request index[k] set cols[o[k]:o[k + 1]]
            lens, changed = v
            c = got["changed"]
            o = c["offsets"].tolist()
            got_changed = {int(j): (c["cols"][o[k]:o[k + 1]], c["vals"][:, o[k]:o[k + 1]])
                           for k, j in enumerate(c["index"].tolist())}
            same = (got["lens"].tolist() == lens and got_changed.keys() == changed.keys()
                    and all(np.array_equal(got_changed[j][0], changed[j][0])
                            and np.array_equal(got_changed[j][1], changed[j][1]) for j in changed))
        else:
            same = got is True
        if not same:
            return f"ops[{i}] ({want.kind}): daemon {str(got)[:300]} != clean manager {str(v)[:300]}"
    return None


# ----------------------------------------------------------------------------- the fuzzer


class Fuzzer:
    """Messages the daemon must refuse whole (``ok: false``), in named kinds, drawn from one seeded generator.

    Ops that lean on liveness (an extend of a request that is not admitted,
    an admit of one that is) draw ids the message's other ops leave alone, so
    each message stays bad whatever valid ops surround its bad one.
    """

    def __init__(self, rng: random.Random, valid: ValidStream) -> None:
        self.rng = rng
        self.valid = valid
        self._fresh = itertools.count()
        self.kinds: dict[str, tuple[float, Callable[[], list[bytes]]]] = {
            "random_bytes": (8, self.random_bytes),
            "truncated": (10, self.truncated),
            "byte_flips": (10, self.byte_flips),
            "wrong_field": (30, self.wrong_field),
            "missing_field": (4, self.missing_field),
            "dead_ids": (8, self.dead_ids),
            "bad_array_ext": (8, self.bad_array_ext),
            "huge_claims": (4, self.huge_claims),
            "deep_nesting": (3, self.deep_nesting),
            "unknown_op": (5, self.unknown_op),
            "multipart": (3, self.multipart),
            "empty_frame": (1, lambda: [b""]),
            "oversized": (0.3, self.oversized),
            "too_many": (0.1, self.too_many),
            "version_lookalike": (1, self.version_lookalike),
            "counts_overflow": (1, self.counts_overflow),
            "num_computed_beyond_tokens": (1, self.num_computed_beyond_tokens),
        }
        self._names = list(self.kinds)
        self._weights = list(itertools.accumulate(w for w, _ in self.kinds.values()))

    def message(self) -> tuple[str, list[bytes]]:
        kind = self.rng.choices(self._names, cum_weights=self._weights)[0]
        return kind, self.kinds[kind][1]()

    # -------------------------------------------------------------- pieces

    def envelope(self, ops: Any, /, **fields: Any) -> dict[str, Any]:
        """A message of ``ops`` from one of 50 fuzz clients; ``fields`` replace envelope fields (``ops`` too)."""
        env = {"v": PROTOCOL_VERSION, "client": f"fuzz{self.rng.randrange(50)}",
               "id": self.rng.randrange(-I64, I64), "ops": ops}
        env.update(fields)
        return env

    def fresh(self) -> str:
        return f"f{next(self._fresh)}"

    def dead(self) -> Any:
        """A request id nobody admits: the valid stream uses v* and 10**12+, the fuzzer's admits f*."""
        return self.rng.choice((f"dead{self.rng.randrange(10**6)}", -self.rng.randrange(1, I64), 5 * 10**17))

    def live(self, avoid: set) -> Any | None:
        choices = [r for r in self.valid.live if r not in avoid]
        return self.rng.choice(choices) if choices else None

    def template(self, kind: str, avoid: set) -> dict[str, Any]:
        """A valid op of ``kind`` (an admit when it needs a live request and none is left to use)."""
        rng = self.rng
        req = self.live(avoid)
        if kind in ("extend", "free", "table", "extend_many") and req is None:
            kind = "admit"
        tokens = np.array(rng.choices(range(100), k=rng.randrange(1, 9)), dtype=np.uint32)
        if kind == "admit":
            return {"op": "admit", "req": self.fresh(), "tokens": tokens}
        if kind == "extend":
            return {"op": "extend", "req": req, "tokens": tokens}
        if kind in ("free", "table"):
            return {"op": kind, "req": req}
        if kind == "extend_many":
            return {"op": "extend_many", "reqs": [req], "tokens": tokens, "counts": np.array([tokens.size])}
        if kind == "lookup":
            return {"op": "lookup", "tokens": tokens}
        if kind == "can_admit":
            return {"op": "can_admit", "num_tokens": rng.randrange(0, 100)}
        return {"op": kind}

    def read_only_op(self) -> dict[str, Any]:
        """A valid op that changes nothing: table (of a live request or not), lookup, can_admit, ping, ..."""
        kind = self.rng.choice(("table", "lookup", "can_admit", "ping", "stats", "usage"))
        if kind == "table":
            return {"op": "table", "req": self.live(set()) or self.dead()}
        return self.template(kind, set())

    def surround(self, bad: dict[str, Any] | Raw, avoid: set) -> list:
        """The bad op alone, or among valid ops (which must not apply either: the message is refused whole)."""
        if self.rng.random() < 0.5:
            return [bad]
        kinds = ("admit", "extend", "free", "table", "extend_many", "lookup", "can_admit", "ping", "stats")
        ops = [self.template(self.rng.choice(kinds), avoid) for _ in range(self.rng.randrange(1, 4))]
        ops.insert(self.rng.randrange(len(ops) + 1), bad)
        return ops

    def poisoned(self) -> dict[str, Any]:
        """A message of valid ops plus one op whose field is wrong (the base of byte mutations)."""
        op, avoid = self.bad_op()
        return self.envelope(self.surround(op, avoid))

    def bad_op(self) -> tuple[dict[str, Any], set]:
        """One op with one field holding a value its field refuses."""
        rng = self.rng
        kind = rng.choice(("admit", "extend", "free", "table", "extend_many", "lookup", "can_admit"))
        op = self.template(kind, set())
        kind = op["op"]
        avoid = {op.get("req")} | set(op.get("reqs", ()))
        name, pool = rng.choice(list(self.bad_fields(op).items()))
        op[name] = rng.choice(pool)
        return op, avoid

    def bad_fields(self, op: dict[str, Any]) -> dict[str, list]:
        """For each field of a valid op, values that field refuses."""
        kind = op["op"]
        if kind == "admit":
            return {"req": NOT_ID, "tokens": NOT_TOKENS + [[], np.zeros(0, np.uint32)],
                    "num_tokens": NOT_OPTIONAL_COUNT + [0, -1, int(op["tokens"].size) + 1],
                    "slot": NOT_OPTIONAL_COUNT + [-1, MAX_SLOTS], "salt": NOT_STR, "lora": NOT_STR, "mm": NOT_MM}
        if kind == "extend":
            return {"req": NOT_ID, "tokens": NOT_TOKENS, "num_computed": NOT_OPTIONAL_COUNT + [-1, -I64]}
        if kind in ("free", "table"):
            return {"req": NOT_ID}
        if kind == "extend_many":
            size = int(op["tokens"].size)
            return {"reqs": [None, "r", 1, {}, b"", [None], [1.5], ["x" * 257], [True], [I64], np.array([1, 2]),
                             [self.dead()], [op["reqs"][0], self.dead()]],
                    "tokens": NOT_TOKENS,
                    "counts": [None, [size], 1, np.array([float(size)]), np.array([[size]]), np.array([size, 0]),
                               np.array([size + 1]), np.array([size + 1, -1]), np.zeros(2, np.int64),
                               np.array([-size], np.int64)]}
        if kind == "lookup":
            return {"tokens": NOT_TOKENS, "salt": NOT_STR, "lora": NOT_STR, "mm": NOT_MM}
        return {"num_tokens": [None, True, 1.5, "1", [], -1, I64, U64_MAX, np.array([1])]}

    # -------------------------------------------------------------- kinds

    def random_bytes(self) -> list[bytes]:
        return [self.rng.randbytes(self.rng.choice((1, 2, 5, 20, 100, 300)))]

    def truncated(self) -> list[bytes]:
        """A strict prefix of a message (even a valid one) never decodes: msgpack maps declare their size."""
        msg = self.poisoned() if self.rng.random() < 0.5 else self.envelope(
            [self.template(self.rng.choice(("admit", "extend", "free", "extend_many")), set())])
        data = encode(msg)
        return [data[: self.rng.randrange(len(data))]]

    def byte_flips(self) -> list[bytes]:
        """Bytes flipped, dropped or inserted in a read-only message with a bad op.

        Up to three edits can repair a bad op, so a mutant may be valid; made
        of read-only ops (no mutating op name is within three edits of theirs),
        it then changes nothing either (see READ_ONLY_MUTANTS).
        """
        op = self.read_only_op()
        op[{"table": "req", "lookup": "tokens", "can_admit": "num_tokens"}.get(op["op"], "op")] = self.rng.choice(
            (None, 1.5, [-1], "x" * 300, {}, b"b"))
        ops = [self.read_only_op() for _ in range(self.rng.randrange(0, 3))]
        ops.insert(self.rng.randrange(len(ops) + 1), op)
        data = bytearray(encode(self.envelope(ops)))
        for _ in range(self.rng.randrange(1, 4)):
            i = self.rng.randrange(len(data))
            action = self.rng.random()
            if action < 0.6:
                data[i] ^= self.rng.randrange(1, 256)
            elif action < 0.8:
                del data[i]
            else:
                data.insert(i, self.rng.randrange(256))
        return [bytes(data)]

    def wrong_field(self) -> list[bytes]:
        rng = self.rng
        if rng.random() < 0.25:
            field, pool = rng.choice((("v", NOT_VERSION), ("client", NOT_CLIENT), ("id", NOT_MESSAGE_ID),
                                      ("ops", NOT_OPS)))
            ops = [self.template(rng.choice(("admit", "extend", "free", "ping")), set())]
            return [encode(self.envelope(ops, **{field: rng.choice(pool)}))]
        if rng.random() < 0.1:
            return [encode(self.envelope(self.surround(rng.choice(NOT_OP), set())))]
        return [encode(self.poisoned())]

    def missing_field(self) -> list[bytes]:
        rng = self.rng
        if rng.random() < 0.3:
            msg = self.envelope([self.template("admit", set())])
            del msg[rng.choice(("v", "id", "ops"))]
            return [encode(msg)]
        op = self.template(rng.choice(("admit", "extend", "free", "table", "extend_many", "lookup", "can_admit")),
                           set())
        required = {"admit": ("req", "tokens"), "extend": ("req", "tokens"), "free": ("req",), "table": ("req",),
                    "extend_many": ("reqs", "tokens", "counts"), "lookup": ("tokens",),
                    "can_admit": ("num_tokens",)}[op["op"]]
        del op[rng.choice(required)]
        return [encode(self.envelope(self.surround(op, set(self.valid.live))))]

    def dead_ids(self) -> list[bytes]:
        """Ops on requests not admitted, an admit of a live one, a double free: refused before anything applies."""
        rng = self.rng
        choice = rng.random()
        live = self.live(set())
        if live is not None and choice < 0.25:
            op: dict[str, Any] = {"op": "admit", "req": live, "tokens": np.arange(5, dtype=np.uint32)}
            return [encode(self.envelope(self.surround(op, {live})))]
        if live is not None and choice < 0.4:
            ops = [{"op": "free", "req": live}, {"op": "free", "req": live}]
            return [encode(self.envelope(ops))]
        kind = rng.choice(("extend", "free", "table", "extend_many"))
        dead = self.dead()
        op = {"op": kind, "req": dead, "tokens": np.arange(3, dtype=np.uint32)}
        if kind == "extend_many":
            op = {"op": kind, "reqs": [dead], "tokens": np.arange(3, dtype=np.uint32), "counts": np.array([3])}
        return [encode(self.envelope(self.surround(op, set())))]

    def bad_array_ext(self) -> list[bytes]:
        """Array exts that lie: unknown dtype codes, too many dimensions, shapes the data does not fill."""
        rng = self.rng
        ext = rng.choice((
            lambda: array_ext(rng.choice((0, 11, 12, 99, 255)), 1, [2], b"\0" * 8),
            lambda: array_ext(1, 5, [1, 1, 1, 1, 1], b"\0" * 4),
            lambda: raw_ext(1, b""),
            lambda: raw_ext(1, b"\x01"),
            lambda: array_ext(1, 2, [3], b""),
            lambda: array_ext(1, 1, [3], b"\0" * rng.choice((0, 11, 13, 16))),
            lambda: array_ext(3, 1, [2**32 - 1], b"\0" * 8),
            lambda: array_ext(1, 2, [2**31, 2**31], b""),
            lambda: raw_ext(rng.choice((0, 2, 5, 42, 127, -2, -128)), rng.randbytes(rng.randrange(9))),
            lambda: raw_ext(-1, rng.randbytes(rng.choice((0, 1, 5, 13)))),
        ))()
        where = rng.random()
        if where < 0.15:
            field = rng.choice(("v", "client", "id", "ops"))
            return [encode(self.envelope([self.template("admit", set())], **{field: ext}))]
        op = self.template(rng.choice(("admit", "extend", "extend_many", "lookup")), set())
        op[rng.choice(("tokens", "req", "counts", "salt", "op") if op["op"] != "extend_many"
                      else ("tokens", "counts", "op"))] = ext
        return [encode(self.envelope(self.surround(op, set())))]

    def huge_claims(self) -> list[bytes]:
        """Headers claiming 2**20..2**32-1 elements or bytes with a few bytes behind them."""
        rng = self.rng
        claim = Raw(rng.choice(CLAIMS) + struct.pack(">I", rng.choice((2**20, 2**31, 2**32 - 1)))
                    + rng.randbytes(rng.randrange(8)))
        if rng.random() < 0.3:
            return [bytes(claim)]
        op = self.template(rng.choice(("admit", "extend", "lookup")), set())
        if rng.random() < 0.3:
            return [encode(self.envelope([op], **{rng.choice(("v", "client", "id", "ops")): claim}))]
        op[rng.choice(("tokens", "req", "salt", "mm", "op"))] = claim
        return [encode(self.envelope(self.surround(op, set())))]

    def deep_nesting(self) -> list[bytes]:
        rng = self.rng
        value = deep(rng.choice((2, 10, 100, 500, 990, 1000, 1023, 1024, 1025, 2000, 50_000)), rng.random() < 0.5)
        if rng.random() < 0.3:
            return [encode(self.envelope([self.template("admit", set())],
                                         **{rng.choice(("v", "client", "id", "ops")): value}))]
        op = self.template(rng.choice(("admit", "extend", "lookup")), set())
        checked = {"admit": ("op", "req", "tokens", "salt", "mm", "num_tokens"),
                   "extend": ("op", "req", "tokens", "num_computed"), "lookup": ("op", "tokens", "salt", "mm")}
        op[rng.choice(checked[op["op"]])] = value  # a field the op reads: an ignored one would stay valid
        return [encode(self.envelope(self.surround(op, set())))]

    def unknown_op(self) -> list[bytes]:
        return [encode(self.envelope(self.surround({"op": self.rng.choice(UNKNOWN_OPS), "req": self.fresh()},
                                                   set())))]

    def multipart(self) -> list[bytes]:
        """Extra frames ahead of a bad payload: the daemon answers the last frame and echoes the rest."""
        junk = [self.rng.randbytes(self.rng.randrange(0, 9)) for _ in range(self.rng.randrange(1, 4))]
        return [*junk, encode(self.poisoned())]

    def oversized(self) -> list[bytes]:
        size = MAX_BYTES + self.rng.choice((1, 100, 4096, 3 * MAX_BYTES))
        if self.rng.random() < 0.5:
            return [self.rng.randbytes(size)]
        op = {"op": "admit", "req": self.fresh(), "tokens": np.arange(4, dtype=np.uint32), "salt": "s" * size}
        return [encode(self.envelope([op]))]

    def too_many(self) -> list[bytes]:
        if self.rng.random() < 0.5:
            return [encode(self.envelope([0] * (MAX_OPS + 1)))]
        reqs = [self.dead()] * (MAX_OPS + 1)
        return [encode(self.envelope([{"op": "extend_many", "reqs": reqs, "tokens": [], "counts": np.zeros(1)}]))]

    def version_lookalike(self) -> list[bytes]:
        """A version that is not the integer 1 (1.0, true, an array) on an otherwise valid admit."""
        op = {"op": "admit", "req": self.fresh(), "tokens": np.arange(6, dtype=np.uint32)}
        return [encode(self.envelope([op], v=self.rng.choice(VERSION_LOOKALIKES)))]

    def counts_overflow(self) -> list[bytes]:
        """extend_many counts that wrap to the token count in 64-bit arithmetic but are absurd."""
        live = self.valid.live
        if len(live) < 2:
            return self.dead_ids()
        if self.rng.random() < 0.5:
            reqs, counts, tokens = live[:2], np.array([I64, I64], np.uint64), np.zeros(0, np.uint32)
        else:
            reqs, counts, tokens = (live * 4)[:4], np.array([2**62] * 4, np.int64), np.zeros(0, np.uint32)
        return [encode(self.envelope([{"op": "extend_many", "reqs": reqs, "tokens": tokens, "counts": counts}]))]

    def num_computed_beyond_tokens(self) -> list[bytes]:
        """An extend claiming more computed tokens than the request has, after a free of another request."""
        live = self.valid.live
        if len(live) < 2:
            return self.dead_ids()
        target, other = live[0], live[-1]
        beyond = self.valid.m.num_tokens(target) + self.rng.choice((1, 1000, 2**62))
        ops = [{"op": "free", "req": other}, {"op": "extend", "req": target, "tokens": [1], "num_computed": beyond}]
        return [encode(self.envelope(ops))]


READ_ONLY_MUTANTS = frozenset({"byte_flips"})  # kinds whose messages may be valid, and then change nothing


def check_bad_reply(sent: list[bytes], frames: list[bytes], may_pass: bool = False) -> str | None:
    """Why a reply to a bad message is wrong (accepted, unnamed, an internal error, an echo), or None."""
    if frames[:-1] != sent[:-1]:
        return f"reply frames {[len(f) for f in frames]} do not echo the {len(sent) - 1} envelope frame(s)"
    try:
        reply = unpack(frames[-1], 1 << 30)
    except Exception as exc:
        return f"undecodable reply: {exc}"
    if may_pass and isinstance(reply, dict) and reply.get("ok") is True:
        return None
    if not isinstance(reply, dict) or reply.get("ok") is not False:
        return f"accepted: {str(reply)[:300]}"
    error = reply.get("error")
    if not isinstance(error, str) or not error:
        return f"no error text: {str(reply)[:300]}"
    if error.startswith("internal error"):
        return error[:300]
    if len(error) > MAX_ERROR_CHARS:
        return f"error of {len(error)} characters echoes the message: {error[:120]}..."
    return None


# ----------------------------------------------------------------------------- the volume test


def vm_kib(pid: int, field: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field} not in /proc/{pid}/status")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def exchange(sock: zmq.Socket, window: list[list[bytes]], timeout_s: float = 30.0) -> Iterator[list[bytes]]:
    """Send a window of messages, then yield their replies in order (the daemon answers one peer in order)."""
    for frames in window:
        sock.send_multipart(frames)
    for i in range(len(window)):
        if not sock.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no reply to message {i} of a window of {len(window)} within {timeout_s:g} s")
        yield sock.recv_multipart()


def test_100k_hostile_messages_change_nothing_but_what_the_valid_ones_do(daemon):
    """Every bad message gets an error naming the problem; afterwards the daemon is alive, consistent, and its
    state equals a clean manager fed only the valid messages."""
    d = daemon(*FLAGS)
    rng = random.Random(SEED)
    reference = build_manager(GEOMETRY)[0]
    valid = ValidStream(rng, reference)
    fuzzer = Fuzzer(rng, valid)
    sent: collections.Counter[str] = collections.Counter()
    passed: collections.Counter[str] = collections.Counter()  # read-only mutants that came out valid
    wrong: collections.Counter[str] = collections.Counter()  # wrong replies per kind
    examples: dict[str, list[str]] = collections.defaultdict(list)  # the first three of each kind
    start = time.monotonic()
    with zmq.Context() as ctx:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(d.endpoint)
        while sent.total() - sent["valid"] < BAD_MESSAGES:
            window: list[list[bytes]] = []
            owed: list[tuple[str, Any]] = []
            for _ in range(WINDOW):
                if rng.random() < VALID_SHARE:
                    payload, expects = valid.message()
                    window.append([payload])
                    owed.append(("valid", expects))
                else:
                    kind, frames = fuzzer.message()
                    window.append(frames)
                    owed.append((kind, frames))
            for (kind, what), frames in zip(owed, exchange(sock, window)):
                sent[kind] += 1
                if kind == "valid":
                    problem = check_valid_reply(unpack(frames[-1], 1 << 30), what)
                else:
                    problem = check_bad_reply(what, frames, may_pass=kind in READ_ONLY_MUTANTS)
                    if problem is None and unpack(frames[-1], 1 << 30).get("ok") is True:
                        passed[kind] += 1
                if problem is not None:
                    wrong[kind] += 1
                    if len(examples[kind]) < 3:
                        examples[kind].append(f"#{sent.total()}: {problem}")
        elapsed = time.monotonic() - start
        pong, integrity, stats, usage = final_state(sock, [{"op": "ping"}, {"op": "check_integrity"},
                                                          {"op": "stats"}, {"op": "usage"}])
        tables = [final_state(sock, [{"op": "table", "req": req}])[0] for req in valid.live]
        sock.close(0)
    total = sent.total()
    print(f"\nfuzz: {total:,} messages ({total - sent['valid']:,} bad, {sent['valid']:,} valid) in {elapsed:.1f} s "
          f"= {total / elapsed:,.0f}/s; daemon CPU {cpu_seconds(d.process.pid):.1f} s, "
          f"peak RSS {vm_kib(d.process.pid, 'VmHWM') / 1024:.0f} MiB")
    print("  " + ", ".join(f"{k} {n:,}" for k, n in sorted(sent.items())))
    print(f"  valid read-only mutants answered ok: {dict(passed)}")
    assert d.process.poll() is None, d.log()
    assert not wrong, "\n".join(f"{kind}: {n} wrong replies, first: {examples[kind]}"
                                for kind, n in sorted(wrong.items()))
    assert pong == "pong" and integrity is True, (pong, integrity)
    clean = reference.stats()._asdict()
    assert {k: stats[k] for k in clean} == clean
    assert np.asarray(stats["free_blocks"]).tolist() == reference.num_free_blocks.tolist()
    assert np.allclose(usage["per_row"], reference.usage.per_row)
    for req, table in zip(valid.live, tables):
        assert isinstance(table, np.ndarray) and np.array_equal(table, reference.table(req)), (req, table)
    assert "internal error" not in d.log()


_final_ids = itertools.count()


def final_state(sock: zmq.Socket, ops: list[dict[str, Any]]) -> list[Any]:
    """The results of read-only ``ops``, or the daemon's error in place of each."""
    message = pack({"v": PROTOCOL_VERSION, "client": "final", "id": next(_final_ids), "ops": ops})
    (frames,) = exchange(sock, [[message]])
    reply = unpack(frames[-1], 1 << 30)
    return reply["results"] if reply.get("ok") else [reply.get("error")] * len(ops)


# ----------------------------------------------------------------------------- any value in any field


SCALARS = (st.none() | st.booleans() | st.integers(-I64, U64_MAX) | st.floats() | st.text(max_size=8)
           | st.binary(max_size=8)
           | hnp.arrays(st.sampled_from([np.int32, np.uint32, np.int64, np.float64, np.uint8]),
                        hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3)))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)
FIELDS = {
    "envelope": ("v", "client", "id", "ops"),
    "admit": ("op", "req", "tokens", "num_tokens", "slot", "salt", "lora", "mm"),
    "extend": ("op", "req", "tokens", "num_computed"),
    "extend_many": ("op", "reqs", "tokens", "counts"),
    "free": ("op", "req"),
    "lookup": ("op", "tokens", "salt", "lora", "mm"),
    "can_admit": ("op", "num_tokens"),
}


@pytest.fixture(scope="module")
def in_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheServer]:
    folder = tmp_path_factory.mktemp("fz")
    manager, layout, _ = build_manager(GEOMETRY)
    server = CacheServer(ServeConfig(endpoint=f"ipc://{folder}/k.sock", max_tokens=MAX_TOKENS,
                                     max_slots=MAX_SLOTS), manager, layout=layout)
    yield server
    server.close()


_ids = itertools.count()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), kind=st.sampled_from(sorted(FIELDS)), value=VALUES)
def test_any_value_in_any_field_is_refused_by_name_or_applied_whole(in_process, data, kind, value):
    """Whatever a field holds, the daemon answers without an internal error; a refusal changes nothing and
    names the field; an acceptance leaves pool, index and tables consistent."""
    server = in_process
    if "live" not in server.manager or len(server.manager) > 20:
        server.handle(pack({"v": PROTOCOL_VERSION, "client": "setup", "id": next(_ids),
                            "ops": [{"op": "free", "req": r} for r in list(server.state.slots.of)]
                            + [{"op": "admit", "req": "live", "tokens": np.arange(9, dtype=np.uint32)}]}))
    field = data.draw(st.sampled_from(FIELDS[kind]))
    template = {
        "envelope": {"op": "ping"},
        "admit": {"op": "admit", "req": f"h{next(_ids)}", "tokens": np.arange(6, dtype=np.uint32)},
        "extend": {"op": "extend", "req": "live", "tokens": [1, 2]},
        "extend_many": {"op": "extend_many", "reqs": ["live"], "tokens": [3], "counts": np.array([1])},
        "free": {"op": "free", "req": "live"},
        "lookup": {"op": "lookup", "tokens": [1, 2, 3]},
        "can_admit": {"op": "can_admit", "num_tokens": 4},
    }[kind]
    msg: dict[str, Any] = {"v": PROTOCOL_VERSION, "client": "h", "id": next(_ids), "ops": [template]}
    if kind == "envelope":
        msg[field] = value
    else:
        template[field] = value
    before = observed(server)
    reply = unpack(server.handle(pack(msg)), 1 << 30)
    assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool), reply
    if reply["ok"]:
        server.manager.check_integrity()
        return
    error = reply["error"]
    assert not error.startswith("internal error"), error
    assert len(error) <= MAX_ERROR_CHARS, error[:200]
    assert error.startswith(("message:", field if kind == "envelope" else "ops[0]")), error
    assert observed(server) == before


def observed(server: CacheServer) -> dict[str, Any]:
    """What a client can see of the daemon's state: stats (live requests, seq, free blocks per row, ...)."""
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in server.stats().items()}

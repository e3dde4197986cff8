"""The daemon's wire protocol: msgpack maps with a version, arrays as raw little-endian bytes.

Scheduler → daemon (one ROUTER frame)::

    {"v": 2, "client": str, "id": int, "ops": [op, ...]}

``client`` names the sender (a random id per CacheClient unless given);
``id`` is unique per client and should count up by one per request (from a
random start, as CacheClient's do). A retry sends the same bytes again and
gets the first answer, never a second application; the same ``(client, id)``
with other content is refused. Replies are kept for retries within the
daemon's ``--dedupe-bytes``; beyond that, ids that count up are remembered as
ranges, so a retry whose reply was dropped is refused ("the retry window
passed") rather than applied again. A message whose reply could pass
``--max-reply-bytes`` is refused before any op applies. Ops::

    {"op": "admit",  "req": ID, "tokens": TOKENS, "salt"?: str, "lora"?: str | [str, str],
                     "mm"?: [[str, int, int], ...], "num_tokens"?: int, "slot"?: int}
    {"op": "extend", "req": ID, "tokens": TOKENS, "num_computed"?: int}
    {"op": "free",   "req": ID}
    {"op": "table",  "req": ID}
    {"op": "lookup", "tokens": TOKENS, "salt"?, "lora"?, "mm"?}
    {"op": "can_admit", "num_tokens": int}
    {"op": "extend_many", "reqs": [ID, ...], "tokens": TOKENS, "counts": int array}   (a decode step)
    {"op": "usage"} | {"op": "stats"} | {"op": "info"} | {"op": "ping"} | {"op": "reset_prefix_cache"}
    {"op": "owned"} → the live request ids this client (by name) owns
    {"op": "reclaim", "reqs": [ID, ...]} → the ids now owned by this client (a restarted scheduler)
    {"op": "check_integrity"}   (admin: pool, index and tables agree; an error result names what does not)

Scheduler-owned block lists (KVCacheManager's ``match_blocks`` family, for schedulers that keep their own
tables, such as FastDeploy's; no table deltas: the scheduler hands its tables to its workers)::

    {"op": "match_blocks", "req": ID, "tokens": TOKENS, "salt"?, "lora"?, "mm"?} → int32 blocks (whole-prompt hits)
    {"op": "allocate_blank", "req": ID, "num_blocks": int} → int32 blocks, or None (too few allocatable)
    {"op": "commit_blocks", "req": ID, "blocks": [int, ...], "tokens": TOKENS, "blank_from"?: ID} → blocks indexed
    {"op": "release_blocks", "req": ID, "blocks"?: [int, ...]} → true (no blocks: the committed part ends)
    {"op": "evict_cached", "num_blocks": int} → blocks evicted
    {"op": "owned_blocks", "req": ID} → [committed int32 blocks, blank int32 blocks]
    {"op": "free_blocks"} → {"free": per row, "cached_free": per row, "uncached": int32 free blocks holding no prefix}
    lookup with "whole_prompt": true → the tokens match_blocks would find

PD disaggregation (``kvcache serve --role prefill|decode``; see kvcache/pd/state.py for the flow)::

    decode:  {"op": "reserve", "req": ID, "tokens": TOKENS, "salt"?, "lora"?, "mm"?, "slot"?, "timeout"?: seconds}
               → admit's result + "receivers": [endpoint per decode rank] + "rows": [the daemon's rows]
             {"op": "attach", "rank": int, "endpoint": str, "key"?: int}   (a decode rank's CacheReceiver)
             {"op": "received", "req": ID, "rank": int, "key": int}  (every writer to that rank has finished)
    prefill: admit with "dest": {"receivers": [str], "table": int32[rows, blocks], "cached": int,
                                 "decode": str, "rows"?: the reserve's rows, "timeout"?: seconds}
             (a daemon of several rows needs "rows", and refuses rows whose policies or cells differ from its own)
             {"op": "attach", "rank": int, "key"?: int}         (a prefill rank's messager claims its rank)
             {"op": "plans", "reqs": [ID, ...]} → per request its plan or None (messagers)
             {"op": "sent", "req": ID, "rank": int, "key": int}  (a prefill rank wrote and notified all)
    both:    {"op": "cancel", "req": ID, "release"?: bool} | {"op": "transfer_failed", "req": ID, "error": str}
             {"op": "pd_poll"} → {"done": [[ID, t_ns], ...], "failed": [[ID, error], ...]} (the caller's requests)

A request in transfer refuses free (cancel it instead), and extend on decode; a prefill node admits it
with ``num_tokens`` and extends it chunk by chunk (chunked prefill), ``dest.table`` covering the whole prompt.

``ID`` is a str (at most 256 characters) or an int in int64; ``TOKENS`` an
integer array (or a list of ints). The whole message is validated, structure
and request-id liveness in op order, before any op is applied: a bad message
changes nothing. Reply::

    {"v": 2, "id": int, "ok": true, "epoch": int, "seq": int, "results": [result, ...]}
    {"v": 2, "id": int, "ok": false, "error": "ops[2].tokens: token id -5 is outside [0, 2**32)"}

``seq`` is the last table-delta sequence number published when the reply
was sent, ``epoch`` the daemon incarnation's (workers: ``wait_for(seq, epoch)``).
Results: admit → ``{"cached", "num_tokens", "table", "slot"}`` or None (no room);
extend → ``{"len", "cols", "vals"}`` (the table's delta) or None; extend_many →
the tables' lengths and the changed ones' deltas in compressed rows::

    {"lens": int32[n] (-1 = no room, that request unchanged),
     "changed": {"index": int32[m], "offsets": int32[m + 1], "cols": int32[total], "vals": int32[rows, total]}}

where request ``reqs[index[k]]`` (``index`` ascending) set columns ``cols[offsets[k]:offsets[k + 1]]``
of its table, now ``lens[index[k]]`` wide, to ``vals[:, offsets[k]:offsets[k + 1]]``; the other
requests' tables did not change. table → array; others as named. An op that fails while applying
(e.g. one on a request whose admit in the same message found no room) gets ``{"error": str}`` as
its result; the others still apply.

Table deltas (PUB, multipart ``[b"T" + epoch as 8-byte big-endian, seq as 8-byte big-endian, payload]``;
the epoch is random per daemon incarnation, so workers notice a restart)::

    {"t": uint64, "v": 2, "epoch": int, "seq": int,
     "changes": {"reqs": [ID, ...], "slots": int32[m], "lens": int32[m],
                 "offsets": int32[m + 1], "cols": int32[total], "vals": int32[rows, total]},
     "freed": [ID, ...], "reset": bool}

Change k, in op order, puts ``reqs[k]`` at batch slot ``slots[k]`` and sets columns
``cols[offsets[k]:offsets[k + 1]]`` of its table (now ``lens[k]`` columns wide; rows = every kv head of
the model in head-wise mode) to ``vals[:, offsets[k]:offsets[k + 1]]``; a change setting every column is
an admit. ``changes`` is always present (m may be 0). Apply a delta's ``freed`` before its ``changes``:
the daemon starts a new delta rather than free a request changed earlier in the same one.

``t`` is the daemon's CLOCK_MONOTONIC ns when it sent the delta. The payload is a fixmap whose first
entry is ``"t"`` packed as uint64 (``0xcf`` then 8 big-endian bytes at ``DELTA_T_OFFSET``), rewritten in
place just before sending. A replayed delta keeps the time of its first send; one never sent live (replayed
from a journal while recovering) holds the time it was encoded, as recovery ended.

After ``heartbeat_ms`` without a delta the PUB sends ``[topic+epoch, seq, b""]``: an empty payload
saying "the latest seq is this" (a worker behind asks for replay).

Same-host clients may send a request as one datagram to the daemon's local endpoint (a Unix datagram
socket, ``info()["local_endpoint"]``) from a socket bound to an address of its own; the reply comes
back as one datagram to that address. Either way a datagram stays within ``LOCAL_MAX_BYTES``: a larger
request goes over ZMQ, and a larger reply is replaced by ``{"v": 2, "id": int, "ok": false, "resend":
true}`` (the request was applied and its reply kept: the same ``(client, id)`` sent over ZMQ gets it).

Workers on the daemon's host may take the table deltas from the local endpoint instead of the PUB: a
datagram ``LOCAL_SUBSCRIBE`` (bytes that are not a msgpack map) registers the sender's address, and the
daemon answers it with a heartbeat. That address must be a socket file (of the daemon's user or root) in the
local endpoint's own folder, which only that user may write: an abstract name, which anyone may bind once
its worker is gone, is answered with an error reply and sent nothing. From then on every delta and
heartbeat comes as one datagram ``topic+epoch (9 bytes) | seq (8 bytes) | payload``, the PUB's three
frames back to back. A delta whose datagram would pass ``LOCAL_MAX_BYTES`` (a payload over 65,519 bytes)
comes as a heartbeat of its seq, on the PUB as on the local endpoint (fetch it by replay); one that finds
the worker's queue full is not sent (the worker sees the gap). The daemon forgets an address it can no
longer reach (and removes the socket file a killed worker left), and one that sends ``LOCAL_UNSUBSCRIBE``
(a worker's goodbye when it closes); a worker renews its subscription when deltas
stop coming. At most ``MAX_LOCAL_SUBSCRIBERS`` addresses are kept.

Who may send which op (``OP_CALLERS``, checked once where a message enters, before any op applies; a refused
op refuses its whole message with one line naming the op and who may send it)::

    scheduler  admit extend extend_many free table lookup can_admit owned reclaim reserve cancel
               transfer_failed pd_poll tier_failed match_blocks         any client
               allocate_blank commit_blocks release_blocks evict_cached
               owned_blocks free_blocks
    admin      usage stats info ping check_integrity reset_prefix_cache  any client
    worker     plans                                                    any client (a PD messager's plans)
    rank       sent received "key": int                                 only the worker attached as that rank (the
                                                                        messager, the receiver), naming its key
               tier_attach "key"?: int "admin"?: int                    a rank not claimed: any client (its key
                                                                        claims it); else only that key or the
                                                                        daemon's admin key (kvcache.rank_keys)
               tier_done "agent": int                                   only the agent attached as that rank now,
                                                                        proving it with the key it attached with
               attach "key"?: int "admin"?: int                         the same rule as tier_attach (a decode
                                                                        receiver, or a prefill messager: no endpoint)
    daemon     tier_expire                                              the daemon itself (its host-tier deadline);
                                                                        never a client

Arrays: msgpack ExtType 1 whose data is ``dtype code (u8) | ndim (u8) |
shape (ndim × u32 LE) | C-order little-endian bytes``.

Version 2 changed only replies and deltas (version 1 sent a ``[i, cols, vals]`` list per changed request in
extend_many results and a map per change in deltas), so a daemon still replays version-1 requests from
its journal.
"""
from __future__ import annotations

import reprlib
import secrets
import socket
import struct
from typing import Any

import msgpack
import numpy as np

from kvcache import _wire
from kvcache.allocator import _tables
from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.prefix import as_token_array

PROTOCOL_VERSION = 2
JOURNAL_VERSIONS = (1, 2)  # request formats a journal may hold: requests did not change in 2
ARRAY_EXT = 1
DELTA_TOPIC = b"T"
MAX_ID_CHARS = 256
MAX_OPS = 65_536
LOCAL_MAX_BYTES = 65_536  # a local-endpoint datagram, either way (fits Linux's default socket buffers)
LOCAL_SUBSCRIBE = b"\x00subscribe"  # a worker's datagram: send me the deltas (never a msgpack request map)
LOCAL_UNSUBSCRIBE = b"\x00unsubscribe"
MAX_LOCAL_SUBSCRIBERS = 256
DELTA_HEAD_BYTES = 17  # a delta datagram's topic+epoch (9 bytes) and seq (8) before the payload
DELTA_T_OFFSET = 4  # a delta payload's "t" value: after the fixmap byte, the key "t" (2 bytes) and 0xcf

_CODES = {
    1: np.dtype("<i4"),
    2: np.dtype("<u4"),
    3: np.dtype("<i8"),
    4: np.dtype("<u8"),
    5: np.dtype("<f8"),
    6: np.dtype("u1"),
    7: np.dtype("<i2"),
    8: np.dtype("<u2"),
    9: np.dtype("i1"),
    10: np.dtype("<f4"),
}
_CODE_OF = {dt: code for code, dt in _CODES.items()}
# Hot-path lookups: the code of a native-order dtype (the dtypes arrays come in), and one struct per ndim.
_NATIVE_CODE = {dt.newbyteorder("="): code for code, dt in _CODES.items()}
_HEADERS = [struct.Struct(f"<BB{ndim}I") for ndim in range(5)]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_LITTLE_HOST = np.dtype("=i4") == np.dtype("<i4")


class ProtocolError(KVCacheError):
    """A message that cannot be decoded or violates the protocol; the message names the field."""


#: Who may send each op: "scheduler" and "admin" ops any client; "worker" ops any client (a PD messager's plans);
#: "rank" ops a TP rank's worker, proving the rank with its key (the daemon checks the key; the daemon's admin key
#: claims any rank); "daemon" ops only the daemon itself (an expiry it journals like a message), never a client.
OP_CALLERS: dict[str, str] = {
    **dict.fromkeys(("admit", "extend", "extend_many", "free", "table", "lookup", "can_admit", "owned", "reclaim",
                     "reserve", "cancel", "transfer_failed", "pd_poll", "tier_failed", "match_blocks",
                     "allocate_blank", "commit_blocks", "release_blocks", "evict_cached", "owned_blocks",
                     "free_blocks"), "scheduler"),
    **dict.fromkeys(("usage", "stats", "info", "ping", "check_integrity", "reset_prefix_cache"), "admin"),
    "plans": "worker",
    **dict.fromkeys(("tier_attach", "tier_done", "attach", "sent", "received"), "rank"),
    "tier_expire": "daemon",
}


def check_caller(kind: str, field: str, *, own: bool) -> None:
    """Refuse op ``kind`` from a client when only the daemon may send it (``own``: the daemon's own message)."""
    if OP_CALLERS.get(kind) == "daemon" and not own:
        raise ProtocolError(f"{field}.op: {kind} is the daemon's own op (who may send it: the daemon itself, "
                            "never a client)")


_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother = 2, 60, 60


def show(value: Any) -> str:
    """A sender's value for an error message: its repr cut short, so deep nesting or a huge string is never echoed."""
    return _SHOW.repr(value)


def encode_array(arr: np.ndarray) -> msgpack.ExtType:
    """An array as the protocol's ExtType: dtype code, shape, raw little-endian bytes."""
    code = _NATIVE_CODE.get(arr.dtype) if _LITTLE_HOST else None
    if code is None:
        code = _CODE_OF.get(arr.dtype.newbyteorder("<") if arr.dtype.itemsize > 1 else arr.dtype)
        if code is None:
            raise ProtocolError(f"array: dtype {arr.dtype} has no wire code")
    data = np.ascontiguousarray(arr, dtype=_CODES[code])
    if data.ndim > 4:
        raise ProtocolError(f"array: {data.ndim} dimensions, at most 4 allowed")
    return msgpack.ExtType(ARRAY_EXT, b"".join((_HEADERS[data.ndim].pack(code, data.ndim, *data.shape), data)))


def _decode_ext(code: int, data: bytes) -> Any:
    if code != ARRAY_EXT:
        raise ProtocolError(f"unknown ext type {code}")
    if len(data) < 2:
        raise ProtocolError("array: truncated header")
    dtype = _CODES.get(data[0])
    if dtype is None:
        raise ProtocolError(f"array: unknown dtype code {data[0]}")
    ndim = data[1]
    if ndim > 4:
        raise ProtocolError(f"array: {ndim} dimensions, at most 4 allowed")
    start = 2 + 4 * ndim
    if len(data) < start:
        raise ProtocolError("array: truncated shape")
    shape = _HEADERS[ndim].unpack_from(data)[2:]
    count = 1
    for n in shape:
        count *= n
    if len(data) - start != count * dtype.itemsize:
        raise ProtocolError(f"array: shape {shape} of {dtype} needs {count * dtype.itemsize} bytes, "
                            f"got {len(data) - start}")
    return np.frombuffer(data, dtype=dtype, offset=start).reshape(shape)


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return encode_array(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")


_wire.configure(ProtocolError, np.frombuffer, np.ndarray, np.integer, np.floating, msgpack.ExtType, _CODES,
                _NATIVE_CODE if _LITTLE_HOST else None, _default)


def pack(obj: Any) -> bytes:
    """Encode a protocol message (numpy arrays become array exts), in C (``kvcache._wire``).

    The bytes are msgpack-python's ``packb(obj, use_bin_type=True, default=...)`` (``pack_reference``).
    """
    return _wire.packb(obj)


def pack_lists(obj: Any, wide: type | None = None) -> bytes:
    """``pack``, with 1-D integer arrays written as msgpack arrays of ints (``arr.tolist()``'s bytes, no Python int
    per element), and maps of the dict subclass ``wide`` with a map 16 header however short (as msgspec writes a
    struct of 16 fields or more): vLLM's KV events are written that way."""
    return _wire.packb_lists(obj, wide)


def unpack(data: bytes, max_bytes: int, max_items: int | None = None) -> Any:
    """Decode a protocol message, refusing it by size first; errors are ProtocolError.

    ``max_items`` caps every list and map, so a message of millions of tiny
    items (a token list instead of an array) is refused before it is built.
    Decoded in C (``kvcache._wire``) as ``unpack_reference`` decodes it.
    """
    if len(data) > max_bytes:
        raise ProtocolError(f"message: {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        return _wire.unpackb(data, -1 if max_items is None else max_items)
    except ProtocolError:
        raise
    except Exception as exc:  # malformed msgpack raises several types
        raise ProtocolError(f"message: not valid msgpack ({type(exc).__name__}: {exc})") from None


def pack_reference(obj: Any) -> bytes:
    """``pack`` through msgpack-python and Python hooks: the reference the C codec is tested against."""
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def unpack_reference(data: bytes, max_items: int | None = None) -> Any:
    """``unpack`` (without its size check or error wrapping) through msgpack-python and Python hooks."""
    limits = {} if max_items is None else {"max_array_len": max_items, "max_map_len": max_items}
    return msgpack.unpackb(data, ext_hook=_decode_ext, raw=False, strict_map_key=False, use_list=True, **limits)


# ----------------------------------------------------------------------------- validation


def check_request_id(value: Any, field: str) -> str | int:
    """A request id: a str of at most 256 characters or an int within int64."""
    if isinstance(value, str):
        if len(value) > MAX_ID_CHARS:
            raise ProtocolError(f"{field}: request id longer than {MAX_ID_CHARS} characters")
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        if not INT64_MIN <= value <= INT64_MAX:
            raise ProtocolError(f"{field}: request id {value} outside int64")
        return value
    raise ProtocolError(f"{field}: request id must be a str or int, got {type(value).__name__}")


def check_int(value: Any, field: str, least: int = 0, most: int = INT64_MAX) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{field}: must be an integer, got {type(value).__name__}")
    if not least <= value <= most:
        raise ProtocolError(f"{field}: {value} is outside [{least}, {most}]")
    return value


def check_tokens(value: Any, field: str, max_tokens: int) -> np.ndarray:
    """Tokens as a uint32 array: an integer array ext or a list of ints (no bools), ids in [0, 2**32)."""
    usual = _tables.token_array(value)  # the usual case in one C call: a uint32 array, or int32 ids >= 0
    if usual is not None and usual.size <= max_tokens:
        return usual
    if isinstance(value, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ProtocolError(f"{field}: expected integers")
    if not isinstance(value, (np.ndarray, list)):
        raise ProtocolError(f"{field}: expected an integer array, got {type(value).__name__}")
    if len(value) > max_tokens:
        raise ProtocolError(f"{field}: {len(value)} tokens exceed the limit of {max_tokens}")
    try:
        return as_token_array(value, field)
    except KVCacheError as exc:
        raise ProtocolError(str(exc)) from None


def check_optional_str(op: dict, key: str, field: str, most: int = 4096) -> str | None:
    value = op.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > most:
        raise ProtocolError(f"{field}.{key}: must be a str of at most {most} characters")
    return value


def check_lora(op: dict, field: str, most: int = 4096) -> str | tuple[str, str] | None:
    """An op's optional ``lora``: a LoRA name, or [name, path] (two adapters under one name differ by path)."""
    value = op.get("lora")
    if value is None or (isinstance(value, str) and len(value) <= most):
        return value
    if isinstance(value, list) and len(value) == 2 and all(isinstance(x, str) and len(x) <= most for x in value):
        return (value[0], value[1])
    raise ProtocolError(f"{field}.lora: must be a LoRA name or [name, path], str of at most {most} characters each")


def check_mm(value: Any, field: str) -> list[tuple[str, int, int]] | None:
    """Multimodal placeholders: [[identifier, offset, length], ...]."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > 4096:
        raise ProtocolError(f"{field}: must be a list of at most 4096 [identifier, offset, length]")
    items = []
    for i, item in enumerate(value):
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and len(item[0]) <= 1024):
            raise ProtocolError(f"{field}[{i}]: must be [identifier (str), offset, length]")
        items.append((item[0], check_int(item[1], f"{field}[{i}].offset"),
                      check_int(item[2], f"{field}[{i}].length", least=1)))
    return items


def header(msg: Any, max_ops: int = MAX_OPS, versions: tuple[int, ...] = (PROTOCOL_VERSION,)) -> tuple[str, int, list]:
    """Check a request's envelope (its ``v`` one of ``versions``); returns (client, id, ops)."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"message: must be a map, got {type(msg).__name__}")
    version = msg.get("v")
    if type(version) is not int or version not in versions:  # not 2.0, True or an array that compares equal
        raise ProtocolError(f"v: protocol version {show(version)} is not supported (expected {PROTOCOL_VERSION})")
    client = msg.get("client", "")
    if not isinstance(client, str) or len(client) > MAX_ID_CHARS:
        raise ProtocolError(f"client: must be a str of at most {MAX_ID_CHARS} characters")
    req_id = check_int(msg.get("id"), "id", least=INT64_MIN)
    ops = msg.get("ops")
    if not isinstance(ops, list):
        raise ProtocolError(f"ops: must be a list, got {type(ops).__name__}")
    if len(ops) > max_ops:
        raise ProtocolError(f"ops: {len(ops)} operations exceed the limit of {max_ops}")
    return client, req_id, ops


def error_reply(request_id: Any, message: str) -> bytes:
    rid = request_id if isinstance(request_id, int) and not isinstance(request_id, bool) else None
    return pack({"v": PROTOCOL_VERSION, "id": rid, "ok": False, "error": message})


def resend_reply(request_id: Any) -> bytes:
    """A local endpoint's answer when the reply outgrew a datagram: get it over ZMQ with the same id."""
    return pack({"v": PROTOCOL_VERSION, "id": request_id, "ok": False, "resend": True})


def pack_delta(body: dict[str, Any], t_ns: int) -> bytearray:
    """A delta's payload: ``body`` with ``"t": t_ns`` first as a fixed-width uint64, for ``stamp_delta`` to rewrite.

    Fixed width, so the publish time is written into the packed bytes at
    send time instead of packing the whole delta again.
    """
    rest = pack(body)
    assert 0x80 <= rest[0] < 0x8F, f"a delta is a fixmap of at most 14 entries, got header byte {rest[0]:#x}"
    out = bytearray(DELTA_T_OFFSET + 8 + len(rest) - 1)
    out[:DELTA_T_OFFSET] = bytes((rest[0] + 1,)) + b"\xa1t\xcf"  # one more entry; "t" as uint64
    out[DELTA_T_OFFSET + 8:] = memoryview(rest)[1:]
    stamp_delta(out, t_ns)
    return out


def stamp_delta(payload: bytearray, t_ns: int) -> None:
    """Write the publish time (CLOCK_MONOTONIC ns) into a payload made by ``pack_delta``."""
    payload[DELTA_T_OFFSET:DELTA_T_OFFSET + 8] = t_ns.to_bytes(8, "big")


def bind_private(sock: socket.socket, kind: str) -> bytes:
    """Bind a datagram socket to a fresh abstract address of 128 random bits; returns it.

    Not Linux's autobind: its names are 20-bit and handed out in turn, so a
    process could inherit a dead client's or worker's address and get a reply
    or delta the daemon still meant for it.
    """
    address = b"\0kvcache-" + kind.encode() + b"-" + secrets.token_hex(16).encode()
    sock.bind(address)
    return address


def seq_frame(seq: int) -> bytes:
    """A sequence number as the 8-byte big-endian frame of PUB messages."""
    return seq.to_bytes(8, "big", signed=True)

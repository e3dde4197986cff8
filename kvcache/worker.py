"""TableSubscriber: one TP rank's block tables, kept current from the daemon's table deltas.

A worker process builds one subscriber and, before running each step the
scheduler planned, calls ``wait_for(seq)`` with the ``seq`` of the
scheduler's reply; the tables then hold every change of that step::

    sub = TableSubscriber("ipc:///run/kvcache.sock", rank=r, tp_size=tp, out="paddle", local=True)
    sub.wait_for(step.seq)                 # the step's deltas are applied
    block_tables = sub.tensor[slots]       # [batch, rows of this rank, max_blocks], -1 = empty

The tables are int32 ``[max_slots, rows, max_blocks]``: a request's table
lives at the batch slot the daemon gave it, in the rows of this rank (its kv
heads, its layer groups: see ``TableSubscriber``); everything else is -1.
Start-up loads a consistent state (every buffered
delta from seq 0, or a snapshot); then deltas arrive on the PUB socket in seq
order. A seq that skips ahead (the PUB dropped messages for a slow worker)
asks the replay socket for the missing ones; a worker too far behind gets a
snapshot instead. Every wait has a deadline.

Where the tables live (``out``), and what each step costs:

    out                              .tensor                     per-step copy
    "numpy"                          the numpy array             none
    "paddle"                         paddle CPU int32 tensor     none: a DLPack view of the numpy array
    "torch"                          torch CPU int32 tensor      none: torch.from_numpy of the numpy array
    your host array (__dlpack__)     your object                 none: .tables is np.from_dlpack of it
    your device tensor (GPU, CuPy)   your object                 changed slots copied from .tables,
                                                                 ``tensor[a:b] = ...`` per run of slots

``zero_copy`` says which case holds. With a device tensor ``.tables`` is a
numpy mirror and the copies happen before ``poll``/``wait_for`` return.

``wait_for`` knows which seq it needs, so it also recovers a dropped *last*
delta (nothing after it to reveal the gap) by asking the replay socket after
a short silence; ``poll`` only sees gaps that a later delta reveals. Each
daemon incarnation has its own epoch (in every delta's topic frame): a
subscriber that sees a new one drops every table and loads the new daemon's
state, so a restarted daemon never leaves a worker with stale tables.

With ``local=True`` a worker on the daemon's host takes the deltas from the
daemon's local endpoint (a Unix datagram socket, see ``kvcache.protocol``)
instead of the PUB: each delta is one datagram sent straight to this worker's
socket, with no ZMQ I/O thread on either side. The same seq checks, replay and
epochs apply. Where the daemon has no local endpoint, or this host cannot reach
it, the worker takes the PUB as before (``local`` says which it uses).

Before it connects to an ipc:// socket or the local endpoint, a worker checks
that only its user or root can have put the socket there (kvcache.paths), as
CacheClient does. The worker's own socket, where the deltas come, is a file
beside the local endpoint in that owner-only folder, not an abstract name:
nobody but the daemon's user (or root) can bind its address once the worker is
gone, so the deltas meant for it (request ids, tables) reach nobody else.
``close`` says goodbye to the daemon and removes the file.
"""
from __future__ import annotations

import collections
import logging
import re
import select
import socket
import time
import types
import warnings
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np
import zmq

from kvcache.allocator.errors import KVCacheError
from kvcache.auth import CurveConfig, secure_client_socket
from kvcache.allocator.rows import Row, cell_rows, rows_of_rank
from kvcache.allocator.table import EMPTY, rank_rows
from kvcache.client import CacheClient, DaemonUnavailable
from kvcache.paths import bind_beside, check_socket_path, remove_socket_file
from kvcache.protocol import (
    DELTA_HEAD_BYTES,
    DELTA_TOPIC,
    LOCAL_MAX_BYTES,
    LOCAL_SUBSCRIBE,
    LOCAL_UNSUBSCRIBE,
    PROTOCOL_VERSION,
    ProtocolError,
    check_request_id,
    pack,
    unpack,
)

log = logging.getLogger("kvcache.worker")

_MAX_MESSAGE_BYTES = 1 << 31
_DRAIN_LIMIT = 4096  # messages applied per drain, so a flood cannot hold poll() forever
_RENEW_AFTER_S = 0.5  # a local subscriber that heard nothing this long (5 idle heartbeats) subscribes again
_FIRST_NUDGE_S = 0.02  # silence after which wait_for asks the replay socket instead of waiting on
_DLPACK_CPU = 1


class SyncTimeout(DaemonUnavailable):
    """The tables did not reach the wanted seq, or the replay socket did not answer, before the deadline."""


class TableCapacityError(KVCacheError):
    """A delta does not fit the subscriber's tables (``max_slots`` or ``max_blocks`` too small)."""


class _Changes(NamedTuple):
    """A delta's checked changes: change k puts ``reqs[k]`` at ``slots[k]``, ``lens[k]`` columns wide, and sets
    its columns ``cols[offsets[k]:offsets[k + 1]]`` to those of ``vals`` (see protocol.py)."""

    reqs: list[Any]
    slots: list[int]
    lens: list[int]
    offsets: list[int]  # m + 1
    sizes: np.ndarray  # int64 [m]: columns per change
    cols: np.ndarray  # int64 [total]
    vals: np.ndarray  # [num_rows, total]


class _Output:
    """The tables' storage: a numpy array, possibly shared with a framework tensor, else mirrored into it."""

    def __init__(self, out: Any, shape: tuple[int, int, int]) -> None:
        self.tensor: Any
        self.convert: Callable[[np.ndarray], Any] = lambda arr: arr
        if isinstance(out, str):
            self.mirror = np.full(shape, EMPTY, dtype=np.int32)
            self.tensor = _framework_view(out, self.mirror)
            self.zero_copy = True
            return
        self.tensor = out
        view = _host_view(out)
        self.zero_copy = view is not None
        if view is None:
            self.mirror = np.full(shape, EMPTY, dtype=np.int32)
            self.convert = _converter(out)
        else:
            self.mirror = view
        self.mirror.fill(EMPTY)
        self.write_all()

    def write(self, slots: set[int]) -> None:
        """Copy the given slots from the mirror into the tensor (nothing to do when they share memory)."""
        if self.zero_copy or not slots:
            return
        order = np.fromiter(sorted(slots), dtype=np.int64, count=len(slots))
        breaks = np.flatnonzero(np.diff(order) != 1) + 1
        for run in np.split(order, breaks):
            start, stop = int(run[0]), int(run[-1]) + 1
            self.tensor[start:stop] = self.convert(self.mirror[start:stop])

    def write_all(self) -> None:
        if not self.zero_copy:
            self.tensor[0:self.mirror.shape[0]] = self.convert(self.mirror)


def _framework_view(out: str, mirror: np.ndarray) -> Any:
    """A CPU tensor of ``out``'s framework sharing ``mirror``'s memory."""
    if out == "numpy":
        return mirror
    if out == "paddle":
        # Paddle warns at import when ccache, which only its C++ extension builds use, is not on PATH: this one
        # warning only (catch_warnings() would also drop the filters Paddle sets as it imports).
        warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning,
                                module=r"paddle\.utils\.cpp_extension")
        try:
            import paddle
        except ImportError:
            raise KVCacheError("out: 'paddle' needs paddlepaddle installed") from None
        return paddle.utils.dlpack.from_dlpack(mirror.__dlpack__())
    if out == "torch":
        try:
            import torch
        except ImportError:
            raise KVCacheError("out: 'torch' needs PyTorch installed") from None
        return torch.from_numpy(mirror)
    raise KVCacheError(f"out: {out!r} is not 'numpy', 'paddle', 'torch' or an array")


def _host_view(out: Any) -> np.ndarray | None:
    """A writable numpy view of ``out``'s memory when it lives on the host, else None."""
    if isinstance(out, np.ndarray):
        return out if out.flags.writeable and out.flags.c_contiguous else None
    if not hasattr(out, "__dlpack__"):
        return None
    device = getattr(out, "__dlpack_device__", lambda: (None, 0))()
    if device[0] != _DLPACK_CPU:
        return None
    try:
        view = np.from_dlpack(out)
    except (BufferError, RuntimeError, TypeError, ValueError):
        return None
    return view if view.flags.writeable and view.flags.c_contiguous else None


def _converter(out: Any) -> Callable[[np.ndarray], Any]:
    """How to turn a numpy block of the mirror into something ``out[a:b] = ...`` accepts."""
    module = type(out).__module__.split(".")[0]
    if module == "cupy":
        import cupy

        return cupy.asarray
    if module == "torch":
        import torch

        return torch.from_numpy
    return lambda arr: arr  # paddle, and most array types, take numpy arrays in __setitem__


def _shape_of(out: Any) -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in out.shape)
    except (AttributeError, TypeError):
        raise KVCacheError(f"out: expected 'numpy', 'paddle', 'torch' or an array, got {type(out).__name__}") from None


def _int_array(value: Any, field: str, size: int | None) -> np.ndarray:
    """A 1-D integer array of a delta (of ``size`` items, if given) as int64."""
    if not (isinstance(value, np.ndarray) and value.dtype.kind in "iu" and value.ndim == 1
            and (size is None or value.size == size)):
        raise ProtocolError(f"{field}: must be a 1-D integer array" + ("" if size is None else f" of {size}"))
    return value.astype(np.int64, copy=False)


def _reachable(bound: str, via: str) -> str:
    """``bound`` with a wildcard TCP host (``*``, 0.0.0.0, ::) replaced by the host of ``via``."""
    match = re.fullmatch(r"tcp://(\*|0\.0\.0\.0|\[::\]|::):(\d+)", bound)
    host = re.fullmatch(r"tcp://(.+):\d+", via)
    if match and host:
        return f"tcp://{host.group(1)}:{match.group(2)}"
    return bound


def _check_ipc(endpoint: str, field: str) -> None:
    """``check_socket_path`` for an ipc:// endpoint; tcp:// ones are CURVE's to secure."""
    if endpoint.startswith("ipc://"):
        check_socket_path(endpoint, field)


def _error_of(datagram: bytes) -> str | None:
    """The message of an error reply datagram (``{"ok": false, "error": ...}``), else None."""
    try:
        reply = unpack(datagram, LOCAL_MAX_BYTES)
    except ProtocolError:
        return None
    if isinstance(reply, dict) and reply.get("ok") is False:
        return str(reply.get("error"))
    return None


def _ms(seconds: float) -> int:
    return max(0, int(seconds * 1000) + 1)


def _layout(info: Mapping[str, Any]) -> tuple[Row, ...] | None:
    """The rows' cells from an info reply, or None where the daemon names none (no model config)."""
    rows = info.get("rows")
    if not (isinstance(rows, list) and rows and all(isinstance(r, dict) and "layers" in r for r in rows)):
        return None
    if len(rows) != info.get("num_rows"):
        raise ProtocolError(f"info: {len(rows)} rows described for num_rows {info.get('num_rows')!r}")
    return tuple(Row.from_description(r, f"info.rows[{i}]") for i, r in enumerate(rows))


class TableSubscriber:
    """A TP rank's block tables (int32 ``[max_slots, rows, max_blocks]``), current up to ``seq``.

    Rows: a daemon serving a model's config names each row's (layer, kv head)
    cells (``layout``); rank r holds the rows with one of its kv heads
    (``rank_rows``), and ``cell_rows[layer, head]`` says which of them a layer's
    head reads (layer groups: the sliding layers' row or the full layers'; per
    head within each group with ``--head-wise``). Without a config, one row is
    every rank's, and head-wise rows are kv heads. ``max_slots``/``max_blocks`` default
    to 1024/4096, or to the shape of an array passed as ``out``. ``tp_size``
    defaults to the daemon's ``--tp``. Not thread-safe: one thread polls it.
    """

    def __init__(self, endpoint: str, *, rank: int = 0, tp_size: int | None = None, max_slots: int | None = None,
                 max_blocks: int | None = None, out: Any = "numpy", context: zmq.Context | None = None,
                 timeout: float = 5.0, curve: CurveConfig | None = None, local: bool = False) -> None:
        if timeout <= 0:
            raise KVCacheError(f"timeout: must be positive, got {timeout}")
        self.endpoint = endpoint
        self.timeout = timeout
        self._ctx = context or zmq.Context.instance()
        self._curve = curve
        with CacheClient(endpoint, timeout=timeout, context=self._ctx, curve=curve) as client:
            info = client.info()
        if info.get("protocol") != PROTOCOL_VERSION:
            raise ProtocolError(f"daemon speaks protocol {info.get('protocol')!r}, this worker {PROTOCOL_VERSION}")
        self.num_rows: int = info["num_rows"]
        self.tp_size = info.get("tp", 1) if tp_size is None else tp_size
        self.rank = rank
        rank_rows(1, self.tp_size, rank)  # validates rank and tp_size
        #: Every row's (layer, kv head) cells, where the daemon serves a model's config (else None).
        self.layout: tuple[Row, ...] | None = _layout(info)
        #: int32 [layers, this rank's kv heads]: the index among this rank's rows of the row that holds each
        #: cell (None without a layout). Layer l's kv head h reads ``tables[slots, cell_rows[l, h]]``.
        self.cell_rows: np.ndarray | None = None
        if self.layout is not None:
            heads = info.get("num_kv_heads") or 1 + max(max(r.kv_heads) for r in self.layout)
            layers = info.get("num_layers") or 1 + max(max(r.layers) for r in self.layout)
            ids = np.asarray(rows_of_rank(self.layout, heads, self.tp_size, rank), dtype=np.intp)
            self.cell_rows = cell_rows(self.layout, layers, heads, self.tp_size, rank)
        elif self.num_rows == 1:
            ids = np.zeros(1, dtype=np.intp)
        else:
            heads = info.get("num_kv_heads")
            if heads is not None and heads != self.num_rows:
                raise KVCacheError(f"daemon has {self.num_rows} rows but the model {heads} kv heads; "
                                   "head-wise tables need one row per kv head")
            ids = np.arange(self.num_rows)[rank_rows(self.num_rows, self.tp_size, rank)]
        #: This rank's rows of the daemon's tables: a slice where they are contiguous, else their indices.
        self.rows: slice | np.ndarray = (slice(int(ids[0]), int(ids[-1]) + 1)
                                         if (np.diff(ids) == 1).all() else ids)
        self.row_ids: tuple[int, ...] = tuple(ids.tolist())
        self.row_policies: list[dict[str, Any]] = [info["rows"][i] for i in self.row_ids]
        shape = self._table_shape(out, max_slots, max_blocks)
        self.max_slots, self.max_blocks = shape[0], shape[2]
        self.daemon_max_slots: int = info.get("max_slots", shape[0])
        self._out = _Output(out, shape)
        self._readonly = self._out.mirror.view()
        self._readonly.flags.writeable = False
        self._seq = -1
        self._epoch: int = info.get("epoch", 0)
        self._slot_of: dict[Any, int] = {}
        self._length: dict[Any, int] = {}
        self._owner: dict[int, Any] = {}
        self._dirty: set[int] = set()
        #: Called with each delta (a map) once applied: a host-tier agent takes the copies it orders.
        self.on_delta: Callable[[dict[str, Any]], None] | None = None
        self.replays = 0  # "D" replies applied after a gap
        self.snapshots = 0  # snapshots loaded
        self._pub_endpoint = _reachable(info["pub_endpoint"], endpoint)
        self._replay_endpoint = _reachable(info["replay_endpoint"], endpoint)
        _check_ipc(self._pub_endpoint, "pub_endpoint")  # before any socket: a refusal leaves none open
        _check_ipc(self._replay_endpoint, "replay_endpoint")
        self._sub: zmq.Socket | None = None
        self._local: socket.socket | None = None
        self._local_path: str | None = info.get("local_endpoint") if local else None
        self._local_address: str | None = None  # our socket file, where the local endpoint sends the deltas
        self._heard = time.monotonic()  # when the local endpoint last sent us something
        if self._local_path:
            self._local = self._subscribe_local(time.monotonic() + timeout)
        if self._local is None:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.SUBSCRIBE, DELTA_TOPIC)
            self._secure(self._sub, self._pub_endpoint)
            self._sub.connect(self._pub_endpoint)
        else:
            self._readable = select.poll()
            self._readable.register(self._local.fileno(), select.POLLIN)
        self._replay = self._connect_replay()
        try:
            # Subscribed first, so every delta after the start-up state arrives or shows up as a gap.
            self._resync(time.monotonic() + timeout, start=0)
            self._flush()
        except BaseException:
            self.close()
            raise

    def _table_shape(self, out: Any, max_slots: int | None, max_blocks: int | None) -> tuple[int, int, int]:
        rows = len(self.row_ids)
        if isinstance(out, str):
            shape = (1024 if max_slots is None else max_slots, rows, 4096 if max_blocks is None else max_blocks)
            if shape[0] < 1 or shape[2] < 1:
                raise KVCacheError(f"max_slots and max_blocks: must be at least 1, got {shape[0]} and {shape[2]}")
            return shape
        got = _shape_of(out)
        dtype = str(getattr(out, "dtype", ""))
        if len(got) != 3 or got[1] != rows:
            raise KVCacheError(f"out: shape {list(got)} is not [max_slots, {rows} rows of rank {self.rank}, "
                               "max_blocks]")
        if not dtype.endswith("int32"):
            raise KVCacheError(f"out: dtype {dtype} is not int32")
        for name, given, actual in (("max_slots", max_slots, got[0]), ("max_blocks", max_blocks, got[2])):
            if given is not None and given != actual:
                raise KVCacheError(f"{name}: {given} given but out has {actual}")
        return got[0], got[1], got[2]

    def _secure(self, sock: zmq.Socket, endpoint: str) -> None:
        """CURVE keys on tcp:// sockets when the daemon asks for them (``curve``)."""
        if self._curve is not None and endpoint.startswith("tcp://"):
            secure_client_socket(sock, self._curve)

    def _connect_replay(self) -> zmq.Socket:
        _check_ipc(self._replay_endpoint, "replay_endpoint")
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        self._secure(sock, self._replay_endpoint)
        sock.connect(self._replay_endpoint)
        return sock

    def close(self) -> None:
        """Close the sockets (linger 0; a local subscription is cancelled first); the tables stay readable."""
        if self._sub is not None:
            self._sub.close(0)
        if self._local is not None:
            try:
                self._local.send(LOCAL_UNSUBSCRIBE)
            except OSError:
                pass  # the daemon forgets an address it cannot reach anyway
            self._local.close()
            remove_socket_file(self._local_address)
        self._replay.close(0)

    @property
    def local(self) -> bool:
        """True when the deltas come as datagrams from the daemon's local endpoint, False when from its PUB."""
        return self._local is not None

    def _subscribe_local(self, deadline: float) -> socket.socket | None:
        """A datagram socket subscribed at the daemon's local endpoint, or None where that fails (use the PUB).

        The socket is bound beside the endpoint (``bind_beside``) and connected to it, so the kernel delivers
        it nothing from anyone else; the daemon's answer must carry the epoch ``info`` gave, or the path leads
        to another daemon. A daemon that refuses the address answers with an error, which sends us to the PUB.
        """
        check_socket_path(self._local_path, "local_endpoint")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        address = None
        try:
            address = bind_beside(sock, self._local_path)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            sock.connect(self._local_path)
            sock.send(LOCAL_SUBSCRIBE)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("no answer")
                sock.settimeout(remaining)
                first = sock.recv(LOCAL_MAX_BYTES + 1)
                if first[:1] == DELTA_TOPIC and len(first) >= DELTA_HEAD_BYTES:
                    break
                refusal = _error_of(first)
                if refusal is not None:
                    raise OSError(refusal)
            if int.from_bytes(first[1:9], "big") != self._epoch:
                raise OSError("another daemon answers there")
        except OSError as exc:  # another host's path, a daemon gone or another one: the PUB serves
            log.info("local endpoint %s not used for deltas (%s); taking the PUB", self._local_path, exc)
            sock.close()
            remove_socket_file(address)
            return None
        self._local_address = address
        sock.setblocking(False)
        return sock

    def _renew(self) -> None:
        """Subscribe again at the local endpoint (deltas stopped: the daemon may have restarted or dropped us)."""
        if self._local is None:
            return
        try:
            try:
                self._local.send(LOCAL_SUBSCRIBE)
            except OSError:  # the daemon we were connected to is gone: reach a new one on the same path
                check_socket_path(self._local_path, "local_endpoint")
                self._local.connect(self._local_path)
                self._local.send(LOCAL_SUBSCRIBE)
        except OSError:
            pass  # the replay socket's deadline reports a daemon that is gone

    def _wait_readable(self, timeout: float) -> bool:
        """Whether a delta is waiting, after waiting up to ``timeout`` seconds for one."""
        if self._local is None:
            return bool(self._sub.poll(_ms(timeout), zmq.POLLIN))
        return bool(self._readable.poll(_ms(timeout)))

    def _next_frames(self) -> list[bytes] | None:
        """The next delta's frames (topic+epoch, seq, payload) without waiting, or None."""
        if self._local is None:
            try:
                return self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return None
        try:
            data = self._local.recv(LOCAL_MAX_BYTES + 1)
        except OSError:  # nothing waiting, or the daemon went away: silence, which the renewals answer
            if time.monotonic() - self._heard > _RENEW_AFTER_S:  # a daemon restarted on the path knows us not
                self._renew()
                self._heard = time.monotonic()
            return None
        self._heard = time.monotonic()
        if data[:1] != DELTA_TOPIC and (refusal := _error_of(data)) is not None:  # a renewal the daemon refused
            log.warning("local endpoint %s: %s", self._local_path, refusal)
            return None
        return [data[:DELTA_HEAD_BYTES - 8], data[DELTA_HEAD_BYTES - 8:DELTA_HEAD_BYTES], data[DELTA_HEAD_BYTES:]]

    def __enter__(self) -> TableSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ state

    @property
    def seq(self) -> int:
        """The last delta applied (-1 before the daemon published any)."""
        return self._seq

    @property
    def tables(self) -> np.ndarray:
        """int32 ``[max_slots, rows, max_blocks]``, read-only; shares memory with ``tensor`` when ``zero_copy``."""
        return self._readonly

    @property
    def tensor(self) -> Any:
        """The tables as the ``out`` object: numpy array, paddle or torch tensor, or the caller's own."""
        return self._out.tensor

    @property
    def zero_copy(self) -> bool:
        """True when ``tensor`` and ``tables`` share memory; else changed slots are copied at each poll."""
        return self._out.zero_copy

    @property
    def requests(self) -> Mapping[Any, int]:
        """Live requests and their slots (a read-only live view)."""
        return types.MappingProxyType(self._slot_of)

    def slot_of(self, request_id: Any) -> int:
        return self._slot_of[self._live(request_id)]

    def num_blocks(self, request_id: Any) -> int:
        """Columns of the request's table (its logical blocks; recycled ones hold -1)."""
        return self._length[self._live(request_id)]

    def table(self, request_id: Any) -> np.ndarray:
        """The request's table for this rank's rows, int32 ``[rows, num_blocks]`` (a read-only view)."""
        req = self._live(request_id)
        return self._readonly[self._slot_of[req], :, : self._length[req]]

    def _live(self, request_id: Any) -> Any:
        if request_id not in self._slot_of:
            raise KVCacheError(f"request_id: {request_id!r} has no table at seq {self._seq}")
        return request_id

    # ------------------------------------------------------------------ receiving

    def poll(self, timeout: float = 0.0) -> int:
        """Apply every delta waiting, or wait up to ``timeout`` s for one; returns deltas applied (snapshot = 1)."""
        applied = 0
        try:
            applied = self._drain(None)
            if not applied and timeout > 0 and self._wait_readable(timeout):
                applied = self._drain(None)
        finally:
            self._flush()
        return applied

    def wait_for(self, seq: int, timeout: float | None = None, *, epoch: int | None = None) -> None:
        """Apply deltas until ``self.seq >= seq``; raises SyncTimeout after ``timeout`` s (default: the client's).

        Silence while ``seq`` is due means its delta was dropped (or the daemon
        is gone): the replay socket is asked, after 20 ms, then at doubling
        intervals, so a lost last delta never stalls the step. Pass the reply's
        ``epoch`` (``CacheClient.last_epoch``): tables of an earlier daemon
        incarnation are then dropped and reloaded rather than taken as current.
        """
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        quiet = _FIRST_NUDGE_S
        try:
            if epoch is not None and epoch != self._epoch:
                self._restart(epoch, deadline)
            while self._seq < seq:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SyncTimeout(f"tables at seq {self._seq}, step needs {seq}: no delta from "
                                      f"{self._local_path if self.local else self._pub_endpoint} within {timeout:g} s")
                if self._wait_readable(min(remaining, quiet)):
                    self._drain(seq, deadline)
                else:
                    self._renew()
                    self._resync(deadline)
                    quiet = min(2 * quiet, 1.0)
        finally:
            self._flush()

    def _drain(self, until: int | None, deadline: float | None = None) -> int:
        """Apply the deltas waiting on the SUB socket (stopping once ``until`` is reached)."""
        applied = 0
        for _ in range(_DRAIN_LIMIT):
            if until is not None and self._seq >= until:
                break
            frames = self._next_frames()
            if frames is None:
                break
            if len(frames) != 3 or len(frames[0]) != 9 or not frames[0].startswith(DELTA_TOPIC) or len(frames[1]) != 8:
                raise ProtocolError(f"delta: expected [topic+epoch, 8-byte seq, payload], got {len(frames)} frames")
            epoch = int.from_bytes(frames[0][1:], "big")
            if epoch != self._epoch:  # the daemon restarted: its seqs start over
                self._restart(epoch, deadline if deadline is not None else time.monotonic() + self.timeout)
                applied += 1
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if not frames[2]:  # a heartbeat: the latest seq; fetch what we lack
                if seq > self._seq:
                    applied += self._resync(deadline if deadline is not None else time.monotonic() + self.timeout)
                continue
            if seq <= self._seq:  # already applied (replay or snapshot got there first)
                continue
            if seq > self._seq + 1:
                applied += self._resync(deadline if deadline is not None else time.monotonic() + self.timeout)
                if seq <= self._seq:
                    continue
                if seq > self._seq + 1:
                    raise ProtocolError(f"delta: seq {seq} still follows {self._seq} after replay")
            self._apply(unpack(frames[2], _MAX_MESSAGE_BYTES))
            applied += 1
        return applied

    def _restart(self, epoch: int, deadline: float) -> None:
        """Drop every table of the old daemon and load the new one's state from its seq 0 or a snapshot."""
        self._out.mirror.fill(EMPTY)
        self._slot_of.clear()
        self._length.clear()
        self._owner.clear()
        self._dirty.update(range(self.max_slots))
        self._seq = -1
        self._epoch = epoch
        self._renew()
        self._resync(deadline, start=0)

    def _resync(self, deadline: float, start: int | None = None) -> int:
        """Ask the replay socket for every delta from ``start`` (default seq + 1); apply the deltas or snapshot."""
        start = self._seq + 1 if start is None else start
        try:  # a DEALER with no peer (a CURVE daemon refused us) would block in send: give it the deadline too
            self._replay.setsockopt(zmq.SNDTIMEO, max(1, _ms(deadline - time.monotonic())))
            self._replay.send(pack({"v": PROTOCOL_VERSION, "from": start}))
            answered = bool(self._replay.poll(_ms(deadline - time.monotonic()), zmq.POLLIN))
        except zmq.Again:
            answered = False
        if not answered:
            # A late reply must never be read as the answer to a later request: start a fresh socket.
            self._replay.close(0)
            self._replay = self._connect_replay()
            raise SyncTimeout(f"replay socket {self._replay_endpoint} did not answer (tables at seq {self._seq})")
        kind, *parts = self._replay.recv_multipart()
        if kind == b"E":
            raise ProtocolError(f"replay: daemon refused from={start}: {parts[0].decode(errors='replace')}")
        if kind == b"S":
            self._load(unpack(parts[0], _MAX_MESSAGE_BYTES))
            self.snapshots += 1
            return 1
        if kind != b"D":
            raise ProtocolError(f"replay: unknown reply kind {kind!r}")
        applied = 0
        for part in parts:
            msg = unpack(part, _MAX_MESSAGE_BYTES)
            seq = msg.get("seq") if isinstance(msg, dict) else None
            if isinstance(msg, dict) and msg.get("epoch", self._epoch) != self._epoch:
                self._restart(msg["epoch"], deadline)
                return applied + 1
            if not isinstance(seq, int) or seq <= self._seq:
                continue
            if seq != self._seq + 1:
                raise ProtocolError(f"replay: reply jumps from seq {self._seq} to {seq}")
            self._apply(msg)
            applied += 1
        if start > 0 and applied:
            self.replays += 1
        return applied

    # ------------------------------------------------------------------ applying

    def _apply(self, msg: Any) -> None:
        """Apply one delta, checked whole first so a delta that does not fit changes nothing.

        A delta lists a step's table changes in op order but its frees apart,
        so where they interleave is rebuilt per request: an admit (a change
        setting every column) follows a free unless it is the request's first
        event, hence a request ends live iff live before + admits - frees = 1,
        and only its changes from its last admit on matter. Frees apply
        before changes, so a slot freed and re-given in one step ends with
        its new owner.
        """
        if not isinstance(msg, dict) or not isinstance(msg.get("seq"), int):
            raise ProtocolError("delta: must be a map with an integer seq")
        seq, freed = msg["seq"], msg.get("freed") or []
        if not isinstance(freed, list):
            raise ProtocolError(f"delta {seq}: freed must be a list")
        for i, req in enumerate(freed):
            check_request_id(req, f"delta {seq} freed[{i}]")
        changes = self._parse(msg.get("changes"), f"delta {seq} changes")
        is_admit = (changes.sizes == np.array(changes.lens, dtype=np.int64)).tolist()
        events: dict[Any, list[int]] = {req: [] for req in freed}
        for i, req in enumerate(changes.reqs):
            events.setdefault(req, []).append(i)
        frees = collections.Counter(freed)
        keep = [True] * len(changes.reqs)
        release = []
        for req, indices in events.items():
            admits = [i for i in indices if is_admit[i]]
            live = (req in self._slot_of) + len(admits) - frees[req] > 0
            if not live or admits:  # ends freed, or (re-)admitted: its old placement goes
                release.append(req)
                for i in indices:
                    keep[i] = live and i >= admits[-1]
        survivors = [i for i, kept in enumerate(keep) if kept]
        gone = set(release)
        claimed: dict[int, Any] = {}  # slots this delta gives out that no request kept from before holds
        for i in survivors:
            req, slot = changes.reqs[i], changes.slots[i]
            holder = self._owner.get(slot)
            if holder is None or holder in gone:
                holder = claimed.setdefault(slot, req)
            if holder != req:
                raise ProtocolError(f"delta {seq}: slot {slot} goes to {req!r} but {holder!r} holds it")
            self._check_fits(req, slot, changes.lens[i])
        for req in release:
            self._release(req)
        for i in survivors:
            self._place(changes.reqs[i], changes.slots[i], changes.lens[i])
        self._write(changes, survivors)
        self._seq = seq
        if self.on_delta is not None:
            self.on_delta(msg)

    def _write(self, changes: _Changes, survivors: list[int]) -> None:
        """Set the surviving changes' columns: one scatter when each request has one, else one by one in op order."""
        mirror = self._out.mirror
        if len(survivors) == len(changes.reqs) and len(set(changes.reqs)) == len(survivors):
            if survivors:  # (slot, column) pairs are distinct, so the scatter has no write order to keep
                slots = np.repeat(np.array(changes.slots, dtype=np.int64), changes.sizes)
                mirror[slots, :, changes.cols] = changes.vals[self.rows].T
            return
        offsets = changes.offsets
        for i in survivors:  # a later change of a request overwrites an earlier one's columns
            a, b = offsets[i], offsets[i + 1]
            mirror[changes.slots[i]][:, changes.cols[a:b]] = changes.vals[self.rows, a:b]

    def _parse(self, block: Any, field: str) -> _Changes:
        """A delta's changes block, checked for shapes and types (whether each fits is checked apart)."""
        if not isinstance(block, dict):
            raise ProtocolError(f"{field}: must be a map")
        reqs = block.get("reqs")
        if not isinstance(reqs, list):
            raise ProtocolError(f"{field}.reqs: must be a list of request ids")
        for i, req in enumerate(reqs):
            check_request_id(req, f"{field}.reqs[{i}]")
        m = len(reqs)
        slots, lens, offsets, cols = (_int_array(block.get(name), f"{field}.{name}", size)
                                      for name, size in (("slots", m), ("lens", m), ("offsets", m + 1), ("cols", None)))
        vals = block.get("vals")
        if not (isinstance(vals, np.ndarray) and vals.dtype.kind in "iu" and vals.shape == (self.num_rows, cols.size)):
            raise ProtocolError(f"{field}.vals: must be an integer array [{self.num_rows}, {cols.size}]")
        if m and (int(slots.min()) < 0 or int(lens.min()) < 0):
            raise ProtocolError(f"{field}: slots and lens must not be negative")
        sizes = offsets[1:] - offsets[:-1]
        if offsets[0] != 0 or offsets[-1] != cols.size or (m and int(sizes.min()) < 0):
            raise ProtocolError(f"{field}.offsets: must rise from 0 to the {cols.size} columns")
        if cols.size and (int(cols.min()) < 0 or (cols >= np.repeat(lens, sizes)).any()):
            raise ProtocolError(f"{field}.cols: columns outside their tables")
        return _Changes(reqs, slots.tolist(), lens.tolist(), offsets.tolist(), sizes, cols, vals)

    def _check_fits(self, req: Any, slot: int, length: int) -> None:
        if slot >= self.max_slots:
            raise TableCapacityError(f"request {req!r} is in slot {slot}, but the tables hold max_slots="
                                     f"{self.max_slots} (the daemon hands out up to {self.daemon_max_slots}: "
                                     "start it with --max-slots, or size the tables larger)")
        if length > self.max_blocks:
            raise TableCapacityError(f"request {req!r} needs {length} blocks, but the tables hold "
                                     f"max_blocks={self.max_blocks}")

    def _place(self, req: Any, slot: int, length: int) -> None:
        """Put ``req`` at ``slot`` with ``length`` columns; a slot nobody holds is all -1, so a new one starts empty."""
        if self._slot_of.get(req) != slot:
            self._release(req)
            self._slot_of[req], self._owner[slot] = slot, req
        self._length[req] = length
        self._dirty.add(slot)

    def _release(self, req: Any) -> None:
        slot = self._slot_of.pop(req, None)
        if slot is None:
            return
        del self._owner[slot], self._length[req]
        self._out.mirror[slot] = EMPTY
        self._dirty.add(slot)

    def _load(self, snap: Any) -> None:
        """Replace every table with a snapshot's (checked whole first)."""
        if not isinstance(snap, dict) or not isinstance(snap.get("seq"), int) or not isinstance(
                snap.get("tables"), list):
            raise ProtocolError("snapshot: must be a map with seq and tables")
        entries = []
        for i, entry in enumerate(snap["tables"]):
            table = entry.get("table") if isinstance(entry, dict) else None
            slot = entry.get("slot") if isinstance(entry, dict) else None
            if not (isinstance(table, np.ndarray) and table.ndim == 2 and table.shape[0] == self.num_rows
                    and isinstance(slot, int) and slot >= 0):
                raise ProtocolError(f"snapshot tables[{i}]: needs a slot and a [{self.num_rows}, n] table")
            req = check_request_id(entry.get("req"), f"snapshot tables[{i}].req")
            self._check_fits(req, slot, table.shape[1])
            entries.append((req, slot, table))
        self._out.mirror.fill(EMPTY)
        self._slot_of.clear()
        self._length.clear()
        self._owner.clear()
        for req, slot, table in entries:
            self._slot_of[req], self._owner[slot], self._length[req] = slot, req, table.shape[1]
            self._out.mirror[slot, :, : table.shape[1]] = table[self.rows]
        self._dirty.update(range(self.max_slots))
        self._seq = snap["seq"]
        self._epoch = snap.get("epoch", self._epoch)

    def _flush(self) -> None:
        """Copy changed slots into a tensor that does not share the mirror's memory."""
        if self._dirty:
            if len(self._dirty) == self.max_slots:
                self._out.write_all()
            else:
                self._out.write(self._dirty)
            self._dirty.clear()

"""`kvcache bench daemon`: a real `kvcache serve` against raw ZMQ on the same transport, in one run.

One transport per run (ipc:// by default, ``--transport tcp`` for 127.0.0.1 on free ports):
  1. limit: a DEALER/ROUTER echo server in its own process (pyzmq only, no kvcache code): round
     trips at the byte sizes of a real step's request and reply (read off a real step first),
     and pipelined small-message throughput with a window of outstanding requests;
  2. step round trip: a daemon holding 256 decoding requests with 2,048-token prompts (block 16,
     uniform rows, prefix caching on, unique prompts so every admit hashes and, once the pool is
     full, evicts); each step is one ``client.batch()``: 2 frees of the oldest requests, 256
     one-token extends (one extend_many on the wire), 2 admits of fresh prompts. The peer is vLLM's
     own scheduler step on the same workload in this process (kvcache.bench.vllm, where ``vllm`` is
     importable): its p50 over the daemon's is the target. Echo round trips, steps and vLLM's steps
     take turns in rounds, so a slow spell of the machine falls on all. Two floors go
     with them: the codec floor (the echo server decoding the step and encoding its reply, the
     client the reverse) and the native floor (the codec floor plus the daemon's C work in a step,
     from section 5): a step with no Python on either side would take at least that; 2c: the same steps
     on two more daemons, one serving head-wise rows (6 x a 1,024-token window with a 64-token sink, 2 full),
     one two layer-group rows (a window, a full), taking turns with the uniform daemon's: p50 over uniform;
  3. throughput: extends per second through the daemon, from client processes in parallel,
     through ``CacheClient.batch()`` (what a scheduler pays per request), ``CacheClient.extend_many``
     (ids, tokens and counts as arrays) and as pre-packed extend_many messages (the daemon's own
     limit: the client does next to nothing);
  3b. journal on/off: two fresh daemons started alike but for ``--journal`` (a folder in the run's /tmp
     folder, removed afterwards) run the step workload and every row of section 3 in turns (step rounds
     alternate which goes first, each row runs in halves A B B A; a row's clients hold only the requests
     they extend): extends/s and p50 of each, on/off (target >= 0.75 in every row: the journal costs at
     most 25% of throughput), and the disk's floor, a 4 KiB write + fdatasync into a preallocated file there;
  4. delta lag: raw subscribers in separate processes record, per delta, receive time minus the
     delta's publish time ``t`` (both CLOCK_MONOTONIC, system-wide on Linux; ``t`` is written as
     the delta is sent and read at its fixed offset, undecoded) while steps run, and check that
     every seq arrived: SUB sockets on the PUB, then datagram sockets subscribed at the local
     endpoint, taking turns twice;
  5. profile: the step workload through ``CacheServer.handle`` in this process on pre-packed
     messages, timed plain (also on a daemon publishing KV events, ``--events``), with the time in
     this package's C extensions counted per step (timers wrapped around their functions), and then
     under cProfile, its time split along the call tree (decode, validate, apply, pack, publish,
     bookkeeping).
Every process started is stopped on the way out (errors and Ctrl-C included) and every wait has a
deadline. The exit code is 0 whatever the numbers: a benchmark reports, it does not fail.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import dataclasses
import json
import os
import platform
import pstats
import select
import shutil
import socket
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import numpy as np
import zmq

from kvcache.allocator.errors import KVCacheError
from kvcache.bench import vllm
from kvcache.arguments import positive_int
from kvcache.bench.common import Fleet, expect, mark, progress, ratio, table
from kvcache.client import CacheClient, DaemonError
from kvcache.config import ServeConfig
from kvcache.journal import records_end
from kvcache.paths import bind_beside, remove_socket_file
from kvcache.protocol import (
    DELTA_HEAD_BYTES,
    DELTA_T_OFFSET,
    LOCAL_MAX_BYTES,
    LOCAL_SUBSCRIBE,
    LOCAL_UNSUBSCRIBE,
    MAX_OPS,
    PROTOCOL_VERSION,
    pack,
    unpack,
)

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from collections.abc import Iterator

VOCAB = 150_000
DECODE_TOKENS = 1
SETUP_ADMITS_PER_MESSAGE = 16
THROUGHPUT_PROMPT_TOKENS = 16  # and up to 15 more: one or two blocks, so admitting thousands is quick
RENEW_OPS_PER_MESSAGE = 1024
SMALL_MESSAGE_BYTES = 64
WARMUP_STEPS = 20
CHILD_GRACE_S = 5.0  # a child's own deadline (the client timeout) passes first, so its error is the one shown
PIPELINE_DEPTH = 8  # messages in flight per client on the "pipelined" throughput path
OK_MARK = b"\xa2ok\xc3"  # msgpack "ok": true, within a reply's first bytes
READY = b"kvcache serve: ready"

# Targets.
VLLM_STEP_TARGET = 3.0  # vLLM's in-process step p50 over the daemon's step round trip p50
EXTENDS_PER_S_TARGET = 500_000
LAG_P99_TARGET_US = 1000.0
JOURNAL_RATIO_TARGET = 0.75  # extends/s with --journal over without: the journal costs at most 25%
ROWS_TARGET = 1.5  # a head-wise or layer-group daemon's step p50 over the uniform daemon's, in the same turns
ROW_MODES = (("head-wise 8", "window:1024:64*6,full*2"), ("layer groups", "window:1024,full"))  # section 2c

FSYNC_PROBE_BYTES = 4096
FSYNC_PROBE_WARMUP = 10


@dataclasses.dataclass(frozen=True, slots=True)
class BenchConfig:
    """One run's sizes and counts; ``quick_defaults()`` holds the small ones tests use."""

    transport: str = "ipc"
    requests: int = 256
    prompt_tokens: int = 2048
    admits: int = 2  # per step, and as many frees
    block_size: int = 16
    num_blocks: int = 1_048_576  # a 1 s row at 4M extends/s grows the tables by about 250,000 blocks
    steps: int = 1000
    rounds: int = 10  # echo and steps take turns this many times
    seconds: float = 1.0  # per throughput row, and for pipelined echo
    batches: tuple[int, ...] = (256, 4096)
    clients: tuple[int, ...] = (1, 2, 4)
    window: int = 64
    subscribers: int = 8
    io_threads: int = 1  # the daemons' --io-threads
    lag_steps: int = 500
    profile_steps: int = 300
    fsync_probes: int = 500  # 4 KiB appends + fdatasync timed in section 3b
    timeout: float = 30.0
    quick: bool = False

    @staticmethod
    def quick_defaults() -> dict[str, Any]:
        return {"steps": 120, "rounds": 3, "seconds": 0.2, "clients": (1, 2), "lag_steps": 100,
                "profile_steps": 60, "fsync_probes": 100, "quick": True}


# --------------------------------------------------------------------------- processes


class _Endpoints(NamedTuple):
    """Where the echo server and the daemon listen, all on the run's transport."""

    echo: str
    daemon: str
    pub: str
    replay: str
    echo_local: str | None  # the echo's Unix datagram socket, beside the daemon's local endpoint (ipc only)


def _free_tcp_ports(count: int) -> list[int]:
    """Ports of 127.0.0.1 free right now (held open together, so they differ)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _endpoints(transport: str, folder: Path) -> _Endpoints:
    if transport == "ipc":
        return _Endpoints(*(f"ipc://{folder}/{name}.sock" for name in ("echo", "d", "d-pub", "d-replay")),
                          str(folder / "echo-local.sock"))
    return _Endpoints(*(f"tcp://127.0.0.1:{port}" for port in _free_tcp_ports(4)), None)


# --------------------------------------------------------------------------- 1. raw zmq echo


_SERVER_MAX_ITEMS = max(MAX_OPS, ServeConfig().max_tokens)  # what the daemon's protocol.unpack allows


def _echo_server(conn: Connection, endpoint: str, local_path: str | None) -> None:
    """ROUTER echo: a request whose first 4 bytes (LE) say N gets N zero bytes back; N = 0 echoes it.

    The codec floor, in two frames: ``[b"R", reply]`` keeps a step's reply (decoded once); ``[b"C",
    request]`` is answered with that reply after the request is decoded and the reply encoded, as the
    daemon's protocol does both (``protocol.unpack`` / ``pack``), and nothing else. With ``local_path``
    it echoes datagrams there the same way (the limit of steps over the daemon's local endpoint).
    """
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    local = None
    if local_path is not None:
        local = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        local.bind(local_path)
        local.setblocking(False)
        poller.register(local.fileno(), zmq.POLLIN)
    conn.send(("ready",))
    replies: dict[int, bytes] = {}
    decoded_reply: Any = None
    try:
        while True:
            if not poller.poll(100):
                if conn.poll(0):  # checked only when idle, so it adds nothing to a round trip
                    return
                continue
            while local is not None:
                try:
                    payload, address = local.recvfrom(LOCAL_MAX_BYTES)
                except BlockingIOError:
                    break
                size = int.from_bytes(payload[:4], "little")
                local.sendto(payload if size == 0 else replies.get(size) or replies.setdefault(size, bytes(size)),
                             address)
            for _ in range(1024):
                try:
                    ident, *frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) == 2:  # the codec floor
                    kind, payload = frames
                    if kind == b"R":
                        decoded_reply = unpack(payload, 1 << 31)
                        sock.send_multipart([ident, b"ok"])
                    else:
                        unpack(payload, 1 << 31, _SERVER_MAX_ITEMS)
                        sock.send_multipart([ident, pack(decoded_reply)])
                    continue
                payload = frames[0]
                size = int.from_bytes(payload[:4], "little")
                reply = payload if size == 0 else replies.get(size) or replies.setdefault(size, bytes(size))
                sock.send_multipart([ident, reply])
    finally:
        sock.close(0)
        ctx.term()
        if local is not None:
            local.close()


class _EchoClient:
    """The scheduler's side of the echo: round trips of given sizes, and a pipelined flood."""

    def __init__(self, ctx: zmq.Context, endpoint: str, timeout: float) -> None:
        self.timeout = timeout
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def close(self) -> None:
        self.sock.close(0)

    def _recv(self) -> bytes:
        if not self.sock.poll(int(self.timeout * 1000)):
            raise KVCacheError(f"echo server: no reply within {self.timeout:g} s")
        return self.sock.recv()

    def round_trips(self, request_bytes: int, reply_bytes: int, count: int) -> np.ndarray:
        """ns of each of ``count`` round trips: ``request_bytes`` out, ``reply_bytes`` back."""
        return _round_trips(self.sock.send, self._recv, request_bytes, reply_bytes, count)

    def keep_reply(self, reply: bytes) -> None:
        """Give the server the step reply that codec round trips get back."""
        self.sock.send_multipart([b"R", reply])
        self._recv()

    def codec_round_trips(self, request: bytes, count: int) -> np.ndarray:
        """ns of each of ``count`` codec round trips: the step encoded here, decoded there, its reply likewise."""
        message = unpack(request, 1 << 31, _SERVER_MAX_ITEMS)
        out = np.empty(count, dtype=np.int64)
        for i in range(count):
            t0 = time.perf_counter_ns()
            self.sock.send_multipart([b"C", pack(message)])
            unpack(self._recv(), 1 << 31)
            out[i] = time.perf_counter_ns() - t0
        return out

    def pipelined(self, window: int, size: int, seconds: float) -> tuple[int, float]:
        """Messages answered and seconds taken, keeping ``window`` requests in flight for ``seconds``."""
        payload = bytes(max(size, 4))  # size 0 in the header: the server echoes it
        t0 = time.perf_counter()
        end = t0 + seconds
        for _ in range(window):
            self.sock.send(payload)
        answered, in_flight = 0, window
        while in_flight:
            self._recv()
            answered += 1
            in_flight -= 1
            if time.perf_counter() < end:
                self.sock.send(payload)
                in_flight += 1
        return answered, time.perf_counter() - t0


class _LocalEchoClient:
    """Round trips to the echo server's datagram socket: the local endpoint's transport, nothing else."""

    def __init__(self, path: str, timeout: float) -> None:
        self.timeout = timeout
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("")
        self.sock.connect(path)
        self.sock.settimeout(timeout)

    def close(self) -> None:
        self.sock.close()

    def _recv(self) -> bytes:
        try:
            return self.sock.recv(LOCAL_MAX_BYTES)
        except TimeoutError:
            raise KVCacheError(f"echo server: no datagram reply within {self.timeout:g} s") from None

    def round_trips(self, request_bytes: int, reply_bytes: int, count: int) -> np.ndarray:
        """ns of each of ``count`` round trips: ``request_bytes`` out, ``reply_bytes`` back."""
        return _round_trips(self.sock.send, self._recv, request_bytes, reply_bytes, count)


def _round_trips(send: Callable[[bytes], Any], recv: Callable[[], bytes], request_bytes: int, reply_bytes: int,
                 count: int) -> np.ndarray:
    """ns of each of ``count`` echo round trips: ``request_bytes`` out, whose header asks ``reply_bytes`` back."""
    payload = max(reply_bytes, 1).to_bytes(4, "little") + bytes(max(request_bytes - 4, 0))
    out = np.empty(count, dtype=np.int64)
    for i in range(count):
        t0 = time.perf_counter_ns()
        send(payload)
        recv()
        out[i] = time.perf_counter_ns() - t0
    return out


# --------------------------------------------------------------------------- 2. the step workload


class _StepInput(NamedTuple):
    """What one step sends, made before its clock starts: a decode token per request and fresh prompts."""

    decode: list[np.ndarray]
    prompts: list[np.ndarray]


class _Scheduler:
    """The step workload over one CacheClient: a steady set of ``requests`` decoding requests.

    A step in a scheduler's order: free the ``admits`` oldest requests (they
    finished last step, so this step does not extend them), extend each of the
    ``requests`` running ones by a token, admit as many fresh prompts (unique
    tokens: no prefix hits; they decode from the next step on). So ``requests
    + admits`` are live between steps.

        live before a step   | finished (admits) | running (requests) ...        |
        the step's ops       | free, free        | extend × requests | admit, admit
    """

    def __init__(self, client: CacheClient, cfg: BenchConfig, seed: int = 0, first_id: int = 0) -> None:
        self.client = client
        self.cfg = cfg
        self.rng = np.random.default_rng(seed)
        self.live: collections.deque[int] = collections.deque()
        self._next_id = first_id

    def _prompt(self) -> np.ndarray:
        return self.rng.integers(0, VOCAB, size=self.cfg.prompt_tokens, dtype=np.int32)

    def setup(self) -> None:
        """Admit the steady set (and the first step's finishing requests), a few prompts per message."""
        total = self.cfg.requests + self.cfg.admits
        while len(self.live) < total:
            batch = self.client.batch()
            ids = list(range(self._next_id, self._next_id + min(SETUP_ADMITS_PER_MESSAGE, total - len(self.live))))
            for rid in ids:
                batch.admit(rid, self._prompt())
            _check(batch.send(), "setup admit")
            self._next_id += len(ids)
            self.live.extend(ids)

    def inputs(self, count: int) -> list[_StepInput]:
        tokens = self.rng.integers(0, VOCAB, size=(count, self.cfg.requests, DECODE_TOKENS), dtype=np.int32)
        return [_StepInput(list(tokens[i]), [self._prompt() for _ in range(self.cfg.admits)]) for i in range(count)]

    def step(self, inp: _StepInput) -> list[Any]:
        """One round trip: free the oldest, extend the running requests, admit fresh prompts.

        Returns the extends' and admits' results (a free's result is always None).
        """
        batch = self.client.batch()
        for _ in inp.prompts:
            batch.free(self.live.popleft())
        for rid, tokens in zip(self.live, inp.decode):
            batch.extend(rid, tokens)
        for prompt in inp.prompts:
            batch.admit(self._next_id, prompt)
            self.live.append(self._next_id)
            self._next_id += 1
        return batch.send()[len(inp.prompts):]

    def run(self, count: int) -> np.ndarray:
        """ns of each of ``count`` steps (inputs made beforehand, results checked afterwards)."""
        out = np.empty(count, dtype=np.int64)
        for i, inp in enumerate(self.inputs(count)):
            t0 = time.perf_counter_ns()
            results = self.step(inp)
            out[i] = time.perf_counter_ns() - t0
            _check(results, "step")
        return out


def _check(results: list[Any], what: str) -> None:
    """Every op applied: no DaemonError, no None (no room would mean --num-blocks is too small)."""
    for r in results:
        if isinstance(r, DaemonError):
            raise KVCacheError(f"{what}: the daemon refused an op: {r}")
        if r is None:
            raise KVCacheError(f"{what}: the daemon had no room (raise --num-blocks)")


class _StepCapture:
    """Stands in for a client's socket for one step, remembering the request and the reply."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.sent = self.received = b""

    def send(self, data: bytes, *args: Any, **kwargs: Any) -> Any:
        self.sent = bytes(data)
        return self.sock.send(data, *args, **kwargs)

    def recv(self, *args: Any, **kwargs: Any) -> bytes:
        data = self.sock.recv(*args, **kwargs)
        self.received = bytes(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def _capture_step(sched: _Scheduler) -> tuple[bytes, bytes]:
    """A real step's request and reply, read off the client's socket."""
    client = sched.client
    probe = _StepCapture(client._sock)
    client._sock = probe  # type: ignore[assignment]
    try:
        _check(sched.step(sched.inputs(1)[0]), "step")
    finally:
        if client._sock is probe:
            client._sock = probe.sock
    return probe.sent, probe.received


def _percentiles_us(ns: np.ndarray) -> tuple[float, float]:
    p50, p99 = np.percentile(ns, [50, 99])
    return float(p50) / 1e3, float(p99) / 1e3


def _warmup_steps(cfg: BenchConfig) -> int:
    """Steps until every request admitted at set-up was replaced: the steady state.

    The set-up's requests all hold 2,048 tokens, so they cross block boundaries
    (an extend's slow path: allocate, hash) in the same step, every 16 steps;
    requests admitted a step apart are spread evenly, as in a running server.
    """
    return max(WARMUP_STEPS, -(-cfg.requests // cfg.admits) + 1)


def bench_local_steps(cfg: BenchConfig, echo: _LocalEchoClient, sched: _Scheduler, zmq_echo_p50_us: float
                      ) -> dict[str, Any]:
    """Section 2b: the same steps from a client using the daemon's local endpoint, taking turns with a datagram echo."""
    request, reply = _steady_step(cfg, sched)
    echo.round_trips(len(request), len(reply), WARMUP_STEPS)
    echo_all, steps_all = _in_turns(cfg, lambda n: echo.round_trips(len(request), len(reply), n), sched.run)
    e50, e99 = _percentiles_us(echo_all)
    s50, s99 = _percentiles_us(steps_all)
    return {"steps": int(steps_all.size), "echo_p50_us": e50, "echo_p99_us": e99, "p50_us": s50,
            "p99_us": s99, "p50_over_local_echo_p50": s50 / e50, "p50_over_zmq_echo_p50": s50 / zmq_echo_p50_us}


def _steady_step(cfg: BenchConfig, sched: _Scheduler) -> tuple[bytes, bytes]:
    """Set the scheduler's requests up, step to the steady state, and capture one step's request and reply."""
    sched.setup()
    sched.run(_warmup_steps(cfg))
    return _capture_step(sched)


def _in_turns(cfg: BenchConfig, *measures: Callable[[int], np.ndarray]) -> list[np.ndarray]:
    """Each measure's ns over ``cfg.steps``, in ``cfg.rounds`` rounds where the measures take turns (noise hits all)."""
    per_round = max(1, cfg.steps // cfg.rounds)
    runs: list[list[np.ndarray]] = [[] for _ in measures]
    for _ in range(cfg.rounds):
        for out, measure in zip(runs, measures):
            out.append(measure(per_round))
    return [np.concatenate(r) for r in runs]


class _VllmSteps:
    """vLLM's own scheduler step on the same workload, in this process (kvcache.bench.vllm): the peer of section 2."""

    def __init__(self, cfg: BenchConfig) -> None:
        self.rng = np.random.default_rng(3)
        self.cfg = cfg
        self.step = vllm.SchedulerStep(cfg.requests, cfg.prompt_tokens, cfg.admits, cfg.block_size,
                                       cfg.num_blocks + 1)  # + vLLM's null block: the same usable blocks
        self.step.setup(self.rng)
        self.run(_warmup_steps(cfg))

    def run(self, count: int) -> np.ndarray:
        """ns of each of ``count`` steps (their inputs made before the clock starts)."""
        cfg = self.cfg
        return self.step.run(vllm.step_inputs(self.rng, count, cfg.requests, cfg.admits, cfg.prompt_tokens, VOCAB))


def bench_echo_and_steps(cfg: BenchConfig, echo: _EchoClient, sched: _Scheduler) -> tuple[dict, dict]:
    """Sections 1 and 2: echo at a real step's sizes, the steps themselves and vLLM's in-process step, in turns."""
    request, reply = _steady_step(cfg, sched)
    request_bytes, reply_bytes = len(request), len(reply)
    echo.round_trips(request_bytes, reply_bytes, WARMUP_STEPS)
    echo.keep_reply(reply)
    echo.codec_round_trips(request, WARMUP_STEPS)
    measures = [lambda n: echo.round_trips(request_bytes, reply_bytes, n),
                lambda n: echo.codec_round_trips(request, n), sched.run]
    peer_version = vllm.version()
    if peer_version is not None:
        progress(f"2. vLLM {peer_version}'s step in this process: setting up {cfg.num_blocks:,} blocks")
        measures.append(_VllmSteps(cfg).run)
    echo_all, codec_all, steps_all, *peer_all = _in_turns(cfg, *measures)
    c50, c99 = _percentiles_us(codec_all)
    answered, seconds = echo.pipelined(cfg.window, SMALL_MESSAGE_BYTES, cfg.seconds)
    e50, e99 = _percentiles_us(echo_all)
    s50, s99 = _percentiles_us(steps_all)
    v50, v99 = _percentiles_us(peer_all[0]) if peer_all else (None, None)
    echo_out = {
        "request_bytes": request_bytes,
        "reply_bytes": reply_bytes,
        "round_trips": int(echo_all.size),
        "p50_us": e50,
        "p99_us": e99,
        "pipelined": {"window": cfg.window, "message_bytes": SMALL_MESSAGE_BYTES, "messages": answered,
                      "seconds": seconds, "messages_per_s": answered / seconds},
    }
    peer_ratio = None if v50 is None else v50 / s50
    step_out = {
        "requests": cfg.requests,
        "extends_per_step": cfg.requests,
        "admits_per_step": cfg.admits,
        "frees_per_step": cfg.admits,
        "prompt_tokens": cfg.prompt_tokens,
        "steps": int(steps_all.size),
        "p50_us": s50,
        "p99_us": s99,
        "mean_us": float(steps_all.mean()) / 1e3,
        "echo_p50_us": e50,
        "codec_p50_us": c50,
        "codec_p99_us": c99,
        "codec_over_echo_p50": c50 / e50,
        "p50_over_echo_p50": s50 / e50,
        "p99_over_echo_p99": s99 / e99,
        "extends_per_s": cfg.requests / (float(steps_all.mean()) / 1e9),
        "vllm": peer_version,
        "vllm_p50_us": v50,
        "vllm_p99_us": v99,
        "vllm_over_p50": peer_ratio,
        "target": f"vllm in-process p50 >= {VLLM_STEP_TARGET:g}x daemon p50",
        "ok": None if peer_ratio is None else peer_ratio >= VLLM_STEP_TARGET,
    }
    return echo_out, step_out


def bench_rows_steps(cfg: BenchConfig, fleet: Fleet, ctx: zmq.Context, sched: _Scheduler) -> list[dict[str, Any]]:
    """Section 2c: the step workload on daemons serving head-wise rows (6 with a 1,024-token window and a 64-token
    sink, 2 full) and layer-group rows (a window row, a full row), taking turns with the uniform daemon's steps;
    each one's p50 over the uniform one's. The daemons are stopped before it returns."""
    daemons, clients, scheds = [], [], []
    try:
        for k, (mode, rows) in enumerate(ROW_MODES):
            endpoint, pub, replay = _daemon_endpoints(cfg.transport, fleet.folder, f"rows{k}")
            daemons.append(fleet.start(_serve_argv(cfg, endpoint, pub, replay, "--rows", rows), READY, cfg.timeout,
                                       f"kvcache serve --rows {rows}"))
            clients.append(CacheClient(endpoint, timeout=cfg.timeout, name=f"bench-rows-{k}", context=ctx))
            scheds.append(_Scheduler(clients[-1], cfg, seed=10 + k))
            scheds[-1].setup()
            scheds[-1].run(_warmup_steps(cfg))
        uniform, *others = _in_turns(cfg, sched.run, *(s.run for s in scheds))
    finally:
        for client in clients:
            client.close()
        for daemon in daemons:
            fleet.terminate(daemon)
    u50, _ = _percentiles_us(uniform)
    out = []
    for (mode, rows), steps in zip(ROW_MODES, others):
        p50, p99 = _percentiles_us(steps)
        out.append({"mode": mode, "rows": rows, "steps": int(steps.size), "p50_us": p50, "p99_us": p99,
                    "uniform_p50_us": u50, "over_uniform": p50 / u50,
                    "target": f"p50 <= {ROWS_TARGET:g}x uniform", "ok": p50 / u50 <= ROWS_TARGET})
    return out


# --------------------------------------------------------------------------- 3. throughput


def _extend_client(conn: Connection, endpoint: str, index: int, timeout: float) -> None:
    """A client process: on "renew" holds a fresh set of requests, on "run" extends them for a while."""
    ctx = zmq.Context()
    client = CacheClient(endpoint, timeout=timeout, name=f"bench-extend-{index}-{os.getpid()}", context=ctx)
    rng = np.random.default_rng(index)
    ids: list[int] = []
    generation = 0
    runs = 0
    try:
        conn.send(("ready",))
        while True:
            if not conn.poll(1.0):
                continue
            cmd = conn.recv()
            if cmd[0] == "stop":
                return
            if cmd[0] == "renew":
                generation += 1
                fresh = [(index + 1) * 10**12 + generation * 10**6 + i for i in range(cmd[1])]
                ops: list[tuple[str, int]] = [("free", r) for r in ids] + [("admit", r) for r in fresh]
                for start in range(0, len(ops), RENEW_OPS_PER_MESSAGE):
                    batch = client.batch()
                    for kind, rid in ops[start:start + RENEW_OPS_PER_MESSAGE]:
                        if kind == "free":
                            batch.free(rid)
                        else:  # lengths spread over a block, as in a running server: a message's extends
                            # cross block boundaries (the slow path) evenly, not all at once every 16 messages
                            size = THROUGHPUT_PROMPT_TOKENS + rid % THROUGHPUT_PROMPT_TOKENS
                            batch.admit(rid, rng.integers(0, VOCAB, size, dtype=np.int32))
                    results = batch.send()
                    _check([r for (kind, _), r in zip(ops[start:start + RENEW_OPS_PER_MESSAGE], results)
                            if kind == "admit"], "renew")
                ids = fresh
                conn.send(("renewed",))
            elif cmd[0] == "run":
                _, path, size, t_start, t_end = cmd
                runs += 1
                if path == "client":
                    out = _run_client_path(client, ids[:size], t_start, t_end)
                elif path == "arrays":
                    out = _run_arrays_path(client, ids[:size], t_start, t_end)
                else:
                    out = _run_wire_path(ctx, endpoint, f"{client.name}-wire-{runs}", ids[:size], t_start, t_end,
                                         timeout, PIPELINE_DEPTH if path == "pipelined" else 1)
                conn.send(("ran", out))
    finally:
        client.close()
        ctx.destroy(0)


def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _run_client_path(client: CacheClient, ids: list[int], t_start: float, t_end: float) -> dict[str, Any]:
    """Batches of one-token extends through CacheClient.batch() until ``t_end`` (at least one: a client that starts
    late on a loaded machine still measures something)."""
    tokens = list(np.ones((len(ids), 1), dtype=np.int32))
    lat, no_room = [], 0
    _sleep_until(t_start)
    while not lat or time.monotonic() < t_end:
        t0 = time.perf_counter_ns()
        batch = client.batch()
        for rid, tok in zip(ids, tokens):
            batch.extend(rid, tok)
        results = batch.send()
        lat.append(time.perf_counter_ns() - t0)
        no_room += sum(r is None for r in results)
        _check([r for r in results if r is not None], "extend")
    return {"messages": len(lat), "extends": len(lat) * len(ids), "end": time.monotonic(),
            "p50_us": float(np.median(lat)) / 1e3 if lat else 0.0, "no_room": no_room}


def _run_arrays_path(client: CacheClient, ids: list[int], t_start: float, t_end: float) -> dict[str, Any]:
    """One-token extends through CacheClient.extend_many (ids, tokens and counts as arrays) until ``t_end`` (at
    least one)."""
    rids, tokens, counts = np.array(ids, dtype=np.int64), np.ones(len(ids), np.int32), np.ones(len(ids), np.int32)
    lat, no_room = [], 0
    _sleep_until(t_start)
    while not lat or time.monotonic() < t_end:
        t0 = time.perf_counter_ns()
        results = client.extend_many(rids, tokens, counts)
        lat.append(time.perf_counter_ns() - t0)
        no_room += sum(r is None for r in results)
        _check([r for r in results if r is not None], "extend_many")
    return {"messages": len(lat), "extends": len(lat) * len(ids), "end": time.monotonic(),
            "p50_us": float(np.median(lat)) / 1e3 if lat else 0.0, "no_room": no_room}


def _run_wire_path(ctx: zmq.Context, endpoint: str, name: str, ids: list[int], t_start: float, t_end: float,
                   timeout: float, window: int = 1) -> dict[str, Any]:
    """Pre-packed extend_many messages (as Batch.send puts them on the wire) on a raw DEALER until ``t_end``.

    ``window`` messages are kept in flight (1: each waits for the previous reply, as a scheduler's step does).
    """
    n = len(ids)
    ops = pack([{"op": "extend_many", "reqs": ids, "tokens": np.ones(n, dtype=np.int32),
                 "counts": np.ones(n, dtype=np.int32)}])
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    lat: list[int] = []
    sent_at: collections.deque[int] = collections.deque()
    reply = b""
    request_id = 0

    def send() -> None:
        nonlocal request_id
        request_id += 1
        head = pack({"v": PROTOCOL_VERSION, "client": name, "id": request_id, "ops": []})
        sent_at.append(time.perf_counter_ns())
        sock.send(head[:-1] + ops)  # head ends with the empty ops list (0x90): splice the packed ops in

    try:
        _sleep_until(t_start)
        for _ in range(window):
            send()
        while sent_at:
            if not sock.poll(int(timeout * 1000)):
                raise KVCacheError(f"daemon: no reply within {timeout:g} s")
            reply = sock.recv()  # replies come back in order: one daemon thread answers them
            lat.append(time.perf_counter_ns() - sent_at.popleft())
            if OK_MARK not in reply[:32]:
                raise KVCacheError(f"extend_many refused: {unpack(reply, 1 << 31).get('error')}")
            if time.monotonic() < t_end:
                send()
    finally:
        sock.close(0)
    no_room = int((unpack(reply, 1 << 31)["results"][0]["lens"] < 0).sum()) if reply else 0
    return {"messages": len(lat), "extends": len(lat) * n, "end": time.monotonic(),
            "p50_us": float(np.median(lat)) / 1e3 if lat else 0.0, "no_room": no_room}


_PATH_NAMES = {"client": "CacheClient.batch()", "arrays": "CacheClient.extend_many", "wire": "pre-packed extend_many",
               "pipelined": f"pre-packed, {PIPELINE_DEPTH} in flight"}


def _throughput_plan(cfg: BenchConfig) -> list[tuple[str, int, int]]:
    """Section 3's rows after the steps one, as (path, client processes, extends per message)."""
    plan = [(path, 1, b) for path in ("client", "arrays") for b in cfg.batches]
    plan += [("wire", n, b) for n in cfg.clients for b in cfg.batches]
    return plan + [("pipelined", 1, b) for b in cfg.batches]


def _spawn_extend_clients(cfg: BenchConfig, fleet: Fleet, endpoint: str, count: int) -> list[Connection]:
    """``count`` extend client processes of one daemon; the caller waits for their "ready"."""
    return [fleet.spawn(_extend_client, endpoint, i, cfg.timeout) for i in range(count)]


def _renew(cfg: BenchConfig, active: list[Connection], count: int) -> None:
    """Each of ``active`` client processes frees its requests and admits ``count`` fresh ones."""
    for c in active:
        c.send(("renew", count))
    deadline = time.monotonic() + cfg.timeout + CHILD_GRACE_S
    for i, c in enumerate(active):
        expect(c, "renewed", deadline, f"extend client {i}")


class _Run(NamedTuple):
    """What the client processes of one timed run reported, and its seconds (start to the last one's end)."""

    outs: list[dict[str, Any]]
    seconds: float


def _timed_run(cfg: BenchConfig, active: list[Connection], path: str, size: int, seconds: float) -> _Run:
    """``active`` client processes extend ``size`` of their requests per message, together, for ``seconds``."""
    t_start = time.monotonic() + 0.05
    t_end = t_start + seconds
    for c in active:
        c.send(("run", path, size, t_start, t_end))
    deadline = t_end + cfg.timeout + CHILD_GRACE_S
    outs = [expect(c, "ran", deadline, f"extend client {i}")[1] for i, c in enumerate(active)]
    return _Run(outs, max(o["end"] for o in outs) - t_start)


def _row(path: str, clients: int, size: int, runs: list[_Run]) -> dict[str, Any]:
    """A throughput row from one or more timed runs of it: totals over their summed seconds."""
    outs = [o for run in runs for o in run.outs]
    seconds = sum(run.seconds for run in runs)
    return {
        "path": _PATH_NAMES[path],
        "clients": clients,
        "extends_per_message": size,
        "extends_per_s": sum(o["extends"] for o in outs) / seconds,
        "messages_per_s": sum(o["messages"] for o in outs) / seconds,
        "p50_us": float(np.median([o["p50_us"] for o in outs])),
        "no_room": sum(o["no_room"] for o in outs),
    }


def bench_throughput(cfg: BenchConfig, fleet: Fleet, endpoint: str, step: dict[str, Any]) -> list[dict[str, Any]]:
    """Extends per second: the step workload's, then batches through 1..N client processes."""
    rows = [{"path": "steps (section 2)", "clients": 1, "extends_per_message": cfg.requests,
             "extends_per_s": step["extends_per_s"], "messages_per_s": 1e6 / step["mean_us"],
             "p50_us": step["p50_us"], "no_room": 0}]
    conns = _spawn_extend_clients(cfg, fleet, endpoint, max(cfg.clients))
    try:
        deadline = time.monotonic() + cfg.timeout
        for i, c in enumerate(conns):
            expect(c, "ready", deadline, f"extend client {i}")
        plan = _throughput_plan(cfg)
        for i, (path, n, size) in enumerate(plan, 1):
            progress(f"   row {i} of {len(plan)}: {_PATH_NAMES[path]}, {n} client(s), {size:,} extends per message")
            _renew(cfg, conns, 0)  # every client gives its grown tables back first, so no admit waits on another's
            _renew(cfg, conns[:n], max(cfg.batches))  # then fresh requests for this row's clients
            rows.append(_row(path, n, size, [_timed_run(cfg, conns[:n], path, size, cfg.seconds)]))
    finally:
        fleet.stop(conns)
    for r in rows:
        r["ok"] = r["extends_per_s"] >= EXTENDS_PER_S_TARGET
    return rows


# --------------------------------------------------------------------------- 3b. journal on / off


JOURNAL_MODES = ("off", "on")


def _alternate(i: int) -> tuple[str, ...]:
    """The order of the two daemons in turn ``i``: off first, then on first, and so on."""
    return JOURNAL_MODES if i % 2 == 0 else JOURNAL_MODES[::-1]


def _daemon_endpoints(transport: str, folder: Path, name: str) -> tuple[str, str, str]:
    """ROUTER, PUB and replay endpoints of one more daemon, on the run's transport."""
    if transport == "ipc":
        return tuple(f"ipc://{folder}/{name}{suffix}.sock" for suffix in ("", "-pub", "-replay"))  # type: ignore
    return tuple(f"tcp://127.0.0.1:{port}" for port in _free_tcp_ports(3))  # type: ignore[return-value]


def _serve_argv(cfg: BenchConfig, endpoint: str, pub: str, replay: str, *extra: str) -> list[str]:
    """`kvcache serve` as every daemon of the benchmark is started (``extra`` appended)."""
    return [sys.executable, "-m", "kvcache", "serve", "--endpoint", endpoint, "--pub-endpoint", pub,
            "--replay-endpoint", replay, "--num-blocks", str(cfg.num_blocks), "--block-size", str(cfg.block_size),
            "--rows", "full", "--enable-prefix-caching", "--io-threads", str(cfg.io_threads), "--log-level", "WARNING",
            *extra]


def _filesystem(path: Path) -> str:
    """``fstype device (mount point)`` of the mount holding ``path``, from /proc/mounts; "unknown" elsewhere."""
    target = os.path.realpath(path)
    best: tuple[str, str, str] | None = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, fstype = (line.split() + ["", "", ""])[:3]
            mount = mount.replace("\\040", " ")
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and (best is None or len(mount) >= len(best[1])):
                best = (device, mount, fstype)
    return "unknown" if best is None else f"{best[2]} {best[0]} ({best[1]})"


def _fdatasync_floor(folder: Path, count: int) -> dict[str, Any]:
    """The disk's floor under a commit: ``count`` 4 KiB writes + fdatasync in ``folder``, as the journal does them.

    Into a zero-filled preallocated file (the journal's way: fdatasync flushes
    data only), and, for comparison, appended to a growing file.
    """
    data = bytes(FSYNC_PROBE_BYTES)
    out: dict[str, Any] = {"bytes": FSYNC_PROBE_BYTES, "count": count}
    for how in ("append", "preallocated"):
        path = folder / f"fdatasync-probe-{how}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        times = np.empty(count, dtype=np.int64)
        try:
            if how == "preallocated":
                os.write(fd, bytes((count + FSYNC_PROBE_WARMUP) * FSYNC_PROBE_BYTES))
                os.fsync(fd)
                os.lseek(fd, 0, os.SEEK_SET)
            for i in range(-FSYNC_PROBE_WARMUP, count):
                t0 = time.perf_counter_ns()
                os.write(fd, data)
                os.fdatasync(fd)
                if i >= 0:
                    times[i] = time.perf_counter_ns() - t0
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)
        p50, p99 = _percentiles_us(times)
        if how == "append":
            out["append_p50_us"] = p50
        else:
            out["p50_us"], out["p99_us"] = p50, p99
    return out


class _JournalMeter:
    """Bytes the journaled daemon appends to its WAL over timed runs, and compactions seen (a new snapshot)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.bytes = 0
        self.seconds = 0.0
        self.compactions = 0

    def _state(self) -> tuple[int, int]:
        try:
            return (self.folder / "snapshot").stat().st_ino, records_end(self.folder / "wal")
        except OSError:
            return -1, 0

    @contextlib.contextmanager
    def timed(self) -> Any:
        inode, size = self._state()
        t0 = time.perf_counter()
        yield
        self.seconds += time.perf_counter() - t0
        inode_after, size_after = self._state()
        if inode_after == inode and size_after >= size:
            self.bytes += size_after - size
        else:  # compacted: the WAL restarted from empty (what was written before the snapshot is not counted)
            self.compactions += 1
            self.bytes += size_after


def _journal_pair(off: dict[str, Any], on: dict[str, Any], *, loaded: bool, **head: Any) -> dict[str, Any]:
    """One row of section 3b. Only ``loaded`` rows (messages waiting while the daemon works, so one
    fdatasync serves many) measure the daemon's throughput and carry the target; in the others each
    client waits for every reply, so each message pays a whole fdatasync: latency, reported as such."""
    r = on["extends_per_s"] / off["extends_per_s"]
    return {**head, "off": off, "on": on, "ratio": r, "added_p50_us": on["p50_us"] - off["p50_us"],
            "loaded": loaded, "ok": r >= JOURNAL_RATIO_TARGET if loaded else None}


def bench_journal(cfg: BenchConfig, fleet: Fleet, ctx: zmq.Context) -> dict[str, Any]:
    """Section 3b: two fresh daemons started alike but for ``--journal``, measured in turns.

    The step workload of section 2 (rounds alternate which daemon goes first) and
    every batched-extend row of section 3 (each row in halves A B B A across the two
    daemons; a row's clients hold only the requests they extend, so renewing them
    between rows stays cheap). The journal lives in the
    run's /tmp folder and is removed afterwards; a 4 KiB write + fdatasync loop (as the journal writes)
    there gives the disk's floor.
    """

    folder = fleet.folder / "journal"
    daemons: dict[str, subprocess.Popen] = {}
    clients: dict[str, CacheClient] = {}
    endpoints: dict[str, str] = {}
    conns: dict[str, list[Connection]] = {}
    meter = _JournalMeter(folder)
    try:
        for mode in JOURNAL_MODES:
            endpoint, pub, replay = _daemon_endpoints(cfg.transport, fleet.folder, f"j-{mode}")
            extra = ("--journal", str(folder)) if mode == "on" else ()
            daemons[mode] = fleet.start(_serve_argv(cfg, endpoint, pub, replay, *extra), READY, cfg.timeout,
                                        f"serve-journal-{mode}")
            endpoints[mode] = endpoint
        most = max(cfg.clients)
        for mode in JOURNAL_MODES:  # the clients start while the schedulers below set up
            conns[mode] = _spawn_extend_clients(cfg, fleet, endpoints[mode], most)

        # The step workload: set up and warm up both, then rounds of steps taking turns.
        scheds: dict[str, _Scheduler] = {}
        for mode in JOURNAL_MODES:
            clients[mode] = CacheClient(endpoints[mode], timeout=cfg.timeout, name=f"bench-journal-{mode}",
                                        context=ctx)
            scheds[mode] = _Scheduler(clients[mode], cfg)
            scheds[mode].setup()
            scheds[mode].run(_warmup_steps(cfg))
        deadline = time.monotonic() + cfg.timeout  # every process started before anything is timed
        for mode in JOURNAL_MODES:
            for i, c in enumerate(conns[mode]):
                expect(c, "ready", deadline, f"extend client {i} (journal {mode})")
        floor = _fdatasync_floor(folder, cfg.fsync_probes)
        per_round = max(1, cfg.steps // cfg.rounds)
        step_ns: dict[str, list[np.ndarray]] = {mode: [] for mode in JOURNAL_MODES}
        for i in range(cfg.rounds):
            for mode in _alternate(i):
                with meter.timed() if mode == "on" else contextlib.nullcontext():
                    step_ns[mode].append(scheds[mode].run(per_round))
        steps: dict[str, dict[str, Any]] = {}
        for mode in JOURNAL_MODES:
            ns = np.concatenate(step_ns[mode])
            p50, p99 = _percentiles_us(ns)
            steps[mode] = {"extends_per_s": cfg.requests / (float(ns.mean()) / 1e9),
                           "messages_per_s": 1e9 / float(ns.mean()), "p50_us": p50, "p99_us": p99,
                           "no_room": 0, "steps": int(ns.size)}
        rows = [_journal_pair(steps["off"], steps["on"], path="steps (as in section 2)", clients=1,
                              extends_per_message=cfg.requests, loaded=False)]

        # The batched-extend rows of section 3: both daemons renew, then the row runs in two halves on
        # each, in the order A B B A (A = off on even rows, on on odd ones), so a drift falls on both.
        plan = _throughput_plan(cfg)
        for k, (path, n, size) in enumerate(plan):
            progress(f"   row {k + 1} of {len(plan)}: {_PATH_NAMES[path]}, {n} client(s), {size:,} per message")
            _renew(cfg, conns["off"] + conns["on"], 0)  # both daemons at once, every table back first: nothing timed
            _renew(cfg, conns["off"][:n] + conns["on"][:n], size)
            runs: dict[str, list[_Run]] = {mode: [] for mode in JOURNAL_MODES}
            first, second = _alternate(k)
            for mode in (first, second, second, first):
                with meter.timed() if mode == "on" else contextlib.nullcontext():
                    runs[mode].append(_timed_run(cfg, conns[mode][:n], path, size, cfg.seconds / 2))
            off, on = (_row(path, n, size, runs[mode]) for mode in JOURNAL_MODES)
            head = {key: off.pop(key) for key in ("path", "clients", "extends_per_message")}
            for key in head:
                on.pop(key)
            rows.append(_journal_pair(off, on, loaded=path == "pipelined", **head))
    finally:
        try:
            fleet.stop([c for group in conns.values() for c in group])
            for client in clients.values():
                client.close()
            for process in daemons.values():
                fleet.terminate(process)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    worst = min((r for r in rows if r["loaded"]), key=lambda r: r["ratio"])
    best_off = max(r["off"]["extends_per_s"] for r in rows)
    best_on = max(r["on"]["extends_per_s"] for r in rows)
    return {
        "folder": str(folder),
        "filesystem": _filesystem(fleet.folder),
        "fdatasync": floor,
        "rows": rows,
        "journal_bytes": meter.bytes,
        "journal_seconds": meter.seconds,
        "compactions": meter.compactions,
        "snapshot_bytes": ServeConfig().snapshot_bytes,
        "best_off_extends_per_s": best_off,
        "best_on_extends_per_s": best_on,
        "best_ratio": best_on / best_off,
        "worst_ratio": worst["ratio"],
        "worst_row": f"{worst['path']}, {worst['clients']} client(s), {worst['extends_per_message']:,}/message",
        "target": f"on/off >= {JOURNAL_RATIO_TARGET:g} (journal costs <= {1 - JOURNAL_RATIO_TARGET:.0%})",
        "ok": all(r["ok"] for r in rows if r["loaded"]),
    }


# --------------------------------------------------------------------------- 4. delta lag


class _RawDeltas:
    """Deltas as the protocol text describes them, from a SUB socket or as datagrams from the local endpoint."""

    def __init__(self, endpoint: str, local: bool) -> None:
        self.ctx: zmq.Context | None = None
        self.dgram: socket.socket | None = None
        self.path: str | None = None
        if local:
            self.dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self.path = bind_beside(self.dgram, endpoint)  # a socket file the daemon accepts, as a worker's
            self.dgram.connect(endpoint)
            self.dgram.setblocking(False)
            self.dgram.send(LOCAL_SUBSCRIBE)
            self.poller = select.poll()
            self.poller.register(self.dgram.fileno(), select.POLLIN)
        else:
            self.ctx = zmq.Context()
            self.sub = self.ctx.socket(zmq.SUB)
            self.sub.setsockopt(zmq.LINGER, 0)
            self.sub.setsockopt(zmq.SUBSCRIBE, b"T")
            self.sub.connect(endpoint)

    def wait(self, ms: int) -> bool:
        return bool(self.poller.poll(ms)) if self.dgram is not None else bool(self.sub.poll(ms))

    def next(self) -> tuple[bytes, bytes] | None:
        """The next waiting delta's seq frame and payload (empty for a heartbeat), or None."""
        if self.dgram is not None:
            try:
                data = self.dgram.recv(LOCAL_MAX_BYTES + 1)
            except BlockingIOError:
                return None
            return data[DELTA_HEAD_BYTES - 8:DELTA_HEAD_BYTES], data[DELTA_HEAD_BYTES:]
        try:
            frames = self.sub.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        return frames[1], frames[2]

    def close(self) -> None:
        if self.dgram is not None:
            self.dgram.send(LOCAL_UNSUBSCRIBE)
            self.dgram.close()
            remove_socket_file(self.path)
        else:
            self.sub.close(0)
            self.ctx.term()


def _subscriber(conn: Connection, endpoint: str, local: bool) -> None:
    """A raw subscriber: per delta, seq, receive time minus the delta's publish time, and its bytes."""
    deltas = _RawDeltas(endpoint, local)
    seqs: list[int] = []
    lags: list[int] = []
    sizes: list[int] = []
    report_at: int | None = None
    report_by = 0.0
    announced = False
    try:
        conn.send(("connected",))
        while True:
            if deltas.wait(20):
                while (got := deltas.next()) is not None:
                    now = time.monotonic_ns()  # before decoding: the lag is the transport's, not ours
                    seq, payload = int.from_bytes(got[0], "big", signed=True), got[1]
                    if not announced:  # a heartbeat does as well: the subscription is live
                        conn.send(("first", seq))
                        announced = True
                    if not payload:  # a heartbeat (the latest seq, no delta) after the daemon's idle spells
                        continue
                    seqs.append(seq)  # only "t" is read, at its fixed offset: no decoding on 2 shared cores
                    lags.append(now - int.from_bytes(payload[DELTA_T_OFFSET:DELTA_T_OFFSET + 8], "big"))
                    sizes.append(len(payload))
            if conn.poll(0):
                cmd = conn.recv()
                if cmd[0] == "stop":
                    return
                report_at, report_by = cmd[1], time.monotonic() + cmd[2]
            if report_at is not None and ((seqs and seqs[-1] >= report_at) or time.monotonic() > report_by):
                conn.send(("report", seqs, lags, sizes))
                report_at = None
    finally:
        deltas.close()


class _LagRound(NamedTuple):
    """What one round of subscribers saw: per subscriber, the lags (ns) and sizes of the round's deltas."""

    lags: list[np.ndarray]
    sizes: list[np.ndarray]
    deltas: int  # published in the round: every subscriber should have seen each once
    gaps: int
    step_ns: np.ndarray


def _lag_round(cfg: BenchConfig, fleet: Fleet, endpoint: str, local: bool, sched: _Scheduler, steps: int
               ) -> _LagRound:
    """Fresh subscriber processes on one transport time every delta of ``steps`` steps run back to back."""
    conns = [fleet.spawn(_subscriber, endpoint, local) for _ in range(cfg.subscribers)]
    try:
        deadline = time.monotonic() + cfg.timeout
        for i, c in enumerate(conns):
            expect(c, "connected", deadline, f"subscriber {i}")
        # A SUB socket joins a moment after connect: step until every subscriber has seen a delta.
        waiting = set(range(len(conns)))
        deadline = time.monotonic() + cfg.timeout
        while waiting:
            if time.monotonic() > deadline:
                raise KVCacheError(f"subscribers {sorted(waiting)}: no delta within {cfg.timeout:g} s")
            sched.run(1)
            for i in [i for i in waiting if conns[i].poll(0)]:
                expect(conns[i], "first", deadline, f"subscriber {i}")
                waiting.discard(i)
        first = sched.client.last_seq
        step_ns = sched.run(steps)
        last = sched.client.last_seq
        for c in conns:
            c.send(("report", last, cfg.timeout))
        deadline = time.monotonic() + cfg.timeout
        reports = [expect(c, "report", deadline, f"subscriber {i}")[1:] for i, c in enumerate(conns)]
    finally:
        fleet.stop(conns)
    lag_ns, sizes, gaps = [], [], 0
    for seqs, lags, size in reports:
        s = np.asarray(seqs)
        window = (s > first) & (s <= last)
        lag_ns.append(np.asarray(lags, dtype=np.int64)[window])
        sizes.append(np.asarray(size)[window])
        gaps += (last - first) - np.unique(s[window]).size
    return _LagRound(lag_ns, sizes, last - first, int(gaps), step_ns)


def bench_lag(cfg: BenchConfig, fleet: Fleet, transports: list[tuple[str, str, bool]], sched: _Scheduler
              ) -> list[dict[str, Any]]:
    """Section 4: subscribers in their own processes time every delta while steps run back to back.

    ``transports`` are (name, endpoint, local): the daemon's PUB, or with ``local`` its local
    endpoint (deltas as datagrams). They take turns, half of ``lag_steps`` each per turn, twice.
    """
    rounds: dict[str, list[_LagRound]] = {name: [] for name, _, _ in transports}
    for _ in range(2):
        for name, endpoint, local in transports:
            rounds[name].append(_lag_round(cfg, fleet, endpoint, local, sched, max(1, cfg.lag_steps // 2)))
    out = []
    for name, got in rounds.items():
        per_sub = [np.concatenate([r.lags[i] for r in got]) for i in range(cfg.subscribers)]
        lags_all = np.concatenate(per_sub)
        if lags_all.size == 0:
            raise KVCacheError(f"subscribers ({name}): none of the deltas arrived")
        p50, p99 = _percentiles_us(lags_all)
        s50, s99 = _percentiles_us(np.concatenate([r.step_ns for r in got]))
        gaps = sum(r.gaps for r in got)
        out.append({
            "transport": name,
            "subscribers": cfg.subscribers,
            "cpus": os.cpu_count(),
            "steps": int(sum(r.step_ns.size for r in got)),
            "step_p50_us": s50,
            "step_p99_us": s99,
            "deltas": sum(r.deltas for r in got),
            "received": int(lags_all.size),
            "delta_bytes_mean": float(np.concatenate([s for r in got for s in r.sizes]).mean()),
            "p50_us": p50,
            "p99_us": p99,
            "max_us": float(lags_all.max()) / 1e3,
            "worst_subscriber_p99_us": max(float(np.percentile(a, 99)) / 1e3 if a.size else 0.0 for a in per_sub),
            "gaps": int(gaps),
            "target": f"p99 <= {LAG_P99_TARGET_US / 1e3:g} ms, no seq gaps",
            "ok": p99 <= LAG_P99_TARGET_US and gaps == 0,
        })
    return out


# --------------------------------------------------------------------------- 5. profile


def _step_messages(cfg: BenchConfig, steps: int, seed: int = 1) -> tuple[list[bytes], list[bytes]]:
    """Pre-packed setup and step messages of the step workload, ops shaped as Batch.send sends them."""
    rng = np.random.default_rng(seed)
    live: collections.deque[int] = collections.deque()
    msg_id = 0

    def message(ops: list[dict[str, Any]]) -> bytes:
        nonlocal msg_id
        msg_id += 1
        return pack({"v": PROTOCOL_VERSION, "client": "bench-profile", "id": msg_id, "ops": ops})

    def prompt() -> np.ndarray:
        return rng.integers(0, VOCAB, size=cfg.prompt_tokens, dtype=np.int32)

    setup = []
    total = cfg.requests + cfg.admits
    for start in range(0, total, SETUP_ADMITS_PER_MESSAGE):
        ids = list(range(start, min(start + SETUP_ADMITS_PER_MESSAGE, total)))
        setup.append(message([{"op": "admit", "req": r, "tokens": prompt()} for r in ids]))
        live.extend(ids)
    next_id = total
    out = []
    for _ in range(steps):
        ops: list[dict[str, Any]] = [{"op": "free", "req": live.popleft()} for _ in range(cfg.admits)]
        ops.append({"op": "extend_many", "reqs": list(live),
                    "tokens": rng.integers(0, VOCAB, size=len(live) * DECODE_TOKENS, dtype=np.int32),
                    "counts": np.full(len(live), DECODE_TOKENS, dtype=np.int32)})
        for _ in range(cfg.admits):
            ops.append({"op": "admit", "req": next_id, "tokens": prompt()})
            live.append(next_id)
            next_id += 1
        out.append(message(ops))
    return setup, out


# What the leaves of the split (functions outside the server's file) do, by function name.
_MEANING = {
    "unpack": "msgpack decode, array exts",
    "header": "envelope check",
    "check_request_id": "type and range, per request",
    "check_tokens": "token array check",
    "extend_many": "decode extends",
    "extend_many_deltas": "decode extends",
    "extend": "slow path: allocate, hash, register",
    "admit": "hash, match, allocate",
    "free": "blocks back to the pool",
    "pack": "msgpack encode, array exts",
    "pack_delta": "the delta's msgpack encode",
    "observe_step": "metrics",
    "update": "metrics",
}
MIN_PHASE_SHARE = 0.01  # smaller callees are summed into one "other" row
# The daemon's modules (kvcache/<part>.py): the profile's phases open up their functions.
_DAEMON_PARTS = ("server", "daemon_state", "deltas", "durability", "endpoints")


def _label(key: tuple[str, int, str], homes: frozenset[str]) -> str:
    """``module.function`` of a profiler key; bare ``function`` in ``homes`` (the daemon's files) and built-ins."""
    file, _, name = key
    return name if file == "~" or file in homes else f"{Path(file).stem}.{name}"


def _split(stats: dict, root: tuple[str, int, str], steps: int) -> list[dict[str, Any]]:
    """The root's cumulative time per step, split along call edges.

    Functions of the daemon's own files (the server and the parts it puts together, which change often) are
    opened up into what they call; anything else (protocol, manager, metrics,
    built-ins) is a leaf. Parts under ``MIN_PHASE_SHARE`` are summed into one row.
    """
    callees: dict[tuple, dict[tuple, float]] = collections.defaultdict(dict)
    for key, (_, _, _, _, callers) in stats.items():
        for caller, edge in callers.items():
            callees[caller][key] = edge[3]
    rows: list[tuple[str, str, float]] = []
    homes = frozenset(str(Path(root[0]).with_name(f"{part}.py")) for part in _DAEMON_PARTS)

    def walk(key: tuple, path: str, scale: float, above: frozenset) -> None:
        rows.append((f"{path} (own code)", "", stats[key][2] * scale))
        for child, seconds in sorted(callees[key].items(), key=lambda kv: -kv[1]):
            label = f"{path} > {_label(child, homes)}"
            if child[0] in homes and stats[child][3] > 0 and child not in above:  # recursion stays a leaf
                walk(child, label, scale * seconds / stats[child][3], above | {child})  # this path's part of it
            else:
                rows.append((label, _MEANING.get(child[2], ""), seconds * scale))

    walk(root, root[2], 1.0, frozenset([root]))
    total = stats[root][3]
    kept = [(path, what, s) for path, what, s in rows if s >= MIN_PHASE_SHARE * total]
    rest = total - sum(s for _, _, s in kept)
    kept.append((f"other ({len(rows) - len(kept)} smaller parts)", "", rest))
    paths = [path.split(" > ") for path, _, _ in kept[:-1]]
    common = 0  # leading steps every row shares, printed once above the table
    while paths and all(len(p) > common + 1 and p[common] == paths[0][common] for p in paths):
        common += 1
    return [{"path": " > ".join(p[:common]) if p else root[2], "phase": " > ".join(p[common:]) if p else path,
             "what": what, "us": s * 1e6 / steps, "share": s / total}
            for p, (path, what, s) in zip([*paths, []], kept)]


def _timed(func: Callable[..., Any], spent: list[int], part: int) -> Callable[..., Any]:
    """``func`` adding the ns each call takes to ``spent[part]``."""
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return func(*args, **kwargs)
        finally:
            spent[part] += time.perf_counter_ns() - t0
    return timed


@contextlib.contextmanager
def _timing_native(spent: list[int]) -> Iterator[None]:
    """While inside, every function of this package's C extensions adds the ns it takes to ``spent[0]`` (the
    codec, ``_wire``) or ``spent[1]`` (the allocator's passes). A caller that bound one before is not seen."""
    from kvcache import _wire
    from kvcache.allocator import _chainhash, _hashtable, _pool, _tables

    saved = [(module, name, func) for module in (_wire, _tables, _chainhash, _pool, _hashtable)
             for name, func in vars(module).items() if isinstance(func, types.BuiltinFunctionType)]
    try:
        for module, name, func in saved:
            setattr(module, name, _timed(func, spent, 0 if module is _wire else 1))
        yield
    finally:
        for module, name, func in saved:
            setattr(module, name, func)


def _native_handles(cfg: BenchConfig, folder: Path, messages: list[bytes], warm: int) -> dict[str, float]:
    """p50 µs per step in this package's C extensions (codec, allocator) over the timed steps, on a server built
    with them timed: a step with no Python around them costs this."""
    spent = [0, 0]
    per_step = np.empty((cfg.profile_steps, 2), dtype=np.int64)
    with _timing_native(spent), _profile_server(cfg, folder, "native") as server:
        _timed_handles(server, messages[:warm])
        for i, m in enumerate(messages[warm:warm + cfg.profile_steps]):
            spent[:] = [0, 0]
            _check_reply(server.handle(m))
            per_step[i] = spent
    codec, allocator = np.median(per_step, axis=0) / 1e3
    return {"codec": float(codec), "allocator": float(allocator)}


@contextlib.contextmanager
def _profile_server(cfg: BenchConfig, folder: Path, name: str, **settings: Any) -> Iterator[Any]:
    """A CacheServer in this process as the benchmark's daemon is configured (plus ``settings``); it and its
    context are closed on the way out."""
    from kvcache.serve import build_manager
    from kvcache.server import CacheServer

    serve_cfg = ServeConfig(endpoint=f"ipc://{folder}/{name}.sock", num_blocks=cfg.num_blocks,
                            block_size=cfg.block_size, rows="full", enable_prefix_caching=True, **settings)
    manager, layout, extra = build_manager(serve_cfg.resolved())
    ctx = zmq.Context()
    try:
        server = CacheServer(serve_cfg, manager, layout=layout, context=ctx, extra_info=extra)
        try:
            yield server
        finally:
            server.close()
    finally:
        ctx.destroy(0)


def _timed_handles(server: Any, messages: list[bytes]) -> np.ndarray:
    """ns of ``server.handle`` on each message, every reply checked."""
    out = np.empty(len(messages), dtype=np.int64)
    for i, m in enumerate(messages):
        t0 = time.perf_counter_ns()
        reply = server.handle(m)
        out[i] = time.perf_counter_ns() - t0
        _check_reply(reply)
    return out


def _handle_with_events(cfg: BenchConfig, folder: Path, messages: list[bytes], warm: int) -> np.ndarray:
    """ns of CacheServer.handle on the timed steps of a daemon that also publishes KV events (``--events``)."""
    with _profile_server(cfg, folder, "events-profile", events=True) as server:
        _timed_handles(server, messages[:warm])
        return _timed_handles(server, messages[warm:warm + cfg.profile_steps])


def bench_profile(cfg: BenchConfig, folder: Path) -> dict[str, Any]:
    """Section 5: CacheServer.handle on pre-packed step messages, timed plain (also with KV events published),
    then under cProfile."""
    from kvcache.server import CacheServer

    with _profile_server(cfg, folder, "p") as server:
        warm = _warmup_steps(cfg)
        setup, messages = _step_messages(cfg, warm + 2 * cfg.profile_steps)
        with_events = _handle_with_events(cfg, folder, setup + messages, len(setup) + warm)
        native = _native_handles(cfg, folder, setup + messages, len(setup) + warm)
        _timed_handles(server, setup + messages[:warm])
        plain = _timed_handles(server, messages[warm:warm + cfg.profile_steps])
        profiled = messages[warm + cfg.profile_steps:]
        profiler = cProfile.Profile()
        replies = []
        profiler.enable()
        for m in profiled:
            replies.append(server.handle(m))
        profiler.disable()
        for reply in replies:
            _check_reply(reply)
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    n = len(profiled)
    code = CacheServer.handle.__code__
    root = (code.co_filename, code.co_firstlineno, code.co_name)
    top = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:12]
    p50, p99 = _percentiles_us(plain)
    return {
        "steps": n,
        "message_bytes": len(profiled[0]),
        "handle_p50_us": p50,
        "handle_p99_us": p99,
        "handle_events_p50_us": _percentiles_us(with_events)[0],
        "profiled_us_per_step": stats[root][3] * 1e6 / n,
        "native_us": native,
        "phases": _split(stats, root, n),
        "top": [{"function": f"{Path(f).name}:{line}({name})", "own_us": v[2] * 1e6 / n, "cum_us": v[3] * 1e6 / n,
                 "calls_per_step": v[1] / n} for (f, line, name), v in top],
    }


def _check_reply(reply: bytes) -> None:
    if OK_MARK not in reply[:32]:
        raise KVCacheError(f"profile: the server refused a step: {unpack(reply, 1 << 31).get('error')}")


# --------------------------------------------------------------------------- the run


def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """Every section, measured now; one JSON-ready dict. Every process started is stopped before it returns."""
    fleet = Fleet()
    ctx = zmq.Context()
    try:
        ends = _endpoints(cfg.transport, fleet.folder)
        echo_conn = fleet.spawn(_echo_server, ends.echo, ends.echo_local)
        daemon = fleet.start(_serve_argv(cfg, ends.daemon, ends.pub, ends.replay), READY, cfg.timeout,
                             "kvcache serve")
        expect(echo_conn, "ready", time.monotonic() + cfg.timeout, "echo server")
        echo = _EchoClient(ctx, ends.echo, cfg.timeout)
        client = CacheClient(ends.daemon, timeout=cfg.timeout, name="bench-scheduler", context=ctx)
        try:
            sched = _Scheduler(client, cfg)
            progress(f"1-2. raw echo and {cfg.steps:,} step round trips, in {cfg.rounds} rounds")
            echo_out, step_out = bench_echo_and_steps(cfg, echo, sched)
            step_out["local"] = None
            if ends.echo_local is not None:
                progress("2b. the same steps over the local endpoint")
                with contextlib.closing(_LocalEchoClient(ends.echo_local, cfg.timeout)) as local_echo, \
                        CacheClient(ends.daemon, timeout=cfg.timeout, name="bench-local", context=ctx,
                                    local=True) as local_client:
                    step_out["local"] = bench_local_steps(cfg, local_echo, _Scheduler(local_client, cfg, seed=1, first_id=1 << 40),
                                                          echo_out["p50_us"])
            progress("2c. the same steps on head-wise and layer-group daemons, in turns with the uniform one")
            step_out["rows"] = bench_rows_steps(cfg, fleet, ctx, sched)
            fleet.stop([echo_conn])
            progress(f"3. throughput: {len(_throughput_plan(cfg))} rows of {cfg.seconds:g} s")
            throughput = bench_throughput(cfg, fleet, ends.daemon, step_out)
            info = client.info()
            transports = [("PUB", info["pub_endpoint"], False)]
            if info.get("local_endpoint"):
                transports.append(("local endpoint", info["local_endpoint"], True))
            progress(f"4. delta lag: {cfg.subscribers} subscribers, {cfg.lag_steps} steps per transport")
            lags = bench_lag(cfg, fleet, transports, sched)
        finally:
            echo.close()
            client.close()
        fleet.terminate(daemon)  # the profile runs the server in this process: the daemon's core is free
        progress("3b. journal on / off: two fresh daemons, section 3's rows in turns")
        journal = bench_journal(cfg, fleet, ctx)  # two fresh daemons of their own, after the first one stopped
        progress(f"5. profile: {cfg.profile_steps} steps in process")
        profile = bench_profile(cfg, fleet.folder)
        step_out["handle_p50_us"] = profile["handle_p50_us"]
        step_out["native_floor_us"] = step_out["codec_p50_us"] + profile["native_us"]["allocator"]
        step_out["native_floor_over_echo_p50"] = step_out["native_floor_us"] / step_out["echo_p50_us"]
    finally:
        try:
            fleet.close()
        finally:
            ctx.destroy(0)
    best = max(throughput, key=lambda r: r["extends_per_s"])
    return {
        "benchmark": "daemon",
        "config": {
            **{k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()},
            "python": platform.python_version(),
            "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(),
            "numpy": np.__version__,
            "cpus": os.cpu_count(),
        },
        "echo": echo_out,
        "step": step_out,
        "throughput": throughput,
        "journal": journal,
        "lag": lags,
        "profile": profile,
        "processes": fleet.pids,
        "targets": [t for t in [
            {"name": "vLLM's in-process step p50 / the daemon's step round trip p50",
             "value": ratio(step_out["vllm_over_p50"]), "target": step_out["target"], "ok": step_out["ok"]},
            *({"name": f"step p50, {r['mode']} rows / uniform", "value": ratio(r["over_uniform"]),
               "target": r["target"], "ok": r["ok"]} for r in step_out["rows"]),
            {"name": "extends per second (best row)",
             "value": f"{best['extends_per_s']:,.0f} ({best['path']}, {best['clients']} client(s), "
                      f"{best['extends_per_message']:,}/message)",
             "target": f">= {EXTENDS_PER_S_TARGET:,}", "ok": best["ok"]},
            {"name": "extends per second, journal on / off (worst row)",
             "value": f"{journal['worst_ratio']:.2f} ({journal['worst_row']})", "target": journal["target"],
             "ok": journal["ok"]},
            *({"name": f"delta lag p99, {lag['subscribers']} subscribers, {lag['transport']}",
               "value": f"{lag['p99_us'] / 1e3:.2f} ms, {lag['gaps']} gaps", "target": lag["target"], "ok": lag["ok"]}
              for lag in lags),
        ] if t["ok"] is not None],
    }


# --------------------------------------------------------------------------- report


def _us(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _render_journal(j: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    """Section 3b's lines."""
    floor = j["fdatasync"]
    rate = j["journal_bytes"] / j["journal_seconds"] if j["journal_seconds"] > 0 else 0.0
    lines = [
        f"3b. journal: the step workload and section 3's rows against two fresh daemons, one with --journal "
        f"(group commit: one fdatasync per loop turn), in turns ({cfg['seconds']:g} s per row per daemon, in "
        "halves A B B A; a row's clients hold only the requests they extend)",
        table(
            ["path", "clients", "extends/msg", "off extends/s", "on extends/s", "on/off", "off p50 us",
             "on p50 us", "added p50 us", "target", ""],
            [[r["path"], str(r["clients"]), f"{r['extends_per_message']:,}", f"{r['off']['extends_per_s']:,.0f}",
              f"{r['on']['extends_per_s']:,.0f}", f"{r['ratio']:.2f}", _us(r["off"]["p50_us"]),
              _us(r["on"]["p50_us"]), f"{r['added_p50_us']:+,.0f}",
              f">= {JOURNAL_RATIO_TARGET:g}" if r["loaded"] else "latency", mark(r["ok"])]
             for r in j["rows"]],
        ),
        f"  disk floor: {floor['bytes'] // 1024} KiB write + fdatasync into a preallocated file in the journal's "
        f"folder (as the journal writes), {floor['count']} times: p50 {_us(floor['p50_us'])} us, p99 "
        f"{_us(floor['p99_us'])} us (appending to a growing file: p50 {_us(floor['append_p50_us'])} us); "
        f"filesystem {j['filesystem']}",
        f"  best row: {j['best_off_extends_per_s']:,.0f} extends/s off, {j['best_on_extends_per_s']:,.0f} on "
        f"({j['best_ratio']:.2f}); worst loaded row on/off {j['worst_ratio']:.2f} ({j['worst_row']}); the "
        f"target holds for the rows that load the daemon ({PIPELINE_DEPTH} messages in flight); where each "
        "client waits for every reply, each message pays one fdatasync (the 'added p50' column; compare the "
        "disk floor)",
        f"  journal written while timed: {j['journal_bytes'] / 2**20:,.1f} MiB ({rate / 2**20:,.1f} MiB/s); "
        f"compactions: {j['compactions']} (at {j['snapshot_bytes'] / 2**20:,.0f} MiB of WAL)",
    ]
    if j["filesystem"].split(" ", 1)[0] in ("tmpfs", "ramfs"):
        lines.append("  note: the journal's folder is in memory (tmpfs): fdatasync costs nothing here")
    return lines


def _render_rows(step: dict[str, Any]) -> list[str]:
    """Section 2c's lines: the same steps on head-wise and layer-group daemons against the uniform one."""
    rows = step.get("rows") or []
    if not rows:
        return []
    return [f"  2c. the same steps on daemons with other rows (kvcache serve --rows ...), in turns with the uniform "
            f"daemon's (p50 {_us(rows[0]['uniform_p50_us'])} us in these turns)",
            table(["mode", "--rows", "steps", "p50 us", "p99 us", "over uniform", "target", ""],
                  [[r["mode"], r["rows"], f"{r['steps']:,}", _us(r["p50_us"]), _us(r["p99_us"]),
                    ratio(r["over_uniform"]), r["target"], mark(r["ok"])] for r in rows])]


def _render_local(step: dict[str, Any]) -> list[str]:
    local = step["local"]
    if local is None:
        return ["  2b. over the local endpoint: not measured (ipc transport only)"]
    return [
        "  2b. the same steps from a second client over the daemon's local endpoint (Unix datagrams), taking turns "
        "with a raw datagram echo of the same sizes:",
        table(["steps", "p50 us", "p99 us", "datagram echo p50 us", "p50/datagram echo", "p50/ZMQ echo"],
              [[f"{local['steps']:,}", _us(local["p50_us"]), _us(local["p99_us"]), _us(local["echo_p50_us"]),
                ratio(local["p50_over_local_echo_p50"]), ratio(local["p50_over_zmq_echo_p50"])]]),
    ]


def render(result: dict[str, Any]) -> str:
    """The human-readable report: one table per section."""
    cfg, echo, step, lags, prof = result["config"], result["echo"], result["step"], result["lag"], result["profile"]
    lag = lags[0]
    pipe = echo["pipelined"]
    out = [
        f"kvcache bench daemon: transport {cfg['transport']}, python {cfg['python']}, pyzmq {cfg['pyzmq']} "
        f"(libzmq {cfg['libzmq']}), {cfg['cpus']} cpu(s){', quick' if cfg['quick'] else ''}",
        f"  daemon: kvcache serve --num-blocks {cfg['num_blocks']:,} --block-size {cfg['block_size']} --rows full "
        f"--enable-prefix-caching --io-threads {cfg['io_threads']}; {cfg['requests']} requests of {cfg['prompt_tokens']:,}-token prompts",
        "",
        "1. limit: raw ZMQ DEALER/ROUTER echo (own process, pyzmq only) at a real step's sizes",
        table(
            ["request B", "reply B", "round trips", "p50 us", "p99 us"],
            [[f"{echo['request_bytes']:,}", f"{echo['reply_bytes']:,}", f"{echo['round_trips']:,}",
              _us(echo["p50_us"]), _us(echo["p99_us"])]],
        ),
        f"  pipelined: {pipe['message_bytes']} B messages, window {pipe['window']}: "
        f"{pipe['messages_per_s']:,.0f} messages/s",
        "",
        f"2. step round trip: one client.batch() of {step['frees_per_step']} frees + {step['extends_per_step']} "
        f"one-token extends (one extend_many) + {step['admits_per_step']} admits of {step['prompt_tokens']:,} tokens",
        table(
            ["steps", "p50 us", "p99 us", "echo p50 us", "p50/echo", "daemon handle p50 us", "vllm p50 us",
             "vllm p99 us", "vllm/daemon", "target", ""],
            [[f"{step['steps']:,}", _us(step["p50_us"]), _us(step["p99_us"]), _us(step["echo_p50_us"]),
              ratio(step["p50_over_echo_p50"]), _us(step["handle_p50_us"]),
              "-" if step["vllm_p50_us"] is None else _us(step["vllm_p50_us"]),
              "-" if step["vllm_p99_us"] is None else _us(step["vllm_p99_us"]), ratio(step["vllm_over_p50"]),
              step["target"], mark(step["ok"])]],
        ),
        "  vllm = vLLM's own scheduler step on this workload in the bench's process (its KVCacheManager: decode "
        "tokens appended and allocate_slots, Requests built and hashed, get_computed_blocks, allocate_slots, free)"
        if step["vllm"] else "  vllm: not importable here, no peer step measured",
        "  daemon handle = CacheServer.handle in-process on the same messages (section 5): the daemon's share",
        *_render_local(step),
        *_render_rows(step),
        f"  codec floor: the echo server decoding this step and encoding its reply (protocol.unpack/pack, no other "
        f"work), the client encoding the step and decoding the reply: p50 {_us(step['codec_p50_us'])} us = "
        f"{ratio(step['codec_over_echo_p50'])} echo, taking turns with the echo and the steps",
        f"  native floor: the codec floor + the allocator's C work in a step ({_us(prof['native_us']['allocator'])} "
        f"us, section 5) = {_us(step['native_floor_us'])} us = {ratio(step['native_floor_over_echo_p50'])} echo: "
        "the step with no Python in the daemon and none in the client, before the client's own C work",
        "",
        f"3. throughput: extends per second through one daemon ({cfg['seconds']:g} s per row; pre-packed = the "
        "client only splices an id into a packed extend_many and checks 'ok')",
        table(
            ["path", "clients", "extends/msg", "extends/s", "msgs/s", "msg p50 us", "no room", "target", ""],
            [[r["path"], str(r["clients"]), f"{r['extends_per_message']:,}", f"{r['extends_per_s']:,.0f}",
              f"{r['messages_per_s']:,.0f}", _us(r["p50_us"]), str(r["no_room"]),
              f">= {EXTENDS_PER_S_TARGET:,}/s", mark(r["ok"])] for r in result["throughput"]],
        ),
        "",
        *_render_journal(result["journal"], cfg),
        "",
        f"4. delta lag: {lag['subscribers']} subscriber processes, receive - publish time (CLOCK_MONOTONIC), steps "
        f"back to back; {lag['cpus']} cpu(s) for {lag['subscribers']} subscribers + daemon + client"
        f"{' (oversubscribed)' if lag['subscribers'] + 2 > lag['cpus'] else ''}; "
        "SUB sockets on the PUB, then datagrams from the local endpoint",
        table(
            ["transport", "deltas", "received", "bytes/delta", "p50 us", "p99 us", "max us", "worst sub p99", "gaps",
             "step p50 us", "target", ""],
            [[r["transport"], f"{r['deltas']:,}", f"{r['received']:,}", f"{r['delta_bytes_mean']:,.0f}",
              _us(r["p50_us"]), _us(r["p99_us"]), _us(r["max_us"]), _us(r["worst_subscriber_p99_us"]), str(r["gaps"]),
              _us(r["step_p50_us"]), r["target"], mark(r["ok"])] for r in lags],
        ),
        "",
        f"5. profile: CacheServer.handle in-process, {prof['steps']} steps of {prof['message_bytes']:,} B; plain "
        f"p50 {_us(prof['handle_p50_us'])} us, p99 {_us(prof['handle_p99_us'])} us (with --events p50 "
        f"{_us(prof['handle_events_p50_us'])} us); under cProfile "
        f"{_us(prof['profiled_us_per_step'])} us/step; in this package's C extensions (timed without cProfile, "
        f"p50): codec {_us(prof['native_us']['codec'])} us, allocator {_us(prof['native_us']['allocator'])} us",
        f"  call paths below start at {prof['phases'][0]['path']}",
        table(
            ["where", "what", "us/step (profiled)", "share"],
            [[p["phase"], p["what"], _us(p["us"]), f"{100 * p['share']:.0f}%"] for p in prof["phases"]],
            align_left=2,
        ),
        "  most own time:",
        table(
            ["function", "own us/step", "cum us/step", "calls/step"],
            [[t["function"], _us(t["own_us"]), _us(t["cum_us"]), f"{t['calls_per_step']:,.0f}"]
             for t in prof["top"][:8]],
            align_left=1,
        ),
        "",
        f"targets met: {sum(bool(t['ok']) for t in result['targets'])} of {len(result['targets'])}"
        + ("" if step["vllm"] else " (the step's target needs vllm)"),
        *(f"  MISS {t['name']}: {t['value']} (target {t['target']})" for t in result["targets"] if t["ok"] is False),
    ]
    return "\n".join(out)


def _config_from_args(args: argparse.Namespace) -> BenchConfig:
    values: dict[str, Any] = BenchConfig.quick_defaults() if args.quick else {}
    for name in ("transport", "steps", "seconds", "subscribers", "io_threads", "window", "num_blocks", "lag_steps",
                 "profile_steps", "timeout"):
        given = getattr(args, name)
        if given is not None:
            values[name] = given
    if args.clients is not None:
        values["clients"] = tuple(args.clients)
    return BenchConfig(**values)


def _run(args: argparse.Namespace) -> int:
    result = run_benchmark(_config_from_args(args))
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _client_counts(text: str) -> list[int]:
    try:
        return [positive_int(part) for part in text.split(",")]
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated counts like 1,2,4: {exc}") from None


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Register `kvcache bench daemon`."""
    d = BenchConfig()
    q = BenchConfig(**BenchConfig.quick_defaults())
    p = targets.add_parser(
        "daemon",
        allow_abbrev=False,
        help="a real kvcache serve against a raw ZMQ echo: step latency, extend throughput, delta lag, profile",
        description="Start a raw pyzmq echo server and a real `kvcache serve` (block 16, uniform rows, prefix "
        f"caching) on one transport and measure: (1) echo round trips at a real step's request/reply sizes, "
        f"and pipelined echo throughput; (2) step round trips ({d.requests} one-token extends + {d.admits} frees "
        f"+ {d.admits} admits of {d.prompt_tokens:,} tokens in one client.batch()) against the echo and, where "
        f"`vllm` is importable, vLLM's own scheduler step on the same workload in process (target: vLLM's p50 >= "
        f"{VLLM_STEP_TARGET:g}x the daemon's); (3) extends per second from 1..N client processes (target >= "
        f"{EXTENDS_PER_S_TARGET:,}); (3b) the step workload and (3)'s rows against two fresh daemons, one with "
        f"--journal in a /tmp folder (removed afterwards), in turns: extends/s with/without (target >= "
        f"{JOURNAL_RATIO_TARGET:g}) and a 4 KiB fdatasync's cost there; (4) table-delta lag at N subscriber "
        "processes (target p99 <= 1 ms, no seq gaps); (5) a cProfile split of the daemon's step handling. Marks "
        "targets ok/MISS; always exits 0; stops every process it started, also on errors and Ctrl-C.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.add_argument("--quick", action="store_true",
                   help=f"small counts for tests and CI ({q.steps} steps, {q.seconds:g} s per throughput row, "
                   f"clients {','.join(map(str, q.clients))}, {q.fsync_probes} fdatasync probes, {q.lag_steps} lag "
                   f"steps, {q.profile_steps} profiled steps); still runs every section; flags given explicitly win")
    p.add_argument("--transport", choices=("ipc", "tcp"),
                   help="ipc:// sockets in a fresh /tmp folder (default), or tcp:// on 127.0.0.1 with free ports; "
                   "the echo, the daemon and its PUB socket all use it")
    p.add_argument("--steps", type=positive_int, metavar="N",
                   help=f"timed steps in section 2, in {d.rounds} rounds taking turns with as many echo round "
                   f"trips (default {d.steps})")
    p.add_argument("--seconds", type=_positive_float, metavar="S",
                   help=f"duration of each throughput row and of the pipelined echo (default {d.seconds:g})")
    p.add_argument("--clients", type=_client_counts, metavar="N,N,...",
                   help="client process counts for the pre-packed throughput rows "
                   f"(default {','.join(map(str, d.clients))})")
    p.add_argument("--window", type=positive_int, metavar="N",
                   help=f"requests in flight for the pipelined echo (default {d.window})")
    p.add_argument("--subscribers", type=positive_int, metavar="N",
                   help=f"SUB processes timing table deltas in section 4 (default {d.subscribers})")
    p.add_argument("--io-threads", type=positive_int, metavar="N",
                   help=f"the daemons' ZMQ I/O threads (kvcache serve --io-threads; default {d.io_threads})")
    p.add_argument("--num-blocks", type=positive_int, metavar="N",
                   help=f"the daemon's blocks (default {d.num_blocks:,}; the steady set takes about "
                   f"{d.requests * (d.prompt_tokens // d.block_size + 10):,})")
    p.add_argument("--lag-steps", type=positive_int, metavar="N",
                   help=f"steps run while the subscribers time deltas in section 4 (default {d.lag_steps})")
    p.add_argument("--profile-steps", type=positive_int, metavar="N",
                   help=f"steps timed, and again profiled, in section 5 (default {d.profile_steps})")
    p.add_argument("--timeout", type=_positive_float, metavar="S",
                   help=f"deadline of every wait: a reply, a child's start or report (default {d.timeout:g})")
    p.set_defaults(run=_run)

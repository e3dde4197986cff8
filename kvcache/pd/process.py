"""A prefill rank's messager, or a decode rank's receiver, in a process of its own beside the worker.

In the worker's process the messager's threads share the GIL with the model runner, whose Python
holds it while it launches a step's kernels, so the messager wakes on a layer's signal only when
the runner lets go (README, "A model runner that holds the GIL"). ``MessagerProcess`` and
``ReceiverProcess`` (host caches only: see its docstring) take ``PrefillLink``'s and
``DecodeLink``'s arguments (``key_file`` and ``admin`` included: the child claims the rank with them)
and run that link in a spawned child. The child maps the worker's
cache (``kvcache.transfer.sharing``: CUDA IPC, or a shared host file such as
``SharedHostBuffer``), opens the layer signal by name, and makes its own NIXL engine. The worker
hands it each step over a pipe::

    link = MessagerProcess(prefill_endpoint, region, signal, rank)   # as PrefillLink
    link.run_step(signal.begin_step(), reqs, plans)
    ... write each layer, send_cache(stream, signal, layer)
    link.close()

``call(fn, *args)`` runs ``fn(link, region, *args)`` in the child (``fn`` importable by name):
benchmarks read the messager's timings that way. The child exits when the worker closes the link
or dies (its end of the pipe closes). Every wait has a deadline; after the child died, every call
raises KVCacheError saying so, and its transfers fail on both daemons at their deadline.
"""
from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvcache.allocator.errors import KVCacheError
from kvcache.auth import CurveConfig
from kvcache.transfer.regions import KVRegion
from kvcache.transfer.sharing import SharedRegion, share_region
from kvcache.transfer.signal import LayerSignal

__all__ = ["MessagerProcess", "ReceiverProcess"]

log = logging.getLogger("kvcache.pd.process")

START_TIMEOUT_S = 120.0  # the child imports NIXL and maps the cache: seconds on a loaded machine
STOP_TIMEOUT_S = 10.0


class _LinkProcess:
    """A link (``kind`` prefill or decode) running in a spawned child; see the module docstring."""

    kind = ""

    def __init__(self, region: KVRegion, options: dict[str, Any], start_timeout: float) -> None:
        shared = share_region(region)  # refuses memory another process cannot map, before any process starts
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # Messages leave through a sender thread: a child that stopped reading can never stall the worker's step.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name=f"kvcache-{self.kind}-link-send", daemon=True)
        self._sender.start()
        self._call_lock = threading.Lock()
        self._calls = itertools.count(1)  # each call's answer carries its number (0: the start)
        self._closed = False
        self.process = ctx.Process(target=_child_main, args=(child, self.kind, shared, options),
                                   name=f"kvcache-{self.kind}-link", daemon=True)
        try:
            try:
                self.process.start()
            finally:
                child.close()  # the child has its own copy now (or never will)
            self.info: dict[str, Any] = self._reply(0, start_timeout, "start")
        except BaseException:
            self._stop(0.0)
            raise

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> Any:
        """``fn(link, region, *args)`` in the child; its result (picklable), or KVCacheError with the child's error."""
        with self._call_lock:
            number = next(self._calls)
            self._send(("call", number, fn, args))
            return self._reply(number, timeout, getattr(fn, "__name__", "call"))

    @property
    def failures(self) -> list[tuple[Any, str]]:
        """What the link saw fail (also reported to both daemons), as ``PrefillLink.failures``."""
        return self.call(_failures)

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the child (its link closes: transfers in progress fail) within ``timeout``, else kill it. Idempotent."""
        if self._closed:
            return
        self._stop(timeout)

    def __enter__(self) -> _LinkProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stop(self, timeout: float) -> None:
        self._closed = True
        started = self.process.pid is not None
        if started and self.process.is_alive() and timeout > 0:
            self._outbox.put(("stop",))
            self.process.join(timeout)
        if started and self.process.is_alive():
            self.process.terminate()
            self.process.join(2.0)
        if started and self.process.is_alive():
            self.process.kill()
            self.process.join(2.0)
        self._outbox.put(None)
        self._sender.join(2.0)  # a send to a dead child fails at once
        self._conn.close()

    def _send(self, message: tuple) -> None:
        if self._closed:
            raise KVCacheError(f"the {self.kind} link process is closed")
        if not self.process.is_alive():  # a pipe would take a message or two before it noticed
            raise KVCacheError(self._dead())
        self._outbox.put(message)

    def _send_loop(self) -> None:
        while True:
            message = self._outbox.get()
            if message is None:
                return
            try:
                self._conn.send(message)
            except (BrokenPipeError, ConnectionResetError, OSError):  # the child is gone: calls see it, steps fail
                return  # on both daemons at their deadline

    def _reply(self, number: int, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            if self._conn.poll(max(0.0, min(0.05, deadline - time.monotonic()))):
                try:
                    tag, status, value = self._conn.recv()
                except (EOFError, OSError):
                    raise KVCacheError(self._dead()) from None
                if tag != number:  # the late answer to a call that gave up at its deadline
                    continue
                if status == "ok":
                    return value
                raise KVCacheError(f"{self.kind} link process: {what} failed: {value}")
            if not self.process.is_alive():
                raise KVCacheError(self._dead())
            if time.monotonic() >= deadline:
                raise KVCacheError(f"{self.kind} link process (pid {self.process.pid}) did not answer {what} "
                                   f"within {timeout:g} s")

    def _dead(self) -> str:
        self.process.join(0.5)
        return f"the {self.kind} link process (pid {self.process.pid}) exited with code {self.process.exitcode}"


class MessagerProcess(_LinkProcess):
    """``PrefillLink`` in its own process: its arguments (no ``engine``: the child makes its own) and ``run_step``."""

    kind = "prefill"

    def __init__(self, endpoint: str, region: KVRegion, signal: LayerSignal, rank: int, *, timeout: float = 5.0,
                 curve: CurveConfig | None = None, progress: str = "thread",
                 key_file: str | os.PathLike | None = None, admin: int | None = None,
                 start_timeout: float = START_TIMEOUT_S) -> None:
        self.endpoint, self.rank = endpoint, rank
        super().__init__(region, dict(endpoint=endpoint, signal=signal.name, rank=rank, timeout=timeout, curve=curve,
                                      progress=progress, key_file=_path(key_file), admin=admin), start_timeout)

    def run_step(self, step: int, reqs: Sequence[Any], plans: Mapping[Any, dict[str, Any]] | None = None) -> None:
        """As ``PrefillLink.run_step``: hands the step to the child (no reply awaited; it sends as the layers come)."""
        self._send(("run_step", step, list(reqs), dict(plans) if plans else None))


class ReceiverProcess(_LinkProcess):
    """``DecodeLink`` in its own process, for host caches; ``listen_endpoint`` is where its receiver takes notices.

    GPU caches are refused: peers write into the memory a receiver registers, and UCX (cuda_ipc) can
    hand peers only memory that the registering process allocated. Memory it imported over CUDA IPC
    is written through a fallback path (H100: 0.46 GB/s against 1,000+ GB/s), so keep a GPU cache's
    ``DecodeLink`` in the worker. The messager side has no such limit: it writes from its memory.
    """

    kind = "decode"

    def __init__(self, endpoint: str, region: KVRegion, rank: int, *, listen: str = "tcp://127.0.0.1:*",
                 timeout: float = 5.0, curve: CurveConfig | None = None, progress: str = "thread",
                 key_file: str | os.PathLike | None = None, admin: int | None = None, watch: float = 1.0,
                 start_timeout: float = START_TIMEOUT_S) -> None:
        if region.is_cuda:
            raise KVCacheError(f"region: a ReceiverProcess cannot take a GPU cache ({region.device}): peers would "
                               "write it through UCX's slow fallback for imported memory; use DecodeLink in the worker")
        self.endpoint, self.rank = endpoint, rank
        super().__init__(region, dict(endpoint=endpoint, rank=rank, listen=listen, timeout=timeout, curve=curve,
                                      progress=progress, key_file=_path(key_file), admin=admin, watch=watch),
                         start_timeout)
        self.listen_endpoint: str = self.info["endpoint"]


def _path(path: str | os.PathLike | None) -> str | None:
    """A key file's path for the child, absolute: the child's working folder need not be the worker's."""
    return None if path is None else os.path.abspath(path)


def _failures(link: Any, region: KVRegion) -> list[tuple[Any, str]]:
    return list(link.failures)


# --------------------------------------------------------------------------- the child


def _child_main(conn: Any, kind: str, shared: Any, options: dict[str, Any]) -> None:
    """The link process: map the cache, start the link, then follow the worker's commands until stop or EOF."""
    from kvcache.pd.links import DecodeLink, PrefillLink

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s kvcache {kind}-link %(levelname)s %(message)s")
    mapped = signal = link = None
    try:
        mapped = SharedRegion.open(shared)
        if kind == "prefill":
            signal = LayerSignal.open(options.pop("signal"))
            link = PrefillLink(options.pop("endpoint"), mapped.region, signal, options.pop("rank"), **options)
            info: dict[str, Any] = {}
        else:
            link = DecodeLink(options.pop("endpoint"), mapped.region, options.pop("rank"), **options)
            info = {"endpoint": link.receiver.endpoint}
    except BaseException as exc:
        _close_child(link, signal, mapped)
        _answer(conn, 0, "error", f"{type(exc).__name__}: {exc}")
        return
    _answer(conn, 0, "ok", info)
    stopping = False
    try:
        while not stopping:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the worker is gone: stop sending its cache
                log.warning("the worker closed the pipe; stopping")
                break
            if message[0] == "run_step":
                try:
                    link.run_step(*message[1:])
                except Exception:
                    log.exception("run_step failed")
            elif message[0] == "call":
                _, number, fn, args = message
                try:
                    result = fn(link, mapped.region, *args)
                except Exception as exc:
                    _answer(conn, number, "error", f"{type(exc).__name__}: {exc}")
                else:
                    _answer(conn, number, "ok", result)
            elif message[0] == "stop":
                stopping = True
    finally:
        _close_child(link, signal, mapped)


def _answer(conn: Any, number: int, status: str, value: Any) -> None:
    try:
        conn.send((number, status, value))
    except (BrokenPipeError, OSError):
        pass


def _close_child(link: Any, signal: Any, mapped: Any) -> None:
    for part in (link, signal, mapped):
        if part is not None:
            try:
                part.close()
            except Exception:
                log.exception("closing %r failed", part)

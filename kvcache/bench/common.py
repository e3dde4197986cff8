"""What `kvcache bench` targets share: tables, ok/MISS marks, ratios, flag types, child processes."""
from __future__ import annotations

import contextlib
import multiprocessing
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcache.allocator.errors import KVCacheError

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess


_STARTED = time.monotonic()


def run_alone(add_parser: Callable[[Any], None], target: str, argv: Sequence[str] | None = None) -> int:
    """Run one benchmark from its own module (``python -m kvcache.bench.TARGET``, the same flags as
    ``kvcache bench TARGET``), without importing the CLI's other commands."""
    import argparse

    parser = argparse.ArgumentParser(prog="kvcache bench", allow_abbrev=False)
    add_parser(parser.add_subparsers(dest="target", required=True))
    args = parser.parse_args([target, *(argv if argv is not None else sys.argv[1:])])
    return args.run(args)


def progress(text: str) -> None:
    """Say on stderr what a benchmark measures now, with the seconds since it started (the tables go to stdout)."""
    print(f"kvcache bench: [{time.monotonic() - _STARTED:6.1f} s] {text}", file=sys.stderr, flush=True)


class TimedSteps:
    """A scheduler-step workload whose ``step(input)`` is timed one input at a time by ``run``."""

    def step(self, inp: Any) -> None:
        raise NotImplementedError

    def run(self, inputs: Sequence[Any]) -> np.ndarray:
        """ns of each step, one per input (the inputs made before any clock starts)."""
        out = np.empty(len(inputs), dtype=np.int64)
        for i, inp in enumerate(inputs):
            t0 = time.perf_counter_ns()
            self.step(inp)
            out[i] = time.perf_counter_ns() - t0
        return out


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, align_left: int = 0) -> str:
    """Columns two spaces apart, indented by two; right-aligned but for the first ``align_left`` (text)."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    lines = [headers, *rows]
    return "\n".join("  " + "  ".join(c.ljust(w) if i < align_left else c.rjust(w)
                                       for i, (c, w) in enumerate(zip(line, widths))).rstrip() for line in lines)


def mark(ok: bool | None) -> str:
    """A target check as the tables print it: ok, MISS, or - where there is no target."""
    return "-" if ok is None else "ok" if ok else "MISS"


def ratio(value: float | None) -> str:
    """A ratio as ``1.5x`` (``-`` when unknown)."""
    return "-" if value is None else f"{value:.1f}x"


# --------------------------------------------------------------------------- processes


def _child_main(fn: Callable[..., None], conn: Connection, args: tuple) -> None:
    """A child's entry: run ``fn(conn, *args)``; a failure goes back on the pipe instead of dying silently."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops its children
    try:
        fn(conn, *args)
    except (EOFError, BrokenPipeError):
        pass  # the parent is gone
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))


def expect(conn: Connection, kind: str, deadline: float, who: str) -> tuple:
    """The next message ``(kind, ...)`` from a child by ``deadline`` (time.monotonic); else KVCacheError.

    A child that failed sent ``("error", traceback)``: it is raised here with the traceback.
    """
    while True:
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0 or not conn.poll(remaining):
                raise KVCacheError(f"{who}: no {kind!r} message before the deadline")
            msg = conn.recv()
        except (EOFError, OSError):
            raise KVCacheError(f"{who}: exited before sending {kind!r}") from None
        if msg[0] == "error":
            raise KVCacheError(f"{who} failed:\n{msg[1]}")
        if msg[0] == kind:
            return msg


class Fleet:
    """Every process a benchmark starts, and a scratch folder; ``close`` stops them all and removes it.

    Use it in ``try/finally`` (or ``with``): errors and Ctrl-C stop every child too. Children
    are spawned (fresh interpreters: no fork of a process holding zmq threads), ignore SIGINT,
    and are asked to stop with ``("stop",)`` on their pipe, then terminated, then killed.
    """

    def __init__(self, prefix: str = "kvb-") -> None:
        self.folder = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))  # short: unix socket paths are limited
        self.pids: list[int] = []  # everything ever started, for callers that check it is all gone
        self._mp = multiprocessing.get_context("spawn")
        self._children: list[tuple[BaseProcess, Connection]] = []
        self._commands: list[subprocess.Popen] = []

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def spawn(self, fn: Callable[..., None], *args: Any) -> Connection:
        """Run ``fn(conn, *args)`` (a module-level function) in a child; returns the parent's end of the pipe."""
        parent, child = self._mp.Pipe()
        process = self._mp.Process(target=_child_main, args=(fn, child, args), daemon=True)
        process.start()
        child.close()
        self._children.append((process, parent))
        self.pids.append(process.pid)  # type: ignore[arg-type]
        return parent

    def stop(self, conns: Sequence[Connection]) -> None:
        """Stop the children behind ``conns``: ask, then terminate, then kill, 2 s apart at most."""
        chosen = [c for c in self._children if c[1] in conns]
        for _, conn in chosen:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("stop",))
        for process, conn in chosen:
            for end in (None, process.terminate, process.kill):
                if end is not None and process.is_alive():
                    end()
                process.join(2.0)
            conn.close()
            self._children.remove((process, conn))

    def start(self, argv: Sequence[str], ready: bytes, timeout: float, name: str) -> subprocess.Popen:
        """Run a command (output in the folder as NAME.out/.err) until it prints ``ready``; KVCacheError if not."""
        out, err = self.folder / f"{name}.out", self.folder / f"{name}.err"
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            process = subprocess.Popen(list(argv), stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL)
        self._commands.append(process)
        self.pids.append(process.pid)
        deadline = time.monotonic() + timeout
        while ready not in out.read_bytes():
            if process.poll() is not None or time.monotonic() > deadline:
                state = (f"exited with {process.returncode}" if process.returncode is not None
                         else f"not ready within {timeout:g} s")
                raise KVCacheError(f"{name} {state}:\n{err.read_text(errors='replace')[-2000:]}")
            time.sleep(0.02)
        return process

    def terminate(self, process: subprocess.Popen) -> None:
        """SIGTERM a started command, then SIGKILL if it has not exited within 5 s."""
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(5.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5.0)
        self._commands.remove(process)

    def close(self) -> None:
        try:
            self.stop([conn for _, conn in self._children])
        finally:
            for process in list(self._commands):
                self.terminate(process)
            shutil.rmtree(self.folder, ignore_errors=True)

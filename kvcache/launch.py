"""Start a `kvcache serve` process and wait for its ready line: for tools, benchmarks and examples that run one."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from kvcache.allocator.errors import KVCacheError

READY = b"kvcache serve: ready"


def launch_serve(flags: Sequence[str], log: Path) -> subprocess.Popen:
    """Start ``kvcache serve FLAGS`` with its output in ``log``; ``wait_ready`` then waits for it."""
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "kvcache", "serve", *flags], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def wait_ready(process: subprocess.Popen, log: Path, timeout: float = 30.0) -> None:
    """Return once the daemon printed its ready line; raise (with its log) if it exited or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while READY not in log.read_bytes():
        if process.poll() is not None or time.monotonic() > deadline:
            why = f"exited with {process.returncode}" if process.poll() is not None else f"not ready in {timeout:g} s"
            raise KVCacheError(f"kvcache serve {why}:\n{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.02)


def start_serve(flags: Sequence[str], log: Path, timeout: float = 30.0) -> subprocess.Popen:
    """``launch_serve`` and ``wait_ready``: a daemon ready for clients (stop it with ``stop_serve``)."""
    process = launch_serve(flags, log)
    try:
        wait_ready(process, log, timeout)
    except BaseException:
        stop_serve(process)
        raise
    return process


def stop_serve(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)

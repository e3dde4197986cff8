"""Shared fixtures: a real `kvcache serve` daemon in a subprocess."""
from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
from hypothesis import HealthCheck, settings

READY = b"kvcache serve: ready"

# How long one example takes says nothing about the code on a loaded machine: no per-example deadline, and no
# health check failing a test for slow data generation. Loaded before the test modules apply their @settings.
settings.register_profile("kvcache", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvcache")


@dataclasses.dataclass
class Daemon:
    """A running `kvcache serve` process and the scheduler endpoint it listens on."""

    endpoint: str
    process: subprocess.Popen
    folder: Path

    def log(self) -> str:
        """What the daemon wrote to stdout and stderr so far (for failure messages)."""
        return "".join((self.folder / name).read_text(errors="replace") for name in ("stdout", "stderr"))

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: the daemon dies without closing its sockets."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5.0)


@pytest.fixture
def daemon() -> Iterator[Callable[..., Daemon]]:
    """Factory: ``daemon("--num-blocks", "100", ...)`` starts `kvcache serve` and returns once it is ready.

    Sockets live in a short /tmp folder (unix socket paths are limited to
    about 107 bytes); every daemon is stopped and its folder removed at
    teardown.
    """
    started: list[Daemon] = []

    def start(*flags: str, ready_timeout: float = 30.0, folder: Path | None = None) -> Daemon:
        """Start a daemon; ``folder`` reuses an earlier one's (same endpoint: a restart)."""
        folder = folder or Path(tempfile.mkdtemp(prefix="kv-", dir="/tmp"))
        endpoint = f"ipc://{folder}/k.sock"
        with open(folder / "stdout", "wb") as out, open(folder / "stderr", "wb") as err:
            process = subprocess.Popen([sys.executable, "-m", "kvcache", "serve", "--endpoint", endpoint, *flags],
                                       stdout=out, stderr=err, stdin=subprocess.DEVNULL)
        d = Daemon(endpoint, process, folder)
        started.append(d)
        deadline = time.monotonic() + ready_timeout
        while READY not in (folder / "stdout").read_bytes():
            if process.poll() is not None:
                raise RuntimeError(f"kvcache serve exited with {process.returncode}:\n{d.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvcache serve not ready within {ready_timeout:g} s:\n{d.log()}")
            time.sleep(0.02)
        return d

    yield start
    for d in started:
        d.stop()
        shutil.rmtree(d.folder, ignore_errors=True)


def free_port() -> int:
    """A free port of 127.0.0.1, under the ephemeral range where there is room (see _below_ephemeral_ports)."""
    ports = _below_ephemeral_ports()
    for _ in range(50):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", random.SystemRandom().choice(ports) if len(ports) > 1000 else 0))
            except OSError:
                continue
            return probe.getsockname()[1]
    raise RuntimeError("no free port")


def _below_ephemeral_ports() -> range:
    """Ports under the kernel's ephemeral range: no outgoing connection takes one between our probe and the bind."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(1024, low - 10_000), max(1024, low - 5))


@pytest.fixture
def tcp_endpoint() -> str:
    """``tcp://127.0.0.1:PORT`` whose port and next four are free (a daemon's PUB, replay and event sockets)."""
    ports = _below_ephemeral_ports()
    for _ in range(50):
        if len(ports) > 1000:
            base = random.SystemRandom().choice(ports)
        else:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                base = probe.getsockname()[1]
        if base > 65000:
            continue
        held: list[socket.socket] = []
        try:
            for port in range(base, base + 5):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return f"tcp://127.0.0.1:{base}"
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError("no run of 5 free ports")


@dataclasses.dataclass
class SmallDisk:
    """A tmpfs of a few MiB that a test can fill."""

    path: Path

    def fill(self, name: str = "filler") -> Path:
        """Write zeros to ``path/name`` until the disk is full; returns the file (delete it to free the space)."""
        filler = self.path / name
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(bytes(1 << 16))
                    f.flush()
            except OSError:
                pass
        return filler


@pytest.fixture
def small_disk(request, tmp_path) -> Iterator[SmallDisk]:
    """A tmpfs of ``request.param`` (default 24m) mounted for the test (root only; skipped where not allowed)."""
    size = getattr(request, "param", "24m")
    folder = tmp_path / "disk"
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (and a kernel that allows it here)")
    yield SmallDisk(folder)
    subprocess.run(["umount", "-l", str(folder)], check=True)

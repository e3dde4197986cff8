"""The daemon's bound sockets: one daemon per path, owner-only socket files, and nothing left behind on exit."""
from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache.allocator.errors import KVCacheError
from kvcache.auth import check_ipc_permissions
from kvcache.client import CacheClient
from kvcache.listeners import Listeners

FLAGS = ("--num-blocks", "16", "--block-size", "4")
# Every socket file of a daemon on ipc://FOLDER/k.sock with --events, and its lock file beside it.
SOCKETS = ("k.sock", "k-pub.sock", "k-replay.sock", "k-events.sock", "k-events-replay.sock", "k-local.sock")


def serve_once(endpoint: str, *flags: str) -> subprocess.CompletedProcess:
    """A `kvcache serve` that is expected to refuse to start (killed after 20 s otherwise)."""
    return subprocess.run([sys.executable, "-m", "kvcache", "serve", "--endpoint", endpoint, *FLAGS, *flags],
                          capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)


def test_a_second_daemon_on_a_live_daemons_path_is_refused_naming_its_pid(daemon):
    """The second exits non-zero with one line naming the endpoint and the first daemon's pid; the first keeps its
    socket and answers."""
    first = daemon(*FLAGS)
    second = serve_once(first.endpoint)
    lock = first.folder / "k.sock.lock"
    assert second.returncode == 2 and "ready" not in second.stdout
    assert second.stderr.splitlines() == [
        f"kvcache serve: error: endpoint: {first.endpoint} is in use by a running kvcache serve (pid "
        f"{first.process.pid}, lock {lock}); stop it or choose another path"]
    assert lock.read_text() == f"{first.process.pid}\n"
    with CacheClient(first.endpoint, timeout=5) as client:
        assert client.ping()


def test_a_daemon_killed_with_sigkill_leaves_files_that_the_next_start_replaces(daemon):
    """kill -9 leaves the socket and lock files; their lock died with the process, so a new daemon takes them."""
    first = daemon(*FLAGS)
    first.kill()
    assert (first.folder / "k.sock").exists() and (first.folder / "k.sock.lock").exists()
    second = daemon(*FLAGS, folder=first.folder)
    with CacheClient(second.endpoint, timeout=5) as client:
        assert client.ping()
    assert (first.folder / "k.sock.lock").read_text() == f"{second.process.pid}\n"


def test_a_second_daemon_on_a_tcp_port_in_use_is_refused_in_one_line(daemon, tcp_endpoint):
    daemon("--endpoint", tcp_endpoint, *FLAGS)
    second = serve_once(tcp_endpoint)
    assert second.returncode == 2 and "ready" not in second.stdout
    assert second.stderr.splitlines() == [(
        f"kvcache serve: error: endpoint: cannot bind {tcp_endpoint}: the address is in use (another kvcache serve, "
        "or another program, listens there); stop it or choose another port")]
    with CacheClient(tcp_endpoint, timeout=5) as client:
        assert client.ping()


def test_every_socket_file_is_owner_only_and_removed_with_its_lock_on_sigterm(daemon):
    """With --events on ipc: the scheduler, deltas, replay, events, events replay and local sockets are all
    owner-only, each beside a 0600 lock file holding the pid; SIGTERM removes every one of them."""
    d = daemon(*FLAGS, "--events")
    for name in SOCKETS:
        check_ipc_permissions(d.folder / name)
        lock = d.folder / f"{name}.lock"
        assert stat.S_IMODE(lock.stat().st_mode) == 0o600 and lock.read_text() == f"{d.process.pid}\n", name
    d.stop()
    assert d.process.returncode == 0, d.log()
    assert sorted(p.name for p in d.folder.iterdir()) == ["stderr", "stdout"]


def test_a_path_is_claimed_by_one_listeners_at_a_time(tmp_path: Path):
    """The lock is per open file, so it also holds between two Listeners of one process; closing releases it."""
    path = tmp_path / "x.sock"
    first, second = Listeners(), Listeners()
    sock = first.bind_datagram(path, "local_endpoint")
    try:
        with pytest.raises(KVCacheError, match=r"local_endpoint: .*x\.sock is in use by a running kvcache serve"):
            second.bind_datagram(path, "local_endpoint")
        assert path.is_socket()  # the refused claim left the first's socket alone
    finally:
        sock.close()
        first.close()
    assert list(tmp_path.iterdir()) == []
    second.bind_datagram(path, "local_endpoint").close()
    second.close()
    assert list(tmp_path.iterdir()) == []


def test_two_sockets_of_one_daemon_on_one_path_are_refused_naming_the_second(tmp_path: Path):
    """Binding the second would replace the first's socket file and leave the first unreachable."""
    listeners = Listeners()
    path = tmp_path / "x.sock"
    listeners.bind_datagram(path, "local_endpoint").close()
    try:
        with pytest.raises(KVCacheError, match=r"^pub_endpoint: .*x\.sock is already one of this daemon's sockets"):
            listeners.bind_datagram(path, "pub_endpoint")
    finally:
        listeners.close()
    assert list(tmp_path.iterdir()) == []

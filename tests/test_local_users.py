"""Another user on the same host: they may not put sockets where the daemon's clients connect, nor host files under
a worker's tier.

The other user is `nobody` (uid/gid 65534), played by subprocesses that drop to it; the tests need root to do that.
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcache.allocator.errors import KVCacheError
from kvcache.client import CacheClient
from kvcache.launch import stop_serve
from kvcache.transfer.manager import map_host_file
from kvcache.worker import TableSubscriber
from test_tier import make_spec

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="playing another user (nobody) needs root")

NOBODY = 65534
FLAGS = ("--num-blocks", "16", "--block-size", "4")
READY = b"ready"


def as_nobody() -> None:
    """preexec_fn: become uid/gid 65534 for good."""
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)


def nobody_runs(command: str) -> None:
    """Run the shell ``command`` as nobody; it must succeed."""
    out = subprocess.run(["/bin/sh", "-c", command], preexec_fn=as_nobody, cwd="/", capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr


def serve(*args: str, env: dict[str, str] | None = None, umask: int = 0o022,
          wait: float = 20.0) -> tuple[subprocess.Popen, str, str]:
    """A `kvcache serve`: (the process, its stdout, its stderr) once it is ready or has exited (killed after ``wait``
    seconds otherwise); a ready one is still running."""

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen([sys.executable, "-m", "kvcache", "serve", *args, *FLAGS], stdout=out, stderr=err,
                                   stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}, cwd="/",
                                   preexec_fn=lambda: os.umask(umask))
        deadline = time.monotonic() + wait
        while process.poll() is None and time.monotonic() < deadline:
            out.seek(0)
            if READY in out.read():
                break
            time.sleep(0.05)
        else:
            if process.poll() is None:
                process.kill()
                process.wait(5)
        out.seek(0)
        err.seek(0)
        return process, out.read().decode(), err.read().decode()


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A root-owned sticky folder that every user may write, like /tmp and /dev/shm."""
    folder = Path(tempfile.mkdtemp(prefix="kv-users-", dir="/tmp"))
    os.chmod(folder, 0o1777)
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=False)


def refusal(path: Path, owner: str, mode: str, fix: str, field: str = "endpoint") -> str:
    return (f"{field}: refusing the socket folder {path}: owned by {owner} with mode {mode}, so another user could "
            f"answer in the daemon's place; it must be owned by root and writable by its owner alone: {fix}")


NOBODYS = "nobody (uid 65534)"
REMOVE = "remove it (as its owner or root) or choose another path"


# ---------------------------------------------------------------------------------------------- the daemon


@pytest.mark.parametrize("how", ["XDG_RUNTIME_DIR", "--endpoint"])
def test_serve_refuses_a_socket_folder_another_user_made(shared_tmp: Path, how: str) -> None:
    """Another user made the runtime folder first (as with /tmp/kvcache-$UID) and opened it to all: the daemon
    exits non-zero with one line naming the folder, its owner, its mode and the fix, and binds nothing there."""
    folder = shared_tmp / "kvcache"
    nobody_runs(f"mkdir {folder} && chmod 777 {folder}")
    if how == "XDG_RUNTIME_DIR":
        process, out, err = serve(env={"XDG_RUNTIME_DIR": str(shared_tmp)})
    else:
        process, out, err = serve("--endpoint", f"ipc://{folder}/k.sock")
    stop_serve(process)
    assert process.returncode == 2 and "ready" not in out, out + err
    assert err.splitlines() == [f"kvcache serve: error: {refusal(folder, NOBODYS, '0777', REMOVE)}"]
    assert os.listdir(folder) == []


def test_serve_refuses_its_own_folder_when_others_may_write_it(shared_tmp: Path) -> None:
    """A folder of ours that group or others may write is refused too, with chmod as the fix."""
    folder = shared_tmp / "ours"
    folder.mkdir()
    os.chmod(folder, 0o777)
    process, out, err = serve("--endpoint", f"ipc://{folder}/k.sock")
    stop_serve(process)
    fix = f"chmod go-w {folder}, or remove it and choose another path"
    assert process.returncode == 2, out + err
    assert err.splitlines() == [f"kvcache serve: error: {refusal(folder, 'root (uid 0)', '0777', fix)}"]


def test_serve_refuses_a_folder_under_one_another_user_may_rename(shared_tmp: Path) -> None:
    """Our own 0700 folder inside a folder that nobody owns is theirs to move aside and replace: refused, naming the
    folder above."""
    theirs = shared_tmp / "theirs"
    nobody_runs(f"mkdir -m 755 {theirs}")
    ours = theirs / "ours"
    ours.mkdir(mode=0o700)
    process, out, err = serve("--endpoint", f"ipc://{ours}/k.sock")
    stop_serve(process)
    assert process.returncode == 2, out + err
    assert err.splitlines() == [
        f"kvcache serve: error: endpoint: refusing the folder above the socket folder {theirs}: owned by {NOBODYS} "
        f"with mode 0755, so another user could answer in the daemon's place; it must be owned by root and writable "
        f"by its owner alone: {REMOVE}"]


def test_serve_creates_the_default_folder_and_those_above_it_owner_only(tmp_path: Path) -> None:
    """With XDG_RUNTIME_DIR naming a folder not made yet, every folder the daemon creates is 0700, whatever the
    umask; clients, local ones included, and workers reach it."""
    base = tmp_path / "run" / "user"
    process, out, err = serve(env={"XDG_RUNTIME_DIR": str(base)}, umask=0o002)
    try:
        assert READY.decode() in out, out + err
        for folder in (tmp_path / "run", base, base / "kvcache"):
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
        endpoint = f"ipc://{base}/kvcache/kvcache.sock"
        with CacheClient(endpoint, timeout=5, local=True) as client:
            assert client.ping()
            assert client.admit("r", list(range(8))) is not None
            assert client.local_endpoint == f"{base}/kvcache/kvcache-local.sock"
        sub = TableSubscriber(endpoint, timeout=5, local=True)
        assert sub.local
        sub.close()
    finally:
        stop_serve(process)
    assert process.returncode == 0, out + err


# ---------------------------------------------------------------------------------------------- clients and workers


def test_clients_and_workers_refuse_a_daemon_in_another_users_folder(shared_tmp: Path) -> None:
    """A daemon answers in a folder that nobody owns (whoever owns the folder decides who answers there): a root
    client or worker given that endpoint refuses before it connects, naming the folder and its owner."""
    folder = shared_tmp / "impostor"
    folder.mkdir(mode=0o700)
    endpoint = f"ipc://{folder}/k.sock"
    process, out, err = serve("--endpoint", endpoint)
    try:
        assert READY.decode() in out, out + err
        with CacheClient(endpoint, timeout=5) as client:
            assert client.ping()
        os.chown(folder, NOBODY, NOBODY)  # now nobody's: they may move the socket aside and bind their own
        line = refusal(folder, NOBODYS, "0700", REMOVE)
        with pytest.raises(KVCacheError) as refused:
            with CacheClient(endpoint, timeout=2) as client:
                client.ping()
        assert str(refused.value) == line
        with pytest.raises(KVCacheError) as refused:
            TableSubscriber(endpoint, timeout=2)
        assert str(refused.value) == line
    finally:
        stop_serve(process)


def test_clients_and_workers_refuse_a_folder_others_may_write(shared_tmp: Path) -> None:
    """A folder of ours that others may write (anyone could bind there) is refused before connecting."""
    folder = shared_tmp / "open"
    folder.mkdir()
    os.chmod(folder, 0o757)
    endpoint = f"ipc://{folder}/k.sock"
    line = refusal(folder, "root (uid 0)", "0757", f"chmod go-w {folder}, or remove it and choose another path")
    for connect in (lambda: CacheClient(endpoint, timeout=1).ping(), lambda: TableSubscriber(endpoint, timeout=1)):
        with pytest.raises(KVCacheError) as refused:
            connect()
        assert str(refused.value) == line


def test_a_socket_folder_that_is_a_symbolic_link_is_refused(shared_tmp: Path, tmp_path: Path) -> None:
    """A link another user may have put where the folder should be is never followed, not even to a good folder."""
    link = shared_tmp / "link"
    nobody_runs(f"ln -s {tmp_path} {link}")
    with pytest.raises(KVCacheError) as refused:
        CacheClient(f"ipc://{link}/k.sock", timeout=1).ping()
    assert str(refused.value) == (f"endpoint: the socket folder {link} is a symbolic link (to {tmp_path}), which "
                                  f"another user may have made; give the real folder's path")


# ---------------------------------------------------------------------------------------------- host files


def test_a_host_file_that_is_a_symbolic_link_is_refused_and_its_target_untouched(shared_tmp: Path,
                                                                                  tmp_path: Path) -> None:
    """nobody links the host file's path to a file of root's: the link is not followed, the file keeps its bytes."""
    target = tmp_path / "roots"
    target.write_bytes(b"root's data")
    os.chmod(target, 0o600)
    path = shared_tmp / "kvcache-host-rank0"
    nobody_runs(f"ln -s {target} {path}")
    with pytest.raises(KVCacheError) as refused:
        map_host_file(path, make_spec("bf16"), 4)
    assert str(refused.value) == (f"host_file: {str(path)!r} is a symbolic link, which is never followed (another "
                                  f"user could point it at a file of ours); give the path of a file of your own")
    assert target.read_bytes() == b"root's data"


def test_a_host_file_another_user_made_is_refused(shared_tmp: Path) -> None:
    """A 0666 file nobody made first at the host file's path (they could read the KV and write blocks) is refused
    and left as it was."""
    path = shared_tmp / "kvcache-host-rank0"
    nobody_runs(f"printf bait > {path} && chmod 666 {path}")
    with pytest.raises(KVCacheError) as refused:
        map_host_file(path, make_spec("bf16"), 4)
    assert str(refused.value) == (
        f"host_file: refusing {str(path)!r} (owned by {NOBODYS}, mode 0666): another user could read the offloaded KV "
        f"or write into its blocks; a host file must be a regular file of uid 0 with mode 0600: remove it (a new "
        f"one is created 0600) or choose another path")
    assert path.read_bytes() == b"bait"


def test_a_host_file_of_ours_that_others_may_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "host"
    path.write_bytes(b"")
    os.chmod(path, 0o640)
    with pytest.raises(KVCacheError, match=r"\(owned by root \(uid 0\), mode 0640\)"):
        map_host_file(path, make_spec("bf16"), 4)
    os.chmod(path, 0o600)
    map_host_file(path, make_spec("bf16"), 4)


def test_a_new_host_file_is_created_0600_and_mapped_again_by_a_restarted_worker(shared_tmp: Path) -> None:
    """Whatever the umask, a new host file is owner-only; the next process of the same user maps it, same id."""
    path = shared_tmp / "kvcache-host-rank0"
    old = os.umask(0)
    try:
        _, first = map_host_file(path, make_spec("bf16"), 4)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == 0
    assert map_host_file(path, make_spec("bf16"), 4)[1] == first

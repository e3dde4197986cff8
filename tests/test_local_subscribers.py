"""Who receives a worker's deltas on the local endpoint: that worker while it lives, and nobody after it.

The deltas name request ids and hold their tables. A worker's socket is a file beside the local endpoint, in the
daemon user's owner-only folder, so only that user (or root) can bind its address again once the worker is gone;
the daemon takes subscriptions from no other address. The daemons here beat their heartbeat once a minute, so any
datagram a test sees comes from a step it made, and a worker forgotten at once was forgotten for its goodbye.
"""
from __future__ import annotations

import ast
import os
import select
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvcache.client import CacheClient
from kvcache.protocol import LOCAL_MAX_BYTES, LOCAL_SUBSCRIBE, unpack
from kvcache.worker import TableSubscriber

FLAGS = ("--rows", "full", "--block-size", "4", "--num-blocks", "64", "--heartbeat-ms", "60000")
NOBODY = 65534

# A worker process: subscribes at the local endpoint, prints its socket's address, then waits to be killed.
WORKER = """
import sys
from kvcache.worker import TableSubscriber
sub = TableSubscriber(sys.argv[1], max_slots=8, max_blocks=16, local=True)
print(repr(sub._local.getsockname()) if sub.local else "pub", flush=True)
sys.stdin.read()
"""

# Another process that takes a gone worker's address (as ``uid``: it drops to it once Python has started, since
# the interpreter lives where uid 65534 cannot read), then counts the datagrams reaching it until its stdin closes.
IMPOSTOR = """
import ast, os, select, socket, sys
address, uid = ast.literal_eval(sys.argv[1]), int(sys.argv[2])
if uid != os.geteuid():
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
try:
    if isinstance(address, str) and os.path.lexists(address):
        os.unlink(address)  # the gone worker's file
    sock.bind(address)
except OSError as exc:
    print("refused:", exc.strerror, flush=True)
else:
    print("bound", flush=True)
count = 0
while True:
    ready, _, _ = select.select([sock, sys.stdin], [], [], 30)
    if sock not in ready:
        break  # stdin closed: the test made its steps
    sock.recv(1 << 17)
    count += 1
print(count, flush=True)
"""


def start_worker(endpoint: str) -> tuple[subprocess.Popen, str | bytes]:
    """A worker process subscribed at the local endpoint, and its socket's address."""
    worker = subprocess.Popen([sys.executable, "-c", WORKER, endpoint], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    line = worker.stdout.readline()
    assert line and line != "pub\n", f"the worker did not take the local endpoint: {line!r}"
    return worker, ast.literal_eval(line)


def start_impostor(address: str | bytes, uid: int) -> tuple[subprocess.Popen, str]:
    """An impostor process on ``address`` as ``uid``, and what its bind said ("bound" or "refused: ...")."""
    impostor = subprocess.Popen([sys.executable, "-c", IMPOSTOR, repr(address), str(uid)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd="/")
    return impostor, impostor.stdout.readline().strip()


def received(impostor: subprocess.Popen) -> int:
    """How many datagrams reached the impostor (it stops once its stdin closes)."""
    impostor.stdin.close()
    count = impostor.stdout.readline()
    impostor.wait(10)
    return int(count)


def admit_some(client: CacheClient, live: TableSubscriber, first: int, n: int = 5) -> None:
    """``n`` admits; returns once the daemon sent their deltas to every local subscriber.

    The daemon answers a turn's messages before it sends the turn's deltas, so a reply alone does not say
    they went out: ``live`` (a local subscriber) having the last one does, and a call after that comes
    in a later turn than the sends to the others.
    """
    for rid in range(first, first + n):
        assert client.admit(rid, np.arange(10) + rid) is not None
    live.wait_for(client.last_seq, timeout=10, epoch=client.last_epoch)
    client.stats()


def witness(endpoint: str) -> TableSubscriber:
    """A live local subscriber."""
    sub = TableSubscriber(endpoint, max_slots=64, max_blocks=16, local=True)
    assert sub.local
    return sub


def subscribers(client: CacheClient, want: int, within: float) -> int:
    """The daemon's count of local subscribers, once it is ``want`` or ``within`` seconds have passed."""
    deadline = time.monotonic() + within
    while (count := client.stats()["local_subscribers"]) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return count


def kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(10)


def test_a_worker_takes_every_delta_from_a_socket_file_beside_the_endpoint(daemon):
    """The worker's address is a 0600 socket file in the endpoint's folder; every step's delta reaches it as a
    datagram (no replay needed), and closing removes the file."""
    d = daemon(*FLAGS)
    with CacheClient(d.endpoint) as c, TableSubscriber(d.endpoint, max_slots=64, max_blocks=16, local=True) as sub:
        address = sub._local.getsockname()
        assert sub.local and isinstance(address, str)
        assert Path(address).parent == d.folder and Path(address).name.startswith("worker-")
        info = os.lstat(address)
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
        replays, snapshots = sub.replays, sub.snapshots
        for rid in range(12):
            table = c.admit(rid, np.arange(8) + 100 * rid)
            if rid % 3 == 2:
                c.free(rid - 1)
            sub.wait_for(c.last_seq, timeout=10, epoch=c.last_epoch)
            assert sub.table(rid).tolist() == table.table.tolist()
        assert (sub.replays, sub.snapshots) == (replays, snapshots)
        assert sorted(sub.requests) == sorted(set(range(12)) - {1, 4, 7, 10})
    assert not os.path.lexists(address)


@pytest.mark.skipif(os.geteuid() != 0, reason="playing another user (nobody) needs root")
def test_another_user_cannot_take_a_killed_workers_address_and_gets_no_delta(daemon):
    """A worker is killed (no goodbye); another user binds its address before the daemon sends again: the next
    admits' deltas reach that user not at all, and only the live worker, which gets every one."""
    d = daemon(*FLAGS)
    with CacheClient(d.endpoint) as c, witness(d.endpoint) as live:
        worker, address = start_worker(d.endpoint)
        try:
            assert c.stats()["local_subscribers"] == 2
            kill(worker)
            impostor, bound = start_impostor(address, NOBODY)
            try:
                admit_some(c, live, 0)
                assert received(impostor) == 0, f"the impostor on {address!r} ({bound}) received deltas"
                assert bound == "refused: Permission denied"
            finally:
                kill(impostor)
        finally:
            kill(worker)
        assert [live.table(rid).tolist() for rid in range(5)] == [c.table(rid).tolist() for rid in range(5)]
        assert c.stats()["local_subscribers"] == 1  # the killed worker, forgotten at the first delta
    assert not os.path.lexists(address)  # and its socket file removed


def test_a_worker_that_closes_is_forgotten_at_once_and_its_address_gets_nothing(daemon):
    """Closing says goodbye: the daemon forgets the worker before any send (the heartbeat is a minute away), and
    a process that binds the same address afterwards receives no delta of the next admits."""
    d = daemon(*FLAGS)
    with CacheClient(d.endpoint) as c, witness(d.endpoint) as live:
        sub = TableSubscriber(d.endpoint, max_slots=8, max_blocks=16, local=True)
        address = sub._local.getsockname()
        assert c.stats()["local_subscribers"] == 2
        sub.close()
        assert not os.path.lexists(address)
        assert subscribers(c, 1, within=2.0) == 1
        impostor, bound = start_impostor(address, os.geteuid())
        try:
            admit_some(c, live, 0)
            assert received(impostor) == 0
            assert bound == "bound"
        finally:
            kill(impostor)


def test_a_killed_worker_is_forgotten_at_the_next_delta_and_its_file_removed(daemon):
    d = daemon(*FLAGS)
    with CacheClient(d.endpoint) as c, witness(d.endpoint) as live:
        worker, address = start_worker(d.endpoint)
        kill(worker)
        assert os.path.lexists(address) and c.stats()["local_subscribers"] == 2
        admit_some(c, live, 0, n=1)
        assert c.stats()["local_subscribers"] == 1
        assert not os.path.lexists(address)


@pytest.mark.parametrize("where", ["abstract", "another folder"])
def test_a_subscription_from_outside_the_endpoints_folder_is_refused_and_sent_nothing(daemon, tmp_path, where):
    """An abstract name (which anyone may bind once its owner is gone) or a socket file elsewhere may not take
    the deltas: the daemon answers with an error naming its folder, counts no subscriber and sends no delta."""
    d = daemon(*FLAGS)
    with CacheClient(d.endpoint) as c, witness(d.endpoint) as live:
        local = c.info()["local_endpoint"]
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            if where == "abstract":
                sock.bind(b"\0kvcache-worker-" + os.urandom(16).hex().encode())
            else:
                sock.bind(str(tmp_path / "w.sock"))
            sock.connect(local)
            sock.send(LOCAL_SUBSCRIBE)
            sock.settimeout(10)
            reply = unpack(sock.recv(LOCAL_MAX_BYTES + 1), LOCAL_MAX_BYTES)
            assert reply["ok"] is False
            assert reply["error"].startswith("subscribe: the worker's address ")
            assert f"is not a socket file in {d.folder}: another user could take it" in reply["error"]
            assert c.stats()["local_subscribers"] == 1
            admit_some(c, live, 0, n=2)
            assert select.select([sock], [], [], 0.5)[0] == []
        finally:
            sock.close()

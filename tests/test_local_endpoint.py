"""The daemon's local endpoint (a Unix datagram socket) against real `kvcache serve` processes."""
from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from kvcache.client import CacheClient, DaemonUnavailable
from kvcache.config import LOCAL_OFF, ServeConfig
from kvcache.protocol import LOCAL_MAX_BYTES, pack, unpack


def _datagram_socket() -> socket.socket:
    """A raw client socket as the protocol describes it: bound to an address of its own, with a deadline."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("")
    sock.settimeout(5)
    return sock


def _ask(sock: socket.socket, path: str, message: dict) -> dict:
    sock.sendto(msgpack.packb(message), path)
    return msgpack.unpackb(sock.recv(LOCAL_MAX_BYTES + 1), raw=False, strict_map_key=False)


def _local_path(d) -> str:
    with CacheClient(d.endpoint) as client:
        return client.info()["local_endpoint"]


def test_local_client_gives_the_same_results_as_a_zmq_client(daemon):
    """The same random steps through a local client and a ZMQ-only client (two twin daemons) agree exactly."""
    flags = ("--num-blocks", "60", "--block-size", "4", "--rows", "window:16:4*2,full*2", "--hash-seed", "s")
    local_daemon, zmq_daemon = daemon(*flags), daemon(*flags)
    rng = np.random.default_rng(7)
    live: list[int] = []
    with CacheClient(local_daemon.endpoint, local=True) as near, CacheClient(zmq_daemon.endpoint) as far:
        assert near.ping() and far.ping()
        assert near.local_endpoint == str(local_daemon.folder / "k-local.sock")
        assert far.local_endpoint is None
        for step in range(200):
            action = rng.integers(3) if live else 0
            if action == 0:
                prompt = rng.integers(0, 9, rng.integers(1, 20))
                got, want = near.admit(step, prompt), far.admit(step, prompt)
                assert (got is None) == (want is None)
                if want is not None:
                    assert got.num_cached_tokens == want.num_cached_tokens
                    assert np.array_equal(got.table, want.table)
                    live.append(step)
            elif action == 1:
                batch_near, batch_far = near.batch(), far.batch()
                for rid in live:
                    tokens = rng.integers(0, 9, rng.integers(1, 3))
                    batch_near.extend(rid, tokens)
                    batch_far.extend(rid, tokens)
                for got, want in zip(batch_near.send(), batch_far.send()):
                    assert (got is None) == (want is None)
                    if want is not None:
                        assert np.array_equal(got, want)
            else:
                rid = live.pop(rng.integers(len(live)))
                near.free(rid)
                far.free(rid)
            assert near.num_free_blocks.tolist() == far.num_free_blocks.tolist()
            assert near.last_seq == far.last_seq
        near.check_integrity()


def test_a_datagram_request_written_from_the_protocol_gets_its_reply(daemon):
    """A client written only from protocol.py's text: one datagram in, one reply datagram back to its address."""
    d = daemon("--num-blocks", "40", "--block-size", "4")
    path = _local_path(d)
    with _datagram_socket() as sock:
        tokens = np.arange(10, dtype="<u4")
        array = msgpack.ExtType(1, bytes([2, 1]) + (10).to_bytes(4, "little") + tokens.tobytes())
        reply = _ask(sock, path, {"v": 2, "client": "raw", "id": 11,
                                  "ops": [{"op": "admit", "req": "r", "tokens": array}, {"op": "ping"}]})
        assert reply["ok"] and reply["id"] == 11
        admitted, pong = reply["results"]
        assert pong == "pong" and admitted["num_tokens"] == 10 and admitted["cached"] == 0
        # The same (client, id) again is answered from memory, not applied twice.
        again = _ask(sock, path, {"v": 2, "client": "raw", "id": 11,
                                  "ops": [{"op": "admit", "req": "r", "tokens": array}, {"op": "ping"}]})
        assert again == reply
        bad = _ask(sock, path, {"v": 2, "client": "raw", "id": 12, "ops": [{"op": "free", "req": "nobody"}]})
        assert not bad["ok"] and "ops[0].req" in bad["error"]
    with CacheClient(d.endpoint) as client:
        assert client.usage.per_row.tolist() == [3 / 40]  # one admit of 10 tokens in blocks of 4


def test_a_reply_too_big_for_a_datagram_is_fetched_over_zmq_and_applied_once(daemon):
    """The daemon answers "resend"; the same id over ZMQ gets the kept reply; the op ran once."""
    d = daemon("--num-blocks", "30000", "--block-size", "1")
    path = _local_path(d)
    with CacheClient(d.endpoint, local=True) as client:
        assert client.admit("big", np.arange(20_000)) is not None  # over ZMQ: the request is too big
        assert client.local_endpoint == path
        table = client.table("big")  # a small request with an 80 KB reply: resent over ZMQ
        assert table.shape == (1, 20_000)
    message = {"v": 2, "client": "raw", "id": 5, "ops": [{"op": "extend", "req": "big", "tokens": [1]},
                                                         {"op": "table", "req": "big"}]}
    with _datagram_socket() as sock:
        assert _ask(sock, path, message) == {"v": 2, "id": 5, "ok": False, "resend": True}
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(d.endpoint)
        dealer.send(pack(message))
        assert dealer.poll(5000)
        reply = unpack(dealer.recv(), 1 << 30)
    assert reply["ok"] and reply["results"][0]["len"] == 20_001
    assert reply["results"][1].shape == (1, 20_001)  # one token more: the extend ran once


def test_a_local_client_follows_a_restart_and_fails_within_its_timeout_when_the_daemon_is_gone(daemon):
    d = daemon("--num-blocks", "40", "--block-size", "4")
    client = CacheClient(d.endpoint, local=True, timeout=0.5)
    try:
        assert client.ping() and client.local_endpoint is not None
        d.kill()  # no cleanup: the socket file stays, and nothing reads it
        start = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="did not answer within 0.5 s"):
            client.ping()
        assert time.monotonic() - start < 3.0
        daemon("--num-blocks", "40", "--block-size", "4", folder=d.folder)  # the same paths
        assert client.ping()
        assert client.admit(1, np.arange(5)) is not None
    finally:
        client.close()


def test_a_path_that_reaches_another_daemon_is_not_used(daemon, tmp_path):
    """A client checks the daemon behind the path is its own (same epoch) before sending anything there."""
    first = daemon("--num-blocks", "40", "--block-size", "4")
    path = _local_path(first)
    second = daemon("--num-blocks", "40", "--block-size", "4")
    os.replace(_local_path(second), path)  # the first daemon's path now leads to the second's socket
    with CacheClient(first.endpoint, local=True) as client:
        assert client.ping()
        assert client.local_endpoint is None
        assert client.admit(1, np.arange(5)) is not None
    with CacheClient(first.endpoint) as client:
        assert client.usage.per_row.tolist() == [2 / 40]


def test_local_endpoint_off_leaves_the_client_on_zmq_and_stop_removes_the_socket(daemon):
    off = daemon("--num-blocks", "40", "--block-size", "4", "--local-endpoint", LOCAL_OFF)
    with CacheClient(off.endpoint, local=True) as client:
        assert client.info()["local_endpoint"] is None
        assert client.ping() and client.local_endpoint is None
    on = daemon("--num-blocks", "40", "--block-size", "4")
    path = Path(_local_path(on))
    assert path.is_socket() and (path.stat().st_mode & 0o077) == 0  # owner-only, as the ipc sockets
    on.stop()
    assert not path.exists()


def test_local_endpoint_defaults_beside_an_ipc_endpoint_and_is_off_for_tcp():
    assert ServeConfig(endpoint="ipc:///run/kv/a.sock").resolved().local_endpoint == "/run/kv/a-local.sock"
    assert ServeConfig(endpoint="tcp://127.0.0.1:5555").resolved().local_endpoint == LOCAL_OFF
    given = ServeConfig(endpoint="tcp://127.0.0.1:5555", local_endpoint="/tmp/x.sock").resolved()
    assert given.local_endpoint == "/tmp/x.sock"


def test_a_datagram_without_a_reply_address_changes_nothing(daemon):
    d = daemon("--num-blocks", "40", "--block-size", "4")
    path = _local_path(d)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as unbound:
        tokens = msgpack.ExtType(1, bytes([2, 1]) + (4).to_bytes(4, "little") + np.arange(4, dtype="<u4").tobytes())
        unbound.sendto(msgpack.packb({"v": 2, "client": "anon", "id": 1,
                                      "ops": [{"op": "admit", "req": 1, "tokens": tokens}]}), path)
    with CacheClient(d.endpoint, local=True) as client:
        assert client.ping()  # answered after the unbound datagram, which was read first
        assert client.usage.per_row.tolist() == [0.0]
        assert os.path.exists(path)


def test_a_local_client_made_before_its_daemon_starts_uses_the_endpoint_once_it_answers(daemon):
    folder = Path(tempfile.mkdtemp(prefix="kv-", dir="/tmp"))
    with CacheClient(f"ipc://{folder}/k.sock", local=True, timeout=0.3) as client:
        with pytest.raises(DaemonUnavailable):
            client.ping()
        daemon("--num-blocks", "40", "--block-size", "4", folder=folder)
        assert client.ping()
        assert client.local_endpoint == str(folder / "k-local.sock")


def test_local_sockets_bind_random_abstract_addresses_never_autobind_ones(daemon):
    """Autobind's 20-bit names come round again; a client's own address is 128 random bits. A worker's is a socket
    file beside the endpoint (tests/test_local_subscribers.py)."""
    from kvcache.worker import TableSubscriber

    d = daemon("--rows", "full", "--block-size", "16", "--num-blocks", "100")
    with CacheClient(d.endpoint, local=True) as a, CacheClient(d.endpoint, local=True) as b, \
            TableSubscriber(d.endpoint, max_slots=4, max_blocks=8, local=True) as sub:
        assert a.ping() and b.ping()  # a client opens the local endpoint with its first request
        assert sub.local and a.local_endpoint and b.local_endpoint
        names = [a._local.getsockname(), b._local.getsockname()]
        for name in names:
            prefix = b"\0kvcache-client-"
            assert name.startswith(prefix), name
            assert len(name) == len(prefix) + 32 and int(name[len(prefix):], 16) >= 0
        assert len(set(names)) == 2
        assert sub._local.getsockname().startswith(f"{d.folder}/worker-")
        assert a.admit(1, np.arange(20)) is not None
        sub.wait_for(a.last_seq, timeout=5, epoch=a.last_epoch)
        assert sub.table(1).tolist() == a.table(1).tolist()

"""A write still on its way when a transfer's deadline passes never lands in blocks handed to another request.

Two nodes on one machine, each in a network namespace of its own (``kvcache.pd.hosts``), UCX over TCP, real
`kvcache serve` daemons and real NIXL. The prefill node's link is pulled while it streams a request's layers:
the writes it posts meanwhile wait in its TCP socket, which retransmits them once the link is back. Both nodes
fail the request at the deadline; the decode node keeps its blocks until the prefill node's word that it stopped
arrives and the decode rank has cut it off (``NixlEngine.cut_off``), and only then hands them on. The parts alone:
the cut between two processes, and a decode daemon holding an expired request's blocks.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvcache.pd import PDProxy
from kvcache.pd.cluster import Cluster, run_batch, wait_outcomes
from kvcache.pd.hosts import unavailable
from kvcache.transfer.nixl import nixl_available

from test_pd_cross_host import assert_new_requests_move, assert_nodes_left_nothing, clients, hosts, submit  # noqa: F401

needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pip install nixl-cu12 --no-deps)")
needs_netns = pytest.mark.skipif(bool(unavailable()), reason=f"two nodes need network namespaces: {unavailable()}")


def blocks_of(cluster: Cluster, table: np.ndarray) -> list[np.ndarray]:
    """Every layer's and tensor's bytes of ``table``'s blocks on the decode node, as they are now."""
    ids = np.unique(table[table >= 0]).astype(np.int64)
    return [a.copy() for layer in cluster.decode_workers[0].call("read", ids) for a in layer]


def cut_receiver(conn: Any, env: dict[str, str]) -> None:
    """A decode rank's engine in a process of its own, UCX over TCP: dumps its cache, cuts peers off on command."""
    os.environ.update(env)
    from test_transfer import Cache, make_spec

    from kvcache.transfer.nixl import NixlEngine

    cache = Cache(make_spec(), 48, seed=5)
    with NixlEngine(f"decode-{os.getpid()}", kernel_copy=False) as engine:
        engine.register(cache.region)
        conn.send(engine.serve("tcp://127.0.0.1:*"))
        while True:
            command, arg = conn.recv()
            if command == "cut":
                conn.send(engine.cut_off(arg))
            elif command == "dump":
                conn.send(cache.buffer.tobytes())
            else:
                return


@needs_nixl
def test_cut_off_resets_a_peers_nixl_connections_and_the_peer_writes_again_once_connected_afresh(monkeypatch):
    """A decode rank cuts off a writer by resetting the TCP connections its NIXL writes come over: the writer's next
    write on the old connection fails and nothing of it lands; connected afresh, its writes land byte for byte. A
    peer that never said hello has nothing to cut."""
    from test_transfer import Cache, make_spec, scattered

    from kvcache.transfer.engines import TransferStatus
    from kvcache.transfer.nixl import NixlEngine

    env = {"UCX_TLS": "tcp", "KVCACHE_KERNEL_COPY": "0"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=cut_receiver, args=(child, env), daemon=True)
    process.start()

    def call(command: str, arg: Any = None) -> Any:
        conn.send((command, arg))
        assert conn.poll(30), f"the receiver did not answer {command}"
        return conn.recv()

    try:
        assert conn.poll(60), "the receiver did not start"
        endpoint = conn.recv()
        spec, rng = make_spec(), np.random.default_rng(2)
        src = Cache(spec, 40, seed=4)
        with NixlEngine("prefill", kernel_copy=False) as engine:
            peer = engine.connect(endpoint)
            src_ids, dst_ids = scattered(rng, 40, 30), scattered(rng, 48, 30)
            assert engine.write(src.region, src_ids, peer.regions[0], dst_ids).wait() is TransferStatus.DONE
            assert call("cut", "nobody") == 0
            assert call("cut", "prefill") >= 1
            before = call("dump")
            handle = engine.write(src.region, dst_ids[::-1] % 40, peer.regions[0], dst_ids, timeout=5)
            assert handle.wait() is not TransferStatus.DONE
            assert call("dump") == before  # nothing of it landed
            engine.disconnect(peer)
            peer = engine.connect(endpoint)
            assert engine.write(src.region, src_ids, peer.regions[0], dst_ids[::-1]).wait() is TransferStatus.DONE
            got = np.frombuffer(call("dump"), dtype=np.uint8)
            want = Cache(spec, 48, seed=5)
            want.buffer[:] = np.frombuffer(before, dtype=np.uint8)
            assert np.array_equal(got, want.expect_copy(src, src_ids, dst_ids[::-1]))
    finally:
        conn.send(("stop", None))
        process.join(10)
        if process.is_alive():
            process.kill()


def wait_for(check, within: float) -> bool:
    deadline = time.monotonic() + within
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return check()


@needs_nixl
@needs_netns
@pytest.mark.parametrize("link", ["thread", "process"])
def test_a_write_that_lands_after_the_deadline_never_reaches_blocks_given_to_another_request(hosts, link):
    """Pull the prefill node's link while it streams a request: its writes wait in its TCP socket. Both nodes fail
    the request at the deadline. Once the decode node gives its blocks back, a new request takes them; when the link
    is back, the prefill node's TCP delivers what it had queued, and none of it may reach the new request's blocks.
    The decode node keeps the blocks past the deadline until the prefill node's word that it stopped comes over the
    restored link and the decode rank cut it off. The link then carries new requests byte for byte."""
    timeout = 4.0
    with Cluster(layers=6, kv_heads=4, head_dim=64, num_blocks=160, timeout=timeout, hosts=hosts,
                 link=link) as cluster:
        prefill, decode = clients(cluster)
        proxy = PDProxy(prefill, decode)
        assert run_batch(cluster, proxy, {"warm": np.arange(300)})["problems"] == []  # the messager is connected
        decode.reset_prefix_cache()
        prompts, items = submit(proxy, 5, (1200,), "late")
        (req, tokens, _, _), = items
        old = np.asarray(decode.table(req))
        stepped = threading.Thread(target=cluster.step, args=(items, 0.25))
        stepped.start()
        time.sleep(0.6)  # the first layers landed; the rest go into the prefill node's socket, not the wire
        hosts.cut("prefill")
        cut = time.monotonic()
        stepped.join(30)
        _, failed = wait_outcomes(decode, {req}, timeout + 10)
        assert set(failed) == {req} and "timed out" in failed[req], failed
        expired = time.monotonic()
        time.sleep(max(0.0, cut + timeout + 1 - time.monotonic()))  # past the deadline on both nodes
        held = decode.usage.max > 0
        if held:  # the decode node waits for the writer to stop, which it hears over the link
            hosts.restore("prefill")
        assert wait_for(lambda: decode.usage.max == 0.0, 3 * timeout)
        released = time.monotonic()
        assert decode.admit("next", np.random.default_rng(9).integers(0, 50_000, 1200)) is not None
        new = np.asarray(decode.table("next"))
        assert set(new[new >= 0].tolist()) & set(old[old >= 0].tolist())  # the old request's blocks, handed on
        before = blocks_of(cluster, new)
        hosts.restore("prefill")
        restored = time.monotonic()
        changed = 0
        while time.monotonic() - restored < 10 and not changed:
            time.sleep(0.25)
            changed = sum(int((a != b).sum()) for a, b in zip(before, blocks_of(cluster, new)))
        assert changed == 0, f"{changed} bytes of the new request's blocks were overwritten after the deadline"
        if held:  # on the decode rank's word, not at the second timeout
            assert released - expired < timeout - 0.5, released - expired
        decode.free("next")
        _, failed = wait_outcomes(prefill, {req}, 30)
        assert set(failed) == {req}
        assert_new_requests_move(cluster, proxy, prefill, decode)
    assert_nodes_left_nothing(hosts, cluster)


def test_a_decode_daemon_keeps_an_expired_requests_blocks_until_each_ranks_writers_stop_or_one_more_timeout(daemon):
    """At its deadline a decode request fails at once, but its blocks stay out of the free pool: until every rank
    that had not reported it says its writers stopped (``received``), or one more timeout passes. Another report of
    the failure meanwhile releases nothing, and its scheduler hears of it once."""
    from kvcache.client import CacheClient

    d = daemon("--num-blocks", "32", "--block-size", "16", "--role", "decode", "--tp", "2", "--transfer-timeout", "1")
    with CacheClient(d.endpoint) as c:
        for rank in (0, 1):
            c.attach(rank, f"tcp://127.0.0.1:{rank + 1}", key=100 + rank)
        c.reserve("a", np.arange(40))
        c.reserve("b", np.arange(100, 140))
        c.received("a", 0, key=100)  # rank 0's writers finished before the deadline
        failed: dict[Any, str] = {}
        assert wait_for(lambda: failed.update(c.pd_poll().failed) or set(failed) == {"a", "b"}, 10), failed
        expired = time.monotonic()
        assert all("timed out" in e for e in failed.values())
        assert c.stats()["in_transfer"] == 2 and c.usage.max > 0  # held: a write may still be on its way
        c.transfer_failed("a", "prefill rank 0: gave up")
        assert c.stats()["in_transfer"] == 2
        c.received("a", 1, key=101)  # rank 1's writers stopped too: nothing of a can land any more
        assert c.stats()["in_transfer"] == 1
        assert wait_for(lambda: c.stats()["in_transfer"] == 0, 10)  # b: no word, one more timeout
        assert time.monotonic() - expired > 0.5
        assert c.usage.max == 0.0 and c.lookup(np.arange(40)) == c.lookup(np.arange(100, 140)) == 0
        assert c.pd_poll() == ({}, {})
        c.check_integrity()


def test_a_held_request_says_why_its_id_is_still_taken(daemon):
    """A scheduler told of the failure may free the request or reserve its id again: until the hold ends both are
    refused in one line that says the request is held after its deadline, and for at most how long."""
    from kvcache.allocator.errors import KVCacheError
    from kvcache.client import CacheClient

    d = daemon("--num-blocks", "32", "--block-size", "16", "--role", "decode", "--transfer-timeout", "1")
    with CacheClient(d.endpoint) as c:
        c.attach(0, "tcp://127.0.0.1:1", key=100)
        c.reserve("a", np.arange(40))
        failed: dict[Any, str] = {}
        assert wait_for(lambda: failed.update(c.pd_poll().failed) or "a" in failed, 10)
        for call in (lambda: c.free("a"), lambda: c.extend("a", [1]), lambda: c.reserve("a", np.arange(40))):
            with pytest.raises(KVCacheError, match=r"failed at its transfer deadline and its blocks are held until "
                                                   r"its writers stop .*, or \d+\.\d s more"):
                call()
        c.received("a", 0, key=100)
        assert c.stats()["in_transfer"] == 0
        assert c.reserve("a", np.arange(40)) is not None  # the id is free again

"""The kernel copy writes only a peer that proved, now, that it is a process on this host, and only the memory it
registered: a hello copied from another process, replayed, or pointing at memory the peer never registered makes
the write go through NIXL (which refuses unregistered memory) or fail, never land outside registered memory.

Each test runs a victim: a real process with a NIXL engine serving its registered cache, and a private buffer it
never registered. The attacker answers the sender's hello on its own socket, with what it learned from the victim.
"""
from __future__ import annotations

import hashlib
import hmac
import multiprocessing as mp
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from kvcache.allocator import CacheSpec
from kvcache.transfer import KVRegion, TransferStatus
from kvcache.transfer.nixl import KernelCopy, nixl_available
from kvcache.transfer.regions import CopyRanges

from caches import random_views

pytestmark = [
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pip install nixl-cu12 --no-deps)"),
    pytest.mark.skipif(not KernelCopy.supported(), reason="no process_vm_writev here"),
]

SPEC = CacheSpec(num_layers=2, num_kv_heads=4, head_dim=16, block_size=8)
BLOCKS = 16
PRIVATE = 0x5A  # every byte of the victim's unregistered buffer


def make_cache(seed: int) -> tuple[np.ndarray, KVRegion]:
    """A random cache of BLOCKS blocks: its bytes and its region."""
    buffer, views = random_views(SPEC, BLOCKS, seed)
    return buffer, KVRegion.from_tensors(SPEC, views)


def victim(conn: Any) -> None:
    """A decode rank in its own process: its cache registered and served; beside it a buffer it never registered."""
    from kvcache.transfer.nixl import NixlEngine

    buffer, region = make_cache(seed=1)
    private = np.full(buffer.size, PRIVATE, dtype=np.uint8)
    with NixlEngine(f"victim-{os.getpid()}", threads=0) as engine:
        engine.register(region)
        conn.send((engine.serve("tcp://127.0.0.1:*"), private.ctypes.data))
        while conn.recv() == "dump":
            conn.send((buffer.tobytes(), private.tobytes()))


class Victim:
    """The victim process, its endpoint, and where its unregistered buffer lies in its memory."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=victim, args=(child,), daemon=True)
        self.process.start()
        assert self.conn.poll(60), "the victim did not start"
        self.endpoint, self.private_addr = self.conn.recv()

    def dump(self) -> tuple[np.ndarray, np.ndarray]:
        """Its registered cache and its private buffer, as they are now."""
        self.conn.send("dump")
        assert self.conn.poll(30), "the victim did not answer"
        cache, private = self.conn.recv()
        return np.frombuffer(cache, dtype=np.uint8), np.frombuffer(private, dtype=np.uint8)

    def private_region(self) -> dict:
        """A description of a region over the victim's private buffer: the attacker's choice of destination."""
        return KVRegion.from_buffer(SPEC, BLOCKS, self.private_addr).describe()

    def stop(self) -> None:
        self.conn.send("stop")
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


class Attacker:
    """A hello server that answers each request with ``answer(request)``: the sender connects here."""

    def __init__(self, answer: Callable[[dict], bytes]) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.answer, self.stopping = answer, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            if self.sock.poll(50):
                frames = self.sock.recv_multipart()
                self.sock.send_multipart([*frames[:-1], self.answer(msgpack.unpackb(frames[-1], raw=False))])

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()


def ask(endpoint: str, request: dict) -> bytes:
    """One hello round trip to ``endpoint``: the raw reply."""
    with zmq.Context() as ctx, ctx.socket(zmq.REQ) as sock:
        sock.linger = 0
        sock.connect(endpoint)
        sock.send(msgpack.packb(request, use_bin_type=True))
        assert sock.poll(10_000), f"no answer from {endpoint}"
        return sock.recv()


def record(endpoint: str) -> bytes:
    """A hello the victim gave the attacker, asking as any peer may."""
    from kvcache.transfer.nixl import PROTOCOL

    return ask(endpoint, {"v": PROTOCOL, "op": "hello", "agent": "attacker", "nonce": os.urandom(32)})


def rewrite(reply: bytes, **fields: Any) -> bytes:
    """``reply`` with ``fields`` of the hello in it replaced; its answer to the nonce, if any, kept as it was."""
    outer = msgpack.unpackb(reply, raw=False)
    if "body" in outer:  # a signed hello: change the hello, keep the signature
        hello = msgpack.unpackb(outer["body"], raw=False)
        hello.update(fields)
        outer["body"] = msgpack.packb(hello, use_bin_type=True)
    else:
        outer.update(fields)
    return msgpack.packb(outer, use_bin_type=True)


@pytest.fixture
def target() -> Iterator[Victim]:
    v = Victim()
    try:
        yield v
    finally:
        v.stop()


@pytest.fixture
def sender() -> Iterator[Any]:
    from kvcache.transfer.nixl import NixlEngine

    with NixlEngine("sender", threads=0) as engine:
        yield engine


def send_all(engine: Any, endpoint: str) -> tuple[Any, TransferStatus, np.ndarray]:
    """Connect to ``endpoint`` and write every block of a fresh cache into the first region it offers."""
    peer = engine.connect(endpoint)
    _, src = make_cache(seed=7)
    ids = np.arange(BLOCKS)
    handle = engine.write(src, ids, peer.regions[0], ids)
    return peer, handle.wait(), ids


def assert_untouched(v: Victim) -> None:
    cache, private = v.dump()
    assert (private == PRIVATE).all(), f"{int((private != PRIVATE).sum())} bytes of unregistered memory were written"
    assert np.array_equal(cache, make_cache(seed=1)[0]), "the registered cache changed"


def assert_refused(v: Victim, engine: Any, answer: Callable[[dict], bytes]) -> Any:
    """Write every block to a hello server that answers with ``answer``: the write fails, not by the kernel, and
    ``v``'s memory keeps every byte. Returns the peer ``engine`` connected to."""
    attacker = Attacker(answer)
    try:
        peer, status, _ = send_all(engine, attacker.endpoint)
        assert_untouched(v)
        assert status is TransferStatus.FAILED
        assert not engine.uses_kernel_copy(peer)
    finally:
        attacker.close()
    return peer


def test_a_hello_relayed_from_another_process_with_a_region_of_its_choosing_gets_no_kernel_write(target, sender):
    """The attacker relays the victim's live hello (real pid, key, metadata, answer to our nonce), changing only the
    regions (to the victim's unregistered buffer) and the host: the signature no longer matches, so no kernel
    copy; NIXL refuses memory the victim never registered, and that buffer keeps every byte."""
    assert_refused(target, sender, lambda request: rewrite(ask(target.endpoint, request),
                                                           regions=[target.private_region()], host="elsewhere"))


def test_a_replayed_hello_without_the_live_answer_gets_no_kernel_write(target, sender):
    """A hello recorded earlier from the victim and served again, verbatim or with the attacker's regions: its
    answer was to another nonce, so the kernel never writes through it. Verbatim, the write goes through NIXL
    into the victim's registered cache (what NIXL alone allows anyone holding its metadata), byte for byte."""
    recorded = record(target.endpoint)
    peer = assert_refused(target, sender, lambda request: rewrite(recorded, regions=[target.private_region()]))
    sender.disconnect(peer)
    attacker = Attacker(lambda request: recorded)
    try:
        peer, status, ids = send_all(sender, attacker.endpoint)
        assert not sender.uses_kernel_copy(peer)
        assert status is TransferStatus.DONE
        cache, private = target.dump()
        assert np.array_equal(cache, make_cache(seed=7)[0]) and (private == PRIVATE).all()
    finally:
        attacker.close()


def test_a_key_planted_in_the_victims_registered_memory_does_not_stand_in_for_its_own(target, sender):
    """The attacker writes bytes of its choosing into the victim's registered cache (NIXL lets any peer do so),
    then serves a hello whose key points there, signed with those bytes: the key is read from the victim's own
    memfd, not from where the hello points, so the signature fails and the unregistered buffer keeps every byte."""
    from kvcache.transfer.nixl import NixlEngine

    genuine = msgpack.unpackb(record(target.endpoint), raw=False)
    hello = msgpack.unpackb(genuine["body"], raw=False) if "body" in genuine else genuine
    with NixlEngine("planter", threads=0, kernel_copy=False) as planter:
        remote = planter.connect(target.endpoint).regions[0]
        planted_bytes, planted_src = make_cache(seed=9)
        assert planter.write(planted_src, [0], remote, [0]).wait() is TransferStatus.DONE
    planted_addr = int(remote.addrs[0, 0])
    key = planted_bytes[:32].tobytes()  # layer 0, tensor 0, block 0: now at planted_addr in the victim

    def answer(request: dict) -> bytes:
        forged = dict(hello, regions=[target.private_region()], token=[planted_addr, key])
        if "body" not in genuine:
            return msgpack.packb(forged, use_bin_type=True)
        forged["key"] = [hello["key"][0], planted_addr]
        body = msgpack.packb(forged, use_bin_type=True)
        proof = hmac.new(key, request["nonce"] + body, hashlib.sha256).digest()
        return msgpack.packb({"v": genuine["v"], "body": body, "proof": proof}, use_bin_type=True)

    attacker = Attacker(answer)
    try:
        peer, status, _ = send_all(sender, attacker.endpoint)
        _, private = target.dump()
        assert (private == PRIVATE).all(), f"{int((private != PRIVATE).sum())} bytes of unregistered memory written"
        assert status is TransferStatus.FAILED
        assert not sender.uses_kernel_copy(peer)
    finally:
        attacker.close()


def test_a_kernel_write_with_a_range_outside_the_registered_memory_is_refused_whole(target, sender):
    """To the genuine peer, by the kernel: a write any of whose ranges leaves the memory the peer registered (into
    its private buffer, or across the end of its cache) fails before a byte moves, its in-bounds ranges too; a
    write inside lands byte for byte."""
    peer = sender.connect(target.endpoint)
    remote = peer.regions[0]
    ext = remote.extents()
    end = int(ext.addr[-1] + ext.length[-1])
    src_bytes, src = make_cache(seed=7)
    sender.register(src)
    base = src_bytes.ctypes.data
    inside = (base, int(remote.addrs[0, 0]), 64)
    for outside in [(base + 64, target.private_addr, 4096), (base + 128, end - 16, 64)]:
        ranges = CopyRanges(*(np.array(v, dtype=np.int64) for v in zip(inside, outside)))
        handle = sender.submit(ranges, peer.agent, src, remote)
        handle.wait()
        assert_untouched(target)
        assert handle.status() is TransferStatus.FAILED
        assert "outside the memory it registered" in handle.error and "nothing written" in handle.error
    ids = np.arange(BLOCKS)
    assert sender.write(src, ids, remote, ids[::-1]).wait() is TransferStatus.DONE
    cache, private = target.dump()
    assert (private == PRIVATE).all() and not np.array_equal(cache, make_cache(seed=1)[0])
    assert sender.uses_kernel_copy(peer)  # the refusals were the kernel path's own check


def pd_receiver(conn: Any) -> None:
    """A decode rank's CacheReceiver in its own process, over the victim's cache; reports what landed."""
    import queue

    from kvcache.pd.messager import CacheReceiver
    from kvcache.transfer.nixl import NixlEngine

    buffer, region = make_cache(seed=1)
    landed: queue.SimpleQueue = queue.SimpleQueue()
    with NixlEngine(f"decode-{os.getpid()}", threads=0) as engine:
        receiver = CacheReceiver(engine, region, 0, on_received=lambda reqs: [landed.put(r) for r in reqs])
        conn.send(receiver.endpoint)
        while conn.recv() == "landed":
            conn.send((landed.get(timeout=20), buffer.tobytes()))
        receiver.close()


def test_the_pd_messager_writes_a_decode_process_on_this_host_by_the_kernel_byte_for_byte(tmp_path):
    """The normal PD path: a messager sending to a decode rank's receiver in another process on this host proves it
    and writes through the kernel; the receiver hears of the request once its blocks landed, exactly."""
    import queue
    import time

    from kvcache.ops import send_cache
    from kvcache.pd.messager import CacheMessager, TransferPlan
    from kvcache.transfer import LayerSignal
    from kvcache.transfer.nixl import NixlEngine

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=pd_receiver, args=(child,), daemon=True)
    process.start()
    try:
        assert conn.poll(60), "the receiver did not start"
        endpoint = conn.recv()
        src_bytes, src = make_cache(seed=7)
        sent: queue.SimpleQueue = queue.SimpleQueue()
        src_ids, dst_ids = np.array([[3, 0, 5, 9]]), np.array([[1, 2, 14, 7]])
        plan = TransferPlan("req-1", src_ids, dst_ids, 0, (endpoint,), time.monotonic() + 20)
        with LayerSignal.create(f"kvcache-kc-{tmp_path.name}", SPEC.num_layers, replace=True) as sig, \
                NixlEngine("prefill", threads=0) as engine:
            messager = CacheMessager(engine, src, sig, 0, fetch_plans=lambda reqs: [plan for _ in reqs],
                                     on_sent=sent.put, on_failed=lambda req, error, plan: sent.put(error))
            try:
                messager.run_step(sig.begin_step(), ["req-1"], {"req-1": plan})
                for layer in range(SPEC.num_layers):
                    send_cache(None, sig, layer)
                assert sent.get(timeout=20) == "req-1"
                conn.send("landed")
                assert conn.poll(30), "the receiver did not answer"
                req, cache = conn.recv()
                assert engine.uses_kernel_copy(f"decode-{process.pid}")
            finally:
                messager.close()
        assert req == "req-1"
        want = make_cache(seed=1)[0].copy()
        per_layer = SPEC.bytes_per_block_per_layer * BLOCKS
        for layer in range(SPEC.num_layers):
            offset = layer * per_layer
            for t in SPEC.tensors():
                size = t.bytes_per_block
                for s, d in zip(src_ids[0], dst_ids[0]):
                    want[offset + d * size:][:size] = src_bytes[offset + s * size:][:size]
                offset += size * BLOCKS
        assert np.array_equal(np.frombuffer(cache, dtype=np.uint8), want)
    finally:
        conn.send("stop")
        process.join(10)
        if process.is_alive():
            process.kill()


def test_only_this_hosts_addresses_count_as_local_and_the_host_identity_names_kernel_and_pid_namespace():
    """The kernel copy needs a peer reached at an address of this host, whose hello names this kernel's boot and
    pid namespace."""
    from kvcache.transfer.nixl import host_identity, is_local_endpoint

    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    assert host_identity().startswith(boot + "/pidns:")
    assert is_local_endpoint("tcp://127.0.0.1:5600") and is_local_endpoint("ipc:///tmp/kvcache-x")
    assert not is_local_endpoint("tcp://192.0.2.1:5600")  # TEST-NET-1: never an address of this host
    assert not is_local_endpoint("tcp://no-such-host.invalid:5600")


def test_byte_ranges_cover_a_range_only_whole_inside_one_of_them():
    """``union`` merges overlapping and touching ranges; ``covers`` agrees with a byte-by-byte check."""
    from kvcache.transfer.regions import ByteRanges

    rng = np.random.default_rng(3)
    parts = [ByteRanges(rng.integers(0, 200, 6), rng.integers(1, 30, 6)) for _ in range(3)]
    held = np.zeros(260, dtype=bool)
    for p in parts:
        for a, n in zip(p.addr, p.length):
            held[a:a + n] = True
    union = ByteRanges.union(parts)
    assert (np.diff(union.addr) > union.length[:-1]).all()  # ascending, disjoint, not touching
    addr, length = rng.integers(0, 240, 2000), rng.choice([-2, -1, *range(1, 20)], 2000)
    inside = np.array([n > 0 and held[a:a + n].all() for a, n in zip(addr, length)])
    assert np.array_equal(union.covers(addr, length), inside)
    assert not ByteRanges.union([]).covers(np.array([5]), np.array([1])).any()

"""Transfer engines: LocalEngine host copies and NixlEngine writes between processes, byte for byte, with deadlines."""
from __future__ import annotations

import contextlib
import glob
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.allocator import CacheSpec, KVCacheError
from kvcache.transfer import KVRegion, LocalEngine, TransferStatus, create_engine
from kvcache.transfer.regions import copy_ranges
from kvcache.transfer._copy import copy as host_copy
from kvcache.transfer.nixl import nixl_available

from caches import random_views

SPECS = {
    "bf16": dict(num_kv_heads=4, head_dim=16),
    "int4_zp": dict(num_kv_heads=2, head_dim=16, quant="int4_zp"),
    "block_wise_fp8": dict(num_kv_heads=4, head_dim=16, quant="block_wise_fp8", scale_layout="blackwell"),
    "mla_fp8": dict(quant="mla_fp8", kv_lora_rank=128, qk_rope_head_dim=32),
}


def make_spec(name: str = "bf16", **overrides: Any) -> CacheSpec:
    fields: dict[str, Any] = dict(num_layers=3, block_size=8, **SPECS[name])
    fields.update(overrides)
    return CacheSpec(**fields)


class Cache:
    """A region over one random numpy buffer (layer-major, then tensor, then block), plus its typed views."""

    def __init__(self, spec: CacheSpec, num_blocks: int, seed: int) -> None:
        self.spec, self.num_blocks, self.seed = spec, num_blocks, seed
        self.buffer, self.views = random_views(spec, num_blocks, seed)
        self.region = KVRegion.from_tensors(spec, self.views)

    def expect_copy(self, src: Cache, src_blocks: np.ndarray, dst_blocks: np.ndarray,
                    layers: list[int] | None = None, rows: np.ndarray | None = None) -> np.ndarray:
        """What this cache's buffer must hold after the copy (computed on a copy of it)."""
        want = _with_buffer(self, self.buffer.copy())
        apply_copy(want, src, src_blocks, dst_blocks, layers, rows)
        return want.buffer


def _with_buffer(cache: Cache, buffer: np.ndarray) -> Cache:
    """A view of ``cache`` whose typed views point into ``buffer`` (same layout)."""
    other = Cache.__new__(Cache)
    other.spec, other.num_blocks, other.buffer = cache.spec, cache.num_blocks, buffer
    base = cache.buffer.ctypes.data
    other.views = [[buffer[v.__array_interface__["data"][0] - base:][:v.nbytes].view(v.dtype).reshape(v.shape)
                    for v in row] for row in cache.views]
    return other


def apply_copy(dst: Cache, src: Cache, src_blocks: np.ndarray, dst_blocks: np.ndarray,
               layers: list[int] | None = None, rows: np.ndarray | None = None) -> None:
    """The slow reference: numpy's own indexing, unit by unit, pairs with a -1 skipped."""
    for layer in range(dst.spec.num_layers) if layers is None else layers:
        for sv, dv in zip(src.views[layer], dst.views[layer]):
            if rows is None:
                for s, d in zip(src_blocks.tolist(), dst_blocks.tolist()):
                    if s >= 0 and d >= 0:
                        dv[d] = sv[s]
            else:
                for r, srow, drow in zip(rows.tolist(), src_blocks, dst_blocks):
                    for s, d in zip(srow.tolist(), drow.tolist()):
                        if s >= 0 and d >= 0:
                            dv[d, r] = sv[s, r]


def scattered(rng: np.random.Generator, num_blocks: int, n: int) -> np.ndarray:
    return rng.permutation(num_blocks)[:n].astype(np.int32)


@pytest.fixture
def engine():
    e = LocalEngine(timeout=10.0)
    yield e
    e.close()


# -- LocalEngine, host to host -------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SPECS))
def test_host_copy_of_scattered_blocks_is_byte_exact(engine, name):
    spec = make_spec(name)
    rng = np.random.default_rng(7)
    src, dst = Cache(spec, 40, seed=1), Cache(spec, 50, seed=2)
    src_ids, dst_ids = scattered(rng, 40, 25), scattered(rng, 50, 25)
    src_ids[3] = -1
    want = dst.expect_copy(src, src_ids, dst_ids)
    handle = engine.write(src.region, src_ids, dst.region, dst_ids)
    assert handle.wait() is TransferStatus.DONE, handle.error
    assert np.array_equal(dst.buffer, want)


def test_head_wise_copy_moves_each_heads_own_blocks_in_the_chosen_layers(engine):
    spec = make_spec()
    rng = np.random.default_rng(3)
    src, dst = Cache(spec, 30, seed=1), Cache(spec, 30, seed=2)
    rows = np.array([1, 3])
    src_ids = np.stack([scattered(rng, 30, 12) for _ in rows])
    dst_ids = np.stack([scattered(rng, 30, 12) for _ in rows])
    src_ids[0, :4] = -1  # a sliding-window head whose first blocks were recycled
    want = dst.expect_copy(src, src_ids, dst_ids, layers=[0, 2], rows=rows)
    handle = engine.write(src.region, src_ids, dst.region, dst_ids, layers=[0, 2], rows=rows)
    assert handle.wait() is TransferStatus.DONE, handle.error
    assert np.array_equal(dst.buffer, want)


def test_many_writes_in_flight_all_complete(engine):
    spec = make_spec()
    src, dst = Cache(spec, 64, seed=1), Cache(spec, 64, seed=2)
    ids = np.arange(64, dtype=np.int32)
    handles = [engine.write(src.region, ids[i::8], dst.region, ids[i::8][::-1], layers=[i % 3]) for i in range(8)]
    assert [h.wait() for h in handles] == [TransferStatus.DONE] * 8
    want = _with_buffer(dst, dst.buffer.copy())
    for i in range(8):
        apply_copy(want, src, ids[i::8], ids[i::8][::-1], layers=[i % 3])
    assert np.array_equal(dst.buffer, want.buffer)


def test_submit_parts_copies_each_part_with_its_own_handle(engine):
    spec = make_spec()
    rng = np.random.default_rng(5)
    src, dst = Cache(spec, 40, seed=1), Cache(spec, 40, seed=2)
    src_ids, dst_ids = scattered(rng, 40, 20), scattered(rng, 40, 20)
    want = dst.expect_copy(src, src_ids, dst_ids)
    ranges = copy_ranges(src.region, src_ids, dst.region, dst_ids)
    cuts = [0, 0, 3, ranges.num_ranges // 2, ranges.num_ranges]  # an empty part too
    handles = engine.submit_parts(ranges, cuts)
    assert [h.wait() for h in handles] == [TransferStatus.DONE] * 4
    assert [h.num_ranges for h in handles] == np.diff(cuts).tolist()
    assert sum(h.nbytes for h in handles) == ranges.nbytes
    assert np.array_equal(dst.buffer, want)


@pytest.mark.parametrize("cuts", [[0, 5], [1, 10], [0, 7, 3, 10], [0.0, 10.0], [[0, 10]], [0]])
def test_submit_parts_refuses_cuts_that_do_not_split_the_ranges_and_copies_nothing(engine, cuts):
    spec = make_spec()
    src, dst = Cache(spec, 10, seed=1), Cache(spec, 10, seed=2)
    ids = np.arange(10, dtype=np.int32)
    ranges = copy_ranges(src.region, ids, dst.region, ids[::-1].copy())
    ranges = type(ranges)(*(np.resize(f, 10) for f in ranges))  # exactly 10 ranges
    before = dst.buffer.copy()
    with pytest.raises(KVCacheError, match="cuts"):
        engine.submit_parts(ranges, cuts)
    assert np.array_equal(dst.buffer, before)


def test_an_empty_selection_is_done_at_once(engine):
    spec = make_spec()
    a, b = Cache(spec, 4, 1), Cache(spec, 4, 2)
    handle = engine.write(a.region, [-1, -1], b.region, [0, 1])
    assert handle.done() and handle.status() is TransferStatus.DONE and handle.nbytes == 0


@pytest.mark.parametrize("threads", [1, 4])
def test_a_copy_past_its_deadline_times_out_and_wait_returns_by_then(threads):
    """256 MiB in 64 KiB ranges cannot finish in 2 ms: TIMEOUT, and wait returned near the deadline."""
    spec = CacheSpec(num_layers=1, num_kv_heads=8, head_dim=128, block_size=32)
    blocks = (256 << 20) // spec.bytes_per_block
    src = KVRegion.from_tensors(spec, [[np.ones(t.shape(blocks), np.uint16) for t in spec.tensors()]])
    dst = KVRegion.from_tensors(spec, [[np.ones(t.shape(blocks), np.uint16) for t in spec.tensors()]])
    ids = np.arange(blocks)
    with LocalEngine(timeout=10.0, threads=threads) as engine:
        handle = engine.write(src, ids, dst, ids[::-1], timeout=0.002)
        start = time.monotonic()
        assert handle.wait() is TransferStatus.TIMEOUT
        assert time.monotonic() - start < 0.5
        assert "deadline" in handle.error
        assert engine.write(src, ids[:2], dst, ids[:2]).wait() is TransferStatus.DONE  # the worker is still alive


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), min_size=0, max_size=40), threads=st.integers(1, 9),
       min_share=st.integers(1, 2000), seed=st.integers(0, 2**32 - 1))
def test_host_copy_on_threads_moves_every_range_exactly(lengths, threads, min_share, seed):
    """Shares cut anywhere, even inside a range, still copy each range once, exactly, and touch nothing else."""
    rng = np.random.default_rng(seed)
    lengths = np.array(lengths, np.int64)
    slots = max(int(lengths.max(initial=0)), 1)
    src = rng.integers(0, 256, slots * (2 * lengths.size + 1), dtype=np.uint8)
    dst = rng.integers(0, 256, src.size, dtype=np.uint8)
    src_at = rng.permutation(2 * lengths.size)[:lengths.size] * slots
    dst_at = rng.permutation(2 * lengths.size)[:lengths.size] * slots
    want = dst.copy()
    for s_at, d_at, n in zip(src_at.tolist(), dst_at.tolist(), lengths.tolist()):
        want[d_at:d_at + n] = src[s_at:s_at + n]
    copied = host_copy(src.ctypes.data + src_at.astype(np.int64), dst.ctypes.data + dst_at.astype(np.int64), lengths,
                       0, threads, min_share)
    assert copied == lengths.size
    assert np.array_equal(dst, want)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 5000), min_size=1, max_size=30), misalign=st.integers(0, 63),
       threads=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_streaming_stores_copy_any_length_and_alignment_exactly(lengths, misalign, threads, seed):
    """Streaming stores cover whole 64-byte destination lines only; heads and tails around them still arrive."""
    rng = np.random.default_rng(seed)
    lengths = np.array(lengths, np.int64)
    slot = 5056
    src = rng.integers(0, 256, slot * (lengths.size + 1), dtype=np.uint8)
    dst = rng.integers(0, 256, slot * (lengths.size + 1), dtype=np.uint8)
    at = np.arange(lengths.size, dtype=np.int64) * slot + misalign
    order = rng.permutation(lengths.size)
    want = dst.copy()
    for s_at, d_at, n in zip(at.tolist(), at[order].tolist(), lengths.tolist()):
        want[d_at:d_at + n] = src[s_at:s_at + n]
    assert host_copy(src.ctypes.data + at, dst.ctypes.data + at[order], lengths, 0, threads, 1, 1) == lengths.size
    assert np.array_equal(dst, want)


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_a_host_copy_stopped_by_its_deadline_counts_only_whole_ranges(threads):
    """Every thread stops after its first few MiB; the count is exactly the ranges whose bytes all arrived."""
    n, size = 2048, 64 << 10
    src = np.full(n * size, 7, np.uint8)
    dst = np.zeros(n * size, np.uint8)
    at = np.random.default_rng(1).permutation(n).astype(np.int64) * size
    copied = host_copy(src.ctypes.data + at, dst.ctypes.data + at[::-1].copy(), np.full(n, size, np.int64), 1,
                       threads)
    landed = (dst.reshape(n, size) == 7).all(axis=1).sum()
    assert 0 < copied < n and copied == landed


def test_host_copies_on_several_threads_or_with_streaming_stores_match_one_thread():
    """A request big enough for four 4 MiB shares lands the same bytes on 4 threads, or streamed, as on one."""
    spec = CacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, block_size=16)
    rng = np.random.default_rng(2)
    src = Cache(spec, 512, seed=1)
    src_ids, dst_ids = scattered(rng, 512, 256), scattered(rng, 512, 256)
    results = []
    for threads, method in ((1, "memcpy"), (4, "memcpy"), (3, "stream")):
        dst = Cache(spec, 512, seed=2)
        with LocalEngine(threads=threads, host_method=method) as engine:
            assert engine.threads == threads
            handle = engine.write(src.region, src_ids, dst.region, dst_ids)
            assert handle.nbytes >= 4 * (4 << 20) and handle.wait() is TransferStatus.DONE, handle.error
        results.append(dst.buffer)
    assert np.array_equal(results[0], results[1]) and np.array_equal(results[0], results[2])
    assert np.array_equal(results[0], Cache(spec, 512, seed=2).expect_copy(src, src_ids, dst_ids))


def test_wait_with_a_short_timeout_returns_pending_before_the_deadline(engine):
    spec = CacheSpec(num_layers=1, num_kv_heads=8, head_dim=128, block_size=64)
    blocks = (1 << 29) // spec.bytes_per_block
    src = KVRegion.from_tensors(spec, [[np.ones(t.shape(blocks), np.uint16) for t in spec.tensors()]])
    dst = KVRegion.from_tensors(spec, [[np.zeros(t.shape(blocks), np.uint16) for t in spec.tensors()]])
    ids = np.arange(blocks)
    handle = engine.write(src, ids, dst, ids[::-1])
    assert handle.wait(timeout=0) is TransferStatus.PENDING
    assert handle.wait() is TransferStatus.DONE


def test_bad_arguments_raise_before_anything_moves(engine):
    spec = make_spec()
    a, b = Cache(spec, 4, 1), Cache(spec, 4, 2)
    before = b.buffer.copy()
    with pytest.raises(KVCacheError, match="not a block id"):
        engine.write(a.region, [0, 9], b.region, [0, 1])
    with pytest.raises(KVCacheError, match="written twice"):
        engine.write(a.region, [0, 1], b.region, [2, 2])
    with pytest.raises(KVCacheError, match="timeout must be positive"):
        engine.write(a.region, [0], b.region, [0], timeout=0)
    remote = KVRegion.from_description(b.region.describe(), owner="decode-0")
    with pytest.raises(KVCacheError, match="belongs to peer 'decode-0'"):
        engine.write(a.region, [0], remote, [0])
    assert np.array_equal(b.buffer, before)


def test_engines_are_chosen_by_name_and_a_closed_engine_refuses_writes():
    spec = make_spec()
    a, b = Cache(spec, 4, 1), Cache(spec, 4, 2)
    with pytest.raises(KVCacheError, match="unknown kind 'rdma'"):
        create_engine("rdma")
    with pytest.raises(KVCacheError, match="cuda_method"):
        LocalEngine(cuda_method="fast")
    for threads in (-1, 2.0, "4", True):
        with pytest.raises(KVCacheError, match="threads must be a whole number"):
            LocalEngine(threads=threads)
    with pytest.raises(KVCacheError, match="host_method: unknown 'avx'"):
        LocalEngine(host_method="avx")
    engine = create_engine("local")
    engine.close()
    engine.close()
    with pytest.raises(KVCacheError, match="closed"):
        engine.write(a.region, [0], b.region, [0])


def test_bench_transfer_quick_reports_every_host_row_against_its_limit(capsys):
    """`kvcache bench transfer --quick --json` runs end to end and exits 0; rows carry ratio and target."""
    from kvcache.bench import transfer as bench
    from kvcache.bench.common import run_alone

    flags = ["--quick", "--json", "--layers", "1", "--repeat", "1", "--sections", "host,nixl"]
    assert run_alone(bench.add_parser, "transfer", flags) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["host"] + (result["nixl"] if isinstance(result["nixl"], list) else [])
    assert {r["block_size"] for r in rows} == {16, 64}
    assert all(r["of_limit"] > 0 and r["bytes"] == 4096 * 8 * 128 * 2 * 2 for r in rows)
    assert [t["ok"] for t in result["targets"]] == [r["ok"] for r in rows if r["ok"] is not None]


# -- NixlEngine between processes ----------------------------------------------------------------

needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pip install nixl-cu12 --no-deps)")
# UCX over TCP only. Where NVIDIA GPUs are present NIXL refuses a UCX_TLS without a CUDA transport.
TCP_ONLY = "tcp,cuda_copy" if glob.glob("/dev/nvidia[0-9]*") else "tcp"


def receiver(conn: Any, spec_fields: dict, num_blocks: int, seed: int, env: dict, progress: str) -> None:
    """The decode side, in its own process: register a random cache, serve metadata, answer commands."""
    os.environ.update(env)
    from kvcache.transfer.nixl import NixlEngine

    cache = Cache(CacheSpec(**spec_fields), num_blocks, seed)
    with NixlEngine(f"decode-{os.getpid()}", progress=progress) as engine:
        engine.register(cache.region)
        conn.send(("ready", engine.serve("tcp://127.0.0.1:*"), engine.name))
        notes: dict[str, list[bytes]] = {}
        while True:
            command = conn.recv()
            if command == "dump":
                conn.send(("dump", cache.buffer.tobytes()))
            elif command == "notifications":  # all so far; waits up to 5 s for the first
                deadline = time.monotonic() + 5
                while True:
                    for k, v in engine.notifications().items():
                        notes.setdefault(k, []).extend(v)
                    if notes or time.monotonic() >= deadline:
                        break
                    time.sleep(0.001)
                conn.send(("notifications", notes))
            else:
                return


class Receiver:
    """A receiver process and the pipe that drives it."""

    def __init__(self, spec: CacheSpec, num_blocks: int, seed: int, env: dict | None = None,
                 progress: str = "thread") -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        fields = {k: v for k, v in spec.describe().items() if k != "kv_heads_per_rank"}
        self.process = ctx.Process(target=receiver, args=(child, fields, num_blocks, seed, env or {}, progress),
                                   daemon=True)
        self.process.start()
        assert self.conn.poll(60), "receiver did not start"
        _, self.endpoint, self.agent = self.conn.recv()

    def call(self, command: str) -> Any:
        self.conn.send(command)
        assert self.conn.poll(30), f"receiver did not answer {command!r}"
        return self.conn.recv()[1]

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send("stop")
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


@needs_nixl
@pytest.mark.parametrize(("transport", "threads", "progress", "kernel"), [
    ("default", 0, "thread", True), ("default", 3, "thread", True), ("default", 3, "thread", False),
    ("tcp", 3, "thread", False), ("default", 0, "poll", False), ("default", 3, "poll", True), ("tcp", 0, "poll", False)])
def test_nixl_writes_scattered_blocks_into_another_process_byte_for_byte(transport, threads, progress, kernel,
                                                                         monkeypatch):
    """The kernel copy into a process on this host, UCX's own choice (shared memory) and TCP land exactly the
    listed units, split over threads or not, the notification after them.

    With progress="poll" neither side runs NIXL's progress thread: the writer's worker progresses
    UCX while its write is in flight, and the receiver's idle worker answers TCP while nobody
    there calls into the engine (its command loop is blocked on the pipe).
    """
    from kvcache.transfer.nixl import SPLIT_DESCRIPTORS, KernelCopy, NixlEngine

    env = {"UCX_TLS": TCP_ONLY} if transport == "tcp" else {}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    spec = make_spec("block_wise_fp8")
    rng = np.random.default_rng(11)
    peer_proc = Receiver(spec, 48, seed=5, env=env, progress=progress)
    try:
        src = Cache(spec, 40, seed=4)
        with NixlEngine("prefill", threads=threads, progress=progress, kernel_copy=kernel) as engine:
            peer = engine.connect(peer_proc.endpoint)
            assert peer.agent == peer_proc.agent and peer.pid == peer_proc.process.pid
            assert (peer.agent in engine._kernel_peers) == (kernel and KernelCopy.supported())
            remote = peer.regions[0]
            src_ids, dst_ids = scattered(rng, 40, 30), scattered(rng, 48, 30)
            handle = engine.write(src.region, src_ids, remote, dst_ids, notify=b"req-1:done")
            assert handle.num_ranges >= 2 * SPLIT_DESCRIPTORS  # enough to be cut into chunks when threaded
            assert handle.wait() is TransferStatus.DONE, handle.error
            got = np.frombuffer(peer_proc.call("dump"), dtype=np.uint8)
            want = Cache(spec, 48, seed=5).expect_copy(src, src_ids, dst_ids)
            assert np.array_equal(got, want)
            assert peer_proc.call("notifications") == {"prefill": [b"req-1:done"]}
    finally:
        peer_proc.stop()


@needs_nixl
def test_nixl_notify_after_earlier_writes_goes_out_once_they_landed_and_never_after_one_failed():
    """A notification with ``after`` reaches the peer once, only when those writes are DONE; an earlier failure stops it."""
    from kvcache.transfer.nixl import NixlEngine
    from kvcache.transfer.regions import copy_ranges

    spec = make_spec("bf16")
    rng = np.random.default_rng(12)
    peer_proc = Receiver(spec, 48, seed=5)
    try:
        src = Cache(spec, 40, seed=4)
        with NixlEngine("prefill", threads=0) as engine:
            remote = engine.connect(peer_proc.endpoint).regions[0]
            engine.register(src.region)
            src_ids, dst_ids = scattered(rng, 40, 30), scattered(rng, 48, 30)
            big = engine.write(src.region, src_ids[:-1], remote, dst_ids[:-1])
            last = engine.submit(copy_ranges(src.region, src_ids[-1:], remote, dst_ids[-1:]), remote.owner,
                                 src.region, remote, notify=b"req-1:done", after=[big])
            assert last.wait() is TransferStatus.DONE, last.error
            assert big.status() is TransferStatus.DONE and big.done_ns <= last.done_ns
            got = np.frombuffer(peer_proc.call("dump"), dtype=np.uint8)
            assert np.array_equal(got, Cache(spec, 48, seed=5).expect_copy(src, src_ids, dst_ids))
            assert peer_proc.call("notifications") == {"prefill": [b"req-1:done"]}

            late = engine.submit(copy_ranges(src.region, src_ids[:1], remote, dst_ids[:1]), remote.owner, src.region,
                                 remote, deadline=time.monotonic() - 1)
            after_late = engine.submit(copy_ranges(src.region, src_ids[1:2], remote, dst_ids[1:2]), remote.owner,
                                       src.region, remote, notify=b"req-2:done", after=[late])
            assert late.wait() is TransferStatus.TIMEOUT
            assert after_late.wait() is TransferStatus.FAILED and "earlier write" in after_late.error
            time.sleep(0.2)  # a notification sent anyway would have arrived by now
            assert peer_proc.call("notifications") == {"prefill": [b"req-1:done"]}  # nothing new came
    finally:
        peer_proc.stop()


class _Pair(NamedTuple):
    spec: CacheSpec
    blocks: int
    src: Cache
    engine: Any
    remote: Any
    peer: Receiver


@contextlib.contextmanager
def big_pair() -> Iterator[_Pair]:
    """A one-thread NIXL engine over a 64 MiB cache (a write of it all keeps the engine busy) and a receiver process."""
    from kvcache.transfer.nixl import NixlEngine

    spec = CacheSpec(num_layers=4, num_kv_heads=8, head_dim=128, block_size=64)
    blocks = (64 << 20) // spec.bytes_per_block
    peer_proc = Receiver(spec, blocks, seed=3)
    try:
        src = Cache(spec, blocks, seed=2)
        with NixlEngine("prefill", threads=0) as engine:
            remote = engine.connect(peer_proc.endpoint).regions[0]
            engine.register(src.region)
            yield _Pair(spec, blocks, src, engine, remote, peer_proc)
    finally:
        peer_proc.stop()


@needs_nixl
def test_writes_queued_behind_a_busy_one_share_one_transfer_and_land_byte_for_byte():
    """A layer-at-a-time producer outrunning the engine: queued writes go as one transfer, the notice after all."""
    from kvcache.transfer.regions import copy_ranges

    with big_pair() as (spec, blocks, src, engine, remote, peer_proc):
        ids = np.arange(blocks)
        handles = [engine.write(src.region, ids[1:], remote, ids[1:])]
        small = [engine.submit(copy_ranges(src.region, ids[:1], remote, ids[:1], layers=[layer]), remote.owner,
                               src.region, remote, notify=b"done" if layer == spec.num_layers - 1 else b"",
                               after=handles[:] if layer == spec.num_layers - 1 else ())
                 for layer in range(spec.num_layers)]
        handles += small
        assert [h.wait() for h in handles] == [TransferStatus.DONE] * len(handles), [h.error for h in handles]
        assert engine.merged_writes >= 1, "the small writes queued behind the big one should have merged"
        assert max(h.done_ns for h in handles[:-1]) <= small[-1].done_ns
        got = np.frombuffer(peer_proc.call("dump"), dtype=np.uint8)
        assert np.array_equal(got, Cache(spec, blocks, seed=3).expect_copy(src, ids, ids))
        assert peer_proc.call("notifications") == {"prefill": [b"done"]}


@needs_nixl
def test_nixl_head_wise_layer_by_layer_writes_match_local_copies():
    """The messager's pattern: each layer's blocks of some heads as the layer finishes; NIXL loopback vs LocalEngine."""
    from kvcache.transfer.nixl import NixlEngine

    spec = make_spec()
    rng = np.random.default_rng(5)
    src, via_nixl, via_local = Cache(spec, 20, 1), Cache(spec, 20, 2), Cache(spec, 20, 2)
    rows = np.array([0, 2, 3])
    src_ids = np.stack([scattered(rng, 20, 9) for _ in rows])
    dst_ids = np.stack([scattered(rng, 20, 9) for _ in rows])
    with NixlEngine() as nixl, LocalEngine() as local:
        for layer in range(spec.num_layers):
            a = nixl.write(src.region, src_ids, via_nixl.region, dst_ids, layers=[layer], rows=rows)
            b = local.write(src.region, src_ids, via_local.region, dst_ids, layers=[layer], rows=rows)
            assert (a.wait(), b.wait()) == (TransferStatus.DONE, TransferStatus.DONE), (a.error, b.error)
    assert np.array_equal(via_nixl.buffer, via_local.buffer)
    assert not np.array_equal(via_nixl.buffer, Cache(spec, 20, 2).buffer)


@needs_nixl
def test_a_peer_killed_mid_transfer_fails_the_write_within_its_deadline(monkeypatch):
    """SIGKILL the receiver while 256 MiB are in flight over TCP: FAILED or TIMEOUT by the deadline, then all is released."""
    from kvcache.transfer.nixl import NixlEngine

    monkeypatch.setenv("UCX_TLS", TCP_ONLY)
    spec = CacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, block_size=64)
    blocks = (256 << 20) // spec.bytes_per_block_per_layer
    peer_proc = Receiver(spec, blocks, seed=0, env={"UCX_TLS": TCP_ONLY})
    try:
        src = KVRegion.from_tensors(spec, {t.name: [np.ones(t.shape(blocks), np.uint16) for _ in range(2)]
                                           for t in spec.tensors()})
        engine = NixlEngine("prefill", kernel_copy=False)  # over TCP, not the kernel's copy on this host
        peer = engine.connect(peer_proc.endpoint)
        ids = np.arange(blocks)
        deadline_s = 8.0
        handle = engine.write(src, ids, peer.regions[0], ids[::-1], timeout=deadline_s)
        assert handle.status() is TransferStatus.PENDING
        os.kill(peer_proc.process.pid, signal.SIGKILL)
        start = time.monotonic()
        status = handle.wait()
        assert status in (TransferStatus.FAILED, TransferStatus.TIMEOUT)
        assert time.monotonic() - start <= deadline_s + 0.5
        assert handle.error
        start = time.monotonic()
        engine.close()
        assert time.monotonic() - start < 10
        assert engine.registered == ()
    finally:
        peer_proc.stop()


@needs_nixl
def test_a_kernel_copy_to_a_peer_that_died_fails_at_once_and_naming_it():
    """The kernel copy into a receiver SIGKILLed after connect: FAILED naming the process, well within the
    deadline, and the engine writes on to a live peer."""
    from kvcache.transfer.nixl import KernelCopy, NixlEngine

    if not KernelCopy.supported():
        pytest.skip("no process_vm_writev here")
    spec = make_spec("bf16")
    dead, live = Receiver(spec, 48, seed=5), Receiver(spec, 48, seed=6)
    try:
        src = Cache(spec, 40, seed=4)
        with NixlEngine("prefill", threads=2) as engine:
            gone, peer = engine.connect(dead.endpoint), engine.connect(live.endpoint)
            assert {gone.agent, peer.agent} <= set(engine._kernel_peers)
            dead.process.kill()
            dead.process.join(5)
            start = time.monotonic()
            handle = engine.write(src.region, np.arange(30), gone.regions[0], np.arange(30), timeout=10)
            assert handle.wait() is TransferStatus.FAILED and f"process {gone.pid}" in handle.error
            assert time.monotonic() - start < 2
            ok = engine.write(src.region, np.arange(30), peer.regions[0], np.arange(30)[::-1], notify=b"n")
            assert ok.wait() is TransferStatus.DONE, ok.error
            got = np.frombuffer(live.call("dump"), dtype=np.uint8)
            assert np.array_equal(got, Cache(spec, 48, seed=6).expect_copy(src, np.arange(30), np.arange(30)[::-1]))
    finally:
        dead.stop()
        live.stop()


def test_kernel_copy_is_refused_by_a_process_that_is_gone_and_stops_at_its_deadline():
    """``finds`` a token only in the process that holds it (not another one, not one that is gone); a write past
    its deadline copies nothing."""
    from kvcache.transfer.nixl import KernelCopy
    from kvcache.transfer.regions import CopyRanges

    if not KernelCopy.supported():
        pytest.skip("no process_vm_writev here")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    copy = KernelCopy(2)
    try:
        src, dst = np.arange(4096, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
        token = np.frombuffer(os.urandom(16), dtype=np.uint8).copy()
        assert copy.finds(os.getpid(), token.ctypes.data, token.tobytes())
        assert not copy.finds(os.getpid(), token.ctypes.data, bytes(16))  # another token: not the process named
        assert not copy.finds(child.pid, token.ctypes.data, token.tobytes())
        ranges = CopyRanges(np.array([src.ctypes.data], np.int64), np.array([dst.ctypes.data], np.int64),
                            np.array([4096], np.int64))
        with pytest.raises(TimeoutError):
            copy.write(os.getpid(), ranges, time.monotonic() - 1)
        assert not dst.any()
        copy.write(os.getpid(), ranges, time.monotonic() + 5)
        assert np.array_equal(dst, src)
        with pytest.raises(OSError):
            copy.write(child.pid, ranges, time.monotonic() + 5)
    finally:
        copy.close()


def test_kernel_copy_goes_on_where_the_kernel_stopped_a_call_past_two_gib():
    """process_vm_writev copies at most 2 GiB less a page a call: a range past that lands whole, in pieces,
    with the scattered small ranges around it."""
    from kvcache.transfer.nixl import KernelCopy
    from kvcache.transfer.regions import CopyRanges

    if not KernelCopy.supported():
        pytest.skip("no process_vm_writev here")
    big = (2 << 30) + 3 * 4096 + 5
    src = np.full(big + 64, 7, dtype=np.uint8)
    src[::4093] = 11  # not one value throughout: a piece landing at the wrong offset shows
    dst = np.zeros(big + 64, dtype=np.uint8)
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    ranges = CopyRanges(np.array([base_s + big, base_s, base_s + big + 32], np.int64),
                        np.array([base_d, base_d + 32, base_d + big + 32], np.int64),
                        np.array([32, big, 32], np.int64))
    copy = KernelCopy(1)
    try:
        copy.write(os.getpid(), ranges, time.monotonic() + 60)
    finally:
        copy.close()
    assert np.array_equal(dst[:32], src[big:big + 32]) and np.array_equal(dst[big + 32:], src[big + 32:big + 64])
    assert np.array_equal(dst[32:big + 32], src[:big])


@needs_nixl
def test_connect_to_a_silent_endpoint_fails_within_its_timeout():
    from kvcache.transfer.nixl import NixlEngine

    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        with NixlEngine() as engine:
            start = time.monotonic()
            with pytest.raises(KVCacheError, match="no answer from"):
                engine.connect(f"tcp://127.0.0.1:{port}", timeout=0.3)
            assert time.monotonic() - start < 2
    finally:
        silent.close(0)
        ctx.term()


@needs_nixl
def test_nixl_refuses_writes_to_unknown_peers_and_after_close():
    from kvcache.transfer.nixl import NixlEngine

    spec = make_spec()
    a = Cache(spec, 4, 1)
    stranger = KVRegion.from_description(a.region.describe(), owner="nobody")
    engine = NixlEngine()
    with pytest.raises(KVCacheError, match="'nobody', which is not connected"):
        engine.write(a.region, [0], stranger, [0])
    engine.register(a.region)
    assert engine.registered == (a.region,)
    engine.close()
    assert engine.registered == ()
    with pytest.raises(KVCacheError, match="closed"):
        engine.write(a.region, [0], a.region, [1])



@needs_nixl
@pytest.mark.parametrize("progress", ["", "Thread", None, "spin"])
def test_nixl_engine_refuses_an_unknown_progress_mode(progress):
    from kvcache.transfer.nixl import NixlEngine

    with pytest.raises(KVCacheError, match="progress: unknown"):
        NixlEngine(progress=progress)


@needs_nixl
@pytest.mark.parametrize("threads", [-1, 1.5, "2", True])
def test_nixl_engine_refuses_a_bad_thread_count(threads):
    from kvcache.transfer.nixl import NixlEngine

    with pytest.raises(KVCacheError, match="threads must be a whole number >= 0"):
        NixlEngine(threads=threads)


@needs_nixl
@pytest.mark.parametrize("progress", ["thread", "poll"])
def test_an_idle_nixl_engine_leaves_the_cpu_alone_and_close_ends_its_threads(progress):
    """NIXL's progress thread sleeps in poll() between events (its Python API would make it spin a core); without
    it, the engine's worker progresses UCX once a millisecond when idle."""
    from kvcache.transfer.nixl import NixlEngine

    def cpu_seconds(tids: set[str]) -> float:
        """CPU time of the given threads of this process (gone ones count 0): only the engine's, not other tests'."""
        ticks = 0
        for tid in tids:
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except FileNotFoundError:
                continue
            ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
        return ticks / os.sysconf("SC_CLK_TCK")

    threads_before = set(os.listdir("/proc/self/task"))
    with NixlEngine(threads=3, progress=progress) as engine:
        engine.serve()
        mine = set(os.listdir("/proc/self/task")) - threads_before
        assert mine, "the engine started no thread"
        before = cpu_seconds(mine)
        time.sleep(1.0)
        used = cpu_seconds(mine) - before
    # A spinning thread takes a whole core (NIXL's Python API: 0.8 s per s). Idle, these threads used 0.03-0.06 s
    # here, also with both cores busy, but 0.28 s once on a fresh 2-core CI machine: the bound is half a core.
    assert used < 0.5, f"an idle engine's threads used {used:.2f} s of CPU in 1 s"
    deadline = time.monotonic() + 5
    while set(os.listdir("/proc/self/task")) & mine and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(os.listdir("/proc/self/task")) & mine, "the engine's threads outlived close()"


@needs_nixl
def test_an_inline_write_posts_from_the_caller_when_idle_and_queues_in_order_behind_others():
    """submit(inline=True) posts in the calling thread on an idle engine; behind a queued write it waits its turn."""
    from kvcache.transfer.regions import copy_ranges

    with big_pair() as (spec, blocks, src, engine, remote, peer_proc):
        ids = np.arange(blocks)
        alone = engine.submit(copy_ranges(src.region, ids[:1], remote, ids[:1], layers=[0]), remote.owner,
                              src.region, remote, notify=b"alone", inline=True)
        assert alone.picked_ns and alone.posted_ns, "an idle engine's inline write is posted before submit returns"
        assert alone.wait() is TransferStatus.DONE, alone.error
        assert peer_proc.call("notifications") == {"prefill": [b"alone"]}

        big = engine.write(src.region, ids[1:], remote, ids[1:])
        last = engine.submit(copy_ranges(src.region, ids[:1], remote, ids[:1], layers=[1, 2, 3]), remote.owner,
                             src.region, remote, notify=b"last", after=[big], inline=True)
        assert [big.wait(), last.wait()] == [TransferStatus.DONE] * 2, (big.error, last.error)
        assert big.picked_ns <= last.picked_ns and big.done_ns <= last.done_ns
        got = np.frombuffer(peer_proc.call("dump"), dtype=np.uint8)
        assert np.array_equal(got, Cache(spec, blocks, seed=3).expect_copy(src, ids, ids))
        assert peer_proc.call("notifications") == {"prefill": [b"alone", b"last"]}


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=6), pieces=st.integers(1, 16),
       least=st.integers(1, 3000))
def test_spread_cuts_host_writes_into_pieces_that_move_the_same_bytes(lengths, pieces, least):
    """Each range is cut end to end, in order, into pieces of one size (the last shorter), none under ``least``."""
    from kvcache.transfer.nixl import spread
    from kvcache.transfer.regions import CopyRanges

    length = np.array(lengths, dtype=np.int64)
    src = np.concatenate([[0], np.cumsum(length + 7)[:-1]])  # gaps between ranges: nothing merges
    dst = src[::-1].copy() * 3 + 100_000
    ranges = CopyRanges(src, dst, length)
    total = int(length.sum())
    assert spread(ranges, pieces, least, total_least=total + 1) is ranges  # too small a write: whole
    out = spread(ranges, pieces, least, total_least=0)
    if len(lengths) >= pieces or total < 2 * least:
        assert out is ranges
        return
    assert out.nbytes == total and np.all(out.length > 0) and out.num_ranges <= pieces + len(lengths)
    size = max(least, -(-total // pieces))  # every cut piece is this long, a range's last one at most
    at = 0
    for n in lengths:  # each range's pieces, in order, end to end
        k = -(-n // size)
        assert out.length[at:at + k].tolist() == [size] * (k - 1) + [n - size * (k - 1)]
        at += k
    # Per byte, the same destination as the original write.
    def mapping(r: CopyRanges) -> dict[int, int]:
        return {s + k: d + k for s, d, n in zip(r.src.tolist(), r.dst.tolist(), r.length.tolist()) for k in range(n)}
    assert mapping(out) == mapping(ranges)


def test_a_handle_looked_at_from_several_threads_is_polled_by_one_at_a_time_and_released_once() -> None:
    """A worker waits on a layer while the tier's owner settles the same handle: a finished copy's resources (a
    CUDA event) must be released exactly once and never looked at after."""
    import threading

    from kvcache.transfer.engines import TransferHandle, TransferStatus

    class Probe(TransferHandle):
        def __init__(self) -> None:
            super().__init__(1, 1, time.monotonic() + 30)
            self.inside = self.most_inside = self.released = self.polls_after_release = 0
            self.guard = threading.Lock()

        def _poll(self) -> None:
            with self.guard:
                self.inside += 1
                self.most_inside = max(self.most_inside, self.inside)
            if self.released:
                self.polls_after_release += 1
            time.sleep(1e-4)  # a look takes a while: a second thread would come in now
            if time.monotonic() > self.ready_at:
                self._finish(TransferStatus.DONE)
                self.released += 1
            with self.guard:
                self.inside -= 1

    for _ in range(20):
        probe = Probe()
        probe.ready_at = time.monotonic() + 0.005
        threads = [threading.Thread(target=probe.wait, args=(5,)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert probe.status() is TransferStatus.DONE
        assert (probe.most_inside, probe.released, probe.polls_after_release) == (1, 1, 0)

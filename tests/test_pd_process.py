"""The messager and the receiver in processes of their own: shared cache memory, the PD flow through them, their deaths.

Real parts throughout: spawned link processes mapping the workers' caches, real daemons, NIXL between processes.
"""
from __future__ import annotations

import ctypes
import importlib.util
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvcache.allocator import CacheSpec
from kvcache.allocator.errors import KVCacheError
from kvcache.pd.cluster import Cluster, run_batch, scenario, wait_outcomes
from kvcache.transfer import KVRegion, LayerSignal
from kvcache.transfer.nixl import nixl_available
from kvcache.transfer.sharing import SharedHostBuffer, SharedRegion, share_region

from test_pd import assert_nothing_held, clients, submit_prompts

needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pip install nixl-cu12 --no-deps)")

SPEC = CacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")


def _bytes_at(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers=st.integers(1, 4), heads=st.integers(1, 3), num_blocks=st.integers(1, 9), gap=st.integers(0, 3),
       buffers=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_an_opened_region_addresses_the_same_bytes_as_the_shared_one(layers, heads, num_blocks, gap, buffers, seed):
    """Any layout (block gaps, layers spread over several shared buffers): each tensor's blocks read the same bytes."""
    spec = CacheSpec(num_layers=layers, num_kv_heads=heads, head_dim=8, block_size=4, dtype="bfloat16")
    bpb = np.array([t.bytes_per_block for t in spec.tensors()], dtype=np.int64)
    strides = bpb * (1 + gap)
    per_layer = int((strides * num_blocks).sum())
    owners = [SharedHostBuffer(per_layer * layers) for _ in range(buffers)]
    try:
        rng = np.random.default_rng(seed)
        addrs = np.zeros((layers, len(bpb)), dtype=np.int64)
        for layer in range(layers):  # layers dealt out over the buffers, each at its own offset
            buf = owners[layer % buffers]
            base = buf.array.ctypes.data + (layer // buffers) * per_layer
            addrs[layer] = base + np.concatenate([[0], np.cumsum(strides * num_blocks)[:-1]])
        for buf in owners:
            buf.array[:] = rng.integers(0, 256, buf.array.size, dtype=np.uint8)
        region = KVRegion.from_addresses(spec, num_blocks, addrs, block_strides=np.broadcast_to(strides, addrs.shape))
        with SharedRegion.open(share_region(region)) as opened:
            got = opened.region
            assert got.addrs.shape == region.addrs.shape and not (got.addrs == region.addrs).any()
            for layer in range(layers):
                for t in range(len(bpb)):
                    span = int((num_blocks - 1) * strides[t] + bpb[t])
                    assert (_bytes_at(int(got.addrs[layer, t]), span) == _bytes_at(int(region.addrs[layer, t]), span)).all()
    finally:
        for buf in owners:
            buf.close()


def _child_writes(shared, value: int) -> None:
    with SharedRegion.open(shared) as opened:
        r = opened.region
        _bytes_at(int(r.addrs[0, 0]), int(r.extents().length.sum()))[:] = value


def test_another_process_writes_the_shared_cache():
    with SharedHostBuffer(SPEC.cache_bytes(5)) as buf:
        region = KVRegion.from_buffer(SPEC, 5, buf.array.ctypes.data, keep=(buf,))
        shared = share_region(region)
        p = mp.get_context("spawn").Process(target=_child_writes, args=(shared, 7))
        p.start()
        p.join(60)
        assert p.exitcode == 0
        assert (buf.array == 7).all()
    assert not os.path.exists(buf.path)  # close() removed the file; the array stays readable
    assert buf.array[0] == 7


def test_private_host_memory_is_refused_with_the_reason():
    arr = np.zeros(SPEC.cache_bytes(5), np.uint8)
    region = KVRegion.from_buffer(SPEC, 5, arr.ctypes.data, keep=(arr,))
    with pytest.raises(KVCacheError, match="not one shared file mapping.*SharedHostBuffer"):
        share_region(region)
    with pytest.raises(KVCacheError, match="nbytes"):
        SharedHostBuffer(0)
    for bad in ("../etc/x", "..", ""):
        with pytest.raises(KVCacheError, match="name: .* must be"):
            SharedHostBuffer(64, name=bad)


@needs_nixl
def test_a_messager_process_that_cannot_start_says_why_and_leaves_no_process():
    from kvcache.pd.process import MessagerProcess

    with SharedHostBuffer(SPEC.cache_bytes(5)) as buf:
        region = KVRegion.from_buffer(SPEC, 5, buf.array.ctypes.data, keep=(buf,))
        sig = LayerSignal.create(f"kvcache-test-gone-{os.getpid()}", SPEC.num_layers, replace=True)
        sig.close()  # the creator's close removes the name: the child cannot open it
        before = set(mp.active_children())
        with pytest.raises(KVCacheError, match="start failed: FileNotFoundError"):
            MessagerProcess("ipc:///nonexistent/daemon.sock", region, sig, 0, start_timeout=60)
        assert set(mp.active_children()) == before


@needs_nixl
def test_a_dead_messager_process_is_reported_by_the_next_call():
    from kvcache.pd.process import MessagerProcess

    with SharedHostBuffer(SPEC.cache_bytes(5)) as buf, \
            LayerSignal.create(f"kvcache-test-dead-{os.getpid()}", SPEC.num_layers, replace=True) as sig:
        region = KVRegion.from_buffer(SPEC, 5, buf.array.ctypes.data, keep=(buf,))
        link = MessagerProcess("ipc:///nonexistent/daemon.sock", region, sig, 0, start_timeout=60)
        try:
            assert link.failures == []
            os.kill(link.process.pid, signal.SIGKILL)
            link.process.join(10)
            with pytest.raises(KVCacheError, match=f"pid {link.process.pid}.*exited with code -9"):
                link.run_step(sig.begin_step(), ["r"])
            with pytest.raises(KVCacheError, match="exited"):
                link.failures
        finally:
            link.close()
        assert not link.process.is_alive()


def _slow(link, region, seconds: float, value: str) -> str:
    time.sleep(seconds)
    return value


@needs_nixl
def test_a_call_that_gave_up_at_its_deadline_does_not_answer_the_next_one():
    from kvcache.pd.process import MessagerProcess

    with SharedHostBuffer(SPEC.cache_bytes(5)) as buf, \
            LayerSignal.create(f"kvcache-test-late-{os.getpid()}", SPEC.num_layers, replace=True) as sig:
        region = KVRegion.from_buffer(SPEC, 5, buf.array.ctypes.data, keep=(buf,))
        with MessagerProcess("ipc:///nonexistent/daemon.sock", region, sig, 0, start_timeout=60) as link:
            with pytest.raises(KVCacheError, match="did not answer _slow within 0.2 s"):
                link.call(_slow, 1.0, "late", timeout=0.2)
            assert link.call(_slow, 0.0, "fresh", timeout=30) == "fresh"
            with pytest.raises(KVCacheError, match="_slow failed: TypeError"):
                link.call(_slow, "not seconds", "x")
        assert not link.process.is_alive()


@needs_nixl
def test_links_in_their_own_processes_move_concurrent_requests_byte_for_byte():
    """The PD scenario (fresh prompts, prefix hits on either side) with every messager and receiver in its own process."""
    from kvcache.pd import PDProxy

    with Cluster(layers=4, kv_heads=4, head_dim=32, prefill_tp=2, decode_tp=1, link="process") as cluster:
        for w in cluster.prefill_workers + cluster.decode_workers:
            assert w.call("link_pid") not in (w.process.pid, os.getpid())
        prefill, decode = clients(cluster)
        proxy = PDProxy(prefill, decode)
        for name, prompts, clear in scenario(np.random.default_rng(11), cluster.spec.block_size):
            if clear:
                (prefill if clear == "prefill" else decode).reset_prefix_cache()
            result = run_batch(cluster, proxy, prompts, hand_plans=name != "fresh prompts")
            assert result["problems"] == [], name
        assert_nothing_held(prefill, decode)


@needs_nixl
def test_a_killed_messager_process_fails_its_requests_on_both_sides_and_nothing_stays_held():
    """SIGKILL a prefill rank's messager process mid-step: both schedulers hear the requests failed; both nodes drain."""
    timeout = 6.0
    with Cluster(layers=6, kv_heads=4, head_dim=64, timeout=timeout, link="process") as cluster:
        prefill, decode = clients(cluster)
        prompts, items = submit_prompts(prefill, decode, 5, (400, 700), "m")
        worker = cluster.prefill_workers[0]
        link_pid = worker.call("link_pid")
        worker.send("steps", ([(items, None)], 0.2, True, False, False))  # 1.2 s of "compute"
        time.sleep(0.4)
        os.kill(link_pid, signal.SIGKILL)
        killed = time.monotonic()
        worker._reply("steps", 30)  # the model goes on: send_cache needs no messager
        done, failed = wait_outcomes(prefill, set(prompts), timeout + 5)
        assert not done and set(failed) == set(prompts), (done, failed)
        assert time.monotonic() - killed < timeout + 3
        assert_nothing_held(prefill, decode, within=timeout + 3)


def test_a_receiver_process_refuses_a_gpu_cache_before_starting_anything():
    """Peers could write GPU memory a process imported only through UCX's slow fallback: refused, with the reason."""
    from kvcache.pd.process import ReceiverProcess

    region = KVRegion.from_addresses(SPEC, 4, np.full((SPEC.num_layers, len(SPEC.tensors())), 1 << 40), device="cuda:0")
    before = set(mp.active_children())
    with pytest.raises(KVCacheError, match="cannot take a GPU cache.*DecodeLink"):
        ReceiverProcess("ipc:///nonexistent/daemon.sock", region, 0)
    assert set(mp.active_children()) == before


def _exited(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (its worker, the parent, is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@needs_nixl
def test_a_link_process_exits_when_its_worker_dies_and_the_cluster_leaves_no_shared_cache_behind():
    with Cluster(layers=2, kv_heads=2, head_dim=32, link="process") as cluster:
        worker = cluster.prefill_workers[0]
        link_pid = worker.call("link_pid")
        prefix = cluster.cfg["signal_prefix"]
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"{prefix}-cache-")]  # removed once mapped
        os.kill(worker.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while not _exited(link_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _exited(link_pid)


def run_demo(*flags: str) -> list[str]:
    """examples/pd_demo.py's stderr lines after a refusal (exit code 2)."""
    demo = Path(__file__).resolve().parents[1] / "examples" / "pd_demo.py"
    result = subprocess.run([sys.executable, str(demo), *flags], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    return result.stderr.strip().splitlines()


def test_the_demo_refuses_a_tp_size_the_heads_do_not_split_over_in_one_line():
    assert run_demo("--prefill-tp", "3") == [
        "pd_demo: error: tp_size: 4 kv heads cannot be split over 3 ranks (heads must divide evenly, or the ranks "
        "must be a multiple of the heads)"]


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="PyTorch is installed here")
def test_the_demo_on_cuda_without_pytorch_says_what_to_install():
    assert run_demo("--device", "cuda") == ["pd_demo: error: device: cuda:0 needs PyTorch with CUDA (pip install torch)"]

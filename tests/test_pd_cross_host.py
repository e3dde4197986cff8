"""PD between two nodes on one machine: each node in a network namespace of its own (``kvcache.pd.hosts``).

Within one host NIXL moves KV through the kernel (KernelCopy), UCX's shared memory or cuda_ipc, none of which
exists between nodes. Here each node's daemon, workers and links run in a namespace of their own, joined by a
bridge, with UCX on TCP and the kernel copy off, so every byte (the daemons' messages too) crosses a veth pair:
the path a second node takes. Real `kvcache serve` daemons, real NIXL. The link is pulled mid-transfer (taken
down at the bridge: packets dropped, nobody told) or the decode node is killed; every scenario ends with no block
held, no process left in either namespace and nothing left in /dev/shm.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from kvcache.client import CacheClient
from kvcache.pd import PDProxy
from kvcache.pd.cluster import Cluster, run_batch, scenario, wait_outcomes
from kvcache.pd.hosts import Hosts, unavailable
from kvcache.transfer.nixl import nixl_available

pytestmark = [pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pip install nixl-cu12 --no-deps)"),
              pytest.mark.skipif(bool(unavailable()), reason=f"two nodes need network namespaces: {unavailable()}")]


@pytest.fixture
def hosts():
    with Hosts() as made:
        yield made
    assert not {made.bridge} & set(os.listdir("/sys/class/net"))
    for node in made.nodes.values():
        assert not os.path.exists(f"/run/netns/{node.netns}")


def clients(cluster: Cluster) -> tuple[CacheClient, CacheClient]:
    return CacheClient(cluster.cfg["prefill"], timeout=10), CacheClient(cluster.cfg["decode"], timeout=10)


def assert_nothing_held(prefill: CacheClient, decode: CacheClient, within: float = 0.0) -> None:
    """Both nodes back to zero blocks in use (waiting up to ``within`` seconds), and consistent."""
    deadline = time.monotonic() + within
    while (prefill.usage.max, decode.usage.max) != (0.0, 0.0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (prefill.usage.max, decode.usage.max) == (0.0, 0.0)
    assert prefill.stats()["in_transfer"] == decode.stats()["in_transfer"] == 0
    prefill.check_integrity()
    decode.check_integrity()


def assert_new_requests_move(cluster: Cluster, proxy: PDProxy, prefill: CacheClient, decode: CacheClient) -> None:
    """After a failure: both nodes hold nothing (within 10 s), then new requests move byte for byte over the same
    workers, and again nothing stays held."""
    assert_nothing_held(prefill, decode, within=10)
    fresh = {f"after{i}": np.random.default_rng(20 + i).integers(0, 50_000, n) for i, n in enumerate((129, 640))}
    assert run_batch(cluster, proxy, fresh)["problems"] == []
    assert_nothing_held(prefill, decode)


def assert_nodes_left_nothing(hosts: Hosts, cluster: Cluster) -> None:
    """After ``cluster.close()``: no process in either node's namespace, nothing of the cluster's in /dev/shm."""
    assert hosts.pids("prefill") == [] and hosts.pids("decode") == []
    assert [f for f in os.listdir("/dev/shm") if cluster.cfg["signal_prefix"] in f] == []


def submit(proxy: PDProxy, seed: int, lengths: tuple[int, ...], prefix: str) -> tuple[dict, list]:
    """Fresh prompts through the proxy; returns them and their prefill step's items (whole prompts)."""
    rng = np.random.default_rng(seed)
    prompts = {f"{prefix}{i}": rng.integers(0, 50_000, n) for i, n in enumerate(lengths)}
    placed = {r: proxy.submit(r, t) for r, t in prompts.items()}
    return prompts, [(r, t, np.asarray(placed[r][1].table)[0].copy(), 0) for r, t in prompts.items()]


@pytest.mark.parametrize("link", ["thread", "process"])
def test_kv_crosses_the_link_between_two_nodes_byte_for_byte(hosts, link):
    """Fresh prompts, then prefix hits on both nodes, on prefill only, on decode only: every decode byte is the
    prefill node's and the model's, the bytes went over the decode node's link, and no engine copies with the kernel."""
    with Cluster(layers=4, kv_heads=4, head_dim=32, link=link, hosts=hosts) as cluster:
        assert cluster.cfg["decode"].startswith(f"tcp://{hosts.nodes['decode'].address}:")
        assert [w.call("kernel_copy") for w in cluster.prefill_workers + cluster.decode_workers] == [False, False]
        prefill, decode = clients(cluster)
        proxy = PDProxy(prefill, decode)
        before = hosts.link_bytes("decode")
        moved = 0
        for name, prompts, clear in scenario(np.random.default_rng(11), cluster.spec.block_size):
            if clear:
                (prefill if clear == "prefill" else decode).reset_prefix_cache()
            result = run_batch(cluster, proxy, prompts)
            assert result["problems"] == [], name
            moved += result["bytes"]
        assert moved > 1 << 20
        assert hosts.link_bytes("decode").received - before.received >= moved  # the KV crossed the wire
        assert_nothing_held(prefill, decode)
    assert_nodes_left_nothing(hosts, cluster)


def test_a_link_pulled_mid_transfer_fails_the_request_on_both_nodes_at_the_deadline_and_frees_every_block(hosts):
    """The decode node's link goes down while the prefill node streams layers into it, with no reset: the writes
    time out at the plan's deadline, the prefill node fails and frees the requests, and the decode node (unreachable
    meanwhile) fails and frees them at its own deadline. Back up, the same workers move new requests byte for byte."""
    timeout = 4.0
    with Cluster(layers=6, kv_heads=4, head_dim=64, timeout=timeout, hosts=hosts) as cluster:
        prefill, decode = clients(cluster)
        proxy = PDProxy(prefill, decode)
        run_batch(cluster, proxy, {"warm": np.arange(300)})  # connects the messager to the receiver
        prompts, items = submit(proxy, 5, (700, 900), "cut")
        stepped = threading.Thread(target=cluster.step, args=(items, 0.25))  # 1.5 s of compute, a layer at a time
        stepped.start()
        time.sleep(0.6)  # a couple of layers are on their way
        hosts.cut("decode")
        cut = time.monotonic()
        stepped.join(30)
        done, failed = wait_outcomes(prefill, set(prompts), timeout + 10)
        assert not done and set(failed) == set(prompts), (done, failed)
        assert time.monotonic() - cut < timeout + 10
        assert prefill.usage.max == 0.0 and prefill.stats()["in_transfer"] == 0
        assert all(prefill.lookup(t) == 0 for t in prompts.values())  # KV nobody finished sending is not offered
        time.sleep(max(0.0, cut + timeout + 1 - time.monotonic()))  # the decode node's deadline passes unseen
        hosts.restore("decode")
        done, failed = wait_outcomes(decode, set(prompts), 30)
        assert not done and set(failed) == set(prompts), (done, failed)
        assert_new_requests_move(cluster, proxy, prefill, decode)
    assert_nodes_left_nothing(hosts, cluster)


def test_a_decode_node_killed_mid_transfer_fails_the_request_on_the_prefill_node_within_its_deadline(hosts):
    """SIGKILL the decode daemon and workers while layers stream over the link: the prefill scheduler hears of it
    within the deadline, the prefill node holds nothing, and nothing is left running in the decode node."""
    timeout = 5.0
    with Cluster(layers=6, kv_heads=4, head_dim=64, timeout=timeout, hosts=hosts) as cluster:
        prefill, decode = clients(cluster)
        proxy = PDProxy(prefill, decode)
        prompts, items = submit(proxy, 6, (500, 900), "kill")
        stepped = threading.Thread(target=cluster.step, args=(items, 0.2))
        stepped.start()
        time.sleep(0.5)
        cluster.kill_decode()
        killed = time.monotonic()
        stepped.join(30)
        done, failed = wait_outcomes(prefill, set(prompts), timeout + 5)
        assert not done and set(failed) == set(prompts), (done, failed)
        assert time.monotonic() - killed < timeout + 3
        assert prefill.usage.max == 0.0 and prefill.stats()["in_transfer"] == 0
        prefill.check_integrity()
        deadline = time.monotonic() + 10
        while hosts.pids("decode") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hosts.pids("decode") == []
    assert_nodes_left_nothing(hosts, cluster)


def test_bench_pd_quick_runs_between_two_nodes(capsys):
    import json

    from kvcache.bench import pd as bench
    from kvcache.bench.common import run_alone

    assert run_alone(bench.add_parser, "pd", ["--quick", "--json", "--cross-host"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["workload"]["cross_host"] is True
    assert r["rate"] > 0 and r["stream_rate"] > 0 and r["tail_s"]["median"] > 0


def test_kvcache_kernel_copy_0_turns_the_kernel_copy_off_in_engines_not_told_otherwise(monkeypatch):
    """The documented switch: KVCACHE_KERNEL_COPY=0 sends every write through NIXL (what a second node gets);
    ``kernel_copy=`` still decides where given; a value other than 0 or 1 is refused, naming the variable."""
    from kvcache.allocator.errors import KVCacheError
    from kvcache.transfer.nixl import KERNEL_COPY_ENV, KernelCopy, NixlEngine

    monkeypatch.setenv(KERNEL_COPY_ENV, "0")
    for kwargs, expected in (({}, False), ({"kernel_copy": True}, KernelCopy.supported())):
        engine = NixlEngine(**kwargs)
        try:
            assert engine.kernel_copy is expected
        finally:
            engine.close()
    monkeypatch.setenv(KERNEL_COPY_ENV, "yes")
    with pytest.raises(KVCacheError, match=f"^{KERNEL_COPY_ENV}: must be 0 .off. or 1 .on., got 'yes'$"):
        NixlEngine()

"""Host tier on a GPU: blocks offloaded to pinned host memory and loaded back, byte for byte, PyTorch caches standing in for Paddle's."""
from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvcache.allocator import CacheSpec, KVCacheManager  # noqa: E402
from kvcache.transfer import HostTierConfig, KVRegion, TransferManager, TransferStatus  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BLOCKS = 64
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "uint8": torch.uint8,
          "int8": torch.int8, "float8_e4m3fn": torch.uint8}


def make_spec(**overrides) -> CacheSpec:
    fields = dict(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    fields.update(overrides)
    return CacheSpec(**fields)


def random_caches(spec: CacheSpec, seed: int, device: str = "cuda") -> list[list["torch.Tensor"]]:
    """Per layer, per spec tensor: random bytes viewed as the tensor's dtype, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(spec.num_layers):
        row = []
        for t in spec.tensors():
            raw = torch.randint(0, 256, (BLOCKS, t.bytes_per_block), dtype=torch.uint8, generator=g)
            row.append(raw.view(DTYPES[t.dtype]).reshape(t.shape(BLOCKS)).to(device))
        out.append(row)
    return out


def raw(x: "torch.Tensor") -> "torch.Tensor":
    """The bytes of a contiguous tensor (bit patterns compared, so NaNs compare equal)."""
    return x.contiguous().view(torch.uint8).cpu()


def second_gpu() -> str:
    """cuda:1 for a cache on another GPU than the process's current one (as a PD decode node beside its prefill
    node), with cuda:0 in use first; skips on a one-GPU machine."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    torch.cuda.set_device(0)
    torch.ones(1, device="cuda:0").sum().item()
    return "cuda:1"


@pytest.mark.parametrize("mode, quant, device", [("uniform", "none", "cuda:0"), ("head-wise", "none", "cuda:0"),
                                                 ("head-wise", "block_wise_fp8", "cuda:0"),
                                                 ("head-wise", "none", "cuda:1")])
def test_evicted_blocks_reload_from_pinned_host_byte_for_byte(mode: str, quant: str, device: str) -> None:
    """free -> offload to pinned host; every GPU block rewritten by new owners; admit -> load -> the old bytes.
    Also with the cache on the second GPU: its copies run there, whichever device the process uses."""
    spec = make_spec(quant=quant)
    if device != "cuda:0":
        device = second_gpu()
    caches = random_caches(spec, 1, device)
    region = KVRegion.from_tensors(spec, caches)
    manager = KVCacheManager.from_spec(spec, BLOCKS, head_wise=mode == "head-wise", enable_events=True)
    with TransferManager(manager, region, HostTierConfig(host_blocks=BLOCKS)) as tm:
        assert tm.host.pinned, "on a GPU machine the host tier is page-locked"
        bs = spec.block_size
        prompt = list(range(1, 10 * bs + 2))  # 10 full blocks and 2 tokens: a hit takes all 10
        first = manager.admit("a", prompt)
        table = first.table.copy()
        saved = [[raw(c) for c in row] for row in caches]
        manager.free("a")
        assert tm.drain(60)
        assert tm.stats().offloaded_blocks == 10
        fillers = [f"f{i}" for i in range(BLOCKS)]
        for i, rid in enumerate(fillers):
            assert manager.admit(rid, [i]) is not None
        for row in caches:  # the new owners write every block
            for c in row:
                c.view(torch.uint8).copy_(torch.randint(0, 256, c.view(torch.uint8).shape, dtype=torch.uint8))
        for rid in fillers:
            manager.free(rid)
        assert tm.lookup(prompt) == (0, 10 * bs)
        second = manager.admit("b", prompt)
        assert second.num_cached_tokens == 10 * bs
        load = tm.load("b")
        for layer in range(spec.num_layers):
            assert load.wait(layer, timeout=60) is TransferStatus.DONE
        torch.cuda.synchronize(device)
        new = second.table
        heads = [None] if mode == "uniform" else range(new.shape[0])
        for layer, row in enumerate(caches):
            now = [raw(c) for c in row]
            for t in range(len(row)):
                for col in range(10):
                    for r in heads:
                        i = 0 if r is None else r
                        got = now[t][int(new[i, col])]
                        want = saved[layer][t][int(table[i, col])]
                        if r is not None:
                            got, want = got[r], want[r]
                        assert torch.equal(got, want), f"layer {layer} tensor {t} column {col} head {r}"
        tm.poll()
        tm.check_integrity()
        manager.check_integrity()
        assert tm.stats().loaded_blocks == 10


@pytest.mark.parametrize("device", ["cuda:0", "cuda:1"])
def test_offload_of_a_4096_token_request_lands_in_pinned_host_memory_byte_for_byte(device: str) -> None:
    """The benchmark's shape at 4 layers: 256 scattered blocks out and back through the CUDA path (staged copies),
    also from the second GPU."""
    spec = make_spec(num_layers=4)
    blocks = 512
    if device != "cuda:0":
        device = second_gpu()
    caches = [[torch.randint(0, 256, (blocks, t.bytes_per_block), dtype=torch.uint8, device=device)
               .view(torch.bfloat16).reshape(t.shape(blocks)) for t in spec.tensors()] for _ in range(spec.num_layers)]
    region = KVRegion.from_tensors(spec, caches)
    manager = KVCacheManager.from_spec(spec, blocks)
    rng = np.random.default_rng(0)
    with TransferManager(manager, region, HostTierConfig(host_bytes=256 * spec.bytes_per_block)) as tm:
        fillers = [("f", i) for i in range(blocks)]
        for i, rid in enumerate(fillers):
            manager.admit(rid, [i])
        for k in rng.permutation(blocks).tolist():
            manager.free(fillers[k])
        prompt = rng.integers(0, 50_000, 4096).tolist()
        table = manager.admit("a", prompt).table.copy()
        saved = [[raw(c) for c in row] for row in caches]
        manager.free("a")
        assert tm.drain(60)
        ids = tm.host_blocks_of(b"".join(manager._hasher.hash_blocks(np.asarray(prompt, dtype=np.uint32))))
        assert (ids[:, 0] >= 0).all()
        host = [[torch.from_numpy(np.ctypeslib.as_array(
            (ctypes.c_uint8 * t.nbytes(tm.num_blocks)).from_address(int(tm.host.addrs[layer, k]))))
            .reshape(tm.num_blocks, -1) for k, t in enumerate(spec.tensors())] for layer in range(spec.num_layers)]
        for layer in range(spec.num_layers):
            for k in range(len(spec.tensors())):
                want = saved[layer][k].reshape(blocks, -1)[torch.from_numpy(table[0].astype(np.int64))]
                got = host[layer][k][torch.from_numpy(ids[:, 0].astype(np.int64))]
                assert torch.equal(got, want), f"layer {layer} tensor {k}"


@pytest.mark.parametrize("host_file", [False, True])
def test_the_daemons_host_tier_brings_gpu_blocks_back_byte_for_byte(daemon, host_file: bool) -> None:
    """A real `kvcache serve` with a host tier and a TierAgent over CUDA tensors: free -> offload; every GPU block
    rewritten by another request; admit -> reload -> the old bytes. With a host file in /dev/shm the agent is
    restarted on it before the reload (the file's memory registered for the copies, the daemon keeping the blocks)."""
    import os
    from pathlib import Path

    from kvcache.client import CacheClient
    from kvcache.tier_agent import TierAgent
    from kvcache.worker import TableSubscriber

    spec = make_spec()
    bs = spec.block_size
    d = daemon("--num-blocks", str(BLOCKS), "--block-size", str(bs), "--host-block-budget", str(2 * BLOCKS),
               "--hash-seed", "gpu tier")
    caches = random_caches(spec, 7)
    region = KVRegion.from_tensors(spec, caches)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    path = shm / f"kvcache-test-host-{os.getpid()}" if host_file else None
    client, sub = CacheClient(d.endpoint, timeout=30), TableSubscriber(d.endpoint)
    agent = TierAgent(sub, region, host_file=path)
    try:
        def settled(cached: int) -> dict:
            sub.wait_for(client.last_seq)
            assert agent.drain(60)
            for _ in range(500):
                stats = client.stats()["host_tier"]
                if stats["cached_blocks"] >= cached and stats["pending_offloads"] == stats["pending_loads"] == 0:
                    return stats
                time.sleep(0.01)
            return stats

        prompt = list(range(1, 10 * bs + 2))  # 10 full blocks and 2 tokens: a hit takes all 10
        table = np.asarray(client.admit("a", prompt).table).copy()
        saved = [[raw(c) for c in row] for row in caches]
        client.free("a")
        assert settled(10)["cached_blocks"] == 10
        if host_file:
            agent.close()
            agent = TierAgent(sub, region, host_file=path)  # a restarted worker on the same file
            assert client.stats()["host_tier"]["cached_blocks"] == 10
        filler = client.admit("f", list(range(1000, 1000 + BLOCKS * bs)))
        assert filler is not None
        for row in caches:  # the new owner writes every GPU block
            for c in row:
                c.view(torch.uint8).random_(0, 256)
        client.free("f")
        settled(10)
        again = client.admit("b", prompt)
        assert again.num_host_tokens == again.num_cached_tokens == 10 * bs
        sub.wait_for(client.last_seq)
        for layer in range(spec.num_layers):
            assert agent.wait(layer, 60) is TransferStatus.DONE
        now = np.asarray(again.table)
        for layer, row in enumerate(caches):
            for t, c in enumerate(row):
                got = raw(c)
                for col in range(10):
                    assert torch.equal(got[int(now[0, col])], saved[layer][t][int(table[0, col])]), (layer, t, col)
    finally:
        agent.close()
        sub.close()
        client.close()
        if path is not None:
            path.unlink(missing_ok=True)

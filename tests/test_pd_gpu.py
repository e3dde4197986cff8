"""PD disaggregation with PyTorch caches on a GPU: the demo's checks, and the benchmark's smoke run (VRAM over NIXL)."""
from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvcache.transfer.nixl import nixl_available  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")]
DEMO = Path(__file__).resolve().parent.parent / "examples" / "pd_demo.py"


@pytest.mark.parametrize("tp, link", [(("1", "1"), "thread"), (("2", "1"), "thread"), (("2", "1"), "process")])
def test_the_demo_moves_gpu_caches_byte_for_byte(tp, link):
    """With ``process``, every messager and receiver maps its worker's GPU cache through CUDA IPC."""
    run = subprocess.run([sys.executable, str(DEMO), "--device", "cuda", "--prefill-tp", tp[0], "--decode-tp", tp[1],
                          "--layers", "4", "--link", link], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK: decode KV equals prefill KV byte for byte" in run.stdout


def test_bench_pd_quick_runs_on_gpu_caches(capsys):
    from kvcache.bench import pd as bench
    from kvcache.bench.common import run_alone

    assert run_alone(bench.add_parser, "pd", ["--quick", "--json", "--device", "cuda"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["workload"]["device"] == "cuda:0" and r["rate"] > 0 and r["tail_s"]["median"] > 0


def test_the_demo_moves_head_wise_gpu_caches_byte_for_byte():
    run = subprocess.run([sys.executable, str(DEMO), "--device", "cuda", "--prefill-tp", "2", "--layers", "4",
                          "--rows", "window:64:16*2,full*2"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK: decode KV equals prefill KV byte for byte" in run.stdout


def test_layer_group_rows_move_between_gpu_caches_byte_for_byte():
    """A Gemma-shaped config served with a pool per layer group (the sliding layers' smaller): fresh prompts and
    prefix hits on either node, prefill TP 2 -> decode TP 1, every decode byte the model's, on GPU caches."""
    from kvcache.client import CacheClient
    from kvcache.pd import PDProxy
    from kvcache.pd.cluster import Cluster, run_batch, scenario
    import numpy as np

    config = {"model_type": "gemma3_text", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
              "head_dim": 32, "sliding_window": 32, "sink_size": 16, "sliding_window_pattern": 2}
    with Cluster(model=config, memory="32MiB", max_model_len=2048, max_num_batched_tokens=1040, prefill_tp=2,
                 device="cuda:0") as cluster:
        prefill, decode = CacheClient(cluster.cfg["prefill"]), CacheClient(cluster.cfg["decode"])
        blocks = cluster.cfg["layer_blocks"]["decode"]
        assert blocks[0] < blocks[1]
        proxy = PDProxy(prefill, decode)
        for name, prompts, clear in scenario(np.random.default_rng(6), cluster.spec.block_size):
            if clear:
                (prefill if clear == "prefill" else decode).reset_prefix_cache()
            assert run_batch(cluster, proxy, prompts)["problems"] == [], name


def _child_fills(shared, value: int) -> None:
    """In a process without PyTorch (as a link process): fill each tensor's first block through the opened mapping."""
    from kvcache.transfer.engines import CudaRuntime
    from kvcache.transfer.sharing import SharedRegion

    with SharedRegion.open(shared) as opened:
        r = opened.region
        rt = CudaRuntime()  # the sharer's libcudart, which SharedRegion.open chose
        block = int(r.block_bytes[0])
        host = (ctypes.c_uint8 * block)(*([value] * block))
        for addr in r.addrs.ravel().tolist():
            rt.check(rt.lib.cudaMemcpyAsync(ctypes.c_void_p(addr), host, block, 1, None), "copy")
        rt.check(rt.lib.cudaStreamSynchronize(None), "sync")


def test_a_gpu_region_opened_in_another_process_writes_the_same_memory():
    """CUDA IPC: the child writes each tensor's first block through its own mapping; the owner sees it."""
    import multiprocessing as mp

    from kvcache.allocator import CacheSpec
    from kvcache.transfer import KVRegion
    from kvcache.transfer.sharing import share_region

    spec = CacheSpec(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
    layers = [[torch.zeros(t.shape(8), dtype=torch.bfloat16, device="cuda:0") for t in spec.tensors()]
              for _ in range(spec.num_layers)]
    region = KVRegion.from_tensors(spec, layers)
    p = mp.get_context("spawn").Process(target=_child_fills, args=(share_region(region), 0x3F))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    for row in layers:
        for t in row:
            raw = t.view(torch.uint8).reshape(8, -1)
            assert bool((raw[0] == 0x3F).all()) and bool((raw[1:] == 0).all())


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@two_gpus
@pytest.mark.parametrize("prefill_tp, decode_tp, prefill_device, decode_device, link", [
    (1, 1, "cuda:0", "cuda:1", "thread"),
    (2, 1, "cuda:0", "cuda:1", "process"),
    (2, 1, "cuda:0,cuda:1", "cuda:1", "thread"),
    (1, 2, "cuda:1", "cuda:0,cuda:1", "thread"),
])
def test_caches_on_two_gpus_move_gpu_to_gpu_byte_for_byte(prefill_tp, decode_tp, prefill_device, decode_device,
                                                          link):
    """Each role's caches on their own GPU (or a GPU per rank): fresh prompts and prefix hits on either node arrive
    byte for byte, every decode byte the model's, and both nodes hold nothing after."""
    from kvcache.client import CacheClient
    from kvcache.pd import PDProxy
    from kvcache.pd.cluster import Cluster, role_devices, run_batch, scenario
    import numpy as np

    with Cluster(layers=4, kv_heads=4, head_dim=64, prefill_tp=prefill_tp, decode_tp=decode_tp,
                 prefill_device=prefill_device, decode_device=decode_device, link=link) as cluster:
        assert [w.call("device") for w in cluster.prefill_workers] == role_devices(prefill_device, prefill_tp, "")
        assert [w.call("device") for w in cluster.decode_workers] == role_devices(decode_device, decode_tp, "")
        prefill, decode = CacheClient(cluster.cfg["prefill"]), CacheClient(cluster.cfg["decode"])
        proxy = PDProxy(prefill, decode)
        for name, prompts, clear in scenario(np.random.default_rng(7), cluster.spec.block_size):
            if clear:
                (prefill if clear == "prefill" else decode).reset_prefix_cache()
            assert run_batch(cluster, proxy, prompts)["problems"] == [], name
        assert (prefill.usage.max, decode.usage.max) == (0.0, 0.0)
        assert prefill.stats()["in_transfer"] == decode.stats()["in_transfer"] == 0


@two_gpus
def test_bench_pd_quick_runs_across_two_gpus_against_cuda_memcpy_peer(capsys):
    from kvcache.bench import pd as bench
    from kvcache.bench.common import run_alone

    assert run_alone(bench.add_parser, "pd", ["--quick", "--json", "--prefill-device", "cuda:0",
                                              "--decode-device", "cuda:1"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["workload"]["device"], r["workload"]["decode_device"]) == ("cuda:0", "cuda:1")
    assert r["rate"] > 0 and r["peer_rate"] > 0 and r["nixl_vs_peer"] > 0 and r["tail_s"]["median"] > 0

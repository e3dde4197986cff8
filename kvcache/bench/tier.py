"""`kvcache bench tier`: the host tier's offload and reload of one request, against one memcpy of the same bytes.

Workload: one request of 4,096 tokens, 32 layers, 8 kv heads x 128, bf16, block 16 and 64,
its blocks at scattered ids of a cache twice its size. Each round, after ``reset_prefix_cache``:
  offload: ``free`` the request, then wait until the host copy of every block is findable
           (``drain``): hashing, host allocation, 32 per-layer writes, settling;
  reload:  evict its GPU blocks, then ``admit`` the prompt again and wait for every layer of the load:
           host match, GPU allocation, 32 per-layer writes;
  limits:  one copy of the same total bytes in each direction: on a GPU one pinned cudaMemcpyAsync,
           on the CPU one memcpy (the faster of numpy's copyto and one range through the engine).
The scheduler's own call (``free``/``admit``) is timed too: it only decides and records the copies (the tier's submit
thread works out their ranges and launches them); an admit with the host hit is compared with the same admit finding
nothing (target: within 1.5x).
With ``--daemon`` the same rounds go through a real ``kvcache serve --host-block-budget``: the scheduler's calls
are a ``CacheClient``'s, and a ``TierAgent`` beside a ``TableSubscriber`` copies what the daemon orders and
reports it; offload ends when the agent's reports are in, reload when the agent has every layer.
Target: >= 90% of the limit. Exits 0 whatever the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import numpy as np

from kvcache.allocator.manager import KVCacheManager
from kvcache.allocator.prefix import BlockHasher
from kvcache.bench.common import mark as _mark
from kvcache.arguments import positive_int as _positive_int
from kvcache.bench.common import progress as _progress
from kvcache.bench.common import table as _table
from kvcache.bench.transfer import BLOCK_SIZES, CACHE_FACTOR, HEAD_DIM, KV_HEADS, LAYERS, QUICK_LAYERS, SEED, TOKENS
from kvcache.bench.transfer import host_region, make_spec, one_range
from kvcache.transfer.engines import LocalEngine, TransferStatus
from kvcache.transfer.manager import HostTierConfig, TransferManager
from kvcache.transfer.regions import KVRegion

REPEAT = 10
QUICK_REPEAT = 3
TARGET = 0.90
ADMIT_TARGET = 1.5  # an admit with a host hit over one with none


def _ok(handle: Any) -> None:
    status = handle.wait()
    if status is not TransferStatus.DONE:
        raise RuntimeError(f"transfer {status.value}: {handle.error}")


class _Setup:
    """A cache twice the request, its region, the limit copies, and (in subclasses) a host tier over them."""

    def __init__(self, block_size: int, layers: int, torch: Any) -> None:
        spec = make_spec(block_size, layers)
        self.spec = spec
        n = TOKENS // block_size
        num_blocks = CACHE_FACTOR * n
        self.keep: list[Any] = []
        nbytes = spec.bytes_per_block * n
        self.nbytes = nbytes
        if torch is not None:
            shape = (num_blocks, KV_HEADS, block_size, HEAD_DIM)
            caches = [[torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2)] for _ in range(layers)]
            self.region = KVRegion.from_tensors(spec, caches)
            flat_gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.keep += [caches, flat_gpu, flat_host]
            self.limits = {"offload": [one_range(nbytes, flat_gpu.data_ptr(), flat_host.data_ptr())],
                           "reload": [one_range(nbytes, flat_host.data_ptr(), flat_gpu.data_ptr())]}
            self.device = "cuda:0"
            self.limit_name = "one pinned cudaMemcpyAsync"
        else:
            self.region, buffer = host_region(spec, num_blocks, 1)
            other = np.empty(nbytes, dtype=np.uint8)
            self.keep += [buffer, other]
            self.copyto = (lambda: np.copyto(other, buffer[:nbytes]), lambda: np.copyto(buffer[:nbytes], other))
            self.limits = {"offload": [one_range(nbytes, buffer.ctypes.data, other.ctypes.data)],
                           "reload": [one_range(nbytes, other.ctypes.data, buffer.ctypes.data)]}
            self.device = "cpu"
            self.limit_name = "one memcpy"
        self.num_blocks = num_blocks
        self.limit_engine = LocalEngine(timeout=120.0, cuda_method="loop")  # one range: one cudaMemcpyAsync
        self.hasher = BlockHasher(block_size, "sha256", b"bench tier")  # the manager's hashes: where blocks sit
        self.rng = np.random.default_rng(SEED)
        self.prompt = self.rng.integers(0, 50_000, TOKENS, dtype=np.uint32)

    def limits_round(self, out: dict[str, float]) -> None:
        """The request's bytes through each limit copy; seconds into ``out``."""
        for name in ("offload", "reload"):
            t0 = time.perf_counter()
            _ok(self.limit_engine.submit(self.limits[name][0], device=self.device))
            out[f"{name}_limit"] = time.perf_counter() - t0
        if self.device == "cpu":
            for name, fn in zip(("offload", "reload"), self.copyto):
                t0 = time.perf_counter()
                fn()
                out[f"{name}_limit"] = min(out[f"{name}_limit"], time.perf_counter() - t0)

    def engine_round(self, out: dict[str, float], engine: LocalEngine, host: KVRegion, gpu_ids: np.ndarray,
                     host_ids: np.ndarray, hit: int) -> None:
        """The same blocks through one engine write of all layers each way: what the tier adds on top."""
        for name, args in (("offload", (self.region, gpu_ids, host, host_ids)),
                           ("reload", (host, host_ids[:hit], self.region, gpu_ids[:hit]))):
            t0 = time.perf_counter()
            _ok(engine.write(*args))
            out[f"{name}_engine"] = time.perf_counter() - t0

    def close(self) -> None:
        self.limit_engine.close()


class _LibrarySetup(_Setup):
    """A manager over the cache (free ids shuffled) with a ``TransferManager`` host tier in this process."""

    def __init__(self, block_size: int, layers: int, torch: Any) -> None:
        super().__init__(block_size, layers, torch)
        n = TOKENS // block_size
        self.manager = KVCacheManager.from_spec(self.spec, self.num_blocks, hash_seed=b"bench tier")
        self.tm = TransferManager(self.manager, self.region, HostTierConfig(host_blocks=n, timeout=120.0))
        self.engine = LocalEngine(timeout=120.0, cuda_method=self.tm._out.resolved_cuda_method() if torch else "auto")
        self.method = self.tm.resolved_cuda_method() if torch else None

    def shuffle(self) -> None:
        """Scatter the free ids: one-token requests take every block and leave in random order (evicting all)."""
        count = int(self.manager.num_free_blocks.min())
        rids = [("fill", i) for i in range(count)]
        for i, rid in enumerate(rids):
            assert self.manager.admit(rid, [i]) is not None
        for k in self.rng.permutation(count).tolist():
            self.manager.free(rids[k])

    def round(self) -> dict[str, float]:
        """One offload and one reload, timed, then the same bytes through each limit; seconds."""
        m, tm = self.manager, self.tm
        m.reset_prefix_cache()
        self.shuffle()
        out: dict[str, float] = {}
        t0 = time.perf_counter()
        admission = m.admit("r", self.prompt)
        out["admit_call"] = time.perf_counter() - t0
        assert admission is not None and admission.num_cached_tokens == 0
        t0 = time.perf_counter()
        m.free("r")
        t1 = time.perf_counter()
        assert tm.drain(120.0), "offload did not finish"
        t2 = time.perf_counter()
        assert tm.stats().cached_blocks == TOKENS // self.spec.block_size, tm.stats()
        out["offload"], out["offload_call"] = t2 - t0, t1 - t0
        self.shuffle()
        t0 = time.perf_counter()
        admission = m.admit("r", self.prompt)
        t1 = time.perf_counter()
        load = tm.load("r")
        assert admission is not None and load is not None
        for layer in range(self.spec.num_layers):
            if load.wait(layer) is not TransferStatus.DONE:
                raise RuntimeError(f"load of layer {layer}: {load.status(layer).value}")
        t2 = time.perf_counter()
        assert admission.num_cached_tokens == (TOKENS - 1) // self.spec.block_size * self.spec.block_size
        out["reload"], out["reload_call"] = t2 - t0, t1 - t0
        tm.poll()
        # The same blocks through one engine write (all layers, the tier's CUDA method): what the tier adds.
        gpu_ids = admission.table[0]
        host_ids = tm.host_blocks_of(b"".join(self.hasher.hash_blocks(self.prompt)))[: gpu_ids.size, 0]
        assert (host_ids >= 0).all(), "every block of the request is on host"
        hit = admission.num_cached_tokens // self.spec.block_size  # a reload takes all but the last token's block
        self.engine_round(out, self.engine, tm.host, gpu_ids, host_ids, hit)
        m.free("r")
        self.limits_round(out)
        return out

    def close(self) -> None:
        self.tm.close()
        self.engine.close()
        super().close()


class _DaemonSetup(_Setup):
    """The same cache behind a real ``kvcache serve --host-block-budget``, copied by a ``TierAgent``."""

    def __init__(self, block_size: int, layers: int, torch: Any) -> None:
        import tempfile
        from pathlib import Path

        from kvcache.client import CacheClient
        from kvcache.launch import start_serve
        from kvcache.tier_agent import TierAgent
        from kvcache.worker import TableSubscriber

        super().__init__(block_size, layers, torch)
        n = TOKENS // block_size
        self.folder = Path(tempfile.mkdtemp(prefix="kv-bench-tier-", dir="/tmp"))
        endpoint = f"ipc://{self.folder}/k.sock"
        self.process = start_serve(["--endpoint", endpoint, "--num-blocks", str(self.num_blocks), "--block-size",
                                    str(block_size), "--host-block-budget", str(n), "--hash-seed", "bench tier",
                                    "--tier-timeout", "120", "--max-slots", str(self.num_blocks + 8)],
                                   self.folder / "serve.log")
        self.client = CacheClient(endpoint, timeout=120)
        self.sub = TableSubscriber(endpoint, max_slots=self.num_blocks + 8, max_blocks=self.num_blocks + 1,
                                   timeout=120, local=True)
        self.agent = TierAgent(self.sub, self.region, timeout=120.0)
        self.engine = LocalEngine(timeout=120.0, cuda_method=self.agent._engine.resolved_cuda_method() if torch
                                  else "auto")
        self.method = self.agent.resolved_cuda_method() if torch else None

    def shuffle(self) -> None:
        """As in process: one-token requests take every block and leave in random order, in one message each way."""
        count = int(np.min(self.client.num_free_blocks))
        batch = self.client.batch()
        for i in range(count):
            batch.admit(f"fill-{i}", [i])
        assert all(r is not None for r in batch.send())
        batch = self.client.batch()
        for k in self.rng.permutation(count).tolist():
            batch.free(f"fill-{k}")
        batch.send()

    def round(self) -> dict[str, float]:
        c, agent = self.client, self.agent
        c.reset_prefix_cache()
        self.shuffle()
        out: dict[str, float] = {}
        t0 = time.perf_counter()
        admission = c.admit("r", self.prompt)
        out["admit_call"] = time.perf_counter() - t0
        assert admission is not None and admission.num_cached_tokens == 0
        self.sub.wait_for(c.last_seq)
        offloaded = c.stats()["host_tier"]["offloaded_blocks"]
        t0 = time.perf_counter()
        c.free("r")
        t1 = time.perf_counter()
        self.sub.wait_for(c.last_seq)  # the delta with the orders: the agent starts copying
        assert agent.drain(120.0), "offload did not finish"
        t2 = time.perf_counter()
        stats = c.stats()["host_tier"]
        assert stats["offloaded_blocks"] - offloaded == TOKENS // self.spec.block_size, stats
        out["offload"], out["offload_call"] = t2 - t0, t1 - t0
        self.shuffle()
        self.sub.wait_for(c.last_seq)
        t0 = time.perf_counter()
        admission = c.admit("r", self.prompt)
        t1 = time.perf_counter()
        self.sub.wait_for(c.last_seq)
        for layer in range(self.spec.num_layers):
            if agent.wait(layer, 120.0) is not TransferStatus.DONE:
                raise RuntimeError(f"load of layer {layer} did not land")
        t2 = time.perf_counter()
        hit = admission.num_cached_tokens // self.spec.block_size
        assert admission.num_host_tokens == admission.num_cached_tokens == hit * self.spec.block_size
        out["reload"], out["reload_call"] = t2 - t0, t1 - t0
        gpu_ids = np.asarray(admission.table[0])
        self.engine_round(out, self.engine, agent.host, gpu_ids, np.arange(gpu_ids.size, dtype=np.int32), hit)
        c.free("r")
        self.sub.wait_for(c.last_seq)
        agent.drain(120.0)
        self.limits_round(out)
        return out

    def close(self) -> None:
        import shutil

        from kvcache.launch import stop_serve

        self.agent.close()
        self.sub.close()
        self.client.close()
        self.engine.close()
        stop_serve(self.process)
        shutil.rmtree(self.folder, ignore_errors=True)
        super().close()


def bench(layers: int, repeat: int, device: str, daemon: bool = False) -> dict[str, Any]:
    torch = _torch() if device in ("auto", "gpu") else None
    if device == "gpu" and torch is None:
        raise SystemExit("kvcache bench tier: --device gpu needs PyTorch with a CUDA device")
    rows = []
    method = None
    for bs in BLOCK_SIZES:
        setup = (_DaemonSetup if daemon else _LibrarySetup)(bs, layers, torch)
        method = setup.method
        try:
            setup.round()  # warm-up: engines, pinning, kernels
            best: dict[str, float] = {}
            for _ in range(repeat):
                for key, seconds in setup.round().items():
                    best[key] = min(best.get(key, float("inf")), seconds)
        finally:
            setup.close()
        for name in ("offload", "reload"):
            ours, limit = best[name], best[f"{name}_limit"]
            ratio = limit / ours
            rows.append({
                "path": f"{name} ({'device -> host' if name == 'offload' else 'host -> device'})",
                "block_size": bs, "blocks": TOKENS // bs, "bytes": setup.nbytes, "ms": ours * 1e3,
                "call_ms": best[f"{name}_call"] * 1e3, "gb_per_s": setup.nbytes / ours / 1e9,
                "engine_ms": best[f"{name}_engine"] * 1e3, "of_engine": best[f"{name}_engine"] / ours,
                "limit": setup.limit_name, "limit_ms": limit * 1e3, "limit_gb_per_s": setup.nbytes / limit / 1e9,
                "of_limit": ratio, "target": f">= {TARGET:.0%} of limit", "ok": ratio >= TARGET,
            })
        admit = best["reload_call"] / best["admit_call"]
        rows.append({"path": "admit with the host hit / admit finding nothing", "block_size": bs,
                     "ms": best["reload_call"] * 1e3, "limit_ms": best["admit_call"] * 1e3, "ratio": admit,
                     "target": f"<= {ADMIT_TARGET:g}x", "ok": admit <= ADMIT_TARGET})
    info: dict[str, Any] = {"device": "cpu (a host buffer stands in for the GPU cache)"}
    if torch is not None:
        info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda_method": method}
    info["through"] = "kvcache serve and a TierAgent" if daemon else "TransferManager in process"
    return {"benchmark": "tier", "info": info, "rows": rows,
            "config": {"layers": layers, "repeat": repeat, "tokens": TOKENS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                       "block_sizes": list(BLOCK_SIZES), "python": platform.python_version(), "cpus": os.cpu_count()}}


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def render(result: dict[str, Any]) -> str:
    cfg = result["config"]
    rows = [r for r in result["rows"] if "of_limit" in r]
    admits = [r for r in result["rows"] if "ratio" in r]
    return "\n".join([
        f"kvcache bench tier: {cfg['tokens']:,} tokens, {cfg['layers']} layers, {cfg['kv_heads']} kv heads x "
        f"{cfg['head_dim']}, bf16, scattered ids; best of {cfg['repeat']}; {result['info']['device']}; "
        f"{result['info']['through']}"
        + (f"; copies: {result['info']['cuda_method']}" if result["info"].get("cuda_method") else "")
        + f"; python {cfg['python']}, {cfg['cpus']} cpu(s)",
        "  offload = free() until every block is findable on host; reload = admit() until every layer landed;",
        "  call = the scheduler's free()/admit() alone (it records the copies; a submit thread launches them);",
        "  engine = the same blocks in one LocalEngine write of all layers (what the tier adds on top of the engine)",
        _table(["path", "block", "blocks", "MiB", "ms", "call ms", "GB/s", "engine ms", "of engine", "limit",
                "limit ms", "limit GB/s", "of limit", "target", ""],
               [[r["path"], str(r["block_size"]), str(r["blocks"]), f"{r['bytes'] / 2**20:.0f}", f"{r['ms']:.2f}",
                 f"{r['call_ms']:.2f}", f"{r['gb_per_s']:.1f}", f"{r['engine_ms']:.2f}", f"{r['of_engine']:.0%}",
                 r["limit"], f"{r['limit_ms']:.2f}",
                 f"{r['limit_gb_per_s']:.1f}", f"{r['of_limit']:.0%}", r["target"], _mark(r["ok"])] for r in rows],
               align_left=1),
        _table(["scheduler call", "block", "ms", "without a hit, ms", "ratio", "target", ""],
               [[r["path"], str(r["block_size"]), f"{r['ms']:.2f}", f"{r['limit_ms']:.2f}", f"{r['ratio']:.2f}",
                 r["target"], _mark(r["ok"])] for r in admits], align_left=1),
        "",
        f"targets met: {sum(r['ok'] for r in result['rows'])} of {len(result['rows'])}",
    ])


def _run(args: argparse.Namespace) -> int:
    repeat = args.repeat or (QUICK_REPEAT if args.quick else REPEAT)
    layers = args.layers or (QUICK_LAYERS if args.quick else LAYERS)
    _progress(f"offload and reload, {layers} layers, {repeat} rounds each (device {args.device})")
    result = bench(layers, repeat, args.device, args.daemon)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Register `kvcache bench tier`."""
    p = targets.add_parser(
        "tier",
        allow_abbrev=False,
        help="host tier: offload and reload of one request against one memcpy of the same bytes",
        description="Time the host tier (TransferManager) moving one 4,096-token request (32 layers, 8 kv heads "
        "x 128, bf16, block 16 and 64, scattered ids) to host on free and back on a host hit, against one copy of "
        "the same bytes (pinned cudaMemcpyAsync on a GPU, memcpy on the CPU). Always exits 0.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_LAYERS} layers and {QUICK_REPEAT} runs instead of {LAYERS} and {REPEAT}, for tests")
    p.add_argument("--repeat", type=_positive_int, metavar="N", help="timed rounds; the best is reported")
    p.add_argument("--layers", type=_positive_int, metavar="N", help=f"model layers (default {LAYERS})")
    p.add_argument("--daemon", action="store_true",
                   help="through a real kvcache serve --host-block-budget and a TierAgent instead of in process")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="auto: the GPU when PyTorch sees one, else a host buffer stands in for the GPU cache")
    p.set_defaults(run=_run)


if __name__ == "__main__":
    from kvcache.bench.common import run_alone

    sys.exit(run_alone(add_parser, "tier"))

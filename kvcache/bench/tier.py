"""`kvcache bench tier`: the host tier's offload and reload of one request, against one memcpy of the same bytes.

Workload: one request of 4,096 tokens, 32 layers, 8 kv heads x 128, bf16, block 16 and 64,
its blocks at scattered ids of a cache twice its size. Each round, after ``reset_prefix_cache``:
  offload: ``free`` the request, then wait until the host copy of every block is findable
           (``drain``): hashing, host allocation, 32 per-layer writes, settling;
  reload:  evict its GPU blocks, then ``admit`` the prompt again and wait for every layer of the load:
           host match, GPU allocation, 32 per-layer writes;
  limits:  one copy of the same total bytes in each direction: on a GPU one pinned cudaMemcpyAsync,
           on the CPU one memcpy (the faster of numpy's copyto and one range through the engine).
The scheduler's own call (``free``/``admit``) is timed too: it only queues the copies.
Target: >= 85% of the limit, as for the local and GPU swaps. Exits 0 whatever the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
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
TARGET = 0.85


def _ok(handle: Any) -> None:
    status = handle.wait()
    if status is not TransferStatus.DONE:
        raise RuntimeError(f"transfer {status.value}: {handle.error}")


class _Setup:
    """A manager over a cache twice the request (free ids shuffled), its region, a host tier, and the limit copies."""

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
        self.manager = KVCacheManager.from_spec(spec, num_blocks, hash_seed=b"bench tier")
        self.tm = TransferManager(self.manager, self.region, HostTierConfig(host_blocks=n, timeout=120.0))
        self.limit_engine = LocalEngine(timeout=120.0, cuda_method="loop")  # one range: one cudaMemcpyAsync
        self.engine = LocalEngine(timeout=120.0, cuda_method=self.tm.resolved_cuda_method() if torch else "auto")
        self.hasher = BlockHasher(block_size, "sha256", b"bench tier")  # the manager's hashes: where blocks sit
        self.rng = np.random.default_rng(SEED)
        self.prompt = self.rng.integers(0, 50_000, TOKENS, dtype=np.uint32)

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
        admission = m.admit("r", self.prompt)
        assert admission is not None and admission.num_cached_tokens == 0
        out: dict[str, float] = {}
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
        for name, args in (("offload", (self.region, gpu_ids, tm.host, host_ids)),
                           ("reload", (tm.host, host_ids[:hit], self.region, gpu_ids[:hit]))):
            t0 = time.perf_counter()
            _ok(self.engine.write(*args))
            out[f"{name}_engine"] = time.perf_counter() - t0
        m.free("r")
        for name in ("offload", "reload"):
            t0 = time.perf_counter()
            _ok(self.limit_engine.submit(self.limits[name][0], device=self.device))
            out[f"{name}_limit"] = time.perf_counter() - t0
        if self.device == "cpu":
            for name, fn in zip(("offload", "reload"), self.copyto):
                t0 = time.perf_counter()
                fn()
                out[f"{name}_limit"] = min(out[f"{name}_limit"], time.perf_counter() - t0)
        return out

    def close(self) -> None:
        self.tm.close()
        self.limit_engine.close()
        self.engine.close()


def bench(layers: int, repeat: int, device: str) -> dict[str, Any]:
    torch = _torch() if device in ("auto", "gpu") else None
    if device == "gpu" and torch is None:
        raise SystemExit("kvcache bench tier: --device gpu needs PyTorch with a CUDA device")
    rows = []
    method = None
    for bs in BLOCK_SIZES:
        setup = _Setup(bs, layers, torch)
        if torch is not None:
            method = setup.tm.resolved_cuda_method()
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
    info: dict[str, Any] = {"device": "cpu (a host buffer stands in for the GPU cache)"}
    if torch is not None:
        info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda_method": method}
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
    cfg, rows = result["config"], result["rows"]
    return "\n".join([
        f"kvcache bench tier: {cfg['tokens']:,} tokens, {cfg['layers']} layers, {cfg['kv_heads']} kv heads x "
        f"{cfg['head_dim']}, bf16, scattered ids; best of {cfg['repeat']}; {result['info']['device']}; "
        f"python {cfg['python']}, {cfg['cpus']} cpu(s)",
        "  offload = free() until every block is findable on host; reload = admit() until every layer landed;",
        "  call = the scheduler's free()/admit() alone (it only queues per-layer copies); engine = the same blocks",
        "  in one LocalEngine write of all layers (what the tier adds on top of the engine)",
        _table(["path", "block", "blocks", "MiB", "ms", "call ms", "GB/s", "engine ms", "of engine", "limit",
                "limit ms", "limit GB/s", "of limit", "target", ""],
               [[r["path"], str(r["block_size"]), str(r["blocks"]), f"{r['bytes'] / 2**20:.0f}", f"{r['ms']:.2f}",
                 f"{r['call_ms']:.2f}", f"{r['gb_per_s']:.1f}", f"{r['engine_ms']:.2f}", f"{r['of_engine']:.0%}",
                 r["limit"], f"{r['limit_ms']:.2f}",
                 f"{r['limit_gb_per_s']:.1f}", f"{r['of_limit']:.0%}", r["target"], _mark(r["ok"])] for r in rows],
               align_left=1),
        "",
        f"targets met: {sum(r['ok'] for r in rows)} of {len(rows)}",
    ])


def _run(args: argparse.Namespace) -> int:
    repeat = args.repeat or (QUICK_REPEAT if args.quick else REPEAT)
    layers = args.layers or (QUICK_LAYERS if args.quick else LAYERS)
    _progress(f"offload and reload, {layers} layers, {repeat} rounds each (device {args.device})")
    result = bench(layers, repeat, args.device)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Register `kvcache bench tier`."""
    p = targets.add_parser(
        "tier",
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
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="auto: the GPU when PyTorch sees one, else a host buffer stands in for the GPU cache")
    p.set_defaults(run=_run)


def main(argv: Sequence[str] | None = None) -> int:
    """Run as `python -m kvcache.bench.tier` (same flags)."""
    parser = argparse.ArgumentParser(prog="kvcache bench")
    add_parser(parser.add_subparsers(dest="target", required=True))
    args = parser.parse_args(["tier", *(argv if argv is not None else sys.argv[1:])])
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())

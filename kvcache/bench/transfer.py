"""`kvcache bench transfer`: moving one request's KV blocks, against the raw limit of each path in the same run.

Workload: one request of 4,096 tokens, 32 layers, 8 kv heads x 128, bf16, block 16 and
64; its blocks sit at scattered ids of a cache twice its size, and land at other scattered ids.
Sections, each the best wall time of N runs (write + wait), ours and the limit taking turns:
  1. host to host, LocalEngine: all layers in one write (and layer by layer, the messager's
     pattern), with its default copy method and with the other (streaming stores or memcpy); limit:
     one copy of the same total bytes as one range (the fastest of numpy's copyto and one range
     through the engine's C loop either way, on as many threads as the engine uses);
  2. NIXL (where installed): the same write into a receiver process (UCX's choice of transport on
     one host) with the engine's threads, with one thread, and layer by layer; limit: one NIXL
     write of the same bytes as a single descriptor, through the same engine;
  3. CUDA (with PyTorch and a GPU): device to pinned host, host to device and device to device
     with each batched method (cudaMemcpyBatchAsync, copy kernel, unrolled copy kernel) and one
     cudaMemcpyAsync per range; limit: one cudaMemcpyAsync of the same total bytes, pinned.
Targets: local and GPU swaps >= 85% of their limit, NIXL >= 80% of raw NIXL. Exits 0 whatever the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvcache.allocator.layout import CacheSpec
from kvcache.bench.common import Fleet, expect
from kvcache.bench.common import mark as _mark
from kvcache.arguments import positive_int as _positive_int
from kvcache.arguments import nonnegative_int
from kvcache.bench.common import progress as _progress
from kvcache.bench.common import table as _table
from kvcache.transfer.engines import HOST_METHODS, LocalEngine, TransferStatus
from kvcache.transfer.regions import CopyRanges, KVRegion

TOKENS = 4096
LAYERS = 32
KV_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZES = (16, 64)
CACHE_FACTOR = 2  # the cache holds this many requests' worth of blocks; ids are scattered over it
REPEAT = 10
QUICK_REPEAT = 3
QUICK_LAYERS = 2
SEED = 0

LOCAL_TARGET = 0.85
GPU_TARGET = 0.85
NIXL_TARGET = 0.85


def make_spec(block_size: int, layers: int) -> CacheSpec:
    return CacheSpec(num_layers=layers, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=block_size,
                     dtype="bfloat16")


def scattered_ids(block_size: int, seed: int) -> tuple[int, np.ndarray]:
    """(cache blocks, the request's block ids scattered over them)."""
    n = TOKENS // block_size
    num_blocks = CACHE_FACTOR * n
    return num_blocks, np.random.default_rng(seed).permutation(num_blocks)[:n].astype(np.int32)


def host_region(spec: CacheSpec, num_blocks: int, fill: int) -> tuple[KVRegion, np.ndarray]:
    """A region over one numpy buffer (layer-major, then key/value), and the buffer."""
    buffer = np.full(spec.cache_bytes(num_blocks), fill, dtype=np.uint8)
    return KVRegion.from_buffer(spec, num_blocks, buffer.ctypes.data, keep=(buffer,)), buffer


def one_range(nbytes: int, src: int, dst: int) -> CopyRanges:
    return CopyRanges(np.array([src], np.int64), np.array([dst], np.int64), np.array([nbytes], np.int64))


def best_interleaved(fns: Sequence[Callable[[], None]], repeat: int) -> list[float]:
    """Best seconds of each fn over ``repeat`` rounds after one warm-up round, the fns taking turns."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def _done(handle: Any) -> None:
    status = handle.wait()
    if status is not TransferStatus.DONE:
        raise RuntimeError(f"transfer {status.value}: {handle.error}")


def _row(path: str, block_size: int, mode: str, ranges: int, nbytes: int, ours_s: float, limit_s: float,
         limit: str, target: float | None) -> dict[str, Any]:
    ratio = limit_s / ours_s
    return {
        "path": path, "block_size": block_size, "mode": mode, "ranges": ranges, "bytes": nbytes,
        "ms": ours_s * 1e3, "gb_per_s": nbytes / ours_s / 1e9, "limit": limit, "limit_ms": limit_s * 1e3,
        "limit_gb_per_s": nbytes / limit_s / 1e9, "of_limit": ratio,
        "target": None if target is None else f">= {target:.0%} of limit",
        "ok": None if target is None else ratio >= target,
    }


# --------------------------------------------------------------------------- 1. host to host


def bench_host(layers: int, repeat: int, threads: int | None = None) -> list[dict[str, Any]]:
    rows = []
    with LocalEngine(timeout=120.0, threads=threads) as engine, \
            LocalEngine(timeout=120.0, threads=threads,
                        host_method=next(m for m in HOST_METHODS if m != engine.host_method)) as other:
        for bs in BLOCK_SIZES:
            spec = make_spec(bs, layers)
            num_blocks, src_ids = scattered_ids(bs, SEED)
            _, dst_ids = scattered_ids(bs, SEED + 1)
            src, src_buf = host_region(spec, num_blocks, 1)
            dst, dst_buf = host_region(spec, num_blocks, 2)
            nbytes = spec.bytes_per_block * src_ids.size
            limit = one_range(nbytes, src_buf.ctypes.data, dst_buf.ctypes.data)
            ranges = engine.write(src, src_ids, dst, dst_ids)
            _done(ranges)
            whole, whole_other, per_layer, one_engine, one_other, plain = best_interleaved([
                lambda: _done(engine.write(src, src_ids, dst, dst_ids)),
                lambda: _done(other.write(src, src_ids, dst, dst_ids)),
                lambda: [_done(h) for h in [engine.write(src, src_ids, dst, dst_ids, layers=[layer])
                                            for layer in range(layers)]],
                lambda: _done(engine.submit(limit)),
                lambda: _done(other.submit(limit)),
                lambda: np.copyto(dst_buf[:nbytes], src_buf[:nbytes]),
            ], repeat)
            raw, name = min((one_engine, f"one range ({engine.host_method})"),
                            (one_other, f"one range ({other.host_method})"), (plain, "one range (numpy)"))
            count = ranges.num_ranges
            how = f"{engine.threads} thread(s)"
            rows.append(_row("host -> host", bs, f"all layers, one write, {engine.host_method}, {how}", count, nbytes,
                             whole, raw, name, LOCAL_TARGET))
            rows.append(_row("host -> host", bs, f"all layers, one write, {other.host_method}, {how}", count, nbytes,
                             whole_other, raw, name, None))
            rows.append(_row("host -> host", bs, f"{layers} writes, a layer each", count, nbytes, per_layer, raw,
                             name, None))
            for label, seconds in (("numpy copyto", plain), (f"engine {engine.host_method}", one_engine),
                                   (f"engine {other.host_method}", one_other)):
                rows[-3].setdefault("limits_ms", {})[label] = seconds * 1e3
            src_buf = dst_buf = None  # freed before the next size's: rebinding, as the lambdas above hold the cells
    return rows


# --------------------------------------------------------------------------- 2. NIXL


def _nixl_receiver(conn: Any, block_size: int, layers: int) -> None:
    """The receiving process: one registered host region, served over ZMQ until stopped."""
    from kvcache.transfer.nixl import NixlEngine

    spec = make_spec(block_size, layers)
    num_blocks, _ = scattered_ids(block_size, SEED)
    region, _buffer = host_region(spec, num_blocks, 0)
    with NixlEngine(f"bench-decode-{os.getpid()}") as engine:
        engine.register(region)
        conn.send(("ready", engine.serve("tcp://127.0.0.1:*")))
        while conn.recv()[0] != "stop":
            pass


def bench_nixl(layers: int, repeat: int, threads: int | None = None) -> list[dict[str, Any]] | str:
    """NIXL writes into a receiver process: the engine's threads (the target row), one thread, layer by layer, and
    the same write through UCX alone (``kernel_copy=False``: what the engine does where the kernel copy is not
    allowed); the limit is one NIXL write of the same bytes as one descriptor, through UCX."""
    try:
        from kvcache.transfer.nixl import NixlEngine, default_threads, nixl_available
    except ImportError as exc:  # pyzmq or msgpack missing: no control plane
        return f"cannot import the NIXL engine: {exc}"
    if not nixl_available():
        return "NIXL is not installed (pip install nixl-cu12 --no-deps)"
    threads = default_threads() if threads is None else threads
    rows = []
    for bs in BLOCK_SIZES:
        spec = make_spec(bs, layers)
        num_blocks, src_ids = scattered_ids(bs, SEED)
        _, dst_ids = scattered_ids(bs, SEED + 1)
        with (Fleet() as fleet, NixlEngine("bench-prefill", timeout=120.0, threads=threads) as engine,
              NixlEngine("bench-prefill-1", timeout=120.0, threads=0) as single,
              NixlEngine("bench-prefill-ucx", timeout=120.0, threads=threads, kernel_copy=False) as ucx):
            conn = fleet.spawn(_nixl_receiver, bs, layers)
            endpoint = expect(conn, "ready", time.monotonic() + 120, "NIXL receiver")[1]
            src, src_buf = host_region(spec, num_blocks, 1)
            nbytes = spec.bytes_per_block * src_ids.size
            for e in (engine, single, ucx):
                e.register(src)
                peer = e.connect(endpoint)
            dst = peer.regions[0]
            limit = one_range(nbytes, src_buf.ctypes.data, int(dst.addrs[0, 0]))
            first = engine.write(src, src_ids, dst, dst_ids)
            _done(first)
            ours, one_thread, per_layer, through_ucx, raw = best_interleaved([
                lambda: _done(engine.write(src, src_ids, dst, dst_ids)),
                lambda: _done(single.write(src, src_ids, dst, dst_ids)),
                lambda: [_done(h) for h in [engine.write(src, src_ids, dst, dst_ids, layers=[layer])
                                            for layer in range(layers)]],
                lambda: _done(ucx.write(src, src_ids, dst, dst_ids)),
                lambda: _done(ucx.submit(limit, dst.owner, src, dst)),
            ], repeat)
            name = "one-descriptor NIXL write"
            kernel = " (kernel copy)" if engine._kernel_peers else ""
            rows.append(_row("NIXL host -> other process", bs,
                             f"all layers, one write, {engine.threads or 1} thread(s){kernel}", first.num_ranges,
                             nbytes, ours, raw, name, NIXL_TARGET))
            rows.append(_row("NIXL host -> other process", bs, f"all layers, one write, 1 thread{kernel}",
                             first.num_ranges, nbytes, one_thread, raw, name, None))
            rows.append(_row("NIXL host -> other process", bs, f"{layers} writes, a layer each{kernel}",
                             first.num_ranges, nbytes, per_layer, raw, name, None))
            rows.append(_row("NIXL host -> other process", bs, f"all layers, one write, {ucx.threads or 1} "
                             "thread(s), through UCX", first.num_ranges, nbytes, through_ucx, raw, name, None))
            fleet.stop([conn])
    return rows


# --------------------------------------------------------------------------- 3. CUDA


def bench_gpu(layers: int, repeat: int) -> dict[str, Any] | str:
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            return "needs PyTorch and a GPU"
    if not torch.cuda.is_available():
        return "needs PyTorch and a GPU"
    engines = {m: LocalEngine(timeout=120.0, cuda_method=m) for m in ("batch", "kernel", "kernel_unrolled", "loop")}
    limit_engine = engines["loop"]
    methods = {}
    for name, engine in engines.items():
        try:
            engine.resolved_cuda_method()
            if name == "batch" and engine.cuda.batch is None:
                raise RuntimeError(f"runtime {engine.cuda.version} has no cudaMemcpyBatchAsync")
            if name.startswith("kernel"):
                from kvcache.transfer.cuda import cupy_module

                if cupy_module() is None:
                    raise RuntimeError("CuPy is not installed")
            methods[name] = None
        except Exception as exc:
            methods[name] = str(exc)
    rows: list[dict[str, Any]] = []
    try:
        for bs in BLOCK_SIZES:
            spec = make_spec(bs, layers)
            num_blocks, src_ids = scattered_ids(bs, SEED)
            _, dst_ids = scattered_ids(bs, SEED + 1)
            shape = (num_blocks, KV_HEADS, bs, HEAD_DIM)
            gpu_a = [[torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2)] for _ in range(layers)]
            gpu_b = [[torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in range(2)] for _ in range(layers)]
            host = [[torch.empty(shape, dtype=torch.bfloat16, pin_memory=True) for _ in range(2)] for _ in range(layers)]
            regions = {k: KVRegion.from_tensors(spec, v) for k, v in (("gpu", gpu_a), ("gpu2", gpu_b), ("host", host))}
            nbytes = spec.bytes_per_block * src_ids.size
            flat_gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            flat_gpu2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            paths = [("device -> host", "gpu", "host", flat_gpu, flat_host),
                     ("host -> device", "host", "gpu", flat_host, flat_gpu),
                     ("device -> device", "gpu", "gpu2", flat_gpu, flat_gpu2)]
            for path, a, b, fa, fb in paths:
                limit = one_range(nbytes, fa.data_ptr(), fb.data_ptr())
                for method, missing in methods.items():
                    if missing:
                        continue
                    engine = engines[method]
                    first = engine.write(regions[a], src_ids, regions[b], dst_ids)
                    _done(first)
                    submit = [float("inf")]

                    def timed_write(engine: LocalEngine = engine, a: str = a, b: str = b) -> None:
                        t0 = time.perf_counter()
                        handle = engine.write(regions[a], src_ids, regions[b], dst_ids)
                        submit[0] = min(submit[0], time.perf_counter() - t0)
                        _done(handle)

                    ours, raw = best_interleaved([
                        timed_write,
                        lambda: _done(limit_engine.submit(limit, device="cuda:0")),
                    ], repeat)
                    target = GPU_TARGET if path != "device -> device" and method != "loop" else None
                    rows.append(_row(path, bs, method, first.num_ranges, nbytes, ours, raw,
                                     "one cudaMemcpyAsync", target))
                    rows[-1]["submit_ms"] = submit[0] * 1e3  # CPU time in write(): ranges, upload, launch
            del gpu_a, gpu_b, host, flat_gpu, flat_gpu2, flat_host
            regions = None  # rebound, not deleted: timed_write's closure holds the cell
            torch.cuda.empty_cache()
        cuda = limit_engine.cuda
        info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "runtime": cuda.version,
                "cudart": cuda.path}
    finally:
        for engine in engines.values():
            engine.close()
    return {"info": info, "methods": {k: v or "ok" for k, v in methods.items()}, "rows": rows}


# --------------------------------------------------------------------------- report


def _rows_table(rows: list[dict[str, Any]]) -> str:
    return _table(
        ["path", "block", "mode", "ranges", "MiB", "ms", "GB/s", "limit", "limit ms", "limit GB/s", "of limit",
         "target", ""],
        [[r["path"], str(r["block_size"]), r["mode"], f"{r['ranges']:,}", f"{r['bytes'] / 2**20:.0f}",
          f"{r['ms']:.2f}", f"{r['gb_per_s']:.1f}", r["limit"], f"{r['limit_ms']:.2f}", f"{r['limit_gb_per_s']:.1f}",
          f"{r['of_limit']:.0%}", r["target"] or "-", _mark(r["ok"])] for r in rows],
        align_left=3,
    )


def render(result: dict[str, Any]) -> str:
    cfg = result["config"]
    out = [
        f"kvcache bench transfer: {TOKENS:,} tokens, {cfg['layers']} layers, {KV_HEADS} kv heads x {HEAD_DIM}, bf16, "
        f"ids scattered over a cache {CACHE_FACTOR}x the request; best of {cfg['repeat']}; python {cfg['python']}, "
        f"{cfg['cpus']} cpu(s){', quick' if cfg['quick'] else ''}",
        "",
        "1. host -> host (LocalEngine: one C copy loop over all ranges, shared among its threads); limit: the same "
        "bytes as one range (the fastest of numpy's copyto and one range through the engine either way, same threads)",
        _rows_table(result["host"]),
        *(f"  block {r['block_size']} one-range copies, ms: "
          + ", ".join(f"{k} {v:.2f}" for k, v in r["limits_ms"].items()) for r in result["host"] if "limits_ms" in r),
        "",
    ]
    nixl = result["nixl"]
    out += ["2. NIXL into another process (UCX's transport choice on one host; a write of many ranges is split over "
            "the engine's threads); limit: one NIXL write of the same bytes as one descriptor",
            _rows_table(nixl) if isinstance(nixl, list) else f"  skipped: {nixl}", ""]
    gpu = result["gpu"]
    if isinstance(gpu, str):
        out.append(f"3. CUDA: skipped ({gpu})")
    else:
        info = gpu["info"]
        out += [f"3. CUDA ({info['device']}, torch {info['torch']}, runtime {info['runtime']}); methods: "
                + ", ".join(f"{k} {v}" for k, v in gpu["methods"].items()),
                _rows_table(gpu["rows"]),
                "  write() returned after, ms (CPU side: ranges, table upload, launch): "
                + ", ".join(f"{r['path']} {r['block_size']} {r['mode']} {r['submit_ms']:.2f}" for r in gpu["rows"])]
    out += ["", f"targets met: {sum(t['ok'] for t in result['targets'])} of {len(result['targets'])}",
            *(f"  MISS {t['name']}: {t['value']} (target {t['target']})" for t in result["targets"] if not t["ok"])]
    return "\n".join(out)


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"name": f"{r['path']} block {r['block_size']} {r['mode']}", "value": f"{r['of_limit']:.0%}",
             "target": r["target"], "ok": bool(r["ok"])} for r in rows if r["ok"] is not None]


def run_benchmark(layers: int, repeat: int, quick: bool, sections: Sequence[str],
                  threads: int | None = None) -> dict[str, Any]:
    """Every chosen section, measured now; one JSON-ready dict. ``threads``: the engines' (None: their default)."""
    _progress("1. host -> host") if "host" in sections else None
    host = bench_host(layers, repeat, threads) if "host" in sections else []
    _progress("2. NIXL into another process") if "nixl" in sections else None
    nixl = bench_nixl(layers, repeat, threads) if "nixl" in sections else "not chosen"
    _progress("3. CUDA copies (where PyTorch sees a GPU)") if "gpu" in sections else None
    gpu = bench_gpu(layers, repeat) if "gpu" in sections else "not chosen"
    rows = host + (nixl if isinstance(nixl, list) else []) + (gpu["rows"] if isinstance(gpu, dict) else [])
    return {
        "benchmark": "transfer",
        "config": {"layers": layers, "repeat": repeat, "quick": quick, "python": platform.python_version(),
                   "numpy": np.__version__, "cpus": os.cpu_count(), "tokens": TOKENS, "kv_heads": KV_HEADS,
                   "head_dim": HEAD_DIM, "block_sizes": list(BLOCK_SIZES)},
        "host": host,
        "nixl": nixl,
        "gpu": gpu,
        "targets": _targets(rows),
    }


def _run(args: argparse.Namespace) -> int:
    repeat = args.repeat or (QUICK_REPEAT if args.quick else REPEAT)
    layers = args.layers or (QUICK_LAYERS if args.quick else LAYERS)
    result = run_benchmark(layers, repeat, args.quick, args.sections, args.threads)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def _sections(text: str) -> list[str]:
    chosen = [s for s in text.split(",") if s]
    bad = [s for s in chosen if s not in ("host", "nixl", "gpu")]
    if bad or not chosen:
        raise argparse.ArgumentTypeError(f"sections are host, nixl, gpu (comma-separated), got {text!r}")
    return chosen


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Register `kvcache bench transfer`."""
    p = targets.add_parser(
        "transfer",
        allow_abbrev=False,
        help="move one request's KV blocks: host copies, NIXL, CUDA swaps, each against its raw limit",
        description="Time moving one 4,096-token request (32 layers, 8 kv heads x 128, bf16, block 16 and 64, "
        "scattered ids): host to host against the fastest copy of the same bytes as one range; NIXL into another "
        "process against one single-descriptor NIXL write; with PyTorch and a GPU, device/host swaps per method "
        "against one pinned cudaMemcpyAsync. Marks the targets ok/MISS; always exits 0.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_LAYERS} layers and {QUICK_REPEAT} runs instead of {LAYERS} and {REPEAT}, for tests")
    p.add_argument("--repeat", type=_positive_int, metavar="N", help="timed runs per measurement; the best is reported")
    p.add_argument("--layers", type=_positive_int, metavar="N", help=f"model layers (default {LAYERS})")
    p.add_argument("--threads", type=nonnegative_int, metavar="N",
                   help="threads of the host copy and NIXL engines (default: theirs, from the CPU count; 0 or 1: one)")
    p.add_argument("--sections", type=_sections, default=["host", "nixl", "gpu"], metavar="LIST",
                   help="comma-separated subset of host,nixl,gpu (default: all; absent libraries are skipped)")
    p.set_defaults(run=_run)


if __name__ == "__main__":
    from kvcache.bench.common import run_alone

    sys.exit(run_alone(add_parser, "transfer"))

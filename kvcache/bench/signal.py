"""`kvcache bench signal`: how fast a layer's completion reaches the cache messager in another process.

Sections, each timed with CLOCK_MONOTONIC (comparable across processes), waiters in spawned processes:
  1. CPU path: send_cache(None, ...) in this process to LayerSignal.wait returning in another, p50/p99;
     peer in the same run, samples interleaved: a multiprocessing Pipe (send_bytes / blocking recv_bytes).
  2. idle waiter: CPU time (getrusage of the thread) of a waiter blocked 1 s in LayerSignal.wait.
  3. CUDA (only with PyTorch and a GPU): a spin kernel, then a one-element fill kernel writing pinned host
     memory that a host thread spins on (the kernel-end mark; a 4-byte device-to-host copy where PyTorch won't
     alias host memory), then either the floor, a bare cudaLaunchHostFunc whose C callback writes the time,
     or send_cache; ours is the time the waiter in another process returns from wait.
     Samples alternate floor / ours. Also the cost of the enqueue call on the issuing thread, p50.
Targets are marked ok / MISS; the exit code is 0 whatever the numbers: a benchmark reports, it does not fail.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import struct
import sys
import time
import uuid
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvcache.arguments import positive_int as _positive_int
from kvcache.bench.common import progress as _progress
from kvcache.ops import _send_cache, send_cache
from kvcache.transfer import LayerSignal, WaitStatus

CPU_SAMPLES = 2000
GPU_SAMPLES = 1000
QUICK_SAMPLES = 200
GAP_S = 0.0005  # between CPU-path samples: the waiter is asleep in the kernel when the signal comes
KERNEL_US = 50  # the spin kernel ahead of each GPU sample: host work is queued well before it ends
ENQUEUE_CALLS = 200
ENQUEUE_WARMUP = 20
IDLE_S = 1.0

CPU_P50_TARGET_US = 20.0
IDLE_CPU_TARGET_MS = 1.0  # per second of waiting
GPU_FLOOR_RATIO_TARGET = 1.5
ENQUEUE_TARGET_US = 5.0

SPAWN = mp.get_context("spawn")


def _percentiles(ns: Sequence[int]) -> dict[str, float]:
    """p50, p99 and max in microseconds."""
    a = np.asarray(ns, dtype=np.float64) / 1e3
    return {"p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)), "max_us": float(a.max()),
            "samples": int(a.size)}


# --------------------------------------------------------------------------- waiters (spawned processes)


def _signal_waiter(name: str, first_step: int, count: int, idle_s: float, conn: Connection) -> None:
    """Wait for layer 0 of steps first_step.. ; send back wake - completion ns each, then idle CPU use."""
    sig = LayerSignal.open(name)
    conn.send("ready")
    latencies, bad = [], 0
    for step in range(first_step, first_step + count):
        status = sig.wait(0, step, 10.0)
        woke = time.monotonic_ns()
        if status != WaitStatus.DONE:
            bad += 1
            continue
        latencies.append(woke - sig.record.layer(0)[1])
    idle = None
    if idle_s > 0:
        r0 = resource.getrusage(resource.RUSAGE_THREAD)
        status = sig.wait(0, first_step + count + 1000, idle_s)
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
        idle = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime) * 1e3 if status == WaitStatus.TIMEOUT else None
    conn.send((latencies, bad, idle))
    sig.close()


def _pipe_waiter(pipe: Connection, count: int, conn: Connection) -> None:
    """Peer: block in recv_bytes for each sample; send back wake - send ns each."""
    conn.send("ready")
    latencies = []
    for _ in range(count):
        payload = pipe.recv_bytes()
        woke = time.monotonic_ns()
        latencies.append(woke - struct.unpack("q", payload)[0])
    conn.send(latencies)


def _gpu_waiter(name: str, first_step: int, count: int, conn: Connection) -> None:
    """Wait for layer 0 of each step and send back the time wait returned, one message per sample."""
    sig = LayerSignal.open(name)
    conn.send("ready")
    for step in range(first_step, first_step + count):
        status = sig.wait(0, step, 10.0)
        conn.send(time.monotonic_ns() if status == WaitStatus.DONE else -int(status))
    sig.close()


def _start(target: Any, *args: Any) -> tuple[mp.Process, Connection]:
    """A spawned process running target(*args, conn), returned once it reports ready."""
    ours, theirs = SPAWN.Pipe()
    p = SPAWN.Process(target=target, args=(*args, theirs), daemon=True)
    p.start()
    if not ours.poll(60) or ours.recv() != "ready":
        raise RuntimeError(f"{target.__name__} did not start")
    return p, ours


# --------------------------------------------------------------------------- 1, 2. CPU path


def bench_cpu(samples: int) -> dict[str, Any]:
    """Signal-to-wake across processes, ours against a Pipe, samples interleaved; then 1 s of idle waiting."""
    name = f"kvbench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    with LayerSignal.create(name, 1) as sig:
        waiter, results = _start(_signal_waiter, name, 1, samples, IDLE_S)
        reader, writer = SPAWN.Pipe(duplex=False)
        peer, peer_results = _start(_pipe_waiter, reader, samples)
        for _ in range(samples):
            sig.begin_step()
            time.sleep(GAP_S)
            send_cache(None, sig, 0)
            time.sleep(GAP_S)
            writer.send_bytes(struct.pack("q", time.monotonic_ns()))
        latencies, bad, idle_ms = results.recv()
        peer_latencies = peer_results.recv()
        waiter.join(10)
        peer.join(10)
    ours, pipe = _percentiles(latencies), _percentiles(peer_latencies)
    return {
        "ours": ours,
        "peer": {"name": "multiprocessing Pipe", **pipe},
        "peer_over_ours_p50": pipe["p50_us"] / ours["p50_us"],
        "not_done": bad,
        "idle_wait_s": IDLE_S,
        "idle_cpu_ms": idle_ms,
    }


# --------------------------------------------------------------------------- 3. CUDA


def _cuda() -> Any:
    """torch if it has a GPU here, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _sleep_cycles(torch: Any, us: float) -> int:
    """torch.cuda._sleep cycles that keep the GPU busy for about `us` microseconds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    end.synchronize()
    return max(1000, int(2_000_000 * us / (start.elapsed_time(end) * 1e3)))


def _enqueue_costs(torch: Any, stream: Any, sig: LayerSignal, cycles: int) -> dict[str, float]:
    """p50 us of one enqueue call on the issuing thread, while the stream is busy (nothing runs yet).

    The forms take turns call by call, after a few untimed calls each, so they share the same moments.
    """
    sid = stream.cuda_stream
    slots = np.zeros(ENQUEUE_CALLS + ENQUEUE_WARMUP, dtype=np.int64)
    base = slots.ctypes.data
    forms = {
        "floor: bare cudaLaunchHostFunc": lambda i: _send_cache._floor_launch(sid, base + 8 * i),
        "send_cache(int stream)": lambda i: send_cache(sid, sig, 0),
        "send_cache(torch.cuda.Stream)": lambda i: send_cache(stream, sig, 0),
    }
    ns: dict[str, list[int]] = {label: [] for label in forms}
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles * 200)  # about 10 ms: every call below is queued behind it
        for i in range(ENQUEUE_CALLS + ENQUEUE_WARMUP):
            for label, call in forms.items():
                t0 = time.perf_counter_ns()
                call(i)
                ns[label].append(time.perf_counter_ns() - t0)
        stream.synchronize()
    return {label: float(np.percentile(v[ENQUEUE_WARMUP:], 50)) / 1e3 for label, v in ns.items()}


class _CudaArray:
    """A CUDA array interface over an address: lets a PyTorch kernel write pinned host memory directly."""

    def __init__(self, address: int) -> None:
        self.__cuda_array_interface__ = {"shape": (1,), "typestr": "<i4", "data": (address, False), "version": 3}


def _kernel_end_mark(torch: Any, host: Any) -> Any | None:
    """A CUDA int32 tensor aliasing pinned `host`, so a fill kernel marks kernel end; None if PyTorch refuses it."""
    try:
        view = torch.as_tensor(_CudaArray(host.data_ptr()), device="cuda")
        view.fill_(-7)
        torch.cuda.synchronize()
    except (RuntimeError, TypeError, ValueError):
        return None
    return view if int(host[0]) == -7 else None


def bench_gpu(samples: int) -> dict[str, Any] | None:
    """Kernel end to floor callback and to the waiter's wake in another process, alternating; enqueue costs."""
    torch = _cuda()
    if torch is None:
        return None
    runtime = _send_cache.cuda_runtime()
    stream = torch.cuda.Stream()
    sid = stream.cuda_stream
    cycles = _sleep_cycles(torch, KERNEL_US)
    mark_dev = torch.zeros(1, dtype=torch.int32, device="cuda")
    mark_host = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    mark_view = _kernel_end_mark(torch, mark_host)
    slot = np.zeros(1, dtype=np.int64)
    name = f"kvbench-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    floor_ns, wake_ns, callback_ns, missed = [], [], [], 0
    with LayerSignal.create(name, 1) as sig:
        waiter, woke = _start(_gpu_waiter, name, 1, samples)
        with torch.cuda.stream(stream):
            for k in range(1, 2 * samples + 1):
                ours = k % 2 == 0
                if ours:
                    sig.begin_step()
                slot[0] = 0
                if mark_view is not None:
                    torch.cuda._sleep(cycles)
                    mark_view.fill_(k)  # a one-element kernel writing host memory: seen ~1 us after it ends
                else:
                    mark_dev.fill_(k)
                    torch.cuda._sleep(cycles)
                    mark_host.copy_(mark_dev, non_blocking=True)
                if ours:
                    send_cache(sid, sig, 0)
                else:
                    _send_cache._floor_launch(sid, slot.ctypes.data)
                end = _send_cache._spin_until(mark_host.data_ptr(), k, 10.0)
                stream.synchronize()
                woke_ns = woke.recv() if ours else 0  # paces the loop: the waiter is back in wait() next time
                if end == 0 or woke_ns < 0:
                    missed += 1
                elif not ours:
                    floor_ns.append(int(slot[0]) - end)
                else:
                    wake_ns.append(woke_ns - end)
                    callback_ns.append(sig.record.layer(0)[1] - end)
        waiter.join(10)
        enqueue = _enqueue_costs(torch, stream, sig, cycles)
    floor, wake = _percentiles(floor_ns), _percentiles(wake_ns)
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda_runtime": runtime,
        "kernel_us": KERNEL_US,
        "kernel_end_mark": "fill kernel writing pinned host memory" if mark_view is not None
        else "4-byte device-to-host copy after the kernel",
        "floor": floor,
        "ours_wake": wake,
        "ours_callback": _percentiles(callback_ns),
        "ours_over_floor_p50": wake["p50_us"] / floor["p50_us"],
        "missed": missed,
        "enqueue_p50_us": enqueue,
    }


# --------------------------------------------------------------------------- report


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Right-aligned columns, two spaces apart, indented by two."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    return "\n".join("  " + "  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in [headers, *rows])


def _row(label: str, p: dict[str, float]) -> list[str]:
    return [label, f"{p['p50_us']:.1f}", f"{p['p99_us']:.1f}", f"{p['max_us']:.1f}", str(p["samples"])]


def _targets(cpu: dict[str, Any], gpu: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Every measured value that has a target."""
    out = [
        {"name": "CPU path signal-to-wake p50", "value": f"{cpu['ours']['p50_us']:.1f} us",
         "target": f"<= {CPU_P50_TARGET_US:g} us", "ok": cpu["ours"]["p50_us"] <= CPU_P50_TARGET_US},
        {"name": f"idle waiter CPU over {IDLE_S:g} s",
         "value": "-" if cpu["idle_cpu_ms"] is None else f"{cpu['idle_cpu_ms']:.2f} ms",
         "target": f"<= {IDLE_CPU_TARGET_MS:g} ms",
         "ok": cpu["idle_cpu_ms"] is not None and cpu["idle_cpu_ms"] <= IDLE_CPU_TARGET_MS},
    ]
    if gpu is not None:
        enqueue = gpu["enqueue_p50_us"]["send_cache(int stream)"]
        out += [
            {"name": "kernel end to waiter wake p50 / floor p50", "value": f"{gpu['ours_over_floor_p50']:.2f}x",
             "target": f"<= {GPU_FLOOR_RATIO_TARGET:g}x", "ok": gpu["ours_over_floor_p50"] <= GPU_FLOOR_RATIO_TARGET},
            {"name": "send_cache enqueue p50", "value": f"{enqueue:.2f} us", "target": f"<= {ENQUEUE_TARGET_US:g} us",
             "ok": enqueue <= ENQUEUE_TARGET_US},
        ]
    return out


def render(result: dict[str, Any]) -> str:
    """The human-readable report."""
    cfg, cpu, gpu = result["config"], result["cpu"], result["gpu"]
    out = [
        f"kvcache bench signal: python {cfg['python']}, {cfg['cpus']} cpu(s){', quick' if cfg['quick'] else ''}",
        "",
        f"1. CPU path: signal in this process to wait() returning in another, us ({GAP_S * 1e3:g} ms apart)",
        _table(["", "p50", "p99", "max", "samples"],
               [_row("send_cache(None) -> LayerSignal.wait", cpu["ours"]), _row(cpu["peer"]["name"], cpu["peer"])]),
        f"  pipe/ours p50: {cpu['peer_over_ours_p50']:.2f}x; waits not DONE: {cpu['not_done']}",
        "",
        f"2. idle waiter: {'-' if cpu['idle_cpu_ms'] is None else format(cpu['idle_cpu_ms'], '.2f')} ms of CPU "
        f"over {cpu['idle_wait_s']:g} s blocked in wait()",
        "",
    ]
    if gpu is None:
        out.append("3. CUDA: skipped (needs PyTorch and a GPU)")
    else:
        out += [
            f"3. CUDA ({gpu['device']}, torch {gpu['torch']}, runtime {gpu['cuda_runtime']}):",
            f"   us from the kernel-end mark ({gpu['kernel_end_mark']}, seen by a spinning host thread); a "
            f"{gpu['kernel_us']} us kernel ahead of each sample",
            _table(["", "p50", "p99", "max", "samples"], [
                _row("floor: bare host function's timestamp", gpu["floor"]),
                _row("send_cache: its host function's stamp", gpu["ours_callback"]),
                _row("send_cache: waiter wakes (other process)", gpu["ours_wake"]),
            ]),
            f"  ours/floor p50: {gpu['ours_over_floor_p50']:.2f}x; samples missed: {gpu['missed']}",
            "  enqueue cost on the issuing thread, p50 us: " + "; ".join(
                f"{k} {v:.2f}" for k, v in gpu["enqueue_p50_us"].items()),
        ]
    out += ["", f"targets met: {sum(t['ok'] for t in result['targets'])} of {len(result['targets'])}",
            *(f"  MISS {t['name']}: {t['value']} (target {t['target']})" for t in result["targets"] if not t["ok"])]
    return "\n".join(out)


def run_benchmark(cpu_samples: int, gpu_samples: int, quick: bool) -> dict[str, Any]:
    """Every section, measured now; one JSON-ready dict."""
    _progress(f"1-2. CPU path, {cpu_samples} samples, then 1 s of idle waiting")
    cpu = bench_cpu(cpu_samples)
    _progress(f"3. CUDA path, {gpu_samples} samples (where PyTorch sees a GPU)")
    gpu = bench_gpu(gpu_samples)
    return {
        "benchmark": "signal",
        "config": {"quick": quick, "python": platform.python_version(), "cpus": os.cpu_count(),
                   "cpu_samples": cpu_samples, "gpu_samples": gpu_samples},
        "cpu": cpu,
        "gpu": gpu,
        "targets": _targets(cpu, gpu),
    }


def _run(args: argparse.Namespace) -> int:
    samples = args.samples
    cpu = samples or (QUICK_SAMPLES if args.quick else CPU_SAMPLES)
    gpu = samples or (QUICK_SAMPLES if args.quick else GPU_SAMPLES)
    result = run_benchmark(cpu, gpu, args.quick)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Register `kvcache bench signal`."""
    p = targets.add_parser(
        "signal",
        allow_abbrev=False,
        help="layer signal latency across processes (CPU path, and CUDA against a bare host function)",
        description="Time (1) send_cache's CPU path to a LayerSignal.wait returning in another process, against "
        "a multiprocessing Pipe, (2) the CPU an idle waiter uses, (3) with PyTorch and a GPU: kernel end to the "
        "waiter's wake-up against a bare cudaLaunchHostFunc callback, and the enqueue cost. Prints p50/p99 and "
        "marks the targets ok/MISS; always exits 0.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_SAMPLES} samples per section instead of {CPU_SAMPLES} (CPU) and {GPU_SAMPLES} (CUDA)")
    p.add_argument("--samples", type=_positive_int, metavar="N", help="samples per section (overrides --quick)")
    p.set_defaults(run=_run)


if __name__ == "__main__":
    from kvcache.bench.common import run_alone

    sys.exit(run_alone(add_parser, "signal"))

"""`kvcache bench pd`: the PD pipeline's tail and throughput, against its own path's NIXL limits in the same run.

Workload: one request of 4,096 tokens, 32 layers, 8 kv heads x 128, bf16 (block 64 by
default), prefill TP 1 -> decode TP 1, through the whole stack: `kvcache serve --role prefill`
and `--role decode`, a prefill worker process (LayerSignal, CacheMessager) and a decode worker
process (CacheReceiver), NIXL between them (UCX's choice of transport on one host; caches are
numpy, or PyTorch with --device cuda; --prefill-device cuda:0 --decode-device cuda:1 puts each cache on its own
GPU, where NIXL writes GPU to GPU). Measured in one run:
  1. limits, from the prefill worker on the messager's own path into the decode worker: one
     layer's write alone (median of 2N; its best shown too), and all the request's bytes as one
     NIXL descriptor (best of 2N); also every layer's ranges as one write and each kind's
     transfer() call, which split the pipeline's cost into per transfer, per range and per byte;
  2. tail (paced): the fake model spends ``--pace`` x one layer's (median) transfer time per layer, the
     premise of a layer-wise pipeline (compute per layer >= transfer per layer); the tail is the
     decode daemon marking the request ready minus the last layer's signal. Target: at most one
     layer's transfer + 1 ms;
  3. throughput (unpaced): every layer signalled back to back, so the messager moves data as fast
     as it can; bytes / (first layer's signal -> decode ready), for one request alone, for a
     prefill batch of ``--inflight`` such requests in one step, and for ``--steps`` such steps back
     to back (the node's total bytes/s while it streams steps, what the target is about: each step's
     start and its notices overlap the other steps' copies, as in a running prefill node). Target:
     the steps' >= 85% of one write of the same bytes as one range through the messager's own engine (over
     NIXL, or the engine's kernel copy into a decode process on the same host);
  4. across two GPUs, that write against the hardware's own copy of the same bytes (``cudaMemcpyPeer``).
The plans go to the prefill worker with each step, as a scheduler hands them over (``Sending.plan``).
Each measure lists its stages (when the messager woke, queued the last write, the engine posted it,
saw it done, the receiver had every notice, the decode daemon marked it ready), so a miss says where
the time went. ``--tokens`` shrinks the layers to their fixed costs (a CPU stand-in for GPU caches,
whose layers move in microseconds); ``--progress`` picks who drives UCX (NixlEngine's ``progress``);
``--compute spin`` makes the fake model hold the GIL through each paced layer, as a runner launching
kernels does; ``--link process`` runs the messager and the receiver in processes of their own; ``--cross-host``
puts each node in a network namespace of its own (``kvcache.pd.hosts``: root and iproute2), UCX on TCP and the
kernel copy off, so the KV takes the path between two nodes.
Exits 0 whatever the numbers.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np

from kvcache.arguments import positive_int
from kvcache.bench.common import mark, table
from kvcache.bench.common import progress as report_progress

TOKENS = 4096
LAYERS = 32
KV_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 64
REPEAT = 5
INFLIGHT = 8
QUICK_LAYERS = 4
QUICK_REPEAT = 2
QUICK_INFLIGHT = 2
QUICK_STEPS = 2
GPU_STEPS = 8  # steps in the throughput measure on a GPU; on the CPU 1, as every step's requests need host memory
PACE = 1.25
TAIL_SLACK_S = 1e-3
THROUGHPUT_TARGET = 0.85
OUTCOME_POLL_S = 0.02  # the daemons stamp outcomes themselves; polling slowly keeps the bench off the CPUs it measures


def run_benchmark(*, layers: int, block_size: int, repeat: int, pace: float, device: str, tokens: int = TOKENS,
                  progress: str = "thread", inflight: int = INFLIGHT, steps: int | None = None,
                  compute: str = "sleep", link: str = "thread", decode_device: str = "",
                  cross_host: bool = False) -> dict[str, Any]:
    """``device`` holds the prefill cache, and the decode cache unless ``decode_device`` names another."""
    from kvcache.client import CacheClient
    from kvcache.pd.cluster import Cluster, wait_outcomes
    from kvcache.pd import PDProxy

    decode_device = decode_device or device
    blocks = -(-tokens // block_size)
    if steps is None:
        steps = default_steps(device)
    rng = np.random.default_rng(0)
    with contextlib.ExitStack() as stack:
        hosts = None
        if cross_host:
            from kvcache.pd.hosts import Hosts

            hosts = stack.enter_context(Hosts())
        cluster = stack.enter_context(Cluster(
            layers=layers, kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=block_size,
            num_blocks=(steps * inflight + 1) * blocks, prefill_device=device, decode_device=decode_device,
            timeout=120.0, progress=progress, link=link, hosts=hosts))
        prefill = stack.enter_context(CacheClient(cluster.cfg["prefill"], timeout=30))
        decode = stack.enter_context(CacheClient(cluster.cfg["decode"], timeout=30))
        proxy = PDProxy(prefill, decode)
        receiver = cluster.decode_workers[0]
        counter = iter(range(1 << 30))
        tables: dict[str, np.ndarray] = {}  # the last request's, for the probe of the limits
        nbytes = blocks * cluster.spec.bytes_per_block_per_layer * layers

        def run(count: int = 1, layer_delay: float = 0.0, number: int = 1) -> dict[str, Any]:
            """``number`` prefill steps back to back, each of ``count`` new requests, each layer followed by
            ``layer_delay`` s of fake compute: the stages of the last request to be ready."""
            per_step = [[f"bench-{next(counter)}" for _ in range(count)] for _ in range(number)]
            reqs = [req for step in per_step for req in step]
            placed = {req: proxy.submit(req, rng.integers(0, 1 << 31, tokens)) for req in reqs}
            if any(p is None for p in placed.values()):
                raise RuntimeError("no room for the step's requests")
            src = {req: np.asarray(a.table)[0].astype(np.int64) for req, (_, a) in placed.items()}
            tables["src"], tables["dst"] = src[reqs[-1]], np.asarray(placed[reqs[-1]][0].table)[0].astype(np.int64)
            batches = [([(req, np.empty(0, np.int64), src[req], 0) for req in step],
                        {req: placed[req][1].plan for req in step}) for step in per_step]
            signalled = cluster.steps(batches, layer_delay, compute=False, spin=compute == "spin")
            times = signalled[0]._replace(last_ns=signalled[-1].last_ns)
            time.sleep(OUTCOME_POLL_S)  # ask only after the tail: a poll now would take CPU from the transfer it times
            ready, failed = wait_outcomes(decode, set(reqs), 120, interval=OUTCOME_POLL_S)
            wait_outcomes(prefill, set(reqs), 120, interval=OUTCOME_POLL_S)
            if set(ready) != set(reqs):
                raise RuntimeError(f"transfer failed: {failed or 'no answer'}")
            for req in reqs:
                posted = cluster.prefill_workers[0].call("posted", req)
                if posted != nbytes:
                    raise RuntimeError(f"the messager posted {posted:,} bytes of request {req}'s {nbytes:,}")
                decode.free(req)
            last = max(ready, key=ready.__getitem__)
            return stages(last, times, ready[last])

        def stages(req: str, times: Any, ready_ns: int) -> dict[str, Any]:
            """When each stage of ``req``'s end happened, since the last and since the first layer's signal."""
            received = receiver.call("received_ns")[req]
            sent = cluster.prefill_workers[0].call("sent_ns", req)
            stamps = {"messager woke": sent.get("last_signal", 0),
                      "earlier writes all landed": sent.get("earlier_landed", 0),
                      "messager queued the last write": sent.get("submitted", 0),
                      "engine took up the last write": sent.get("picked", 0),
                      "its transfer() call returned": sent.get("posted", 0), "engine saw it done": sent.get("landed", 0),
                      "separate notification sent": sent.get("notified", 0), "receiver has all notes": received,
                      "decode daemon ready": ready_ns}
            since = lambda ns, t0: (ns - t0) / 1e9 if ns else float("nan")  # noqa: E731
            from_first = {"messager began the step": since(sent.get("step_start", 0), times.first_ns),
                          "messager had the plans": since(sent.get("planned", 0), times.first_ns),
                          "messager built every layer's ranges": since(sent.get("ranged", 0), times.first_ns),
                          "last layer signalled": since(times.last_ns, times.first_ns)}
            return {"tail_s": since(ready_ns, times.last_ns), "received_s": since(received, times.last_ns),
                    "total_s": (ready_ns - times.first_ns) / 1e9,
                    "stages_s": {name: since(ns, times.last_ns) for name, ns in stamps.items()},
                    "from_first_s": {**from_first, **{name: since(ns, times.first_ns) for name, ns in stamps.items()}}}

        report_progress("warming up both nodes")
        run(inflight)  # touches every block the batches use, on both sides
        for _ in range(2):  # connects the messager to the receiver, warms both sides' memory and UCX's paths
            run()
        # The limits move the warm-up request's own tables, as the messager did.
        report_progress("the limits: raw NIXL writes of one layer, one request and one batch")
        limits = cluster.prefill_workers[0].call(
            "probe", (tables["src"], tables["dst"], tuple(decode.info()["receivers"]), repeat + 2, inflight),
            timeout=300)
        layer_s = limits["layer_s"]
        peer = None
        if decode_device != device and "cpu" not in (device, decode_device):
            report_progress(f"the hardware's limit: cudaMemcpyPeer {device} -> {decode_device}")
            peer = cluster.prefill_workers[0].call("peer_copy", (decode_device, inflight * nbytes, repeat + 2),
                                                   timeout=300)
        report_progress(f"tail: {repeat} paced requests")
        paced = [run(1, pace * layer_s) for _ in range(repeat)]
        report_progress(f"throughput: {repeat} requests, {repeat} batches of {inflight}"
                        + (f", {repeat} runs of {steps} steps" if steps > 1 else ""))
        unpaced = [run() for _ in range(repeat)]
        batched = [run(inflight) for _ in range(repeat)]
        streamed = [run(inflight, number=steps) for _ in range(repeat)] if steps > 1 else batched
    batches = [r["total_s"] for r in batched]
    streams = [r["total_s"] for r in streamed]
    assert nbytes == limits["raw_bytes"], (nbytes, limits["raw_bytes"])
    tails = [r["tail_s"] for r in paced]
    tail = statistics.median(tails)
    best_total = min(r["total_s"] for r in unpaced)
    raw_rate = nbytes / limits["raw_s"]
    rate = nbytes / best_total
    batch_rate, batch_raw_rate = inflight * nbytes / min(batches), inflight * nbytes / limits["raw_batch_s"]
    stream_rate = steps * inflight * nbytes / min(streams)
    return {
        "workload": {"tokens": tokens, "layers": layers, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16",
                     "block_size": block_size, "device": device, "decode_device": decode_device, "bytes": nbytes,
                     "repeat": repeat, "pace": pace, "progress": progress, "inflight": inflight, "steps": steps,
                     "compute": compute, "link": link, "cross_host": cross_host},
        "peer_copy_s": peer["peer_s"] if peer else None,
        "peer_rate": inflight * nbytes / peer["peer_s"] if peer else None,
        "peer_p2p": peer["p2p"] if peer else None,
        "nixl_vs_peer": limits["raw_batch_s"] and (peer["peer_s"] / limits["raw_batch_s"]) if peer else None,
        "host": platform.node(),
        "one_layer_s": layer_s,
        "one_layer_best_s": limits["layer_best_s"],
        "one_layer_bytes": limits["layer_bytes"],
        "one_layer_ranges": limits["layer_ranges"],
        "raw_s": limits["raw_s"],
        "every_layer_s": limits["every_s"],
        "every_layer_ranges": limits["every_ranges"],
        "post_s": limits["post_s"],
        "paced_layer_delay_s": pace * layer_s,
        "tail_s": {"median": tail, "min": min(tails), "max": max(tails)},
        "tail_received_s": statistics.median(r["received_s"] for r in paced),
        "tail_stages_s": {name: _median([r["stages_s"][name] for r in paced]) for name in paced[0]["stages_s"]},
        "separate_notifications": sum(r["stages_s"]["separate notification sent"] == r["stages_s"]["separate notification sent"]
                                      for r in paced),
        "tail_limit_s": layer_s + TAIL_SLACK_S,
        "tail_ok": tail <= layer_s + TAIL_SLACK_S,
        "unpaced_total_s": best_total,
        "unpaced_stages_s": _stage_medians(unpaced),
        "rate": rate,
        "raw_rate": raw_rate,
        "rate_ratio": rate / raw_rate,
        "batch_s": {"best": min(batches), "median": statistics.median(batches)},
        "batch_stages_s": _stage_medians(batched),
        "batch_rate": batch_rate,
        "raw_batch_s": limits["raw_batch_s"],
        "raw_batch_rate": batch_raw_rate,
        "batch_rate_ratio": batch_rate / batch_raw_rate,
        "stream_s": {"best": min(streams), "median": statistics.median(streams)},
        "stream_stages_s": _stage_medians(streamed),
        "stream_rate": stream_rate,
        "stream_rate_ratio": stream_rate / batch_raw_rate,
        "rate_ok": stream_rate / batch_raw_rate >= THROUGHPUT_TARGET,
    }


def default_steps(device: str) -> int:
    """Prefill steps in the throughput measure: several on a GPU, one on the CPU (where caches take host memory)."""
    return GPU_STEPS if device.startswith("cuda") else 1


def _stage_medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each stage's median time since the first signal over ``runs`` (the separate notice left out)."""
    return {name: _median([r["from_first_s"][name] for r in runs])
            for name in runs[0]["from_first_s"] if not name.startswith("separate")}


def _median(values: list[float]) -> float:
    """The median of the values that are not NaN (NaN if none is)."""
    present = [v for v in values if v == v]
    return statistics.median(present) if present else float("nan")


def render(r: dict[str, Any]) -> str:
    w = r["workload"]
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    gbs = lambda b: f"{b / 1e9:.2f} GB/s"  # noqa: E731
    t = r["tail_s"]

    def since_first(stages: dict[str, float]) -> list[list[str]]:
        return [[f"    {name} (since first signal)", ms(v) if v == v else "-", "", "", ""] for name, v in stages.items()]

    rows = [
        ["one layer alone (limit)", f"{ms(r['one_layer_s'])} (median; best {ms(r['one_layer_best_s'])})",
         f"{r['one_layer_bytes'] / 2**20:.1f} MiB in {r['one_layer_ranges']} ranges", "", ""],
        ["tail: last signal -> decode ready", f"{ms(t['median'])} (median; {ms(t['min'])}-{ms(t['max'])})",
         f"<= {ms(r['tail_limit_s'])} (one layer + 1 ms)", f"{t['median'] / r['tail_limit_s']:.2f}x",
         mark(r["tail_ok"])],
        *[[f"  {name} (since last signal)", ms(v) if v == v else "-",
           f"{r['separate_notifications']} of {w['repeat']} runs" if name.startswith("separate") else "", "", ""]
          for name, v in r["tail_stages_s"].items()],
        *([[f"throughput, {w['steps']} prefill steps of {w['inflight']} requests back to back, layers back to back "
            "(best)", gbs(r["stream_rate"]), f"one-range write {gbs(r['raw_batch_rate'])}",
            f"{r['stream_rate_ratio']:.2f}", mark(r["rate_ok"]) + f" (>= {THROUGHPUT_TARGET:.0%})"],
           ["  first signal -> last request ready (best; median)",
            f"{ms(r['stream_s']['best'])}; {ms(r['stream_s']['median'])}",
            f"raw {ms(r['raw_batch_s'] * w['steps'])}", "", ""],
           *since_first(r["stream_stages_s"])] if w["steps"] > 1 else []),
        *([["  one-range NIXL write vs cudaMemcpyPeer of the same bytes (best)", gbs(r["raw_batch_rate"]),
            f"cudaMemcpyPeer {gbs(r['peer_rate'])}" + ("" if r["peer_p2p"] else " (no P2P: through the host)"),
            f"{r['nixl_vs_peer']:.2f}", ""]] if r.get("peer_rate") else []),
        [f"throughput, one step of {w['inflight']} requests, layers back to back (best)", gbs(r["batch_rate"]),
         f"one-range write {gbs(r['raw_batch_rate'])}", f"{r['batch_rate_ratio']:.2f}",
         "" if w["steps"] > 1 else mark(r["rate_ok"]) + f" (>= {THROUGHPUT_TARGET:.0%})"],
        ["  first signal -> last request ready (best; median)",
         f"{ms(r['batch_s']['best'])}; {ms(r['batch_s']['median'])}", f"raw {ms(r['raw_batch_s'])}", "", ""],
        *since_first(r["batch_stages_s"]),
        ["throughput, one request alone, layers back to back", gbs(r["rate"]),
         f"one-range write {gbs(r['raw_rate'])}", f"{r['rate_ratio']:.2f}", ""],
        ["  first signal -> decode ready (best)", ms(r["unpaced_total_s"]), f"raw {ms(r['raw_s'])}", "", ""],
        *since_first(r["unpaced_stages_s"]),
        ["  every layer as one write, alone (best)", ms(r["every_layer_s"]), f"{r['every_layer_ranges']} ranges", "", ""],
        ["  transfer() call (median): one layer / every layer / raw",
         " / ".join(ms(r["post_s"][k]) for k in ("layer", "every", "raw")), "", "", ""],
    ]
    head = (f"kvcache bench pd: {w['tokens']:,} tokens, {w['layers']} layers, {w['kv_heads']} kv heads x "
            f"{w['head_dim']}, {w['dtype']}, block {w['block_size']}, {w['bytes'] / 2**20:.0f} MiB, {_devices(w)}, "
            f"NIXL progress by {w['progress']}; {_links(w)}; throughput: steps of {w['inflight']} requests; "
            f"paced at {ms(r['paced_layer_delay_s'])} per layer ({w['pace']}x one layer, the model "
            f"{'spinning in Python' if w['compute'] == 'spin' else 'asleep'}); "
            f"best/median of {w['repeat']}")
    return head + "\n" + table(["measure", "ours", "limit", "ratio", ""], rows, align_left=1)


def _devices(w: dict[str, Any]) -> str:
    """Where the caches live, and whether the nodes are apart (``--cross-host``)."""
    where = w["device"] if w["decode_device"] == w["device"] else f"prefill {w['device']} -> decode {w['decode_device']}"
    return where + (", each node in its own network namespace (UCX over TCP, no kernel copy)" if w["cross_host"] else "")


def _links(w: dict[str, Any]) -> str:
    """Where the messager and the receiver ran (a GPU cache's receiver stays in its worker: see ReceiverProcess)."""
    if w.get("link") != "process":
        return "messager and receiver in the workers"
    if w["decode_device"] == "cpu":
        return "messager and receiver in processes of their own"
    return "messager in a process of its own, receiver in its worker"


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Register `kvcache bench pd`."""
    from kvcache.transfer.nixl import PROGRESS_MODES

    p = targets.add_parser(
        "pd", help="PD pipeline: last layer -> decode ready vs one layer's transfer; bytes/s vs one range (needs NIXL)",
        description="Move one 4,096-token request (32 layers, 8 kv heads x 128, bf16) from a prefill worker to a "
        "decode worker through both daemons, the messager and the receiver, over NIXL. Reports the time from the last "
        "layer's signal to the decode daemon marking the request ready against one layer's write alone (target: "
        "<= one layer + 1 ms, paced so each layer's fake compute outlasts its transfer), and bytes/s with layers back "
        "to back against one write of the same bytes as one range through the same engine, for one request, for a "
        "prefill batch of --inflight requests, and for --steps such batches back to back (target: the steps >= 85%), "
        "all measured in the same run. Always exits 0.", allow_abbrev=False)
    p.add_argument("--layers", type=positive_int, default=LAYERS, help=f"model layers (default {LAYERS})")
    p.add_argument("--tokens", type=positive_int, default=TOKENS,
                   help=f"prompt tokens (default {TOKENS}); few tokens make small layers, whose time is the per-layer "
                   "fixed cost")
    p.add_argument("--block-size", type=positive_int, default=BLOCK_SIZE, help=f"tokens per block (default {BLOCK_SIZE})")
    p.add_argument("--repeat", type=positive_int, default=REPEAT, help=f"runs of each measure (default {REPEAT})")
    p.add_argument("--inflight", type=positive_int, default=INFLIGHT,
                   help=f"requests in the throughput measure's prefill batch (default {INFLIGHT}); each node's cache "
                   "holds one more request's worth of blocks than this")
    p.add_argument("--steps", type=positive_int, default=None,
                   help=f"prefill steps back to back in the throughput measure (default {GPU_STEPS} with --device "
                   "cuda, else 1). Each step's requests hold their own blocks on both nodes, 512 MiB each by default: "
                   f"2 x ({GPU_STEPS} x 8 + 1) x 512 MiB = 65 GiB of GPU memory at the defaults (pass --steps 4 on a "
                   "40 GB GPU), and host memory on the CPU")
    p.add_argument("--pace", type=float, default=PACE,
                   help=f"fake compute per layer, in units of one layer's transfer time (default {PACE})")
    p.add_argument("--compute", choices=("sleep", "spin"), default="sleep",
                   help="how the fake model spends each paced layer: asleep (the GIL free, as a model runner waiting "
                   "on its GPU; default) or running Python (the GIL held, as a runner launching kernels, which the "
                   "messager's threads then wait for)")
    p.add_argument("--device", default="cpu", help="cpu (numpy caches) or cuda[:N] (PyTorch caches), for both nodes "
                   "unless --prefill-device or --decode-device says otherwise")
    p.add_argument("--prefill-device", default="", help="the prefill cache's device (default --device)")
    p.add_argument("--decode-device", default="",
                   help="the decode cache's device (default --device); another GPU than the prefill's (--prefill-device "
                   "cuda:0 --decode-device cuda:1) moves the KV GPU to GPU, measured against cudaMemcpyPeer")
    p.add_argument("--cross-host", action="store_true",
                   help="each node in a network namespace of its own, joined by a bridge (root and iproute2's ip), UCX "
                   "on TCP and the kernel copy off: the KV takes the path between two nodes")
    p.add_argument("--link", choices=("thread", "process"), default="thread",
                   help="where the messager and the receiver run: threads in the workers' processes (PrefillLink, "
                   "DecodeLink; default) or processes of their own (MessagerProcess, out of reach of a runner that "
                   "holds the GIL, and with CPU caches ReceiverProcess; those caches then live in shared memory)")
    p.add_argument("--progress", choices=PROGRESS_MODES, default="thread",
                   help="who drives UCX in both workers' NIXL engines: NIXL's progress thread (wakes on events or "
                   "every 1 ms) or the engine's worker (polls every 50 us while a write is in flight)")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_LAYERS} layers, {QUICK_REPEAT} runs, batches of {QUICK_INFLIGHT} (a smoke test)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from kvcache.transfer.nixl import nixl_available

    if not nixl_available():
        print("kvcache bench pd: NIXL is not installed (pip install nixl-cu12 --no-deps)")
        return 0
    from kvcache.pd.cluster import role_devices

    device = role_devices(args.prefill_device or args.device, 1, "--prefill-device")[0]
    decode_device = role_devices(args.decode_device or args.device, 1, "--decode-device")[0]
    if args.cross_host:
        from kvcache.pd.hosts import unavailable

        if unavailable():
            print(f"kvcache bench pd: --cross-host: {unavailable()}")
            return 0
    result = run_benchmark(layers=QUICK_LAYERS if args.quick else args.layers, block_size=args.block_size,
                           repeat=QUICK_REPEAT if args.quick else args.repeat, pace=args.pace, device=device,
                           decode_device=decode_device, cross_host=args.cross_host,
                           tokens=args.tokens, progress=args.progress,
                           inflight=QUICK_INFLIGHT if args.quick else args.inflight,
                           steps=QUICK_STEPS if args.quick and args.steps is None else args.steps,
                           compute=args.compute, link=args.link)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    from kvcache.bench.common import run_alone

    sys.exit(run_alone(add_parser, "pd"))

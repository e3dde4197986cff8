"""PD disaggregation on one machine: a prefill node and a decode node, each a daemon plus fake model workers.

    python examples/pd_demo.py                        # CPU: numpy caches, NIXL over shared memory/TCP
    python examples/pd_demo.py --prefill-tp 2 --decode-tp 1
    python examples/pd_demo.py --device cuda          # PyTorch caches on the GPU
    python examples/pd_demo.py --rows "window:64:16*2,full*2"   # head-wise: one table row per kv head

Starts `kvcache serve --role prefill` and `--role decode`, one worker process per prefill rank
(its cache, a LayerSignal, a CacheMessager) and per decode rank (its cache, a CacheReceiver).
Each prefill worker is a fake model: for every layer it writes deterministic KV (a function of
token id, position, layer, head and element, so prefix hits on either node give identical
bytes) into the request's blocks it did not have cached, then calls ``send_cache``. A proxy
reserves on decode and admits on prefill; messagers move each layer as its signal fires. At the
end every request's KV on the decode node is checked, byte for byte, against the prefill node's
and against the formula. Batches: fresh prompts, then prefix hits on both nodes, on the prefill
node only, on the decode node only. Prints timings; exits 1 on any mismatch.

Needs NIXL with its UCX plugins (`make install`, or `pip install --no-deps nixl-cu12`), which
move KV between the nodes' processes; on a CPU too.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.pd.cluster import Cluster, run_batch, scenario
from kvcache.transfer.nixl import nixl_available

NO_NIXL = ("NIXL is not installed, and the PD demo moves KV between its nodes over NIXL (UCX, on a CPU too): "
           "pip install --no-deps nixl-cu12 (nixl-cu13 for CUDA 13), or make install")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--device", default="cpu", help="cpu (numpy caches) or cuda[:N] (PyTorch caches)")
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", default="full", help="both daemons' --rows: full (uniform tables), or one policy "
                        "per kv head, e.g. window:64:16*2,full*2 (head-wise; window heads keep sink and window)")
    parser.add_argument("--link", choices=("thread", "process"), default="thread",
                        help="run each messager and receiver in its worker's process (default) or in a process of "
                        "its own (MessagerProcess; ReceiverProcess with CPU caches only)")
    args = parser.parse_args(argv)
    if not nixl_available():  # checked before any daemon or worker starts, each of which would fail on it
        print(f"pd_demo: error: {NO_NIXL}", file=sys.stderr)
        return 2
    try:
        return run(args)
    except KVCacheError as exc:
        print(f"pd_demo: error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    device = "cuda:0" if args.device == "cuda" else args.device
    from kvcache.client import CacheClient
    from kvcache.pd import PDProxy

    with Cluster(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=args.block_size,
                 prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, device=device, rows=args.rows,
                 link=args.link) as cluster, \
            CacheClient(cluster.cfg["prefill"]) as prefill, CacheClient(cluster.cfg["decode"]) as decode:
        proxy = PDProxy(prefill, decode)
        print(f"prefill tp {args.prefill_tp} -> decode tp {args.decode_tp}, {args.layers} layers, {args.kv_heads} kv "
              f"heads x {args.head_dim}, block {args.block_size}, rows {args.rows}, {device}, "
              f"{'messagers in processes of their own' if args.link == 'process' else 'links in the workers'}")
        failures = 0
        for name, prompts, clear in scenario(np.random.default_rng(args.seed), args.block_size):
            if clear:
                (prefill if clear == "prefill" else decode).reset_prefix_cache()
            result = run_batch(cluster, proxy, prompts)
            hits = f"decode cached {sorted(result['decode_cached'].values())}, prefill cached " \
                   f"{sorted(result['prefill_cached'].values())}"
            print(f"{name:30s} {result['requests']} requests, {result['tokens']:5d} tokens, "
                  f"{result['bytes'] / 2**20:7.2f} MiB moved in {result['seconds'] * 1e3:7.1f} ms; last layer -> "
                  f"decode ready {result['tail_ms']:.2f} ms; {hits}")
            for problem in result["problems"]:
                print("  MISMATCH", problem)
            failures += len(result["problems"])
        usage = (prefill.usage.max, decode.usage.max)
        print(f"blocks in use at the end: prefill {usage[0]:.0%}, decode {usage[1]:.0%}")
        if usage != (0.0, 0.0):
            failures += 1
        print("OK: decode KV equals prefill KV byte for byte" if not failures else f"FAILED: {failures} problem(s)")
        return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

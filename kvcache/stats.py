"""`kvcache stats`: a live summary of a running daemon for a person (or one JSON object)."""
from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from kvcache.arguments import add_daemon_arguments, client_from_args
from kvcache.client import CacheClient


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stats", allow_abbrev=False, help="print a running daemon's usage, prefix hits and traffic",
                       description="Ask a running `kvcache serve` for its geometry, usage and counters.")
    add_daemon_arguments(p)
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until interrupted")
    p.add_argument("--json", action="store_true", help="print one JSON object and exit")
    p.set_defaults(run=_run)


def collect(client: CacheClient) -> dict[str, Any]:
    """Info, stats and usage in one round trip, and the scheduler endpoint they came from."""
    info, stats, usage = client.batch().op("info").op("stats").op("usage").send()
    return {"endpoint": client.endpoint, "info": info, "stats": stats, "usage": usage}


def render(snapshot: dict[str, Any], previous: dict[str, Any] | None = None, interval: float = 0.0) -> str:
    """The summary as text; with a previous snapshot, rates over the interval."""
    info, stats, usage = snapshot["info"], snapshot["stats"], snapshot["usage"]
    per_row = np.asarray(usage["per_row"])
    queried = stats["prefix_queried_tokens"]
    lines = [
        f"kvcache {info['version']} at {snapshot['endpoint']}: {info['num_blocks']:,} blocks x "
        f"{info['num_rows']} row(s), block_size {info['block_size']}, prefix caching "
        f"{'on (' + info['hash_algorithm'] + ')' if info['prefix_caching'] else 'off'}"
        + (f", max_concurrency {info['max_concurrency']:,} (requests of {info['max_model_len']:,} tokens at once)"
           if info.get("max_concurrency") is not None else ""),
        f"requests {stats['num_requests']:,}   cached hashes {stats['num_cached_hashes']:,}   "
        f"min free blocks {stats['min_free_blocks']:,}   subscribers {stats.get('subscribers')} on the PUB, "
        f"{stats.get('local_subscribers', 0)} on the local endpoint",
        f"usage max {usage['max']:.4%}   per row " + " ".join(f"{u:.2%}" for u in per_row[:16])
        + (" ..." if per_row.size > 16 else ""),
        f"prefix hits {stats['prefix_hit_tokens']:,} of {queried:,} tokens "
        f"({stats['prefix_hit_tokens'] / queried:.1%})" if queried else "prefix hits: no queries yet",
        f"evicted {stats['evicted_blocks']:,}   SWA recycled {stats['recycled_blocks']:,}   "
        f"delta seq {stats['seq']:,}",
    ]
    if info.get("role") in ("prefill", "decode"):
        t = stats.get("transfers", {})
        lines.append(f"PD {info['role']}: in transfer {stats['in_transfer']:,}   started {t.get('started', 0):,}   "
                     f"done {t.get('done', 0):,}   failed {t.get('failed', 0):,}   cancelled {t.get('cancelled', 0):,}")
    tier = stats.get("host_tier")
    if tier:
        lines.append(f"host tier: {tier['cached_blocks']:,} of {tier['num_blocks']:,} blocks findable, "
                     f"{tier['pending_offloads']:,} offloads and {tier['pending_loads']:,} loads in flight, "
                     f"{tier['ranks']} rank(s) attached")
        lines.append(f"host tier since start: offloaded {tier['offloaded_blocks']:,}   loaded "
                     f"{tier['loaded_blocks']:,}   hit tokens {tier['hit_tokens']:,}   evicted "
                     f"{tier['evicted_blocks']:,}   dropped {tier['dropped_blocks']:,}   failed loads "
                     f"{tier['failed_loads']:,}   retired {tier['retired_blocks']:,}"
                     + (f"   GPU blocks held {tier['held_gpu_blocks']:,}" if tier.get("held_gpu_blocks") else ""))
    if previous is not None and interval > 0:
        prev = previous["stats"]
        lines.append(f"per second: deltas {(stats['seq'] - prev['seq']) / interval:,.0f}   admits "
                     f"{(stats['prefix_queries'] - prev['prefix_queries']) / interval:,.0f}   evictions "
                     f"{(stats['evicted_blocks'] - prev['evicted_blocks']) / interval:,.0f}")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    with client_from_args(args) as client:
        snapshot = collect(client)
        if args.json:
            print(json.dumps(snapshot, default=lambda o: o.tolist() if isinstance(o, np.ndarray) else str(o)))
            return 0
        print(render(snapshot))
        while args.watch:
            time.sleep(args.watch)
            previous, snapshot = snapshot, collect(client)
            print()
            print(render(snapshot, previous, args.watch))
    return 0

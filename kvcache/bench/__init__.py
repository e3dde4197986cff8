"""`kvcache bench ...`: benchmarks users can run; each prints a ratio against a limit or peer measured in the same run."""
from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `kvcache bench` and its targets on the top-level subparsers."""
    bench = sub.add_parser("bench", help="run a benchmark and print ratios against limits measured in the same run",
                           allow_abbrev=False)
    targets = bench.add_subparsers(dest="target", metavar="TARGET", required=True)
    from kvcache.bench import allocator, daemon, engine, pd, signal, tier, transfer

    allocator.add_parser(targets)
    daemon.add_parser(targets)
    engine.add_parser(targets)
    pd.add_parser(targets)
    signal.add_parser(targets)
    tier.add_parser(targets)
    transfer.add_parser(targets)

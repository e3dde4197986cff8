"""The `kvcache` command: one subcommand per job (plan, serve, stats, keys, journal, bench)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from kvcache import __version__
from kvcache.allocator.errors import KVCacheError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcache",
        allow_abbrev=False,
        description="Paged KV-cache allocation, prefix caching and KV transfer for LLM inference engines.",
    )
    parser.add_argument("--version", action="version", version=f"kvcache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from kvcache import bench, journal_cli, keys, plan, serve, stats

    plan.add_parser(sub)
    serve.add_parser(sub)
    stats.add_parser(sub)
    keys.add_parser(sub)
    journal_cli.add_parser(sub)
    bench.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KVCacheError as exc:
        print(f"kvcache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`kvcache plan --json | head`): nothing more to say to it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not fail too
        return 141


if __name__ == "__main__":
    sys.exit(main())

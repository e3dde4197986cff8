"""Many small notified NIXL writes into another process, one at a time: how many never finish.

Not a test (pytest does not collect it): a stress that found the NIXL engine's worker waiting past
its deadline (see the README's "A stuck write, fixed"). Run from the repository root:

    python tests/stress_nixl_writes.py --writes 60000

Each write moves one scattered block of every layer (12 ranges with this spec) with a
notification, the shape of a PD step's closing write; its deadline is 3 s, so a stuck write
costs 3 s and is counted.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))  # the receiver process and caches of test_transfer


def main() -> int:
    from test_transfer import Cache, Receiver, make_spec, scattered

    from kvcache.transfer.engines import TransferStatus
    from kvcache.transfer.nixl import NixlEngine

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0], allow_abbrev=False)
    parser.add_argument("--writes", type=int, default=20_000)
    parser.add_argument("--threads", type=int, default=2, help="the writer's UCX thread pool (0: none)")
    parser.add_argument("--blocks", type=int, default=1, help="scattered blocks per write")
    args = parser.parse_args()
    spec = make_spec("block_wise_fp8")
    rng = np.random.default_rng(1)
    peer = Receiver(spec, 48, seed=5)
    src = Cache(spec, 40, seed=4)
    seconds, stuck = [], 0
    try:
        with NixlEngine("stress-writer", threads=args.threads) as engine:
            remote = engine.connect(peer.endpoint).regions[0]
            for i in range(args.writes):
                start = time.perf_counter()
                handle = engine.write(src.region, scattered(rng, 40, args.blocks), remote,
                                      scattered(rng, 48, args.blocks), timeout=3.0, notify=b"w%d" % i)
                status = handle.wait()
                seconds.append(time.perf_counter() - start)
                if status is not TransferStatus.DONE:
                    stuck += 1
                    print(f"write {i}: {status.value}: {handle.error}", flush=True)
    finally:
        peer.stop()
    ms = np.array(seconds) * 1e3
    print(f"{args.writes:,} writes of {handle.num_ranges} ranges, thread pool {args.threads}: {stuck} not finished; "
          f"p50 {np.percentile(ms, 50):.3f} ms, p99 {np.percentile(ms, 99):.3f} ms, max {ms.max():.1f} ms")
    return 1 if stuck else 0


if __name__ == "__main__":
    sys.exit(main())

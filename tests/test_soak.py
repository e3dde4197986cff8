"""Soak: 8 schedulers and 8 workers on one daemon for 60 s lose no delta and grow no memory."""
from __future__ import annotations

import multiprocessing
import queue
import random
import time
import traceback
from typing import Any

import numpy as np
import pytest

from kvcache.client import CacheClient
from kvcache.worker import TableSubscriber

CLIENTS = 8
SUBSCRIBERS = 8
RUN_S = 60.0
WARM_S = 10.0  # RSS is compared from here on: every bounded buffer is full by then (see the test's docstring)
RSS_GROWTH_KIB = 16 * 1024
LIVE_PER_CLIENT = 8
MAX_TOKENS = 400  # a request this long ends: tables stay within MAX_BLOCKS
MAX_BLOCKS = 256
PAUSES = (5.0, 25.0, 45.0)  # seconds into the run when the odd subscribers stop reading for PAUSE_S
PAUSE_S = (2.0, 8.0)
# A small PUB queue, so a paused subscriber loses deltas (a replay) or more than the replay buffer (a snapshot).
FLAGS = ("--num-blocks", "2000", "--block-size", "4", "--rows", "window:16:4,full", "--hash-seed", "soak",
         "--replay-buffer", "1024", "--dedupe-window", "128", "--pub-bytes", "6553600")


def _report(results: Any, index: int, work: Any) -> None:
    """Run ``work`` and put its result, or its traceback, on ``results``; a failure still exits non-zero."""
    try:
        results.put((index, "ok", work()))
    except BaseException:
        results.put((index, "error", traceback.format_exc()))
        raise


def _client(endpoint: str, index: int, stop: Any, results: Any) -> None:
    """Random scheduler steps until ``stop``: admits with shared prefixes, batches of extends, frees, lookups.

    Reports the tables and slots it was told for its live requests, and its step count.
    """
    def work() -> dict[str, Any]:
        rng = random.Random(1000 + index)
        prefixes = [list(range(p * 100, p * 100 + 40)) for p in range(4)]
        tokens: dict[str, int] = {}
        tables: dict[str, np.ndarray] = {}
        steps = 0
        with CacheClient(endpoint, timeout=30, name=f"soak-{index}") as client:
            while not stop.is_set():
                batch = client.batch()
                ops: list[tuple[str, str, int]] = []
                for rid in list(tokens):
                    r = rng.random()
                    if r < 0.05 or tokens[rid] > MAX_TOKENS:
                        batch.free(rid)
                        ops.append(("free", rid, 0))
                    elif r < 0.9:
                        n = rng.choice((1, 1, 1, 1, 2, 7))
                        batch.extend(rid, [rng.randrange(500) for _ in range(n)])
                        ops.append(("extend", rid, n))
                if len(tokens) < LIVE_PER_CLIENT and rng.random() < 0.5:
                    rid = f"c{index}-{steps}"
                    prompt = rng.choice(prefixes)[: rng.randrange(1, 40)] + [rng.randrange(500)
                                                                          for _ in range(rng.randrange(0, 30))]
                    batch.admit(rid, prompt)
                    ops.append(("admit", rid, len(prompt)))
                if rng.random() < 0.1:
                    batch.op("lookup", tokens=np.array(rng.choice(prefixes), dtype=np.uint32))
                    ops.append(("lookup", "", 0))
                if not ops:
                    continue
                for (kind, rid, n), result in zip(ops, batch.send()):
                    if isinstance(result, Exception):
                        raise result
                    if kind == "free":
                        del tokens[rid], tables[rid]
                    elif kind == "admit" and result is not None:
                        tokens[rid], tables[rid] = result.num_tokens, result.table
                    elif kind == "extend" and result is not None:
                        tokens[rid] += n
                        tables[rid] = result
                steps += 1
            live = {rid: (client.slot(rid), table.tolist()) for rid, table in tables.items()}
        return {"steps": steps, "live": live}

    _report(results, index, work)


def _subscriber(endpoint: str, index: int, ready: Any, target: Any, results: Any) -> None:
    """Follow the deltas until told the daemon's last seq; then report the tables held at exactly that seq.

    Odd subscribers stop reading now and then, as a worker stuck in a long
    step would: they fall behind, lose deltas, and must catch up by replay or snapshot.
    """
    def work() -> dict[str, Any]:
        rng = random.Random(2000 + index)
        with TableSubscriber(endpoint, max_blocks=MAX_BLOCKS, timeout=30) as sub:
            ready.put(index)
            started = time.monotonic()
            pauses = [started + t for t in PAUSES] if index % 2 else []
            applied = 0
            while True:
                try:
                    seq, epoch = target.get_nowait()
                    break
                except queue.Empty:
                    applied += sub.poll(0.05)
                if pauses and time.monotonic() >= pauses[0]:
                    pauses.pop(0)
                    time.sleep(rng.uniform(*PAUSE_S))
            sub.wait_for(seq, timeout=60, epoch=epoch)
            tables = {rid: (sub.slot_of(rid), sub.table(rid).tolist()) for rid in sub.requests}
            return {"seq": sub.seq, "applied": applied, "replays": sub.replays, "snapshots": sub.snapshots,
                    "tables": tables}

    _report(results, index, work)


def vm_rss_kib(pid: int) -> int:
    """Resident memory of a process (VmRSS of /proc/PID/status), KiB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def _collect(results: Any, count: int, timeout: float) -> dict[int, Any]:
    """``count`` reports from ``results`` by process index; a process's traceback fails the test."""
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(out) < count:
        index, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
        assert status == "ok", f"process {index} failed:\n{value}"
        out[index] = value
    return out


@pytest.mark.slow
def test_eight_schedulers_and_eight_workers_for_a_minute_lose_nothing_and_do_not_grow(daemon):
    """60 s of random steps from 8 client processes while 8 TableSubscriber processes follow the deltas.

    No lost delta: afterwards every subscriber sits at the daemon's last seq
    and holds exactly the daemon's live tables and slots (which equal what
    each scheduler was told), however many replays and snapshots it took; the
    odd subscribers stall for 2-8 s three times, so some must take them.

    Memory bound: the daemon's RSS may grow at most 16 MiB between 10 s and
    60 s. All of its state is bounded and full by 10 s (about 4,000 steps):
    the allocator by its 2,000 blocks per row, live requests by 8 per client,
    the replay buffer by 1,024 deltas (under 1 KiB each: at most ~1 MiB), the
    dedupe cache by 128 replies per client (~1 MiB for 8 clients and the
    admin), the PUB's queue to a stalled worker by 100 deltas (--pub-bytes). 16 MiB is
    several times that, room for allocator fragmentation, yet a leak of 1 KiB
    per step would exceed it within the 50 s (20,000+ steps).
    """
    d = daemon(*FLAGS)
    ctx = multiprocessing.get_context("spawn")
    stop, ready, results = ctx.Event(), ctx.Queue(), ctx.Queue()
    targets = [ctx.Queue() for _ in range(SUBSCRIBERS)]
    subscribers = [ctx.Process(target=_subscriber, args=(d.endpoint, i, ready, targets[i], results))
                   for i in range(SUBSCRIBERS)]
    clients = [ctx.Process(target=_client, args=(d.endpoint, i, stop, results)) for i in range(CLIENTS)]
    processes = subscribers + clients
    try:
        for p in subscribers:
            p.start()
        for _ in range(SUBSCRIBERS):
            ready.get(timeout=120)
        for p in clients:
            p.start()
        start = time.monotonic()
        rss: list[tuple[float, int]] = []
        while (elapsed := time.monotonic() - start) < RUN_S:
            assert d.process.poll() is None, d.log()
            rss.append((elapsed, vm_rss_kib(d.process.pid)))
            time.sleep(min(1.0, RUN_S - elapsed))
        rss.append((time.monotonic() - start, vm_rss_kib(d.process.pid)))
        stop.set()
        told = _collect(results, CLIENTS, timeout=60)
        for p in clients:
            p.join(30)
        with CacheClient(d.endpoint, timeout=30) as admin:
            admin.check_integrity()
            stats = admin.stats()
            epoch = admin.info()["epoch"]
            live = {rid: entry for report in told.values() for rid, entry in report["live"].items()}
            assert stats["num_requests"] == len(live)
            for rid, (slot, table) in live.items():
                assert admin.table(rid).tolist() == table, rid
        for q in targets:
            q.put((stats["seq"], epoch))
        followed = _collect(results, SUBSCRIBERS, timeout=120)
        for p in subscribers:
            p.join(30)
    finally:
        stop.set()
        for p in processes:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    warm = next(kib for t, kib in rss if t >= WARM_S)
    growth = rss[-1][1] - warm
    steps = sum(r["steps"] for r in told.values())
    print(f"\nsoak: {steps:,} steps ({steps / RUN_S:,.0f}/s), last seq {stats['seq']:,}, {len(live)} live requests; "
          f"daemon RSS {warm / 1024:.1f} MiB at {WARM_S:g} s -> {rss[-1][1] / 1024:.1f} MiB at the end "
          f"(growth {growth / 1024:+.1f} MiB, bound {RSS_GROWTH_KIB / 1024:g}); subscribers: "
          + ", ".join(f"#{i} {r['applied']} deltas/{r['replays']} replays/{r['snapshots']} snapshots"
                      for i, r in sorted(followed.items())))
    assert [p.exitcode for p in processes] == [0] * len(processes)
    for index, report in sorted(followed.items()):
        assert report["seq"] == stats["seq"], (index, report["seq"], stats["seq"])
        assert report["tables"] == live, f"subscriber {index} differs from the daemon"
    assert sum(r["replays"] + r["snapshots"] for r in followed.values()) >= 1, "no subscriber ever fell behind"
    assert growth <= RSS_GROWTH_KIB, rss

"""kill -9 under load, restart from the journal: every acknowledged allocation is there, nothing is doubled."""
from __future__ import annotations

import json
import multiprocessing
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvcache.client import CacheClient, DaemonUnavailable

FLAGS = ("--num-blocks", "600", "--block-size", "4", "--rows", "window:12:4*2,full*2", "--hash-seed", "crash")


def _client(endpoint: str, index: int, folder: str, pause: Any, paused: Any, stop: Any) -> None:
    """Random steps with retries; after every acknowledged step, write the tables it was told to a file.

    The file is what this scheduler *knows*: the daemon must still hold exactly
    these tables after any crash (an unacknowledged step may or may not have
    happened, so its retry, with the same request id, settles it).
    """
    rng = random.Random(index)
    known: dict[str, list] = {}
    out = Path(folder) / f"client{index}.json"
    with CacheClient(endpoint, timeout=0.5, retries=60, name=f"client-{index}") as client:
        step = 0
        while not stop.is_set():
            if pause.is_set():
                paused.put(index)
                while pause.is_set() and not stop.is_set():
                    time.sleep(0.01)
                continue
            batch = client.batch()
            ops = []
            for rid in list(known):
                if rng.random() < 0.15:
                    batch.free(rid)
                    ops.append(("free", rid))
                elif rng.random() < 0.7:
                    batch.extend(rid, [rng.randrange(50) for _ in range(rng.choice([1, 1, 3, 7]))])
                    ops.append(("extend", rid))
            if len(known) < 6:
                rid = f"c{index}-{step}"
                prefix = list(range(rng.randrange(1, 16)))
                batch.admit(rid, prefix + [rng.randrange(50) for _ in range(rng.randrange(0, 9))])
                ops.append(("admit", rid))
            try:
                results = batch.send()
            except DaemonUnavailable:
                continue  # the daemon stayed down longer than every retry: start the step over
            for (kind, rid), result in zip(ops, results):
                if kind == "free":
                    known.pop(rid)
                elif kind == "admit" and result is not None:
                    known[rid] = result.table.tolist()
                elif kind == "extend" and result is not None:
                    known[rid] = result.tolist()
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps(known))
            os.replace(tmp, out)
            step += 1


def _pause_all(pause: Any, paused: Any, count: int) -> None:
    pause.set()
    seen = set()
    deadline = time.monotonic() + 60
    while len(seen) < count:
        seen.add(paused.get(timeout=max(0.1, deadline - time.monotonic())))


def test_sigkill_at_random_moments_loses_no_acknowledged_allocation(daemon, tmp_path):
    journal = tmp_path / "journal"
    d = daemon(*FLAGS, "--journal", str(journal), "--snapshot-bytes", "20000")
    ctx = multiprocessing.get_context("spawn")
    pause, stop, paused = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(d.endpoint, i, str(tmp_path), pause, paused, stop)) for i in range(3)]
    for p in procs:
        p.start()
    rng = random.Random(7)
    kills = 0
    try:
        for _ in range(20):
            time.sleep(rng.uniform(0.05, 0.4))
            d.kill()
            kills += 1
            d = daemon(*FLAGS, "--journal", str(journal), "--snapshot-bytes", "20000", folder=d.folder)
            _pause_all(pause, paused, len(procs))
            with CacheClient(d.endpoint, timeout=10) as admin:
                assert admin.ping(), d.log()
                admin.check_integrity()  # refcounts == table membership; free + used == total per row
                stats = admin.stats()
                known: dict[str, list] = {}
                for i in range(len(procs)):
                    path = tmp_path / f"client{i}.json"
                    if path.exists():
                        known.update(json.loads(path.read_text()))
                assert stats["num_requests"] == len(known), (stats["num_requests"], sorted(known))
                for rid, table in known.items():
                    assert admin.table(rid).tolist() == table, rid
            pause.clear()
    finally:
        stop.set()
        pause.clear()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert kills == 20
    assert all(p.exitcode == 0 for p in procs)
    assert sum(1 for _ in tmp_path.glob("client*.json")) == 3
    assert (journal / "snapshot").exists()


def test_a_journal_for_another_geometry_is_refused(daemon, tmp_path):
    journal = tmp_path / "journal"
    d = daemon(*FLAGS, "--journal", str(journal))
    with CacheClient(d.endpoint) as client:
        client.admit("a", np.arange(9))
    d.stop()
    try:
        daemon("--num-blocks", "601", "--block-size", "4", "--rows", "window:12:4*2,full*2", "--journal",
               str(journal), ready_timeout=10)
    except RuntimeError as exc:
        assert "num_blocks is 600 in the journal but 601" in str(exc)
    else:
        raise AssertionError("a daemon started on a journal of another geometry")


def test_a_clean_restart_keeps_tables_epoch_and_hashes(daemon, tmp_path):
    journal = tmp_path / "journal"
    d = daemon("--num-blocks", "100", "--block-size", "4", "--journal", str(journal))
    with CacheClient(d.endpoint) as client:
        first = client.admit("a", np.arange(9))
        epoch = client.last_epoch
    d.stop()
    d = daemon("--num-blocks", "100", "--block-size", "4", "--journal", str(journal), folder=d.folder)
    with CacheClient(d.endpoint) as client:
        assert np.array_equal(client.table("a"), first.table)
        assert client.lookup(np.arange(9)) == 8  # the random hash seed came back with the journal
        client.admit("b", np.arange(3))
        assert client.last_epoch == epoch

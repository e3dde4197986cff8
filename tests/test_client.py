"""CacheClient against a real `kvcache serve` subprocess: same results as the library, deadlines, batches."""
from __future__ import annotations

import multiprocessing
import time
from typing import Any

import numpy as np
import pytest

from kvcache.allocator import Full, KVCacheError, KVCacheManager, Window
from kvcache.client import CacheClient, DaemonError, DaemonUnavailable

from caches import same_random_steps

ROWS = "window:16:4*2,full*2"
POLICIES = [Window(16, 4)] * 2 + [Full()] * 2


def test_client_gives_the_same_results_as_the_library(daemon):
    """The same random steps through the daemon and through an in-process manager agree exactly."""
    d = daemon("--num-blocks", "40", "--block-size", "4", "--rows", ROWS, "--hash-seed", "s")
    library = KVCacheManager(40, 4, POLICIES, hash_seed="s")
    with CacheClient(d.endpoint) as client:
        live = same_random_steps(
            client, library, np.random.default_rng(1), 300,
            prompt=lambda rng: np.concatenate([np.arange(rng.integers(1, 12)), rng.integers(0, 9, rng.integers(0, 6))]),
            new_tokens=lambda rng: rng.integers(0, 9, rng.integers(0, 6)),
            lookahead=lambda rng: rng.choice([0, 0, 1, 6]))  # positions past the tokens, reserved for the next step
        for rid in live:
            assert np.array_equal(client.table(rid), library.table(rid))
        assert client.lookup(np.arange(9)) == library.lookup(np.arange(9))
        assert np.array_equal(client.usage.per_row, library.usage.per_row)


def test_a_batch_is_one_round_trip_and_extends_travel_together(daemon):
    d = daemon("--num-blocks", "200", "--block-size", "4")
    with CacheClient(d.endpoint) as client:
        batch = client.batch()
        for i in range(8):
            batch.admit(i, np.arange(10) + 100 * i)
        admissions = batch.send()
        assert [a.num_tokens for a in admissions] == [10] * 8
        seq_before = client.last_seq
        step = client.batch()
        for i in range(8):
            step.extend(i, [1, 2, 3] if i % 2 else [1])
        step.free(7).op("ping")
        results = step.send()
        assert [r.shape[1] for r in results[:8]] == [3, 4, 3, 4, 3, 4, 3]  + [4]
        assert results[8] is None and results[9] == "pong"
        assert client.last_seq == seq_before + 2  # 7 changed then freed: two deltas keep that order
        for i in range(7):
            assert np.array_equal(results[i], client.table(i))


@pytest.mark.parametrize("local", [False, True])
def test_posted_batches_give_the_librarys_results_in_the_order_they_were_sent(daemon, local):
    """Random steps, each posted: its reply is taken by results(), or first by whatever the client calls next
    (the next post, an admit); every result is the library's, applied in order."""
    d = daemon("--num-blocks", "40", "--block-size", "4", "--rows", ROWS, "--hash-seed", "s")
    library = KVCacheManager(40, 4, POLICIES, hash_seed="s")
    rng = np.random.default_rng(7)
    live: list[int] = []

    def agree(posted: Any, expected: list[Any]) -> None:
        got = posted.results()
        assert len(got) == len(expected)
        for g, w in zip(got[:-1], expected[:-1]):
            assert (g is None) == (w is None) and (w is None or np.array_equal(g, w))
        assert np.allclose(got[-1]["per_row"], expected[-1])

    with CacheClient(d.endpoint, local=local) as client:
        client.ping()
        assert (client.local_endpoint is not None) == local
        previous = None
        for step in range(120):
            batch, want = client.batch(), []
            for rid in live:
                new = rng.integers(0, 9, rng.integers(1, 3))
                batch.extend(rid, new)
                table = library.extend(rid, new)
                want.append(None if table is None else np.array(table))  # tables are live views: as they are now
            if rng.random() < 0.3 and live:
                rid = live.pop(rng.integers(len(live)))
                batch.free(rid)
                library.free(rid)
                want.append(None)
            batch.op("usage")
            want.append(library.usage.per_row.copy())
            posted = batch.post()
            assert not posted.done  # sent, not answered yet
            if previous is not None:
                assert previous[0].done  # the post took its reply first
                agree(*previous)
            previous = (posted, want)
            if rng.random() < 0.5:  # a call of another kind takes the posted reply first
                prompt = rng.integers(0, 5, rng.integers(1, 9))
                got, expected = client.admit(step, prompt), library.admit(step, prompt)
                assert posted.done
                assert (got is None) == (expected is None)
                if expected is not None:
                    assert np.array_equal(got.table, expected.table)
                    live.append(step)
            if rng.random() < 0.3:
                agree(*previous)
                previous = None
        for rid in live:
            assert np.array_equal(client.table(rid), library.table(rid))
        assert client.num_free_blocks.tolist() == library.num_free_blocks.tolist()


def test_a_posted_batch_whose_daemon_is_gone_raises_from_results_within_its_timeout(daemon):
    """A refused batch raises from results(), not from the call that took its reply; a reply that never comes
    raises DaemonUnavailable after the timeout."""
    d = daemon("--num-blocks", "20")
    with CacheClient(d.endpoint, timeout=0.5) as client:
        assert client.admit("a", [1, 2, 3]) is not None
        refused = client.batch().free("nobody").op("ping").post()
        assert client.ping()  # takes the refusal first, and is not failed by it
        with pytest.raises(DaemonError, match="'nobody' is not admitted"):
            refused.results()
        d.kill()
        posted = client.batch().extend("a", [4]).post()
        start = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="did not answer within 0.5 s"):
            client.ping()  # takes the posted reply first (none comes), then fails on its own
        assert posted.done and time.monotonic() - start < 2.0
        with pytest.raises(DaemonUnavailable):
            posted.results()


def test_extend_many_takes_arrays_and_gives_the_librarys_tables(daemon):
    """One extend_many op: request i gets the next counts[i] tokens; each table (None without room) as the library's."""
    d = daemon("--num-blocks", "40", "--block-size", "4", "--rows", ROWS, "--hash-seed", "s")
    library = KVCacheManager(40, 4, POLICIES, hash_seed="s")
    rng = np.random.default_rng(2)
    with CacheClient(d.endpoint) as client:
        for rid in range(4):
            prompt = np.arange(5 + rid)
            client.admit(rid, prompt)
            library.admit(rid, prompt)
        for step in range(40):
            ids = rng.permutation(4)
            counts = rng.integers(0, 4, ids.size)
            tokens = rng.integers(0, 9, int(counts.sum())).astype(np.int32)
            ahead = int(rng.choice([0, 0, 1, 5]))
            got = client.extend_many(ids, tokens, counts, num_lookahead_tokens=ahead)
            want = library.extend_many(ids.tolist(), tokens, counts, num_lookahead_tokens=ahead)
            assert [g is None for g in got] == [w is None for w in want]
            for g, w in zip(got, want):
                assert w is None or np.array_equal(g, w)
        assert any(w is None for w in want), "the pool should have run short by the end"
        results = client.batch().extend(0, [1]).extend_many([1, 1], [2, 3], [1, 1]).op("ping").send()
        library.extend(0, [1])
        library.extend_many([1, 1], [2, 3], [1, 1])
        assert len(results) == 3 and results[2] == "pong" and len(results[1]) == 2
        for rid in range(4):
            assert np.array_equal(client.table(rid), library.table(rid))
        with pytest.raises(KVCacheError, match="counts: need one integer per request"):
            client.batch().extend_many([0, 1], [1, 2], [2])
        with pytest.raises(DaemonError, match=r"ops\[0\].reqs\[1\]: request 'zz' is not admitted"):
            client.extend_many([0, "zz"], [1, 2], [1, 1])
        with pytest.raises(DaemonError, match=r"ops\[0\].lookahead: -1 is outside"):
            client.batch().op("extend_many", reqs=[0], tokens=np.array([1]), counts=np.array([1]), lookahead=-1).send()
        for rid in range(4):  # nothing changed
            assert np.array_equal(client.table(rid), library.table(rid))


@pytest.mark.parametrize("rows, policies", [(ROWS, POLICIES), ("full", [Full()])])
def test_decode_steps_keep_every_table_as_the_librarys_across_buffer_growth(daemon, rows, policies):
    """One-token extends of many requests per batch (a decode step): each result equals the library's table.

    Tables cross block boundaries every few steps and outgrow the client's buffers (8, 16, 32 columns);
    uniform rows give the usual decode delta (one new column each), head-wise ones recycled columns too.
    """
    d = daemon("--num-blocks", "400", "--block-size", "2", "--rows", rows, "--hash-seed", "s")
    library = KVCacheManager(400, 2, policies, hash_seed="s")
    rng = np.random.default_rng(3)
    with CacheClient(d.endpoint) as client:
        for rid in range(6):
            prompt = rng.integers(0, 50, 3 + 5 * rid)
            client.admit(rid, prompt)
            library.admit(rid, prompt)
        for step in range(60):
            batch = client.batch()
            tokens = rng.integers(0, 50, 6)
            for rid in range(6):
                batch.extend(rid, tokens[rid: rid + 1])
            got = batch.send()
            want = [library.extend(rid, tokens[rid: rid + 1]) for rid in range(6)]
            for g, w in zip(got, want):
                assert np.array_equal(g, w), f"step {step}"


def test_tables_are_read_only_views_the_client_keeps_current(daemon):
    """As the library's: an extend that changes no column gives the same view; one that adds a block, a wider one."""
    d = daemon("--num-blocks", "20", "--block-size", "4")
    with CacheClient(d.endpoint) as client:
        admission = client.admit("a", [1, 2, 3])
        assert not admission.table.flags.writeable
        assert client.extend("a", [4]) is admission.table
        (wider,) = client.batch().extend("a", [5]).send()
        assert wider.shape == (1, 2) and wider[0, 0] == admission.table[0, 0]
        assert np.array_equal(wider, client.table("a"))


def test_errors_name_the_problem_and_keep_the_client_usable(daemon):
    d = daemon("--num-blocks", "20", "--block-size", "4")
    with CacheClient(d.endpoint) as client:
        client.admit("a", [1, 2, 3])
        with pytest.raises(DaemonError, match="already admitted"):
            client.admit("a", [1])
        with pytest.raises(DaemonError, match="not admitted"):
            client.extend("b", [1])
        with pytest.raises(DaemonError, match="outside"):
            client.extend("a", [-3])
        assert client.admit("big", np.arange(1000)) is None
        assert client.extend("a", [4]).shape == (1, 1)


def test_a_client_whose_daemon_is_gone_gets_an_error_within_its_timeout(daemon):
    d = daemon("--num-blocks", "20")
    client = CacheClient(d.endpoint, timeout=0.5)
    assert client.ping()
    d.kill()
    start = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="did not answer within 0.5 s"):
        client.admit("a", [1, 2, 3])
    assert time.monotonic() - start < 1.5
    client.close()


def test_a_client_with_no_daemon_at_all_fails_fast(tmp_path):
    with CacheClient(f"ipc://{tmp_path}/nothing.sock", timeout=0.3) as client:
        with pytest.raises(DaemonUnavailable):
            client.ping()


def test_bad_client_arguments_are_refused_locally():
    with pytest.raises(KVCacheError, match="timeout"):
        CacheClient("ipc:///tmp/x.sock", timeout=0)


def _scheduler(endpoint: str, name: int, steps: int, queue) -> None:
    """A scheduler process: admits, extends in batches, frees; reports its live tables at the end."""
    rng = np.random.default_rng(name)
    live: list[str] = []
    with CacheClient(endpoint, timeout=10) as client:
        for step in range(steps):
            batch = client.batch()
            for rid in live:
                batch.extend(rid, rng.integers(0, 50, rng.integers(1, 3)))
            rid = f"{name}-{step}"
            batch.admit(rid, rng.integers(0, 50, rng.integers(1, 20)))
            results = batch.send()
            if results[-1] is not None:
                live.append(rid)
            if len(live) > 4:
                client.free(live.pop(0))
        queue.put({rid: client.table(rid).tolist() for rid in live})


def test_several_scheduler_processes_share_one_daemon_without_sharing_blocks(daemon):
    d = daemon("--num-blocks", "400", "--block-size", "4", "--rows", ROWS)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_scheduler, args=(d.endpoint, i, 60, queue)) for i in range(3)]
    for p in procs:
        p.start()
    tables = {}
    for _ in procs:
        tables.update(queue.get(timeout=120))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    with CacheClient(d.endpoint) as client:
        assert client.stats()["num_requests"] == len(tables) == 12
        for rid, table in tables.items():
            assert client.table(rid).tolist() == table
        # Reference counts equal table membership (a block in two tables only through a shared prefix),
        # and free + used == total per row.
        client.check_integrity()


def test_a_lora_given_as_name_and_path_reaches_the_daemon_as_the_library_keys_it(daemon):
    d = daemon("--num-blocks", "64", "--block-size", "4", "--hash-algorithm", "sha256_cbor")
    library = KVCacheManager(64, 4, hash_algorithm="sha256_cbor")
    prompt = np.arange(13)
    with CacheClient(d.endpoint) as client:
        for m in (client, library):
            m.admit("a", prompt, lora=("sql", "/adapters/sql"))
        for lora in (("sql", "/adapters/sql"), ("sql", "/adapters/other"), "sql", None):
            assert client.lookup(prompt, lora=lora) == library.lookup(prompt, lora=lora)
        assert client.lookup(prompt, lora=("sql", "/adapters/sql")) == 12

"""PD disaggregation end to end: real `kvcache serve --role prefill|decode` daemons, worker processes, messagers over NIXL.

The cluster and the fake model are kvcache.pd.cluster's, as examples/pd_demo.py uses them: what the demo shows is tested.
Every scenario ends with no block held on either node.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from kvcache.allocator.errors import KVCacheError
from kvcache.client import CacheClient, DaemonError
from kvcache.pd.cluster import Cluster, check_request, run_batch, scenario, signal_of, table_of, wait_outcomes
from kvcache.transfer.nixl import nixl_available

needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pip install nixl-cu12 --no-deps)")


def clients(cluster: Cluster) -> tuple[CacheClient, CacheClient]:
    return CacheClient(cluster.cfg["prefill"]), CacheClient(cluster.cfg["decode"])


def submit_prompts(prefill: CacheClient, decode: CacheClient, seed: int, lengths: tuple[int, ...], prefix: str
                   ) -> tuple[dict, list]:
    """Submit fresh prompts through a PDProxy of these clients (whose pd_poll then sees them); returns the prompts
    and their prefill step's items (whole prompts)."""
    from kvcache.pd import PDProxy

    proxy = PDProxy(prefill, decode)
    rng = np.random.default_rng(seed)
    prompts = {f"{prefix}{i}": rng.integers(0, 50_000, n) for i, n in enumerate(lengths)}
    placed = {r: proxy.submit(r, t) for r, t in prompts.items()}
    return prompts, [(r, t, np.asarray(placed[r][1].table)[0].copy(), 0) for r, t in prompts.items()]


def assert_nothing_held(prefill: CacheClient, decode: CacheClient, within: float = 0.0) -> None:
    """Both nodes back to zero blocks in use (waiting up to ``within`` seconds), and consistent."""
    deadline = time.monotonic() + within
    while (prefill.usage.max, decode.usage.max) != (0.0, 0.0) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (prefill.usage.max, decode.usage.max) == (0.0, 0.0)
    assert prefill.stats()["in_transfer"] == decode.stats()["in_transfer"] == 0
    prefill.check_integrity()
    decode.check_integrity()


@needs_nixl
@pytest.mark.parametrize("progress, hand_plans", [("thread", True), ("poll", False)])
def test_concurrent_requests_with_prefix_hits_on_either_side_arrive_byte_for_byte(progress, hand_plans):
    """Four concurrent prompts of 37 to 1,000 tokens, then prefix hits on both nodes, on prefill only, on decode only.

    Either NIXL's progress thread drives UCX in both workers, or their engines' worker threads do;
    the plans go with the step, or the messagers fetch them.
    """
    from kvcache.pd import PDProxy

    with Cluster(layers=4, kv_heads=4, head_dim=32, progress=progress) as cluster:
        prefill, decode = clients(cluster)
        proxy = PDProxy(prefill, decode)
        for name, prompts, clear in scenario(np.random.default_rng(1), cluster.spec.block_size):
            if clear:
                (prefill if clear == "prefill" else decode).reset_prefix_cache()
            result = run_batch(cluster, proxy, prompts, hand_plans=hand_plans)
            assert result["problems"] == [], name
            hits_d, hits_p = result["decode_cached"], result["prefill_cached"]
            if name == "fresh prompts":
                assert set(hits_d.values()) == set(hits_p.values()) == {0}
                stamps = [cluster.prefill_workers[0].call("sent_ns", req) for req in prompts]
                assert len({s["posted"] for s in stamps}) == 1 and stamps[0]["posted"] > 0  # one closing write for all
            elif name == "prefix hits on both nodes":
                assert all(hits_d[r] == hits_p[r] > 0 for r in prompts)
            elif name == "prefix hits on prefill only":
                assert set(hits_d.values()) == {0} and all(v > 0 for v in hits_p.values())
            else:
                assert set(hits_p.values()) == {0} and all(v > 0 for v in hits_d.values())
        assert_nothing_held(prefill, decode)


@needs_nixl
@pytest.mark.parametrize("prefill_tp, decode_tp, kv_heads", [(2, 1, 4), (1, 2, 4), (2, 4, 2)])
def test_heads_are_resliced_between_different_tp_sizes(prefill_tp, decode_tp, kv_heads):
    """Prefill TP 2 -> decode 1 (stacking), 1 -> 2 (splitting), 2 -> 4 with 2 heads (replicated on decode)."""
    from kvcache.pd import PDProxy

    with Cluster(layers=3, kv_heads=kv_heads, head_dim=32, prefill_tp=prefill_tp, decode_tp=decode_tp) as cluster:
        prefill, decode = clients(cluster)
        proxy = PDProxy(prefill, decode)
        batches = scenario(np.random.default_rng(2), cluster.spec.block_size)[:2]
        for name, prompts, _ in batches:
            result = run_batch(cluster, proxy, prompts)
            assert result["problems"] == [], name
        assert_nothing_held(prefill, decode)


@needs_nixl
def test_a_killed_decode_node_fails_the_transfer_on_the_prefill_side_within_its_deadline():
    """SIGKILL the decode daemon and workers mid-prefill: the prefill scheduler hears of it; prefill holds nothing."""
    timeout = 6.0
    with Cluster(layers=6, kv_heads=4, head_dim=64, timeout=timeout) as cluster:
        prefill, decode = clients(cluster)
        prompts, items = submit_prompts(prefill, decode, 3, (500, 900), "k")
        for w in cluster.prefill_workers:
            w.send("steps", ([(items, None)], 0.2, True, False, False))  # 1.2 s of "compute"
        time.sleep(0.5)
        cluster.kill_decode()
        killed = time.monotonic()
        for w in cluster.prefill_workers:
            w._reply("steps", 30)
        done, failed = wait_outcomes(prefill, set(prompts), timeout + 5)
        assert not done and set(failed) == set(prompts), (done, failed)
        assert time.monotonic() - killed < timeout + 3
        assert prefill.usage.max == 0.0 and prefill.stats()["in_transfer"] == 0
        prefill.check_integrity()
        assert prefill.lookup(prompts["k0"]) == 0  # KV nobody finished sending is not offered as a prefix


@needs_nixl
def test_a_cancelled_request_is_reported_to_both_schedulers_and_released_at_once():
    """Cancel one of two requests before its prefill step: both sides report it cancelled; the other arrives intact."""
    from kvcache.pd import PDProxy

    with Cluster(layers=3, kv_heads=2, head_dim=32, timeout=30.0) as cluster:
        prefill, decode = clients(cluster)
        proxy = PDProxy(prefill, decode)
        rng = np.random.default_rng(4)
        prompts = {"keep": rng.integers(0, 50_000, 200), "drop": rng.integers(0, 50_000, 300)}
        placed = {r: proxy.submit(r, t) for r, t in prompts.items()}
        proxy.cancel("drop")
        start = time.monotonic()
        items = [(r, t, np.asarray(placed[r][1].table)[0].copy(), 0) for r, t in prompts.items()]
        cluster.step(items)
        ready, failed = wait_outcomes(decode, set(prompts), 10)
        sent, failed_p = wait_outcomes(prefill, set(prompts), 10)
        assert set(ready) == {"keep"} and failed == {"drop": "cancelled"}
        assert set(sent) == {"keep"} and failed_p == {"drop": "cancelled"}
        assert check_request(cluster, prompts["keep"], np.asarray(placed["keep"][0].table)[0],
                                     np.asarray(placed["keep"][1].table)[0], 0) == []
        decode.free("keep")
        assert_nothing_held(prefill, decode, within=5.0)
        assert time.monotonic() - start < 10  # released on the messagers' word, not at the 30 s deadline


@needs_nixl
def test_a_request_cancelled_after_its_plan_went_with_the_step_is_released_once_the_messager_reports():
    """The messager cannot see a cancel it was never asked about: it writes, and both sides release on its word."""
    from kvcache.pd import PDProxy

    with Cluster(layers=3, kv_heads=2, head_dim=32, timeout=30.0) as cluster:
        prefill, decode = clients(cluster)
        proxy = PDProxy(prefill, decode)
        tokens = np.random.default_rng(7).integers(0, 50_000, 300)
        _, admission = proxy.submit("h", tokens)
        proxy.cancel("h")
        start = time.monotonic()
        cluster.step([("h", tokens, np.asarray(admission.table)[0].copy(), 0)], plans={"h": admission.plan})
        _, failed = wait_outcomes(decode, {"h"}, 10)
        _, failed_p = wait_outcomes(prefill, {"h"}, 10)
        assert failed == failed_p == {"h": "cancelled"}
        assert_nothing_held(prefill, decode, within=5.0)
        assert time.monotonic() - start < 10  # on the reports, not at the 30 s deadline
        assert cluster.prefill_workers[0].call("posted", "h") > 0  # it was written: the plan said where
        assert decode.lookup(tokens) == 0


@needs_nixl
def test_a_decode_side_cancel_mid_transfer_keeps_the_blocks_until_the_writes_stop():
    """Blocks still being written must not be handed to anyone else: released only once the prefill side is done."""
    from kvcache.pd import PDProxy

    with Cluster(layers=4, kv_heads=2, head_dim=32, timeout=30.0) as cluster:
        prefill, decode = clients(cluster)
        proxy = PDProxy(prefill, decode)
        tokens = np.random.default_rng(5).integers(0, 50_000, 400)
        reservation, admission = proxy.submit("x", tokens)
        decode.cancel("x")
        assert decode.pd_poll().failed == {"x": "cancelled"}
        assert decode.usage.max > 0  # the prefill node may still write into them
        cluster.step([("x", tokens, np.asarray(admission.table)[0].copy(), 0)])
        sent, _ = wait_outcomes(prefill, {"x"}, 10)
        assert set(sent) == {"x"}
        assert_nothing_held(prefill, decode, within=5.0)
        assert decode.lookup(tokens) == 0


@needs_nixl
def test_a_prefill_worker_that_dies_fails_the_request_on_both_sides_at_the_deadline():
    """Nothing hangs: a writer gone mid-step leaves both reservations to their deadline, then both schedulers hear."""
    from kvcache.pd import PDProxy

    timeout = 3.0
    with Cluster(layers=4, kv_heads=2, head_dim=32, timeout=timeout) as cluster:
        prefill, decode = clients(cluster)
        proxy = PDProxy(prefill, decode)
        tokens = np.random.default_rng(6).integers(0, 50_000, 300)
        _, admission = proxy.submit("w", tokens)
        worker = cluster.prefill_workers[0]
        worker.send("steps", ([([("w", tokens, np.asarray(admission.table)[0].copy(), 0)], None)], 0.5, True, False, False))
        time.sleep(0.3)
        worker.process.kill()
        start = time.monotonic()
        _, failed_d = wait_outcomes(decode, {"w"}, timeout + 5)
        _, failed_p = wait_outcomes(prefill, {"w"}, timeout + 5)
        assert "timed out" in failed_d["w"] and "timed out" in failed_p["w"]
        assert time.monotonic() - start < timeout + 3
        # The decode node keeps the blocks one more timeout: no word that the dead writer stopped ever comes.
        assert_nothing_held(prefill, decode, within=timeout + 2)
    assert not Path("/dev/shm", signal_of(cluster.cfg, 0)).exists()  # the dead writer's signal is gone too


# --------------------------------------------------------------------------- the daemons' PD ops alone


def test_pd_ops_refuse_bad_input_naming_the_field_and_change_nothing(daemon):
    d = daemon("--num-blocks", "32", "--block-size", "16", "--role", "decode", "--tp", "2")
    both = daemon("--num-blocks", "32", "--block-size", "16")
    with CacheClient(d.endpoint) as c, CacheClient(both.endpoint) as plain:
        with pytest.raises(DaemonError, match=r"decode rank\(s\) \[0, 1\] have no receiver attached"):
            c.reserve("a", np.arange(40))
        with pytest.raises(DaemonError, match=r"ops\[0\].rank: 2 is outside \[0, 1\]"):
            c.attach(2, "tcp://127.0.0.1:1")
        c.attach(0, "tcp://127.0.0.1:1")
        c.attach(1, "tcp://127.0.0.1:2")
        with pytest.raises(DaemonError, match=r"ops\[0\].timeout: must be seconds"):
            c.batch().reserve("a", np.arange(40), timeout=-1).send()
        r = c.reserve("a", np.arange(40))
        assert r.receivers == ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2") and r.table.shape == (1, 3)
        with pytest.raises(DaemonError, match=r"ops\[0\].req: request 'a' is still in transfer; extend it"):
            c.extend("a", [1])
        with pytest.raises(DaemonError, match=r"ops\[0\].op: plans needs a daemon started with --role prefill"):
            c.plans(["a"])
        with pytest.raises(DaemonError, match=r"ops\[0\].req: request 'b' is not in transfer"):
            c.received("b", 0)
        with pytest.raises(DaemonError, match="reserve needs a daemon started with --role decode"):
            plain.reserve("a", np.arange(40))
        with pytest.raises(DaemonError, match="dest.table: has 2 blocks; 40 tokens at block size 16 need 3"):
            CacheClient(daemon("--num-blocks", "8", "--block-size", "16", "--role", "prefill").endpoint).admit(
                "a", np.arange(40), dest={"receivers": ["tcp://x:1"], "table": np.zeros((1, 2), np.int32),
                                          "cached": 0, "decode": "ipc:///x"})
        assert c.stats()["in_transfer"] == 1 and c.usage.max == 3 / 32
        c.received("a", 0)
        assert c.pd_poll().done == {}
        c.received("a", 1)
        assert list(c.pd_poll().done) == ["a"]
        c.free("a")
        assert c.usage.max == 0.0


def test_a_prefill_admit_with_a_destination_returns_the_plan_the_plans_op_gives(daemon):
    """Sending.plan is what the messagers would fetch: source = the admission's table, destination = the reservation's."""
    from kvcache.pd.state import Sending

    d = daemon("--num-blocks", "32", "--block-size", "16", "--role", "decode")
    p = daemon("--num-blocks", "32", "--block-size", "16", "--role", "prefill", "--transfer-timeout", "9")
    with CacheClient(d.endpoint) as dc, CacheClient(p.endpoint) as pc:
        dc.attach(0, "tcp://127.0.0.1:1")
        dc.reserve("seed", np.arange(40))
        dc.received("seed", 0)
        reservation = dc.reserve("a", np.arange(70))  # hits seed's 2 full blocks on decode
        assert reservation.num_cached_tokens == 32
        sending = pc.admit("a", np.arange(70), dest=reservation.dest(d.endpoint))
        assert isinstance(sending, Sending) and sending.num_tokens == 70
        fetched, = pc.plans(["a"])
        for plan in (sending.plan, fetched):
            assert plan["req"] == "a" and plan["first_block"] == 2 and plan["decode"] == d.endpoint
            assert plan["receivers"] == ["tcp://127.0.0.1:1"]
            assert np.array_equal(plan["src_table"], sending.table)
            assert np.array_equal(plan["table"], reservation.table)
            assert 0 < plan["deadline_s"] <= 9
        assert type(pc.admit("b", np.arange(20))) is not Sending  # no destination, no plan
        pc.cancel("a")
        assert pc.plans(["a"]) == [{"req": "a", "cancelled": True, "decode": d.endpoint}]


@needs_nixl
def test_a_receivers_batch_report_lands_every_request_still_in_transfer_when_one_is_gone(daemon):
    """The receiver reports a poll's requests in one message; one no longer in transfer must not sink the rest."""
    from kvcache.pd.cluster import Cache, spec_of
    from kvcache.pd.links import DecodeLink
    from kvcache.transfer import KVRegion

    d = daemon("--num-blocks", "32", "--block-size", "16", "--role", "decode")
    cfg = dict(layers=2, kv_heads=2, head_dim=16, block_size=16)
    spec = spec_of(cfg, 1)
    region = KVRegion.from_tensors(spec, Cache(spec, 32, "cpu").layers)
    with DecodeLink(d.endpoint, region, 0) as link, CacheClient(d.endpoint) as c:
        for req in ("a", "b", "c"):
            c.reserve(req, np.arange(40) + 100 * ord(req))
        c.transfer_failed("b", "prefill rank 0: gone")
        link._received(["a", "b", "c"])
        outcome = c.pd_poll()
        assert set(outcome.done) == {"a", "c"} and set(outcome.failed) == {"b"}
        link._received(["a"])  # reported twice (a retry): refused, logged, nothing breaks
        for req in ("a", "c"):
            c.free(req)
        assert c.usage.max == 0.0


def test_a_reservation_survives_a_daemon_restart_from_its_journal(daemon, tmp_path):
    """kill -9 the decode daemon while a request is arriving: restarted, it still holds and completes it."""
    from kvcache.rank_keys import rank_key

    flags = ("--num-blocks", "32", "--block-size", "16", "--role", "decode", "--journal", str(tmp_path / "j"))
    d = daemon(*flags)
    with CacheClient(d.endpoint, name="sched") as c:
        c.attach(0, "tcp://127.0.0.1:1", key=rank_key(d.endpoint, 0))  # a worker's key: its reports count
        table = c.reserve("a", np.arange(40)).table.copy()
    d.kill()
    again = daemon(*flags, folder=d.folder)
    with CacheClient(again.endpoint, name="sched") as c:
        assert c.stats()["in_transfer"] == 1
        assert np.array_equal(c.table("a"), table)
        c.received("a", 0, key=rank_key(again.endpoint, 0))
        assert list(c.pd_poll().done) == ["a"]
        c.free("a")
        c.check_integrity()


@needs_nixl
@pytest.mark.parametrize("link", ["thread", "process"])
def test_bench_pd_quick_reports_the_tail_and_throughput_against_limits_from_the_same_run(capsys, link):
    import json

    from kvcache.bench import pd as bench
    from kvcache.bench.common import run_alone

    assert run_alone(bench.add_parser, "pd", ["--quick", "--json", "--link", link]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["workload"]["link"] == link
    assert r["workload"]["layers"] == 4 and r["workload"]["bytes"] == 4096 * 8 * 128 * 2 * 2 * 4
    assert 0 < r["one_layer_best_s"] <= r["one_layer_s"] and r["raw_s"] > 0
    assert r["tail_limit_s"] == pytest.approx(r["one_layer_s"] + 1e-3)
    assert r["tail_ok"] == (r["tail_s"]["median"] <= r["tail_limit_s"])
    assert r["rate_ratio"] == pytest.approx(r["rate"] / r["raw_rate"])
    assert r["workload"]["inflight"] == 2 and 0 < r["raw_batch_s"] and r["batch_s"]["best"] <= r["batch_s"]["median"]
    assert r["batch_rate"] == pytest.approx(2 * r["workload"]["bytes"] / r["batch_s"]["best"])
    assert r["batch_rate_ratio"] == pytest.approx(r["batch_rate"] / r["raw_batch_rate"])
    assert r["workload"]["steps"] == 2 and r["stream_s"]["best"] <= r["stream_s"]["median"]
    assert r["stream_rate"] == pytest.approx(2 * 2 * r["workload"]["bytes"] / r["stream_s"]["best"])
    assert r["stream_rate_ratio"] == pytest.approx(r["stream_rate"] / r["raw_batch_rate"])
    assert r["rate_ok"] == (r["stream_rate_ratio"] >= 0.85)
    assert r["tail_s"]["min"] > 0 and r["tail_received_s"] <= r["tail_s"]["median"] + 1e-3
    stages = r["tail_stages_s"]
    order = ["messager woke", "messager queued the last write", "engine took up the last write", "its transfer() call returned", "engine saw it done"]
    assert [stages[name] for name in order] == sorted(stages[name] for name in order)
    assert stages["receiver has all notes"] <= stages["decode daemon ready"]
    assert r["every_layer_ranges"] >= r["one_layer_ranges"] and r["every_layer_s"] > 0
    assert set(r["post_s"]) == {"layer", "every", "raw"} and all(v >= 0 for v in r["post_s"].values())
    unpaced = r["unpaced_stages_s"]
    assert (unpaced["messager began the step"] <= unpaced["messager had the plans"]
            <= unpaced["messager built every layer's ranges"] <= unpaced["messager woke"]
            <= unpaced["messager queued the last write"])
    assert unpaced["decode daemon ready"] >= r["unpaced_total_s"]  # the median run against the best one
    assert r["separate_notifications"] == 0  # the notice goes with the last write, never through the completion thread


def test_a_request_sharing_still_arriving_blocks_is_ready_only_after_their_owner_and_fails_with_it(daemon):
    """B hits A's blocks on decode while A's KV is still arriving: B waits for A; when A fails, B fails too."""
    d = daemon("--num-blocks", "32", "--block-size", "16", "--role", "decode")
    with CacheClient(d.endpoint) as c:
        c.attach(0, "tcp://127.0.0.1:1")
        prompt = np.arange(60)
        c.reserve("a", prompt[:50])
        b = c.reserve("b", prompt)
        assert b.num_cached_tokens == 48  # a's three full blocks, not yet written
        c.received("b", 0)
        assert c.pd_poll() == ({}, {})  # b's own block landed, a's have not
        c.received("a", 0)
        assert list(c.pd_poll().done) == ["a", "b"]
        c.check_integrity()
        c.free("a")
        c.free("b")
        c.reserve("c", np.arange(100, 160))
        d2 = c.reserve("d", np.arange(100, 170))
        assert d2.num_cached_tokens == 48
        c.transfer_failed("c", "prefill rank 0: boom")
        failed = c.pd_poll().failed
        assert failed["c"] == "prefill rank 0: boom" and "shares cached blocks" in failed["d"]
        assert c.usage.max == 0.0 and c.lookup(np.arange(100, 170)) == 0  # nothing unwritten stays cached
        c.check_integrity()


def test_a_silent_schedulers_reservation_is_cancelled_by_its_lease_and_released_at_the_deadline(daemon):
    d = daemon("--num-blocks", "32", "--block-size", "16", "--role", "decode", "--lease-timeout", "0.3",
               "--transfer-timeout", "1.5")
    with CacheClient(d.endpoint, name="receiver") as r, CacheClient(d.endpoint, name="sched") as s:
        r.attach(0, "tcp://127.0.0.1:1")
        s.reserve("a", np.arange(40))
        deadline = time.monotonic() + 10
        while r.stats()["expired_requests"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.stats()["expired_requests"] == 1
        assert r.usage.max > 0  # cancelled, but a writer may still be at it
        while r.usage.max > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.usage.max == 0.0 and r.stats()["in_transfer"] == 0
        r.check_integrity()


@needs_nixl
def test_chunked_prefill_sends_each_chunk_as_it_is_computed_and_notifies_after_the_last():
    """A 700-token prompt prefilled in three chunks, the decode node holding its first 256 tokens already."""
    from kvcache.pd import PDProxy

    with Cluster(layers=3, kv_heads=2, head_dim=32) as cluster:
        prefill, decode = clients(cluster)
        proxy = PDProxy(prefill, decode)
        tokens = np.random.default_rng(7).integers(0, 50_000, 700)
        assert run_batch(cluster, proxy, {"seed": tokens[:257]})["problems"] == []  # decode caches tokens [0, 256)
        prefill.reset_prefix_cache()
        reservation = decode.reserve("c", tokens)
        assert reservation.num_cached_tokens == 256
        admission = prefill.admit("c", tokens, num_tokens=200, dest=reservation.dest(decode.endpoint))
        table = lambda: np.asarray(prefill.table("c"))[0].copy()  # noqa: E731
        cluster.step([("c", tokens, table(), 0, 200, False)])  # entirely inside the decode node's cache
        prefill.extend("c", tokens[200:450])
        cluster.step([("c", tokens, table(), 200, 450, False)])
        assert decode.pd_poll() == ({}, {})  # not before the last chunk
        prefill.extend("c", tokens[450:])
        whole = table()  # the prefill node frees the request once it is sent
        cluster.step([("c", tokens, whole, 450, 700, True)])
        ready, failed = wait_outcomes(decode, {"c"}, 10)
        sent, _ = wait_outcomes(prefill, {"c"}, 10)
        assert set(ready) == set(sent) == {"c"}, failed
        assert admission.num_cached_tokens == 0
        assert check_request(cluster, tokens, np.asarray(reservation.table)[0], whole, 16) == []
        decode.free("c")
        assert_nothing_held(prefill, decode)


@needs_nixl
def test_a_messager_whole_steps_behind_its_writer_still_sends_every_step():
    """The writer computes three steps before the messager hears of the first: each layer is then already
    done in a later step (STALE to the signal), which means done in the step asked for too."""
    from kvcache.pd import PDProxy

    with Cluster(layers=3, kv_heads=2, head_dim=32) as cluster:
        prefill, decode = clients(cluster)
        proxy = PDProxy(prefill, decode)
        rng = np.random.default_rng(11)
        steps = [{f"s{k}-{i}": rng.integers(0, 50_000, n) for i, n in enumerate((90 + 40 * k, 300))} for k in range(3)]
        placed = {req: proxy.submit(req, tokens) for prompts in steps for req, tokens in prompts.items()}
        batches = [([(req, tokens, table_of(placed[req][1]), 0) for req, tokens in prompts.items()],
                    {req: placed[req][1].plan for req in prompts}) for prompts in steps]
        cluster.steps(batches, compute=True, messager_behind=True)
        every = {req for prompts in steps for req in prompts}
        ready, failed = wait_outcomes(decode, every, 20)
        sent, failed_p = wait_outcomes(prefill, every, 20)
        assert set(ready) == set(sent) == every, (failed, failed_p)
        for prompts in steps:
            for req, tokens in prompts.items():
                reservation, admission = placed[req]
                first = reservation.num_cached_tokens // cluster.spec.block_size
                assert check_request(cluster, tokens, np.asarray(reservation.table)[0], table_of(admission), first) == []
                decode.free(req)
        assert_nothing_held(prefill, decode)


@needs_nixl
def test_the_messager_and_the_receiver_shorten_the_gil_switch_interval_unless_told_not_to(tmp_path):
    """A model runner holding the GIL would make their threads wait the default 5 ms per hand-off."""
    import sys

    from kvcache.pd.cluster import Cache, spec_of
    from kvcache.transfer import KVRegion, LayerSignal
    from kvcache.pd.messager import SWITCH_INTERVAL_S, CacheMessager, CacheReceiver
    from kvcache.transfer.nixl import NixlEngine

    spec = spec_of(dict(layers=2, kv_heads=2, head_dim=16, block_size=16), 1)
    region = KVRegion.from_tensors(spec, Cache(spec, 8, "cpu").layers)
    before = sys.getswitchinterval()

    def build(kind: str, sig: LayerSignal, **kw) -> None:
        """Make one and close it, each with an engine of its own (a receiver serves its engine's metadata)."""
        with NixlEngine(f"switch-test-{kind}") as engine:
            made = (CacheMessager(engine, region, sig, 0, fetch_plans=list, on_sent=print, on_failed=print, **kw)
                    if kind == "messager" else CacheReceiver(engine, region, 0, on_received=print, **kw))
            made.close()

    try:
        with LayerSignal.create(f"kvcache-switch-test-{tmp_path.name}", spec.num_layers, replace=True) as sig:
            for kind in ("messager", "receiver"):
                sys.setswitchinterval(0.005)
                build(kind, sig)
                assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S), kind
                sys.setswitchinterval(0.005)
                build(kind, sig, switch_interval=None)
                assert sys.getswitchinterval() == pytest.approx(0.005), kind
                sys.setswitchinterval(SWITCH_INTERVAL_S / 2)  # already shorter: left alone
                build(kind, sig)
                assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S / 2), kind
                with pytest.raises(KVCacheError, match="switch_interval"):
                    build(kind, sig, switch_interval=0.0)
    finally:
        sys.setswitchinterval(before)


def test_a_failed_send_leaves_no_uncomputed_prefill_block_in_the_prefix_cache(daemon):
    """The decode node had 2 blocks cached (not sent), the prefill node none (it computes them): a failure drops all."""
    p = daemon("--num-blocks", "32", "--block-size", "16", "--role", "prefill")
    with CacheClient(p.endpoint) as c:
        dest = {"receivers": ["tcp://127.0.0.1:1"], "table": np.arange(3, dtype=np.int32)[None, :], "cached": 32,
                "decode": "ipc:///nowhere"}
        c.admit("a", np.arange(40), dest=dest)
        assert c.plans(["a"])[0]["first_block"] == 2
        c.transfer_failed("a", "decode rank 0 died")
        assert c.pd_poll().failed == {"a": "decode rank 0 died"}
        assert c.lookup(np.arange(40)) == 0 and c.usage.max == 0.0
        c.admit("b", np.arange(40), dest=dest)
        c.attach(0)  # as rank 0's messager
        c.sent("b", 0)
        assert list(c.pd_poll().done) == ["b"]
        assert c.lookup(np.arange(40)) == 32  # sent: computed, so cached
        c.check_integrity()


# -- the messager's per-layer split of one vectorised range computation ------------------------------------------


def _buffer_region(spec, num_blocks, addrs=None, block_strides=None):
    from kvcache.transfer.regions import KVRegion

    buf = np.zeros(spec.cache_bytes(num_blocks), np.uint8)
    if addrs is None:
        return KVRegion.from_buffer(spec, num_blocks, buf.ctypes.data, keep=(buf,))
    return KVRegion.from_addresses(spec, num_blocks, buf.ctypes.data + addrs, block_strides=block_strides,
                                   keep=(buf,))


def _triples(r):
    return sorted(zip(r.src.tolist(), r.dst.tolist(), r.length.tolist()))


@pytest.mark.parametrize("prefill_tp", [1, 2])
@pytest.mark.parametrize("layout", ["layer-major", "block-major"])
def test_a_messagers_layer_ranges_give_each_layer_exactly_the_ranges_built_for_it_alone(prefill_tp, layout):
    """Every layer's ranges built at once equal each layer's own, for every route to the rank (TP 2 -> 1 too),

    also where layers interleave in memory (block-major), and none reaches into another layer."""
    from kvcache.allocator import CacheSpec
    from kvcache.transfer.heads import head_routes, route_ranges
    from kvcache.pd.messager import CacheMessager, TransferPlan

    layers, rng = 5, np.random.default_rng(3)
    spec = CacheSpec(num_layers=layers, num_kv_heads=4, head_dim=32, block_size=16, tp_size=prefill_tp)
    dspec = CacheSpec(num_layers=layers, num_kv_heads=4, head_dim=32, block_size=16, tp_size=1)
    tensors = len(spec.tensors())

    def region(s: CacheSpec, blocks: int):
        if layout == "layer-major":
            return _buffer_region(s, blocks)
        bb = s.bytes_per_block_per_layer // tensors  # block b of layer l, tensor t at ((b * layers + l) * tensors + t) * bb
        inner = np.arange(layers * tensors, dtype=np.int64).reshape(layers, tensors) * bb
        return _buffer_region(s, blocks, inner, block_strides=layers * tensors * bb)

    src, dst = region(spec, 40), region(dspec, 50)
    sb, db = rng.permutation(40)[:20], rng.permutation(50)[:20]
    sb[:6], db[:6] = np.arange(6), np.arange(10, 16)  # a run of neighbours on both sides: merged within a layer
    db[7] = -1  # a block the decode side had: moves nothing
    plan = TransferPlan("r", sb[None], db[None], 0, ("tcp://x:1",), time.monotonic() + 60)
    messager = CacheMessager.__new__(CacheMessager)  # only its range building: no engine, no threads
    messager.region, messager.rank, messager._routes, messager._layouts = src, 0, {}, {}
    messager._cells_of = {}
    every, starts = messager._layer_ranges(plan, 0, dst, 0, None)
    assert starts[0] == 0 and starts[-1] == every.num_ranges and np.all(np.diff(starts) > 0)
    routes = [r for r in head_routes(4, prefill_tp, 1) if r.src == 0]
    for layer in range(layers):
        part = every.select(slice(starts[layer], starts[layer + 1]))
        alone = [route_ranges(src, sb, dst, db, r, layers=[layer]) for r in routes]
        assert _triples(part) == sorted(t for r in alone for t in _triples(r)), layer
        if prefill_tp == 1 and layout == "layer-major":  # whole blocks, tensors apart: the run of 6 is one range
            assert part.num_ranges == (19 - 5) * tensors


@pytest.mark.parametrize("prefill_tp", [1, 2])
@pytest.mark.parametrize("head_wise", [False, True])
def test_a_messagers_layer_ranges_read_each_layers_own_row_of_layer_group_tables(prefill_tp, head_wise):
    """Tables whose rows are layer groups (sliding layers, full layers; per kv head within each with head_wise):
    each layer's ranges move, head by head, that layer's own row on both sides, in layers whose pools differ
    (TP 2 -> 1 too); a table of some other row count fails by name."""
    from kvcache.allocator import CacheSpec, Full, KVCacheError, Window
    from kvcache.allocator.rows import derive_rows
    from kvcache.transfer.heads import head_routes, route_ranges
    from kvcache.transfer.regions import KVRegion
    from kvcache.pd.messager import CacheMessager, TransferPlan

    policies = [Window(32), Window(32), Full(), Window(32), Full()]
    rows = derive_rows(policies, 4, head_wise=head_wise)
    spec = CacheSpec(num_layers=5, num_kv_heads=4, head_dim=32, block_size=16, tp_size=prefill_tp, rows=rows)
    dspec = CacheSpec(num_layers=5, num_kv_heads=4, head_dim=32, block_size=16, tp_size=1, rows=rows)
    pools = {"src": (30, 40), "dst": (35, 50)}  # (window rows, full rows)
    regions = []
    for side, s in (("src", spec), ("dst", dspec)):
        counts = [pools[side][isinstance(p, Full)] for p in policies]
        buf = np.zeros(sum(s.bytes_per_block_per_layer * n for n in counts), np.uint8)
        regions.append(KVRegion.from_buffer(s, counts, buf.ctypes.data, keep=(buf,)))
    src, dst = regions
    rng = np.random.default_rng(5)

    def table(side: str) -> np.ndarray:
        return np.stack([rng.permutation(pools[side][isinstance(r.policy, Full)])[:12] for r in rows])

    sb, db = table("src"), table("dst")
    sb[0, :3] = -1  # a window row's recycled blocks move nothing
    plan = TransferPlan("r", sb, db, 0, ("tcp://x:1",), time.monotonic() + 60)
    messager = CacheMessager.__new__(CacheMessager)  # only its range building
    messager.region, messager.rank, messager._routes, messager._layouts, messager._cells_of = src, 0, {}, {}, {}
    every, starts = messager._layer_ranges(plan, 0, dst, 0, None)
    row_of = {(layer, head): i for i, r in enumerate(rows) for layer in r.layers for head in r.kv_heads}
    for layer in range(5):
        part = every.select(slice(starts[layer], starts[layer + 1]))
        want = []
        for r in (r for r in head_routes(4, prefill_tp, 1) if r.src == 0):
            for k in range(r.count):  # one head at a time, from that head's row (rank 0's heads start at 0)
                one = r._replace(src_row=r.src_row + k, dst_row=r.dst_row + k, count=1)
                i = row_of[(layer, r.src_row + k)]
                want += _triples(route_ranges(src, sb[i], dst, db[i], one, layers=[layer]))
        assert _bytes(_triples(part)) == _bytes(want), layer
    with pytest.raises(KVCacheError, match="tables of 3 rows"):
        three = np.vstack([sb, sb])[:3]
        messager._check_rows(TransferPlan("r", three, three, 0, ("tcp://x:1",), time.monotonic() + 60))


def _bytes(triples):
    """Every (src, dst) 64-byte unit a list of ranges moves, however the ranges are merged."""
    return sorted((s + i, d + i) for s, d, n in triples for i in range(0, n, 64))

"""Daemon metrics: exact counters from a real manager, the HTTP endpoint, and subscriber counting."""
from __future__ import annotations

import pickle
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import zmq
from conftest import free_port
from prometheus_client.parser import text_string_to_metric_families

from kvcache.allocator import Full, KVCacheManager, Window
from kvcache.client import CacheClient
from kvcache.metrics import DaemonMetrics, SubscriberCounter
from kvcache.pd.state import PDState

BS = 4
TIMEOUT_S = 5.0


def make_manager(num_blocks: int = 8, rows=(Full(),)) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, rows, hash_seed=b"metrics-test")


def scrape(text: bytes | str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition as {(name, sorted labels): value}."""
    if isinstance(text, bytes):
        text = text.decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_counters_follow_the_managers_prefix_hits_and_evictions_exactly():
    """Two admits of a shared 8-token prefix, then an eviction: counters equal the manager's totals, counted once."""
    m = make_manager(num_blocks=8)
    metrics = DaemonMetrics(m.num_rows)
    m.admit("a", list(range(10)))                       # 3 blocks, 2 full and cached
    metrics.update(m)
    m.admit("b", list(range(8)) + [50, 51, 52])         # hits 8 tokens, 1 new block
    metrics.update(m)
    metrics.update(m)                                   # a second update adds nothing
    s = scrape(metrics.render())
    assert value(s, "kvcache_prefix_queries_total") == 2
    assert value(s, "kvcache_prefix_hit_requests_total") == 1
    assert value(s, "kvcache_prefix_queried_tokens_total") == 21
    assert value(s, "kvcache_prefix_hit_tokens_total") == 8
    assert value(s, "kvcache_live_requests") == 2
    assert value(s, "kvcache_cached_hashes") == 2
    assert value(s, "kvcache_free_blocks", row="0") == 4
    assert value(s, "kvcache_block_usage_ratio", row="0") == 0.5
    assert value(s, "kvcache_evicted_blocks_total") == 0

    m.free("a")
    m.free("b")
    assert m.admit("c", list(range(100, 132))) is not None  # 8 blocks: every cached block is evicted
    metrics.update(m)
    s = scrape(metrics.render())
    assert value(s, "kvcache_evicted_blocks_total") == m.stats().evicted_blocks == 2
    assert value(s, "kvcache_prefix_queries_total") == 3
    assert value(s, "kvcache_free_blocks", row="0") == 0
    assert value(s, "kvcache_block_usage_ratio", row="0") == 1.0
    assert value(s, "kvcache_cached_hashes") == m.stats().num_cached_hashes


def test_sliding_window_recycling_is_counted_per_row():
    """A window row that gives back blocks adds its (row, block) pairs to the recycled counter; gauges are per row."""
    m = make_manager(num_blocks=16, rows=(Full(), Window(4), Window(4)))
    metrics = DaemonMetrics(m.num_rows)
    m.admit("a", list(range(8)))
    m.extend("a", list(range(8, 16)))
    metrics.update(m)
    s = scrape(metrics.render())
    recycled = m.stats().recycled_blocks
    assert recycled > 0 and value(s, "kvcache_swa_recycled_blocks_total") == recycled
    free = m.num_free_blocks.tolist()
    assert [value(s, "kvcache_free_blocks", row=str(r)) for r in range(3)] == free
    assert free[0] < free[1] == free[2]


def test_a_new_manager_is_a_counter_reset_not_a_negative_increment():
    """Totals that go backwards (a restarted manager) restart the counter's growth instead of failing."""
    m = make_manager()
    metrics = DaemonMetrics(1)
    m.admit("a", list(range(9)))
    m.admit("b", list(range(9)))
    metrics.update(m)
    fresh = make_manager()
    fresh.admit("x", list(range(5)))
    metrics.update(fresh)
    assert value(scrape(metrics.render()), "kvcache_prefix_queries_total") == 3


def test_rate_limited_update_keeps_counters_exact_and_refreshes_gauges_every_100ms():
    m = make_manager()
    metrics = DaemonMetrics(1)
    metrics.update(m, now=10.0)
    m.admit("a", list(range(9)))
    metrics.update(m, now=10.05)
    s = scrape(metrics.render())
    assert value(s, "kvcache_prefix_queries_total") == 1, "counters never wait"
    assert value(s, "kvcache_live_requests") == 0, "gauges wait for 100 ms"
    metrics.update(m, now=10.1)
    assert value(scrape(metrics.render()), "kvcache_live_requests") == 1


def test_steps_errors_and_deltas():
    """Operations by type, the latency histogram, errors by kind and delta traffic are counted as observed."""
    metrics = DaemonMetrics(2)
    metrics.observe_step({"admit": 3, "extend": 5, "free": 0}, 20e-6)
    metrics.observe_step({"extend": 2}, 0.2)
    metrics.observe_error("decode")
    metrics.observe_error("validate")
    metrics.observe_error("validate")
    metrics.observe_delta(4, 1000)
    metrics.observe_delta(1, 24)
    metrics.set_subscribers(3)
    s = scrape(metrics.render())
    assert value(s, "kvcache_operations_total", op="admit") == 3
    assert value(s, "kvcache_operations_total", op="extend") == 7
    assert ("kvcache_operations_total", (("op", "free"),)) not in s
    assert value(s, "kvcache_step_seconds_count") == 2
    assert value(s, "kvcache_step_seconds_bucket", le="1e-05") == 0
    assert value(s, "kvcache_step_seconds_bucket", le="2.5e-05") == 1
    assert value(s, "kvcache_step_seconds_bucket", le="0.1") == 1
    assert value(s, "kvcache_step_seconds_bucket", le="+Inf") == 2
    assert value(s, "kvcache_errors_total", kind="decode") == 1
    assert value(s, "kvcache_errors_total", kind="validate") == 2
    assert value(s, "kvcache_errors_total", kind="internal") == 0
    assert value(s, "kvcache_deltas_published_total") == 2
    assert value(s, "kvcache_delta_changes_total") == 5
    assert value(s, "kvcache_delta_bytes_total") == 1024
    assert value(s, "kvcache_subscribers") == 3


def test_each_instance_has_its_own_registry():
    a, b = DaemonMetrics(1), DaemonMetrics(1)
    a.observe_error("decode")
    assert value(scrape(b.render()), "kvcache_errors_total", kind="decode") == 0


def test_http_endpoint_serves_the_metrics():
    """A real HTTP GET of /metrics on the chosen port returns the registry's text."""
    m = make_manager()
    m.admit("a", list(range(9)))
    metrics = DaemonMetrics(1)
    metrics.update(m)
    port = metrics.serve_http(0)  # the kernel picks the port as it binds: no other process can take it first
    assert port > 0
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT_S) as reply:
            assert reply.status == 200
            body = reply.read()
        s = scrape(body)
        assert value(s, "kvcache_live_requests") == 1
        assert value(s, "kvcache_prefix_queries_total") == 1
    finally:
        metrics.close()


# -- SubscriberCounter ---------------------------------------------------------------------------

@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def wait_for_count(counter: SubscriberCounter, expected: int) -> None:
    """Handle monitor events as the daemon's poller would, until the count is ``expected``."""
    poller = zmq.Poller()
    poller.register(counter.monitor_socket, zmq.POLLIN)
    deadline = time.monotonic() + TIMEOUT_S
    while counter.count != expected:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"subscriber count stuck at {counter.count}, expected {expected}"
        if poller.poll(int(remaining * 1000) + 1):
            counter.handle()


def test_subscriber_counter_monitors_a_socket_whose_default_monitor_address_is_taken(ctx, tmp_path):
    """pyzmq names a monitor after the socket's file descriptor; a socket closed a moment ago may still hold that
    inproc address in the context. The counter's monitor has an address of its own, so the daemon still starts."""
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"ipc://{tmp_path}/pub.sock")
    stale = ctx.socket(zmq.PAIR)
    stale.bind(f"inproc://monitor.s-{pub.FD}")  # what a dead socket's monitor on the same descriptor left bound
    counter = SubscriberCounter(pub)
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"ipc://{tmp_path}/pub.sock")
        wait_for_count(counter, 1)
    finally:
        sub.close(linger=0)
        counter.close()
        stale.close(linger=0)
        pub.close(linger=0)


def test_subscriber_counter_counts_connections_and_disconnections(ctx, tmp_path):
    """Two SUB sockets connect: 2; one closes: 1. handle() never blocks."""
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"ipc://{tmp_path}/pub.sock")
    counter = SubscriberCounter(pub)
    subs = []
    try:
        counter.handle()
        assert counter.count == 0
        for _ in range(2):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"ipc://{tmp_path}/pub.sock")
            subs.append(sub)
        wait_for_count(counter, 2)
        subs.pop().close(linger=0)
        wait_for_count(counter, 1)
        counter.handle()
        assert counter.count == 1
    finally:
        for sub in subs:
            sub.close(linger=0)
        counter.close()
        pub.close(linger=0)


def test_subscriber_counter_counts_tcp_peers(ctx):
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    counter = SubscriberCounter(pub)
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(f"tcp://127.0.0.1:{port}")
        wait_for_count(counter, 1)
        sub.close(linger=0)
        wait_for_count(counter, 0)
    finally:
        sub.close(linger=0)
        counter.close()
        pub.close(linger=0)


# -- PD transfers --------------------------------------------------------------------------------

def test_pd_transfers_are_counted_by_outcome_with_the_done_ones_durations():
    """Three reservations on a decode PDState end done, failed and cancelled: counted once each, one duration."""
    pd = PDState("decode", tp=1, rows=1, num_blocks=8, block_size=BS, timeout=5.0)
    table = np.array([[0, 1]], dtype=np.int32)
    for i, req in enumerate("abc"):
        pd.start(req, "sched", table + 2 * i, 0, 5.0, now=100.0)
    metrics = DaemonMetrics(1, pd=True)
    metrics.update_pd(pd)
    s = scrape(metrics.render())
    assert value(s, "kvcache_pd_transfers_total", outcome="started") == 3
    assert value(s, "kvcache_pd_in_transfer") == 3
    pd.report("a", 0, now_ns=int(100.25e9))
    pd.fail("b", "boom")
    pd.cancel("c", release=True)
    metrics.update_pd(pd)
    metrics.update_pd(pd)  # a second update adds nothing
    s = scrape(metrics.render())
    for outcome, n in (("started", 3), ("done", 1), ("failed", 1), ("cancelled", 1)):
        assert value(s, "kvcache_pd_transfers_total", outcome=outcome) == n, outcome
    assert value(s, "kvcache_pd_in_transfer") == 0
    assert value(s, "kvcache_pd_transfer_seconds_count") == 1
    assert value(s, "kvcache_pd_transfer_seconds_sum") == pytest.approx(0.25)
    assert value(s, "kvcache_pd_transfer_seconds_bucket", le="0.25") == 1
    assert value(s, "kvcache_pd_transfer_seconds_bucket", le="0.1") == 0

    again = pickle.loads(pickle.dumps(pd))  # a journal snapshot: totals kept, no durations or start times
    assert again.totals == {"started": 3, "done": 1, "failed": 1, "cancelled": 1}
    assert not again.durations and not again._begun


def test_a_daemon_without_a_pd_role_has_no_pd_metrics():
    assert "kvcache_pd" not in DaemonMetrics(1).render().decode()


def test_a_decode_daemon_serves_its_transfers_on_metrics_and_in_stats(daemon):
    """A real `kvcache serve --role decode`: transfers that end ready, failed and cancelled, scraped over HTTP."""
    port = free_port()
    d = daemon("--num-blocks", "32", "--block-size", "16", "--role", "decode", "--metrics-port", str(port))
    with CacheClient(d.endpoint, name="sched") as c:
        c.attach(0, "tcp://127.0.0.1:1")
        for req in ("a", "b", "c"):
            c.reserve(req, np.arange(40) + 100 * ord(req))
        c.received("a", 0)
        c.transfer_failed("b", "peer died")
        c.cancel("c", release=True)
        stats = c.stats()
    assert stats["transfers"] == {"started": 3, "done": 1, "failed": 1, "cancelled": 1}
    assert stats["in_transfer"] == 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT_S) as reply:
        s = scrape(reply.read())
    for outcome, n in (("started", 3), ("done", 1), ("failed", 1), ("cancelled", 1)):
        assert value(s, "kvcache_pd_transfers_total", outcome=outcome) == n, outcome
    assert value(s, "kvcache_pd_transfer_seconds_count") == 1
    assert 0 < value(s, "kvcache_pd_transfer_seconds_sum") < 30
    assert value(s, "kvcache_pd_in_transfer") == 0
    out = subprocess.run([sys.executable, "-m", "kvcache", "stats", "--endpoint", d.endpoint], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert "PD decode: in transfer 0   started 3   done 1   failed 1   cancelled 1" in out
    assert "32 blocks x 1 row(s), block_size 16" in out
    assert "on the PUB, 0 on the local endpoint" in out


# -- from the start ------------------------------------------------------------------------------

def scrape_daemon(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT_S) as reply:
        return scrape(reply.read())


def test_a_daemons_metrics_show_its_state_before_any_message(daemon):
    """Scraped before anything talks to the daemon, the gauges hold its state, not zeros: every block of every
    row free, the host tier's blocks free, nothing in flight."""
    port = free_port()
    daemon("--num-blocks", "24", "--block-size", str(BS), "--rows", "window:8:4,full", "--host-block-budget", "16",
           "--metrics-port", str(port))
    s = scrape_daemon(port)
    for row in ("0", "1"):
        assert value(s, "kvcache_free_blocks", row=row) == 24, row
        assert value(s, "kvcache_block_usage_ratio", row=row) == 0, row
    assert value(s, "kvcache_live_requests") == 0 and value(s, "kvcache_cached_hashes") == 0
    assert value(s, "kvcache_subscribers") == 0
    assert value(s, "kvcache_host_tier_state_blocks", state="free") == 16
    assert value(s, "kvcache_host_tier_state_blocks", state="cached") == 0
    assert value(s, "kvcache_host_tier_state_blocks", state="retired") == 0
    assert value(s, "kvcache_host_tier_copies_in_flight", kind="offload") == 0
    assert value(s, "kvcache_host_tier_copies_in_flight", kind="load") == 0
    assert value(s, "kvcache_host_tier_held_gpu_blocks") == 0


def test_a_restarted_daemons_metrics_show_its_recovered_state_before_any_message(daemon, tmp_path):
    """A daemon restarted from its journal serves, from the start, the usage and transfers it recovered."""
    port = free_port()
    flags = ("--num-blocks", "32", "--block-size", "16", "--role", "decode", "--journal", str(tmp_path / "j"))
    first = daemon(*flags)
    with CacheClient(first.endpoint, name="sched") as c:
        c.attach(0, "tcp://127.0.0.1:1")
        c.admit("held", np.arange(40))  # 3 blocks
        c.reserve("moving", np.arange(40) + 1000)  # 3 blocks, in transfer
    first.stop()
    daemon(*flags, "--metrics-port", str(port), folder=first.folder)
    s = scrape_daemon(port)
    assert value(s, "kvcache_free_blocks", row="0") == 26
    assert value(s, "kvcache_live_requests") == 2
    assert value(s, "kvcache_pd_in_transfer") == 1
    assert value(s, "kvcache_pd_transfers_total", outcome="started") == 1

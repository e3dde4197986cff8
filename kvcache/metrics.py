"""Prometheus metrics for the daemon: block usage, prefix hits, evictions, operations, latency, errors, fan-out.

Every metric is named ``kvcache_*`` and lives in the instance's own registry, so
several daemons (or tests) in one process do not collide. The daemon's thread
writes; the HTTP thread of ``serve_http`` only reads (prometheus_client locks
each value), so the one-owner rule for daemon state still holds.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import zmq
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from zmq.utils.monitor import recv_monitor_message

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.pool import usage
from kvcache.auth import open_monitor

if TYPE_CHECKING:
    from kvcache.allocator.manager import KVCacheManager, ManagerStats
    from kvcache.pd.state import PDState

# Step latency from 10 µs (a ping) to 100 ms (a step of thousands of ops).
STEP_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 1e-1)
ERROR_KINDS = ("decode", "validate", "journal", "internal")  # journal: refused while its disk is full
# A PD transfer from its reserve/admit to done: a layer-wise pipeline's prefill time plus its tail.
PD_BUCKETS = (1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
GAUGE_INTERVAL_S = 0.1

# ManagerStats totals mirrored as counters: (stats field, metric name, help).
_TOTALS = (
    ("prefix_queries", "kvcache_prefix_queries", "Admissions that looked up the prefix cache"),
    ("prefix_hit_requests", "kvcache_prefix_hit_requests", "Admissions that reused at least one cached block"),
    ("prefix_queried_tokens", "kvcache_prefix_queried_tokens", "Prompt tokens looked up in the prefix cache"),
    ("prefix_hit_tokens", "kvcache_prefix_hit_tokens", "Prompt tokens found in the prefix cache"),
    ("evicted_blocks", "kvcache_evicted_blocks", "Cached (row, block) pairs evicted for reuse"),
    ("recycled_blocks", "kvcache_swa_recycled_blocks", "(row, block) pairs sliding-window rows gave back"),
)


class DaemonMetrics:
    """The daemon's Prometheus metrics, fed once per scheduler message from the manager's own counters.

    Manager totals become counters by adding the difference since the last
    ``update``, so nothing is counted twice however often ``update`` runs; a
    total that goes backwards (a new manager) is taken as a counter reset.
    """

    def __init__(self, num_rows: int, registry: CollectorRegistry | None = None, *, pd: bool = False,
                 tier: bool = False) -> None:
        """``pd``: also the PD transfer metrics (a daemon with ``--role prefill`` or ``decode``)."""
        self.registry = CollectorRegistry() if registry is None else registry
        reg = self.registry
        self.num_rows = num_rows
        rows = [str(r) for r in range(num_rows)]
        usage_gauge = Gauge("kvcache_block_usage_ratio", "Fraction of the row's blocks in use", ["row"], registry=reg)
        free_gauge = Gauge("kvcache_free_blocks", "Allocatable blocks of the row (free or cached but unused)",
                           ["row"], registry=reg)
        self._usage = [usage_gauge.labels(r) for r in rows]
        self._free = [free_gauge.labels(r) for r in rows]
        self._requests = Gauge("kvcache_live_requests", "Requests holding blocks", registry=reg)
        self._cached = Gauge("kvcache_cached_hashes", "Block hashes in the prefix index", registry=reg)
        self._totals = [(field, Counter(name, doc, registry=reg)) for field, name, doc in _TOTALS]
        self._last = dict.fromkeys((field for field, _, _ in _TOTALS), 0)
        self._ops_counter = Counter("kvcache_operations", "Operations applied, by type", ["op"], registry=reg)
        self._ops: dict[str, Counter] = {}
        self._step_seconds = Histogram("kvcache_step_seconds", "Time to answer one scheduler message",
                                       buckets=STEP_BUCKETS, registry=reg)
        errors = Counter("kvcache_errors", "Messages refused or failed, by kind", ["kind"], registry=reg)
        self._errors_counter = errors
        self._errors = {kind: errors.labels(kind) for kind in ERROR_KINDS}
        self._subscribers = Gauge("kvcache_subscribers",
                                  "Workers taking table deltas: peers of the PUB socket and local-endpoint subscribers",
                                  registry=reg)
        self._deltas = Counter("kvcache_deltas_published", "Table-delta messages published", registry=reg)
        self._delta_changes = Counter("kvcache_delta_changes", "Table changes carried by published deltas",
                                      registry=reg)
        self._delta_bytes = Counter("kvcache_delta_bytes", "Payload bytes of published deltas", registry=reg)
        self._next_gauges = 0.0
        self._http: object | None = None
        self._pd: tuple[Counter, Histogram, Gauge] | None = None
        self._pd_last: dict[str, int] = {}
        if pd:
            self._pd = (
                Counter("kvcache_pd_transfers", "PD transfers begun (started) and ended (done: decode ready or every "
                        "prefill rank sent; failed; cancelled)", ["outcome"], registry=reg),
                Histogram("kvcache_pd_transfer_seconds", "PD transfer time from reserve (decode) or admit (prefill) "
                          "to done", buckets=PD_BUCKETS, registry=reg),
                Gauge("kvcache_pd_in_transfer", "Requests in PD transfer now", registry=reg),
            )

        self._tier: tuple[Counter, Gauge, Gauge, Gauge] | None = None
        self._tier_last: dict[str, int] = {}
        if tier:
            self._tier = (
                Counter("kvcache_host_tier_blocks", "Host-tier blocks since start, by event: offloaded (findable), "
                        "loaded (copied back), dropped (a copy failed, timed out or was reset), evicted (LRU), "
                        "hit_tokens (tokens admitted as cached from host), failed_loads (loads, not blocks)",
                        ["event"], registry=reg),
                Gauge("kvcache_host_tier_state_blocks", "Host-tier blocks now: free, findable (cached), retired",
                      ["state"], registry=reg),
                Gauge("kvcache_host_tier_copies_in_flight", "Host-tier copies ordered and not yet reported by "
                      "every rank", ["kind"], registry=reg),
                Gauge("kvcache_host_tier_held_gpu_blocks", "GPU blocks the host tier keeps out of the pool: a decode "
                      "daemon's loads a rank may still run (for good once timed out)", registry=reg),
            )

    def observe_step(self, ops: Mapping[str, int], seconds: float) -> None:
        """Count one scheduler message's operations by type and record its latency.

        Op names should come from a fixed set (the protocol's validated op
        names): each new name is a new time series.
        """
        self.observe_steps(ops, (seconds,))

    def observe_steps(self, ops: Mapping[str, int], seconds: Iterable[float]) -> None:
        """``observe_step`` of several messages at once: their operations by type, and each one's latency."""
        for op, n in ops.items():
            if n:
                child = self._ops.get(op)
                if child is None:
                    child = self._ops[op] = self._ops_counter.labels(op)
                child.inc(n)
        for value in seconds:
            self._step_seconds.observe(value)

    def observe_error(self, kind: str) -> None:
        """Count a refused or failed message by kind (decode, validate, journal, internal)."""
        child = self._errors.get(kind)
        if child is None:
            child = self._errors[kind] = self._errors_counter.labels(kind)
        child.inc()

    def update(self, manager: KVCacheManager, now: float | None = None) -> None:
        """Refresh from the manager: counters always, exactly; gauges too, or with ``now`` at most every 100 ms.

        Pass ``now`` (``time.monotonic()``) where the step rate makes the
        per-row gauges' cost matter; counters stay exact either way.
        """
        stats = manager.stats()
        self._count_totals(stats)
        if now is not None:
            if now < self._next_gauges:
                return
            self._next_gauges = now + GAUGE_INTERVAL_S
        self._requests.set(stats.num_requests)
        self._cached.set(stats.num_cached_hashes)
        free = manager.num_free_blocks
        per_row = usage(free, manager.row_blocks).per_row
        for gauge, value in zip(self._free, free.tolist()):
            gauge.set(value)
        for gauge, value in zip(self._usage, per_row.tolist()):
            gauge.set(value)

    def update_pd(self, pd: PDState) -> None:
        """Refresh the PD metrics from the daemon's PD state: totals by difference, done transfers' durations drained."""
        if self._pd is None:
            return
        counter, seconds, in_transfer = self._pd
        for outcome, total in pd.totals.items():
            _follow(counter.labels(outcome), self._pd_last, outcome, total)
        while pd.durations:
            seconds.observe(pd.durations.popleft())
        in_transfer.set(len(pd.transfers))

    def update_tier(self, stats: Any) -> None:
        """Refresh the host-tier metrics from ``DaemonTier.stats()``: totals by difference, gauges as they are."""
        if self._tier is None:
            return
        totals, state, in_flight, held = self._tier
        for event, field in (("offloaded", "offloaded_blocks"), ("loaded", "loaded_blocks"),
                             ("dropped", "dropped_blocks"), ("evicted", "evicted_blocks"),
                             ("hit_tokens", "hit_tokens"), ("failed_loads", "failed_loads")):
            _follow(totals.labels(event), self._tier_last, event, getattr(stats, field))
        state.labels("free").set(stats.free_blocks)
        state.labels("cached").set(stats.cached_blocks)
        state.labels("retired").set(stats.retired_blocks)
        in_flight.labels("offload").set(stats.pending_offloads)
        in_flight.labels("load").set(stats.pending_loads)
        held.set(stats.held_gpu_blocks)

    def set_subscribers(self, count: int) -> None:
        """Workers now taking table deltas: PUB peers (from SubscriberCounter) and local-endpoint subscribers."""
        self._subscribers.set(count)

    def observe_delta(self, num_changes: int, payload_bytes: int) -> None:
        """Count one published table delta, its changes and its payload size."""
        self.observe_deltas(1, num_changes, payload_bytes)

    def observe_deltas(self, deltas: int, num_changes: int, payload_bytes: int) -> None:
        """Count ``deltas`` published table deltas, their changes and payload bytes in all."""
        self._deltas.inc(deltas)
        self._delta_changes.inc(num_changes)
        self._delta_bytes.inc(payload_bytes)

    def serve_http(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` from a background thread; returns the bound port (``port`` 0 picks a free one)."""
        try:
            server, _ = start_http_server(port, addr, registry=self.registry)
        except OSError as exc:  # in use, or a port this user may not bind
            raise KVCacheError(f"metrics_port: cannot serve on {addr}:{port}: {exc.strerror}") from None
        self._http = server
        return int(server.server_port)

    def close(self) -> None:
        """Stop the HTTP server, if one runs."""
        server, self._http = self._http, None
        if server is not None:
            server.shutdown()  # type: ignore[attr-defined]
            server.server_close()  # type: ignore[attr-defined]

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format."""
        return generate_latest(self.registry)

    def _count_totals(self, stats: ManagerStats) -> None:
        """Add to each counter what the manager's total grew by since the last update."""
        for field, counter in self._totals:
            _follow(counter, self._last, field, getattr(stats, field))


def _follow(counter: Counter, last: dict[str, int], key: str, total: int) -> None:
    """Add to ``counter`` what ``total`` grew by since ``last[key]``; a total that went back is a reset (a new source)."""
    grown = total - last.get(key, 0)
    if grown:
        counter.inc(grown if grown > 0 else total)
        last[key] = total


class SubscriberCounter:
    """Counts peers connected to a bound (or connecting) zmq socket from its monitor events, without blocking.

    Register ``monitor_socket`` in the poller (POLLIN) and call ``handle`` when
    it is readable. A connection counts from EVENT_ACCEPTED (or EVENT_CONNECTED
    for a socket that connects out) until EVENT_DISCONNECTED; a peer that
    fails the handshake is counted in and out again.

    libzmq gives a socket one monitor. Whoever else needs the socket's events
    (the CURVE handshake watcher of ``KeyAuthenticator.hand_over``) passes
    them as ``also`` and gets each event through ``on_event``.
    """

    def __init__(self, socket: zmq.Socket, also: int = 0,
                 on_event: Callable[[dict[str, Any]], object] | None = None) -> None:
        self.socket = socket
        self.monitor_socket = open_monitor(socket, zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                           | also)
        self._on_event = on_event
        self.count = 0

    def handle(self) -> None:
        """Apply every pending monitor event."""
        while True:
            try:
                message = recv_monitor_message(self.monitor_socket, zmq.NOBLOCK)
            except zmq.Again:
                return
            event = message["event"]
            if self._on_event is not None:
                self._on_event(message)
            if event in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                self.count += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self.count -= 1

    def close(self) -> None:
        """Stop monitoring and close the monitor socket (call before closing the watched socket)."""
        try:
            self.socket.disable_monitor()
        except zmq.ZMQError:
            pass  # the watched socket is already closed
        self.monitor_socket.close(linger=0)

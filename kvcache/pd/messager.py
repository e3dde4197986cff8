"""CacheMessager and CacheReceiver: layer-wise KV transfer from a prefill rank to the decode ranks, over NIXL.

One CacheMessager per prefill rank (in the worker's process, beside the model): for each step the
worker runs, it is told the step and the requests it prefills, wakes on each layer's signal
(``send_cache``) and writes that layer's blocks of every request past the decode side's cached
prefix straight into the decode ranks' blocks, re-slicing heads when the two TP sizes differ
(``kvcache.transfer.heads``); layers that finished while it was still posting earlier ones go out
together, as one write. Before the first signal it builds every layer's ranges (in C, merged within
each layer), so a write is queued within microseconds of its signal. The last layer's write to each
decode rank carries the NIXL notification, ordered after every earlier write of the request (``NixlEngine.submit(after=...)``):
it rides on that write when the earlier ones have landed by then (the pipelined case), else the
engine's worker sends it the moment the last of them lands. One CacheReceiver per decode rank
counts the notifications and reports a request once every prefill rank that writes to it has
finished::

    worker (prefill rank p)       CacheMessager p                      CacheReceiver d (decode rank d)
    step = signal.begin_step()
    messager.run_step(step, reqs,    plans: handed over with the step,
                      plans)         else plans(reqs) from the control plane
    for layer:                       wait(layer, step) -> DONE
        attention; write KV          write layer's blocks to each d --> (data lands in d's region)
        send_cache(None, sig, layer) last layer: notification      ----> notifications() -> all writers in:
                                     on_sent(req)                           on_received(reqs)

Control-plane callbacks (where plans come from, whom to tell) are plain callables, so this module
does no daemon I/O of its own; ``kvcache.pd.links`` wires them to the daemons. Every wait has a
deadline (the plan's): a dead writer, a dead peer or a late layer fails the request through
``on_failed``, never a hang.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import msgpack
import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.rows import layer_classes, rows_blocks, table_cells
from kvcache.pd.state import row_difference
from kvcache.transfer.engines import TransferHandle, TransferStatus
from kvcache.transfer.heads import Route, RouteLayout, head_routes, layout_ranges, rank_heads, route_layout
from kvcache.transfer.regions import CopyRanges, KVRegion
from kvcache.transfer.signal import STEP_MOD, LayerSignal, WaitStatus

if TYPE_CHECKING:
    from kvcache.transfer.nixl import NixlEngine, Peer

__all__ = ["SWITCH_INTERVAL_S", "CacheMessager", "CacheReceiver", "Chunk", "TransferPlan", "shorten_switch_interval",
           "writers_of"]

log = logging.getLogger("kvcache.pd.messager")
_STOP = object()

SWITCH_INTERVAL_S = 2e-4
"""The messager and the receiver share their process with the model runner, whose Python holds the
GIL while it launches a step's kernels; CPython hands the GIL to a waiting thread only after the
switch interval (5 ms by default), so a layer's write could wait that long after its signal. Both
lower the process's interval to this. H100, a runner spinning in Python (``kvcache bench pd
--compute spin``): tail 1.70 ms at 5 ms, 1.13-1.31 ms at 0.2 ms, 1.01 ms at 0.05 ms (0.65-0.88 ms
beside a sleeping runner); the runner's own Python keeps about 97% of its speed at 0.2 ms beside a thread
that wakes every 50 µs, 84% at 0.05 ms."""


def shorten_switch_interval(limit: float | None) -> None:
    """Lower CPython's GIL switch interval to ``limit`` seconds (None, or already shorter: leave it)."""
    if limit is not None and not limit > 0:
        raise KVCacheError(f"switch_interval: must be positive seconds (or None), got {limit}")
    if limit is not None and sys.getswitchinterval() > limit:
        sys.setswitchinterval(limit)


@dataclasses.dataclass(frozen=True, slots=True)
class TransferPlan:
    """One request's move: its prefill blocks, the decode blocks they land in, and which to skip.

    Tables are ``[rows, n]`` as the daemons hold them: one row (uniform), or one per kv head
    (head-wise; ``-1`` where a window head keeps no block, moved by neither side). Columns
    ``[first_block, n)`` of ``src_blocks`` go to the same columns of ``dst_blocks``; columns
    before ``first_block`` the decode side had cached. ``receivers[d]`` is decode rank d's
    CacheReceiver endpoint; ``decode`` names the decode daemon (for failure reports).
    """

    req: Any
    src_blocks: np.ndarray
    dst_blocks: np.ndarray
    first_block: int
    receivers: tuple[str, ...]
    deadline: float  # time.monotonic() by which every write must be done
    decode: str = ""
    cancelled: bool = False  # the prefill scheduler gave it up: write nothing, report it failed

    @classmethod
    def from_wire(cls, plan: dict[str, Any]) -> TransferPlan:
        """A plan as the prefill daemon's ``plans`` op returns it."""
        if plan.get("cancelled"):
            empty = np.empty((1, 0), dtype=np.int64)
            return cls(plan["req"], empty, empty, 0, (), time.monotonic(), plan.get("decode", ""), True)
        return cls(plan["req"], np.atleast_2d(plan["src_table"]).astype(np.int64),
                   np.atleast_2d(plan["table"]).astype(np.int64), int(plan["first_block"]),
                   tuple(plan["receivers"]), time.monotonic() + float(plan["deadline_s"]), plan.get("decode", ""))


class Chunk(NamedTuple):
    """Part of a request's prompt a step computes (chunked prefill): its KV is valid up to token ``stop``.

    Each step sends the blocks holding tokens not sent before, up to ``stop`` (a partly filled last
    block goes again with the next chunk); ``last`` marks the chunk that completes the prompt, after
    which the decode side is notified. A bare request id in ``run_step`` is one chunk of the whole prompt.
    """

    req: Any
    stop: int
    last: bool


@dataclasses.dataclass(slots=True)
class _Progress:
    """A request being sent over several steps: the next block to send and every write so far, per decode rank."""

    next_block: int
    handles: dict[int, list[TransferHandle]]
    agents: dict[int, str]
    deadline: float


class _Closing(NamedTuple):
    """A request's last write to one decode rank, waiting to go out with the step's others to the same rank."""

    plan: TransferPlan
    progress: _Progress
    d: int
    remote: KVRegion
    ranges: CopyRanges


def writers_of(num_kv_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int) -> frozenset[int]:
    """The prefill ranks that write to ``decode_rank``: the receiver waits for one notification from each."""
    return frozenset(r.src for r in head_routes(num_kv_heads, prefill_tp, decode_tp) if r.dst == decode_rank)


def _done_in(finished: int, step: int) -> bool:
    """A layer whose last completion was in step ``finished`` (-1: never) has completed ``step``: that step or a later one."""
    return finished >= 0 and (finished - step) % STEP_MOD < STEP_MOD // 2


def _notice(reqs: list[Any], rank: int, tp: int) -> bytes:
    """What a receiver hears when prefill rank ``rank`` (of ``tp``) finished writing ``reqs`` to it."""
    return msgpack.packb({"reqs": reqs, "src": rank, "tp": tp}, use_bin_type=True)


def _stopped(reqs: list[Any], rank: int, tp: int, cut: bool) -> bytes:
    """What a receiver hears when prefill rank ``rank`` gave ``reqs`` up; ``cut``: a write of them may still land."""
    return msgpack.packb({"stopped": reqs, "src": rank, "tp": tp, "cut": cut}, use_bin_type=True)


class CacheMessager:
    """Sends one prefill rank's KV to the decode ranks, layer by layer, as the layer signals arrive.

    ``fetch_plans(reqs)`` returns a TransferPlan (or None: skip it) per request; ``on_sent(req)``
    runs once every write of the request landed and the decode ranks were notified;
    ``on_failed(req, error, plan)`` when any part failed or ran out of time. Both callbacks run on
    the messager's threads. ``close`` stops it and fails what is still running. It lowers the
    process's GIL switch interval to ``switch_interval`` (see SWITCH_INTERVAL_S; None: leave it).
    """

    def __init__(self, engine: NixlEngine, region: KVRegion, signal: LayerSignal, rank: int, *,
                 fetch_plans: Callable[[list[Any]], Sequence[TransferPlan | None]],
                 on_sent: Callable[[Any], None], on_failed: Callable[[Any, str, TransferPlan | None], None],
                 connect_timeout: float = 5.0, switch_interval: float | None = SWITCH_INTERVAL_S) -> None:
        spec = region.spec
        if not 0 <= rank < spec.tp_size:
            raise KVCacheError(f"rank: {rank} is outside the region's tp_size {spec.tp_size}")
        if signal.num_layers < spec.num_layers:
            raise KVCacheError(f"signal: has {signal.num_layers} layers, the cache {spec.num_layers}")
        self.engine, self.region, self.signal, self.rank = engine, region, signal, rank
        self.fetch_plans, self.on_sent, self.on_failed = fetch_plans, on_sent, on_failed
        self.connect_timeout = connect_timeout
        shorten_switch_interval(switch_interval)
        self.last_step_ns: dict[str, int] = {}  # timings of the last step, for benchmarks
        self.posted_bytes: dict[Any, int] = {}  # bytes posted per request (the last 4096), for benchmarks
        self.sent_ns: dict[Any, dict[str, int]] = {}  # per request, when each stage of its end happened (last 4096)
        self._peers: dict[str, Peer] = {}
        self._routes: dict[int, dict[int, list[Route]]] = {}  # decode tp -> decode rank -> my routes to it
        # (id(peer region), route, layers) -> (that region, its layout): what every request to it starts from
        self._layouts: dict[tuple[int, Route, tuple[int, ...]], tuple[KVRegion, RouteLayout]] = {}
        self._cells_of: dict[int, np.ndarray] = {}  # table rows -> which row each (layer, global head) reads
        self._rows = [r.describe() for r in spec.row_layout]  # what a decode rank's rows must be
        self._row_checks: dict[int, tuple[KVRegion, str]] = {}  # id(peer region) -> (it, how its rows differ or "")
        self._progress: dict[Any, _Progress] = {}  # requests sent in chunks, between their steps (step thread only)
        self._steps: queue.SimpleQueue = queue.SimpleQueue()
        self._finishing: queue.SimpleQueue = queue.SimpleQueue()
        engine.register(region)
        self._thread = threading.Thread(target=self._run_steps, name=f"messager-{rank}", daemon=True)
        self._completer = threading.Thread(target=self._run_completions, name=f"messager-{rank}-done", daemon=True)
        self._thread.start()
        self._completer.start()
        self._closed = False

    def run_step(self, step: int, reqs: Sequence[Any], plans: Mapping[Any, TransferPlan] | None = None) -> None:
        """The worker is about to write step ``step``'s layers for ``reqs``: request ids (whole prompts) or Chunks.

        ``plans`` (by request) are plans the scheduler handed over with the step (``Sending.plan``):
        those requests skip ``fetch_plans``, a control-plane round trip after the step has begun.
        """
        if self._closed:
            raise KVCacheError("the messager is closed")
        chunks = [r if isinstance(r, Chunk) else Chunk(r, 1 << 62, True) for r in reqs]
        if chunks:
            self._steps.put((step, chunks, dict(plans or {})))

    def close(self) -> None:
        """Stop both threads (steps in progress fail at their deadline or now). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._steps.put(_STOP)
        self._thread.join(timeout=10)
        self._finishing.put(_STOP)
        self._completer.join(timeout=10)

    # ----------------------------------------------------------------- the step thread

    def _run_steps(self) -> None:
        while True:
            item = self._steps.get()
            if item is _STOP:
                return
            step, chunks, given = item
            try:
                self._send_step(step, chunks, given)
            except Exception as exc:  # a bug or a broken control plane: fail the step's requests, keep serving
                log.exception("messager %d: step %d failed", self.rank, step)
                for chunk in chunks:
                    self._stop(chunk.req, self._progress.pop(chunk.req, None))
                    self._fail(chunk.req, f"messager error: {type(exc).__name__}: {exc}", None)

    def _send_step(self, step: int, chunks: list[Chunk], given: dict[Any, TransferPlan]) -> None:
        timings = {"start_ns": time.monotonic_ns()}
        now = time.monotonic()
        for req in [r for r, p in self._progress.items() if now >= p.deadline]:  # never finished: give up
            self._stop(req, self._progress.pop(req))
            self._fail(req, "the prompt's last chunk never came before the deadline", None)
        try:
            missing = [c.req for c in chunks if c.req not in given]
            fetched = dict(zip(missing, self.fetch_plans(missing))) if missing else {}
            plans = [given[c.req] if c.req in given else fetched[c.req] for c in chunks]
        except Exception as exc:
            for chunk in chunks:
                self._stop(chunk.req, self._progress.pop(chunk.req, None))
                self._fail(chunk.req, f"could not fetch the transfer plan: {exc}", None)
            return
        bs = self.region.spec.block_size
        # (plan, chunk, its progress, this step's blocks [lo, hi), decode rank -> remote region)
        active: list[tuple[TransferPlan, Chunk, _Progress, int, int, dict[int, KVRegion]]] = []
        for chunk, plan in zip(chunks, plans):
            if plan is None:
                self._progress.pop(chunk.req, None)
                continue
            if plan.cancelled:
                self._stop(chunk.req, self._progress.pop(chunk.req, None))
                self._fail(plan.req, "cancelled", plan)
                continue
            try:
                targets = self._targets(plan)
                self._check_rows(plan, targets)
            except KVCacheError as exc:
                self._stop(chunk.req, self._progress.pop(chunk.req, None))
                self._fail(plan.req, str(exc), plan)
                continue
            progress = self._progress.setdefault(plan.req, _Progress(
                plan.first_block, {d: [] for d in targets}, {d: agent for d, (_, agent) in targets.items()},
                plan.deadline))
            lo = max(progress.next_block, plan.first_block)
            hi = min(-(-chunk.stop // bs), plan.dst_blocks.shape[1], plan.src_blocks.shape[1])
            progress.next_block = max(progress.next_block, min(chunk.stop // bs, hi))
            active.append((plan, chunk, progress, lo, hi, {d: remote for d, (remote, _) in targets.items()}))
        timings["planned_ns"] = time.monotonic_ns()
        last = self.region.num_layers - 1
        notified: set[tuple[Any, int]] = set()  # (request, decode rank) whose last write carries the notice
        # Every layer's ranges at once, built before the signals come: (active index, decode rank) -> (ranges in
        # layer order, where each layer's start).
        by_layer = {(i, d): self._layer_ranges(plan, d, remote, lo, hi)
                    for i, (plan, _, _, lo, hi, remotes) in enumerate(active) if lo < hi for d, remote in remotes.items()}
        timings["ranged_ns"] = time.monotonic_ns()
        layer = 0
        while layer <= last:
            if not active:
                return
            deadline = min(plan.deadline for plan, *_ in active)
            status = self.signal.wait(layer, step, timeout=max(0.0, deadline - time.monotonic()))
            # STALE: the writer has since finished the layer in a later step, so it finished it in this one
            # first (a step's layers run in order on one stream): the messager fell behind, the data is there.
            if status not in (WaitStatus.DONE, WaitStatus.STALE):
                for plan, *_ in active:
                    self._stop(plan.req, self._progress.pop(plan.req, None))
                    self._fail(plan.req, f"layer {layer} of step {step} never completed ({status.name})", plan)
                return
            # Layers that finished while we were busy go together, as one write per request and rank.
            finished = self.signal.layer_times().steps
            upto = layer
            while upto < last and _done_in(int(finished[upto + 1]), step):
                upto += 1
            layers = list(range(layer, upto + 1))
            layer = upto + 1
            if upto == last:
                timings["last_signal_ns"] = time.monotonic_ns()
            closing: dict[str, list[_Closing]] = {}  # decode agent -> the last writes to it
            for i, (plan, chunk, progress, lo, hi, remotes) in enumerate(active):
                if lo >= hi:
                    continue
                for d, remote in remotes.items():
                    every, starts = by_layer[(i, d)]
                    part = slice(starts[layers[0]], starts[upto + 1])
                    ranges = every.select(part)
                    self.posted_bytes[plan.req] = self.posted_bytes.get(plan.req, 0) + ranges.nbytes
                    if chunk.last and upto == last:
                        closing.setdefault(progress.agents[d], []).append(_Closing(plan, progress, d, remote, ranges))
                        continue
                    # Posted from this thread when the engine is idle (no hand-off to its worker, which beside a
                    # runner holding the GIL costs up to a switch interval per layer), unless both sides are host
                    # memory: there the post itself copies, and this thread must be free for the next signal.
                    progress.handles[d].append(self.engine.submit(ranges, progress.agents[d], self.region, remote,
                                                                  deadline=plan.deadline,
                                                                  inline=self.region.is_cuda or remote.is_cuda))
            for parts in closing.values():
                self._close(parts, notified)
        timings["posted_ns"] = time.monotonic_ns()
        self.last_step_ns = timings
        while len(self.posted_bytes) > 4096:
            self.posted_bytes.pop(next(iter(self.posted_bytes)))
        for plan, chunk, progress, *_ in active:
            if chunk.last:
                del self._progress[plan.req]
                pending = {progress.agents[d]: (hs, (plan.req, d) not in notified) for d, hs in progress.handles.items()}
                self._finishing.put((plan, pending, timings))

    def _close(self, parts: list[_Closing], notified: set[tuple[Any, int]]) -> None:
        """Post the last writes of requests whose prompts end in this step, to one decode rank, as one write.

        It carries one notice naming them all: NIXL sends it with the write when the requests'
        earlier writes have landed by the time it is posted, else the engine's worker sends it the
        moment the last of them lands (no hand-off to the completion thread). One write of all the
        step's requests costs one transfer() call, which UCX's workers post in parallel. The write
        that carries the notice ends the tail, so it is posted from here when the engine is idle.
        The requests share its fate: if it fails, each of them fails.
        """
        reqs = [p.plan.req for p in parts]
        first = parts[0]
        handle = self.engine.submit(
            CopyRanges.joined([p.ranges for p in parts]), first.progress.agents[first.d], self.region, first.remote,
            deadline=min(p.plan.deadline for p in parts), notify=_notice(reqs, self.rank, self.region.spec.tp_size),
            after=[h for p in parts for h in p.progress.handles[p.d]], inline=True)
        for p in parts:
            p.progress.handles[p.d].append(handle)
            notified.add((p.plan.req, p.d))

    def _check_rows(self, plan: TransferPlan, targets: dict[int, tuple[KVRegion, str]] | None = None) -> None:
        """Both tables have the same rows, rows this rank's cache can read (``_cells``), and every decode rank
        written holds the same rows as this rank's cache: which layers and kv heads each row holds, and its
        policy, as the rank's region says (its NIXL hello); else the request fails, naming the first row that
        differs. A plan that skipped the daemons' check (``check_same_rows``) still never writes one row's
        blocks into another's."""
        rows = (plan.src_blocks.shape[0], plan.dst_blocks.shape[0])
        if rows[0] != rows[1]:
            raise KVCacheError(f"tables of {rows[0]} (prefill) and {rows[1]} (decode) rows: both need the same rows")
        self._cells(rows[0])
        for d, (remote, _) in (targets or {}).items():
            held = self._row_checks.get(id(remote))
            if held is None or held[0] is not remote:
                if len(self._row_checks) >= 256:  # peers come and go: forget the oldest
                    self._row_checks.pop(next(iter(self._row_checks)))
                why = row_difference([r.describe() for r in remote.spec.row_layout], self._rows)
                held = self._row_checks[id(remote)] = (remote, why)
            if held[1]:
                raise KVCacheError(f"decode rank {d} at {plan.receivers[d]}: its cache's rows differ from this "
                                   f"prefill rank's: {held[1]}")

    def _cells(self, num_rows: int) -> np.ndarray:
        """int64 [layers, global kv heads]: which row of a table of ``num_rows`` rows each layer's head reads."""
        cells = self._cells_of.get(num_rows)
        if cells is None:
            spec = self.region.spec
            cells = self._cells_of[num_rows] = table_cells(spec.rows, num_rows, spec.num_layers, spec.num_kv_heads)
        return cells

    def _targets(self, plan: TransferPlan) -> dict[int, tuple[KVRegion, str]]:
        """Decode rank -> (its region, its agent) for every decode rank this rank writes to; connects as needed."""
        tp = len(plan.receivers)
        routes = self._routes_to(tp)
        out = {}
        for d in routes:
            endpoint = plan.receivers[d]
            peer = self._peers.get(endpoint)
            if peer is None:
                peer = self._peers[endpoint] = self.engine.connect(endpoint, timeout=self.connect_timeout)
            if not peer.regions:
                raise KVCacheError(f"decode rank {d} at {endpoint} registered no region")
            out[d] = (peer.regions[0], peer.agent)
        return out

    def _routes_to(self, decode_tp: int) -> dict[int, list[Route]]:
        routes = self._routes.get(decode_tp)
        if routes is None:
            spec = self.region.spec
            routes = {}
            for r in head_routes(spec.num_kv_heads, spec.tp_size, decode_tp):
                if r.src == self.rank:
                    routes.setdefault(r.dst, []).append(r)
            self._routes[decode_tp] = routes
        return routes

    def _layout(self, remote: KVRegion, route: Route, layers: tuple[int, ...]) -> RouteLayout:
        """``layers``' units of ``route`` into ``remote``, built once per peer region (not per request)."""
        key = (id(remote), route, layers)
        held = self._layouts.get(key)
        if held is None or held[0] is not remote:
            if len(self._layouts) >= 256:  # peers come and go: forget the oldest
                self._layouts.pop(next(iter(self._layouts)))
            held = self._layouts[key] = (remote, route_layout(self.region, remote, route, list(layers)))
        return held[1]

    def _ranges(self, plan: TransferPlan, d: int, remote: KVRegion, layers: list[int]) -> CopyRanges:
        """Every block past the decode side's cache, of ``layers``, for decode rank ``d``."""
        return self._layer_ranges(plan, d, remote, plan.first_block, None, layers)[0]

    def _layer_ranges(self, plan: TransferPlan, d: int, remote: KVRegion, lo: int, hi: int | None,
                      layers: list[int] | None = None) -> tuple[CopyRanges, np.ndarray]:
        """Blocks ``[lo, hi)`` of ``layers`` (default all) for decode rank ``d``, in layer order, and where each starts.

        Each route's heads read their table rows layer by layer (``_cells``): layers whose heads read the same
        rows go together, whole blocks where one row holds every head of the route, else a row per head.
        """
        src, dst = plan.src_blocks[:, lo:hi], plan.dst_blocks[:, lo:hi]
        spec = self.region.spec
        selected = list(range(spec.num_layers)) if layers is None else list(layers)
        cells = self._cells(src.shape[0])
        parts: list[tuple[CopyRanges, np.ndarray, list[int]]] = []
        for r in self._routes_to(len(plan.receivers))[d]:
            g = rank_heads(spec.num_kv_heads, spec.tp_size, self.rank)[r.src_row]  # the route's first global head
            for picks, group in layer_classes(cells[:, g:g + r.count], selected).items():
                layout = (self._layout(remote, r, tuple(group)) if layers is None
                          else route_layout(self.region, remote, r, group))
                ranges, starts = layout_ranges(layout, rows_blocks(src, picks), rows_blocks(dst, picks))
                parts.append((ranges, starts, group))
        if len(parts) == 1:
            return parts[0][0], parts[0][1]
        # Several routes (TP re-slicing) or layer classes: each layer's ranges together, layers in selection order.
        position = {layer: i for i, layer in enumerate(selected)}
        layer = np.concatenate([np.repeat([position[x] for x in group], np.diff(starts)).astype(np.int64)
                                for _, starts, group in parts])
        order = np.argsort(layer, kind="stable")
        joined = CopyRanges.concat([p for p, _, _ in parts]).select(order)
        return joined, np.searchsorted(layer[order], np.arange(len(selected) + 1))

    def _stop(self, req: Any, progress: _Progress | None) -> None:
        """``req`` fails after this rank may have written some of it (``progress``: what it posted; None: nothing)."""
        if progress is not None:
            self._stop_writes(req, {progress.agents[d]: hs for d, hs in progress.handles.items()})

    def _stop_writes(self, req: Any, handles: dict[str, list[TransferHandle]]) -> None:
        """Tell each decode rank written for ``req`` that this rank stopped writing it (``_stopped``), before
        the failure is reported: a rank with a write that did not land (still on its way, or lost) is asked to
        cut this rank off, so that write can never land in blocks its daemon hands to another request; that
        peer is dropped here and connected afresh for later requests."""
        for agent, posted in handles.items():
            cut = any(h.status() is not TransferStatus.DONE for h in posted)
            try:
                self.engine.notify(agent, _stopped([req], self.rank, self.region.spec.tp_size, cut))
            except KVCacheError as exc:  # gone, or never connected: its daemon's deadline covers it
                log.info("messager %d: could not tell %s that %r stopped: %s", self.rank, agent, req, exc)
            if cut:
                for endpoint, peer in list(self._peers.items()):
                    if peer.agent == agent:
                        del self._peers[endpoint]
                        self.engine.disconnect(peer)

    def _fail(self, req: Any, error: str, plan: TransferPlan | None) -> None:
        try:
            self.on_failed(req, error, plan)
        except Exception:
            log.exception("messager %d: reporting the failure of %r failed", self.rank, req)

    # ----------------------------------------------------------------- the completion thread

    def _run_completions(self) -> None:
        while True:
            item = self._finishing.get()
            if item is _STOP:
                return
            plan, by_agent, timings = item
            errors = []
            stamps = {"step_start": timings["start_ns"], "planned": timings.get("planned_ns", 0),
                      "ranged": timings.get("ranged_ns", 0),
                      "last_signal": timings.get("last_signal_ns", 0), "earlier_landed": 0, "submitted": 0, "picked": 0,
                      "posted": 0, "landed": 0, "notified": 0}
            for agent, (handles, notify) in by_agent.items():
                for k, h in enumerate(handles):  # in posting order; the last carries the notice
                    if h.wait() is not TransferStatus.DONE:
                        errors.append(h.error or h.status().value)
                    if k < len(handles) - 1:
                        stamps["earlier_landed"] = max(stamps["earlier_landed"], getattr(h, "done_ns", 0))
                    stamps["submitted"] = max(stamps["submitted"], getattr(h, "submitted_ns", 0))
                    stamps["picked"] = max(stamps["picked"], getattr(h, "picked_ns", 0))
                    stamps["posted"] = max(stamps["posted"], getattr(h, "posted_ns", 0))
                    stamps["landed"] = max(stamps["landed"], getattr(h, "done_ns", 0))
                if notify and not errors:  # every write to this rank landed: say so
                    try:
                        self.engine.notify(agent, _notice([plan.req], self.rank, self.region.spec.tp_size))
                        stamps["notified"] = time.monotonic_ns()
                    except KVCacheError as exc:
                        errors.append(str(exc))
            self.sent_ns[plan.req] = stamps
            while len(self.sent_ns) > 4096:
                self.sent_ns.pop(next(iter(self.sent_ns)))
            if errors:
                self._stop_writes(plan.req, {agent: handles for agent, (handles, _) in by_agent.items()})
                for endpoint in plan.receivers:  # the peer may be gone: connect afresh next time
                    peer = self._peers.pop(endpoint, None)
                    if peer is not None:
                        self.engine.disconnect(peer)
                self._fail(plan.req, f"{len(errors)} write(s) to the decode side failed: {errors[0]}", plan)
                continue
            try:
                self.on_sent(plan.req)
            except Exception:
                log.exception("messager %d: reporting %r sent failed", self.rank, plan.req)


class CacheReceiver:
    """A decode rank's side: registers its cache with NIXL, serves its metadata, and reports requests that landed.

    ``on_received(reqs)`` runs (on the receiver's thread) with the requests for which every prefill
    rank that writes to this rank has notified that its writes are done: all that one poll of the
    notifications completed, so a step's batch is reported in one call. ``on_stopped(reqs)`` runs
    with the requests whose writers to this rank have all ended, one or more having given up: a
    writer that gave up with a write still on its way is cut off first (``NixlEngine.cut_off``), so
    once ``on_stopped`` runs nothing of these requests can land here any more. Partial counts older
    than ``stale_after`` seconds (a sender that failed half way) are dropped. Like the messager, it
    lowers the process's GIL switch interval to ``switch_interval``.
    """

    def __init__(self, engine: NixlEngine, region: KVRegion, rank: int, *, on_received: Callable[[list[Any]], None],
                 on_stopped: Callable[[list[Any]], None] | None = None,
                 endpoint: str = "tcp://127.0.0.1:*", poll_interval: float = 2e-4, stale_after: float = 600.0,
                 switch_interval: float | None = SWITCH_INTERVAL_S) -> None:
        spec = region.spec
        if not 0 <= rank < spec.tp_size:
            raise KVCacheError(f"rank: {rank} is outside the region's tp_size {spec.tp_size}")
        self.engine, self.region, self.rank, self.on_received = engine, region, rank, on_received
        self.on_stopped = on_stopped
        self.poll_interval, self.stale_after = poll_interval, stale_after
        shorten_switch_interval(switch_interval)
        engine.register(region)
        self.endpoint = engine.serve(endpoint)
        self.received_ns: dict[Any, int] = {}  # when each request completed here, for benchmarks (last 4096)
        self._partial: dict[Any, tuple[float, set[int], set[int]]] = {}  # req -> (first heard, done, gave up)
        self._writers: dict[int, frozenset[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"receiver-{rank}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop polling (the engine, owned by the caller, stays open). Idempotent."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        idle = 0.0
        while not self._stop.is_set():
            try:
                notes = self.engine.notifications()
            except KVCacheError:
                return  # the engine closed
            if not notes:
                idle = min(self.poll_interval, idle * 2 or 20e-6)
                time.sleep(idle)
                continue
            idle = 0.0
            complete, stopped = [], []
            for agent, messages in notes.items():
                for message in messages:
                    done, halted = self._note(agent, message)
                    complete += done
                    stopped += halted
            for callback, reqs, what in ((self.on_received, complete, "received"),
                                         (self.on_stopped, stopped, "stopped")):
                if reqs and callback is not None:
                    try:
                        callback(reqs)
                    except Exception:
                        log.exception("receiver %d: reporting %r %s failed", self.rank, reqs, what)
            self._prune()

    def _note(self, agent: str, message: bytes) -> tuple[list[Any], list[Any]]:
        """Count one notification from ``agent``: the requests it completed, and those whose writers all ended with
        one or more giving up (a notice that a writer stopped: ``_stopped``, cutting the writer off if it asks)."""
        try:
            note = msgpack.unpackb(message, raw=False)
            stopped = "stopped" in note
            reqs, src, tp = note["stopped" if stopped else "reqs"], int(note["src"]), int(note["tp"])
            if not isinstance(reqs, list):
                raise TypeError(f"reqs is a {type(reqs).__name__}, not a list")
            writers = self._writers.get(tp)
            if writers is None:
                spec = self.region.spec
                writers = self._writers[tp] = writers_of(spec.num_kv_heads, tp, spec.tp_size, self.rank)
        except Exception as exc:
            log.warning("receiver %d: ignoring a malformed notification (%s)", self.rank, exc)
            return [], []
        if stopped and note.get("cut"):  # a write of these may still be on its way: nothing of it may land now
            reset = self.engine.cut_off(agent)
            log.warning("receiver %d: %s gave up %d request(s) with writes still on their way; reset %d of its "
                        "connections", self.rank, agent, len(reqs), reset)
        complete, halted = [], []
        for req in reqs:
            if stopped and req in self.received_ns:
                continue  # it landed here whole before the writer gave up elsewhere
            _, done, gave_up = self._partial.setdefault(req, (time.monotonic(), set(), set()))
            (gave_up if stopped else done).add(src)
            if done | gave_up >= writers:
                del self._partial[req]
                if gave_up:
                    halted.append(req)
                    continue
                self.received_ns[req] = time.monotonic_ns()
                if len(self.received_ns) > 4096:
                    self.received_ns.pop(next(iter(self.received_ns)))
                complete.append(req)
        return complete, halted

    def _prune(self) -> None:
        now = time.monotonic()
        for req in [r for r, (t, *_) in self._partial.items() if now - t > self.stale_after]:
            del self._partial[req]

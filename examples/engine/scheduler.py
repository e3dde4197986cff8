"""Who runs this step: continuous batching over kvcache's tables, one token budget per step.

Per step the scheduler grows every decoding request by its last sampled token
(``extend_many``), continues chunked prefills (``extend``), admits waiting
requests with their prefix hits (``admit`` with ``num_tokens``), and preempts
a request whose blocks run out (``free``; it comes back later and recomputes
what the prefix cache no longer holds). Decodes go first and count against
the budget (``chunk``, vLLM's ``max_num_batched_tokens``).

``cache`` is a ``KVCacheManager`` in process or a ``CacheClient`` of a
``kvcache serve``: the same method names. Through a daemon each decode extend
also reserves the next step's position, so that step's tables are known
before its tokens are: the step posts its extends (``Batch.post``) and the
model runs meanwhile; ``settle`` takes the replies after the model.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, Callable, NamedTuple

import numpy as np

from sequence import Sequence


class Scheduled(NamedTuple):
    """A request's part of a step: positions ``[start, stop)`` are computed; its table covers them."""

    seq: Sequence
    start: int
    stop: int


@dataclasses.dataclass
class StepStats:
    """What a step did: tokens computed, prefix-hit tokens, preemptions, the cache's usage after it, and whether
    the daemon's round trip overlapped the model."""

    computed: int = 0
    hit: int = 0
    preempted: int = 0
    usage: float = 0.0
    overlapped: bool = False  # the daemon extended the decoding requests while the model ran (``Batch.post``)


@dataclasses.dataclass
class StepPlan:
    """A scheduled step: its work, its stats so far, and the decode extends posted to the daemon (if any)."""

    work: list[Scheduled]
    stats: StepStats
    decoding: list[Sequence]
    posted: Any = None


class Scheduler:
    """The waiting, running and finished requests, and each step's choice of what runs."""

    def __init__(self, cache: Any, *, chunk: int, max_num_seqs: int, windowed: bool) -> None:
        """``windowed``: some row gives blocks back (a window or chunks); a block reserved ahead for the next
        position could then be one a window gives back, so decodes reserve nothing ahead."""
        self.cache, self.chunk, self.max_num_seqs, self.windowed = cache, chunk, max_num_seqs, windowed
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished: dict[Any, Sequence] = {}
        # PD prefill: ``handoff(sequence)`` takes a request once its prompt is computed and its first token
        # sampled (its KV goes to the decode node) instead of it decoding here.
        self.handoff: Callable[[Sequence], None] | None = None
        self.tier_failures = False  # the daemon keeps a host tier: ask it which copies back failed
        # What the daemon's host tier failed, taken with the last step's posted extends (None: ask it this step).
        self._tier_failed: list[Any] | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        """This step's work: decodes, then chunked prefills, then admits, within the budget."""
        stats = StepStats()
        work: list[Scheduled] = []
        budget = self.chunk
        if self.tier_failures:  # the daemon's host tier could not copy these back: start them again
            failed = self.cache.tier_failed() if self._tier_failed is None else self._tier_failed
            self._tier_failed = None
            for rid in failed:
                s = next((s for s in self.running if s.rid == rid), None)
                if s is not None:
                    self._preempt(s, stats)
        decoding = [s for s in self.running if s.scheduled == len(s.tokens) - 1]
        plan = StepPlan(work, stats, decoding)
        if decoding:
            ids, last, ones = [s.rid for s in decoding], [s.tokens[-1] for s in decoding], [1] * len(decoding)
            ahead = 1 if hasattr(self.cache, "batch") and not self.windowed else 0
            refused = [False] * len(decoding)
            if ahead and all(s.scheduled < s.covered for s in decoding):
                batch = self.cache.batch().extend_many(ids, last, ones, num_lookahead_tokens=ahead).op("usage")
                if self.tier_failures:  # the next step's failed loads, without a round trip of their own
                    batch.op("tier_failed")
                plan.posted = batch.post()
                stats.overlapped = True
            else:
                grown = self.cache.extend_many(ids, last, ones, num_lookahead_tokens=ahead)
                refused = [table is None for table in grown]
            for s, out_of_blocks in zip(decoding, refused):
                if out_of_blocks:
                    self._preempt(s, stats)
                    continue
                work.append(Scheduled(s, s.scheduled, s.scheduled + 1))
                s.scheduled += 1
                s.covered = max(s.covered, s.scheduled + (ahead if plan.posted is None else 0))
                budget -= 1
        for s in [s for s in self.running if s.scheduled < len(s.tokens)]:  # chunked prefills (decodes are ahead)
            n = min(budget, len(s.tokens) - s.scheduled)
            if n <= 0:
                continue
            if self.cache.extend(s.rid, s.tokens[s.scheduled:s.scheduled + n]) is None:
                self._preempt(s, stats)
                continue
            work.append(Scheduled(s, s.scheduled, s.scheduled + n))
            s.scheduled += n
            s.covered = max(s.covered, s.scheduled)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            s = self.waiting[0]
            wanted = min(len(s.tokens), budget)
            admission = self.cache.admit(s.rid, s.tokens, num_tokens=wanted)
            if admission is None:
                if not self.running and not work:
                    raise RuntimeError(f"request {s.rid!r} of {len(s.tokens)} tokens can never fit the cache")
                break
            self.waiting.popleft()
            self.running.append(s)
            s.computed = admission.num_cached_tokens
            s.scheduled = s.covered = min(len(s.tokens), max(wanted, s.computed + 1))  # what the table covers now
            stats.hit += s.computed
            work.append(Scheduled(s, s.computed, s.scheduled))
            budget -= s.scheduled - s.computed
        return plan

    def postprocess(self, work: list[Scheduled], ends: list[int], sampled: list[int],
                    logits: list[np.ndarray] | None) -> None:
        """After the model ran ``work``: its tokens are computed; ``work[ends[k]]`` sampled ``sampled[k]``
        (from ``logits[k]``, where kept); a request done sampling is freed (its full blocks stay cached)."""
        for w in work:
            w.seq.computed = w.stop
        for k, i in enumerate(ends):
            s = work[i].seq
            if logits is not None:
                s.logits.append(logits[k])
            s.tokens.append(int(sampled[k]))
            if self.handoff is not None:
                self.running.remove(s)
                self.handoff(s)
            elif s.done:
                self.cache.free(s.rid)
                self.running.remove(s)
                self.finished[s.rid] = s

    def settle(self, plan: StepPlan) -> None:
        """After the model: the posted extends' replies (a decode with no block for its next position is
        preempted) and the cache's usage, into the step's stats."""
        stats, posted = plan.stats, plan.posted
        if posted is None:
            stats.usage = float(self.cache.usage.max)
            return
        later_calls = posted.done  # an admit or a prefill's extend took the reply: usage is theirs to give
        tables, usage, *failed = posted.results()  # extend_many's tables, usage's answer, tier_failed's ids
        if failed:
            self._tier_failed = failed[0]
        for s, table in zip(plan.decoding, tables):
            if table is not None:
                s.covered = s.scheduled + 1
            elif s in self.running:  # no block for its next position: the daemon kept nothing of the extend
                self._preempt(s, stats)
        stats.usage = float(self.cache.usage.max if later_calls or stats.preempted else usage["max"])

    def _preempt(self, s: Sequence, stats: StepStats) -> None:
        """Out of blocks: free the request (its full blocks stay cached) and queue it to start again first."""
        self.cache.free(s.rid)
        self.running.remove(s)
        s.computed = s.scheduled = s.covered = 0
        s.preemptions += 1
        stats.preempted += 1
        self.waiting.appendleft(s)

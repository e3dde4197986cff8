"""Decode steps over row groups, expanded (head-wise) rows and window or chunked groups, in one C pass.

``_tables.extend_rows`` takes the decode batches of every manager that is not
one uniform row: several row groups (layer groups), rows expanded from them
(head-wise), window groups giving blocks back, chunked groups. Whatever it
does, the result must be exactly that of ``extend`` called request by request
in order, and that of the numpy batch path it replaces (a twin held off the
pass): the same deltas, tables, token counts, free counts, statistics, KV
events, prefix hits, and an index and pool that pass ``check_integrity``.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.allocator import Chunked, Full, KVCacheManager, Window, _tables

PREFIXES = [list(range(60)), list(range(1000, 1060)), list(range(12)) + list(range(5000, 5048))]


def shape_rows(shape: str, window: int, sink: int, chunk: int) -> list:
    """A manager's rows: head-wise (windows over several kv heads, then full heads), layer groups (one row per
    distinct policy), or others that mix windows, sinks and chunks."""
    win = Window(window, sink)
    return {
        "head-wise": [win] * 6 + [Full()] * 2,
        "layer groups": [Window(window), Full()],
        "two windows": [win, Full(), Window(window + 3), win],
        "window only": [win, win],
        "chunked": [Chunked(chunk), Full(), Chunked(chunk)],
        "chunk and window": [Chunked(chunk), win, Full()],
        "full rows": [Full(), Full()],
        "one window": [win],
    }[shape]


def plain(events: list) -> list:
    """Events as comparable tuples (token ids as lists)."""
    return [(type(e).__name__, *(v.tolist() if isinstance(v, np.ndarray) else v for v in dataclasses.astuple(e)))
            for e in events]


class Trio:
    """Three identical managers: one takes decode batches through the C pass, one through the numpy batch path,
    one extend at a time. Every call goes to all three and their answers and states must agree."""

    def __init__(self, rows: list, num_blocks: int, block_size: int, caching: bool, algorithm: str, events: bool,
                 monkeypatch: pytest.MonkeyPatch) -> None:
        make = lambda: KVCacheManager(num_blocks, block_size, rows, enable_prefix_caching=caching,
                                      hash_algorithm=algorithm, hash_seed=b"rows", enable_events=events)
        self.one_pass, self.numpy_run, self.single = make(), make(), make()
        monkeypatch.setattr(self.numpy_run, "_decodes_in_one_pass", lambda: None)
        self.block_size = block_size
        self.live: list[int] = []
        self.tokens_of: dict[int, list[int]] = {}

    @property
    def managers(self) -> tuple[KVCacheManager, KVCacheManager, KVCacheManager]:
        return self.one_pass, self.numpy_run, self.single

    def admit(self, rid: int, prompt: list[int]) -> int | None:
        got = [m.admit(rid, prompt) for m in self.managers]
        assert len({a is None for a in got}) == 1
        if got[0] is None:
            return None
        assert len({(a.num_cached_tokens, a.num_tokens, a.table.tobytes()) for a in got}) == 1
        self.live.append(rid)
        self.tokens_of[rid] = list(prompt)
        return got[0].num_cached_tokens

    def free(self, rid: int) -> None:
        self.live.remove(rid)
        for m in self.managers:
            m.free(rid)

    def step(self, tokens: list[int], lookahead: int, deltas: bool) -> list[int]:
        """Every live request decodes one token; returns the ids refused (and frees them, as a scheduler would)."""
        rids = list(self.live)
        want = [self.single.extend(rid, [t], num_lookahead_tokens=lookahead) for rid, t in zip(rids, tokens)]
        changed = [self.single.changed_columns(rid).tolist() if w is not None else None for rid, w in zip(rids, want)]
        counts = np.ones(len(rids), dtype=np.int32)
        for m in (self.one_pass, self.numpy_run):
            if deltas:
                d = m.extend_many_deltas(rids, np.array(tokens, dtype=np.int64), counts, num_lookahead_tokens=lookahead)
                assert d.lens.tolist() == [-1 if w is None else w.shape[1] for w in want]
                assert d.offsets[0] == 0 and d.offsets[-1] == d.cols.size == d.vals.shape[1]
                assert d.offsets.size == d.index.size + 1 and d.vals.shape[0] == m.num_rows
                touched = [i for i, c in enumerate(changed) if c]
                assert d.index.tolist() == touched
                for j, i in enumerate(touched):
                    cols = d.cols[d.offsets[j]:d.offsets[j + 1]]
                    assert cols.tolist() == changed[i], (i, cols.tolist(), changed[i])
                    assert d.vals[:, d.offsets[j]:d.offsets[j + 1]].tolist() == want[i][:, cols].tolist()
            else:
                changes: list[np.ndarray] = []
                tables = m.extend_many(rids, tokens, counts, changes=changes, num_lookahead_tokens=lookahead)
                assert [t is None for t in tables] == [w is None for w in want]
                for t, w, c, got in zip(tables, want, changed, changes):
                    if w is not None:
                        assert t.tolist() == w.tolist()
                        assert got.tolist() == c
        for rid, t, w in zip(rids, tokens, want):
            if w is not None:
                self.tokens_of[rid].append(t)
        refused = [rid for rid, w in zip(rids, want) if w is None]
        for rid in refused:
            self.free(rid)
        return refused

    def check(self) -> None:
        """The three managers hold the same state, and it is consistent."""
        events = plain(self.single.take_events())
        for m in (self.one_pass, self.numpy_run):
            m.check_integrity()
            for rid in self.live:
                assert m.table(rid).tolist() == self.single.table(rid).tolist(), rid
                assert m.num_tokens(rid) == self.single.num_tokens(rid), rid
                assert m.changed_columns(rid).tolist() == self.single.changed_columns(rid).tolist(), rid
            assert m.num_free_blocks.tolist() == self.single.num_free_blocks.tolist()
            assert m.stats() == self.single.stats()
            assert plain(m.take_events()) == events

    def lookups(self) -> None:
        """Prefix hits agree: every live request's tokens, and each shared prefix."""
        for prompt in [*self.tokens_of.values(), *PREFIXES]:
            assert len({m.lookup(prompt) for m in self.managers}) == 1


class PassSpy:
    """Counts what ``_tables.extend_rows`` did: taken or declined, and what each taken pass contained."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: Counter[str] = Counter()
        real = _tables.extend_rows

        def spy(*args):
            got = real(*args)
            if got is None:
                self.seen["declined"] += 1
            else:
                counted = args[22]
                self.seen["taken"] += 1
                self.seen["widened"] += bool(got[4])
                self.seen["gave with a gap or opened"] += bool(got[5])
                self.seen["filled"] += got[9] > 0
                self.seen["evicted"] += int(counted[0]) > 0
                self.seen["gave"] += int(counted[1]) > 0
            return got

        monkeypatch.setattr(_tables, "extend_rows", spy)


steps = st.lists(st.tuples(st.sampled_from(["decode"] * 6 + ["admit", "free", "reset"]), st.integers(0, 10**6),
                           st.sampled_from([0, 0, 0, 0, 1, 1, 2, 4]), st.booleans(), st.integers(0, 3)),
                 min_size=1, max_size=40)


@settings(max_examples=250, deadline=None)
@given(shape=st.sampled_from(["head-wise", "layer groups", "two windows", "window only", "chunked",
                              "chunk and window", "full rows", "one window"]),
       window=st.integers(1, 24), sink=st.integers(0, 9), chunk_blocks=st.integers(1, 4),
       block_size=st.sampled_from([1, 2, 4, 8]), num_blocks=st.integers(6, 64), caching=st.booleans(),
       algorithm=st.sampled_from(["sha256", "sha256_cbor"]), events=st.booleans(),
       prompts=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 60), st.lists(st.integers(0, 9), max_size=5)),
                        min_size=1, max_size=6),
       ops=steps)
def test_decode_steps_in_one_pass_equal_the_numpy_path_and_extends_one_at_a_time(
        shape, window, sink, chunk_blocks, block_size, num_blocks, caching, algorithm, events, prompts, ops):
    """Random windows, sinks, chunks, block sizes, pools small enough to evict and refuse, shared prefixes that
    hit (with holes a window left), lookahead changing from step to step, resets: the three never differ."""
    with pytest.MonkeyPatch.context() as mp:
        trio = Trio(shape_rows(shape, window, sink, chunk_blocks * block_size), num_blocks, block_size, caching,
                    algorithm, events, mp)
        next_id = 0
        for base, keep, suffix in prompts:
            trio.admit(next_id, PREFIXES[base][:keep] + suffix)
            next_id += 1
        trio.check()
        for op, pick, lookahead, deltas, seed in ops:
            if op == "admit":
                base, keep, suffix = prompts[pick % len(prompts)]
                trio.admit(next_id, PREFIXES[base][:keep] + suffix + [pick % 7])
                next_id += 1
            elif op == "free" and trio.live:
                trio.free(trio.live[pick % len(trio.live)])
            elif op == "reset":
                assert len({m.reset_prefix_cache() for m in trio.managers}) == 1
            elif op == "decode" and trio.live:
                # seed 0 and 1: every request decodes the same token, so equal chains meet indexed hashes
                tokens = [seed] * len(trio.live) if seed < 2 else [(pick + i) % 11 for i in range(len(trio.live))]
                trio.step(tokens, lookahead, deltas)
            trio.check()
        trio.lookups()


@pytest.mark.parametrize("shape", ["head-wise", "layer groups", "chunk and window"])
@pytest.mark.parametrize("events", [False, True])
@pytest.mark.parametrize("deltas", [False, True])
def test_a_server_like_run_takes_the_pass_through_evictions_windows_widening_and_refusals(monkeypatch, shape, events,
                                                                                          deltas):
    """Requests admitted with shared prefixes decode step after step in a pool small enough that opens evict
    cached blocks and, at the end, a step runs out of blocks: the pass gives window blocks back (with gaps where
    two windows differ), widens tables, evicts and fills, and declines the steps it must leave to the general
    path (a refused request, a known hash); the three managers agree after every step."""
    spy = PassSpy(monkeypatch)
    trio = Trio(shape_rows(shape, 10, 3, 8), 70, 4, True, "sha256", events, monkeypatch)
    rng = np.random.default_rng(7)
    next_id = 0
    for step in range(150):
        if step % 10 == 0 and step < 110:
            for _ in range(3):
                base = next_id % 3
                trio.admit(next_id, PREFIXES[base][:20 + next_id % 17] + rng.integers(0, 50, next_id % 5).tolist())
                next_id += 1
            while len(trio.live) > 5:
                trio.free(trio.live[0])
        if not trio.live:
            continue
        same = step % 9 == 0  # every request decodes token 3: equal chains meet hashes already indexed
        tokens = [3] * len(trio.live) if same else rng.integers(0, 40, len(trio.live)).tolist()
        trio.step(tokens, 1 if step % 13 == 5 else 0, deltas)
        trio.check()
    trio.lookups()
    want = {"taken", "declined", "widened", "filled", "evicted", "gave"}
    assert want <= {k for k, v in spy.seen.items() if v}, spy.seen


def test_a_head_wise_step_gives_back_every_block_behind_a_fresh_prompts_window():
    """A 2,048-token prompt's first decode step gives back, in its window rows only, every block behind the
    1,024-token window and past the 64-token sink; the full rows keep theirs, and the changed columns carry
    -1 in the window rows and the blocks in the full rows."""
    rows = [Window(1024, 64)] * 6 + [Full()] * 2
    m = KVCacheManager(1024, 16, rows, hash_seed=b"x")
    prompt = np.arange(2048, dtype=np.int32)
    assert m.admit("p", prompt).num_tokens == 2048
    free_before = m.num_free_blocks.tolist()
    d = m.extend_many_deltas(["p"], [5], [1])
    gone = list(range(4, (2048 - 1024 + 1) // 16))  # blocks 4 .. 63: wholly past the sink, wholly dead
    assert d.lens.tolist() == [129] and d.index.tolist() == [0]
    assert d.cols.tolist() == gone + [128]
    table = m.table("p")
    assert (d.vals[:6, :-1] == -1).all() and (d.vals[6:, :-1] == table[6:, gone]).all()
    assert (table[:6, gone] == -1).all() and (table[:, 128] >= 0).all()
    assert m.num_free_blocks.tolist() == [f + len(gone) - 1 for f in free_before[:6]] + [f - 1 for f in free_before[6:]]
    assert m.stats().recycled_blocks == 6 * len(gone)
    m.check_integrity()


def test_two_windows_give_back_columns_with_a_gap_between_them(monkeypatch):
    """Windows of 2 and 20 tokens at block size 1 each give a block back every step, 18 columns apart: the
    request's changed columns are both, with the gap between them, and so are the deltas' (the pass hands such
    requests' columns to the caller to record)."""
    spy = PassSpy(monkeypatch)
    trio = Trio([Window(2), Full(), Window(20)], 64, 1, True, "sha256", True, monkeypatch)
    trio.admit(0, list(range(30)))
    trio.step([7], 0, True)  # the first step gives back everything behind each window: [0, 29) and [0, 11)
    assert trio.single.changed_columns(0).tolist() == list(range(29)) + [30]
    trio.check()
    for token in (8, 9):
        trio.step([token], 0, True)
        cols = trio.single.changed_columns(0).tolist()
        assert len(cols) == 3 and cols[1] - cols[0] > 1, cols  # one from each window, then the opened block
        trio.check()
    assert spy.seen["gave with a gap or opened"] == 3 and spy.seen["declined"] == 0


def test_extend_rows_refuses_inconsistent_arrays_and_changes_nothing():
    """The pass checks its arrays before it writes: a lens one short, a last_block of the wrong width, a row
    naming a group that does not exist, a window of no group, or an index without room for the keys is a
    ValueError and leaves the manager as it was; a given slot no request holds is left to the general path."""
    m = KVCacheManager(32, 4, [Window(4, 1), Full(), Window(4, 1)], hash_seed=b"x")
    for rid in range(3):
        m.admit(rid, np.arange(4 * rid, 4 * rid + 11, dtype=np.uint32))  # the next token fills a block
    pool, index = m._pool, m._index
    state = lambda: [a.copy() for a in (m._tail, m._ntok, m._width, m._last_hash, m._last_block, m._next_recycle,
                                        pool._ref, pool._cached, index._slots)] + [index._num_spare,
                                                                                   index._num_entries]
    before = state()
    ids, tokens, counts = [0, 1, 2], np.array([7, 8, 9], dtype=np.uint32), np.ones(3, dtype=np.int64)
    index.reserve(3, 6)

    def arrays(**change):
        args = dict(slot_of=m._slot_of, lens=np.empty(3, dtype=np.int32), last_block=m._last_block,
                    row_group=m._row_group, windows=m._windows_table(), entries=index._num_entries)
        args.update(change)
        return (args["slot_of"], ids, tokens, counts, m._by_slot, 0, 0, False, m._ntok, m._fast_limit,
                m._next_recycle, m._tail, m._changed_ok, m._stamp, m._keyed, m._salted, m._last_hash,
                args["last_block"], m._width, args["lens"], args["row_group"], args["windows"],
                np.zeros(2, dtype=np.int64), *pool._c_arrays(), *index._c_arrays(), args["entries"])

    same = lambda after: all(np.array_equal(x, y) for x, y in zip(after[:9], before[:9])) and after[9:] == before[9:]
    for bad in (dict(lens=np.empty(2, dtype=np.int32)), dict(last_block=np.zeros((m._ntok.size, 1), np.int32)),
                dict(row_group=np.array([0, 1, 5], dtype=np.intp)),
                dict(windows=np.array([[4, 0, 4, 1]], dtype=np.int64)),
                dict(entries=len(index._holders) - 1)):
        with pytest.raises(ValueError, match="extend_rows"):
            _tables.extend_rows(*arrays(**bad))
        assert same(state()), bad
    free_row = np.array([0, 1, len(m._by_slot)], dtype=np.intp)
    m._free_slots.append(len(m._by_slot))
    m._by_slot.append(None)
    assert _tables.extend_rows(*arrays(slot_of=free_row)) is None
    assert same(state())
    assert _tables.extend_rows(*arrays(slot_of=m.slots_of(ids))) is not None
    assert [m.num_tokens(r) for r in range(3)] == [12, 12, 12]

"""KVCacheManager.extend_many and extend_many_deltas against the same extends applied one at a time.

The batch takes a vectorised fast path and a batched slow path (one allocation
and one index insert for a whole decode step); whatever it does, the result
must be exactly that of ``extend`` called request by request in order: the same
tables, free counts, eviction order, prefix index, events and statistics.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache.allocator import Full, KVCacheError, KVCacheManager, Window
from kvcache.durability import STATE_CODEC

import pytest

BS = 4
SHAPES = {
    "uniform": [Full()],
    "head-wise": [Full(), Window(6, 2), Window(9), Full(), Window(6, 2)],
    "one window": [Window(5)],
    "sink and full": [Window(8, 4), Full()],
}
PREFIXES = [list(range(40)), list(range(1000, 1040)), list(range(12)) + list(range(5000, 5028))]


def twins(shape: str, num_blocks: int, caching: bool, algorithm: str, block_size: int = BS, events: bool = True
          ) -> tuple[KVCacheManager, KVCacheManager]:
    """Two identical managers: one is driven by batches, the other one request at a time."""
    make = lambda: KVCacheManager(num_blocks, block_size, SHAPES[shape], enable_prefix_caching=caching,
                                  hash_algorithm=algorithm, hash_seed=b"twins", enable_events=events)
    return make(), make()


def assert_same(batched: KVCacheManager, single: KVCacheManager, live: list[int]) -> None:
    batched.check_integrity()
    for rid in live:
        assert batched.table(rid).tolist() == single.table(rid).tolist(), f"request {rid}"
        assert batched.num_tokens(rid) == single.num_tokens(rid), f"request {rid}"
    assert batched.num_free_blocks.tolist() == single.num_free_blocks.tolist()
    assert batched.stats() == single.stats()
    assert plain(batched.take_events()) == plain(single.take_events())


def plain(events: list) -> list:
    """Events as comparable tuples (token ids as lists)."""
    return [(type(e).__name__, *(v.tolist() if isinstance(v, np.ndarray) else v for v in dataclasses.astuple(e)))
            for e in events]


decode = st.tuples(st.just("decode"), st.lists(st.integers(0, 10**6), min_size=1, max_size=12, unique=True),
                   st.lists(st.sampled_from([1, 1, 1, 1, 1, 1, 0, 2]), min_size=12, max_size=12), st.booleans(),
                   st.integers(0, 3), st.sampled_from([0, 0, 0, 0, 1, 5]))
step = st.one_of(
    decode, decode, decode,
    st.tuples(st.just("admit"), st.integers(0, 2), st.integers(1, 40), st.lists(st.integers(0, 9), max_size=6),
              st.sampled_from([None, None, "salt"]), st.sampled_from([None, None, None, "lora"])),
    st.tuples(st.just("free"), st.integers(0, 10**6)),
    st.tuples(st.just("repeat"), st.lists(st.integers(0, 10**6), min_size=2, max_size=6)),
    st.tuples(st.just("reset")),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from(sorted(SHAPES)), num_blocks=st.integers(4, 48), caching=st.booleans(),
       algorithm=st.sampled_from(["sha256", "sha256_cbor"]), block_size=st.sampled_from([1, BS]),
       steps=st.lists(step, max_size=60), events=st.booleans())
def test_extend_many_equals_extends_one_at_a_time(shape, num_blocks, caching, algorithm, block_size, steps, events):
    """Random admits, frees and decode batches (evictions, no room, shared prefixes): the twins never differ."""
    batched, single = twins(shape, num_blocks, caching, algorithm, block_size, events)
    live: list[int] = []
    next_id = 0
    for op in steps:
        if op[0] == "admit":
            _, base, keep, suffix, salt, lora = op
            prompt = PREFIXES[base][:keep] + suffix
            a = batched.admit(next_id, prompt, cache_salt=salt, lora=lora)
            b = single.admit(next_id, prompt, cache_salt=salt, lora=lora)
            assert (a is None) == (b is None)
            if a is not None:
                assert a.table.tolist() == b.table.tolist() and a.num_cached_tokens == b.num_cached_tokens
                live.append(next_id)
            next_id += 1
        elif op[0] == "free" and live:
            rid = live.pop(op[1] % len(live))
            batched.free(rid)
            single.free(rid)
        elif op[0] in ("decode", "repeat") and live:
            if op[0] == "decode":
                picks, counts_all, use_deltas, seed, ahead = op[1:]
                rids = list(dict.fromkeys(live[p % len(live)] for p in picks))
                counts = counts_all[: len(rids)]
            else:  # blocks reserved ahead by earlier steps meet the batch paths here
                rids = [live[p % len(live)] for p in op[1]]
                counts, use_deltas, seed, ahead = [1] * len(op[1]), False, 0, 0
            # Same-content decodes (token = seed) make equal chains, so inserts meet hashes already indexed.
            flat = np.full(sum(counts), seed, dtype=np.int64) if seed < 2 else np.arange(sum(counts)) % 7
            want = []
            offset = 0
            for rid, k in zip(rids, counts):
                got = single.extend(rid, flat[offset:offset + k], num_lookahead_tokens=ahead)
                want.append(None if got is None else (got.shape[1], single.changed_columns(rid).tolist()))
                offset += k
            if use_deltas:
                d = batched.extend_many_deltas(rids, flat, counts, num_lookahead_tokens=ahead)
                assert d.lens.tolist() == [-1 if w is None else w[0] for w in want]
                changed = [i for i, w in enumerate(want) if w is not None and w[1]]
                assert d.index.tolist() == changed
                for j, i in enumerate(changed):
                    cols = d.cols[d.offsets[j]:d.offsets[j + 1]]
                    assert cols.tolist() == want[i][1]
                    assert d.vals[:, d.offsets[j]:d.offsets[j + 1]].tolist() == single.table(rids[i])[:, cols].tolist()
            else:
                changes: list[np.ndarray] = []
                tables = batched.extend_many(rids, flat, counts, changes=changes, num_lookahead_tokens=ahead)
                assert [t is None for t in tables] == [w is None for w in want]
                last = {rid: i for i, rid in enumerate(rids)}
                for i, (rid, w) in enumerate(zip(rids, want)):
                    if w is not None:  # each table as its extend made it: the width of that moment
                        assert tables[i].shape[1] == w[0]
                    if w is not None and last[rid] == i:
                        assert changes[i].tolist() == w[1]
                        assert tables[i].tolist() == single.table(rid).tolist()
        elif op[0] == "reset":
            assert batched.reset_prefix_cache() == single.reset_prefix_cache()
        assert_same(batched, single, live)
    copy = STATE_CODEC.loads(STATE_CODEC.dumps(batched))  # a journal snapshot keeps the slot arrays
    assert_same(copy, single, live)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from(sorted(SHAPES)), num_blocks=st.integers(8, 64), caching=st.booleans(),
       algorithm=st.sampled_from(["sha256", "sha256_cbor"]), block_size=st.sampled_from([1, 2, BS]),
       prompts=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 24), st.sampled_from([None, None, "salt"])),
                        min_size=1, max_size=10),
       steps=st.lists(st.tuples(st.lists(st.sampled_from([1] * 8 + [0, 2]), min_size=10, max_size=10),
                                st.integers(0, 9), st.integers(0, 3)), min_size=1, max_size=30),
       events=st.booleans())
def test_decode_steps_equal_extends_one_at_a_time(shape, num_blocks, caching, algorithm, block_size, prompts, steps,
                                                  events):
    """Steps of a running server: every live request decodes (mostly one token), one finishes, one arrives."""
    batched, single = twins(shape, num_blocks, caching, algorithm, block_size, events)
    live: list[int] = []

    def admit(rid: int, base: int, keep: int, salt: str | None) -> None:
        a = batched.admit(rid, PREFIXES[base][:keep], cache_salt=salt)
        b = single.admit(rid, PREFIXES[base][:keep], cache_salt=salt)
        assert (a is None) == (b is None)
        if a is not None:
            live.append(rid)

    for rid, prompt in enumerate(prompts):
        admit(rid, *prompt)
    next_id = len(prompts)
    for n, (counts_all, finish, seed) in enumerate(steps):
        counts = [counts_all[j % 10] for j in range(len(live))]
        flat = np.full(sum(counts), seed, dtype=np.int64) if seed < 2 else np.arange(sum(counts)) % 5
        want = []
        offset = 0
        for rid, k in zip(live, counts):
            got = single.extend(rid, flat[offset:offset + k])
            want.append(-1 if got is None else got.shape[1])
            offset += k
        assert batched.extend_many_deltas(live, flat, counts).lens.tolist() == want
        assert_same(batched, single, live)
        if live and finish < 3:
            rid = live.pop(finish % len(live))
            batched.free(rid)
            single.free(rid)
        admit(next_id, *prompts[n % len(prompts)])
        next_id += 1
        assert_same(batched, single, live)


def test_a_decode_step_changes_only_the_tables_that_open_a_block():
    """256 one-token extends: the requests at a block boundary get one new column each, the rest nothing."""
    m = KVCacheManager(4096, 16, enable_prefix_caching=True, hash_seed=b"x")
    for rid in range(256):
        m.admit(rid, np.arange(rid, rid + 16 + rid % 16))
    d = m.extend_many_deltas(list(range(256)), np.ones(256, dtype=np.int32), np.ones(256, dtype=np.int32))
    opened = [rid for rid in range(256) if rid % 16 == 0]
    assert d.index.tolist() == opened
    assert d.lens.tolist() == [2] * 256
    assert d.offsets.tolist() == list(range(len(opened) + 1))
    assert d.cols.tolist() == [1] * len(opened)
    assert d.vals.tolist() == [[m.table(rid)[0, 1] for rid in opened]]
    assert len(set(d.vals[0].tolist())) == len(opened), "each opened its own block"
    m.check_integrity()


def test_extend_many_deltas_refuses_bad_input_before_any_change():
    m = KVCacheManager(64, 4, hash_seed=b"x")
    m.admit("a", [1, 2, 3])
    for args, field in [((["a", "zz"], [1, 2], [1, 1]), "request_id"), ((["a"], [1, 2], [1]), "counts"),
                        ((["a"], [-1], [1]), "tokens"), ((["a"], [1], [-1]), "counts")]:
        with pytest.raises(KVCacheError, match=field):
            m.extend_many_deltas(*args)
        assert m.num_tokens("a") == 3
    for ahead in (-1, 2**31, 2**63 - 1, 1.5):  # past 2**31 - 1, position arithmetic could wrap
        for call in (m.extend_many_deltas, m.extend_many):
            with pytest.raises(KVCacheError, match="num_lookahead_tokens"):
                call(["a"], [1], [1], num_lookahead_tokens=ahead)
        with pytest.raises(KVCacheError, match="num_lookahead_tokens"):
            m.extend("a", [1], num_lookahead_tokens=ahead)
        assert m.num_tokens("a") == 3 and m.table("a").shape[1] == 1


def test_extend_many_takes_strided_counts_and_any_integer_tokens():
    """Counts and tokens as views or other integer dtypes give the same result as plain arrays."""
    a, b = KVCacheManager(64, 4, hash_seed=b"x"), KVCacheManager(64, 4, hash_seed=b"x")
    for m in (a, b):
        for rid in range(3):
            m.admit(rid, list(range(rid, rid + 3)))
    strided = np.array([[1, 9], [2, 9], [1, 9]], dtype=np.int16)[:, 0]
    got = a.extend_many([0, 1, 2], np.array([5, 6, 7, 8], dtype=np.uint16), strided)
    want = b.extend_many([0, 1, 2], np.array([5, 6, 7, 8], dtype=np.uint32), np.array([1, 2, 1]))
    assert [t.tolist() for t in got] == [t.tolist() for t in want]
    assert [a.num_tokens(r) for r in range(3)] == [b.num_tokens(r) for r in range(3)] == [4, 5, 4]
    assert a.lookup([0, 1, 2, 5, 0]) == b.lookup([0, 1, 2, 5, 0]) == 4


@pytest.mark.parametrize("deltas", [True, False])
def test_uniform_decode_steps_take_the_c_run_and_match_the_general_path(monkeypatch, deltas):
    """A uniform manager's decode steps go through one C pass (_tables.extend_decode), for extend_many_deltas and
    extend_many alike; a manager kept off it (the general numpy path) gives the same tables, free counts and
    prefix hits."""
    from kvcache.allocator import _tables

    calls = []  # the blocks each pass opened
    real = _tables.extend_decode
    monkeypatch.setattr(_tables, "extend_decode", lambda *a: (r := real(*a)) and calls.append(len(r[0]) // 4) or r)
    c_run, general = (KVCacheManager(64, 4, enable_prefix_caching=True, hash_seed=b"x") for _ in range(2))
    general._decodes_in_one_pass = lambda: None
    rng = np.random.default_rng(3)
    for m in (c_run, general):
        for rid in range(6):
            assert m.admit(rid, np.arange(rid * 100, rid * 100 + 3 + rid)) is not None
    rids = list(range(6))
    for step in range(12):
        tokens = rng.integers(0, 50, 6)
        if deltas:
            a, b = c_run.extend_many_deltas(rids, tokens, [1] * 6), general.extend_many_deltas(rids, tokens, [1] * 6)
            for field in ("lens", "index", "offsets", "cols", "vals"):
                assert getattr(a, field).tolist() == getattr(b, field).tolist(), (step, field)
        else:
            a, b = c_run.extend_many(rids, tokens, [1] * 6), general.extend_many(rids, tokens, [1] * 6)
            assert [t.tolist() for t in a] == [t.tolist() for t in b], step
        c_run.check_integrity()
    assert sum(calls) >= 6 and c_run.num_free_blocks.tolist() == general.num_free_blocks.tolist()
    for rid in rids:
        assert c_run.table(rid).tolist() == general.table(rid).tolist()
        prompt = np.arange(rid * 100, rid * 100 + 3 + rid)
        assert c_run.lookup(prompt) == general.lookup(prompt)


@pytest.mark.parametrize("caching,algorithm,events,given", [
    (True, "sha256", False, False), (True, "sha256_cbor", False, False), (False, "sha256", False, False),
    (True, "sha256", True, False), (True, "sha256_cbor", True, False), (True, "sha256", False, True),
    (True, "sha256", True, True)])
def test_extend_decode_matches_the_general_path_through_evictions_widening_and_refusals(monkeypatch, caching,
                                                                                         algorithm, events, given):
    """extend_many_deltas' one C pass (``_tables.extend_decode``) against a twin held to the general path, on a
    pool small enough that decode steps evict cached blocks, tables outgrow their buffers, a step runs out of
    blocks (the pass declines and the general path refuses exactly the requests without one), and shared
    content makes a filled block's hash one the index holds (declined too). With events, both managers report the
    same KV events in the same order (evictions before stores, request by request). With ``given``, the one-pass
    manager gets the ids' rows from ``slots_of`` instead of looking them up itself."""
    from kvcache.allocator import _tables

    outcomes: list[str] = []
    real = _tables.extend_decode

    def spy(*args):
        got = real(*args)
        if got is None:
            outcomes.append("declined")
        else:
            outcomes.extend(["ok"] + ["evicted"] * (got[4] > 0) + ["widened"] * bool(got[3]) + ["filled"] * (got[8] > 0))
        return got

    monkeypatch.setattr(_tables, "extend_decode", spy)
    make = lambda: KVCacheManager(40, 4, enable_prefix_caching=caching, hash_algorithm=algorithm, hash_seed=b"d",
                                  enable_events=events)
    one_pass, general = make(), make()
    monkeypatch.setattr(general, "_decodes_in_one_pass", lambda: None)
    rng = np.random.default_rng(5)
    live: list[int] = []
    seen_events: set[str] = set()
    for step in range(160):
        if step % 12 == 0 and step < 120:  # admit three, free two: freed blocks stay cached until evicted; then
            # the live requests only decode, until a step runs out of blocks
            for rid in range(step, step + 3):
                prompt = np.arange(rid % 5, rid % 5 + 5 + rid % 4, dtype=np.int32)
                a, b = one_pass.admit(rid, prompt), general.admit(rid, prompt)
                assert (a is None) == (b is None)
                if a is not None:
                    live.append(rid)
            for _ in range(min(2, len(live) - 1)):
                rid = live.pop(0)
                one_pass.free(rid)
                general.free(rid)
        if not live:
            continue
        same = step % 7 == 0  # every request decodes token 3: equal chains meet hashes already indexed
        tokens = np.full(len(live), 3, dtype=np.int32) if same else rng.integers(0, 9, len(live)).astype(np.int32)
        counts = np.ones(len(live), dtype=np.int32)
        slots = one_pass.slots_of(list(live)) if given else None
        assert not given or slots.tolist() == [one_pass._slot_of[rid] for rid in live]
        a = one_pass.extend_many_deltas(list(live), tokens, counts, slots=slots)
        b = general.extend_many_deltas(list(live), tokens, counts)
        for field in ("lens", "index", "offsets", "cols", "vals"):
            assert getattr(a, field).tolist() == getattr(b, field).tolist(), (step, field)
        refused = [rid for rid, width in zip(list(live), a.lens.tolist()) if width < 0]
        for rid in refused:  # as a scheduler would: preempt what got no block
            live.remove(rid)
            one_pass.free(rid)
            general.free(rid)
        one_pass.check_integrity()
        assert one_pass.num_free_blocks.tolist() == general.num_free_blocks.tolist()
        assert one_pass.stats() == general.stats()
        got = plain(one_pass.take_events())
        assert got == plain(general.take_events()), step
        seen_events.update(event[0] for event in got)
        for rid in live:
            assert one_pass.table(rid).tolist() == general.table(rid).tolist()
            assert one_pass.num_tokens(rid) == general.num_tokens(rid)
    for probe in ([0, 1, 2, 3, 4, 5, 6, 7], [3, 4, 5, 6, 7, 3, 3, 3, 3]):
        assert one_pass.lookup(probe) == general.lookup(probe)
    want = {"ok", "declined", "widened"} | ({"evicted", "filled"} if caching else set())
    assert want <= set(outcomes), outcomes
    if events:
        assert {"BlockStored", "BlockRemoved"} <= seen_events, seen_events


def test_extend_decode_refuses_inconsistent_arrays_and_changes_nothing():
    """The pass checks its arrays' sizes before it writes: a wrong-sized output, or an index without room for the
    keys, is a ValueError and leaves the manager as it was."""
    from kvcache.allocator import _tables

    m = KVCacheManager(32, 4, enable_prefix_caching=True, hash_seed=b"x", enable_events=False)
    for rid in range(3):
        m.admit(rid, np.arange(4 * rid, 4 * rid + 3, dtype=np.uint32))  # the next token fills block 0
    pool, index = m._pool, m._index
    state = lambda: [a.copy() for a in (m._tail, m._ntok, m._width, m._last_hash, pool._ref, pool._cached,
                                        index._slots)] + [index._num_spare, index._num_entries]
    before = state()
    ids, tokens, counts = [0, 1, 2], np.array([7, 8, 9], dtype=np.uint32), np.ones(3, dtype=np.int64)
    index.reserve(3, 3)
    arrays = lambda lens, entries: (m._slot_of, ids, tokens, counts, m._by_slot, 0, m._ntok, m._fast_limit,
                                    m._next_recycle, m._tail, m._changed_ok, m._stamp, m._keyed, m._salted,
                                    m._last_hash, m._last_block, m._width, lens, *pool._c_arrays(),
                                    *index._c_arrays(), entries)
    for lens, entries in ((np.empty(2, dtype=np.int32), index._num_entries),  # one width short
                          (np.empty(3, dtype=np.int32), len(index._holders) - 1)):  # no room for 3 more keys
        with pytest.raises(ValueError, match="extend_decode"):
            _tables.extend_decode(*arrays(lens, entries))
        after = state()
        assert all(np.array_equal(x, y) for x, y in zip(after[:7], before[:7])) and after[7:] == before[7:]
    given = lambda slots: (slots, *arrays(np.empty(3, dtype=np.int32), index._num_entries)[1:])
    with pytest.raises(ValueError, match="one intp per id"):  # given rows, one short
        _tables.extend_decode(*given(np.array([0, 1], dtype=np.intp)))
    free_row = np.array([0, 1, len(m._by_slot)], dtype=np.intp)  # a row no request holds: left to the general path
    m._free_slots.append(len(m._by_slot))
    m._by_slot.append(None)
    assert _tables.extend_decode(*given(free_row)) is None
    after = state()
    assert all(np.array_equal(x, y) for x, y in zip(after[:7], before[:7])) and after[7:] == before[7:]
    assert m.slots_of([0, 1, 5]) is None and m.slots_of([0, 1, 2], {2: True}) is None
    assert _tables.extend_decode(*given(m.slots_of(ids))) is not None
    assert [m.num_tokens(r) for r in range(3)] == [4, 4, 4]


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("events", [False, True])
@pytest.mark.parametrize("rows", ["uniform", "head-wise"])
def test_decode_steps_with_lookahead_match_extends_one_at_a_time_on_both_batch_paths(monkeypatch, block_size, events,
                                                                                     rows):
    """Decode steps whose tables also cover positions ahead (num_lookahead_tokens, changing from step to step):
    the one C pass and the numpy run (a twin held off the pass) each equal ``extend`` one request at a time. A
    request's token then fills a block behind the one it opens, or one of the blocks it reserved; a lookahead
    that grew needs several blocks at once (the pass declines it, the run hands it to ``extend``). A finished
    request's tokens, admitted again, hit the same blocks on all three. Head-wise rows (window heads giving
    blocks back, full heads) take the pass over row groups (``_tables.extend_rows``), uniform ones
    ``_tables.extend_decode``."""
    from kvcache.allocator import _tables

    passes: list[tuple[int, bool, int]] = []  # (lookahead, declined, blocks filled)
    name = "extend_decode" if rows == "uniform" else "extend_rows"
    real = getattr(_tables, name)

    def spy(*args):
        got = real(*args)
        if name == "extend_decode":
            passes.append((args[-1], got is None, 0 if got is None else got[8]))
        else:
            passes.append((args[6], got is None, 0 if got is None else got[9]))
        return got

    monkeypatch.setattr(_tables, name, spy)
    num_blocks = 240 // block_size  # room for the live requests, with freed blocks evicted as it fills
    policies = [Full()] if rows == "uniform" else [Window(7, 2), Full(), Window(7, 2), Window(12)]
    make = lambda: KVCacheManager(num_blocks, block_size, policies, enable_prefix_caching=True, hash_seed=b"ahead",
                                  enable_events=events)
    one_pass, numpy_run, single = make(), make(), make()
    monkeypatch.setattr(numpy_run, "_decodes_in_one_pass", lambda: None)
    managers = (one_pass, numpy_run, single)
    rng = np.random.default_rng(11)
    tokens_of: dict[int, list[int]] = {}

    def admit(rid: int, prompt: list[int]) -> int:
        got = {m.admit(rid, prompt).num_cached_tokens for m in managers}
        assert len(got) == 1, got
        tokens_of[rid] = list(prompt)
        return got.pop()

    live = list(range(5))
    for rid in live:
        admit(rid, rng.integers(0, 1000, 3 + 2 * rid).tolist())
    aheads = [1] * 9 + [2, 2, 0, 0, 1, 5, 1, 1, 3, 0, 1] * 2
    for step, ahead in enumerate(aheads):
        tokens = rng.integers(0, 1000, len(live))
        want = [single.extend(rid, [int(t)], num_lookahead_tokens=ahead) for rid, t in zip(live, tokens)]
        d = one_pass.extend_many_deltas(live, tokens, np.ones(len(live), np.int32), num_lookahead_tokens=ahead)
        tables = numpy_run.extend_many(live, tokens, [1] * len(live), num_lookahead_tokens=ahead)
        assert d.lens.tolist() == [-1 if w is None else w.shape[1] for w in want], step
        assert [t is None for t in tables] == [w is None for w in want], step
        events_single = plain(single.take_events())
        for rid, t in zip(live, tokens.tolist()):
            tokens_of[rid].append(t)
        for m in (one_pass, numpy_run):
            m.check_integrity()
            for rid in live:
                assert m.table(rid).tolist() == single.table(rid).tolist(), (step, rid)
            assert m.num_free_blocks.tolist() == single.num_free_blocks.tolist(), step
            assert m.stats() == single.stats(), step
            assert plain(m.take_events()) == events_single, step
        if step % 7 == 6:  # one ends; its tokens come back as a new request and hit its filled blocks
            rid = live.pop(0)
            for m in managers:
                m.free(rid)
            new = max(live) + 1
            assert admit(new, tokens_of[rid] + [7]) >= len(tokens_of[rid]) // block_size * block_size - block_size
            live.append(new)
    assert any(ahead and not declined and filled for ahead, declined, filled in passes), "a pass filled behind"
    assert any(ahead and declined for ahead, declined, _ in passes), "a grown lookahead was declined"

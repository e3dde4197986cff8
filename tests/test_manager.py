"""KVCacheManager: admit/extend/free, prefix hits, sliding-window recycling, and a model-based test."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcache.allocator import CacheSpec, Full, KVCacheError, KVCacheManager, Window
from kvcache.allocator.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcache.allocator.prefix import BlockHasher
from kvcache.allocator.swa import needed_blocks
from kvcache.durability import STATE_CODEC
from reference_manager import ReferenceManager

BS = 4


def make_manager(num_blocks: int = 16, rows=(Full(),), block_size: int = BS, **options) -> KVCacheManager:
    options.setdefault("hash_seed", b"test")
    return KVCacheManager(num_blocks, block_size, rows, **options)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


# -- admission and growth ------------------------------------------------------------------------

def test_fresh_admit_allocates_blocks_in_order():
    m = make_manager()
    adm = m.admit("a", tokens(10))
    assert adm.num_cached_tokens == 0 and adm.num_tokens == 10
    assert adm.table.tolist() == [[0, 1, 2]]
    assert m.num_free_blocks.tolist() == [13]
    m.check_integrity()


@pytest.mark.parametrize("caching", [False, True])
def test_a_prompt_gets_its_blocks_in_ascending_order_also_when_they_were_freed_in_any_order(caching):
    """Reused blocks come back sorted (the stack and the LRU ring would hand them out reversed or mixed)."""
    m = make_manager(num_blocks=14, enable_prefix_caching=caching)
    for rid, n in (("a", 14), ("b", 9), ("c", 23)):  # 4 + 3 + 6 of the 14 blocks
        m.admit(rid, tokens(n, 1000 * len(rid) + n))
    m.free("b")
    m.free("a")
    m.free("c")
    table = m.admit("d", tokens(52, 50_000)).table[0]
    assert sorted(table.tolist()) == table.tolist() and len(set(table.tolist())) == 13
    m.check_integrity()


def test_extend_allocates_only_when_a_block_fills():
    m = make_manager()
    m.admit("a", tokens(7))
    assert m.extend("a", [100]).tolist() == [[0, 1]]
    assert m.extend("a", [101]).tolist() == [[0, 1, 2]]
    assert m.num_tokens("a") == 9
    m.check_integrity()


def test_free_returns_every_block():
    m = make_manager(rows=[Full(), Window(4), Window(8, 4)], enable_prefix_caching=False)
    m.admit("a", tokens(30))
    for step in range(20):
        m.extend("a", [step])
    m.free("a")
    assert m.num_free_blocks.tolist() == [16, 16, 16]
    assert "a" not in m and len(m) == 0
    m.check_integrity()


def test_failed_admit_returns_none_and_changes_nothing():
    m = make_manager(num_blocks=4)
    m.admit("a", tokens(8))
    before = m.num_free_blocks.copy()
    assert m.admit("b", tokens(12, 1000)) is None
    assert "b" not in m
    assert m.num_free_blocks.tolist() == before.tolist()
    assert m.admit("b", tokens(8, 1000)).table.tolist() == [[2, 3]]
    m.check_integrity()


def test_failed_extend_returns_none_and_changes_nothing():
    m = make_manager(num_blocks=2, enable_prefix_caching=False)
    m.admit("a", tokens(8))
    assert m.extend("a", [1]) is None
    assert m.num_tokens("a") == 8
    assert m.table("a").tolist() == [[0, 1]]


def test_chunked_admit_covers_num_tokens_and_extend_continues():
    m = make_manager()
    adm = m.admit("a", tokens(10), num_tokens=5)
    assert adm.num_tokens == 5 and adm.table.shape == (1, 2)
    m.extend("a", tokens(5, 5))
    assert m.num_tokens("a") == 10


def test_can_admit_counts_blocks_of_every_row():
    m = make_manager(num_blocks=4, rows=[Full(), Full()])
    assert m.can_admit(16) and not m.can_admit(17)
    m.admit("a", tokens(5))
    assert m.can_admit(8) and not m.can_admit(9)


def test_tables_are_read_only_views():
    m = make_manager()
    table = m.admit("a", tokens(5)).table
    assert table.dtype == np.int32
    with pytest.raises(ValueError):
        table[0, 0] = 7


def test_numpy_tokens_of_any_integer_dtype_are_accepted():
    m = make_manager()
    m.admit("a", np.arange(9, dtype=np.int64))
    m.extend("a", np.array([3], dtype=np.uint16))
    assert m.num_tokens("a") == 10


def test_extend_many_gives_each_request_its_tokens_in_order():
    m = make_manager(rows=[Full(), Window(4)])
    m.admit("a", tokens(3))
    m.admit("b", tokens(4, 100))
    tables = m.extend_many(["a", "b", "a"], np.array([7, 8, 9, 10]), [1, 2, 1])
    assert m.num_tokens("a") == 5 and m.num_tokens("b") == 6
    assert tables[2].tolist() == m.table("a").tolist()
    assert m.lookup(tokens(3) + [7, 10, 0]) == 4   # a's first block 0,1,2,7 is full and cached
    assert m.changed_columns("a").tolist() == [1]   # the second extend of a opened block 1


def test_extend_many_checks_everything_before_changing_anything():
    m = make_manager()
    m.admit("a", tokens(3))
    for args, message in [((["a", "zz"], [1, 2], [1, 1]), "not admitted"),
                          ((["a"], [1, 2], [1]), "counts"),
                          ((["a"], [1], [-1]), "counts"),
                          ((["a"], [-1], [1]), "outside")]:
        with pytest.raises(KVCacheError, match=message):
            m.extend_many(*args)
        assert m.num_tokens("a") == 3


# -- caller mistakes -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: m.admit("a", tokens(3)), "already admitted"),
        (lambda m: m.extend("zzz", [1]), "not admitted"),
        (lambda m: m.free("zzz"), "not admitted"),
        (lambda m: m.table("zzz"), "not admitted"),
        (lambda m: m.admit("b", []), "at least one token"),
        (lambda m: m.admit("b", [1.5, 2.0]), "tokens"),
        (lambda m: m.admit("b", ["x"]), "tokens"),
        (lambda m: m.admit("b", [-1, 2]), "outside"),
        (lambda m: m.admit("b", [2**32]), "outside"),
        (lambda m: m.admit("b", np.zeros((2, 2), dtype=np.int32)), "1-D"),
        (lambda m: m.admit("b", np.array([0.5])), "integer"),
        (lambda m: m.admit("b", "hello"), "tokens"),
        (lambda m: m.admit("b", tokens(3), num_tokens=4), "num_tokens"),
        (lambda m: m.admit("b", tokens(3), num_tokens=0), "num_tokens"),
        (lambda m: m.extend("a", [1], num_computed_tokens=99), "num_computed_tokens"),
        (lambda m: m.extend("a", [1.0]), "tokens"),
    ],
)
def test_caller_mistakes_raise_and_change_nothing(call, message):
    m = make_manager()
    m.admit("a", tokens(6))
    free, table = m.num_free_blocks.copy(), m.table("a").copy()
    with pytest.raises(KVCacheError, match=message):
        call(m)
    assert m.num_free_blocks.tolist() == free.tolist()
    assert m.table("a").tolist() == table.tolist()
    assert m.num_tokens("a") == 6
    m.check_integrity()


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(num_blocks=0), "num_blocks"),
        (dict(block_size=0), "block_size"),
        (dict(rows=[]), "rows"),
        (dict(rows=["full"]), r"rows\[0\]"),
        (dict(hash_algorithm="md5"), "algorithm"),
    ],
)
def test_bad_construction_is_a_clear_error(args, message):
    with pytest.raises(KVCacheError, match=message):
        make_manager(**args)


# -- prefix caching ------------------------------------------------------------------------------

def test_identical_prompts_hit_all_but_the_last_token():
    """A prompt of exactly k blocks hits k-1 blocks: the last token is always computed."""
    m = make_manager()
    first = m.admit("a", tokens(12)).table
    m.free("a")
    adm = m.admit("b", tokens(12))
    assert adm.num_cached_tokens == 8
    assert adm.table[0, :2].tolist() == first[0, :2].tolist()


def test_a_shared_prefix_hits_while_the_first_request_runs():
    m = make_manager()
    m.admit("a", tokens(9))
    adm = m.admit("b", tokens(8) + [999, 998])
    assert adm.num_cached_tokens == 8
    assert adm.table.tolist() == [[0, 1, 3]]
    m.check_integrity()


def test_partial_blocks_are_never_cached():
    m = make_manager()
    m.admit("a", tokens(7))
    m.free("a")
    assert m.stats().num_cached_hashes == 1
    assert m.admit("b", tokens(7) + [50]).num_cached_tokens == 4


def test_salt_changes_the_whole_chain():
    m = make_manager()
    m.admit("a", tokens(9), cache_salt="tenant-1")
    m.free("a")
    assert m.admit("b", tokens(9), cache_salt="tenant-2").num_cached_tokens == 0
    assert m.admit("c", tokens(9)).num_cached_tokens == 0
    assert m.admit("d", tokens(9), cache_salt="tenant-1").num_cached_tokens == 8


def test_disabled_prefix_caching_never_hits():
    m = make_manager(enable_prefix_caching=False)
    m.admit("a", tokens(9))
    m.free("a")
    assert m.admit("b", tokens(9)).num_cached_tokens == 0
    assert m.lookup(tokens(9)) == 0


def test_lookup_reports_the_hit_without_taking_it():
    m = make_manager()
    m.admit("a", tokens(9))
    free = m.num_free_blocks.copy()
    assert m.lookup(tokens(9)) == 8
    assert m.num_free_blocks.tolist() == free.tolist()


def test_eviction_is_lru_among_unreferenced_cached_blocks():
    """Uncached free blocks go first; then cached ones, oldest freed first, tail of a prefix first."""
    m = make_manager(num_blocks=6)
    m.admit("a", tokens(9))            # blocks 0,1,2 (0,1 full and cached)
    m.admit("b", tokens(9, 100))       # blocks 3,4,5 (3,4 cached)
    m.free("a")                        # released 2, then 1, 0 into the LRU
    m.free("b")                        # released 5, then 4, 3
    adm = m.admit("c", tokens(9, 500))
    # Uncached free blocks 5 and 2, then the oldest cached block: a's tail, block 1; the table has them sorted.
    assert adm.table.tolist() == [[1, 2, 5]]
    assert m.lookup(tokens(9)) == 4     # a's chain lost its second block, keeps the first
    assert m.lookup(tokens(9, 100)) == 8
    m.check_integrity()


def test_a_block_in_use_is_never_evicted():
    """a holds cached blocks 0, 1 and partial block 2; b fits only once a is freed, and then
    takes the uncached free blocks 2, 3 before touching a's cached prefix."""
    m = make_manager(num_blocks=4)
    m.admit("a", tokens(8))
    m.extend("a", [1])
    assert m.admit("b", tokens(8, 100)) is None
    m.free("a")
    assert m.admit("b", tokens(8, 100)).table.tolist() == [[2, 3]]
    assert m.lookup(tokens(9)) == 8


def test_reset_prefix_cache_forgets_every_hash():
    m = make_manager(enable_events=True)
    m.admit("a", tokens(9))
    m.free("a")
    assert m.reset_prefix_cache() == 2
    assert m.lookup(tokens(9)) == 0
    assert isinstance(m.take_events()[-1], AllBlocksCleared)
    m.check_integrity()


def test_events_report_stored_and_removed_hashes_of_the_group():
    m = make_manager(num_blocks=3, enable_events=True)
    m.admit("a", tokens(9))
    stored = m.take_events()
    assert len(stored) == 1 and isinstance(stored[0], BlockStored)
    hashes = BlockHasher(BS, seed=b"test").hash_blocks(tokens(8))
    assert stored[0].block_hashes == tuple(hashes)
    assert stored[0].parent_block_hash is None and (stored[0].group, stored[0].window) == (0, None)
    assert stored[0].token_ids.tolist() == tokens(8) and stored[0].extra_keys == (None, None)
    m.free("a")
    m.admit("b", tokens(9, 100))
    removed = [e for e in m.take_events() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [(hashes[1], hashes[0])]


def test_stats_count_prefix_hits():
    m = make_manager()
    m.admit("a", tokens(9))
    m.admit("b", tokens(9))
    s = m.stats()
    assert (s.num_requests, s.prefix_queries, s.prefix_hit_requests) == (2, 2, 1)
    assert (s.prefix_queried_tokens, s.prefix_hit_tokens) == (18, 8)


def test_stats_count_evicted_and_recycled_row_blocks():
    m = make_manager(num_blocks=4, rows=[Full(), Window(4), Window(4)])
    m.admit("a", tokens(8))
    m.extend("a", tokens(5, 50))      # query 8 sees 5..8: both window rows give back block 0
    assert m.stats().recycled_blocks == 2
    m.free("a")
    m.admit("b", tokens(16, 900))     # reuses every cached block of all 3 rows
    assert m.stats().evicted_blocks > 0


# -- sliding window ------------------------------------------------------------------------------

def test_window_rows_recycle_dead_blocks_past_the_sink():
    """Window(8, sink 4), block 4: after 20 tokens the query at 20 sees 13..20 and 0..3.

        token  0..3 | 4..7 | 8..11 | 12..15 | 16..19 | 20
        block  0    | 1    | 2     | 3      | 4      | 5
               sink | dead | dead  | live   | live   | new
    """
    m = make_manager(rows=[Full(), Window(8, 4)], enable_prefix_caching=False)
    m.admit("a", tokens(20))
    table = m.extend("a", [7])
    assert table[0].tolist() == [0, 1, 2, 3, 4, 5]
    # Blocks 2 then 1 went back (tail first), and the new block 5 reuses the last released: 1.
    assert table[1].tolist() == [0, -1, -1, 3, 4, 1]
    assert m.num_free_blocks.tolist() == [10, 12]
    m.check_integrity()


def test_num_computed_tokens_holds_back_blocks_a_step_in_flight_reads():
    m = make_manager(rows=[Window(4)], enable_prefix_caching=False)
    m.admit("a", tokens(16))
    assert m.extend("a", [1], num_computed_tokens=8).tolist() == [[-1, 1, 2, 3, 0]]
    assert m.extend("a", [], num_computed_tokens=17).tolist() == [[-1, -1, -1, 3, 0]]


def test_usage_is_exact_and_fractional():
    m = make_manager(num_blocks=1000, rows=[Full(), Window(4)])
    m.admit("a", tokens(1))
    u = m.usage
    assert u.per_row.tolist() == [0.001, 0.001]
    assert u.max == 0.001


def test_head_wise_hit_with_window_rows_reuses_sink_and_window_blocks():
    """Rows [Full, Window(8, sink 4)], block 4: a 21-token prompt hits 5 blocks; the window row
    takes only the sink block 0 and blocks 3, 4 (tokens 13..19 seen by query 20)."""
    m = make_manager(num_blocks=32, rows=[Full(), Window(8, 4)])
    first = m.admit("a", tokens(21)).table
    m.free("a")
    adm = m.admit("b", tokens(21))
    assert adm.num_cached_tokens == 20
    assert adm.table[0, :5].tolist() == first[0, :5].tolist()
    assert adm.table[1, :5].tolist() == [first[1, 0], -1, -1, first[1, 3], first[1, 4]]
    m.check_integrity()


def test_window_hit_is_shortened_when_window_blocks_were_reused():
    """The window row lost block 3 of the cached prompt: the hit stops where it is still usable."""
    m = make_manager(num_blocks=8, rows=[Full(), Window(4)])
    m.admit("a", tokens(17))
    for t in range(4):
        m.extend("a", [t])  # window row gives back blocks as the request grows
    m.free("a")
    m.admit("x", tokens(13, 900))  # reuses free blocks, evicting some cached ones
    m.free("x")
    reference = ReferenceManager(8, BS, [Full(), Window(4)], BlockHasher(BS, seed=b"test"))
    reference.admit("a", tokens(17))
    for t in range(4):
        reference.extend("a", [t])
    reference.free("a")
    reference.admit("x", tokens(13, 900))
    reference.free("x")
    expected = reference.admit("b", tokens(22))
    adm = m.admit("b", tokens(22))
    assert (adm.num_cached_tokens, adm.table.tolist()) == expected[:2]
    m.check_integrity()


def test_from_spec_builds_one_row_per_kv_head_of_the_rank():
    spec = CacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, block_size=16, tp_size=2)
    m = KVCacheManager.from_spec(spec, 64, head_wise=True, policies=[Full(), Full(), Window(64), Window(64)])
    assert m.num_rows == 4 and m.block_size == 16
    assert KVCacheManager.from_spec(spec, 64).num_rows == 1
    with pytest.raises(KVCacheError, match="policies"):
        KVCacheManager.from_spec(spec, 64, head_wise=True, policies=[Full()])


def test_a_manager_from_a_journal_snapshot_carries_on_exactly_like_the_original():
    """A journal snapshot holds the manager: the copy must behave identically from there on."""
    rng = np.random.default_rng(3)
    original = make_manager(num_blocks=40, rows=[Window(8, 4), Full(), Window(8, 4)])
    live: list[int] = []

    def step(m: KVCacheManager, i: int, r: np.random.Generator) -> object:
        kind = r.integers(3) if live else 0
        if kind == 0:
            return m.admit(i, r.integers(0, 5, r.integers(1, 20)))
        if kind == 1:
            return m.extend(live[r.integers(len(live))], r.integers(0, 5, r.integers(0, 6)))
        return m.free(live[r.integers(len(live))])

    for i in range(60):
        step(original, i, rng)
        live[:] = [rid for rid in range(i + 1) if rid in original]
    copy = STATE_CODEC.loads(STATE_CODEC.dumps(original))
    copy.check_integrity()
    for i in range(60, 160):
        state = rng.bit_generator.state
        a = step(original, i, rng)
        rng.bit_generator.state = state
        b = step(copy, i, rng)
        assert (a is None) == (b is None)
        live[:] = [rid for rid in range(i + 1) if rid in original]
        assert [rid for rid in range(i + 1) if rid in copy] == live
        for rid in live:
            assert np.array_equal(original.table(rid), copy.table(rid))
        assert original.num_free_blocks.tolist() == copy.num_free_blocks.tolist()
    copy.check_integrity()


# -- model-based: the fast manager against the plain-Python reference ------------------------------

VOCAB_PREFIXES = [tokens(40, 0), tokens(40, 1000), tokens(12, 0) + tokens(28, 5000)]


class ManagerMachine(RuleBasedStateMachine):
    """Random admit/extend/free/reset sequences; after every step tables and free counts match."""

    rows: list = [Full()]
    events = True

    @initialize(num_blocks=st.integers(6, 40), caching=st.booleans())
    def setup(self, num_blocks, caching):
        hasher = BlockHasher(BS, seed=b"machine") if caching else None
        self.fast = KVCacheManager(num_blocks, BS, self.rows, enable_prefix_caching=caching,
                                   hash_seed=b"machine", enable_events=self.events)
        self.ref = ReferenceManager(num_blocks, BS, self.rows, hasher)
        self.num_blocks = num_blocks
        self.next_id = 0
        self.live: list[int] = []

    @rule(data=st.data())
    def admit(self, data):
        base = data.draw(st.sampled_from(VOCAB_PREFIXES))
        keep = data.draw(st.integers(1, len(base)))
        suffix = data.draw(st.lists(st.integers(0, 50), max_size=6))
        prompt = base[:keep] + suffix
        salt = data.draw(st.sampled_from([None, None, "s"]))
        chunk = data.draw(st.one_of(st.none(), st.integers(1, len(prompt))))
        rid = self.next_id
        self.next_id += 1
        got = self.fast.admit(rid, np.array(prompt), cache_salt=salt, num_tokens=chunk)
        want = self.ref.admit(rid, prompt, salt=salt, num_tokens=chunk)
        if want is None:
            assert got is None
            return
        assert got is not None
        assert (got.num_cached_tokens, got.table.tolist(), got.num_tokens) == want
        assert got.num_cached_tokens % BS == 0 and got.num_cached_tokens <= len(prompt) - 1
        self.live.append(rid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def extend(self, data):
        rid = data.draw(st.sampled_from(self.live))
        new = data.draw(st.lists(st.integers(0, 50), min_size=0, max_size=3 * BS))
        current = self.fast.num_tokens(rid)
        done = data.draw(st.one_of(st.none(), st.integers(max(0, current - 2 * BS), current)))
        ahead = data.draw(st.sampled_from([0, 0, 0, 1, 2 * BS]))
        before = self.fast.table(rid).copy()
        got = self.fast.extend(rid, new, num_computed_tokens=done, num_lookahead_tokens=ahead)
        want = self.ref.extend(rid, new, num_computed=done, lookahead=ahead)
        if want is None:
            assert got is None
        else:
            assert got is not None and got.tolist() == want
            # The changed columns alone turn the old table into the new one (what workers receive).
            cols = self.fast.changed_columns(rid)
            rebuilt = np.full(got.shape, -1, dtype=np.int32)
            rebuilt[:, : before.shape[1]] = before
            rebuilt[:, cols] = got[:, cols]
            assert rebuilt.tolist() == want

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def extend_many(self, data):
        """A decode-style batch: several requests (repeats allowed) gain a few tokens each."""
        rids = data.draw(st.lists(st.sampled_from(self.live), min_size=1, max_size=5))
        counts = data.draw(st.lists(st.integers(0, 2), min_size=len(rids), max_size=len(rids)))
        flat = data.draw(st.lists(st.integers(0, 50), min_size=sum(counts), max_size=sum(counts)))
        ahead = data.draw(st.sampled_from([0, 0, 0, 1]))
        got = self.fast.extend_many(rids, np.array(flat, dtype=np.int64), counts, num_lookahead_tokens=ahead)
        offset = 0
        last = {rid: i for i, rid in enumerate(rids)}  # tables are live views: compare a request's last one
        for i, (rid, k, table) in enumerate(zip(rids, counts, got)):
            want = self.ref.extend(rid, flat[offset:offset + k], lookahead=ahead)
            offset += k
            if want is None:
                assert table is None
            elif last[rid] == i:
                assert table is not None and table.tolist() == want

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(self.live))
        self.live.remove(rid)
        self.fast.free(rid)
        self.ref.free(rid)

    @rule()
    def reset(self):
        self.fast.reset_prefix_cache()
        self.ref.reset_prefix_cache()

    @invariant()
    def consistent(self):
        if not hasattr(self, "fast"):
            return
        self.fast.check_integrity()
        assert self.fast.num_free_blocks.tolist() == self.ref.num_free()
        self.fast.take_events()

    def teardown(self):
        if not hasattr(self, "fast"):
            return
        for rid in list(self.live):
            self.fast.free(rid)
        self.fast.check_integrity()
        assert self.fast.num_free_blocks.tolist() == [self.num_blocks] * len(self.rows)


class UniformMachine(ManagerMachine):
    rows = [Full()]


class HeadWiseMachine(ManagerMachine):
    rows = [Full(), Window(6, 2), Window(9), Full(), Window(6, 2)]


MACHINE_SETTINGS = settings(max_examples=150, stateful_step_count=30, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])
TestUniformManager = UniformMachine.TestCase
TestUniformManager.settings = MACHINE_SETTINGS
TestHeadWiseManager = HeadWiseMachine.TestCase
TestHeadWiseManager.settings = MACHINE_SETTINGS


def test_discard_drops_unwritten_blocks_from_the_prefix_index_but_keeps_the_hit():
    """A failed transfer: blocks past the hit were never written, so nobody may hit them; the hit stays cached."""
    m = KVCacheManager(num_blocks=16, block_size=4)
    prompt = np.arange(17)
    m.admit("a", prompt[:9])
    m.free("a")  # blocks of tokens [0, 8) cached
    adm = m.admit("b", prompt)
    assert adm.num_cached_tokens == 8
    m.discard("b", first_block=adm.num_cached_tokens // 4)
    m.check_integrity()
    assert m.lookup(prompt) == 8
    assert m.num_free_blocks.tolist() == [16]
    again = m.admit("c", prompt)
    assert again.num_cached_tokens == 8


def test_discard_of_a_shared_block_uncaches_it_for_later_requests_only():
    m = KVCacheManager(num_blocks=8, block_size=4)
    m.admit("a", np.arange(9))
    m.admit("b", np.arange(9))  # hits a's two blocks, which a never filled
    m.discard("a")
    m.check_integrity()
    assert m.lookup(np.arange(9)) == 0
    m.free("b")
    m.check_integrity()
    assert m.lookup(np.arange(9)) == 0 and m.num_free_blocks.tolist() == [8]
    with pytest.raises(KVCacheError, match="not admitted"):
        m.discard("a")


def test_shed_window_gives_back_blocks_behind_the_window_and_uncaches_those_not_held_before():
    """A PD decode reservation of 40 tokens (Window(8, sink 4), block 4): blocks 1..7 go back at once; those
    past the node's own hit (block 6 on) leave the prefix index, since the sender may never write them.
    """
    rows = [Full(), Window(8, 4)]
    prompt = np.arange(40)
    m = make_manager(32, rows)
    m.admit("x", prompt[:24])
    m.free("x")  # 6 blocks cached on both rows
    adm = m.admit("a", prompt)
    assert adm.num_cached_tokens == 24
    assert adm.table[1].tolist() == [0, -1, -1, -1, 4, 5, 6, 7, 8, 9]  # the hit keeps sink and window only
    changed = m.shed_window("a", first_block=6)
    m.check_integrity()
    assert changed.tolist() == [4, 5, 6, 7]  # 1..3 the hit already skipped
    assert m.table("a")[1].tolist() == [0, -1, -1, -1, -1, -1, -1, -1, 8, 9]
    assert m.table("a")[0].tolist() == list(range(10))
    assert m.changed_columns("a").tolist() == [4, 5, 6, 7]
    assert m.num_free_blocks.tolist() == [22, 29]
    assert m.lookup(prompt[:25]) == 24  # blocks 4, 5 were this node's own hit: still cached
    assert m.lookup(prompt[:33]) == 24  # blocks 6, 7 never arrived: gone from the index
    twin = make_manager(32, rows)
    twin.admit("x", prompt[:24])
    twin.free("x")
    twin.admit("a", prompt)
    twin.extend("a", [99], num_computed_tokens=40)  # the same blocks recycled the ordinary way stay cached
    assert twin.lookup(prompt[:33]) == 32
    m.extend("a", [99], num_computed_tokens=40)  # nothing more to give back
    assert m.table("a")[1].tolist() == [0, -1, -1, -1, -1, -1, -1, -1, 8, 9, 6]  # 6 went back uncached: reused first
    m.free("a")
    m.check_integrity()
    assert m.num_free_blocks.tolist() == [32, 32]


def test_shed_window_without_window_rows_changes_nothing():
    m = make_manager(8)
    m.admit("a", np.arange(9))
    assert m.shed_window("a").size == 0
    assert m.table("a").tolist() == [[0, 1, 2]] and m.num_free_blocks.tolist() == [5]
    with pytest.raises(KVCacheError, match="first_block"):
        m.shed_window("a", first_block=-1)


class UniformNoEventsMachine(ManagerMachine):
    """The uniform machine without KV events: admits commit in one C pass (_tables.admit_commit)."""

    rows = [Full()]
    events = False


class HeadWiseNoEventsMachine(HeadWiseMachine):
    """The head-wise machine (window groups, rows expanded from groups) without KV events: the same C commit."""

    events = False


TestUniformManagerNoEvents = UniformNoEventsMachine.TestCase
TestUniformManagerNoEvents.settings = MACHINE_SETTINGS
TestHeadWiseManagerNoEvents = HeadWiseNoEventsMachine.TestCase
TestHeadWiseManagerNoEvents.settings = MACHINE_SETTINGS


@pytest.mark.parametrize("events", [False, True], ids=["no-events", "events"])
@pytest.mark.parametrize("rows", [[Full()], [Window(8, 4), Full(), Window(8, 4)]], ids=["uniform", "head-wise"])
def test_admits_take_the_one_pass_commit_and_match_the_general_path(monkeypatch, rows, events):
    """A manager commits an admit in one C pass (_tables.admit_commit), cached prefix and revived blocks included;
    a twin held to the general path gives the same tables, evictions, free counts, hits and stats, and with KV
    events the same events in the same order (the pass takes uniform managers then; head-wise ones keep the
    general path). A prompt whose first block is gone but a later one still indexed is left to the general path,
    which merges it."""
    from kvcache.allocator import _tables

    calls = []
    real = _tables.admit_commit

    def spy(*args):
        calls.append((args[19].shape[-1] if args[19].size else 0, real(*args)))  # (blocks hit, result)
        return calls[-1][1]

    monkeypatch.setattr(_tables, "admit_commit", spy)
    one_pass, general = (KVCacheManager(24, BS, rows, enable_prefix_caching=True, hash_seed=b"x",
                                        enable_events=events) for _ in range(2))
    monkeypatch.setattr(general, "_admits_in_one_pass", lambda: False)
    seen: set[str] = set()
    rng = np.random.default_rng(7)
    prompts: dict[int, np.ndarray] = {}
    live: list[int] = []
    for rid in range(60):
        if len(live) > 3 or (live and rng.random() < 0.3):
            gone = live.pop(int(rng.integers(len(live))))
            one_pass.free(gone)
            general.free(gone)
        reuse = prompts and rng.random() < 0.3  # a hit (the general path on both) or a refused one-pass admit
        prompt = (prompts[int(rng.integers(len(prompts)))] if reuse
                  else rng.integers(0, 1000, int(rng.integers(1, 4 * BS + 3))).astype(np.uint32))
        chunk = None if rng.random() < 0.7 else int(rng.integers(1, prompt.size + 1))
        a, b = one_pass.admit(rid, prompt, num_tokens=chunk), general.admit(rid, prompt, num_tokens=chunk)
        assert (a is None) == (b is None), rid
        if a is not None:
            assert (a.num_cached_tokens, a.table.tolist(), a.num_tokens) == (b.num_cached_tokens, b.table.tolist(),
                                                                           b.num_tokens), rid
            prompts[rid] = prompt
            live.append(rid)
        if rid % 7 == 3 and live:  # drop a live request's first block from the index: its prompt now misses
            first = one_pass.table(live[0])[:, 0]
            for m in (one_pass, general):
                m.drop_cached(np.arange(first.size), first)
        one_pass.check_integrity()
        assert one_pass.num_free_blocks.tolist() == general.num_free_blocks.tolist()
        assert one_pass.stats() == general.stats()
        got = [(type(e).__name__, *(v.tolist() if isinstance(v, np.ndarray) else v for v in dataclasses.astuple(e)))
               for e in one_pass.take_events()]
        assert got == [(type(e).__name__, *(v.tolist() if isinstance(v, np.ndarray) else v
                                            for v in dataclasses.astuple(e))) for e in general.take_events()], rid
        seen.update(e[0] for e in got)
    assert one_pass.num_free_blocks.tolist() == general.num_free_blocks.tolist()
    if events:
        assert {"BlockStored", "BlockRemoved"} <= seen, seen
        if len(rows) > 1:  # head-wise with events: the general path only
            assert not calls
            return
    assert any(isinstance(c, tuple) and not h for h, c in calls), "no admit without a hit took the one-pass commit"
    assert any(isinstance(c, tuple) and h for h, c in calls), "no admit with a hit took the one-pass commit"
    assert any(c is False for _, c in calls), "no one-pass admit was refused for an indexed hash"
    assert one_pass.stats().evicted_blocks > 0
    for rid, prompt in prompts.items():
        assert one_pass.lookup(prompt) == general.lookup(prompt)


def test_admit_commit_checks_sizes_and_hit_first_and_changes_nothing():
    """A slot past the slot arrays, a table too narrow or a hit block that is free and uncached is an error, and no
    pool, index or slot array changes."""
    from kvcache.allocator import _tables

    m = KVCacheManager(16, BS, enable_prefix_caching=True, hash_seed=b"x", enable_events=False)
    m.admit(0, np.arange(9, dtype=np.uint32))
    pool, index = m._pool, m._index
    arrays = [pool._ref, pool._cached, pool._stack, pool._top, pool._ring, pool._lru_pos, pool._head, pool._tail,
              pool._lru_count, index._slots, index._hash_of, index._blocks, index._entry_at, index._holders,
              m._ntok, m._last_block, m._tail, m._last_hash, m._width]
    before = [a.copy() for a in arrays]
    tokens = np.arange(100, 109, dtype=np.uint32)
    hashes = m._hasher.hash_blocks_packed(tokens)[: 2 * 32]
    index.reserve(2, 3)
    free_block = int(pool._stack[pool._top[0] - 1])  # on the free stack: no reference, not cached
    for slot, width, hit, error in ((10**6, 4, [], ValueError), (1, 2, [], ValueError),  # no such slot; too narrow
                                    (1, 4, [free_block], AssertionError)):
        with pytest.raises(error, match="admit_commit|incref of a free uncached block"):
            _tables.admit_commit(*arrays[:9], index._slots, index._seed, index._hash_of, index._blocks,
                                 index._entry_at, index._holders, index._spare, index._num_spare, index._num_entries,
                                 hashes, np.array([hit], dtype=np.int32), tokens, 9, np.empty((1, width), dtype=np.int32),
                                 slot, m._ntok, m._changed_ok, m._last_block, m._tail, m._last_hash, m._fast_limit,
                                 m._next_recycle, m._width, m._hasher.root, 0, np.zeros(1, dtype=np.intp))
    assert all(np.array_equal(a, b) for a, b in zip(arrays, before))


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
def test_a_lora_is_keyed_by_name_and_path(algorithm):
    """The same name pointed at another adapter must not reuse KV; a name alone is yet another key."""
    m = make_manager(32, hash_algorithm=algorithm)
    prompt = tokens(17)
    m.admit("a", prompt, lora=("sql", "/adapters/sql-v1"))
    assert m.lookup(prompt, lora=("sql", "/adapters/sql-v1")) == 16
    assert m.lookup(prompt, lora=["sql", "/adapters/sql-v1"]) == 16  # a list is the same pair
    assert m.lookup(prompt, lora=("sql", "/adapters/sql-v2")) == 0
    assert m.lookup(prompt, lora="sql") == 0 and m.lookup(prompt) == 0
    with pytest.raises(KVCacheError, match="lora: must be a LoRA name"):
        m.admit("b", prompt, lora=("sql",))
    assert "b" not in m


def brute_force_hit(m: KVCacheManager, prompt: list[int]) -> int:
    """The longest cached prefix every row can use, in tokens, by trying every length from the longest down.

    Presence per row comes from the prefix index; a Full row needs every block of the prefix, a Window row
    its sink blocks and the blocks the next query sees (swa.needed_blocks).
    """
    bs = m.block_size
    hashes = m.hasher.hash_blocks_packed(prompt[: len(prompt) - 1])
    present = m._index.blocks_of(hashes) >= 0  # [blocks, groups]
    policies = list(dict.fromkeys(m.rows))
    for length in range(len(hashes) // 32, 0, -1):
        needed = [needed_blocks(p, length * bs, bs) for p in policies]
        if all(present[b, g] for g, need in enumerate(needed) for b in [*need.sink, *need.window]):
            return length * bs
    return 0


def test_a_window_only_hit_may_skip_blocks_evicted_before_its_window():
    """vLLM's sliding-window manager finds the hit from the right: the sink and the last window suffice, so the
    prefix's first blocks, recycled while it decoded and evicted since, need not be cached."""
    m = make_manager(8, [Window(4)], block_size=2)
    prompt = tokens(14)
    m.admit("a", prompt[:4])
    for t in prompt[4:]:  # decoding: blocks 0-4 go back one by one as the window passes them
        m.extend("a", [t])
    m.free("a")
    m.admit("b", tokens(6, 100))  # one free block and the two oldest cached ones: blocks 0 and 1 of "a"
    m.free("b")
    present = (m._index.blocks_of(m.hasher.hash_blocks_packed(prompt[:13])) >= 0).ravel().tolist()
    assert present == [False, False, True, True, True, True]
    assert m.lookup(prompt) == brute_force_hit(m, prompt) == 12  # the query at 12 sees tokens 9-12: blocks 4, 5
    adm = m.admit("c", prompt)
    assert adm.num_cached_tokens == 12 and adm.table[0, :4].tolist() == [-1, -1, -1, -1]
    m.check_integrity()


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_the_hit_is_the_longest_prefix_every_row_can_use(data):
    """Random rows, prompts sharing prefixes, admits and frees that evict: lookup and admit find exactly the
    brute-force hit."""
    bs = data.draw(st.sampled_from([1, 2, 4]))
    policies = data.draw(st.lists(st.sampled_from([Full(), Window(3), Window(5, 2), Window(8, 1)]), min_size=1,
                                  max_size=3))
    m = make_manager(data.draw(st.integers(6, 24)), policies, block_size=bs)
    stems = [tokens(40, 1000 * i) for i in range(3)]
    live = []
    for step in range(data.draw(st.integers(1, 25))):
        prompt = data.draw(st.sampled_from(stems))[: data.draw(st.integers(1, 40))] + tokens(data.draw(
            st.integers(0, 6)), 50_000 + step * 10)
        assert m.lookup(prompt) == brute_force_hit(m, prompt)
        adm = m.admit(step, prompt)
        if adm is not None:
            live.append(step)
        if live and data.draw(st.booleans()):
            m.free(live.pop(data.draw(st.integers(0, len(live) - 1))))
        m.check_integrity()


def test_each_row_group_reports_its_own_stores_and_removals_with_extra_keys():
    """Head-wise rows [Window, Full, Window]: groups 0 (the window) and 1 (full). A window group that gives a
    block back and loses it to eviction reports it alone; extra keys follow vLLM's untagged form."""
    m = make_manager(num_blocks=6, rows=[Window(4), Full(), Window(4)], block_size=2, enable_events=True)
    assert m.row_groups.tolist() == [0, 1, 0] and m.group_windows == [4, None]
    m.admit("a", tokens(5), lora=("sql", "/v1"), cache_salt="s", mm=[("img", 1, 2)])
    stored = m.take_events()
    assert [(e.group, e.window, len(e.block_hashes)) for e in stored] == [(0, 4, 2), (1, None, 2)]
    assert stored[0].block_hashes == stored[1].block_hashes
    assert stored[0].extra_keys == (("sql", ("img", 1), "s"), ("sql", ("img", -1)))
    assert stored[0].lora == ("sql", "/v1")
    m.free("a")
    m.admit("c", tokens(12))  # six blocks per group: "a"'s two cached ones are evicted in each
    assert [(type(e), e.group, len(e.block_hashes)) for e in m.take_events()] == [
        (BlockRemoved, 0, 2), (BlockRemoved, 1, 2), (BlockStored, 0, 6), (BlockStored, 1, 6)]
    m.shed_window("c")  # the window group drops blocks 0-3 (the query at 12 sees tokens 9-12); full keeps them
    removed = m.take_events()
    hashes = m.hasher.hash_blocks(tokens(12))
    assert [(type(e), e.group, e.block_hashes) for e in removed] == [(BlockRemoved, 0, tuple(hashes[:4]))]
    m.check_integrity()


# -- scheduler-owned block lists (match_blocks, allocate_blank, commit_blocks, release_blocks) ---------------


def test_committed_blocks_are_found_whole_prompt_by_match_blocks_and_shared_with_admit():
    """A scheduler's blank blocks, committed with their tokens, are cached prefixes: match_blocks finds every full
    block (the last one too), admit finds them as it finds its own (never the last prompt block)."""
    m = make_manager(num_blocks=8, enable_events=True)
    assert m.match_blocks("a", tokens(10)).tolist() == []
    blank = m.allocate_blank("a", 3)
    assert blank.tolist() == [0, 1, 2] and blank.dtype == np.int32
    assert m.lookup(tokens(8), whole_prompt=True) == 0
    assert m.commit_blocks("a", blank[:2], tokens(8)) == 2
    stored = m.take_events()
    assert [type(e) for e in stored] == [BlockStored]
    assert stored[0].block_hashes == tuple(m.hasher.hash_blocks(tokens(8))) and stored[0].parent_block_hash is None
    assert m.lookup(tokens(8), whole_prompt=True) == 8 and m.lookup(tokens(8)) == 4
    assert [b.tolist() for b in m.owned_blocks("a")] == [[0, 1], [2]]
    m.check_integrity()
    assert m.match_blocks("b", tokens(8)).tolist() == [0, 1]  # whole prompt
    assert m.admit("c", tokens(9)).table[0, :2].tolist() == [0, 1]
    m.check_integrity()
    m.release_blocks("a")
    m.release_blocks("a", blank[2:])
    assert "a" not in m._owned
    m.release_blocks("b")
    m.free("c")
    m.check_integrity()
    assert m.num_free_blocks.tolist() == [8] and m.num_cached_free_blocks.tolist() == [2]


def test_commit_continues_the_hash_chain_of_the_matched_prefix():
    """Blocks committed after a hit hash as children of the hit's last block: the same hashes as one request
    admitting the whole prompt, so a third request finds all of them."""
    m = make_manager(num_blocks=8)
    m.admit("x", tokens(9))
    m.free("x")  # blocks 0, 1 cached
    assert m.match_blocks("a", tokens(16)).tolist() == [0, 1]
    blank = m.allocate_blank("a", 2)
    m.commit_blocks("a", blank, tokens(8, 8))
    assert m.lookup(tokens(16), whole_prompt=True) == 16
    assert m.match_blocks("b", tokens(16)).tolist() == [0, 1] + blank.tolist()
    m.check_integrity()


def test_a_refused_owned_operation_changes_nothing():
    """Too few blocks gives None; a block not held blank, a wrong token count, a duplicate, an admitted id or a
    second match raise KVCacheError naming the field; none of them changes the pool, index or owners."""
    m = make_manager(num_blocks=4)
    m.match_blocks("a", tokens(8))
    blank = m.allocate_blank("a", 3)
    m.admit("z", tokens(3))
    before = (m.num_free_blocks.tolist(), len(m._index), m.owned_blocks("a")[1].tolist())
    assert m.allocate_blank("a", 1) is None
    for call, field in [
        (lambda: m.commit_blocks("a", [3], tokens(4)), "blocks"),
        (lambda: m.commit_blocks("a", [blank[0], blank[0]], tokens(8)), "blocks"),
        (lambda: m.commit_blocks("a", blank[:1], tokens(3)), "tokens"),
        (lambda: m.commit_blocks("b", blank[:1], tokens(4)), "request_id"),
        (lambda: m.release_blocks("a", [int(blank[0])] * 2), "blocks"),
        (lambda: m.release_blocks("a", [9]), "blocks[0]"),
        (lambda: m.allocate_blank("z", 1), "request_id"),
        (lambda: m.match_blocks("a", tokens(4)), "request_id"),
        (lambda: m.allocate_blank("a", -1), "num_blocks"),
    ]:
        with pytest.raises(KVCacheError, match=f"^{re.escape(field)}"):
            call()
        assert (m.num_free_blocks.tolist(), len(m._index), m.owned_blocks("a")[1].tolist()) == before
        m.check_integrity()
    with pytest.raises(KVCacheError, match="^request_id"):
        m.admit("a", tokens(4))


def test_owned_blocks_need_one_row_group():
    m = make_manager(rows=[Full(), Window(4)])
    with pytest.raises(KVCacheError, match="^allocate_blank: scheduler-owned blocks need one row group"):
        m.allocate_blank("a", 1)


def test_evict_cached_takes_the_oldest_released_first_and_keeps_the_free_order():
    m = make_manager(num_blocks=6)
    for rid, start in (("a", 0), ("b", 100)):
        m.match_blocks(rid, tokens(8, start))
        m.commit_blocks(rid, m.allocate_blank(rid, 2), tokens(8, start))
    m.release_blocks("a")  # released tail first: 1, then 0
    m.release_blocks("b")
    assert m.evict_cached(3) == 3
    assert m.lookup(tokens(8), whole_prompt=True) == 0  # a's blocks 1 and 0, then b's tail
    assert m.lookup(tokens(8, 100), whole_prompt=True) == 4
    assert m.num_cached_free_blocks.tolist() == [1] and m.evict_cached(5) == 1
    assert m.uncached_free_blocks().tolist() == list(range(6))
    m.check_integrity()


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_owned_and_admitted_requests_share_one_pool_and_index(data):
    """Random scheduler-owned requests (match, blank allocations, commits of their tokens, releases) mixed with
    admits and frees: pool, index and tables agree after every step, and a match finds exactly the leading
    blocks a brute-force lookup of the index finds."""
    m = make_manager(data.draw(st.integers(4, 20)), enable_events=data.draw(st.booleans()))
    stems = [tokens(24, 1000 * i) for i in range(3)]
    owned: dict[int, list] = {}  # id -> [prompt, committed count, blank list]
    admitted = []
    for step in range(data.draw(st.integers(1, 30))):
        kind = data.draw(st.sampled_from(["match", "blank", "commit", "release", "admit", "free"]))
        if kind == "match":
            prompt = data.draw(st.sampled_from(stems))[: data.draw(st.integers(1, 24))]
            expect = m.lookup(prompt, whole_prompt=True)
            hashes = m.hasher.hash_blocks_packed(prompt)
            found = m.match_blocks(step, prompt)
            assert found.size * BS == expect == m._index.match(hashes).shape[0] * BS
            owned[step] = [prompt, found.size, []]
        elif kind == "blank" and owned:
            rid = data.draw(st.sampled_from(sorted(owned)))
            before = m.num_free_blocks.tolist()
            got = m.allocate_blank(rid, data.draw(st.integers(0, 3)))
            if got is None:
                assert m.num_free_blocks.tolist() == before
            else:
                owned[rid][2] += got.tolist()
        elif kind == "commit" and owned:
            rid = data.draw(st.sampled_from(sorted(owned)))
            prompt, done, blank = owned[rid]
            n = min(len(blank), len(prompt) // BS - done)
            if n > 0:
                m.commit_blocks(rid, blank[:n], prompt[done * BS:(done + n) * BS])
                owned[rid] = [prompt, done + n, blank[n:]]
        elif kind == "release" and owned:
            rid = data.draw(st.sampled_from(sorted(owned)))
            m.release_blocks(rid, owned[rid][2])
            m.release_blocks(rid)
            del owned[rid]
            assert rid not in m._owned
        elif kind == "admit":
            if m.admit(("adm", step), data.draw(st.sampled_from(stems))[: data.draw(st.integers(1, 24))]):
                admitted.append(("adm", step))
        elif kind == "free" and admitted:
            m.free(admitted.pop(0))
        m.check_integrity()


def test_commit_takes_blank_blocks_of_another_owner():
    """A scheduler that allocates before naming the request keeps blank blocks under one id; committing them to
    a request passes their references to it."""
    m = make_manager(num_blocks=4)
    blank = m.allocate_blank("pool", 3)
    m.match_blocks("a", tokens(8))
    with pytest.raises(KVCacheError, match="^blocks: block 0 is listed 1 time"):
        m.commit_blocks("a", blank[:2], tokens(8))
    assert m.commit_blocks("a", blank[:2], tokens(8), blank_from="pool") == 2
    assert [b.tolist() for b in m.owned_blocks("a")] == [[0, 1], []]
    assert [b.tolist() for b in m.owned_blocks("pool")] == [[], [2]]
    m.check_integrity()
    m.release_blocks("pool", blank[2:])
    assert "pool" not in m._owned
    m.release_blocks("a")
    m.check_integrity()

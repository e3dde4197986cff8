"""BlockPool: exact ids, reuse and eviction order, refcounts, and a step-by-step check against a plain baseline."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.pool import Allocation, BlockPool, usage


def make_pool(num_rows: int = 1, num_blocks: int = 8) -> BlockPool:
    """A fresh pool; tests read best with few blocks."""
    return BlockPool(num_rows, num_blocks)


def ids(allocation: Allocation | None) -> list[list[int]]:
    """Allocated block ids per row as plain lists."""
    assert allocation is not None
    return allocation.blocks.tolist()


def evicted(allocation: Allocation) -> list[tuple[int, int]]:
    """Evicted (row, block) pairs in reported order."""
    return list(zip(allocation.evicted_rows.tolist(), allocation.evicted_blocks.tolist()))


def row0(blocks: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Pairs of row 0 for a list of blocks."""
    return np.zeros(len(blocks), dtype=np.int32), np.array(blocks, dtype=np.int32)


def snapshot(pool: BlockPool) -> tuple:
    """Everything observable about a pool, to compare before and after an operation."""
    rows = np.arange(pool.num_rows)[:, None]
    blocks = np.arange(pool.num_blocks)[None, :]
    return (pool.num_free().tolist(), pool.num_cached_free().tolist(),
            pool.refcount(rows, blocks).tolist(), pool.is_cached(rows, blocks).tolist())


class ReferencePool:
    """Obviously correct baseline: Python lists and dicts, one pair at a time, same rules."""

    def __init__(self, num_rows: int, num_blocks: int) -> None:
        """Stacks pop 0 first; every LRU is empty."""
        self.num_rows, self.num_blocks = num_rows, num_blocks
        self.stack = [list(range(num_blocks - 1, -1, -1)) for _ in range(num_rows)]
        self.lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_rows)]
        self.ref = [[0] * num_blocks for _ in range(num_rows)]
        self.cached = [set() for _ in range(num_rows)]

    def num_free(self, row: int) -> int:
        """Uncached free plus cached free."""
        return len(self.stack[row]) + len(self.lru[row])

    def allocate(self, n: int, rows: list[int]) -> tuple[list[list[int]], list[tuple[int, int]]] | None:
        """Pop the stack, then evict oldest cached; None if any row is short."""
        if any(self.num_free(r) < n for r in rows):
            return None
        out, gone = [], []
        for r in rows:
            got = []
            while len(got) < n and self.stack[r]:
                got.append(self.stack[r].pop())
            while len(got) < n:
                block, _ = self.lru[r].popitem(last=False)
                self.cached[r].discard(block)
                gone.append((r, block))
                got.append(block)
            for block in got:
                self.ref[r][block] = 1
            out.append(got)
        return out, gone

    def incref(self, pairs: list[tuple[int, int]]) -> None:
        """Revive cached free blocks; count every pair."""
        for r, b in pairs:
            if b < 0:
                continue
            if self.ref[r][b] == 0:
                del self.lru[r][b]
            self.ref[r][b] += 1

    def decref(self, pairs: list[tuple[int, int]]) -> None:
        """Release at 0: cached to the LRU tail, uncached onto the stack."""
        for r, b in pairs:
            if b < 0:
                continue
            self.ref[r][b] -= 1
            assert self.ref[r][b] >= 0
            if self.ref[r][b] == 0:
                if b in self.cached[r]:
                    self.lru[r][b] = None
                else:
                    self.stack[r].append(b)

    def mark_cached(self, pairs: list[tuple[int, int]]) -> None:
        """Flag referenced blocks."""
        for r, b in pairs:
            if b >= 0:
                self.cached[r].add(b)

    def uncache(self, pairs: list[tuple[int, int]]) -> None:
        """Unflag; a free cached block moves onto the stack."""
        for r, b in pairs:
            if b >= 0 and b in self.cached[r]:
                self.cached[r].remove(b)
                if self.ref[r][b] == 0:
                    del self.lru[r][b]
                    self.stack[r].append(b)

    def reset_cached(self) -> list[tuple[int, int]]:
        """Unflag all; LRU blocks go onto the stack oldest first."""
        pairs = [(r, b) for r in range(self.num_rows) for b in sorted(self.cached[r])]
        for r in range(self.num_rows):
            self.stack[r].extend(self.lru[r])
            self.lru[r].clear()
            self.cached[r].clear()
        return pairs


# ------------------------------------------------------------ allocation order


def test_fresh_pool_hands_out_ids_in_order():
    """Every row of a fresh pool hands out 0, 1, 2, ... in order."""
    pool = make_pool(3, 8)
    assert ids(pool.allocate(3)) == [[0, 1, 2]] * 3
    assert ids(pool.allocate(2)) == [[3, 4]] * 3
    pool.check_integrity()


def test_uncached_free_blocks_are_reused_last_freed_first():
    """LIFO: the block freed last is handed out first (GPU locality)."""
    pool = make_pool(1, 8)
    pool.allocate(4)
    pool.decref(*row0([1, 3]))
    assert ids(pool.allocate(3)) == [[3, 1, 4]]
    pool.check_integrity()


def test_cached_blocks_are_reused_last_oldest_first():
    """Cached free blocks are taken only after every uncached one, oldest released first."""
    pool = make_pool(1, 6)
    pool.allocate(4)
    pool.mark_cached(*row0([0, 1, 2]))
    pool.decref(*row0([2, 0, 3, 1]))
    assert pool.num_free().tolist() == [6]
    assert pool.num_cached_free().tolist() == [3]
    got = pool.allocate(5)
    assert ids(got) == [[3, 4, 5, 2, 0]]
    assert evicted(got) == [(0, 2), (0, 0)]
    assert ids(pool.allocate(1)) == [[1]]
    pool.check_integrity()


def test_evicted_blocks_lose_cached_flag():
    """Reuse evicts: the flag is cleared so the new owner's block is not a prefix."""
    pool = make_pool(1, 2)
    pool.allocate(2)
    pool.mark_cached(*row0([0, 1]))
    pool.decref(*row0([0, 1]))
    got = pool.allocate(1)
    assert evicted(got) == [(0, 0)]
    assert pool.is_cached(*row0([0, 1])).tolist() == [False, True]
    pool.check_integrity()


def test_eviction_reports_pairs_row_by_row_oldest_first():
    """Evictions are listed in the order rows were given, oldest first within a row."""
    pool = make_pool(2, 3)
    pool.allocate(3)
    pool.mark_cached(np.array([[0], [1]]), np.array([[0, 1, 2], [0, 1, 2]]))
    pool.decref(np.array([[0], [1]]), np.array([[2, 1, 0], [0, 1, 2]]))
    got = pool.allocate(2, rows=np.array([1, 0]))
    assert ids(got) == [[0, 1], [2, 1]]
    assert evicted(got) == [(1, 0), (1, 1), (0, 2), (0, 1)]
    pool.check_integrity()


def test_rows_mix_stack_and_eviction_independently():
    """A row with free uncached blocks does not evict while another row does."""
    pool = make_pool(2, 4)
    pool.allocate(3)
    pool.mark_cached(np.array([0, 0, 0]), np.array([0, 1, 2]))
    pool.decref(np.array([[0], [1]]), np.array([[0, 1, 2], [0, 1, 2]]))
    got = pool.allocate(3)
    assert ids(got) == [[3, 0, 1], [2, 1, 0]]
    assert evicted(got) == [(0, 0), (0, 1)]
    pool.check_integrity()


def test_reverse_logical_free_evicts_prefix_tail_first():
    """Freeing a table in reverse logical order puts its last block first in line for eviction."""
    pool = make_pool(2, 4)
    table = pool.allocate(4).blocks
    rows = np.arange(2)[:, None]
    pool.mark_cached(rows, table)
    pool.decref(rows, table[:, ::-1])
    got = pool.allocate(1)
    assert evicted(got) == [(0, 3), (1, 3)]
    pool.check_integrity()


def test_allocate_subset_of_rows_leaves_others():
    """Only the named rows give blocks; results come in the order rows were named."""
    pool = make_pool(3, 4)
    pool.allocate(1, rows=np.array([2]))
    got = pool.allocate(2, rows=np.array([2, 0]))
    assert ids(got) == [[1, 2], [0, 1]]
    assert pool.num_free().tolist() == [2, 4, 1]
    pool.check_integrity()


def test_allocate_zero_blocks_gives_empty_rows():
    """Allocating 0 always succeeds and changes nothing."""
    pool = make_pool(2, 1)
    pool.allocate(1)
    got = pool.allocate(0)
    assert got.blocks.shape == (2, 0) and got.blocks.dtype == np.int32
    assert pool.num_free().tolist() == [0, 0]


def test_failed_allocation_changes_nothing():
    """A row short of blocks makes the whole call return None with no state change."""
    pool = make_pool(2, 4)
    pool.allocate(2, rows=np.array([1]))
    pool.mark_cached(np.array([1]), np.array([0]))
    pool.decref(np.array([1]), np.array([0]))
    before = snapshot(pool)
    assert not pool.can_allocate(4)
    assert pool.allocate(4) is None
    assert snapshot(pool) == before
    assert pool.can_allocate(3) and pool.can_allocate(4, rows=np.array([0]))
    pool.check_integrity()


def test_allocation_results_are_int32():
    """Block ids and eviction pairs are int32, as tables are."""
    pool = make_pool(2, 2)
    pool.allocate(2)
    pool.mark_cached(np.array([[0], [1]]), np.array([[0, 1], [0, 1]]))
    pool.decref(np.array([[0], [1]]), np.array([[0, 1], [0, 1]]))
    got = pool.allocate(1)
    assert got.blocks.dtype == got.evicted_rows.dtype == got.evicted_blocks.dtype == np.int32


# ------------------------------------------------------------- reference counts


def test_incref_revives_cached_free_block_without_eviction():
    """A prefix hit takes a cached free block out of the LRU; it is neither evicted nor reused."""
    pool = make_pool(1, 3)
    pool.allocate(3)
    pool.mark_cached(*row0([0, 1, 2]))
    pool.decref(*row0([0, 1, 2]))
    pool.incref(*row0([0]))
    assert pool.refcount(*row0([0])).tolist() == [1]
    assert pool.num_free().tolist() == [2] and pool.num_cached_free().tolist() == [2]
    got = pool.allocate(2)
    assert ids(got) == [[1, 2]] and evicted(got) == [(0, 1), (0, 2)]
    assert pool.is_cached(*row0([0])).tolist() == [True]
    pool.check_integrity()


def test_revived_block_released_again_goes_to_lru_tail():
    """A revived block released later is evicted after blocks released before it."""
    pool = make_pool(1, 3)
    pool.allocate(3)
    pool.mark_cached(*row0([0, 1, 2]))
    pool.decref(*row0([0, 1, 2]))
    pool.incref(*row0([0]))
    pool.decref(*row0([0]))
    assert evicted(pool.allocate(3)) == [(0, 1), (0, 2), (0, 0)]
    pool.check_integrity()


def test_duplicate_pairs_are_counted():
    """A pair repeated k times in one call moves its count by k."""
    pool = make_pool(2, 4)
    pool.allocate(2)
    pool.incref(np.array([0, 0, 1, 0]), np.array([1, 1, 0, 1]))
    assert pool.refcount(np.array([0, 1]), np.array([1, 0])).tolist() == [4, 2]
    pool.decref(np.array([0, 0, 0]), np.array([1, 1, 1]))
    assert pool.refcount(np.array([0]), np.array([1])).tolist() == [1]
    pool.check_integrity()


def test_duplicated_pair_is_released_at_its_last_occurrence():
    """Release order is as if pairs were decref'd one by one: a repeated pair frees at its last place."""
    pool = make_pool(1, 4)
    pool.allocate(3)
    pool.incref(*row0([0]))
    pool.decref(*row0([0, 1, 2, 0]))
    assert ids(pool.allocate(3)) == [[0, 2, 1]]
    pool.check_integrity()


def test_duplicate_revival_counts_once():
    """Reviving the same cached free block twice in one call removes it from the LRU once."""
    pool = make_pool(1, 2)
    pool.allocate(2)
    pool.mark_cached(*row0([0, 1]))
    pool.decref(*row0([0, 1]))
    pool.incref(*row0([0, 0]))
    assert pool.refcount(*row0([0])).tolist() == [2]
    assert pool.num_cached_free().tolist() == [1]
    pool.check_integrity()


def test_holes_are_ignored():
    """Table slots of -1 (recycled) are skipped by every pair operation."""
    pool = make_pool(2, 4)
    table = pool.allocate(3).blocks
    table[1, 0] = -1
    rows = np.arange(2)[:, None]
    pool.incref(rows, table)
    pool.mark_cached(rows, table)
    assert pool.refcount(rows, table).tolist() == [[2, 2, 2], [0, 2, 2]]
    assert pool.is_cached(rows, table).tolist() == [[True] * 3, [False, True, True]]
    pool.uncache(rows, table)
    pool.decref(rows, table)
    assert pool.refcount(np.array([1]), np.array([0])).tolist() == [1]
    assert pool.refcount(np.array([0, 0]), np.array([-1, 0])).tolist() == [0, 1]
    assert pool.is_cached(np.array([0]), np.array([-1])).tolist() == [False]
    pool.check_integrity()


def test_table_form_pairs_broadcast_in_c_order():
    """rows[:, None] against a [rows, n] table means every slot, row by row."""
    pool = make_pool(2, 4)
    table = pool.allocate(3).blocks
    pool.decref(np.array([[1], [0]]), table[::-1, ::-1])
    assert ids(pool.allocate(3)) == [[0, 1, 2], [0, 1, 2]]
    pool.check_integrity()


def test_decref_of_free_block_raises_and_changes_nothing():
    """Decref below zero is an owner bug: AssertionError naming the pair, state untouched."""
    pool = make_pool(1, 4)
    pool.allocate(2)
    before = snapshot(pool)
    with pytest.raises(AssertionError, match=r"row 0, block 3"):
        pool.decref(*row0([0, 3]))
    with pytest.raises(AssertionError, match=r"block 1\) has 1 references, dropping 2"):
        pool.decref(*row0([0, 1, 1]))
    assert snapshot(pool) == before
    pool.check_integrity()


def test_a_whole_table_decref_names_an_id_out_of_range_and_changes_nothing():
    """The one-C-pass table path (unique, rows as a column) refuses bad ids as KVCacheError, whatever their dtype:
    an int64 id that an int32 cast would wrap into range included."""
    pool = make_pool(2, 4)
    table = pool.allocate(2).blocks  # int32 [2, 2]
    before = snapshot(pool)
    rows = np.array([[0], [1]])
    bad = table.copy()
    bad[1, 0] = 4
    with pytest.raises(KVCacheError, match=r"blocks: ids must lie in \[0, 4\)"):
        pool.decref(rows, bad, unique=True)
    wrapped = table.astype(np.int64)
    wrapped[0, 1] += 2**32  # as int32 this would read as a live block
    with pytest.raises(KVCacheError, match=r"blocks: ids must lie in \[0, 4\)"):
        pool.decref(rows, wrapped, unique=True)
    with pytest.raises(KVCacheError, match=r"rows: ids must lie in \[0, 2\)"):
        pool.decref(np.array([[0], [2]]), table, unique=True)
    with pytest.raises(AssertionError, match="has 0 references"):
        pool.decref(rows, np.array([[table[0, 0], 3], [table[1, 0], -1]], dtype=np.int32), unique=True)
    assert snapshot(pool) == before
    pool.decref(rows, table, unique=True)
    assert pool.num_free().tolist() == [4, 4]
    pool.check_integrity()


def test_incref_of_uncached_free_block_is_a_bug():
    """Only a cached free block can be revived; anything else raises with no change."""
    pool = make_pool(1, 4)
    pool.allocate(1)
    before = snapshot(pool)
    with pytest.raises(AssertionError, match=r"row 0, block 2"):
        pool.incref(*row0([0, 2]))
    assert snapshot(pool) == before


def test_mark_cached_of_free_uncached_block_is_a_bug():
    """Only blocks holding written KV (referenced) can become cached."""
    pool = make_pool(1, 4)
    pool.allocate(1)
    with pytest.raises(AssertionError, match=r"block 3"):
        pool.mark_cached(*row0([0, 3]))
    assert pool.is_cached(*row0([0, 3])).tolist() == [False, False]


def test_uncache_moves_free_cached_block_to_free_stack():
    """An uncached free block is reused next, LIFO, and is not reported as evicted."""
    pool = make_pool(1, 4)
    pool.allocate(4)
    pool.mark_cached(*row0([0, 1, 2, 3]))
    pool.decref(*row0([0, 1, 2, 3]))
    pool.uncache(*row0([2, 1, 2, 0]))
    assert pool.num_cached_free().tolist() == [1]
    got = pool.allocate(4)
    assert ids(got) == [[0, 1, 2, 3]] and evicted(got) == [(0, 3)]
    pool.check_integrity()


def test_uncache_of_referenced_block_only_clears_flag():
    """A referenced block loses its flag and, released later, goes to the free stack."""
    pool = make_pool(1, 4)
    pool.allocate(2)
    pool.mark_cached(*row0([0, 1]))
    pool.uncache(*row0([0]))
    pool.decref(*row0([1, 0]))
    assert pool.num_cached_free().tolist() == [1]
    assert ids(pool.allocate(1)) == [[0]]
    pool.check_integrity()


def test_reset_cached_returns_pairs_and_frees_lru_newest_on_top():
    """reset_cached reports every cached pair row-major; free ones move to the stack oldest first."""
    pool = make_pool(2, 4)
    pool.allocate(4)
    rows = np.array([[0], [1]])
    pool.mark_cached(rows, np.array([[3, 1, 0, 2], [1, 1, 1, 1]]))
    pool.decref(np.array([0, 0, 0]), np.array([3, 1, 0]))
    got_rows, got_blocks = pool.reset_cached()
    assert list(zip(got_rows.tolist(), got_blocks.tolist())) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 1)]
    assert got_rows.dtype == got_blocks.dtype == np.int32
    assert pool.num_cached_free().tolist() == [0, 0]
    assert not pool.is_cached(rows, np.arange(4)[None, :]).any()
    got = pool.allocate(3, rows=np.array([0]))
    assert ids(got) == [[0, 1, 3]] and evicted(got) == []
    pool.check_integrity()


def test_ring_compaction_keeps_lru_order():
    """Many revive/release cycles (stale ring entries, compaction) keep exact oldest-first order."""
    pool = make_pool(2, 4)
    rows = np.array([[0], [1]])
    table = pool.allocate(4).blocks
    pool.mark_cached(rows, table)
    pool.decref(rows, table)
    for i in range(50):
        block = np.array([[i % 4], [(i + 1) % 4]])
        pool.incref(rows, block)
        pool.decref(rows, block)
        pool.check_integrity()
    got = pool.allocate(4)
    order = [[(49 - k) % 4 for k in range(3, -1, -1)], [(50 - k) % 4 for k in range(3, -1, -1)]]
    assert ids(got) == order
    pool.check_integrity()


@settings(max_examples=200, deadline=None)
@given(num_rows=st.integers(1, 3), num_blocks=st.integers(1, 6), as_table=st.booleans(), data=st.data())
def test_lru_order_survives_churn_and_compaction(num_rows: int, num_blocks: int, as_table: bool, data: st.DataObject):
    """Long revive/release churn (stale entries, repeated compaction) evicts exactly like the baseline, also when
    the releases come as a table column per row with unique=True (the one-pass C path, its own compaction)."""
    pool, ref = BlockPool(num_rows, num_blocks), ReferencePool(num_rows, num_blocks)
    rows = np.arange(num_rows)[:, None]
    table = pool.allocate(num_blocks).blocks
    ref.allocate(num_blocks, list(range(num_rows)))
    pool.mark_cached(rows, table)
    ref.mark_cached([(r, b) for r in range(num_rows) for b in range(num_blocks)])
    order = data.draw(st.permutations(range(num_blocks)))
    pool.decref(rows, np.tile(order, (num_rows, 1)))
    ref.decref([(r, b) for r in range(num_rows) for b in order])
    churn = data.draw(st.lists(st.lists(st.integers(0, num_blocks - 1), min_size=num_rows, max_size=num_rows),
                               min_size=3 * num_blocks, max_size=8 * num_blocks))
    for step in churn:
        pairs = list(enumerate(step))
        r, b = np.arange(num_rows), np.array(step)
        pool.incref(r, b)
        ref.incref(pairs)
        if as_table:
            pool.decref(r[:, None], b[:, None], unique=True)
        else:
            pool.decref(r, b)
        ref.decref(pairs)
        pool.check_integrity()
    got = pool.allocate(num_blocks)
    want = ref.allocate(num_blocks, list(range(num_rows)))
    assert got.blocks.tolist() == want[0] and evicted(got) == want[1]


# ------------------------------------------------------------------ fast paths


def test_unique_calls_count_and_release_like_default_calls():
    """unique=True (the caller promises no repeated pair) gives the same counts, release order and ids."""
    pools = [make_pool(2, 6), make_pool(2, 6)]
    rows = np.array([[0], [1]])
    for pool, unique in zip(pools, (False, True)):
        table = pool.allocate(4).blocks
        pool.mark_cached(rows, table[:, :2])
        pool.incref(rows, table[:, 1:3], unique=unique)
        pool.decref(rows, table[:, ::-1], unique=unique)
        pool.incref(rows, np.array([[2, -1], [0, 1]]), unique=unique)
        pool.check_integrity()
    assert snapshot(pools[0]) == snapshot(pools[1])
    for n, alloc_rows in ((3, None), (1, np.array([0]))):
        first, second = pools[0].allocate(n, alloc_rows), pools[1].allocate(n, alloc_rows)
        assert ids(first) == ids(second) and evicted(first) == evicted(second)
    assert evicted(second) == [(0, 0)]


def test_unique_calls_raise_and_change_nothing_like_default_calls():
    """The unique path checks references the same way: AssertionError naming the pair, state untouched."""
    pool = make_pool(1, 4)
    pool.allocate(2)
    before = snapshot(pool)
    with pytest.raises(AssertionError, match=r"row 0, block 3"):
        pool.decref(*row0([0, 3]), unique=True)
    with pytest.raises(AssertionError, match=r"row 0, block 2"):
        pool.incref(*row0([0, 2]), unique=True)
    assert snapshot(pool) == before
    pool.check_integrity()


def test_single_pairs_are_validated_like_batches():
    """A one-pair call (a decode step's) raises the same errors and skips a hole."""
    pool = make_pool(2, 4)
    pool.allocate(1)
    before = snapshot(pool)
    with pytest.raises(AssertionError, match=r"decref of a free block: \(row 0, block 3\)"):
        pool.decref(np.array([0]), np.array([3]))
    with pytest.raises(AssertionError, match=r"row 1, block 2"):
        pool.incref(np.array([[1]]), np.array([[2]]))
    with pytest.raises(KVCacheError, match="blocks"):
        pool.decref(np.array([0]), np.array([4]))
    with pytest.raises(KVCacheError, match="rows"):
        pool.incref(np.array([2]), np.array([0]))
    pool.incref(np.array([1]), np.array([-1]))
    pool.decref(np.array([1]), np.array([-1]))
    assert snapshot(pool) == before
    pool.check_integrity()


def test_decode_steps_one_block_at_a_time_keep_exact_order():
    """allocate(1) and one-pair decref/incref keep LIFO reuse of uncached and LRU order of cached blocks."""
    pool = make_pool(1, 4)
    assert [ids(pool.allocate(1)) for _ in range(4)] == [[[0]], [[1]], [[2]], [[3]]]
    pool.mark_cached(*row0([0, 1, 3]))
    for block in (3, 2, 0, 1):
        pool.decref(*row0([block]))
    pool.incref(*row0([1]))  # the newest ring entry: revived
    assert ids(pool.allocate(1)) == [[2]]
    got = pool.allocate(1)
    assert ids(got) == [[3]] and evicted(got) == [(0, 3)]
    pool.decref(*row0([1]))
    assert evicted(pool.allocate(2)) == [(0, 0), (0, 1)]
    pool.check_integrity()


@pytest.mark.parametrize("num_rows", [1, 3])
def test_reviving_the_newest_ring_entries_leaves_none_stale(num_rows: int):
    """A prefix released last and hit again leaves the ring's tail, so evictions scan no stale entry.

    White-box: the ring's tail moves back by the revived count; eviction order stays exact.
    """
    pool = make_pool(num_rows, 8)
    rows = np.arange(num_rows)[:, None]
    table = pool.allocate(8).blocks
    pool.mark_cached(rows, table)
    pool.decref(rows, table[:, ::-1], unique=True)  # blocks 2, 1, 0 are released last
    tail = pool._tail.copy()
    pool.incref(rows, table[:, :3], unique=True)
    assert (pool._tail == tail - 3).all()
    pool.check_integrity()
    pool.incref(rows, table[:, 6:7])  # not the newest entry: left stale, skipped when evicting
    assert (pool._tail == tail - 3).all()
    got = pool.allocate(4)
    assert ids(got) == [[7, 5, 4, 3]] * num_rows
    assert evicted(got) == [(r, b) for r in range(num_rows) for b in (7, 5, 4, 3)]
    pool.check_integrity()


@settings(max_examples=200, deadline=None)
@given(num_rows=st.integers(1, 3), num_blocks=st.integers(2, 12), data=st.data())
def test_prefix_cache_cycles_match_reference(num_rows: int, num_blocks: int, data: st.DataObject):
    """The manager's cycle with unique=True evicts exactly like the baseline.

    Each cycle hits a cached prefix, allocates the rest, caches it and frees it tail first: ring
    tails are pulled back, stale entries skipped, rings wrap.
    """
    pool, ref = BlockPool(num_rows, num_blocks), ReferencePool(num_rows, num_blocks)
    rows = np.arange(num_rows)[:, None]
    tables: list[np.ndarray] = []
    for _ in range(data.draw(st.integers(1, 12))):
        hit = np.empty((num_rows, 0), dtype=np.int32)
        if tables:
            table = data.draw(st.sampled_from(tables))
            hit = table[:, :data.draw(st.integers(0, table.shape[1]))]
            if not pool.is_cached(rows, hit).all():
                hit = hit[:, :0]
        pool.incref(rows, hit, unique=True)
        ref.incref([(r, int(b)) for r in range(num_rows) for b in hit[r]])
        n = data.draw(st.integers(0, num_blocks - hit.shape[1]))
        got, want = pool.allocate(n), ref.allocate(n, list(range(num_rows)))
        assert got.blocks.tolist() == want[0] and evicted(got) == want[1]
        table = np.concatenate([hit, got.blocks], axis=1)
        pool.mark_cached(rows, table)
        ref.mark_cached([(r, int(b)) for r in range(num_rows) for b in table[r]])
        tables = [t for t in tables if pool.is_cached(rows, t).all()] + [table]
        pool.decref(rows, table[:, ::-1], unique=True)
        ref.decref([(r, int(b)) for r in range(num_rows) for b in table[r, ::-1]])
        pool.check_integrity()
    got, want = pool.allocate(num_blocks), ref.allocate(num_blocks, list(range(num_rows)))
    assert got.blocks.tolist() == want[0] and evicted(got) == want[1]


def test_a_pickled_pool_carries_on_exactly_like_the_original():
    """Journal snapshots pickle the pool: the copy's stacks and rings stay one state, not two."""
    import pickle

    original = make_pool(2, 6)
    rows = np.array([[0], [1]])
    table = original.allocate(5).blocks
    original.mark_cached(rows, table[:, :3])
    original.decref(rows, table[:, ::-1])
    copy = pickle.loads(pickle.dumps(original))
    copy.check_integrity()
    for pool in (original, copy):
        pool.incref(rows, table[:, :1])
        pool.decref(rows, pool.allocate(4).blocks[:, [2, 0, 3, 1]])  # pushed in a new order
        pool.check_integrity()
    assert snapshot(copy) == snapshot(original)
    for n in (3, 2):
        first, second = original.allocate(n), copy.allocate(n)
        assert ids(first) == ids(second) and evicted(first) == evicted(second)


# ------------------------------------------------------------ argument checks


def test_bad_arguments_raise_kvcache_error():
    """Caller mistakes name the field and change nothing."""
    with pytest.raises(KVCacheError, match="num_rows"):
        BlockPool(0, 4)
    with pytest.raises(KVCacheError, match="num_blocks"):
        BlockPool(1, 0)
    pool = make_pool(2, 4)
    with pytest.raises(KVCacheError, match="n:"):
        pool.allocate(-1)
    with pytest.raises(KVCacheError, match="distinct"):
        pool.allocate(1, rows=np.array([1, 1]))
    with pytest.raises(KVCacheError, match="rows"):
        pool.allocate(1, rows=np.array([2]))
    with pytest.raises(KVCacheError, match="blocks"):
        pool.decref(np.array([0]), np.array([4]))
    with pytest.raises(KVCacheError, match="blocks"):
        pool.incref(np.array([0]), np.array([-2]))
    with pytest.raises(KVCacheError, match="rows"):
        pool.refcount(np.array([5]), np.array([0]))
    assert pool.num_free().tolist() == [4, 4]


def test_check_integrity_reports_a_corrupted_free_stack():
    """The integrity check catches a referenced block left on the free stack."""
    pool = make_pool(1, 4)
    pool.allocate(1)
    pool._top[0] += 1  # put block 0, which is in use, back on the stack
    with pytest.raises(AssertionError, match="row 0"):
        pool.check_integrity()


# ------------------------------------------------------------------- usage


def test_usage_is_exact_and_never_rounds_to_zero():
    """One used block in a million reads 1e-6; the maximum is over rows."""
    got = usage(np.array([999_999, 1_000_000]), 1_000_000)
    assert got.per_row.tolist() == [1e-6, 0.0]
    assert got.max == 1e-6
    pool = make_pool(3, 4)
    pool.allocate(3, rows=np.array([1]))
    assert usage(pool.num_free(), pool.num_blocks).per_row.tolist() == [0.0, 0.75, 0.0]


# ---------------------------------------------------- against the baseline


class PoolMatchesReference(RuleBasedStateMachine):
    """Random request-like traffic on BlockPool and ReferencePool gives identical ids, evictions and state.

    A holding is what one request owns: a [rows, n] table from an allocation
    or the pairs of a prefix hit. Freeing a holding may first flag it cached,
    and passes it as a table, reversed, or shuffled with holes.
    """

    @initialize(num_rows=st.integers(1, 4), num_blocks=st.integers(1, 8))
    def start(self, num_rows: int, num_blocks: int) -> None:
        """Both pools fresh, same geometry."""
        self.pool = BlockPool(num_rows, num_blocks)
        self.ref = ReferencePool(num_rows, num_blocks)
        self.holdings: list[tuple[np.ndarray, np.ndarray]] = []

    def pairs(self, rows: np.ndarray, blocks: np.ndarray) -> list[tuple[int, int]]:
        """A holding's pairs in C order, as the baseline takes them."""
        r, b = np.broadcast_arrays(rows, blocks)
        return list(zip(r.reshape(-1).tolist(), b.reshape(-1).tolist()))

    def held(self) -> list[tuple[int, int]]:
        """Every referenced pair once."""
        return [(r, b) for r in range(self.ref.num_rows) for b in range(self.ref.num_blocks) if self.ref.ref[r][b]]

    def cached_free(self) -> list[tuple[int, int]]:
        """Revivable pairs."""
        return [(r, b) for r in range(self.ref.num_rows) for b in self.ref.lru[r]]

    @rule(data=st.data(), n=st.integers(0, 4))
    def allocate(self, data: st.DataObject, n: int) -> None:
        """Same ids and evictions, or None for both; a success becomes a holding."""
        rows = None
        if data.draw(st.booleans()):
            rows = np.array(data.draw(st.lists(st.integers(0, self.ref.num_rows - 1), unique=True, min_size=1)))
        row_list = list(range(self.ref.num_rows)) if rows is None else rows.tolist()
        expect = all(self.ref.num_free(r) >= n for r in row_list)
        assert self.pool.can_allocate(n, rows) == expect
        ascending = data.draw(st.booleans())
        got = self.pool.allocate(n, rows, ascending=ascending)
        want = self.ref.allocate(n, row_list)
        if want is None:
            assert got is None and not expect
            return
        assert got is not None
        assert got.blocks.tolist() == ([sorted(b) for b in want[0]] if ascending else want[0])
        assert evicted(got) == want[1]  # evictions stay oldest first either way
        self.holdings.append((np.array(row_list)[:, None], got.blocks))

    @rule(data=st.data())
    def prefix_hit(self, data: st.DataObject) -> None:
        """Incref held or cached free pairs (revivals, repeats and holes included) as a new holding."""
        choices = self.held() + self.cached_free()
        if not choices:
            return
        pairs = data.draw(st.lists(st.sampled_from(choices + [(0, -1)]), min_size=1, max_size=8))
        rows = np.array([p[0] for p in pairs], dtype=np.int32)
        blocks = np.array([p[1] for p in pairs], dtype=np.int32)
        self.pool.incref(rows, blocks)
        self.ref.incref(pairs)
        self.holdings.append((rows, blocks))

    @rule(data=st.data(), cache=st.booleans(), how=st.sampled_from(["table", "reversed", "shuffled"]))
    def free(self, data: st.DataObject, cache: bool, how: str) -> None:
        """Release one holding, maybe flagging it cached first."""
        if not self.holdings:
            return
        rows, blocks = self.holdings.pop(data.draw(st.integers(0, len(self.holdings) - 1)))
        if cache:
            self.pool.mark_cached(rows, blocks)
            self.ref.mark_cached(self.pairs(rows, blocks))
        if how == "reversed":
            rows, blocks = (rows, blocks[:, ::-1]) if rows.ndim == 2 else (rows[::-1], blocks[::-1])
        elif how == "shuffled":
            flat = self.pairs(rows, blocks)
            flat = data.draw(st.permutations(flat)) + [(self.ref.num_rows - 1, -1)]
            rows = np.array([p[0] for p in flat])
            blocks = np.array([p[1] for p in flat])
        self.pool.decref(rows, blocks)
        self.ref.decref(self.pairs(rows, blocks))

    @rule(data=st.data())
    def prefix_hit_table(self, data: st.DataObject) -> None:
        """Incref with unique=True a [rows, k] table of distinct held or cached free blocks per row (holes pad)."""
        num_rows, num_blocks = self.ref.num_rows, self.ref.num_blocks
        per_row = []
        for r in range(num_rows):
            options = [b for b in range(num_blocks) if self.ref.ref[r][b] or b in self.ref.lru[r]]
            drawn = data.draw(st.lists(st.sampled_from(options), unique=True, max_size=4)) if options else []
            per_row.append(drawn)
        width = max(len(blocks) for blocks in per_row)
        if width == 0:
            return
        table = np.full((num_rows, width), -1, dtype=np.int32)
        for r, blocks in enumerate(per_row):
            table[r, :len(blocks)] = blocks
        rows = np.arange(num_rows)[:, None]
        self.pool.incref(rows, table, unique=True)
        self.ref.incref(self.pairs(rows, table))
        self.holdings.append((rows, table))

    @rule(data=st.data(), cache=st.booleans(), rehit=st.booleans())
    def free_unique(self, data: st.DataObject, cache: bool, rehit: bool) -> None:
        """Release a holding with no repeated pair, tail first, with unique=True; maybe hit it again at once.

        Hitting again a holding just released (cached) revives the ring's newest entries.
        """
        def repeats(holding: tuple[np.ndarray, np.ndarray]) -> bool:
            pairs = [p for p in self.pairs(*holding) if p[1] >= 0]
            return len(set(pairs)) != len(pairs)

        candidates = [i for i, holding in enumerate(self.holdings) if not repeats(holding)]
        if not candidates:
            return
        rows, blocks = self.holdings.pop(data.draw(st.sampled_from(candidates)))
        if cache:
            self.pool.mark_cached(rows, blocks)
            self.ref.mark_cached(self.pairs(rows, blocks))
        tail_first = (rows, blocks[:, ::-1]) if rows.ndim == 2 else (rows[::-1], blocks[::-1])
        self.pool.decref(*tail_first, unique=True)
        self.ref.decref(self.pairs(*tail_first))
        if cache and rehit:
            self.pool.incref(rows, blocks, unique=True)
            self.ref.incref(self.pairs(rows, blocks))
            self.holdings.append((rows, blocks))

    @rule(data=st.data())
    def uncache(self, data: st.DataObject) -> None:
        """Unflag arbitrary pairs, repeats and holes included."""
        pair = st.tuples(st.integers(0, self.ref.num_rows - 1), st.integers(-1, self.ref.num_blocks - 1))
        pairs = data.draw(st.lists(pair, max_size=4))
        self.pool.uncache(np.array([p[0] for p in pairs], dtype=np.int32),
                          np.array([p[1] for p in pairs], dtype=np.int32))
        self.ref.uncache(pairs)

    @rule(data=st.data())
    def reset_cached(self, data: st.DataObject) -> None:
        """Same pairs reported, same stacks after (rarely: it empties the LRU)."""
        if data.draw(st.integers(0, 9)):
            return
        rows, blocks = self.pool.reset_cached()
        assert list(zip(rows.tolist(), blocks.tolist())) == self.ref.reset_cached()

    @invariant()
    def same_state(self) -> None:
        """Integrity holds and every observable agrees with the baseline."""
        if not hasattr(self, "pool"):
            return
        self.pool.check_integrity()
        rows = np.arange(self.ref.num_rows)[:, None]
        blocks = np.arange(self.ref.num_blocks)[None, :]
        assert self.pool.refcount(rows, blocks).tolist() == self.ref.ref
        assert self.pool.is_cached(rows, blocks).tolist() == [
            [b in self.ref.cached[r] for b in range(self.ref.num_blocks)] for r in range(self.ref.num_rows)]
        assert self.pool.num_free().tolist() == [self.ref.num_free(r) for r in range(self.ref.num_rows)]
        assert self.pool.num_cached_free().tolist() == [len(lru) for lru in self.ref.lru]


PoolMatchesReference.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_pool_matches_reference = PoolMatchesReference.TestCase


@settings(max_examples=200, deadline=None)
@given(num_rows=st.integers(1, 3), num_blocks=st.integers(1, 6), data=st.data())
def test_can_allocate_agrees_with_allocate(num_rows: int, num_blocks: int, data: st.DataObject):
    """can_allocate(n) is True exactly when allocate(n) succeeds."""
    pool = BlockPool(num_rows, num_blocks)
    for n in data.draw(st.lists(st.integers(0, num_blocks + 1), max_size=5)):
        expect = pool.can_allocate(n)
        assert (pool.allocate(n) is not None) == expect
    pool.check_integrity()


def test_a_single_row_allocation_from_a_ring_short_of_live_entries_raises_and_changes_nothing():
    """An LRU count above the ring's live entries is an owner bug: AssertionError, no array changed."""
    pool = BlockPool(1, 4)
    got = pool.allocate(4)
    pool.mark_cached(np.zeros((1, 1), dtype=np.intp), got.blocks)
    pool.decref(np.zeros((1, 1), dtype=np.intp), got.blocks, unique=True)  # all four cached free, in the ring
    pool._lru_count[0] += 1  # claims a fifth live entry
    pool._top[0] = 0
    before = {name: getattr(pool, name).copy() for name in ("_ref", "_cached", "_stack", "_top", "_ring", "_lru_pos",
                                                             "_head", "_tail", "_lru_count")}
    with pytest.raises(AssertionError, match="holds fewer than 5 live entries"):
        pool.allocate(5)
    for name, value in before.items():
        assert np.array_equal(getattr(pool, name), value), name


def test_the_c_passes_reject_arrays_of_disagreeing_sizes_and_change_nothing():
    """``_pool.take`` and ``_pool.release`` check the pool's arrays and their outputs before touching any."""
    from kvcache.allocator import _pool

    pool = BlockPool(1, 8)
    arrays = [pool._ref, pool._cached, pool._stack, pool._top, pool._ring, pool._lru_pos, pool._head, pool._tail,
              pool._lru_count]
    before = [a.copy() for a in arrays]
    short_stack = arrays[:2] + [pool._stack[:4].copy()] + arrays[3:]
    out, evicted = np.empty(2, dtype=np.int32), np.empty(2, dtype=np.int32)
    with pytest.raises(ValueError, match="take: the pool's arrays have inconsistent sizes"):
        _pool.take(*short_stack, 0, out, evicted, False)
    with pytest.raises(ValueError, match="take: out must be int32 and evicted at least as long"):
        _pool.take(*arrays, 0, out, evicted[:1], False)
    with pytest.raises(ValueError, match=r"take: row 1 is not in \[0, 1\)"):
        _pool.take(*arrays, 1, out, evicted, False)
    with pytest.raises(ValueError, match="release: the pool's arrays have inconsistent sizes"):
        _pool.release(*short_stack, np.zeros(1, dtype=np.int64), np.zeros((1, 1), dtype=np.int32))
    assert all(np.array_equal(a, b) for a, b in zip(arrays, before))


def test_a_pool_state_saved_before_row_sizes_existed_restores_with_every_row_full() -> None:
    """Journal snapshots of pools from before per-row sizes hold no ``_row_blocks``: restored, every row holds
    every id, and the pool works as before."""
    pool = BlockPool(2, 8)
    pool.allocate(3)
    state = pool.__getstate__()
    del state["_row_blocks"]
    restored = BlockPool.__new__(BlockPool)
    restored.__setstate__(state)
    assert restored.row_blocks.tolist() == [8, 8]
    restored.check_integrity()
    assert restored.allocate(5) is not None and restored.allocate(1) is None


def _pool_state(pool: BlockPool) -> list[np.ndarray]:
    return [a.copy() for a in pool._c_arrays()]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_incref_of_one_int32_row_matches_the_general_path(seed):
    """One distinct int32 row (the host tier pinning a load's blocks) takes a C pass with the same result."""
    rng = np.random.default_rng(seed)
    pools = [BlockPool(2, 16), BlockPool(2, 16)]
    for pool in pools:  # the same history: allocate, cache some, release in a random order
        got = pool.allocate(12, np.array([1])).blocks[0]
        pool.mark_cached(np.ones(6, dtype=np.intp), got[:6])
    order = np.random.default_rng(seed).permutation(12)
    for pool in pools:
        pool.decref(np.ones(12, dtype=np.intp), got[order], unique=True)
    cached = got[:6]
    pick = rng.permutation(cached)[: rng.integers(1, 7)].astype(np.int32)
    if rng.integers(2):
        pick = np.sort(pick)
    pick = np.concatenate([pick, [-1]]).astype(np.int32)
    rows = np.ones((1, 1), dtype=np.intp)
    pools[0].incref(rows, pick[None, :], unique=True)
    pools[1].incref(rows, pick[None, :].astype(np.int64), unique=True)  # the general numpy path
    for a, b in zip(_pool_state(pools[0]), _pool_state(pools[1])):
        np.testing.assert_array_equal(a, b)
    pools[0].check_integrity()


def test_incref_of_one_int32_row_checks_before_any_change():
    pool = BlockPool(1, 8)
    got = pool.allocate(4, np.array([0])).blocks[0]
    pool.mark_cached(np.zeros(2, dtype=np.intp), got[:2])
    pool.decref(np.zeros(4, dtype=np.intp), got, unique=True)
    before = _pool_state(pool)
    row = np.zeros((1, 1), dtype=np.intp)
    with pytest.raises(AssertionError, match="incref of 2 free uncached blocks"):
        pool.incref(row, np.array([got[:2].tolist() + got[2:].tolist()], dtype=np.int32), unique=True)
    with pytest.raises(KVCacheError, match="blocks: ids must lie"):
        pool.incref(row, np.array([[got[0], 8]], dtype=np.int32), unique=True)
    for a, b in zip(_pool_state(pool), before):
        np.testing.assert_array_equal(a, b)

"""PrefixIndex and its C hash table, checked against plain dicts."""
from __future__ import annotations

import hashlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvcache.allocator import _hashtable
from kvcache.allocator.prefix import PrefixIndex, _empty_slots


def h(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def packed(ids) -> bytes:
    return b"".join(h(i) for i in ids)


def test_match_returns_the_longest_run_of_known_leading_hashes():
    index = PrefixIndex(2, 16)
    index.insert(packed([1, 2, 3]), np.array([[5, 6], [7, -1], [8, 9]], dtype=np.int32))
    assert index.match(packed([1, 2, 3, 4])).tolist() == [[5, 6], [7, -1], [8, 9]]
    assert index.match(packed([1, 4, 3])).tolist() == [[5, 6]]
    assert index.match(packed([4, 1])).shape == (0, 2)
    assert len(index) == 3 and h(2) in index and h(4) not in index


def test_insert_keeps_an_existing_block_and_fills_missing_rows():
    index = PrefixIndex(2, 16)
    index.insert(packed([1]), np.array([[5, -1]], dtype=np.int32))
    inserted = index.insert(packed([1]), np.array([[6, 7]], dtype=np.int32))
    assert inserted.added.tolist() == [[False, True]] and inserted.new.tolist() == [False]
    assert index.match(packed([1])).tolist() == [[5, 7]]
    index.check_integrity()


def test_a_hash_lives_until_its_last_row_loses_it():
    index = PrefixIndex(2, 16)
    index.insert(packed([1, 2]), np.array([[5, 6], [7, 8]], dtype=np.int32))
    removed = index.remove(np.array([0, 1, 1]), np.array([5, 8, 3]))
    assert removed.rows.tolist() == [0, 1] and removed.blocks.tolist() == [5, 8]
    assert [bytes(x) for x in removed.hashes] == [h(1), h(2)]
    assert len(removed.gone) == 0 and len(index) == 2
    assert [bytes(x) for x in index.remove(np.array([1]), np.array([6])).gone] == [h(1)]
    assert h(1) not in index and index.match(packed([1, 2])).shape == (0, 2)
    index.check_integrity()


def test_clear_forgets_everything():
    index = PrefixIndex(1, 8)
    index.insert(packed([1, 2]), np.array([[1], [2]], dtype=np.int32))
    assert index.clear() == 2
    assert len(index) == 0 and index.held_pairs()[0].size == 0
    index.insert(packed([3]), np.array([[1]], dtype=np.int32))
    index.check_integrity()


def twin(i: int) -> bytes:
    """A key whose first 8 bytes (all the table's tag and home slot are made of) only 7 keys share: every probe
    run holds keys with equal tags, which only the full key tells apart."""
    return (i % 7).to_bytes(8, "little") + h(i)[8:]


class HashTableMachine(RuleBasedStateMachine):
    """The C table (find/insert/remove on packed keys) behaves as a dict, across growth and deletions.

    Entry i holds key ``twin(i)`` (the table keeps entry ids; the keys live in ``hash_of``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.cap = 8
        self.hash_of = np.frombuffer(b"".join(twin(i) for i in range(61)), dtype=np.uint8).reshape(61, 32).copy()
        self.slots = _empty_slots(self.cap)
        self.model: dict[bytes, int] = {}
        # Small tables at load up to 1/2: probe runs collide and wrap around the end.
        self.seed = 12345

    def _keys(self, ids) -> bytes:
        return b"".join(twin(i) for i in ids)

    def _grow(self, extra: int) -> None:
        if 2 * (len(self.model) + extra) <= self.cap:
            return
        while 2 * (len(self.model) + extra) > self.cap:
            self.cap *= 2
        self.slots = _empty_slots(self.cap)
        if self.model:
            _hashtable.insert(self.slots, self.hash_of, self.seed, b"".join(self.model),
                              np.array(list(self.model.values()), dtype=np.int32).tobytes())

    @rule(ids=st.lists(st.integers(0, 60), max_size=12, unique=True))
    def insert(self, ids):
        self._grow(len(ids))
        inserted = _hashtable.insert(self.slots, self.hash_of, self.seed, self._keys(ids),
                                     np.array(ids, dtype=np.int32).tobytes())
        expected = 0
        for i in ids:
            if twin(i) not in self.model:
                self.model[twin(i)] = i
                expected += 1
        assert inserted == expected

    @rule(ids=st.lists(st.integers(0, 60), max_size=12, unique=True))
    def remove(self, ids):
        removed = _hashtable.remove(self.slots, self.hash_of, self.seed, self._keys(ids))
        assert removed == sum(self.model.pop(twin(i), None) is not None for i in ids)

    @rule(ids=st.lists(st.integers(0, 60), max_size=12))
    def find(self, ids):
        got = np.frombuffer(_hashtable.find(self.slots, self.hash_of, self.seed, self._keys(ids), False),
                            dtype=np.int32)
        assert got.tolist() == [self.model.get(twin(i), -1) for i in ids]
        prefix = np.frombuffer(_hashtable.find(self.slots, self.hash_of, self.seed, self._keys(ids), True),
                               dtype=np.int32)
        expected = []
        for i in ids:
            if twin(i) not in self.model:
                break
            expected.append(self.model[twin(i)])
        assert prefix.tolist() == expected

    @invariant()
    def size_matches(self):
        assert int((self.slots["entry"] >= 0).sum()) == len(self.model)


TestHashTable = HashTableMachine.TestCase
TestHashTable.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_insert_new_refuses_a_pair_that_already_holds_a_hash_and_changes_nothing():
    import pytest

    index = PrefixIndex(2, 16)
    index.insert_new(packed([1, 2]), np.array([[5, 6], [7, 8]], dtype=np.int32))
    with pytest.raises(AssertionError, match="row 1, block 8"):
        index.insert_new(packed([3, 4]), np.array([[9, 10], [11, 8]], dtype=np.int32))
    with pytest.raises(AssertionError, match="row 0, block 16"):
        index.insert_new(packed([3]), np.array([[16, 1]], dtype=np.int32))
    index.check_integrity()
    assert len(index) == 2 and h(3) not in index and h(4) not in index
    index.insert_new(packed([3, 4]), np.array([[9, 10], [11, 12]], dtype=np.int32))
    assert index.match(packed([1, 2, 3, 4])).tolist() == [[5, 6], [7, 8], [9, 10], [11, 12]]
    index.check_integrity()


def test_insert_of_a_chain_with_a_known_hash_or_a_hole_takes_the_general_path():
    """insert tries the one-pass insert of new hashes first; a known hash (in any position) or a row without a
    block makes it change nothing and fall back, which keeps the row that already holds a hash."""
    index = PrefixIndex(2, 32)
    index.insert(packed([1, 2]), np.array([[5, 6], [7, 8]], dtype=np.int32))
    before = (index._blocks.copy(), index._entry_at.copy(), index._holders.copy(), index._slots.copy())
    fresh = index._put_new(packed([3, 2]), np.array([[9, 10], [11, 12]], dtype=np.int32), fresh_only=True)
    assert not fresh and h(3) not in index  # hash 2 is known: nothing written
    hole = index._put_new(packed([3, 4]), np.array([[9, 10], [11, -1]], dtype=np.int32), fresh_only=True)
    assert not hole and h(3) not in index and h(4) not in index
    assert all(np.array_equal(a, b) for a, b in zip(before, (index._blocks, index._entry_at, index._holders,
                                                             index._slots)))
    got = index.insert(packed([3, 2, 4]), np.array([[9, 10], [11, 12], [13, -1]], dtype=np.int32))
    assert got.new.tolist() == [True, False, True] and not got.everything
    assert got.added.tolist() == [[True, True], [False, False], [True, False]]
    assert index.match(packed([1, 2, 3, 4])).tolist() == [[5, 6], [7, 8], [9, 10], [13, -1]]
    every = index.insert(packed([20, 21]), np.array([[14, 15], [16, 17]], dtype=np.int32))
    assert every.everything and every.added.all() and every.new.all()
    index.check_integrity()


def test_hash_table_rejects_malformed_buffers_and_changes_nothing():
    import pytest

    hash_of = np.frombuffer(packed([0, 1]), dtype=np.uint8).reshape(2, 32).copy()
    slots = _empty_slots(8)
    with pytest.raises(ValueError, match="power of two"):
        _hashtable.find(_empty_slots(6), hash_of, 0, b"", False)
    with pytest.raises(ValueError, match="multiple of 32"):
        _hashtable.find(slots, hash_of, 0, b"abc", False)
    with pytest.raises(ValueError, match="32 bytes per entry"):
        _hashtable.find(slots, hash_of.ravel()[:40], 0, b"", False)
    with pytest.raises(ValueError, match="outside hash_of"):
        _hashtable.insert(slots, hash_of, 0, packed([0, 1]), np.array([0, -1], dtype=np.int32).tobytes())
    with pytest.raises(ValueError, match="outside hash_of"):
        _hashtable.insert(slots, hash_of, 0, packed([0, 1]), np.array([0, 2], dtype=np.int32).tobytes())
    with pytest.raises(ValueError, match=r"hash_of\[0\] does not hold new_keys\[1\]"):
        _hashtable.insert(slots, hash_of, 0, packed([0, 1]), np.array([0, 0], dtype=np.int32).tobytes())
    assert (slots["entry"] == -1).all()  # the first (good) pair was not inserted either
    assert _hashtable.insert(slots, hash_of, 0, packed([1, 0]), np.array([1, 0], dtype=np.int32).tobytes()) == 2
    assert np.frombuffer(_hashtable.find(slots, hash_of, 0, packed([0, 1, 2]), False), np.int32).tolist() == [0, 1, -1]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "remove"]), st.lists(st.integers(0, 30), max_size=6,
                                                                             unique=True), st.booleans()), max_size=25))
def test_prefix_index_matches_a_dict_model(ops):
    """Random inserts (fresh blocks on some rows, or on every row: the one-pass path when all hashes are new) and
    removals keep index and dict model equal."""
    rows, num_blocks = 3, 256
    index = PrefixIndex(rows, num_blocks)
    model: dict[bytes, dict[int, int]] = {}
    next_block = [0] * rows
    for kind, ids, every_row in ops:
        if kind == "insert":
            blocks = np.full((len(ids), rows), -1, dtype=np.int32)
            for j, i in enumerate(ids):
                for r in range(rows):
                    if (every_row or (i + r) % 3) and next_block[r] < num_blocks:
                        blocks[j, r] = next_block[r]
                        next_block[r] += 1
            index.insert(packed(ids), blocks)
            for j, i in enumerate(ids):
                for r in range(rows):
                    b = int(blocks[j, r])
                    if b >= 0 and r not in model.get(h(i), {}):
                        model.setdefault(h(i), {})[r] = b
        else:
            pairs = [(r, b) for i in ids for r, b in model.get(h(i), {}).items()]
            index.remove(np.array([p[0] for p in pairs], dtype=np.intp), np.array([p[1] for p in pairs], dtype=np.intp))
            for i in ids:
                model.pop(h(i), None)
        index.check_integrity()
        assert len(index) == len(model)
        for key, held in model.items():
            got = index.match(key)
            assert got.shape == (1, rows)
            assert {r: int(b) for r, b in enumerate(got[0]) if b >= 0} == held


def test_filling_every_block_with_a_hash_never_rebuilds_the_table() -> None:
    """The table and entry arrays are sized for a hash per block up front: filling the cache never stops a
    step to rehash (a rebuild at 131,072 hashes took milliseconds)."""
    num_blocks = 4096
    index = PrefixIndex(1, num_blocks)
    slots, entries = index._slots, index._hash_of
    hashes = b"".join(hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(num_blocks))
    for start in range(0, num_blocks, 128):  # as admits of 128 blocks do
        chunk = hashes[start * 32:(start + 128) * 32]
        index.insert_new(chunk, np.arange(start, start + 128, dtype=np.int32)[:, None])
    assert len(index) == num_blocks
    assert index._slots is slots and index._hash_of is entries
    assert index.match(hashes[:64]).ravel().tolist() == [0, 1]
    index.check_integrity()


def test_more_hashes_than_blocks_grow_the_table_and_every_one_stays_findable() -> None:
    """Rows holding different hashes can hold more hashes than there are blocks (up to rows x blocks): past its
    presized half load the table is rebuilt from the entries' hashes, and lookups and removals still agree."""
    rows, num_blocks = 2, 64
    index = PrefixIndex(rows, num_blocks)
    before = index._slots.size
    ids = list(range(rows * num_blocks))
    for start in range(0, len(ids), 16):
        chunk = ids[start:start + 16]
        blocks = np.full((len(chunk), rows), -1, dtype=np.int32)
        for j, i in enumerate(chunk):
            blocks[j, i % rows] = i // rows  # hash i on row i % rows only
        index.insert(packed(chunk), blocks)
    index.check_integrity()
    assert index._slots.size > before and len(index) == len(ids)
    for i in ids:
        expected = [-1] * rows
        expected[i % rows] = i // rows
        assert index.match(h(i)).tolist() == [expected]
    gone = index.remove(np.array([i % rows for i in ids[::2]]), np.array([i // rows for i in ids[::2]])).gone
    assert sorted(bytes(g) for g in gone) == sorted(h(i) for i in ids[::2])
    index.check_integrity()
    assert [h(i) in index for i in ids[:4]] == [False, True, False, True]


def _match_then_mask(index: PrefixIndex, hashes: bytes, ready: np.ndarray) -> np.ndarray:
    """match_ready's reference: match, mask the blocks ``ready`` does not mark, cut at the first hash none holds."""
    blocks = index.match(hashes)
    ok = ready[blocks] & (blocks >= 0)
    found = ok.any(axis=1)
    k = found.size if found.all() else int(np.argmin(found))
    return np.where(ok, blocks, -1)[:k]


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 3), st.lists(st.integers(0, 40), max_size=30, unique=True), st.integers(0, 2**32 - 1),
       st.lists(st.integers(0, 50), max_size=30))
def test_match_ready_is_match_masked_by_the_ready_blocks(rows, ids, seed, queries):
    """A lower tier's lookup in one C pass (match_ready) finds what match and the ready mask find: the blocks of
    the leading hashes some row holds in a ready block, -1 for a row whose block is absent or not ready."""
    num_blocks = 64
    rng = np.random.default_rng(seed)
    index = PrefixIndex(rows, num_blocks)
    blocks = np.stack([rng.permutation(num_blocks)[: len(ids)] for _ in range(rows)], axis=1).astype(np.int32)
    blocks[rng.random(blocks.shape) < 0.2] = -1  # a hash no row holds is not kept
    index.insert(packed(ids), blocks)
    ready = rng.random(num_blocks) < 0.8
    chain = [i for i in ids if rng.random() < 0.9] + queries  # mostly known hashes first (a prompt's), then any
    got = index.match_ready(packed(chain), ready)
    expected = _match_then_mask(index, packed(chain), ready)
    assert got.dtype == np.int32 and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def test_match_ready_refuses_a_block_past_the_ready_flags():
    import pytest

    index = PrefixIndex(1, 16)
    index.insert(packed([1, 2]), np.array([[3], [12]], dtype=np.int32))
    assert index.match_ready(packed([1, 2]), np.ones(16, dtype=bool)).tolist() == [[3], [12]]
    assert index.match_ready(packed([1, 2]), np.arange(16) != 12).tolist() == [[3]]
    with pytest.raises(AssertionError, match="past the 8 ready flags"):
        index.match_ready(packed([1, 2]), np.ones(8, dtype=bool))

"""Sliding-window recycling: which logical blocks may be freed, checked against the token-level rule."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.swa import Full, NeededBlocks, Window, needed_blocks, recyclable_blocks

HORIZON = 64  # future queries checked beyond T; the rule's worst case is q = T, so any horizon >= 0 works


def dead(policy: Window, token: int, first_pending_query: int) -> bool:
    """Token-level definition: no query q in [T, T + HORIZON] attends to ``token`` and it is no sink."""
    if token < policy.sink_tokens:
        return False
    return all(q - token >= policy.window_tokens
               for q in range(first_pending_query, first_pending_query + HORIZON + 1))


def brute_recyclable(policy: Window, first_pending_query: int, block_size: int) -> set[int]:
    """Blocks all of whose tokens are dead, found by checking every token and query."""
    last_block = first_pending_query // block_size + 2
    return {i for i in range(last_block)
            if all(dead(policy, p, first_pending_query) for p in range(i * block_size, (i + 1) * block_size))}


def brute_needed(policy: Window, num_tokens: int, block_size: int) -> set[int]:
    """Blocks holding a cached token the query at ``num_tokens`` attends to, or its own token's block.

    Query L's key is written at L; if L shares a block with the prefix's last tokens, that block stays.
    """
    q = num_tokens
    seen = {p for p in range(num_tokens) if p < policy.sink_tokens or q - p < policy.window_tokens}
    written = {q // block_size} if q % block_size else set()
    return {p // block_size for p in seen} | written


windows = st.builds(Window, window_tokens=st.integers(1, 40), sink_tokens=st.integers(0, 20))


def test_policies_are_frozen_records():
    """Policies are immutable values that compare by fields."""
    assert Window(8, 2) == Window(window_tokens=8, sink_tokens=2)
    assert Window(8).sink_tokens == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        Window(8).window_tokens = 4  # type: ignore[misc]
    assert Full() == Full()


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"window_tokens": 0}, "window_tokens"),
    ({"window_tokens": 4, "sink_tokens": -1}, "sink_tokens"),
    ({"window_tokens": 2.5}, "window_tokens"),
    ({"window_tokens": True}, "window_tokens"),
])
def test_window_rejects_bad_fields_naming_them(kwargs: dict, field: str):
    """A window of 0 tokens, a negative sink or a non-integer is a caller mistake naming the field."""
    with pytest.raises(KVCacheError, match=field):
        Window(**kwargs)


def test_bad_positions_and_block_sizes_are_rejected():
    """Negative positions and empty blocks name their argument."""
    with pytest.raises(KVCacheError, match="first_pending_query"):
        recyclable_blocks(Window(4), -1, 16)
    with pytest.raises(KVCacheError, match="block_size"):
        recyclable_blocks(Window(4), 10, 0)
    with pytest.raises(KVCacheError, match="num_tokens"):
        needed_blocks(Window(4), -3, 16)


def test_full_rows_never_free_anything():
    """Full attention keeps every block and needs every block of a prefix."""
    assert recyclable_blocks(Full(), 10_000, 16) == range(0, 0)
    assert needed_blocks(Full(), 33, 16) == NeededBlocks(range(0, 0), range(0, 3))


def test_docstring_example_frees_only_the_block_between_sink_and_window():
    """W=6, S=2, B=4, T=15: block 0 holds the sink, block 2 holds tokens 10 and 11 that q=15 sees."""
    assert recyclable_blocks(Window(6, 2), 15, 4) == range(1, 2)
    assert needed_blocks(Window(6, 2), 16, 4) == NeededBlocks(range(0, 1), range(2, 4))


def test_nothing_is_freed_before_the_window_has_passed_a_whole_block():
    """With T - W + 1 short of a block boundary, no block is wholly dead."""
    assert recyclable_blocks(Window(16), 16, 16) == range(0, 0)
    assert recyclable_blocks(Window(16), 31, 16) == range(0, 1)
    assert recyclable_blocks(Window(16), 30, 16) == range(0, 0)


def test_sink_blocks_are_never_freed():
    """A block holding any sink token stays, even long after the window passed it."""
    assert recyclable_blocks(Window(4, sink_tokens=1), 1000, 16).start == 1
    assert recyclable_blocks(Window(4, sink_tokens=17), 1000, 16).start == 2
    assert recyclable_blocks(Window(4, sink_tokens=32), 1000, 16).start == 2


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("sink", [0, 1, 3, 4, 7])
@pytest.mark.parametrize("window", [1, 2, 3, 5, 8])
def test_window_frees_blocks_only_past_sink_and_wholly_dead(window: int, sink: int, block_size: int):
    """Exhaustive on small sizes: the range is exactly the blocks whose every token is dead."""
    policy = Window(window, sink)
    for first_pending_query in range(0, 40):
        got = recyclable_blocks(policy, first_pending_query, block_size)
        assert set(got) == brute_recyclable(policy, first_pending_query, block_size), first_pending_query


@pytest.mark.parametrize("block_size", [1, 2, 3, 4])
@pytest.mark.parametrize("sink", [0, 1, 3, 5])
@pytest.mark.parametrize("window", [1, 2, 3, 6])
def test_needed_blocks_are_those_the_next_query_sees(window: int, sink: int, block_size: int):
    """Exhaustive on small sizes: sink and window ranges cover exactly the blocks query L reads or writes."""
    policy = Window(window, sink)
    for num_tokens in range(0, 30):
        got = needed_blocks(policy, num_tokens, block_size)
        assert set(got.sink) | set(got.window) == brute_needed(policy, num_tokens, block_size), num_tokens


@settings(max_examples=500, deadline=None)
@given(policy=windows, first_pending_query=st.integers(0, 300), block_size=st.integers(1, 33))
def test_freed_blocks_hold_only_tokens_no_pending_query_reads(policy: Window, first_pending_query: int,
                                                              block_size: int):
    """Every token of a freed block is past the sink and before every pending query's window."""
    got = recyclable_blocks(policy, first_pending_query, block_size)
    assert got.step == 1 and got.start <= got.stop
    for i in got:
        first, last = i * block_size, (i + 1) * block_size - 1
        assert first >= policy.sink_tokens
        assert first_pending_query - last >= policy.window_tokens
        assert last < first_pending_query
    assert set(got) == brute_recyclable(policy, first_pending_query, block_size)


@settings(max_examples=300, deadline=None)
@given(policy=windows, first_pending_query=st.integers(0, 300), block_size=st.integers(1, 33))
def test_recycling_only_grows_as_queries_advance(policy: Window, first_pending_query: int, block_size: int):
    """A block freed at T stays freeable at T + 1: holes never need refilling."""
    now = recyclable_blocks(policy, first_pending_query, block_size)
    later = recyclable_blocks(policy, first_pending_query + 1, block_size)
    assert set(now) <= set(later)


@settings(max_examples=500, deadline=None)
@given(policy=st.one_of(windows, st.just(Full())), num_tokens=st.integers(0, 300), block_size=st.integers(1, 33))
def test_needed_and_recyclable_split_a_prefix(policy: Window | Full, num_tokens: int, block_size: int):
    """Each block of a cached prefix is either needed by the next query or recyclable at T = L, never both."""
    needed = needed_blocks(policy, num_tokens, block_size)
    recyclable = set(recyclable_blocks(policy, num_tokens, block_size))
    kept = set(needed.sink) | set(needed.window)
    assert kept.isdisjoint(recyclable)
    assert kept | recyclable == set(range(-(-num_tokens // block_size)))
    if isinstance(policy, Window):
        assert set(needed.sink) | set(needed.window) == brute_needed(policy, num_tokens, block_size)

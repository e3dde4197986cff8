"""Attention policies per row and which logical blocks a sliding-window or chunked row may free.

Query ``q`` of a ``Window(W, S)`` row attends to keys ``q-W+1 .. q`` plus the
first ``S`` (sink) tokens; a ``Chunked(C)`` row (Llama 4's chunked local
attention) to keys ``(q // C) * C .. q``, its own chunk; a ``Full`` row to
every earlier key. So a Window row no longer needs token ``p`` once every
query still to run, ``q >= T``, has ``q - p >= W``, i.e. once ``p <= T - W``;
a Chunked row once ``p < (T // C) * C``. Full rows never free anything.
Everything here is arithmetic on ranges: no arrays, no state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Union

import numpy as np

from kvcache.allocator.errors import KVCacheError


def _check_int(field: str, value: int, least: int) -> None:
    """Raise KVCacheError naming ``field`` unless ``value`` is an int >= ``least``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise KVCacheError(f"{field}: must be an integer >= {least}, got {value!r}")


@dataclass(frozen=True, slots=True)
class Full:
    """Full attention: every key stays needed for the request's lifetime."""


@dataclass(frozen=True, slots=True)
class Window:
    """Sliding-window attention over the last ``window_tokens`` keys plus ``sink_tokens`` first keys.

    ``window_tokens`` counts the query's own token (W=1 sees only itself).
    """

    window_tokens: int
    sink_tokens: int = 0

    def __post_init__(self) -> None:
        """Validate once here so the range arithmetic below can trust the fields."""
        _check_int("window_tokens", self.window_tokens, 1)
        _check_int("sink_tokens", self.sink_tokens, 0)


@dataclass(frozen=True, slots=True)
class Chunked:
    """Chunked local attention: query ``q`` sees keys ``(q // C) * C .. q``, the chunk of ``chunk_tokens`` it is in.

    Blocks of earlier chunks are given back as a window's are. A manager needs ``chunk_tokens`` to be a multiple
    of its block size, so a chunk starts on a block and prefix hits follow vLLM's ``ChunkedLocalAttentionSpec``.
    """

    chunk_tokens: int

    def __post_init__(self) -> None:
        """Validate once here so the range arithmetic below can trust the field."""
        _check_int("chunk_tokens", self.chunk_tokens, 1)


AttentionPolicy = Union[Full, Window, Chunked]
LocalPolicy = Union[Window, Chunked]  # the policies whose rows give blocks back


class NeededBlocks(NamedTuple):
    """Logical blocks a row must hold to serve the next query: sink blocks and window blocks.

    The two ranges may overlap; a Full row needs everything and reports it as
    ``window`` with an empty ``sink``.
    """

    sink: range
    window: range


def _ceil_div(a: int, b: int) -> int:
    """Ceiling of ``a / b`` for ``a >= 0, b >= 1``."""
    return -(-a // b)


def sink_tokens(policy: AttentionPolicy) -> int:
    """The first tokens every query of the row sees (a Window's sink; none for Chunked or Full)."""
    return policy.sink_tokens if isinstance(policy, Window) else 0


def first_seen_token(policy: LocalPolicy, query: int | np.ndarray) -> int | np.ndarray:
    """The first key past the sink that the query at ``query`` sees (elementwise for an int array)."""
    if isinstance(policy, Chunked):
        return query // policy.chunk_tokens * policy.chunk_tokens
    if isinstance(query, np.ndarray):
        return np.maximum(query - policy.window_tokens + 1, 0)
    return max(query - policy.window_tokens + 1, 0)  # an int: no numpy call (an admit's window progress)


def recycle_at(policy: LocalPolicy, recycled: int | np.ndarray, block_size: int) -> int | np.ndarray:
    """The least ``first_pending_query`` at which block ``recycled`` may be freed, sinks aside (elementwise).

    Window: ``(recycled + 1) * B + W - 1``; Chunked: the first chunk start at or past ``(recycled + 1) * B``.
    """
    end = (recycled + 1) * block_size
    if isinstance(policy, Chunked):
        return -(-end // policy.chunk_tokens) * policy.chunk_tokens
    return end + policy.window_tokens - 1


def recyclable_blocks(policy: AttentionPolicy, first_pending_query: int, block_size: int) -> range:
    """Logical blocks ``[start, stop)`` a row may free before queries from ``first_pending_query`` run.

    ``first_pending_query`` (T) is the smallest query position whose attention
    has not finished: the first token of the earliest step that is being
    scheduled *or still in flight*. Keys ``>= T`` are still to be written and
    queries ``>= T`` read keys from ``T - W + 1`` on, while a freed block holds
    only tokens ``p <= T - W``, so nothing in flight touches it. ``start =
    ceil(S / B)`` is the first block wholly past the sink; ``stop = (T - W +
    1) // B`` counts the blocks wholly dead (all hold tokens ``< T``, so they
    exist). Empty for Full rows and whenever ``stop <= start``; the range only
    grows as T grows, so a caller frees ``[previous stop, stop)`` each step.
    A Chunked row has no sink and ``stop = (T // C) * C // B``: the blocks
    before T's chunk (vLLM's ``remove_skipped_blocks`` with T computed tokens).

    Example W=6, S=2, B=4, T=15 (dead tokens p <= 9)::

        token   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15 | 16 ...
        block   0       | 1       | 2         | 3           |
                S S . . | d d d d | d d  .  . | .  .  .  q  |
                sink    | freed   | kept      | q = T = 15 sees 10..15 and 0..1
        -> range(1, 2): block 0 holds sink tokens, block 2 holds live tokens 10, 11.
    """
    _check_int("first_pending_query", first_pending_query, 0)
    _check_int("block_size", block_size, 1)
    if isinstance(policy, Full):
        return range(0, 0)
    start = _ceil_div(sink_tokens(policy), block_size)
    return range(start, window_stop(policy, first_pending_query, block_size))


def window_stop(policy: LocalPolicy, first_pending_query: int | np.ndarray, block_size: int) -> int | np.ndarray:
    """``recyclable_blocks(policy, ...).stop`` for a Window or Chunked row, unchecked: what a decode step's loops
    call, for one request (an int) or a run of them (an int array, elementwise)."""
    stop = first_seen_token(policy, first_pending_query) // block_size
    sink = -(-sink_tokens(policy) // block_size)
    return np.maximum(sink, stop) if isinstance(stop, np.ndarray) else int(max(sink, stop))


def needed_blocks(policy: AttentionPolicy, num_tokens: int, block_size: int) -> NeededBlocks:
    """Blocks of a cached prefix of ``num_tokens`` (L) tokens that the query at position L needs.

    ``sink`` holds tokens ``[0, min(S, L))``; ``window`` runs from the block of
    token ``L - W + 1`` (the first the query sees) through the prefix's last
    block, which also receives token L's own key when L is not a multiple of
    B. A prefix hit is usable on a row only if every block in both ranges is
    still cached there; the other blocks of ``[0, ceil(L / B))`` are exactly
    ``recyclable_blocks(policy, L, B)``, so they may be -1 holes.

    Example W=6, S=2, B=4, L=16 (query 16 sees tokens 11..15 and 0..1)::

        token   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15 | 16
        block   0       | 1       | 2         | 3           |
                S S . . | . . . . | . .  .  w | w  w  w  w  | q
        -> sink range(0, 1), window range(2, 4); block 1 may be a hole.

    A Chunked row needs the blocks of L's chunk before L: with C a multiple of
    B, a prefix of L tokens is a hit once blocks ``(L // C) * C // B`` through
    its last are cached, which is vLLM's ``ChunkedLocalAttentionSpec`` rule.
    """
    _check_int("num_tokens", num_tokens, 0)
    _check_int("block_size", block_size, 1)
    total = _ceil_div(num_tokens, block_size)
    if isinstance(policy, Full):
        return NeededBlocks(range(0, 0), range(0, total))
    sink = range(0, _ceil_div(min(sink_tokens(policy), num_tokens), block_size))
    first_seen = int(first_seen_token(policy, num_tokens))
    return NeededBlocks(sink, range(min(first_seen // block_size, total), total))

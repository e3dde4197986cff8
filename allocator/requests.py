"""Requests' bookkeeping for KVCacheManager: each admitted request's record and the slot arrays of its hot fields.

An admitted request gets a slot: a row of the manager's per-request arrays
(token count, fast-path limits, the partial block's tokens, last hash, table
width), which the C passes of a decode step read and write for all requests at
once. The ``_Request`` record holds the rest (its table, window progress, hash
keys). Tables go out as read-only views, cached until the table changes.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.prefix import HASH_BYTES, Inserted, LoRA, MMPlaceholder
from kvcache.allocator.swa import recyclable_blocks, recycle_at

if TYPE_CHECKING:
    from collections.abc import Sequence

_NEVER = 2**62  # a _next_recycle no request reaches
_NO_COLUMNS = np.empty(0, dtype=np.int32)


class Admission(NamedTuple):
    """What ``admit`` decided: the cached prefix, the table, and the tokens the table covers.

    ``num_cached_tokens`` is a multiple of block_size and at most
    ``len(prompt) - 1``; the step computes tokens ``[num_cached_tokens, num_tokens)``.
    """

    num_cached_tokens: int
    table: np.ndarray
    num_tokens: int
    num_host_tokens: int = 0  # of the cached tokens, those a lower tier (host memory) copies back


@dataclasses.dataclass(slots=True)
class _Request:
    """One admitted request: its table and hashing progress (token counts live in the manager's slot arrays).

    Only the tokens of the partial last block are kept (in the manager's
    ``_tail[slot]``): every full block is hashed as it fills, and a block's
    tokens are never read again after that.
    """

    slot: int  # row of the manager's per-request arrays
    table: np.ndarray  # int32 [num_groups, capacity_blocks]: one row per distinct policy
    heads: np.ndarray | None  # int32 [num_rows, capacity_blocks]: table expanded to rows, when they differ
    num_blocks: int
    recycled: list[int]  # per window group: logical blocks [0, recycled) already given back
    cache_salt: str | None
    lora: LoRA | None
    mm: list[MMPlaceholder] | None
    changed: np.ndarray | range | None  # columns the last admit/extend set (None: the last one; see _changed_ok)
    view: np.ndarray | None = None  # cached read-only view of the table handed to callers


class _Chunk(NamedTuple):
    """Changed columns of some requests of a batch: request ``index[j]`` set ``sizes[j]`` of ``cols`` (in turn).

    ``vals`` (int32 ``[num_rows, cols.size]``) holds the new values, or None
    for one request's chunk whose values are read from its table afterwards.
    """

    index: np.ndarray
    sizes: np.ndarray
    cols: np.ndarray
    vals: np.ndarray | None


class TableDeltas(NamedTuple):
    """What ``extend_many_deltas`` changed, in the wire protocol's compressed rows.

    ``lens[i]`` is request i's table width after the batch (-1: no room, request
    unchanged); request ``index[j]`` (ascending) set columns
    ``cols[offsets[j]:offsets[j + 1]]`` to ``vals[:, offsets[j]:offsets[j + 1]]``
    (int32 ``[num_rows, total]``); every other table is as it was.
    """

    lens: np.ndarray
    index: np.ndarray
    offsets: np.ndarray
    cols: np.ndarray
    vals: np.ndarray


class RequestSlots:
    """KVCacheManager's request bookkeeping: slots, records and the fast-path limits kept per slot."""

    def _init_slots(self) -> None:
        """Empty per-request slot arrays: a decode step updates these hot fields all at once.

        Per slot: tokens covered, the fast-path limits (see _refresh), the table
        width, whether req.changed is current (a fast-path extend changes no
        column), the partial last block's tokens, the last column's blocks, the
        last full block's hash, and whether hashing needs extra keys.
        """
        groups = len(self._group_col)
        self._slot_of: dict[object, int] = {}
        self._by_slot: list[_Request | None] = []
        self._free_slots: list[int] = []
        self._ntok = np.zeros(0, dtype=np.int64)
        self._fast_limit = np.zeros(0, dtype=np.int64)
        self._next_recycle = np.zeros(0, dtype=np.int64)
        self._width = np.zeros(0, dtype=np.int32)
        self._changed_ok = np.zeros(0, dtype=bool)
        self._tail = np.zeros((0, self.block_size), dtype=np.uint32)
        self._stamp = np.zeros(0, dtype=np.intp)  # scratch for _tables.extend_fast
        self._keyed = np.zeros(0, dtype=bool)  # the request's blocks hash extra keys (LoRA, multimodal)
        self._salted = np.zeros(0, dtype=bool)  # the request's block 0 hashes a cache salt
        self._last_block = np.zeros((0, groups), dtype=np.int32)  # each group's block in the last column
        self._last_hash = np.zeros((0, HASH_BYTES), dtype=np.uint8)  # hash of the last full block (root: none)
        self._all_new = Inserted(np.ones((1, groups), dtype=bool), np.ones(1, dtype=bool))  # one new hash, all rows

    def _next_slot(self) -> int:
        """The row ``_take_slot`` gives next, the arrays grown to hold it; nothing taken."""
        if self._free_slots:
            return self._free_slots[-1]
        slot = len(self._by_slot)
        if slot == self._ntok.size:
            size = max(64, 2 * slot)
            self._ntok = _resized(self._ntok, size)
            self._fast_limit = _resized(self._fast_limit, size)
            self._next_recycle = _resized(self._next_recycle, size)
            self._width = _resized(self._width, size)
            self._changed_ok = _resized(self._changed_ok, size)
            self._tail = _resized(self._tail, size)
            self._keyed = _resized(self._keyed, size)
            self._last_block = _resized(self._last_block, size)
            self._last_hash = _resized(self._last_hash, size)
            self._salted = _resized(self._salted, size)
            self._stamp = np.zeros(size, dtype=np.intp)
        return slot

    def _take_slot(self) -> int:
        """A free row of the per-request arrays, growing them by doubling."""
        slot = self._next_slot()
        if self._free_slots:
            self._free_slots.pop()
        else:
            self._by_slot.append(None)
        return slot

    def _get(self, request_id: object) -> _Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise KVCacheError(f"request_id: {request_id!r} is not admitted") from None

    def _record(self, request_id: object, slot: int, table: np.ndarray, num_blocks: int, recycled: list[int],
                cache_salt: str | None, lora: LoRA | None, mm: Sequence[MMPlaceholder | tuple[str, int, int]] | None
                ) -> _Request:
        """An admitted request's record, filed under its id and ``slot``, with the slot's hashing flags."""
        req = _Request(slot, table, table[self._row_group] if self._expand else None, num_blocks, recycled,
                       cache_salt, lora, list(mm) if mm else None, range(0, num_blocks))
        self._requests[request_id] = req
        self._slot_of[request_id] = slot
        self._by_slot[slot] = req
        self._keyed[slot] = lora is not None or bool(mm)
        self._salted[slot] = bool(cache_salt)
        return req

    def _refresh(self, req: _Request) -> None:
        """After a table change: drop the cached view and recompute the fast-path limits."""
        req.view = None
        self._set_limits(req.slot, req.num_blocks, self._recycle_at(req.recycled))

    def _set_limits(self, slots: int | np.ndarray, num_blocks: int | np.ndarray,
                    next_recycle: int | np.ndarray) -> None:
        """The fast-path limits of a slot (an int) or of several (an intp array, with arrays of the rest), whose
        tables hold ``num_blocks`` and whose window rows give a block back next at ``next_recycle`` tokens."""
        bs = self.block_size
        # An extend up to ``limit`` tokens stays in the last block and, with hashing, does not fill it.
        limit = num_blocks * bs
        if self._hasher is not None:
            limit = np.minimum(limit, (self._ntok[slots] // bs + 1) * bs - 1)
        self._fast_limit[slots] = limit
        self._next_recycle[slots] = next_recycle
        self._width[slots] = num_blocks

    def _recycle_at(self, recycled: list[int] | list[np.ndarray]) -> int | np.ndarray:
        """The first num_computed_tokens at which a window or chunked row would give a block back (per group,
        ``recycled`` blocks are given back already; with one window group, an array of counts gives an array)."""
        if not self._window_groups:
            return _NEVER
        bs = self.block_size
        return min(recycle_at(policy, recycled[g], bs) for g, (policy, _) in enumerate(self._window_groups))

    def _recycled_after(self, num_hit: int) -> list[int]:
        """Per window group, the blocks a request admitted with a hit of ``num_hit`` blocks has given back."""
        if not self._window_groups:
            return []
        bs = self.block_size
        return [recyclable_blocks(w, num_hit * bs, bs).stop for w, _ in self._window_groups]

    def _count_query(self, num_tokens: int, num_cached: int) -> None:
        """The prefix-hit statistics of one admitted prompt of ``num_tokens`` with ``num_cached`` blocks cached."""
        self._queries += 1
        self._hit_requests += num_cached > 0
        self._queried_tokens += num_tokens
        self._hit_tokens += num_cached * self.block_size

    def _changed_of(self, req: _Request) -> np.ndarray:
        """``changed_columns`` of a request record."""
        if not self._changed_ok[req.slot]:
            return _NO_COLUMNS
        if req.changed is None:
            return np.array([req.num_blocks - 1], dtype=np.int32)
        if isinstance(req.changed, range):
            return np.arange(req.changed.start, req.changed.stop, dtype=np.int32)
        return req.changed


def _view(req: _Request) -> np.ndarray:
    """The request's table as a read-only view (cached until the table changes)."""
    view = (req.table if req.heads is None else req.heads)[:, : req.num_blocks]
    view.setflags(write=False)  # (a third cheaper than view.flags.writeable = False)
    req.view = view
    return view


def _columns(ranges: list[range]) -> np.ndarray:
    """The union of column ranges as an ascending int32 array."""
    parts = [np.arange(r.start, r.stop, dtype=np.int32) for r in ranges if r.stop > r.start]
    if not parts:
        return np.empty(0, dtype=np.int32)
    return parts[0] if len(parts) == 1 else np.unique(np.concatenate(parts))


def _resized(arr: np.ndarray, rows: int) -> np.ndarray:
    """A zero-filled copy of ``arr`` with ``rows`` rows, the existing ones kept."""
    out = np.zeros((rows, *arr.shape[1:]), dtype=arr.dtype)
    out[: arr.shape[0]] = arr
    return out


def _put_column(req: _Request, col: int, column: np.ndarray) -> None:
    """Write table column ``col`` of a request whose table is full: it doubles first (its expanded rows too)."""
    req.table = _widen(req.table, col, _grow(col + 1, 4))
    req.table[:, col] = column
    if req.heads is not None:
        req.heads = _widen(req.heads, col, req.table.shape[1])


def _widen(table: np.ndarray, used: int, capacity: int) -> np.ndarray:
    """A copy of ``table`` with ``capacity`` columns: the first ``used`` kept, the rest -1."""
    grown = np.full((table.shape[0], capacity), -1, dtype=np.int32)
    grown[:, :used] = table[:, :used]
    return grown


def _grow(needed: int, least: int) -> int:
    """Capacity for ``needed`` items: the next power of two, at least ``least``."""
    return max(least, 1 << max(0, needed - 1).bit_length())


def _check_count(value: object, field: str, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise KVCacheError(f"{field}: must be an integer, got {value!r}")
    if value < least:
        raise KVCacheError(f"{field}: must be at least {least}, got {value}")

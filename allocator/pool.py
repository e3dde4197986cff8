"""Per-row block pool: free heaps, reference counts and LRU of cached free blocks.

A row is an independent block-id space over ``[0, num_blocks)`` (KVCacheManager
gives the pool one row per row group: one for a uniform cache, one per distinct
attention policy for a head-wise one). Every operation is a handful of
numpy array operations over all the (row, block) pairs it touches; Python
loops run only over rows, and only on rare paths (ring compaction, reset). A
single pair, or a one-row pool, takes a scalar or slice path instead: a decode
step allocates and frees one block at a time, where numpy's per-call cost is
most of the work.

Free blocks live in one of two places per row:

* the *free stack* holds uncached free blocks, reused LIFO (a just-freed block
  is reused first, which keeps the working set small and GPU-local);
* the *LRU ring* holds cached free blocks (refcount 0, ``cached`` set),
  reused only when the stack is empty, oldest-released first. Reusing one
  *evicts* it: the allocation reports the pair and the flag is cleared.

The ring is a circular per-row buffer of block ids (a power of two >= 2 *
num_blocks slots) between ``head`` and ``tail`` positions, with a
per-(row, block) ``lru_pos``: ring entry ``g`` is live iff
``lru_pos[row, ring[g]] == g``. Reviving (incref from 0) or uncaching a block
sets ``lru_pos`` to -1, which makes its entry stale in O(1); popping skips
stale entries; a ring filled with stale entries is compacted, amortised O(1).
Reviving a row's newest entries (a prefix released last, hit again: the usual
case) pulls its tail back over them instead, so no stale entry is left.

The pool knows nothing about hashes: ``cached`` is a flag its owner sets.
"""
from __future__ import annotations

from typing import NamedTuple

from collections.abc import Sequence

import numpy as np

from kvcache.allocator import _pool
from kvcache.allocator.errors import KVCacheError

_EMPTY_I32 = np.empty(0, dtype=np.int32)
_ONE = np.int32(1)  # same dtype as the refcounts keeps np.add.at on its fast path


class Allocation(NamedTuple):
    """New blocks per row and the cached blocks evicted to provide them.

    ``blocks[i]`` are row ``rows[i]``'s new blocks (int32): first those taken
    from the free stack in LIFO order, then evicted ones oldest first.
    ``evicted_rows``/``evicted_blocks`` (int32, parallel) list every evicted
    pair row by row in the order rows were given, oldest first within a row;
    the owner must drop whatever it keyed on those pairs (their hashes).
    """

    blocks: np.ndarray
    evicted_rows: np.ndarray
    evicted_blocks: np.ndarray


class Usage(NamedTuple):
    """Fraction of blocks in use per row (float64, exact: 1 of 10**6 is 1e-6) and its maximum."""

    per_row: np.ndarray
    max: float


def usage(num_free: np.ndarray, num_blocks: int | np.ndarray) -> Usage:
    """Used fraction per row from free counts and each row's blocks (one count for all, or one per row); never
    rounds a non-empty row down to 0."""
    total = np.asarray(num_blocks, dtype=np.float64)
    if (total < 1).any():
        raise KVCacheError(f"num_blocks: must be at least 1, got {num_blocks}")
    free = np.asarray(num_free, dtype=np.float64)
    per_row = (total - free) / total
    return Usage(per_row, float(per_row.max()) if per_row.size else 0.0)


class BlockPool:
    """Reference-counted blocks for ``num_rows`` independent rows of ``num_blocks`` ids each.

    Guarantees: deterministic (same calls, same ids; a fresh pool hands out
    0, 1, 2, ... in every row); a failed ``allocate`` returns None and changes
    nothing; cached free blocks are reused only when no uncached free block is
    left, oldest-released first; a block with references is never handed out.
    Pair arguments ``(rows, blocks)`` are int arrays that broadcast together
    (e.g. ``rows[:, None]`` against a ``[rows, n]`` table); C order is the
    order of the pairs; block -1 (a table hole) is skipped. ``incref`` and
    ``decref`` take ``unique=True`` when the caller knows no pair repeats
    (a request's table, a prefix hit): it skips the duplicate handling.
    """

    def __init__(self, num_rows: int, num_blocks: int, row_blocks: Sequence[int] | None = None) -> None:
        """Every block free, uncached, refcount 0; the free stacks pop 0 first.

        ``row_blocks`` gives row r only blocks ``[0, row_blocks[r])`` (each at most ``num_blocks``, the id
        space): rows whose requests hold fewer blocks (a sliding window's) get smaller pools.
        """
        for field, value in (("num_rows", num_rows), ("num_blocks", num_blocks)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise KVCacheError(f"{field}: must be an integer >= 1, got {value!r}")
        if num_blocks >= 2**31 - 1:
            raise KVCacheError(f"num_blocks: block ids are int32, got {num_blocks}")
        rows, n = int(num_rows), int(num_blocks)
        sizes = np.full(rows, n, dtype=np.intp) if row_blocks is None else np.asarray(row_blocks)
        if sizes.shape != (rows,) or sizes.dtype.kind not in "iu" or (sizes < 1).any() or (sizes > n).any():
            raise KVCacheError(f"row_blocks: needs one integer in [1, {n}] per row ({rows}), got "
                               f"{list(row_blocks) if row_blocks is not None else None!r}")
        self._row_blocks = sizes.astype(np.intp)
        self._rows, self._n = rows, n
        # Ring slots per row: a power of two >= 2n, so positions wrap with a mask
        # and, after compaction, at least n free slots remain.
        self._cap = 1 << (2 * n - 1).bit_length()
        self._mask = self._cap - 1
        self._all_rows = np.arange(rows, dtype=np.intp)
        self._row_base = self._all_rows[:, None] * n  # flat offset of each row, as a column
        self._row_edges = np.arange(rows + 1, dtype=np.intp)
        self._zeros = np.zeros(n, dtype=np.intp)  # row ids of a row-0 table, sliced (read-only)
        self._zeros.flags.writeable = False
        self._ref = np.zeros(rows * n, dtype=np.int32)
        self._cached = np.zeros(rows * n, dtype=bool)
        # Stack bottom..top is n_r-1..0 so the first pops are 0, 1, 2, ... (row r holds n_r of the n ids).
        self._stack2d = np.tile(np.arange(n - 1, -1, -1, dtype=np.int32), (rows, 1))
        for r in np.flatnonzero(self._row_blocks < n).tolist():
            k = int(self._row_blocks[r])
            self._stack2d[r, :k] = np.arange(k - 1, -1, -1, dtype=np.int32)
        self._stack = self._stack2d.reshape(-1)  # flat view: slot row*n + i
        self._top = self._row_blocks.copy()
        self._ring2d = np.zeros((rows, self._cap), dtype=np.int32)
        self._ring = self._ring2d.reshape(-1)  # flat view: entry g = row*cap + (position & mask)
        self._lru_pos = np.full(rows * n, -1, dtype=np.intp)  # live ring entry g per (row, block), or -1
        self._head = np.zeros(rows, dtype=np.intp)  # positions, not wrapped: entries are [head, tail)
        self._tail = np.zeros(rows, dtype=np.intp)
        self._lru_count = np.zeros(rows, dtype=np.intp)

    def __getstate__(self) -> dict[str, object]:
        """Pickle without the flat views: unpickled, a view would be a copy that no longer aliases."""
        state = self.__dict__.copy()
        del state["_stack"], state["_ring"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        """Restore the fields and rebuild the flat views."""
        self.__dict__.update(state)
        if "_row_blocks" not in state:  # a snapshot of a pool whose rows all hold every id
            self._row_blocks = np.full(self._rows, self._n, dtype=np.intp)
        self._stack = self._stack2d.reshape(-1)
        self._ring = self._ring2d.reshape(-1)
        self._zeros.flags.writeable = False

    @property
    def num_rows(self) -> int:
        """Number of independent rows."""
        return self._rows

    @property
    def num_blocks(self) -> int:
        """The block id space of every row: ``[0, num_blocks)``."""
        return self._n

    @property
    def row_blocks(self) -> np.ndarray:
        """Blocks each row holds (intp ``[num_rows]``, a copy): ``num_blocks`` unless the pool was given sizes."""
        return self._row_blocks.copy()

    def _c_arrays(self) -> tuple[np.ndarray, ...]:
        """The arrays the C passes over the pool take first, in their order (``_pool.h``'s ``open_pool``)."""
        return (self._ref, self._cached, self._stack, self._top, self._ring, self._lru_pos, self._head, self._tail,
                self._lru_count)

    # ----------------------------------------------------------------- queries

    def num_free(self, rows: np.ndarray | None = None) -> np.ndarray:
        """Allocatable blocks per row (intp): uncached free plus cached-but-unreferenced."""
        if rows is None:
            return self._top + self._lru_count
        r = self._row_ids(rows)
        return self._top[r] + self._lru_count[r]

    def min_free(self) -> int:
        """The fewest allocatable blocks of any row: ``allocate(n)`` of every row succeeds iff n <= this."""
        if self._rows == 1:
            return int(self._top[0]) + int(self._lru_count[0])
        return int((self._top + self._lru_count).min())

    def num_cached_free(self, rows: np.ndarray | None = None) -> np.ndarray:
        """Cached blocks with no references per row (intp): free, but evicted if reused."""
        return self._lru_count[self._row_ids(rows)].copy()

    def refcount(self, rows: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Reference counts (int32) in the broadcast shape of the pairs; holes (-1) read 0."""
        flat, holes = self._lookup(rows, blocks)
        out = self._ref[flat]
        return out if holes is None else np.where(holes, np.int32(0), out)

    def is_cached(self, rows: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """Cached flags (bool) in the broadcast shape of the pairs; holes (-1) read False."""
        flat, holes = self._lookup(rows, blocks)
        out = self._cached[flat]
        return out if holes is None else out & ~holes

    def can_allocate(self, n: int, rows: np.ndarray | None = None) -> bool:
        """Whether ``allocate(n, rows)`` would succeed (every row has ``n`` allocatable blocks)."""
        self._check_n(n)
        r = self._row_ids(rows)
        return bool(((self._top[r] + self._lru_count[r]) >= n).all())

    # ----------------------------------------------------------------- actions

    def allocate(self, n: int, rows: np.ndarray | None = None, *, ascending: bool = False) -> Allocation | None:
        """Take ``n`` blocks in each of ``rows`` (None: all rows) with refcount 1.

        Per row: pop the free stack (LIFO), then evict from the LRU ring
        (oldest first). Returns None and changes nothing if any row has fewer
        than ``n`` allocatable blocks. ``ascending`` sorts each row's blocks:
        for one request's table, so neighbours in memory sit side by side in it
        and every transfer of them (PD writes, host-tier copies) merges them
        into fewer, longer ranges (without it, blocks freed together come back
        in reverse).
        """
        if rows is None and self._rows == 1:
            self._check_n(n)
            return self._allocate_row(0, n, ascending)
        allocation = self._take(n, rows)
        if ascending and allocation is not None and n > 1:
            # A copy: on some paths the blocks and the evicted ids (oldest first) share memory.
            allocation = allocation._replace(blocks=np.sort(allocation.blocks, axis=1))
        return allocation

    def _take(self, n: int, rows: np.ndarray | None) -> Allocation | None:
        """``allocate``'s blocks in pop order."""
        self._check_n(n)
        if rows is None and self._rows == 1:
            return self._allocate_row(0, n)
        if rows is None:
            tops = self._top.tolist()
            if 0 < n <= min(tops):
                # Common case: every row pops its stack, no eviction; one slice when the tops agree.
                t0 = tops[0]
                if tops.count(t0) == self._rows:
                    blocks = self._stack2d[:, t0 - n:t0][:, ::-1].copy()
                else:
                    blocks = self._stack[(self._row_base - 1 + self._top[:, None]) - np.arange(n)]
                self._top -= n
                self._ref[self._row_base + blocks] = 1
                return Allocation(blocks, _EMPTY_I32, _EMPTY_I32)
        r = self._row_ids(rows)
        if r.size == 1:
            return self._allocate_row(int(r[0]), n)
        top = self._top[r]
        if ((top + self._lru_count[r]) < n).any():
            return None
        if n == 0:
            return Allocation(np.empty((r.size, 0), dtype=np.int32), _EMPTY_I32, _EMPTY_I32)
        t0 = int(top[0])
        if t0 >= n and (top == t0).all():
            blocks = self._stack2d[r, t0 - n:t0][:, ::-1].copy()
            self._top[r] = t0 - n
            self._ref[(r * self._n)[:, None] + blocks] = 1
            return Allocation(blocks, _EMPTY_I32, _EMPTY_I32)
        # Row by row, each in one C pass (pop, then evict oldest first); every row has room (checked above).
        parts = [self._allocate_row(row, n) for row in r.tolist()]
        return Allocation(np.concatenate([p.blocks for p in parts]), np.concatenate([p.evicted_rows for p in parts]),
                          np.concatenate([p.evicted_blocks for p in parts]))

    def _allocate_row(self, row: int, n: int, ascending: bool = False) -> Allocation | None:
        """``allocate`` in one row, in one C pass (a request's admit, a decode step's new blocks)."""
        blocks = np.empty((1, n), dtype=np.int32)
        evicted = np.empty(n, dtype=np.int32)
        count = _pool.take(*self._c_arrays(), row, blocks, evicted, ascending)
        if count < 0:
            return None
        if not count:
            return Allocation(blocks, _EMPTY_I32, _EMPTY_I32)
        return Allocation(blocks, np.full(count, row, dtype=np.int32), evicted[:count])

    def incref(self, rows: np.ndarray, blocks: np.ndarray, *, unique: bool = False) -> None:
        """Add one reference per pair (duplicates count); a cached free block is revived.

        Reviving takes the block out of the LRU ring without evicting it (a
        prefix hit). An incref of an uncached free block is an owner bug and
        raises AssertionError before any change. ``unique=True`` promises that
        no pair repeats (holes may) and skips the duplicate handling.
        """
        r, b = np.asarray(rows), np.asarray(blocks)
        if r.size == 1 and b.size == 1:
            self._incref_one(*self._one_pair(r, b))
            return
        if unique and r.shape == (1, 1) and b.ndim == 2 and b.shape[0] == 1 and b.dtype == np.int32:
            self.hold_row(int(r.item()), b[0])  # one table row of int32 ids: one C pass
            return
        r, b, flat = self._pairs(r, b)
        if flat.size == 0:
            return
        before = self._ref[flat]
        zero = before == 0
        num_zero = np.count_nonzero(zero)
        if num_zero:
            rz, fz = (r, flat) if num_zero == flat.size else (r[zero], flat[zero])
            g = self._lru_pos[fz]
            lowest = int(np.minimum.reduce(g))
            if lowest < 0:
                lost = g < 0
                rr, bb = r[zero][lost], b[zero][lost]
                raise AssertionError(f"incref of {lost.sum()} free uncached blocks, "
                                     f"first (row {rr[0]}, block {bb[0]})")
        if unique:
            self._ref[flat] = before + _ONE
        else:
            np.add.at(self._ref, flat, _ONE)
            if num_zero and int(self._ref[flat].sum()) - int(before.sum()) != flat.size:
                rz, _, fz, _ = _merge(rz, rz, fz, keep="first")  # a pair repeated: revive it once
                g = self._lru_pos[fz]
        if num_zero:
            self._revive(rz, fz, g, lowest)

    def hold_row(self, row: int, blocks: np.ndarray) -> None:
        """``incref([[row]], blocks[None, :], unique=True)`` for distinct int32 ``blocks`` [L] of one row (-1 =
        hole): the C pass without incref's argument handling. Revives cached free blocks as incref does."""
        try:
            _pool.hold(*self._c_arrays(), row, np.ascontiguousarray(blocks, dtype=np.int32))
        except AssertionError:  # nothing changed: an id out of range is the caller's error, named as such
            self._check_pairs(np.full((1, 1), row, dtype=np.intp), blocks[None, :])
            raise

    def release_table(self, rows: np.ndarray, blocks: np.ndarray, used: int = -1) -> None:
        """``decref(rows[:, None], blocks, unique=True)`` for int64 ``rows`` and a C-contiguous int32 ``blocks``
        (a table, row by row): the C pass without decref's argument handling. With ``used`` >= 0, only columns
        ``[0, used)``, released last column first (a freed request's table: its tail is evicted first)."""
        try:
            _pool.release(*self._c_arrays(), rows, blocks, used)
        except AssertionError:  # nothing changed: an id out of range is the caller's error, named as such
            self._check_pairs(rows[:, None], blocks if used < 0 else blocks[:, used - 1::-1] if used else blocks[:, :0])
            raise

    def decref(self, rows: np.ndarray, blocks: np.ndarray, *, unique: bool = False) -> None:
        """Drop one reference per pair (duplicates count); blocks reaching 0 become free.

        Release order is the order of the pairs (a duplicated pair is released
        at its last occurrence), exactly as if each pair were decref'd alone:
        uncached blocks are pushed on the free stack (the last released is
        reused first), cached ones appended to the LRU ring (the first released
        is evicted first). So freeing a request in reverse logical order makes
        a prefix's tail evicted before its head. Decref of a block with too few
        references raises AssertionError before any change. ``unique=True``
        promises that no pair repeats (holes may) and skips the duplicate handling.
        """
        r, b = np.asarray(rows), np.asarray(blocks)
        if r.size == 1 and b.size == 1:
            self._decref_one(*self._one_pair(r, b))
            return
        if unique and b.ndim == 2 and r.shape == (b.shape[0], 1):  # a whole table, row by row: one C pass
            if b.dtype != np.int32 or r.dtype.kind not in "iu":  # the C pass range-checks int32 ids exactly
                self._check_pairs(r, b)
            self.release_table(r.astype(np.int64).reshape(-1), np.ascontiguousarray(b, dtype=np.int32))
            return
        r, b, flat = self._pairs(r, b)
        if flat.size == 0:
            return
        before = self._ref[flat]
        if np.count_nonzero(before) != flat.size:  # counts are >= 0: a zero is a free block
            i = int(np.flatnonzero(before < 1)[0])
            raise AssertionError(f"decref of a free block: (row {r[i]}, block {b[i]}) has 0 references")
        if unique:
            after = before - _ONE
            self._ref[flat] = after
        else:
            np.subtract.at(self._ref, flat, _ONE)
            after = self._ref[flat]
            # Each pair repeated k times drops k at each of its k places, so the sum
            # exceeds the number of pairs exactly when some pair repeats.
            if int(before.sum()) - int(after.sum()) != flat.size:
                np.add.at(self._ref, flat, _ONE)
                r, b, flat, counts = _merge(r, b, flat, keep="last")
                before = self._ref[flat]
                short = before < counts
                if short.any():
                    i = int(np.flatnonzero(short)[0])
                    raise AssertionError(f"decref below 0: (row {r[i]}, block {b[i]}) has {before[i]} "
                                         f"references, dropping {counts[i]}")
                after = before - counts
                self._ref[flat] = after
        released = after == 0
        num_released = np.count_nonzero(released)
        if num_released == 0:
            return
        if num_released < flat.size:
            r, b, flat = r[released], b[released], flat[released]
        cached = self._cached[flat]
        num_cached = np.count_nonzero(cached)
        if num_cached == 0:
            self._push_stack(r, b)
        elif num_cached == flat.size:
            self._append_lru(r, b, flat)
        else:
            self._push_stack(r[~cached], b[~cached])
            self._append_lru(r[cached], b[cached], flat[cached])

    def mark_cached(self, rows: np.ndarray, blocks: np.ndarray) -> None:
        """Set the cached flag of referenced (or already cached) blocks; idempotent.

        Marking an uncached free block is an owner bug (AssertionError, no change):
        only blocks holding written KV can hold a prefix.
        """
        r, b, flat = self._pairs(rows, blocks)
        if np.count_nonzero(self._ref[flat]) != flat.size:
            ok = (self._ref[flat] > 0) | self._cached[flat]
            if not ok.all():
                i = int(np.flatnonzero(~ok)[0])
                raise AssertionError(f"mark_cached of {(~ok).sum()} free uncached blocks, "
                                     f"first (row {r[i]}, block {b[i]})")
        self._cached[flat] = True

    def mark_cached_columns(self, blocks: np.ndarray) -> None:
        """``mark_cached`` of int32 ``[m, num_rows]`` blocks (row r's block in column r), all referenced.

        A decode step's newly full blocks, one row of ``blocks`` per request: no
        holes, no pair checks beyond the reference counts.
        """
        flat = blocks.reshape(-1).astype(np.intp) if self._rows == 1 else blocks + self._row_base.T
        assert np.count_nonzero(self._ref[flat]) == flat.size, "mark_cached_columns of a free block"
        self._cached[flat] = True

    def uncache(self, rows: np.ndarray, blocks: np.ndarray) -> None:
        """Clear the cached flag; a cached free block moves to the free stack (in pair order).

        Pairs that are not cached are ignored, so the call is idempotent.
        """
        r, b, flat = self._pairs(rows, blocks)
        hit = self._cached[flat]
        if not hit.any():
            return
        r, b, flat = r[hit], b[hit], flat[hit]
        if flat.size > 1:  # rare call: a sort to apply a repeated pair once is fine
            r, b, flat, _ = _merge(r, b, flat, keep="first")
        self._cached[flat] = False
        free = self._ref[flat] == 0
        if free.any():
            self._lru_pos[flat[free]] = -1
            self._lru_count -= np.bincount(r[free], minlength=self._rows)
            self._push_stack(r[free], b[free])

    def reset_cached(self) -> tuple[np.ndarray, np.ndarray]:
        """Clear every cached flag (reset_prefix_cache); returns the (rows, blocks) that had one.

        Pairs come row-major, ascending block id (int32). Cached free blocks
        move to the free stack oldest-released first, so the most recently
        released is reused first.
        """
        rows, blocks = np.divmod(np.flatnonzero(self._cached), self._n)
        for row in np.flatnonzero(self._lru_count):
            live = self._live_ring(int(row))
            k = live.size
            self._stack2d[row, self._top[row]:self._top[row] + k] = live
            self._top[row] += k
        self._cached[:] = False
        self._lru_pos[:] = -1
        self._lru_count[:] = 0
        self._head[:] = 0
        self._tail[:] = 0
        return rows.astype(np.int32), blocks.astype(np.int32)

    def check_integrity(self) -> None:
        """Raise AssertionError with the numbers if any invariant is broken."""
        n = self._n
        ref, cached = self._ref.reshape(self._rows, n), self._cached.reshape(self._rows, n)
        lru_pos = self._lru_pos.reshape(self._rows, n)
        assert (ref >= 0).all(), f"negative refcounts at {np.argwhere(ref < 0)[:5].tolist()}"
        for row in range(self._rows):
            top, head, tail = int(self._top[row]), int(self._head[row]), int(self._tail[row])
            assert 0 <= top <= n, f"row {row}: stack top {top} outside [0, {n}]"
            assert 0 <= head <= tail <= head + self._cap, \
                f"row {row}: ring head {head} tail {tail} cap {self._cap}"
            stack = self._stack2d[row, :top]
            assert ((stack >= 0) & (stack < n)).all(), f"row {row}: stack holds ids outside [0, {n})"
            assert np.unique(stack).size == top, f"row {row}: stack of {top} has duplicates"
            assert (ref[row, stack] == 0).all(), \
                f"row {row}: referenced blocks on the free stack: {stack[ref[row, stack] != 0][:5].tolist()}"
            assert not cached[row, stack].any(), \
                f"row {row}: cached blocks on the free stack: {stack[cached[row, stack]][:5].tolist()}"
            live = self._live_ring(row)
            in_lru = np.flatnonzero(lru_pos[row] >= 0)
            assert live.size == self._lru_count[row] == in_lru.size, \
                f"row {row}: ring holds {live.size} live entries, count {self._lru_count[row]}, " \
                f"lru_pos marks {in_lru.size}"
            assert np.array_equal(np.sort(live), in_lru), f"row {row}: ring entries disagree with lru_pos"
            slot = lru_pos[row, in_lru] - row * self._cap
            assert ((slot >= 0) & (((slot - head) & self._mask) < tail - head)).all(), \
                f"row {row}: lru_pos outside the ring's [{head}, {tail})"
            expect = np.flatnonzero((ref[row] == 0) & cached[row])
            assert np.array_equal(in_lru, expect), \
                f"row {row}: LRU holds {in_lru.size} blocks, {expect.size} are cached with refcount 0"
            k = int(self._row_blocks[row])  # the row's blocks: ids past them are never handed out
            assert (stack < k).all() and not ref[row, k:].any() and not cached[row, k:].any(), \
                f"row {row}: ids past its {k} blocks are in use"
            free, used = int(np.count_nonzero(ref[row, :k] == 0)), int(np.count_nonzero(ref[row]))
            assert top + live.size == free and free + used == k, \
                f"row {row}: stack {top} + lru {live.size} != free {free}, or free + used {used} != {k}"

    # ---------------------------------------------------------------- internals

    def _check_n(self, n: int) -> None:
        """Reject a negative or non-integer block count (caller mistake)."""
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
            raise KVCacheError(f"n: must be an integer >= 0, got {n!r}")

    def _row_ids(self, rows: np.ndarray | None) -> np.ndarray:
        """Validated distinct row ids (intp); None means every row."""
        if rows is None:
            return self._all_rows
        r = np.asarray(rows, dtype=np.intp).reshape(-1)
        if r.size and (r.min() < 0 or r.max() >= self._rows):
            raise KVCacheError(f"rows: ids must lie in [0, {self._rows}), got {r.tolist()}")
        if np.unique(r).size != r.size:
            raise KVCacheError(f"rows: ids must be distinct, got {r.tolist()}")
        return r

    def _one_pair(self, r: np.ndarray, b: np.ndarray) -> tuple[int, int]:
        """The validated (row, block) of one-element pair arguments, as ints."""
        row, block = int(r.item()), int(b.item())
        if not 0 <= row < self._rows:
            raise KVCacheError(f"rows: ids must lie in [0, {self._rows}), got {row}..{row}")
        if not -1 <= block < self._n:
            raise KVCacheError(f"blocks: ids must lie in [0, {self._n}) or be -1 (hole), "
                               f"got {block}..{block}")
        return row, block

    def _check_pairs(self, r: np.ndarray, b: np.ndarray) -> bool:
        """Raise KVCacheError unless rows lie in [0, num_rows), blocks in [-1, num_blocks); whether -1 occurs.

        Viewed unsigned, negative ids are huge, so one maximum per argument
        clears the usual call (no hole); holes and mistakes take a second look.
        """
        if r.size and not _max_unsigned(r) < self._rows:
            low, high = np.minimum.reduce(r, axis=None), np.maximum.reduce(r, axis=None)
            if low < 0 or high >= self._rows:
                raise KVCacheError(f"rows: ids must lie in [0, {self._rows}), got {int(low)}..{int(high)}")
        if not b.size or _max_unsigned(b) < self._n:
            return False
        low, high = np.minimum.reduce(b, axis=None), np.maximum.reduce(b, axis=None)
        if low < -1 or high >= self._n:
            raise KVCacheError(f"blocks: ids must lie in [0, {self._n}) or be -1 (hole), "
                               f"got {int(low)}..{int(high)}")
        return bool(low == -1)

    def _pairs(self, rows: np.ndarray, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flatten pairs in C order, drop holes (-1), validate; returns (rows, blocks, row*n+block).

        Rows and flat indices are intp (index-ready: numpy indexes with intp
        several times faster than with int32); blocks keep the caller's int
        dtype. A ``[k, 1]`` rows column against a ``[k, L]`` table (the usual
        call) is flattened without materialising the broadcast first.
        """
        r, b = np.asarray(rows), np.asarray(blocks)
        holes = self._check_pairs(r, b)
        if b.ndim == 2 and r.shape == (b.shape[0], 1):
            width = b.shape[1]
            if r.shape[0] == 1:
                row = int(r.item())
                b = b.reshape(-1)  # a view, also of a reversed table
                flat = b.astype(np.intp)  # numpy indexes with intp several times faster than with int32
                if row:
                    flat += row * self._n
                r = self._zeros[:width] if row == 0 and width <= self._n else np.full(width, row, np.intp)
            else:
                r = r.astype(np.intp, copy=False)
                flat = (r * self._n + b).reshape(-1)
                r = np.repeat(r.reshape(-1), width)
                b = b.reshape(-1)
        else:
            r = r.astype(np.intp, copy=False)
            if r.shape != b.shape:
                shape = np.broadcast_shapes(r.shape, b.shape)
                r, b = np.broadcast_to(r, shape), np.broadcast_to(b, shape)
            r = r.reshape(-1)
            b = b.reshape(-1)
            flat = r * self._n + b
        if holes:
            keep = b >= 0
            r, b, flat = r[keep], b[keep], flat[keep]
        return r, b, flat

    def _lookup(self, rows: np.ndarray, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Flat indices in the pairs' broadcast shape (holes point anywhere valid) and the hole mask."""
        r, b = np.asarray(rows), np.asarray(blocks)
        holes = self._check_pairs(r, b)
        if r.size == 1 and r.ndim <= b.ndim:  # one row: the broadcast shape is the blocks' shape
            flat = b.astype(np.intp)  # numpy indexes with intp several times faster than with int32
            row = int(r.item())
            if row:
                flat += row * self._n
        else:
            flat = r.astype(np.intp, copy=False) * self._n + b
        # A hole reads row*n - 1 (or, in row 0, the last entry): in range, masked later.
        return flat, (b == -1 if holes else None)

    def _incref_one(self, row: int, block: int) -> None:
        """``incref`` of one pair, in scalars."""
        if block < 0:
            return
        f = row * self._n + block
        count = int(self._ref[f])
        if count == 0:
            g = int(self._lru_pos[f])
            if g < 0:
                raise AssertionError(f"incref of 1 free uncached blocks, first (row {row}, block {block})")
            self._lru_pos[f] = -1
            self._lru_count[row] -= 1
            tail = int(self._tail[row])
            if g == row * self._cap + ((tail - 1) & self._mask):  # the newest entry: drop it
                self._tail[row] = tail - 1
        self._ref[f] = count + 1

    def _decref_one(self, row: int, block: int) -> None:
        """``decref`` of one pair, in scalars."""
        if block < 0:
            return
        f = row * self._n + block
        count = int(self._ref[f])
        if count < 1:
            raise AssertionError(f"decref of a free block: (row {row}, block {block}) has 0 references")
        self._ref[f] = count - 1
        if count > 1:
            return
        if not self._cached[f]:
            top = int(self._top[row])
            self._stack[row * self._n + top] = block
            self._top[row] = top + 1
            return
        if self._lru_count[row] == 0:  # every entry is stale: restart at 0
            self._head[row] = self._tail[row] = 0
        elif self._tail[row] - self._head[row] == self._cap:
            self._compact(row)
        tail = int(self._tail[row])
        g = row * self._cap + (tail & self._mask)
        self._ring[g] = block
        self._lru_pos[f] = g
        self._tail[row] = tail + 1
        self._lru_count[row] += 1

    def _revive(self, r: np.ndarray, flat: np.ndarray, g: np.ndarray, lowest: int) -> None:
        """Take distinct cached free pairs (ring entries ``g``, the least ``lowest``) out of the LRU.

        Where a row's revived entries are exactly its newest ones (a prefix
        released last and hit again), its tail moves back over them, so later
        evictions do not scan them as stale entries.
        """
        self._lru_pos[flat] = -1
        if self._rows == 1:
            # k distinct entries fill the k newest slots iff they span k slots ending at the
            # newest (when those slots wrap round the ring's end the entries just go stale).
            k = flat.size
            self._lru_count[0] -= k
            tail = int(self._tail[0])
            if int(np.maximum.reduce(g)) == (tail - 1) & self._mask == lowest + k - 1:
                self._tail[0] = tail - k
            return
        bounds = self._bounds(r)
        if bounds is None:  # pairs out of row order (not a table): leave the entries stale
            self._lru_count -= np.bincount(r, minlength=self._rows)
            return
        counts = bounds[1:] - bounds[:-1]
        self._lru_count -= counts
        # As for one row, per row with revived entries (reduceat needs non-empty runs).
        rows = np.flatnonzero(counts)
        starts = bounds[rows]
        low, high = np.minimum.reduceat(g, starts), np.maximum.reduceat(g, starts)
        newest = rows * self._cap + ((self._tail[rows] - 1) & self._mask)
        k = counts[rows]
        pull = (high == newest) & (high - low == k - 1)
        self._tail[rows] -= np.where(pull, k, 0)

    def _bounds(self, r: np.ndarray) -> np.ndarray | None:
        """Where each row's pairs start, and the end, if ``r`` is ascending (a flattened table); else None."""
        if np.count_nonzero(r[1:] < r[:-1]):
            return None
        return np.searchsorted(r, self._row_edges)

    def _slots(self, r: np.ndarray, base: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per pair ``base[row]`` plus its rank among earlier pairs of its row; and pairs per row.

        Pairs in ascending row order (a table flattened row by row) take a sort-free path.
        """
        bounds = self._bounds(r)
        if bounds is not None:
            counts = bounds[1:] - bounds[:-1]
            return np.arange(r.size) + np.repeat(base - bounds[:-1], counts), counts
        counts = np.bincount(r, minlength=self._rows)
        order = np.argsort(r.astype(np.uint16 if self._rows < 2**16 else np.intp), kind="stable")
        slot = np.empty(r.size, dtype=np.intp)
        slot[order] = np.arange(r.size) + (base - (counts.cumsum() - counts))[r[order]]
        return slot, counts

    def _push_stack(self, r: np.ndarray, b: np.ndarray) -> None:
        """Push uncached free blocks, in pair order, on their rows' stacks."""
        if self._rows == 1:
            top = int(self._top[0])
            self._stack[top:top + b.size] = b
            self._top[0] = top + b.size
            return
        slot, counts = self._slots(r, self._all_rows * self._n + self._top)
        self._stack[slot] = b
        self._top += counts

    def _append_lru(self, r: np.ndarray, b: np.ndarray, flat: np.ndarray) -> None:
        """Append cached free blocks, in pair order, at their rows' ring tails."""
        if self._rows == 1:
            self._append_lru_row0(b, flat)
            return
        empty = self._lru_count == 0  # every entry is stale: restart at 0
        self._head[empty] = 0
        self._tail[empty] = 0
        start = self._tail & self._mask
        g, counts = self._slots(r, self._all_rows * self._cap + start)
        over = np.flatnonzero(self._tail - self._head + counts > self._cap)
        if over.size:
            for row in over:
                self._compact(int(row))
            start = self._tail & self._mask
            g, counts = self._slots(r, self._all_rows * self._cap + start)
        if (start + counts > self._cap).any():  # some row wraps around its ring's end
            row_off = r * self._cap
            g = row_off + ((g - row_off) & self._mask)
        self._ring[g] = b
        self._lru_pos[flat] = g
        self._tail += counts
        self._lru_count += counts

    def _append_lru_row0(self, b: np.ndarray, flat: np.ndarray) -> None:
        """``_append_lru`` of a one-row pool: slices instead of per-pair slots."""
        m = b.size
        if self._lru_count[0] == 0:  # every entry is stale: restart at 0
            self._head[0] = self._tail[0] = 0
        elif self._tail[0] - self._head[0] + m > self._cap:
            self._compact(0)
        tail = int(self._tail[0])
        start = tail & self._mask
        if start + m <= self._cap:
            self._ring[start:start + m] = b
            g = np.arange(start, start + m)
        else:
            g = np.arange(tail, tail + m) & self._mask
            self._ring[g] = b
        self._lru_pos[flat] = g
        self._tail[0] = tail + m
        self._lru_count[0] += m

    def _live_ring(self, row: int) -> np.ndarray:
        """A row's live ring entries (int32 block ids), oldest first."""
        head, tail = int(self._head[row]), int(self._tail[row])
        g = row * self._cap + (np.arange(head, tail) & self._mask)
        seg = self._ring[g]
        return seg[self._lru_pos[row * self._n + seg] == g]

    def _compact(self, row: int) -> None:
        """Move a row's live ring entries to the front, dropping stale ones."""
        live = self._live_ring(row)
        k = live.size
        self._ring2d[row, :k] = live
        self._lru_pos[row * self._n + live] = row * self._cap + np.arange(k)
        self._head[row] = 0
        self._tail[row] = k

def _max_unsigned(a: np.ndarray) -> int | float:
    """The largest element, negative ones reading huge (signed ints viewed unsigned): one reduction."""
    if a.size <= 16:  # a rows column, a decode step's blocks: Python beats a numpy call here
        values = a.ravel().tolist()
        return max(values) if min(values) >= 0 else np.inf
    if a.dtype.kind == "i":
        a = a.view(f"u{a.dtype.itemsize}")
    elif a.dtype.kind != "u":
        return np.inf  # not ints: the caller takes the full look
    return np.maximum.reduce(a, axis=None)


def _merge(r: np.ndarray, b: np.ndarray, flat: np.ndarray, keep: str
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Collapse duplicate pairs to one with its count, ordered by first or last occurrence.

    A sort: hot paths call it only after detecting that a pair repeats.
    """
    m = flat.size
    if keep == "last":
        uniq, idx, counts = np.unique(flat[::-1], return_index=True, return_counts=True)
        idx = m - 1 - idx
    else:
        uniq, idx, counts = np.unique(flat, return_index=True, return_counts=True)
    order = np.argsort(idx, kind="stable")
    sel = idx[order]
    return r[sel], b[sel], uniq[order], counts[order]

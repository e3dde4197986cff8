"""KVCacheManager's batch path: ``extend_many`` and ``extend_many_deltas``, a decode step's extends at once.

A decode step gives most requests one token that lands in the block they
already hold; every ``block_size`` steps a request opens a block, one step
before that its block fills and is hashed, and window rows give a block back.
The batch is equivalent to calling ``extend`` for each request in order; see
``kvcache.allocator.manager`` for which path takes which batch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import numpy as np

from kvcache.allocator import _tables
from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.events import BlockRemoved, CacheEvent
from kvcache.allocator.prefix import _PACKED, HASH_BYTES, as_token_array
from kvcache.allocator.requests import _NO_COLUMNS, TableDeltas, _check_count, _Chunk, _columns, _put_column, _view
from kvcache.allocator.swa import Chunked, window_stop

if TYPE_CHECKING:
    from kvcache.allocator.manager import Tokens
    from kvcache.allocator.pool import Allocation

_H = HASH_BYTES
_NO_HASH = bytes(HASH_BYTES)  # extend_decode's mark of an eviction that dropped no hash
_MAX_LOOKAHEAD = 2**31 - 1  # num_lookahead_tokens' bound: position arithmetic stays in int64


class _WindowSteps(NamedTuple):
    """What a decode run's requests give back in a manager's one window group (``DecodeBatch._window_steps``):
    pool rows and blocks, in run order, each giver's tail first; the givers' positions in the run, records and given
    columns ``[starts, stops)``."""

    rows: np.ndarray
    blocks: np.ndarray
    positions: np.ndarray
    reqs: list[Any]
    starts: np.ndarray
    stops: np.ndarray


class DecodeBatch:
    """KVCacheManager's batch extends (mixed into it; every attribute used here is the manager's)."""

    def extend_many(self, request_ids: Sequence[object], tokens: Tokens, counts: Sequence[int] | np.ndarray,
                    *, changes: list[np.ndarray] | None = None, num_lookahead_tokens: int = 0
                    ) -> list[np.ndarray | None]:
        """``extend`` for many requests at once: request i gets the next ``counts[i]`` of ``tokens``.

        A decode step's shape: most requests gain one token that lands in a block
        they already hold, and those take a vectorised fast path with no block,
        hash or table work. Equivalent to calling ``extend`` for each in order
        (each may return None for lack of blocks, changing nothing for that
        request). Unknown ids or bad tokens raise before any request changes.
        Tables are live read-only views, so a request listed twice shows its
        final table in both places. With ``changes`` (a list), each request's
        changed columns are appended to it in order (what ``changed_columns``
        gives after each extend). ``num_lookahead_tokens`` as ``extend``'s, for
        every request: a decode step with one takes the same batch paths.
        """
        lookahead = self._lookahead(num_lookahead_tokens)
        deltas = self._extend_decode(request_ids, tokens, counts, lookahead=lookahead)
        if deltas is not None:  # the ids are a list, every one admitted
            if changes is not None:
                ends = deltas.offsets.tolist()
                found = {i: deltas.cols[ends[k]:ends[k + 1]] for k, i in enumerate(deltas.index.tolist())}
                changes.extend(found.get(i, _NO_COLUMNS) for i in range(len(request_ids)))
            reqs = self._requests
            return [None if n < 0 else req.view if (req := reqs[rid]).view is not None else _view(req)
                    for rid, n in zip(request_ids, deltas.lens.tolist())]
        slots, flat, counts = self._check_many(request_ids, tokens, counts)
        views: list[np.ndarray | None] = []
        ok, changed, widths = self._extend_slots(slots, flat, counts, views, lookahead)
        if self.tier is not None:
            self._record_tier_tokens(slots, flat, counts, ok)
        if changes is not None:
            found: dict[int, np.ndarray] = {}
            for index, sizes, cols, _ in changed:
                found.update(zip(index.tolist(), np.split(cols, np.cumsum(sizes)[:-1])))
            changes.extend(found.get(i, _NO_COLUMNS) for i in range(slots.size))
        if widths is not None:  # a slot listed twice: each extend's table as it was made, as one by one
            return views
        by_slot = self._by_slot
        out: list[np.ndarray | None] = []
        for s, good in zip(slots.tolist(), ok.tolist()):
            req = by_slot[s]
            out.append(None if not good else req.view if req.view is not None else _view(req))
        return out

    def extend_many_deltas(self, request_ids: Sequence[object], tokens: Tokens,
                           counts: Sequence[int] | np.ndarray, *, slots: np.ndarray | None = None,
                           num_lookahead_tokens: int = 0) -> TableDeltas:
        """``extend_many``, answering with array deltas instead of a table per request (what the daemon sends).

        No Python object per request on the way out: a decode step changes
        one table in ``block_size``, and only those are listed. ``slots`` is what
        ``slots_of`` gave for these ids, if nothing was admitted or freed since:
        the ids are not looked up again.
        """
        lookahead = self._lookahead(num_lookahead_tokens)
        deltas = self._extend_decode(request_ids, tokens, counts, slots, lookahead)
        if deltas is not None:
            return deltas
        slots, flat, counts = self._check_many(request_ids, tokens, counts)
        ok, changed, widths = self._extend_slots(slots, flat, counts, None, lookahead)
        if self.tier is not None:
            self._record_tier_tokens(slots, flat, counts, ok)
        lens = np.where(ok, self._width[slots] if widths is None else widths, -1).astype(np.int32)
        if not changed:
            return TableDeltas(lens, np.empty(0, dtype=np.int32), np.zeros(1, dtype=np.int32), _NO_COLUMNS,
                               np.empty((self.num_rows, 0), dtype=np.int32))
        by_slot = self._by_slot
        vals = []
        for index, _, cols, chunk_vals in changed:
            # A chunk without values: one request's, read from its table (final even if listed twice).
            vals.append(chunk_vals if chunk_vals is not None else _view(by_slot[slots[index[0]]])[:, cols])
        if len(changed) == 1:
            index, sizes, cols, _ = changed[0]
        else:
            index, sizes, cols = (np.concatenate([c[k] for c in changed]) for k in range(3))
        offsets = np.zeros(index.size + 1, dtype=np.int32)
        np.cumsum(sizes, out=offsets[1:])
        return TableDeltas(lens, index.astype(np.int32, copy=False), offsets, cols.astype(np.int32, copy=False),
                           vals[0] if len(vals) == 1 else np.concatenate(vals, axis=1))

    def _lookahead(self, num_lookahead_tokens: int) -> int:
        """``num_lookahead_tokens`` checked, as an int."""
        _check_count(num_lookahead_tokens, "num_lookahead_tokens", least=0)
        if num_lookahead_tokens > _MAX_LOOKAHEAD:
            raise KVCacheError(f"num_lookahead_tokens: must be at most {_MAX_LOOKAHEAD}, got {num_lookahead_tokens}")
        return int(num_lookahead_tokens)

    def slots_of(self, request_ids: list[object], exclude: dict | None = None) -> np.ndarray | None:
        """Each id's row in the per-request arrays (intp), in one C pass; None if one is not admitted, not an int
        or str, or a key of ``exclude``. What ``extend_many_deltas`` takes as ``slots`` (a daemon checks a step's
        ids with it before applying anything)."""
        found = np.empty(len(request_ids), dtype=np.intp)
        return found if _tables.lookup_ids(self._slot_of, request_ids, found, exclude) < 0 else None

    def _decodes_in_one_pass(self) -> int | None:
        """The C decode passes' hashing argument (-1 none, 0 sha256, 1 sha256_cbor) where they can take a batch of
        extends: no tier, a native hasher; else None. ``_tables.extend_decode`` takes a one-group manager without
        window or expanded rows, ``_tables.extend_rows`` any other."""
        if self.tier is not None:
            return None
        if self._hasher is None:
            return -1
        return (self._hasher.algorithm != "sha256") if self._hasher.native else None

    def _extend_decode(self, request_ids: Sequence[object], tokens: Tokens, counts: Sequence[int] | np.ndarray,
                       slots: np.ndarray | None = None, lookahead: int = 0) -> TableDeltas | None:
        """``extend_many_deltas`` in one C pass (a decode step), or None, changing nothing, where the pass leaves
        the batch to the general path (which also names any bad input)."""
        hashing = self._decodes_in_one_pass()
        if hashing is None or type(request_ids) is not list:
            return None
        counts = np.asarray(counts)
        if counts.ndim != 1:
            return None
        # The pass reads int64 counts, or contiguous int32 ones (as the wire brings them).
        if counts.dtype != np.int64 and (counts.dtype != np.int32 or not counts.flags.c_contiguous):
            if counts.dtype.kind not in "iu" or counts.dtype.itemsize == 8:  # uint64 might not fit
                return None
            counts = counts.astype(np.int64)
        if counts.size != len(request_ids):
            return None
        flat = as_token_array(tokens)
        if len(self._group_col) != 1 or self._window_groups or self._expand:
            return self._extend_rows(request_ids, flat, counts, slots, hashing, lookahead)
        n = counts.size
        pool, prefix = self._pool, self._index
        prefix.reserve(n, n)
        lens = np.empty(n, dtype=np.int32)
        done = _tables.extend_decode(self._slot_of if slots is None else slots, request_ids, flat, counts,
                                     self._by_slot, hashing, self._ntok, self._fast_limit, self._next_recycle,
                                     self._tail, self._changed_ok, self._stamp, self._keyed, self._salted,
                                     self._last_hash, self._last_block, self._width, lens,
                                     *pool._c_arrays(), *prefix._c_arrays(), prefix._num_entries, self.enable_events,
                                     lookahead)
        if done is None:
            return None
        index, cols, vals, widen, evicted, prefix._num_spare, prefix._num_entries, gone, added = done[:9]
        prefix._count += added - gone
        self._evicted += evicted
        index = np.frombuffer(index, dtype=np.int32)
        if self.enable_events:
            self._decode_events(index, evicted, *done[9:])
        cols = np.frombuffer(cols, dtype=np.int32)
        vals = np.frombuffer(vals, dtype=np.int32).reshape(1, -1)
        for q in widen:
            _put_column(self._by_slot[self._slot_of[request_ids[index[q]]]], int(cols[q]), vals[:, q])
        return TableDeltas(lens, index, np.arange(index.size + 1, dtype=np.int32), cols, vals)

    def _extend_rows(self, request_ids: list[object], flat: np.ndarray, counts: np.ndarray, slots: np.ndarray | None,
                     hashing: int, lookahead: int) -> TableDeltas | None:
        """``_extend_decode`` of a manager with several row groups, expanded rows or window groups, in one C pass
        (``_tables.extend_rows``: request by request, as ``_extend`` one at a time), or None, changing nothing."""
        n = counts.size
        groups = len(self._group_col)
        pool, prefix = self._pool, self._index
        prefix.reserve(n, n * groups)
        lens = np.empty(n, dtype=np.int32)
        counted = np.zeros(2, dtype=np.int64)  # (row, block) pairs evicted, and given back by windows
        done = _tables.extend_rows(self._slot_of if slots is None else slots, request_ids, flat, counts,
                                   self._by_slot, hashing, lookahead, self.enable_events, self._ntok,
                                   self._fast_limit, self._next_recycle, self._tail, self._changed_ok, self._stamp,
                                   self._keyed, self._salted, self._last_hash, self._last_block, self._width, lens,
                                   self._row_group, self._windows_table(), counted,
                                   *pool._c_arrays(), *prefix._c_arrays(), prefix._num_entries)
        if done is None:
            return None
        index, offsets, cols, vals, widen, givers, prefix._num_spare, prefix._num_entries, gone, added = done[:10]
        prefix._count += added - gone
        evicted, recycled = counted.tolist()
        self._evicted += evicted
        self._recycled += recycled
        index = np.frombuffer(index, dtype=np.int32)
        offsets = np.frombuffer(offsets, dtype=np.int32)
        cols = np.frombuffer(cols, dtype=np.int32)
        vals = np.frombuffer(vals, dtype=np.int32).reshape(self.num_rows, -1)
        reqs = self._requests
        for k, col, blocks in widen:  # an opened column past its table's capacity: widen, then write it
            req = reqs[request_ids[index[k]]]
            column = np.frombuffer(blocks, dtype=np.int32)
            _put_column(req, col, column)
            if req.heads is not None:
                req.heads[:, col] = column[self._row_group]
        for k in givers:  # given columns and an opened one, or given ones with a gap: as extend records them
            reqs[request_ids[index[k]]].changed = cols[offsets[k]:offsets[k + 1]]
        if self.enable_events:
            self._rows_events(*done[10:])
        return TableDeltas(lens, index, offsets, cols, vals)

    def _windows_table(self) -> np.ndarray:
        """``_tables.extend_rows``' windows argument: per window or chunked group (group, chunk_tokens or 0,
        window_tokens or 0, sink_tokens), int64 ``[w, 4]``; built once per manager."""
        table = self.__dict__.get("_windows")
        if table is None:
            rows = [(int(group[0]), policy.chunk_tokens, 0, 0) if isinstance(policy, Chunked)
                    else (int(group[0]), 0, policy.window_tokens, policy.sink_tokens)
                    for policy, group in self._window_groups]
            table = self._windows = np.array(rows, dtype=np.int64).reshape(-1, 4)
        return table

    def _rows_events(self, removed: list[tuple[int, int, bytes]],
                     stored: list[tuple[int, int, bytes, bytes, bytes]]) -> None:
        """``_tables.extend_rows``' KV events in the one-by-one order: request by request, its evictions (group by
        group, one BlockRemoved each) before its filled block's stores (one BlockStored per group)."""
        tagged: list[tuple[int, int, CacheEvent]] = [(position, 0, BlockRemoved((digest,), group=group))
                                                     for position, group, digest in removed]
        for position, block, digest, parent, tokens in stored:  # no extra keys here: keyed requests are declined
            filled = np.frombuffer(tokens, dtype=np.uint32)
            tagged += [(position, 1, self._stored(g, digest, parent if block else None, filled, None, (None,)))
                       for g in range(len(self._group_col))]
        tagged.sort(key=lambda item: item[:2])
        self._events += [event for _, _, event in tagged]

    def _decode_events(self, opened: np.ndarray, evicted: int, removed: bytes,
                       stored: list[tuple[int, int, bytes, bytes, bytes]]) -> None:
        """``_tables.extend_decode``'s KV events in the one-by-one order: request by request, an open's eviction
        (the last ``evicted`` opens evicted, in order) before a fill's store."""
        tagged: list[tuple[int, int, CacheEvent]] = []
        first = opened.size - evicted
        for q in range(evicted):
            dropped = removed[q * _H:(q + 1) * _H]
            if dropped != _NO_HASH:
                tagged.append((int(opened[first + q]), 0, BlockRemoved((dropped,))))
        for position, block, digest, parent, tokens in stored:  # no extra keys here: keyed requests are declined
            tagged.append((position, 1, self._stored(0, digest, parent if block else None,
                                                     np.frombuffer(tokens, dtype=np.uint32), None, (None,))))
        tagged.sort(key=lambda item: item[:2])
        self._events += [event for _, _, event in tagged]

    def _check_many(self, request_ids: Sequence[object], tokens: Tokens, counts: Sequence[int] | np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``extend_many``'s arguments checked, as (slots, uint32 tokens, int64 counts); raises before any change."""
        flat = as_token_array(tokens)
        counts = np.asarray(counts)
        if counts.ndim != 1 or counts.size != len(request_ids) or (counts.size and counts.dtype.kind not in "iu"):
            raise KVCacheError(f"counts: need one integer per request ({len(request_ids)}), got {counts.shape}")
        if counts.size and int(counts.min()) < 0:
            raise KVCacheError("counts: must not be negative")
        counts = np.ascontiguousarray(counts, dtype=np.int64)
        if int(counts.sum()) != flat.size:
            raise KVCacheError(f"counts: sum to {int(counts.sum())} but {flat.size} tokens were given")
        ids = request_ids if type(request_ids) is list else list(request_ids)
        slots = np.empty(len(ids), dtype=np.intp)
        if _tables.lookup_ids(self._slot_of, ids, slots, None) >= 0:  # an unknown id (or one of another type)
            try:
                slots = np.fromiter(map(self._slot_of.__getitem__, ids), dtype=np.intp, count=len(ids))
            except (KeyError, TypeError):
                for rid in ids:
                    self._get(rid)
                raise
        return slots, flat, counts

    def _extend_slots(self, slots: np.ndarray, flat: np.ndarray, counts: np.ndarray,
                      views: list[np.ndarray | None] | None, lookahead: int = 0
                      ) -> tuple[np.ndarray, list[_Chunk], np.ndarray | None]:
        """Extend request ``slots[i]`` by its ``counts[i]`` tokens of ``flat``, as ``extend`` would in order.

        Returns which succeeded (bool ``[n]``), the changed columns as chunks
        in ascending request order (see ``_Chunk``), and, when a slot is
        listed twice, each extend's table width (else None: the widths are
        ``_width[slots]``; then ``views``, if a list, receives each extend's
        table view as it was made, as ``extend`` returns it). Requests that stay inside their partial block
        (``_fast_limit``) and free nothing (``_next_recycle``) are updated
        in one C pass (``_tables.extend_fast``); they touch no shared state, so they
        commute with the others, which go through ``_extend_run`` (decode
        steps, batched) or ``_extend`` one at a time, in order. A slot listed
        twice sends the whole batch one at a time. With ``lookahead``, the fast
        ones' tables also cover the positions ahead.
        """
        n = slots.size
        ok = np.ones(n, dtype=bool)
        if n == 0:
            return ok, [], None
        limit = self._fast_limit
        if lookahead:  # fast only while the table also covers the lookahead positions
            limit = limit.copy()
            limit[slots] = np.minimum(limit[slots], self._width[slots].astype(np.int64) * self.block_size - lookahead)
        found = _tables.extend_fast(slots, counts, flat, self._ntok, limit, self._next_recycle, self._tail,
                                    self._changed_ok, self._stamp, self._keyed, self._salted, self._hasher is not None)
        if found is None:
            widths = np.zeros(n, dtype=np.int32)
            return ok, self._extend_in_order(slots, flat, counts, ok, widths, views, lookahead), widths
        changed: list[_Chunk] = []
        if found[0]:
            slow = np.frombuffer(found[0], dtype=np.intp)
            t = self._ntok[slots]  # the slow ones' are still as before the batch
            offsets = np.cumsum(counts) - counts
            # Plain one-token extends (nothing to free, no extra keys to hash) go through _extend_run in
            # runs; any other request runs alone between them, so the order of pool and index
            # operations is the one-by-one order.
            start = 0
            for j in [*(i for i, plain in enumerate(found[1]) if not plain), slow.size]:
                if j > start:
                    self._extend_run(slow[start:j], slots, flat, counts, offsets, t, ok, changed, lookahead)
                if j < slow.size:
                    self._extend_each(slow[j:j + 1], slots, flat, counts, offsets, t, ok, changed, lookahead)
                start = j + 1
        return ok, changed, None

    def _extend_run(self, index: np.ndarray, slots: np.ndarray, flat: np.ndarray, counts: np.ndarray,
                    offsets: np.ndarray, t: np.ndarray, ok: np.ndarray, changed: list[_Chunk],
                    lookahead: int = 0) -> None:
        """One-token extends (``index``, ascending) that open a block, fill one, or free window blocks; batched.

        A decode step's slow path: one pool allocation for every request that
        crosses into a new block, one hash call and one index insert for every
        block that fills, one release of every block a window row gives back.
        Done one by one in order, allocations (pops, and evictions of cached
        free blocks), inserts of hashes new to the index, and releases of
        cached blocks all commute: a released cached block joins the LRU ring
        behind every block there before the run, and the run's evictions, no
        more than those blocks (each row's allocations fit its free blocks
        before the run), never reach it. So the batch is exact when every
        allocation succeeds and every hash it inserts is new and distinct, and
        every released block is cached (an uncached one would go on the free
        stack, which the allocations pop). Otherwise the run goes one by one. Events keep the
        one-by-one order: each open's evictions, then each fill's store.

        A request opens a block when its table does not cover its new token and
        ``lookahead`` positions more (at most one: else the run goes one by one);
        the block its token fills may then be behind its last one (blocks reserved
        ahead).
        """
        bs = self.block_size
        s = slots[index]
        tt = t[index]
        tok = flat[offsets[index]]
        width = self._width[s]
        pos = tt % bs
        opens = -(-(tt + 1 + lookahead) // bs) - width  # blocks to open; below 0 with blocks reserved ahead
        if int(opens.max()) > 1:  # a lookahead that grew since the last extend: blocks to catch up
            self._extend_each(index, slots, flat, counts, offsets, t, ok, changed, lookahead)
            return
        need = opens > 0
        num_need = int(np.count_nonzero(need))
        pool = self._pool
        if num_need and pool.min_free() < num_need:
            self._extend_each(index, slots, flat, counts, offsets, t, ok, changed, lookahead)
            return
        by_slot = self._by_slot
        recycle = np.flatnonzero(tt >= self._next_recycle[s])  # only with hashing: see extend_fast's plain
        gives = self._window_steps(s, tt, recycle) if recycle.size else None
        if recycle.size:
            if gives is not None:
                rec_rows, rec_blocks = gives.rows, gives.blocks
            else:
                returns = [self._recyclable(by_slot[x], d) for x, d in zip(s[recycle].tolist(), tt[recycle].tolist())]
                rec_rows = np.concatenate([r for r, _, _ in returns])
                rec_blocks = np.concatenate([b for _, b, _ in returns])
            if rec_rows.size and not pool.is_cached(rec_rows, rec_blocks).all():
                self._extend_each(index, slots, flat, counts, offsets, t, ok, changed, lookahead)
                return
        hashes = b""
        if self._hasher is not None:
            fills = pos == bs - 1
            fill = np.flatnonzero(fills)
            if fill.size:
                blocks_tok = self._tail[s[fill]]
                blocks_tok[:, bs - 1] = tok[fill]
                hashes = self._hasher.hash_each(blocks_tok, self._last_hash[s[fill]].tobytes())
                if not self._fills_new(hashes, fill.size):
                    self._extend_each(index, slots, flat, counts, offsets, t, ok, changed, lookahead)
                    return
        # Commit: nothing below can fail.
        self._tail[s, pos] = tok
        self._ntok[s] = tt + 1
        self._changed_ok[s] = need
        recycled: dict[int, list[range]] = {}  # position in the run -> window columns it emptied
        tagged: list[tuple[int, int, CacheEvent]] = []  # events with their request's position in the run
        if recycle.size:
            if rec_rows.size:  # in request order, tail first: the LRU order of one by one
                # One C pass, pair by pair (a block two requests give back goes free at the second, as one by one).
                pool.release_table(rec_rows.astype(np.int64), rec_blocks.astype(np.int32).reshape(-1, 1))
                self._recycled += int(self._group_sizes[rec_rows].sum())
            if gives is not None:
                self._mark_window_steps(gives)
            else:
                for j, (_, blocks, stops) in zip(recycle.tolist(), returns):
                    if blocks.size:  # as _extend: a window with nothing left to give keeps its marks
                        recycled[j] = self._mark_recycled(by_slot[s[j]], stops)
        if num_need:
            allocation = pool.allocate(num_need)
            assert allocation is not None, "allocation failed after the free-block check"
            if self.enable_events and allocation.evicted_rows.size:
                tagged = self._forget_each(allocation, np.flatnonzero(need))
            else:
                self._forget(allocation.evicted_rows, allocation.evicted_blocks)
            new_blocks = allocation.blocks  # [groups, num_need], in request order
            heads = new_blocks[self._row_group] if self._expand else new_blocks
            opened = s[need]
            reqs = [by_slot[x] for x in opened.tolist()]
            cols = width[need].astype(np.int64)
            new_blocks = np.ascontiguousarray(new_blocks, dtype=np.int32)
            for j in _tables.set_columns([req.table for req in reqs], cols, new_blocks):
                _put_column(reqs[j], int(cols[j]), new_blocks[:, j])
            if self._expand:
                assert not _tables.set_columns([req.heads for req in reqs], cols, heads), "rows narrower than table"
            for req in reqs:
                req.num_blocks += 1
                req.changed = None
                req.view = None
            self._last_block[opened] = new_blocks.T
            self._width[opened] = width[need] + 1
            if not recycled and (gives is None or not gives.positions.size):
                changed.append(_Chunk(index[need], np.ones(num_need, dtype=np.int32), width[need], heads))
        if gives is not None and gives.positions.size:
            changed.append(self._window_step_changes(gives, index, s, need, width))
        if recycled:  # changes one request at a time, in order, each the union of its columns
            for j in sorted(set(np.flatnonzero(need).tolist()) | recycled.keys()):
                req = by_slot[s[j]]
                opened_col = [range(int(width[j]), int(width[j]) + 1)] if need[j] else []
                req.changed = cols = _columns(opened_col + recycled.get(j, []))
                self._changed_ok[s[j]] = True
                changed.append(_Chunk(index[j:j + 1], np.array([cols.size]), cols, None))
        if hashes:
            filled = s[fill]
            blocks = self._last_block[filled]
            filled_col = tt[fill] // bs
            for q in np.flatnonzero(filled_col != self._width[filled] - 1).tolist():  # behind blocks reserved ahead
                blocks[q] = by_slot[filled[q]].table[:, filled_col[q]]
            self._index.insert_new(hashes, blocks)
            pool.mark_cached_columns(blocks)
        if self.enable_events and hashes:
            for f, j in enumerate(fill.tolist()):
                before = len(self._events)
                self._store_events(by_slot[s[j]], int(tt[j]) // bs, hashes[f * _H:(f + 1) * _H], self._all_new,
                                   blocks_tok[f])
                tagged += [(j, 1, e) for e in self._events[before:]]
                del self._events[before:]
        if tagged:  # one by one, request j's evictions come before its store, and both before j + 1's
            tagged.sort(key=lambda item: item[:2])
            self._events += [e for _, _, e in tagged]
        if hashes:
            self._last_hash[filled] = np.frombuffer(hashes, dtype=np.uint8).reshape(-1, _H)
        self._set_limits(s, self._width[s].astype(np.int64), self._next_recycle[s])  # _refresh's, at once
        for j in recycled:
            self._refresh(by_slot[s[j]])  # the next recycling point moved on
        if gives is not None and gives.positions.size:  # _refresh's limits for the givers, at once
            given = s[gives.positions]
            self._set_limits(given, self._width[given].astype(np.int64), self._recycle_at([gives.stops]))

    def _window_steps(self, s: np.ndarray, tt: np.ndarray, recycle: np.ndarray) -> _WindowSteps | None:
        """What a run's requests ``recycle`` give back where the manager has one window group, read without a
        change; None with several (``_recyclable`` request by request)."""
        if len(self._window_groups) != 1:
            return None
        policy, group = self._window_groups[0]
        bs, g = self.block_size, int(group[0])
        rs = s[recycle]
        reqs = [self._by_slot[x] for x in rs.tolist()]
        stop = np.minimum(window_stop(policy, tt[recycle], bs), self._width[rs])
        start = np.fromiter((req.recycled[0] for req in reqs), dtype=np.int64, count=len(reqs))
        span = np.maximum(stop - start, 0)
        owner, cols = _spans(span, start, descending=True)  # each request's columns, tail first (the LRU order)
        old = np.empty((len(self._group_col), cols.size), dtype=np.int32)
        _tables.clear_columns([req.table for req in reqs], owner, cols, np.zeros(old.shape[0], np.uint8), old)
        live = old[g] >= 0
        gives = np.bincount(owner[live], minlength=len(reqs)) > 0  # a window with nothing to give keeps its marks
        done = np.flatnonzero(gives)
        return _WindowSteps(np.full(int(live.sum()), g, dtype=np.intp), old[g][live], recycle[done],
                            [reqs[k] for k in done.tolist()], start[done], stop[done])

    def _mark_window_steps(self, gives: _WindowSteps) -> None:
        """``_mark_recycled`` of ``_window_steps``' givers: their given columns emptied in the window group's rows."""
        if not gives.positions.size:
            return
        g = int(self._window_groups[0][1][0])
        owner, cols = _spans(gives.stops - gives.starts, gives.starts)
        for tables, clear in (([req.table for req in gives.reqs], self._group_col[:, 0] == g),
                              ([req.heads for req in gives.reqs] if self._expand else None, self._row_group == g)):
            if tables is not None:
                scratch = np.empty((clear.size, cols.size), dtype=np.int32)
                _tables.clear_columns(tables, owner, cols, clear.view(np.uint8), scratch)
        for req, stop in zip(gives.reqs, gives.stops.tolist()):
            req.recycled[0] = stop
            req.view = None

    def _window_step_changes(self, gives: _WindowSteps, index: np.ndarray, s: np.ndarray, need: np.ndarray,
                             width: np.ndarray) -> _Chunk:
        """One chunk of a run's changed columns where ``_window_steps`` took the givers: each request that opened a
        block or gave some back, in order, its given columns, then its opened one, with their values now."""
        gave_at = np.zeros(need.size, dtype=bool)
        gave_at[gives.positions] = True
        order = np.flatnonzero(need | gave_at)
        gave = gave_at[order]
        given_start = np.zeros(order.size, dtype=np.int64)
        given_span = np.zeros(order.size, dtype=np.int64)
        given_start[gave] = gives.starts  # both ascending by position
        given_span[gave] = gives.stops - gives.starts
        opens = need[order].astype(np.int64)
        owner, cols = _spans(given_span + opens, given_start)
        last = np.cumsum(given_span + opens) - 1
        cols[last[opens > 0]] = width[order[opens > 0]]  # an opener's last column is the block it opened
        by_slot = self._by_slot
        reqs = [by_slot[x] for x in s[order].tolist()]
        tables = [req.table if req.heads is None else req.heads for req in reqs]
        vals = np.empty((self.num_rows, cols.size), dtype=np.int32)
        _tables.clear_columns(tables, owner, cols, np.zeros(self.num_rows, np.uint8), vals)  # read only
        cols32 = cols.astype(np.int32)
        sizes = (given_span + opens).astype(np.int32)
        ends = np.cumsum(sizes).tolist()
        for req, a, b in zip(reqs, [0, *ends[:-1]], ends):
            req.changed = cols32[a:b]
        self._changed_ok[s[order]] = True
        return _Chunk(index[order], sizes, cols32, vals)

    def _extend_each(self, index: np.ndarray, slots: np.ndarray, flat: np.ndarray, counts: np.ndarray,
                     offsets: np.ndarray, t: np.ndarray, ok: np.ndarray, changed: list[_Chunk],
                     lookahead: int = 0) -> None:
        """``_extend`` of requests ``index`` (no slot repeated) one by one, in order."""
        by_slot = self._by_slot
        for i in index.tolist():
            req = by_slot[slots[i]]
            o = int(offsets[i])
            if self._extend(req, flat[o:o + int(counts[i])], int(t[i]), lookahead) is None:
                ok[i] = False
            elif len(req.changed):
                cols = self._changed_of(req)
                changed.append(_Chunk(np.array([i]), np.array([cols.size]), cols, None))

    def _extend_in_order(self, slots: np.ndarray, flat: np.ndarray, counts: np.ndarray, ok: np.ndarray,
                         widths: np.ndarray, views: list[np.ndarray | None] | None, lookahead: int = 0
                         ) -> list[_Chunk]:
        """``_extend_slots`` one request at a time (a slot is listed more than once)."""
        by_slot = self._by_slot
        changed: list[_Chunk] = []
        offset = 0
        for i, (s, k) in enumerate(zip(slots.tolist(), counts.tolist())):
            req = by_slot[s]
            if self._extend(req, flat[offset:offset + k], int(self._ntok[s]), lookahead) is None:
                ok[i] = False
            else:
                cols = self._changed_of(req)
                if cols.size:
                    changed.append(_Chunk(np.array([i]), np.array([cols.size]), cols, None))
            widths[i] = req.num_blocks
            if views is not None:
                views.append(None if not ok[i] else req.view if req.view is not None else _view(req))
            offset += k
        return changed

    def _fills_new(self, hashes: bytes, count: int) -> bool:
        """Whether ``count`` packed hashes a run's blocks filled are distinct and none is in the index: what
        makes one insert of them all the one-by-one result."""
        if count > 1 and len(set(np.frombuffer(hashes, dtype=_PACKED).tolist())) < count:
            return False
        return not self._index.any_known(hashes)

    def _forget_each(self, allocation: Allocation, opens: np.ndarray) -> list[tuple[int, int, CacheEvent]]:
        """``_forget`` of a run's evictions one open at a time, in order; their events, tagged with the open's position.

        Row g's part of the allocation took its stack's blocks first and then
        evicted, so the last ``e_g`` opens of the run are the ones that evicted
        there. The events are taken back out for the caller to merge with the
        run's stores.
        """
        m = allocation.blocks.shape[1]
        first = m - np.bincount(allocation.evicted_rows, minlength=allocation.blocks.shape[0])
        took = np.arange(m) >= first[:, None]  # [groups, opens]: that open evicted in that row
        start = len(self._events)
        tagged = []
        for q, j in enumerate(opens.tolist()):
            rows = np.flatnonzero(took[:, q])
            if rows.size:
                before = len(self._events)
                self._forget(rows, allocation.blocks[rows, q])
                tagged += [(j, 0, e) for e in self._events[before:]]
        del self._events[start:]
        return tagged


def _spans(lengths: np.ndarray, starts: np.ndarray, *, descending: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Columns ``starts[k] .. starts[k] + lengths[k] - 1`` of every k, back to back (each k's run descending with
    ``descending``), and the k each belongs to."""
    lengths = np.asarray(lengths, dtype=np.int64)
    owner = np.repeat(np.arange(lengths.size), lengths)
    within = np.arange(owner.size) - (np.cumsum(lengths) - lengths)[owner]
    first = np.asarray(starts, dtype=np.int64)[owner]
    return owner, (first + lengths[owner] - 1 - within) if descending else first + within

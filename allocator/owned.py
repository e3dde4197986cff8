"""Blocks a scheduler owns the table of: KVCacheManager's operations for schedulers that keep their own block lists.

Some schedulers (FastDeploy's ``ResourceManagerV1``) keep each request's block list themselves: they ask for
blank blocks before knowing their tokens, and later say which of their blocks now hold which tokens. These
operations serve them on the same pool and prefix index as ``admit``/``extend``, so both kinds of request share
prefixes, evictions and KV events. A request is one kind or the other: an id admitted cannot own blocks here,
and the reverse. One request's blocks (block_size 4)::

    scheduler's list | m0 | m1 | b2 | b3 | b4 |
                     |match_blocks|allocate_blank(3)|
    committed        |<-- m0 m1 b2 ----->|            commit_blocks([b2], tokens[8:12])
    release          release_blocks(id) ends the committed part; release_blocks(id, [b3, b4]) the rest

Every block in an owner's list holds one reference of it. Only managers of one row group (uniform tables)
serve these operations: a scheduler's list is one block id per position.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.prefix import HASH_BYTES, LoRA, MMPlaceholder, as_token_array, check_lora

if TYPE_CHECKING:
    from kvcache.allocator.manager import Tokens

_H = HASH_BYTES
_ROW0 = np.zeros(1, dtype=np.intp)


@dataclasses.dataclass(slots=True)
class _Owned:
    """One owner's blocks: the committed part (positions ``[0, len(committed))`` of its list, each holding the
    tokens its hash says) and blank blocks (no tokens known), each listed once per reference held."""

    committed: list[int] = dataclasses.field(default_factory=list)
    blank: list[int] = dataclasses.field(default_factory=list)
    hashes: bytearray = dataclasses.field(default_factory=bytearray)  # the committed part's chained hashes
    matched: bool = False  # match_blocks ran and release_blocks(id) has not: the committed part is live
    cache_salt: str | None = None
    lora: LoRA | None = None
    mm: list[MMPlaceholder] | None = None


class OwnedBlocks:
    """``match_blocks``, ``allocate_blank``, ``commit_blocks``, ``release_blocks``: a scheduler-owned block list."""

    def _owner(self, request_id: object, op: str) -> _Owned:
        if len(self._group_col) != 1:
            raise KVCacheError(f"{op}: scheduler-owned blocks need one row group (uniform tables); the manager has "
                               f"{len(self._group_col)}")
        if request_id in self._requests:
            raise KVCacheError(f"request_id: {request_id!r} is admitted; its table is the manager's")
        return self._owned.get(request_id) or _Owned()

    def _keep(self, request_id: object, owned: _Owned) -> None:
        """Store ``owned`` as the request's, or drop the record once it holds nothing and has no committed part."""
        if owned.matched or owned.committed or owned.blank:
            self._owned[request_id] = owned
        else:
            self._owned.pop(request_id, None)

    def owned_blocks(self, request_id: object) -> tuple[np.ndarray, np.ndarray]:
        """The request's committed blocks (its list's first positions, in order) and its blank blocks (int32)."""
        owned = self._owned.get(request_id)
        if owned is None:
            return np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int32)
        return np.asarray(owned.committed, dtype=np.int32), np.asarray(owned.blank, dtype=np.int32)

    def is_matched(self, request_id: object) -> bool:
        """Whether the request's committed part is live: ``match_blocks`` ran and ``release_blocks(id)`` has not."""
        owned = self._owned.get(request_id)
        return owned is not None and owned.matched

    def match_blocks(self, request_id: object, tokens: Tokens, *, cache_salt: str | None = None,
                     lora: LoRA | None = None, mm: Sequence[MMPlaceholder | tuple[str, int, int]] | None = None
                     ) -> np.ndarray:
        """Start the request's committed part with its tokens' leading cached blocks, one reference each.

        Unlike ``admit`` every full block may hit, the last one included (a whole-prompt hit): the scheduler
        decides what to recompute. Returns the blocks (int32); the request's later ``commit_blocks`` continue
        its hash chain. Refused while the request's committed part is live (``release_blocks(id)`` ends it).
        """
        owned = self._owner(request_id, "match_blocks")
        if owned.matched:
            raise KVCacheError(f"request_id: {request_id!r} is matched already; release_blocks({request_id!r}) first")
        lora = check_lora(lora)
        tokens = as_token_array(tokens)
        found = np.empty(0, dtype=np.int32)
        hashes = b""
        if self._hasher is not None:
            hashes = self._hasher.hash_blocks_packed(tokens, cache_salt=cache_salt, lora=lora, mm=mm)
            found = self._index.match(hashes)[:, 0].astype(np.int32)
            self._count_query(int(tokens.size), int(found.size))
        if found.size:
            self._pool.incref(np.zeros(found.size, dtype=np.intp), found, unique=True)
        owned.matched = True
        owned.committed = found.tolist()
        owned.hashes = bytearray(hashes[: found.size * _H])
        owned.cache_salt, owned.lora = cache_salt, lora
        owned.mm = [m if isinstance(m, MMPlaceholder) else MMPlaceholder(*m) for m in mm] if mm else None
        self._owned[request_id] = owned
        return found

    def allocate_blank(self, request_id: object, num_blocks: int) -> np.ndarray | None:
        """``num_blocks`` blank blocks (int32) the request holds, one reference each, no tokens in them yet.

        Free blocks first, lowest id first, then cached free ones (oldest released first), whose prefixes leave
        the index (reported as removed). Returns None, changing nothing, when too few are allocatable.
        """
        owned = self._owner(request_id, "allocate_blank")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)) or num_blocks < 0:
            raise KVCacheError(f"num_blocks: must be an integer >= 0, got {num_blocks!r}")
        if num_blocks == 0:
            return np.empty(0, dtype=np.int32)
        allocation = self._pool.allocate(int(num_blocks), ascending=True)
        if allocation is None:
            return None
        self._forget(allocation.evicted_rows, allocation.evicted_blocks)
        blocks = allocation.blocks[0].astype(np.int32)
        owned.blank += blocks.tolist()
        self._keep(request_id, owned)
        return blocks

    def commit_blocks(self, request_id: object, blocks: Sequence[int] | np.ndarray, tokens: Tokens, *,
                      blank_from: object = None) -> int:
        """The request's blank ``blocks`` now hold the next full blocks of its tokens: they join its committed
        part (after the matched and earlier committed blocks) and enter the prefix index.

        ``tokens`` are the tokens of those blocks (``len(blocks) * block_size``, following the committed part's).
        A block whose hash another block holds already stays the request's own, not indexed twice. Returns the
        blocks newly indexed. Refused, changing nothing, for a block the request does not hold blank.

        ``blank_from``: the blocks are another owner's blank ones (a scheduler that allocates before it names
        the request keeps its blank blocks under one id); their references pass to the request.
        """
        owned = self._owner(request_id, "commit_blocks")
        if blank_from == request_id:
            blank_from = None
        source = owned if blank_from is None else self._owner(blank_from, "commit_blocks")
        if not owned.matched:
            raise KVCacheError(f"request_id: {request_id!r} was not matched (match_blocks) or is released")
        ids = _block_ids(blocks, "blocks", self.num_blocks)
        tokens = as_token_array(tokens)
        if tokens.size != ids.size * self.block_size:
            raise KVCacheError(f"tokens: {tokens.size} given for {ids.size} blocks of {self.block_size}")
        if np.unique(ids).size != ids.size:
            raise KVCacheError(f"blocks: request {request_id!r} lists a block twice")
        _take(source.blank, ids.tolist(), "blocks", request_id if blank_from is None else blank_from, "blank",
              apply=False)
        if ids.size == 0:
            return 0
        if self._hasher is None:
            _take(source.blank, ids.tolist(), "blocks", request_id, "blank")
            owned.committed += ids.tolist()
            if source is not owned:
                self._keep(blank_from, source)
            return 0
        _, indexed = self._index.hashes_at(np.zeros(ids.size, dtype=np.intp), ids)
        if indexed.any():  # a blank block is never indexed: only a bug gets here
            raise KVCacheError(f"blocks: block {int(ids[indexed][0])} already holds a cached prefix")
        start = len(owned.committed)
        parent = bytes(owned.hashes[-_H:]) if start else None
        hashes = self._hasher.hash_blocks_packed(tokens, cache_salt=owned.cache_salt, lora=owned.lora, mm=owned.mm,
                                                 parent=parent, start_block=start)
        _take(source.blank, ids.tolist(), "blocks", request_id, "blank")
        if source is not owned:
            self._keep(blank_from, source)
        inserted = self._index.insert(hashes, ids[:, None])
        added = inserted.added[:, 0]
        if added.any():
            self._pool.mark_cached(np.zeros(int(added.sum()), dtype=np.intp), ids[added].astype(np.intp))
            if self.enable_events:
                held = np.concatenate(([False], added, [False]))
                edges = np.flatnonzero(held[1:] != held[:-1])
                bs = self.block_size
                extra = self._extra_keys(owned.cache_salt, owned.lora, owned.mm, start, start + ids.size)
                for first, stop in zip(edges[::2].tolist(), edges[1::2].tolist()):
                    before = hashes[(first - 1) * _H:first * _H] if first else parent
                    self._events.append(self._stored(0, hashes[first * _H:stop * _H], before,
                                                     tokens[first * bs:stop * bs], owned.lora, extra[first:stop]))
        owned.committed += ids.tolist()
        owned.hashes += hashes
        return int(added.sum())

    def release_blocks(self, request_id: object, blocks: Sequence[int] | np.ndarray | None = None) -> None:
        """Drop the request's references: ``blocks=None`` ends its committed part (tail first, so a prefix's last
        blocks are evicted before its first), a list drops one reference of each listed blank block.

        Released blocks no one else holds return to the pool; indexed ones stay findable until reused. Refused,
        changing nothing, for a block the request does not hold blank.
        """
        owned = self._owner(request_id, "release_blocks")
        if blocks is None:
            if not owned.matched:
                raise KVCacheError(f"request_id: {request_id!r} was not matched (match_blocks) or is released")
            drop = np.asarray(owned.committed[::-1], dtype=np.intp)
            owned.committed, owned.hashes, owned.matched = [], bytearray(), False
            if drop.size:
                self._pool.decref(np.zeros(drop.size, dtype=np.intp), drop, unique=True)
        else:
            ids = _block_ids(blocks, "blocks", self.num_blocks)
            _take(owned.blank, ids.tolist(), "blocks", request_id, "blank")
            if ids.size:
                self._pool.decref(np.zeros(ids.size, dtype=np.intp), ids.astype(np.intp))
        self._keep(request_id, owned)

    def evict_cached(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` cached free blocks now, oldest released first; returns how many.

        The free blocks keep their order (the evicted ones go under them), as if allocated and given back.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)) or num_blocks < 0:
            raise KVCacheError(f"num_blocks: must be an integer >= 0, got {num_blocks!r}")
        if len(self._group_col) != 1:
            raise KVCacheError(f"evict_cached: needs one row group; the manager has {len(self._group_col)}")
        cached_free = int(self._pool.num_cached_free()[0])
        count = min(int(num_blocks), cached_free)
        if count == 0:
            return 0
        uncached = int(self._pool.num_free()[0]) - cached_free
        allocation = self._pool.allocate(uncached + count)
        assert allocation is not None, "allocation failed after the free-block count"
        self._forget(allocation.evicted_rows, allocation.evicted_blocks)
        taken = allocation.blocks[0][::-1].astype(np.intp)
        self._pool.decref(np.zeros(taken.size, dtype=np.intp), taken, unique=True)
        return count

    @property
    def num_cached_free_blocks(self) -> np.ndarray:
        """Of ``num_free_blocks``, those holding a cached prefix (int array ``[num_rows]``)."""
        return self._pool.num_cached_free()[self._row_group]

    def uncached_free_blocks(self) -> np.ndarray:
        """Free blocks holding no prefix, ascending (int32; one row group only)."""
        ids = np.arange(self.num_blocks)
        free = (self._pool.refcount(_ROW0, ids) == 0) & ~self._pool.is_cached(_ROW0, ids)
        return np.flatnonzero(free).astype(np.int32)

    def _owned_refs(self) -> np.ndarray:
        """References owners hold per block (int64 ``[num_blocks]``), for ``check_integrity``."""
        refs = np.zeros(self.num_blocks, dtype=np.int64)
        for owned in self._owned.values():
            listed = owned.committed + owned.blank
            if listed:
                np.add.at(refs, np.asarray(listed, dtype=np.intp), 1)
        return refs


def _block_ids(blocks: Sequence[int] | np.ndarray, field: str, num_blocks: int) -> np.ndarray:
    """``blocks`` as an int32 array after checking each is a block id."""
    items = blocks.tolist() if isinstance(blocks, np.ndarray) else list(blocks)
    for i, b in enumerate(items):
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 0 <= b < num_blocks:
            raise KVCacheError(f"{field}[{i}]: {b!r} is not a block id in [0, {num_blocks})")
    return np.asarray(items, dtype=np.int32)


def _take(held: list[int], ids: list[int], field: str, request_id: object, what: str, *, apply: bool = True) -> None:
    """Remove each of ``ids`` once from ``held`` (only check, with ``apply=False``); raise (``held`` unchanged) if
    one is not there enough times."""
    need: dict[int, int] = {}
    for b in ids:
        need[b] = need.get(b, 0) + 1
    have: dict[int, int] = {}
    for b in held:
        have[b] = have.get(b, 0) + 1
    for b, n in need.items():
        if have.get(b, 0) < n:
            raise KVCacheError(f"{field}: block {b} is listed {n} time(s) but request {request_id!r} holds it "
                               f"{what} {have.get(b, 0)} time(s)")
    if not apply:
        return
    for b in ids:
        held.remove(b)

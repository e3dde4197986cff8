"""Cache tiers below the GPU blocks: the interface a KVCacheManager consults, and how far a tier extends a hit.

A lower tier (the host-memory tier, ``kvcache.transfer.manager.TransferManager``)
holds copies of blocks keyed by the same chained hashes as the prefix index. The
manager stays free of I/O: it asks the tier which hashes it holds, tells it which
GPU blocks it must fill, which it releases and which it is about to reuse; the
tier does the copying. A hit is GPU blocks first, then the tier's::

    prompt   | gpu | gpu | tier | tier | new | new |
             |<- GPU hit ->|<- loaded ->|
             |<-- num_cached_tokens -->|
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.prefix import HASH_BYTES, LoRA, MMPlaceholder, as_token_array, check_lora
from kvcache.allocator.swa import AttentionPolicy, Full, first_seen_token, sink_tokens

if TYPE_CHECKING:
    from kvcache.allocator.events import CacheEvent
    from kvcache.allocator.manager import Tokens
    from kvcache.allocator.requests import _Request

_H = HASH_BYTES


class LowerTier(Protocol):
    """What a KVCacheManager needs of a tier under its GPU blocks; every call comes from the manager's owner thread.

    Rows are the manager's rows (one, or one per kv head); blocks are GPU block
    ids; ``hashes`` are packed (32 bytes each) like ``BlockHasher.hash_blocks_packed``.
    """

    def poll(self) -> None:
        """Settle copies that finished; may call the manager back (``drop_cached``, ``push_events``).

        The manager calls it first thing in ``admit`` and ``free``, so a failed
        load is forgotten before a hit could use its blocks.
        """

    def held(self, hashes: bytes) -> np.ndarray:
        """bool ``[k, num_rows]``: the rows the tier holds, now and findable, for the leading ``k`` hashes.

        ``k`` stops at the first hash no row holds. Answers stay true until
        ``admitted`` returns (the tier drops nothing in between).
        """

    def admitted(self, request_id: object, table: np.ndarray, num_gpu_blocks: int, hashes: bytes) -> None:
        """``admit`` gave ``request_id`` the table ``[num_rows, n]``; its first ``num_gpu_blocks`` were GPU hits.

        The next ``len(hashes) // 32`` columns come from the tier: each block id
        >= 0 there must be filled from the tier's copy of that column's hash
        before the request runs. Called after every admit while a tier is attached.
        """

    def released(self, request_id: object, hashes: bytes, blocks: np.ndarray, tokens: np.ndarray,
                 lora: str | tuple[str, str] | None, extra_keys: tuple[tuple | None, ...]) -> None:
        """``free``: the request's first ``n`` hashed blocks ``[num_rows, n]`` lose their last reference.

        An id >= 0 holds that column's hash in the prefix index and its KV is
        final; -1 where not (shared with a live request, a duplicate, recycled).
        ``tokens`` are the ``n`` blocks' tokens, ``extra_keys`` their keys as
        events publish them (``BlockStored.extra_keys``). Called on every free (n may be 0).
        """

    def evicting(self, rows: np.ndarray, blocks: np.ndarray) -> None:
        """These (row, block) pairs are about to get a new owner (or lose their hash); the owner writes them next.

        The tier must not read them after returning, nor write them later.
        """

    def reset(self) -> None:
        """``reset_prefix_cache``: forget every block the tier holds."""


def tier_extension(present: np.ndarray, start: int, policies: Sequence[AttentionPolicy], block_size: int) -> int:
    """Longest ``L`` such that a GPU hit of ``start`` blocks plus the tier's next ``L`` blocks serves every group.

    ``present`` is bool ``[k, groups]``: group g holds block ``start + j`` on the
    tier. A Full group needs every block of ``[start, start + L)``; a Window
    group only those in its sink or its window at length ``start + L`` (the
    GPU hit already holds the window's part before ``start``, as it held a
    wider one). Like the GPU match, the longest usable length wins, so a
    Window group's gap may lie inside the extension.
    """
    k = present.shape[0]
    if all(isinstance(policy, Full) for policy in policies):  # every block of [start, start + L) in every group
        complete = present.all(axis=1)
        return k if complete.all() else int(np.argmin(complete))
    lengths = np.arange(k + 1)
    usable = np.ones(k + 1, dtype=bool)
    for g, policy in enumerate(policies):
        missing = np.concatenate([[0], np.cumsum(~present[:, g])])
        if isinstance(policy, Full):
            usable &= missing == 0
            continue
        total = start + lengths
        sink_stop = np.minimum(-(-np.minimum(sink_tokens(policy), total * block_size) // block_size), total)
        first_seen = np.minimum(first_seen_token(policy, total * block_size) // block_size, total)
        a = np.clip(sink_stop - start, 0, lengths)
        b = np.clip(first_seen - start, 0, lengths)
        usable &= (missing[a] == 0) & (missing[lengths] - missing[b] == 0)
    return int(np.flatnonzero(usable)[-1])


class TierLink:
    """KVCacheManager's side of a lower tier (mixed into it): attaching one, finding hits in it, what it is told."""

    def attach_tier(self, tier: LowerTier | None) -> None:
        """Put a cache tier under the GPU blocks (None detaches it); see ``allocator/tiers.py``.

        With a tier, ``admit`` counts the tier's blocks after a GPU hit as cached,
        ``free`` offers released blocks to it, and evictions are reported first.
        """
        if tier is not None and self.tier is not None and tier is not self.tier:
            raise KVCacheError("tier: this manager already has a tier attached; detach it first")
        self.tier = tier

    def lookup_tiers(self, prompt_tokens: Tokens, *, cache_salt: str | None = None, lora: LoRA | None = None,
                     mm: Sequence[MMPlaceholder | tuple[str, int, int]] | None = None) -> tuple[int, int]:
        """(GPU-cached tokens, further tokens the tier holds) that ``admit`` would count now (no state change)."""
        lora = check_lora(lora)
        tokens = as_token_array(prompt_tokens)
        if self._hasher is None or tokens.size < 2:
            return 0, 0
        hashes = self._hasher.hash_blocks_packed(tokens[: tokens.size - 1], cache_salt=cache_salt, lora=lora, mm=mm)
        num_hit = self._match(hashes)[0]
        num_tier = self._match_tier(hashes, num_hit, len(hashes) // _H)[0] if self.tier is not None else 0
        return num_hit * self.block_size, num_tier * self.block_size

    def drop_cached(self, rows: np.ndarray, blocks: np.ndarray) -> None:
        """Forget the hashes these (row, block) pairs hold: their KV is not what the hash says (a failed load).

        Live requests keep the blocks; free ones go back uncached. Emits BlockRemoved for hashes that left.
        """
        rows = np.asarray(rows, dtype=np.intp).ravel()
        blocks = np.asarray(blocks, dtype=np.intp).ravel()
        keep = blocks >= 0
        if not keep.all():
            rows, blocks = rows[keep], blocks[keep]
        if rows.size and ((rows < 0) | (rows >= self.num_rows) | (blocks >= self.num_blocks)).any():
            raise KVCacheError(f"rows/blocks: pairs must lie in [0, {self.num_rows}) x [0, {self.num_blocks})")
        groups = np.unique(self._row_group[rows] * self.num_blocks + blocks)
        groups, blocks = np.divmod(groups, self.num_blocks)
        removed = self._index.remove(groups, blocks)
        self._pool.uncache(removed.rows, removed.blocks)
        if self.enable_events:
            self._events += self._removed(removed.rows, removed.hashes)

    def push_events(self, events: Sequence[CacheEvent]) -> None:
        """Queue a tier's events (medium "CPU") behind the manager's own, so subscribers see one ordered stream."""
        if self.enable_events:
            self._events.extend(events)

    def _match_tier(self, hashes: bytes, start: int, limit: int) -> tuple[int, np.ndarray | None]:
        """Blocks after a GPU hit of ``start`` blocks that the tier supplies, and which groups it holds them for.

        Returns (n, bool ``[groups, n]``, or None where every group holds all n), or (0, None); hashes are the
        prompt's, ``limit`` the most blocks a hit may take.
        """
        assert self.tier is not None
        if limit <= start:
            return 0, None
        held = np.asarray(self.tier.held(hashes[start * _H: limit * _H]), dtype=bool)
        if held.shape[0] == 0:
            return 0, None
        if len(self.rows) == 1 and isinstance(self.rows[0], Full):  # held stops at the first block its row lacks
            return held.shape[0], None
        num_groups = len(self._group_col)
        present = held if not self._expand and held.shape[1] == num_groups else np.stack(
            [held[:, self._row_group == g].all(axis=1) for g in range(num_groups)], axis=1)
        policies = list(dict.fromkeys(self.rows))
        n = tier_extension(present, start, policies, self.block_size)
        return (n, present[:n].T.copy()) if n else (0, None)

    def _release_to_tier(self, request_id: object, req: _Request) -> None:
        """Offer the tier the request's hashed blocks that lose their last reference with this free."""
        assert self.tier is not None
        self.tier.poll()
        bs = self.block_size
        history = self._tier_tokens.get(req.slot)
        tokens = np.concatenate(history) if history else np.empty(0, dtype=np.uint32)
        n = int(self._ntok[req.slot]) // bs if history and self._hasher is not None else 0
        hashes = b""
        blocks = np.empty((self.num_rows, 0), dtype=np.int32)
        if n:
            hashes = self._hasher.hash_blocks_packed(tokens[: n * bs], cache_salt=req.cache_salt, lora=req.lora,
                                                     mm=req.mm)
            table = req.table[:, :n]
            last = self._pool.refcount(self._group_col, table) == 1
            holds = (self._index.blocks_of(hashes).T == table) & (table >= 0)
            blocks = np.where(last & holds, table, -1)[self._row_group]
        self.tier.released(request_id, hashes, blocks, tokens[: n * bs], req.lora,
                           self._extra_keys(req.cache_salt, req.lora, req.mm, 0, n))

    def _record_tier_tokens(self, slots: np.ndarray, flat: np.ndarray, counts: np.ndarray, ok: np.ndarray) -> None:
        """Append each successful extend's tokens, in order, to its request's history (a tier is attached)."""
        ends = np.cumsum(counts)
        for s, good, end, k in zip(slots.tolist(), np.asarray(ok).tolist(), ends.tolist(), np.asarray(counts).tolist()):
            history = self._tier_tokens.get(s)
            if good and history is not None:
                history.append(flat[end - k:end].copy())

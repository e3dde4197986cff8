"""KVCacheManager: the scheduler's API over block pool, sliding-window policy and prefix index.

A scheduler calls ``admit`` once per request, ``extend`` each step the request
grows (next prefill chunk, decoded tokens), and ``free`` when it ends. Every
call that would need more blocks than are free returns None and changes
nothing. Tables are int32 ``[num_rows, num_blocks]``; ``-1`` marks a slot a
sliding-window row no longer holds.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple, Sequence, Union

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent
from kvcache.allocator.pool import BlockPool, Usage, usage
from kvcache.allocator.prefix import (
    HASH_BYTES,
    BlockHash,
    BlockHasher,
    Inserted,
    MMPlaceholder,
    PrefixIndex,
    as_token_array,
)
from kvcache.allocator.swa import AttentionPolicy, Full, Window, recyclable_blocks
from kvcache.allocator.tiers import tier_extension

if TYPE_CHECKING:
    from kvcache.allocator.layout import CacheSpec
    from kvcache.allocator.tiers import LowerTier

Tokens = Union[Sequence[int], np.ndarray]


class Admission(NamedTuple):
    """What ``admit`` decided: the cached prefix, the table, and the tokens the table covers.

    ``num_cached_tokens`` is a multiple of block_size and at most
    ``len(prompt) - 1``; the step computes tokens ``[num_cached_tokens, num_tokens)``.
    """

    num_cached_tokens: int
    table: np.ndarray
    num_tokens: int


class ManagerStats(NamedTuple):
    """Counters for metrics: live requests, cached hashes, free blocks, prefix hits, evictions, recycling.

    Block counts are (row, block) pairs: a block of an 8-row table counts 8.
    """

    num_requests: int
    num_cached_hashes: int
    min_free_blocks: int
    prefix_queries: int
    prefix_hit_requests: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    evicted_blocks: int
    recycled_blocks: int


@dataclasses.dataclass(slots=True)
class _Request:
    """One admitted request: its tokens, table and hashing progress (buffers grow by doubling)."""

    tokens: np.ndarray  # uint32 [capacity]
    num_tokens: int
    table: np.ndarray  # int32 [num_groups, capacity_blocks]: one row per distinct policy
    heads: np.ndarray | None  # int32 [num_rows, capacity_blocks]: table expanded to rows, when they differ
    num_blocks: int
    num_hashed: int  # leading full blocks whose hashes are registered
    last_hash: BlockHash | None
    recycled: list[int]  # per window group: logical blocks [0, recycled) already given back
    cache_salt: str | None
    lora: str | None
    mm: list[MMPlaceholder] | None
    changed: np.ndarray  # int32 columns the last admit/extend set
    view: np.ndarray | None = None  # cached read-only view of the table handed to callers
    fast_limit: int = 0  # extends up to this many tokens need no block, hash or table change
    next_recycle: float = 0  # first num_computed_tokens at which a window row would give a block back


class KVCacheManager:
    """Per-row paged KV block allocation with sliding-window recycling and prefix caching.

    ``rows`` holds one attention policy per allocation row: ``[Full()]`` for a
    uniform cache (every head of every layer shares a block id), or one policy
    per kv head for head-wise allocation, where SWA heads give blocks back as
    their window slides. Rows with equal policies always receive the same
    operations, so their free heaps stay identical: they share one pool row (a
    *group*) and tables are expanded to rows only when handed out, which keeps
    8-row head-wise mode near the cost of its distinct policies. Not
    thread-safe: one owner calls it (the daemon gives it a thread of its own).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        rows: Sequence[AttentionPolicy] = (Full(),),
        *,
        enable_prefix_caching: bool = True,
        hash_algorithm: str = "sha256",
        hash_seed: bytes | str | None = None,
        enable_events: bool = False,
    ) -> None:
        _check_count(num_blocks, "num_blocks", least=1)
        _check_count(block_size, "block_size", least=1)
        rows = tuple(rows)
        if not rows:
            raise KVCacheError("rows: need at least one row policy")
        for i, policy in enumerate(rows):
            if not isinstance(policy, (Full, Window)):
                raise KVCacheError(f"rows[{i}]: expected Full() or Window(...), got {policy!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.rows = rows
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_events = enable_events
        groups = list(dict.fromkeys(rows))
        self._row_group = np.array([groups.index(p) for p in rows], dtype=np.intp)
        self._expand = len(groups) != len(rows)
        self._pool = BlockPool(len(groups), num_blocks)
        self._index = PrefixIndex(len(groups), num_blocks)
        self._hasher = BlockHasher(block_size, hash_algorithm, hash_seed) if enable_prefix_caching else None
        self._group_col = np.arange(len(groups), dtype=np.intp)[:, None]
        self._full_rows = np.array([g for g, p in enumerate(groups) if isinstance(p, Full)], dtype=np.intp)
        self._window_groups: list[tuple[Window, np.ndarray]] = [
            (p, np.array([g], dtype=np.intp)) for g, p in enumerate(groups) if isinstance(p, Window)
        ]
        self._requests: dict[object, _Request] = {}
        self._events: list[CacheEvent] = []
        self._group_sizes = np.bincount(self._row_group)
        self._queries = self._hit_requests = self._queried_tokens = self._hit_tokens = 0
        self._evicted = self._recycled = 0
        self.tier: LowerTier | None = None  # a cache tier under the GPU blocks (attach_tier)

    def __getstate__(self) -> dict:
        """Pickle (a journal snapshot) without the attached tier: it holds memory and threads, not state."""
        state = self.__dict__.copy()
        state["tier"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        """Unpickling (a journal snapshot): cached table views would be copies now, so drop them."""
        self.__dict__.update(state)
        for req in self._requests.values():
            req.view = None

    @classmethod
    def from_spec(
        cls,
        spec: CacheSpec,
        num_blocks: int,
        *,
        head_wise: bool = False,
        policies: Sequence[AttentionPolicy] | None = None,
        **options: object,
    ) -> KVCacheManager:
        """A manager for one TP rank of ``spec``: one row, or one row per kv head of the rank.

        ``policies`` gives each of the rank's kv heads its policy (default all Full).
        """
        num_rows = spec.kv_heads_per_rank if head_wise else 1
        if policies is None:
            policies = [Full()] * num_rows
        elif len(policies) != num_rows:
            raise KVCacheError(f"policies: {len(policies)} given, the rank has {num_rows} row(s)")
        return cls(num_blocks, spec.block_size, policies, **options)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ queries

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def num_free_blocks(self) -> np.ndarray:
        """Allocatable blocks per row (free plus cached-but-unused), int array ``[num_rows]``."""
        return self._pool.num_free()[self._row_group]

    @property
    def usage(self) -> Usage:
        """Fraction of blocks in use per row and the largest, exact (never rounded to 0)."""
        return usage(self.num_free_blocks, self.num_blocks)

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens fits even with no prefix hit."""
        _check_count(num_tokens, "num_tokens", least=0)
        return self._pool.can_allocate(-(-num_tokens // self.block_size))

    def lookup(self, prompt_tokens: Tokens, *, cache_salt: str | None = None, lora: str | None = None,
               mm: Sequence[MMPlaceholder | tuple[str, int, int]] | None = None) -> int:
        """Tokens of ``prompt_tokens`` that ``admit`` would find cached now (no state change)."""
        tokens = as_token_array(prompt_tokens)
        if self._hasher is None or tokens.size < 2:
            return 0
        hashes = self._hasher.hash_blocks_packed(tokens[: tokens.size - 1], cache_salt=cache_salt, lora=lora, mm=mm)
        num_hit = self._match(hashes)[0]
        if self.tier is not None:
            num_hit += self._match_tier(hashes, num_hit, len(hashes) // _H)[0]
        return num_hit * self.block_size

    def table(self, request_id: object) -> np.ndarray:
        """The request's block table, int32 ``[num_rows, num_blocks]`` (a read-only view)."""
        req = self._get(request_id)
        return _view(req)

    def changed_columns(self, request_id: object) -> np.ndarray:
        """Columns (int32, ascending) the request's last admit or extend set: all of them after admit.

        What a daemon sends workers as the table's delta instead of the whole table.
        """
        return self._get(request_id).changed

    def num_tokens(self, request_id: object) -> int:
        """Tokens the request's table covers."""
        return self._get(request_id).num_tokens

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def stats(self) -> ManagerStats:
        return ManagerStats(
            len(self._requests), len(self._index), int(self._pool.num_free().min()),
            self._queries, self._hit_requests, self._queried_tokens, self._hit_tokens,
            self._evicted, self._recycled,
        )

    def take_events(self) -> list[CacheEvent]:
        """Cache events since the last call, oldest first (empty unless ``enable_events``)."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ actions

    def admit(
        self,
        request_id: object,
        prompt_tokens: Tokens,
        *,
        cache_salt: str | None = None,
        lora: str | None = None,
        mm: Sequence[MMPlaceholder | tuple[str, int, int]] | None = None,
        num_tokens: int | None = None,
    ) -> Admission | None:
        """Take a new request: reuse its longest cached prefix and allocate blocks for the rest.

        The table covers tokens ``[0, N)`` with ``N = max(num_tokens, hit + 1)``
        capped at the prompt (``num_tokens`` defaults to the whole prompt; pass
        less for chunked prefill and send the rest with ``extend``)::

            prompt   |<-------------------- len(prompt) ------------------->|
            blocks   | hit | hit | hit | new | new | new |                  |
                     |<-- num_cached ->|<-- computed now -->|
                     |<----------------- N ---------------->|

        Returns None, changing nothing, when the blocks are short.
        """
        if request_id in self._requests:
            raise KVCacheError(f"request_id: {request_id!r} is already admitted")
        tokens = as_token_array(prompt_tokens)
        if tokens.size == 0:
            raise KVCacheError("prompt_tokens: must hold at least one token")
        if num_tokens is None:
            num_tokens = int(tokens.size)
        _check_count(num_tokens, "num_tokens", least=1)
        if num_tokens > tokens.size:
            raise KVCacheError(f"num_tokens: {num_tokens} exceeds the prompt's {tokens.size} tokens")
        bs = self.block_size
        hashes = b""
        num_hit, hit = 0, None
        num_tier, tier_held = 0, None
        if self.tier is not None:
            self.tier.poll()
        if self._hasher is not None:
            hashes = self._hasher.hash_blocks_packed(tokens, cache_salt=cache_salt, lora=lora, mm=mm)
            num_hit, hit = self._match(hashes[: (tokens.size - 1) // bs * _H])
            if self.tier is not None:
                num_tier, tier_held = self._match_tier(hashes, num_hit, (tokens.size - 1) // bs)
        num_cached = num_hit + num_tier
        covered = min(int(tokens.size), max(num_tokens, num_cached * bs + 1))
        num_blocks = -(-covered // bs)
        num_new = num_blocks - num_hit
        free = self._pool.num_free()
        if hit is not None:
            revived = (self._pool.refcount(self._group_col, hit) == 0) & (hit >= 0)
            free = free - revived.sum(axis=1)
        if (free < num_new).any():
            return None
        if hit is not None:
            self._pool.incref(self._group_col, hit, unique=True)
        allocation = self._pool.allocate(num_new)
        assert allocation is not None, "allocation failed after the free-block check"
        self._forget(allocation.evicted_rows, allocation.evicted_blocks)
        capacity = _grow(num_blocks, 4)
        table = np.full((len(self._group_col), capacity), -1, dtype=np.int32)
        if hit is not None:
            table[:, :num_hit] = hit
        table[:, num_hit:num_blocks] = allocation.blocks
        if tier_held is not None and not tier_held.all():
            # A window row skips tier blocks outside its window: give those back unwritten, never index them.
            g, j = np.nonzero(~tier_held)
            self._pool.decref(g, table[g, num_hit + j], unique=True)
            table[g, num_hit + j] = -1
        buffer = np.empty(_grow(covered, 64), dtype=np.uint32)
        buffer[:covered] = tokens[:covered]
        req = _Request(
            tokens=buffer, num_tokens=covered, table=table, heads=table[self._row_group] if self._expand else None,
            num_blocks=num_blocks, num_hashed=num_hit,
            last_hash=hashes[(num_hit - 1) * _H: num_hit * _H] if num_hit else None,
            recycled=[recyclable_blocks(w, num_hit * bs, bs).stop for w, _ in self._window_groups],
            cache_salt=cache_salt, lora=lora, mm=list(mm) if mm else None,
            changed=np.arange(num_blocks, dtype=np.int32),
        )
        self._requests[request_id] = req
        self._refresh(req)
        if self._hasher is not None:
            self._register(req, hashes[num_hit * _H: covered // bs * _H])
            self._queries += 1
            self._hit_requests += num_cached > 0
            self._queried_tokens += int(tokens.size)
            self._hit_tokens += num_cached * bs
        view = _view(req)
        if self.tier is not None:
            self.tier.admitted(request_id, view, num_hit, hashes[num_hit * _H: num_cached * _H])
        return Admission(num_cached * bs, view, covered)

    def extend(self, request_id: object, tokens: Tokens, *, num_computed_tokens: int | None = None) -> np.ndarray | None:
        """Append ``tokens`` (a prefill chunk or decoded tokens) and allocate the blocks they need.

        Sliding-window rows first give back blocks no query from
        ``num_computed_tokens`` on can see (default: every token before this
        call, i.e. the previous step finished; pass less under asynchronous
        scheduling so no block a step in flight still reads or writes is
        freed). Newly full blocks enter the prefix index. Returns the table, or
        None, changing nothing, when blocks are short.
        """
        req = self._get(request_id)
        new_tokens = as_token_array(tokens)
        done = req.num_tokens if num_computed_tokens is None else num_computed_tokens
        _check_count(done, "num_computed_tokens", least=0)
        if done > req.num_tokens:
            raise KVCacheError(f"num_computed_tokens: {done} exceeds the request's {req.num_tokens} tokens")
        return self._extend(req, new_tokens, done)

    def _extend(self, req: _Request, new_tokens: np.ndarray, done: int) -> np.ndarray | None:
        """``extend`` after validation: ``new_tokens`` is uint32, ``done`` within the request's tokens."""
        bs = self.block_size
        total = req.num_tokens + int(new_tokens.size)
        num_blocks = -(-total // bs)
        num_new = num_blocks - req.num_blocks
        rows, blocks, stops = self._recyclable(req, done)
        changed = [range(req.num_blocks, num_blocks)]
        if num_new:
            free = self._pool.num_free()
            if (free < num_new).any() and blocks.size:
                returned = self._pool.refcount(rows, blocks) == 1
                free = free + np.bincount(rows[returned], minlength=free.size)
            if (free < num_new).any():
                return None
        if blocks.size:
            self._pool.decref(rows, blocks, unique=True)
            self._recycled += int(self._group_sizes[rows].sum())
            for g, (_, group) in enumerate(self._window_groups):
                changed.append(range(req.recycled[g], stops[g]))
                req.table[group, req.recycled[g]:stops[g]] = -1
                if req.heads is not None:
                    req.heads[self._row_group == group[0], req.recycled[g]:stops[g]] = -1
                req.recycled[g] = max(req.recycled[g], stops[g])
        if num_new:
            allocation = self._pool.allocate(num_new)
            assert allocation is not None, "allocation failed after the free-block check"
            self._forget(allocation.evicted_rows, allocation.evicted_blocks)
            if num_blocks > req.table.shape[1]:
                req.table = _widen(req.table, req.num_blocks, _grow(num_blocks, 4))
                if req.heads is not None:
                    req.heads = _widen(req.heads, req.num_blocks, req.table.shape[1])
            req.table[:, req.num_blocks:num_blocks] = allocation.blocks
            if req.heads is not None:
                req.heads[:, req.num_blocks:num_blocks] = allocation.blocks[self._row_group]
            req.num_blocks = num_blocks
        if total > req.tokens.size:
            grown_tokens = np.empty(_grow(total, 64), dtype=np.uint32)
            grown_tokens[: req.num_tokens] = req.tokens[: req.num_tokens]
            req.tokens = grown_tokens
        req.tokens[req.num_tokens:total] = new_tokens
        req.num_tokens = total
        req.changed = _columns(changed)
        if self._hasher is not None and total // bs > req.num_hashed:
            start = req.num_hashed
            hashes = self._hasher.hash_blocks_packed(
                req.tokens[start * bs: (total // bs) * bs], cache_salt=req.cache_salt, lora=req.lora,
                mm=req.mm, parent=req.last_hash, start_block=start,
            )
            self._register(req, hashes)
        self._refresh(req)
        return _view(req)

    def extend_many(self, request_ids: Sequence[object], tokens: Tokens, counts: Sequence[int] | np.ndarray,
                    *, changes: list[np.ndarray] | None = None) -> list[np.ndarray | None]:
        """``extend`` for many requests at once: request i gets the next ``counts[i]`` of ``tokens``.

        A decode step's shape: most requests gain one token that lands in a block
        they already hold, and those take a fast path with no block, hash or
        table work. Equivalent to calling ``extend`` for each in order (each may
        return None for lack of blocks, changing nothing for that request).
        Unknown ids or bad tokens raise before any request changes. Tables are
        live read-only views, so a request listed twice shows its final table
        in both places. With ``changes`` (a list), each request's changed columns
        are appended to it in order (what ``changed_columns`` gives after each extend).
        """
        flat = as_token_array(tokens)
        counts = np.asarray(counts)
        if counts.ndim != 1 or counts.size != len(request_ids) or (counts.size and counts.dtype.kind not in "iu"):
            raise KVCacheError(f"counts: need one integer per request ({len(request_ids)}), got {counts.shape}")
        if counts.size and int(counts.min()) < 0:
            raise KVCacheError("counts: must not be negative")
        if int(counts.sum()) != flat.size:
            raise KVCacheError(f"counts: sum to {int(counts.sum())} but {flat.size} tokens were given")
        requests = self._requests
        for rid in request_ids:
            if rid not in requests:
                self._get(rid)
        out: list[np.ndarray | None] = []
        offset = 0
        for rid, k in zip(request_ids, counts.tolist()):
            req = requests[rid]
            t = req.num_tokens
            if t < req.next_recycle and t + k <= req.fast_limit:
                if k == 1:
                    req.tokens[t] = flat[offset]
                elif k:
                    req.tokens[t:t + k] = flat[offset:offset + k]
                req.num_tokens = t + k
                req.changed = _NO_COLUMNS
                out.append(req.view if req.view is not None else _view(req))
            else:
                out.append(self._extend(req, flat[offset:offset + k], t))
            if changes is not None:
                changes.append(req.changed if out[-1] is not None else _NO_COLUMNS)
            offset += k
        return out

    def free(self, request_id: object) -> None:
        """End a request: its blocks return to the pool; full ones stay cached for later hits.

        Blocks are released tail first, so a prefix's last blocks are evicted
        before its first ones (which more requests share).
        """
        req = self._get(request_id)
        if self.tier is not None:
            self._release_to_tier(request_id, req)
        del self._requests[request_id]
        self._pool.decref(self._group_col, req.table[:, req.num_blocks - 1::-1], unique=True)

    def discard(self, request_id: object, first_block: int = 0) -> None:
        """End a request whose KV from block ``first_block`` on was never written (a failed transfer).

        As ``free``, but those blocks leave the prefix index first, so no later request hits
        them; blocks before ``first_block`` (a prefix hit, written by others) stay cached.
        """
        req = self._get(request_id)
        _check_count(first_block, "first_block", least=0)
        blocks = req.table[:, first_block:req.num_blocks]
        rows = np.broadcast_to(self._group_col, blocks.shape)
        live = blocks >= 0
        if live.any():
            rows, blocks = rows[live], blocks[live]
            removed = self._index.remove(rows, blocks)
            self._pool.uncache(rows, blocks)
            if self.enable_events and len(removed.gone):
                self._events.append(BlockRemoved(tuple(bytes(h) for h in removed.gone)))
        self.free(request_id)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (live requests keep their blocks); returns the hashes dropped."""
        if self.tier is not None:
            self.tier.evicting(*self._expand_pairs(*self._index.held_pairs()))
            self.tier.reset()
        dropped = self._index.clear()
        self._pool.reset_cached()
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return dropped

    # ------------------------------------------------------------------ lower tier

    def attach_tier(self, tier: LowerTier | None) -> None:
        """Put a cache tier under the GPU blocks (None detaches it); see ``allocator/tiers.py``.

        With a tier, ``admit`` counts the tier's blocks after a GPU hit as cached,
        ``free`` offers released blocks to it, and evictions are reported first.
        """
        if tier is not None and self.tier is not None and tier is not self.tier:
            raise KVCacheError("tier: this manager already has a tier attached; detach it first")
        self.tier = tier

    def lookup_tiers(self, prompt_tokens: Tokens, *, cache_salt: str | None = None, lora: str | None = None,
                     mm: Sequence[MMPlaceholder | tuple[str, int, int]] | None = None) -> tuple[int, int]:
        """(GPU-cached tokens, further tokens the tier holds) that ``admit`` would count now (no state change)."""
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
        if self.enable_events and len(removed.gone):
            self._events.append(BlockRemoved(tuple(bytes(h) for h in removed.gone)))

    def push_events(self, events: Sequence[CacheEvent]) -> None:
        """Queue a tier's events (medium "CPU") behind the manager's own, so subscribers see one ordered stream."""
        if self.enable_events:
            self._events.extend(events)

    def check_integrity(self) -> None:
        """Raise AssertionError with the numbers if pool, index and tables disagree."""
        self._pool.check_integrity()
        self._index.check_integrity()
        refs = np.zeros((len(self._group_col), self.num_blocks), dtype=np.int64)
        for req in self._requests.values():
            t = req.table[:, : req.num_blocks]
            r, c = np.nonzero(t >= 0)
            np.add.at(refs, (r, t[r, c]), 1)
            assert req.num_blocks == -(-req.num_tokens // self.block_size), "table length disagrees with tokens"
            if req.heads is not None:
                assert (req.heads[:, : req.num_blocks] == t[self._row_group]).all(), "rows disagree with their group"
        actual = self._pool.refcount(self._group_col, np.arange(self.num_blocks)[None, :])
        bad = np.argwhere(refs != actual)
        assert bad.size == 0, (
            f"(row {bad[0][0]}, block {bad[0][1]}) is in {refs[tuple(bad[0])]} live tables "
            f"but has refcount {actual[tuple(bad[0])]}" if bad.size else ""
        )
        rows, blocks = self._index.held_pairs()
        cached = self._pool.is_cached(self._group_col, np.arange(self.num_blocks)[None, :])
        held = np.zeros_like(cached)
        held[rows, blocks] = True
        assert (cached == held).all(), f"{int((cached != held).sum())} pairs cached in the pool but not the index"

    # ------------------------------------------------------------------ internals

    def _get(self, request_id: object) -> _Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise KVCacheError(f"request_id: {request_id!r} is not admitted") from None

    def _match(self, hashes: bytes) -> tuple[int, np.ndarray | None]:
        """Longest usable cached prefix in blocks, and its blocks ``[num_rows, L]`` (-1 where not needed).

        Full rows need every block of the prefix; a Window row needs only its
        sink blocks and the blocks the next query (at ``L * block_size``) sees.
        """
        found = self._index.match(hashes)  # [k, rows]
        k = found.shape[0]
        if k == 0:
            return 0, None
        present = found >= 0
        if not self._window_groups:  # all rows Full: the hit is the leading run every row holds
            complete = present.all(axis=1)
            num_hit = k if complete.all() else int(np.argmin(complete))
            return (num_hit, found[:num_hit].T.copy()) if num_hit else (0, None)
        usable = np.ones(k + 1, dtype=bool)  # usable[L] for L = 0..k
        if self._full_rows.size:
            complete = present[:, self._full_rows].all(axis=1)
            first_gap = int(np.argmin(complete)) if not complete.all() else k
            usable[first_gap + 1:] = False
        bs = self.block_size
        lengths = np.arange(k + 1)
        windows = []
        for policy, group in self._window_groups:
            missing = np.concatenate([[0], np.cumsum(~present[:, group].all(axis=1))])
            sink_stop = np.minimum(-(-np.minimum(policy.sink_tokens, lengths * bs) // bs), lengths)
            first_seen = np.minimum(np.maximum(0, lengths * bs - policy.window_tokens + 1) // bs, lengths)
            usable &= (missing[sink_stop] == 0) & (missing[lengths] - missing[first_seen] == 0)
            windows.append((group, sink_stop, first_seen))
        num_hit = int(np.flatnonzero(usable)[-1])
        if num_hit == 0:
            return 0, None
        blocks = found[:num_hit].T.copy()
        for group, sink_stop, first_seen in windows:
            keep = np.zeros(num_hit, dtype=bool)
            keep[: sink_stop[num_hit]] = True
            keep[first_seen[num_hit]:] = True
            blocks[np.ix_(group, np.flatnonzero(~keep))] = -1
        return num_hit, blocks

    def _match_tier(self, hashes: bytes, start: int, limit: int) -> tuple[int, np.ndarray | None]:
        """Blocks after a GPU hit of ``start`` blocks that the tier supplies, and which groups it holds them for.

        Returns (n, bool ``[groups, n]``), or (0, None); hashes are the prompt's, ``limit`` the most blocks a hit may take.
        """
        assert self.tier is not None
        if limit <= start:
            return 0, None
        held = np.asarray(self.tier.held(hashes[start * _H: limit * _H]), dtype=bool)
        if held.shape[0] == 0:
            return 0, None
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
        n = req.num_hashed
        hashes = b""
        blocks = np.empty((self.num_rows, 0), dtype=np.int32)
        if n and self._hasher is not None:
            bs = self.block_size
            hashes = self._hasher.hash_blocks_packed(req.tokens[: n * bs], cache_salt=req.cache_salt, lora=req.lora,
                                                     mm=req.mm)
            table = req.table[:, :n]
            last = self._pool.refcount(self._group_col, table) == 1
            holds = (self._index.blocks_of(hashes).T == table) & (table >= 0)
            blocks = np.where(last & holds, table, -1)[self._row_group]
        self.tier.released(request_id, hashes, blocks, req.tokens[: n * self.block_size].copy(), req.lora)

    def _expand_pairs(self, groups: np.ndarray, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(group, block) pairs as the (row, block) pairs they stand for."""
        groups = np.asarray(groups, dtype=np.intp)
        blocks = np.asarray(blocks, dtype=np.intp)
        if not self._expand:
            return groups, blocks
        i, r = np.nonzero(self._row_group[None, :] == groups[:, None])
        return r, blocks[i]

    def _recyclable(self, req: _Request, done: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """(rows, blocks) the window rows may give back before queries from ``done``, tail first."""
        stops: list[int] = []
        rows_parts, block_parts = [], []
        for g, (policy, group) in enumerate(self._window_groups):
            stop = min(recyclable_blocks(policy, done, self.block_size).stop, req.num_blocks)
            stops.append(stop)
            start = max(req.recycled[g], -(-policy.sink_tokens // self.block_size))
            if stop <= start:
                continue
            part = req.table[group, start:stop][:, ::-1]
            rows_parts.append(np.broadcast_to(group[:, None], part.shape).ravel())
            block_parts.append(part.ravel())
        if not rows_parts:
            return _EMPTY, _EMPTY, stops
        rows, blocks = np.concatenate(rows_parts), np.concatenate(block_parts)
        live = blocks >= 0
        return rows[live], blocks[live], stops

    def _register(self, req: _Request, hashes: bytes) -> None:
        """Enter the request's newly full blocks (packed ``hashes``, from block ``num_hashed`` on) in the index."""
        if not hashes:
            return
        start = req.num_hashed
        stop = start + len(hashes) // _H
        blocks = req.table[:, start:stop].T
        inserted = self._index.insert(hashes, blocks)
        if inserted.added.any():
            i, r = np.nonzero(inserted.added)
            self._pool.mark_cached(r, blocks[i, r])
        if self.enable_events and inserted.new.any():
            self._store_events(req, hashes, start, inserted)
        req.num_hashed = stop
        req.last_hash = hashes[-_H:]

    def _forget(self, rows: np.ndarray, blocks: np.ndarray) -> None:
        """Drop evicted (row, block) pairs from the index and report the hashes that left it."""
        if rows.size == 0:
            return
        self._evicted += int(self._group_sizes[rows].sum())
        if self.tier is not None:
            self.tier.evicting(*self._expand_pairs(rows, blocks))
        removed = self._index.remove(rows, blocks)
        if self.enable_events and len(removed.gone):
            self._events.append(BlockRemoved(tuple(bytes(h) for h in removed.gone)))

    def _store_events(self, req: _Request, packed: bytes, start: int, inserted: Inserted) -> None:
        """One BlockStored per run of consecutive hashes new to the index and stored on the same rows."""
        bs = self.block_size
        hashes = [packed[i: i + _H] for i in range(0, len(packed), _H)]
        keys = [bytes(p) if new else None for p, new in
                zip(np.packbits(inserted.added, axis=1, bitorder="little"), inserted.new.tolist())]
        run_start = 0
        for i in range(1, len(keys) + 1):
            if i < len(keys) and keys[i] == keys[run_start]:
                continue
            if keys[run_start] is not None:
                first = start + run_start
                self._events.append(BlockStored(
                    block_hashes=tuple(hashes[run_start:i]),
                    parent_block_hash=hashes[run_start - 1] if run_start else req.last_hash,
                    token_ids=req.tokens[first * bs: (start + i) * bs].copy(),
                    block_size=bs,
                    rows=self._rows_of(np.flatnonzero(inserted.added[run_start])),
                    lora=req.lora,
                ))
            run_start = i

    def _refresh(self, req: _Request) -> None:
        """After a table change: drop the cached view and recompute the fast-path limits."""
        bs = self.block_size
        req.view = None
        limit = min(req.num_blocks * bs, req.tokens.size)
        if self._hasher is not None:
            limit = min(limit, (req.num_hashed + 1) * bs - 1)
        req.fast_limit = limit
        req.next_recycle = min(
            ((req.recycled[g] + 1) * bs + policy.window_tokens - 1 for g, (policy, _) in
             enumerate(self._window_groups)),
            default=float("inf"),
        )

    def _rows_of(self, groups: np.ndarray) -> tuple[int, ...]:
        """The rows (heads) that the given groups stand for, ascending."""
        return tuple(np.flatnonzero(np.isin(self._row_group, groups)).tolist())


_EMPTY = np.empty(0, dtype=np.intp)
_NO_COLUMNS = np.empty(0, dtype=np.int32)
_H = HASH_BYTES


def _view(req: _Request) -> np.ndarray:
    """The request's table as a read-only view (cached until the table changes)."""
    view = (req.table if req.heads is None else req.heads)[:, : req.num_blocks]
    view.flags.writeable = False
    req.view = view
    return view


def _columns(ranges: list[range]) -> np.ndarray:
    """The union of column ranges as an ascending int32 array."""
    parts = [np.arange(r.start, r.stop, dtype=np.int32) for r in ranges if r.stop > r.start]
    if not parts:
        return np.empty(0, dtype=np.int32)
    return parts[0] if len(parts) == 1 else np.unique(np.concatenate(parts))


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

"""KVCacheManager: the scheduler's API over block pool, sliding-window policy and prefix index.

A scheduler calls ``admit`` once per request, ``extend`` each step the request
grows (next prefill chunk, decoded tokens), and ``free`` when it ends. Every
call that would need more blocks than are free returns None and changes
nothing. Tables are int32 ``[num_rows, num_blocks]``; ``-1`` marks a slot a
sliding-window row no longer holds.

A decode step (``extend_many``, one token per request) is the hot path. Each
request's hot fields live in slot-indexed arrays, so the step touches a
request in one of three ways (block_size 4, prefix caching on)::

    tokens   | t0 t1 t2 t3 | t4 t5 .  .  |
    fast     |             | t4 t5 +1    |  inside the last block: one C pass over all of them
    fill     |             | t4 t5 t6 +1 |  fills it: hashed and indexed with the step's other fills
    open     | t0 t1 t2 t3 | +1          |  a new block: one pool allocation for the step's opens

Anything else (recycling a window, several tokens, extra hash keys) runs
``extend`` one request at a time, in order between the batched runs.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple, Sequence, Union

import numpy as np

from kvcache.allocator import _tables
from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent
from kvcache.allocator.pool import Allocation, BlockPool, Usage, usage
from kvcache.allocator.prefix import (
    _PACKED,
    HASH_BYTES,
    BlockHasher,
    Inserted,
    LoRA,
    MMPlaceholder,
    PrefixIndex,
    as_token_array,
    check_lora,
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
        self._group_rows = np.arange(len(groups), dtype=np.int64)  # the same, flat: what the pool's C passes take
        self._full_rows = np.array([g for g, p in enumerate(groups) if isinstance(p, Full)], dtype=np.intp)
        self._group_windows = [p.window_tokens if isinstance(p, Window) else None for p in groups]  # for events
        self._window_groups: list[tuple[Window, np.ndarray]] = [
            (p, np.array([g], dtype=np.intp)) for g, p in enumerate(groups) if isinstance(p, Window)
        ]
        self._requests: dict[object, _Request] = {}
        self._init_slots()
        self._events: list[CacheEvent] = []
        self._group_sizes = np.bincount(self._row_group)
        self._queries = self._hit_requests = self._queried_tokens = self._hit_tokens = 0
        self._evicted = self._recycled = 0
        self.tier: LowerTier | None = None  # a cache tier under the GPU blocks (attach_tier)
        # With a tier: each request's tokens since admit, by slot (the tier keys and announces what it
        # takes by them; without a tier only the partial last block's tokens are kept).
        self._tier_tokens: dict[int, list[np.ndarray]] = {}

    def __getstate__(self) -> dict:
        """The state a journal snapshot saves: everything but the attached tier (memory and threads, not state)
        and the events not yet taken (they were published)."""
        state = self.__dict__.copy()
        state["tier"] = None
        state["_tier_tokens"] = {}
        state["_events"] = []
        return state

    def __setstate__(self, state: dict) -> None:
        """Restore a journal snapshot's state; cached table views would be copies now, so drop them."""
        self.__dict__.update(state)
        for req in self._requests.values():
            req.view = None

    @property
    def row_groups(self) -> np.ndarray:
        """Each row's group (intp ``[num_rows]``): rows with equal policies form one, numbered in order of first
        appearance; KV events name groups (vLLM's ``group_idx``)."""
        return self._row_group

    @property
    def group_windows(self) -> list[int | None]:
        """Each group's sliding window in tokens, None for a full-attention group."""
        return list(self._group_windows)

    @property
    def hasher(self) -> BlockHasher | None:
        """The prefix hasher (its algorithm and root), or None with prefix caching off."""
        return self._hasher

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

    def lookup(self, prompt_tokens: Tokens, *, cache_salt: str | None = None, lora: LoRA | None = None,
               mm: Sequence[MMPlaceholder | tuple[str, int, int]] | None = None) -> int:
        """Tokens of ``prompt_tokens`` that ``admit`` would find cached now (no state change)."""
        return sum(self.lookup_tiers(prompt_tokens, cache_salt=cache_salt, lora=lora, mm=mm))

    def table(self, request_id: object) -> np.ndarray:
        """The request's block table, int32 ``[num_rows, num_blocks]`` (a read-only view)."""
        req = self._get(request_id)
        return _view(req)

    def changed_columns(self, request_id: object) -> np.ndarray:
        """Columns (int32, ascending) the request's last admit or extend set: all of them after admit.

        What a daemon sends workers as the table's delta instead of the whole table.
        """
        return self._changed_of(self._get(request_id))

    def num_tokens(self, request_id: object) -> int:
        """Tokens the request's table covers."""
        return int(self._ntok[self._get(request_id).slot])

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def stats(self) -> ManagerStats:
        return ManagerStats(
            len(self._requests), len(self._index), self._pool.min_free(),
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
        lora: LoRA | None = None,
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
        lora = check_lora(lora)
        tokens = as_token_array(prompt_tokens)
        if tokens.size == 0:
            raise KVCacheError("prompt_tokens: must hold at least one token")
        if num_tokens is None:
            num_tokens = int(tokens.size)
        else:
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
            if tokens.size > bs:  # else no block before the last token: nothing to find
                num_hit, hit = self._match(hashes[: (tokens.size - 1) // bs * _H])
            if self.tier is not None:
                num_tier, tier_held = self._match_tier(hashes, num_hit, (tokens.size - 1) // bs)
        num_cached = num_hit + num_tier
        covered = min(int(tokens.size), max(num_tokens, num_cached * bs + 1))
        num_blocks = -(-covered // bs)
        num_new = num_blocks - num_hit
        if self._admits_in_one_pass():
            admission = self._admit_commit(request_id, tokens, hashes, num_hit, hit, covered, num_blocks, cache_salt,
                                           lora, mm)
            if admission is not False:
                return admission
        if hit is None:
            if self._pool.min_free() < num_new:
                return None
        else:
            revived = (self._pool.refcount(self._group_col, hit) == 0) & (hit >= 0)
            if (self._pool.num_free() - revived.sum(axis=1) < num_new).any():
                return None
        if hit is not None:
            self._pool.incref(self._group_col, hit, unique=True)
        allocation = self._pool.allocate(num_new, ascending=True)  # a prompt's blocks side by side: longer copies
        assert allocation is not None, "allocation failed after the free-block check"
        self._forget(allocation.evicted_rows, allocation.evicted_blocks)
        capacity = _grow(num_blocks + 1, 4)  # room for the block its first extend opens (a power-of-two prompt's)
        table = np.full((len(self._group_col), capacity), -1, dtype=np.int32)
        if hit is not None:
            table[:, :num_hit] = hit
        table[:, num_hit:num_blocks] = allocation.blocks
        if tier_held is not None and not tier_held.all():
            # A window row skips tier blocks outside its window: give those back unwritten, never index them.
            g, j = np.nonzero(~tier_held)
            self._pool.decref(g, table[g, num_hit + j], unique=True)
            table[g, num_hit + j] = -1
        slot = self._take_slot()
        req = self._record(request_id, slot, table, num_blocks, self._recycled_after(num_hit), cache_salt, lora, mm)
        self._ntok[slot] = covered
        self._changed_ok[slot] = True
        self._last_block[slot] = table[:, num_blocks - 1]
        partial = covered % bs
        self._tail[slot, :partial] = tokens[covered - partial:covered]
        if self._hasher is not None:
            self._last_hash[slot] = np.frombuffer(hashes[(num_hit - 1) * _H: num_hit * _H] if num_hit
                                                  else self._hasher.root, dtype=np.uint8)
            self._register(req, num_hit, hashes[num_hit * _H: covered // bs * _H], tokens[num_hit * bs:])
            self._count_query(int(tokens.size), num_cached)
        self._refresh(req)
        view = _view(req)
        if self.tier is not None:
            self._tier_tokens[slot] = [tokens[:covered].copy()]
            self.tier.admitted(request_id, view, num_hit, hashes[num_hit * _H: num_cached * _H])
        return Admission(num_cached * bs, view, covered)

    def _admits_in_one_pass(self) -> bool:
        """Whether an admit's commit is ``_tables.admit_commit``'s: prefix caching, no tier to serve, and with KV
        events one group without window rows (whose stores are one event per admit)."""
        return self._hasher is not None and self.tier is None and (
            not self.enable_events or (len(self._group_col) == 1 and not self._window_groups))

    def _admit_commit(self, request_id: object, tokens: np.ndarray, hashes: bytes, num_hit: int,
                      hit: np.ndarray | None, covered: int, num_blocks: int, cache_salt: str | None, lora: LoRA | None,
                      mm: Sequence[MMPlaceholder | tuple[str, int, int]] | None) -> Admission | None | bool:
        """``admit``'s commit once its hit is known, in one C pass: the Admission, None (no room), or False where
        a new block's hash is indexed already (the general path merges it); None and False change nothing."""
        bs = self.block_size
        full = covered // bs
        groups = len(self._group_col)
        pool, index = self._pool, self._index
        index.reserve(full, groups * num_blocks)
        slot = self._next_slot()
        # Room for the block its first extend opens.
        table = np.empty((groups, _grow(num_blocks + 1, 4)), dtype=np.int32)
        recycled = self._recycled_after(num_hit)
        evicted = np.zeros(groups, dtype=np.intp)
        removed = bytearray(groups * num_blocks * _H) if self.enable_events else None  # the hashes evictions drop
        done = _tables.admit_commit(
            *pool._c_arrays(), *index._c_arrays(), index._num_entries, hashes[: full * _H],
            _NO_HIT if hit is None else hit, tokens, covered, table, slot, self._ntok, self._changed_ok,
            self._last_block, self._tail, self._last_hash, self._fast_limit, self._next_recycle, self._width,
            self._hasher.root, self._recycle_at(recycled), evicted, removed)
        if not done:
            return done
        index._num_spare, index._num_entries, added, dropped = done
        index._count += added
        if removed is not None:  # as the general path reports them: its evictions' drops, then one store
            if dropped:
                self._events.append(BlockRemoved(tuple(bytes(removed[i * _H:(i + 1) * _H]) for i in range(dropped))))
            if full > num_hit:
                self._events.append(self._stored(
                    0, hashes[num_hit * _H:full * _H], hashes[(num_hit - 1) * _H:num_hit * _H] if num_hit else None,
                    tokens[num_hit * bs:full * bs], lora, self._extra_keys(cache_salt, lora, mm, num_hit, full)))
        per_group = evicted.tolist()
        if any(per_group):  # (row, block) pairs: a group's eviction counts once per row it stands for
            self._evicted += sum(e * size for e, size in zip(per_group, self._group_sizes.tolist()))
        req = self._record(request_id, self._take_slot(), table, num_blocks, recycled, cache_salt, lora, mm)
        self._count_query(int(tokens.size), num_hit)
        return Admission(num_hit * bs, _view(req), covered)

    def _record(self, request_id: object, slot: int, table: np.ndarray, num_blocks: int, recycled: list[int],
                cache_salt: str | None, lora: LoRA | None, mm: Sequence[MMPlaceholder | tuple[str, int, int]] | None
                ) -> _Request:
        """An admitted request's record, filed under its id and ``slot``, with the slot's hashing flags."""
        req = _Request(slot=slot, table=table, heads=table[self._row_group] if self._expand else None,
                       num_blocks=num_blocks, recycled=recycled, cache_salt=cache_salt, lora=lora,
                       mm=list(mm) if mm else None, changed=range(0, num_blocks))
        self._requests[request_id] = req
        self._slot_of[request_id] = slot
        self._by_slot[slot] = req
        self._keyed[slot] = lora is not None or bool(mm)
        self._salted[slot] = bool(cache_salt)
        return req

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
        num_tokens = int(self._ntok[req.slot])
        done = num_tokens if num_computed_tokens is None else num_computed_tokens
        _check_count(done, "num_computed_tokens", least=0)
        if done > num_tokens:
            raise KVCacheError(f"num_computed_tokens: {done} exceeds the request's {num_tokens} tokens")
        table = self._extend(req, new_tokens, done)
        if table is not None and self.tier is not None and req.slot in self._tier_tokens:
            self._tier_tokens[req.slot].append(new_tokens.copy())
        return table

    def _extend(self, req: _Request, new_tokens: np.ndarray, done: int) -> np.ndarray | None:
        """``extend`` after validation: ``new_tokens`` is uint32, ``done`` within the request's tokens."""
        bs = self.block_size
        slot = req.slot
        num_tokens = int(self._ntok[slot])
        total = num_tokens + int(new_tokens.size)
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
            changed += self._mark_recycled(req, stops)
        if num_new:
            allocation = self._pool.allocate(num_new)
            assert allocation is not None, "allocation failed after the free-block check"
            self._forget(allocation.evicted_rows, allocation.evicted_blocks)
            self._place(req, allocation.blocks, num_blocks)
        # The tokens from the partial block's start on: [num_tokens - partial, total).
        partial = num_tokens % bs
        pending = np.concatenate([self._tail[slot, :partial], new_tokens]) if partial else new_tokens
        self._ntok[slot] = total
        req.changed = _columns(changed)
        self._changed_ok[slot] = True
        start = num_tokens // bs  # every full block is hashed as it fills: the first unhashed one
        if self._hasher is not None and total // bs > start:
            hashes = self._hasher.hash_blocks_packed(
                pending[: (total // bs - start) * bs], cache_salt=req.cache_salt, lora=req.lora,
                mm=req.mm, parent=self._last_hash[slot].tobytes() if start else None, start_block=start,
            )
            self._register(req, start, hashes, pending)
        rest = total % bs
        self._tail[slot, :rest] = pending[pending.size - rest:]
        self._refresh(req)
        return _view(req)

    def _place(self, req: _Request, blocks: np.ndarray, num_blocks: int) -> None:
        """Write newly allocated ``blocks`` (int32 ``[num_groups, k]``) after the table's last column."""
        if num_blocks > req.table.shape[1]:
            req.table = _widen(req.table, req.num_blocks, _grow(num_blocks, 4))
            if req.heads is not None:
                req.heads = _widen(req.heads, req.num_blocks, req.table.shape[1])
        req.table[:, req.num_blocks:num_blocks] = blocks
        if req.heads is not None:
            req.heads[:, req.num_blocks:num_blocks] = blocks[self._row_group]
        req.num_blocks = num_blocks
        self._last_block[req.slot] = blocks[:, -1]

    def extend_many(self, request_ids: Sequence[object], tokens: Tokens, counts: Sequence[int] | np.ndarray,
                    *, changes: list[np.ndarray] | None = None) -> list[np.ndarray | None]:
        """``extend`` for many requests at once: request i gets the next ``counts[i]`` of ``tokens``.

        A decode step's shape: most requests gain one token that lands in a block
        they already hold, and those take a vectorised fast path with no block,
        hash or table work. Equivalent to calling ``extend`` for each in order
        (each may return None for lack of blocks, changing nothing for that
        request). Unknown ids or bad tokens raise before any request changes.
        Tables are live read-only views, so a request listed twice shows its
        final table in both places. With ``changes`` (a list), each request's
        changed columns are appended to it in order (what ``changed_columns``
        gives after each extend).
        """
        deltas = self._extend_decode(request_ids, tokens, counts)
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
        ok, changed, widths = self._extend_slots(slots, flat, counts, views)
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
                           counts: Sequence[int] | np.ndarray, *, slots: np.ndarray | None = None) -> TableDeltas:
        """``extend_many``, answering with array deltas instead of a table per request (what the daemon sends).

        No Python object per request on the way out: a decode step changes
        one table in ``block_size``, and only those are listed. ``slots`` is what
        ``slots_of`` gave for these ids, if nothing was admitted or freed since:
        the ids are not looked up again.
        """
        deltas = self._extend_decode(request_ids, tokens, counts, slots)
        if deltas is not None:
            return deltas
        slots, flat, counts = self._check_many(request_ids, tokens, counts)
        ok, changed, widths = self._extend_slots(slots, flat, counts, None)
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

    def _decodes_in_one_pass(self) -> int | None:
        """``_tables.extend_decode``'s hashing argument (-1 none, 0 sha256, 1 sha256_cbor) where it can take a batch
        of extends: one group, no window or expanded rows, no tier, a native hasher; else None."""
        if len(self._group_col) != 1 or self._window_groups or self._expand or self.tier is not None:
            return None
        if self._hasher is None:
            return -1
        return (self._hasher.algorithm != "sha256") if self._hasher.native else None

    def slots_of(self, request_ids: list[object], exclude: dict | None = None) -> np.ndarray | None:
        """Each id's row in the per-request arrays (intp), in one C pass; None if one is not admitted, not an int
        or str, or a key of ``exclude``. What ``extend_many_deltas`` takes as ``slots`` (a daemon checks a step's
        ids with it before applying anything)."""
        found = np.empty(len(request_ids), dtype=np.intp)
        return found if _tables.lookup_ids(self._slot_of, request_ids, found, exclude) < 0 else None

    def _extend_decode(self, request_ids: Sequence[object], tokens: Tokens, counts: Sequence[int] | np.ndarray,
                       slots: np.ndarray | None = None) -> TableDeltas | None:
        """``extend_many_deltas`` in one C pass (a decode step on a one-row manager), or None, changing nothing,
        where ``_tables.extend_decode`` leaves the batch to the general path (which also names any bad input)."""
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
        n = counts.size
        pool, prefix = self._pool, self._index
        prefix.reserve(n, n)
        lens = np.empty(n, dtype=np.int32)
        done = _tables.extend_decode(self._slot_of if slots is None else slots, request_ids, flat, counts,
                                     self._by_slot, hashing, self._ntok, self._fast_limit, self._next_recycle,
                                     self._tail, self._changed_ok, self._stamp, self._keyed, self._salted,
                                     self._last_hash, self._last_block, self._width, lens,
                                     *pool._c_arrays(), *prefix._c_arrays(), prefix._num_entries, self.enable_events)
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
                      views: list[np.ndarray | None] | None) -> tuple[np.ndarray, list[_Chunk], np.ndarray | None]:
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
        twice sends the whole batch one at a time.
        """
        n = slots.size
        ok = np.ones(n, dtype=bool)
        if n == 0:
            return ok, [], None
        found = _tables.extend_fast(slots, counts, flat, self._ntok, self._fast_limit, self._next_recycle, self._tail,
                                    self._changed_ok, self._stamp, self._keyed, self._salted, self._hasher is not None)
        if found is None:
            widths = np.zeros(n, dtype=np.int32)
            return ok, self._extend_in_order(slots, flat, counts, ok, widths, views), widths
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
                    self._extend_run(slow[start:j], slots, flat, counts, offsets, t, ok, changed)
                if j < slow.size:
                    self._extend_each(slow[j:j + 1], slots, flat, counts, offsets, t, ok, changed)
                start = j + 1
        return ok, changed, None

    def _extend_each(self, index: np.ndarray, slots: np.ndarray, flat: np.ndarray, counts: np.ndarray,
                     offsets: np.ndarray, t: np.ndarray, ok: np.ndarray, changed: list[_Chunk]) -> None:
        """``_extend`` of requests ``index`` (no slot repeated) one by one, in order."""
        by_slot = self._by_slot
        for i in index.tolist():
            req = by_slot[slots[i]]
            o = int(offsets[i])
            if self._extend(req, flat[o:o + int(counts[i])], int(t[i])) is None:
                ok[i] = False
            elif len(req.changed):
                cols = self._changed_of(req)
                changed.append(_Chunk(np.array([i]), np.array([cols.size]), cols, None))

    def _extend_run(self, index: np.ndarray, slots: np.ndarray, flat: np.ndarray, counts: np.ndarray,
                    offsets: np.ndarray, t: np.ndarray, ok: np.ndarray, changed: list[_Chunk]) -> None:
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
        """
        if not (self._window_groups or self._expand or self.enable_events):
            self._extend_plain_run(index, slots, flat, counts, offsets, t, ok, changed)
            return
        bs = self.block_size
        s = slots[index]
        tt = t[index]
        tok = flat[offsets[index]]
        width = self._width[s]
        pos = tt % bs
        need = pos == 0  # at a block boundary: opens a block (a request holds >= 1 token)
        num_need = int(np.count_nonzero(need))
        pool = self._pool
        if num_need and pool.min_free() < num_need:
            self._extend_each(index, slots, flat, counts, offsets, t, ok, changed)
            return
        by_slot = self._by_slot
        recycle = np.flatnonzero(tt >= self._next_recycle[s])  # only with hashing: see extend_fast's plain
        if recycle.size:
            returns = [self._recyclable(by_slot[x], d) for x, d in zip(s[recycle].tolist(), tt[recycle].tolist())]
            rec_rows = np.concatenate([r for r, _, _ in returns])
            rec_blocks = np.concatenate([b for _, b, _ in returns])
            if rec_rows.size and not pool.is_cached(rec_rows, rec_blocks).all():
                self._extend_each(index, slots, flat, counts, offsets, t, ok, changed)
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
                    self._extend_each(index, slots, flat, counts, offsets, t, ok, changed)
                    return
        # Commit: nothing below can fail.
        self._tail[s, pos] = tok
        self._ntok[s] = tt + 1
        self._changed_ok[s] = need
        recycled: dict[int, list[range]] = {}  # position in the run -> window columns it emptied
        tagged: list[tuple[int, int, CacheEvent]] = []  # events with their request's position in the run
        if recycle.size:
            if rec_rows.size:  # in request order, tail first: the LRU order of one by one
                pool.decref(rec_rows, rec_blocks)
                self._recycled += int(self._group_sizes[rec_rows].sum())
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
            if not recycled:
                changed.append(_Chunk(index[need], np.ones(num_need, dtype=np.int32), width[need], heads))
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
        # _refresh's limits: an opened block takes bs tokens (with hashing bs - 1: its last one fills
        # it), a filled one none (the next extend opens a block).
        if self._hasher is None:
            self._fast_limit[s] = tt + bs
        else:
            self._fast_limit[s] = np.where(fills, tt + 1, tt + bs - 1)
        for j in recycled:
            self._refresh(by_slot[s[j]])  # the next recycling point moved on

    def _extend_plain_run(self, index: np.ndarray, slots: np.ndarray, flat: np.ndarray, counts: np.ndarray,
                          offsets: np.ndarray, t: np.ndarray, ok: np.ndarray, changed: list[_Chunk]) -> None:
        """``_extend_run`` where no row has a window, rows are groups and events are off: C passes.

        ``_tables.run_prepare`` gathers the run (who opens a block, who fills
        one, and the filled blocks' tokens); the hasher runs here; then
        ``_tables.run_take`` checks the filled blocks' hashes, allocates and
        drops the evicted blocks from the index; ``_tables.run_commit`` writes
        every slot array, table column and request record, as the general path
        does; ``_tables.insert_cached`` indexes the filled blocks. With a tier
        (it hears of evictions) the pool and index calls stay in Python.
        """
        bs, m, groups = self.block_size, index.size, len(self._group_col)
        hashing = self._hasher is not None
        s, tt, tok = np.empty(m, dtype=np.intp), np.empty(m, dtype=np.int64), np.empty(m, dtype=np.uint32)
        need, fill = np.empty(m, dtype=np.intp), np.empty(m, dtype=np.intp)
        blocks_tok = np.empty((m if hashing else 0, bs), dtype=np.uint32)
        parents = np.empty((m if hashing else 0, _H), dtype=np.uint8)
        num_need, num_fill = _tables.run_prepare(index, slots, flat, offsets, t, self._tail, self._last_hash, s, tt,
                                                 tok, need, fill, blocks_tok, parents, hashing)
        pool = self._pool
        if num_need and pool.min_free() < num_need:
            self._extend_each(index, slots, flat, counts, offsets, t, ok, changed)
            return
        hashes = b""
        if num_fill:
            hashes = self._hasher.hash_each(blocks_tok[:num_fill], parents[:num_fill].tobytes())
        if self.tier is None:  # the fill check, allocation and its evictions' index drops in one C pass
            new_blocks = np.empty((groups, num_need), dtype=np.int32)
            prefix = self._index
            prefix.reserve(0, num_need)
            done = _tables.run_take(*pool._c_arrays(), *prefix._c_arrays(), hashes, new_blocks)
            if not done:  # a fill's hash repeats or is indexed (None, no room, is ruled out above)
                self._extend_each(index, slots, flat, counts, offsets, t, ok, changed)
                return
            evicted, prefix._num_spare, gone = done
            prefix._count -= gone
            self._evicted += evicted
        else:
            if num_fill and not self._fills_new(hashes, num_fill):
                self._extend_each(index, slots, flat, counts, offsets, t, ok, changed)
                return
            # Commit: nothing below can fail.
            if num_need:
                allocation = pool.allocate(num_need)
                assert allocation is not None, "allocation failed after the free-block check"
                self._forget(allocation.evicted_rows, allocation.evicted_blocks)
                new_blocks = np.ascontiguousarray(allocation.blocks, dtype=np.int32)  # [groups, num_need], in order
            else:
                new_blocks = np.empty((groups, 0), dtype=np.int32)
        need = need[:num_need]
        cols = np.empty(num_need, dtype=np.int32)
        filled = np.empty((num_fill, groups), dtype=np.int32)
        by_slot = self._by_slot
        for q in _tables.run_commit(s, tt, tok, need, fill[:num_fill], new_blocks, by_slot, self._tail, self._ntok,
                                    self._changed_ok, self._last_block, self._width, self._fast_limit,
                                    self._last_hash, hashes, cols, filled, hashing):
            _put_column(by_slot[s[need[q]]], int(cols[q]), new_blocks[:, q])
        if num_need:
            changed.append(_Chunk(index[need], np.ones(num_need, dtype=np.int32), cols, new_blocks))
        if num_fill and self.tier is None:  # the new hashes' insert and cached flags in one C pass
            prefix.reserve(num_fill, 0)
            prefix._num_spare, prefix._num_entries, added = _tables.insert_cached(
                *pool._c_arrays(), *prefix._c_arrays(), prefix._num_entries, hashes, filled)
            prefix._count += added
        elif num_fill:
            self._index.insert_new(hashes, filled)
            pool.mark_cached_columns(filled)

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

    def _mark_recycled(self, req: _Request, stops: list[int]) -> list[range]:
        """Empty (-1) each window group's columns up to ``stops[g]`` whose blocks went back; returns those columns."""
        emptied = []
        for g, (_, group) in enumerate(self._window_groups):
            emptied.append(range(req.recycled[g], stops[g]))
            req.table[group, req.recycled[g]:stops[g]] = -1
            if req.heads is not None:
                req.heads[self._row_group == group[0], req.recycled[g]:stops[g]] = -1
            req.recycled[g] = max(req.recycled[g], stops[g])
        return emptied

    def _extend_in_order(self, slots: np.ndarray, flat: np.ndarray, counts: np.ndarray, ok: np.ndarray,
                         widths: np.ndarray, views: list[np.ndarray | None] | None) -> list[_Chunk]:
        """``_extend_slots`` one request at a time (a slot is listed more than once)."""
        bs = self.block_size
        by_slot = self._by_slot
        changed: list[_Chunk] = []
        offset = 0
        for i, (s, k) in enumerate(zip(slots.tolist(), counts.tolist())):
            req = by_slot[s]
            t = int(self._ntok[s])
            if t < self._next_recycle[s] and t + k <= self._fast_limit[s]:
                p = t % bs
                self._tail[s, p:p + k] = flat[offset:offset + k]
                self._ntok[s] = t + k
                self._changed_ok[s] = False
            elif self._extend(req, flat[offset:offset + k], t) is None:
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

    def _changed_of(self, req: _Request) -> np.ndarray:
        """``changed_columns`` of a request record."""
        if not self._changed_ok[req.slot]:
            return _NO_COLUMNS
        if req.changed is None:
            return np.array([req.num_blocks - 1], dtype=np.int32)
        if isinstance(req.changed, range):
            return np.arange(req.changed.start, req.changed.stop, dtype=np.int32)
        return req.changed

    def _take_slot(self) -> int:
        """A free row of the per-request arrays, growing them by doubling."""
        slot = self._next_slot()
        if self._free_slots:
            self._free_slots.pop()
        else:
            self._by_slot.append(None)
        return slot

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

    def free(self, request_id: object) -> None:
        """End a request: its blocks return to the pool; full ones stay cached for later hits.

        Blocks are released tail first, so a prefix's last blocks are evicted
        before its first ones (which more requests share).
        """
        req = self._get(request_id)
        if self.tier is not None:
            self._release_to_tier(request_id, req)
        self._tier_tokens.pop(req.slot, None)
        del self._requests[request_id]
        del self._slot_of[request_id]
        self._by_slot[req.slot] = None
        self._free_slots.append(req.slot)
        self._pool.release_table(self._group_rows, np.ascontiguousarray(req.table[:, req.num_blocks - 1::-1]))

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
            if self.enable_events:
                self._events += self._removed(removed.rows, removed.hashes)
        self.free(request_id)

    def shed_window(self, request_id: object, first_block: int = 0) -> np.ndarray:
        """Give back now what the request's window rows no longer need (as its next extend would); returns the changed columns.

        For a request whose prompt KV another node computes and sends (a PD decode node): a
        window row's blocks behind its window are never read here, and the sender may not even
        hold them (its own prefix hit skipped them), so from ``first_block`` on (the blocks this
        node did not have cached) they leave the prefix index before they go back, as in ``discard``.
        """
        req = self._get(request_id)
        _check_count(first_block, "first_block", least=0)
        rows, blocks, stops = self._recyclable(req, int(self._ntok[req.slot]))
        if not blocks.size:
            return _NO_COLUMNS
        bs = self.block_size
        for g, (policy, group) in enumerate(self._window_groups):
            part = req.table[group, max(req.recycled[g], -(-policy.sink_tokens // bs), first_block):stops[g]]
            held = part >= 0
            if held.any():
                r, b = np.broadcast_to(group[:, None], part.shape)[held], part[held]
                removed = self._index.remove(r, b)
                self._pool.uncache(r, b)
                if self.enable_events:
                    self._events += self._removed(removed.rows, removed.hashes)
        self._pool.decref(rows, blocks, unique=True)
        self._recycled += int(self._group_sizes[rows].sum())
        req.changed = changed = _columns(self._mark_recycled(req, stops))
        self._changed_ok[req.slot] = True
        self._refresh(req)
        return changed

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (live requests keep their blocks); returns the hashes dropped.

        Unlike vLLM 0.33's ``reset_prefix_cache``, which refuses (returns False, changing nothing) while any block
        is in use, this resets with live requests too: their blocks stay theirs but are no longer findable, so no
        later admit hits KV computed before the reset (after a weight update, say).
        """
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

    def check_integrity(self) -> None:
        """Raise AssertionError with the numbers if pool, index and tables disagree."""
        self._pool.check_integrity()
        self._index.check_integrity()
        refs = np.zeros((len(self._group_col), self.num_blocks), dtype=np.int64)
        for req in self._requests.values():
            t = req.table[:, : req.num_blocks]
            r, c = np.nonzero(t >= 0)
            np.add.at(refs, (r, t[r, c]), 1)
            assert req.num_blocks == -(-int(self._ntok[req.slot]) // self.block_size), "table length disagrees with tokens"
            assert self._by_slot[req.slot] is req, f"slot {req.slot} does not hold its request"
            if self._ntok[req.slot] % self.block_size:
                assert (self._last_block[req.slot] == t[:, -1]).all(), "last block out of date"
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
        With only Window rows a hit may hold holes (blocks long evicted before
        the window), so every hash is looked up, not just the leading run.
        """
        if self._window_groups and not self._full_rows.size:
            found = self._index.blocks_of(hashes)  # [n, rows], -1 where no row holds the hash
        else:
            found = self._index.match(hashes)  # [k, rows]: the leading run, which bounds any Full row's hit
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

    def _register(self, req: _Request, start: int, hashes: bytes, tokens: np.ndarray) -> None:
        """Enter the request's newly full blocks (packed ``hashes``, from block ``start`` on) in the index.

        ``tokens`` are the request's tokens from block ``start`` on (for events).
        """
        if not hashes:
            return
        stop = start + len(hashes) // _H
        blocks = req.table[:, start:stop].T
        inserted = self._index.insert(hashes, blocks)
        if inserted.everything:  # no hole, all referenced: no pair selection
            self._pool.mark_cached_columns(blocks)
        elif inserted.added.any():
            i, r = np.nonzero(inserted.added)
            self._pool.mark_cached(r, blocks[i, r])
        if self.enable_events and (inserted.everything or inserted.added.any()):
            self._store_events(req, start, hashes, inserted, tokens)
        self._last_hash[req.slot] = np.frombuffer(hashes[-_H:], dtype=np.uint8)

    def _forget(self, rows: np.ndarray, blocks: np.ndarray) -> None:
        """Drop evicted (row, block) pairs from the index and report the hashes that left it."""
        if rows.size == 0:
            return
        self._evicted += int(self._group_sizes[rows].sum())
        if self.tier is not None:
            self.tier.evicting(*self._expand_pairs(rows, blocks))
        if self.enable_events:
            removed = self._index.remove(rows, blocks)
            self._events += self._removed(removed.rows, removed.hashes)
        else:
            self._index.remove_gone(rows, blocks)

    def _store_events(self, req: _Request, start: int, packed: bytes, inserted: Inserted, tokens: np.ndarray) -> None:
        """Per row group, one BlockStored per run of consecutive hashes the group newly holds.

        ``packed`` hashes blocks ``start`` on, whose tokens ``tokens`` start with.
        """
        bs = self.block_size
        parent = self._last_hash[req.slot].tobytes() if start else None
        n = len(packed) // _H
        extra = self._extra_keys(req.cache_salt, req.lora, req.mm, start, start + n)
        if inserted is self._all_new or inserted.everything:  # every group holds every block now
            self._events += [self._stored(g, packed, parent, tokens[:n * bs], req.lora, extra)
                             for g in range(len(self._group_col))]
            return
        added = inserted.added  # [n, groups]
        for g in range(added.shape[1]):
            held = np.concatenate(([False], added[:, g], [False]))
            edges = np.flatnonzero(held[1:] != held[:-1])
            for first, stop in zip(edges[::2].tolist(), edges[1::2].tolist()):
                self._events.append(self._stored(
                    g, packed[first * _H:stop * _H], packed[(first - 1) * _H:first * _H] if first else parent,
                    tokens[first * bs:stop * bs], req.lora, extra[first:stop]))

    def _stored(self, group: int, hashes: bytes, parent: bytes | None, tokens: np.ndarray, lora: LoRA | None,
                extra_keys: tuple[tuple | None, ...]) -> BlockStored:
        """Row group ``group`` holds these packed hashes now (``tokens`` their blocks' tokens, copied)."""
        return BlockStored(block_hashes=tuple(hashes[i:i + _H] for i in range(0, len(hashes), _H)),
                           parent_block_hash=parent, token_ids=tokens.copy(), block_size=self.block_size, group=group,
                           window=self._group_windows[group], lora=lora, extra_keys=extra_keys)

    def _removed(self, groups: np.ndarray, hashes: np.ndarray) -> list[BlockRemoved]:
        """One BlockRemoved per row group of the dropped (group, hash) pairs (packed ``V32`` hashes), groups
        ascending, pairs in order."""
        if groups.size == 0:
            return []
        if len(self._group_col) == 1:
            return [BlockRemoved(tuple(bytes(h) for h in hashes))]
        return [BlockRemoved(tuple(bytes(h) for h in hashes[groups == g]), group=int(g)) for g in np.unique(groups)]

    def _extra_keys(self, cache_salt: str | None, lora: LoRA | None, mm: Sequence[MMPlaceholder] | None,
                    first: int, stop: int) -> tuple[tuple | None, ...]:
        """Blocks ``[first, stop)``'s extra hash keys as vLLM publishes them in events: untagged, per block the
        LoRA's name, each overlapping multimodal item's ``(identifier, offset - block start)``, then (block 0)
        the salt; None for a block with none."""
        if lora is None and not mm and not cache_salt:
            return (None,) * (stop - first)
        bs = self.block_size
        name = lora if lora is None or isinstance(lora, str) else lora[0]
        out: list[tuple | None] = []
        for b in range(first, stop):
            keys: list[object] = [] if name is None else [name]
            keys += [(ident, offset - b * bs) for ident, offset, length in mm or ()
                     if offset < (b + 1) * bs and offset + length > b * bs]
            if b == 0 and cache_salt:
                keys.append(cache_salt)
            out.append(tuple(keys) if keys else None)
        return tuple(out)

    def _refresh(self, req: _Request) -> None:
        """After a table change: drop the cached view and recompute the fast-path limits."""
        bs = self.block_size
        req.view = None
        slot = req.slot
        # An extend up to ``limit`` tokens stays in the last block and, with hashing, does not fill it.
        limit = req.num_blocks * bs
        if self._hasher is not None:
            limit = min(limit, (int(self._ntok[slot]) // bs + 1) * bs - 1)
        self._fast_limit[slot] = limit
        self._next_recycle[slot] = self._recycle_at(req.recycled)
        self._width[slot] = req.num_blocks

    def _recycle_at(self, recycled: list[int]) -> int:
        """The first num_computed_tokens at which a window row would give a block back (per window group,
        ``recycled`` blocks are given back already)."""
        if not self._window_groups:
            return _NEVER
        bs = self.block_size
        return min((recycled[g] + 1) * bs + policy.window_tokens - 1 for g, (policy, _) in
                   enumerate(self._window_groups))


_EMPTY = np.empty(0, dtype=np.intp)
_NEVER = 2**62  # a _next_recycle no request reaches
_NO_COLUMNS = np.empty(0, dtype=np.int32)
_NO_HASH = bytes(HASH_BYTES)  # extend_decode's mark of an eviction that dropped no hash
_NO_HIT = np.empty((0, 0), dtype=np.int32)  # admit_commit's hit of a request with no cached prefix
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

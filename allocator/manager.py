"""KVCacheManager: the scheduler's API over block pool, sliding-window policy and prefix index.

A scheduler calls ``admit`` once per request, ``extend`` each step the request
grows (next prefill chunk, decoded tokens), and ``free`` when it ends. Every
call that would need more blocks than are free returns None and changes
nothing. Tables are int32 ``[num_rows, num_blocks]``; ``-1`` marks a slot a
sliding-window row no longer holds.

The class is spread over four modules, each a part a reader looks for:
this one (admit, extend one request, free, the prefix index and events),
``requests`` (each request's record and the slot arrays of its hot fields),
``decode`` (``extend_many``, a decode step's batch) and ``tiers`` (a lower
cache tier). A decode step gives a request one token, which lands in one of
three places (block_size 4, prefix caching on)::

    tokens   | t0 t1 t2 t3 | t4 t5 .  .  |
    fast     |             | t4 t5 +1    |  inside the last block
    fill     |             | t4 t5 t6 +1 |  fills it: hashed and indexed
    open     | t0 t1 t2 t3 | +1          |  a new block from the pool

Every operation has one general path, in Python over numpy: ``admit``,
``_extend`` (one request), ``_extend_each`` (a batch one request at a time,
in order). The paths below are faster ways to the same result, each kept for
what it buys on ``kvcache bench allocator`` and ``kvcache bench daemon``
(time with the path switched off over time with it, same run; 2-core x86):

===================  =================================================  =======================================
path                 taken when                                         buys
===================  =================================================  =======================================
``_admit_commit``    prefix caching, no tier; with events one group     admit + free 5.0x at 16 tokens, 2.3x at
(C admit_commit)     and no window (stores are one event per admit);    2,048, 1.5x at 32,768; step 1.3x;
                     declines (general path) when a new block's hash    daemon step 1.3x
                     is indexed already
``_extend_decode``   ``extend_many`` / ``_deltas`` with a list of       step 1.55x (uniform); daemon step 1.7x
(C extend_decode)    ids on one group, no window, no expanded rows,
                     no tier, a native hasher; declines a batch with
                     a multi-token or keyed extend, too few blocks, a
                     slot listed twice, or a fill's hash known
``_extend_rows``     the same batches on several groups, expanded       head-wise step 2.1x (6 window rows);
(C extend_rows)      rows or window and chunked groups, request by      layer groups 2.2x
                     request as ``_extend`` does; declines as
                     extend_decode does
``extend_fast``      the general batch path: extends that stay in       the in-block case of every batch the C
(C)                  the last block and give nothing back              decode passes decline (tiers, keyed or
                                                                        multi-token extends)
``_extend_run``      the general batch path: one-token extends that     head-wise step 4.1x (6 window rows;
(numpy, batched)     open, fill or recycle, while the result equals     the C passes off)
                     one-by-one (enough blocks, new distinct hashes,
                     released blocks cached)
``_window_steps``    in ``_extend_run``, one window group: what the     head-wise step 1.5x (the C passes off)
(numpy, batched)     run's requests give back, for all at once
===================  =================================================  =======================================

A batch that lists a request twice runs one request at a time
(``_extend_in_order``): each extend's table is returned as it was made.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence, Union

import numpy as np

from kvcache.allocator import _tables
from kvcache.allocator.decode import DecodeBatch
from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.events import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent
from kvcache.allocator.pool import BlockPool, Usage, usage
from kvcache.allocator.prefix import (
    HASH_BYTES,
    BlockHasher,
    Inserted,
    LoRA,
    MMPlaceholder,
    PrefixIndex,
    as_token_array,
    check_lora,
)
from kvcache.allocator.swa import (AttentionPolicy, Chunked, Full, LocalPolicy, Window, first_seen_token,
                                   sink_tokens, window_stop)
from kvcache.allocator.requests import (
    _NO_COLUMNS,
    Admission,
    RequestSlots,
    _check_count,
    _columns,
    _grow,
    _Request,
    _view,
    _widen,
)
from kvcache.allocator.owned import OwnedBlocks
from kvcache.allocator.tiers import TierLink

if TYPE_CHECKING:
    from kvcache.allocator.layout import CacheSpec
    from kvcache.allocator.tiers import LowerTier

Tokens = Union[Sequence[int], np.ndarray]


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


class KVCacheManager(RequestSlots, DecodeBatch, TierLink, OwnedBlocks):
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
        row_blocks: Sequence[int] | None = None,
    ) -> None:
        """``num_blocks`` is every row's block id space; ``row_blocks`` (one count per row, each at most
        ``num_blocks``) gives rows smaller pools, e.g. a sliding-window row the blocks its requests hold at most
        (``kvcache plan --max-model-len`` sizes them). Rows with equal policies share a pool: equal counts."""
        _check_count(num_blocks, "num_blocks", least=1)
        _check_count(block_size, "block_size", least=1)
        rows = tuple(rows)
        if not rows:
            raise KVCacheError("rows: need at least one row policy")
        for i, policy in enumerate(rows):
            if not isinstance(policy, (Full, Window, Chunked)):
                raise KVCacheError(f"rows[{i}]: expected Full(), Window(...) or Chunked(...), got {policy!r}")
            if isinstance(policy, Chunked) and policy.chunk_tokens % block_size:
                raise KVCacheError(f"rows[{i}]: chunk_tokens {policy.chunk_tokens} must be a multiple of "
                                   f"block_size {block_size} (a chunk starts on a block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.rows = rows
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_events = enable_events
        groups = list(dict.fromkeys(rows))
        self._row_group = np.array([groups.index(p) for p in rows], dtype=np.intp)
        self._expand = len(groups) != len(rows)
        group_blocks = None
        if row_blocks is not None:
            sizes = list(row_blocks)
            if len(sizes) != len(rows):
                raise KVCacheError(f"row_blocks: needs one count per row ({len(rows)}), got {len(sizes)}")
            for i, size in enumerate(sizes):
                _check_count(size, f"row_blocks[{i}]", least=1)
            group_blocks = [sizes[self._row_group.tolist().index(g)] for g in range(len(groups))]
            for i, size in enumerate(sizes):
                if size != group_blocks[self._row_group[i]]:
                    raise KVCacheError(f"row_blocks[{i}]: rows with equal policies share a pool; row {i} has "
                                       f"{size} blocks, an earlier row of policy {rows[i]!r} has "
                                       f"{group_blocks[self._row_group[i]]}")
        self._pool = BlockPool(len(groups), num_blocks, group_blocks)
        self._index = PrefixIndex(len(groups), num_blocks)
        self._hasher = BlockHasher(block_size, hash_algorithm, hash_seed) if enable_prefix_caching else None
        self._group_col = np.arange(len(groups), dtype=np.intp)[:, None]
        self._group_rows = np.arange(len(groups), dtype=np.int64)  # the same, flat: what the pool's C passes take
        self._full_rows = np.array([g for g, p in enumerate(groups) if isinstance(p, Full)], dtype=np.intp)
        self._group_windows = [p.window_tokens if isinstance(p, Window) else None for p in groups]  # for events
        self._group_chunks = [p.chunk_tokens if isinstance(p, Chunked) else None for p in groups]  # for events
        # Window and Chunked groups: the rows that give blocks back as their requests go on.
        self._window_groups: list[tuple[LocalPolicy, np.ndarray]] = [
            (p, np.array([g], dtype=np.intp)) for g, p in enumerate(groups) if not isinstance(p, Full)
        ]
        self._requests: dict[object, _Request] = {}
        self._owned: dict[object, object] = {}  # scheduler-owned block lists (owned.OwnedBlocks), by request id
        self._init_slots()
        self._events: list[CacheEvent] = []
        self._group_sizes = np.bincount(self._row_group)
        self._queries = self._hit_requests = self._queried_tokens = self._hit_tokens = 0
        self._evicted = self._recycled = 0
        self.tier: LowerTier | None = None  # a cache tier under the GPU blocks (attach_tier)
        self._held = np.zeros((len(groups), num_blocks), dtype=np.int64)  # references a tier holds (hold)
        # With a tier: each request's tokens since admit, by slot (the tier keys and announces what it
        # takes by them; without a tier only the partial last block's tokens are kept).
        self._tier_tokens: dict[int, list[np.ndarray]] = {}

    def __getstate__(self) -> dict:
        """The state a journal snapshot saves: everything but the events not yet taken (they were published) and
        an attached tier of this process's memory and threads; a tier that is state (``journaled``, the daemon's)
        stays, with the tokens it keys releases by."""
        state = self.__dict__.copy()
        if not getattr(self.tier, "journaled", False):
            state["tier"] = None
            state["_tier_tokens"] = {}
        state["_events"] = []
        return state

    def __setstate__(self, state: dict) -> None:
        """Restore a journal snapshot's state; cached table views would be copies now, so drop them."""
        self.__dict__.update(state)
        for req in self._requests.values():
            req.view = None
        if "_owned" not in state:  # a snapshot from before scheduler-owned blocks
            self._owned = {}
        if "_held" not in state:  # a snapshot from before tiers could hold blocks
            self._held = np.zeros((len(self._group_col), self.num_blocks), dtype=np.int64)

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
    def row_blocks(self) -> np.ndarray:
        """Blocks each row holds (intp ``[num_rows]``): ``num_blocks`` unless the manager was given
        ``row_blocks``."""
        return self._pool.row_blocks[self._row_group]

    @property
    def usage(self) -> Usage:
        """Fraction of blocks in use per row and the largest, exact (never rounded to 0)."""
        return usage(self.num_free_blocks, self.row_blocks)

    def can_admit(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens fits even with no prefix hit."""
        _check_count(num_tokens, "num_tokens", least=0)
        return self._pool.can_allocate(-(-num_tokens // self.block_size))

    def lookup(self, prompt_tokens: Tokens, *, cache_salt: str | None = None, lora: LoRA | None = None,
               mm: Sequence[MMPlaceholder | tuple[str, int, int]] | None = None, whole_prompt: bool = False) -> int:
        """Tokens of ``prompt_tokens`` that ``admit`` would find cached now (no state change).

        ``whole_prompt``: the tokens ``match_blocks`` would find instead, where the last block may hit too (GPU
        blocks only).
        """
        if not whole_prompt:
            return sum(self.lookup_tiers(prompt_tokens, cache_salt=cache_salt, lora=lora, mm=mm))
        lora = check_lora(lora)
        tokens = as_token_array(prompt_tokens)
        if self._hasher is None:
            return 0
        hashes = self._hasher.hash_blocks_packed(tokens, cache_salt=cache_salt, lora=lora, mm=mm)
        return self._match(hashes)[0] * self.block_size

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
        if request_id in self._owned:
            raise KVCacheError(f"request_id: {request_id!r} owns blocks (match_blocks, allocate_blank); "
                               "release them first")
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
            hashes = self._hasher._hash(tokens, cache_salt, lora, mm, None, 0, split=False)  # hash_blocks_packed's
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
        return Admission(num_cached * bs, view, covered, num_tier * bs)

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
        if self._free_slots:  # the slot _next_slot gave: take it
            self._free_slots.pop()
        else:
            self._by_slot.append(None)
        req = self._record(request_id, slot, table, num_blocks, recycled, cache_salt, lora, mm)
        self._queries += 1  # _count_query's statistics, inline on this path
        self._hit_requests += num_hit > 0
        self._queried_tokens += int(tokens.size)
        self._hit_tokens += num_hit * bs
        return Admission(num_hit * bs, _view(req), covered)

    def extend(self, request_id: object, tokens: Tokens, *, num_computed_tokens: int | None = None,
               num_lookahead_tokens: int = 0) -> np.ndarray | None:
        """Append ``tokens`` (a prefill chunk or decoded tokens) and allocate the blocks they need.

        Sliding-window rows first give back blocks no query from
        ``num_computed_tokens`` on can see (default: every token before this
        call, i.e. the previous step finished; pass less under asynchronous
        scheduling so no block a step in flight still reads or writes is
        freed). Newly full blocks enter the prefix index. Returns the table, or
        None, changing nothing, when blocks are short.

        ``num_lookahead_tokens``: the table also covers that many positions after the tokens, whose tokens are
        not known yet (vLLM's lookahead slots): a scheduler can hand out the next decode step's table while
        the current step runs, and a later extend fills those positions first (a block is hashed once full).
        """
        req = self._get(request_id)
        new_tokens = as_token_array(tokens)
        num_tokens = int(self._ntok[req.slot])
        done = num_tokens if num_computed_tokens is None else num_computed_tokens
        _check_count(done, "num_computed_tokens", least=0)
        if done > num_tokens:
            raise KVCacheError(f"num_computed_tokens: {done} exceeds the request's {num_tokens} tokens")
        table = self._extend(req, new_tokens, done, self._lookahead(num_lookahead_tokens))
        if table is not None and self.tier is not None and req.slot in self._tier_tokens:
            self._tier_tokens[req.slot].append(new_tokens.copy())
        return table

    def _extend(self, req: _Request, new_tokens: np.ndarray, done: int, lookahead: int = 0) -> np.ndarray | None:
        """``extend`` after validation: ``new_tokens`` is uint32, ``done`` within the request's tokens; the table
        to cover ``lookahead`` positions more (blocks reserved ahead stay the request's)."""
        bs = self.block_size
        slot = req.slot
        num_tokens = int(self._ntok[slot])
        total = num_tokens + int(new_tokens.size)
        num_blocks = max(req.num_blocks, -(-(total + lookahead) // bs))
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
        self._pool.release_table(self._group_rows, req.table, req.num_blocks)

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
            part = req.table[group, max(req.recycled[g], -(-sink_tokens(policy) // bs), first_block):stops[g]]
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

    def reset_prefix_cache(self, *, keep_lower_tier: bool = False) -> int:
        """Forget every cached prefix (live requests keep their blocks); returns the hashes dropped.

        Unlike vLLM 0.33's ``reset_prefix_cache``, which refuses (returns False, changing nothing) while any block
        is in use, this resets with live requests too: their blocks stay theirs but are no longer findable, so no
        later admit hits KV computed before the reset (after a weight update, say). ``keep_lower_tier``: forget
        only what the GPU blocks hold (a worker restarted and lost them); the lower tier's copies stay findable.
        """
        if self.tier is not None:
            self.tier.evicting(*self._expand_pairs(*self._index.held_pairs()))
            if not keep_lower_tier:
                self.tier.reset()
        dropped = self._index.clear()
        self._pool.reset_cached()
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return dropped

    # ------------------------------------------------------------------ lower tier

    def check_integrity(self) -> None:
        """Raise AssertionError with the numbers if pool, index and tables disagree."""
        self._pool.check_integrity()
        self._index.check_integrity()
        refs = np.zeros((len(self._group_col), self.num_blocks), dtype=np.int64)
        for req in self._requests.values():
            t = req.table[:, : req.num_blocks]
            r, c = np.nonzero(t >= 0)
            np.add.at(refs, (r, t[r, c]), 1)
            filled = -(-int(self._ntok[req.slot]) // self.block_size)
            assert req.num_blocks >= filled, "table shorter than its tokens"
            if req.num_blocks > filled:  # blocks reserved ahead: nothing in them yet, so nothing cached
                ahead = t[:, filled:]
                rows = np.broadcast_to(self._group_col, ahead.shape)
                live = ahead >= 0
                assert not self._pool.is_cached(rows[live], ahead[live]).any(), "a block reserved ahead is cached"
            assert self._by_slot[req.slot] is req, f"slot {req.slot} does not hold its request"
            if self._ntok[req.slot] % self.block_size:
                assert (self._last_block[req.slot] == t[:, -1]).all(), "last block out of date"
            if req.heads is not None:
                assert (req.heads[:, : req.num_blocks] == t[self._row_group]).all(), "rows disagree with their group"
        refs += self._held
        if self._owned:
            refs[0] += self._owned_refs()
        actual = self._pool.refcount(self._group_col, np.arange(self.num_blocks)[None, :])
        bad = np.argwhere(refs != actual)
        assert bad.size == 0, (
            f"(row {bad[0][0]}, block {bad[0][1]}) is in {refs[tuple(bad[0])]} live tables and tier holds "
            f"but has refcount {actual[tuple(bad[0])]}" if bad.size else ""
        )
        rows, blocks = self._index.held_pairs()
        cached = self._pool.is_cached(self._group_col, np.arange(self.num_blocks)[None, :])
        held = np.zeros_like(cached)
        held[rows, blocks] = True
        assert (cached == held).all(), f"{int((cached != held).sum())} pairs cached in the pool but not the index"

    # ------------------------------------------------------------------ internals

    def _match(self, hashes: bytes) -> tuple[int, np.ndarray | None]:
        """Longest usable cached prefix in blocks, and its blocks ``[num_rows, L]`` (-1 where not needed).

        Full rows need every block of the prefix; a Window or Chunked row needs
        only its sink blocks and the blocks the next query (at ``L * block_size``)
        sees (``swa.needed_blocks``). With only Window or Chunked rows a hit may hold holes (blocks long evicted before
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
            sink_stop = np.minimum(-(-np.minimum(sink_tokens(policy), lengths * bs) // bs), lengths)
            first_seen = np.minimum(first_seen_token(policy, lengths * bs) // bs, lengths)
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

    @property
    def held_blocks(self) -> int:
        """(group, block) pairs a lower tier keeps out of the pool (``hold``)."""
        return int(np.count_nonzero(self._held))

    def hold(self, rows: np.ndarray, blocks: np.ndarray) -> None:
        """A lower tier keeps these (row, block) pairs, which a live request holds now, out of the pool until
        ``let_go``: a copy its workers have not run yet still writes them."""
        groups, blocks = self._group_pairs(rows, blocks)
        self._pool.incref(groups, blocks, unique=True)
        self._held[groups, blocks] += 1

    def let_go(self, rows: np.ndarray, blocks: np.ndarray) -> None:
        """End a ``hold`` of the same pairs: blocks no one else holds return to the pool."""
        groups, blocks = self._group_pairs(rows, blocks)
        if (self._held[groups, blocks] < 1).any():
            raise KVCacheError("let_go: a pair the tier does not hold")
        self._held[groups, blocks] -= 1
        self._pool.decref(groups, blocks, unique=True)

    def _group_pairs(self, rows: np.ndarray, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row, block) pairs as the distinct (group, block) pairs that hold them."""
        groups = self._row_group[np.asarray(rows, dtype=np.intp)]
        pairs = np.unique(groups.astype(np.int64) * self.num_blocks + np.asarray(blocks, dtype=np.int64))
        return (pairs // self.num_blocks).astype(np.intp), (pairs % self.num_blocks).astype(np.intp)

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
        bs = self.block_size
        stops: list[int] = []
        rows_parts, block_parts = [], []
        for g, (policy, group) in enumerate(self._window_groups):
            stop = min(window_stop(policy, done, bs), req.num_blocks)
            stops.append(stop)
            start = max(req.recycled[g], -(-sink_tokens(policy) // bs))
            if stop <= start:
                continue
            part = req.table[group, start:stop][:, ::-1]  # [rows of the group, blocks], tail first
            rows_parts.append(np.repeat(group, stop - start))
            block_parts.append(part.ravel())
        if not rows_parts:
            return _EMPTY, _EMPTY, stops
        if len(rows_parts) == 1:
            rows, blocks = rows_parts[0], block_parts[0]
        else:
            rows, blocks = np.concatenate(rows_parts), np.concatenate(block_parts)
        live = blocks >= 0
        return (rows, blocks, stops) if live.all() else (rows[live], blocks[live], stops)

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
                           window=self._group_windows[group], chunk=self._group_chunks[group], lora=lora,
                           extra_keys=extra_keys)

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

_EMPTY = np.empty(0, dtype=np.intp)
_NO_HIT = np.empty((0, 0), dtype=np.int32)  # admit_commit's hit of a request with no cached prefix
_H = HASH_BYTES



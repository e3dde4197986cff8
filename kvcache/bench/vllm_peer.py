"""vLLM v1's prefix-caching block allocator in pure Python: the peer `kvcache bench allocator` times.

A faithful re-statement with vLLM's per-block Python costs kept (one KVCacheBlock object per
block, a doubly linked free list walked block by block, a dict from hash to block), so the
benchmark compares against what a vLLM scheduler really pays. Source (Apache-2.0, vLLM
contributors), read from vllm-project/vllm:
  vllm/v1/core/block_pool.py @ c59cb794: BlockHashToBlockMap, BlockPool (get_cached_block,
    cache_full_blocks, get_new_blocks, _maybe_evict_cached_block, touch, free_blocks with
    fresh blocks prepended and cached ones appended).
  vllm/v1/core/kv_cache_utils.py (the version block_pool.py @ c59cb794 imports: KVCacheBlock
    with slots, FreeKVCacheBlockQueue with fake head/tail, popleft_n, prepend_n, append_n,
    remove; BlockHashWithGroupId as hash bytes + 4-byte group id).
  vllm/v1/core/single_type_kv_cache_manager.py @ 129ab7c6: FullAttentionManager's
    find_longest_cache_hit loop; get_num_blocks_to_allocate, allocate_new_computed_blocks,
    allocate_new_blocks, cache_blocks and free of SingleTypeKVCacheManager.
  vllm/v1/core/kv_cache_manager.py @ ace980e6: get_computed_blocks (hit capped at
    num_tokens - 1) and allocate_slots' order of steps.
Simplified, because this workload never reaches it: one KV cache group with full attention
(the unitary coordinator), no KV events, no metrics collector, no prefix-cache stats, no
eagle, no DCP/PCP, no external (connector) tokens, no lookahead or encoder tokens, hash block
size equal to block size, and a request is (id, block hashes, token count) instead of a
vllm Request (vLLM's request computes its block hashes when created; the benchmark does that
with the loop in kvcache.bench.hashing).
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NewType, Union

BlockHash = NewType("BlockHash", bytes)
BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """vLLM's key: the hash bytes followed by the group id as 4 big-endian bytes (no tuple)."""
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big", signed=False))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    """The BlockHash part of a key."""
    return BlockHash(key[:-4])


def cdiv(a: int, b: int) -> int:
    """Ceiling division, as vllm.utils.math_utils.cdiv."""
    return -(a // -b)


@dataclass(slots=True)
class KVCacheBlock:
    """One block's metadata; prev/next link it into the free queue without allocating."""

    block_id: int
    ref_cnt: int = 0
    _block_hash: BlockHashWithGroupId | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHashWithGroupId) -> None:
        assert self._block_hash is None, "The block already has a hash. This should not happen."
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the hash when the block is evicted."""
        self._block_hash = None

    def __repr__(self) -> str:
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
                f"_block_hash={self._block_hash!r}, prev_free_block={prev_id}, next_free_block={next_id})")


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order (front evicted first).

    Fake head and tail blocks remove the empty-list branches; O(1) removal from the
    middle is why vLLM does not use a deque. Starts ordered by block id.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        for i in range(self.num_free_blocks):
            if i > 0:
                blocks[i].prev_free_block = blocks[i - 1]
            if i < self.num_free_blocks - 1:
                blocks[i].next_free_block = blocks[i + 1]
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        if self.num_free_blocks > 0:
            self.fake_free_list_head.next_free_block = blocks[0]
            blocks[0].prev_free_block = self.fake_free_list_head
            self.fake_free_list_tail.prev_free_block = blocks[-1]
            blocks[-1].next_free_block = self.fake_free_list_tail
        else:
            self.fake_free_list_head.next_free_block = self.fake_free_list_tail
            self.fake_free_list_tail.prev_free_block = self.fake_free_list_head

    def popleft(self) -> KVCacheBlock:
        """Pop the first free block."""
        first = self.fake_free_list_head.next_free_block
        if first is self.fake_free_list_tail or first is None:
            assert self.num_free_blocks == 0, f"num_free_blocks ({self.num_free_blocks}) is out of sync"
            raise ValueError("No free blocks available")
        if first.next_free_block is None:
            raise RuntimeError("Invalid block found in popleft() which doesn't have a valid next_free_block")
        self.fake_free_list_head.next_free_block = first.next_free_block
        first.next_free_block.prev_free_block = self.fake_free_list_head
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop the first n free blocks, unlinking each."""
        if n == 0:
            return []
        assert self.num_free_blocks >= n
        self.num_free_blocks -= n
        curr = self.fake_free_list_head.next_free_block
        ret = []
        for _ in range(n):
            assert curr is not None
            ret.append(curr)
            last = curr
            curr = curr.next_free_block
            last.prev_free_block = None
            last.next_free_block = None
        if curr is not None:
            self.fake_free_list_head.next_free_block = curr
            curr.prev_free_block = self.fake_free_list_head
        return ret

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from the middle of the queue (a prefix hit revives it)."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove() called on an invalid block: {block}")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put one block at the back (evicted last)."""
        last = self.fake_free_list_tail.prev_free_block
        if last is None:
            raise RuntimeError("prev_free_block of fake_free_list_tail should always exist")
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = block
        self.num_free_blocks += 1

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks at the front, in order (uncached blocks are reused first)."""
        if not blocks:
            return
        first = self.fake_free_list_head.next_free_block
        assert first is not None, "next_free_block of fake_free_list_head should always exist"
        prev = self.fake_free_list_head
        for block in blocks:
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks at the back, in order."""
        if not blocks:
            return
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None, "prev_free_block of fake_free_list_tail should always exist"
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, front to back (tests)."""
        ret = []
        curr = self.fake_free_list_head.next_free_block
        assert curr is not None, "next_free_block of fake_free_list_head should always exist"
        while curr.next_free_block is not None:
            ret.append(curr)
            curr = curr.next_free_block
        return ret


class BlockHashToBlockMap:
    """Hash key → one block, or a dict of blocks when duplicates exist (vLLM never de-duplicates)."""

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, Union[KVCacheBlock, dict[int, KVCacheBlock]]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        """Any block cached under key."""
        blocks = self._cache.get(key)
        if blocks is not None:
            if isinstance(blocks, KVCacheBlock):
                return blocks
            if isinstance(blocks, dict):
                return next(iter(blocks.values()))
            raise AssertionError(f"Invalid KV cache block type {type(blocks)}")
        return None

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        """Cache block under key, next to any blocks already there."""
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif isinstance(blocks, KVCacheBlock):
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        elif isinstance(blocks, dict):
            blocks[block.block_id] = block
        else:
            raise AssertionError(f"Invalid KV cache block type {type(blocks)}")

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Remove block_id from key's entry; None when it is not there."""
        blocks = self._cache.pop(key, None)
        if blocks is None:
            return None
        if isinstance(blocks, KVCacheBlock):
            if blocks.block_id == block_id:
                return blocks
            self._cache[key] = blocks
            return None
        if isinstance(blocks, dict):
            block = blocks.pop(block_id, None)
            if len(blocks) > 0:
                self._cache[key] = blocks
            return block
        raise AssertionError(f"Invalid KV cache block type {type(blocks)}")

    def __len__(self) -> int:
        return len(self._cache)


class BlockPool:
    """All blocks, the free queue in eviction order and the hash map; block 0 is the null block."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True) -> None:
        assert isinstance(num_gpu_blocks, int) and num_gpu_blocks > 0
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(idx) for idx in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Placeholder block 0: never counted, never freed, never cached.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_cached_block(self, block_hash: BlockHash, kv_cache_group_ids: list[int]) -> list[KVCacheBlock] | None:
        """The cached block for block_hash in every group, or None on a miss in any."""
        cached_blocks = []
        for group_id in kv_cache_group_ids:
            block = self.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(block_hash, group_id))
            if not block:
                return None
            cached_blocks.append(block)
        return cached_blocks

    def cache_full_blocks(
        self,
        block_hashes: Sequence[BlockHash],
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        kv_cache_group_id: int,
    ) -> None:
        """Give blocks [num_cached_blocks, num_full_blocks) their hashes and enter them in the map."""
        if num_cached_blocks >= num_full_blocks:
            return
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
        assert len(block_hashes) >= num_full_blocks
        new_block_hashes = block_hashes[num_cached_blocks:]
        for i, blk in enumerate(new_full_blocks):
            if blk.is_null:
                continue
            if blk.block_hash is not None:
                expected = make_block_hash_with_group_id(new_block_hashes[i], kv_cache_group_id)
                assert blk.block_hash == expected, f"Cached block has wrong hash: {blk.block_hash!r} != {expected!r}"
                continue
            key = make_block_hash_with_group_id(new_block_hashes[i], kv_cache_group_id)
            blk.block_hash = key
            self.cached_block_hash_to_block.insert(key, blk)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop num_blocks from the front of the free queue, evicting any that are cached."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        if self.enable_caching:
            for block in ret:
                self._maybe_evict_cached_block(block)
                assert block.ref_cnt == 0
                block.ref_cnt += 1
        else:
            for block in ret:
                assert block.ref_cnt == 0
                block.ref_cnt += 1
        return ret

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop block's hash from the map if it has one; True when it was evicted."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        if self.cached_block_hash_to_block.pop(block_hash, block.block_id) is None:
            return False
        block.reset_hash()
        return True

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on each block; a free one (eviction candidate) leaves the queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block, given in eviction order (first evicted first).

        Blocks reaching 0 without a hash go to the front of the queue (reused first);
        cached ones go to the back (kept longest for prefix hits).
        """
        blocks_list = list(ordered_blocks)
        for block in blocks_list:
            block.ref_cnt -= 1
        freeable = [b for b in blocks_list if b.ref_cnt == 0 and not b.is_null]
        fresh_blocks = [b for b in freeable if b.block_hash is None]
        cached_blocks = [b for b in freeable if b.block_hash is not None]
        if fresh_blocks:
            self.free_block_queue.prepend_n(fresh_blocks)
        if cached_blocks:
            self.free_block_queue.append_n(cached_blocks)

    def get_num_free_blocks(self) -> int:
        """Free blocks, cached eviction candidates included."""
        return self.free_block_queue.num_free_blocks


def find_longest_cache_hit(
    block_hashes: Sequence[BlockHash],
    max_length: int,
    kv_cache_group_ids: list[int],
    block_pool: BlockPool,
    block_size: int,
) -> tuple[list[KVCacheBlock], ...]:
    """FullAttentionManager.find_longest_cache_hit: cached blocks of the leading hashes, per group."""
    computed_blocks: tuple[list[KVCacheBlock], ...] = tuple([] for _ in range(len(kv_cache_group_ids)))
    max_num_blocks = max_length // block_size
    for block_hash in itertools.islice(block_hashes, max_num_blocks):
        # A chain: once one hash misses, no later one can hit.
        if cached_block := block_pool.get_cached_block(block_hash, kv_cache_group_ids):
            for computed, cached in zip(computed_blocks, cached_block):
                computed.append(cached)
        else:
            break
    return computed_blocks


class KVCacheManager:
    """vLLM's KVCacheManager over one full-attention group: get_computed_blocks, allocate_slots, free."""

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        self.kv_cache_group_ids = [0]
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    def get_computed_blocks(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> tuple[list[KVCacheBlock], int]:
        """Cached blocks of the prompt's prefix and the tokens they cover (at most num_tokens - 1)."""
        if not self.enable_caching:
            return [], 0
        # The last token is always recomputed to get logits.
        computed = find_longest_cache_hit(
            block_hashes, num_tokens - 1, self.kv_cache_group_ids, self.block_pool, self.block_size
        )[0]
        return computed, len(computed) * self.block_size

    def allocate_slots(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
    ) -> list[KVCacheBlock] | None:
        """Slots for a new request's whole prompt: touch the hit, allocate the rest, cache full blocks.

        Returns the new blocks, or None (changing nothing) when the pool is short.
        """
        pool = self.block_pool
        num_required_blocks = cdiv(num_tokens, self.block_size)
        num_req_blocks = len(self.req_to_blocks.get(request_id, ()))
        num_new_blocks = max(num_required_blocks - (len(new_computed_blocks) + num_req_blocks), 0)
        num_evictable = sum(blk.ref_cnt == 0 and not blk.is_null for blk in new_computed_blocks)
        if num_new_blocks + num_evictable > pool.get_num_free_blocks():
            return None
        if new_computed_blocks:
            if self.enable_caching:
                pool.touch(new_computed_blocks)
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not req_blocks, "allocate_slots is for a new request here"
        req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            num_cached = self.num_cached_block.get(request_id, 0)
            num_full = num_tokens // self.block_size
            if num_cached < num_full:
                pool.cache_full_blocks(block_hashes, req_blocks, num_cached, num_full, self.kv_cache_group_ids[0])
                self.num_cached_block[request_id] = num_full
        return new_blocks

    def admit(
        self, request_id: str, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> tuple[int, list[KVCacheBlock]] | None:
        """What a vLLM scheduler does for a new request: hit lookup, then allocate_slots.

        Returns (num_computed_tokens, the request's blocks), or None when blocks are short.
        """
        computed, num_computed_tokens = self.get_computed_blocks(block_hashes, num_tokens)
        if self.allocate_slots(request_id, block_hashes, num_tokens, computed) is None:
            return None
        return num_computed_tokens, self.req_to_blocks[request_id]

    def free(self, request_id: str) -> None:
        """Free the request's blocks tail first, so a prefix's tail is evicted before its head."""
        req_blocks = self.req_to_blocks.pop(request_id, [])
        self.block_pool.free_blocks(reversed(req_blocks))
        self.num_cached_block.pop(request_id, None)

    def num_cached_hashes(self) -> int:
        """Hash keys in the map."""
        return len(self.block_pool.cached_block_hash_to_block)

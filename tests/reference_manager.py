"""A slow, obviously-correct KVCacheManager in plain Python, to test the fast one against.

Same decisions as the real manager, written token by token and block by
block: per-row free stacks (LIFO) and LRU lists of cached free blocks, a dict
prefix index, and the sliding-window rules stated on tokens rather than ranges.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.allocator.prefix import BlockHasher
from kvcache.allocator.swa import Full


class RowPool:
    """One row: refcounts, a LIFO stack of uncached free blocks, an LRU list of cached free ones."""

    def __init__(self, num_blocks: int) -> None:
        self.ref = [0] * num_blocks
        self.cached = [False] * num_blocks
        self.stack = list(range(num_blocks - 1, -1, -1))  # pops 0 first
        self.lru: list[int] = []  # oldest first

    def free_count(self) -> int:
        return len(self.stack) + len(self.lru)

    def allocate(self, n: int) -> tuple[list[int], list[int]]:
        blocks, evicted = [], []
        for _ in range(n):
            if self.stack:
                b = self.stack.pop()
            else:
                b = self.lru.pop(0)
                self.cached[b] = False
                evicted.append(b)
            self.ref[b] = 1
            blocks.append(b)
        return blocks, evicted

    def incref(self, b: int) -> None:
        if self.ref[b] == 0:
            assert self.cached[b]
            self.lru.remove(b)
        self.ref[b] += 1

    def decref(self, b: int) -> None:
        assert self.ref[b] > 0
        self.ref[b] -= 1
        if self.ref[b] == 0:
            (self.lru if self.cached[b] else self.stack).append(b)

    def reset_cached(self) -> None:
        self.stack.extend(self.lru)
        self.lru = []
        self.cached = [False] * len(self.cached)


def needed(policy, block: int, block_size: int, query: int) -> bool:
    """Whether the query at ``query`` still attends to some token of logical ``block``."""
    if isinstance(policy, Full):
        return True
    tokens = range(block * block_size, (block + 1) * block_size)
    return any(p < policy.sink_tokens or query - p < policy.window_tokens for p in tokens if p < query)


def dead(policy, block: int, block_size: int, first_pending_query: int) -> bool:
    """Whether no query from ``first_pending_query`` on attends to any token of ``block``."""
    if isinstance(policy, Full):
        return False
    tokens = range(block * block_size, (block + 1) * block_size)
    return all(p >= policy.sink_tokens and first_pending_query - p >= policy.window_tokens for p in tokens)


@dataclass
class Req:
    tokens: list[int]
    table: list[list[int]]  # [row][logical block]
    num_hashed: int = 0
    hashes: list[bytes] = field(default_factory=list)
    salt: str | None = None


class ReferenceManager:
    def __init__(self, num_blocks: int, block_size: int, rows, hasher: BlockHasher | None) -> None:
        self.bs = block_size
        self.rows = list(rows)
        self.pools = [RowPool(num_blocks) for _ in self.rows]
        self.index: dict[bytes, dict[int, int]] = {}
        self.owner: dict[tuple[int, int], bytes] = {}
        self.hasher = hasher
        self.reqs: dict[object, Req] = {}

    def _hashes(self, tokens: list[int], salt: str | None) -> list[bytes]:
        assert self.hasher is not None
        return self.hasher.hash_blocks(tokens, cache_salt=salt)

    def _evict(self, row: int, blocks: list[int]) -> None:
        for b in blocks:
            h = self.owner.pop((row, b), None)
            if h is not None:
                del self.index[h][row]
                if not self.index[h]:
                    del self.index[h]

    def _allocate(self, n: int, ascending: bool = False) -> list[list[int]]:
        """``n`` blocks per row in pop order, or sorted (an admit's: its blocks side by side)."""
        out = []
        for row, pool in enumerate(self.pools):
            blocks, evicted = pool.allocate(n)
            self._evict(row, evicted)
            out.append(sorted(blocks) if ascending else blocks)
        return out

    def _register(self, req: Req, upto: int) -> None:
        if self.hasher is None or upto <= req.num_hashed:
            return
        req.hashes = self._hashes(req.tokens[: upto * self.bs], req.salt)
        for j in range(req.num_hashed, upto):
            h = req.hashes[j]
            for row in range(len(self.rows)):
                b = req.table[row][j]
                if b < 0 or row in self.index.get(h, {}):
                    continue
                self.index.setdefault(h, {})[row] = b
                self.owner[(row, b)] = h
                self.pools[row].cached[b] = True
        req.num_hashed = upto

    def admit(self, rid, prompt: list[int], salt=None, num_tokens=None):
        bs = self.bs
        n = len(prompt)
        num_tokens = n if num_tokens is None else num_tokens
        hit = 0
        if self.hasher is not None:
            hashes = self._hashes(prompt, salt)[: (n - 1) // bs]
            known = 0
            while known < len(hashes) and hashes[known] in self.index:
                known += 1
            for length in range(known, -1, -1):
                if all(
                    row in self.index[hashes[j]]
                    for row, policy in enumerate(self.rows)
                    for j in range(length)
                    if needed(policy, j, bs, length * bs)
                ):
                    hit = length
                    break
        covered = min(n, max(num_tokens, hit * bs + 1))
        num_blocks = -(-covered // bs)
        hit_table = [
            [self.index[hashes[j]][row] if needed(policy, j, bs, hit * bs) else -1 for j in range(hit)]
            for row, policy in enumerate(self.rows)
        ] if hit else [[] for _ in self.rows]
        for row, pool in enumerate(self.pools):
            revived = sum(1 for b in hit_table[row] if b >= 0 and pool.ref[b] == 0)
            if pool.free_count() - revived < num_blocks - hit:
                return None
        for row, pool in enumerate(self.pools):
            for b in hit_table[row]:
                if b >= 0:
                    pool.incref(b)
        new = self._allocate(num_blocks - hit, ascending=True)
        req = Req(tokens=list(prompt[:covered]), table=[hit_table[r] + new[r] for r in range(len(self.rows))],
                  num_hashed=hit, salt=salt)
        self.reqs[rid] = req
        self._register(req, covered // bs)
        return hit * bs, [list(row) for row in req.table], covered

    def extend(self, rid, tokens: list[int], num_computed=None, lookahead=0):
        req = self.reqs[rid]
        bs = self.bs
        done = len(req.tokens) if num_computed is None else num_computed
        total = len(req.tokens) + len(tokens)
        num_blocks = max(len(req.table[0]), -(-(total + lookahead) // bs))  # blocks ahead stay the request's
        new = num_blocks - len(req.table[0])
        recycle = [
            [j for j in range(len(req.table[row]) - 1, -1, -1) if req.table[row][j] >= 0 and dead(policy, j, bs, done)]
            for row, policy in enumerate(self.rows)
        ]
        for row, pool in enumerate(self.pools):
            returned = sum(1 for j in recycle[row] if pool.ref[req.table[row][j]] == 1)
            if new and pool.free_count() + returned < new:
                return None
        for row, pool in enumerate(self.pools):
            for j in recycle[row]:
                pool.decref(req.table[row][j])
                req.table[row][j] = -1
        fresh = self._allocate(new)
        for row in range(len(self.rows)):
            req.table[row].extend(fresh[row])
        req.tokens.extend(tokens)
        self._register(req, total // bs)
        return [list(row) for row in req.table]

    def free(self, rid) -> None:
        req = self.reqs.pop(rid)
        for row, pool in enumerate(self.pools):
            for b in reversed(req.table[row]):
                if b >= 0:
                    pool.decref(b)

    def reset_prefix_cache(self) -> None:
        self.index.clear()
        self.owner.clear()
        for pool in self.pools:
            pool.reset_cached()

    def num_free(self) -> list[int]:
        return [pool.free_count() for pool in self.pools]

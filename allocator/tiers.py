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

from typing import Protocol, Sequence

import numpy as np

from kvcache.allocator.swa import AttentionPolicy, Full


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
    lengths = np.arange(k + 1)
    usable = np.ones(k + 1, dtype=bool)
    for g, policy in enumerate(policies):
        missing = np.concatenate([[0], np.cumsum(~present[:, g])])
        if isinstance(policy, Full):
            usable &= missing == 0
            continue
        total = start + lengths
        sink_stop = np.minimum(-(-np.minimum(policy.sink_tokens, total * block_size) // block_size), total)
        first_seen = np.minimum(np.maximum(0, total * block_size - policy.window_tokens + 1) // block_size, total)
        a = np.clip(sink_stop - start, 0, lengths)
        b = np.clip(first_seen - start, 0, lengths)
        usable &= (missing[a] == 0) & (missing[lengths] - missing[b] == 0)
    return int(np.flatnonzero(usable)[-1])

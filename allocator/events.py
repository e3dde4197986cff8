"""Prefix-cache events: which block hashes rows gained or lost (vLLM's KV event kinds, plus rows)."""
from __future__ import annotations

import dataclasses
from typing import Union

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks entered the prefix index on ``rows``.

    ``token_ids`` (uint32) are the blocks' tokens, ``len(block_hashes) *
    block_size`` of them; ``parent_block_hash`` is the hash before the first
    block (None at a request's start).
    """

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: np.ndarray
    block_size: int
    rows: tuple[int, ...]
    lora: str | None = None
    medium: str = "GPU"


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The blocks holding these hashes on ``rows`` were reused; those rows lost them."""

    block_hashes: tuple[bytes, ...]
    rows: tuple[int, ...]
    medium: str = "GPU"


@dataclasses.dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached prefix was forgotten (reset_prefix_cache)."""


CacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]

"""Prefix-cache events with vLLM's hash-level meaning: a hash is stored when it enters the index, removed when it leaves.

A hash leaves when no row holds a block for it any more; in head-wise mode one
row losing it (an SWA head's block reused) is not an event.
"""
from __future__ import annotations

import dataclasses
from typing import Union

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks' hashes entered the prefix index, held on ``rows``.

    ``token_ids`` (uint32) are the blocks' tokens, ``len(block_hashes) *
    block_size`` of them; ``parent_block_hash`` is the hash before the first
    block (None at a request's start).
    """

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: np.ndarray
    block_size: int
    rows: tuple[int, ...]
    lora: str | tuple[str, str] | None = None  # the LoRA's name, or (name, path)
    medium: str = "GPU"


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    """These hashes left the prefix index: every block that held them was reused."""

    block_hashes: tuple[bytes, ...]
    medium: str = "GPU"


@dataclasses.dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached prefix was forgotten (reset_prefix_cache)."""


CacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]

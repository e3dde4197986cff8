"""Prefix-cache events per row group, with vLLM's meaning: a group stores a hash when it caches a block for it, and
removes it when that block is reused.

A row group is the rows that share one attention policy, numbered in order of first appearance in the manager's
rows; a uniform cache has one group, a head-wise one with window and full heads two. vLLM numbers its groups
(``group_idx``) otherwise for a hybrid model: several groups of equal size per policy (``kvcache.allocator.groups``).
``renumber_groups`` publishes a row group's events as vLLM's groups of its policy would, one under each number.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Union

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks' hashes that row group ``group`` now holds.

    ``token_ids`` (uint32) are the blocks' tokens, ``len(block_hashes) *
    block_size`` of them; ``parent_block_hash`` is the hash before the first
    block (None at a request's start). ``window`` is the group's sliding
    window in tokens (None: full attention), ``chunk`` a chunked-attention
    group's chunk in tokens (None otherwise). ``extra_keys`` holds, per block,
    what its hash took beyond the tokens as vLLM publishes it (untagged: the
    LoRA's name, ``(mm identifier, offset)`` pairs, the cache salt), None for a
    block with none.
    """

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: np.ndarray
    block_size: int
    group: int = 0
    window: int | None = None
    lora: str | tuple[str, str] | None = None  # the LoRA's name, or (name, path)
    extra_keys: tuple[tuple | None, ...] | None = None
    medium: str = "GPU"
    chunk: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Row group ``group`` no longer holds these hashes: its blocks for them were reused or dropped."""

    block_hashes: tuple[bytes, ...]
    group: int = 0
    medium: str = "GPU"


@dataclasses.dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every cached prefix was forgotten (reset_prefix_cache)."""


CacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


def renumber_groups(events: Sequence[CacheEvent], numbers: Sequence[Sequence[int]]) -> list[CacheEvent]:
    """``events`` with each row group's BlockStored and BlockRemoved published once under each of its group numbers
    (``numbers[g]``, e.g. ``kvcache.allocator.groups.vllm_group_numbers``), in order; AllBlocksCleared as it is."""
    out: list[CacheEvent] = []
    for event in events:
        if isinstance(event, AllBlocksCleared):
            out.append(event)
        else:
            out += [event if n == event.group else dataclasses.replace(event, group=n) for n in numbers[event.group]]
    return out

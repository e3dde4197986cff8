"""Attention over the paged cache, one TP rank's (every head without TP), on the CPU: store the step's K and V
by table, read them back by table, attend.

A step's requests reach attention as ``Item``s. Before attention reads, ``refuse_unheld`` refuses a step whose
mask lets a query see a token in a block its table no longer holds (-1: given back by a sliding window or an
earlier chunk), so a block given back too early fails loudly instead of reading as whatever it holds now. The GPU
path (``gpu.FlexAttention``) calls the same check.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from model import Model, ModelConfig, visible
from paged_cache import PagedCache


class Item(NamedTuple):
    """One request's part of a step, as attention needs it: the request, the positions computed, the tokens the
    table covers then, its table (None where each TP rank reads its own) and the host tier's copy to wait for."""

    rid: Any
    positions: np.ndarray
    stop: int
    table: np.ndarray | None
    load: Any = None


def refuse_unheld(config: ModelConfig, layer: int, item: Item, head_rows: np.ndarray, heads: range,
                  block_size: int) -> None:
    """Raise if a query of ``item`` sees, in ``layer``, a token whose block the table of one of ``heads`` (the
    model's kv heads the caller holds; ``head_rows`` gives its rows) no longer holds."""
    keys = np.arange(item.stop)
    held = item.table[head_rows[layer]][:, keys // block_size] >= 0  # [heads, keys]
    lost = np.flatnonzero(~held.all(axis=0))
    if not len(lost):
        return
    seen = visible(config, layer, item.positions, keys[lost])[heads.start:heads.stop]  # [heads, queries, lost]
    if (seen & ~held[:, None, lost]).any():
        raise RuntimeError(f"layer {layer}: a query of request {item.rid!r} sees a token in a block its table no "
                           "longer holds")


class RankAttention:
    """A TP rank's attention: it stores the step's K and V of its kv heads in its ``PagedCache`` and attends its
    query heads over the blocks each request's table names (one rank holding every head without TP)."""

    reads_tables = True  # the engine hands it each request's table (TP ranks read their own)

    def __init__(self, model: Model, paged: PagedCache, head_rows: np.ndarray, heads: range) -> None:
        self.model, self.paged, self.head_rows, self.heads = model, paged, head_rows, heads

    def __call__(self, layer: int, q: Any, kv: tuple[Any, ...], items: list[Item]) -> Any:
        """q [n, the rank's query heads, d] and kv (the rank's heads) of the step's items, in order."""
        outs, lo = [], 0
        for item in items:
            hi = lo + len(item.positions)
            if item.load is not None and item.load.wait(layer, timeout=10).value != "done":
                raise RuntimeError(f"layer {layer}: the host tier's copy did not land")
            self.paged.write(layer, item.table, self.head_rows, item.positions, tuple(x[lo:hi] for x in kv))
            refuse_unheld(self.model.config, layer, item, self.head_rows, self.heads, self.paged.block_size)
            cached = self.paged.gather(layer, item.table, self.head_rows, item.stop)
            mask = visible(self.model.config, layer, item.positions, np.arange(item.stop))
            outs.append(self.model.attention(layer, q[lo:hi], cached, mask[self.heads.start:self.heads.stop]))
            lo = hi
        return self.model.ops.cat(outs, axis=0)

"""Tensors in, tokens out: one forward of the model over a step's scheduled tokens, attention over the cache.

The runner lays the step's requests side by side (``Item``s: positions, table, the host tier's copy to wait
for), runs ``Model.forward`` with attention by ``attention(layer, q, kv, items)`` (``RankAttention`` on the CPU,
``gpu.FlexAttention`` on a GPU, ``tp.TPAttention`` over TP ranks), and samples greedily where a request reached
the end of its tokens.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from attention import Item
from model import Model
from scheduler import Scheduled


class ModelRunner:
    """The model and its attention over the cache; ``run`` is one step's forward."""

    def __init__(self, model: Model, attention: Any, keep_logits: bool = True) -> None:
        """``keep_logits`` brings each sampled token's logits to the host, for comparing; without it only the
        sampled tokens leave the device."""
        self.model, self.attention, self.keep_logits = model, attention, keep_logits
        # PD prefill: ``on_step(items)`` runs before a step's layers and ``on_layer(layer)`` after each layer's K
        # and V are written (the messager's layer signal).
        self.on_step: Callable[[list[Item]], None] | None = None
        self.on_layer: Callable[[int], None] | None = None

    def run(self, work: list[Scheduled], tables: list[np.ndarray | None],
            loads: list[Any]) -> tuple[list[int], np.ndarray, np.ndarray | None]:
        """Forward ``work`` (each item reading ``tables[i]``, waiting for ``loads[i]``): the indices of the items
        that reached the end of their tokens, the token each sampled, and the logits it came from (if kept)."""
        tokens = np.concatenate([np.asarray(w.seq.tokens[w.start:w.stop]) for w in work])
        positions = np.concatenate([np.arange(w.start, w.stop) for w in work])
        bounds = np.cumsum([0] + [w.stop - w.start for w in work])
        items = [Item(w.seq.rid, positions[bounds[i]:bounds[i + 1]], w.stop, table, load)
                 for i, (w, table, load) in enumerate(zip(work, tables, loads))]

        def attend(layer: int, q: Any, kv: tuple[Any, ...]) -> Any:
            out = self.attention(layer, q, kv, items)
            if self.on_layer is not None:
                self.on_layer(layer)
            return out

        if self.on_step is not None:
            self.on_step(items)
        ends = [i for i, w in enumerate(work) if w.stop == len(w.seq.tokens)]
        logits_at = bounds[1:][ends] - 1
        if not self.keep_logits:
            return ends, self.model.forward(tokens, positions, attend, logits_at, greedy=True), None
        logits = self.model.forward(tokens, positions, attend, logits_at)
        if np.isnan(logits).any():
            raise RuntimeError("NaN logits: attention read a block the table no longer holds")
        return ends, logits.argmax(axis=-1), logits

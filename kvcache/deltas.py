"""The daemon's table deltas: staged as messages apply, encoded once durable, the recent ones kept for replay.

A delta is what one message changed in the workers' tables::

    seq      its number: one more than the last delta's, within the daemon's epoch
    freed    requests whose tables went, listed before the changes
    changes  per changed request: its slot, its table's new width, and the columns set (all, for an admit)
    reset    whether the prefix cache was reset
    tier     host-tier copies the workers run (kvcache.host_tier), with the tables they fill

Its life, all in the daemon's one thread: ``stage`` numbers it when its message
is applied (its arrays are copies nothing changes later); ``encode_staged``
packs it once the turn's journal commit made it durable and the replies went
out, keeping it for replay; the daemon's endpoints send it. A worker that
missed some asks the replay socket, which answers with ``since``'s deltas, or a
snapshot of every table when they are no longer kept.
"""
from __future__ import annotations

import collections
import itertools
import os
import time
from typing import Any

import numpy as np

from kvcache.protocol import PROTOCOL_VERSION, pack_delta


class Changes:
    """One delta's table changes in op order, gathered in pieces and joined once into the wire's compressed rows."""

    def __init__(self) -> None:
        self.reqs: list[Any] = []
        self.slots: list[int] = []
        self.lens: list[int] = []
        self.sizes: list[int] = []  # columns per change
        self.cols: list[np.ndarray] = []  # pieces: one per admit or extend, one per extend_many
        self.vals: list[np.ndarray] = []
        self.touched: set[Any] = set()  # requests with a change here: freeing one starts a new delta

    def __len__(self) -> int:
        return len(self.reqs)

    def add(self, req: Any, slot: int, length: int, cols: np.ndarray, vals: np.ndarray) -> None:
        """One request's change: ``cols`` of its table, now ``length`` wide, set to ``vals`` (a copy, not a view)."""
        self.add_many([req], [slot], [length], [cols.size], cols, vals)

    def add_many(self, reqs: list[Any], slots: list[int], lens: list[int], sizes: list[int], cols: np.ndarray,
                 vals: np.ndarray) -> None:
        """Changes of several requests whose columns lie back to back in ``cols`` and ``vals``."""
        self.reqs += reqs
        self.slots += slots
        self.lens += lens
        self.sizes += sizes
        self.cols.append(cols)
        self.vals.append(vals)
        self.touched.update(reqs)

    def wire(self, rows: int) -> dict[str, Any]:
        """The protocol's ``changes`` block: per-change lists and arrays, columns and values concatenated."""
        offsets = np.fromiter(itertools.accumulate(self.sizes, initial=0), dtype=np.int32, count=len(self.sizes) + 1)
        if len(self.cols) == 1:
            cols, vals = self.cols[0], self.vals[0]
        elif self.cols:
            cols, vals = np.concatenate(self.cols), np.concatenate(self.vals, axis=1)
        else:
            cols, vals = np.empty(0, dtype=np.int32), np.empty((rows, 0), dtype=np.int32)
        return {"reqs": self.reqs, "slots": np.array(self.slots, dtype=np.int32),
                "lens": np.array(self.lens, dtype=np.int32), "offsets": offsets,
                "cols": cols.astype(np.int32, copy=False), "vals": vals.astype(np.int32, copy=False)}


# What a message's apply hands on to be staged: its changes, freed requests, whether it reset the prefix cache,
# and the host-tier copies ordered with it.
Delta = tuple[Changes, list[Any], bool, list[dict[str, Any]]]


class DeltaStream:
    """The daemon's deltas, numbered by ``seq`` within its ``epoch``: staged, then encoded and kept for replay.

    The history keeps at most ``replay_buffer`` deltas and ``replay_bytes`` of them, the oldest dropped first (the
    newest always stays). ``totals`` counts the deltas, changes and payload bytes encoded since the metrics last
    took them.
    """

    def __init__(self, replay_buffer: int, replay_bytes: int) -> None:
        self.seq = -1
        # A new epoch per daemon incarnation: workers that see it change drop their tables and resync. A journal
        # keeps it across restarts (kvcache.durability).
        self.epoch = int.from_bytes(os.urandom(8), "big") >> 1
        self.replay_buffer = replay_buffer
        self.replay_bytes = replay_bytes
        # Deltas numbered but not yet encoded or sent (not yet durable, or not yet answered): seq, changes, freed,
        # reset, host-tier orders
        self.staged: list[tuple[int, Changes, list[Any], bool, list[dict[str, Any]]]] = []
        self.history: collections.deque[tuple[int, bytearray]] = collections.deque()  # for replay, oldest first
        self.history_bytes = 0
        self.totals = [0, 0, 0]  # deltas, changes and payload bytes encoded since the metrics took them

    def stage(self, changes: Changes, freed: list[Any], reset: bool, orders: list[dict[str, Any]]) -> None:
        """Number a delta; it is encoded, kept for replay and sent once its message is durable and answered.

        Its arrays are copies that nothing changes later (the reply shares them), so encoding it after
        the turn's other messages were applied gives the same bytes.
        """
        self.seq += 1
        self.staged.append((self.seq, changes, freed, reset, orders))

    def encode_staged(self, rows: int) -> list[tuple[int, bytearray]]:
        """The staged deltas encoded (with ``"t"`` now) and kept for replay, in seq order; empties the stage.

        ``rows``: the manager's rows, the height of a delta's values when it changes no table."""
        encoded = []
        for seq, changes, freed, reset, orders in self.staged:
            delta = {"v": PROTOCOL_VERSION, "epoch": self.epoch, "seq": seq, "changes": changes.wire(rows),
                     "freed": freed, "reset": reset}
            if orders:
                delta["tier"] = orders
            payload = pack_delta(delta, time.monotonic_ns())
            self._remember(seq, payload)
            encoded.append((seq, payload))
            totals = self.totals
            totals[0] += 1
            totals[1] += len(changes)
            totals[2] += len(payload)
        self.staged.clear()
        return encoded

    def _remember(self, seq: int, payload: bytearray) -> None:
        """Keep a delta for replay, dropping the oldest past ``replay_buffer`` deltas or ``replay_bytes`` (the newest
        always stays)."""
        history = self.history
        history.append((seq, payload))
        self.history_bytes += len(payload)
        while len(history) > 1 and (len(history) > self.replay_buffer or self.history_bytes > self.replay_bytes):
            self.history_bytes -= len(history.popleft()[1])

    def since(self, start: int) -> list[bytearray] | None:
        """The kept deltas from seq ``start`` on, oldest first (none when ``start`` is past the last one), or None
        when some of them are no longer kept: the worker then needs a snapshot of every table."""
        oldest = self.history[0][0] if self.history else self.seq + 1
        if start > self.seq:
            return []
        if start >= oldest:
            return [payload for _, payload in list(self.history)[start - oldest:]]
        return None

"""LayerSignal: "layer L of step S is written", from the worker's CUDA stream to the cache messager.

One small record in POSIX shared memory (/dev/shm/<name>) per (rank, device). The worker creates
it and, after each layer's cache write, calls ``kvcache.ops.send_cache(stream, signal, layer)``;
the messager opens it by name and ``wait(layer, step)``s, sleeping in the kernel (futex, GIL
released) until the GPU has finished that layer. The record holds the step counter, the newest
step's highest completed layer, and every layer's last completion time (for metrics).

    worker (writer)                          messager (waiter)
    sig = LayerSignal.create(name, L)        sig = LayerSignal.open(name)
    step = sig.begin_step()                  (learns step from the scheduler, or sig.step)
    for layer in range(L):
        attention(...); write_cache(...)
        send_cache(stream, sig, layer)  ---> sig.wait(layer, step) -> DONE: send layer's blocks

Steps are uint32 and wrap; they compare by serial-number arithmetic, so a waiter may pass any
int (it is taken mod 2**32). A waiter never burns CPU: it sleeps until woken, waking every
``liveness_interval`` of no progress to check that the writer's process still exists, so a
crashed writer yields WRITER_DEAD instead of a hang.
"""
from __future__ import annotations

import enum
import os
import weakref
from typing import NamedTuple

import numpy as np

from kvcache.ops import Record, unlink

__all__ = ["LayerSignal", "LayerTimes", "Progress", "WaitStatus", "signal_name"]

STEP_MOD = 1 << 32


class WaitStatus(enum.IntEnum):
    """Outcome of LayerSignal.wait."""

    DONE = 0  # the layer completed in exactly the step asked for
    TIMEOUT = 1  # the deadline passed, the writer alive
    WRITER_DEAD = 2  # the writer closed, exited or crashed, and the layer is not done
    STALE = 3  # the layer has since completed a later step: the step asked for is behind the writer


_STATUS = tuple(WaitStatus)


class Progress(NamedTuple):
    """The newest step with a completion (or begun), its highest completed layer (-1: none), and when the step began."""

    step: int
    last_layer: int
    step_begin_ns: int


class LayerTimes(NamedTuple):
    """Each layer's last completion: its step (int64, -1 = never) and CLOCK_MONOTONIC ns (int64, 0 = never)."""

    steps: np.ndarray
    done_ns: np.ndarray


def signal_name(rank: int, device: int, prefix: str = "kvcache") -> str:
    """The conventional shared-memory name of the layer signal of (rank, device)."""
    return f"{prefix}-layers-r{rank}-d{device}"


def _release(record: Record, name: str, creator_pid: int | None) -> None:
    """Close the mapping; the creating process also removes the name (runs at close, collection or exit).

    A child forked from the creator inherits the object but must not remove the creator's record.
    """
    record.close()
    if creator_pid == os.getpid():
        unlink(name)


class LayerSignal:
    """Per-layer completion of the current step, shared by one writer process and any number of waiters.

    The creator removes /dev/shm/<name> when it closes, is collected, or its interpreter exits;
    processes that opened it keep a valid mapping until they close. A writer killed with
    SIGKILL leaves the name behind: ``create(..., replace=True)`` takes it over.
    """

    def __init__(self, record: Record, owner: bool) -> None:
        """Wrap a Record; use create() or open()."""
        self.record = record
        self.owner = owner
        self._finalizer = weakref.finalize(self, _release, record, record.name, os.getpid() if owner else None)

    @classmethod
    def create(cls, name: str, num_layers: int, *, start_step: int = 0, replace: bool = False,
               mode: int = 0o600) -> LayerSignal:
        """Create the record (FileExistsError if the name is taken, unless ``replace``); this process is its writer.

        ``replace`` removes an old record of that name first (one left by a crashed worker):
        waiters still mapping the old one get WRITER_DEAD from it and should open the new one.
        """
        if replace:
            unlink(name)
        return cls(Record.create(name, num_layers, start_step % STEP_MOD, mode), owner=True)

    @classmethod
    def open(cls, name: str) -> LayerSignal:
        """Map an existing record by name (FileNotFoundError if there is none)."""
        return cls(Record.open(name), owner=False)

    @staticmethod
    def remove(name: str) -> bool:
        """Remove a record's name without opening it (cleanup after a crash); False if there was none."""
        return unlink(name)

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def num_layers(self) -> int:
        return self.record.num_layers

    @property
    def step(self) -> int:
        """The current step, in [0, 2**32)."""
        return self.record.step

    @property
    def writer_pid(self) -> int:
        return self.record.writer_pid

    @property
    def writer_alive(self) -> bool:
        """False once the writer has closed the record or its process has gone."""
        return self.record.writer_alive

    @property
    def closed(self) -> bool:
        return self.record.closed

    def begin_step(self) -> int:
        """Start the next step on the CPU and return it; layers already queued keep the step they were queued in."""
        return self.record.begin_step()

    def complete(self, layer: int) -> None:
        """Mark ``layer`` of the current step complete now (the CPU path of send_cache)."""
        self.record.mark(layer)

    def wait(self, layer: int, step: int, timeout: float | None = None, *,
             liveness_interval: float = 0.5) -> WaitStatus:
        """Block until ``layer`` of ``step`` is complete; return at once if it already is.

        Returns DONE, TIMEOUT after ``timeout`` seconds (None: no limit), WRITER_DEAD within
        about ``liveness_interval`` of the writer going away, or STALE if the layer has since
        completed a later step. Sleeps in the kernel with the GIL released; Ctrl-C interrupts it.
        """
        return _STATUS[self.record.wait(layer, step % STEP_MOD, -1.0 if timeout is None else timeout,
                                        liveness_interval)]

    def progress(self) -> Progress:
        """The newest step, its highest completed layer and when it began; a cheap poll for dashboards."""
        step, layers_done, begin_ns = self.record.progress()
        return Progress(step, layers_done - 1, begin_ns)

    def layer_times(self) -> LayerTimes:
        """Every layer's last completion step and time, for per-layer latency metrics."""
        steps, done_ns = self.record.layer_times()
        return LayerTimes(np.frombuffer(steps, dtype=np.int64), np.frombuffer(done_ns, dtype=np.int64))

    def claim_writer(self) -> None:
        """Make this process the writer whose death waiters detect (when the record was made by another)."""
        self.record.claim_writer()

    def close(self) -> None:
        """Unmap (after any queued send_cache has run); the creator also removes the name. Idempotent."""
        self._finalizer()

    def __enter__(self) -> LayerSignal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return f"LayerSignal({self.name!r}, closed)"
        return f"LayerSignal({self.name!r}, num_layers={self.num_layers}, step={self.step}, writer_pid={self.writer_pid})"

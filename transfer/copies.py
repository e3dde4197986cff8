"""Copies decided on one thread and started on another: the decision costs its caller microseconds.

A host tier decides inside the scheduler's call what to copy (which GPU blocks to which host
blocks); working out the byte ranges and launching the per-layer transfers takes milliseconds
for a long request. So the call records a ``Copy`` and hands it to a ``Submitter``, whose
thread starts the copies in the order they were recorded::

    owner thread:   free()/admit() -> Copy(deadline) -> submitter.put(copy, start)   (returns at once)
    submit thread:  start(seconds left) -> one transfer per layer on an in-order engine
    any thread:     copy.wait(layer) / copy.status()   (PENDING until started, then the layer's transfer)

A copy never outlives its deadline: one still unstarted when it passes is TIMEOUT and never
starts; one started gets transfers with the same deadline.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from kvcache.transfer.engines import TransferHandle, TransferStatus

__all__ = ["Copy", "Submitter", "worst"]

log = logging.getLogger("kvcache.transfer.copies")

# A copy whose start began just before its deadline gets its transfers within this (its ranges are being worked
# out); they carry the same deadline, so they are TIMEOUT by then at the latest.
_START_GRACE = 5.0


def worst(statuses: object) -> TransferStatus:
    """FAILED over TIMEOUT over PENDING over DONE."""
    seen = set(statuses)  # type: ignore[call-overload]
    for status in (TransferStatus.FAILED, TransferStatus.TIMEOUT, TransferStatus.PENDING):
        if status in seen:
            return status
    return TransferStatus.DONE


class Copy:
    """One copy of ``num_layers`` layers that a ``Submitter`` starts: one transfer per layer, ended in layer order.

    Until started it is PENDING, and TIMEOUT once ``deadline`` (``time.monotonic()`` seconds) passes unstarted
    (then it never starts). A start that raised makes every layer FAILED. Every method may be called from any
    thread; ``wait`` never blocks past the deadline.
    """

    def __init__(self, num_layers: int, deadline: float) -> None:
        self.num_layers = int(num_layers)
        self.deadline = deadline
        self._handles: list[TransferHandle] | None = None
        self._state = "queued"  # -> "starting" -> "started", or -> "expired" (never started)
        self._error = ""
        self._lock = threading.Lock()
        # Held until the copy is started or expires: waiters take it and hand it on (cheaper to make than an Event,
        # and a copy is made inside the scheduler's call).
        self._gate = threading.Lock()
        self._gate.acquire()

    def start(self, launch: Callable[[float], list[TransferHandle]]) -> None:
        """Start the transfers (the submit thread): ``launch(seconds left)`` returns one handle per layer."""
        with self._lock:
            if self._state != "queued":
                return
            left = self.deadline - time.monotonic()
            if left <= 0:
                self._expire()
                return
            self._state = "starting"
        try:
            handles = launch(left)
            if len(handles) != self.num_layers:
                raise RuntimeError(f"{len(handles)} transfers for {self.num_layers} layers")
        except Exception as exc:  # the copy fails; the thread that started it goes on
            log.error("copy of %d layers could not start: %s", self.num_layers, exc)
            with self._lock:
                self._error = f"could not start: {exc}"
                self._state = "failed"
        else:
            self._handles = handles
            self._state = "started"
        self._gate.release()

    def status(self, layer: int | None = None) -> TransferStatus:
        """The worst status of the layer's transfer (every layer's when None), without blocking."""
        handles = self._handles
        if handles is None:
            with self._lock:
                if self._state == "queued" and time.monotonic() >= self.deadline:
                    self._expire()
                state = self._state
            if state == "expired":
                return TransferStatus.TIMEOUT
            if state == "failed":
                return TransferStatus.FAILED
            handles = self._handles
            if handles is None:
                return TransferStatus.PENDING
        if layer is None:
            return worst(h.status() for h in handles)
        return handles[layer].status()

    def ended(self) -> bool:
        """True once every layer's transfer has finished, well or not (or the copy never started)."""
        handles = self._handles
        if handles is None:
            return self.status() is not TransferStatus.PENDING
        return all(h.status().finished for h in handles)

    def wait(self, layer: int | None = None, timeout: float | None = None) -> TransferStatus:
        """Block until the layer's transfer (every layer's when None) ended, ``timeout`` passes (PENDING), or the
        deadline; returns ``status(layer)``."""
        now = time.monotonic()
        end = self.deadline if timeout is None else min(self.deadline, now + timeout)
        if self._handles is None:
            self._pass_gate(max(0.0, end - now))
            if self._handles is None and timeout is None and self.status() is TransferStatus.PENDING:
                self._pass_gate(_START_GRACE)  # starting at its deadline: its transfers end by the same one
            if self._handles is None:
                return self.status(layer)
        handles = self._handles if layer is None else [self._handles[layer]]
        for handle in handles:
            left = None if timeout is None else max(0.0, end - time.monotonic())
            if handle.wait(left) is TransferStatus.PENDING:
                return TransferStatus.PENDING
        return self.status(layer)

    @property
    def error(self) -> str:
        """Why the copy did not end well: the first transfer's error, else its worst status's name ("" when DONE)."""
        handles = self._handles
        if handles is None:
            status = self.status()
            return self._error or ("" if status is TransferStatus.PENDING else
                                   f"not started by its deadline ({self.num_layers} layers)")
        status = worst(h.status() for h in handles)
        if status is TransferStatus.DONE:
            return ""
        return next((h.error for h in handles if h.error), status.value)

    def _expire(self) -> None:
        """Unstarted at its deadline (the lock held): it never starts."""
        self._state = "expired"
        self._gate.release()

    def _pass_gate(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the copy to start or expire."""
        if self._gate.acquire(timeout=timeout):
            self._gate.release()

    def __repr__(self) -> str:
        return f"Copy({self.num_layers} layers, {self.status().value})"


class Submitter:
    """A thread that starts recorded copies one at a time, in the order they were put, so none waits for its caller.

    Copies put on one submitter reach their engines in that order: copies on one in-order engine run in it.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def put(self, copy: Copy, launch: Callable[[float], list[TransferHandle]]) -> Copy:
        """Start ``copy`` with ``launch`` once those put before it have started; returns it at once."""
        if self._closed:
            copy.start(_closed)
        else:
            self._queue.put((copy, launch))
        return copy

    def close(self, timeout: float) -> None:
        """Start what was put (unstarted copies past their deadline are TIMEOUT), then stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            copy, launch = item
            copy.start(launch)


def _closed(left: float) -> list[TransferHandle]:
    raise RuntimeError("the submitter is closed")

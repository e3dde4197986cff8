"""What every transfer engine guarantees: ``TransferEngine``, the ``TransferHandle`` it returns, ``TransferStatus``.

The engines (``engines.py``, ``nixl.py``) and the CUDA handle (``cuda.py``) build on these;
``kvcache.transfer.engines`` and ``kvcache.transfer`` export them too.
"""
from __future__ import annotations

import enum
import threading
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from kvcache.allocator.errors import KVCacheError

if TYPE_CHECKING:
    from kvcache.transfer.regions import KVRegion

__all__ = ["DEFAULT_TIMEOUT", "TransferEngine", "TransferHandle", "TransferStatus"]

DEFAULT_TIMEOUT = 30.0


class TransferStatus(str, enum.Enum):
    """Where a transfer stands; every status but PENDING is final."""

    PENDING = "pending"
    DONE = "done"  # every byte has landed
    FAILED = "failed"  # an error stopped it; TransferHandle.error says which
    TIMEOUT = "timeout"  # its deadline passed first

    @property
    def finished(self) -> bool:
        return self is not TransferStatus.PENDING


class TransferHandle(ABC):
    """One transfer in flight: poll it with ``done()``/``status()``, or ``wait`` for it; it never outlives its deadline.

    Once the deadline (``time.monotonic()`` seconds) passes, a transfer that has not finished
    is TIMEOUT; a FAILED or TIMEOUT transfer may have written part of its destination blocks.
    """

    max_poll_interval = 1e-3  # seconds between looks while waiting, reached by doubling from 20 µs

    def __init__(self, nbytes: int, num_ranges: int, deadline: float) -> None:
        self.nbytes = nbytes
        self.num_ranges = num_ranges
        self.deadline = deadline
        self._status = TransferStatus.PENDING
        self._error: str | None = None
        # Threads may look at one handle together (a worker waiting on a layer while the tier's owner settles
        # it): one look at a time, so a finished copy's resources (a CUDA event) are released once, never used after.
        self._looking = threading.Lock()

    @abstractmethod
    def _poll(self) -> None:
        """Look at the transfer once; on completion call ``_finish``."""

    def _expire(self) -> None:
        """The deadline passed unfinished: stop what can be stopped and release what it holds."""

    def _finish(self, status: TransferStatus, error: str | None = None) -> None:
        if self._status is TransferStatus.PENDING:
            self._status, self._error = status, error

    def _sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    @property
    def error(self) -> str | None:
        """Why the transfer FAILED or timed out; None while pending or when DONE."""
        return self._error

    def status(self) -> TransferStatus:
        """The current status, without blocking; safe from several threads."""
        if self._status is TransferStatus.PENDING:
            with self._looking:
                if self._status is TransferStatus.PENDING:
                    self._poll()
                if self._status is TransferStatus.PENDING and time.monotonic() >= self.deadline:
                    self._expire()
                    self._finish(TransferStatus.TIMEOUT, f"not finished by its deadline ({self.nbytes:,} bytes in "
                                                         f"{self.num_ranges:,} ranges)")
        return self._status

    def done(self) -> bool:
        """True once the transfer has finished, well or not."""
        return self.status().finished

    def wait(self, timeout: float | None = None) -> TransferStatus:
        """Block until finished, ``timeout`` seconds pass (then PENDING), or the deadline (then TIMEOUT)."""
        end = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
        delay = 20e-6
        while True:
            status = self.status()
            now = time.monotonic()
            if status.finished or now >= end:
                return status
            self._sleep(min(delay, end - now))
            delay = min(delay * 2, self.max_poll_interval)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._status.value}, {self.nbytes:,} bytes, {self.num_ranges:,} ranges)"


class TransferEngine(ABC):
    """Moves lists of KV blocks from one registered region to another.

    Guarantees of every engine:
    - ``write`` checks its arguments (ids, rows, layers, matching specs) and raises KVCacheError
      before anything moves; otherwise it returns a handle at once and the copy runs in the
      background. Only the listed (block, row) units of the listed layers are written.
    - Every transfer has a deadline (``timeout`` seconds, or the engine's default); a handle's
      ``wait`` never blocks past it, and a transfer not done by then is TIMEOUT. Errors, such as a
      peer that died, make it FAILED with a message; neither hangs the caller.
    - ``close`` releases whatever the engine registered, pinned or connected; it is idempotent.
    """

    timeout: float = DEFAULT_TIMEOUT

    def register(self, region: KVRegion) -> None:
        """Prepare a local region for transfers (pin or register its memory); writes do it when needed."""

    def deregister(self, region: KVRegion) -> None:
        """Undo ``register`` for a region that is about to be freed."""

    @abstractmethod
    def write(self, src_region: KVRegion, src_blocks: Any, dst_region: KVRegion, dst_blocks: Any,
              layers: Any = None, rows: Any = None, *, timeout: float | None = None) -> TransferHandle:
        """Copy ``src_blocks`` of ``src_region`` onto ``dst_blocks`` of ``dst_region`` (see ``copy_ranges``)."""

    def close(self) -> None:
        """Release everything the engine holds."""

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _deadline(self, timeout: float | None) -> float:
        seconds = self.timeout if timeout is None else timeout
        if not seconds > 0:
            raise KVCacheError(f"timeout must be positive seconds, got {timeout!r}")
        return time.monotonic() + seconds

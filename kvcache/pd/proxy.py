"""The scheduler's side of a PD pair: a request reserved on the decode daemon, then admitted on the prefill one."""
from __future__ import annotations

from typing import Any

from kvcache.client import CacheClient, DaemonError


class PDProxy:
    """The scheduler's side of a PD pair: reserve on decode, then admit on prefill with that destination.

    As vLLM's PD proxy does. ``cancel`` gives a request up on both daemons; outcomes reach each
    side's scheduler through its own ``pd_poll`` (this proxy's clients own the requests here).
    """

    def __init__(self, prefill: CacheClient, decode: CacheClient, *, timeout: float | None = None) -> None:
        self.prefill, self.decode, self.timeout = prefill, decode, timeout

    def submit(self, request_id: Any, prompt_tokens: Any, **options: Any) -> tuple[Any, Any] | None:
        """(Reservation, Admission) for a new request, or None when either side lacks blocks (nothing is left held)."""
        reservation = self.decode.reserve(request_id, prompt_tokens, timeout=self.timeout, **options)
        if reservation is None:
            return None
        try:
            admission = self.prefill.admit(request_id, prompt_tokens,
                                           dest=reservation.dest(self.decode.endpoint, self.timeout), **options)
        except BaseException:
            self._cancel_decode(request_id)
            raise
        if admission is None:
            self._cancel_decode(request_id)
            return None
        return reservation, admission

    def cancel(self, request_id: Any) -> None:
        """Give the request up on both sides (either may have finished or failed it already)."""
        for client in (self.prefill, self.decode):
            try:
                client.cancel(request_id)
            except DaemonError:
                pass  # not in transfer there any more

    def _cancel_decode(self, request_id: Any) -> None:
        try:
            self.decode.cancel(request_id, release=True)
        except DaemonError:
            pass

"""Leases: which scheduler owns each request, and which schedulers have gone silent.

A scheduler (a CacheClient name) owns the requests it admitted, and those it
first gave scheduler-owned blocks. Every message it sends renews its lease; one
silent for longer than the lease timeout has its requests freed (their owned
blocks released) by the daemon, so its blocks return. A
restarted scheduler reclaims its requests by id (or simply reuses its name).
Pure bookkeeping: no clocks of its own, no I/O; the daemon passes ``now``.
"""
from __future__ import annotations

from typing import Any, Iterable


class Leases:
    """Owners of live requests and the last time each owner was heard from."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout  # seconds of silence before a lease expires; 0 turns expiry off
        self._owner: dict[Any, str] = {}
        self._owned: dict[str, set[Any]] = {}
        self._seen: dict[str, float] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Journal snapshots keep owners, not times: after a restart every lease starts afresh."""
        return {"timeout": self.timeout, "_owner": self._owner, "_owned": self._owned, "_seen": {}}

    def touch(self, client: str, now: float) -> None:
        """``client`` was heard from at ``now``."""
        self._seen[client] = now

    def own(self, client: str, request_id: Any) -> None:
        """``client`` admitted ``request_id``."""
        self._owner[request_id] = client
        self._owned.setdefault(client, set()).add(request_id)

    def release(self, request_id: Any) -> None:
        """``request_id`` was freed (by anyone)."""
        client = self._owner.pop(request_id, None)
        if client is not None:
            owned = self._owned[client]
            owned.discard(request_id)
            if not owned:
                del self._owned[client]

    def owner(self, request_id: Any) -> str | None:
        return self._owner.get(request_id)

    def owned(self, client: str) -> list[Any]:
        """The live requests ``client`` owns, in no particular order."""
        return list(self._owned.get(client, ()))

    def count(self, client: str) -> int:
        """How many live requests ``client`` owns."""
        return len(self._owned.get(client, ()))

    def reclaim(self, client: str, request_ids: Iterable[Any], now: float) -> list[Any]:
        """Make ``client`` the owner of the given live requests; returns those it now owns."""
        taken = []
        for rid in request_ids:
            if rid in self._owner:
                self.release(rid)
                self.own(client, rid)
                taken.append(rid)
        self.touch(client, now)
        return taken

    def expired(self, now: float) -> list[tuple[str, list[Any]]]:
        """Owners silent for longer than the timeout, with their requests (oldest silence first).

        An owner never heard from since the daemon (re)started counts from the
        first call after it; expiry is off with a timeout of 0.
        """
        if self.timeout <= 0:
            return []
        out = []
        for client in list(self._owned):
            seen = self._seen.setdefault(client, now)
            if now - seen > self.timeout:
                out.append((seen, client))
        return [(client, sorted(self._owned[client], key=repr)) for _, client in sorted(out, key=lambda x: x[0])]

    def forget(self, client: str) -> None:
        """Drop an owner's lease record (after its requests were freed)."""
        self._seen.pop(client, None)

"""The daemon's durability: its journal recovered at start, committed once per turn, compacted into snapshots.

With ``--journal DIR`` (kvcache.journal holds the files) a restart finds what
was acknowledged before it:

- ``Durability.open`` takes the journal's snapshot and replays the messages
  logged after it through the state machine, as they were accepted (the
  limits of their day), then checks that the state is whole and fits this
  configuration, or refuses to start naming the setting;
- ``commit`` makes a turn's messages durable with one fdatasync, before any
  of their replies or deltas leave;
- ``compact`` writes a new snapshot once the log passes ``--snapshot-bytes``.

Snapshots hold the daemon's state through ``STATE_CODEC``: instances of the
listed classes only, no code run on load (kvcache.state_codec). A class's
qualified name is written in every snapshot, so renaming one listed here
makes older journals unreadable.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from kvcache import __version__
from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.manager import KVCacheManager, _Request
from kvcache.allocator.owned import _Owned
from kvcache.allocator.pool import BlockPool
from kvcache.allocator.prefix import BlockHasher, Inserted, MMPlaceholder, PrefixIndex
from kvcache.allocator.swa import Chunked, Full, Window
from kvcache.config import ServeConfig
from kvcache.daemon_state import DaemonState, _RetryCache, _Slots
from kvcache.host_tier import DaemonTier, TierJob
from kvcache.journal import Journal, JournalFull, Recovered
from kvcache.leases import Leases
from kvcache.pd.state import PDState, Transfer
from kvcache.protocol import unpack
from kvcache.state_codec import StateCodec

log = logging.getLogger("kvcache.server")
# Settings a journal records: its records are replayed under the first three (the limits they were accepted
# with); the recovered state must fit the rest (_fit_settings).
_REPLAY_SETTINGS = ("max_tokens", "max_message_bytes", "max_slots")
_JOURNALED_SETTINGS = (*_REPLAY_SETTINGS, "role", "tp")
SNAPSHOT_RETRY_S = 10.0  # a snapshot that found the disk full is tried again after this long


class Durability:
    """The journal of one ``DaemonState``: recovery, group commit and snapshots (no journal: commit does nothing).

    ``journal`` is None until ``open``; the state machine appends to it (``DaemonState.journal``) as it applies
    messages, and this commits them.
    """

    def __init__(self, state: DaemonState) -> None:
        self.state = state
        self.journal: Journal | None = None
        self._next_snapshot = 0.0  # time.monotonic() before which a snapshot that found the disk full is not retried

    def open(self) -> None:
        """Open the journal: load its snapshot and replay the messages after it, or start a new one.

        A journal keeps the daemon's epoch, so workers keep their tables across
        the restart: every delta they saw was durable before it was sent. The
        messages are replayed under the limits they were accepted with; the
        recovered state must then fit this configuration, or the daemon refuses
        to start, naming the setting. Nothing acknowledged is ever dropped.
        """
        state, folder = self.state, self.state.config.journal
        self.journal = state.journal = Journal(folder)
        recovered = self.journal.open()
        if recovered.snapshot is None:
            self.journal.write_snapshot(self.saved())
            log.info("journal %s: new", folder)
            return
        journaled = self.restore(recovered)
        if any(journaled[name] != getattr(state.config, name) for name in _JOURNALED_SETTINGS):
            self.journal.write_snapshot(self.saved())  # later records follow this configuration's limits
        if recovered.truncated_bytes:
            log.warning("journal %s: cut a torn tail of %d bytes after offset %d (a commit that was never "
                        "acknowledged)", folder, recovered.truncated_bytes, recovered.records_end)
        log.info("journal %s: recovered %d requests at seq %d (%d messages replayed)", folder, len(state.manager),
                 state.deltas.seq, len(recovered.records))

    def restore(self, recovered: Recovered) -> dict[str, Any]:
        """Take a journal's snapshot and replay its records as a restart does, checking that the state is whole
        and fits this configuration; returns the settings the journal was written with.

        ``kvcache journal check`` runs this same path, so what it calls recoverable is what a restart
        recovers. A snapshot whose parts disagree (damaged, or edited by hand) is refused, naming what, before
        its records are replayed over it.
        """
        assert recovered.snapshot is not None, "no snapshot to restore"
        try:
            journaled = self._restore(load_state(recovered.snapshot), recovered.records, recovered.snapshot_lsn)
            self._fit_settings(journaled)
            self._check_recovered("after its log is replayed")
        except KVCacheError:
            raise
        except Exception as exc:  # noqa: BLE001 - a snapshot's values reach code that trusts its own state
            raise KVCacheError(f"journal: the snapshot's state is malformed ({type(exc).__name__}: {exc}); the "
                               "journal is damaged or was edited") from None
        return journaled

    def _check_recovered(self, when: str) -> None:
        """Refuse a recovered state whose parts disagree, naming the first disagreement (the integrity checks)."""
        state = self.state
        manager = state.manager
        try:
            state.slots.check_integrity(manager)
            manager.check_integrity()
            state.pd.check_integrity(manager)
            if state.tier is not None:
                state.tier.check_integrity()
        except AssertionError as exc:
            raise KVCacheError(f"journal: the recovered state is inconsistent {when} ({exc}); the journal is "
                               "damaged or was edited; nothing was changed") from None

    def _restore(self, saved: dict[str, Any], records: list[bytes], snapshot_lsn: int) -> dict[str, Any]:
        """Take a snapshot's state and replay the records after it, under the limits they were accepted with;
        returns the settings the journal was written with."""
        state = self.state
        journaled = saved["settings"]
        check_compatible(saved["manager"], state.manager, state.config)
        saved["manager"].enable_events = state.manager.enable_events
        state.manager = saved["manager"]
        if isinstance(state.manager.tier, DaemonTier):
            state.manager.tier.bind(state.manager)
        state.slots, state.deltas.seq, state.deltas.epoch = saved["slots"], saved["seq"], saved["epoch"]
        state.retries, state.leases, state.pd = saved["retries"], saved["leases"], saved["pd"]
        state.leases.timeout = state.config.lease_timeout
        self._check_recovered("in its snapshot")  # before any record runs over it
        configured = state.config
        state.config = dataclasses.replace(configured, **{name: journaled[name] for name in _REPLAY_SETTINGS})
        try:
            for lsn, payload in enumerate(records, snapshot_lsn + 1):
                reply = unpack(state.process(payload, replaying=True), 1 << 40)
                if not reply.get("ok"):
                    raise KVCacheError(f"journal: record {lsn} was accepted when written but is refused on replay "
                                       f"({reply.get('error')}); the journal does not fit this version of kvcache")
        finally:
            state.config = configured
        state.deltas.encode_staged(state.manager.num_rows)  # kept for replay (workers may ask for them), never sent
        state.staged_events.clear()
        state.manager.take_events()
        state.pd.forget_timing()
        tier = state.tier
        if tier is not None:  # copies in flight get a full deadline from now (the clock restarted with us)
            tier.take_orders()
            end = time.monotonic() + state.config.tier_timeout
            state.tier_deadlines = {job: end for job in tier.pending_jobs()}
        return journaled

    def _fit_settings(self, journaled: dict[str, Any]) -> None:
        """Check that the recovered state fits this configuration and apply its limits, or refuse to start."""
        state = self.state
        cfg, pd = state.config, state.pd
        used = max(state.slots.owner, default=-1)
        if used >= cfg.max_slots:
            raise KVCacheError(f"max_slots: the journal's requests hold batch slot {used} (written with max_slots "
                               f"{journaled['max_slots']}), which {cfg.max_slots} does not reach; start with "
                               f"--max-slots {journaled['max_slots']}")
        state.slots.limit = cfg.max_slots
        if (cfg.role, cfg.tp) != (pd.role, pd.tp):
            name, old, new = ("role", pd.role, cfg.role) if cfg.role != pd.role else ("tp", pd.tp, cfg.tp)
            if pd.transfers:
                raise KVCacheError(f"{name}: the journal was written with {name} {old!r} and holds "
                                   f"{len(pd.transfers)} transfer(s) in flight, which {name} {new!r} cannot "
                                   f"carry on; start with --{name} {old} until they end")
            totals = pd.totals
            m = state.manager
            pd = state.pd = PDState(cfg.role, cfg.tp, m.num_rows, m.num_blocks, m.block_size, cfg.transfer_timeout)
            pd.totals = totals
        pd.timeout = cfg.transfer_timeout
        state.retries.limit(cfg.dedupe_window, cfg.dedupe_bytes)

    def saved(self) -> list[bytes | memoryview]:
        """Everything a restart needs, for a journal snapshot (as pieces to write in turn)."""
        state = self.state
        return dump_state({"manager": state.manager, "slots": state.slots, "seq": state.deltas.seq,
                           "epoch": state.deltas.epoch, "retries": state.retries, "leases": state.leases,
                           "pd": state.pd,
                           "settings": {name: getattr(state.config, name) for name in _JOURNALED_SETTINGS}})

    def commit(self) -> None:
        """Make the messages applied since the last commit durable (one fdatasync; nothing without a journal).

        Space was reserved before they were applied, so this fails only on an I/O error; the daemon then stops
        without answering them, and a restart recovers what was acknowledged.
        """
        if self.journal is not None:
            try:
                self.journal.commit()
            except OSError as exc:
                log.critical("journal %s: commit failed (%s); stopping without answering the messages it held",
                             self.state.config.journal, exc)
                raise KVCacheError(f"journal: commit failed: {exc}") from None

    def compact(self) -> None:
        """Write a snapshot once the log passes ``--snapshot-bytes``; on a full disk, try again after a while."""
        journal = self.journal
        if (journal is not None and journal.wal_bytes > self.state.config.snapshot_bytes
                and time.monotonic() >= self._next_snapshot):
            try:
                journal.write_snapshot(self.saved())
            except (JournalFull, OSError) as exc:  # the log still holds everything: nothing is lost
                self._next_snapshot = time.monotonic() + SNAPSHOT_RETRY_S
                log.warning("journal %s: snapshot not written (%s); it is tried again in %g s, the log grows "
                            "meanwhile", self.state.config.journal, exc, SNAPSHOT_RETRY_S)

    def close(self) -> None:
        """Close the journal and release its lock (the state machine appends nothing more)."""
        if self.journal is not None:
            self.journal.close()
            self.journal = self.state.journal = None


def check_compatible(journaled: KVCacheManager, configured: KVCacheManager, cfg: ServeConfig) -> None:
    """Refuse a journal written for another geometry or prefix hash, naming the setting that differs."""
    old_hasher, new_hasher = journaled.hasher, configured.hasher
    for name, old, new in (
        ("num_blocks", journaled.num_blocks, configured.num_blocks),
        ("block_size", journaled.block_size, configured.block_size),
        ("rows", journaled.rows, configured.rows),
        ("row_blocks", journaled.row_blocks.tolist(), configured.row_blocks.tolist()),
        ("enable_prefix_caching", journaled.enable_prefix_caching, configured.enable_prefix_caching),
        ("hash_algorithm", old_hasher and old_hasher.algorithm, new_hasher and new_hasher.algorithm),
    ):
        if old != new:
            raise KVCacheError(f"journal: {name} is {old!r} in the journal but {new!r} in this configuration")
    old_tier, new_tier = (m.tier.num_blocks if isinstance(m.tier, DaemonTier) else 0 for m in (journaled, configured))
    if old_tier != new_tier:
        raise KVCacheError(f"journal: the host tier holds {old_tier} blocks in the journal but {new_tier} in this "
                           "configuration (host_memory / host_block_budget); start with the journal's size")
    if old_hasher is not None and old_hasher.root != new_hasher.root:
        if cfg.hash_seed:
            raise KVCacheError("journal: hash_seed differs from the one the journal's cached prefixes were hashed "
                               "with; start with the same --hash-seed, or none to keep the journal's")
        # A journal from a daemon with another seed, or from before the default root was fixed: its prefixes
        # keep their hashes, so they still hit here, but a router indexing several daemons sees them apart.
        log.warning("journal: keeps the hash root its cached prefixes were hashed with, not the default one; "
                    "a router sees this daemon's block hashes differ from other daemons' until it starts with a "
                    "new journal")


SNAPSHOT_FORMAT = 1
STATE_CODEC = StateCodec(  # what journal snapshots may hold
    [KVCacheManager, _Request, _Owned, BlockPool, PrefixIndex, BlockHasher, Inserted, MMPlaceholder, Full,
     Window, Chunked, _Slots, _RetryCache, Leases, PDState, Transfer, DaemonTier, TierJob])
_STATE_TYPES = {"manager": KVCacheManager, "slots": _Slots, "retries": _RetryCache, "leases": Leases, "pd": PDState,
                "seq": int, "epoch": int, "settings": dict}


def dump_state(state: dict[str, Any]) -> list[bytes | memoryview]:
    """A daemon's state (``Durability.saved``'s map) as journal snapshot pieces."""
    return STATE_CODEC.chunks({"format": SNAPSHOT_FORMAT, "kvcache": __version__, **state})


def load_state(data: bytearray) -> dict[str, Any]:
    """The map ``dump_state`` saved; anything else raises ``KVCacheError`` without running code from the snapshot."""
    state = STATE_CODEC.loads(data)
    if not isinstance(state, dict) or state.get("format") != SNAPSHOT_FORMAT:
        found = state.get("format") if isinstance(state, dict) else None
        raise KVCacheError(f"journal: the snapshot's format {found!r} is not {SNAPSHOT_FORMAT}, the one this "
                           f"version of kvcache reads")
    for name, kind in _STATE_TYPES.items():
        if not isinstance(state.get(name), kind):
            raise KVCacheError(f"journal: the snapshot's {name} is not a {kind.__name__}")
    missing = [name for name in _JOURNALED_SETTINGS if name not in state["settings"]]
    if missing:
        raise KVCacheError(f"journal: the snapshot lacks the settings {', '.join(missing)}")
    return state

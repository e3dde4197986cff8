"""Journal: records survive reopen, torn tails are cut, snapshots replace what they cover."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.allocator.errors import KVCacheError
from kvcache.journal import PREALLOCATE_BYTES, Journal, records_end


def reopen(folder):
    journal = Journal(folder)
    return journal, journal.open()


def test_committed_records_come_back_in_order(tmp_path):
    journal, rec = reopen(tmp_path)
    assert rec.snapshot is None and rec.records == []
    for i in range(5):
        journal.append(f"r{i}".encode())
    journal.commit()
    journal.close()
    journal, rec = reopen(tmp_path)
    assert rec.records == [b"r0", b"r1", b"r2", b"r3", b"r4"] and journal.lsn == 5
    journal.append(b"r5")
    journal.close()
    assert reopen(tmp_path)[1].records[-1] == b"r5"


def test_uncommitted_records_are_not_written(tmp_path):
    journal, _ = reopen(tmp_path)
    journal.append(b"kept")
    journal.commit()
    journal.append(b"lost")
    os.close(journal._fd)  # a crash: no commit, no close
    assert reopen(tmp_path)[1].records == [b"kept"]


def test_a_torn_tail_is_cut_at_the_last_whole_record(tmp_path):
    journal, _ = reopen(tmp_path)
    for i in range(3):
        journal.append(bytes([i]) * 100)
    journal.commit()
    size = journal.wal_bytes
    journal.close()
    wal = tmp_path / "wal"
    with open(wal, "r+b") as f:
        f.truncate(size - 7)
    journal, rec = reopen(tmp_path)
    assert rec.records == [bytes([0]) * 100, bytes([1]) * 100] and rec.truncated_bytes == 116 - 7
    journal.append(b"after")
    journal.close()
    assert reopen(tmp_path)[1].records[-1] == b"after"


def test_a_corrupt_record_ends_recovery_there(tmp_path):
    journal, _ = reopen(tmp_path)
    for i in range(3):
        journal.append(bytes([65 + i]) * 10)
    journal.close()
    data = bytearray((tmp_path / "wal").read_bytes())
    data[16 + 10 + 16 + 3] ^= 0xFF  # a payload byte of the second record
    (tmp_path / "wal").write_bytes(bytes(data))
    assert reopen(tmp_path)[1].records == [b"A" * 10]


def test_a_snapshot_replaces_the_records_it_holds(tmp_path):
    journal, _ = reopen(tmp_path)
    journal.append(b"a")
    journal.append(b"b")
    journal.write_snapshot(b"STATE-AFTER-B")
    journal.append(b"c")
    journal.close()
    journal, rec = reopen(tmp_path)
    assert (rec.snapshot, rec.snapshot_lsn, rec.records, journal.lsn) == (b"STATE-AFTER-B", 2, [b"c"], 3)


def test_records_the_snapshot_holds_are_skipped_if_the_wal_was_not_emptied(tmp_path):
    """A crash between renaming the snapshot and truncating the WAL must not apply records twice."""
    journal, _ = reopen(tmp_path)
    journal.append(b"a")
    journal.append(b"b")
    journal.commit()
    wal_before = (tmp_path / "wal").read_bytes()
    journal.write_snapshot(b"S")
    journal.close()
    (tmp_path / "wal").write_bytes(wal_before)
    journal, rec = reopen(tmp_path)
    assert rec.snapshot == b"S" and rec.records == [] and journal.lsn == 2


def test_a_damaged_snapshot_is_a_clear_error(tmp_path):
    journal, _ = reopen(tmp_path)
    journal.write_snapshot(b"state")
    journal.close()
    data = bytearray((tmp_path / "snapshot").read_bytes())
    data[-1] ^= 1
    (tmp_path / "snapshot").write_bytes(bytes(data))
    with pytest.raises(KVCacheError, match="checksum"):
        Journal(tmp_path).open()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=40), st.booleans(), st.booleans()), max_size=25), st.data())
def test_any_crash_point_recovers_a_prefix_holding_every_committed_record(tmp_path_factory, ops, data):
    folder = tmp_path_factory.mktemp("j")
    journal, _ = reopen(folder)
    state: list[bytes] = []  # every record appended, in order
    committed = 0
    snap_len = 0
    for payload, commit, snapshot in ops:
        journal.append(payload)
        state.append(payload)
        if commit:
            journal.commit()
            committed = len(state)
        if snapshot:
            journal.write_snapshot(repr(state).encode())
            committed = snap_len = len(state)
    journal.commit()
    committed = len(state)
    end = journal.wal_bytes
    os.close(journal._fd)
    wal = folder / "wal"
    size = wal.stat().st_size
    cut = data.draw(st.integers(0, end) | st.integers(end, size))
    with open(wal, "r+b") as f:
        f.truncate(cut)
    _, rec = reopen(folder)
    recovered = (list(eval(rec.snapshot.decode())) if rec.snapshot else []) + rec.records
    assert recovered == state[: len(recovered)]
    assert len(recovered) >= snap_len
    if cut >= end:  # only preallocated zeros were cut
        assert len(recovered) == committed


def test_commits_overwrite_preallocated_zeros_without_growing_the_file(tmp_path):
    """fdatasync then flushes data only: the WAL's size changes only when a zero-filled stretch runs out."""
    journal, _ = reopen(tmp_path)
    size = (tmp_path / "wal").stat().st_size
    assert size >= PREALLOCATE_BYTES
    for i in range(50):
        journal.append(bytes([i]) * 1000)
        journal.commit()
    assert (tmp_path / "wal").stat().st_size == size and journal.wal_bytes == 50 * (16 + 1000)
    journal.append(b"x" * PREALLOCATE_BYTES)
    journal.commit()
    assert (tmp_path / "wal").stat().st_size >= journal.wal_bytes + PREALLOCATE_BYTES // 4
    journal.close()
    rec = reopen(tmp_path)[1]
    assert len(rec.records) == 51 and rec.records[-1] == b"x" * PREALLOCATE_BYTES and rec.truncated_bytes == 0


def test_a_record_that_reached_the_disk_after_a_torn_one_never_rejoins_the_chain(tmp_path):
    """Pages can reach the disk out of order: recovery zeroes everything after the last whole record.

    Without that, a new record 2 written over a torn one, ending where the old
    record 3 begins, would make the never-acknowledged old record 3 replay.
    """
    journal, _ = reopen(tmp_path)
    for payload in (b"A" * 10, b"B" * 10, b"C" * 10):
        journal.append(payload)
    journal.commit()
    journal.close()
    data = bytearray((tmp_path / "wal").read_bytes())
    data[16 + 10 + 16 + 3] ^= 0xFF  # record 2 torn; record 3 whole behind it
    (tmp_path / "wal").write_bytes(bytes(data))
    journal, rec = reopen(tmp_path)
    assert rec.records == [b"A" * 10] and rec.truncated_bytes == 2 * (16 + 10)
    journal.append(b"N" * 10)  # the same length: ends exactly where the old record 3 began
    journal.close()
    assert reopen(tmp_path)[1].records == [b"A" * 10, b"N" * 10]


def test_records_end_finds_where_the_records_stop_in_a_preallocated_wal(tmp_path):
    journal, _ = reopen(tmp_path)
    assert records_end(tmp_path / "wal") == 0
    journal.append(b"a" * 5)
    journal.append(b"b" * 7)
    journal.commit()
    assert records_end(tmp_path / "wal") == journal.wal_bytes == 2 * 16 + 12
    journal.close()
    assert records_end(tmp_path / "missing") == 0

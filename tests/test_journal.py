"""Journal: records survive reopen, torn tails are cut, snapshots replace what they cover."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.allocator.errors import KVCacheError
from kvcache.journal import PREALLOCATE_BYTES, Journal, JournalFull, examine, records_end, repair


def reopen(folder):
    """Open a journal; a new one gets an empty snapshot first, as the daemon gives it."""
    journal = Journal(folder)
    recovered = journal.open()
    if recovered.snapshot is None:
        journal.write_snapshot(b"")
    return journal, recovered


def crash(journal):
    """What a kill does to an open journal: its files close (and its lock goes) without a commit."""
    for fd in (journal._fd, journal._lock, journal._lock_file):
        os.close(fd)
    journal._fd = journal._lock = journal._lock_file = None


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
    crash(journal)  # no commit, no close
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
    crash(journal)
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


def commits(journal, *groups):
    """Append and commit each group of records as one commit."""
    for group in groups:
        for payload in group:
            journal.append(payload)
        journal.commit()


def test_a_flip_in_an_acknowledged_commit_with_later_commits_behind_it_is_refused_and_nothing_changes(tmp_path):
    """Corruption followed by valid records of later commits is not a torn tail: opening refuses, naming the offset."""
    journal, _ = reopen(tmp_path)
    commits(journal, [b"a" * 10], [b"b" * 10, b"c" * 10], [b"d" * 10])
    journal.close()
    wal = tmp_path / "wal"
    data = bytearray(wal.read_bytes())
    data[26 + 16 + 2] ^= 0x04  # a payload byte of record 2 (the second commit's first)
    wal.write_bytes(bytes(data))
    with pytest.raises(KVCacheError, match=r"damaged at offset 26 \(record 2 fails its checksum\) and 2 valid "
                                           r"record\(s\) of later commits follow from offset 52 \(up to record 4\)"):
        Journal(tmp_path).open()
    assert wal.read_bytes() == bytes(data)
    report = examine(tmp_path)
    assert report.records == [b"a" * 10] and report.damage.offset == 26 and report.damage.records_after == 2


def test_damage_in_the_last_commit_is_a_torn_tail_even_with_its_own_records_behind_it(tmp_path):
    journal, _ = reopen(tmp_path)
    commits(journal, [b"a" * 10], [b"b" * 10, b"c" * 10, b"d" * 10])
    journal.close()
    data = bytearray((tmp_path / "wal").read_bytes())
    data[26 + 16 + 2] ^= 0x04
    (tmp_path / "wal").write_bytes(bytes(data))
    assert examine(tmp_path).damage is None
    _, rec = reopen(tmp_path)
    assert rec.records == [b"a" * 10] and rec.truncated_bytes == 3 * 26


def test_a_log_without_its_snapshot_is_refused_and_kept(tmp_path):
    journal, _ = reopen(tmp_path)
    commits(journal, [b"a"], [b"b"])
    journal.close()
    (tmp_path / "snapshot").unlink()
    before = (tmp_path / "wal").read_bytes()
    with pytest.raises(KVCacheError, match="holds records but .*snapshot is missing"):
        Journal(tmp_path).open()
    assert (tmp_path / "wal").read_bytes() == before


def test_a_snapshot_without_its_log_is_refused(tmp_path):
    journal, _ = reopen(tmp_path)
    journal.close()
    (tmp_path / "wal").unlink()
    with pytest.raises(KVCacheError, match="has no .*wal beside it"):
        Journal(tmp_path).open()


def test_a_second_journal_on_the_same_folder_is_refused_naming_the_holder(tmp_path):
    journal, _ = reopen(tmp_path)
    with pytest.raises(KVCacheError, match=f"in use by process {os.getpid()}"):
        Journal(tmp_path).open()
    journal.close()
    reopen(tmp_path)[0].close()  # free again once closed


@pytest.mark.parametrize("target, mode, fix", [("", 0o777, "chmod 700"), ("", 0o720, "chmod 700"),
                                               ("wal", 0o666, "chmod 600"), ("snapshot", 0o620, "chmod 600")])
def test_a_journal_others_may_write_is_refused(tmp_path, target, mode, fix):
    journal, _ = reopen(tmp_path)
    journal.close()
    path = tmp_path / target if target else tmp_path
    os.chmod(path, mode)
    with pytest.raises(KVCacheError, match=f"{path} is writable by other users .*; {fix} {path}"):
        Journal(tmp_path).open()
    with pytest.raises(KVCacheError, match="writable by other users"):
        examine(tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_journal_file_of_another_user_is_refused(tmp_path):
    journal, _ = reopen(tmp_path)
    journal.close()
    os.chown(tmp_path / "snapshot", 4321, -1)
    with pytest.raises(KVCacheError, match="snapshot belongs to uid 4321"):
        Journal(tmp_path).open()


def test_an_old_pickle_snapshot_is_never_loaded(tmp_path):
    journal, _ = reopen(tmp_path)
    journal.close()
    (tmp_path / "snapshot").write_bytes(b"KVCJ1\n" + bytes(12) + b"cos\nsystem\n(S'touch x'\ntR.")
    with pytest.raises(KVCacheError, match="as a pickle, which could run code"):
        Journal(tmp_path).open()


def test_repair_cuts_at_a_record_boundary_and_keeps_a_backup(tmp_path):
    journal, _ = reopen(tmp_path)
    commits(journal, [b"a" * 10], [b"b" * 10], [b"c" * 10])
    journal.close()
    wal = tmp_path / "wal"
    data = bytearray(wal.read_bytes())
    data[26 + 16] ^= 1
    wal.write_bytes(bytes(data))
    with pytest.raises(KVCacheError, match="--truncate-at: 30 is not where a whole record"):
        repair(tmp_path, 30)
    backup = repair(tmp_path, examine(tmp_path).damage.offset)
    assert backup.read_bytes() == bytes(data) and wal.stat().st_size == 26
    _, rec = reopen(tmp_path)
    assert rec.records == [b"a" * 10] and rec.truncated_bytes == 0


def test_repair_of_a_folder_without_a_log_is_one_line_and_writes_nothing(tmp_path):
    tmp_path.chmod(0o700)
    with pytest.raises(KVCacheError, match=r"has no log \(.*wal\): nothing to repair"):
        repair(tmp_path, 0)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("lock")) == []


def test_repair_refuses_a_journal_in_use(tmp_path):
    journal, _ = reopen(tmp_path)
    with pytest.raises(KVCacheError, match=f"in use by process {os.getpid()}; stop it before repairing"):
        repair(tmp_path, 0)
    journal.close()


@pytest.mark.parametrize("small_disk", ["12m"], indirect=True)
def test_a_full_disk_is_found_by_reserve_before_anything_is_written(small_disk):
    journal, _ = reopen(small_disk.path / "j")
    filler = small_disk.fill()  # takes what the log has not preallocated
    journal.reserve(1000)  # within the preallocated stretch: no disk needed
    with pytest.raises(JournalFull, match="no space left on device"):
        journal.reserve(PREALLOCATE_BYTES)
    commits(journal, [b"x" * 1000])  # what was reserved commits
    with pytest.raises(JournalFull):
        journal.write_snapshot(b"S" * (2 << 20))
    assert not (small_disk.path / "j" / "snapshot.tmp").exists()
    filler.unlink()
    journal.reserve(PREALLOCATE_BYTES)
    journal.write_snapshot(b"S" * (2 << 20))
    journal.close()
    _, rec = reopen(small_disk.path / "j")
    assert rec.snapshot == b"S" * (2 << 20) and rec.records == []


def test_repairs_never_overwrite_a_backup(tmp_path):
    """Each repair keeps its own backup, even two within one second or beside a backup of that name already there."""
    import time

    journal, _ = reopen(tmp_path)
    commits(journal, [b"a" * 10], [b"b" * 10])
    journal.close()
    wal = tmp_path / "wal"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() + 1))
    placed = tmp_path / f"wal.backup-{stamp}"  # where a repair in the next second would write
    placed.write_bytes(b"an earlier backup")
    first_log = wal.read_bytes()
    first = repair(tmp_path, 26)
    second_log = wal.read_bytes()
    second = repair(tmp_path, 0)
    third = repair(tmp_path, 0)
    assert len({first, second, third, placed}) == 4
    assert [first.read_bytes(), second.read_bytes(), third.read_bytes()] == [first_log, second_log, b""]
    assert placed.read_bytes() == b"an earlier backup"
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in (first, second, third))

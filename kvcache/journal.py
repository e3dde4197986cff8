"""An append-only, checksummed journal with snapshots, so a restarted daemon comes back with every allocation.

A journal is a folder, owned by the daemon's user and writable by nobody else, holding::

    snapshot   the whole state after record ``lsn`` (atomically replaced: temp file, fsync, rename, fsync dir)
    wal        records after the snapshot: [u32 length | u32 crc32 | u64 lsn | payload] each
    lock       names the pid of the daemon using the journal

The daemon holds an flock on the folder itself (and on ``lock``) for its
life, so deleting or replacing ``lock`` lets no second daemon, and no
``repair``, in while it runs.

``commit()`` makes every appended record durable with one fdatasync (group
commit): the daemon sends a reply only after the record of its message is
committed. The first record of each commit carries a flag (the length's top
bit). The WAL is zero-filled ahead of the writes (``PREALLOCATE_BYTES`` at a
time, as PostgreSQL does with its segments), so a commit overwrites allocated
blocks and its fdatasync flushes data only, not the file's size (about 40%
cheaper on ext4); and a full disk shows when space is reserved (``reserve``),
before the daemon applies a message, never halfway through a commit. A zero
header ends the records.

On recovery the records are read up to the first that is not whole. What
follows tells a crash from damage:

* a torn tail: nothing valid follows, or only records of the same commit
  (pages can reach the disk out of order while a commit is written, and that
  commit was never acknowledged). It is cut off and zeroed, so none of it can
  rejoin the chain later.
* corruption: a valid record of a later commit follows, so the damaged commit
  had been made durable and answered. Opening refuses and changes nothing;
  ``kvcache journal check`` shows the damage and ``kvcache journal repair``
  cuts the log there, keeping a backup.

Records the snapshot already holds (a crash between snapshot and WAL
truncation) are skipped by their lsn. A WAL holding records without a
snapshot, or a snapshot without a WAL, means a file was lost: refused.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import time
import zlib
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.listeners import LockHeld, pid_lock

_HEADER = struct.Struct("<IIQ")  # length (top bit: first record of a commit), crc32 of length+lsn+payload, lsn
_CRC_HEAD = struct.Struct("<IQ")
_COMMIT_START = 1 << 31
HEADER_BYTES = _HEADER.size
_SNAPSHOT_MAGIC = b"KVCJ2\n"
_PICKLE_MAGIC = b"KVCJ1\n"  # snapshots of older versions: pickles, never loaded
_SNAPSHOT_HEAD = struct.Struct("<QI")  # lsn, crc32 of the state
MAX_RECORD_BYTES = 1 << 30
# A log is read whole to recover it: one holding more data than this (a damaged file, not a daemon's log) is
# refused rather than read. Holes in a sparse file count as the zeros they read as, past the last data.
MAX_WAL_BYTES = 16 << 30
PREALLOCATE_BYTES = 4 << 20  # zero-filled ahead of the writes, this much at a time
_ZEROS = memoryview(bytes(1 << 20))
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class JournalFull(KVCacheError):
    """The journal's disk has no room for what must be written; nothing was applied or acknowledged."""


class Damage(NamedTuple):
    """Records that fail their checksum, followed by valid ones of a later commit (what opening refuses)."""

    offset: int  # where the first bad record starts: where ``repair --truncate-at`` would cut
    lsn: int  # the record expected there
    problem: str  # what is wrong with it
    resumes_at: int  # offset of the first valid record after it
    records_after: int  # whole records from ``resumes_at`` on
    last_lsn: int  # the last of them


class Recovered(NamedTuple):
    """What a journal held at open: the snapshot (or None) and the records after it, oldest first."""

    snapshot: bytearray | None
    snapshot_lsn: int
    records: list[bytes]
    truncated_bytes: int  # torn tail cut off (or, from ``examine``, that would be cut)
    records_end: int = 0  # offset in the WAL where the whole records end
    damage: Damage | None = None  # only from ``examine``: ``open`` refuses instead


def _crc(word: int, lsn: int, payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, zlib.crc32(_CRC_HEAD.pack(word, lsn)))


def _record_at(data: bytes, offset: int) -> tuple[int, int, bool, bytes] | None:
    """(end, lsn, starts a commit, payload) of the whole, checksummed record at ``offset``, or None."""
    if offset + HEADER_BYTES > len(data):
        return None
    word, crc, lsn = _HEADER.unpack_from(data, offset)
    length = word & ~_COMMIT_START
    end = offset + HEADER_BYTES + length
    if length > MAX_RECORD_BYTES or end > len(data):
        return None
    payload = data[offset + HEADER_BYTES:end]
    if _crc(word, lsn, payload) != crc:
        return None  # torn or corrupt, or the preallocated zeros (a zero header never checks out)
    return end, lsn, bool(word & _COMMIT_START), payload


def _whole_records(data: bytes, offset: int = 0) -> Iterator[tuple[int, int, bool, bytes]]:
    """(end offset, lsn, starts a commit, payload) of each whole record from ``offset``, up to the first that is not."""
    while True:
        record = _record_at(data, offset)
        if record is None:
            return
        yield record
        offset = record[0]


def _later_commit(data: bytes, start: int, expected_lsn: int) -> Damage | None:
    """The damage at ``start`` if a valid record of a commit after the one holding ``expected_lsn`` lies past it.

    Candidates are the byte offsets whose lsn field would hold a value after
    ``expected_lsn`` (found by numpy, a stretch at a time); each is checked by its checksum.
    """
    stop = len(data[start:].rstrip(b"\0")) + start
    most = expected_lsn + (stop - start) // HEADER_BYTES
    buffer = np.frombuffer(data, dtype=np.uint8)
    step = 1 << 22
    for begin in range(start, stop - HEADER_BYTES + 1, step):
        count = min(step, stop - HEADER_BYTES + 1 - begin)
        values = np.zeros(count, dtype=np.uint64)  # the 8 bytes at offset + 8 of each offset, little-endian
        for k in range(8):
            values |= buffer[begin + 8 + k:begin + 8 + k + count].astype(np.uint64) << np.uint64(8 * k)
        for candidate in np.flatnonzero((values > expected_lsn) & (values <= most)).tolist():
            offset = begin + candidate
            if _record_at(data, offset) is None:
                continue
            records, last_lsn, later = 0, 0, False
            for _, lsn, commit_start, _ in _whole_records(data, offset):
                records, last_lsn, later = records + 1, lsn, later or commit_start
            if later:
                return Damage(start, expected_lsn, "fails its checksum", offset, records, last_lsn)
    return None


def _data_end(fd: int, size: int) -> int:
    """Where the last stretch of data of a file of ``size`` bytes ends (its size where holes cannot be found)."""
    end = position = 0
    try:
        while position < size and end <= MAX_WAL_BYTES:
            start = os.lseek(fd, position, os.SEEK_DATA)
            end = position = os.lseek(fd, start, os.SEEK_HOLE)
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # ENXIO: no data past ``position``
            return size
    return min(end, size)


def read_wal(wal: str | Path) -> bytes:
    """A WAL's bytes up to the end of its data (b"" for a missing file), or a one-line ``KVCacheError`` for a file
    past ``MAX_WAL_BYTES`` or one that cannot be read: memory stays bounded whatever its size claims."""
    wal = Path(wal)
    try:
        fd = os.open(wal, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return b""
    except OSError as exc:
        raise KVCacheError(f"journal: cannot read {wal}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        end = _data_end(fd, os.fstat(fd).st_size)
        if end > MAX_WAL_BYTES:
            raise KVCacheError(f"journal: {wal} holds data past {MAX_WAL_BYTES:,} bytes, more than a log is read "
                               "into memory to recover; it is not a daemon's log (damaged or replaced): move it away")
        f.seek(0)  # finding the data moved the file's offset
        return f.read(end)


def records_end(wal: str | Path) -> int:
    """Where a WAL's whole records end (its preallocated zeros start); 0 for a missing file.

    For observers such as a benchmark measuring bytes journaled: the file's
    size says nothing once it is preallocated.
    """
    data = read_wal(wal)
    end = 0
    for end, _, _, _ in _whole_records(data):
        pass
    return end


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_private(path: Path, what: str) -> None:
    """Refuse ``path`` unless this user owns it and nobody else may write it: whoever could write a journal could
    make the daemon hand out blocks that are in use."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise KVCacheError(f"journal: {path} is a symbolic link; the {what} must be a plain file or folder")
    if info.st_uid != os.geteuid():
        raise KVCacheError(f"journal: {path} belongs to uid {info.st_uid}, not this user ({os.geteuid()}); "
                           f"the {what} must be the daemon's own (chown {os.geteuid()} {path})")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        fix = "700" if stat.S_ISDIR(info.st_mode) else "600"
        raise KVCacheError(f"journal: {path} is writable by other users (mode {mode:04o}); chmod {fix} {path}")


def _holder(lock: Path) -> str:
    """The pid a lock file names, for a refusal ("unknown" where it is gone or unreadable)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return "unknown (its lock file was removed)"
    try:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)


def lock_folder(folder: Path) -> tuple[int, int]:
    """Hold ``folder``'s lock: an flock on the folder itself, then on its ``lock`` file (which names this pid);
    returns both descriptors (closing them releases it). ``LockHeld`` names the holder while another process has it.

    The folder's own lock is what keeps a second writer out: deleting or replacing the lock file cannot void it.
    The file's keeps out older versions of kvcache, which lock only the file.
    """
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise KVCacheError(f"journal: cannot open the folder {folder}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd, pid_lock(folder / "lock")
    except BlockingIOError:
        os.close(fd)
        raise LockHeld(folder / "lock", _holder(folder / "lock")) from None
    except LockHeld:
        os.close(fd)
        raise
    except OSError as exc:
        os.close(fd)
        raise KVCacheError(f"journal: cannot use the lock file {folder / 'lock'}: {exc.strerror}") from None


def _no_space(path: Path) -> JournalFull:
    return JournalFull(f"journal: no space left on device ({path}); state-changing operations are refused until "
                       "there is room again")


class Journal:
    """The daemon's write-ahead log; one owner thread appends, commits and snapshots."""

    def __init__(self, folder: str | Path, *, sync: bool = True) -> None:
        self.folder = Path(folder)
        self.sync = sync
        self.lsn = 0  # last record written (or held by the snapshot)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._wal_bytes = 0  # the records' end: where the next commit writes
        self._allocated = 0  # the WAL file's size; zeros from _wal_bytes to here
        self._fd: int | None = None
        self._lock: int | None = None  # the folder's flock
        self._lock_file: int | None = None  # the lock file's

    @property
    def wal_bytes(self) -> int:
        """Bytes in the WAL since the last snapshot (what compaction would save)."""
        return self._wal_bytes

    @property
    def wal(self) -> Path:
        return self.folder / "wal"

    def open(self) -> Recovered:
        """Lock the folder (creating it if new), read the snapshot and every whole record after it, open for
        appending. A torn tail is cut; a missing file or damage followed by valid records is refused, changing
        nothing on disk."""
        self._take_lock()
        try:
            recovered = examine(self.folder, locked=True)
            if recovered.damage is not None:
                d = recovered.damage
                raise KVCacheError(
                    f"journal: {self.wal} is damaged at offset {d.offset} (record {d.lsn} {d.problem}) and "
                    f"{d.records_after} valid record(s) of later commits follow from offset {d.resumes_at} (up to "
                    f"record {d.last_lsn}); nothing was changed. See `kvcache journal check {self.folder}`; "
                    f"`kvcache journal repair {self.folder} --truncate-at {d.offset}` drops them, keeping a backup")
            if recovered.snapshot is None and (recovered.records or recovered.truncated_bytes):
                raise KVCacheError(f"journal: {self.wal} holds records but {self.folder / 'snapshot'} is missing; "
                                   "restore the snapshot, or move the folder away to start with no allocations")
            if recovered.snapshot is not None and not self.wal.exists():
                raise KVCacheError(f"journal: {self.folder / 'snapshot'} has no {self.wal} beside it; restore "
                                   "the log, or move the folder away to start with no allocations")
            self.lsn = recovered.snapshot_lsn + len(recovered.records)
            self._fd = os.open(self.wal, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            self._wal_bytes = self._allocated = recovered.records_end
            try:
                self._preallocate(0)  # zeroes whatever followed the last whole record
            except JournalFull:
                pass  # the tail is not zeroed: nothing can be committed until ``reserve`` finds room and does it
            return recovered
        except BaseException:
            self.close()
            raise

    def _take_lock(self) -> None:
        """Create the folder if new, check who owns it, and hold its lock: one daemon per journal."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise KVCacheError(f"journal: cannot create {self.folder}: {exc.strerror}") from None
        check_private(self.folder, "journal folder")
        for name, what in (("snapshot", "snapshot"), ("wal", "log"), ("lock", "lock file")):
            check_private(self.folder / name, what)
        try:
            self._lock, self._lock_file = lock_folder(self.folder)
        except LockHeld as exc:
            raise KVCacheError(f"journal: {self.folder} is in use by process {exc.holder} (another kvcache serve); "
                               "stop it, or give this daemon another --journal") from None

    def _preallocate(self, needed: int) -> None:
        """Zero-fill the WAL so that ``needed`` more bytes fit with ``PREALLOCATE_BYTES`` to spare, then sync it.

        Raises ``JournalFull`` when the disk has no room for ``needed`` bytes, giving back what it had begun to take.
        """
        assert self._fd is not None, "journal is not open"
        if self._wal_bytes + needed + PREALLOCATE_BYTES // 4 <= self._allocated:
            return
        end = self._wal_bytes + needed + PREALLOCATE_BYTES
        position = self._allocated
        try:
            while position < end:
                position += os.pwrite(self._fd, _ZEROS[:end - position], position)
            os.ftruncate(self._fd, end)  # drops what lay past ``end`` (a recovered WAL's old tail)
            if self.sync:
                os.fsync(self._fd)  # the new size too: later fdatasyncs leave it alone
        except OSError as exc:
            if exc.errno not in _NO_SPACE:
                raise
            os.ftruncate(self._fd, self._allocated)  # gives back what this attempt took
            if self._wal_bytes + needed <= self._allocated:
                return  # it still fits the stretch zero-filled before; growing is tried again next time
            raise _no_space(self.wal) from None
        self._allocated = end

    def reserve(self, payload_bytes: int) -> None:
        """Make sure a record of ``payload_bytes`` fits after what is queued, or raise ``JournalFull``.

        The daemon calls this before applying a message that changes state, so a
        full disk refuses the message instead of failing its commit.
        """
        self._preallocate(self._pending_bytes + HEADER_BYTES + payload_bytes)

    def append(self, payload: bytes) -> int:
        """Queue one record (durable at the next ``commit``); returns its lsn."""
        if len(payload) > MAX_RECORD_BYTES:
            raise KVCacheError(f"journal: record of {len(payload)} bytes exceeds {MAX_RECORD_BYTES}")
        self.lsn += 1
        word = len(payload) | (0 if self._pending else _COMMIT_START)
        self._pending.append(_HEADER.pack(word, _crc(word, self.lsn, payload), self.lsn))
        self._pending.append(payload)
        self._pending_bytes += HEADER_BYTES + len(payload)
        return self.lsn

    def commit(self) -> None:
        """Write every queued record and make it durable with one fdatasync."""
        if not self._pending:
            return
        assert self._fd is not None, "journal is not open"
        data = b"".join(self._pending)
        self._pending.clear()
        self._pending_bytes = 0
        self._preallocate(len(data))  # a no-op after ``reserve``
        view = memoryview(data)
        position = self._wal_bytes
        while view:
            written = os.pwrite(self._fd, view, position)
            view, position = view[written:], position + written
        if self.sync:
            os.fdatasync(self._fd)
        self._wal_bytes += len(data)

    def write_snapshot(self, state: bytes | Sequence[bytes | memoryview]) -> None:
        """Replace the snapshot with ``state`` (everything up to ``lsn``; bytes, or pieces written in turn) and
        empty the WAL.

        A full disk raises ``JournalFull`` and leaves the old snapshot and the WAL
        as they were (or, when only the new WAL's zero-filling failed, the new
        snapshot and an empty WAL): nothing recovered is lost either way.
        """
        self.commit()
        assert self._fd is not None, "journal is not open"
        pieces = [state] if isinstance(state, (bytes, bytearray, memoryview)) else state
        crc = 0
        for piece in pieces:
            crc = zlib.crc32(piece, crc)
        tmp = self.folder / "snapshot.tmp"
        try:
            with open(tmp, "wb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW, 0o600)) as f:
                f.write(_SNAPSHOT_MAGIC + _SNAPSHOT_HEAD.pack(self.lsn, crc))
                for piece in pieces:
                    f.write(piece)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno in _NO_SPACE:
                raise _no_space(tmp) from None
            raise
        os.replace(tmp, self.folder / "snapshot")
        _fsync_dir(self.folder)
        os.ftruncate(self._fd, 0)
        self._wal_bytes = self._allocated = 0
        self._preallocate(0)

    def close(self) -> None:
        """Commit what is queued, close the WAL and release the lock."""
        if self._fd is not None:
            try:
                self.commit()
            finally:
                os.close(self._fd)
                self._fd = None
        for fd in (self._lock_file, self._lock):  # closing releases the flocks
            if fd is not None:
                os.close(fd)
        self._lock = self._lock_file = None


def read_snapshot(folder: str | Path) -> tuple[bytearray | None, int]:
    """The state of ``folder``'s snapshot (a bytearray of its own, so arrays decoded from it can be views) and the
    lsn it holds, or (None, 0) when there is none."""
    path = Path(folder) / "snapshot"
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None, 0
    with f:
        head = f.read(len(_SNAPSHOT_MAGIC) + _SNAPSHOT_HEAD.size)
        if head.startswith(_PICKLE_MAGIC):
            raise KVCacheError(f"journal: {path} was written by an older kvcache as a pickle, which could run code "
                               "when loaded, so it is not read; drain that daemon's requests and start with an empty "
                               "folder")
        if not head.startswith(_SNAPSHOT_MAGIC) or len(head) < len(_SNAPSHOT_MAGIC) + _SNAPSHOT_HEAD.size:
            raise KVCacheError(f"journal: {path} is not a kvcache snapshot")
        lsn, crc = _SNAPSHOT_HEAD.unpack_from(head, len(_SNAPSHOT_MAGIC))
        state = bytearray(os.fstat(f.fileno()).st_size - len(head))
        if f.readinto(state) != len(state):
            raise KVCacheError(f"journal: {path} changed while it was read")
    if zlib.crc32(state) != crc:
        raise KVCacheError(f"journal: {path} fails its checksum; the journal is damaged")
    return state, lsn


def examine(folder: str | Path, *, locked: bool = False) -> Recovered:
    """What opening ``folder`` would recover, changing nothing on disk; damage is reported, not raised.

    Also checks ownership and modes (and, unless ``locked``, that the folder exists).
    """
    folder = Path(folder)
    if not locked:
        if not folder.is_dir():
            raise KVCacheError(f"journal: {folder} is not a folder")
        check_private(folder, "journal folder")
        for name, what in (("snapshot", "snapshot"), ("wal", "log"), ("lock", "lock file")):
            check_private(folder / name, what)
    snapshot, snapshot_lsn = read_snapshot(folder)
    data = read_wal(folder / "wal")
    records: list[bytes] = []
    offset = 0
    lsn = snapshot_lsn
    for end, record_lsn, _, payload in _whole_records(data):
        if record_lsn > snapshot_lsn:
            if record_lsn != lsn + 1:
                return Recovered(snapshot, snapshot_lsn, records, 0, offset,
                                 Damage(offset, lsn + 1, f"is missing (record {record_lsn} is there)", offset, 1,
                                        record_lsn))
            records.append(payload)
            lsn = record_lsn
        offset = end
    damage = _later_commit(data, offset, lsn + 1)
    truncated = 0 if damage else len(data[offset:].rstrip(b"\0"))  # zeros past the end are preallocation
    return Recovered(snapshot, snapshot_lsn, records, truncated, offset, damage)


def repair(folder: str | Path, truncate_at: int) -> Path:
    """Cut ``folder``'s WAL at ``truncate_at`` (where whole records end), after copying it aside; returns the copy.

    Everything from that offset on is dropped: the records a damaged stretch
    hid, and those after it.
    """
    folder = Path(folder)
    check_private(folder, "journal folder")
    wal = folder / "wal"
    check_private(wal, "log")
    check_private(folder / "lock", "lock file")
    try:
        fds = lock_folder(folder)
    except LockHeld as exc:
        raise KVCacheError(f"journal: {folder} is in use by process {exc.holder}; stop it before repairing") from None
    try:
        if not wal.exists():
            raise KVCacheError(f"journal: {folder} has no log ({wal}): nothing to repair")
        data = read_wal(wal)
        ends = {0, *(end for end, _, _, _ in _whole_records(data))}
        if truncate_at not in ends:
            raise KVCacheError(f"--truncate-at: {truncate_at} is not where a whole record of {wal} ends "
                               f"(the last whole record ends at {max(ends)}); use the offset `kvcache journal check` "
                               "names")
        backup = _write_backup(folder, data)
        with open(wal, "r+b", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as f:
            f.truncate(truncate_at)
            f.flush()
            os.fsync(f.fileno())
        return backup
    finally:
        for fd in reversed(fds):
            os.close(fd)


def _write_backup(folder: Path, data: bytes) -> Path:
    """Write ``data`` (a log about to be cut) to a new ``wal.backup-<time>[-<n>]`` file, durably; never overwrites
    one: an earlier backup may be the only copy of acknowledged records."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        backup = folder / (f"wal.backup-{stamp}" if n == 1 else f"wal.backup-{stamp}-{n}")
        try:
            fd = os.open(backup, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(folder)  # the backup is on disk before the log is cut
        return backup
    raise KVCacheError(f"journal: {folder} already holds 999 backups of the log stamped {stamp}; move some away")

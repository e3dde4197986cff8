"""A real `kvcache serve` on a journal that was tampered with, damaged, restarted with other limits, or out of disk."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import zlib

import msgpack
import numpy as np
import pytest

from kvcache.client import CacheClient, DaemonError

FLAGS = ("--num-blocks", "4000", "--block-size", "16")


def refused(daemon, *flags, folder=None) -> str:
    """Start a daemon that must refuse to start; returns what it printed."""
    try:
        d = daemon(*flags, ready_timeout=20, folder=folder)
    except RuntimeError as exc:
        return str(exc)
    d.stop()
    raise AssertionError(f"the daemon started with {flags}")


def journal_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcache", "journal", *args], capture_output=True, text=True,
                          timeout=60)


def admit_many(endpoint: str, count: int, tokens: int = 40, start: int = 0) -> dict:
    """Admit ``count`` requests (one per message); returns their tables."""
    tables = {}
    with CacheClient(endpoint) as client:
        for i in range(start, start + count):
            tables[i] = client.admit(i, np.arange(i * 100_000, i * 100_000 + tokens)).table.tolist()
    return tables


def test_a_snapshot_that_would_run_code_is_never_loaded(daemon, tmp_path):
    """A pickle or a snapshot naming a class outside the daemon's state: refused, and the marker never appears."""
    journal = tmp_path / "j"
    d = daemon(*FLAGS, "--journal", str(journal))
    admit_many(d.endpoint, 2)
    d.stop()
    marker = tmp_path / "pwned"
    snapshot = journal / "snapshot"
    original = snapshot.read_bytes()
    payload = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()  # what pickle.loads would run
    snapshot.write_bytes(b"KVCJ1\n" + bytes(12) + payload)
    assert "as a pickle, which could run code" in refused(daemon, *FLAGS, "--journal", str(journal))
    # The current format, naming a class the codec was not given (the object of an os.system call)
    head = original[:6 + 8]
    meta = msgpack.packb([msgpack.ExtType(3, bytes([8]) + (0).to_bytes(4, "little") + b"posix.system"),
                          [f"touch {marker}"]])
    state = len(meta).to_bytes(8, "little") + meta
    snapshot.write_bytes(head + zlib.crc32(state).to_bytes(4, "little") + state)
    assert "unknown class 'posix.system'" in refused(daemon, *FLAGS, "--journal", str(journal))
    assert not marker.exists()


def test_a_journal_others_can_write_is_refused_naming_the_path_and_the_fix(daemon, tmp_path):
    journal = tmp_path / "j"
    d = daemon(*FLAGS, "--journal", str(journal))
    d.stop()
    os.chmod(journal, 0o777)
    assert f"{journal} is writable by other users (mode 0777); chmod 700 {journal}" in refused(
        daemon, *FLAGS, "--journal", str(journal))
    os.chmod(journal, 0o700)
    os.chmod(journal / "wal", 0o664)
    assert f"chmod 600 {journal / 'wal'}" in refused(daemon, *FLAGS, "--journal", str(journal))


def test_a_second_daemon_on_a_journal_in_use_is_refused_naming_the_first(daemon, tmp_path):
    journal = tmp_path / "j"
    first = daemon(*FLAGS, "--journal", str(journal))
    message = refused(daemon, *FLAGS, "--journal", str(journal))
    assert f"is in use by process {first.process.pid}" in message
    assert admit_many(first.endpoint, 1)  # the first still serves


def test_a_deleted_snapshot_is_refused_and_the_log_kept(daemon, tmp_path):
    journal = tmp_path / "j"
    d = daemon(*FLAGS, "--journal", str(journal))
    admit_many(d.endpoint, 5)
    d.kill()
    (journal / "snapshot").unlink()
    log = (journal / "wal").read_bytes()
    assert "holds records but" in refused(daemon, *FLAGS, "--journal", str(journal))
    assert (journal / "wal").read_bytes() == log
    result = journal_tool("check", str(journal))
    assert result.returncode == 1 and "the snapshot is missing" in result.stdout


def test_a_flipped_bit_mid_log_is_refused_and_repair_keeps_what_came_before(daemon, tmp_path):
    """One bit a third into the log: the restart refuses (naming the offset), check says where, repair cuts there."""
    journal = tmp_path / "j"
    d = daemon(*FLAGS, "--journal", str(journal))
    tables = admit_many(d.endpoint, 20)
    d.kill()
    wal = journal / "wal"
    data = bytearray(wal.read_bytes())
    end = len(data.rstrip(b"\0"))
    data[end // 3] ^= 0x10
    wal.write_bytes(bytes(data))
    message = refused(daemon, *FLAGS, "--journal", str(journal))
    assert "is damaged at offset" in message and "nothing was changed" in message
    assert wal.read_bytes() == bytes(data)
    check = journal_tool("check", str(journal), "--json")
    assert check.returncode == 1, check.stderr
    import json

    report = json.loads(check.stdout)
    offset, kept = report["damage"]["offset"], report["state"]["requests"]
    assert offset < end // 3 and 0 < kept < 20 and report["damage"]["records_after"] == 20 - kept - 1
    fixed = journal_tool("repair", str(journal), "--truncate-at", str(offset))
    assert fixed.returncode == 0, fixed.stderr
    backups = list(journal.glob("wal.backup-*"))
    assert len(backups) == 1 and backups[0].read_bytes() == bytes(data)
    d = daemon(*FLAGS, "--journal", str(journal), folder=d.folder)
    with CacheClient(d.endpoint) as client:
        assert client.stats()["num_requests"] == kept
        for i in range(kept):
            assert client.table(i).tolist() == tables[i]


def test_a_restart_with_smaller_limits_keeps_every_acknowledged_request_or_refuses(daemon, tmp_path):
    """Records replay under the limits they were accepted with; state the new limits cannot hold refuses start."""
    journal = tmp_path / "j"
    d = daemon(*FLAGS, "--journal", str(journal), "--snapshot-bytes", "100000000")
    tables = admit_many(d.endpoint, 20, tokens=3000)
    d.kill()
    d = daemon(*FLAGS, "--journal", str(journal), "--max-tokens", "100", "--max-message-bytes", "2000",
               folder=d.folder)
    with CacheClient(d.endpoint) as client:
        assert client.stats()["num_requests"] == 20
        assert all(client.table(i).tolist() == tables[i] for i in range(20))
        with pytest.raises(DaemonError, match="tokens"):  # the new limit holds for new messages
            client.admit("big", np.arange(200))
        epoch = client.info()["epoch"]
    d.kill()
    message = refused(daemon, *FLAGS, "--journal", str(journal), "--max-slots", "10", folder=d.folder)
    assert "max_slots: the journal's requests hold batch slot 19" in message and "--max-slots 65536" in message
    d = daemon(*FLAGS, "--journal", str(journal), "--max-slots", "20", folder=d.folder)
    with CacheClient(d.endpoint) as client:
        assert client.stats()["num_requests"] == 20 and client.info()["epoch"] == epoch
        with pytest.raises(DaemonError, match="slots are in use"):
            client.admit("one more", np.arange(5))


def test_a_full_disk_refuses_changes_answers_reads_and_recovers_everything_acknowledged(daemon, small_disk):
    journal = small_disk.path / "j"
    d = daemon(*FLAGS, "--journal", str(journal), "--snapshot-bytes", "200000")
    tables = admit_many(d.endpoint, 5, tokens=2000)
    filler = small_disk.fill()
    refusals = 0
    with CacheClient(d.endpoint) as client:
        for i in range(5, 400):  # the log's preallocated stretch runs out; snapshots fail meanwhile
            try:
                live = i
                tables[i] = client.admit(i, np.arange(i * 100_000, i * 100_000 + 30_000)).table.tolist()
                client.free(i)
                live = None
                del tables[i]
            except DaemonError as exc:
                assert str(exc).startswith("journal: no space left on device")
                refusals += 1
                break
        assert refusals == 1 and i > 10
        assert sorted(tables) == [*range(5), *([live] if live in tables else [])]  # the refused op changed nothing
        if live in tables:  # the free was refused: the request is still there
            assert client.table(live).tolist() == tables[live]
        assert client.lookup(np.arange(0, 2000)) == 1984 and client.table(0).tolist() == tables[0]  # reads
        assert client.stats()["num_requests"] == len(tables)
        with pytest.raises(DaemonError, match="no space left"):
            client.admit("big", np.arange(30_000))
        filler.unlink()
        tables["after"] = client.admit("after", np.arange(7, 2007)).table.tolist()
        client.free(1)
        del tables[1]
    assert d.process.poll() is None
    assert "Traceback" not in d.log() and "snapshot not written (journal: no space left on device" in d.log()
    d.kill()
    d = daemon(*FLAGS, "--journal", str(journal), folder=d.folder)
    with CacheClient(d.endpoint) as client:
        assert client.stats()["num_requests"] == len(tables)
        assert all(client.table(rid).tolist() == table for rid, table in tables.items())


def test_layer_group_pools_survive_kill_9_and_a_restart_with_other_pools_is_refused(daemon, tmp_path):
    """A daemon serving a model's layer groups with pools of their own: after kill -9 the same flags bring back
    every table and pool; other pool sizes (another --max-model-len) are refused, naming the setting."""
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gemma3_text", "num_hidden_layers": 6, "num_attention_heads": 8,
                                  "num_key_value_heads": 4, "head_dim": 64, "sliding_window": 64,
                                  "sliding_window_pattern": 3}))
    journal = tmp_path / "j"
    flags = ("--model", str(config), "--block-size", "16", "--gpu-memory", "64MiB", "--utilization", "1",
             "--max-num-batched-tokens", "256", "--journal", str(journal))
    d = daemon(*flags, "--max-model-len", "1024")
    with CacheClient(d.endpoint) as client:
        before = client.info()["rows"]
        assert before[0]["num_blocks"] < before[1]["num_blocks"]
        client.admit("long", np.arange(900))
        client.extend("long", np.arange(50))
        table = client.table("long")
        usage = client.usage.per_row.tolist()
    assert (table[0] == -1).any()
    d.kill()
    d = daemon(*flags, "--max-model-len", "1024", folder=d.folder)
    with CacheClient(d.endpoint) as client:
        assert client.info()["rows"] == before
        assert np.array_equal(client.table("long"), table) and client.usage.per_row.tolist() == usage
        client.check_integrity()
    d.stop()
    assert re.search(r"journal: (num_blocks|row_blocks) is .* in the journal but",
                     refused(daemon, *flags, "--max-model-len", "2048", folder=d.folder))


def rewrite_snapshot(journal, change) -> None:
    """Decode the journal's snapshot, let ``change(state)`` edit it, and write it back with a valid checksum (what a
    damaged disk or a hand edit could leave, past every check of the file itself)."""
    from kvcache.durability import dump_state, load_state

    path = journal / "snapshot"
    raw = path.read_bytes()
    state = load_state(bytearray(raw[6 + 12:]))
    change(state)
    state = b"".join(dump_state({k: v for k, v in state.items() if k not in ("format", "kvcache")}))
    path.write_bytes(raw[:6 + 8] + zlib.crc32(state).to_bytes(4, "little") + state)


@pytest.mark.parametrize("change, reason", [
    (lambda s: setattr(s["slots"], "owner", {str(k): v for k, v in s["slots"].owner.items()}),
     "slots: a batch slot that is not an integer >= 0"),
    (lambda s: s["manager"]._pool._stack2d.__setitem__((0, 0), s["manager"]._pool._stack2d[0, 1]),
     "has duplicates"),
])
def test_a_snapshot_whose_parts_disagree_is_refused_by_restart_and_check_alike(daemon, tmp_path, change, reason):
    """A snapshot that decodes but whose state is inconsistent (a slot map keyed by text, a free stack naming a
    block twice): the restart refuses with one line naming it, and `kvcache journal check` says the same, never
    "ok"."""
    journal = tmp_path / "j"
    d = daemon(*FLAGS, "--journal", str(journal), "--snapshot-bytes", "1")
    admit_many(d.endpoint, 3)
    d.stop()
    rewrite_snapshot(journal, change)
    before = {name: (journal / name).read_bytes() for name in ("snapshot", "wal")}
    message = refused(daemon, *FLAGS, "--journal", str(journal))
    assert "Traceback" not in message and f"journal: the recovered state is inconsistent in its snapshot" in message
    assert reason in message
    check = journal_tool("check", str(journal))
    assert check.returncode != 0 and "ok: a restart recovers" not in check.stdout
    assert "Traceback" not in check.stderr and reason in check.stderr and len(check.stderr.splitlines()) == 1
    assert {name: (journal / name).read_bytes() for name in ("snapshot", "wal")} == before


def test_a_deleted_lock_file_lets_no_second_daemon_or_repair_in(daemon, tmp_path):
    """The daemon locks the journal folder itself: with its lock file deleted, a second daemon and a repair are
    still refused (one line each) while it runs, and the log is untouched."""
    journal = tmp_path / "j"
    first = daemon("--num-blocks", "16", "--journal", str(journal))
    admit_many(first.endpoint, 1, tokens=20)
    (journal / "lock").unlink()
    message = refused(daemon, "--num-blocks", "16", "--journal", str(journal))
    assert "is in use by process" in message and "Traceback" not in message
    log = (journal / "wal").read_bytes()
    cut = journal_tool("repair", str(journal), "--truncate-at", "0")
    assert cut.returncode == 2 and "is in use by process" in cut.stderr and len(cut.stderr.splitlines()) == 1
    assert (journal / "wal").read_bytes() == log and not list(journal.glob("wal.backup-*"))
    (journal / "lock").write_text("1\n")  # a lock file put back by hand, naming someone else, changes nothing
    assert "is in use by process" in refused(daemon, "--num-blocks", "16", "--journal", str(journal))
    assert admit_many(first.endpoint, 1, tokens=20, start=1)  # the first still serves
    first.stop()
    assert journal_tool("repair", str(journal), "--truncate-at", "0").returncode == 0  # once it stopped


def limited(*args: str) -> subprocess.CompletedProcess:
    """``kvcache journal ARGS`` in an address space of 4 GiB: a log of 64 GiB read whole would not fit."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.RLIM_INFINITY))

    return subprocess.run([sys.executable, "-m", "kvcache", "journal", *args], capture_output=True, text=True,
                          timeout=60, preexec_fn=limit)


def test_check_and_repair_of_a_symlinked_lock_or_a_huge_sparse_log_say_one_line_in_bounded_memory(daemon, tmp_path):
    journal = tmp_path / "j"
    d = daemon(*FLAGS, "--journal", str(journal))
    admit_many(d.endpoint, 2)
    d.stop()
    wal = journal / "wal"
    (journal / "lock").unlink()
    (journal / "lock").symlink_to(tmp_path / "elsewhere")
    for result in (journal_tool("check", str(journal)), journal_tool("repair", str(journal), "--truncate-at", "0")):
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert f"{journal / 'lock'} is a symbolic link" in result.stderr and len(result.stderr.splitlines()) == 1
    (journal / "lock").unlink()
    os.truncate(wal, 64 << 30)  # a hole of 64 GiB after the records: zeros, as preallocation leaves
    check = limited("check", str(journal))
    assert check.returncode == 0 and "a restart recovers: 2 request(s)" in check.stdout, check.stderr
    d = daemon(*FLAGS, "--journal", str(journal), folder=d.folder)  # the restart reads no more than the check
    with CacheClient(d.endpoint) as client:
        assert client.stats()["num_requests"] == 2
    d.stop()
    with open(wal, "r+b") as f:  # data 64 GiB in: past what a log may hold
        f.seek(64 << 30)
        f.write(b"\1")
    for result in (limited("check", str(journal)), limited("repair", str(journal), "--truncate-at", "0")):
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert "holds data past 17,179,869,184 bytes" in result.stderr and len(result.stderr.splitlines()) == 1
    assert "holds data past" in refused(daemon, *FLAGS, "--journal", str(journal), folder=d.folder)


# Runs `kvcache journal check DIR` in this process, then prints the folders, sockets and threads it made.
_CHECK_WATCHED = """
import os, sys
made = []
sys.addaudithook(lambda event, args: made.append(f"{event} {args[0]}")
                 if event in ("os.mkdir", "tempfile.mkdtemp", "socket.__new__", "socket.bind") else None)
from kvcache.cli import main
threads = len(os.listdir("/proc/self/task"))
code = main(["journal", "check", sys.argv[1]])
print("made:", made, "new threads:", len(os.listdir("/proc/self/task")) - threads, "exit:", code)
"""


def test_check_replays_in_memory_with_no_socket_folder_or_zmq_thread(daemon, tmp_path):
    """`kvcache journal check` runs the restart's recovery on the daemon's state machine alone: it makes no
    folder or socket for the replay and starts no ZMQ I/O thread, and reports what the restart recovers."""
    journal = tmp_path / "j"
    d = daemon(*FLAGS, "--journal", str(journal))
    admit_many(d.endpoint, 3)
    d.stop()
    result = subprocess.run([sys.executable, "-c", _CHECK_WATCHED, str(journal)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "a restart recovers: 3 request(s) at delta seq 2" in result.stdout
    assert result.stdout.splitlines()[-1] == "made: [] new threads: 0 exit: 0"

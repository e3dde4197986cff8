"""`kvcache journal check|repair DIR`: what a restart would recover from a daemon's journal, and cutting a damaged log.

``check`` changes nothing: it reads the snapshot and replays the log in memory
as a restart would, and reports the requests that come back, a torn tail a
restart would cut, and damage a restart would refuse. ``repair`` cuts the log
at a record boundary (the offset ``check`` names), after copying it aside.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvcache.allocator.errors import KVCacheError
from kvcache.config import LOCAL_OFF, ServeConfig
from kvcache.journal import examine, repair


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `kvcache journal` with its check and repair commands."""
    p = sub.add_parser("journal", allow_abbrev=False, help="check or repair a daemon's journal folder",
                       description="Check what a restart would recover from a `kvcache serve --journal` folder, or "
                       "cut a damaged log. Run them while the daemon is stopped (check also works while it runs).")
    tools = p.add_subparsers(dest="journal_command", metavar="ACTION", required=True)
    check = tools.add_parser("check", help="report what a restart would recover, and any damage (changes nothing)",
                             allow_abbrev=False)
    check.add_argument("folder", metavar="DIR", help="the journal folder (--journal of kvcache serve)")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(run=_run_check)
    fix = tools.add_parser("repair", help="cut the log at a record boundary, keeping a backup of it", allow_abbrev=False)
    fix.add_argument("folder", metavar="DIR", help="the journal folder (--journal of kvcache serve)")
    fix.add_argument("--truncate-at", type=int, required=True, metavar="OFFSET",
                     help="where to cut: the offset `kvcache journal check` names; every record from it on is dropped")
    fix.set_defaults(run=_run_repair)


def check_journal(folder: str | Path) -> dict[str, Any]:
    """What a restart on ``folder`` would find: the snapshot, the records, the state they make, torn tail, damage.

    The records are replayed in memory by the daemon's state machine and journal (``Durability.restore``, what a
    restart runs), with no socket and no file written."""
    from kvcache.daemon_state import DaemonState
    from kvcache.durability import Durability, load_state

    recovered = examine(folder)
    report: dict[str, Any] = {
        "folder": str(folder), "snapshot_lsn": recovered.snapshot_lsn, "records": len(recovered.records),
        "last_lsn": recovered.snapshot_lsn + len(recovered.records), "records_end": recovered.records_end,
        "torn_bytes": recovered.truncated_bytes, "damage": None, "problem": None, "state": None,
    }
    if recovered.snapshot is None:
        if recovered.records or recovered.damage is not None or recovered.truncated_bytes:
            report["problem"] = "the log holds records but the snapshot is missing: a restart refuses"
        return report
    if recovered.damage is not None:
        report["damage"] = recovered.damage._asdict()
    state = load_state(bytearray(recovered.snapshot))  # the journal's own geometry and settings, to start as
    manager = state["manager"]
    settings = state["settings"]
    try:
        cfg = ServeConfig(local_endpoint=LOCAL_OFF, num_blocks=manager.num_blocks, block_size=manager.block_size,
                          role=settings["role"], tp=settings["tp"], max_slots=settings["max_slots"],
                          max_tokens=settings["max_tokens"], max_message_bytes=settings["max_message_bytes"])
        daemon = DaemonState(cfg.resolved(), manager)
    except (AttributeError, TypeError, ValueError) as exc:
        raise KVCacheError(f"journal: the snapshot's geometry or settings are malformed ({exc})") from None
    Durability(daemon).restore(recovered)  # what a restart runs
    hasher = daemon.manager.hasher
    report["state"] = {
        "requests": len(daemon.manager), "seq": daemon.deltas.seq, "epoch": daemon.deltas.epoch,
        "in_transfer": len(daemon.pd.transfers), "num_blocks": manager.num_blocks,
        "block_size": manager.block_size, "rows": len(manager.rows),
        "hash_algorithm": hasher.algorithm if hasher is not None else None, "settings": settings,
        "written_by": state.get("kvcache"),
    }
    return report


def render(report: dict[str, Any]) -> str:
    """The report as lines for a person."""
    folder = report["folder"]
    lines = [f"journal {folder}: snapshot at record {report['snapshot_lsn']}, {report['records']} record(s) after it "
             f"(to record {report['last_lsn']}, ending at offset {report['records_end']} of the log)"]
    if report["problem"]:
        lines.append(f"problem: {report['problem']}")
    state = report["state"]
    if state is not None:
        settings = ", ".join(f"{k}={v}" for k, v in state["settings"].items())
        lines.append(f"written by kvcache {state['written_by']} with {settings}; {state['num_blocks']:,} blocks x "
                     f"{state['rows']} row(s), block_size {state['block_size']}, prefix hash "
                     f"{state['hash_algorithm'] or 'off'}")
        before = " (the records before the damage)" if report["damage"] else ""
        lines.append(f"a restart recovers{before}: {state['requests']:,} request(s) at delta seq {state['seq']:,}, "
                     f"epoch {state['epoch']:#x}, {state['in_transfer']} in transfer")
    if report["torn_bytes"]:
        lines.append(f"torn tail: {report['torn_bytes']} byte(s) after offset {report['records_end']} (a commit "
                     "that was never acknowledged); a restart cuts them")
    damage = report["damage"]
    if damage:
        lines.append(f"damage: record {damage['lsn']} at offset {damage['offset']} {damage['problem']}, and "
                     f"{damage['records_after']} valid record(s) of later commits follow from offset "
                     f"{damage['resumes_at']} (up to record {damage['last_lsn']}): a restart refuses. "
                     f"`kvcache journal repair {folder} --truncate-at {damage['offset']}` drops record "
                     f"{damage['lsn']} and everything after it, keeping a backup of the log")
    if not (report["problem"] or damage):
        lines.append("ok: a restart recovers all of it")
    return "\n".join(lines)


def _run_check(args: argparse.Namespace) -> int:
    report = check_journal(args.folder)
    print(json.dumps(report) if args.json else render(report))
    return 1 if report["problem"] or report["damage"] else 0


def _run_repair(args: argparse.Namespace) -> int:
    before = examine(args.folder)
    if args.truncate_at > before.records_end and before.damage is None:
        raise KVCacheError(f"--truncate-at: {args.truncate_at} lies past the log's last whole record "
                           f"(offset {before.records_end}); nothing to cut")
    backup = repair(args.folder, args.truncate_at)
    after = examine(args.folder)
    dropped = len(before.records) - len(after.records) + (before.damage.records_after if before.damage else 0)
    print(f"kvcache journal repair: cut {Path(args.folder) / 'wal'} at offset {args.truncate_at}, dropping {dropped} "
          f"valid record(s) and any damaged bytes from there on; the old log is kept in {backup}")
    return 0

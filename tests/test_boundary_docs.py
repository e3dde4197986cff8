"""docs/operations.md's "Who may touch what" is the one statement of the daemon's boundaries, and it cannot drift:
every op the code declares a caller for (``OP_CALLERS``) is listed there under that caller and no other, every
refusal it quotes is a line the code prints, and docs/protocol.md links to it instead of repeating the rules."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvcache.protocol import OP_CALLERS

from test_docs import check_line

ROOT = Path(__file__).resolve().parents[1]
OPERATIONS = ROOT / "docs" / "operations.md"
PROTOCOL = ROOT / "docs" / "protocol.md"
SECTION = "### Who may touch what"


def section() -> str:
    text = OPERATIONS.read_text()
    assert SECTION in text, f"{OPERATIONS.name} lost its section {SECTION!r}"
    return text.split(SECTION, 1)[1].split("\n## ", 1)[0]


def table_rows(text: str, header: str) -> list[list[str]]:
    """The body rows (cells, stripped) of the markdown table whose header row starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    assert rows, f"the table headed {header!r} is empty"
    return rows


def documented_callers() -> dict[str, list[str]]:
    """Each op the op table names, with every caller row it appears in."""
    found: dict[str, list[str]] = {}
    for caller, ops, *_ in table_rows(section(), "| caller | ops |"):
        m = re.fullmatch(r"`(\w+)`", caller)
        assert m, f"a caller cell must be one `name`, got {caller!r}"
        for op in re.findall(r"`(\w+)`", ops):
            found.setdefault(op, []).append(m.group(1))
    return found


def quoted_refusals() -> list[str]:
    """The lines quoted in the boundary table's "refused with" column."""
    rows = table_rows(section(), "| boundary | who may |")
    assert all(len(row) == 4 for row in rows), [row[0] for row in rows if len(row) != 4]
    return [line for row in rows for line in re.findall(r"`([^`]+)`", row[3])]


def test_every_op_is_in_the_table_under_the_caller_the_code_declares() -> None:
    """The table lists each op of OP_CALLERS once, with OP_CALLERS's caller; it names no op the daemon lacks."""
    documented = documented_callers()
    assert {op: callers for op, callers in documented.items() if len(callers) > 1} == {}
    assert {op: callers[0] for op, callers in documented.items()} == OP_CALLERS


def test_each_boundary_a_finding_named_has_a_row() -> None:
    """The boundaries that need a rule each have a row: sockets, folders, journal, host file, keys, worker sockets,
    transfer peers, reports and revocation."""
    firsts = " ".join(row[0] for row in table_rows(section(), "| boundary | who may |"))
    for word in ("tcp sockets", "socket folder", "ipc socket file", "delta socket", "journal folder", "host file",
                 "key file", "admin key", "attach", "received", "sent", "tier_done", "tier_expire",
                 "kernel copy", "revoking"):
        assert word in firsts, f"no boundary row names {word!r}"


@pytest.mark.parametrize("line", quoted_refusals())
def test_a_quoted_refusal_is_a_line_the_code_prints(line: str) -> None:
    assert check_line(line), f"no format string in kvcache, allocator or transfer prints {line!r}"


def test_protocol_md_links_to_the_table_and_does_not_repeat_it() -> None:
    text = PROTOCOL.read_text()
    assert "operations.md#who-may-touch-what" in text
    assert not re.search(r"^\| (scheduler|admin|worker of rank r|the daemon) \|", text, re.MULTILINE), \
        "protocol.md repeats the callers table: link to operations.md instead"

"""The lines docs/operations.md quotes from the daemon are the daemon's exact text.

Convention (stated above the table in the doc): every line in backticks in the first column of the table under
"What failures look like in the log" is printed by the daemon, on stderr (``kvcache serve: error: ...``) or in its
log (``LEVEL message``, after the time and the logger's name). In a quoted line a word in capitals stands for a
value, a number is an example of one, and ``...`` is text left out (at the end: the rest of the line).

Each line is checked against the format strings in the source (f-strings and %-formats, their placeholders taking
one value each, or a whole message built by another format string), and the lines of a refused start are also
provoked from a real ``kvcache serve``.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "operations.md"
SECTION = "## What failures look like in the log"
SOURCES = ("kvcache", "allocator", "transfer")
LEVELS = {"debug": "DEBUG", "info": "INFO", "warning": "WARNING", "error": "ERROR", "exception": "ERROR",
          "critical": "CRITICAL"}
PERCENT = re.compile(r"%(?:\([^)]*\))?[-#0 +]*\d*(?:\.\d+)?[sdrfgixXeEc]")
MAX_DEPTH = 3  # messages inside messages: the CLI's "error: {exc}" around a journal's message around an OSError's
MIN_CUT_WORDS = 3  # a line cut short with "..." keeps at least this many words of its own

Template = tuple  # literal strings and None for each placeholder, in order


def quoted_lines() -> list[str]:
    """The backticked first cell of each row of the failure table."""
    text = DOC.read_text()
    assert SECTION in text, f"{DOC.name} lost its section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    lines = [m.group(1) for m in re.finditer(r"^\| `([^`]+)`", section, re.MULTILINE)]
    assert lines, f"no quoted lines under {SECTION!r}"
    return lines


def _parts_of(node: ast.AST) -> Template | None:
    """A string literal or f-string as literal parts and placeholders (None); None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        parts: list[str | None] = []
        pos = 0
        for m in PERCENT.finditer(node.value):
            parts += [node.value[pos:m.start()], None]
            pos = m.end()
        parts.append(node.value[pos:])
        return tuple(p.replace("%%", "%") if p is not None else None for p in parts)
    if isinstance(node, ast.JoinedStr):
        return tuple(v.value if isinstance(v, ast.Constant) else None for v in node.values)
    return None


@lru_cache(maxsize=1)
def templates() -> tuple[dict[str, tuple[Template, ...]], tuple[Template, ...]]:
    """(log format strings by level, with "any" for ``log.log``), and every string literal of the package."""
    by_level: dict[str, list[Template]] = {}
    every: list[Template] = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                parts = _parts_of(node)
                if parts is not None and _has_word(parts):
                    every.append(parts)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                    name = node.func.attr
                    args = node.args[1:] if name == "log" else node.args
                    level = "any" if name == "log" else LEVELS.get(name)
                    fmt = _parts_of(args[0]) if level and args else None
                    if fmt is not None:
                        by_level.setdefault(level, []).append(fmt)
    return {k: tuple(v) for k, v in by_level.items()}, tuple(dict.fromkeys(every))


def _has_word(parts: Template) -> bool:
    """Whether a template says something of its own (a word of 3+ letters), not just joins values."""
    return any(p and re.search(r"[A-Za-z]{3}", p) for p in parts)


@lru_cache(maxsize=None)
def _regexes(parts: Template, cut: bool, loose: bool) -> tuple[re.Pattern, ...]:
    """Regexes a text matches when it is an instance of ``parts`` (with ``cut``, the start of one, ending at a
    placeholder or a word). A placeholder takes one value (no space), or with ``loose`` any text."""
    hole = "(.*?)" if loose else r"(\S*)"

    def build(items: Template, tail: str = "") -> re.Pattern:
        return re.compile("".join(hole if p is None else re.escape(p) for p in items) + re.escape(tail), re.DOTALL)

    if not cut:
        return (build(parts),)
    out = []
    for k, p in enumerate(parts):
        if p is None:
            out.append(build(parts[:k + 1]))
        else:
            out += [build(parts[:k], p[:j]) for j in range(1, len(p)) if p[j] == " "]
    return tuple(out)


@lru_cache(maxsize=None)
def is_printed(text: str, candidates: tuple[Template, ...], depth: int = 0) -> bool:
    """Whether ``text`` (a quoted line, placeholders and ``...`` as the doc writes them) is an instance of one of
    ``candidates``: each placeholder holding one value or a message of any template. A trailing `` ...`` leaves
    the rest of the message out, after at least ``MIN_CUT_WORDS`` of its own words."""
    cut = text.endswith(" ...")
    for loose in (False, True):
        for parts in candidates:
            if _first_word(parts) not in text:  # a quick filter: the template's first word is in every instance
                continue
            for regex in _regexes(parts, False, loose):
                m = regex.fullmatch(text)
                if m and all(_is_value(g, depth) for g in m.groups()):
                    return True
            if cut:
                for regex in _regexes(parts, True, loose):
                    m = regex.fullmatch(text[:-4])
                    if m and _words(text) - sum(map(_words, m.groups())) >= MIN_CUT_WORDS and all(
                            _is_value(g, depth) for g in m.groups()):
                        return True
    return False


def _first_word(parts: Template) -> str:
    return next(m.group() for p in parts if p for m in [re.search(r"[A-Za-z]{3,}", p)] if m)


def _words(text: str) -> int:
    return len(re.findall(r"[A-Za-z]{2,}", text))


def _is_value(text: str, depth: int) -> bool:
    """A placeholder's text: one value (no space, or ``...``), or a message some template prints."""
    if " " not in text:
        return True
    return depth < MAX_DEPTH and is_printed(text, templates()[1], depth + 1)


def check_line(line: str) -> bool:
    """Whether the daemon prints ``line``: a log message at its level, or a line of the process's stderr."""
    by_level, every = templates()
    level, _, message = line.partition(" ")
    if level in LEVELS.values():
        return is_printed(message, by_level.get(level, ()) + by_level.get("any", ()))
    return is_printed(line, every)


@pytest.mark.parametrize("line", quoted_lines())
def test_quoted_line_is_the_daemons_text(line):
    assert check_line(line), f"docs/operations.md quotes a line no format string in the source prints: {line!r}"


@pytest.mark.parametrize("line", [
    "kvcache serve: error: endpoint: ... is held by process PID",  # an inner lock error, printed only rewrapped
    "WARNING journal DIR: cut a torn tail of N bytes",  # a line cut short without saying so
    "ERROR journal DIR: cut a torn tail of N bytes after offset M (a commit that was never acknowledged)",
    "kvcache serve: error: journal: DIR is in use by process PID (another daemon) ...",
])
def test_lines_the_daemon_never_prints_are_refused(line):
    """The check is strict enough to catch a misquote: wrong words, a wrong level, a silently shortened line."""
    assert not check_line(line)


def as_regex(line: str) -> re.Pattern:
    """A quoted line as a regex over the real text: capitals and numbers are values, ``...`` any text."""
    out = []
    for token in re.split(r"(\.\.\.|\b[A-Z][A-Z_]+\b|\b[A-Z]\b|\b\d+(?:\.\d+)?\b)", line):
        if token == "...":
            out.append(".*")
        elif re.fullmatch(r"[A-Z][A-Z_]*|\d+(?:\.\d+)?", token) and token not in ("CURVE",):
            out.append(r"\S+?")
        else:
            out.append(re.escape(token))
    return re.compile("".join(out))


def test_refused_starts_print_the_quoted_lines(daemon, tmp_path):
    """A second daemon on the same endpoint, and one on another endpoint with the same journal, print what the
    doc says, word for word."""
    journal = tmp_path / "journal"
    journal.mkdir(mode=0o700)
    first = daemon("--num-blocks", "64", "--journal", str(journal))
    quoted = {line.split(": ")[2]: line for line in quoted_lines() if " is in use by " in line}

    def refused(*flags: str) -> str:
        result = subprocess.run([sys.executable, "-m", "kvcache", "serve", "--num-blocks", "64", *flags],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        return result.stderr.strip().splitlines()[-1]

    line = refused("--endpoint", first.endpoint)
    assert as_regex(quoted["endpoint"]).fullmatch(line), line
    line = refused("--endpoint", f"ipc://{first.folder}/other.sock", "--journal", str(journal))
    assert as_regex(quoted["journal"]).fullmatch(line), line

"""docs/deployment.md stays true: the `kvcache plan` output it quotes is what the command prints now, and every test
it names for a claim exists."""
from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "deployment.md"


def quoted_runs() -> list[tuple[list[str], list[str]]]:
    """(arguments after `kvcache`, the output lines quoted under it) of each `$ kvcache ...` in the doc's code blocks;
    a `...` line stands for lines left out."""
    runs: list[tuple[list[str], list[str]]] = []
    for block in re.findall(r"^```\w*\n(.*?)^```", DOC.read_text(), re.DOTALL | re.MULTILINE):
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            if not lines[i].startswith("$ kvcache "):
                if runs:
                    runs[-1][1].append(lines[i])
                i += 1
                continue
            command = lines[i][2:]
            while command.endswith("\\"):
                i += 1
                command = command[:-1] + lines[i].strip()
            runs.append((shlex.split(command, comments=True)[1:], []))
            i += 1
    assert runs, "no `$ kvcache` command quoted in docs/deployment.md"
    return runs


def named_tests() -> list[str]:
    return sorted(set(re.findall(r"tests/(test_\w+\.py::test_\w+)", DOC.read_text())))


@pytest.mark.parametrize("args, quoted", quoted_runs(), ids=lambda v: " ".join(v[:6]) if v and v[0] == "plan" else "")
def test_the_quoted_output_is_what_the_command_prints(args: list[str], quoted: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "kvcache", *args], capture_output=True, text=True, timeout=120,
                         check=True).stdout.splitlines()
    for line in quoted:
        if line.strip() and line.strip() != "...":
            assert line in out, f"`kvcache {' '.join(args)}` no longer prints {line!r}"


@pytest.mark.parametrize("ref", named_tests())
def test_a_named_test_exists(ref: str) -> None:
    file, name = ref.split("::")
    path = ROOT / "tests" / file
    assert path.exists(), f"docs/deployment.md names {ref}, but tests/{file} does not exist"
    defined = {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}
    assert name in defined, f"docs/deployment.md names {ref}, but tests/{file} has no {name}"

"""Every code block of README.md runs, so the README cannot drift from the package.

The blocks run in the order a reader meets them:

- ```python: executed in one namespace (a later block uses what an earlier one defined). The names the README
  leaves to the reader's program (a prompt's tokens, the engine's cache tensors, ...) are ``GIVENS``; a block
  that talks to a daemon gets the one the last ```sh block started (its ``ipc://...`` address replaced by that
  daemon's), or, for a worker of a host tier, one that ``host_tier_daemon`` starts.
- ```sh: every line is a command. ``kvcache serve`` starts (in a private folder, its ``--journal`` there too),
  prints its ready line and stays up for the blocks after it, stopped by SIGTERM when the next one starts; a line
  with ``...`` in its flags is checked by the CLI's own parser and settings. Other ``kvcache`` commands and
  ``python examples/...`` run and must exit 0 (the PD demo parses its flags only where NIXL is missing);
  ``make X`` must name a target of the Makefile.
- ```text: output of the command just before it; its lines appear in that output in order (``...`` skips lines).

Anything else (another language, a command of another kind) fails: a new block needs a rule here.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

from kvcache.allocator.layout import DTYPE_BYTES
from kvcache.transfer.nixl import nixl_available

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
SHELL = ("sh", "bash", "console", "shell")
READY = "kvcache serve: ready"
RAW = {1: np.uint8, 2: np.uint16, 4: np.uint32}  # numpy has no bfloat16: an element width's unsigned dtype

# Names the README leaves to the reader's program, as small values that fit the blocks.
GIVENS: dict[str, Any] = {
    "prompt_tokens": list(range(1, 2_001)),  # a prompt (the allocator's)
    "prompt": list(range(100, 400)),
    "next_token": 5, "ids": ["req-1"], "tokens": [7], "counts": [1],  # a decode step
    "decoded": {"req-a": 11, "req-b": 12},  # requests decoding through the daemon: their sampled tokens
    "rank": 0, "device": os.getpid(), "num_layers": 4, "stream": None,  # send_cache on the CPU
    "num_blocks": 64, "rid": "req-1", "layer": 0, "r": 0,
}
HOST_TIER_FLAGS = ["--model", "gemma-3-4b", "--block-size", "16", "--num-blocks", str(GIVENS["num_blocks"]),
                   "--host-block-budget", "64"]


class Block(NamedTuple):
    lang: str
    text: str
    line: int  # of the opening fence, 1-based


def readme_blocks() -> list[Block]:
    """The fenced code blocks of README.md."""
    blocks, lang, start, body = [], None, 0, []
    for n, line in enumerate(README.read_text().splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, body = line[3:].strip(), n, []
            else:
                blocks.append(Block(lang, "\n".join(body), start))
                lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"README.md: the block at line {start} is not closed"
    return blocks


def commands(block: Block) -> list[list[str]]:
    """A shell block's commands, each split as the shell would (comments dropped)."""
    return [argv for line in block.text.splitlines() if (argv := shlex.split(line, comments=True))]


def kind_of(argv: list[str]) -> str:
    """What the test does with a command: make / serve / parse-only serve / run; else it cannot check it."""
    if argv[0] == "make":
        return "make"
    if argv[0] == "kvcache" and argv[1:2] == ["serve"]:
        return "parse" if "..." in argv else "serve"
    if argv[0] == "kvcache" or argv[:2] == ["python", "-m"] and argv[2:3] == ["kvcache"]:
        return "run"
    if argv[0] == "python" and argv[1:2] and argv[1].startswith("examples/") and (ROOT / argv[1]).is_file():
        return "run"
    return "unknown"


def test_every_block_is_one_the_test_checks():
    """A block in another language, or a command the test does not know how to check, fails here first."""
    blocks = readme_blocks()
    assert blocks
    for i, block in enumerate(blocks):
        where = f"README.md line {block.line}"
        assert block.lang in ("python", "text", *SHELL), f"{where}: a ```{block.lang} block; tests/test_readme.py " \
                                                          "runs python, sh and text blocks"
        if block.lang in SHELL:
            for argv in commands(block):
                assert kind_of(argv) != "unknown", f"{where}: tests/test_readme.py cannot check {shlex.join(argv)!r}"
        if block.lang == "text":
            assert i and blocks[i - 1].lang in SHELL, f"{where}: a text block shows the output of a sh block before it"


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w.-]*):", text, re.MULTILINE))


class Reader:
    """Runs the README's blocks in order: the namespace, the running daemon, the last command's output."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.runtime = folder / "run"  # $XDG_RUNTIME_DIR: the daemon's default endpoint lands here
        self.runtime.mkdir(mode=0o700)
        self.env = dict(os.environ, XDG_RUNTIME_DIR=str(self.runtime))
        self.namespace: dict[str, Any] = dict(GIVENS)
        self.daemon: subprocess.Popen | None = None
        self.endpoint: str | None = None
        self.output: str | None = None
        self.journals = 0

    # ------------------------------------------------------------------ shell blocks

    def shell(self, block: Block) -> None:
        self.output = None
        for argv in commands(block):
            kind = kind_of(argv)
            where = f"README.md line {block.line}: {shlex.join(argv)}"
            if kind == "make":
                missing = set(argv[1:]) - makefile_targets()
                assert not missing, f"{where}: no Makefile target {', '.join(sorted(missing))}"
            elif kind == "parse":
                self.parse_serve([a for a in argv[2:] if a != "..."], where)
            elif kind == "serve":
                self.start_serve(argv[2:], where)
            elif kind == "run":
                self.output = self.run(argv, where)
            else:
                pytest.fail(f"{where}: tests/test_readme.py cannot check this command")

    def run(self, argv: list[str], where: str) -> str:
        if argv[0] == "kvcache":
            argv = [sys.executable, "-m", "kvcache", *argv[1:]]
        elif argv[0] == "python":
            argv = [sys.executable, *argv[1:]]
            if argv[1] == "examples/pd_demo.py" and not nixl_available():  # its flags, where NIXL cannot run it
                argv.append("--help")
        result = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, (f"{where}: exit {result.returncode}\n"
                                        f"{result.stdout[-2000:]}{result.stderr[-4000:]}")
        return result.stdout

    @staticmethod
    def parse_serve(flags: list[str], where: str) -> None:
        """The flags go through `kvcache serve`'s parser and settings checks, as a start would take them."""
        from kvcache.allocator.errors import KVCacheError
        from kvcache.cli import build_parser
        from kvcache.serve import config_from_args

        try:
            config_from_args(build_parser().parse_args(["serve", *flags]))
        except (KVCacheError, SystemExit) as exc:
            pytest.fail(f"{where}: {exc}")

    def start_serve(self, flags: list[str], where: str) -> None:
        """Start `kvcache serve FLAGS` (a journal folder moved into this test's folder), wait for its ready line."""
        self.stop_daemon()
        flags = list(flags)
        if "--journal" in flags:
            self.journals += 1
            flags[flags.index("--journal") + 1] = str(self.folder / f"journal-{self.journals}")
        log = self.folder / f"serve-{time.monotonic_ns()}.log"
        with open(log, "wb") as out:
            self.daemon = subprocess.Popen([sys.executable, "-m", "kvcache", "serve", *flags], stdout=out,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env)
        deadline = time.monotonic() + 60
        while READY not in log.read_text(errors="replace"):
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                self.stop_daemon()
                pytest.fail(f"{where}: no ready line\n{log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.05)
        line = next(x for x in log.read_text().splitlines() if x.startswith(READY))
        self.endpoint = re.search(r"endpoint=(\S+)", line).group(1)

    def stop_daemon(self) -> None:
        """SIGTERM the running daemon; it must exit cleanly within 10 s."""
        if self.daemon is None:
            return
        daemon, self.daemon, self.endpoint = self.daemon, None, None
        daemon.send_signal(signal.SIGTERM)
        try:
            assert daemon.wait(10) == 0, f"kvcache serve exited with {daemon.returncode} on SIGTERM"
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(10)
            pytest.fail("kvcache serve did not stop within 10 s of SIGTERM")

    # ------------------------------------------------------------------ text blocks

    def text(self, block: Block) -> None:
        """The block's lines appear in the last command's output, in order; ``...`` skips lines."""
        assert self.output is not None, f"README.md line {block.line}: no command output to compare with"
        lines = [line.rstrip() for line in self.output.splitlines()]
        at = 0
        for segment in re.split(r"^\.\.\.$", block.text, flags=re.MULTILINE):
            want = [line.rstrip() for line in segment.strip("\n").splitlines()]
            if not want:
                continue
            found = next((i for i in range(at, len(lines) - len(want) + 1) if lines[i:i + len(want)] == want), None)
            assert found is not None, (f"README.md line {block.line}: these lines are not in the output, in order:\n"
                                       + "\n".join(want) + "\n--- the output:\n" + self.output)
            at = found + len(want)

    # ------------------------------------------------------------------ python blocks

    def python(self, block: Block) -> None:
        code = block.text
        if "TierAgent(" in code:
            self.host_tier_daemon()
        if "KVRegion.from_tensors(spec, caches)" in code and "caches" not in self.namespace:
            self.namespace["caches"] = numpy_caches(self.namespace["spec"], self.namespace["num_blocks"])
        if "ipc://" in code:
            assert self.endpoint, f"README.md line {block.line}: the block needs a daemon; no sh block started one"
            code = re.sub(r'"ipc://[^"]*"', repr(self.endpoint), code)
            if "decoded" in code:
                self.admit_decoding()
        exec(compile(code, f"README.md, block at line {block.line}", "exec"), self.namespace)
        results = self.namespace.get("results")
        if isinstance(results, list):
            from kvcache.client import DaemonError
            failed = [r for r in results if isinstance(r, DaemonError)]
            assert not failed, f"README.md line {block.line}: the daemon refused {failed}"
            self.namespace.pop("results")

    def admit_decoding(self) -> None:
        """The requests ``decoded`` extends, and the one the step frees, exist on the daemon."""
        from kvcache.client import CacheClient

        with CacheClient(self.endpoint) as client:
            for i, rid in enumerate([*GIVENS["decoded"], "done"]):
                assert client.admit(rid, [i + 1] * 40) is not None

    def host_tier_daemon(self) -> None:
        """A daemon with a host tier serving the namespace's ``spec``, and ``cache``, its scheduler after a step."""
        from kvcache.client import CacheClient

        self.start_serve(HOST_TIER_FLAGS, "host tier daemon")
        self.namespace["endpoint"] = self.endpoint
        cache = CacheClient(self.endpoint)
        assert cache.admit("host-req", GIVENS["prompt"]) is not None
        self.namespace["cache"] = cache

    def close(self) -> None:
        """Close what the blocks opened (later first), stop the daemon."""
        for obj in reversed(list(self.namespace.values())):
            if type(obj).__module__.startswith("kvcache") and callable(getattr(obj, "close", None)):
                obj.close()
        sig = self.namespace.get("sig")
        if sig is not None:
            type(sig).remove(sig.name)
        self.stop_daemon()


def numpy_caches(spec: Any, num_blocks: int) -> list[list[np.ndarray]]:
    """An engine's per-layer cache tensors for ``spec`` in numpy (zeros, paged in only where written)."""
    return [[np.zeros(t.shape(num_blocks), dtype=RAW[DTYPE_BYTES[t.dtype]]) for t in spec.tensors()]
            for _ in range(spec.num_layers)]


def test_readme_blocks_run_in_order():
    folder = Path(tempfile.mkdtemp(prefix="kv-readme-", dir="/tmp"))  # short: ipc socket paths are limited
    reader = Reader(folder)
    try:
        for block in readme_blocks():
            if block.lang == "python":
                reader.python(block)
            elif block.lang in SHELL:
                reader.shell(block)
            elif block.lang == "text":
                reader.text(block)
            else:
                pytest.fail(f"README.md line {block.line}: tests/test_readme.py does not run ```{block.lang} blocks")
    finally:
        reader.close()
        shutil.rmtree(folder, ignore_errors=True)


def measured_section() -> str:
    text = README.read_text()
    assert "## Measured\n" in text, "README.md lost its Measured section"
    return text.split("## Measured\n", 1)[1].split("\n## ", 1)[0]


def test_readme_figures_are_quoted_from_benchmarks():
    """docs/benchmarks.md is the one source of numbers: the README's Measured section holds no table, and each
    figure it gives is a backticked quote found there word for word."""
    section = measured_section()
    benchmarks = " ".join(BENCHMARKS.read_text().split())
    assert "|---" not in section, "README.md repeats a results table; point to docs/benchmarks.md instead"
    prose = re.sub(r"\]\([^)]*\)", "]", section)  # link targets are no figures
    quotes = re.findall(r"`([^`]+)`", prose, flags=re.DOTALL)
    for quote in quotes:
        if re.search(r"\d", quote):
            assert " ".join(quote.split()) in benchmarks, f"README.md quotes {quote!r}, not in docs/benchmarks.md"
    bare = re.sub(r"`[^`]+`", "", prose, flags=re.DOTALL)
    assert not re.search(r"\d", bare), f"README.md's Measured section has a figure outside a quote: {bare!r}"

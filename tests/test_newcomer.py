"""What a first run of the examples and commands shows: one clear line where something is missing, nothing else."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_S = 120.0  # a subprocess that hangs fails the test instead of the suite


def hide_modules(folder: Path, *names: str) -> dict[str, str]:
    """An environment whose Python cannot import ``names``: each is a module in ``folder`` that raises ImportError."""
    folder.mkdir(exist_ok=True)
    for name in names:
        (folder / f"{name}.py").write_text(f"raise ImportError('{name} is hidden for this test')\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH", "")]))
    return env


def test_pd_demo_without_nixl_says_what_to_install_in_one_line(tmp_path):
    """Without NIXL, examples/pd_demo.py starts nothing: it prints one line naming NIXL and the command that
    installs it, and exits 2 (not a worker's traceback and then the demo's)."""
    env = hide_modules(tmp_path / "hidden", "nixl_cu12", "nixl_cu13", "nixl")
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "pd_demo.py")], env=env, capture_output=True,
                          text=True, timeout=RUN_S, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("pd_demo: error: NIXL is not installed")
    assert "pip install --no-deps nixl-cu12" in lines[0] and "make install" in lines[0]


def test_the_engine_backend_imports_paddle_without_the_ccache_warning(tmp_path):
    """The reference engine's Paddle backend (every process of examples/engine/demo.py and check.py) imports
    Paddle without its "No ccache found" warning and keeps every other warning filter: other warnings, Paddle's
    included, still show."""
    pytest.importorskip("paddle")
    code = """
import sys, warnings
sys.path.insert(0, sys.argv[1])
from backend import paddle_backend
before = list(warnings.filters)
backend = paddle_backend()
assert backend.name == "paddle" and all(f in warnings.filters for f in before)
warnings.warn_explicit("another warning", UserWarning, "extension_utils.py", 1,
                       module="paddle.utils.cpp_extension.extension_utils")
"""
    done = subprocess.run([sys.executable, "-c", code, str(ROOT / "examples" / "engine")], capture_output=True,
                          text=True, timeout=RUN_S, cwd=tmp_path, env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert "ccache" not in done.stdout + done.stderr
    assert "UserWarning: another warning" in done.stderr


def test_a_worker_with_paddle_tables_imports_paddle_without_the_ccache_warning(tmp_path):
    """A worker asking for Paddle tables (out="paddle") imports Paddle without its "No ccache found" warning."""
    pytest.importorskip("paddle")
    code = """
import numpy as np
from kvcache.worker import _framework_view
view = _framework_view("paddle", np.arange(6, dtype=np.int32))
assert view.numpy().tolist() == list(range(6))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=RUN_S,
                          cwd=tmp_path, env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert "ccache" not in done.stdout + done.stderr


def test_stats_names_the_scheduler_endpoint_it_asked(daemon, capsys):
    """`kvcache stats --endpoint E` heads its summary with E, the socket it queried, not the daemon's PUB socket;
    --json carries it too."""
    from kvcache.cli import main

    d = daemon("--num-blocks", "32", "--block-size", "4")
    assert main(["stats", "--endpoint", d.endpoint]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("kvcache ") and f" at {d.endpoint}: 32 blocks x 1 row(s)" in first, first
    assert "pub" not in first
    assert main(["stats", "--endpoint", d.endpoint, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["endpoint"] == d.endpoint

"""A regular (non-editable) install carries every package folder, the examples and the C extensions."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_and_runs_outside_the_source_tree(tmp_path):
    """`pip install .` maps allocator/, transfer/, ops/ into kvcache.* and ships what the CLI needs."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist")],
        check=True, capture_output=True, timeout=600,
    )
    (wheel,) = (tmp_path / "dist").glob("kvcache-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for expected in ("kvcache/allocator/layout.py", "kvcache/transfer/__init__.py", "kvcache/ops/__init__.py",
                     "kvcache/examples/llama-3.1-70b.json", "kvcache/cli.py", "kvcache/bench/allocator.py"):
        assert expected in names
    for extension in ("kvcache/allocator/_chainhash", "kvcache/allocator/_hashtable", "kvcache/allocator/_tables",
                      "kvcache/allocator/_pool",
                      "kvcache/ops/_send_cache",
                      "kvcache/transfer/_copy"):
        assert any(n.startswith(extension) and n.endswith(".so") for n in names), f"{extension} not built"
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = dict(os.environ, PYTHONPATH=str(site))
    probe = (
        "import kvcache, kvcache.allocator, kvcache.transfer, kvcache.ops, json, sys;"
        "from kvcache.allocator import BlockHasher, KVCacheManager;"
        "assert BlockHasher(16).native;"
        "m = KVCacheManager(8, 4); m.admit(0, list(range(9)));"
        "print(kvcache.__file__);"
        "from kvcache.cli import main; sys.exit(main(['plan', '--json']))"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    first, rest = result.stdout.split("\n", 1)
    assert first.startswith(str(site)), f"imported {first}, not the installed wheel"
    assert '"num_blocks"' in rest

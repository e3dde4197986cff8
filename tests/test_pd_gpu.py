"""PD disaggregation with PyTorch caches on a GPU: the demo's checks, and the benchmark's smoke run (VRAM over NIXL)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvcache.transfer.nixl import nixl_available  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")]
DEMO = Path(__file__).resolve().parent.parent / "examples" / "pd_demo.py"


@pytest.mark.parametrize("tp", [("1", "1"), ("2", "1")])
def test_the_demo_moves_gpu_caches_byte_for_byte(tp):
    run = subprocess.run([sys.executable, str(DEMO), "--device", "cuda", "--prefill-tp", tp[0], "--decode-tp", tp[1],
                          "--layers", "4"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK: decode KV equals prefill KV byte for byte" in run.stdout


def test_bench_pd_quick_runs_on_gpu_caches(capsys):
    from kvcache.bench import pd as bench

    assert bench.main(["--quick", "--json", "--device", "cuda"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["workload"]["device"] == "cuda:0" and r["rate"] > 0 and r["tail_s"]["median"] > 0


def test_the_demo_moves_head_wise_gpu_caches_byte_for_byte():
    run = subprocess.run([sys.executable, str(DEMO), "--device", "cuda", "--prefill-tp", "2", "--layers", "4",
                          "--rows", "window:64:16*2,full*2"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK: decode KV equals prefill KV byte for byte" in run.stdout

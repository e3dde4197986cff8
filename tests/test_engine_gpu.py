"""The reference engine on a GPU: the model in PyTorch, attention by flex attention over kvcache's paged cache."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ENGINE = Path(__file__).resolve().parents[1] / "examples" / "engine"


def test_the_gpu_engine_generates_what_the_dense_model_generates() -> None:
    """Every configuration (windows, chunked prefill, preemption, host tier, MLA, fp8, the daemon, TP ranks in
    processes of their own, PD over NIXL where installed, bfloat16) matches the dense model computed in PyTorch
    on the same GPU, token for token."""
    sys.path.insert(0, str(ENGINE))
    import check

    from kvcache.transfer.nixl import nixl_available

    served = [check.on_gpu(case) for case in check.CASES.values()]
    expected = sum(nixl_available() or not case.pd for case in served) + len(check.GPU_CASES)
    skips = [] if nixl_available() else ["--allow-skips"]  # without NIXL the PD configurations are skipped
    out = subprocess.run([sys.executable, str(ENGINE / "check.py"), "--device", "cuda", *skips], capture_output=True,
                         text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert len(lines) == expected >= 17 and all(line.startswith("ok") for line in lines)


def test_bench_engine_quick_reports_paged_against_contiguous() -> None:
    import json

    out = subprocess.run([sys.executable, "-m", "kvcache.cli", "bench", "engine", "--engine-dir", str(ENGINE),
                          "--quick", "--rounds", "1", "--requests", "8", "--prompt-tokens", "64", "--new-tokens", "24",
                          "--chunk", "64", "--json"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["paged_tokens_per_s"] > 0 and r["contiguous_tokens_per_s"] > 0 and r["paged_over_contiguous"] > 0

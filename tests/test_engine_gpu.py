"""The reference engine on a GPU: the model in PyTorch, attention by flex attention over kvcache's paged cache."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ENGINE = Path(__file__).resolve().parents[1] / "examples" / "engine"
VECTORS = Path(__file__).resolve().parent / "vectors" / "engine"


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


def test_a_query_that_sees_a_block_its_table_no_longer_holds_is_refused_on_the_gpu() -> None:
    """As on the CPU: from the second step on, the table flex attention's block mask is built from lacks the
    request's first block (-1), which every query of a model with no window sees; the step is refused by name
    before attention reads, instead of the mask silently leaving the token out."""
    sys.path.insert(0, str(ENGINE))
    from backend import TorchBackend
    from engine import library_engine
    from engine_faults import refuses_a_lost_block
    from model import Model, ModelConfig

    engine = library_engine(Model(ModelConfig(), TorchBackend("cuda:0")), num_blocks=32, block_size=16)
    assert len(refuses_a_lost_block(engine, list(range(20)))) == 2


@pytest.mark.parametrize("daemon", [False, True], ids=["library", "daemon"])
def test_llama4_chunked_layers_by_flex_attention_give_transformers_tokens(tmp_path: Path, daemon: bool) -> None:
    """Llama 4's chunked layers on the GPU: flex attention's block mask keeps each query to its own chunk (units
    of earlier chunks left out, the chunk's start masked), token for token and logit for logit (1e-3) with
    transformers' stored greedy tokens, in process and through a daemon."""
    from llama4_engine import serve_llama4

    serve_llama4(tmp_path, "cuda", daemon)


@pytest.mark.parametrize("daemon", [False, True], ids=["library", "daemon"])
def test_generate_on_the_gpu_gives_transformers_tokens(tmp_path: Path, daemon: bool) -> None:
    """generate.py's ``--device cuda`` on every tiny checkpoint (float32, blocks of 16, in process and through a
    daemon): transformers' stored tokens, each chosen logit within 1e-3."""
    import json

    import numpy as np

    sys.path.insert(0, str(ENGINE))
    import checkpoints
    import generate

    expected = json.loads((VECTORS / "expected.json").read_text())["models"]
    for name in checkpoints.CONFIGS:
        case = expected[name]
        got = generate.serve(checkpoints.write(name, tmp_path / name), case["prompts"], case["max_new_tokens"],
                             daemon=daemon, device="cuda", block_size=16, num_blocks=64, keep_logits=True)
        assert [s.generated for s in got] == case["tokens"], name
        chosen = [[float(row[t]) for row, t in zip(s.logits, s.generated)] for s in got]
        assert np.abs(np.array(chosen) - np.array(case["logits"])).max() < 1e-3, name

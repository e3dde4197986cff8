"""The reference engine (examples/engine): greedy generation over kvcache's paged tables, token for token and
logit for logit against a dense model that recomputes full attention with no cache."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("paddle")
ENGINE = Path(__file__).resolve().parents[1] / "examples" / "engine"
sys.path.insert(0, str(ENGINE))

import check  # noqa: E402

from kvcache.transfer.nixl import nixl_available  # noqa: E402


@pytest.mark.parametrize("name", list(check.CASES))
def test_the_engine_generates_what_the_dense_model_generates(name: str) -> None:
    """Every request of every wave matches; the last wave hit the prefix cache (from host where a tier holds it,
    on both nodes with PD), window rows gave blocks back, and the preemption cases preempted."""
    case = check.CASES[name]
    if case.pd and not nixl_available():
        pytest.skip("NIXL is not installed (pip install nixl-cu12 --no-deps)")
    r = check.run(case)
    assert r["mismatched"] == [] and r["requests"] == sum(len(wave) for wave in check.prompts_of(case))
    assert r["cache_faults"] == [] and r["blocks_checked"] > 0
    assert r["max_logit_diff"] < case.logit_tolerance and r["hit_tokens"] > 0
    if case.model.window:
        assert r["recycled"] > 0, "a window configuration must give blocks back"
    if "preemption" in name:
        assert r["preempted"] > 0
    if case.pd:
        assert r["decode_hit_tokens"] > 0, "the decode node's reservations must hit too"
    if case.host_blocks:
        assert r["host_tokens"] > 0, "the last wave's hits must come back from host"
        if case.pd:
            assert r["decode_host_tokens"] > 0, "the decode node's reservations must hit its host tier too"
    if case.daemon and not case.pd and not case.model.window:  # a step's tables were reserved by the one before
        assert r["overlapped"] * 2 > r["steps"], "most steps should run while the daemon applies their extends"
    if case.pool_blocks or "sized from memory" in name:
        assert len(r["layer_blocks"]) == 2, "window layers hold fewer blocks than full ones"


def test_a_table_naming_a_wrong_block_fails_the_comparison() -> None:
    """One step of one request reads a block its table does not name: its logits (and the prefix it leaves in the
    cache for a later request) differ far beyond rounding."""
    r = check.run(check.CASES["uniform"], corrupt=True)
    assert "a1" in r["mismatched"] and r["max_logit_diff"] > 100 * check.CASES["uniform"].logit_tolerance
    assert any(fault.startswith("request 'a1', read by the step: layer 0 key: block(s)") for fault in r["cache_faults"])


def test_a_query_that_sees_a_block_its_table_no_longer_holds_is_refused() -> None:
    """From the second step on, the table the model reads lacks the request's first block (-1), which every
    query of a model with no window sees: the step is refused by name before attention reads, whatever the NaN
    keys such a block reads as would do in the softmax."""
    from engine import library_engine
    from engine_faults import refuses_a_lost_block
    from model import Model

    refuses_a_lost_block(library_engine(Model(check.ModelConfig()), num_blocks=32), list(range(9)))


def test_the_check_script_runs_every_configuration_and_exits_zero() -> None:
    """Every configuration runs (without NIXL the PD ones are skipped, which only --allow-skips accepts)."""
    skips = [] if nixl_available() else ["--allow-skips"]
    out = subprocess.run([sys.executable, str(ENGINE / "check.py"), *skips], capture_output=True, text=True,
                         timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith(("ok", "FAIL"))]
    assert out.returncode == 0, out.stdout + out.stderr
    run = [case for case in check.CASES.values() if nixl_available() or not case.pd]
    assert len(lines) == len(run) + 1 and all(line.startswith("ok") for line in lines)
    assert all(" 0 faults;" in line for line in lines[:-1])


def test_a_skipped_configuration_fails_the_check_unless_skips_are_allowed(monkeypatch: pytest.MonkeyPatch,
                                                                           capsys: pytest.CaptureFixture) -> None:
    """Without NIXL the PD configurations cannot run: check.py says which were skipped and exits 1, or 0 with
    --allow-skips."""
    monkeypatch.setattr(check, "nixl_available", lambda: False)
    assert check.main(["--only", "PD with layer groups"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == ("FAIL skipped 1 configuration(s): PD with layer groups x "
                                                        "head-wise (--allow-skips accepts this)")
    assert check.main(["--only", "PD with layer groups", "--allow-skips"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "skipped 1 configuration(s): PD with layer groups x head-wise"


def test_the_demo_runs_generate_on_a_checkpoint_through_a_daemon_and_matches_the_reference() -> None:
    """`make demo`: generate.py --daemon on a Mistral checkpoint the demo writes; the second wave finds the first's
    prefixes cached, and every prompt's tokens equal the numpy reference's."""
    out = subprocess.run([sys.executable, str(ENGINE / "demo.py")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "generated tokens equal a numpy decoder's with no cache (reference.py): 8 of 8 prompts" in out.stdout
    assert "examples/engine/generate.py --model " in out.stdout and " --daemon " in out.stdout
    assert any(line.startswith("wave 1 step") and " 0 found cached" not in line for line in out.stdout.splitlines())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_window_layout_block_size_and_budget_generates_what_the_dense_model_does(data: st.DataObject) -> None:
    """Random windows (size, sink, which layers, which kv heads), head-wise or layer-group rows, block sizes,
    prefill chunks and pools tight enough to preempt: the engine over kvcache's tables always matches the dense
    model, so no block a query still sees was ever given back or handed to another request."""
    from dataclasses import replace

    layers = data.draw(st.integers(1, 3), label="layers")
    window = data.draw(st.sampled_from([0, 1, 3, 5, 8, 13]), label="window")
    model = check.ModelConfig(num_layers=layers, num_q_heads=4, num_kv_heads=2, head_dim=8, hidden=32, ffn=48,
                              vocab=97, seed=data.draw(st.integers(0, 9), label="seed"), window=window)
    if window:
        model = replace(model, sink=data.draw(st.sampled_from([0, 1, 4]), label="sink"),
                        window_layers=data.draw(st.one_of(st.none(), st.sets(st.integers(0, layers - 1)).map(
                            lambda s: tuple(sorted(s)))), label="window layers"),
                        head_wise_swa_ratio=data.draw(st.one_of(st.none(), st.sampled_from([0.25, 0.5, 1.0])),
                                                      label="head-wise ratio"))  # window kv heads: none, 1, both
    head_wise = model.head_wise_swa_ratio is not None or data.draw(st.booleans(), label="head-wise")
    block_size = data.draw(st.sampled_from([1, 2, 4, 16]), label="block size")
    lens = tuple(data.draw(st.lists(st.integers(1, 30), min_size=1, max_size=4), label="prompt lengths"))
    need = max(-(-(n + 12 + 5 + 6) // block_size) for n in lens)  # the longest request, whole, in blocks
    case = check.Case(model=model, block_size=block_size, head_wise=head_wise, prompt_lens=lens, max_new_tokens=6,
                      chunk=data.draw(st.sampled_from([1, 3, 8, 64]), label="chunk"), max_num_seqs=4,
                      num_blocks=data.draw(st.integers(need, 3 * need), label="blocks a row"))
    r = check.run(case)
    assert r["mismatched"] == [] and r["cache_faults"] == [], r


@pytest.mark.parametrize("daemon", [False, True], ids=["library", "daemon"])
def test_llama4_chunks_of_16_in_blocks_of_16_give_transformers_tokens(tmp_path: Path, daemon: bool) -> None:
    """What the GPU engine serves (tests/test_engine_gpu.py), on the CPU: the stored tokens hold in blocks of 16."""
    from llama4_engine import serve_llama4

    serve_llama4(tmp_path, "cpu", daemon)


def test_caches_the_engine_cannot_write_are_refused_by_name() -> None:
    from engine import library_engine
    from model import Model

    with pytest.raises(ValueError, match="^scale_layout: the engine writes block_wise_fp8's per-token scales"):
        library_engine(Model(check.ModelConfig(dtype="float64")), num_blocks=8, quant="block_wise_fp8",
                       scale_layout="blackwell")


def test_bench_engine_without_a_gpu_says_what_it_needs() -> None:
    out = subprocess.run([sys.executable, "-m", "kvcache.cli", "bench", "engine", "--engine-dir", str(ENGINE)],
                         capture_output=True, text=True, timeout=120)
    try:
        import torch
        if torch.cuda.is_available():
            pytest.skip("a GPU is here: tests/test_engine_gpu.py runs the benchmark")
    except ImportError:
        pass
    assert out.returncode != 0 and "needs PyTorch with a CUDA device" in out.stderr

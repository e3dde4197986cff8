"""`kvcache bench allocator`: runs end to end, with vLLM as the peer where it is importable."""
from __future__ import annotations

import json

import pytest

from kvcache.bench import allocator as bench
from kvcache.bench import vllm
from kvcache.cli import main


def test_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "allocator", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--json", "--quick", "--repeat"):
        assert flag in text


def test_quick_json_run_reports_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    """Structure and positivity only: no assertion here is about speed."""
    assert main(["bench", "allocator", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["quick"] is True

    peer = result["config"]["vllm"]
    assert peer == vllm.version()

    def peer_ok(row: dict, ratio: str = "peer_over_ours") -> None:
        """With vLLM the row has its ratio and a verdict; without, neither."""
        if peer is None:
            assert row[ratio] is None and row.get("ok") is None
        else:
            assert row[ratio] > 0 and isinstance(row["ok"], bool)

    alloc = result["block_alloc"]
    assert {(r["batch"], r["rows"]) for r in alloc} == {(n, k) for n in (10, 100, 1000) for k in (1, 8)}
    for r in alloc:
        assert r["ours_ns_per_block"] > 0
        assert (r["peer_ns_per_block"] is None) == (r["peer_over_ours"] is None) == (peer is None)

    hashing = result["hashing"]
    assert {(r["algorithm"], r["block_size"], r["input"].split("[")[0]) for r in hashing} == {
        (a, b, i) for a in ("sha256", "sha256_cbor") for b in (16, 64) for i in ("ndarray", "list")
    }
    for r in hashing:
        assert r["ours_ms"] > 0 and r["ours_ns_per_token"] > 0 and r["limit_ms"] > 0
        assert r["over_floor"] == pytest.approx(r["ours_ms"] / r["limit_ms"])
        if r["algorithm"] == "sha256" and r["block_size"] == 64:  # judged against the floor, with or without vLLM
            assert r["ok"] == (r["over_floor"] <= bench.HASH_FLOOR_TARGET)
        else:
            peer_ok(r)

    e2e = result["end_to_end"]
    ours = [r for r in e2e if r["impl"] == "kvcache"]
    assert {(r["block_size"], r["mode"], r["input"].split("[")[0]) for r in ours} == {
        (16, "uniform", "ndarray"), (16, "uniform", "list"), (16, "head-wise 8", "ndarray"),
        (16, "gemma-3 rows", "ndarray"), (64, "uniform", "ndarray"), (64, "head-wise 8", "ndarray"),
        (64, "gemma-3 rows", "ndarray"),
    }
    assert {r["block_size"] for r in e2e if r["impl"] != "kvcache"} == (set() if peer is None else {16, 64})
    for r in e2e:
        assert r["ms"] > 0
        assert r["hit_tokens_min"] == r["hit_tokens_max"] == bench.SHARED_TOKENS, "every iteration a 50% hit"
        assert r["evictions"] and r["evicted_hashes"] > 0, "steady state must evict"
    for r in ours:
        if r["mode"] != "uniform":
            assert r["head_wise_over_uniform"] > 0 and isinstance(r["ok"], bool)
        elif peer is None:
            assert r["peer_over_ours"] is None
        else:
            assert r["peer_over_ours"] > 0 and isinstance(r["ok"], bool)

    lengths = result["prompt_lengths"]
    ours = [r for r in lengths if r["impl"] == "kvcache"]
    assert {(r["num_tokens"], r["input"].split("[")[0]) for r in ours} == {
        (n, i) for n in bench.SWEEP_TOKENS for i in ("ndarray", "list")}
    for r in lengths:
        assert r["us"] > 0 and r["hit_tokens_max"] == 0, "fresh prompts: no prefix hit"
        assert r["evictions"], "the pool holds four prompts: steady state evicts"
    for r in ours:
        peer_ok(r)

    uniform, head_wise, groups, ahead = result["step"]
    assert [r["mode"] for r in result["step"]] == ["uniform", "head-wise 8", "layer groups", "uniform, lookahead 1"]
    assert (uniform["lookahead"], ahead["lookahead"]) == (0, 1)
    for r in result["step"]:
        assert r["ours_p99_us"] >= r["ours_p50_us"] > 0
    peer_ok(uniform)
    peer_ok(ahead)
    for r in (head_wise, groups):  # p50 over uniform's, measured in the same turns
        assert r["head_wise_over_uniform"] == pytest.approx(r["ours_p50_us"] / uniform["ours_p50_us"])
        assert r["ok"] == (r["head_wise_over_uniform"] <= bench.STEP_ROWS_TARGET)

    for r in result["hybrid_capacity"]:  # kvcache plan's arithmetic: more requests fit with a pool per row
        assert r["rows"] == 2 and r["rows_requests"] > r["uniform_requests"] > 0
        assert r["gain"] == pytest.approx(r["rows_requests"] / r["uniform_requests"])
        assert r["rows_tokens"] == r["rows_requests"] * bench.PROMPT_TOKENS
        if peer is None:
            assert r["vllm_requests"] is r["ours_at_vllm_in_flight"] is None
        else:  # vLLM's own planner: ours, given its in-flight tokens, fits as many, up to its group padding
            assert r["vllm_requests"] <= r["ours_at_vllm_in_flight"] + 1 <= r["vllm_requests"] * 1.05 + 1

    assert all(isinstance(t["ok"], bool) for t in result["targets"])
    text = bench.render(result)
    for heading in ("1. block allocate + free", "2. hashing", "3. end to end", "4. admit + free of a fresh",
                    "5. scheduler step", "6. a Gemma 3 4B-shaped model", "targets met"):
        assert heading in text


@pytest.mark.skipif(vllm.version() is None, reason="vllm is not importable")
def test_vllm_finds_the_prefix_hits_we_find() -> None:
    """vLLM's own manager and ours, fed the same prompts (block 16, shared first halves), report the same hits."""
    import numpy as np

    from kvcache.allocator import Full, KVCacheManager

    ours, theirs = KVCacheManager(64, 16, (Full(),)), vllm.Allocator(65, 16)
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 1000, 40).tolist()
    for i in range(6):
        prompt = shared[: 8 * i] + rng.integers(0, 1000, 30).tolist()
        request = theirs.request(prompt)
        assert ours.admit(i, prompt).num_cached_tokens == theirs.admit(request)
        ours.free(i)
        theirs.free(request)

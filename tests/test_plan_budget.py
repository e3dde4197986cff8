"""A plan sized for one step budget across all requests is real: the requests it plans run to completion through
`KVCacheManager` with the plan's pools, one more runs out where the bound says, and no schedule within the budget
holds more of a window row than the bound (``kvcache.plan``'s module docstring derives it)."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvcache.allocator import CacheSpec, KVCacheError, KVCacheManager
from kvcache.allocator.swa import Full, Window
from kvcache.config import ServeConfig
from kvcache.examples import load_example
from kvcache.plan import Load, Plan, make_plan, row_blocks, window_blocks
from kvcache.serve import build_manager

VLLM_GEMMA_3_27B = 6.87  # vLLM 0.33's hybrid planner on Gemma 3 27B, 72 GiB, requests of 32,768, 8,192 a step
# A Gemma-shaped model scaled down to run in seconds: 4 layers with a 64-token window, 2 full, block 16.
SMALL = {"model_type": "gemma3_text", "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
         "head_dim": 64, "sliding_window": 64, "sliding_window_pattern": 3}
SMALL_LOAD = Load(max_model_len=1024, max_num_seqs=256, max_num_batched_tokens=256)
SMALL_MEMORY = 32 << 20


class Refusal(NamedTuple):
    """Where a schedule ran out: the step, the request, and each row's free blocks against the blocks it needed."""

    step: int
    request: int
    free: tuple[int, ...]
    needed: int


def small_plan(load: Load = SMALL_LOAD) -> Plan:
    return make_plan(CacheSpec.from_hf_config(SMALL, block_size=16), gpu_memory=SMALL_MEMORY, utilization=1.0,
                     load=load)


def make_manager(plan: Plan) -> KVCacheManager:
    """A manager over the plan's rows and pools."""
    pools = [r.num_blocks for r in plan.rows]
    return KVCacheManager(max(pools), plan.spec.block_size, [r.row.policy for r in plan.rows], row_blocks=pools)


def tokens_of(request: int, start: int, count: int) -> np.ndarray:
    """Request ``request``'s tokens ``[start, start + count)``: distinct per request, so no prefix is shared."""
    return np.arange(start, start + count, dtype=np.uint32) + np.uint32(request << 20)


class Simulation:
    """Requests through a manager under one budget per step, noting every row's most blocks in use.

    ``step(chunks)`` runs one step: ``chunks[r]`` tokens for request ``r`` (a new request is admitted, a running one
    extended; 0 extends with no tokens, which only gives back), in the given order, after ``give_back_first``
    extends every running request with no tokens."""

    def __init__(self, manager: KVCacheManager, budget: int) -> None:
        self.manager, self.budget = manager, budget
        self.tokens: dict[int, int] = {}
        self.steps = 0
        self.peak = np.zeros(manager.num_rows, dtype=np.int64)

    def in_use(self) -> np.ndarray:
        return self.manager.row_blocks - self.manager.num_free_blocks

    def step(self, chunks: dict[int, int], give_back_first: bool = False) -> Refusal | None:
        assert sum(chunks.values()) <= self.budget, "the schedule overran the step's budget"
        self.steps += 1
        if give_back_first:
            for r in self.tokens:
                assert self.manager.extend(r, []) is not None
        for r, count in chunks.items():
            done = self.tokens.get(r, 0)
            if r in self.tokens:
                table = self.manager.extend(r, tokens_of(r, done, count))
            else:
                assert count > 0, "a request is admitted with at least one token"
                # The whole request's tokens are its prompt here; only the first `count` are computed this step.
                table = self.manager.admit(r, tokens_of(r, 0, count), num_tokens=count)
            if table is None:
                needed = -(-(done + count) // self.manager.block_size) - (
                    self.manager.table(r).shape[1] if r in self.tokens else 0)
                return Refusal(self.steps, r, tuple(self.manager.num_free_blocks.tolist()), needed)
            self.tokens[r] = done + count
            self.peak = np.maximum(self.peak, self.in_use())
        self.manager.check_integrity()
        return None

    def finish(self, r: int) -> None:
        self.manager.free(r)
        del self.tokens[r]


def run_first_come_first_served(sim: Simulation, prompts: list[int], total: int) -> tuple[Refusal | None, int]:
    """vLLM's order: each step, running requests in admission order get their next prompt chunk or one decode token
    while the budget lasts (every one is extended, with no tokens where the budget is spent), then waiting requests
    are admitted with what is left; a request ends at ``total`` tokens. Returns the first refusal (None when every
    request ran to completion) and the most requests that ran at once."""
    waiting, running, most = list(range(len(prompts))), [], 0
    while waiting or running:
        left, chunks = sim.budget, {}
        for r in running:
            done = sim.tokens[r]
            chunks[r] = min(prompts[r] - done if done < prompts[r] else 1, left)
            left -= chunks[r]
        while waiting and left > 0:
            r = waiting.pop(0)
            chunks[r] = min(prompts[r], left)
            left -= chunks[r]
            running.append(r)
        most = max(most, len(running))
        refusal = sim.step(chunks)
        if refusal is not None:
            return refusal, most
        for r in [r for r in running if sim.tokens[r] == total]:
            sim.finish(r)
            running.remove(r)
    return None, most


def worst_step_schedule(policy: Window, block_size: int, load: Load, n: int) -> tuple[int, list[dict[int, int]]]:
    """The schedule that fills a ``policy`` row to ``row_blocks``: bring every request to a ``T`` whose window starts
    on a block's last slot (chunks within the budget), then one step gives ``d`` tokens to each of ``k``
    requests and the rest of the budget to the last of them. Returns ``T`` and the steps (none where the budget
    opens no block: then the bound is ``held(0)`` a request)."""
    lead = policy.window_tokens - 2
    first = -(-lead // block_size) * block_size - lead + 1
    start = lead + block_size * (-(-policy.sink_tokens // block_size) + 1)
    budget = load.max_num_batched_tokens
    if budget < first:
        return start, []
    steps, owed = [], {r: start for r in range(n)}
    while owed:
        left, chunks = budget, {}
        for r in list(owed):
            chunks[r] = min(owed[r], left)
            left -= chunks[r]
            owed[r] -= chunks[r]
            if not owed[r]:
                del owed[r]
            if not left:
                break
        steps.append({r: c for r, c in chunks.items() if c})
    opened = min(n, budget // first)
    last = {r: first for r in range(opened)}
    last[opened - 1] += budget - opened * first
    steps.append(last)
    return start, steps


# -- the plan's numbers ---------------------------------------------------------------------------------------


def test_gemma_3_27b_plans_over_three_times_vllms_hybrid_planner() -> None:
    """Gemma 3 27B, 72 GiB, requests of 32,768 tokens, 8,192 tokens a step: 23 requests, 3.3× vLLM's 6.87; 22
    with a step in flight (16,384 tokens, what vLLM counts); sized per request, 11 (vLLM's way, before padding)."""
    spec = CacheSpec.from_hf_config(load_example("gemma-3-27b"), block_size=16)
    load = Load(32_768, 256, 8_192)
    plan = make_plan(spec, gpu_memory=80 << 30, load=load)
    window, full = plan.rows
    assert (window.blocks_per_request, window.blocks_per_step, full.blocks_per_request) == (65, 530, 2_048)
    assert plan.max_concurrency == 23 and plan.max_concurrency >= 3 * VLLM_GEMMA_3_27B
    in_flight = make_plan(spec, gpu_memory=80 << 30, load=dataclasses.replace(load, max_num_batched_tokens=16_384))
    assert in_flight.max_concurrency == 22 >= 3 * VLLM_GEMMA_3_27B
    per_request = make_plan(spec, gpu_memory=80 << 30, load=dataclasses.replace(load, per_request_chunks=True))
    assert per_request.max_concurrency == 11 and per_request.rows[0].blocks_per_request == 577


@pytest.mark.skipif(__import__("kvcache.bench.vllm", fromlist=["version"]).version() is None,
                    reason="vllm is not importable")
def test_gemma_3_27b_plans_three_times_what_vllm_plans_live() -> None:
    """vLLM's own hybrid planner on Gemma 3 27B's layers, with the tokens it keeps in flight: our plan for the same
    tokens in flight fits at least three times its requests."""
    from kvcache.bench import vllm

    spec = CacheSpec.from_hf_config(load_example("gemma-3-27b"), block_size=16)
    windows: list[int | None] = [None] * spec.num_layers
    for row in spec.row_layout:
        for layer in row.layers:
            windows[layer] = row.policy.window_tokens if isinstance(row.policy, Window) else None
    budget = int((80 << 30) * 0.9)
    assert spec.num_kv_heads is not None and spec.head_dim is not None
    theirs = vllm.hybrid_concurrency(windows, spec.num_kv_heads, spec.head_dim, 16, 32_768, 8_192, budget)
    ours = make_plan(spec, gpu_memory=80 << 30, load=Load(32_768, 256, theirs["max_in_flight_tokens"]))
    assert ours.max_concurrency is not None and ours.max_concurrency >= 3 * theirs["max_concurrency"]


@pytest.mark.parametrize("name, budget_plan, per_request_plan", [
    ("gemma-3-4b", 95, 43), ("gpt-oss-20b", 95, 76), ("mistral-7b-v0.1", 141, 47)])
def test_published_configs_plan_more_requests_with_one_budget(name, budget_plan, per_request_plan) -> None:
    """72 GiB, requests of 32,768 tokens, 8,192 tokens a step, block 16: the requests each plan fits."""
    spec = CacheSpec.from_hf_config(load_example(name), block_size=16)
    load = Load(32_768, 256, 8_192)
    assert make_plan(spec, gpu_memory=80 << 30, load=load).max_concurrency == budget_plan
    per_request = make_plan(spec, gpu_memory=80 << 30, load=dataclasses.replace(load, per_request_chunks=True))
    assert per_request.max_concurrency == per_request_plan


def test_pools_hold_the_planned_requests_and_part_of_one_more() -> None:
    """Each row's pool is what the planned requests need of it plus the leftover budget's share of one request
    more, which never reaches that request's need; together they fit the budget."""
    plan = small_plan()
    n = plan.max_concurrency
    assert n == 13
    bs = plan.spec.block_size
    for rp in plan.rows:
        need = row_blocks(rp.row.policy, bs, SMALL_LOAD, n)
        assert need <= rp.num_blocks < row_blocks(rp.row.policy, bs, SMALL_LOAD, n + 1)
        assert need == n * rp.blocks_per_request + rp.blocks_per_step
    assert sum(rp.num_blocks * rp.bytes_per_block for rp in plan.rows) <= plan.budget_bytes


# -- the planned requests run; one more runs out ------------------------------------------------------------


@pytest.mark.parametrize("prompts", ["random", "short"])
def test_the_planned_requests_run_to_completion_first_come_first_served(prompts) -> None:
    """The plan's 13 requests of 1,024 tokens (prompts of 16 to 1,000 tokens, or all of 16), decoded to 1,024 in
    vLLM's order under 256 tokens a step with decodes counted, all run at once and to completion with no refusal;
    no row ever holds more than the plan's bound."""
    plan = small_plan()
    n = plan.max_concurrency
    lengths = np.random.default_rng(7).integers(16, 1_000, size=n).tolist() if prompts == "random" else [16] * n
    sim = Simulation(make_manager(plan), SMALL_LOAD.max_num_batched_tokens)
    refusal, most = run_first_come_first_served(sim, lengths, SMALL_LOAD.max_model_len)
    assert refusal is None and most == n and not sim.tokens
    bound = [row_blocks(rp.row.policy, plan.spec.block_size, SMALL_LOAD, n) for rp in plan.rows]
    assert (sim.peak <= bound).all(), (sim.peak, bound)
    assert (sim.manager.num_free_blocks == sim.manager.row_blocks).all()


def test_the_worst_step_fills_the_window_row_exactly_and_one_more_request_runs_out() -> None:
    """The schedule of the bound: the 13 planned requests at T = 78, then 3 tokens to each and the rest of the
    budget to the last, hold 13 × 5 + 13 + (256 − 39) // 16 = 91 window blocks, the bound and the whole pool, with
    no refusal. With a 14th request the same schedule holds 70 blocks at T = 78; in the last step the first 13
    take one block each and the 14th, needing 1 + (256 − 42) // 16 = 14 more, finds 8: the window row runs out."""
    plan = small_plan()
    window = plan.rows[0]
    assert isinstance(window.row.policy, Window)
    n, bs = plan.max_concurrency, plan.spec.block_size
    start, steps = worst_step_schedule(window.row.policy, bs, SMALL_LOAD, n)
    assert start == 78 and steps[-1] == {**{r: 3 for r in range(n - 1)}, n - 1: 3 + 256 - 3 * n}
    sim = Simulation(make_manager(plan), SMALL_LOAD.max_num_batched_tokens)
    for chunks in steps:
        assert sim.step(chunks, give_back_first=True) is None
    bound = row_blocks(window.row.policy, bs, SMALL_LOAD, n)
    assert sim.in_use()[0] == sim.peak[0] == bound == window.num_blocks == 13 * 5 + 13 + (256 - 39) // 16 == 91

    more = n + 1
    start, steps = worst_step_schedule(window.row.policy, bs, SMALL_LOAD, more)
    sim = Simulation(make_manager(plan), SMALL_LOAD.max_num_batched_tokens)
    for chunks in steps[:-1]:
        assert sim.step(chunks, give_back_first=True) is None
    held = sim.in_use()[0]
    assert held == more * window_blocks(window.row.policy, bs, 1024, 0) == 70
    refusal = sim.step(steps[-1], give_back_first=True)
    assert refusal is not None and refusal.step == len(steps)
    # The first 13 take a block each (83 held); the last needs 1 + (256 - 42) // 16 = 14 more, past the pool.
    assert window.num_blocks < row_blocks(window.row.policy, bs, SMALL_LOAD, more) == 70 + 13 + 14
    assert refusal.request == more - 1 and refusal.needed == 14
    assert refusal.free[0] == 91 - 83 < refusal.needed <= refusal.free[1]


def test_one_request_more_first_come_first_served_runs_out_in_the_full_row() -> None:
    """14 requests with 16-token prompts, admitted in one step and decoded in lockstep: each holds cdiv(T, 16)
    full-row blocks, so at the step they open block b, with 14 × b past the full row's pool, the request that
    would take the pool's block past its last is refused."""
    plan = small_plan()
    full = plan.rows[1]
    n = plan.max_concurrency + 1
    sim = Simulation(make_manager(plan), SMALL_LOAD.max_num_batched_tokens)
    refusal, _ = run_first_come_first_served(sim, [16] * n, SMALL_LOAD.max_model_len)
    assert refusal is not None
    opened = -(-(full.num_blocks + 1) // n)  # the block b whose opening overruns the pool
    assert refusal.step == 1 + 16 * (opened - 1) - 15 and refusal.needed == 1
    assert refusal.request == full.num_blocks - n * (opened - 1) < n
    assert refusal.free[1] == 0 < refusal.free[0]


# -- no schedule within the budget holds more than the bound --------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 80), sink=st.sampled_from([0, 0, 5, 16]), block=st.sampled_from([1, 2, 4, 16]),
       budget=st.integers(1, 96), max_model_len=st.integers(8, 240), n=st.integers(1, 8),
       fcfs=st.booleans(), seed=st.integers(0, 2**16))
def test_no_schedule_within_the_budget_holds_more_than_the_bound(window, sink, block, budget, max_model_len, n,
                                                                 fcfs, seed) -> None:
    """A window row sized to exactly the bound: requests of ``max_model_len`` tokens with random prompts run to
    completion under the budget, in vLLM's order or in a random order and random chunks after giving back
    first; never refused. Where the worst step fits the request, it fills the row exactly."""
    policy = Window(window, sink)
    load = Load(max_model_len, 256, budget)
    bound = row_blocks(policy, block, load, n)
    assume(bound >= 1)
    rng = np.random.default_rng(seed)
    sim = Simulation(KVCacheManager(bound, block, [policy]), budget)
    prompts = rng.integers(1, max_model_len + 1, size=n).tolist()
    if fcfs:
        refusal, _ = run_first_come_first_served(sim, prompts, max_model_len)
        assert refusal is None
    else:
        finished = [False] * n
        while not all(finished):
            left, chunks = budget, {}
            for r in rng.permutation(n).tolist():
                if finished[r]:
                    continue
                rest = max_model_len - sim.tokens.get(r, 0)
                count = int(rng.integers(0, min(rest, left) + 1))
                if r in sim.tokens or count:
                    chunks[r] = count
                    left -= count
            assert sim.step(chunks, give_back_first=True) is None
            for r in [r for r, t in sim.tokens.items() if t == max_model_len]:
                sim.finish(r)
                finished[r] = True
    assert sim.peak[0] <= bound
    start, steps = worst_step_schedule(policy, block, load, n)
    if window > 1 and start + budget <= max_model_len and steps:  # (one-token windows admit with holes: fewer)
        worst = Simulation(KVCacheManager(bound, block, [policy]), budget)
        for chunks in steps:
            assert worst.step(chunks, give_back_first=True) is None
        assert worst.in_use()[0] == bound


def test_window_blocks_is_the_most_any_position_holds() -> None:
    """held(c) against every position T a request can be at (swa's recyclable_blocks give back below it)."""
    from kvcache.allocator.swa import recyclable_blocks

    for window, sink, block, length in [(6, 0, 4, 40), (6, 2, 4, 40), (1, 0, 1, 20), (64, 16, 16, 300),
                                        (17, 3, 8, 30)]:
        policy = Window(window, sink)
        for chunk in range(0, length + 1):
            most = 0
            for start in range(0, length - chunk + 1):
                end = -(-(start + chunk) // block)
                gone = recyclable_blocks(policy, start, block)
                held = end - len(range(gone.start, min(gone.stop, -(-start // block))))
                most = max(most, held)
            assert window_blocks(policy, block, length, chunk) == most, (window, sink, block, length, chunk)


# -- serve sizes the same pools --------------------------------------------------------------------------------


def test_serve_sizes_its_pools_from_the_plan_and_per_request_chunks_keeps_the_old_bound(tmp_path) -> None:
    """`kvcache serve --model --gpu-memory --max-model-len --max-num-batched-tokens` serves the plan's pools;
    ``per_request_chunks`` serves the per-request ones (a larger window pool, fewer requests); without
    --max-model-len it is refused by name."""
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL))
    base = {"endpoint": f"ipc://{tmp_path}/d.sock", "block_size": 16, "model": str(config), "gpu_memory": "32MiB",
            "utilization": 1.0, "max_model_len": 1024, "max_num_batched_tokens": 256}
    manager, _, _ = build_manager(ServeConfig(**base).resolved())
    assert manager.row_blocks.tolist() == [r.num_blocks for r in small_plan().rows]
    per_request = small_plan(dataclasses.replace(SMALL_LOAD, per_request_chunks=True))
    assert per_request.max_concurrency < small_plan().max_concurrency
    manager, _, _ = build_manager(ServeConfig(**base, per_request_chunks=True).resolved())
    assert manager.row_blocks.tolist() == [r.num_blocks for r in per_request.rows]
    assert manager.row_blocks[0] > small_plan().rows[0].num_blocks
    with pytest.raises(KVCacheError, match=r"^per_request_chunks: .*--max-model-len"):
        build_manager(ServeConfig(**{**base, "max_model_len": 0}, per_request_chunks=True).resolved())


def test_plan_cli_reports_the_budget_and_per_request_bounds(capsys) -> None:
    """`kvcache plan --max-model-len` reports the bound's rows (blocks a request, blocks a step);
    --per-request-chunks the per-request ones; without --max-model-len the flag is refused by name."""
    import json

    from kvcache.cli import main

    argv = ["plan", "--example", "gemma-3-27b", "--block-size", "16", "--max-model-len", "32768",
            "--max-num-batched-tokens", "8192"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_concurrency"] == 23 and out["load"]["per_request_chunks"] is False
    assert [(r["blocks_per_request"], r["blocks_per_step"]) for r in out["rows"]] == [(65, 530), (2_048, 0)]
    assert main([*argv, "--per-request-chunks", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_concurrency"] == 11
    assert [(r["blocks_per_request"], r["blocks_per_step"]) for r in out["rows"]] == [(577, 0), (2_048, 0)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "pools sized for 23 requests of 32,768 tokens, 8,192 tokens a step across them" in table
    assert main(["plan", "--example", "gemma-3-27b", "--per-request-chunks"]) == 2
    assert "--per-request-chunks: " in capsys.readouterr().err


def test_full_rows_hold_every_block_of_every_request() -> None:
    assert row_blocks(Full(), 16, SMALL_LOAD, 13) == 13 * 64

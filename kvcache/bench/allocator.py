"""`kvcache bench allocator`: block pool, hashing, admit + free and a scheduler step against vLLM, same run.

The peer is the installed vLLM itself (kvcache.bench.vllm: its `BlockPool`, request block hasher
and `KVCacheManager`); where `vllm` is not importable, our rows are reported without it. Five
sections, in this process, ours and the peer taking turns (in rounds, or in passes) so a slow
spell of a shared machine does not fall on one side only:
  1. block allocate + free, ns per block: our BlockPool against vLLM's get_new_blocks + free_blocks;
  2. hashing a 32,768-token prompt: a summary of kvcache.bench.hashing (ours against vLLM's hasher);
  3. end to end: admit + free of a 32,768-token prompt whose first half is cached, a fresh second
     half every iteration, in a pool small enough that steady state evicts (as a server does);
  4. admit + free of a fresh prompt of 16 to 32,768 tokens (the fixed cost of a call and of
     list input), from an array and from a list;
  5. a scheduler step: 256 decoding requests (2,048-token prompts) each gain a token, the two
     oldest end and two fresh prompts are admitted (p50 of steps after the pool started evicting);
     uniform, head-wise (6 window rows, 2 full) and layer-group rows (a window row, a full row), each
     over uniform in the same turns; also with a lookahead slot, against vLLM given the same
     num_lookahead_tokens.
Times are the best of N (sections 1-4) or the median (5). Each of our rows carries the peer's
time over ours; rows with a target are marked ok / MISS. The exit code is 0 whatever the
numbers: a benchmark reports, it does not fail.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from kvcache.allocator import CacheSpec, Full, KVCacheManager, Window, prefix
from kvcache.allocator.pool import BlockPool
from kvcache.allocator.swa import AttentionPolicy
from kvcache.bench import vllm
from kvcache.bench.common import mark as _mark
from kvcache.arguments import positive_int as _positive_int
from kvcache.bench.common import progress as _progress
from kvcache.bench.common import ratio as _x
from kvcache.bench.common import TimedSteps
from kvcache.bench.common import table as _table
from kvcache.examples import load_example
from kvcache.bench.hashing import bench_hashing
from kvcache.plan import Load, make_plan

PROMPT_TOKENS = 32768
SHARED_TOKENS = 16384
BLOCK_SIZES = (16, 64)
ALLOC_BATCHES = (10, 100, 1000)
ALLOC_POOL_BLOCKS = 16384
ALLOC_ROWS = (1, 8)
POOL_PROMPTS = 4  # pool size in prompts' worth of blocks: small enough that iterations evict
HEAD_WISE_ROWS: tuple[AttentionPolicy, ...] = (Window(4096, 64),) * 6 + (Full(),) * 2
SWEEP_TOKENS = (16, 256, 2048, 32768)
SWEEP_MIN_BLOCKS = 1024
STEP_REQUESTS = 256
STEP_PROMPT_TOKENS = 2048
STEP_ADMITS = 2
STEP_POOL_BLOCKS = 65536  # the steady set holds about 34,000: the pool starts evicting after ~120 steps
STEP_WARMUP = 160
STEP_HEAD_WISE_ROWS: tuple[AttentionPolicy, ...] = (Window(1024, 64),) * 6 + (Full(),) * 2  # windows recycle
STEP_LAYER_GROUP_ROWS: tuple[AttentionPolicy, ...] = (Window(1024), Full())  # a window layer group, a full one
# A Gemma 3 4B-shaped model (its config.json's attention fields): its rows come from the config.
HYBRID_EXAMPLE = "gemma-3-4b"  # its published config: 34 layers, 29 with a 1,024-token window
HYBRID_MEMORY = int(80 * 2**30 * 0.9)  # 72 GiB of an 80 GiB GPU
HYBRID_BATCHED_TOKENS = 8192
HYBRID_TARGET = 2.0  # admit + free with the config's rows, over uniform
VOCAB = 150_000
SEED = "0"
REPEAT = 50
QUICK_REPEAT = 3
PASSES = 2  # sections 2-4: each contender's timed samples come in this many separate passes
REWARM = 2  # sections 3-4: untimed prompts at the start of each pass

# Targets, for a 2-core machine.
HASH_TARGET = {"sha256": 20.0, "sha256_cbor": 3.0}  # vllm/ours
# sha256 at block 64: one hashlib call over the same compressions (the floor) is only ~15x vLLM's hasher, so the
# target there is ours within this much of the floor.
HASH_FLOOR_TARGET = 1.25
E2E_PEER_TARGET = 10.0
E2E_MS_TARGET = 0.7  # block 16, uniform, ndarray input
HEAD_WISE_TARGET = 2.0
STEP_ROWS_TARGET = 1.5  # a head-wise or layer-group step's p50 over the uniform one's
SWEEP_TARGET = 3.0
STEP_TARGET = 15.0
STEP_LOOKAHEAD = 1  # the scheduler step's third mode: each extend also covers the next step's position


def _peer_ratio(peer: float | None, ours: float) -> float | None:
    return None if peer is None else peer / ours


def _check_target(ratio: float | None, target: float) -> bool | None:
    """ok / MISS of a peer-over-ours ratio; None (no verdict) where the peer was not measured."""
    return None if ratio is None else ratio >= target


# --------------------------------------------------------------------------- 1. block allocate + free


def _ours_alloc_cycle(pool: BlockPool, row_col: np.ndarray, n: int, cycles: int) -> None:
    """`cycles` times: allocate n blocks per row, then drop their references."""
    for _ in range(cycles):
        allocation = pool.allocate(n)
        pool.decref(row_col, allocation.blocks)


def _best_interleaved(fns: Sequence[Callable[[], object]], repeat: int) -> list[int]:
    """Best ns of each fn over `repeat` rounds (after two warm-up rounds), the fns taking turns.

    Taking turns makes a slow spell of the machine (a neighbour on the other core) hit every
    contender alike, so their ratio holds even when the absolute numbers move.
    """
    for _ in range(2):
        for fn in fns:
            fn()
    best = [0] * len(fns)
    for r in range(repeat):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter_ns()
            fn()
            ns = time.perf_counter_ns() - t0
            best[k] = ns if r == 0 or ns < best[k] else best[k]
    return best


def bench_block_alloc(repeat: int, peer: bool) -> list[dict[str, Any]]:
    """ns per block of allocate + free for each batch size and row count, with vLLM's ns per block."""
    rows_out = []
    for n in ALLOC_BATCHES:
        cycles = max(1, 4000 // n)  # each sample is a few hundred microseconds, well above timer noise
        fns: list[Callable[[], object]] = []
        if peer:
            fns.append(partial(vllm.pool_cycle(ALLOC_POOL_BLOCKS + 1), n, cycles))  # + vLLM's null block
        for num_rows in ALLOC_ROWS:
            pool = BlockPool(num_rows, ALLOC_POOL_BLOCKS)
            fns.append(partial(_ours_alloc_cycle, pool, np.arange(num_rows, dtype=np.intp)[:, None], n, cycles))
        per_block = [ns / (cycles * n) for ns in _best_interleaved(fns, repeat)]
        peer_ns = per_block.pop(0) if peer else None
        for num_rows, ours_ns in zip(ALLOC_ROWS, per_block):
            rows_out.append({
                "batch": n,
                "rows": num_rows,
                "pool_blocks": ALLOC_POOL_BLOCKS,
                "ours_ns_per_block": ours_ns,
                "ours_ns_per_row_block": ours_ns / num_rows,
                "peer_ns_per_block": peer_ns,
                "peer_over_ours": _peer_ratio(peer_ns, ours_ns),
            })
    return rows_out


# --------------------------------------------------------------------------- 2. hashing


def best_hashing_rows(runs: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each row of several bench_hashing runs at its fastest (runs are passes, as in section 3)."""
    best: dict[tuple[Any, ...], dict[str, Any]] = {}
    for run in runs:
        for r in run:
            key = (r["impl"], r["algorithm"], r["block_size"], r.get("backend"), r.get("input"))
            if r.get("available", True) and (key not in best or r["ms_per_prompt"] < best[key]["ms_per_prompt"]):
                best[key] = r
    return list(best.values())


def summarise_hashing(raw: list[dict[str, Any]], backend: str) -> list[dict[str, Any]]:
    """Our default-backend rows (ndarray and list input), with vLLM's time (same hash name), ratio and target."""
    peers = {(r["algorithm"], r["block_size"]): r for r in raw if r["impl"] != "kvcache"}
    out = []
    for r in raw:
        if r["impl"] != "kvcache" or r["backend"] != backend:
            continue
        peer = peers.get((r["algorithm"], r["block_size"]))
        peer_ms = None if peer is None else peer["ms_per_prompt"]
        ratio = _peer_ratio(peer_ms, r["ms_per_prompt"])
        over_floor = r["ms_per_prompt"] / r["limit_ms"]
        if r["algorithm"] == "sha256" and r["block_size"] > 16:
            target, ok = f"ours <= {HASH_FLOOR_TARGET:g}x floor", over_floor <= HASH_FLOOR_TARGET
        else:
            target = f"vllm/ours >= {HASH_TARGET[r['algorithm']]:g}x"
            ok = _check_target(ratio, HASH_TARGET[r["algorithm"]])
        out.append({
            "algorithm": r["algorithm"],
            "block_size": r["block_size"],
            "num_tokens": r["num_tokens"],
            "backend": backend,
            "input": r["input"],
            "ours_ms": r["ms_per_prompt"],
            "ours_ns_per_token": r["ns_per_token"],
            "limit_ms": r["limit_ms"],
            "peer": r["peer"],
            "peer_ms": peer_ms,
            "peer_over_ours": ratio,
            "over_floor": over_floor,
            "target": target,
            "ok": ok,
        })
    return out


# --------------------------------------------------------------------------- 3. and 4. admit + free


def _prompts(rng: np.random.Generator, shared: np.ndarray, count: int, num_tokens: int) -> list[np.ndarray]:
    """`count` prompts of `num_tokens`: `shared` first, then fresh random tokens (int32, as a scheduler holds them)."""
    fresh = rng.integers(0, VOCAB, size=(count, num_tokens - shared.size), dtype=np.int32)
    return [np.concatenate([shared, row]) for row in fresh]


def _as_lists(prompts: Sequence[np.ndarray], shared: np.ndarray) -> list[list[int]]:
    """The prompts as lists, sharing the first part's int objects (as a scheduler's lists would)."""
    shared_list = shared.tolist()
    return [shared_list + p[shared.size:].tolist() for p in prompts]


class _Contender(NamedTuple):
    """One admit + free case: how to run one prompt, its prompts, and its cached-hash count."""

    impl: str
    mode: str
    input: str
    cycle: Callable[[int, Any], int]
    inputs: Sequence[Any]
    cached: Callable[[], int]


def _measure_in_passes(contenders: Sequence[_Contender], warmup: int, per_pass: int, new_per_cycle: int
                       ) -> list[tuple[int, list[int], int]]:
    """Per contender: best ns of one prompt, the hits, and the hashes evicted after warm-up.

    Each contender runs its prompts back to back (its own arrays stay cache-hot, as in a
    loop of admits), in PASSES passes taken in turn, so a slow spell of the machine (a
    neighbour on the other core) rarely covers all of one contender's samples. The first
    `warmup` prompts, and REWARM at the start of each pass, are untimed. Evicted = hashes
    registered after warm-up minus the growth of the cached-hash count.
    """
    for c in contenders:
        for i in range(warmup):
            c.cycle(i, c.inputs[i])
    before = [c.cached() for c in contenders]
    best: list[int | None] = [None] * len(contenders)
    hits: list[list[int]] = [[] for _ in contenders]
    start = warmup
    for _ in range(PASSES):
        for k, c in enumerate(contenders):
            for i in range(start, start + REWARM):
                c.cycle(i, c.inputs[i])
            for i in range(start + REWARM, start + REWARM + per_pass):
                t0 = time.perf_counter_ns()
                hit = c.cycle(i, c.inputs[i])
                ns = time.perf_counter_ns() - t0
                hits[k].append(hit)
                best[k] = ns if best[k] is None or ns < best[k] else best[k]
        start += REWARM + per_pass
    registered = (start - warmup) * new_per_cycle
    return [(int(best[k] or 0), hits[k], registered - (c.cached() - before[k])) for k, c in enumerate(contenders)]


def _ours_cycle(manager: KVCacheManager, i: int, tokens: Any) -> int:
    """Admit then free one prompt; the tokens it found cached."""
    admission = manager.admit(i, tokens)
    assert admission is not None, "the pool holds four prompts: admit must succeed"
    manager.free(i)
    return admission.num_cached_tokens


def _peer_cycle(allocator: vllm.Allocator, i: int, tokens: list[int]) -> int:
    """vLLM's path for one prompt: a `Request` (its blocks hashed as it is built), admit, free."""
    request = allocator.request(tokens)
    hit = allocator.admit(request)
    assert hit is not None, "the pool holds four prompts: admit must succeed"
    allocator.free(request)
    return hit


def _ours(mode: str, kind: str, rows: tuple[AttentionPolicy, ...], num_blocks: int, block_size: int,
          inputs: Sequence[Any], setup: np.ndarray) -> _Contender:
    manager = KVCacheManager(num_blocks, block_size, rows, hash_seed=SEED)
    _ours_cycle(manager, -1, setup)
    return _Contender("kvcache", mode, kind, partial(_ours_cycle, manager), inputs,
                      lambda: manager.stats().num_cached_hashes)


def _peer(num_blocks: int, block_size: int, inputs: Sequence[list[int]], setup: np.ndarray) -> _Contender:
    allocator = vllm.Allocator(num_blocks + 1, block_size)  # + vLLM's null block: same usable blocks
    _peer_cycle(allocator, -1, setup.tolist())
    return _Contender(f"vllm {vllm.version()}", "uniform", "list[int]", partial(_peer_cycle, allocator), inputs,
                      allocator.num_cached_blocks)


def _warmup_iterations(block_size: int) -> int:
    """Untimed iterations after which every further one evicts cached blocks (plus two to settle)."""
    prompt_blocks = PROMPT_TOKENS // block_size
    new_blocks = (PROMPT_TOKENS - SHARED_TOKENS) // block_size
    free_after_setup = POOL_PROMPTS * prompt_blocks - prompt_blocks
    return -(-free_after_setup // new_blocks) + 2


def _cycle_row(c: _Contender, block_size: int, num_tokens: int, shared: int, pool_blocks: int, ns: int,
               hits: list[int], evicted: int) -> dict[str, Any]:
    """One admit + free result row."""
    return {
        "impl": c.impl,
        "block_size": block_size,
        "mode": c.mode,
        "input": c.input,
        "num_tokens": num_tokens,
        "shared_tokens": shared,
        "pool_blocks": pool_blocks,
        "ms": ns / 1e6,
        "hit_tokens_min": min(hits),
        "hit_tokens_max": max(hits),
        "evicted_hashes": evicted,
        "evictions": evicted > 0,
    }


def bench_end_to_end(repeat: int, peer: bool) -> list[dict[str, Any]]:
    """Admit + free of half-cached prompts for ours (uniform, head-wise; ndarray, list) and vLLM's manager."""
    rng = np.random.default_rng(0)
    shared = rng.integers(0, VOCAB, size=SHARED_TOKENS, dtype=np.int32)
    out: list[dict[str, Any]] = []
    for bs in BLOCK_SIZES:
        num_blocks = POOL_PROMPTS * PROMPT_TOKENS // bs
        warmup = _warmup_iterations(bs)
        new_per_cycle = (PROMPT_TOKENS - SHARED_TOKENS) // bs
        setup, = _prompts(rng, shared, 1, PROMPT_TOKENS)
        per_pass = -(-repeat // PASSES)
        prompts = _prompts(rng, shared, warmup + PASSES * (REWARM + per_pass), PROMPT_TOKENS)
        lists = _as_lists(prompts, shared)
        kind = f"ndarray[{prompts[0].dtype}]"
        contenders = [_ours("uniform", kind, (Full(),), num_blocks, bs, prompts, setup)]
        if bs == BLOCK_SIZES[0]:
            contenders.append(_ours("uniform", "list[int]", (Full(),), num_blocks, bs, lists, setup))
        contenders.append(_ours("head-wise 8", kind, HEAD_WISE_ROWS, num_blocks, bs, prompts, setup))
        contenders.append(_ours("gemma-3 rows", kind, _hybrid_policies(bs), num_blocks, bs, prompts, setup))
        if peer:
            contenders.append(_peer(num_blocks, bs, lists, setup))
        for c, (ns, hits, evicted) in zip(contenders, _measure_in_passes(contenders, warmup, per_pass, new_per_cycle)):
            out.append(_cycle_row(c, bs, PROMPT_TOKENS, SHARED_TOKENS, num_blocks, ns, hits, evicted))
    _add_e2e_ratios(out)
    return out


def _add_e2e_ratios(rows: list[dict[str, Any]]) -> None:
    """Give our rows the peer's ms over ours, head-wise over uniform, and the target checks."""
    peer_ms = {r["block_size"]: r["ms"] for r in rows if r["impl"] != "kvcache"}
    uniform_ms = {r["block_size"]: r["ms"] for r in rows
                  if r["impl"] == "kvcache" and r["mode"] == "uniform" and r["input"].startswith("ndarray")}
    for r in rows:
        if r["impl"] != "kvcache":
            continue
        bs = r["block_size"]
        r["peer_ms"] = peer_ms.get(bs)
        r["peer_over_ours"] = _peer_ratio(r["peer_ms"], r["ms"])
        if r["mode"] == "uniform":
            r["target"] = f"vllm/ours >= {E2E_PEER_TARGET:g}x"
            r["ok"] = _check_target(r["peer_over_ours"], E2E_PEER_TARGET)
            if bs == 16 and r["input"].startswith("ndarray"):
                r["target"] += f", <= {E2E_MS_TARGET:g} ms"
                r["ok"] = (r["ok"] is not False) and r["ms"] <= E2E_MS_TARGET
        else:
            r["head_wise_over_uniform"] = r["ms"] / uniform_ms[bs]
            target = HYBRID_TARGET if r["mode"] == "gemma-3 rows" else HEAD_WISE_TARGET
            r["target"] = f"{'rows' if r['mode'] == 'gemma-3 rows' else 'head-wise'}/uniform <= {target:g}x"
            r["ok"] = r["head_wise_over_uniform"] <= target


def bench_prompt_lengths(repeat: int, peer: bool) -> list[dict[str, Any]]:
    """Admit + free of fresh prompts of each length in SWEEP_TOKENS (block 16), ndarray and list, and vLLM's."""
    rng = np.random.default_rng(1)
    none = np.empty(0, dtype=np.int32)
    bs = BLOCK_SIZES[0]
    out: list[dict[str, Any]] = []
    for num_tokens in SWEEP_TOKENS:
        _progress(f"4. admit + free of a fresh {num_tokens:,}-token prompt")
        num_blocks = max(SWEEP_MIN_BLOCKS, POOL_PROMPTS * -(-num_tokens // bs))
        warmup = -(-num_blocks // max(1, num_tokens // bs)) + 2  # then every admit evicts
        per_pass = -(-repeat // PASSES) * (4 if num_tokens <= 256 else 1)  # short calls: more samples, same time
        setup, = _prompts(rng, none, 1, num_tokens)
        prompts = _prompts(rng, none, warmup + PASSES * (REWARM + per_pass), num_tokens)
        lists = _as_lists(prompts, none)
        contenders = [_ours("uniform", "ndarray[int32]", (Full(),), num_blocks, bs, prompts, setup),
                      _ours("uniform", "list[int]", (Full(),), num_blocks, bs, lists, setup)]
        if peer:
            contenders.append(_peer(num_blocks, bs, lists, setup))
        results = _measure_in_passes(contenders, warmup, per_pass, num_tokens // bs)
        rows = [_cycle_row(c, bs, num_tokens, 0, num_blocks, ns, hits, evicted)
                for c, (ns, hits, evicted) in zip(contenders, results)]
        peer_ms = rows[-1]["ms"] if peer else None
        for r in rows:
            r["us"] = r["ms"] * 1e3
            if r["impl"] == "kvcache":
                r["peer_ms"] = peer_ms
                r["peer_over_ours"] = _peer_ratio(peer_ms, r["ms"])
                r["target"] = f"vllm/ours >= {SWEEP_TARGET:g}x"
                r["ok"] = _check_target(r["peer_over_ours"], SWEEP_TARGET)
        out.extend(rows)
    return out


def _hybrid_spec(block_size: int) -> CacheSpec:
    return CacheSpec.from_hf_config(load_example(HYBRID_EXAMPLE), block_size=block_size)


def _hybrid_policies(block_size: int) -> tuple[AttentionPolicy, ...]:
    """The manager rows of the hybrid model: one per row its config gives (a layer group each)."""
    return tuple(row.policy for row in _hybrid_spec(block_size).row_layout)


def hybrid_capacity(peer: bool) -> list[dict[str, Any]]:
    """Tokens of 32,768-token requests that fit 72 GiB with the hybrid model's rows (a pool each, ``kvcache plan``'s
    sizing) against every layer full, at block 16 and 64; with vLLM, what its own hybrid planner fits given the
    tokens it keeps in flight, and our plan given the same."""
    out = []
    for bs in BLOCK_SIZES:
        spec = _hybrid_spec(bs)
        plan = make_plan(spec, gpu_memory=80 * 2**30, load=Load(PROMPT_TOKENS, 256, HYBRID_BATCHED_TOKENS))
        assert plan.max_concurrency is not None and plan.uniform_concurrency is not None
        row = {"block_size": bs, "rows": len(plan.rows), "max_model_len": PROMPT_TOKENS,
               "max_num_batched_tokens": HYBRID_BATCHED_TOKENS, "budget_bytes": plan.budget_bytes,
               "rows_requests": plan.max_concurrency, "uniform_requests": plan.uniform_concurrency,
               "rows_tokens": plan.max_concurrency * PROMPT_TOKENS,
               "uniform_tokens": plan.uniform_concurrency * PROMPT_TOKENS,
               "gain": plan.max_concurrency / plan.uniform_concurrency,
               "vllm_requests": None, "vllm_in_flight_tokens": None, "ours_at_vllm_in_flight": None}
        if peer:
            layer_windows: list[int | None] = [None] * spec.num_layers
            for r in spec.row_layout:
                for layer in r.layers:
                    layer_windows[layer] = None if isinstance(r.policy, Full) else r.policy.window_tokens
            assert spec.num_kv_heads is not None and spec.head_dim is not None
            theirs = vllm.hybrid_concurrency(layer_windows, spec.num_kv_heads, spec.head_dim, bs, PROMPT_TOKENS,
                                             HYBRID_BATCHED_TOKENS, plan.budget_bytes)
            same = make_plan(spec, gpu_memory=80 * 2**30,
                             load=Load(PROMPT_TOKENS, 256, theirs["max_in_flight_tokens"]))
            row.update(vllm_requests=theirs["max_concurrency"], vllm_in_flight_tokens=theirs["max_in_flight_tokens"],
                       ours_at_vllm_in_flight=same.max_concurrency)
        out.append(row)
    return out


# --------------------------------------------------------------------------- 5. scheduler step


class _OursStep(TimedSteps):
    """The step workload of kvcache.bench.vllm.SchedulerStep on our KVCacheManager, in this process."""

    def __init__(self, num_blocks: int, rows: tuple[AttentionPolicy, ...], lookahead: int = 0) -> None:
        self.manager = KVCacheManager(num_blocks, BLOCK_SIZES[0], rows, hash_seed=SEED)
        self.live: collections.deque[int] = collections.deque()
        self.next_id = 0
        self.ones = np.ones(STEP_REQUESTS, dtype=np.int32)
        self.lookahead = lookahead

    def setup(self, rng: np.random.Generator) -> None:
        for prompt in rng.integers(0, VOCAB, size=(STEP_REQUESTS + STEP_ADMITS, STEP_PROMPT_TOKENS)).tolist():
            self._admit(prompt)

    def _admit(self, prompt: list[int]) -> None:
        if self.manager.admit(self.next_id, prompt) is None:
            raise RuntimeError("the pool is too small for the step workload")
        self.live.append(self.next_id)
        self.next_id += 1

    def step(self, inp: vllm.StepInput) -> None:
        manager = self.manager
        for _ in inp.prompts:
            manager.free(self.live.popleft())
        tables = manager.extend_many(list(self.live), inp.decode, self.ones, num_lookahead_tokens=self.lookahead)
        if any(t is None for t in tables):
            raise RuntimeError("the pool is too small for the step workload")
        for prompt in inp.prompts:
            self._admit(prompt)


def bench_step(repeat: int, peer: bool) -> list[dict[str, Any]]:
    """p50/p99 of a scheduler step, ours (uniform, head-wise, layer groups, uniform with a lookahead slot) and
    vLLM's (without and with the same lookahead), after STEP_WARMUP steps, in turns."""
    rng = np.random.default_rng(2)
    modes = [("uniform", (Full(),), 0), ("head-wise 8", STEP_HEAD_WISE_ROWS, 0),
             ("layer groups", STEP_LAYER_GROUP_ROWS, 0),
             (f"uniform, lookahead {STEP_LOOKAHEAD}", (Full(),), STEP_LOOKAHEAD)]
    contenders: list[Any] = [_OursStep(STEP_POOL_BLOCKS, rows, ahead) for _, rows, ahead in modes]
    peer_of = {0: 0, STEP_LOOKAHEAD: 1}  # a mode's lookahead -> its vLLM contender, after ours
    if peer:
        contenders += [vllm.SchedulerStep(STEP_REQUESTS, STEP_PROMPT_TOKENS, STEP_ADMITS, BLOCK_SIZES[0],
                                          STEP_POOL_BLOCKS + 1, lookahead=ahead) for ahead in peer_of]
    rounds, per_round = PASSES * 2, max(4, repeat)
    inputs = vllm.step_inputs(rng, STEP_WARMUP + rounds * per_round, STEP_REQUESTS, STEP_ADMITS, STEP_PROMPT_TOKENS,
                              VOCAB)
    for c in contenders:
        c.setup(np.random.default_rng(3))
        c.run(inputs[:STEP_WARMUP])
    times: list[list[np.ndarray]] = [[] for _ in contenders]
    for r in range(rounds):
        chunk = inputs[STEP_WARMUP + r * per_round:STEP_WARMUP + (r + 1) * per_round]
        for k, c in enumerate(contenders):
            times[k].append(c.run(chunk))
    p50, p99 = ([float(np.percentile(np.concatenate(t), q)) / 1e3 for t in times] for q in (50, 99))
    out = []
    for k, (mode, rows, ahead) in enumerate(modes):
        theirs = len(modes) + peer_of[ahead] if peer else None
        peer_p50 = None if theirs is None else p50[theirs]
        ratio = _peer_ratio(peer_p50, p50[k])
        row = {
            "mode": mode, "rows": len(rows), "lookahead": ahead, "requests": STEP_REQUESTS,
            "prompt_tokens": STEP_PROMPT_TOKENS, "admits": STEP_ADMITS, "frees": STEP_ADMITS,
            "block_size": BLOCK_SIZES[0], "pool_blocks": STEP_POOL_BLOCKS, "steps": rounds * per_round,
            "input": "list[int]", "ours_p50_us": p50[k], "ours_p99_us": p99[k],
            "peer_p50_us": peer_p50, "peer_p99_us": None if theirs is None else p99[theirs], "peer_over_ours": ratio,
        }
        if len(rows) == 1:
            row.update(target=f"vllm/ours >= {STEP_TARGET:g}x (p50)", ok=_check_target(ratio, STEP_TARGET))
        else:
            row["head_wise_over_uniform"] = p50[k] / p50[0]  # measured in the same turns
            row.update(target=f"rows/uniform <= {STEP_ROWS_TARGET:g}x (p50)",
                       ok=row["head_wise_over_uniform"] <= STEP_ROWS_TARGET)
        out.append(row)
    return out


# --------------------------------------------------------------------------- report


def _ms(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(result: dict[str, Any]) -> str:
    """The human-readable report: one table per section."""
    cfg = result["config"]
    peer = f"vLLM {cfg['vllm']}" if cfg["vllm"] else "vLLM not importable: peer columns empty"
    out = [
        f"kvcache bench allocator: repeat {cfg['repeat']} (best of), python {cfg['python']}, "
        f"numpy {cfg['numpy']}, {cfg['cpus']} cpu(s){', quick' if cfg['quick'] else ''}; peer: {peer}",
        "",
        "1. block allocate + free, ns per block (8 rows: one id per kv head; vLLM's one block serves all heads)",
        _table(
            ["batch", "rows", "ours ns/block", "ours ns/(row,block)", "vllm ns/block", "vllm/ours"],
            [[str(r["batch"]), str(r["rows"]), f"{r['ours_ns_per_block']:.0f}", f"{r['ours_ns_per_row_block']:.0f}",
              _ms(r["peer_ns_per_block"], 0), _x(r["peer_over_ours"])] for r in result["block_alloc"]],
        ),
        "",
        f"2. hashing a {PROMPT_TOKENS:,}-token prompt (kvcache.bench.hashing; backend "
        f"{cfg['hash_backend']}; floor: one hashlib call over the same SHA-256 compressions)",
        _table(
            ["algorithm", "block", "input", "ours ms", "ns/token", "floor ms", "ours/floor", "vllm ms", "vllm/ours",
             "target", ""],
            [[r["algorithm"], str(r["block_size"]), r["input"], f"{r['ours_ms']:.3f}", f"{r['ours_ns_per_token']:.2f}",
              f"{r['limit_ms']:.3f}", _x(r["over_floor"]), _ms(r["peer_ms"]), _x(r["peer_over_ours"]), r["target"],
              _mark(r["ok"])]
             for r in result["hashing"]],
        ),
        "",
        f"3. end to end: admit + free of a {PROMPT_TOKENS:,}-token prompt whose first {SHARED_TOKENS:,} tokens are "
        f"cached, a fresh second half each time;",
        f"   pool {POOL_PROMPTS} prompts' worth, warmed up until every iteration evicts; evicted = hashes dropped "
        "after warm-up; head-wise and gemma-3 rows (section 6's model, its two rows) are compared with our uniform",
        _table(
            ["block", "mode", "input", "ours ms", "vllm ms", "vllm/ours", "hw/uniform", "hit tokens", "evicted",
             "target", ""],
            [[str(r["block_size"]), r["mode"], r["input"], f"{r['ms']:.3f}", _ms(r["peer_ms"]),
              _x(r["peer_over_ours"]), _x(r.get("head_wise_over_uniform")),
              _hits(r), f"{r['evicted_hashes']:,}", r["target"], _mark(r["ok"])]
             for r in result["end_to_end"] if r["impl"] == "kvcache"],
        ),
        "  vllm (a Request with its block hasher, get_computed_blocks, allocate_slots, free): " + ("; ".join(
            f"block {r['block_size']} {r['ms']:.3f} ms, hit {_hits(r)}, evicted {r['evicted_hashes']:,}"
            for r in result["end_to_end"] if r["impl"] != "kvcache") or "-"),
        "",
        f"4. admit + free of a fresh prompt (no cached prefix, block {BLOCK_SIZES[0]}, pool {POOL_PROMPTS} prompts' "
        f"worth or {SWEEP_MIN_BLOCKS:,} blocks), microseconds",
        _table(
            ["tokens", "input", "ours us", "vllm us", "vllm/ours", "target", ""],
            [[f"{r['num_tokens']:,}", r["input"], f"{r['us']:.1f}", _ms(None if r["peer_ms"] is None else r["peer_ms"] * 1e3, 1),
              _x(r["peer_over_ours"]), r["target"], _mark(r["ok"])]
             for r in result["prompt_lengths"] if r["impl"] == "kvcache"],
        ),
        "",
        f"5. scheduler step, in process: {STEP_REQUESTS} decoding requests ({STEP_PROMPT_TOKENS:,}-token "
        f"prompts) gain a token, {STEP_ADMITS} end, {STEP_ADMITS} fresh prompts are admitted; lists in; pool "
        f"{STEP_POOL_BLOCKS:,} blocks a row, evicting; head-wise: 6 rows with a 1,024-token window (64 sink) "
        f"giving blocks back, 2 full; layer groups: a row with a 1,024-token window, a full one; rows/uniform: "
        f"p50 over uniform's, same turns; lookahead: each table also covers the next step's position (vLLM's "
        f"num_lookahead_tokens, compared with vLLM given the same)",
        _table(
            ["mode", "p50 us", "p99 us", "vllm p50 us", "vllm/ours (p50)", "rows/uniform", "target", ""],
            [[r["mode"], f"{r['ours_p50_us']:.1f}", f"{r['ours_p99_us']:.1f}", _ms(r["peer_p50_us"], 1),
              _x(r["peer_over_ours"]), _x(r.get("head_wise_over_uniform")), r["target"], _mark(r["ok"])]
             for r in result["step"]],
        ),
        "",
        "6. a Gemma 3 4B-shaped model's rows from its config (29 layers with a 1,024-token window, 5 full): "
        f"requests of {PROMPT_TOKENS:,} tokens that fit {HYBRID_MEMORY / 2**30:.0f} GiB with a pool per row "
        f"(kvcache plan, {HYBRID_BATCHED_TOKENS:,} tokens a step across requests) against every layer full; "
        "their admit + free is section 3's 'gemma-3 rows'",
        _table(
            ["block", "rows", "requests", "tokens", "uniform requests", "uniform tokens", "gain",
             "vllm in flight", "vllm requests", "ours then"],
            [[str(r["block_size"]), str(r["rows"]), f"{r['rows_requests']:,}", f"{r['rows_tokens']:,}",
              f"{r['uniform_requests']:,}", f"{r['uniform_tokens']:,}", _x(r["gain"]),
              "-" if r["vllm_in_flight_tokens"] is None else f"{r['vllm_in_flight_tokens']:,}",
              "-" if r["vllm_requests"] is None else f"{r['vllm_requests']:.1f}",
              "-" if r["ours_at_vllm_in_flight"] is None else f"{r['ours_at_vllm_in_flight']:,}"]
             for r in result["hybrid_capacity"]],
        ),
        "  vllm = vLLM's own hybrid planner for the same layers and memory (it keeps max_num_batched_tokens x its "
        "concurrent batches in flight); ours then = our plan given those in-flight tokens",
        "",
        f"targets met: {sum(bool(t['ok']) for t in result['targets'])} of {len(result['targets'])}"
        + ("" if cfg["vllm"] else " (peer targets need vllm)"),
        *(f"  MISS {t['name']}: {t['value']} (target {t['target']})" for t in result["targets"] if t["ok"] is False),
    ]
    return "\n".join(out)


def _hits(row: dict[str, Any]) -> str:
    lo, hi = row["hit_tokens_min"], row["hit_tokens_max"]
    return f"{lo:,}" if lo == hi else f"{lo:,}..{hi:,}"


def _targets(hashing: list[dict[str, Any]], e2e: list[dict[str, Any]], lengths: list[dict[str, Any]],
             step: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every row with a verdict (ok or MISS), flattened for a summary line."""
    out = []
    for r in hashing:
        value = _x(r["over_floor"]) + " floor" if r["target"].startswith("ours") else _x(r["peer_over_ours"])
        out.append({"name": f"hashing {r['algorithm']} block {r['block_size']} {r['input']}",
                    "value": value, "target": r["target"], "ok": r["ok"]})
    for r in e2e:
        if r["impl"] == "kvcache":
            value = (f"{r['ms']:.3f} ms, {_x(r['peer_over_ours'])}" if r["mode"] == "uniform"
                     else _x(r["head_wise_over_uniform"]))
            out.append({"name": f"end to end block {r['block_size']} {r['mode']} {r['input']}",
                        "value": value, "target": r["target"], "ok": r["ok"]})
    for r in lengths:
        if r["impl"] == "kvcache":
            out.append({"name": f"admit + free {r['num_tokens']} tokens {r['input']}",
                        "value": f"{r['us']:.1f} us, {_x(r['peer_over_ours'])}", "target": r["target"],
                        "ok": r["ok"]})
    for r in step:
        value = _x(r["peer_over_ours"]) if r["rows"] == 1 else _x(r["head_wise_over_uniform"])
        out.append({"name": f"scheduler step {r['mode']}", "value": f"{r['ours_p50_us']:.1f} us, {value}",
                    "target": r["target"], "ok": r["ok"]})
    return [t for t in out if t["ok"] is not None]


def run_benchmark(repeat: int, quick: bool) -> dict[str, Any]:
    """Every section, measured now; one JSON-ready dict."""
    native = prefix._chainhash
    backend = native.backend() if native is not None else "python"
    peer_version = vllm.version()
    peer = peer_version is not None
    _progress(f"1. block allocate + free (peer: {'vllm ' + peer_version if peer else 'none, vllm not importable'})")
    block_alloc = bench_block_alloc(repeat, peer)
    _progress(f"2. hashing a {PROMPT_TOKENS:,}-token prompt, {PASSES} passes")
    runs = [bench_hashing(PROMPT_TOKENS, BLOCK_SIZES, repeat=max(4, -(-repeat // PASSES))) for _ in range(PASSES)]
    hashing = summarise_hashing(best_hashing_rows(runs), backend)
    _progress("3. end to end: admit + free of half-cached prompts")
    e2e = bench_end_to_end(repeat, peer)
    lengths = bench_prompt_lengths(repeat, peer)
    _progress("5. scheduler step")
    step = bench_step(repeat, peer)
    capacity = hybrid_capacity(peer)
    return {
        "benchmark": "allocator",
        "config": {
            "repeat": repeat,
            "quick": quick,
            "python": platform.python_version(),
            "numpy": np.__version__,
            "cpus": os.cpu_count(),
            "hash_backend": backend,
            "vllm": peer_version,
        },
        "block_alloc": block_alloc,
        "hashing": hashing,
        "end_to_end": e2e,
        "prompt_lengths": lengths,
        "step": step,
        "hybrid_capacity": capacity,
        "targets": _targets(hashing, e2e, lengths, step),
    }


def _run(args: argparse.Namespace) -> int:
    repeat = args.repeat if args.repeat is not None else QUICK_REPEAT if args.quick else REPEAT
    result = run_benchmark(repeat, args.quick)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Register `kvcache bench allocator`."""
    p = targets.add_parser(
        "allocator",
        allow_abbrev=False,
        help="block pool, prefix hashing, admit + free and a scheduler step, against vLLM's own allocator",
        description="Time, in this process, (1) block allocate + free per block, (2) hashing a 32,768-token "
        "prompt, (3) admit + free of a 32,768-token prompt with half of it cached, uniform and head-wise "
        "(8 rows), (4) admit + free of fresh prompts of 16 to 32,768 tokens from arrays and lists, (5) a "
        "scheduler step of 256 decoding requests; each against the installed vLLM's BlockPool, request "
        "block hasher and KVCacheManager (`pip install vllm` to compare; without it our rows are reported "
        "alone). Prints ratios to the peer and marks the targets ok/MISS; always exits 0.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"small repeat counts (default {QUICK_REPEAT} instead of {REPEAT}) for tests and CI; still runs "
        "every section",
    )
    p.add_argument(
        "--repeat",
        type=_positive_int,
        metavar="N",
        help=f"timed runs per measurement, the best is reported (default {REPEAT}, or {QUICK_REPEAT} with "
        f"--quick); sections 2-4 split them over {PASSES} passes, and kvcache.bench.hashing times "
        "vLLM's slower hasher a quarter as often",
    )
    p.set_defaults(run=_run)

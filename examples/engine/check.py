"""Prove the engine: greedy tokens over kvcache's paged tables equal a dense model's with no cache.

    python examples/engine/check.py            # every configuration, one line each; exit 0 only if all match

Each configuration serves two waves of prompts sharing prefixes (the second wave hits the prefix cache) and
compares every request's tokens and logits with ``reference.Reference``, a numpy decoder that shares no code with
the engine. After every step it also compares the cache itself (``CacheProof``): every block a request's table
names, in the tables the step's attention read and in the cache's own tables after the step, holds exactly the
K and V (MLA's latent; block_wise_fp8's float8 values and scales) the reference computes for the tokens at those
positions, so a swapped, stale or early-reused block fails even where attention over it would hide the fault.
The last line shows the comparison catching a fault: one step of one request reads a block its table does not
name, and its logits must then differ. A configuration that cannot run here (PD without NIXL) fails the run
unless ``--allow-skips`` is given.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvcache.transfer.nixl import nixl_available  # noqa: E402

from backend import TorchBackend  # noqa: E402
from daemons import daemons  # noqa: E402
from engine import daemon_engine, library_engine  # noqa: E402
from model import Model, ModelConfig  # noqa: E402
from reference import Reference, e4m3_decode, weights_of  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Case:
    """A model, the engine's settings and the prompts' shape."""

    model: ModelConfig = ModelConfig()
    num_blocks: int = 96
    block_size: int = 4
    chunk: int = 64
    max_num_seqs: int = 8
    head_wise: bool = False
    pool_blocks: tuple[int, ...] | None = None  # each row's pool (None: num_blocks each)
    prompt_lens: tuple[int, ...] = (21, 34, 9, 40)
    max_new_tokens: int = 10
    daemon: tuple[str, ...] | None = None  # serve through a real `kvcache serve` with these flags (and --model)
    host_blocks: int = 0  # a host tier; a wave of other prompts then pushes the first wave's blocks out to it
    quant: str = "none"  # the cache's quant type (block_wise_fp8: the dense model rounds K and V the same way)
    tp: int = 1  # TP ranks (daemon mode; PD: the prefill node's): each rank's cache and attention in a process
    pd: bool = False  # prefill and decode on two engines and daemons, the KV moved over NIXL (with daemon's flags)
    logit_tolerance: float = 1e-3  # float32: what summing in another order may change; a wrong block changes far more
    # Compare logits along the engine's own tokens (the dense model continues from them), for low precision: a
    # token may differ from the dense model's only where the dense model's margin for it is within the tolerance.
    forced: bool = False
    # What a cached K or V may differ by from the reference's, relative to the largest (float32 rounding stays
    # near 1e-6; a block holding other positions' vectors differs by their whole size).
    cache_tolerance: float = 1e-4


WINDOWED = ModelConfig(window=8, sink=4)
# FastDeploy's head-wise window at ratio 0.5: 8 query heads over 4 kv heads, the last 2 kv heads windowed at TP 1;
# at TP 2 each rank windows its last one (kv heads 1 and 3), so its model computes as FastDeploy's does there.
HEAD_WISE = dataclasses.replace(WINDOWED, head_wise_swa_ratio=0.5)
HEAD_WISE_TP2 = dataclasses.replace(HEAD_WISE, tp=2)
CASES: dict[str, Case] = {
    "uniform": Case(),
    "head-wise SWA (FastDeploy: 2 of 4 kv heads windowed)": Case(
        model=HEAD_WISE, head_wise=True),
    "layer groups (Gemma: layers 0, 1, 3 windowed), own pools": Case(
        model=dataclasses.replace(WINDOWED, window_layers=(0, 1, 3)), pool_blocks=(72, 96)),
    "layer groups x head-wise": Case(model=dataclasses.replace(WINDOWED, window_layers=(1, 2)), head_wise=True),
    "window on every layer, no sink": Case(model=ModelConfig(window=6)),
    "chunked prefill (8 tokens a step)": Case(model=dataclasses.replace(WINDOWED, window_layers=(0, 2)), chunk=8),
    "preemption (blocks for about two requests)": Case(num_blocks=30, prompt_lens=(30, 38, 26, 34), max_new_tokens=16),
    "host tier: evicted prefixes come back from host": Case(num_blocks=40, host_blocks=128, max_num_seqs=2),
    "host tier with layer groups x head-wise": Case(
        model=dataclasses.replace(WINDOWED, window_layers=(0, 1, 3)), head_wise=True, num_blocks=40,
        host_blocks=128, max_num_seqs=2),
    "MLA (DeepSeek-style latent, one cache head)": Case(
        model=ModelConfig(num_kv_heads=1, kv_lora_rank=32, rope_dim=8)),
    "MLA with a host tier": Case(model=ModelConfig(num_kv_heads=1, kv_lora_rank=32, rope_dim=8), num_blocks=40,
                                 host_blocks=128, max_num_seqs=2),
    "block_wise_fp8 (float8 K and V, a scale per token and head; float64 model)": Case(
        model=ModelConfig(dtype="float64"), quant="block_wise_fp8"),
    "block_wise_fp8 with layer groups x head-wise and preemption": Case(
        model=dataclasses.replace(WINDOWED, window_layers=(0, 2), dtype="float64"), head_wise=True,
        quant="block_wise_fp8", num_blocks=30, prompt_lens=(30, 38, 26, 34), max_new_tokens=16),
    "daemon: uniform": Case(daemon=("--num-blocks", "96")),
    "daemon: layer groups x head-wise, chunked, pools sized from memory": Case(
        model=dataclasses.replace(WINDOWED, window_layers=(0, 1, 3)), head_wise=True, chunk=16,
        daemon=("--gpu-memory", "768KiB", "--utilization", "1", "--max-model-len", "72",
                "--max-num-batched-tokens", "16")),
    "daemon, TP 2 (a process per rank): head-wise SWA (FastDeploy at TP 2: kv heads 1 and 3 windowed)": Case(
        model=HEAD_WISE_TP2, head_wise=True, tp=2, daemon=("--num-blocks", "96")),
    "daemon, TP 2: layer groups x head-wise, preemption": Case(
        model=dataclasses.replace(WINDOWED, window_layers=(0, 2)), head_wise=True, tp=2, num_blocks=30,
        prompt_lens=(30, 38, 26, 34), max_new_tokens=16, daemon=("--num-blocks", "30")),
    "PD: prefill and decode daemons, KV layer by layer over NIXL, head-wise SWA": Case(
        model=HEAD_WISE, head_wise=True, pd=True, daemon=("--num-blocks", "96")),
    "PD with layer groups x head-wise": Case(
        model=dataclasses.replace(WINDOWED, window_layers=(0, 1, 3)), head_wise=True, pd=True,
        daemon=("--num-blocks", "96")),
    # Layer groups x head-wise: FastDeploy's head-wise split is per rank, so one model at TP 2 and TP 1 has none.
    "PD, prefill TP 2 (a messager per rank) to decode TP 1": Case(
        model=dataclasses.replace(WINDOWED, window_layers=(0, 1, 3)), head_wise=True, pd=True, tp=2,
        daemon=("--num-blocks", "96")),
    "daemon with a host tier (kvcache serve --host-block-budget): prefixes come back from host": Case(
        num_blocks=40, host_blocks=128, max_num_seqs=2, daemon=("--num-blocks", "40", "--host-block-budget", "128")),
    "daemon with a host tier, layer groups x head-wise": Case(
        model=dataclasses.replace(WINDOWED, window_layers=(0, 1, 3)), head_wise=True, num_blocks=40, host_blocks=128,
        max_num_seqs=2, daemon=("--num-blocks", "40", "--host-block-budget", "128")),
    "daemon, TP 2, with a host tier: each rank's agent copies its kv heads": Case(
        model=HEAD_WISE_TP2, head_wise=True, tp=2, num_blocks=40, host_blocks=128,
        max_num_seqs=2, daemon=("--num-blocks", "40", "--host-block-budget", "128")),
    "PD with a host tier on both nodes (the decode node's hits come back from its host)": Case(
        model=HEAD_WISE, head_wise=True, pd=True, num_blocks=80, host_blocks=128,
        daemon=("--num-blocks", "80", "--host-block-budget", "128")),
    "daemon: preemption": Case(num_blocks=30, prompt_lens=(30, 38, 26, 34), max_new_tokens=16,
                               daemon=("--num-blocks", "30")),
}


def prompts_of(case: Case, seed: int = 7) -> list[dict[str, list[int]]]:
    """Two waves: prompts sharing a 12-token head, then the same prompts grown by a few tokens (prefix hits); with
    a host tier, a wave of other prompts between them moves the first wave's blocks to host."""
    rng = np.random.default_rng(seed)
    vocab = case.model.vocab
    head = rng.integers(0, vocab, 12).tolist()
    first = {f"a{i}": (head if i % 2 == 0 else []) + rng.integers(0, vocab, n).tolist()
             for i, n in enumerate(case.prompt_lens)}
    second = {f"b{i}": p + rng.integers(0, vocab, 5).tolist() for i, p in enumerate(first.values())}
    if not case.host_blocks:
        return [first, second]
    others = {f"x{i}": rng.integers(0, vocab, 36).tolist() for i in range(6)}  # push the first wave out of the cache
    return [first, others, second]


@contextlib.contextmanager
def serving(case: Case) -> Iterator[dict[str, str]]:
    """`kvcache serve` daemons for the case's model and flags, stopped on the way out: their endpoints by role
    ("both"; "prefill" and "decode" for PD; none in library mode)."""
    roles = ("prefill", "decode") if case.pd else ("both",) if case.daemon is not None else ()
    with daemons(case.model, block_size=case.block_size, roles=roles, head_wise=case.head_wise, tp=case.tp,
                 flags=case.daemon or ()) as endpoints:
        yield endpoints


# Configurations only the GPU engine runs: a bfloat16 model and cache, against the numpy reference in float32
# (numpy has no bfloat16). Its logits (up to about 17 here, where a bfloat16 step is 0.125) differ by rounding:
# the dense bfloat16 model's differ from the float32 reference's by up to 0.25 (seen on the CPU), and flex
# attention, summing in float32 over tiles, from the dense bfloat16 model's by up to 0.28. The tolerance is eight
# steps (a wrong block moves logits by tens); near ties may break either way, so the case is compared along the
# engine's tokens. Its cached K and V differ from the float32 reference's by up to 1.3% of the largest (four
# layers of bfloat16 rounding); a block holding other positions' vectors differs by their whole size.
GPU_CASES: dict[str, Case] = {
    "bfloat16 model and cache, head-wise SWA": Case(
        model=dataclasses.replace(HEAD_WISE, dtype="bfloat16"), head_wise=True, block_size=16,
        num_blocks=26, logit_tolerance=1.0, forced=True, cache_tolerance=0.05),
}


def on_gpu(case: Case) -> Case:
    """The case for the GPU engine (PD runs both nodes' engines on the GPU, the KV moved over NIXL; TP ranks each
    keep their kv heads' cache on the GPU in a process of their own). Flex attention reads blocks of 16 tokens or
    more: the same tokens in a quarter of the blocks (two more: partly filled blocks of 16 leave a request more
    room unused); MLA's latent is read as one head of 64 values (its rank widened to ``64 - rope_dim``)."""
    scale = 16 // case.block_size

    def blocks(n: int) -> int:
        return -(-n // scale) + 2

    daemon = case.daemon
    for flag in ("--num-blocks", "--host-block-budget"):
        if daemon and flag in daemon:
            at = daemon.index(flag) + 1
            daemon = (*daemon[:at], str(blocks(int(daemon[at]))), *daemon[at + 1:])
    model = case.model
    if model.kv_lora_rank:
        model = dataclasses.replace(model, kv_lora_rank=64 - model.rope_dim)
    return dataclasses.replace(case, model=model, block_size=16, num_blocks=blocks(case.num_blocks), daemon=daemon,
                               host_blocks=blocks(case.host_blocks) if case.host_blocks else 0,
                               pool_blocks=tuple(map(blocks, case.pool_blocks)) if case.pool_blocks else None)


def run(case: Case, corrupt: bool = False, device: str = "cpu") -> dict[str, Any]:
    """Serve the case's waves and compare with the dense model: matches, hits, preemptions, blocks given back.
    ``device`` "cuda:N": the model and its dense reference in PyTorch there, attention by flex attention."""
    if case.model.head_wise_swa_ratio is not None and case.model.tp != case.tp:
        raise ValueError(f"tp: the model windows FastDeploy's heads at TP {case.model.tp}, the case runs {case.tp}")
    with serving(case) as endpoints:
        if case.pd:
            return _run_pd(case, endpoints, device)
        return _run(case, endpoints.get("both"), corrupt, device)


def _run_pd(case: Case, endpoints: dict[str, str], device: str = "cpu") -> dict[str, Any]:
    """Prefill on one engine and daemon, decode on another, the KV moved layer by layer over NIXL (on a host of
    several GPUs, the decode engine and its cache on the next GPU: GPU to GPU)."""
    from pd import PDPair

    model = Model(case.model, TorchBackend(device) if device != "cpu" else None)
    decode_model = None
    if device != "cpu" and model.ops.torch.cuda.device_count() > 1:
        torch = model.ops.torch
        other = ((torch.device(device).index or 0) + 1) % torch.cuda.device_count()
        decode_model = Model(case.model, TorchBackend(f"cuda:{other}"))
    pair = PDPair(model, endpoints["prefill"], endpoints["decode"], block_size=case.block_size,
                  head_wise=case.head_wise, quant=case.quant, prefill_tp=case.tp, decode_model=decode_model)
    reference = reference_of(model, case)
    try:
        proofs = [CacheProof(side, reference, case.cache_tolerance) for side in (pair.prefill, pair.decode)]
        mismatched, total, worst = _compare(reference, case, pair.generate)
        prefill_hits, decode_hits = pair.hit_tokens()
        for side in (pair.prefill, pair.decode):
            side.cache.check_integrity()
        stats = [side.cache.stats() for side in (pair.prefill, pair.decode)]
        recycled = sum(s["recycled_blocks"] for s in stats)
        prefill_host, decode_host = (s.get("host_tier", {}).get("hit_tokens", 0) for s in stats)
        decode = pair.decode
        blocks = sorted(set(decode.paged.layer_blocks if decode.paged is not None else decode.attention.layer_blocks))
    finally:
        pair.close()
    return {"requests": total, "mismatched": mismatched, "max_logit_diff": worst, "hit_tokens": prefill_hits,
            "decode_hit_tokens": decode_hits, "host_tokens": prefill_host + decode_host,
            "decode_host_tokens": decode_host, "preempted": 0,
            "cache_faults": [f for proof in proofs for f in proof.faults],
            "blocks_checked": sum(proof.blocks_checked for proof in proofs),
            "rows": len(pair.spec.row_layout),
            "layer_blocks": blocks, "recycled": int(recycled),
            "rank_devices": getattr(pair.prefill.attention, "devices", None),
            "steps": len(pair.prefill.stats) + len(pair.decode.stats)}


def reference_of(model: Model, case: Case) -> Reference:
    """The numpy oracle for the case's model (a bfloat16 model's in float32: numpy has no bfloat16)."""
    dtype = "float32" if case.model.dtype == "bfloat16" else case.model.dtype
    return Reference(case.model.hf_config(), weights_of(model), dtype, fp8=case.quant == "block_wise_fp8",
                     tp=case.model.tp)


def _compare(reference: Reference, case: Case, generate: Any) -> tuple[list[str], int, float]:
    """Every wave through ``generate``, each request against the reference: (mismatched, requests, worst logit gap)."""
    mismatched, total, worst = [], 0, 0.0
    for wave in prompts_of(case):
        got = generate(wave, case.max_new_tokens)
        for rid, prompt in wave.items():
            total += 1
            tokens, logits = reference.generate(prompt, case.max_new_tokens,
                                                forced=got[rid].generated if case.forced else None)
            # Logits over the cache may differ from the dense ones in rounding only (sums in another order)
            diff = float(np.abs(np.array(got[rid].logits) - logits).max())
            worst = max(worst, diff)
            steps = np.arange(len(tokens))
            margin = logits[steps, tokens] - logits[steps, got[rid].generated]  # 0 where the tokens agree
            if (margin > case.logit_tolerance).any() or (not case.forced and got[rid].generated != tokens) \
                    or diff > case.logit_tolerance:
                mismatched.append(rid)
    return mismatched, total, worst


def _numpy(x: Any) -> np.ndarray:
    """A cache tensor (Paddle or PyTorch, on any device) as numpy; float8 bytes stay uint8, bfloat16 widens."""
    if type(x).__module__.startswith("torch"):
        x = x.detach()
        return (x.float() if x.dtype.is_floating_point and x.element_size() < 4 else x).cpu().numpy()
    return x.numpy()


class CacheProof:
    """After every step of ``engine``, every block a request's table names holds what ``reference`` computes for
    the tokens at those positions: in the tables the step's attention read (a request that finished in the step
    included, and a prefix hit's blocks), and in the cache's own tables of the requests still running. Blocks a
    table no longer holds (-1, a window's) are skipped; positions past what the request computed are not read.
    ``faults`` collects one line per disagreement (``max_faults`` at most)."""

    def __init__(self, engine: Any, reference: Reference, tolerance: float = 1e-4, max_faults: int = 20) -> None:
        self.engine, self.reference, self.tolerance, self.max_faults = engine, reference, tolerance, max_faults
        self.faults: list[str] = []
        self.blocks_checked = 0
        run, step = engine.run, engine.step

        def checked_run(work: list[Any], tables: list[Any]) -> None:
            run(work, tables)
            self._verify([(w.seq.rid, w.seq.tokens[:w.stop]) for w in work], tables, "read by the step")

        def checked_step() -> Any:
            stats = step()
            running = [(s.rid, s.tokens[:s.computed]) for s in engine.running if s.computed]
            self._verify(running, None, "in the cache's table after the step")
            return stats

        engine.run, engine.step = checked_run, checked_step

    def _parts(self, rids: list[Any], tables: list[Any] | None) -> list[tuple[range, np.ndarray, list[Any], list[Any]]]:
        """Per holder of cache heads (the engine, or each TP rank): its kv heads, ``head_rows``, the tables of ``rids``
        (``tables`` where given, else the cache's own now) and its cache arrays by layer."""
        engine = self.engine
        if hasattr(engine.attention, "inspect"):  # TP ranks: each reports its tables and cache arrays
            return engine.attention.inspect(rids, step=tables is not None)
        if tables is None:
            tables = [np.array(engine.cache.table(rid)) for rid in rids]
        views = engine.paged.views if engine.paged is not None else engine.attention.views
        arrays = [{name: _numpy(x) for name, x in views(layer).items()} for layer in range(engine.spec.num_layers)]
        return [(range(engine.model.config.cache_heads), np.asarray(engine.head_rows), tables, arrays)]

    def _verify(self, requests: list[tuple[Any, list[int]]], tables: list[Any] | None, where: str) -> None:
        if not requests or len(self.faults) >= self.max_faults:
            return
        rids = [rid for rid, _ in requests]
        for heads, head_rows, held, arrays in self._parts(rids, tables):
            for (rid, tokens), table in zip(requests, held):
                for fault in self._faults(heads, head_rows, np.asarray(table), arrays, tokens):
                    self.faults.append(f"request {rid!r}, {where}: {fault}")

    def _faults(self, heads: range, head_rows: np.ndarray, table: np.ndarray, arrays: list[dict[str, np.ndarray]],
                tokens: list[int]) -> list[str]:
        """Where the blocks ``table`` names for ``tokens`` (positions 0..n-1) hold something else."""
        if not tokens:
            return []
        want = self.reference.run(tokens).cache
        block_size = self.engine.spec.block_size
        positions = np.arange(len(tokens))
        out = []
        for layer, stored in enumerate(arrays):
            blocks = table[head_rows[layer]][:, positions // block_size]  # [heads, n]
            head, pos = np.nonzero(blocks >= 0)
            block = blocks[head, pos]
            self.blocks_checked += len(np.unique(block))
            for name, got in stored.items():
                expect = want[layer][name][pos, heads.start + head]  # [k, dim]
                got = got[block, head, pos % block_size]
                if name.endswith("_scale"):
                    bad = ~np.isclose(got, expect[:, 0], rtol=1e-5, atol=0)
                elif got.dtype == np.uint8:  # float8 bytes: within one float8 step of the reference's rounding
                    got = e4m3_decode(got)
                    step = np.exp2(np.maximum(np.floor(np.log2(np.maximum(np.abs(expect), 2.0 ** -9))), -6) - 3)
                    bad = ~(np.abs(got - expect) <= step * 1.001).all(axis=-1)
                else:
                    tol = self.tolerance * max(1.0, float(np.abs(expect).max(initial=0)))
                    bad = ~(np.abs(got - expect) <= tol).all(axis=-1)
                if bad.any():
                    at = np.flatnonzero(bad)
                    blocks_bad = sorted(set(block[at].tolist()))
                    out.append(f"layer {layer} {name}: block(s) {blocks_bad[:6]} (kv head(s) "
                               f"{sorted(set((heads.start + head[at]).tolist()))}) do not hold positions "
                               f"{pos[at].min()}..{pos[at].max()} ({len(at)} vectors)")
        return out


def corrupt_once(engine: Any, rid: Any, row: int, col: int) -> None:
    """A fault for the proof to catch: once request ``rid``'s block in column ``col`` of table row ``row`` holds
    tokens, one step reads and writes another block there (one that row does not name)."""
    run, pending = engine.run, [True]

    def corrupted(work: list[Any], tables: list[Any]) -> None:
        for w, table in zip(work, tables):
            if pending and w.seq.rid == rid and w.start >= (col + 1) * engine.spec.block_size:
                table[row, col] = next(b for b in range(min(engine.paged.layer_blocks)) if b not in table[row])
                pending.clear()
        run(work, tables)

    engine.run = corrupted


def _run(case: Case, endpoint: str | None, corrupt: bool, device: str = "cpu") -> dict[str, Any]:
    model = Model(case.model, TorchBackend(device) if device != "cpu" else None)
    options = dict(block_size=case.block_size, head_wise=case.head_wise, chunk=case.chunk,
                   max_num_seqs=case.max_num_seqs, quant=case.quant)
    if endpoint is None:
        engine = library_engine(model, num_blocks=case.num_blocks, **options, host_blocks=case.host_blocks,
                                pool_blocks=list(case.pool_blocks) if case.pool_blocks else None)
    else:
        engine = daemon_engine(model, endpoint, tp=case.tp, **options)
    if corrupt:
        corrupt_once(engine, "a1", 0, 1)
    reference = reference_of(model, case)
    proof = CacheProof(engine, reference, case.cache_tolerance)
    mismatched, total, worst = _compare(reference, case, engine.generate)
    host_tokens = 0
    if engine.tier is not None:
        engine.tier.drain(10)
        engine.tier.check_integrity()
        host_tokens = engine.tier.stats().hit_tokens
    if engine.agent is not None:
        assert engine.agent.drain(10) and engine.agent.failed == 0
    engine.cache.check_integrity()
    stats = engine.cache.stats()
    if isinstance(stats, dict):  # a daemon's, with its host tier's hits (TP ranks' agents too)
        recycled, host_tokens = stats["recycled_blocks"], stats.get("host_tier", {}).get("hit_tokens", host_tokens)
    else:
        recycled = stats.recycled_blocks
    blocks = sorted(set(engine.paged.layer_blocks if engine.paged is not None else
                       getattr(engine.attention, "layer_blocks", [])))
    engine.close()
    return {"requests": total, "mismatched": mismatched, "max_logit_diff": worst,
            "hit_tokens": sum(s.hit for s in engine.stats), "preempted": sum(s.preempted for s in engine.stats),
            "host_tokens": int(host_tokens), "rows": len(engine.spec.row_layout),
            "layer_blocks": blocks, "rank_devices": getattr(engine.attention, "devices", None),
            "recycled": int(recycled), "steps": len(engine.stats),
            "overlapped": sum(s.overlapped for s in engine.stats),
            "cache_faults": proof.faults, "blocks_checked": proof.blocks_checked}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--only", help="run the configurations whose name contains this text")
    parser.add_argument("--device", default="cpu",
                        help="cpu (Paddle), or cuda / cuda:N: the model in PyTorch there, attention by flex attention "
                        "over the paged cache (the configurations the GPU engine serves)")
    parser.add_argument("--allow-skips", action="store_true",
                        help="exit 0 even when configurations cannot run here (PD without NIXL); without it a "
                        "skipped configuration fails the run")
    args = parser.parse_args(argv)
    device = "cuda:0" if args.device == "cuda" else args.device
    ok, skipped = True, []
    cases = CASES if device == "cpu" else {**CASES, **GPU_CASES}
    for name, case in cases.items():
        if args.only and args.only not in name:
            continue
        if device != "cpu" and name in CASES:
            case = on_gpu(case)
        if case.pd and not nixl_available():
            print(f"skip {name}: NIXL is not installed (pip install nixl-cu12 --no-deps)", flush=True)
            skipped.append(name)
            continue
        start = time.perf_counter()
        r = run(case, device=device)
        good = not r["mismatched"] and not r["cache_faults"]
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'} {name}: {r['requests'] - len(r['mismatched'])}/{r['requests']} match; "
              f"logits within {r['max_logit_diff']:.1e}; {r['blocks_checked']} blocks checked after steps, "
              f"{len(r['cache_faults'])} faults; rows {r['rows']} "
              f"({'blocks ' + '/'.join(map(str, r['layer_blocks'])) if r['layer_blocks'] else 'a cache per TP rank'}"
              f"{' on ' + ', '.join(r['rank_devices']) if r.get('rank_devices') and r['rank_devices'][0] else ''}), "
              f"{r['hit_tokens']} prefix-hit tokens ({r['host_tokens']} from host"
              f"{', %d on the decode node' % r['decode_hit_tokens'] if 'decode_hit_tokens' in r else ''}), {r['preempted']} preemptions, "
              f"{r['recycled']} window blocks given back, {r['steps']} steps"
              f"{' (%d overlapping the daemon)' % r['overlapped'] if r.get('overlapped') else ''} "
              f"({time.perf_counter() - start:.1f} s)",
              flush=True)
        for fault in r["cache_faults"][:5]:
            print(f"     cache: {fault}", flush=True)
    if not args.only and device == "cpu":
        r = run(CASES["uniform"], corrupt=True)
        caught = bool(r["mismatched"]) and bool(r["cache_faults"])
        ok &= caught
        print(f"{'ok  ' if caught else 'FAIL'} a table with one block id swapped for one step: "
              f"{'caught' if caught else 'NOT caught'} ({', '.join(r['mismatched']) or 'all matched'}; "
              f"{len(r['cache_faults'])} cache faults)", flush=True)
    if skipped:
        print(f"{'skipped' if args.allow_skips else 'FAIL skipped'} {len(skipped)} configuration(s): "
              f"{'; '.join(skipped)}" + ("" if args.allow_skips else " (--allow-skips accepts this)"), flush=True)
        ok &= args.allow_skips
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""`kvcache bench engine`: decode throughput of the reference engine over kvcache's paged tables, on a GPU.

A Llama-1B-shaped model (seeded random weights, bfloat16) serves concurrent requests through the reference
engine (``examples/engine``) with a ``KVCacheManager``: prompts are prefilled, then every request decodes. The
same engine runs twice in the same process, in turns: its attention reading the paged cache through the tables
(flex attention with a block mask from the tables), and reading a contiguous region per request (the same kernel,
no table: the limit). Reports decode tokens/s of each and their ratio against the target. Then time to first
token: the same number of prompts arrives at once, first with nothing cached, then sharing a prefix of each
``--shares`` with a request served before them; the mean time to first token should fall with the cached share.
With ``--daemon`` the engine also schedules through a real `kvcache serve`: each decode extend reserves the next
step's position (``num_lookahead_tokens=1``), so the next step posts its extends and runs the model while the
daemon applies them.
Needs PyTorch with a GPU and the source checkout's ``examples/engine`` (``--engine-dir``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvcache.arguments import positive_int
from kvcache.bench.common import progress

BLOCK_SIZE = 16
PAGED_TARGET = 0.95  # paged decode tokens/s over contiguous
DAEMON_TARGET = 0.95  # through the daemon over in process
TTFT_SLACK = 1.2  # time to first token with a prefix hit over a cold one, at most this times the uncached share


def _engine_dir(given: str | None) -> Path:
    folder = Path(given) if given else Path(__file__).resolve().parents[2] / "examples" / "engine"
    if not (folder / "engine.py").is_file():
        raise SystemExit(f"kvcache bench engine: --engine-dir: no engine.py in {folder} (the source checkout's "
                         "examples/engine)")
    return folder


def _build(mode: str, model: Any, requests: int, prompt: int, new: int, chunk: int, endpoint: str = "") -> Any:
    """An engine for ``mode``: ``paged`` (flex attention over the tables), ``contiguous`` (a region per request) or
    ``daemon`` (paged, scheduling through the `kvcache serve` at ``endpoint``, tables from a subscriber)."""
    from engine import daemon_engine, library_engine
    from gpu import ContiguousAttention

    options = dict(block_size=BLOCK_SIZE, chunk=chunk, max_num_seqs=requests, keep_logits=False)
    if mode == "daemon":
        return daemon_engine(model, endpoint, **options)
    attention = None
    if mode == "contiguous":  # the same scheduler and manager; the attention reads no table
        attention = ContiguousAttention(model, max_batch=requests, max_len=prompt + new, max_tokens=chunk,
                                        block_size=BLOCK_SIZE)
    return library_engine(model, num_blocks=_num_blocks(requests, prompt, new), attention=attention, **options)


def _num_blocks(requests: int, prompt: int, new: int) -> int:
    """Blocks for every request at its longest, and a few spare."""
    return requests * -(-(prompt + new) // BLOCK_SIZE) + 16


def _decode_rate(engine: Any, prompts: list[list[int]], new: int, warmup: int) -> dict[str, float]:
    """Prefill every prompt, then time the steps in which every request decodes (after ``warmup`` of them)."""
    for i, prompt in enumerate(prompts):
        engine.add(i, prompt, new)
    decode_s, tokens, seen, overlapped = 0.0, 0, 0, 0
    while engine.waiting or engine.running:
        decoding = not engine.waiting and all(s.scheduled == len(s.tokens) - 1 for s in engine.running)
        start = time.perf_counter()
        stats = engine.step()
        took = time.perf_counter() - start
        if decoding:
            seen += 1
            if seen > warmup:
                decode_s += took
                tokens += stats.computed
                overlapped += stats.overlapped
    timed = max(seen - warmup, 1)
    return {"tokens": tokens, "seconds": decode_s, "tokens_per_s": tokens / decode_s if decode_s else 0.0,
            "overlapped_share": overlapped / timed}


def _mean_ttft(engine: Any, prompts: dict[str, list[int]]) -> float:
    """Seconds from the prompts' arrival (all at once) to each one's first token, averaged."""
    for rid, prompt in prompts.items():
        engine.add(rid, prompt, 1)
    start, first = time.perf_counter(), {}
    while engine.waiting or engine.running:
        engine.step()  # ends by reading the logits back: the GPU is done with the step
        now = time.perf_counter()
        for rid in prompts:
            if rid in engine.finished and rid not in first:
                first[rid] = now - start
    for rid in prompts:
        engine.finished.pop(rid)
    return float(np.mean(list(first.values())))


def _ttft(args: argparse.Namespace, model: Any, shares: list[float]) -> list[dict[str, float]]:
    """Mean time to first token of ``--requests`` prompts arriving at once: with nothing cached, and sharing
    each share of their tokens with a request served just before. The first round of each only compiles."""
    requests, prompt, vocab = args.requests, args.prompt_tokens, model.config.vocab
    engine = _build("paged", model, requests, prompt, 1, args.chunk)
    rng = np.random.default_rng(1)

    def fresh(n: int, tag: str) -> dict[str, list[int]]:
        return {f"{tag}{i}": rng.integers(0, vocab, n).tolist() for i in range(requests)}

    out = []
    try:
        for share in shares:
            hit = int(share * prompt) // BLOCK_SIZE * BLOCK_SIZE  # the cache keeps whole blocks
            times = {}
            for round_ in range(2):
                progress(f"time to first token, {share:.0%} shared: round {round_ + 1}/2")
                cold = _mean_ttft(engine, fresh(prompt, f"c{share}-{round_}-"))
                head = rng.integers(0, vocab, hit).tolist()
                _mean_ttft(engine, {f"w{share}-{round_}": head + rng.integers(0, vocab, prompt - hit).tolist()})
                warm = _mean_ttft(engine, {rid: head + tail for rid, tail in
                                           fresh(prompt - hit, f"h{share}-{round_}-").items()})
                times = {"cold_s": cold, "hit_s": warm}
            ratio = times["hit_s"] / times["cold_s"]
            uncached = 1 - hit / prompt
            out.append({"share": hit / prompt, **times, "ratio": ratio, "uncached": uncached,
                        "ok": ratio <= TTFT_SLACK * uncached})
    finally:
        engine.close()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(_engine_dir(args.engine_dir)))
    try:
        import torch
    except ImportError:
        raise SystemExit("kvcache bench engine: needs PyTorch with a CUDA device (pip install torch)") from None
    if not torch.cuda.is_available():
        raise SystemExit("kvcache bench engine: needs PyTorch with a CUDA device")
    from backend import TorchBackend
    from model import Model, ModelConfig

    quick = args.quick
    config = ModelConfig(num_layers=4 if quick else 16, num_q_heads=32, num_kv_heads=8, head_dim=64, hidden=2048,
                         ffn=8192, vocab=32_000 if quick else 128_256, dtype="bfloat16")
    requests, prompt, new = args.requests, args.prompt_tokens, args.new_tokens
    progress(f"building the model ({config.num_layers} layers, hidden {config.hidden}, bf16)")
    model = Model(config, TorchBackend(args.device))
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, config.vocab, (requests, prompt)).tolist()
    modes = ("paged", "contiguous", "daemon") if args.daemon else ("paged", "contiguous")
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    with _serving(args, model, _num_blocks(requests, prompt, new)) as endpoint:
        for round_ in range(args.rounds):
            for mode in modes:
                progress(f"round {round_ + 1}/{args.rounds}: {mode}, {requests} requests of {prompt} tokens, "
                         f"{new} decode steps")
                engine = _build(mode, model, requests, prompt, new, args.chunk, endpoint)
                results[mode].append(_decode_rate(engine, prompts, new, warmup=4))
                engine.close()
                torch.cuda.empty_cache()
    best = {mode: max(r["tokens_per_s"] for r in rows) for mode, rows in results.items()}
    ratio = best["paged"] / best["contiguous"]
    out = {"device": torch.cuda.get_device_name(), "layers": config.num_layers, "requests": requests,
           "prompt_tokens": prompt, "new_tokens": new, "rounds": results, "paged_tokens_per_s": best["paged"],
           "contiguous_tokens_per_s": best["contiguous"], "paged_over_contiguous": ratio,
           "target": f"paged/contiguous >= {PAGED_TARGET:g}", "ok": ratio >= PAGED_TARGET}
    out["ttft"] = _ttft(args, model, args.shares) if args.shares else []
    if args.daemon:
        out.update(daemon_tokens_per_s=best["daemon"], daemon_over_library=best["daemon"] / best["paged"],
                   daemon_overlapped_share=max(results["daemon"], key=lambda r: r["tokens_per_s"])["overlapped_share"],
                   daemon_target=f"daemon/library >= {DAEMON_TARGET:g}",
                   daemon_ok=best["daemon"] / best["paged"] >= DAEMON_TARGET)
    return out


@contextlib.contextmanager
def _serving(args: argparse.Namespace, model: Any, num_blocks: int) -> Iterator[str]:
    """A `kvcache serve` for the model (with --daemon), stopped on the way out; its endpoint ("" without)."""
    if not args.daemon:
        yield ""
        return
    from check import Case, serving

    with serving(Case(model=model.config, block_size=BLOCK_SIZE, daemon=("--num-blocks", str(num_blocks)))) as endpoints:
        yield endpoints["both"]


def _print_daemon(r: dict[str, Any]) -> None:
    print(f"  daemon (kvcache serve, tables from a subscriber) {r['daemon_tokens_per_s']:8,.0f} tokens/s; "
          f"{r['daemon_overlapped_share']:.0%} of decode steps overlap the daemon's round trip")
    print(f"  daemon / library {r['daemon_over_library']:.3f}   target {r['daemon_target']}: "
          f"{'ok' if r['daemon_ok'] else 'MISS'}")


def _print(r: dict[str, Any]) -> None:
    print(f"decode throughput, {r['requests']} requests of {r['prompt_tokens']} tokens, {r['layers']} layers, "
          f"{r['device']} (best of {len(r['rounds']['paged'])} rounds each, in turns)")
    print(f"  paged (flex attention over kvcache's tables)   {r['paged_tokens_per_s']:10,.0f} tokens/s")
    print(f"  contiguous (a region per request, no table)   {r['contiguous_tokens_per_s']:10,.0f} tokens/s")
    print(f"  paged / contiguous {r['paged_over_contiguous']:.3f}   target {r['target']}: "
          f"{'ok' if r['ok'] else 'MISS'}")


def _print_ttft(r: dict[str, Any]) -> None:
    print(f"time to first token, {r['requests']} prompts of {r['prompt_tokens']} tokens arriving at once (mean)")
    for t in r["ttft"]:
        print(f"  {t['share']:4.0%} cached: {t['hit_s'] * 1e3:8.1f} ms against {t['cold_s'] * 1e3:8.1f} ms cold = "
              f"{t['ratio']:.3f}; uncached share {t['uncached']:.3f}, target <= {TTFT_SLACK:g} x that: "
              f"{'ok' if t['ok'] else 'MISS'}")


def _run(args: argparse.Namespace) -> int:
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else "", end="\n" if args.json else "")
    if not args.json:
        _print(result)
        if "daemon_tokens_per_s" in result:
            _print_daemon(result)
        if result["ttft"]:
            _print_ttft(result)
    return 0


def _shares(text: str) -> list[float]:
    try:
        shares = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if any(not 0 <= share < 1 for share in shares):
        raise argparse.ArgumentTypeError(f"each share must be in [0, 1): {text!r}")
    return shares


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Register `kvcache bench engine`."""
    p = targets.add_parser("engine", help="the reference engine's decode tokens/s over paged tables vs a contiguous "
                           "cache (GPU)", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--device", default="cuda:0", help="the GPU (default cuda:0)")
    p.add_argument("--engine-dir", help="the source checkout's examples/engine (default: next to this package)")
    p.add_argument("--requests", type=positive_int, default=64, help="concurrent requests (default 64)")
    p.add_argument("--prompt-tokens", type=positive_int, default=512, help="tokens of each prompt (default 512)")
    p.add_argument("--new-tokens", type=positive_int, default=256,
                   help="tokens each request decodes (default 256: every request decodes together for most of them)")
    p.add_argument("--chunk", type=positive_int, default=512, help="tokens a step computes at most (default 512)")
    p.add_argument("--rounds", type=positive_int, default=2, help="rounds of each mode, in turns (default 2)")
    p.add_argument("--quick", action="store_true", help="4 layers and a small vocabulary (a smoke run)")
    p.add_argument("--daemon", action="store_true",
                   help="also schedule through a real kvcache serve, the model reading a subscriber's tables")
    p.add_argument("--shares", type=_shares, default=[0.5, 0.875],
                   help="prefix shares for time to first token, comma-separated in [0, 1) (default 0.5,0.875; "
                   "'' skips it)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=_run)


if __name__ == "__main__":
    from kvcache.bench.common import run_alone

    sys.exit(run_alone(add_parser, "engine"))

"""`kvcache bench engine`: decode throughput of the reference engine over kvcache's paged tables, on a GPU.

A Llama-1B-shaped model (seeded random weights, bfloat16) serves concurrent requests through the reference
engine (``examples/engine``) with a ``KVCacheManager``: prompts are prefilled, then every request decodes. The
same engine runs twice in the same process, in turns: its attention reading the paged cache through the tables
(flex attention with a block mask from the tables), and reading a contiguous region per request (the same kernel,
no table: the limit). Reports decode tokens/s of each and their ratio against the target.
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
from typing import Any, Sequence

import numpy as np

from kvcache.arguments import positive_int
from kvcache.bench.common import progress

BLOCK_SIZE = 16
PAGED_TARGET = 0.95  # paged decode tokens/s over contiguous
DAEMON_TARGET = 0.95  # through the daemon over in process


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

    options = dict(block_size=BLOCK_SIZE, chunk=chunk, max_num_seqs=requests)
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
    decode_s, tokens, seen = 0.0, 0, 0
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
    return {"tokens": tokens, "seconds": decode_s, "tokens_per_s": tokens / decode_s if decode_s else 0.0}


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
    if args.daemon:
        out.update(daemon_tokens_per_s=best["daemon"], daemon_over_library=best["daemon"] / best["paged"],
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
    print(f"  daemon (kvcache serve, tables from a subscriber) {r['daemon_tokens_per_s']:8,.0f} tokens/s")
    print(f"  daemon / library {r['daemon_over_library']:.3f}   target {r['daemon_target']}: "
          f"{'ok' if r['daemon_ok'] else 'MISS'}")


def _print(r: dict[str, Any]) -> None:
    print(f"decode throughput, {r['requests']} requests of {r['prompt_tokens']} tokens, {r['layers']} layers, "
          f"{r['device']} (best of {len(r['rounds']['paged'])} rounds each, in turns)")
    print(f"  paged (flex attention over kvcache's tables)   {r['paged_tokens_per_s']:10,.0f} tokens/s")
    print(f"  contiguous (a region per request, no table)   {r['contiguous_tokens_per_s']:10,.0f} tokens/s")
    print(f"  paged / contiguous {r['paged_over_contiguous']:.3f}   target {r['target']}: "
          f"{'ok' if r['ok'] else 'MISS'}")


def _run(args: argparse.Namespace) -> int:
    result = run(args)
    print(json.dumps(result, indent=2) if args.json else "", end="\n" if args.json else "")
    if not args.json:
        _print(result)
        if "daemon_tokens_per_s" in result:
            _print_daemon(result)
    return 0


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Register `kvcache bench engine`."""
    p = targets.add_parser("engine", help="the reference engine's decode tokens/s over paged tables vs a contiguous "
                           "cache (GPU)", description=__doc__.split("\n\n")[0])
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
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=_run)


def main(argv: Sequence[str] | None = None) -> int:
    """Run as `python -m kvcache.bench.engine` (same flags)."""
    parser = argparse.ArgumentParser(prog="kvcache bench")
    add_parser(parser.add_subparsers(dest="target", required=True))
    args = parser.parse_args(["engine", *(argv if argv is not None else sys.argv[1:])])
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

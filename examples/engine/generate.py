"""Greedy generation from a Hugging Face checkpoint folder with the reference engine, over kvcache's paged tables.

    python examples/engine/generate.py --model DIR --prompts FILE.json --max-new-tokens N [--json] [--daemon]
        [--device cpu|cuda] [--eos ID] [--block-size B] [--num-blocks N]

DIR holds ``config.json`` and ``model.safetensors`` (or the shards that
``model.safetensors.index.json`` names) of a Llama, Mistral, Qwen3 or Gemma 3
text model (``checkpoint.py``). FILE is a JSON list of prompts, each a list
of token ids. They are served in two waves, the first half of the list and
then the second, so prompts of the second wave that extend ones of the first
hit the prefix cache. Decoding is greedy and runs ``--max-new-tokens`` tokens
per prompt, stopping early at ``--eos`` only where it is given. The cache is
a ``KVCacheManager`` in this process, or with ``--daemon`` a real ``kvcache
serve`` started for the run. Each step prints a line; with ``--json`` the
last line is a JSON list of each prompt's new token ids, in order.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvcache.allocator import Chunked, Window  # noqa: E402
from kvcache.allocator.errors import KVCacheError  # noqa: E402

import checkpoint  # noqa: E402
from engine import Engine, daemon_engine, library_engine  # noqa: E402
from model import Model, ModelConfig  # noqa: E402
from scheduler import StepStats  # noqa: E402
from sequence import Sequence  # noqa: E402


def read_prompts(path: str | Path, vocab: int) -> list[list[int]]:
    """The prompts of a JSON file: a non-empty list of non-empty lists of token ids below ``vocab``."""
    try:
        prompts = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise KVCacheError(f"--prompts: cannot read {path} as JSON ({e})") from None
    if not isinstance(prompts, list) or not prompts:
        raise KVCacheError("--prompts: must hold a non-empty JSON list of prompts")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, list) or not prompt:
            raise KVCacheError(f"--prompts: prompt {i} must be a non-empty list of token ids")
        bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise KVCacheError(f"--prompts: prompt {i} holds {bad!r}, not a token id in [0, {vocab})")
    return prompts


def generate(folder: str | Path, prompts: list[list[int]], max_new_tokens: int, **options: Any) -> list[list[int]]:
    """Each prompt's new tokens, greedy, from the checkpoint in ``folder`` (``serve``'s options)."""
    return [s.generated for s in serve(folder, prompts, max_new_tokens, **options)]


def serve(folder: str | Path, prompts: list[list[int]], max_new_tokens: int, *, daemon: bool = False,
          device: str = "cpu", eos: int | None = None, block_size: int = 16, num_blocks: int = 256, chunk: int = 256,
          keep_logits: bool = False, on_step: Callable[[int, Engine, StepStats], None] | None = None) -> list[Sequence]:
    """Each prompt's request, run to the end, from the checkpoint in ``folder``: the first half of ``prompts`` as
    one wave, then the rest. ``keep_logits`` keeps what each token was sampled from (``Sequence.logits``);
    ``on_step(wave, engine, stats)`` sees every step."""
    config, weights = checkpoint.load(folder)
    return serve_model(config, weights, prompts, max_new_tokens, daemon=daemon, device=device, eos=eos,
                       block_size=block_size, num_blocks=num_blocks, chunk=chunk, keep_logits=keep_logits,
                       on_step=on_step)


def serve_model(config: ModelConfig, weights: dict[str, Any], prompts: list[list[int]], max_new_tokens: int, *,
                daemon: bool = False, device: str = "cpu", eos: int | None = None, block_size: int = 16,
                num_blocks: int = 256, chunk: int = 256, keep_logits: bool = False,
                on_step: Callable[[int, Engine, StepStats], None] | None = None) -> list[Sequence]:
    """``serve`` for a model given as its ``ModelConfig`` and weights (``Model``'s layout)."""
    backend = None
    if device != "cpu":
        from backend import TorchBackend

        backend = TorchBackend("cuda:0" if device == "cuda" else device)
    model = Model(config, backend, weights)
    half = len(prompts) // 2
    waves = [w for w in ({i: p for i, p in enumerate(prompts) if i < half},
                         {i: p for i, p in enumerate(prompts) if i >= half}) if w]
    options = dict(block_size=block_size, chunk=chunk, keep_logits=keep_logits)
    with contextlib.ExitStack() as stack:
        if daemon:
            from daemons import daemons

            served = daemons(config, block_size=block_size, flags=("--num-blocks", str(num_blocks)))
            engine = daemon_engine(model, stack.enter_context(served)["both"], **options)
        else:
            engine = library_engine(model, num_blocks=num_blocks, **options)
        stack.callback(engine.close)
        out: dict[int, Sequence] = {}
        for w, wave in enumerate(waves):
            for rid, prompt in wave.items():
                engine.add(rid, prompt, max_new_tokens, eos)
            while engine.waiting or engine.running:
                stats = engine.step()
                if on_step is not None:
                    on_step(w, engine, stats)
            out.update({rid: engine.finished.pop(rid) for rid in wave})
    return [out[i] for i in range(len(prompts))]


def step_line(wave: int, engine: Engine, stats: StepStats) -> str:
    """A step as ``make demo`` shows it: what ran, what it computed and found cached, each row's usage."""
    kinds = ["window" if isinstance(row.policy, Window) else "chunk" if isinstance(row.policy, Chunked) else "full"
             for row in engine.spec.row_layout]
    usage = engine.cache.usage.per_row
    return (f"wave {wave} step {len(engine.stats):3d}: {len(engine.running)} running, {len(engine.waiting)} waiting | "
            f"computed {stats.computed:3d} tokens, {stats.hit:3d} found cached | usage "
            + ", ".join(f"{kind} {u:4.0%}" for kind, u in zip(kinds, usage)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint folder (config.json, safetensors)")
    parser.add_argument("--prompts", required=True, help="a JSON file: a list of prompts, each a list of token ids")
    parser.add_argument("--max-new-tokens", type=int, required=True, help="tokens to generate per prompt")
    parser.add_argument("--json", action="store_true", help="print each prompt's new tokens as a JSON list, last")
    parser.add_argument("--daemon", action="store_true", help="serve the cache from a real `kvcache serve`")
    parser.add_argument("--device", default="cpu", help="cpu (Paddle) or cuda / cuda:N (PyTorch, flex attention)")
    parser.add_argument("--eos", type=int, help="stop a prompt when it generates this token (default: never)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per cache block (default 16)")
    parser.add_argument("--num-blocks", type=int, default=256, help="cache blocks per row (default 256)")
    args = parser.parse_args(argv)
    try:
        for flag in ("max_new_tokens", "block_size", "num_blocks"):
            if getattr(args, flag) < 1:
                raise KVCacheError(f"--{flag.replace('_', '-')}: must be at least 1, got {getattr(args, flag)}")
        if args.device != "cpu" and not args.device.startswith("cuda"):
            raise KVCacheError(f"--device: cpu or cuda[:N], got {args.device!r}")
        if args.device != "cpu" and (args.block_size < 16 or args.block_size & (args.block_size - 1)):
            raise KVCacheError(f"--block-size: flex attention on a GPU reads blocks of a power of two >= 16, "
                               f"got {args.block_size}")
        config = checkpoint.model_config(_read_config(args.model))
        if args.eos is not None and not 0 <= args.eos < config.vocab:
            raise KVCacheError(f"--eos: must be a token id in [0, {config.vocab}), got {args.eos}")
        prompts = read_prompts(args.prompts, config.vocab)
        print(checkpoint.describe(config), flush=True)

        def show(wave: int, engine: Engine, stats: StepStats) -> None:
            print(step_line(wave, engine, stats), flush=True)

        tokens = generate(args.model, prompts, args.max_new_tokens, daemon=args.daemon, device=args.device,
                          eos=args.eos, block_size=args.block_size, num_blocks=args.num_blocks, on_step=show)
    except KVCacheError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # e.g. a prompt longer than the cache's blocks can ever hold
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(tokens))
    else:
        for i, new in enumerate(tokens):
            print(f"prompt {i} ({len(prompts[i])} tokens): {new}")
    return 0


def _read_config(folder: str) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text())
    except OSError:
        raise KVCacheError(f"--model: {folder} has no config.json") from None
    except ValueError as e:
        raise KVCacheError(f"{path}: not a JSON config ({e})") from None


if __name__ == "__main__":
    sys.exit(main())

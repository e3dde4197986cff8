"""Compute the engine's expected tokens with transformers, from the exact checkpoint files the tests write.

    python tests/vectors/engine/make_expected.py            # rewrites expected.json next to this file

Run where torch and transformers are installed (not kvcache: it needs only
numpy, safetensors and ``examples/engine/checkpoints.py``). For each tiny
checkpoint it records the files' sha256 (the tests check they write the same
bytes), the prompts (two waves: the second grows the first's prompts, so it
hits the prefix cache), and transformers' greedy tokens: each step a forward
over the whole sequence in float32 with eager attention, no cache, the
argmax of the last logits (``logits``: the chosen token's logit, each
step). ``min_margin`` is the smallest gap between a chosen token's logit and
the runner-up's over every step: how far from a tie the comparison stands.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "examples" / "engine"))

import checkpoints  # noqa: E402

MAX_NEW_TOKENS = 8


def prompts(vocab: int, seed: int = 5) -> list[list[int]]:
    """Four prompts: two of 21 and 31 tokens sharing a 9-token head, then each grown by 6 (the second wave)."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, vocab, 9).tolist()
    first = [head + rng.integers(0, vocab, 12).tolist(), head + rng.integers(0, vocab, 22).tolist()]
    return first + [p + rng.integers(0, vocab, 6).tolist() for p in first]


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def transformers_tokens(folder: Path, prompt_list: list[list[int]],
                        max_new_tokens: int) -> tuple[list[list[int]], list[list[float]], float]:
    """Greedy tokens of each prompt by transformers, each one's logit, and the smallest margin of a choice over
    the runner-up."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    out, chosen, margin = [], [], float("inf")
    with torch.no_grad():
        for prompt in prompt_list:
            tokens, values = list(prompt), []
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([tokens]), use_cache=False).logits[0, -1].double()
                top = torch.topk(logits, 2).values
                margin = min(margin, float(top[0] - top[1]))
                tokens.append(int(logits.argmax()))
                values.append(round(float(top[0]), 5))
            out.append(tokens[len(prompt):])
            chosen.append(values)
    return out, chosen, margin


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--out", default=str(Path(__file__).with_name("expected.json")))
    args = parser.parse_args(argv)
    import torch
    import transformers

    models: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in checkpoints.CONFIGS.items():
            folder = checkpoints.write(name, Path(tmp) / name)
            prompt_list = prompts(cfg["vocab_size"])
            tokens, logits, margin = transformers_tokens(folder, prompt_list, MAX_NEW_TOKENS)
            models[name] = {"files": digests(folder), "prompts": prompt_list, "max_new_tokens": MAX_NEW_TOKENS,
                            "tokens": tokens, "logits": logits, "min_margin": round(margin, 4)}
            print(f"{name}: {tokens} (smallest margin {margin:.3f})")
    provenance = {"command": "python tests/vectors/engine/make_expected.py",
                  "transformers": transformers.__version__, "torch": torch.__version__, "numpy": np.__version__,
                  "python": platform.python_version(),
                  "method": "AutoModelForCausalLM.from_pretrained(dtype=float32, attn_implementation='eager'); "
                            "greedy, a full forward per step without cache"}
    Path(args.out).write_text(json.dumps({"provenance": provenance, "models": models}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A tiny Llama 4 text model with chunked local attention, and transformers' greedy tokens for it.

    python tests/vectors/engine/make_llama4.py      # rewrites llama4_chunked.json next to this file

``write`` (numpy and safetensors only) writes the checkpoint: a ``Llama4ForCausalLM`` config.json and its
model.safetensors, weights drawn from a seed. Its config sets ``attention_chunk_size`` 8 and leaves
``no_rope_layers`` and ``layer_types`` to transformers' defaults (every 4th layer NoPE and full, the others RoPE
and chunked), dense MLPs on every layer (``moe_layers`` empty) and no query/key L2 norm. Run ``main`` where torch
and transformers are installed: it records the files' sha256 (the tests check they write the same bytes), the
prompts (two waves; the second grows the first's, so it hits the prefix cache and crosses chunk boundaries) and
transformers' greedy tokens: each step a forward over the whole sequence in float32 with eager attention, no
cache. ``min_margin`` is the smallest gap between a chosen token's logit and the runner-up's over every step.
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
from safetensors.numpy import save_file

CONFIG: dict[str, Any] = {
    "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "torch_dtype": "float32",
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "intermediate_size_mlp": 128,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
    "attention_chunk_size": 8, "use_qk_norm": False, "moe_layers": [], "attention_bias": False,
    "tie_word_embeddings": False, "max_position_embeddings": 512, "attention_dropout": 0.0,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, "use_cache": True,
}
SEED = 15
MAX_NEW_TOKENS = 8
HERE = Path(__file__).resolve().parent


def tensors() -> dict[str, np.ndarray]:
    """The checkpoint's tensors (float32) by Hugging Face's names, drawn from ``SEED``."""
    cfg = CONFIG
    rng = np.random.default_rng(SEED)
    hidden, ffn, vocab, d = cfg["hidden_size"], cfg["intermediate_size_mlp"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def linear(out: int, inp: int) -> np.ndarray:
        return rng.standard_normal((out, inp), dtype=np.float32) * np.float32(inp ** -0.5)

    def norm(width: int = hidden) -> np.ndarray:
        return 0.1 * rng.standard_normal(width, dtype=np.float32) + np.float32(1.0)

    out = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden), dtype=np.float32)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
                    p + "self_attn.q_proj.weight": linear(q, hidden), p + "self_attn.k_proj.weight": linear(kv, hidden),
                    p + "self_attn.v_proj.weight": linear(kv, hidden), p + "self_attn.o_proj.weight": linear(hidden, q),
                    p + "feed_forward.gate_proj.weight": linear(ffn, hidden),
                    p + "feed_forward.up_proj.weight": linear(ffn, hidden),
                    p + "feed_forward.down_proj.weight": linear(hidden, ffn)})
    out["model.norm.weight"] = norm()
    out["lm_head.weight"] = linear(vocab, hidden) * np.float32(4.0)  # peaked logits: clear greedy choices
    return out


def write(folder: str | Path) -> Path:
    """Write the checkpoint into ``folder`` (created): config.json and model.safetensors."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=2, sort_keys=True) + "\n")
    save_file(tensors(), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def prompts(vocab: int, seed: int = 6) -> list[list[int]]:
    """Four prompts: two of 21 and 30 tokens sharing a 10-token head, then each grown by 7 (the second wave)."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, vocab, 10).tolist()
    first = [head + rng.integers(0, vocab, 11).tolist(), head + rng.integers(0, vocab, 20).tolist()]
    return first + [p + rng.integers(0, vocab, 7).tolist() for p in first]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--out", default=str(HERE / "llama4_chunked.json"))
    args = parser.parse_args(argv)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = write(Path(tmp) / "llama4")
        files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
        model.eval()
        layer_types = list(model.config.layer_types)
        prompt_list = prompts(CONFIG["vocab_size"])
        tokens, chosen, margin = [], [], float("inf")
        with torch.no_grad():
            for prompt in prompt_list:
                seq, values = list(prompt), []
                for _ in range(MAX_NEW_TOKENS):
                    logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1].double()
                    top = torch.topk(logits, 2).values
                    margin = min(margin, float(top[0] - top[1]))
                    seq.append(int(logits.argmax()))
                    values.append(round(float(top[0]), 5))
                tokens.append(seq[len(prompt):])
                chosen.append(values)
    provenance = {"command": "python tests/vectors/engine/make_llama4.py", "model": type(model).__name__,
                  "transformers": transformers.__version__, "torch": torch.__version__, "numpy": np.__version__,
                  "python": platform.python_version(),
                  "method": "AutoModelForCausalLM.from_pretrained(dtype=float32, attn_implementation='eager'); "
                            "greedy, a full forward per step without cache"}
    out = {"provenance": provenance, "files": files, "layer_types": layer_types, "prompts": prompt_list,
           "max_new_tokens": MAX_NEW_TOKENS, "tokens": tokens, "logits": chosen, "min_margin": round(margin, 4)}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{layer_types}: {tokens} (smallest margin {margin:.3f}); wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

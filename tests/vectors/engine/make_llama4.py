"""A tiny Llama 4 text model with chunked local attention, and transformers' greedy tokens for it.

    python tests/vectors/engine/make_llama4.py              # rewrites llama4_chunked.json next to this file
    python tests/vectors/engine/make_llama4.py --chunk 16   # llama4_chunk16.json: chunks of 16 (blocks of 16 on GPUs)

``write`` (numpy and safetensors only) writes the checkpoint: a ``Llama4ForCausalLM`` config.json and its
model.safetensors, weights drawn from a seed. Its config sets ``attention_chunk_size`` 8 and leaves
``no_rope_layers`` and ``layer_types`` to transformers' defaults (every 4th layer NoPE and full, the others RoPE
and chunked), dense MLPs on every layer (``moe_layers`` empty) and no query/key L2 norm. Run ``main`` where torch
and transformers are installed: it records the files' sha256 (the tests check they write the same bytes), the
prompts (two waves; the second grows the first's, so it hits the prefix cache and crosses chunk boundaries) and
transformers' greedy tokens: each step a forward over the whole sequence in float32 with eager attention, no
cache. ``min_margin`` is the smallest gap between a chosen token's logit and the runner-up's over every step.
``--chunk 16`` writes the same weights with ``attention_chunk_size`` 16 and longer prompts: what a GPU engine,
whose flex attention reads blocks of 16 tokens or more, serves (kvcache's chunk must be a multiple of the block).
``engine_model`` reads a written checkpoint as the reference engine's ``ModelConfig`` and weights.
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
# Per chunk size: the vectors file, and the prompts' lengths past their shared head (the second wave adds 7).
VARIANTS = {8: ("llama4_chunked.json", (11, 20)), 16: ("llama4_chunk16.json", (25, 40))}


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


def write(folder: str | Path, chunk: int = 8) -> Path:
    """Write the checkpoint, with ``attention_chunk_size`` ``chunk``, into ``folder`` (created): config.json and
    model.safetensors."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(CONFIG, attention_chunk_size=chunk)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors(), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def prompts(vocab: int, seed: int = 6, lengths: tuple[int, int] = (11, 20)) -> list[list[int]]:
    """Four prompts: two sharing a 10-token head (21 and 30 tokens by default), then each grown by 7 (the second
    wave)."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, vocab, 10).tolist()
    first = [head + rng.integers(0, vocab, lengths[0]).tolist(), head + rng.integers(0, vocab, lengths[1]).tolist()]
    return first + [p + rng.integers(0, vocab, 7).tolist() for p in first]


def engine_model(folder: str | Path) -> tuple[Any, dict[str, Any]]:
    """The checkpoint in ``folder`` as the reference engine's (``ModelConfig``, weights): interleaved RoPE pairs
    (Llama 4 rotates (2i, 2i + 1)) become halves by permuting each head's query and key rows, a permutation of
    both that leaves every score as it is; NoPE layers (``no_rope_layers`` 0) rotate nothing; layers [in, out].
    Its queries' temperature tuning on NoPE layers is 1 below ``floor_scale`` (8192) positions, as here."""
    from safetensors.numpy import load_file

    sys.path.insert(0, str(HERE.parents[2] / "examples" / "engine"))
    from model import ModelConfig, Rope

    from kvcache.allocator import Chunked
    from kvcache.allocator.rows import layer_policies

    folder = Path(folder)
    hf = json.loads((folder / "config.json").read_text())
    t = load_file(str(folder / "model.safetensors"))
    d, layers = hf["head_dim"], hf["num_hidden_layers"]
    order = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])

    def halves(w: np.ndarray) -> np.ndarray:  # rows of [heads * d, in]: each head's (0, 2, ..., 1, 3, ...)
        return w.reshape(-1, d, w.shape[1])[:, order].reshape(w.shape)

    weights: dict[str, Any] = {"embed": t["model.embed_tokens.weight"], "lm_head": t["lm_head.weight"].T,
                               "final_norm": t["model.norm.weight"], "layers": []}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights["layers"].append({
            "attn_norm": t[p + "input_layernorm.weight"], "mlp_norm": t[p + "post_attention_layernorm.weight"],
            "wq": halves(t[p + "self_attn.q_proj.weight"]).T, "wk": halves(t[p + "self_attn.k_proj.weight"]).T,
            "wv": t[p + "self_attn.v_proj.weight"].T, "wo": t[p + "self_attn.o_proj.weight"].T,
            "gate": t[p + "feed_forward.gate_proj.weight"].T, "up": t[p + "feed_forward.up_proj.weight"].T,
            "down": t[p + "feed_forward.down_proj.weight"].T})
    chunked = tuple(i for i, policy in enumerate(layer_policies(hf, layers)) if isinstance(policy, Chunked))
    config = ModelConfig(num_layers=layers, num_q_heads=hf["num_attention_heads"],
                         num_kv_heads=hf["num_key_value_heads"], head_dim=d, hidden=hf["hidden_size"],
                         ffn=hf["intermediate_size_mlp"], vocab=hf["vocab_size"], rope=Rope(theta=hf["rope_theta"]),
                         norm_eps=hf["rms_norm_eps"], chunk=hf["attention_chunk_size"], chunk_layers=chunked,
                         nope_layers=tuple(i for i in range(layers) if i not in chunked))
    return config, weights


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--chunk", type=int, choices=sorted(VARIANTS), default=8, help="attention_chunk_size")
    parser.add_argument("--out", help="default: the chunk size's file next to this one")
    args = parser.parse_args(argv)
    name, lengths = VARIANTS[args.chunk]
    out_path = Path(args.out) if args.out else HERE / name
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = write(Path(tmp) / "llama4", args.chunk)
        files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
        model.eval()
        layer_types = list(model.config.layer_types)
        prompt_list = prompts(CONFIG["vocab_size"], lengths=lengths)
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
    command = "python tests/vectors/engine/make_llama4.py" + (f" --chunk {args.chunk}" if args.chunk != 8 else "")
    provenance = {"command": command, "model": type(model).__name__,
                  "transformers": transformers.__version__, "torch": torch.__version__, "numpy": np.__version__,
                  "python": platform.python_version(),
                  "method": "AutoModelForCausalLM.from_pretrained(dtype=float32, attn_implementation='eager'); "
                            "greedy, a full forward per step without cache"}
    out = {"provenance": provenance, "files": files, "layer_types": layer_types, "prompts": prompt_list,
           "max_new_tokens": MAX_NEW_TOKENS, "tokens": tokens, "logits": chosen, "min_margin": round(margin, 4)}
    out_path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{layer_types}: {tokens} (smallest margin {margin:.3f}); wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tiny Hugging Face checkpoints with seeded weights, in each architecture's real tensor names and shapes.

    python examples/engine/checkpoints.py OUT        # OUT/llama3, OUT/qwen3, OUT/mistral, OUT/gemma3

Written from numpy alone (no torch), byte for byte the same on every run:
what the engine's tests load and what transformers computed the stored
tokens from (``tests/vectors/engine/make_expected.py``). Each exercises what
its architecture adds: Llama 3's ``llama3`` RoPE scaling and ``rms_norm_eps``;
Qwen3's q/k norms, a ``head_dim`` apart from ``hidden / heads``, tied
embeddings and two shards with an index; Mistral's window on every layer;
Gemma 3's sliding and full layers, local and global RoPE bases (linear
scaling on the global one), its four ``1 + w`` norms, GeLU-tanh,
``query_pre_attn_scalar``, the logits' soft-cap, in bfloat16. Windows are smaller
than the test prompts. Each has an RMSNorm input as small as its ``rms_norm_eps``
(layer 0's keys, or the embeddings), so the epsilon read from the config shows
in the cache and the tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

COMMON = {"torch_dtype": "float32", "max_position_embeddings": 512, "initializer_range": 0.02, "use_cache": True,
          "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama3": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "vocab_size": 256, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64},
               "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
              "intermediate_size": 160, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "vocab_size": 320, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": True,
              "use_sliding_window": False, "sliding_window": None, "max_window_layers": 3},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1,
                "head_dim": 16, "vocab_size": 288, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                "rope_theta": 1000000.0, "sliding_window": 8, "tie_word_embeddings": False},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 32, "vocab_size": 384, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
               "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
               "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 24,
               "sliding_window": 12, "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                                      "sliding_attention"],
               "attn_logit_softcapping": None, "final_logit_softcapping": 30.0, "attention_bias": False,
               "tie_word_embeddings": True, "torch_dtype": "bfloat16"},
}
GAIN = 4.0
SEEDS = {"llama3": 11, "qwen3": 12, "mistral": 13, "gemma3": 14}


def tensors(name: str) -> dict[str, np.ndarray]:
    """The checkpoint's tensors (float32), by Hugging Face's names, drawn from the architecture's seed."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(SEEDS[name])
    hidden, ffn, vocab, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    gemma = cfg["model_type"] == "gemma3_text"

    def linear(out: int, inp: int) -> np.ndarray:
        return rng.standard_normal((out, inp), dtype=np.float32) * np.float32(inp ** -0.5)

    def norm(width: int = hidden, mean: float = 1.0) -> np.ndarray:  # Gemma's norms multiply by 1 + w, others by w
        w = 0.1 * rng.standard_normal(width, dtype=np.float32) + np.float32(mean)
        return w - np.float32(1.0) if gemma else w

    # With tied embeddings a token's own embedding dominates the residual and the model repeats its last token;
    # stronger layer outputs make the tokens depend on attention and the MLP.
    gain = np.float32(GAIN if cfg["tie_word_embeddings"] else 1.0)

    # Gemma scales its embeddings up by sqrt(hidden): smaller ones keep its residual from being the token's own.
    embed = rng.standard_normal((vocab, hidden), dtype=np.float32) * np.float32(0.25 if gemma else 1.0)
    qk_norm = cfg["model_type"] in ("qwen3", "gemma3_text")
    # Where an RMSNorm's input has a mean square near rms_norm_eps, the epsilon moves its output by tens of percent
    # (1e-5 against 1e-6: a factor up to 2.3), so a model that misreads it writes other keys and says other tokens.
    # Architectures with q/k norms get layer 0's keys that small, the others their embeddings (untied).
    small = np.float32(np.sqrt(cfg["rms_norm_eps"]))
    if not qk_norm:
        embed = embed * small
    out = {"model.embed_tokens.weight": embed}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": norm(),
                    p + "post_attention_layernorm.weight": norm(mean=GAIN if gemma else 1.0),
                    p + "self_attn.q_proj.weight": linear(q, hidden),
                    p + "self_attn.k_proj.weight": linear(kv, hidden) * (small if qk_norm and not i else np.float32(1)),
                    p + "self_attn.v_proj.weight": linear(kv, hidden),
                    p + "self_attn.o_proj.weight": linear(hidden, q) * gain,
                    p + "mlp.gate_proj.weight": linear(ffn, hidden), p + "mlp.up_proj.weight": linear(ffn, hidden),
                    p + "mlp.down_proj.weight": linear(hidden, ffn) * gain})
        if qk_norm:
            out.update({p + "self_attn.q_norm.weight": norm(d), p + "self_attn.k_norm.weight": norm(d)})
        if gemma:
            out.update({p + "pre_feedforward_layernorm.weight": norm(),
                        p + "post_feedforward_layernorm.weight": norm(mean=GAIN)})
    out["model.norm.weight"] = norm()
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = linear(vocab, hidden) * np.float32(4.0)  # peaked logits: clear greedy choices
    return out


def write(name: str, folder: str | Path) -> Path:
    """Write checkpoint ``name`` into ``folder`` (created): config.json and its safetensors file(s)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {**COMMON, **CONFIGS[name]}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    weights = tensors(name)
    if cfg["torch_dtype"] == "bfloat16":
        save_bfloat16(weights, folder / "model.safetensors")
    elif name == "qwen3":  # two shards and the index that names each tensor's
        names = sorted(weights)
        shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
                  "model-00002-of-00002.safetensors": names[len(names) // 2:]}
        for shard, keys in shards.items():
            save_file({k: weights[k] for k in keys}, str(folder / shard), metadata={"format": "pt"})
        index = {"metadata": {"total_size": sum(w.nbytes for w in weights.values())},
                 "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    else:
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def save_bfloat16(weights: dict[str, np.ndarray], path: Path) -> None:
    """A safetensors file of bfloat16 tensors (rounded to nearest even from float32), written by hand: numpy has
    no bfloat16 for safetensors' numpy API to write."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for key in sorted(weights):
        bits = np.ascontiguousarray(weights[key], dtype=np.float32).view(np.uint32).astype(np.uint64)
        data = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()
        header[key] = {"dtype": "BF16", "shape": list(weights[key].shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for data in blobs:
            f.write(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("out", help="folder to write one checkpoint folder per architecture into")
    parser.add_argument("--only", choices=sorted(CONFIGS), help="write this one only")
    args = parser.parse_args(argv)
    for name in [args.only] if args.only else CONFIGS:
        print(write(name, Path(args.out) / name))
    return 0


if __name__ == "__main__":
    sys.exit(main())

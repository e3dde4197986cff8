"""A Hugging Face checkpoint folder as the engine's model: ``config.json`` and safetensors weights, read with numpy.

    config, weights = load("path/to/Llama-3.2-1B")
    model = Model(config, weights=weights)

Llama (Llama 3's ``rope_scaling`` type ``llama3`` included), Mistral (a window
on every layer), Qwen3 (q/k norms) and Gemma 3 text (sliding and full layers
from ``layer_types``, a local RoPE base, four norms with ``1 + w``, embedding
scale, ``query_pre_attn_scalar``, the logits' soft-capping; like transformers' Gemma 3, it leaves
``attn_logit_softcapping`` unused: QK norms took its place). The weights come from
``model.safetensors`` or the shards ``model.safetensors.index.json`` names,
through safetensors' numpy API; bfloat16 tensors, which numpy lacks, are read
as their bits and widened to float32. The model's windows are the ones
kvcache reads from the same config (``layer_policies``), so the cache's rows
and the model's masks cannot disagree. Anything else in a config that changes
the math is refused in one line naming it.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.rows import layer_policies
from kvcache.allocator.swa import Window

from model import ModelConfig, Rope

ARCHITECTURES = ("llama", "mistral", "qwen3", "gemma3_text")
# Keys kvcache's rows understand that these architectures' Hugging Face models do not: a checkpoint setting them
# would run one way here and another in transformers.
FOREIGN_KEYS = ("sink_size", "head_wise_swa_ratio", "window_attn_skip_freq", "attention_chunk_size", "kv_lora_rank")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def load(folder: str | Path, dtype: str = "float32") -> tuple[ModelConfig, dict[str, Any]]:
    """The checkpoint in ``folder`` as (``ModelConfig``, weights for ``Model``); ``dtype``: what the model
    computes in."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise KVCacheError(f"--model: {folder} has no config.json")
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise KVCacheError(f"{path}: not a JSON config ({e})") from None
    config = model_config(hf, dtype)
    return config, weights_of(config, read_tensors(folder))


def model_config(hf: Mapping[str, Any], dtype: str = "float32") -> ModelConfig:
    """The engine's ``ModelConfig`` of a Hugging Face ``config.json`` (a dict), or one line naming what is not
    supported."""
    kind = hf.get("model_type")
    if kind not in ARCHITECTURES:
        hint = "; give the text model's config (gemma3_text)" if kind == "gemma3" else ""
        raise KVCacheError(f"config.model_type: {kind!r} is not supported ({', '.join(ARCHITECTURES)}){hint}")
    gemma = kind == "gemma3_text"
    for key in FOREIGN_KEYS:
        if hf.get(key):
            raise KVCacheError(f"config.{key}: not part of a {kind} model")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise KVCacheError(f"config.{key}: biases are not supported")
    if kind == "llama" and hf.get("sliding_window"):
        raise KVCacheError("config.sliding_window: a llama model attends in full; use model_type mistral")
    act_key = "hidden_activation" if gemma and hf.get("hidden_activation") else "hidden_act"
    act = hf.get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
    if act not in ACTIVATIONS:
        raise KVCacheError(f"config.{act_key}: {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    if gemma and hf.get("layer_types") is None and hf.get("sliding_window_pattern") is None:
        raise KVCacheError("config.layer_types: a gemma3_text config needs layer_types or sliding_window_pattern")

    num_layers = _int(hf, "num_hidden_layers")
    heads = _int(hf, "num_attention_heads")
    hidden = _int(hf, "hidden_size")
    head_dim = hf.get("head_dim") or hidden // heads
    policies = layer_policies(hf, num_layers)
    windowed = tuple(i for i, p in enumerate(policies) if isinstance(p, Window))
    window = max((p.window_tokens for p in policies if isinstance(p, Window)), default=0)  # one sliding_window
    rope, local_rope = _ropes(hf, gemma)
    scalar = hf.get("query_pre_attn_scalar", 256) if gemma else None
    return ModelConfig(
        num_layers=num_layers, num_q_heads=heads, num_kv_heads=_int(hf, "num_key_value_heads", heads),
        head_dim=_int({"head_dim": head_dim}, "head_dim"), hidden=hidden, ffn=_int(hf, "intermediate_size"),
        vocab=_int(hf, "vocab_size"), window=window, window_layers=windowed,
        dtype=dtype, rope=rope, local_rope=local_rope, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qk_norm=kind in ("qwen3", "gemma3_text"), sandwich_norm=gemma, act=ACTIVATIONS[act],
        embed_scale=float(hidden ** 0.5) if gemma else 1.0,
        attn_scale=float(scalar) ** -0.5 if scalar else 0.0,
        final_softcap=float(hf.get("final_logit_softcapping") or 0.0) if gemma else 0.0,
        hf=dict(hf, tie_word_embeddings=_tied(hf, gemma)))


def _int(hf: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise KVCacheError(f"config.{key}: must be a positive integer, got {value!r}")
    return value


def _tied(hf: Mapping[str, Any], gemma: bool) -> bool:
    return bool(hf.get("tie_word_embeddings", gemma))


def _ropes(hf: Mapping[str, Any], gemma: bool) -> tuple[Rope, Rope | None]:
    """The global RoPE and (Gemma 3) the local one of the sliding layers, from ``rope_theta``, ``rope_scaling``
    and ``rope_local_base_freq``, or from transformers 5's ``rope_parameters`` (flat, or per layer type)."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:
        local = params.get("sliding_attention")
        return _rope(params["full_attention"], "rope_parameters.full_attention", 1e6 if gemma else 10000.0), (
            _rope(local, "rope_parameters.sliding_attention", 10000.0) if gemma and local else None)
    if isinstance(params, Mapping):
        scaling, theta = params, params.get("rope_theta", hf.get("rope_theta"))
        key = "rope_parameters"
    else:
        scaling, theta, key = hf.get("rope_scaling") or {}, hf.get("rope_theta"), "rope_scaling"
    default = 1e6 if gemma else 10000.0
    rope = _rope(dict(scaling, rope_theta=theta if theta is not None else default), key, default)
    local = Rope(theta=float(hf.get("rope_local_base_freq", 10000.0))) if gemma else None
    return rope, local


def _rope(params: Mapping[str, Any], key: str, default_theta: float) -> Rope:
    if not isinstance(params, Mapping):
        raise KVCacheError(f"config.{key}: must be an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta") or default_theta)
    if kind == "default":
        return Rope(theta=theta)
    if kind == "linear":
        return Rope(theta=theta, kind=kind, factor=float(params["factor"]))
    if kind == "llama3":
        try:
            return Rope(theta=theta, kind=kind, factor=float(params["factor"]),
                        low_freq_factor=float(params["low_freq_factor"]),
                        high_freq_factor=float(params["high_freq_factor"]),
                        original_max_position=int(params["original_max_position_embeddings"]))
        except KeyError as e:
            raise KVCacheError(f"config.{key}: llama3 needs {e.args[0]}") from None
    raise KVCacheError(f"config.{key}: rope_type {kind!r} is not supported (default, linear, llama3)")


def read_tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of ``model.safetensors`` or of the shards its index names, as float32 numpy arrays."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, Mapping) or not weight_map:
            raise KVCacheError(f"{index}: has no weight_map")
        files = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        weight_map, files = None, ["model.safetensors"]
    else:
        raise KVCacheError(f"--model: {folder} has neither model.safetensors nor model.safetensors.index.json")
    out: dict[str, np.ndarray] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise KVCacheError(f"{index}: names {name}, which {folder} lacks")
        with safe_open(str(path), framework="np") as f:
            for key in f.keys():
                dtype = f.get_slice(key).get_dtype()
                out[key] = _bfloat16(path, key) if dtype == "BF16" else f.get_tensor(key).astype(np.float32)
    if weight_map is not None and set(weight_map) != set(out):
        missing = sorted(set(weight_map) - set(out))
        raise KVCacheError(f"{index}: {missing[0] if missing else sorted(set(out) - set(weight_map))[0]} is not where "
                           "the weight_map says")
    return out


def _bfloat16(path: Path, key: str) -> np.ndarray:
    """A bfloat16 tensor widened to float32: its 16 bits are the top half of the float32's (numpy has no bfloat16,
    so safetensors' numpy API cannot give it; its place comes from the file's header)."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(size))[key]
    start, end = entry["data_offsets"]
    bits = np.fromfile(path, dtype="<u2", count=(end - start) // 2, offset=8 + size + start)
    return (bits.astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])


def weights_of(config: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """Hugging Face's tensors by name as the model reads them: projections transposed to [in, out], Gemma's norms
    as ``1 + w``, the LM head the embedding's where tied. A tensor missing, of another shape, or left unused
    is one line naming it."""
    c, hf = config, config.hf or {}
    gemma = c.sandwich_norm
    left = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}

    def take(name: str, *shape: int) -> np.ndarray:
        if name not in left:
            raise KVCacheError(f"weights: {name} is missing")
        x = left.pop(name)
        if x.shape != shape:
            raise KVCacheError(f"weights: {name} has shape {list(x.shape)}, the config says {list(shape)}")
        return x

    def linear(name: str, out: int, inp: int) -> np.ndarray:
        return np.ascontiguousarray(take(name, out, inp).T)

    def norm(name: str, width: int = c.hidden) -> np.ndarray:
        w = take(name, width)
        return w + np.float32(1.0) if gemma else w

    q_width, kv_width = c.num_q_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w = dict(attn_norm=norm(p + "input_layernorm.weight"),
                 wq=linear(p + "self_attn.q_proj.weight", q_width, c.hidden),
                 wk=linear(p + "self_attn.k_proj.weight", kv_width, c.hidden),
                 wv=linear(p + "self_attn.v_proj.weight", kv_width, c.hidden),
                 wo=linear(p + "self_attn.o_proj.weight", c.hidden, q_width),
                 gate=linear(p + "mlp.gate_proj.weight", c.ffn, c.hidden),
                 up=linear(p + "mlp.up_proj.weight", c.ffn, c.hidden),
                 down=linear(p + "mlp.down_proj.weight", c.hidden, c.ffn))
        if gemma:  # Gemma names its norm after attention post_attention_layernorm; Llama its norm before the MLP
            w.update(attn_out_norm=norm(p + "post_attention_layernorm.weight"),
                     mlp_norm=norm(p + "pre_feedforward_layernorm.weight"),
                     mlp_out_norm=norm(p + "post_feedforward_layernorm.weight"))
        else:
            w.update(mlp_norm=norm(p + "post_attention_layernorm.weight"))
        if c.qk_norm:
            w.update(q_norm=norm(p + "self_attn.q_norm.weight", c.head_dim),
                     k_norm=norm(p + "self_attn.k_norm.weight", c.head_dim))
        layers.append(w)
    embed = take("model.embed_tokens.weight", c.vocab, c.hidden)
    if hf.get("tie_word_embeddings"):
        left.pop("lm_head.weight", None)
        lm_head = np.ascontiguousarray(embed.T)
    else:
        lm_head = linear("lm_head.weight", c.vocab, c.hidden)
    out = dict(embed=embed, layers=layers, final_norm=norm("model.norm.weight"), lm_head=lm_head)
    if left:
        raise KVCacheError(f"weights: {sorted(left)[0]} is not a tensor of a {hf.get('model_type')} model "
                           f"({len(left)} such)")
    return out


def describe(config: ModelConfig) -> str:
    """One line: the architecture and what of it the engine runs."""
    c, hf = config, config.hf or {}
    window = f"window {c.window} on layers {list(c.window_layers or ())}" if c.window else "no window"
    rope = f"rope {c.rope.kind} base {c.rope.theta:g}" + (f", local {c.local_rope.theta:g}" if c.local_rope else "")
    return (f"{hf.get('model_type')}: {c.num_layers} layers, {c.num_q_heads} query / {c.num_kv_heads} kv heads of "
            f"{c.head_dim}, hidden {c.hidden}, vocab {c.vocab}; {window}; {rope}")

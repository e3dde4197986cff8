"""The oracle: the decoder in plain numpy, written from the architecture, sharing no code with the paged path.

``check.py`` proves the engine against this module. It imports nothing of
``model.py``, ``engine.py`` or ``backend.py``: its causal and sliding-window
mask, the query-head to kv-head mapping, RoPE and the block_wise_fp8
quantizer are its own, and the architecture comes from the model's
``config.json`` fields (Hugging Face's defaults where a key is absent), so a
bug in the engine's helpers cannot cancel out against the same bug here.
Only the weights come from the model under test (``weights_of``).

``Reference.run(tokens)`` recomputes every position with no cache and returns
what a cache must hold for each layer (K and V per kv head, MLA's latent, or
block_wise_fp8's float8 values and scales) and the last position's logits.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn: 1.75 * 2**8


def e4m3_round(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest float8_e4m3fn (ties to even): 3 mantissa bits, exponents -6..8, subnormals
    down to 2**-9; |x| must not exceed 448."""
    mag = np.abs(x)
    exponent = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    step = np.exp2(np.maximum(exponent, -6) - 3)
    return np.round(x / step) * step


def e4m3_decode(raw: np.ndarray) -> np.ndarray:
    """float64 values of float8_e4m3fn bytes (uint8): sign, 4 exponent bits (bias 7), 3 mantissa bits; 0x7f and
    0xff are NaN."""
    raw = raw.astype(np.int64)
    sign = np.where(raw & 0x80, -1.0, 1.0)
    exponent, mantissa = (raw >> 3) & 0xF, raw & 0x7
    value = np.where(exponent == 0, mantissa * 2.0 ** -9, (1 + mantissa / 8.0) * np.exp2(exponent - 7.0))
    return np.where((raw & 0x7F) == 0x7F, np.nan, sign * value)


def quantize_fp8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """block_wise_fp8 as FastDeploy's per-token scales define it: each vector's scale is its largest magnitude
    over 448 (float32; 1 for a zero vector), its values x / scale rounded to float8. Returns (values as float64,
    scales [..., 1] float32)."""
    scale = (np.abs(x).max(axis=-1, keepdims=True) / E4M3_MAX).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0))
    return e4m3_round(x / scale.astype(x.dtype)), scale


class Layout(NamedTuple):
    """The architecture as the reference reads it from ``config.json``."""

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    eps: float
    theta: float
    window: int  # 0: none
    sink: int
    window_layers: frozenset[int]
    window_heads: frozenset[int]  # the kv heads of a windowed layer that keep the window
    rank: int  # MLA's kv_lora_rank (0: grouped-query attention)
    rope_dim: int  # MLA's rotary part
    qk_norm: bool


def fastdeploy_window_heads(ratio: float | None, q_heads: int, kv_heads: int, head_dim: int, tp: int) -> frozenset[int]:
    """The kv heads FastDeploy's attention windows under ``head_wise_swa_ratio``, read from its code (develop
    c1b7c083): each of ``tp`` ranks runs ``q_heads // tp`` query heads over its kv heads; append_attn_backend.py
    takes ``int((1 - ratio) * heads * head_dim)`` output columns from full attention, ops/append_attention.py copies
    them over the window's output (none for ratio 0 or 1: every head windowed). A kv head is windowed when none of
    its query heads has a full column."""
    if ratio is None or ratio in (0, 1):
        return frozenset(range(kv_heads))
    heads, local_kv = q_heads // tp, max(1, kv_heads // tp)
    group, full = heads // local_kv, int((1 - ratio) * heads * head_dim)
    out = set()
    for rank in range(tp):
        first = rank * local_kv if kv_heads >= tp else rank * kv_heads // tp  # the rank's first (global) kv head
        out |= {first + k for k in range(local_kv) if k * group * head_dim >= full}
    return frozenset(out)


def layout_of(hf: Mapping[str, Any], tp: int = 1) -> Layout:
    """Read the fields the reference computes from (``tp``: the TP ranks FastDeploy's head-wise window is split
    over); a model type or RoPE scaling it does not compute is refused."""
    kind = hf.get("model_type", "llama")
    if kind not in ("llama", "mistral", "qwen3", "deepseek_v3"):
        raise ValueError(f"model_type: the numpy reference computes llama, mistral, qwen3 and the engine's "
                         f"deepseek_v3 (MLA), not {kind!r}")
    if (hf.get("rope_scaling") or {}).get("rope_type", "default") not in ("default",) or "rope_parameters" in hf:
        raise ValueError("rope_scaling: the numpy reference computes plain RoPE only")
    layers, kv = int(hf["num_hidden_layers"]), int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
    window = int(hf.get("sliding_window") or 0)
    types = hf.get("layer_types")
    windowed = {i for i in range(layers) if window and (types is None or types[i] == "sliding_attention")}
    rank = int(hf.get("kv_lora_rank") or 0)
    q_heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // q_heads)
    window_heads = fastdeploy_window_heads(hf.get("head_wise_swa_ratio"), q_heads, 1 if rank else kv, head_dim, tp)
    return Layout(layers=layers, q_heads=q_heads, kv_heads=1 if rank else kv, head_dim=head_dim,
                  eps=float(hf.get("rms_norm_eps", 1e-6)), theta=float(hf.get("rope_theta", 10000.0)),
                  window=window, sink=int(hf.get("sink_size") or 0), window_layers=frozenset(windowed),
                  window_heads=window_heads, rank=rank,
                  rope_dim=int(hf.get("qk_rope_head_dim") or 0), qk_norm=kind == "qwen3")


def weights_of(model: Any) -> dict[str, Any]:
    """The weights of a ``model.Model`` as numpy arrays (what it computes with, read back from its tensors)."""
    read = model.ops.numpy
    return dict(embed=read(model.embed), lm_head=read(model.lm_head), final_norm=read(model.final_norm),
                layers=[{k: read(v) for k, v in layer.items()} for layer in model.layers])


class Step(NamedTuple):
    """What a cache must hold for each layer of a sequence, and its last position's logits. ``cache[layer]``
    maps the cache's tensor names to arrays [positions, cache heads, dim] (scales [positions, heads, 1])."""

    cache: list[dict[str, np.ndarray]]
    logits: np.ndarray


class Reference:
    """The dense decoder with no cache, in numpy: RMSNorm, attention with half-split RoPE and grouped kv heads
    (or MLA's latent), a SwiGLU MLP. ``fp8`` rounds K and V as a block_wise_fp8 cache stores them."""

    def __init__(self, hf: Mapping[str, Any], weights: Mapping[str, Any], dtype: str = "float32",
                 fp8: bool = False, tp: int = 1) -> None:
        self.at = layout_of(hf, tp)
        self.dtype, self.fp8 = np.dtype(dtype), fp8
        self.w = {k: np.asarray(v, self.dtype) for k, v in weights.items() if k != "layers"}
        self.layers = [{k: np.asarray(v, self.dtype) for k, v in layer.items()} for layer in weights["layers"]]
        self._memo: dict[tuple[int, ...], Step] = {}

    def _rms(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + self.at.eps) * weight

    def _rotate(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """RoPE on x [n, heads, d]: dimension i pairs with i + d/2 and turns by position / theta ** (2i / d); the
        frequencies and angles in float32, as Hugging Face computes them."""
        d = x.shape[-1]
        freq = np.float32(1.0) / np.float32(self.at.theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
        angle = (positions.astype(np.float32)[:, None] * freq[None, :]).astype(np.float64)[:, None, :]
        cos, sin = np.cos(angle).astype(self.dtype), np.sin(angle).astype(self.dtype)
        a, b = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def mask(self, layer: int, n: int) -> np.ndarray:
        """bool [kv heads, n, n]: query i sees key j when j <= i, and on a windowed head also when i - j is under
        the window or j is one of the first ``sink`` tokens."""
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        causal = j <= i
        out = np.repeat(causal[None], self.at.kv_heads, axis=0)
        if layer in self.at.window_layers:
            out[sorted(self.at.window_heads)] &= (i - j < self.at.window) | (j < self.at.sink)
        return out

    def _stored(self, x: np.ndarray, name: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """What the cache holds of x (by tensor name) and what attention then reads back."""
        if not self.fp8:
            return {name: x}, x
        values, scale = quantize_fp8(x)
        return {name: values, f"{name}_scale": scale}, (values * scale).astype(self.dtype)

    def run(self, tokens: list[int]) -> Step:
        """Every layer's cache contents for ``tokens`` at positions 0..n-1, and the logits after the last."""
        key = tuple(int(t) for t in tokens)
        if key not in self._memo:
            self._memo[key] = self._forward(np.asarray(key))
        return self._memo[key]

    def _forward(self, tokens: np.ndarray) -> Step:
        at, n = self.at, len(tokens)
        positions = np.arange(n)
        x = self.w["embed"][tokens]
        cache = []
        for layer, w in enumerate(self.layers):
            h = self._rms(x, w["attn_norm"])
            if at.rank:
                q = (h @ w["wq"]).reshape(n, at.q_heads, at.head_dim + at.rope_dim)
                q = np.concatenate([q[..., : at.head_dim], self._rotate(q[..., at.head_dim:], positions)], axis=-1)
                latent = np.concatenate([self._rms(h @ w["w_dkv"], w["kv_norm"]),
                                         self._rotate((h @ w["w_kr"])[:, None, :], positions)[:, 0]], axis=-1)
                stored, latent = self._stored(latent[:, None, :], "latent")
                c = latent[:, 0, : at.rank]
                k = np.concatenate([(c @ w["w_uk"]).reshape(n, at.q_heads, at.head_dim),
                                    np.repeat(latent[:, :, at.rank:], at.q_heads, axis=1)], axis=-1)
                v = (c @ w["w_uv"]).reshape(n, at.q_heads, at.head_dim)
                group, mask = 1, np.repeat(self.mask(layer, n), at.q_heads, axis=0)
            else:
                q = (h @ w["wq"]).reshape(n, at.q_heads, at.head_dim)
                k = (h @ w["wk"]).reshape(n, at.kv_heads, at.head_dim)
                if at.qk_norm:
                    q, k = self._rms(q, w["q_norm"]), self._rms(k, w["k_norm"])
                q, k = self._rotate(q, positions), self._rotate(k, positions)
                v = (h @ w["wv"]).reshape(n, at.kv_heads, at.head_dim)
                stored_k, k = self._stored(k, "key")
                stored_v, v = self._stored(v, "value")
                stored = {**stored_k, **stored_v}
                group, mask = at.q_heads // at.kv_heads, self.mask(layer, n)
            cache.append(stored)
            out = np.empty((n, at.q_heads, v.shape[-1]), self.dtype)
            for head in range(at.q_heads):  # query head h reads kv head h // group
                kv = head // group
                scores = (q[:, head] @ k[:, kv].T) / np.sqrt(np.float64(q.shape[-1])).astype(self.dtype)
                scores = np.where(mask[kv], scores, -np.inf)
                weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
                out[:, head] = (weights / weights.sum(axis=-1, keepdims=True)) @ v[:, kv]
            x = x + out.reshape(n, -1) @ w["wo"]
            g = self._rms(x, w["mlp_norm"])
            gate = g @ w["gate"]
            x = x + (gate / (1 + np.exp(-gate)) * (g @ w["up"])) @ w["down"]
        logits = self._rms(x[-1:], self.w["final_norm"]) @ self.w["lm_head"]
        return Step(cache, logits[0])

    def generate(self, prompt: list[int], max_new_tokens: int,
                 forced: list[int] | None = None) -> tuple[list[int], np.ndarray]:
        """Greedy tokens and the logits each came from ([tokens, vocab]); with ``forced`` each step continues from
        those tokens instead (the tokens returned are still this model's choices)."""
        tokens, rows = list(prompt), []
        for step in range(max_new_tokens):
            rows.append(self.run(tokens).logits)
            tokens.append(int(np.argmax(rows[-1])) if forced is None else forced[step])
        rows_array = np.array(rows)
        return [int(t) for t in rows_array.argmax(axis=-1)], rows_array

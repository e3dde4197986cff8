"""The decoder the engine runs: seeded weights (no download), or a Hugging Face checkpoint's (``checkpoint.py``).

Llama, Mistral, Qwen3 and Gemma 3 text are one decoder whose ``ModelConfig``
says what differs: RoPE's base and scaling (Llama 3's ``llama3``, Gemma 3's
local base on its sliding layers), q/k norms, Gemma's norms around attention
and MLP, its GeLU-tanh MLP, embedding scale, query scale and final soft-capping.
RoPE rotates the halves of each head, as Hugging Face does. It computes in
Paddle (CPU) or PyTorch (``backend.py``).

The model knows nothing of caches: ``Model.forward`` runs a batch of token
segments and asks an ``attend(layer, q, kv)`` callback for each layer's
attention, where ``kv`` is what a cache stores per token (K and V per kv head,
or one MLA latent), so the paged engine and the dense reference share every
other computation (``Model.attention`` included). ``ModelConfig`` declares the
sliding windows the way configs do (per layer, Gemma style, or on each TP
rank's last kv heads of a layer, FastDeploy style) and writes them as ``config.json`` fields
for kvcache to read. With ``kv_lora_rank`` the attention is DeepSeek's MLA:
the cache holds one latent per token (``kv_lora_rank + rope_dim`` values)
from which every head's keys and values are projected.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np

from backend import paddle_backend
from kvcache.allocator.rows import window_kv_heads


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary frequencies as Hugging Face computes them (float32): a base and a ``rope_scaling`` type, none
    (``default``), ``linear`` (every frequency over ``factor``) or ``llama3`` (low frequencies over ``factor``,
    high ones kept, smoothed between)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def inv_freq(self, dim: int) -> np.ndarray:
        """float32 [dim / 2]: the angle per position of each rotated pair (i, i + dim / 2)."""
        inv = np.float32(1.0) / np.float32(self.theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
        if self.kind == "linear":
            return (inv / np.float32(self.factor)).astype(np.float32)
        if self.kind != "llama3":
            return inv
        low_wavelen = self.original_max_position / self.low_freq_factor
        high_wavelen = self.original_max_position / self.high_freq_factor
        wavelen = 2 * np.float32(np.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / np.float32(self.factor), inv)
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / np.float32(self.factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Geometry, seed, sliding windows and architecture of the model (the defaults: a Llama with seeded weights)."""

    num_layers: int = 4
    num_q_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 16
    hidden: int = 64
    ffn: int = 128
    vocab: int = 512
    seed: int = 0
    window: int = 0  # sliding window in tokens, the query's own included; 0: every layer attends in full
    sink: int = 0  # first tokens a windowed query also sees
    window_layers: tuple[int, ...] | None = None  # layers with the window (None: all of them)
    # FastDeploy's head-wise window: on each of ``tp`` ranks the last this share of a windowed layer's query heads
    # keep the window, and the kv heads whose query heads all do (``window_kv_heads``); None: every head keeps it.
    # FastDeploy splits per rank, so the same config windows other heads at another TP.
    head_wise_swa_ratio: float | None = None
    tp: int = 1
    chunk: int = 0  # chunked local attention (Llama 4's attention_chunk_size): a query sees only its chunk's keys
    chunk_layers: tuple[int, ...] | None = None  # layers with chunked attention (None: all of them)
    nope_layers: tuple[int, ...] = ()  # layers without RoPE (Llama 4's NoPE layers: no_rope_layers 0)
    kv_lora_rank: int = 0  # MLA: the latent's width (0: grouped-query attention with num_kv_heads)
    rope_dim: int = 0  # MLA: the rotary part of each key, shared by every head
    # What the model computes in. A block_wise_fp8 cache rounds K and V to 3-bit mantissas, so a float32 sum done
    # in another order (the paged engine's batches against the dense model's) can move a value across a rounding
    # boundary; computing in float64 leaves only the cache's own rounding, which both sides do alike.
    dtype: str = "float32"
    rope: Rope = Rope()
    local_rope: Rope | None = None  # the windowed layers' RoPE (Gemma 3's rope_local_base_freq); None: ``rope``
    norm_eps: float = 1e-6  # RMSNorm's epsilon (rms_norm_eps)
    qk_norm: bool = False  # an RMSNorm over each head's query and key before RoPE (Qwen3, Gemma 3)
    sandwich_norm: bool = False  # norms on attention's and the MLP's outputs too (Gemma 3's four norms)
    act: str = "silu"  # the MLP's gate: silu (SwiGLU) or gelu_tanh (Gemma)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden))
    attn_scale: float = 0.0  # scores' scale (0: 1/sqrt(head dim); Gemma 3: query_pre_attn_scalar ** -0.5)
    final_softcap: float = 0.0  # logits -> cap * tanh(logits / cap) where set (Gemma's final_logit_softcapping)
    hf: Mapping[str, Any] | None = None  # a checkpoint's config.json, given to kvcache as it is (``hf_config``)

    @property
    def cache_heads(self) -> int:
        """Heads a cache holds per token: the kv heads, or MLA's one latent."""
        return 1 if self.kv_lora_rank else self.num_kv_heads

    def windowed(self, layer: int) -> np.ndarray:
        """bool [cache heads]: which heads of ``layer`` attend through the window."""
        out = np.zeros(self.cache_heads, dtype=bool)
        if self.window and (self.window_layers is None or layer in self.window_layers):
            out[self._window_heads] = True
        return out

    @functools.cached_property
    def _window_heads(self) -> list[int]:
        """The kv heads a windowed layer windows, as kvcache's rows place them."""
        heads = window_kv_heads(self.hf_config(), self.num_q_heads, self.cache_heads, self.tp)
        return sorted(heads) if heads is not None else list(range(self.cache_heads))

    def chunked(self, layer: int) -> bool:
        """Whether ``layer``'s queries see only the keys of their own chunk of ``chunk`` tokens."""
        return bool(self.chunk) and (self.chunk_layers is None or layer in self.chunk_layers)

    def hf_config(self) -> dict[str, Any]:
        """The model as ``config.json`` fields: what ``CacheSpec.from_hf_config`` reads its rows from (a
        checkpoint's own config where the model came from one)."""
        if self.hf is not None:
            return dict(self.hf)
        out: dict[str, Any] = {
            "model_type": "llama", "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_q_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "hidden_size": self.hidden,
            "intermediate_size": self.ffn, "vocab_size": self.vocab, "torch_dtype": "float32"}
        if self.kv_lora_rank:
            out.update(model_type="deepseek_v3", kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.rope_dim,
                       qk_nope_head_dim=self.head_dim, v_head_dim=self.head_dim)
        if self.window:
            out["sliding_window"] = self.window
            if self.sink:
                out["sink_size"] = self.sink
            if self.window_layers is not None:
                out["layer_types"] = ["sliding_attention" if i in self.window_layers else "full_attention"
                                      for i in range(self.num_layers)]
            if self.head_wise_swa_ratio is not None:
                out["head_wise_swa_ratio"] = self.head_wise_swa_ratio
        if self.chunk:
            out["attention_chunk_size"] = self.chunk
            out["layer_types"] = ["chunked_attention" if self.chunked(i) else "full_attention"
                                  for i in range(self.num_layers)]
        return out


def visible(config: ModelConfig, layer: int, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
    """bool [cache heads, queries, keys]: the keys each head's query sees (causal; a window head also sliding + sink;
    a chunked layer only its own chunk's)."""
    causal = k_pos[None, :] <= q_pos[:, None]
    if config.chunked(layer):
        causal &= k_pos[None, :] // config.chunk == q_pos[:, None] // config.chunk
    near = (q_pos[:, None] - k_pos[None, :] < config.window) | (k_pos[None, :] < config.sink)
    return np.where(config.windowed(layer)[:, None, None], causal & near, causal)


def attention(ops: Any, q: Any, k: Any, v: Any, mask: np.ndarray, scale: float = 0.0) -> Any:
    """Grouped-query attention: q [n, Hq, d], k [Hkv, m, d], v [Hkv, m, dv], mask [Hkv, n, m] -> [n, Hq, dv];
    scores scaled by ``scale`` (0: 1/sqrt(d))."""
    n, hq, d = q.shape
    hkv = k.shape[0]
    group = ops.permute(q.reshape([n, hkv, hq // hkv, d]), [1, 2, 0, 3])  # [Hkv, g, n, d]
    scores = ops.matmul(group, k.unsqueeze(1), transpose_b=True) * (scale or float(d) ** -0.5)  # [Hkv, g, n, m]
    scores = ops.where(ops.tensor(mask[:, None]), scores, ops.fill_like(scores, float("-inf")))
    out = ops.matmul(ops.softmax(scores), v.unsqueeze(1))  # [Hkv, g, n, d]
    return ops.permute(out, [2, 0, 1, 3]).reshape([n, hq, v.shape[-1]])


FP8_MAX = 448.0  # the largest float8_e4m3fn


def fp8_round_trip(ops: Any, x: Any) -> tuple[Any, Any]:
    """``block_wise_fp8`` as a cache stores x [..., d]: float8_e4m3fn values and one float32 scale per vector (its
    largest magnitude over 448, as FastDeploy's per-token scales); returns (values, scales [..., 1])."""
    scale = ops.cast(ops.absmax_last(x) / FP8_MAX, "float32")
    scale = ops.where(scale > 0, scale, ops.fill_like(scale, 1.0))
    return ops.cast(x / ops.cast(scale, x.dtype), ops.fp8), scale


def fp8_dequantize(ops: Any, values: Any, scale: Any, dtype: str) -> Any:
    return ops.cast(values, dtype) * ops.cast(scale, dtype)


Attend = Callable[[int, Any, tuple[Any, ...]], Any]


class Model:
    """The decoder: embedding, layers of RMSNorm, GQA attention with RoPE and a gated MLP, and the LM head."""

    def __init__(self, config: ModelConfig, backend: Any = None, weights: Mapping[str, Any] | None = None) -> None:
        """``backend``: where it computes (``backend.py``; default Paddle on the CPU). ``weights``: numpy arrays
        as ``checkpoint.load`` gives them (``embed``, ``lm_head``, ``final_norm`` and ``layers``, a dict per
        layer); without them the weights are drawn from ``config.seed`` in float32, the same numbers on every
        backend."""
        self.config = c = config
        self.ops = ops = backend or paddle_backend()
        if c.kv_lora_rank and weights is not None:
            raise ValueError("weights: an MLA model's weights are only ever seeded")

        def put(array: Any) -> Any:
            return ops.cast(ops.tensor(np.asarray(array, dtype=np.float32)), c.dtype)

        if weights is None:
            weights = self._seeded()
        self.embed, self.lm_head, self.final_norm = (put(weights[k]) for k in ("embed", "lm_head", "final_norm"))
        self.layers = [{k: put(v) for k, v in layer.items()} for layer in weights["layers"]]
        rotary = c.rope_dim if c.kv_lora_rank else c.head_dim
        ropes = {"global": c.rope, "local": c.local_rope or c.rope}
        self.inv_freq = {kind: rope.inv_freq(rotary) for kind, rope in ropes.items()}
        if c.nope_layers:  # angle 0 at every position: cos 1, sin 0 leave the vectors as they are
            self.inv_freq["none"] = np.zeros(rotary // 2, dtype=np.float32)
        # Each layer's RoPE: a windowed layer's is the local one (Gemma 3), the others the global one.
        self.layer_rope = ["none" if layer in c.nope_layers else "local" if c.windowed(layer).any() else "global"
                           for layer in range(c.num_layers)]

    def _seeded(self) -> dict[str, Any]:
        """Weights drawn from the seed: float32 numpy arrays, laid out as ``forward`` reads them ([in, out])."""
        c = self.config
        rng = np.random.default_rng(c.seed)

        def weight(*shape: int, scale: float) -> np.ndarray:
            return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)

        def norm(width: int = c.hidden) -> np.ndarray:
            return (1 + 0.1 * rng.standard_normal(width)).astype(np.float32)

        embed = weight(c.vocab, c.hidden, scale=1.0)
        q_dim = c.head_dim + c.rope_dim  # MLA's queries carry the rotary part on top; GQA's rope_dim is 0
        layers = []
        for _ in range(c.num_layers):
            w = dict(attn_norm=norm(), mlp_norm=norm(),
                     wq=weight(c.hidden, c.num_q_heads * q_dim, scale=c.hidden ** -0.5),
                     wo=weight(c.num_q_heads * c.head_dim, c.hidden, scale=(c.num_q_heads * c.head_dim) ** -0.5),
                     gate=weight(c.hidden, c.ffn, scale=c.hidden ** -0.5),
                     up=weight(c.hidden, c.ffn, scale=c.hidden ** -0.5), down=weight(c.ffn, c.hidden, scale=c.ffn ** -0.5))
            if c.kv_lora_rank:
                w.update(w_dkv=weight(c.hidden, c.kv_lora_rank, scale=c.hidden ** -0.5),
                         w_kr=weight(c.hidden, c.rope_dim, scale=c.hidden ** -0.5),
                         kv_norm=norm(c.kv_lora_rank),
                         w_uk=weight(c.kv_lora_rank, c.num_q_heads * c.head_dim, scale=c.kv_lora_rank ** -0.5),
                         w_uv=weight(c.kv_lora_rank, c.num_q_heads * c.head_dim, scale=c.kv_lora_rank ** -0.5))
            else:
                w.update(wk=weight(c.hidden, c.num_kv_heads * c.head_dim, scale=c.hidden ** -0.5),
                         wv=weight(c.hidden, c.num_kv_heads * c.head_dim, scale=c.hidden ** -0.5))
            if c.qk_norm:
                w.update(q_norm=norm(c.head_dim), k_norm=norm(c.head_dim))
            if c.sandwich_norm:
                w.update(attn_out_norm=norm(), mlp_out_norm=norm())
            layers.append(w)
        final_norm = norm()
        return dict(embed=embed, layers=layers, final_norm=final_norm,
                    lm_head=weight(c.hidden, c.vocab, scale=c.hidden ** -0.5 * 4))

    def softmax_scale(self, d: int) -> float:
        """What scores of queries of width ``d`` are multiplied by before the softmax."""
        return self.config.attn_scale or float(d) ** -0.5

    def attention(self, layer: int, q: Any, kv: tuple[Any, ...], mask: np.ndarray) -> Any:
        """``layer``'s attention of queries q [n, Hq, d] over what a cache holds of m tokens (K and V
        [Hkv, m, d], or MLA's latent [1, m, kv_lora_rank + rope_dim]) under ``mask`` [cache heads, n, m]."""
        c, ops = self.config, self.ops
        scale = self.softmax_scale(q.shape[-1])
        if not c.kv_lora_rank:
            return attention(ops, q, kv[0], kv[1], mask, scale)
        w = self.layers[layer]
        latent = kv[0][0]  # [m, rank + rope]
        m, rank = latent.shape[0], c.kv_lora_rank
        keys = ops.matmul(latent[:, :rank], w["w_uk"]).reshape([m, c.num_q_heads, c.head_dim])
        values = ops.matmul(latent[:, :rank], w["w_uv"]).reshape([m, c.num_q_heads, c.head_dim])
        rope = ops.expand(latent[:, rank:].unsqueeze(1), [m, c.num_q_heads, c.rope_dim])
        keys = ops.cat([keys, rope], axis=-1)  # each head's key: its own part, then the shared rotary one
        heads = np.broadcast_to(mask, (c.num_q_heads, *mask.shape[1:]))
        return attention(ops, q, ops.permute(keys, [1, 0, 2]), ops.permute(values, [1, 0, 2]), heads, scale)

    def _rotary(self, positions: np.ndarray) -> dict[str, tuple[Any, Any]]:
        """cos and sin [n, 1, d/2] of ``positions`` per RoPE (global, local): one copy to the device per forward,
        every layer uses them. The angles are float32 products, as Hugging Face computes them."""
        out = {}
        for kind, inv_freq in self.inv_freq.items():
            angles = (positions[:, None].astype(np.float32) * inv_freq[None, :]).astype(np.float64)  # [n, d/2]
            both = self.ops.cast(self.ops.tensor(np.stack([np.cos(angles), np.sin(angles)])), self.config.dtype)
            out[kind] = (both[0].unsqueeze(1), both[1].unsqueeze(1))
        return out

    def _rope(self, x: Any, rotary: tuple[Any, Any]) -> Any:
        """Rotate x [n, heads, d] as Hugging Face does: pairs (i, i + d/2), the halves of each head."""
        cos, sin = rotary
        half = x.shape[-1] // 2
        first, second = x[:, :, :half], x[:, :, half:]
        return self.ops.cat([first * cos - second * sin, second * cos + first * sin], axis=-1)

    def _rms(self, x: Any, weight: Any) -> Any:
        return x * self.ops.rsqrt(self.ops.mean_last(x * x) + self.config.norm_eps) * weight

    def _mlp(self, h: Any, w: dict[str, Any]) -> Any:
        ops = self.ops
        gate = ops.matmul(h, w["gate"])
        gate = ops.silu(gate) if self.config.act == "silu" else ops.gelu_tanh(gate)
        return ops.matmul(gate * ops.matmul(h, w["up"]), w["down"])

    def forward(self, tokens: np.ndarray, positions: np.ndarray, attend: Attend, logits_at: np.ndarray, *,
                greedy: bool = False) -> np.ndarray:
        """Run ``tokens`` at ``positions`` (a batch of segments; ``attend`` knows where each starts) and return
        logits [len(logits_at), vocab] of the rows ``logits_at`` (in the model's dtype); with ``greedy`` only each
        row's most likely token, picked where the model runs (the logits stay there)."""
        c, ops = self.config, self.ops
        n = len(tokens)
        rotary = self._rotary(positions)
        x = ops.rows(self.embed, tokens)
        if c.embed_scale != 1.0:
            x = x * c.embed_scale
        for layer, w in enumerate(self.layers):
            angles = rotary[self.layer_rope[layer]]
            h = self._rms(x, w["attn_norm"])
            if c.kv_lora_rank:  # MLA: the cache keeps the normed latent and the rotary key
                q = ops.matmul(h, w["wq"]).reshape([n, c.num_q_heads, c.head_dim + c.rope_dim])
                q = ops.cat([q[:, :, :c.head_dim], self._rope(q[:, :, c.head_dim:], angles)], axis=-1)
                latent = self._rms(ops.matmul(h, w["w_dkv"]), w["kv_norm"])
                rotary_key = self._rope(ops.matmul(h, w["w_kr"]).unsqueeze(1), angles)[:, 0]
                kv: tuple[Any, ...] = (ops.cat([latent, rotary_key], axis=-1).unsqueeze(1),)
            else:
                q = ops.matmul(h, w["wq"]).reshape([n, c.num_q_heads, c.head_dim])
                k = ops.matmul(h, w["wk"]).reshape([n, c.num_kv_heads, c.head_dim])
                if c.qk_norm:
                    q, k = self._rms(q, w["q_norm"]), self._rms(k, w["k_norm"])
                q = self._rope(q, angles)
                kv = (self._rope(k, angles), ops.matmul(h, w["wv"]).reshape([n, c.num_kv_heads, c.head_dim]))
            o = attend(layer, q, kv)
            o = ops.matmul(o.reshape([n, c.num_q_heads * c.head_dim]), w["wo"])
            x = x + (self._rms(o, w["attn_out_norm"]) if c.sandwich_norm else o)
            m = self._mlp(self._rms(x, w["mlp_norm"]), w)
            x = x + (self._rms(m, w["mlp_out_norm"]) if c.sandwich_norm else m)
        last = ops.rows(x, logits_at)
        logits = ops.matmul(self._rms(last, self.final_norm), self.lm_head)
        if c.final_softcap:
            logits = ops.tanh(logits / c.final_softcap) * c.final_softcap
        return ops.numpy(ops.argmax_last(logits) if greedy else logits)


def dense_generate(model: Model, prompt: list[int], max_new_tokens: int, *, fp8: bool = False,
                   forced: list[int] | None = None) -> tuple[list[int], np.ndarray]:
    """The reference: greedy tokens, and the logits each was sampled from ([tokens, vocab]), from full attention
    over the whole sequence at every step, with no cache; ``fp8`` rounds K and V as a block_wise_fp8 cache does.
    With ``forced`` (another run's generated tokens) each step continues from those instead of its own choice,
    so the logits compare step for step even where a near tie went the other way."""
    tokens, rows = list(prompt), []
    for step in range(max_new_tokens):
        positions = np.arange(len(tokens))

        def attend(layer: int, q: Any, kv: tuple[Any, ...]) -> Any:
            mask = visible(model.config, layer, positions, positions)
            if fp8:
                kv = tuple(fp8_dequantize(model.ops, *fp8_round_trip(model.ops, x), model.config.dtype) for x in kv)
            return model.attention(layer, q, tuple(model.ops.permute(x, [1, 0, 2]) for x in kv), mask)

        logits = model.forward(np.asarray(tokens), positions, attend, np.array([len(tokens) - 1]))
        rows.append(logits[0])
        tokens.append(int(np.argmax(logits[0])) if forced is None else forced[step])
    return tokens[len(prompt):] if forced is None else [int(np.argmax(row)) for row in rows], np.array(rows)

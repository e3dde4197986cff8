"""A small Llama-shaped decoder with seeded weights (no download), in Paddle (CPU) or PyTorch (``backend.py``).

The model knows nothing of caches: ``Model.forward`` runs a batch of token
segments and asks an ``attend(layer, q, kv)`` callback for each layer's
attention, where ``kv`` is what a cache stores per token (K and V per kv head,
or one MLA latent), so the paged engine and the dense reference share every
other computation (``Model.attention`` included). ``ModelConfig`` declares the
sliding windows the way configs do (per layer, Gemma style, or on the first kv
heads of a layer, FastDeploy style) and writes them as ``config.json`` fields
for kvcache to read. With ``kv_lora_rank`` the attention is DeepSeek's MLA:
the cache holds one latent per token (``kv_lora_rank + rope_dim`` values)
from which every head's keys and values are projected.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from backend import paddle_backend


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Geometry, seed and sliding windows of the model."""

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
    window_heads: int | None = None  # only the first this many kv heads of a windowed layer keep it (FastDeploy)
    kv_lora_rank: int = 0  # MLA: the latent's width (0: grouped-query attention with num_kv_heads)
    rope_dim: int = 0  # MLA: the rotary part of each key, shared by every head
    # What the model computes in. A block_wise_fp8 cache rounds K and V to 3-bit mantissas, so a float32 sum done
    # in another order (the paged engine's batches against the dense model's) can move a value across a rounding
    # boundary; computing in float64 leaves only the cache's own rounding, which both sides do alike.
    dtype: str = "float32"

    @property
    def cache_heads(self) -> int:
        """Heads a cache holds per token: the kv heads, or MLA's one latent."""
        return 1 if self.kv_lora_rank else self.num_kv_heads

    def windowed(self, layer: int) -> np.ndarray:
        """bool [cache heads]: which heads of ``layer`` attend through the window."""
        out = np.zeros(self.cache_heads, dtype=bool)
        if self.window and (self.window_layers is None or layer in self.window_layers):
            out[: self.cache_heads if self.window_heads is None else self.window_heads] = True
        return out

    def hf_config(self) -> dict[str, Any]:
        """The model as ``config.json`` fields: what ``CacheSpec.from_hf_config`` reads its rows from."""
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
            if self.window_heads is not None:
                out["head_wise_swa_ratio"] = self.window_heads / self.num_kv_heads
        return out


def visible(config: ModelConfig, layer: int, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
    """bool [cache heads, queries, keys]: the keys each head's query sees (causal; a window head also sliding + sink)."""
    causal = k_pos[None, :] <= q_pos[:, None]
    near = (q_pos[:, None] - k_pos[None, :] < config.window) | (k_pos[None, :] < config.sink)
    return np.where(config.windowed(layer)[:, None, None], causal & near, causal)


def attention(ops: Any, q: Any, k: Any, v: Any, mask: np.ndarray) -> Any:
    """Grouped-query attention: q [n, Hq, d], k [Hkv, m, d], v [Hkv, m, dv], mask [Hkv, n, m] -> [n, Hq, dv]."""
    n, hq, d = q.shape
    hkv = k.shape[0]
    group = ops.permute(q.reshape([n, hkv, hq // hkv, d]), [1, 2, 0, 3])  # [Hkv, g, n, d]
    scores = ops.matmul(group, k.unsqueeze(1), transpose_b=True) / float(np.sqrt(d))  # [Hkv, g, n, m]
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
    """The decoder: embedding, layers of RMSNorm, GQA attention with RoPE and a SwiGLU MLP, and the LM head."""

    def __init__(self, config: ModelConfig, backend: Any = None) -> None:
        """``backend``: where it computes (``backend.py``; default Paddle on the CPU). The weights are the same
        numbers on every backend: drawn from ``config.seed`` in float32."""
        self.config = c = config
        self.ops = ops = backend or paddle_backend()
        rng = np.random.default_rng(c.seed)

        def weight(*shape: int, scale: float) -> Any:
            return ops.cast(ops.tensor((rng.standard_normal(shape, dtype=np.float32) * scale)), c.dtype)

        def norm() -> Any:
            return ops.cast(ops.tensor((1 + 0.1 * rng.standard_normal(c.hidden)).astype(np.float32)), c.dtype)

        self.embed = weight(c.vocab, c.hidden, scale=1.0)
        q_dim = c.head_dim + c.rope_dim  # MLA's queries carry the rotary part on top; GQA's rope_dim is 0
        self.layers = []
        for _ in range(c.num_layers):
            w = dict(attn_norm=norm(), mlp_norm=norm(),
                     wq=weight(c.hidden, c.num_q_heads * q_dim, scale=c.hidden ** -0.5),
                     wo=weight(c.num_q_heads * c.head_dim, c.hidden, scale=(c.num_q_heads * c.head_dim) ** -0.5),
                     gate=weight(c.hidden, c.ffn, scale=c.hidden ** -0.5),
                     up=weight(c.hidden, c.ffn, scale=c.hidden ** -0.5), down=weight(c.ffn, c.hidden, scale=c.ffn ** -0.5))
            if c.kv_lora_rank:
                w.update(w_dkv=weight(c.hidden, c.kv_lora_rank, scale=c.hidden ** -0.5),
                         w_kr=weight(c.hidden, c.rope_dim, scale=c.hidden ** -0.5),
                         kv_norm=ops.cast(ops.tensor(1 + 0.1 * rng.standard_normal(c.kv_lora_rank)), c.dtype),
                         w_uk=weight(c.kv_lora_rank, c.num_q_heads * c.head_dim, scale=c.kv_lora_rank ** -0.5),
                         w_uv=weight(c.kv_lora_rank, c.num_q_heads * c.head_dim, scale=c.kv_lora_rank ** -0.5))
            else:
                w.update(wk=weight(c.hidden, c.num_kv_heads * c.head_dim, scale=c.hidden ** -0.5),
                         wv=weight(c.hidden, c.num_kv_heads * c.head_dim, scale=c.hidden ** -0.5))
            self.layers.append(w)
        self.final_norm = norm()
        self.lm_head = weight(c.hidden, c.vocab, scale=c.hidden ** -0.5 * 4)
        rotary = c.rope_dim if c.kv_lora_rank else c.head_dim
        self.inv_freq = 1.0 / (10000.0 ** (np.arange(0, rotary, 2, dtype=np.float64) / rotary))

    def attention(self, layer: int, q: Any, kv: tuple[Any, ...], mask: np.ndarray) -> Any:
        """``layer``'s attention of queries q [n, Hq, d] over what a cache holds of m tokens (K and V
        [Hkv, m, d], or MLA's latent [1, m, kv_lora_rank + rope_dim]) under ``mask`` [cache heads, n, m]."""
        c, ops = self.config, self.ops
        if not c.kv_lora_rank:
            return attention(ops, q, kv[0], kv[1], mask)
        w = self.layers[layer]
        latent = kv[0][0]  # [m, rank + rope]
        m, rank = latent.shape[0], c.kv_lora_rank
        keys = ops.matmul(latent[:, :rank], w["w_uk"]).reshape([m, c.num_q_heads, c.head_dim])
        values = ops.matmul(latent[:, :rank], w["w_uv"]).reshape([m, c.num_q_heads, c.head_dim])
        rope = ops.expand(latent[:, rank:].unsqueeze(1), [m, c.num_q_heads, c.rope_dim])
        keys = ops.cat([keys, rope], axis=-1)  # each head's key: its own part, then the shared rotary one
        heads = np.broadcast_to(mask, (c.num_q_heads, *mask.shape[1:]))
        return attention(ops, q, ops.permute(keys, [1, 0, 2]), ops.permute(values, [1, 0, 2]), heads)

    def _rotary(self, positions: np.ndarray) -> tuple[Any, Any]:
        """cos and sin [n, 1, d/2] of ``positions``: one copy to the device per forward, every layer uses them."""
        angles = positions[:, None].astype(np.float64) * self.inv_freq[None, :]  # [n, d/2]
        both = self.ops.cast(self.ops.tensor(np.stack([np.cos(angles), np.sin(angles)])), self.config.dtype)
        return both[0].unsqueeze(1), both[1].unsqueeze(1)

    def _rope(self, x: Any, rotary: tuple[Any, Any]) -> Any:
        cos, sin = rotary
        even, odd = x[:, :, 0::2], x[:, :, 1::2]
        return self.ops.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1).reshape(list(x.shape))

    def _rms(self, x: Any, weight: Any) -> Any:
        return x * self.ops.rsqrt(self.ops.mean_last(x * x) + 1e-6) * weight

    def forward(self, tokens: np.ndarray, positions: np.ndarray, attend: Attend, logits_at: np.ndarray, *,
                greedy: bool = False) -> np.ndarray:
        """Run ``tokens`` at ``positions`` (a batch of segments; ``attend`` knows where each starts) and return
        logits [len(logits_at), vocab] of the rows ``logits_at`` (in the model's dtype); with ``greedy`` only each
        row's most likely token, picked where the model runs (the logits stay there)."""
        c, ops = self.config, self.ops
        n = len(tokens)
        angles = self._rotary(positions)
        x = ops.rows(self.embed, tokens)
        for layer, w in enumerate(self.layers):
            h = self._rms(x, w["attn_norm"])
            if c.kv_lora_rank:  # MLA: the cache keeps the normed latent and the rotary key
                q = ops.matmul(h, w["wq"]).reshape([n, c.num_q_heads, c.head_dim + c.rope_dim])
                q = ops.cat([q[:, :, :c.head_dim], self._rope(q[:, :, c.head_dim:], angles)], axis=-1)
                latent = self._rms(ops.matmul(h, w["w_dkv"]), w["kv_norm"])
                rotary = self._rope(ops.matmul(h, w["w_kr"]).unsqueeze(1), angles)[:, 0]
                kv: tuple[Any, ...] = (ops.cat([latent, rotary], axis=-1).unsqueeze(1),)
            else:
                q = self._rope(ops.matmul(h, w["wq"]).reshape([n, c.num_q_heads, c.head_dim]), angles)
                kv = (self._rope(ops.matmul(h, w["wk"]).reshape([n, c.num_kv_heads, c.head_dim]), angles),
                      ops.matmul(h, w["wv"]).reshape([n, c.num_kv_heads, c.head_dim]))
            o = attend(layer, q, kv)
            x = x + ops.matmul(o.reshape([n, c.num_q_heads * c.head_dim]), w["wo"])
            h = self._rms(x, w["mlp_norm"])
            x = x + ops.matmul(ops.silu(ops.matmul(h, w["gate"])) * ops.matmul(h, w["up"]), w["down"])
        last = ops.rows(x, logits_at)
        logits = ops.matmul(self._rms(last, self.final_norm), self.lm_head)
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

"""CacheSpec: a model's paged KV-cache geometry, and every byte that follows from it.

One frozen record answers "what tensors does rank r allocate per layer, how many
bytes is one block, how many blocks fit this budget". Sizes include every
per-block tensor, scales too; static per-layer quantisation parameters (the
scales of ``int8``/``fp8``/``*_zp``) are model weights, not paged cache, and
are not counted.

Per layer, per rank, for ``num_blocks`` blocks of ``block_size`` tokens::

    quant            tensors (shape after the leading num_blocks)     dtype
    none             key, value      [heads, block, head_dim(_v)]    model dtype
    int8, int8_zp    key, value      [heads, block, head_dim(_v)]    int8
    fp8              key, value      [heads, block, head_dim(_v)]    float8_e4m3fn
    int4_zp          key, value      [heads, block, head_dim(_v)/2]  uint8 (2 values a byte)
    block_wise_fp8   key, value      [heads, block, head_dim(_v)]    float8_e4m3fn
                     + key_scale, value_scale
                       default:   [heads, block]                     model dtype
                       blackwell: [heads, 4]                         float32
    mla              latent          [1, block, kv_lora_rank + rope] model dtype
    mla_fp8          latent          [1, block, 656]                 uint8
                     (kv_lora_rank fp8 values, kv_lora_rank/128 float32
                      scales, rope bfloat16 values: 512 + 16 + 128 = 656)
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from enum import Enum
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.rows import Row, derive_rows, layer_policies, window_kv_heads
from kvcache.allocator.swa import Full

DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "int8": 1,
    "uint8": 1,
    "float8_e4m3fn": 1,
}
MODEL_DTYPES = ("bfloat16", "float16", "float32")
# Spellings found in HF configs and engine flags, mapped to ours.
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
}
MLA_FP8_GROUP = 128  # latent values per float32 scale in the mla_fp8 format
# Bounds on a model's geometry, far past any real model's, checked before anything is built from it: rows and
# tables hold one entry per layer, kv head or (layer, kv head) cell, and a block's bytes follow from the rest.
MAX_BOUNDS: dict[str, int] = {
    "num_layers": 4096,
    "num_kv_heads": 4096,
    "head_dim": 65_536,
    "head_dim_v": 65_536,
    "kv_lora_rank": 65_536,
    "qk_rope_head_dim": 65_536,
    "block_size": 2**20,
    "tp_size": 1024,
}
MAX_CELLS = 2**18  # (layer, kv head) cells of a model: num_layers x num_kv_heads


class QuantType(str, Enum):
    """How KV values are stored in the paged cache."""

    NONE = "none"
    INT8 = "int8"
    FP8 = "fp8"
    INT8_ZP = "int8_zp"
    INT4_ZP = "int4_zp"
    BLOCK_WISE_FP8 = "block_wise_fp8"
    MLA = "mla"
    MLA_FP8 = "mla_fp8"

    @property
    def is_mla(self) -> bool:
        return self in (QuantType.MLA, QuantType.MLA_FP8)


class ScaleLayout(str, Enum):
    """Where block_wise_fp8 keeps its dynamic scales."""

    DEFAULT = "default"
    BLACKWELL = "blackwell"


class TensorSpec(NamedTuple):
    """One per-layer cache tensor on one rank; its shape is ``(num_blocks, *block_shape)``."""

    name: str
    block_shape: tuple[int, ...]
    dtype: str

    @property
    def bytes_per_block(self) -> int:
        return math.prod(self.block_shape) * DTYPE_BYTES[self.dtype]

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, *self.block_shape)

    def nbytes(self, num_blocks: int) -> int:
        return num_blocks * self.bytes_per_block


def _enum(kind: type[Enum], value: Any, field: str) -> Any:
    try:
        return kind(value.value if isinstance(value, Enum) else str(value).lower())
    except ValueError:
        choices = ", ".join(m.value for m in kind)  # type: ignore[attr-defined]
        raise KVCacheError(f"{field}: unknown value {value!r}; expected one of {choices}") from None


def normalize_dtype(value: Any, field: str = "dtype") -> str:
    """Map a dtype spelling ('bf16', 'torch.bfloat16', 'float16', ...) to a model dtype name."""
    name = str(value).lower().removeprefix("torch.").removeprefix("paddle.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in MODEL_DTYPES:
        raise KVCacheError(f"{field}: unknown model dtype {value!r}; expected one of {', '.join(MODEL_DTYPES)}")
    return name


def _positive_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVCacheError(f"{field}: must be an integer, got {value!r}")
    if value <= 0:
        raise KVCacheError(f"{field}: must be positive, got {value}")
    return value


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CacheSpec:
    """Geometry of one model's paged KV cache; every size is per TP rank unless named global.

    ``num_kv_heads`` is the model's global count; ranks split them evenly where the ranks divide them, or,
    where the heads divide the ranks (ranks a multiple of heads), each rank holds one head replicated on
    ``tp_size // num_kv_heads`` ranks; anything else is an error.
    MLA types store one latent head (``kv_lora_rank + qk_rope_head_dim`` wide)
    replicated on every rank; leave ``num_kv_heads``/``head_dim`` unset for them.
    """

    num_layers: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    head_dim_v: int | None = None
    block_size: int = 64
    dtype: str = "bfloat16"
    quant: QuantType = QuantType.NONE
    scale_layout: ScaleLayout = ScaleLayout.DEFAULT
    tp_size: int = 1
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    rows: tuple[Row, ...] | None = None  # None: one Full row over every layer and kv head

    def __post_init__(self) -> None:
        setattr_ = object.__setattr__
        setattr_(self, "quant", _enum(QuantType, self.quant, "quant"))
        setattr_(self, "scale_layout", _enum(ScaleLayout, self.scale_layout, "scale_layout"))
        setattr_(self, "dtype", normalize_dtype(self.dtype))
        _positive_int(self.num_layers, "num_layers")
        _positive_int(self.block_size, "block_size")
        _positive_int(self.tp_size, "tp_size")
        if self.quant.is_mla:
            self._validate_mla()
        else:
            self._validate_heads()
        if self.rows is not None:
            self._validate_rows()

    def _validate_rows(self) -> None:
        """Rows must hold every (layer, kv head) cell of the model exactly once."""
        assert self.num_kv_heads is not None
        rows = tuple(self.rows or ())
        object.__setattr__(self, "rows", rows)
        seen: set[tuple[int, int]] = set()
        for i, row in enumerate(rows):
            if not isinstance(row, Row) or not row.layers or not row.kv_heads:
                raise KVCacheError(f"rows[{i}]: must be a Row with at least one layer and one kv head")
            for layer in row.layers:
                for head in row.kv_heads:
                    if not (0 <= layer < self.num_layers and 0 <= head < self.num_kv_heads):
                        raise KVCacheError(f"rows[{i}]: cell (layer {layer}, kv head {head}) is outside the model's "
                                           f"{self.num_layers} layers and {self.num_kv_heads} kv heads")
                    if (layer, head) in seen:
                        raise KVCacheError(f"rows[{i}]: cell (layer {layer}, kv head {head}) is in two rows")
                    seen.add((layer, head))
        if len(seen) != self.num_layers * self.num_kv_heads:
            raise KVCacheError(f"rows: hold {len(seen)} of the model's {self.num_layers * self.num_kv_heads} "
                               "(layer, kv head) cells; every cell needs a row")

    def _validate_mla(self) -> None:
        if self.kv_lora_rank is None or self.qk_rope_head_dim is None:
            raise KVCacheError(f"quant={self.quant.value} needs kv_lora_rank and qk_rope_head_dim")
        _positive_int(self.kv_lora_rank, "kv_lora_rank")
        _positive_int(self.qk_rope_head_dim, "qk_rope_head_dim")
        if self.num_kv_heads not in (None, 1):
            raise KVCacheError(
                f"num_kv_heads: MLA caches one latent head shared by all query heads; got {self.num_kv_heads}, "
                "leave it unset or 1"
            )
        width = self.kv_lora_rank + self.qk_rope_head_dim
        if self.head_dim not in (None, width):
            raise KVCacheError(
                f"head_dim: MLA latent width is kv_lora_rank + qk_rope_head_dim = {width}, got {self.head_dim}"
            )
        if self.head_dim_v is not None:
            raise KVCacheError("head_dim_v: MLA caches have no V tensor; leave it unset")
        if self.quant is QuantType.MLA_FP8 and self.kv_lora_rank % MLA_FP8_GROUP:
            raise KVCacheError(
                f"kv_lora_rank: mla_fp8 keeps one float32 scale per {MLA_FP8_GROUP} latent values, "
                f"so kv_lora_rank must be a multiple of {MLA_FP8_GROUP}; got {self.kv_lora_rank}"
            )
        object.__setattr__(self, "num_kv_heads", 1)
        object.__setattr__(self, "head_dim", width)

    def _validate_heads(self) -> None:
        if self.num_kv_heads is None or self.head_dim is None:
            raise KVCacheError(f"quant={self.quant.value} needs num_kv_heads and head_dim")
        heads = _positive_int(self.num_kv_heads, "num_kv_heads")
        _positive_int(self.head_dim, "head_dim")
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        _positive_int(self.head_dim_v, "head_dim_v")
        if self.kv_lora_rank is not None or self.qk_rope_head_dim is not None:
            raise KVCacheError(
                f"kv_lora_rank/qk_rope_head_dim: only MLA quant types (mla, mla_fp8) use them, not {self.quant.value}"
            )
        if heads % self.tp_size and self.tp_size % heads:
            raise KVCacheError(
                f"tp_size: {heads} kv heads cannot be split over {self.tp_size} ranks "
                "(heads must divide evenly, or the ranks must be a multiple of the heads)"
            )
        if self.quant is QuantType.INT4_ZP and (self.head_dim % 2 or self.head_dim_v % 2):
            raise KVCacheError(
                f"head_dim: int4_zp packs two values a byte, so head_dim ({self.head_dim}) and "
                f"head_dim_v ({self.head_dim_v}) must be even"
            )

    @classmethod
    def from_hf_config(cls, config: str | Path | Mapping[str, Any], *, head_wise: bool = False,
                       **overrides: Any) -> CacheSpec:
        """Build a spec from a Hugging Face ``config.json`` (path or dict); keyword overrides win.

        Reads Llama/Qwen-style GQA (``num_key_value_heads``, ``head_dim`` or
        ``hidden_size / num_attention_heads``) and DeepSeek-style MLA
        (``kv_lora_rank``, ``qk_rope_head_dim``); multimodal configs are read
        from their ``text_config``. ``quant`` none/fp8 on an MLA model means
        mla/mla_fp8. The rows come from the config's sliding windows
        (``kvcache.allocator.rows``): one per layer group, or with ``head_wise``
        one per kv head within each group; a model without windows and without
        ``head_wise`` gets the default (one row). A FastDeploy ``head_wise_swa_ratio``
        windows the kv heads FastDeploy windows at ``tp_size`` ranks (``window_kv_heads``).
        """
        cfg = _load_config(config)
        get = _ConfigReader(cfg)
        fields: dict[str, Any] = {"num_layers": get.int("num_hidden_layers", "n_layer", "num_layers")}
        dtype = cfg.get("torch_dtype") or cfg.get("dtype")
        if dtype is not None and "dtype" not in overrides:
            fields["dtype"] = normalize_dtype(dtype, "config.torch_dtype")
        quant = _enum(QuantType, overrides.pop("quant", QuantType.NONE), "quant")
        if cfg.get("kv_lora_rank"):
            fields["kv_lora_rank"] = get.int("kv_lora_rank")
            fields["qk_rope_head_dim"] = get.int("qk_rope_head_dim")
            mla_quant = {QuantType.NONE: QuantType.MLA, QuantType.FP8: QuantType.MLA_FP8}.get(quant, quant)
            if not mla_quant.is_mla:
                raise KVCacheError(f"quant: {quant.value} does not apply to an MLA model; use mla or mla_fp8")
            fields["quant"] = mla_quant
        else:
            if quant.is_mla:
                raise KVCacheError(f"quant: {quant.value} needs an MLA model (config has no kv_lora_rank)")
            num_heads = get.int("num_attention_heads", "n_head")
            fields["num_kv_heads"] = get.int("num_key_value_heads", "num_kv_heads", default=num_heads)
            head_dim = cfg.get("head_dim")
            fields["head_dim"] = head_dim if head_dim else get.int("hidden_size", "n_embd") // num_heads
            fields["quant"] = quant
        rows_given = "rows" in overrides
        fields.update(overrides)
        check_bounds(fields)
        spec = cls(**fields)
        if rows_given:
            return spec
        heads = spec.num_kv_heads or 1
        window_heads = window_kv_heads(cfg, get.int("num_attention_heads", "n_head", default=heads), heads,
                                       spec.tp_size)
        rows = derive_rows(layer_policies(cfg, spec.num_layers), heads, head_wise=head_wise, window_heads=window_heads)
        if len(rows) == 1 and not head_wise and isinstance(rows[0].policy, Full):
            return spec  # no window: the default row
        return dataclasses.replace(spec, rows=rows)

    @property
    def kv_heads_per_rank(self) -> int:
        """kv heads one rank stores: an even share, or one replicated head when the heads divide the ranks."""
        assert self.num_kv_heads is not None
        if self.quant.is_mla:
            return 1
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def head_replicas(self) -> int:
        """How many ranks hold a copy of each kv head (1 unless heads < ranks, or MLA)."""
        assert self.num_kv_heads is not None
        return self.tp_size * self.kv_heads_per_rank // self.num_kv_heads

    def tensors(self) -> tuple[TensorSpec, ...]:
        """The per-layer cache tensors one rank allocates, each of shape ``(num_blocks, *block_shape)``."""
        return _tensors_of(self)  # a spec is immutable; transfers ask for its tensors on every write

    def _tensors(self) -> tuple[TensorSpec, ...]:
        q, bs, heads = self.quant, self.block_size, self.kv_heads_per_rank
        assert self.head_dim is not None and self.head_dim_v is not None or q.is_mla
        if q is QuantType.MLA:
            return (TensorSpec("latent", (1, bs, self.head_dim), self.dtype),)
        if q is QuantType.MLA_FP8:
            assert self.kv_lora_rank is not None and self.qk_rope_head_dim is not None
            width = self.kv_lora_rank + 4 * (self.kv_lora_rank // MLA_FP8_GROUP) + 2 * self.qk_rope_head_dim
            return (TensorSpec("latent", (1, bs, width), "uint8"),)
        value_dtype = {
            QuantType.NONE: self.dtype,
            QuantType.INT8: "int8",
            QuantType.INT8_ZP: "int8",
            QuantType.FP8: "float8_e4m3fn",
            QuantType.BLOCK_WISE_FP8: "float8_e4m3fn",
            QuantType.INT4_ZP: "uint8",
        }[q]
        packing = 2 if q is QuantType.INT4_ZP else 1
        kv = (
            TensorSpec("key", (heads, bs, self.head_dim // packing), value_dtype),
            TensorSpec("value", (heads, bs, self.head_dim_v // packing), value_dtype),
        )
        if q is not QuantType.BLOCK_WISE_FP8:
            return kv
        if self.scale_layout is ScaleLayout.BLACKWELL:
            scale_shape, scale_dtype = (heads, 4), "float32"
        else:
            scale_shape, scale_dtype = (heads, bs), self.dtype
        return kv + (
            TensorSpec("key_scale", scale_shape, scale_dtype),
            TensorSpec("value_scale", scale_shape, scale_dtype),
        )

    @property
    def row_layout(self) -> tuple[Row, ...]:
        """The rows: ``rows``, or the one Full row over every layer and kv head."""
        if self.rows is not None:
            return self.rows
        assert self.num_kv_heads is not None
        return (Row(Full(), tuple(range(self.num_layers)), tuple(range(self.num_kv_heads))),)

    def row_heads_per_rank(self, row: Row) -> int:
        """kv heads of ``row`` one rank that holds it stores (its share of the rank's heads, at least one)."""
        assert self.num_kv_heads is not None
        return max(1, len(row.kv_heads) * self.kv_heads_per_rank // self.num_kv_heads)

    def row_tensors(self, row: Row) -> tuple[TensorSpec, ...]:
        """The cache tensors of one layer of ``row`` on a rank that holds it: the layer's tensors over the row's kv
        heads there, each of shape ``(row's blocks, *block_shape)`` when the row has a pool of its own."""
        heads = self.row_heads_per_rank(row)
        if self.quant.is_mla:
            return self.tensors()
        return tuple(t._replace(block_shape=(heads, *t.block_shape[1:])) for t in self.tensors())

    def row_bytes_per_block(self, row: Row) -> int:
        """Bytes one block of ``row`` takes on a rank that holds it: its layers times its kv heads on that rank."""
        return sum(t.bytes_per_block for t in self.row_tensors(row)) * len(row.layers)

    @property
    def bytes_per_block_per_layer(self) -> int:
        """Bytes one block takes in one layer on one rank, scales included."""
        return sum(t.bytes_per_block for t in self.tensors())

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes over all layers on one rank."""
        return self.bytes_per_block_per_layer * self.num_layers

    @property
    def global_bytes_per_block(self) -> int:
        """Bytes one block takes over all layers and all ranks (replicas counted)."""
        return self.bytes_per_block * self.tp_size

    @property
    def bytes_per_token(self) -> float:
        """Bytes one token takes over all layers on one rank (block bytes / block_size)."""
        return self.bytes_per_block / self.block_size

    def num_blocks_for(self, budget_bytes: int) -> int:
        """The most blocks whose cache fits ``budget_bytes`` on one rank (never over-commits)."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
            raise KVCacheError(f"budget_bytes: must be an integer number of bytes, got {budget_bytes!r}")
        if budget_bytes < 0:
            raise KVCacheError(f"budget_bytes: must not be negative, got {budget_bytes}")
        return budget_bytes // self.bytes_per_block

    def cache_bytes(self, num_blocks: int) -> int:
        """Bytes ``num_blocks`` blocks take over all layers on one rank."""
        return num_blocks * self.bytes_per_block

    def describe(self) -> dict[str, Any]:
        """The spec's fields as plain JSON-ready values."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["quant"] = self.quant.value
        out["scale_layout"] = self.scale_layout.value
        out["kv_heads_per_rank"] = self.kv_heads_per_rank
        out["rows"] = None if self.rows is None else [r.describe() for r in self.rows]
        return out


def check_bounds(fields: Mapping[str, Any]) -> None:
    """Raise KVCacheError naming the first geometry field past its bound (``MAX_BOUNDS``, ``MAX_CELLS``).

    Fields that are not integers are left to ``CacheSpec`` to refuse.
    """
    for name, most in MAX_BOUNDS.items():
        value = fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > most:
            raise KVCacheError(f"{name}: must be at most {most}, got {value}")
    layers, heads = fields.get("num_layers"), fields.get("num_kv_heads")
    if isinstance(layers, int) and isinstance(heads, int) and layers * heads > MAX_CELLS:
        raise KVCacheError(f"num_kv_heads: {layers} layers x {heads} kv heads make {layers * heads} (layer, kv head) "
                           f"cells, more than the {MAX_CELLS} a cache may have")


class _ConfigReader:
    """Reads integer fields from an HF config, naming the missing or bad key in errors."""

    def __init__(self, cfg: Mapping[str, Any]) -> None:
        self.cfg = cfg

    def int(self, *keys: str, default: int | None = None) -> int:
        for key in keys:
            value = self.cfg.get(key)
            if value is not None:
                return _positive_int(value, f"config.{key}")
        if default is not None:
            return default
        raise KVCacheError(f"config: missing key {keys[0]!r}" + (f" (or {', '.join(keys[1:])})" if keys[1:] else ""))


# What transformers' config classes fill in where a published config.json leaves a key out (Google's Gemma 3
# files omit the attention geometry and the window pattern, which Gemma3TextConfig defaults).
MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096,
                    "sliding_window_pattern": 6},
}


def _load_config(config: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        cfg = config
    else:
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except OSError as exc:
            raise KVCacheError(f"model: cannot read {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise KVCacheError(f"model: {path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, Mapping):
        raise KVCacheError(f"model: config must be a JSON object, got {type(cfg).__name__}")
    text = cfg.get("text_config")
    if isinstance(text, Mapping) and "num_hidden_layers" not in cfg:
        merged = dict(cfg)
        merged.update(text)
        cfg = merged
    defaults = MODEL_DEFAULTS.get(str(cfg.get("model_type", "")))
    return {**defaults, **cfg} if defaults else cfg  # layer_types, where given, win over the default pattern


@functools.lru_cache(maxsize=1024)
def _tensors_of(spec: CacheSpec) -> tuple[TensorSpec, ...]:
    return spec._tensors()

"""CacheSpec: per-layer tensors and bytes for every KV dtype, TP splitting, HF configs."""
from __future__ import annotations

import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvcache.allocator import CacheSpec, KVCacheError, QuantType, ScaleLayout
from kvcache.allocator.swa import Window


def make_spec(**overrides) -> CacheSpec:
    fields = dict(num_layers=1, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    fields.update(overrides)
    return CacheSpec(**fields)


def make_mla(**overrides) -> CacheSpec:
    fields = dict(num_layers=1, kv_lora_rank=512, qk_rope_head_dim=64, block_size=64, quant="mla")
    fields.update(overrides)
    return CacheSpec(**fields)


# -- the page sizes the issue fixes ------------------------------------------------------------

def test_bf16_page_for_8_heads_of_128_block_16_is_65536_bytes():
    assert make_spec().bytes_per_block_per_layer == 65_536


def test_fp8_with_per_tensor_scales_page_is_32768_bytes():
    """Static fp8 scales are per-layer parameters, not paged: only K and V count."""
    spec = make_spec(quant="fp8")
    assert spec.bytes_per_block_per_layer == 32_768
    assert [t.name for t in spec.tensors()] == ["key", "value"]


def test_mla_576_wide_bf16_block_64_page_is_73728_bytes():
    spec = make_mla()
    assert spec.bytes_per_block_per_layer == 73_728
    assert spec.tensors()[0].shape(10) == (10, 1, 64, 576)


def test_mla_fp8_page_block_64_is_41984_bytes_656_a_token():
    spec = make_mla(quant="mla_fp8")
    assert spec.bytes_per_block_per_layer == 41_984
    assert spec.tensors()[0].block_shape == (1, 64, 656)


# -- every quant type ---------------------------------------------------------------------------

def test_int8_and_int8_zp_store_one_byte_values_without_paged_scales():
    for quant in ("int8", "int8_zp"):
        spec = make_spec(quant=quant)
        assert [(t.name, t.dtype) for t in spec.tensors()] == [("key", "int8"), ("value", "int8")]
        assert spec.bytes_per_block_per_layer == 2 * 8 * 16 * 128


def test_int4_zp_halves_head_dim():
    spec = make_spec(quant="int4_zp")
    assert [t.block_shape for t in spec.tensors()] == [(8, 16, 64), (8, 16, 64)]
    assert spec.bytes_per_block_per_layer == 16_384


def test_int4_zp_rejects_odd_head_dim():
    with pytest.raises(KVCacheError, match="head_dim.*even"):
        make_spec(quant="int4_zp", head_dim=127)


def test_block_wise_fp8_default_scales_are_per_token_in_model_dtype():
    spec = make_spec(quant="block_wise_fp8", dtype="float16")
    tensors = {t.name: t for t in spec.tensors()}
    assert tensors["key_scale"] == tensors["value_scale"]._replace(name="key_scale")
    assert tensors["key_scale"].block_shape == (8, 16)
    assert tensors["key_scale"].dtype == "float16"
    assert spec.bytes_per_block_per_layer == 32_768 + 2 * (8 * 16 * 2)


def test_block_wise_fp8_blackwell_scales_are_four_float32_per_head():
    spec = make_spec(quant="block_wise_fp8", scale_layout="blackwell")
    tensors = {t.name: t for t in spec.tensors()}
    assert tensors["value_scale"].block_shape == (8, 4)
    assert tensors["value_scale"].dtype == "float32"
    assert spec.bytes_per_block_per_layer == 32_768 + 2 * (8 * 4 * 4)
    assert spec.scale_layout is ScaleLayout.BLACKWELL


def test_head_dim_v_sizes_the_value_tensor():
    spec = make_spec(head_dim=192, head_dim_v=128)
    assert [t.block_shape for t in spec.tensors()] == [(8, 16, 192), (8, 16, 128)]


def test_float32_model_dtype_doubles_unquantised_bytes():
    assert make_spec(dtype="float32").bytes_per_block_per_layer == 2 * make_spec().bytes_per_block_per_layer


# -- tensor parallelism -------------------------------------------------------------------------

def test_tp_splits_heads_evenly():
    spec = make_spec(tp_size=4)
    assert spec.kv_heads_per_rank == 2
    assert spec.head_replicas == 1
    assert spec.bytes_per_block_per_layer * 4 == make_spec().bytes_per_block_per_layer


def test_fewer_heads_than_ranks_replicates_each_head():
    spec = make_spec(num_kv_heads=2, tp_size=8)
    assert spec.kv_heads_per_rank == 1
    assert spec.head_replicas == 4


def test_non_divisible_heads_and_ranks_is_an_error_naming_both():
    with pytest.raises(KVCacheError, match="6 kv heads cannot be split over 4 ranks"):
        make_spec(num_kv_heads=6, tp_size=4)


def test_mla_latent_is_replicated_on_every_rank():
    spec = make_mla(tp_size=8)
    assert spec.kv_heads_per_rank == 1
    assert spec.bytes_per_block == make_mla().bytes_per_block


# -- budgets ------------------------------------------------------------------------------------

def test_num_blocks_for_rounds_down():
    spec = make_spec(num_layers=2)
    assert spec.bytes_per_block == 131_072
    assert spec.num_blocks_for(131_072 * 5 - 1) == 4
    assert spec.num_blocks_for(131_072 * 5) == 5
    assert spec.num_blocks_for(0) == 0


def test_num_blocks_for_rejects_negative_and_non_integer_budgets():
    with pytest.raises(KVCacheError, match="budget_bytes"):
        make_spec().num_blocks_for(-1)
    with pytest.raises(KVCacheError, match="budget_bytes"):
        make_spec().num_blocks_for(1.5)


# -- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(num_layers=-3), "num_layers"),
        (dict(block_size=0), "block_size"),
        (dict(num_kv_heads=0), "num_kv_heads"),
        (dict(head_dim=-1), "head_dim"),
        (dict(tp_size=0), "tp_size"),
        (dict(dtype="float64"), "dtype"),
        (dict(quant="nf4"), "quant"),
        (dict(scale_layout="hopper"), "scale_layout"),
        (dict(num_layers=2.0), "num_layers"),
        (dict(num_kv_heads=None), "num_kv_heads"),
        (dict(kv_lora_rank=512), "kv_lora_rank"),
    ],
)
def test_bad_fields_raise_naming_the_field(overrides, field):
    with pytest.raises(KVCacheError, match=field):
        make_spec(**overrides)


def test_mla_needs_its_dims_and_rejects_heads():
    with pytest.raises(KVCacheError, match="kv_lora_rank"):
        CacheSpec(num_layers=1, quant="mla")
    with pytest.raises(KVCacheError, match="num_kv_heads"):
        make_mla(num_kv_heads=8)
    with pytest.raises(KVCacheError, match="kv_lora_rank.*multiple of 128"):
        make_mla(quant="mla_fp8", kv_lora_rank=500)


def test_dtype_spellings_are_normalised():
    assert make_spec(dtype="bf16").dtype == "bfloat16"
    assert make_spec(dtype="torch.float16").dtype == "float16"


# -- Hugging Face configs -----------------------------------------------------------------------

LLAMA_70B = {
    "hidden_size": 8192, "num_attention_heads": 64, "num_hidden_layers": 80,
    "num_key_value_heads": 8, "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    "hidden_size": 7168, "num_attention_heads": 128, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "torch_dtype": "bfloat16",
}


def test_hf_llama_config_derives_head_dim_from_hidden_size():
    spec = CacheSpec.from_hf_config(LLAMA_70B, block_size=16)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (80, 8, 128)
    assert spec.bytes_per_block_per_layer == 65_536


def test_hf_config_explicit_head_dim_wins_over_hidden_size():
    cfg = dict(LLAMA_70B, head_dim=256)
    assert CacheSpec.from_hf_config(cfg).head_dim == 256


def test_hf_config_without_kv_heads_uses_attention_heads():
    cfg = {k: v for k, v in LLAMA_70B.items() if k != "num_key_value_heads"}
    assert CacheSpec.from_hf_config(cfg).num_kv_heads == 64


def test_hf_deepseek_config_is_mla_and_fp8_means_mla_fp8():
    assert CacheSpec.from_hf_config(DEEPSEEK_V3).quant is QuantType.MLA
    spec = CacheSpec.from_hf_config(DEEPSEEK_V3, quant="fp8", block_size=64)
    assert spec.quant is QuantType.MLA_FP8
    assert spec.bytes_per_block_per_layer == 41_984


def test_hf_multimodal_config_reads_text_config():
    cfg = {"architectures": ["X"], "text_config": dict(LLAMA_70B)}
    assert CacheSpec.from_hf_config(cfg).num_layers == 80


def test_hf_config_from_file_and_folder(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    assert CacheSpec.from_hf_config(tmp_path).num_layers == 80
    assert CacheSpec.from_hf_config(tmp_path / "config.json").num_layers == 80


def test_hf_config_missing_key_is_named():
    cfg = {k: v for k, v in LLAMA_70B.items() if k != "num_hidden_layers"}
    with pytest.raises(KVCacheError, match="num_hidden_layers"):
        CacheSpec.from_hf_config(cfg)


def test_hf_config_unreadable_file_is_a_clear_error(tmp_path):
    with pytest.raises(KVCacheError, match="cannot read"):
        CacheSpec.from_hf_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(KVCacheError, match="not valid JSON"):
        CacheSpec.from_hf_config(tmp_path / "bad.json")


def test_hf_mla_quant_on_gqa_model_is_rejected():
    with pytest.raises(KVCacheError, match="needs an MLA model"):
        CacheSpec.from_hf_config(LLAMA_70B, quant="mla")


# -- properties ---------------------------------------------------------------------------------

NON_MLA = [q for q in QuantType if not q.is_mla]


@st.composite
def specs(draw) -> CacheSpec:
    quant = draw(st.sampled_from(list(QuantType)))
    common = dict(
        num_layers=draw(st.integers(1, 128)),
        block_size=draw(st.integers(1, 512)),
        dtype=draw(st.sampled_from(["bfloat16", "float16", "float32"])),
        quant=quant,
        scale_layout=draw(st.sampled_from(list(ScaleLayout))),
    )
    if quant.is_mla:
        rank = draw(st.integers(1, 8)) * 128
        return CacheSpec(kv_lora_rank=rank, qk_rope_head_dim=draw(st.integers(1, 256)),
                         tp_size=draw(st.integers(1, 16)), **common)
    heads = draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64]))
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8, 16, 32) if heads % t == 0 or t % heads == 0]))
    head_dim = draw(st.integers(1, 256)) * 2
    return CacheSpec(num_kv_heads=heads, head_dim=head_dim, tp_size=tp, **common)


@given(specs())
def test_bytes_equal_the_sum_over_listed_tensors(spec):
    per_layer = sum(math.prod(t.block_shape) * {"bfloat16": 2, "float16": 2, "float32": 4}.get(t.dtype, 1)
                    for t in spec.tensors())
    assert spec.bytes_per_block_per_layer == per_layer
    assert spec.bytes_per_block == per_layer * spec.num_layers
    for t in spec.tensors():
        assert t.nbytes(7) == 7 * t.bytes_per_block


@given(specs(), st.integers(0, 2**44))
def test_num_blocks_for_never_over_commits(spec, budget):
    n = spec.num_blocks_for(budget)
    assert spec.cache_bytes(n) <= budget < spec.cache_bytes(n + 1)


@given(specs())
def test_per_rank_bytes_times_ranks_equal_global_when_heads_divide(spec):
    assume(not spec.quant.is_mla and spec.num_kv_heads % spec.tp_size == 0)
    whole = CacheSpec(**{**_fields(spec), "tp_size": 1})
    assert spec.bytes_per_block * spec.tp_size == whole.bytes_per_block
    assert spec.global_bytes_per_block == whole.bytes_per_block


def _fields(spec: CacheSpec) -> dict:
    import dataclasses

    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}


def test_a_published_gemma_3_config_gets_transformers_defaults_for_what_it_leaves_out():
    """Google's Gemma 3 4B config.json has no heads, head size or window pattern: transformers' Gemma3TextConfig
    defaults (8 heads, 4 kv heads of 256, every 6th layer full) apply, not a window on every layer."""
    published = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                 "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 34,
                                 "sliding_window": 1024}}
    spec = CacheSpec.from_hf_config(published)
    assert (spec.num_kv_heads, spec.head_dim) == (4, 256)
    windowed = [i for i in range(34) if any(i in r.layers for r in spec.rows if isinstance(r.policy, Window))]
    assert [i for i in range(34) if i not in windowed] == [5, 11, 17, 23, 29]
    explicit = CacheSpec.from_hf_config({**published["text_config"], "num_key_value_heads": 8, "head_dim": 128,
                                         "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 32})
    assert (explicit.num_kv_heads, explicit.head_dim) == (8, 128)
    assert sorted(len(r.layers) for r in explicit.rows) == [2, 32]

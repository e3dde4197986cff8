"""Rows from model configs: the published config.json fields of real models give the rows hand arithmetic gives."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.allocator import Full, KVCacheError, Window
from kvcache.allocator.rows import Row, derive_rows, layer_policies, window_kv_heads

# The window fields of published config.json files (google/gemma-2-9b, google/gemma-3-4b-it's text_config,
# openai/gpt-oss-20b, mistralai/Mistral-7B-v0.1, meta-llama/Llama-3.1-8B, deepseek-ai/DeepSeek-V3), and a
# FastDeploy head-wise model config.
GEMMA2 = {"model_type": "gemma2", "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
          "head_dim": 256, "sliding_window": 4096}
GEMMA3 = {"model_type": "gemma3_text", "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
          "head_dim": 256, "sliding_window": 1024, "sliding_window_pattern": 6}
GPT_OSS = {"model_type": "gpt_oss", "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
           "head_dim": 64, "sliding_window": 128,
           "layer_types": ["sliding_attention", "full_attention"] * 12}
MISTRAL = {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "hidden_size": 4096, "sliding_window": 4096}
LLAMA3 = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
          "hidden_size": 4096}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
QWEN25 = {"model_type": "qwen2", "num_hidden_layers": 28, "num_key_value_heads": 4, "sliding_window": 131072,
          "use_sliding_window": False, "max_window_layers": 28}
FASTDEPLOY = {"num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
              "window_size": 4096, "sink_size": 64, "head_wise_swa_ratio": 0.5}

W = Window


def rows_of(config: dict, *, head_wise: bool = False, heads: int | None = None, tp: int = 1) -> tuple[Row, ...]:
    num_layers = config["num_hidden_layers"]
    heads = heads if heads is not None else config.get("num_key_value_heads", 1)
    return derive_rows(layer_policies(config, num_layers), heads, head_wise=head_wise,
                       window_heads=window_kv_heads(config, config.get("num_attention_heads", heads), heads, tp))


def test_gemma2_windows_the_even_layers() -> None:
    window, full = rows_of(GEMMA2)
    assert window == Row(W(4096), tuple(range(0, 42, 2)), tuple(range(8)))
    assert full == Row(Full(), tuple(range(1, 42, 2)), tuple(range(8)))
    assert window.num_cells == full.num_cells == 21 * 8


def test_gemma3_keeps_every_sixth_layer_full() -> None:
    window, full = rows_of(GEMMA3)
    assert full.policy == Full() and full.layers == (5, 11, 17, 23, 29)
    assert window.policy == W(1024) and len(window.layers) == 29 and not set(window.layers) & set(full.layers)
    assert window.num_cells == 29 * 4 and full.num_cells == 5 * 4
    # A config with layer_types says it outright; it wins over the pattern.
    types = ["sliding_attention"] * 34
    for i in (5, 11, 17, 23, 29, 33):
        types[i] = "full_attention"
    window, full = rows_of({**GEMMA3, "layer_types": types})
    assert len(window.layers) == 28 and full.layers == (5, 11, 17, 23, 29, 33)


def test_gpt_oss_alternates_a_128_token_window() -> None:
    window, full = rows_of(GPT_OSS)
    assert window == Row(W(128), tuple(range(0, 24, 2)), tuple(range(8)))
    assert full == Row(Full(), tuple(range(1, 24, 2)), tuple(range(8)))


def test_a_sliding_window_alone_windows_every_layer() -> None:
    """One window row over every cell: the spec keeps it (a lone row is left out only when it is full)."""
    from kvcache.allocator import CacheSpec

    (row,) = rows_of(MISTRAL)
    assert row == Row(W(4096), tuple(range(32)), tuple(range(8)))
    assert CacheSpec.from_hf_config(MISTRAL, block_size=16).row_layout == (row,)


@pytest.mark.parametrize("config", [LLAMA3, DEEPSEEK_V3, QWEN25])
def test_models_without_a_window_in_use_get_one_full_row(config: dict) -> None:
    (row,) = rows_of(config, heads=config.get("num_key_value_heads", 1))
    assert row.policy == Full() and row.layers == tuple(range(config["num_hidden_layers"]))


def test_head_wise_rows_are_the_product_of_layer_groups_and_heads() -> None:
    rows = rows_of(GEMMA3, head_wise=True)
    assert len(rows) == 2 * 4
    assert [r.kv_heads for r in rows] == [(h,) for h in range(4)] * 2
    assert {r.policy for r in rows[:4]} == {W(1024)} and {r.policy for r in rows[4:]} == {Full()}
    assert sum(r.num_cells for r in rows) == 34 * 4


def test_fastdeploy_head_wise_windows_each_ranks_last_kv_heads() -> None:
    """FastDeploy takes each rank's first query heads from full attention: at TP 1 the last kv heads keep the
    window, at TP 2 the last kv head of each rank's pair."""
    full, window = rows_of(FASTDEPLOY)
    assert full == Row(Full(), (0, 1, 2, 3), (0, 1))
    assert window == Row(W(4096, 64), (0, 1, 2, 3), (2, 3))
    assert [(r.policy, r.kv_heads) for r in rows_of(FASTDEPLOY, head_wise=True)] == [
        (Full(), (0,)), (Full(), (1,)), (W(4096, 64), (2,)), (W(4096, 64), (3,))]
    full, window = rows_of(FASTDEPLOY, tp=2)
    assert full == Row(Full(), (0, 1, 2, 3), (0, 2))
    assert window == Row(W(4096, 64), (0, 1, 2, 3), (1, 3))
    # With every other layer full (window_attn_skip_freq 2: layers 0 and 2), the window heads' full layers form a
    # row of their own.
    rows = rows_of({**FASTDEPLOY, "window_attn_skip_freq": 2})
    assert rows == (Row(Full(), (0, 1, 2, 3), (0, 1)), Row(Full(), (0, 2), (2, 3)), Row(W(4096, 64), (1, 3), (2, 3)))


# FastDeploy (develop c1b7c083), restated: per TP rank, append_attn_backend.py:165 takes
#   head_wise_full_hidden = int((1 - head_wise_swa_ratio) * num_heads * head_dim)
# for the rank's num_heads = num_attention_heads // tp (gpu_model_runner.py:1707), and ops/append_attention.py:
# 210-211 copies the full-attention output into those first columns (nothing when it is 0: ratio 0 or 1, where
# every head runs the window). A query head with any full column reads everything; a kv head keeps the window
# only if its whole group (num_heads // kv heads on the rank) is windowed. tests/test_fastdeploy.py checks the
# same cases against FastDeploy's own code where it is importable.
FASTDEPLOY_WINDOW_HEADS = [
    # ratio, query heads, kv heads, head_dim, tp: the global kv heads that keep the window
    (0.5, 16, 4, 128, 1, {2, 3}),
    (0.5, 16, 4, 128, 2, {1, 3}),
    (0.5, 16, 4, 128, 4, set()),  # one kv head per rank, half its query heads full
    (0.75, 64, 8, 128, 1, {2, 3, 4, 5, 6, 7}),
    (0.25, 64, 8, 128, 1, {6, 7}),
    (0.75, 64, 8, 128, 2, {1, 2, 3, 5, 6, 7}),
    (0.25, 64, 8, 128, 4, set()),
    (0.3, 8, 4, 16, 1, {3}),  # 89 full columns: 6 query heads (the 6th partly) -> kv heads 0-2 full
    (0.6, 8, 8, 16, 1, {4, 5, 6, 7}),  # no GQA: 51 columns, the 4th query head partly full
    (0.6, 8, 8, 16, 2, {2, 3, 6, 7}),  # 25 columns a rank: 2 heads
    (0.01, 8, 4, 16, 1, set()),  # a tiny ratio: every query head has a full column
    (0.99, 8, 4, 16, 1, {1, 2, 3}),  # int(0.01 * 128) = 1 column: the first query head reads everything
    (0.999, 8, 4, 16, 1, {0, 1, 2, 3}),  # int(0.128) = 0 columns: no split, the window on every head
    (0.0, 8, 4, 16, 1, {0, 1, 2, 3}),  # FastDeploy's default: no split, the window on every head
    (1.0, 8, 4, 16, 2, {0, 1, 2, 3}),
    (0.5, 8, 2, 16, 4, set()),  # 2 kv heads replicated over 4 ranks: each rank's 2 query heads, one full
    (0.75, 8, 2, 16, 4, set()),  # 8 columns a rank: its first query head partly full
]


@pytest.mark.parametrize(("ratio", "q", "kv", "head_dim", "tp", "expected"), FASTDEPLOY_WINDOW_HEADS)
def test_window_kv_heads_are_those_fastdeploys_attention_windows(ratio, q, kv, head_dim, tp, expected) -> None:
    config = {"head_wise_swa_ratio": ratio, "head_dim": head_dim}
    assert window_kv_heads(config, q, kv, tp) == frozenset(expected)


def test_window_kv_heads_without_a_ratio_or_with_a_bad_one() -> None:
    assert window_kv_heads({"sliding_window": 8}, 8, 4) is None
    assert window_kv_heads({"head_wise_swa_ratio": 0.5, "hidden_size": 128}, 8, 4) == {2, 3}  # head_dim 16
    for config, q, kv, tp, field in [({"head_wise_swa_ratio": 0.5}, 8, 4, 1, "config.head_dim"),
                                     ({"head_wise_swa_ratio": "0.5", "head_dim": 16}, 8, 4, 1, "config.head_wise"),
                                     ({"head_wise_swa_ratio": 0.5, "head_dim": 16}, 8, 4, 3, "num_attention_heads"),
                                     ({"head_wise_swa_ratio": 0.5, "head_dim": 16}, 6, 4, 1, "num_attention_heads")]:
        with pytest.raises(KVCacheError, match=f"^{field}"):
            window_kv_heads(config, q, kv, tp)


@pytest.mark.parametrize(("config", "key"), [
    ({"num_hidden_layers": 4, "layer_types": ["sliding_attention"] * 4}, "layer_types"),
    ({"num_hidden_layers": 4, "sliding_window": 8, "layer_types": ["full_attention"] * 3}, "layer_types"),
    ({"num_hidden_layers": 4, "sliding_window": 8, "layer_types": ["full_attention"] * 3 + ["banded"]},
     "layer_types"),
    ({"num_hidden_layers": 4, "sliding_window": 8, "layer_types": ["chunked_attention"] * 4}, "layer_types"),
    ({"num_hidden_layers": 4, "attention_chunk_size": 0}, "attention_chunk_size"),
    ({"num_hidden_layers": 4, "attention_chunk_size": 64, "no_rope_layers": [1, 0]}, "no_rope_layers"),
    ({"num_hidden_layers": 4, "attention_chunk_size": 64, "sliding_window": 8}, "attention_chunk_size"),
    ({"num_hidden_layers": 4, "sliding_window_pattern": 6}, "sliding_window_pattern"),
    ({"num_hidden_layers": 4, "use_sliding_window": True}, "use_sliding_window"),
    ({"num_hidden_layers": 4, "head_wise_swa_ratio": 0.5}, "head_wise_swa_ratio"),
    ({"num_hidden_layers": 4, "sliding_window": -5, "sink_size": 4}, "sink_size"),
    ({"num_hidden_layers": 4, "sliding_window": "4096"}, "sliding_window"),
    ({"num_hidden_layers": 4, "sliding_window": [4096, 16]}, "sliding_window"),
    ({"num_hidden_layers": 4, "sliding_window": 64, "sink_size": -1}, "sink_size"),
    ({"num_hidden_layers": 4, "sliding_window": 64, "sliding_window_pattern": 0}, "sliding_window_pattern"),
    ({"num_hidden_layers": 4, "sliding_window": 64, "sliding_window_pattern": 2, "window_attn_skip_freq": 2},
     "sliding_window_pattern"),
    ({"num_hidden_layers": 4, "sliding_window": 64, "window_attn_skip_freq": [1, 0]}, "window_attn_skip_freq"),
    ({"num_hidden_layers": 4, "sliding_window": 64, "use_sliding_window": "yes"}, "use_sliding_window"),
    ({"num_hidden_layers": 4, "sliding_window": 64, "use_sliding_window": True, "max_window_layers": -1},
     "max_window_layers"),
    ({"num_hidden_layers": 4, "sliding_window": 64, "head_wise_swa_ratio": 1.5}, "head_wise_swa_ratio"),
])
def test_window_settings_that_cannot_be_read_exactly_are_errors_naming_the_key(config: dict, key: str) -> None:
    with pytest.raises(KVCacheError, match=key):
        rows_of(config, heads=4)


@settings(max_examples=200, deadline=None)
@given(policies=st.lists(st.sampled_from([Full(), W(8), W(8, 4), W(16)]), min_size=1, max_size=12),
       heads=st.integers(1, 6), head_wise=st.booleans(), data=st.data())
def test_rows_cover_every_cell_once_with_its_policy(policies: list, heads: int, head_wise: bool,
                                                    data: st.DataObject) -> None:
    """Every (layer, head) cell is in exactly one row, under its layer's policy (or Full for a head past the
    window heads); rows of one policy never share a cell, and head-wise rows hold one head each."""
    window_heads = data.draw(st.none() | st.frozensets(st.integers(0, heads - 1)))
    rows = derive_rows(policies, heads, head_wise=head_wise, window_heads=window_heads)
    seen: dict[tuple[int, int], object] = {}
    for row in rows:
        assert row.layers == tuple(sorted(row.layers)) and row.kv_heads == tuple(sorted(row.kv_heads))
        if head_wise:
            assert len(row.kv_heads) == 1
        for layer in row.layers:
            for head in row.kv_heads:
                assert (layer, head) not in seen
                seen[(layer, head)] = row.policy
    for layer, policy in enumerate(policies):
        for head in range(heads):
            windowed = isinstance(policy, Window) and (window_heads is None or head in window_heads)
            assert seen[(layer, head)] == (policy if windowed else Full())


def test_transformers_derives_the_same_layer_types() -> None:
    """Where transformers is importable, its own configs' layer_types equal what the pattern fields give here."""
    transformers = pytest.importorskip("transformers")
    cases = [(transformers.Gemma2Config(num_hidden_layers=42, sliding_window=4096), GEMMA2),
             (transformers.Gemma3TextConfig(num_hidden_layers=34, sliding_window=1024), GEMMA3),
             (transformers.Qwen2Config(num_hidden_layers=32, use_sliding_window=True, sliding_window=4096,
                                       max_window_layers=28),
              {"model_type": "qwen2", "num_hidden_layers": 32, "use_sliding_window": True, "sliding_window": 4096,
               "max_window_layers": 28})]
    for theirs, ours in cases:
        expected = tuple(Full() if t == "full_attention" else W(ours["sliding_window"]) for t in theirs.layer_types)
        assert layer_policies(ours, ours["num_hidden_layers"]) == expected


# --------------------------------------------------------------------------- rows in a CacheSpec and in a plan


def test_a_spec_from_a_windowed_config_carries_its_rows_and_their_bytes() -> None:
    """Gemma 3 4B, bf16, block 16: a cell's block is K + V = 2 × 16 × 256 × 2 = 16,384 B; the window row holds
    29 layers × 4 heads, the full row 5 × 4; together every layer's block."""
    from kvcache.allocator import CacheSpec

    spec = CacheSpec.from_hf_config({"text_config": GEMMA3}, block_size=16)
    window, full = spec.row_layout
    assert (window.policy, full.policy) == (W(1024), Full())
    assert spec.row_bytes_per_block(window) == 29 * 4 * 16_384 == 1_900_544
    assert spec.row_bytes_per_block(full) == 5 * 4 * 16_384 == 327_680
    assert spec.row_bytes_per_block(window) + spec.row_bytes_per_block(full) == spec.bytes_per_block
    assert [r.kv_heads for r in CacheSpec.from_hf_config(GEMMA3, block_size=16, head_wise=True).row_layout] == \
        [(h,) for h in range(4)] * 2
    # GPT-OSS 20B over 2 ranks: each rank holds 4 of the 8 heads of every row.
    gpt = CacheSpec.from_hf_config(GPT_OSS, block_size=16, tp_size=2)
    assert [gpt.row_bytes_per_block(r) for r in gpt.row_layout] == [12 * 4 * (2 * 16 * 64 * 2)] * 2
    # Without a window: the default row; DeepSeek-V3's one latent head.
    assert CacheSpec.from_hf_config(LLAMA3).rows is None
    (latent,) = CacheSpec.from_hf_config(DEEPSEEK_V3).row_layout
    assert latent.kv_heads == (0,) and len(latent.layers) == 61


def test_a_spec_refuses_rows_that_miss_or_repeat_a_cell() -> None:
    from kvcache.allocator import CacheSpec

    base = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8}
    for rows, match in [((Row(Full(), (0, 1), (0,)),), "hold 2 of the model's 4"),
                        ((Row(Full(), (0, 1), (0, 1)), Row(W(8), (1,), (1,))), "in two rows"),
                        ((Row(Full(), (0, 1, 2), (0, 1)),), "outside"),
                        ((Row(Full(), (), (0, 1)),), "at least one layer")]:
        with pytest.raises(KVCacheError, match=match):
            CacheSpec(**base, rows=rows)
    assert CacheSpec.from_hf_config(GEMMA3, rows=None).rows is None  # rows given (none) win over the config's


def test_plan_sizes_a_pool_per_row_and_reports_concurrency_against_uniform() -> None:
    """Gemma 3 4B, block 16, 72 GiB (80 GiB × 0.9), requests of 32,768 tokens, 8,192 tokens a step across them: a
    window row holds 1 + cdiv(1022, 16) = 65 blocks of each request and 95 + (8192 − 3 × 95) // 16 = 589 shared
    by 95 of them, the full row 2,048 of each: 95 × (65 × 1,900,544 + 2,048 × 327,680) + 589 × 1,900,544 =
    76,608,700,416 B fit, 96 do not, against 16 with every layer full (2,048 × 2,228,224 B each). Sized for a
    whole chunk per request (577 blocks each), 43 fit."""
    from kvcache.allocator import CacheSpec
    from kvcache.plan import Load, make_plan, plan_json

    spec = CacheSpec.from_hf_config(GEMMA3, block_size=16)
    plan = make_plan(spec, gpu_memory=80 << 30, load=Load(32_768, 256, 8_192))
    window, full = plan.rows
    assert (window.blocks_per_request, window.blocks_per_step, full.blocks_per_request) == (65, 589, 2_048)
    assert 95 * 794_624_000 + 589 * 1_900_544 == 76_608_700_416 <= plan.budget_bytes
    assert 96 * 794_624_000 + 590 * 1_900_544 > plan.budget_bytes and plan.max_concurrency == 95
    assert plan.uniform_concurrency == plan.budget_bytes // (2_048 * 2_228_224) == 16
    assert window.num_blocks * window.bytes_per_block + full.num_blocks * full.bytes_per_block <= plan.budget_bytes
    assert window.num_blocks >= 95 * 65 + 589 and full.num_blocks >= 95 * 2_048
    out = plan_json(plan)
    assert out["max_concurrency"] == 95 and out["uniform_concurrency"] == 16
    assert [(r["kind"], r["blocks_per_request"]) for r in out["rows"]] == [("window", 65), ("full", 2_048)]
    per_request = make_plan(spec, gpu_memory=80 << 30, load=Load(32_768, 256, 8_192, per_request_chunks=True))
    assert [r.blocks_per_request for r in per_request.rows] == [577, 2_048] and per_request.max_concurrency == 43
    # A whole-request chunk per request keeps every block of a 4,096-token request in the window row too.
    short = make_plan(spec, gpu_memory=80 << 30, load=Load(4_096, 256, 4_096, per_request_chunks=True))
    assert [r.blocks_per_request for r in short.rows] == [256, 256]


def test_rows_that_share_a_layer_share_one_pool_size() -> None:
    """A layer's tensors have one block count: FastDeploy's window heads share their layers with full heads, so
    every row gets the full rows' count; Gemma 3 head-wise keeps a smaller pool for the sliding group's rows."""
    from kvcache.allocator import CacheSpec
    from kvcache.plan import Load, make_plan

    load = Load(32_768, 256, 8_192)
    fastdeploy = make_plan(CacheSpec.from_hf_config(FASTDEPLOY, block_size=16, head_wise=True),
                           gpu_memory=80 << 30, load=load)
    assert {r.blocks_per_request for r in fastdeploy.rows} == {2_048}
    assert len({r.num_blocks for r in fastdeploy.rows}) == 1
    gemma = make_plan(CacheSpec.from_hf_config(GEMMA3, block_size=16, head_wise=True), gpu_memory=80 << 30, load=load)
    counts = [(r.row.policy, r.num_blocks) for r in gemma.rows]
    assert len(set(counts)) == 2 and counts[0][1] < counts[-1][1]
    assert [r.blocks_per_request for r in gemma.rows] == [65] * 4 + [2_048] * 4


def test_serve_takes_its_rows_from_the_config(tmp_path) -> None:
    """`kvcache serve --model` serves the config's rows: layer groups by default, per (group, kv head) with
    --head-wise, FastDeploy's window heads (at --tp) as rows; --rows given wins; a --rows count that is neither one nor
    one per kv head is refused by name."""
    import json

    from kvcache.config import ServeConfig
    from kvcache.serve import build_manager

    fastdeploy, gemma = tmp_path / "fastdeploy.json", tmp_path / "gemma3.json"
    fastdeploy.write_text(json.dumps(FASTDEPLOY))
    gemma.write_text(json.dumps(GEMMA3))
    base = {"endpoint": f"ipc://{tmp_path}/d.sock", "num_blocks": 64, "block_size": 16}
    manager, layout, _ = build_manager(ServeConfig(**base, model=str(fastdeploy), head_wise=True).resolved())
    assert layout == rows_of(FASTDEPLOY, head_wise=True)
    assert manager.rows == (Full(), Full(), W(4096, 64), W(4096, 64))
    _, layout, _ = build_manager(ServeConfig(**base, model=str(fastdeploy), head_wise=True, tp=2).resolved())
    assert layout == rows_of(FASTDEPLOY, head_wise=True, tp=2), "--tp 2: each rank's last kv head keeps the window"
    assert [row.policy for row in layout] == [Full(), W(4096, 64), Full(), W(4096, 64)]
    _, layout, _ = build_manager(ServeConfig(**base, model=str(fastdeploy), head_wise=True,
                                             rows="window:128*4").resolved())
    assert layout == tuple(Row(W(128), (0, 1, 2, 3), (h,)) for h in range(4)), "rows given win over the config's"
    manager, layout, extra = build_manager(ServeConfig(**base, model=str(gemma)).resolved())
    assert layout == rows_of(GEMMA3) and manager.rows == (W(1024), Full())
    assert extra["num_layers"] == 34 and manager.row_blocks.tolist() == [64, 64]
    manager, layout, _ = build_manager(ServeConfig(**base, model=str(gemma), head_wise=True).resolved())
    assert layout == rows_of(GEMMA3, head_wise=True) and manager.num_rows == 8
    with pytest.raises(KVCacheError, match=r"^rows: 3 policies given; with --model give one"):
        build_manager(ServeConfig(**base, model=str(gemma), rows="full,full,full").resolved())


def test_serve_sizes_each_rows_pool_as_the_plan_does(tmp_path) -> None:
    """Sized from --gpu-memory with --max-model-len, each row's pool is what the requests the budget fits hold of
    it, plus the leftover budget's share of one request more (hand arithmetic for Gemma 3 4B, 72 GiB, 32k
    requests, 8k tokens a step); without --max-model-len every row gets the uniform count; --max-model-len with
    --num-blocks is refused."""
    import json

    from kvcache.config import ServeConfig
    from kvcache.serve import build_manager

    gemma = tmp_path / "gemma3.json"
    gemma.write_text(json.dumps(GEMMA3))
    base = {"endpoint": f"ipc://{tmp_path}/d.sock", "block_size": 16, "model": str(gemma)}
    manager, _, extra = build_manager(ServeConfig(**base, max_model_len=32_768,
                                                  max_num_batched_tokens=8_192).resolved())
    budget = int((80 << 30) * 0.9)
    cell = 256 * 2 * 2 * 16  # K and V of one kv head, bf16, 16 tokens
    window_bytes, full_bytes = 29 * 4 * cell, 5 * 4 * cell
    window_blocks, full_blocks = 1 + -(-1022 // 16), 32_768 // 16  # 65, 2,048 of each request

    def pools(n: int) -> tuple[int, int]:  # 95 requests: 95 + (8192 - 3 × 95) // 16 window blocks shared
        return n * window_blocks + n + (8_192 - 3 * n) // 16, n * full_blocks

    def cost(n: int) -> int:
        return window_bytes * pools(n)[0] + full_bytes * pools(n)[1]

    assert cost(95) <= budget < cost(96)  # requests of 32k at once: each pool holds them
    spare = (budget - cost(95)) / (cost(96) - cost(95))
    assert manager.row_blocks.tolist() == [now + int(spare * (then - now)) for now, then in zip(pools(95), pools(96))]
    assert budget - window_bytes - full_bytes < extra["cache_bytes_per_rank"] <= budget
    uniform, _, _ = build_manager(ServeConfig(**base).resolved())
    assert uniform.row_blocks.tolist() == [budget // (34 * 4 * cell)] * 2
    with pytest.raises(KVCacheError, match=r"^max_model_len: sizes each row's pool from --gpu-memory"):
        build_manager(ServeConfig(**base, num_blocks=64, max_model_len=4096).resolved())


@pytest.mark.skipif(__import__("kvcache.bench.vllm", fromlist=["version"]).version() is None,
                    reason="vllm is not importable")
def test_plan_concurrency_matches_vllms_hybrid_planner() -> None:
    """vLLM 0.33's own hybrid planner on Gemma 3 4B's layers (72 GiB, requests of 32,768 tokens): our plan, given
    the tokens vLLM keeps in flight and sized per request as vLLM sizes it, fits the requests vLLM fits, up to
    vLLM's padding of its layer groups."""
    from kvcache.allocator import CacheSpec
    from kvcache.bench import vllm
    from kvcache.plan import Load, make_plan

    spec = CacheSpec.from_hf_config(GEMMA3, block_size=16)
    windows = [None if isinstance(p, Full) else p.window_tokens for p in layer_policies(GEMMA3, 34)]
    budget = int((80 << 30) * 0.9)
    theirs = vllm.hybrid_concurrency(windows, 4, 256, 16, 32_768, 8_192, budget)
    plan = make_plan(spec, gpu_memory=80 << 30, load=Load(32_768, 256, theirs["max_in_flight_tokens"],
                                                          per_request_chunks=True))
    assert theirs["max_concurrency"] <= plan.budget_bytes / sum(r.bytes_per_block * r.blocks_per_request
                                                                for r in plan.rows) <= theirs["max_concurrency"] * 1.05
    assert plan.uniform_concurrency < plan.max_concurrency


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4), data=st.data())
def test_rows_with_pools_of_their_own_hand_out_only_their_blocks(sizes: list[int], data: st.DataObject) -> None:
    """A manager whose rows have pools of different sizes: each row hands out ids below its size and refuses an
    admit its smallest pool cannot hold; usage is per row's own pool; the pool's invariants hold throughout."""
    from kvcache.allocator import KVCacheManager

    policies = [W(4 * (i + 1)) if i else Full() for i in range(len(sizes))]  # distinct: a pool each
    m = KVCacheManager(max(sizes), 2, policies, row_blocks=sizes, hash_seed=b"x")
    assert m.row_blocks.tolist() == sizes and m.usage.max == 0.0
    live = []
    for rid, length in enumerate(data.draw(st.lists(st.integers(1, 12), max_size=8))):
        free = m.num_free_blocks.tolist()
        admission = m.admit(rid, list(range(100 * rid, 100 * rid + length)))  # distinct tokens: no prefix hit
        assert (admission is None) == (-(-length // 2) > min(free)), "refused exactly when a row lacks room"
        if admission is None:
            continue
        live.append(rid)
        table = m.table(rid)
        for row, size in enumerate(sizes):
            assert ((table[row] == -1) | (table[row] < size)).all()
        m.check_integrity()
    assert (m.usage.per_row <= 1).all()
    for rid in live:
        m.free(rid)
    m.check_integrity()
    assert m.usage.max == 0.0


def test_row_pool_sizes_are_checked() -> None:
    from kvcache.allocator import KVCacheManager

    for rows, sizes, match in [([Full(), W(8)], [4], "one count per row"),
                               ([Full(), W(8)], [4, 0], r"row_blocks\[1\]"),
                               ([Full(), W(8)], [4, 9], "row_blocks"),
                               ([Full(), W(8), W(8)], [4, 3, 2], "share a pool")]:
        with pytest.raises(KVCacheError, match=match):
            KVCacheManager(8, 4, rows, row_blocks=sizes)


def _config_rows() -> list:
    """The policies of the rows a FastDeploy head-wise config gives (window head 1 of 2, every other layer full),
    head-wise: the product of layer groups and kv heads."""
    config = {"num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 8, "window_size": 6, "sink_size": 2,
              "window_attn_skip_freq": 2, "head_wise_swa_ratio": 0.5}
    rows = derive_rows(layer_policies(config, 4), 2, head_wise=True, window_heads=window_kv_heads(config, 4, 2))
    return [row.policy for row in rows]


def test_a_config_gives_the_product_rows_the_machine_below_runs() -> None:
    assert _config_rows() == [Full(), Full(), W(6, 2)]


from test_manager import MACHINE_SETTINGS, ManagerMachine  # noqa: E402 - the manager's model-checked machine


class ConfigRowsMachine(ManagerMachine):
    """Admits, extends, frees and resets on a manager with a config's layer-group × head-wise rows, against the
    brute-force reference: no block a query can still see is given back, every hit the reference finds is found."""

    rows = _config_rows()


TestConfigRowsManager = ConfigRowsMachine.TestCase
TestConfigRowsManager.settings = MACHINE_SETTINGS


def test_a_rows_tensors_hold_its_kv_heads_on_a_rank() -> None:
    """A row's per-layer tensors are the layer's over the row's heads on a rank; their bytes make the row's block."""
    from kvcache.allocator import CacheSpec

    spec = CacheSpec.from_hf_config(GEMMA3, block_size=16, tp_size=2, quant="block_wise_fp8", head_wise=True)
    row = spec.row_layout[0]
    key, value, key_scale, value_scale = spec.row_tensors(row)
    assert key.shape(10) == (10, 1, 16, 256) and key.dtype == "float8_e4m3fn" and key_scale.block_shape == (1, 16)
    assert spec.row_bytes_per_block(row) == 29 * (2 * 16 * 256 + 2 * 16 * 2)
    layers = CacheSpec.from_hf_config(GEMMA3, block_size=16, tp_size=2)
    assert [t.block_shape for t in layers.row_tensors(layers.row_layout[0])] == [(2, 16, 256)] * 2


def test_head_wise_rows_over_ranks_fit_what_layer_group_rows_fit() -> None:
    """The budget is one rank's: head-wise rows of other ranks' heads do not count against it, so a head-wise plan
    over 2 ranks fits what the layer-group plan fits, about twice the 1-rank plan."""
    from kvcache.allocator import CacheSpec
    from kvcache.plan import Load, make_plan

    load = Load(32_768, 256, 8_192)
    plans = {(tp, hw): make_plan(CacheSpec.from_hf_config(GEMMA3, block_size=16, tp_size=tp, head_wise=hw),
                                 gpu_memory=80 << 30, load=load) for tp in (1, 2) for hw in (False, True)}
    assert plans[(2, True)].max_concurrency == plans[(2, False)].max_concurrency
    assert plans[(1, True)].max_concurrency == plans[(1, False)].max_concurrency == 95
    # At tp 2 a block costs half: 192 × 397,312,000 + (192 + (8192 − 576) // 16) × 950,272 B fit, 193 do not.
    assert 192 * 397_312_000 + 668 * 950_272 <= plans[(2, False)].budget_bytes < 193 * 397_312_000 + 667 * 950_272
    assert plans[(2, False)].max_concurrency == 192


def test_the_readmes_layer_group_snippet_runs(tmp_path) -> None:
    """README's library snippet: a config's rows, a plan's pools, and a manager over them that admits and frees."""
    import json

    from kvcache.allocator import CacheSpec, KVCacheManager
    from kvcache.plan import Load, make_plan

    (tmp_path / "config.json").write_text(json.dumps({"text_config": GEMMA3}))
    spec = CacheSpec.from_hf_config(str(tmp_path / "config.json"), block_size=16)
    plan = make_plan(spec, gpu_memory=80 << 30, load=Load(max_model_len=32_768, max_num_seqs=256,
                                                          max_num_batched_tokens=8_192))
    cache = KVCacheManager(max(r.num_blocks for r in plan.rows), 16, [r.row.policy for r in plan.rows],
                           row_blocks=[r.num_blocks for r in plan.rows])
    assert cache.row_blocks.tolist() == [r.num_blocks for r in plan.rows] and plan.max_concurrency == 95
    adm = cache.admit("req-1", list(range(40_000)))  # past the window: the window row still holds it all (prefill)
    assert adm is not None and adm.table.shape[0] == 2
    cache.extend("req-1", [7])
    table = cache.table("req-1")
    assert (table[0, :(40_001 - 1024) // 16 - 1] == -1).all() and (table[1] >= 0).all(), "the window gave blocks back"
    cache.free("req-1")
    cache.check_integrity()

"""`kvcache plan`: sizing from flags, configs and examples; table and JSON output; errors."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvcache.allocator import CacheSpec, KVCacheError
from kvcache.cli import main
from kvcache.examples import example_models
from kvcache.plan import make_plan
from kvcache.units import format_bytes, parse_size


def run_cli(*argv: str, capsys) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_sizes_parse_decimal_and_binary_units():
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("80G") == 80 * 2**30
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("1.5 TiB") == int(1.5 * 2**40)
    assert parse_size("4096") == 4096
    assert parse_size(7) == 7


@pytest.mark.parametrize("text", ["", "GiB", "80 parsecs", "-1GiB", "1e9"])
def test_unreadable_sizes_name_the_field(text):
    with pytest.raises(KVCacheError, match="--gpu-memory"):
        parse_size(text, "--gpu-memory")


def test_format_bytes_uses_binary_units():
    assert format_bytes(72 * 2**30) == "72 GiB"
    assert format_bytes(512) == "512 B"


def test_plan_budget_is_memory_times_utilization_minus_reserve():
    spec = CacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, block_size=16)
    plan = make_plan(spec, gpu_memory=10 * 2**20, utilization=0.5, reserve=2**20)
    assert plan.budget_bytes == 4 * 2**20
    assert plan.num_blocks == 4 * 2**20 // 131_072 == 32
    assert plan.max_tokens == 32 * 16


def test_plan_host_tier_holds_every_ranks_share_of_a_block():
    spec = CacheSpec(num_layers=2, num_kv_heads=8, head_dim=128, block_size=16, tp_size=4)
    plan = make_plan(spec, gpu_memory=2**30, host_memory=131_072 * 10)
    assert plan.host_num_blocks == 10


def test_plan_that_fits_no_block_is_an_error():
    spec = CacheSpec(num_layers=80, num_kv_heads=8, head_dim=128)
    with pytest.raises(KVCacheError, match="fits no block"):
        make_plan(spec, gpu_memory=2**20)
    with pytest.raises(KVCacheError, match="utilization"):
        make_plan(spec, gpu_memory=2**30, utilization=1.5)


def test_plan_json_has_the_promised_keys(capsys):
    code, out, _ = run_cli(
        "plan", "--example", "llama-3.1-70b", "--gpu-memory", "80GiB", "--utilization", "0.9",
        "--quant", "block_wise_fp8", "--scale-layout", "default", "--block-size", "64",
        "--dtype", "bfloat16", "--tp", "8", "--json", capsys=capsys,
    )
    assert code == 0
    plan = json.loads(out)
    # 1 kv head per rank: K+V fp8 2*64*128, scales 2*64 bf16.
    assert plan["bytes_per_block_per_layer"] == 2 * 64 * 128 + 2 * 64 * 2
    assert plan["bytes_per_block"] == plan["bytes_per_block_per_layer"] * 80
    assert plan["num_blocks"] == int(80 * 2**30 * 0.9) // plan["bytes_per_block"]
    assert plan["max_tokens"] == plan["num_blocks"] * 64
    names = [t["name"] for t in plan["tensors"]]
    assert names == ["key", "value", "key_scale", "value_scale"]
    assert plan["tensors"][2]["shape"] == [plan["num_blocks"], 1, 64]
    assert sum(t["bytes"] for t in plan["tensors"]) == plan["num_blocks"] * plan["bytes_per_block_per_layer"]


def test_plan_from_config_file_matches_explicit_geometry(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    }))
    _, from_file, _ = run_cli("plan", "--model", str(tmp_path), "--json", capsys=capsys)
    _, explicit, _ = run_cli("plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--json",
                             capsys=capsys)
    a, b = json.loads(from_file), json.loads(explicit)
    for key in ("bytes_per_block", "num_blocks", "max_tokens", "tensors"):
        assert a[key] == b[key]


def test_plan_table_shows_tensors_blocks_tokens_and_host(capsys):
    code, out, _ = run_cli("plan", "--example", "deepseek-v3", "--quant", "fp8", "--host-memory", "1TiB",
                           capsys=capsys)
    assert code == 0
    for text in ("latent", "uint8", "41,984", "blocks that fit", "tokens that fit", "host blocks that fit"):
        assert text in out


@pytest.mark.parametrize("name", example_models())
def test_every_example_plans(name, capsys):
    code, out, _ = run_cli("plan", "--example", name, "--json", capsys=capsys)
    assert code == 0 and json.loads(out)["num_blocks"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--example", "gpt-9"], "unknown model 'gpt-9'"),
        (["--kv-heads", "8", "--head-dim", "128"], "--layers"),
        (["--layers", "2", "--kv-heads", "6", "--head-dim", "128", "--tp", "4"], "6 kv heads cannot be split"),
        (["--gpu-memory", "lots"], "--gpu-memory"),
        (["--gpu-memory", "1MiB"], "fits no block"),
        (["--model", "/nonexistent/config.json"], "cannot read"),
        (["--model", "x", "--example", "qwen3-8b"], "not both"),
    ],
)
def test_bad_plan_flags_exit_2_with_a_message(argv, message, capsys):
    code, out, err = run_cli("plan", *argv, capsys=capsys)
    assert code == 2
    assert out == ""
    assert message in err


def test_help_explains_every_plan_flag():
    result = subprocess.run([sys.executable, "-m", "kvcache", "plan", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for flag in ("--model", "--example", "--layers", "--kv-heads", "--head-dim", "--head-dim-v", "--kv-lora-rank",
                 "--rope-dim", "--block-size", "--dtype", "--quant", "--scale-layout", "--tp", "--gpu-memory",
                 "--utilization", "--reserve", "--host-memory", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--per-request-chunks", "--json"):
        assert flag in result.stdout
    top = subprocess.run([sys.executable, "-m", "kvcache", "--help"], capture_output=True, text=True)
    assert top.returncode == 0 and "plan" in top.stdout

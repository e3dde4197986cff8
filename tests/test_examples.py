"""The shipped example configs (``--example NAME``): each is a published model's config.json that
``CacheSpec.from_hf_config`` reads into the layer groups and windows the model has."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache.allocator import CacheSpec, Full, Window
from kvcache.examples import example_models, load_example
from kvcache.plan import Load, make_plan

# name: (published model id, layers, kv heads, head size, {policy: layers of it}); MLA models: head size of the latent.
EXPECTED = {
    "deepseek-v3": ("deepseek-ai/DeepSeek-V3", 61, 1, 576, {Full(): 61}),
    "gemma-3-4b": ("google/gemma-3-4b-it", 34, 4, 256, {Window(1024): 29, Full(): 5}),
    "gemma-3-27b": ("google/gemma-3-27b-it", 62, 16, 128, {Window(1024): 52, Full(): 10}),
    "gpt-oss-20b": ("openai/gpt-oss-20b", 24, 8, 64, {Window(128): 12, Full(): 12}),
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B-Instruct", 32, 8, 128, {Full(): 32}),
    "llama-3.1-70b": ("meta-llama/Llama-3.1-70B-Instruct", 80, 8, 128, {Full(): 80}),
    "mistral-7b-v0.1": ("mistralai/Mistral-7B-v0.1", 32, 8, 128, {Window(4096): 32}),
    "qwen3-8b": ("Qwen/Qwen3-8B", 36, 8, 128, {Full(): 36}),
}


def test_every_shipped_example_is_specified_here():
    """A new example config comes with its expected geometry in this file."""
    assert sorted(EXPECTED) == example_models()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_gives_the_models_layer_groups_and_windows(name):
    model_id, layers, heads, head_dim, groups = EXPECTED[name]
    config = load_example(name)
    assert config["_name_or_path"] == model_id
    spec = CacheSpec.from_hf_config(config, block_size=16)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (layers, heads, head_dim)
    got = {row.policy: len(row.layers) for row in spec.row_layout}
    assert got == groups
    assert sorted(layer for row in spec.row_layout for layer in row.layers) == list(range(layers))


def test_gemma_3_4b_fits_95_requests_of_32k_tokens_in_72_gib():
    """The README's and benchmarks' figure: a pool per row holds 95 such requests, 16 with every layer full."""
    spec = CacheSpec.from_hf_config(load_example("gemma-3-4b"), block_size=16)
    plan = make_plan(spec, gpu_memory=80 << 30, load=Load(32_768, 256, 8_192))
    assert (plan.max_concurrency, plan.uniform_concurrency) == (95, 16)


def test_gpt_oss_windowed_layers_alternate_from_the_first():
    spec = CacheSpec.from_hf_config(load_example("gpt-oss-20b"), block_size=16)
    window = next(row for row in spec.row_layout if isinstance(row.policy, Window))
    assert window.layers == tuple(range(0, 24, 2))


@pytest.mark.parametrize("name", ["gemma-3-27b", "gpt-oss-20b", "mistral-7b-v0.1"])
def test_plan_example_cli_sizes_each_row(name):
    result = subprocess.run([sys.executable, "-m", "kvcache", "plan", "--example", name, "--max-model-len", "32768",
                             "--json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["num_blocks"] > 0
    assert len(plan["rows"]) == len(EXPECTED[name][4])


def test_examples_the_docs_name_are_shipped():
    """Every ``--example NAME``, ``load_example("NAME")`` and ``--model NAME`` (a name, not a path) in the README
    and docs/ names a shipped config, and the README lists every shipped one."""
    root = Path(__file__).resolve().parents[1]
    shipped = set(example_models())
    pattern = re.compile(r"--example[ =]([\w.-]+)|load_example\(\"([^\"]+)\"\)|--model[ =]([\w.-]+)(?=[\s`])")
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for match in pattern.finditer(doc.read_text()):
            name = next(g for g in match.groups() if g)
            if name not in ("NAME", "DIR", "...") and not name.endswith(".json"):  # a path is the reader's own
                assert name in shipped, f"{doc.name} names example {name!r}; shipped: {', '.join(sorted(shipped))}"
    readme = (root / "README.md").read_text()
    assert not [n for n in shipped if f"`{n}`" not in readme], "README.md's list of examples misses one"

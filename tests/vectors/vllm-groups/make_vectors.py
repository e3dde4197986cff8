"""Writes vllm-0.33-kv-cache-groups.json: how vLLM 0.33 groups the KV cache of published and FastDeploy configs.

Run it where vLLM 0.33 and kvcache are installed (it runs on a CPU; ``../shared/tools/setup-vllm.sh`` builds such an
environment, then ``pip install --no-deps -e .`` there), from the repository root::

    python tests/vectors/vllm-groups/make_vectors.py > tests/vectors/vllm-groups/vllm-0.33-kv-cache-groups.json

Each case lists its units in vLLM's order and each one's attention, read here from the config, not by kvcache:
a Hugging Face config through transformers' config class (``layer_types``; else ``sliding_window`` on every layer,
as vLLM's cache config applies it to a model without per-layer types), a FastDeploy head-wise config by FastDeploy's
rule (layer i windowed unless ``i % window_attn_skip_freq == 0``; at TP 1 the first ``int((1 - head_wise_swa_ratio)
* query heads * head_dim)`` output columns come from full attention (FastDeploy's ``head_wise_full_hidden``), so a
kv head keeps the window only if none of its query heads has a full column). vLLM has no attention policy per kv
head, so a head-wise config's units are its (layer, kv head) cells, each a layer of one kv head. The groups are
vLLM's own: ``get_kv_cache_groups`` and the groups of ``get_kv_cache_configs``' plan, which must agree
(``kvcache.bench.vllm.kv_cache_groups``).
"""
from __future__ import annotations

import json
import sys

import transformers
import vllm

from kvcache.bench.vllm import kv_cache_groups
from kvcache.examples import load_example

FASTDEPLOY = {"num_hidden_layers": 28, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
              "window_size": 1024, "sink_size": 64, "window_attn_skip_freq": 4}


def hf_units(config: dict) -> tuple[list[tuple[str, tuple]], int, int]:
    """Per layer ("layers.i", (kind, size)), kv heads and head size, as transformers' config class fills them."""
    config = config.get("text_config", config) if config.get("model_type") == "gemma3" else config
    model_type = config["model_type"]
    hf = transformers.CONFIG_MAPPING[model_type](**{k: v for k, v in config.items() if k != "model_type"})
    types = getattr(hf, "layer_types", None) or (["sliding_attention"] * hf.num_hidden_layers if hf.sliding_window
                                                 else ["full_attention"] * hf.num_hidden_layers)
    units = [(f"layers.{i}", ("window", hf.sliding_window) if t == "sliding_attention" else ("full", None))
             for i, t in enumerate(types)]
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return units, hf.num_key_value_heads, head_dim


def fastdeploy_units(config: dict) -> tuple[list[tuple[str, tuple]], int, int]:
    """Per (layer, kv head) cell ("layers.i.heads.h", (kind, size)) by FastDeploy's head-wise rule."""
    heads, query_heads, head_dim = config["num_key_value_heads"], config["num_attention_heads"], config["head_dim"]
    full_columns = int((1 - config["head_wise_swa_ratio"]) * query_heads * head_dim)
    group = query_heads // heads
    units = []
    for i in range(config["num_hidden_layers"]):
        windowed = i % config["window_attn_skip_freq"] != 0
        units += [(f"layers.{i}.heads.{h}", ("window", config["window_size"])
                   if windowed and h * group * head_dim >= full_columns else ("full", None)) for h in range(heads)]
    return units, 1, config["head_dim"]


CASES = [("gemma-3-4b", load_example("gemma-3-4b"), False), ("gemma-3-27b", load_example("gemma-3-27b"), False),
         ("gpt-oss-20b", load_example("gpt-oss-20b"), False), ("mistral-7b-v0.1", load_example("mistral-7b-v0.1"), False),
         ("fastdeploy-head-wise-0.75", {**FASTDEPLOY, "head_wise_swa_ratio": 0.75}, True),
         ("fastdeploy-head-wise-0.25", {**FASTDEPLOY, "head_wise_swa_ratio": 0.25}, True)]

cases = []
for name, config, head_wise in CASES:
    units, kv_heads, head_dim = fastdeploy_units(config) if head_wise else hf_units(config)
    cases.append({"name": name, "config": name if not head_wise else config, "head_wise": head_wise,
                  "units": [[unit, kind, size] for unit, (kind, size) in units],
                  "groups": kv_cache_groups(units, kv_heads, head_dim)})
json.dump({"source": f"vLLM {vllm.__version__}: vllm.v1.core.kv_cache_planning.get_kv_cache_groups and the "
                     f"kv_cache_groups of get_kv_cache_configs (after get_global_kv_cache_groups), bf16, block 16, "
                     f"hybrid KV cache manager on",
           "command": "python tests/vectors/vllm-groups/make_vectors.py",
           "cases": cases}, sys.stdout, indent=1)
sys.stdout.write("\n")

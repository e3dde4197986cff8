"""examples/engine/generate.py on Hugging Face checkpoints: the engine's greedy tokens equal transformers'.

The checkpoints are tiny Llama 3, Qwen3, Mistral and Gemma 3 models in their real tensor names and shapes,
written from numpy (``examples/engine/checkpoints.py``); transformers computed the expected tokens from the same
bytes (``tests/vectors/engine/make_expected.py``, provenance in ``expected.json``). Blocks of 5 tokens split the
prompts mid-block, and the Mistral and Gemma 3 windows (8 and 12 tokens) are shorter than every prompt.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("paddle")
pytest.importorskip("safetensors")
ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "examples" / "engine"
VECTORS = ROOT / "tests" / "vectors" / "engine"
sys.path.insert(0, str(ENGINE))

import checkpoint  # noqa: E402
import checkpoints  # noqa: E402
import generate  # noqa: E402

from kvcache.allocator.errors import KVCacheError  # noqa: E402

EXPECTED = json.loads((VECTORS / "expected.json").read_text())["models"]
BLOCK_SIZE = 5


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every tiny checkpoint, written once for the module."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: checkpoints.write(name, root / name) for name in checkpoints.CONFIGS}


def test_the_checkpoints_are_the_bytes_transformers_read(folders: dict[str, Path]) -> None:
    """The files written here are the ones the expected tokens were computed from, byte for byte."""
    for name, folder in folders.items():
        got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}
        assert got == EXPECTED[name]["files"], f"{name}: the checkpoint writer no longer writes what transformers read"


def test_the_cases_split_blocks_and_outgrow_windows() -> None:
    """Every prompt ends mid-block; every window is shorter than every prompt; the second wave extends the first."""
    for name, case in EXPECTED.items():
        lengths = [len(p) for p in case["prompts"]]
        assert all(n % BLOCK_SIZE for n in lengths), name
        window = checkpoints.CONFIGS[name].get("sliding_window")
        assert window is None or window < min(lengths), name
        half = len(case["prompts"]) // 2
        assert [p[:len(q)] for p, q in zip(case["prompts"][half:], case["prompts"])] == case["prompts"][:half]


@pytest.mark.parametrize("daemon", [False, True], ids=["library", "daemon"])
@pytest.mark.parametrize("name", list(checkpoints.CONFIGS))
def test_the_engine_generates_what_transformers_generates(folders: dict[str, Path], name: str, daemon: bool) -> None:
    """Greedy tokens over paged tables (a KVCacheManager, or a real `kvcache serve`) equal transformers' stored
    ones, their logits within 1e-3; the second wave found the first wave's prefixes cached."""
    case = EXPECTED[name]
    hits = [0, 0]

    def count(wave: int, engine: object, stats: object) -> None:
        hits[wave] += stats.hit  # type: ignore[attr-defined]

    got = generate.serve(folders[name], case["prompts"], case["max_new_tokens"], daemon=daemon,
                         block_size=BLOCK_SIZE, num_blocks=64, keep_logits=True, on_step=count)
    assert [s.generated for s in got] == case["tokens"]
    # Each chosen token's logit as transformers computed it (Gemma's soft-capped ones too), to float32 rounding.
    chosen = [[float(row[t]) for row, t in zip(s.logits, s.generated)] for s in got]
    assert np.abs(np.array(chosen) - np.array(case["logits"])).max() < 1e-3
    assert hits[1] >= 40, f"the second wave found {hits[1]} tokens cached"


@pytest.mark.parametrize("name", list(checkpoints.CONFIGS))
def test_a_wrong_rms_norm_eps_fails_the_comparison(folders: dict[str, Path], tmp_path: Path, name: str) -> None:
    """Each checkpoint feeds an RMSNorm something as small as its ``rms_norm_eps`` (layer 0's keys, or the
    embeddings): read as the other common value (1e-5 for 1e-6, or the reverse), the engine's first logits leave
    transformers' by far more than the comparison's 1e-3, and its tokens differ."""
    case = EXPECTED[name]
    eps = checkpoints.CONFIGS[name]["rms_norm_eps"]
    folder = _edit(folders[name], tmp_path, rms_norm_eps={1e-5: 1e-6, 1e-6: 1e-5}[eps])
    got = generate.serve(folder, case["prompts"], case["max_new_tokens"], block_size=BLOCK_SIZE, num_blocks=64,
                         keep_logits=True)
    first = [float(s.logits[0][tokens[0]]) for s, tokens in zip(got, case["tokens"])]
    assert np.abs(np.array(first) - np.array(case["logits"])[:, 0]).max() > 0.1
    assert [s.generated for s in got] != case["tokens"]


def test_a_tensor_the_model_has_no_use_for_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    """A bias in a Llama checkpoint (the config says none): one line naming it, not a model that ignores it."""
    from safetensors.numpy import save_file

    folder = _edit(folders["llama3"], tmp_path)
    weights = checkpoints.tensors("llama3")
    weights["model.layers.1.self_attn.q_proj.bias"] = np.zeros(64, dtype=np.float32)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(KVCacheError, match=r"^weights: model.layers.1.self_attn.q_proj.bias is not a tensor of a "
                                           r"llama model \(1 such\)$"):
        checkpoint.load(folder)


def test_the_command_prints_steps_and_the_tokens_as_json(folders: dict[str, Path], tmp_path: Path) -> None:
    """generate.py through a daemon: a line per step, and the tokens as JSON on the last line."""
    case = EXPECTED["mistral"]
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(case["prompts"]))
    out = subprocess.run([sys.executable, str(ENGINE / "generate.py"), "--model", str(folders["mistral"]),
                          "--prompts", str(prompts), "--max-new-tokens", str(case["max_new_tokens"]), "--json",
                          "--daemon", "--block-size", str(BLOCK_SIZE)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert json.loads(lines[-1]) == case["tokens"]
    assert any(line.startswith("wave 1 step") and " 0 found cached" not in line for line in lines)


def test_without_json_each_prompt_gets_a_readable_line(folders: dict[str, Path], tmp_path: Path) -> None:
    case = EXPECTED["llama3"]
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(case["prompts"]))
    out = subprocess.run([sys.executable, str(ENGINE / "generate.py"), "--model", str(folders["llama3"]),
                          "--prompts", str(prompts), "--max-new-tokens", "3"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"prompt 3 ({len(case['prompts'][3])} tokens): {case['tokens'][3][:3]}" in out.stdout


def test_eos_stops_a_prompt_at_that_token(folders: dict[str, Path]) -> None:
    """With ``eos`` each prompt ends at its first sampling of it (included); without, all run to the limit."""
    case = EXPECTED["mistral"]
    eos = case["tokens"][0][2]
    got = generate.generate(folders["mistral"], case["prompts"], case["max_new_tokens"], eos=eos,
                            block_size=BLOCK_SIZE, num_blocks=64)
    assert got == [t[:t.index(eos) + 1] if eos in t else t for t in case["tokens"]]
    assert len(got[0]) == 3


def test_bfloat16_tensors_widen_to_float32_exactly(folders: dict[str, Path]) -> None:
    """Gemma 3's checkpoint is bfloat16: each value read is the float32 one rounded to bfloat16 (nearest even)."""
    read = checkpoint.read_tensors(folders["gemma3"])
    want = checkpoints.tensors("gemma3")
    assert set(read) == set(want)
    for key, value in want.items():
        bits = value.view(np.uint32).astype(np.uint64)
        rounded = (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
        assert read[key].dtype == np.float32 and np.array_equal(read[key], rounded), key
    assert not np.array_equal(read["model.norm.weight"], want["model.norm.weight"])  # bfloat16 did round


def test_a_sharded_checkpoint_reads_every_shard(folders: dict[str, Path]) -> None:
    index = json.loads((folders["qwen3"] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    read = checkpoint.read_tensors(folders["qwen3"])
    want = checkpoints.tensors("qwen3")
    assert set(read) == set(want) and all(np.array_equal(read[k], want[k]) for k in want)


def _edit(folder: Path, tmp_path: Path, **changes: object) -> Path:
    """A copy of a checkpoint folder with config.json changed (a value of None removes the key)."""
    out = tmp_path / "edited"
    out.mkdir()
    for p in folder.iterdir():
        (out / p.name).write_bytes(p.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return out


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "qwen2"}, "config.model_type: 'qwen2' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "config.rope_scaling: rope_type 'yarn' is not supported"),
    ({"attention_bias": True}, "config.attention_bias: biases are not supported"),
    ({"hidden_act": "relu"}, "config.hidden_act: 'relu' is not supported"),
    ({"sink_size": 4}, "config.sink_size: not part of a llama model"),
    ({"sliding_window": 16}, "config.sliding_window: a llama model attends in full"),
    ({"num_hidden_layers": 3}, "weights: model.layers.2.input_layernorm.weight is missing"),
    ({"intermediate_size": 96}, "weights: model.layers.0.mlp.gate_proj.weight has shape [128, 64], the config says "
                                "[96, 64]"),
    ({"model_type": "qwen3"}, "weights: model.layers.0.self_attn.q_norm.weight is missing"),
])
def test_what_the_engine_cannot_run_is_one_line_naming_it(folders: dict[str, Path], tmp_path: Path,
                                                         changes: dict, message: str) -> None:
    """An unsupported architecture, config key or tensor: exit 2 and one line, naming the key or tensor."""
    folder = _edit(folders["llama3"], tmp_path, **changes)
    with pytest.raises(KVCacheError, match="^" + message.replace("[", r"\[").replace("(", r"\(")):
        checkpoint.load(folder)
    prompts = tmp_path / "prompts.json"
    prompts.write_text("[[1, 2, 3]]")
    out = subprocess.run([sys.executable, str(ENGINE / "generate.py"), "--model", str(folder), "--prompts",
                          str(prompts), "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith("error: " + message), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("text, message", [
    ("[]", "--prompts: must hold a non-empty JSON list of prompts"),
    ("[[1, 2], []]", "--prompts: prompt 1 must be a non-empty list of token ids"),
    ("[[1, 256]]", "--prompts: prompt 0 holds 256, not a token id in [0, 256)"),
    ("[[1, 2", "--prompts: cannot read"),
])
def test_bad_prompts_are_one_line(folders: dict[str, Path], tmp_path: Path, text: str, message: str) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(text)
    out = subprocess.run([sys.executable, str(ENGINE / "generate.py"), "--model", str(folders["llama3"]),
                          "--prompts", str(prompts), "--max-new-tokens", "2"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and out.stderr.startswith("error: " + message), out.stderr


def test_transformers_live(folders: dict[str, Path]) -> None:
    """Where transformers is installed: its tokens now, from these files, equal the engine's."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    sys.path.insert(0, str(VECTORS))
    import make_expected

    for name, folder in folders.items():
        case = EXPECTED[name]
        want, _, _ = make_expected.transformers_tokens(folder, case["prompts"], case["max_new_tokens"])
        assert generate.generate(folder, case["prompts"], case["max_new_tokens"], block_size=BLOCK_SIZE,
                                 num_blocks=64) == want, name


# RoPE as transformers 5 saves a config: ``rope_parameters``, flat or per layer type, instead of ``rope_theta``,
# ``rope_scaling`` and ``rope_local_base_freq`` (read from save_pretrained's output, transformers 5.24).
ROPE_PARAMETERS = {
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "gemma3": {"full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
}


@pytest.mark.parametrize("name", list(ROPE_PARAMETERS))
def test_transformers_5_rope_parameters_run_the_same_model(folders: dict[str, Path], tmp_path: Path,
                                                           name: str) -> None:
    folder = _edit(folders[name], tmp_path, rope_theta=None, rope_scaling=None, rope_local_base_freq=None,
                   rope_parameters=ROPE_PARAMETERS[name])
    case = EXPECTED[name]
    assert generate.generate(folder, case["prompts"], case["max_new_tokens"], block_size=BLOCK_SIZE,
                             num_blocks=64) == case["tokens"]


def test_gemma3_layers_from_sliding_window_pattern(folders: dict[str, Path], tmp_path: Path) -> None:
    """An older Gemma 3 config names its full layers by ``sliding_window_pattern`` (every third here: the same
    layers as the checkpoint's ``layer_types``); the engine's windows and the cache's rows both follow it."""
    folder = _edit(folders["gemma3"], tmp_path, layer_types=None, sliding_window_pattern=3)
    config, _ = checkpoint.load(folder)
    assert config.window_layers == (0, 1, 3)
    case = EXPECTED["gemma3"]
    assert generate.generate(folder, case["prompts"], case["max_new_tokens"], block_size=BLOCK_SIZE,
                             num_blocks=64) == case["tokens"]

"""The tiny Llama 4 text model with chunked local attention through the reference engine, against transformers'
stored tokens: shared by the CPU (tests/test_engine.py, tests/test_chunked_attention.py) and GPU
(tests/test_engine_gpu.py) tests."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VECTORS = ROOT / "tests" / "vectors" / "engine"
sys.path.insert(0, str(ROOT / "examples" / "engine"))
sys.path.insert(0, str(VECTORS))


def llama4_checkpoint(folder: Path, chunk: int) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Write the tiny Llama 4 checkpoint with chunks of ``chunk`` into ``folder``, check it is byte for byte what
    transformers read, and return it as the reference engine's ``ModelConfig`` and weights with its stored vectors
    (``tests/vectors/engine``: prompts, transformers' tokens and chosen logits)."""
    import make_llama4

    expected = json.loads((VECTORS / make_llama4.VARIANTS[chunk][0]).read_text())
    folder = make_llama4.write(folder, chunk=chunk)
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())} == \
        expected["files"], "the checkpoint must be the bytes transformers read"
    config, weights = make_llama4.engine_model(folder)
    return config, weights, expected


def serve_llama4(tmp_path: Path, device: str, daemon: bool) -> None:
    """The tiny Llama 4 text model with chunks of 16 (``tests/vectors/engine/llama4_chunk16.json``) through
    ``generate.serve_model`` in blocks of 16: transformers' stored tokens, each chosen logit within 1e-3, chunk
    blocks given back, the second wave finding the first's prefixes; without the chunk mask the tokens differ."""
    import generate

    config, weights, expected = llama4_checkpoint(tmp_path / "llama4", chunk=16)
    seen = {"hit": 0, "recycled": 0}

    def count(wave: int, engine: Any, stats: Any) -> None:
        seen["hit"] += stats.hit
        cache_stats = engine.cache.stats()
        seen["recycled"] = cache_stats["recycled_blocks"] if isinstance(cache_stats, dict) else \
            cache_stats.recycled_blocks

    prompts, n = expected["prompts"], expected["max_new_tokens"]
    got = generate.serve_model(config, weights, prompts, n, daemon=daemon, device=device, block_size=16,
                               num_blocks=64, chunk=64, keep_logits=True, on_step=count)
    assert [s.generated for s in got] == expected["tokens"]
    chosen = [[float(row[t]) for row, t in zip(s.logits, s.generated)] for s in got]
    assert np.abs(np.array(chosen) - np.array(expected["logits"])).max() < 1e-3
    assert seen["recycled"] > 0 and seen["hit"] > 0, seen
    unchunked = generate.serve_model(dataclasses.replace(config, chunk=0), weights, prompts, n, device=device,
                                     block_size=16, num_blocks=64)
    assert all(s.generated != t for s, t in zip(unchunked, expected["tokens"])), \
        "without the chunk mask every request's tokens must differ"

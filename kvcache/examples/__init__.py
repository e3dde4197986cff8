"""The model configs shipped with the package, for ``--example NAME`` and ``load_example``.

Each file is the model's published Hugging Face ``config.json`` (``_name_or_path`` names the model id), so
``kvcache plan --example NAME`` sizes the cache as ``--model`` on a download of that model would (Gemma 3's
files leave attention fields to transformers' defaults, which ``CacheSpec.from_hf_config`` fills in the same way).
"""
from __future__ import annotations

import json
from importlib import resources
from typing import Any

from kvcache.allocator.errors import KVCacheError

DEFAULT_EXAMPLE = "llama-3.1-70b"


def example_models() -> list[str]:
    """Names of the model configs shipped with the package (``--example NAME``)."""
    folder = resources.files(__name__)
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def load_example(name: str) -> dict[str, Any]:
    """The shipped HF-style config of example model ``name``."""
    if name not in example_models():
        raise KVCacheError(f"example: unknown model {name!r}; choose one of {', '.join(example_models())}")
    return json.loads((resources.files(__name__) / f"{name}.json").read_text())

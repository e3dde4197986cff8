"""`kvcache serve` daemons for a run of the engine: started for a model's ``config.json``, stopped on the way out.

    with daemons(config, block_size=16, flags=("--num-blocks", "64")) as endpoints:
        engine = daemon_engine(model, endpoints["both"], block_size=16)
"""
from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvcache.launch import start_serve, stop_serve


@contextlib.contextmanager
def daemons(config: Any, *, block_size: int, roles: tuple[str, ...] = ("both",), head_wise: bool = False,
            tp: int = 1, flags: tuple[str, ...] = ()) -> Iterator[dict[str, str]]:
    """A daemon per role ("both"; "prefill" and "decode" for PD) serving ``config`` (a ``ModelConfig``) with
    ``flags``; their endpoints by role. A PD prefill node has ``tp`` ranks, its decode node one."""
    with tempfile.TemporaryDirectory(prefix="kv-engine-", dir="/tmp") as folder, contextlib.ExitStack() as stack:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps(config.hf_config()))
        endpoints = {}
        for role in roles:
            endpoints[role] = f"ipc://{folder}/{role}.sock"
            ranks = 1 if role == "decode" else tp
            extra = (["--head-wise"] if head_wise else []) + ["--tp", str(ranks), "--role", role]
            process = start_serve(["--endpoint", endpoints[role], "--model", str(path), "--block-size",
                                   str(block_size), "--max-slots", "64", *extra, *flags], Path(folder) / f"{role}.log")
            stack.callback(stop_serve, process)
        yield endpoints

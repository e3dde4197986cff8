"""Benchmark of prefix-cache block hashing: BlockHasher against vLLM's own request block hasher, same run.

Rows report ms per prompt and ns per token (best of `repeat` after a warm-up). Our rows carry
`peer_over_ours` (how many times faster than the installed vLLM's hasher with the same hash
name; None where vLLM is not importable) and `limit_ms`: hashlib (OpenSSL) hashing the same
number of SHA-256 compressions in one call, the floor for any chained SHA-256 of this prompt.
"""
from __future__ import annotations

import hashlib
import time
from functools import partial
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvcache.allocator import prefix
from kvcache.bench import vllm

_SEED = "0"


# --------------------------------------------------------------------------- measurement


def _best_ns(fn: Callable[[], object], repeat: int) -> int:
    """Best wall time of fn in ns over `repeat` runs, after two warm-up runs."""
    fn()
    fn()
    timings = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        timings.append(time.perf_counter_ns() - t0)
    return min(timings)


def _compressions(algorithm: str, tokens: np.ndarray, block_size: int) -> int:
    """SHA-256 compressions our chain performs for these tokens (64-byte blocks after padding)."""
    n = len(tokens) // block_size
    if algorithm == "sha256":
        per_block = np.full(n, 32 + 4 * block_size)
    else:
        widths = np.select([tokens < 24, tokens < 256, tokens < 65536], [1, 2, 3], 5)[: n * block_size]
        header = len(prefix.cbor_encode([0] * block_size)) - block_size
        per_block = 3 + 32 + header + widths.reshape(n, block_size).sum(axis=1) + 1
    return int(((per_block + 9 + 63) // 64).sum())


def _row(impl: str, algorithm: str, block_size: int, num_tokens: int, ns: int, **extra: Any) -> dict[str, Any]:
    """One result row."""
    return {
        "impl": impl,
        "algorithm": algorithm,
        "block_size": block_size,
        "num_tokens": num_tokens,
        "ms_per_prompt": ns / 1e6,
        "ns_per_token": ns / num_tokens,
        **extra,
    }


def bench_hashing(
    num_tokens: int = 32768, block_sizes: Sequence[int] = (16, 64), repeat: int = 20
) -> list[dict[str, Any]]:
    """Time hashing one prompt of num_tokens with each algorithm and backend, and vLLM's request block hasher."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 150_000, size=num_tokens, dtype=np.uint32)
    token_list = tokens.tolist()
    native = prefix._chainhash
    backends = native.available_backends() if native is not None else ("python",)
    peer_version = vllm.version()
    rows: list[dict[str, Any]] = []
    try:
        for block_size in block_sizes:
            for algorithm in prefix.ALGORITHMS:
                peer_name = f"vllm {peer_version} {algorithm}" if peer_version else "vllm"
                peer_ns = None
                if peer_version is not None:
                    peer_run = vllm.prompt_hasher(block_size, algorithm, token_list)
                    peer_ns = _best_ns(peer_run, max(3, repeat // 4))
                limit_bytes = bytes(_compressions(algorithm, tokens, block_size) * 64 - 9)
                limit_ns = _best_ns(partial(hashlib.sha256, limit_bytes), repeat)
                hasher = prefix.BlockHasher(block_size, algorithm, seed=_SEED)
                cases = [(b, "ndarray[uint32]", tokens) for b in backends] + [(backends[0], "list[int]", token_list)]
                for backend, kind, toks in cases:
                    if native is not None:
                        native.set_backend(backend)
                    ns = _best_ns(partial(hasher.hash_blocks, toks), repeat)
                    rows.append(
                        _row(
                            "kvcache",
                            algorithm,
                            block_size,
                            num_tokens,
                            ns,
                            backend=backend,
                            input=kind,
                            limit_ms=limit_ns / 1e6,
                            peer=peer_name,
                            peer_over_ours=(peer_ns / ns) if peer_ns is not None else None,
                        )
                    )
                if peer_ns is None:
                    rows.append(
                        {
                            "impl": peer_name,
                            "algorithm": algorithm,
                            "block_size": block_size,
                            "num_tokens": num_tokens,
                            "available": False,
                            "reason": "vllm is not importable",
                        }
                    )
                else:
                    rows.append(
                        _row(
                            peer_name, algorithm, block_size, num_tokens, peer_ns, backend="python", input="list[int]"
                        )
                    )
    finally:
        if native is not None:
            native.set_backend("auto")
    return rows

"""Benchmark of prefix-cache block hashing: BlockHasher against vLLM's Python loop, same run.

Rows report ms per prompt and ns per token (best of `repeat` after a warm-up). Our rows carry
`peer_over_ours` (how many times faster than vLLM's loop with the same hash name) and
`limit_ms`: hashlib (OpenSSL) hashing the same number of SHA-256 compressions in one call,
the floor for any chained SHA-256 of this prompt.
"""
from __future__ import annotations

import hashlib
import pickle
import time
from functools import partial
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvcache.allocator import prefix

try:
    import cbor2
except ImportError:  # the peer's sha256_cbor row is then reported as unavailable
    cbor2 = None

_SEED = "0"


# --------------------------------------------------------------------------- the peer: vLLM's loop
# A faithful re-statement of vLLM's per-block hashing in pure Python, with its costs kept:
#   vllm/utils/hashing.py (vllm-project/vllm @ ac621345): sha256 = hashlib.sha256(pickle.dumps(x,
#     protocol=HIGHEST_PROTOCOL)); sha256_cbor = hashlib.sha256(cbor2.dumps(x, canonical=True)).
#     Newer versions add xxhash / xxhash_cbor (optional xxhash package); not measured here.
#   vllm/v1/core/kv_cache_utils.py (vllm-project/vllm @ 001cabc1): get_request_block_hasher's
#     loop, generate_block_hash_extra_keys (mm, LoRA, salt, prompt-embeds lists, None when empty)
#     and hash_block_tokens (NONE_HASH for block 0, hash of (parent, tuple(tokens), extra_keys)).


def _vllm_sha256(value: Any) -> bytes:
    """vLLM's `sha256`: SHA-256 of the pickled object."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _vllm_sha256_cbor(value: Any) -> bytes:
    """vLLM's `sha256_cbor`: SHA-256 of canonical CBOR."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def _vllm_extra_keys(start: int, end: int, mm_idx: int) -> tuple[tuple[Any, ...] | None, int]:
    """vLLM's generate_block_hash_extra_keys for a plain request (no mm, LoRA, salt or embeds).

    Each helper returns its empty list at once for such a request; the concatenation and the
    None result are what vLLM pays per block.
    """
    mm_keys: list[Any] = []
    lora_keys: list[str] = []
    salt_keys: list[str] = []
    embeds_keys: list[bytes] = []
    keys = lora_keys + mm_keys + salt_keys + embeds_keys
    if not keys:
        return None, mm_idx
    return tuple(keys), mm_idx


def _vllm_hash_block_tokens(
    hash_fn: Callable[[Any], bytes], none_hash: bytes, parent: bytes | None, tokens: Sequence[int], extra: Any
) -> bytes:
    """vLLM's hash_block_tokens."""
    if not parent:
        parent = none_hash
    return hash_fn((parent, tuple(tokens), extra))


def _vllm_request_hashes(
    hash_fn: Callable[[Any], bytes], none_hash: bytes, tokens: list[int], block_size: int
) -> list[bytes]:
    """vLLM's request_block_hasher for a request with no hashes yet."""
    start = 0
    mm_idx = 0
    prev: bytes | None = None
    hashes: list[bytes] = []
    while True:
        end = start + block_size
        if end > len(tokens):
            break
        extra, mm_idx = _vllm_extra_keys(start, end, mm_idx)
        block_hash = _vllm_hash_block_tokens(hash_fn, none_hash, prev, tokens[start:end], extra)
        hashes.append(block_hash)
        start += block_size
        prev = block_hash
    return hashes


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
    """Time hashing one prompt of num_tokens with each algorithm and backend, and vLLM's loop."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 150_000, size=num_tokens, dtype=np.uint32)
    token_list = tokens.tolist()
    native = prefix._chainhash
    backends = native.available_backends() if native is not None else ("python",)
    peers: dict[str, tuple[str, Callable[[Any], bytes] | None]] = {
        "sha256": ("vllm sha256 (pickle, python loop)", _vllm_sha256),
        "sha256_cbor": ("vllm sha256_cbor (cbor2, python loop)", _vllm_sha256_cbor if cbor2 is not None else None),
    }
    rows: list[dict[str, Any]] = []
    try:
        for block_size in block_sizes:
            for algorithm in prefix.ALGORITHMS:
                peer_name, peer_fn = peers[algorithm]
                peer_ns = None
                if peer_fn is not None:
                    none_hash = peer_fn(_SEED)
                    peer_run = partial(_vllm_request_hashes, peer_fn, none_hash, token_list, block_size)
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
                            "reason": "cbor2 is not installed",
                        }
                    )
                else:
                    rows.append(
                        _row(
                            peer_name, algorithm, block_size, num_tokens, peer_ns, backend="hashlib", input="list[int]"
                        )
                    )
    finally:
        if native is not None:
            native.set_backend("auto")
    return rows

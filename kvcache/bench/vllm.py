"""vLLM's own allocator and block hasher on `kvcache bench`'s workloads: the peer, where `vllm` is importable.

Every call here goes into the installed vLLM (its `KVCacheManager`, `BlockPool`, `Request` with
`get_request_block_hasher`), nothing of it restated: the benchmarks time what vLLM itself does.
vLLM runs its KV-cache manager on a CPU; an environment for it: `pip install vllm==0.33.0` (with a
CPU build of PyTorch). Without it the benchmarks report their own rows and say the peer is missing.
"""
from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from kvcache.bench.common import TimedSteps

MAX_MODEL_LEN = 1 << 17


def version() -> str | None:
    """The importable vLLM's version, or None (then every peer row is left out)."""
    try:
        import vllm
        import vllm.v1.core.kv_cache_manager  # noqa: F401 - what the peer needs
    except Exception:  # noqa: BLE001 - not installed, or installed without what it needs (torch)
        return None
    return str(vllm.__version__)


def hash_function(algorithm: str) -> Callable[[Any], bytes]:
    """vLLM's hash function of that name (``sha256``: SHA-256 of a pickle; ``sha256_cbor``: of canonical CBOR)."""
    from vllm.utils.hashing import sha256, sha256_cbor

    return {"sha256": sha256, "sha256_cbor": sha256_cbor}[algorithm]


class Allocator:
    """vLLM's `KVCacheManager` for one full-attention group, and the requests it schedules.

    ``admit`` does what vLLM's scheduler does for a new request: the cached prefix
    (`get_computed_blocks`), then `allocate_slots` for the rest; ``decode`` appends one
    token and allocates its slot, as a decode step does; ``free`` ends a request.
    """

    def __init__(self, num_blocks: int, block_size: int, algorithm: str = "sha256") -> None:
        import torch
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        fn = hash_function(algorithm)
        init_none_hash(fn)
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer"], kv_cache_spec=spec)])
        self.manager = KVCacheManager(config, max_model_len=MAX_MODEL_LEN, scheduler_block_size=block_size,
                                      hash_block_size=block_size, enable_caching=True)
        self.block_hasher = get_request_block_hasher(block_size, fn)
        self._ids = itertools.count()

    def request(self, tokens: Sequence[int]) -> Any:
        """A new `vllm.v1.request.Request` for ``tokens`` (a list), its block hashes computed as vLLM does."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        return Request(f"bench-{next(self._ids)}", list(tokens), SamplingParams(max_tokens=1 << 16), None,
                       block_hasher=self.block_hasher)

    def admit(self, request: Any) -> int | None:
        """The request's cached prefix and the rest of its slots; the tokens hit, or None where blocks run out."""
        blocks, hit, _ = self.manager.get_computed_blocks(request)
        if self.manager.allocate_slots(request, request.num_tokens - hit, hit, blocks) is None:
            return None
        request.num_computed_tokens = request.num_tokens
        return hit

    def decode(self, request: Any, token: int, lookahead: int = 0) -> bool:
        """One generated token: appended (its block hashed once full) and its slot allocated, with ``lookahead``
        slots more; False without room."""
        request.append_output_token_ids(token)
        if self.manager.allocate_slots(request, 1, num_lookahead_tokens=lookahead) is None:
            return False
        request.num_computed_tokens += 1
        return True

    def free(self, request: Any) -> None:
        self.manager.free(request)

    def num_cached_blocks(self) -> int:
        return len(self.manager.block_pool.cached_block_hash_to_block._cache)


def pool_cycle(num_blocks: int) -> Callable[[int, int], None]:
    """``cycle(n, times)``: vLLM's `BlockPool.get_new_blocks(n)` then `free_blocks` of them, ``times`` times."""
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=16)

    def cycle(n: int, times: int) -> None:
        for _ in range(times):
            pool.free_blocks(pool.get_new_blocks(n))

    return cycle


def prompt_hasher(block_size: int, algorithm: str, tokens: list[int]) -> Callable[[], list[bytes]]:
    """A call that hashes a new request of ``tokens`` as vLLM's request block hasher does when it arrives.

    The `Request` is built once, without the hasher (its construction is not timed); the hasher
    then starts from its first block on every call.
    """
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    fn = hash_function(algorithm)
    init_none_hash(fn)
    hasher = get_request_block_hasher(block_size, fn)
    request = Request("bench-hash", tokens, SamplingParams(max_tokens=1), None)
    return lambda: hasher(request)


class StepInput(NamedTuple):
    """What one scheduler step brings, made before its clock starts: a token per running request, fresh prompts."""

    decode: list[int]
    prompts: list[list[int]]


def step_inputs(rng: np.random.Generator, count: int, requests: int, admits: int, prompt_tokens: int,
                vocab: int = 150_000) -> list[StepInput]:
    """``count`` steps' inputs: ``requests`` decode tokens and ``admits`` unique prompts each, as lists."""
    decode = rng.integers(0, vocab, size=(count, requests), dtype=np.int64).tolist()
    prompts = rng.integers(0, vocab, size=(count, admits, prompt_tokens), dtype=np.int64).tolist()
    return [StepInput(d, p) for d, p in zip(decode, prompts)]


class SchedulerStep(TimedSteps):
    """vLLM's scheduler step on a steady set of decoding requests, in this process.

    A step frees the oldest ``admits`` requests, decodes one token for each of the
    ``requests`` running ones (append, then `allocate_slots` for it, ``lookahead`` slots more), and admits as many
    fresh prompts (a `Request`, hashed as it is built, then `get_computed_blocks` +
    `allocate_slots`): the work vLLM's scheduler asks of its KV cache manager in such a step.
    """

    def __init__(self, requests: int, prompt_tokens: int, admits: int, block_size: int, num_blocks: int,
                 lookahead: int = 0) -> None:
        self.allocator = Allocator(num_blocks, block_size)
        self.requests, self.prompt_tokens, self.admits = requests, prompt_tokens, admits
        self.lookahead = lookahead
        self.live: collections.deque[Any] = collections.deque()

    def setup(self, rng: np.random.Generator) -> None:
        """Admit the steady set and the first step's finishing requests."""
        for prompt in rng.integers(0, 150_000, size=(self.requests + self.admits, self.prompt_tokens)).tolist():
            self._admit(prompt)

    def _admit(self, prompt: list[int]) -> None:
        request = self.allocator.request(prompt)
        if self.allocator.admit(request) is None:
            raise RuntimeError("vLLM's pool is too small for the step workload")
        self.live.append(request)

    def step(self, inp: StepInput) -> None:
        for _ in inp.prompts:
            self.allocator.free(self.live.popleft())
        for request, token in zip(self.live, inp.decode):
            if not self.allocator.decode(request, token, self.lookahead):
                raise RuntimeError("vLLM's pool is too small for the step workload")
        for prompt in inp.prompts:
            self._admit(prompt)


Unit = tuple[str, Any]  # a layer's (or a cell's) attention: ("full", None), ("window", W) or ("chunk", C)


def planner_config(max_model_len: int, max_num_batched_tokens: int, block_size: int) -> Any:
    """A ``VllmConfig`` as vLLM's engine builds it for its KV-cache planner: bf16, the hybrid manager on (as on a
    GPU; the CPU platform turns it off), the NHD layout; its model config read from a one-layer stand-in (only
    ``max_model_len`` matters to the planner)."""
    import json
    import tempfile

    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    with tempfile.TemporaryDirectory() as folder:
        with open(f"{folder}/config.json", "w") as f:
            json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
                       "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64, "hidden_size": 64,
                       "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": max_model_len}, f)
        model = ModelConfig(model=folder, skip_tokenizer_init=True, max_model_len=max_model_len, dtype="bfloat16")
        config = VllmConfig(model_config=model, device_config=DeviceConfig(device="cpu"),
                            scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                                             max_model_len=max_model_len, is_encoder_decoder=False),
                            cache_config=CacheConfig(block_size=block_size))
    config.cache_config.kv_cache_layout = "NHD"
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def layer_specs(units: Sequence[tuple[str, Unit]], num_kv_heads: int, head_dim: int, block_size: int) -> dict:
    """vLLM's per-layer ``KVCacheSpec`` for named units, in order: ``FullAttentionSpec``, ``SlidingWindowSpec`` or
    ``ChunkedLocalAttentionSpec``, bf16, ``num_kv_heads`` of ``head_dim`` each."""
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    common = {"block_size": block_size, "num_kv_heads": num_kv_heads, "head_size": head_dim, "dtype": torch.bfloat16}
    make = {"full": lambda _: FullAttentionSpec(**common),
            "window": lambda w: SlidingWindowSpec(**common, sliding_window=w),
            "chunk": lambda c: ChunkedLocalAttentionSpec(**common, attention_chunk_size=c)}
    return {name: make[kind](size) for name, (kind, size) in units}


def kv_cache_config(config: Any, specs: dict, memory_bytes: int) -> Any:
    """The ``KVCacheConfig`` vLLM's engine plans for one worker with these layer specs and bytes of KV cache:
    ``get_global_kv_cache_groups`` then ``get_kv_cache_configs``, as its engine core calls them."""
    from vllm.v1.core import kv_cache_planning as planning

    return planning.get_kv_cache_configs(config, [specs], [memory_bytes],
                                         planning.get_global_kv_cache_groups(config, [specs]))[0]


def kv_cache_groups(units: Sequence[tuple[str, Unit]], num_kv_heads: int, head_dim: int,
                    block_size: int = 16) -> list[dict[str, Any]]:
    """vLLM's KV cache groups for named units (layers, or head-wise cells as layers of one kv head), in its
    order, each as its spec's kind and size and its units' names; ``get_kv_cache_groups`` and the groups of the
    ``KVCacheConfig`` that ``get_kv_cache_configs`` plans must agree (asserted)."""
    from vllm.v1.core import kv_cache_planning as planning
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec,
                                            UniformTypeKVCacheSpecs)

    config = planner_config(32_768, 8_192, block_size)
    specs = layer_specs(units, num_kv_heads, head_dim, block_size)
    grouped = planning.get_kv_cache_groups(config, dict(specs))
    planned = kv_cache_config(config, specs, 1 << 34).kv_cache_groups
    assert [g.layer_names for g in grouped] == [g.layer_names for g in planned], "vLLM's two groupings differ"

    def describe(spec: Any) -> tuple[str, int | None]:
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = next(iter(spec.kv_cache_specs.values()))
        if isinstance(spec, SlidingWindowSpec):
            return "window", spec.sliding_window
        if isinstance(spec, ChunkedLocalAttentionSpec):
            return "chunk", spec.attention_chunk_size
        assert isinstance(spec, FullAttentionSpec), f"unexpected spec {type(spec).__name__}"
        return "full", None

    return [{"kind": describe(g.kv_cache_spec)[0], "size": describe(g.kv_cache_spec)[1],
             "units": list(g.layer_names)} for g in planned]


def planner_concurrency(units: Sequence[tuple[str, Unit]], num_kv_heads: int, head_dim: int, block_size: int,
                        max_model_len: int, max_num_batched_tokens: int, memory_bytes: int) -> dict[str, Any]:
    """What vLLM's hybrid KV-cache planner gives named units (layers, or head-wise cells as layers of one kv head)
    in ``memory_bytes`` of one worker: its groups' sizes, blocks, max concurrency at ``max_model_len``
    (``get_max_concurrency_for_kv_cache_config``), and the tokens it counts in flight (``max_in_flight_tokens``:
    ``max_num_batched_tokens`` times the batches it keeps running). bf16 caches; the hybrid manager on."""
    from vllm.v1.core import kv_cache_utils

    config = planner_config(max_model_len, max_num_batched_tokens, block_size)
    kv = kv_cache_config(config, layer_specs(units, num_kv_heads, head_dim, block_size), memory_bytes)
    return {"version": version(), "groups": [len(g.layer_names) for g in kv.kv_cache_groups],
            "num_blocks": kv.num_blocks,
            "max_concurrency": kv_cache_utils.get_max_concurrency_for_kv_cache_config(config, kv),
            "max_in_flight_tokens": config.max_in_flight_tokens}


def hybrid_concurrency(windows: Sequence[int | None], num_kv_heads: int, head_dim: int, block_size: int,
                       max_model_len: int, max_num_batched_tokens: int, memory_bytes: int) -> dict[str, Any]:
    """``planner_concurrency`` for layers with these windows (None: full)."""
    units = [(f"layers.{i}", ("window", w) if w else ("full", None)) for i, w in enumerate(windows)]
    return planner_concurrency(units, num_kv_heads, head_dim, block_size, max_model_len, max_num_batched_tokens,
                               memory_bytes)

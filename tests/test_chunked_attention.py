"""Chunked local attention (Llama 4's ``attention_chunk_size``): query q sees keys ``(q // C) * C .. q``.

Blocks of earlier chunks are given back as a sliding window's are, exactly when vLLM's
``ChunkedLocalAttentionManager.remove_skipped_blocks`` frees them, and prefix hits follow its
``find_longest_cache_hit`` (behind the hybrid coordinator with a full group). The two vLLM rules are
restated below from their documented behaviour and checked against the manager, in process and through a
real daemon.
"""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.allocator import Chunked, Full, KVCacheError, KVCacheManager
from kvcache.allocator.events import BlockRemoved, BlockStored
from kvcache.allocator.rows import derive_rows, layer_policies
from kvcache.allocator.swa import NeededBlocks, needed_blocks, recyclable_blocks
from kvcache.client import CacheClient
from kvcache.config import parse_rows

from caches import same_random_steps

HORIZON = 64  # future queries checked past T


# ---------------------------------------------------------------- vLLM's rules, restated

def vllm_skipped_blocks(num_computed_tokens: int, chunk: int, block_size: int) -> int:
    """vLLM frees (nulls) blocks ``[0, skipped // B)``, ``skipped = (N // C) * C`` (``get_num_skipped_tokens``)."""
    return num_computed_tokens // chunk * chunk // block_size


def vllm_chunked_hit(cached: list[bool], max_length: int, chunk: int, block_size: int) -> int:
    """Blocks of vLLM's chunked hit: null blocks up to the block of ``max_length``'s chunk start, then the cached
    run from there, stopping at the first miss."""
    start = max_length // chunk * chunk // block_size if max_length > 0 else 0
    n = start
    while n < max_length // block_size and cached[n]:
        n += 1
    return n


def vllm_full_hit(cached: list[bool], max_length: int, block_size: int) -> int:
    """Blocks of vLLM's full-attention hit: the leading cached run."""
    n = 0
    while n < max_length // block_size and cached[n]:
        n += 1
    return n


def vllm_hit(groups: list[tuple[object, list[bool]]], max_length: int, block_size: int) -> int:
    """The hybrid coordinator: each group's hit bounds the next one's search until the length stops changing."""
    length = max_length
    while True:
        current = length
        for policy, cached in groups:
            blocks = (vllm_full_hit(cached, current, block_size) if isinstance(policy, Full) else
                      vllm_chunked_hit(cached, current, policy.chunk_tokens, block_size))
            current = blocks * block_size
        if current == length:
            return current // block_size
        length = current


# ---------------------------------------------------------------- the policy

def test_chunked_is_a_frozen_record_validated_by_name():
    """Chunked(C) compares by value; a chunk of no tokens is a caller mistake naming the field."""
    assert Chunked(64) == Chunked(chunk_tokens=64) and Chunked(64) != Chunked(32)
    for bad in (0, -4, 2.5, True):
        with pytest.raises(KVCacheError, match="chunk_tokens"):
            Chunked(bad)  # type: ignore[arg-type]


def test_docstring_examples_match_vllms():
    """C = 8, B = 4: at 13 computed tokens the first chunk's two blocks go; a prefix of 15 needs block 2 only."""
    assert recyclable_blocks(Chunked(8), 13, 4) == range(0, 2)
    assert recyclable_blocks(Chunked(8), 7, 4) == range(0, 0)
    assert recyclable_blocks(Chunked(8), 8, 4) == range(0, 2)
    assert needed_blocks(Chunked(8), 15, 4) == NeededBlocks(range(0, 0), range(2, 4))
    assert needed_blocks(Chunked(8), 16, 4) == NeededBlocks(range(0, 0), range(4, 4))


@settings(max_examples=300, deadline=None)
@given(chunk_blocks=st.integers(1, 6), block_size=st.integers(1, 8), first_pending_query=st.integers(0, 200))
def test_freed_blocks_hold_only_tokens_no_later_query_reads(chunk_blocks: int, block_size: int,
                                                            first_pending_query: int):
    """Every block given back holds only keys no query from T on sees; every such whole block is given back; the
    count is vLLM's ``remove_skipped_blocks``."""
    chunk = chunk_blocks * block_size
    freed = recyclable_blocks(Chunked(chunk), first_pending_query, block_size)
    seen = {p for q in range(first_pending_query, first_pending_query + HORIZON)
            for p in range(q // chunk * chunk, q + 1)}
    dead = {b for b in range(first_pending_query // block_size + 2)
            if not seen & set(range(b * block_size, (b + 1) * block_size))}
    assert set(freed) <= dead
    assert set(freed) == {b for b in dead if (b + 1) * block_size <= first_pending_query}
    assert freed == range(0, vllm_skipped_blocks(first_pending_query, chunk, block_size))


@settings(max_examples=200, deadline=None)
@given(chunk_blocks=st.integers(1, 6), block_size=st.integers(1, 8), num_tokens=st.integers(0, 200))
def test_needed_blocks_are_those_the_next_query_sees(chunk_blocks: int, block_size: int, num_tokens: int):
    """A prefix of L tokens needs the blocks of keys the query at L sees, and the block its own key goes to."""
    chunk = chunk_blocks * block_size
    need = needed_blocks(Chunked(chunk), num_tokens, block_size)
    seen = {p // block_size for p in range(num_tokens // chunk * chunk, num_tokens)}
    own = {num_tokens // block_size} if num_tokens % block_size else set()
    assert set(need.sink) | set(need.window) == seen | own


@settings(max_examples=300, deadline=None)
@given(chunk_blocks=st.integers(1, 4), block_size=st.integers(1, 4), cached=st.lists(st.booleans(), max_size=40),
       extra=st.integers(0, 3))
def test_needed_blocks_give_vllms_longest_hit(chunk_blocks: int, block_size: int, cached: list[bool], extra: int):
    """The longest prefix whose needed blocks are cached (the manager's rule) is vLLM's chunked hit."""
    chunk = chunk_blocks * block_size
    max_length = len(cached) * block_size + min(extra, block_size - 1)
    ours = max(n for n in range(len(cached) + 1)
               if all(cached[b] for b in needed_blocks(Chunked(chunk), n * block_size, block_size).window
                      if b < n))
    assert ours == vllm_chunked_hit(cached, max_length, chunk, block_size)


# ---------------------------------------------------------------- the manager

class Cached:
    """Each row group's cached hashes, kept from the manager's KV events (what vLLM's block pool knows)."""

    def __init__(self, num_groups: int) -> None:
        self.hashes: list[set[bytes]] = [set() for _ in range(num_groups)]

    def apply(self, manager: KVCacheManager) -> None:
        for event in manager.take_events():
            if isinstance(event, BlockStored):
                self.hashes[event.group].update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.hashes[event.group].difference_update(event.block_hashes)


@pytest.mark.parametrize("rows", [[Chunked(8), Full()], [Chunked(8)], [Full(), Chunked(16)]])
def test_hits_and_recycling_follow_vllm_over_random_workloads(rows: list):
    """Random admits, chunked prefills (some a step behind), decodes and frees in a small pool: each admit's hit
    is the hybrid coordinator's over the groups' cached hashes, each chunked row's table nulls exactly vLLM's
    skipped blocks and holds the rest, and the manager stays consistent."""
    bs = 4
    manager = KVCacheManager(48, bs, rows, hash_seed="s", enable_events=True)
    cached = Cached(len(rows))
    rng = np.random.default_rng(7)
    stems = [rng.integers(0, 50, 60) for _ in range(3)]
    live: dict[int, int] = {}  # request -> tokens so far
    done_at: dict[int, int] = {}  # request -> the most tokens any step called computed
    hits = 0
    for step in range(600):
        action = rng.integers(4) if live else 0
        if action == 0:
            prompt = np.concatenate([stems[rng.integers(3)][: rng.integers(1, 60)], rng.integers(0, 50, rng.integers(3))])
            hashes = manager.hasher.hash_blocks(prompt)
            groups = [(p, [h in cached.hashes[g] for h in hashes]) for g, p in enumerate(rows)]
            want = vllm_hit(groups, len(prompt) - 1, bs) if len(prompt) > bs else 0
            got = manager.admit(step, prompt, num_tokens=int(rng.integers(1, len(prompt) + 1)))
            if got is not None:
                assert got.num_cached_tokens == want * bs, (step, got.num_cached_tokens, want)
                hits += want > 0
                live[step], done_at[step] = got.num_tokens, got.num_cached_tokens
        elif action == 3:
            rid = list(live)[rng.integers(len(live))]
            manager.free(rid)
            del live[rid], done_at[rid]
        else:
            rid = list(live)[rng.integers(len(live))]
            new = rng.integers(0, 50, rng.integers(0, 9))
            behind = int(rng.integers(0, 3)) if action == 2 else 0  # a step still in flight
            done = max(0, live[rid] - behind)
            if manager.extend(rid, new, num_computed_tokens=done) is not None:
                live[rid] += len(new)
                done_at[rid] = max(done_at[rid], done)
        cached.apply(manager)
        manager.check_integrity()
        for rid, n in live.items():
            table = manager.table(rid)
            for g, policy in enumerate(rows):
                if isinstance(policy, Chunked):
                    width = -(-n // bs)
                    holes = np.flatnonzero(table[g, :width] < 0)
                    # Nulls are a prefix: exactly vLLM's skipped blocks at the last extend's computed tokens.
                    assert holes.tolist() == list(range(holes.size)), (rid, table[g])
                    assert holes.size == vllm_skipped_blocks(done_at[rid], policy.chunk_tokens, bs), (rid, table[g])
                else:
                    assert (table[g, : -(-n // bs)] >= 0).all()
    assert hits > 20, "the workload must exercise prefix hits"


def test_chunks_must_start_on_a_block():
    """A chunk that is not a whole number of blocks is refused by name, changing nothing."""
    with pytest.raises(KVCacheError, match=r"rows\[1\]: chunk_tokens 24 must be a multiple of block_size 16"):
        KVCacheManager(8, 16, [Full(), Chunked(24)])


def test_chunked_blocks_go_back_at_chunk_boundaries():
    """C = 8, B = 4: a request's chunked row drops both blocks of chunk 0 when the first query of chunk 1 runs,
    so a long decode holds at most one chunk of that row while its full row holds everything."""
    manager = KVCacheManager(64, 4, [Chunked(8), Full()])
    manager.admit("r", np.arange(7))
    assert manager.extend("r", [7]).tolist() == [[0, 1], [0, 1]]
    assert manager.extend("r", [8]).tolist() == [[-1, -1, 2], [0, 1, 2]]  # query 8 starts chunk 1
    for t in range(9, 40):
        table = manager.extend("r", [t])
        assert (table[0] >= 0).sum() <= 8 // 4 + 1
    assert (manager.table("r")[1] >= 0).all()


# ---------------------------------------------------------------- config, wire, plan

def test_llama4_configs_give_chunked_rope_layers_and_full_nope_layers():
    """Llama 4's text config: RoPE layers (no_rope_layers 1) chunked, every 4th (NoPE) full; layer_types wins."""
    llama4 = {"model_type": "llama4_text", "num_hidden_layers": 8, "attention_chunk_size": 8192}
    assert layer_policies(llama4, 8) == (Chunked(8192),) * 3 + (Full(),) + (Chunked(8192),) * 3 + (Full(),)
    flags = {**llama4, "no_rope_layers": [1, 0, 1, 1, 1, 1, 1, 0]}
    assert [isinstance(p, Full) for p in layer_policies(flags, 8)] == [False, True] + [False] * 5 + [True]
    types = {**llama4, "layer_types": ["full_attention"] + ["chunked_attention"] * 7}
    assert layer_policies(types, 8) == (Full(),) + (Chunked(8192),) * 7
    chunked, full = derive_rows(layer_policies(llama4, 8), 8)
    assert (chunked.policy, chunked.layers, full.layers) == (Chunked(8192), (0, 1, 2, 4, 5, 6), (3, 7))
    assert chunked.describe()["kind"] == "chunk" and chunked.describe()["chunk"] == 8192
    assert type(chunked).from_description(chunked.describe()) == chunked


def test_rows_flag_reads_chunk_items():
    """``--rows`` takes ``chunk:C`` items with repeats; a bad one names the syntax."""
    assert parse_rows("chunk:64*2,full") == [Chunked(64), Chunked(64), Full()]
    with pytest.raises(KVCacheError, match="chunk:C"):
        parse_rows("chunk:x")
    with pytest.raises(KVCacheError, match="a chunk needs"):
        parse_rows("chunk:0")


def test_plan_holds_one_chunk_per_request_plus_the_step_budget():
    """A chunked row's pool: at most one chunk a request (C - 1 tokens and the step's), whatever max_model_len."""
    from kvcache.allocator.layout import CacheSpec
    from kvcache.plan import Load, blocks_per_request, make_plan, row_blocks

    load = Load(max_model_len=32768, max_num_seqs=256, max_num_batched_tokens=8192)
    assert blocks_per_request(Chunked(8192), 16, load) == 8192 // 16
    # One budget of 8,192 tokens opens a new block for at most 4,096 requests (2 tokens each: the chunk's last
    # and the next chunk's first).
    assert row_blocks(Chunked(8192), 16, load, 10) == 10 * 512 + 10 + min((8192 - 20) // 16, 10 * (2048 - 513))
    llama4 = {"model_type": "llama4_text", "num_hidden_layers": 48, "num_attention_heads": 40,
              "num_key_value_heads": 8, "head_dim": 128, "attention_chunk_size": 8192, "torch_dtype": "bfloat16"}
    spec = CacheSpec.from_hf_config(llama4, block_size=16)
    assert [(row.policy, len(row.layers)) for row in spec.row_layout] == [(Chunked(8192), 36), (Full(), 12)]
    plan = make_plan(spec, gpu_memory=80 << 30, load=load)
    assert [r.blocks_per_request for r in plan.rows] == [512, 2048]
    # A request holds 12 * 2,048 + 36 * 512 blocks of layers instead of 48 * 2,048: over twice the requests.
    assert (plan.max_concurrency, plan.uniform_concurrency) == (26, 12)


def test_daemon_serves_chunk_rows_as_the_library_does(daemon):
    """`kvcache serve --rows chunk:64,full`: info names the chunked row, and random steps through the daemon
    give the library's tables, chunk blocks given back; a chunk that is not whole blocks stops the daemon."""
    d = daemon("--num-blocks", "96", "--block-size", "16", "--rows", "chunk:64,full", "--hash-seed", "s")
    library = KVCacheManager(96, 16, [Chunked(64), Full()], hash_seed="s")
    rng = np.random.default_rng(3)
    stem = rng.integers(0, 100, 300)
    with CacheClient(d.endpoint) as client:
        rows = client.info()["rows"]
        assert [r["kind"] for r in rows] == ["chunk", "full"] and rows[0]["chunk"] == 64
        live = same_random_steps(client, library, rng, 200, prompt=lambda rng: stem[: rng.integers(1, 300)],
                                 new_tokens=lambda rng: rng.integers(0, 100, rng.integers(0, 40)))
        assert any((library.table(rid)[0] < 0).any() for rid in live) or not live
        assert client.num_free_blocks.tolist() == library.num_free_blocks.tolist()
    with pytest.raises(RuntimeError, match="chunk_tokens 24 must be a multiple of block_size 16"):
        daemon("--num-blocks", "16", "--block-size", "16", "--rows", "chunk:24,full")


# ---------------------------------------------------------------- the reference engine, token for token

CHUNKED_MODEL = {"chunk": 8, "chunk_layers": (0, 1, 2)}  # Llama 4's shape: chunked layers, the last one full


@pytest.mark.parametrize("through", ["library", "daemon"])
def test_the_engine_serves_a_chunked_model_as_its_dense_computation(through: str):
    """A Llama with attention_chunk_size 8 on layers 0-2 (block 4): greedy tokens and logits over kvcache's
    tables, chunk blocks given back and prefixes hit, equal the dense model's, which masks each chunked layer's
    queries to their own chunk with no cache; the chunk mask changes what the model says, so the test has teeth."""
    pytest.importorskip("paddle")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "engine"))
    import check
    from engine import daemon_engine, library_engine
    from model import Model, ModelConfig, dense_generate

    config = ModelConfig(**CHUNKED_MODEL)
    case = check.Case(model=config, daemon=("--num-blocks", "96") if through == "daemon" else None)
    model = Model(config)
    with check.serving(case) as endpoints:
        options = dict(block_size=case.block_size, chunk=case.chunk, max_num_seqs=case.max_num_seqs)
        engine = (daemon_engine(model, endpoints["both"], **options) if through == "daemon" else
                  library_engine(model, num_blocks=case.num_blocks, **options))
        try:
            changed = 0
            for wave in check.prompts_of(case):
                got = engine.generate(wave, case.max_new_tokens)
                for rid, prompt in wave.items():
                    tokens, logits = dense_generate(model, prompt, case.max_new_tokens)
                    assert got[rid].generated == tokens, rid
                    assert np.abs(np.array(got[rid].logits) - logits).max() < case.logit_tolerance, rid
                    unchunked = dense_generate(Model(ModelConfig()), prompt, case.max_new_tokens)[0]
                    changed += unchunked != tokens
            engine.cache.check_integrity()
            stats = engine.cache.stats()
            recycled = stats["recycled_blocks"] if isinstance(stats, dict) else stats.recycled_blocks
        finally:
            engine.close()
    assert engine.spec.row_layout[0].policy == Chunked(8) and engine.spec.row_layout[0].layers == (0, 1, 2)
    assert recycled > 0, "chunked rows must give blocks back"
    assert sum(s.hit for s in engine.stats) > 0, "the second wave must hit the prefix cache"
    assert changed > 0, "the chunk mask must change some request's tokens"


def llama4_model():
    """The tiny Llama 4 text checkpoint of tests/vectors/engine with chunks of 8 (written here from its seed, byte
    for byte what transformers read) as the reference engine's model, with its stored vectors."""
    import tempfile
    from pathlib import Path

    from llama4_engine import llama4_checkpoint
    from model import Model

    with tempfile.TemporaryDirectory() as tmp:
        config, weights, expected = llama4_checkpoint(Path(tmp) / "llama4", chunk=8)
    chunked = [i in config.chunk_layers for i in range(config.num_layers)]
    assert chunked == [t == "chunked_attention" for t in expected["layer_types"]]
    return Model(config, weights=weights), expected


@pytest.mark.parametrize("through", ["library", "daemon"])
def test_the_engine_serves_llama4_as_transformers_does(through: str):
    """transformers' Llama4ForCausalLM (chunk 8: layers 0-2 chunked with RoPE, layer 3 full NoPE), greedy over
    two waves: the engine over kvcache's Chunked and Full rows (blocks of 4, chunk blocks given back, the second
    wave hitting the first's prefixes) gives the stored tokens and their logits, and so does its dense model."""
    pytest.importorskip("paddle")
    model, expected = llama4_model()
    import check
    from engine import daemon_engine, library_engine
    from model import dense_generate

    case = check.Case(model=model.config, daemon=("--num-blocks", "96") if through == "daemon" else None)
    prompts, n = expected["prompts"], expected["max_new_tokens"]
    waves = [{"a0": prompts[0], "a1": prompts[1]}, {"b0": prompts[2], "b1": prompts[3]}]
    want = dict(zip(["a0", "a1", "b0", "b1"], zip(expected["tokens"], expected["logits"])))
    with check.serving(case) as endpoints:
        options = dict(block_size=4, chunk=16, max_num_seqs=4)
        engine = (daemon_engine(model, endpoints["both"], **options) if through == "daemon" else
                  library_engine(model, num_blocks=96, **options))
        try:
            for wave in waves:
                got = engine.generate(wave, n)
                for rid, prompt in wave.items():
                    tokens, chosen = want[rid]
                    assert got[rid].generated == tokens, rid
                    logits = np.array(got[rid].logits)[np.arange(n), tokens]
                    assert np.abs(logits - chosen).max() < 1e-3, rid
                    assert dense_generate(model, prompt, n)[0] == tokens, rid
            stats = engine.cache.stats()
            recycled = stats["recycled_blocks"] if isinstance(stats, dict) else stats.recycled_blocks
        finally:
            engine.close()
    assert [r.policy for r in engine.spec.row_layout] == [Chunked(8), Full()]
    assert recycled > 0 and sum(s.hit for s in engine.stats) > 0
    unchunked = copy.copy(model)
    unchunked.config = dataclasses.replace(model.config, chunk=0)
    assert all(dense_generate(unchunked, p, n)[0] != t for p, t in zip(prompts, expected["tokens"])), \
        "without the chunk mask every request's tokens must differ"


def test_a_chunked_daemon_comes_back_from_its_journal(daemon, tmp_path):
    """Killed with -9 after a snapshot, `kvcache serve --rows chunk:8,full --journal` restarts with every table,
    holes included, and goes on giving chunk blocks back."""
    journal = tmp_path / "journal"
    flags = ("--num-blocks", "64", "--block-size", "4", "--rows", "chunk:8,full", "--journal", str(journal),
             "--snapshot-bytes", "2000")
    d = daemon(*flags)
    with CacheClient(d.endpoint) as client:
        for i in range(6):
            client.admit(i, np.arange(30) + 100 * i)
            client.extend(i, [1, 2, 3])
        before = {i: client.table(i) for i in range(6)}
    assert all((t[0] < 0).any() for t in before.values())
    d.kill()
    d = daemon(*flags, folder=d.folder)
    with CacheClient(d.endpoint) as client:
        for i, table in before.items():
            assert np.array_equal(client.table(i), table)
        grown = client.extend(0, list(range(10)))
        # 33 tokens computed: blocks of chunks 0-3 are gone, chunk 4's are held.
        assert (grown[0, :8] < 0).all() and (grown[0, 8:] >= 0).all() and (grown[1] >= 0).all()


def test_llama4_prefixes_come_back_from_a_host_tier():
    """With a host tier under a small pool, the first wave's prefixes are pushed out by two long prompts and the
    second wave takes them back from host (a chunked group needs only its hit's chunk there): the tokens stay
    transformers'."""
    pytest.importorskip("paddle")
    model, expected = llama4_model()
    from engine import library_engine

    engine = library_engine(model, num_blocks=24, block_size=4, chunk=16, max_num_seqs=1, host_blocks=128)
    prompts, n = expected["prompts"], expected["max_new_tokens"]
    waves = [{"a0": prompts[0], "a1": prompts[1]}, {"x": list(range(1, 60))}, {"y": list(range(100, 160))},
             {"b0": prompts[2], "b1": prompts[3]}]
    try:
        got = {rid: seq.generated for wave in waves for rid, seq in engine.generate(wave, n).items()}
        engine.tier.drain(10)
        engine.tier.check_integrity()
        engine.cache.check_integrity()
        host_tokens = engine.tier.stats().hit_tokens
    finally:
        engine.close()
    assert [got[rid] for rid in ("a0", "a1", "b0", "b1")] == expected["tokens"]
    assert host_tokens > 0

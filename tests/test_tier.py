"""Host-memory tier: released blocks offloaded to host, evicted from the GPU, found on host and copied back byte for byte."""
from __future__ import annotations

import ctypes
import json
import hashlib
import logging
import time
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache.allocator import CacheSpec, Full, KVCacheError, KVCacheManager, Window
from kvcache.allocator.events import BlockRemoved, BlockStored
from kvcache.allocator.prefix import BlockHasher
from kvcache.allocator.tiers import tier_extension
from kvcache.events import encode_batch
from kvcache.transfer import HostTierConfig, KVRegion, TransferManager, TransferStatus
from kvcache.transfer.manager import HostBooks
from kvcache.transfer.regions import CopyRanges

from caches import random_views

SPECS = {
    "bf16": dict(num_kv_heads=4, head_dim=16),
    "int8": dict(num_kv_heads=4, head_dim=16, quant="int8"),
    "int4_zp": dict(num_kv_heads=4, head_dim=16, quant="int4_zp"),
    "block_wise_fp8": dict(num_kv_heads=4, head_dim=16, quant="block_wise_fp8"),
    "block_wise_fp8_blackwell": dict(num_kv_heads=4, head_dim=16, quant="block_wise_fp8", scale_layout="blackwell"),
    "mla_fp8": dict(quant="mla_fp8", kv_lora_rank=128, qk_rope_head_dim=16),
}
SEED = b"tier-tests"


def make_spec(name: str = "bf16", **overrides: Any) -> CacheSpec:
    fields: dict[str, Any] = dict(num_layers=3, block_size=4, **SPECS[name])
    fields.update(overrides)
    return CacheSpec(**fields)


class Memory:
    """KV memory standing in for a GPU cache: one random numpy buffer (layer, tensor, block) registered as a KVRegion."""

    def __init__(self, spec: CacheSpec, num_blocks: int, seed: int = 0) -> None:
        self.buffer, views = random_views(spec, num_blocks, seed)
        self.region = KVRegion.from_tensors(spec, views)


def units(region: KVRegion, block: int, row: int | None) -> list[tuple[int, int]]:
    """(address, bytes) of a block (row None) or of one head of it, per layer and tensor."""
    out = []
    for layer in range(region.num_layers):
        for t, tensor in enumerate(region.tensors):
            base = int(region.addrs[layer, t]) + block * int(region.block_strides[layer, t])
            if row is None:
                out.append((base, tensor.bytes_per_block))
            else:
                unit = tensor.bytes_per_block // region.heads
                out.append((base + row * unit, unit))
    return out


def read(region: KVRegion, block: int, row: int | None) -> bytes:
    return b"".join(ctypes.string_at(addr, n) for addr, n in units(region, block, row))


def pattern(key: bytes, row: int | None, n: int) -> bytes:
    """The bytes a block (or head) holding ``key`` must have: a function of the hash alone, like real KV."""
    seed = hashlib.blake2b(key + bytes([255 if row is None else row]), digest_size=64).digest()
    return (seed * (n // 64 + 1))[:n]


def write(region: KVRegion, block: int, row: int | None, key: bytes) -> None:
    data = pattern(key, row, sum(n for _, n in units(region, block, row)))
    offset = 0
    for addr, n in units(region, block, row):
        ctypes.memmove(addr, data[offset:offset + n], n)
        offset += n


class Tier:
    """A manager with a host tier over a Memory, and a worker that 'computes' blocks as pattern(hash)."""

    def __init__(self, spec: CacheSpec, num_blocks: int, host_blocks: int, rows: Any = None, **config: Any) -> None:
        self.spec = spec
        self.memory = Memory(spec, num_blocks)
        policies = {} if rows is None else dict(head_wise=True, policies=rows)
        self.manager = KVCacheManager.from_spec(spec, num_blocks, enable_events=True, hash_seed=SEED, **policies)
        self.tm = TransferManager(self.manager, self.memory.region, HostTierConfig(host_blocks=host_blocks, **config))
        self.hasher = BlockHasher(spec.block_size, "sha256", SEED)
        self.uniform = rows is None

    def keys(self, tokens: list[int]) -> list[bytes]:
        """The hash of each full block of ``tokens``; what a block's bytes are a function of."""
        return self.hasher.hash_blocks(np.asarray(tokens, dtype=np.uint32))

    def rows(self, table: np.ndarray) -> list[int | None]:
        return [None] if self.uniform else list(range(table.shape[0]))

    def compute(self, rid: object, tokens: list[int], table: np.ndarray, start: int) -> None:
        """The step: wait for the request's loads, then write blocks ``[start, ...)`` (partial ones get a request key)."""
        load = self.tm.load(rid)
        if load is not None:
            for layer in range(self.spec.num_layers):
                assert load.wait(layer, timeout=10) is TransferStatus.DONE
        keys = self.keys(tokens)
        for col in range(start, table.shape[1]):
            key = keys[col] if col < len(keys) else repr(rid).encode()
            for i, row in enumerate(self.rows(table)):
                block = int(table[i, col])
                if block >= 0:
                    write(self.memory.region, block, row, key)

    def admit(self, rid: object, tokens: list[int]) -> int:
        admission = self.manager.admit(rid, tokens)
        assert admission is not None
        cached = admission.num_cached_tokens // self.spec.block_size
        self.check_cached(tokens, admission.table, cached, rid)
        self.compute(rid, tokens, admission.table, cached)
        return admission.num_cached_tokens

    def check_cached(self, tokens: list[int], table: np.ndarray, cached: int, rid: object) -> None:
        """Every cached slot of the table holds its hash's bytes (after waiting for loads)."""
        load = self.tm.load(rid)
        if load is not None:
            assert load.wait(timeout=10) is TransferStatus.DONE
        keys = self.keys(tokens)
        for col in range(cached):
            for i, row in enumerate(self.rows(table)):
                block = int(table[i, col])
                if block >= 0:
                    assert read(self.memory.region, block, row) == pattern(keys[col], row, len(
                        read(self.memory.region, block, row))), f"request {rid!r} column {col} row {row}: wrong bytes"

    def check_host(self) -> None:
        """Every hash the tier can serve has its bytes in the host block the tier names."""
        self.tm.check_integrity()
        self.manager.check_integrity()
        index = self.tm._index
        rows, blocks = index.held_pairs()
        if not rows.size:
            return
        hashes, _ = index.hashes_at(rows, blocks)
        ready = self.tm.host_blocks_of(b"".join(bytes(h) for h in hashes))
        for r, b, h, found in zip(rows.tolist(), blocks.tolist(), hashes, ready):
            if found[r] < 0:
                continue  # a copy in flight
            row = None if self.uniform else r
            got = read(self.tm.host, b, row)
            assert got == pattern(bytes(h), row, len(got)), f"host block {b} row {r}: bytes differ from its hash"

    def close(self) -> None:
        self.tm.close()


@pytest.fixture
def tiers():
    made: list[Tier] = []

    def make(*args: Any, **kwargs: Any) -> Tier:
        made.append(Tier(*args, **kwargs))
        return made[-1]

    yield make
    for tier in made:
        tier.close()


def fill_gpu(tier: Tier, count: int = 1, base: int = 10_000) -> None:
    """Evict every cached GPU block without offering the host anything: one-token requests (no full block) fill the GPU."""
    for i in range(count):
        rids = [f"filler{base}-{i}-{j}" for j in range(tier.manager.num_blocks)]
        for j, rid in enumerate(rids):
            assert tier.manager.admit(rid, [base + j]) is not None
        for rid in rids:
            tier.manager.free(rid)


def only_on_host(tier: Tier, prompt: list[int], fills: int = 1) -> None:
    """Compute ``prompt`` as request "a", free it, wait until its blocks are on host, then evict them from the GPU."""
    tier.admit("a", prompt)
    tier.manager.free("a")
    assert tier.tm.drain(10)
    fill_gpu(tier, fills)


# --------------------------------------------------------------------------- evict -> host hit -> identical bytes


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("mode", ["uniform", "head-wise"])
def test_evicted_blocks_come_back_from_host_byte_for_byte(tiers, name: str, mode: str) -> None:
    """A freed request's blocks go to host, leave the GPU, and a new admit of its prompt loads the same bytes back."""
    spec = make_spec(name)
    rows = None if mode == "uniform" else [Full()] * spec.kv_heads_per_rank
    tier = tiers(spec, num_blocks=12, host_blocks=16, rows=rows)
    prompt = list(range(1, 26))  # 6 full blocks and one token: a hit may take 6
    assert tier.admit("a", prompt) == 0
    tier.manager.free("a")
    assert tier.tm.drain(10)
    assert tier.tm.stats().offloaded_blocks == 6
    tier.manager.take_events()
    fill_gpu(tier, 2)
    assert tier.tm.lookup(prompt) == (0, 24)
    removed = [e for e in tier.manager.take_events() if isinstance(e, BlockRemoved) and e.medium == "GPU"]
    assert {h for e in removed for h in e.block_hashes} >= set(tier.keys(prompt))
    assert tier.admit("b", prompt) == 24  # check_cached inside: identical bytes
    tier.tm.poll()
    tier.check_host()
    assert tier.tm.stats().loaded_blocks == 6 and tier.tm.stats().hit_tokens == 24


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stored_events_are_the_maximal_runs_of_kept_columns(tiers, data) -> None:
    """Offload events: per row group, its kept columns in order, each event consecutive columns, no two neighbours
    mergeable; the group's window and the columns' extra keys go with them."""
    from kvcache.transfer.manager import stored_events

    spec = make_spec("bf16", num_kv_heads=3)
    tier = tiers(spec, num_blocks=8, host_blocks=8, rows=[Full(), Window(8), Window(16, 4)])  # three groups
    bs, chain_len = spec.block_size, 24
    cols = np.array(sorted(data.draw(st.sets(st.integers(0, chain_len - 1), min_size=1, max_size=chain_len))),
                    dtype=np.intp)
    present = np.array(data.draw(st.lists(st.sampled_from([(1, 1, 1), (1, 0, 0), (1, 1, 0), (0, 1, 1)]),
                                          min_size=cols.size, max_size=cols.size)), dtype=bool).T
    keep = np.array(data.draw(st.lists(st.booleans(), min_size=cols.size, max_size=cols.size)), dtype=bool)
    keep[data.draw(st.integers(0, cols.size - 1))] = True
    chain = bytes(range(256)) * (chain_len * 32 // 256 + 1)
    chain = chain[: chain_len * 32]
    tokens = np.arange(chain_len * bs, dtype=np.uint32)
    extra = tuple(None if c % 3 else ("lora", c) for c in range(chain_len))
    src = np.where(present, 1, -1).astype(np.int32)
    events = stored_events(tier.manager, chain, tokens, "lora", extra, cols[keep], src[:, keep])
    assert [e.group for e in events] == sorted(e.group for e in events), "groups in order"
    for g, window in enumerate([None, 8, 16]):
        mine = [e for e in events if e.group == g]
        held = [int(c) for c, k, p in zip(cols, keep, present[g]) if k and p]
        assert [c for e in mine for c in range(e.token_ids[0] // bs, e.token_ids[-1] // bs + 1)] == held
        for e in mine:
            first, n = int(e.token_ids[0]) // bs, len(e.block_hashes)
            assert e.window == window and e.medium == "CPU" and e.lora == "lora"
            assert b"".join(e.block_hashes) == chain[first * 32:(first + n) * 32]
            assert e.parent_block_hash == (chain[(first - 1) * 32:first * 32] if first else None)
            assert list(e.token_ids) == list(range(first * bs, (first + n) * bs))
            assert e.extra_keys == extra[first:first + n]
        for e, after in zip(mine, mine[1:]):
            end = int(e.token_ids[-1]) // bs + 1
            start = int(after.token_ids[0]) // bs
            assert end != start or any(k and not p for c, k, p in zip(cols, keep, present[g]) if c == end), \
                "two neighbouring events could be one"


def test_window_rows_load_only_blocks_the_host_holds(tiers) -> None:
    """Head-wise with SWA rows: a decoded request's recycled window blocks never reach host, yet its prompt hits in full."""
    spec = make_spec("bf16", num_kv_heads=2)
    tier = tiers(spec, num_blocks=24, host_blocks=32, rows=[Full(), Window(8, 4)])
    prompt = list(range(1, 10))
    assert tier.admit("a", prompt) == 0
    generated = list(range(500, 520))
    for i, token in enumerate(generated):
        table = tier.manager.extend("a", [token])
        assert table is not None
        tier.compute("a", prompt + generated[: i + 1], table, (len(prompt) + i) // spec.block_size)
    tokens = prompt + generated
    recycled = tier.manager.table("a")[1] < 0
    assert recycled.any(), "the window row should have given blocks back"
    tier.manager.free("a")
    assert tier.tm.drain(10)
    stored = [e for e in tier.manager.take_events() if isinstance(e, BlockStored) and e.medium == "CPU"]
    full = {c for e in stored if e.group == 0 for c in range(e.token_ids[0] // spec.block_size,
                                                               e.token_ids[-1] // spec.block_size + 1)}
    window = {c for e in stored if e.group == 1 for c in range(e.token_ids[0] // spec.block_size,
                                                               e.token_ids[-1] // spec.block_size + 1)}
    assert window < full, "recycled columns are stored for the full row only"
    fill_gpu(tier, 2)
    gpu, host = tier.tm.lookup(tokens)
    assert gpu == 0 and host == (len(tokens) - 1) // spec.block_size * spec.block_size
    admission = tier.manager.admit("b", tokens)
    assert admission.num_cached_tokens == host
    cached = host // spec.block_size
    window = admission.table[1, :cached]
    assert (window[recycled[:cached]] == -1).all(), "a window row gets no block where the host has none"
    tier.check_cached(tokens, admission.table, cached, "b")
    tier.check_host()


def cell_units(region: KVRegion, cells: np.ndarray, row: int, block: int) -> list[tuple[int, int]]:
    """(address, bytes) of every (layer, tensor, head) of ``block`` that table row ``row`` holds."""
    out = []
    for layer, head in zip(*np.nonzero(cells == row)):
        for t, tensor in enumerate(region.tensors):
            unit = tensor.bytes_per_block // region.heads
            out.append((int(region.addrs[layer, t]) + block * int(region.block_strides[layer, t]) + int(head) * unit,
                        unit))
    return out


@pytest.mark.parametrize("name", ["bf16", "block_wise_fp8", "mla_fp8"])
def test_layer_group_rows_go_to_host_and_come_back_byte_for_byte(name: str) -> None:
    """Rows that are layer groups with pools of their own (the sliding layers' row smaller than the full layer's):
    a decoded request's blocks reach host per row, the window row's recycled columns never do, and after the GPU
    forgets them an admit loads every row's cells back into its own layers, byte for byte."""
    from kvcache.allocator.rows import Row, cell_rows

    base = make_spec(name)
    heads = tuple(range(base.num_kv_heads))
    spec = CacheSpec(**{**{k: v for k, v in base.describe().items() if k not in ("kv_heads_per_rank", "rows")},
                        "rows": (Row(Window(8), (0, 2), heads), Row(Full(), (1,), heads))})
    row_blocks, layer_blocks = [10, 16], [10, 16, 10]
    memory, views = random_views(spec, layer_blocks, 0)
    gpu = KVRegion.from_tensors(spec, views)
    manager = KVCacheManager(16, spec.block_size, [Window(8), Full()], row_blocks=row_blocks, enable_events=True,
                             hash_seed=SEED)
    cells = cell_rows(spec.rows, spec.num_layers, spec.num_kv_heads, 1, 0)
    hasher = BlockHasher(spec.block_size, "sha256", SEED)

    def fill(rid: str, tokens: list[int], table: np.ndarray, start: int) -> None:
        keys = hasher.hash_blocks(np.asarray(tokens, dtype=np.uint32))
        for col in range(start, table.shape[1]):
            key = keys[col] if col < len(keys) else rid.encode()
            for row in range(2):
                if table[row, col] >= 0:
                    units = cell_units(gpu, cells, row, int(table[row, col]))
                    data = pattern(key, row, sum(n for _, n in units))
                    offset = 0
                    for addr, n in units:
                        ctypes.memmove(addr, data[offset:offset + n], n)
                        offset += n

    with TransferManager(manager, gpu, HostTierConfig(host_blocks=32)) as tm:
        tokens = list(range(1, 10))
        admission = manager.admit("a", tokens)
        fill("a", tokens, admission.table, 0)
        for token in range(500, 520):
            tokens.append(token)
            table = manager.extend("a", [token])
            fill("a", tokens, table, (len(tokens) - 1) // spec.block_size)
        recycled = manager.table("a")[0] < 0
        assert recycled.any(), "the window row should have given blocks back"
        manager.free("a")
        assert tm.drain(10)
        stored = [e for e in manager.take_events() if isinstance(e, BlockStored) and e.medium == "CPU"]
        by_group = [{c for e in stored if e.group == g
                     for c in range(e.token_ids[0] // spec.block_size, e.token_ids[-1] // spec.block_size + 1)}
                    for g in range(2)]
        assert by_group[0] < by_group[1], "recycled columns are stored for the full row only"
        manager.drop_cached(np.repeat([0, 1], 16), np.tile(np.arange(16), 2))
        memory[:] = 0  # what comes back must come from host
        gpu_hit, host_hit = tm.lookup(tokens)
        assert gpu_hit == 0 and host_hit == (len(tokens) - 1) // spec.block_size * spec.block_size
        admission = manager.admit("b", tokens)
        assert admission.num_cached_tokens == host_hit
        load = tm.load("b")
        for layer in range(spec.num_layers):
            assert load.wait(layer, timeout=10) is TransferStatus.DONE
        keys = hasher.hash_blocks(np.asarray(tokens, dtype=np.uint32))
        cached = host_hit // spec.block_size
        assert (admission.table[0, :cached][recycled[:cached]] == -1).all()
        checked = 0
        for col in range(cached):
            for row in range(2):
                block = int(admission.table[row, col])
                if block < 0:
                    continue
                assert block < row_blocks[row]
                got = b"".join(ctypes.string_at(a, n) for a, n in cell_units(gpu, cells, row, block))
                assert got == pattern(keys[col], row, len(got)), f"column {col} row {row}: wrong bytes"
                checked += 1
        assert checked > cached
        tm.poll()
        tm.check_integrity()
        manager.check_integrity()


def test_blocks_decoded_through_extend_many_reach_host_and_come_back(tiers) -> None:
    """Decode steps in one batch (the daemon's shape): the generated blocks are offloaded under the right keys."""
    spec = make_spec("bf16")
    tier = tiers(spec, num_blocks=24, host_blocks=32)
    prompts = {"a": list(range(1, 8)), "b": list(range(100, 111))}
    tokens = {rid: list(p) for rid, p in prompts.items()}
    for rid, prompt in prompts.items():
        assert tier.admit(rid, prompt) == 0
    for step in range(13):  # "b" is listed twice in a step: two tokens, in order
        new = {"a": [200 + step], "b": [300 + 2 * step, 301 + 2 * step]}
        views = tier.manager.extend_many(["a", "b", "b"], new["a"] + new["b"], [1, 1, 1])
        assert all(v is not None for v in views)
        for rid in ("a", "b"):
            start = (len(tokens[rid]) - 1) // spec.block_size
            tokens[rid] += new[rid]
            tier.compute(rid, tokens[rid], tier.manager.table(rid), start)
    for rid in ("a", "b"):
        tier.manager.free(rid)
    assert tier.tm.drain(10)
    fill_gpu(tier, 2)
    for rid in ("a", "b"):
        full = (len(tokens[rid]) - 1) // spec.block_size * spec.block_size
        assert tier.tm.lookup(tokens[rid]) == (0, full)
        assert tier.admit(f"{rid}-again", tokens[rid]) == full  # check_cached inside: identical bytes
    tier.check_host()


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_tier_extension_matches_a_loop_over_lengths(data) -> None:
    """tier_extension equals trying every length and checking each needed block one by one."""
    k = data.draw(st.integers(0, 12))
    groups = data.draw(st.integers(1, 3))
    present = np.array(data.draw(st.lists(st.lists(st.booleans(), min_size=groups, max_size=groups),
                                          min_size=k, max_size=k)), dtype=bool).reshape(k, groups)
    policies = [data.draw(st.one_of(st.just(Full()), st.builds(Window, st.integers(1, 20), st.integers(0, 9))))
                for _ in range(groups)]
    start = data.draw(st.integers(0, 6))
    bs = data.draw(st.sampled_from([1, 2, 4]))
    best = 0
    for length in range(k + 1):
        total = start + length
        ok = True
        for g, policy in enumerate(policies):
            for j in range(length):
                pos = start + j
                if isinstance(policy, Window):  # the next query, token total*bs, sees the sink and its window
                    in_sink = pos * bs < policy.sink_tokens
                    in_window = (pos + 1) * bs - 1 >= total * bs - policy.window_tokens + 1
                    if not (in_sink or in_window):
                        continue
                ok &= bool(present[j, g])
        if ok:
            best = length
    assert tier_extension(present, start, policies, bs) == best


# --------------------------------------------------------------------------- LRU and events


def test_full_host_evicts_least_recently_used_with_cpu_removed_events(tiers) -> None:
    """Host of 4 blocks: A, B offloaded; A hit again (refreshed); C's offload pushes out B, tail first."""
    spec = make_spec()
    tier = tiers(spec, num_blocks=8, host_blocks=4)
    a, b, c = (list(range(s, s + 9)) for s in (1, 100, 200))
    for rid, tokens in (("a", a), ("b", b)):
        tier.admit(rid, tokens)
        tier.manager.free(rid)
        assert tier.tm.drain(10)
    fill_gpu(tier, 2)
    assert tier.tm.lookup(a) == (0, 8) and tier.tm.lookup(b) == (0, 8)
    tier.manager.take_events()
    assert tier.admit("a2", a) == 8  # loaded from host: A's host blocks become most recent
    tier.manager.free("a2")
    tier.tm.drain(10)
    tier.admit("c", c)
    tier.manager.free("c")
    assert tier.tm.drain(10)
    events = [e for e in tier.manager.take_events() if e.medium == "CPU"]
    assert [type(e).__name__ for e in events] == ["BlockRemoved", "BlockStored"]
    assert events[0].block_hashes == tuple(tier.keys(b)[::-1]), "B leaves, its tail first"
    assert events[1].block_hashes == tuple(tier.keys(c)) and events[1].parent_block_hash is None
    assert list(events[1].token_ids) == c[:8]
    fill_gpu(tier, 2, base=50_000)
    assert tier.tm.lookup(b) == (0, 0) and tier.tm.lookup(a) == (0, 8) and tier.tm.lookup(c) == (0, 8)
    assert tier.tm.stats().evicted_blocks == 2
    tier.check_host()


def test_cpu_events_reach_vllm_subscribers_with_their_medium() -> None:
    """The vLLM encoding carries medium "CPU" in BlockStored and BlockRemoved, where vLLM's structs have it."""
    stored = BlockStored((b"h" * 32,), None, np.arange(4, dtype=np.uint32), 4, medium="CPU")
    removed = BlockRemoved((b"h" * 32,), medium="CPU")
    _, events, _ = msgpack.unpackb(encode_batch([stored, removed], ts=0.0, dp_rank=0))
    assert events[0]["type"] == "BlockStored" and events[0]["medium"] == "CPU"
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [int.from_bytes(b"h" * 8, "big")], "medium": "CPU",
                         "group_idx": 0}


def test_blocks_shared_with_a_live_request_are_not_offloaded_yet(tiers) -> None:
    """Only blocks whose last reference goes are copied; the shared prefix follows when its last user frees it."""
    spec = make_spec()
    tier = tiers(spec, num_blocks=16, host_blocks=16)
    prompt = list(range(1, 18))
    tier.admit("a", prompt)
    tier.admit("b", prompt[:9] + [999] * 8)
    tier.manager.free("a")
    tier.tm.drain(10)
    assert tier.tm.stats().offloaded_blocks == 2  # a's blocks 2 and 3; 0 and 1 are b's too
    tier.manager.free("b")
    tier.tm.drain(10)
    assert tier.tm.stats().offloaded_blocks == 6
    tier.check_host()


# --------------------------------------------------------------------------- failures leave nothing half-registered


def test_timed_out_offload_registers_nothing_and_retires_its_blocks(tiers, caplog) -> None:
    """A copy past its deadline never becomes findable, announces nothing, and its host blocks are not reused."""
    spec = make_spec()
    tier = tiers(spec, num_blocks=8, host_blocks=8, timeout=1e-9)
    tier.admit("a", list(range(1, 10)))
    tier.manager.take_events()
    with caplog.at_level(logging.WARNING, "kvcache.transfer.manager"):
        tier.manager.free("a")
        assert tier.tm.drain(10)
    assert "timeout" in caplog.text
    stats = tier.tm.stats()
    assert (stats.offloaded_blocks, stats.cached_blocks, stats.retired_blocks, stats.free_blocks) == (0, 0, 2, 6)
    assert not [e for e in tier.manager.take_events() if e.medium == "CPU"]
    fill_gpu(tier, 2)
    assert tier.tm.lookup(list(range(1, 10))) == (0, 0)
    tier.check_host()


def test_timed_out_load_forgets_its_gpu_blocks_and_names_the_request(tiers) -> None:
    """A load past its deadline: the request is reported, its GPU blocks lose their hashes, the host copy stays."""
    spec = make_spec()
    tier = tiers(spec, num_blocks=8, host_blocks=8)
    prompt = list(range(1, 10))
    only_on_host(tier, prompt, fills=2)
    tier.manager.take_events()
    tier.tm._in.timeout = 1e-9  # the load engine's deadline: real expiry, nothing stubbed
    admission = tier.manager.admit("b", prompt)
    assert admission.num_cached_tokens == 8
    assert tier.tm.load("b").wait() is TransferStatus.TIMEOUT
    tier.tm.poll()
    assert tier.tm.take_failed() == ["b"]
    assert tier.tm.lookup(prompt) == (0, 8), "the GPU forgot the blocks; the host still has them"
    removed = [e for e in tier.manager.take_events() if isinstance(e, BlockRemoved) and e.medium == "GPU"]
    assert removed and set(removed[-1].block_hashes) == set(tier.keys(prompt))
    tier.check_host()
    tier.manager.free("b")
    tier.tm._in.timeout = 30.0
    assert tier.admit("b", prompt) == 8  # identical bytes this time
    tier.check_host()


def test_offload_still_copying_when_its_block_is_reused_is_dropped(tiers) -> None:
    """An eviction never waits: a copy that has not finished when its GPU block gets a new owner is dropped."""
    spec = make_spec()
    tier = tiers(spec, num_blocks=4, host_blocks=8)
    tier.admit("a", list(range(1, 10)))
    # Keep the offload engine's one worker busy, so a's copy queues behind it.
    big = np.zeros(1 << 28, dtype=np.uint8)
    other = np.empty_like(big)
    busy = tier.tm._out.submit(CopyRanges(np.array([big.ctypes.data]), np.array([other.ctypes.data]),
                                          np.array([big.nbytes])))
    tier.manager.free("a")
    assert tier.tm.stats().pending_offloads == 1
    tier.admit("b", list(range(100, 116)))  # needs all 4 GPU blocks: evicts a's two cached ones
    assert busy.wait(30) is TransferStatus.DONE
    assert tier.tm.drain(10)
    stats = tier.tm.stats()
    assert (stats.dropped_blocks, stats.offloaded_blocks, stats.free_blocks) == (2, 0, 8)
    assert tier.tm.lookup(list(range(1, 10))) == (0, 0)
    tier.check_host()


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("config, field", [
    (dict(), "host_bytes/host_blocks"),
    (dict(host_bytes=10, host_blocks=1), "host_bytes/host_blocks"),
    (dict(host_blocks=0), "host_blocks"),
    (dict(host_blocks=True), "host_blocks"),
    (dict(host_bytes=-5), "host_bytes"),
    (dict(host_blocks=4, engine="nixl"), "engine"),
    (dict(host_blocks=4, timeout=0), "timeout"),
    (dict(host_blocks=4, cuda_method="fast"), "cuda_method"),
])
def test_bad_config_is_refused_naming_the_field(config: dict, field: str) -> None:
    with pytest.raises(KVCacheError, match=f"^{field}:"):
        HostTierConfig(**config)


def test_bad_pairing_is_refused_and_changes_nothing() -> None:
    spec = make_spec()
    memory = Memory(spec, 8)
    manager = KVCacheManager.from_spec(spec, 8)
    with pytest.raises(KVCacheError, match="^host_bytes:"):
        TransferManager(manager, memory.region, HostTierConfig(host_bytes=100))
    with pytest.raises(KVCacheError, match="^gpu: layer 0 holds 8 blocks, but its rows hand out 9"):
        TransferManager(KVCacheManager.from_spec(spec, 9), memory.region, HostTierConfig(host_blocks=4))
    with pytest.raises(KVCacheError, match="^gpu: block_size"):
        TransferManager(KVCacheManager(8, 8), memory.region, HostTierConfig(host_blocks=4))
    with pytest.raises(KVCacheError, match="^manager: .*enable_prefix_caching"):
        TransferManager(KVCacheManager.from_spec(spec, 8, enable_prefix_caching=False), memory.region,
                        HostTierConfig(host_blocks=4))
    assert manager.tier is None
    with TransferManager(manager, memory.region, HostTierConfig(host_blocks=4)) as tm:
        with pytest.raises(KVCacheError, match="^tier: this manager already has a tier"):
            TransferManager(manager, memory.region, HostTierConfig(host_blocks=4))
        assert manager.tier is tm
    assert manager.tier is None


def test_host_bytes_round_down_to_whole_blocks() -> None:
    spec = make_spec()
    assert HostTierConfig(host_bytes=spec.bytes_per_block * 5 + 7).num_blocks(spec) == 5


def test_reset_prefix_cache_empties_the_host_tier_too(tiers) -> None:
    spec = make_spec()
    tier = tiers(spec, num_blocks=8, host_blocks=8)
    tier.admit("a", list(range(1, 10)))
    tier.manager.free("a")
    tier.tm.drain(10)
    tier.manager.reset_prefix_cache()
    assert tier.tm.lookup(list(range(1, 10))) == (0, 0)
    assert tier.tm.stats().free_blocks == 8
    tier.check_host()


def test_a_reset_that_keeps_the_lower_tier_forgets_only_the_gpu_blocks(tiers) -> None:
    spec = make_spec()
    tier = tiers(spec, num_blocks=8, host_blocks=8)
    prompt = list(range(1, 10))
    tier.admit("a", prompt)
    tier.manager.free("a")
    tier.tm.drain(10)
    assert tier.manager.lookup(prompt) == 8
    tier.manager.reset_prefix_cache(keep_lower_tier=True)
    assert tier.tm.lookup(prompt) == (0, 8) and tier.tm.stats().cached_blocks == 2
    again = tier.manager.admit("b", prompt)
    assert again.num_cached_tokens == again.num_host_tokens == 8  # every cached token from host now
    tier.check_host()


# --------------------------------------------------------------------------- state machine


class TierMachine(RuleBasedStateMachine):
    """Random admit / extend / free / drain / reset over a small GPU and host: pools, index and bytes stay consistent."""

    MODE = "uniform"

    def __init__(self) -> None:
        super().__init__()
        spec = make_spec("block_wise_fp8", num_layers=2, num_kv_heads=2, block_size=2)
        rows = None if self.MODE == "uniform" else [Full(), Window(3, 1)]
        self.tier = Tier(spec, num_blocks=10, host_blocks=8, rows=rows)
        self.live: dict[str, list[int]] = {}
        self.count = 0

    @rule(prefix=st.sampled_from([(), (1, 2), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6), (7, 8, 9)]),
          tail=st.lists(st.integers(1, 9), min_size=1, max_size=3))
    def admit(self, prefix: tuple[int, ...], tail: list[int]) -> None:
        tokens = list(prefix) + tail
        rid = f"r{self.count}"
        self.count += 1
        admission = self.tier.manager.admit(rid, tokens)
        if admission is None:
            return
        cached = admission.num_cached_tokens // self.tier.spec.block_size
        self.tier.check_cached(tokens, admission.table, cached, rid)
        self.tier.compute(rid, tokens, admission.table, cached)
        self.live[rid] = tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(st.integers(1, 9), min_size=1, max_size=3))
    def extend(self, data, new: list[int]) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        before = len(self.live[rid])
        table = self.tier.manager.extend(rid, new)
        if table is None:
            return
        self.live[rid] = self.live[rid] + new
        self.tier.compute(rid, self.live[rid], table, before // self.tier.spec.block_size)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        del self.live[rid]
        self.tier.manager.free(rid)

    @rule(settle=st.booleans())
    def evict_gpu(self, settle: bool) -> None:
        """One-token requests take every allocatable GPU block, evicting the cached ones, then leave.

        Without ``settle``, offloads still in flight meet their blocks' eviction.
        """
        manager = self.tier.manager
        if settle:
            assert self.tier.tm.drain(10)
        rids = [f"fill{self.count}-{j}" for j in range(int(manager.num_free_blocks.min()))]
        self.count += 1
        for rid in rids:
            assert manager.admit(rid, [1]) is not None
        for rid in rids:
            manager.free(rid)

    @rule()
    def drain(self) -> None:
        assert self.tier.tm.drain(10)

    @rule()
    def poll(self) -> None:
        self.tier.tm.poll()

    @rule()
    def reset(self) -> None:
        self.tier.manager.reset_prefix_cache()

    @invariant()
    def consistent(self) -> None:
        self.tier.check_host()
        stats = self.tier.tm.stats()
        assert stats.failed_loads == 0 and stats.retired_blocks == 0

    def teardown(self) -> None:
        self.tier.close()


class HeadWiseTierMachine(TierMachine):
    MODE = "head-wise"


_machine_settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = _machine_settings
TestHeadWiseTierMachine = HeadWiseTierMachine.TestCase
TestHeadWiseTierMachine.settings = _machine_settings


# --------------------------------------------------------------------------- benchmark


@pytest.mark.parametrize("daemon", [False, True])
def test_bench_tier_quick_reports_offload_and_reload_against_one_memcpy(capsys, daemon: bool) -> None:
    """`kvcache bench tier --quick --json --device cpu` (in process, or through a real daemon and a TierAgent) runs
    end to end and exits 0; no assertion is about speed."""
    from kvcache.cli import main

    flags = ["--daemon"] if daemon else []
    assert main(["bench", "tier", "--quick", "--json", "--device", "cpu", "--repeat", "1", *flags]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = [r for r in result["rows"] if "of_limit" in r]
    assert [(r["path"].split()[0], r["block_size"]) for r in rows] == [
        ("offload", 16), ("reload", 16), ("offload", 64), ("reload", 64)]
    for r in rows:
        assert r["bytes"] == 4096 * 8 * 128 * 2 * 2 * result["config"]["layers"]
        assert r["ms"] > 0 and r["limit_ms"] > 0 and r["of_limit"] > 0 and isinstance(r["ok"], bool)
        assert 0 < r["call_ms"] <= r["ms"]
    admits = [r for r in result["rows"] if "ratio" in r]
    assert [r["block_size"] for r in admits] == [16, 64] and all(r["ratio"] > 0 for r in admits)
    assert ("kvcache serve" in result["info"]["through"]) == daemon


# --------------------------------------------------------------------------- loads in flight


def occupy(engine: Any, nbytes: int = 1 << 28) -> Any:
    """Queue one large host copy on ``engine``'s single worker, so what is queued next waits behind it."""
    big = np.zeros(nbytes, dtype=np.uint8)
    other = np.empty_like(big)
    handle = engine.submit(CopyRanges(np.array([big.ctypes.data]), np.array([other.ctypes.data]),
                                      np.array([big.nbytes])))
    handle.keep = (big, other)
    return handle


def test_a_hit_on_blocks_still_loading_waits_for_that_load(tiers) -> None:
    """B's load is queued; C, admitted now, hits B's new GPU blocks, so C's Load includes B's copies."""
    spec = make_spec()
    tier = tiers(spec, num_blocks=16, host_blocks=16)
    prompt = list(range(1, 14))
    only_on_host(tier, prompt)
    busy = occupy(tier.tm._in)
    b = tier.manager.admit("b", prompt)
    c = tier.manager.admit("c", prompt)
    assert (b.num_cached_tokens, c.num_cached_tokens) == (12, 12)
    assert (c.table[:, :3] == b.table[:, :3]).all(), "C's hit is on the GPU blocks B is loading"
    load = tier.tm.load("c")
    assert load is not None and load.status() is TransferStatus.PENDING
    assert busy.wait(30) is TransferStatus.DONE
    assert load.wait(timeout=10) is TransferStatus.DONE
    tier.check_cached(prompt, c.table, 3, "c")
    tier.tm.poll()
    assert tier.tm.load("c") is None and tier.tm.stats().pending_loads == 0
    tier.check_host()


def test_a_request_freed_while_loading_is_not_reused_mid_copy(tiers) -> None:
    """free() of a request whose load is still queued waits for the load (bounded by its deadline) before its blocks go."""
    spec = make_spec()
    tier = tiers(spec, num_blocks=8, host_blocks=8)
    prompt = list(range(1, 14))
    only_on_host(tier, prompt)
    busy = occupy(tier.tm._in)
    tier.manager.admit("b", prompt)
    assert tier.tm.stats().pending_loads == 1
    tier.manager.free("b")  # an abort: the step never ran
    assert busy.done() and tier.tm.stats().pending_loads == 0
    fill_gpu(tier)  # new owners may write the blocks now
    assert tier.admit("c", prompt) == 12
    tier.check_host()


def test_a_journal_snapshot_holds_the_manager_without_its_tier(tiers) -> None:
    from kvcache.durability import STATE_CODEC

    tier = tiers(make_spec(), num_blocks=8, host_blocks=8)
    tier.admit("a", list(range(1, 10)))
    copy = STATE_CODEC.loads(STATE_CODEC.dumps(tier.manager))
    assert copy.tier is None and tier.manager.tier is tier.tm
    assert copy.table("a").tolist() == tier.manager.table("a").tolist()


# --------------------------------------------------------------------------- copies started by a submit thread


def test_free_and_admit_only_record_their_copies_the_submit_thread_starts_them(tiers) -> None:
    """With the submit thread held up, free() and admit() still return at once, their copies PENDING and unstarted;
    once it runs on, they land byte for byte and the load's blocks come back."""
    import threading

    from kvcache.transfer.copies import Copy

    spec = make_spec()
    tier = tiers(spec, num_blocks=8, host_blocks=8)
    gate = threading.Event()
    held = Copy(1, time.monotonic() + 30)
    tier.tm._submitter.put(held, lambda left: (gate.wait(left), [])[1] or [_done()])  # blocks the thread
    prompt = list(range(1, 10))
    tier.admit("a", prompt)
    tier.manager.free("a")  # its two full blocks go to host: an offload is recorded
    stats = tier.tm.stats()
    assert stats.pending_offloads == 1 and stats.offloaded_blocks == 0
    offload = next(iter(tier.tm._offloads.values())).copy
    assert offload.status() is TransferStatus.PENDING and offload._handles is None, "nothing started yet"
    gate.set()
    assert tier.tm.drain(10) and tier.tm.stats().offloaded_blocks == 2
    fill_gpu(tier, 2)
    gate.clear()
    tier.tm._submitter.put(Copy(1, time.monotonic() + 30), lambda left: (gate.wait(left), [])[1] or [_done()])
    admission = tier.manager.admit("b", prompt)
    assert admission.num_cached_tokens == 8 and admission.num_host_tokens == 8
    load = tier.tm.load("b")
    assert load.status() is TransferStatus.PENDING and load.wait(0, timeout=0.05) is TransferStatus.PENDING
    gate.set()
    tier.check_cached(prompt, admission.table, 2, "b")  # waits for the load, then reads its blocks
    tier.check_host()


def _done() -> Any:
    from kvcache.transfer.engines import _Finished

    return _Finished(CopyRanges.concat([]), time.monotonic() + 1, TransferStatus.DONE)


def test_a_copy_unstarted_at_its_deadline_times_out_and_never_starts() -> None:
    from kvcache.transfer.copies import Copy

    copy = Copy(2, time.monotonic() + 0.05)
    assert copy.status() is TransferStatus.PENDING and copy.wait(0, timeout=0.001) is TransferStatus.PENDING
    assert copy.wait(1) is TransferStatus.TIMEOUT  # bounded by the deadline
    started = []
    copy.start(lambda left: started.append(left) or [_done(), _done()])
    assert started == [] and copy.status() is TransferStatus.TIMEOUT and copy.ended()
    assert "not started by its deadline" in copy.error


def test_a_copy_whose_start_raises_fails_every_layer_and_the_thread_goes_on(caplog) -> None:
    from kvcache.transfer.copies import Copy, Submitter

    submitter = Submitter("test-submit")
    try:
        bad, good = Copy(2, time.monotonic() + 10), Copy(2, time.monotonic() + 10)

        def refuse(left: float) -> list:
            raise KVCacheError("src_blocks: 99 is not a block id")

        with caplog.at_level(logging.ERROR, "kvcache.transfer.copies"):
            submitter.put(bad, refuse)
            submitter.put(good, lambda left: [_done(), _done()])
            assert good.wait(timeout=5) is TransferStatus.DONE
        assert bad.wait(1) is TransferStatus.FAILED and bad.ended() and "99 is not a block id" in bad.error
        assert "could not start" in caplog.text
    finally:
        submitter.close(5)


def test_copies_start_in_the_order_they_were_put() -> None:
    from kvcache.transfer.copies import Copy, Submitter

    submitter = Submitter("test-submit")
    order: list[int] = []
    try:
        copies = [Copy(1, time.monotonic() + 10) for _ in range(20)]
        for i, copy in enumerate(copies):
            submitter.put(copy, lambda left, i=i: order.append(i) or [_done()])
        assert all(c.wait(timeout=5) is TransferStatus.DONE for c in copies)
        assert order == list(range(20))
    finally:
        submitter.close(5)


# --------------------------------------------------------------------------- staged copies (their plan, on the CPU)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_staged_plan_moves_every_byte_where_the_direct_copy_would(data) -> None:
    """Gathering each range into its piece's slot and moving the slots' host runs in DMAs writes exactly what copying
    the ranges directly writes, each piece fits its slot, and pieces follow the layers (cuts) in order."""
    from kvcache.transfer import staged

    layers = data.draw(st.integers(1, 4))
    unit = data.draw(st.sampled_from([16, 48, 4096]))
    per_layer = data.draw(st.lists(st.integers(0, 12), min_size=layers, max_size=layers))
    to_host = data.draw(st.booleans())
    slot, chunk = data.draw(st.sampled_from([(64, 32), (8192, 4096), (1 << 20, 1 << 16)]))
    total = sum(per_layer)
    gpu_units = data.draw(st.permutations(range(max(total, 1) * 2)))[:total]
    host_units = data.draw(st.permutations(range(max(total, 1) * 2)))[:total]
    lengths = np.array(data.draw(st.lists(st.integers(1, 3), min_size=total, max_size=total)), dtype=np.int64) * unit
    span = int(unit * 3 * max(total, 1) * 2)
    gpu = np.random.default_rng(1).integers(0, 255, 2 * span, dtype=np.uint8)
    gpu_addr = np.array(gpu_units, dtype=np.int64) * unit * 3
    host_addr = np.array(host_units, dtype=np.int64) * unit * 3
    if data.draw(st.booleans()):  # each layer's ranges tile one host span, in a scrambled order (a host tier's copy)
        first = 0
        for a, b in zip(np.cumsum([0, *per_layer])[:-1].tolist(), np.cumsum(per_layer).tolist()):
            order = np.array(data.draw(st.permutations(range(b - a))), dtype=np.int64) + a
            host_addr[order] = span + first + np.cumsum(lengths[order]) - lengths[order]
            first += int(lengths[a:b].sum()) + unit * data.draw(st.integers(0, 2))
        span *= 2
    ranges = CopyRanges(gpu_addr, host_addr, lengths) if to_host else CopyRanges(host_addr, gpu_addr, lengths)
    cuts = np.concatenate(([0], np.cumsum(per_layer))).astype(np.int64)
    source = gpu if to_host else gpu[::-1].copy()  # the host side's bytes when loading
    expected = np.zeros(span, dtype=np.uint8)
    for s, d, n in zip(ranges.src.tolist(), ranges.dst.tolist(), ranges.length.tolist()):
        expected[d:d + n] = source[s:s + n]
    old = staged.SLOT_BYTES, staged.CHUNK_BYTES
    staged.SLOT_BYTES, staged.CHUNK_BYTES = slot, chunk
    try:
        plan = staged._plan(ranges, cuts, to_host)
    finally:
        staged.SLOT_BYTES, staged.CHUNK_BYTES = old
    slots = np.zeros((max(plan.num_pieces, 1), slot + chunk), dtype=np.uint8)
    assert (plan.length <= chunk).all() and (plan.offset + plan.length <= slot + chunk).all()
    assert (np.diff(plan.piece) >= 0).all() and plan.layer_end_piece.tolist() == sorted(plan.layer_end_piece.tolist())
    out = np.zeros(span, dtype=np.uint8)
    for p in range(plan.num_pieces):  # a load: DMA host runs into the slot, then scatter; an offload the other way
        dmas = range(int(plan.dma_starts[p]), int(plan.dma_starts[p + 1]))
        gathered = range(int(plan.piece_starts[p]), int(plan.piece_starts[p + 1]))
        if not to_host:
            for j in dmas:
                o, h, n = int(plan.dma_offset[j]), int(plan.dma_host[j]), int(plan.dma_length[j])
                slots[p, o:o + n] = source[h:h + n]
        for i in gathered:
            o, g, n = int(plan.offset[i]), int(plan.gpu[i]), int(plan.length[i])
            if to_host:
                slots[p, o:o + n] = source[g:g + n]
            else:
                out[g:g + n] = slots[p, o:o + n]
        if to_host:
            for j in dmas:
                o, h, n = int(plan.dma_offset[j]), int(plan.dma_host[j]), int(plan.dma_length[j])
                out[h:h + n] = slots[p, o:o + n]
    assert np.array_equal(out, expected)
    layer_of_piece = np.searchsorted(plan.layer_end_piece, np.arange(plan.num_pieces), side="right")
    ranges_layer = np.repeat(np.arange(layers), per_layer)
    moved = np.bincount(layer_of_piece[plan.piece], weights=plan.length, minlength=layers)
    assert np.array_equal(moved, np.bincount(ranges_layer, weights=lengths, minlength=layers)), "a piece left its layer"


def test_staging_suits_copies_whose_host_side_comes_in_long_runs() -> None:
    """One run of 32 KiB blocks is staged; scattered 32 KiB host blocks go through the copy kernel directly."""
    from kvcache.transfer.staged import StagedCopier

    n, unit = 64, 32 << 10
    scattered = np.random.default_rng(0).permutation(4 * n)[:n].astype(np.int64) * unit
    gpu = np.arange(n, dtype=np.int64)[::-1] * unit + (1 << 40)
    length = np.full(n, unit, dtype=np.int64)
    run = np.arange(n, dtype=np.int64) * unit
    assert StagedCopier.suits(CopyRanges(gpu, run, length), to_host=True)
    assert StagedCopier.suits(CopyRanges(run, gpu, length), to_host=False)
    assert not StagedCopier.suits(CopyRanges(gpu, scattered, length), to_host=True)
    assert not StagedCopier.suits(CopyRanges(scattered, gpu, length), to_host=False)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_the_c_staged_plan_is_the_numpy_plan(data) -> None:
    """``_ranges.stage_plan`` lays every layout out as the numpy reference does: the same pieces, slot offsets and
    DMAs, array for array, whether each layer's host side tiles one span (mirrored) or not (sorted), long ranges cut."""
    from kvcache.transfer import staged

    layers = data.draw(st.integers(1, 5))
    unit = data.draw(st.sampled_from([16, 48, 4096]))
    per_layer = data.draw(st.lists(st.integers(0, 14), min_size=layers, max_size=layers))
    to_host = data.draw(st.booleans())
    slot, chunk = data.draw(st.sampled_from([(64, 32), (96, 40), (8192, 4096), (1 << 20, 1 << 16)]))
    total = sum(per_layer)
    lengths = np.array(data.draw(st.lists(st.integers(1, 40), min_size=total, max_size=total)), dtype=np.int64) * unit
    gpu_addr = np.array(data.draw(st.permutations(range(max(total, 1) * 2)))[:total], dtype=np.int64) * unit * 40
    host_addr = np.array(data.draw(st.permutations(range(max(total, 1) * 2)))[:total], dtype=np.int64) * unit * 40
    if data.draw(st.booleans()):  # each layer's ranges tile one host span (maybe with a gap: a load may still mirror)
        first = 1 << 30
        for a, b in zip(np.cumsum([0, *per_layer])[:-1].tolist(), np.cumsum(per_layer).tolist()):
            order = np.array(data.draw(st.permutations(range(b - a))), dtype=np.int64) + a
            host_addr[order] = first + np.cumsum(lengths[order]) - lengths[order]
            if b - a > 1 and data.draw(st.booleans()):
                host_addr[order[-1]] += unit * data.draw(st.integers(1, 3))
            first += int(lengths[a:b].sum()) + unit * data.draw(st.integers(0, 4))
    ranges = CopyRanges(gpu_addr, host_addr, lengths) if to_host else CopyRanges(host_addr, gpu_addr, lengths)
    cuts = np.concatenate(([0], np.cumsum(per_layer))).astype(np.int64)
    old = staged.SLOT_BYTES, staged.CHUNK_BYTES
    staged.SLOT_BYTES, staged.CHUNK_BYTES = slot, chunk
    try:
        fast, reference = staged._plan(ranges, cuts, to_host), staged._numpy_plan(ranges, cuts, to_host)
    finally:
        staged.SLOT_BYTES, staged.CHUNK_BYTES = old
    for name in staged._Plan.__slots__:
        assert np.array_equal(getattr(fast, name), getattr(reference, name)), name


def test_the_c_staged_plan_refuses_empty_ranges_and_bad_cuts() -> None:
    """stage_plan names what is wrong (a range of no bytes, cuts not ending at the ranges) and writes nothing."""
    from kvcache.transfer import _ranges

    out = [np.zeros(4, dtype=np.int64) for _ in range(11)]
    one = np.array([64], dtype=np.int64)
    with pytest.raises(ValueError, match="range 0 has 0 bytes"):
        _ranges.stage_plan(one, one, np.array([0], dtype=np.int64), np.array([0, 1], dtype=np.int64), True, 128, 64,
                           *out)
    with pytest.raises(ValueError, match="cuts must run from 0"):
        _ranges.stage_plan(one, one, one, np.array([0, 2], dtype=np.int64), True, 128, 64, *out)
    with pytest.raises(ValueError, match="chunk"):
        _ranges.stage_plan(one, one, one, np.array([0, 1], dtype=np.int64), True, 64, 64, *out)
    assert all(not o.any() for o in out)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_per_layer_ranges_are_each_layers_copy_ranges(data) -> None:
    """``copy_ranges_per_layer`` (C, every layer at once) gives, layer by layer, exactly ``copy_ranges`` of that
    layer alone, for tables of several rows read per layer or per kv head, ids -1 skipped."""
    from kvcache.transfer.regions import copy_ranges, copy_ranges_per_layer

    spec = make_spec(data.draw(st.sampled_from(["bf16", "int8", "mla_fp8"])), num_layers=data.draw(st.integers(1, 4)))
    num_blocks, rows, m = 12, data.draw(st.integers(1, 3)), data.draw(st.integers(0, 6))
    src, dst = Memory(spec, num_blocks, seed=1).region, Memory(spec, num_blocks, seed=2).region
    heads = src.heads
    cells = np.array(data.draw(st.lists(st.lists(st.integers(0, rows - 1), min_size=heads, max_size=heads),
                                        min_size=spec.num_layers, max_size=spec.num_layers)), dtype=np.int64)
    tables = []
    for _ in range(2):
        table = np.array([data.draw(st.permutations(range(num_blocks)))[:m] for _ in range(rows)], dtype=np.int32)
        table = table.reshape(rows, m)
        table[np.array(data.draw(st.lists(st.booleans(), min_size=rows * m, max_size=rows * m)),
                       dtype=bool).reshape(rows, m)] = -1
        tables.append(table)
    inner = data.draw(st.sets(st.integers(1, spec.num_layers - 1), max_size=3)) if spec.num_layers > 1 else set()
    bounds = [0, *sorted(inner), spec.num_layers]
    groups = list(copy_ranges_per_layer(src, tables[0], dst, tables[1], bounds, cell_rows=cells))
    assert len(groups) == len(bounds) - 1
    for first, stop, (ranges, cuts) in zip(bounds, bounds[1:], groups):
        assert cuts.tolist() == sorted(cuts.tolist()) and cuts[0] == 0 and cuts[-1] == ranges.num_ranges
        assert cuts.size == stop - first + 1
        for layer in range(first, stop):
            alone = copy_ranges(src, tables[0], dst, tables[1], layers=[layer], cell_rows=cells)
            part = ranges.select(slice(int(cuts[layer - first]), int(cuts[layer - first + 1])))
            for got, want in zip(part, alone):
                assert got.tolist() == want.tolist(), layer


def test_per_layer_ranges_check_the_pairs_and_bounds_before_the_first_group() -> None:
    """A destination written twice, or bounds that do not run from 0 to the layers, are refused at the call, before
    any group is worked out (so a copy never starts half planned)."""
    from kvcache.transfer.regions import copy_ranges_per_layer

    spec = make_spec()
    src, dst = Memory(spec, 8, seed=1).region, Memory(spec, 8, seed=2).region
    with pytest.raises(KVCacheError, match="written twice"):
        copy_ranges_per_layer(src, np.array([0, 1]), dst, np.array([2, 2]), [0, 3])
    with pytest.raises(KVCacheError, match="bounds"):
        copy_ranges_per_layer(src, np.array([0, 1]), dst, np.array([2, 3]), [0, 2])


# --------------------------------------------------------------------------- a host hit's plan in one C pass


def _books_state(books: HostBooks) -> list[np.ndarray]:
    return [a.copy() for a in books._pool._c_arrays()] + [books._filling.copy()]


def _host_history(books: HostBooks, rng: np.random.Generator) -> np.ndarray:
    """Allocate host blocks, make most findable and release some (the LRU); returns the blocks a load may pin."""
    pool, zero = books._pool, np.zeros(books.num_blocks, dtype=np.intp)
    got = pool.allocate(int(rng.integers(1, books.num_blocks + 1)), ascending=True).blocks[0]
    cached = got[rng.random(got.size) < 0.8]
    pool.mark_cached(zero[: cached.size], cached)
    released = rng.permutation(got)[: int(rng.integers(0, got.size + 1))]
    pool.decref(zero[: released.size], released, unique=True)
    return np.setdiff1d(got, released[~np.isin(released, cached)])  # not those free again and not findable


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 12), st.integers(0, 3))
def test_a_one_row_host_hit_is_planned_in_c_as_numpy_plans_it(seed, k, start):
    """A one-row tier plans a host hit's load in one C pass (``_tier.load_plan``): the same GPU and host blocks,
    the same pins in the host pool and the same marks on the GPU blocks as the numpy plan, which tiers of several
    rows still take; where a wanted column has no host block both refuse and change nothing."""
    rng = np.random.default_rng(seed)
    manager = KVCacheManager.from_spec(make_spec(), 32, hash_seed=SEED)
    fast, numpy_path = HostBooks(manager, 24), HostBooks(manager, 24)
    filled = rng.permutation(32)[:5]  # GPU blocks an earlier load fills
    for books in (fast, numpy_path):
        pinnable = _host_history(books, np.random.default_rng(seed))
        books._filling[0, filled] = 3
    found = np.full((k + 2, 1), -1, dtype=np.int32)  # held's blocks: two more columns than the hit takes
    picked = rng.permutation(pinnable)[:k]
    found[rng.permutation(k)[: picked.size], 0] = picked
    table = rng.permutation(32)[None, : start + k + 1].astype(np.int32)
    table[0, start:start + k][(found[:k, 0] < 0) | (rng.random(k) < 0.2)] = -1  # -1: a window row's skip
    if rng.random() < 0.2 and (found[:k, 0] < 0).any():  # a column wanting a block the tier lacks
        table[0, start + int(np.argmax(found[:k, 0] < 0))] = 31
    hashes = bytes(range(32)) * k
    for books in (fast, numpy_path):
        books._last_held = (hashes + bytes(64), found)
    before = _books_state(fast)
    lacking = bool(((table[0, start:start + k] >= 0) & (found[:k, 0] < 0)).any())
    if lacking:
        with pytest.raises(AssertionError, match="lost a block"):
            fast._load_plan(table, start, hashes, job=7)
        with pytest.raises(AssertionError, match="lost a block"):
            numpy_path._load_plan_rows(table[:, start:start + k], found[:k], job=7)
        for a, b in zip(_books_state(fast), before):
            np.testing.assert_array_equal(a, b)
        return
    src, dst, host_ids = fast._load_plan(table, start, hashes, job=7)
    want_dst, want_src, want_ids = numpy_path._load_plan_rows(table[:, start:start + k], found[:k], job=7)
    numpy_path._pool.hold_row(0, want_ids)
    for got, want in ((src, want_src), (dst, want_dst), (host_ids, want_ids)):
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want)
    for a, b in zip(_books_state(fast), _books_state(numpy_path)):
        np.testing.assert_array_equal(a, b)
    fast._pool.check_integrity()


def test_a_one_row_full_manager_takes_every_block_held_finds() -> None:
    """With one Full row, the tier's part of a hit is every block ``held`` found (it stops at the first the row
    lacks): the manager takes that count without ``tier_extension``, and the admit loads exactly those blocks."""
    tier = Tier(make_spec(), num_blocks=12, host_blocks=16)
    try:
        prompt = list(range(19))
        only_on_host(tier, prompt)
        hashes = tier.manager._hasher.hash_blocks_packed(np.asarray(prompt[:-1], dtype=np.uint32))
        n = len(hashes) // 32
        held = tier.tm.held(hashes)
        assert held.shape == (n, 1) and held.all()
        assert tier.manager._match_tier(hashes, 0, n) == (tier_extension(held, 0, [Full()], 4), None) == (n, None)
        assert tier.admit("b", prompt) == n * 4
        tier.check_host()
    finally:
        tier.close()

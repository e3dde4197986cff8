"""KV events numbered as vLLM numbers its groups: a kvcache daemon and a vLLM worker serving one model publish the
same ``group_idx`` values, one BlockStored (and BlockRemoved) per vLLM group.

vLLM 0.33's own grouping of each config is stored in tests/vectors/vllm-groups (``make_vectors.py`` wrote it from a
vLLM environment); where vLLM is importable, its planner is also asked live. ``kvcache serve --model`` reports the
plan's ``max_concurrency`` too.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import zmq

from kvcache.allocator import CacheSpec, Full, KVCacheManager, Window
from kvcache.allocator.events import AllBlocksCleared, BlockRemoved, BlockStored, renumber_groups
from kvcache.allocator.groups import kv_cache_groups, units_of, vllm_group_numbers
from kvcache.allocator.prefix import BlockHasher
from kvcache.allocator.rows import Row
from kvcache.client import CacheClient
from kvcache.events import KVEventPublisher
from kvcache.examples import load_example
from kvcache.plan import Load, make_plan
from test_events import VLLMRouterIndex, decode_event, endpoints, indexed, replay_from

VECTORS = json.loads((Path(__file__).parent / "vectors" / "vllm-groups" / "vllm-0.33-kv-cache-groups.json")
                     .read_text())
CASES = {case["name"]: case for case in VECTORS["cases"]}
BS = 4
SEED = b"event-groups-test"
def vllm_version() -> str | None:
    from kvcache.bench import vllm

    return vllm.version()


def case_spec(case: dict, head_wise: bool = False) -> CacheSpec:
    config = load_example(case["config"]) if isinstance(case["config"], str) else case["config"]
    return CacheSpec.from_hf_config(config, block_size=16, head_wise=head_wise)


def unit_name(unit: tuple[int, int]) -> str:
    layer, head = unit
    return f"layers.{layer}" if head < 0 else f"layers.{layer}.heads.{head}"


def as_vllm(policy) -> tuple[str, int | None]:
    """A policy as the vectors name a spec: vLLM's SlidingWindowSpec has no sink (every window cell shares one)."""
    return ("full", None) if isinstance(policy, Full) else ("window", policy.window_tokens)


def our_units(layout) -> list[list]:
    return [[unit_name(unit), *as_vllm(policy)] for unit, policy in units_of(layout)]


def our_groups(layout) -> list[dict]:
    return [{"kind": as_vllm(g.policy)[0], "size": as_vllm(g.policy)[1], "units": [unit_name(u) for u in g.units]}
            for g in kv_cache_groups(layout)]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("head_wise", [False, True], ids=["layer-rows", "head-wise-rows"])
def test_groups_are_vllm_0_33s_for_each_stored_config(name, head_wise):
    """Our reading of the config gives vLLM's units with their attention, and our grouping gives vLLM's groups,
    unit for unit, in its order; whether kvcache splits rows per kv head does not change them."""
    case = CASES[name]
    layout = case_spec(case, head_wise).row_layout
    assert our_units(layout) == case["units"]
    assert our_groups(layout) == case["groups"]


def test_the_stored_groups_are_the_issue_examples():
    """Gemma 3 4B: six sliding groups, then the full one; 27B: groups of 9, 9, 9, 9, 8, 8 sliding layers and 10
    full; GPT-OSS: one of each; Mistral: one; a head-wise config with few window heads: several full groups."""
    shape = {name: [(g["kind"], len(g["units"])) for g in case["groups"]] for name, case in CASES.items()}
    assert shape["gemma-3-4b"] == [("window", 5)] * 5 + [("window", 4), ("full", 5)]
    assert shape["gemma-3-27b"] == [("window", 9)] * 4 + [("window", 8)] * 2 + [("full", 10)]
    assert shape["gpt-oss-20b"] == [("window", 12), ("full", 12)]
    assert shape["mistral-7b-v0.1"] == [("window", 32)]
    assert shape["fastdeploy-head-wise-0.25"] == [("full", 37), ("full", 37)] + [("full", 36)] * 3 + [("window", 42)]
    assert VECTORS["source"].startswith("vLLM 0.33")


@pytest.mark.skipif(vllm_version() is None, reason="vllm is not importable (../shared/tools/setup-vllm.sh builds "
                                                   "an environment with it)")
def test_vllms_planner_groups_live_configs_as_we_do():
    """vLLM's get_kv_cache_groups and get_kv_cache_configs, asked now, on the stored configs and on random layer
    patterns (full, two windows, chunked layers; layer rows and head-wise cells)."""
    from kvcache.allocator.swa import Chunked
    from kvcache.bench import vllm

    def spec_of(policy) -> tuple[str, int | None]:
        return ("chunk", policy.chunk_tokens) if isinstance(policy, Chunked) else as_vllm(policy)

    layouts = [case_spec(case).row_layout for case in CASES.values()]
    rng = random.Random(42)
    for _ in range(8):
        layers, heads = rng.randint(2, 40), rng.choice([1, 2, 4])
        kinds = rng.sample([Full(), Window(1024), Window(4096), Chunked(8192)], rng.randint(2, 3))
        policies = [rng.choice(kinds) for _ in range(layers)]
        if heads > 1 and rng.random() < 0.3:  # head-wise: the first half of each layer's heads keep its policy
            cells = [((layer, head), p if head < heads // 2 else Full()) for layer, p in enumerate(policies)
                     for head in range(heads)]
            layouts.append(tuple(Row(p, (layer,), (head,)) for (layer, head), p in cells))
        else:
            layouts.append(tuple(Row(p, tuple(i for i, q in enumerate(policies) if q == p), tuple(range(heads)))
                                 for p in dict.fromkeys(policies)))
    for layout in layouts:
        units = [(unit_name(u), spec_of(p)) for u, p in units_of(layout)]
        heads = 1 if units[0][0].count(".") > 1 else len(layout[0].kv_heads)
        theirs = vllm.kv_cache_groups(units, heads, 128)
        ours = [{"kind": spec_of(g.policy)[0], "size": spec_of(g.policy)[1], "units": [unit_name(u) for u in g.units]}
                for g in kv_cache_groups(layout)]
        assert ours == theirs, [p for _, p in units]


def test_each_row_group_publishes_under_its_policys_vllm_groups():
    """A manager's row groups (equal policies, first appearance) map to vLLM's groups of their policy, whether its
    rows are layer groups or one per kv head."""
    spec = case_spec(CASES["gemma-3-4b"])
    assert vllm_group_numbers(spec.row_layout, [r.policy for r in spec.row_layout]) == ((0, 1, 2, 3, 4, 5), (6,))
    head_wise = case_spec(CASES["gemma-3-4b"], head_wise=True).row_layout
    assert len(head_wise) == 8
    assert vllm_group_numbers(head_wise, [r.policy for r in head_wise]) == ((0, 1, 2, 3, 4, 5), (6,))
    few = case_spec(CASES["fastdeploy-head-wise-0.25"], head_wise=True).row_layout
    assert vllm_group_numbers(few, [r.policy for r in few]) == ((0, 1, 2, 3, 4), (5,))


def test_renumbering_gives_one_store_and_one_removal_per_group_in_order():
    tokens = __import__("numpy").arange(4, dtype="uint32")
    stored = BlockStored((b"a" * 32,), None, tokens, 4, group=1)
    removed = BlockRemoved((b"b" * 32,), group=0)
    out = renumber_groups([stored, removed, AllBlocksCleared()], ((0, 1, 2), (3,)))
    assert [(type(e).__name__, getattr(e, "group", None)) for e in out] == [
        ("BlockStored", 3), ("BlockRemoved", 0), ("BlockRemoved", 1), ("BlockRemoved", 2), ("AllBlocksCleared", None)]
    assert out[0].token_ids is stored.token_ids and out[2].block_hashes == removed.block_hashes


def test_a_library_manager_built_from_a_config_publishes_as_vllm():
    """In process: a manager with a config's rows, its events renumbered by the config's vLLM groups."""
    spec = CacheSpec.from_hf_config(load_example("gemma-3-4b"), block_size=16)
    cache = KVCacheManager(64, 16, [r.policy for r in spec.row_layout], enable_events=True)
    cache.admit("r", list(range(40)))
    events = renumber_groups(cache.take_events(), vllm_group_numbers(spec.row_layout, cache.rows))
    assert [(type(e).__name__, e.group, e.window, len(e.block_hashes)) for e in events] == (
        [("BlockStored", k, 1024, 2) for k in range(6)] + [("BlockStored", 6, None, 2)])


def gemma_like_layout() -> tuple[Row, ...]:
    """Gemma 3 4B's layers (29 sliding, every sixth full) with a window small enough to slide in a test."""
    full = tuple(range(5, 34, 6))
    return (Row(Window(8), tuple(i for i in range(34) if i not in full), (0,)), Row(Full(), full, (0,)))


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_a_router_keeps_each_vllm_groups_hashes_as_the_managers_row_group(ctx, tmp_path):
    """A publisher given the numbering, over real sockets, to a router keyed on group_idx: after every step of a
    random workload (admits, extends, frees, evictions, a reset) each of vLLM's seven groups holds exactly the
    hashes the manager's row group of its policy holds, and says that policy's kind."""
    layout = gemma_like_layout()
    numbers = vllm_group_numbers(layout, [r.policy for r in layout])
    assert numbers == ((0, 1, 2, 3, 4, 5), (6,))
    endpoint, replay = endpoints(tmp_path)
    pub = KVEventPublisher(ctx, endpoint, replay, group_numbers=numbers)
    router = VLLMRouterIndex(ctx, endpoint, replay, hasher=BlockHasher(BS, seed=SEED), pump=pub.handle_replay)
    manager = KVCacheManager(24, BS, [r.policy for r in layout], hash_seed=SEED, enable_events=True)
    rng = random.Random(7)
    live: list[int] = []
    try:
        for step in range(120):
            if live and rng.random() < 0.35:
                manager.free(live.pop(rng.randrange(len(live))))
            elif live and rng.random() < 0.5:
                manager.extend(rng.choice(live), [rng.randrange(3) for _ in range(rng.randint(1, 6))])
            elif manager.admit(step, [rng.randrange(3) for _ in range(rng.randint(1, 20))]) is not None:
                live.append(step)
            if step == 90:
                manager.reset_prefix_cache()
            seq = pub.publish(manager.take_events())
            if seq >= 0:
                router.sync(seq)
            held = indexed(manager, router.wire)
            for group, vllm_groups in enumerate(numbers):
                for k in vllm_groups:
                    assert router.hashes.get(k, set()) == held.get(group, set()), (step, group, k)
        assert router.tags == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
        assert router.kinds == {**{k: ("sliding_window", 8) for k in range(6)}, 6: ("full_attention", None)}
    finally:
        router.close()
        pub.close()


def stored_events(d) -> list[dict]:
    """The first batch of a daemon's KV events after one 40-token admit, as (type, fields) maps."""
    with CacheClient(d.endpoint) as client:
        client.admit("r0", list(range(1000, 1040)))
        replayed = replay_from(client.info()["events_replay_endpoint"], 0)
    _, events, _ = msgpack.unpackb(replayed[0][1], raw=False)
    return [dict(decode_event(e)[1], type=decode_event(e)[0]) for e in events]


MODEL_FLAGS = ("--model", "gemma-3-4b", "--block-size", "16", "--gpu-memory", "1GiB", "--events")


def test_a_model_daemon_names_its_vllm_group_numbers_in_its_info(daemon):
    """``event_groups`` in the info reply: per row group, the vLLM groups its events go out under; none with
    --events-groups policy."""
    with CacheClient(daemon(*MODEL_FLAGS).endpoint) as client:
        assert client.info()["event_groups"] == [[0, 1, 2, 3, 4, 5], [6]]
    with CacheClient(daemon(*MODEL_FLAGS, "--events-groups", "policy").endpoint) as client:
        assert "event_groups" not in client.info()


def test_a_model_daemon_publishes_one_store_per_vllm_group(daemon):
    """`kvcache serve --model gemma-3-4b --events`: an admit's blocks are stored under groups 0-5 (sliding) and 6
    (full), the same hashes in each; --events-groups policy keeps one store per row group (0 sliding, 1 full)."""
    stored = stored_events(daemon(*MODEL_FLAGS))
    assert [(e["type"], e["group_idx"], e["kv_cache_spec_kind"]) for e in stored] == (
        [("BlockStored", k, "sliding_window") for k in range(6)] + [("BlockStored", 6, "full_attention")])
    assert len({tuple(e["block_hashes"]) for e in stored}) == 1 and len(stored[0]["block_hashes"]) == 2
    policy = stored_events(daemon(*MODEL_FLAGS, "--events-groups", "policy"))
    assert [(e["group_idx"], e["kv_cache_spec_kind"]) for e in policy] == [(0, "sliding_window"),
                                                                          (1, "full_attention")]


def test_a_bad_events_groups_setting_is_one_line():
    result = subprocess.run([sys.executable, "-m", "kvcache", "serve", "--num-blocks", "8", "--events-groups",
                             "layers"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "events_groups: 'layers' is not one of 'vllm', 'policy'" in result.stderr


# -- max_concurrency -------------------------------------------------------------------------------------------

PLAN_FLAGS = ("--block-size", "16", "--gpu-memory", "80GiB", "--max-model-len", "32768",
              "--max-num-batched-tokens", "8192")


def test_serve_reports_the_plans_max_concurrency_at_start_and_in_stats(daemon):
    """`kvcache serve --model gemma-3-27b` sizes its rows as `kvcache plan` does and says how many requests of
    --max-model-len tokens they hold at once: in its ready line, its info reply and `kvcache stats`."""
    plan = subprocess.run([sys.executable, "-m", "kvcache", "plan", "--example", "gemma-3-27b", *PLAN_FLAGS,
                           "--json"], capture_output=True, text=True, timeout=60, check=True)
    planned = json.loads(plan.stdout)["max_concurrency"]
    spec = CacheSpec.from_hf_config(load_example("gemma-3-27b"), block_size=16)
    assert planned == make_plan(spec, gpu_memory=80 << 30, load=Load(32_768, 256, 8_192)).max_concurrency == 23
    d = daemon("--model", "gemma-3-27b", *PLAN_FLAGS)
    assert f" max_concurrency={planned} " in (d.folder / "stdout").read_text()
    with CacheClient(d.endpoint) as client:
        info = client.info()
    assert (info["max_concurrency"], info["max_model_len"]) == (planned, 32_768)
    stats = subprocess.run([sys.executable, "-m", "kvcache", "stats", "--endpoint", d.endpoint], capture_output=True,
                           text=True, timeout=60, check=True)
    assert f"max_concurrency {planned} (requests of 32,768 tokens at once)" in stats.stdout


def test_serve_without_a_load_reports_no_max_concurrency(daemon):
    d = daemon("--num-blocks", "64")
    assert "max_concurrency" not in (d.folder / "stdout").read_text()
    with CacheClient(d.endpoint) as client:
        assert "max_concurrency" not in client.info()

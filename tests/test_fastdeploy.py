"""kvcache's FastDeploy cache manager: its contract alone, and under FastDeploy's own scheduler.

The first tests call ``FastDeployCacheManager`` as FastDeploy's ``ResourceManagerV1`` does, with plain request
records; they need nothing of FastDeploy and run everywhere.

The rest need FastDeploy importable (``make test-fastdeploy`` builds such an environment; elsewhere they are
skipped). A trace of a few hundred requests sharing system prompts arrives a few per step; each step
FastDeploy's scheduler schedules, a stand-in model gives every running decode one token and every finished
prefill its first, requests that reach their length finish, and preempted requests are put back as FastDeploy's
token processor does. After every step kvcache's ``check_integrity`` checks pool, index and every live
``block_tables`` (each block's references equal the times it is listed). The same trace runs on FastDeploy's
``PrefixCacheManager``; per step the scheduled work, the prefix hits and the blocks the live requests hold must
be the same, until the first step where a cached block is evicted: FastDeploy then evicts ``n`` blocks as soon
as its free list is short of ``n``, kvcache only the blocks an allocation takes, so from there the two may keep
different prefixes.
"""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import msgpack
import pytest

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.swa import Full, Window
from kvcache.integrations import fastdeploy as adapter
from kvcache.integrations.fastdeploy_headwise import HeadWiseCacheManager

os.environ.setdefault("FD_LOG_DIR", os.path.join(tempfile.gettempdir(), "kvcache-fastdeploy-log"))  # not ./log
try:
    from fastdeploy.cache_manager import prefix_cache_manager
    from fastdeploy.config import CacheConfig, FDConfig, ParallelConfig, SchedulerConfig
    from fastdeploy.engine.args_utils import EngineArgs
    from fastdeploy.engine.request import Request, RequestMetrics, RequestStatus
    from fastdeploy.engine.sched.resource_manager_v1 import (
        ResourceManagerV1,
        ScheduledDecodeTask,
        ScheduledPreemptTask,
    )
except ImportError:
    prefix_cache_manager = None

needs_fastdeploy = pytest.mark.skipif(
    prefix_cache_manager is None,
    reason="FastDeploy is not importable here; `make test-fastdeploy` builds an environment with FastDeploy's "
           "sources and runs this file there")

BLOCK = 4


# ---------------------------------------------------------------------- the contract alone


def make_manager(num_blocks: int = 16, **cache: object) -> adapter.FastDeployCacheManager:
    """A manager over ``num_blocks`` blocks of 4 tokens, built as FastDeploy builds it (config, TP, role)."""
    fields = dict(total_block_num=num_blocks, prefill_kvcache_block_num=num_blocks, block_size=BLOCK,
                  num_cpu_blocks=0, kvcache_storage_backend=None)
    fields.update(cache)
    return adapter.FastDeployCacheManager(SimpleNamespace(cache_config=SimpleNamespace(**fields)), 1, "mixed")


def make_task(request_id: str, prompt: list[int], output: list[int] | None = None, mm: dict | None = None):
    """A request record with the fields FastDeploy's manager reads and writes."""
    return SimpleNamespace(request_id=request_id, prompt_token_ids=prompt, output_token_ids=output or [],
                           block_tables=[], num_cached_blocks=0, multimodal_inputs=mm)


def schedule_prefill(manager: adapter.FastDeployCacheManager, task, computed: int | None = None) -> tuple[int, int]:
    """What ResourceManagerV1 does for a new request: match, allocate the rest, cache what is computed.
    Returns (matched tokens, blocks allocated)."""
    ids, matched, _ = manager.request_match_blocks(task, BLOCK)
    task.block_tables = list(ids)
    total = len(task.prompt_token_ids) + len(task.output_token_ids)
    computed = total if computed is None else computed
    need = -(-computed // BLOCK) - len(ids)
    task.block_tables += manager.allocate_gpu_blocks(max(need, 0), task.request_id)
    manager.update_cache_blocks(task, BLOCK, computed)
    return matched, max(need, 0)


def finish(manager: adapter.FastDeployCacheManager, task) -> None:
    """ResourceManagerV1's ``_free_blocks`` with prefix caching on."""
    manager.release_block_ids(task)
    manager.recycle_gpu_blocks(task.block_tables[task.num_cached_blocks:], task.request_id)
    task.block_tables = []


def test_prefix_hit_shares_blocks_and_release_keeps_them_findable() -> None:
    """A second request with the same first 8 tokens gets the first request's 2 blocks (a reference each);
    after both finish the blocks are free but cached: out of ``gpu_free_block_list``, still allocatable."""
    manager = make_manager(16)
    a = make_task("a", list(range(1, 11)))  # 10 tokens: 2 full blocks and a partial one
    assert schedule_prefill(manager, a) == (0, 3)
    assert a.block_tables == [0, 1, 2] and a.num_cached_blocks == 2
    b = make_task("b", list(range(1, 9)) + [99, 98, 97])
    assert schedule_prefill(manager, b) == (8, 1)
    assert b.block_tables[:2] == [0, 1]
    manager.check_integrity(tables=[a.block_tables, b.block_tables])
    finish(manager, a)
    finish(manager, b)
    manager.check_integrity(tables=[])
    assert manager.num_free_gpu_blocks == 14 and len(manager.gpu_free_block_list) == 14
    assert 0 not in manager.gpu_free_block_list and 1 not in manager.gpu_free_block_list
    assert manager.can_allocate_gpu_blocks(16) and not manager.can_allocate_gpu_blocks(16, try_free_gpu_blocks=False)
    assert manager.stats()[:4] == (2, 1, 21, 8)


def test_whole_prompt_hit_is_returned_whole() -> None:
    """A prompt of whole blocks, all cached, matches all of them, as FastDeploy's manager does (its scheduler
    then recomputes the last block in place)."""
    manager = make_manager()
    a = make_task("a", list(range(1, 9)))
    schedule_prefill(manager, a)
    finish(manager, a)
    b = make_task("b", list(range(1, 9)))
    ids, matched, metrics = manager.request_match_blocks(b, BLOCK)
    assert (ids, matched, b.num_cached_blocks) == ([0, 1], 8, 2)
    assert metrics["gpu_match_token_num"] == 8 and metrics["match_gpu_block_ids"] == [0, 1]
    assert metrics["cpu_match_token_num"] == metrics["storage_match_token_num"] == 0


def test_eviction_takes_the_oldest_released_prefix_tail_first() -> None:
    """With no uncached block left, an allocation evicts cached free blocks, the oldest released first and a
    prefix's last block before its first; the evicted prefix no longer hits, the other still does."""
    manager = make_manager(6)
    old = make_task("old", [1] * 4 + [2] * 4 + [3])
    schedule_prefill(manager, old)  # blocks 0, 1 cached, 2 partial
    finish(manager, old)
    new = make_task("new", [5] * 4 + [6] * 4 + [7])
    schedule_prefill(manager, new)
    finish(manager, new)
    taken = manager.allocate_gpu_blocks(3, "x")  # the free blocks first, then one eviction
    assert manager.stats().evicted_blocks == 1
    assert manager.request_match_blocks(make_task("p", [1] * 4 + [2] * 4 + [3]), BLOCK)[1] == 4  # lost its tail
    assert manager.request_match_blocks(make_task("q", [5] * 4 + [6] * 4 + [7]), BLOCK)[1] == 8
    manager.check_integrity()
    assert len(taken) == 3


def test_images_key_blocks_by_their_hash() -> None:
    """FastDeploy's image placeholders are token -1: blocks holding the same placeholders hit only when the
    image's hash and place agree."""
    def task(request_id: str, image: str):
        mm = {"mm_positions": [SimpleNamespace(offset=4, length=8)], "mm_hashes": [image]}
        return make_task(request_id, [1, 2, 3, 4] + [-1] * 8 + [5, 6], mm=mm)

    manager = make_manager()
    first = task("a", "cat")
    schedule_prefill(manager, first)
    assert manager.request_match_blocks(task("b", "dog"), BLOCK)[1] == 4  # only the text block before the image
    assert manager.request_match_blocks(task("c", "cat"), BLOCK)[1] == 12


def test_output_blocks_are_cached_for_later_requests() -> None:
    """``cache_output_blocks`` indexes the full blocks of prompt and output, so a follow-up turn hits them."""
    manager = make_manager()
    a = make_task("a", [1, 2, 3, 4, 5, 6])
    schedule_prefill(manager, a)
    a.output_token_ids = [7, 8, 9]
    a.block_tables += manager.allocate_gpu_blocks(1, "a")
    manager.cache_output_blocks(a, BLOCK)
    assert a.num_cached_blocks == 2
    finish(manager, a)
    assert manager.request_match_blocks(make_task("b", [1, 2, 3, 4, 5, 6, 7, 8, 10]), BLOCK)[1] == 8


def test_refuses_what_it_does_not_serve() -> None:
    """CPU swap space, storage backends and the v0 one-call reservation are refused by name."""
    with pytest.raises(KVCacheError, match="num_cpu_blocks"):
        make_manager(num_cpu_blocks=8)
    with pytest.raises(KVCacheError, match="kvcache_storage_backend"):
        make_manager(kvcache_storage_backend="mooncake")
    with pytest.raises(KVCacheError, match="request_block_ids"):
        make_manager().request_block_ids(make_task("a", [1, 2, 3]), BLOCK, 0)
    manager = make_manager()
    manager.allocate_gpu_blocks(1, "a")
    with pytest.raises(KVCacheError, match="update_cache_config"):
        manager.update_cache_config(manager.cache_config)


def test_bad_calls_change_nothing() -> None:
    """A block the caller does not hold, too many blocks, or a wrong block size: one KVCacheError, no change."""
    manager = make_manager(32)
    blocks = manager.allocate_gpu_blocks(3, "a")
    with pytest.raises(KVCacheError, match="gpu_block_ids"):
        manager.recycle_gpu_blocks([blocks[0], blocks[0]], "a")
    with pytest.raises(KVCacheError, match="gpu_block_ids"):
        manager.recycle_gpu_blocks([40], "a")
    with pytest.raises(KVCacheError, match="num_blocks"):
        manager.allocate_gpu_blocks(30, "b")
    with pytest.raises(KVCacheError, match="block_size"):
        manager.request_match_blocks(make_task("c", [1, 2, 3, 4, 5]), 8)
    with pytest.raises(KVCacheError, match="request_id"):
        manager.release_block_ids(make_task("never", [1]))
    assert manager.num_allocatable_gpu_blocks == 29
    manager.check_integrity(tables=[blocks])
    manager.recycle_gpu_blocks(blocks, "a")
    manager.check_integrity(tables=[])


def test_thread_safe_release_from_executor_threads() -> None:
    """Requests matched, allocated, cached and released from several threads at once keep the invariants."""
    from concurrent.futures import ThreadPoolExecutor

    manager = make_manager(512)
    shared = list(range(1, 17))
    barrier = threading.Barrier(4)

    def one(i: int) -> None:
        if i < 4:
            barrier.wait(timeout=30)  # the first four start together
        task = make_task(f"t{i}", shared + [1000 + i, 7, 8])
        schedule_prefill(manager, task)
        manager.release_block_ids_async(task).result(timeout=30)
        manager.recycle_gpu_blocks(task.block_tables[task.num_cached_blocks:], task.request_id)

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(one, range(200)))
    manager.check_integrity(tables=[])
    assert manager.num_allocatable_gpu_blocks == 512
    assert manager.stats().hit_tokens >= 196 * 16  # the shared 16 tokens hit once some request cached them


# ---------------------------------------------------------------------- head-wise tables

HEAD_WISE = dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                 head_wise_swa_ratio=0.5, window_size=8, sink_size=0)


def make_head_wise(num_blocks: int = 32, cache=None, tp: int = 1, **model: object) -> adapter.FastDeployCacheManager:
    """A manager for FastDeploy's head-wise config: 8 query heads over 4 kv heads, half of each TP rank's query
    heads windowed (8 tokens): at TP 1 the last 2 kv heads, at TP 2 kv heads 1 and 3."""
    config = SimpleNamespace(
        cache_config=SimpleNamespace(total_block_num=num_blocks, block_size=BLOCK, num_cpu_blocks=0,
                                     enable_prefix_caching=True),
        model_config=SimpleNamespace(**{**HEAD_WISE, **model}),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp))
    return adapter.FastDeployCacheManager(config, 1, "mixed", cache=cache)


def head_wise_config_file(folder) -> str:
    """HEAD_WISE as the model's config.json, for `kvcache serve --model`."""
    path = folder / "config.json"
    path.write_text(json.dumps(HEAD_WISE))
    return str(path)


def prefill_in_chunks(manager: adapter.FastDeployCacheManager, task, chunk: int) -> None:
    """ResourceManagerV1's chunked prefill: match, then per chunk allocate, place the tokens, cache them."""
    ids, matched, _ = manager.request_match_blocks(task, BLOCK)
    task.block_tables, task.num_computed_tokens = list(ids), matched
    while task.num_computed_tokens < len(task.prompt_token_ids):
        n = min(chunk, len(task.prompt_token_ids) - task.num_computed_tokens)
        need = -(-(task.num_computed_tokens + n) // BLOCK) - len(task.block_tables)
        assert manager.can_allocate_gpu_blocks(need)
        task.block_tables += manager.allocate_gpu_blocks(need, task.request_id)
        task.num_computed_tokens += n
        manager.update_cache_blocks(task, BLOCK, task.num_computed_tokens)
        manager.check_integrity(tables=[task.block_tables])


def head_wise_trace(manager: adapter.FastDeployCacheManager) -> list[list[list[int]]]:
    """A 30-token prompt prefilled in chunks of 12, freed, then the same prompt with one more token: the
    head-wise tables FastDeploy's requests carry at each point."""
    a = make_task("a", list(range(1, 31)))
    prefill_in_chunks(manager, a, 12)
    seen = [a.block_tables_headwise]
    assert manager.block_tables_headwise("a").tolist() == a.block_tables_headwise
    finish(manager, a)
    manager.check_integrity(tables=[])
    b = make_task("b", list(range(1, 31)) + [99])
    ids, matched, _ = manager.request_match_blocks(b, BLOCK)
    b.block_tables = list(ids)
    seen.append(b.block_tables_headwise)
    manager.check_integrity(tables=[b.block_tables])
    finish(manager, b)
    return seen


def test_head_wise_window_heads_give_blocks_back_and_prefixes_still_hit(monkeypatch) -> None:
    """FD_HEAD_WISE_KV_CACHE=1 with head_wise_swa_ratio 0.5: the scheduler's list is the 2 full heads' row; the 2
    window heads give back the blocks their 8-token window has passed (-1 in block_tables_headwise), a step
    behind the chunk being scheduled; a later request with the same prefix hits 7 blocks, and its window heads
    hold only the last 8 tokens' blocks."""
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    manager = make_head_wise()
    assert type(manager).__name__ == "HeadWiseCacheManager" and manager.num_kv_heads == 4
    after_prefill, hit = head_wise_trace(manager)
    full = list(range(8))
    assert after_prefill == [full, full, [-1] + full[1:], [-1] + full[1:]]
    assert hit == [full[:7], full[:7], [-1] * 5 + [5, 6], [-1] * 5 + [5, 6]]
    assert manager.stats()[:4] == (2, 1, 61, 28)
    assert manager.num_allocatable_gpu_blocks == 32


def test_head_wise_is_off_without_the_switch(monkeypatch) -> None:
    """Without FD_HEAD_WISE_KV_CACHE the same model config gets the uniform manager (one table for every head)."""
    monkeypatch.delenv("FD_HEAD_WISE_KV_CACHE", raising=False)
    manager = make_head_wise()
    assert type(manager) is adapter.FastDeployCacheManager


def test_head_wise_refusals_name_the_field(monkeypatch, daemon) -> None:
    """What head-wise tables cannot serve is refused by name, and a refused call changes nothing."""
    from kvcache.client import CacheClient

    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    for model, field in ((dict(head_wise_swa_ratio=0.1), "model_config.head_wise_swa_ratio"),  # no kv head windowed
                         (dict(head_wise_swa_ratio=None), "model_config.head_wise_swa_ratio"),
                         (dict(window_size=0), "model_config.window_size"),
                         (dict(window_attn_skip_freq=2), "model_config.window_attn_skip_freq"),
                         (dict(num_key_value_heads=1), "model_config.num_key_value_heads")):
        with pytest.raises(KVCacheError, match=f"^{field}"):
            make_head_wise(**model)
    config = SimpleNamespace(cache_config=SimpleNamespace(total_block_num=8, block_size=BLOCK, num_cpu_blocks=0,
                                                          enable_prefix_caching=False),
                             model_config=SimpleNamespace(**HEAD_WISE))
    with pytest.raises(KVCacheError, match="^cache_config.enable_prefix_caching"):
        adapter.FastDeployCacheManager(config)
    config.cache_config.enable_prefix_caching = True
    with pytest.raises(KVCacheError, match="^splitwise_role"):
        adapter.FastDeployCacheManager(config, 1, "prefill")
    manager = make_head_wise()
    with pytest.raises(KVCacheError, match="^req_id"):
        manager.allocate_gpu_blocks(2, "never-matched")
    task = make_task("t", list(range(1, 10)))
    task.use_extend_tables = True
    with pytest.raises(KVCacheError, match="^use_extend_tables"):
        manager.request_match_blocks(task, BLOCK)
    task.use_extend_tables = False
    manager.request_match_blocks(task, BLOCK)
    with pytest.raises(KVCacheError, match="^num_computed_tokens: 4 exceeds the 0 blocks"):
        manager.update_cache_blocks(task, BLOCK, 4)
    task.block_tables = [5]  # a block the adapter never gave this request
    with pytest.raises(KVCacheError, match="^block_tables: request 't' lists 1 blocks, the adapter gave it 0"):
        manager.allocate_gpu_blocks(1, "t")
    task.block_tables = []
    manager.check_integrity(tables=[task.block_tables])
    manager.release_block_ids(task)
    manager.recycle_gpu_blocks([], "t")
    with pytest.raises(KVCacheError, match="^free_block_ids"):
        manager.free_block_ids(1)
    with pytest.raises(KVCacheError, match="^gpu_block_ids"):
        manager.recycle_gpu_blocks([0], "never-matched")
    assert manager.num_allocatable_gpu_blocks == 32
    manager.check_integrity(tables=[])
    d = daemon("--num-blocks", "32", "--block-size", str(BLOCK), "--rows", "window:8:0*2,full*2")
    with pytest.raises(KVCacheError, match=r"^rows: the shared cache serves window:8:0\*2,full\*2, FastDeploy's "
                                           r"head-wise config asks for full\*2,window:8:0\*2"):
        make_head_wise(cache=CacheClient(d.endpoint))


@pytest.mark.parametrize("tp", [1, 2])
def test_head_wise_over_a_daemon_gives_the_tables_it_gives_in_process(monkeypatch, daemon, tmp_path, tp) -> None:
    """A `kvcache serve --model <config> --head-wise --tp N` daemon serves the rows FastDeploy's config asks for
    at TP N and the same head-wise tables as in process; its integrity check passes after every call. A daemon
    started for another TP windows other heads and is refused by name."""
    from kvcache.client import CacheClient

    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    manager = make_head_wise(tp=tp)
    window = Window(8, 0)
    assert manager.policies == ((Full(), Full(), window, window) if tp == 1 else (Full(), window, Full(), window))
    local = head_wise_trace(manager)
    config = head_wise_config_file(tmp_path)
    d = daemon("--num-blocks", "32", "--block-size", str(BLOCK), "--model", config, "--head-wise", "--tp", str(tp))
    shared = make_head_wise(cache=CacheClient(d.endpoint, timeout=30.0), tp=tp)
    assert head_wise_trace(shared) == local
    assert shared.num_allocatable_gpu_blocks == 32
    shared.close()
    other = daemon("--num-blocks", "32", "--block-size", str(BLOCK), "--model", config, "--head-wise",
                   "--tp", str(3 - tp))
    with pytest.raises(KVCacheError, match="^rows: the shared cache serves"):
        make_head_wise(cache=CacheClient(other.endpoint), tp=tp)


# ---------------------------------------------------------------------- engines sharing a daemon


def make_shared(endpoint: str, dp_rank: int = 0) -> adapter.FastDeployCacheManager:
    """An engine's manager on the daemon at ``endpoint`` (what ``install(daemon=endpoint)`` builds)."""
    from kvcache.client import CacheClient

    config = SimpleNamespace(cache_config=SimpleNamespace(
        total_block_num=32, prefill_kvcache_block_num=32, block_size=BLOCK, num_cpu_blocks=0,
        kvcache_storage_backend=None))
    return adapter.FastDeployCacheManager(config, 1, "mixed", dp_rank, cache=CacheClient(endpoint, timeout=30.0))


def test_two_engines_on_one_daemon_share_prefixes_and_publish_kv_events(daemon) -> None:
    """Two DP ranks' managers on one `kvcache serve`: what one rank prefills the other finds whole (the same
    blocks, a reference each); both see the daemon's counts; the daemon publishes each stored block once, under
    the hashes of kvcache's hasher, and the refused call of a rank changes nothing."""
    from kvcache.allocator.prefix import BlockHasher
    from kvcache.client import CacheClient

    from test_events import decode_event, low64, replay_from

    d = daemon("--num-blocks", "32", "--block-size", str(BLOCK), "--events")
    rank0, rank1 = make_shared(d.endpoint, 0), make_shared(d.endpoint, 1)
    assert rank0.num_gpu_blocks == rank1.num_gpu_blocks == 32 and rank1.block_size == BLOCK
    prompt = list(range(1, 11))  # 2 full blocks and a partial one
    a = make_task("a", prompt)
    assert schedule_prefill(rank0, a) == (0, 3)
    b = make_task("b", prompt[:8])
    ids, matched, _ = rank1.request_match_blocks(b, BLOCK)
    assert (ids, matched) == (a.block_tables[:2], 8)  # rank 0's blocks, whole prompt
    b.block_tables = list(ids)
    assert rank1.num_allocatable_gpu_blocks == rank0.num_allocatable_gpu_blocks == 29
    rank0.check_integrity(tables=[a.block_tables])
    rank1.check_integrity(tables=[b.block_tables])
    with pytest.raises(KVCacheError, match="^gpu_block_ids"):
        rank1.recycle_gpu_blocks(a.block_tables[2:], "b")  # rank 0's blank block, not rank 1's
    assert rank1.num_allocatable_gpu_blocks == 29
    finish(rank0, a)
    finish(rank1, b)
    rank0.check_integrity(tables=[])
    rank1.check_integrity(tables=[])
    assert rank0.num_free_gpu_blocks == 30 and rank1.stats()[:4] == (1, 1, 8, 8)
    with CacheClient(d.endpoint) as client:
        client.check_integrity()
        batches = replay_from(client.info()["events_replay_endpoint"], 0)
    stored = [fields for _, payload in batches for tag, fields in map(decode_event, msgpack.unpackb(payload)[1])
              if tag == "BlockStored"]
    assert [(e["block_hashes"], e["parent_block_hash"], e["token_ids"]) for e in stored] == [
        ([low64(h) for h in BlockHasher(BLOCK).hash_blocks(prompt)], None, prompt[:8])]


def test_a_shared_daemon_refuses_another_block_size(daemon) -> None:
    """An engine whose cache config names another block size than the daemon's is refused by name."""
    from kvcache.client import CacheClient

    d = daemon("--num-blocks", "32", "--block-size", "8")
    config = SimpleNamespace(cache_config=SimpleNamespace(total_block_num=32, block_size=BLOCK, num_cpu_blocks=0))
    with pytest.raises(KVCacheError, match="^cache_config.block_size: 4 differs from the shared cache's 8"):
        adapter.FastDeployCacheManager(config, cache=CacheClient(d.endpoint))


def test_an_idle_engine_keeps_its_blocks_past_the_lease_timeout(daemon) -> None:
    """A daemon run with --lease-timeout frees a silent client's blocks; the manager's keepalive pings, at least
    three per lease, keep an idle engine's blank and cached blocks held well past that timeout. Without pings
    (keepalive 0) they are released."""
    import time

    from kvcache.client import CacheClient

    d = daemon("--num-blocks", "32", "--block-size", str(BLOCK), "--lease-timeout", "1")
    config = SimpleNamespace(cache_config=SimpleNamespace(total_block_num=32, block_size=BLOCK, num_cpu_blocks=0))
    for keepalive, held in ((5.0, 29), (0, 32)):  # 5 s: pings come every third of the daemon's 1 s lease
        manager = adapter.FastDeployCacheManager(config, cache=CacheClient(d.endpoint, timeout=30.0),
                                                 keepalive=keepalive)
        task = make_task(f"idle-{keepalive}", list(range(1, 11)))
        schedule_prefill(manager, task)  # 2 cached blocks and 1 blank one
        assert manager.num_allocatable_gpu_blocks == 29
        time.sleep(3.0)  # three lease timeouts without a call from the engine
        with CacheClient(d.endpoint) as observer:
            assert int(observer.num_free_blocks[0]) == held, f"keepalive {keepalive}"
            observer.check_integrity()
        if held == 29:
            manager.check_integrity(tables=[task.block_tables])
            finish(manager, task)
        manager.close()
    assert "lease of scheduler" in d.log() and "released the owned blocks of 2" in d.log()


# ---------------------------------------------------------------------- under FastDeploy's scheduler


@pytest.fixture(scope="module")
def v1_scheduler():
    """FastDeploy's platform reports CUDA while these tests build schedulers: on other platforms its engine args
    turn off the v1 scheduler and chunked prefill this file exercises."""
    from fastdeploy import envs
    from fastdeploy.platforms import current_platform

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(current_platform, "is_cuda", lambda: True)
        mp.setattr(envs, "ENABLE_V1_KVCACHE_SCHEDULER", 1)
        yield


def fastdeploy_test(test):
    """A test that drives FastDeploy's scheduler: skipped without FastDeploy, run with its v1 scheduler on."""
    return needs_fastdeploy(pytest.mark.usefixtures("v1_scheduler")(test))


def fastdeploy_manager() -> type:
    """FastDeploy's own PrefixCacheManager, also where the plugin has installed kvcache's in its place."""
    cls = prefix_cache_manager.PrefixCacheManager
    return getattr(cls, "_fastdeploy_class", cls) if cls is adapter.FastDeployCacheManager else cls


@dataclass(frozen=True, slots=True)
class Spec:
    """One request of a trace: when it arrives, its prompt, how many tokens it generates."""

    request_id: str
    arrival: int
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Step:
    """What one step did, as both managers must agree: work scheduled, prefix hits, blocks held."""

    scheduled: tuple[tuple[str, str, int], ...]  # (request, "prefill" / "blocks" / "preempt", tokens or blocks)
    hits: tuple[tuple[str, int], ...]  # (request, cached tokens) of requests starting a prefill
    blocks_in_use: int  # distinct blocks the live requests' block_tables list


def make_trace(num_requests: int, *, seed: int = 0, per_step: int = 3) -> list[Spec]:
    """Requests over a few shared system prompts (2 to 6 blocks) with their own tails, ``per_step`` a step."""
    rng = random.Random(seed)
    systems = [tuple(rng.randrange(1, 30000) for _ in range(BLOCK * rng.randint(2, 6))) for _ in range(5)]
    specs = []
    for i in range(num_requests):
        prefix = rng.choice(systems) if rng.random() < 0.8 else ()
        tail = tuple(rng.randrange(1, 30000) for _ in range(rng.randint(1, 14)))
        specs.append(Spec(f"r{i}", i // per_step, prefix + tail, rng.randint(1, 16)))
    return specs


def make_scheduler(manager_class: type, *, num_blocks: int, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, output_caching: bool = False,
                   **model_fields: object) -> ResourceManagerV1:
    """FastDeploy's ResourceManagerV1 whose cache manager is ``manager_class`` (block size 4); ``model_fields``
    go into its model config (head-wise windows)."""
    engine_args = EngineArgs(max_num_seqs=max_num_seqs, num_gpu_blocks_override=num_blocks,
                             max_num_batched_tokens=max_num_batched_tokens)
    args = asdict(engine_args)
    cache = CacheConfig(args)
    cache.block_size = BLOCK
    cache.max_block_num_per_seq = 64
    cache.enc_dec_block_num = 1
    cache.enable_prefix_caching = True
    cache.enable_output_caching = output_caching
    cache.bytes_per_token_per_layer = 1
    cache.kv_cache_ratio = 1.0
    model = SimpleNamespace(enable_mm=False, max_model_len=64, architectures=["test_model"],
                            mm_max_tokens_per_item=None, version=None, print=print, **model_fields)
    config = FDConfig(model_config=model, cache_config=cache, parallel_config=ParallelConfig(args),
                      graph_opt_config=engine_args.create_graph_optimization_config(),
                      speculative_config=SimpleNamespace(method=None, num_speculative_tokens=0),
                      scheduler_config=SchedulerConfig(args))
    saved = prefix_cache_manager.PrefixCacheManager
    prefix_cache_manager.PrefixCacheManager = manager_class
    try:
        return ResourceManagerV1(max_num_seqs=max_num_seqs, config=config, tensor_parallel_size=1,
                                 splitwise_role="mixed")
    finally:
        prefix_cache_manager.PrefixCacheManager = saved


def make_request(spec: Spec) -> Request:
    request = Request.from_dict({"request_id": spec.request_id, "multimodal_inputs": {}})
    request.prompt_token_ids = list(spec.prompt)
    request.prompt_token_ids_len = len(spec.prompt)
    request.need_prefill_tokens = len(spec.prompt)
    request.output_token_ids = []
    request.disaggregate_info = {}
    request.metrics = RequestMetrics()
    return request


def next_token(request_id: str, position: int) -> int:
    """The stand-in model's output: a fixed token per (request, position)."""
    return (hash((request_id, position)) & 0x7FFF) + 1


def check(rm: ResourceManagerV1) -> None:
    """kvcache's invariants with every block list the scheduler holds; in head-wise mode each request's
    ``block_tables_headwise`` is kvcache's table for it."""
    manager = rm.cache_manager
    if isinstance(manager, adapter.FastDeployCacheManager):
        manager.check_integrity(tables=[r.block_tables for r in rm.requests.values()])
    if isinstance(manager, HeadWiseCacheManager):
        for r in rm.requests.values():
            if r.block_tables:
                assert r.block_tables_headwise == manager.block_tables_headwise(r.request_id).tolist()


def run(rm: ResourceManagerV1, trace: list[Spec], *, max_steps: int = 3000) -> list[Step]:
    """Drive ``rm`` through ``trace`` until every request finished; one ``Step`` per schedule call.

    As FastDeploy's workers do, every running request in decode makes one token a step whether or not the
    scheduler listed it (it lists a decode only to give it blocks), and a prefill's last chunk makes the first.
    """
    pending = sorted(trace, key=lambda s: s.arrival)
    specs = {s.request_id: s for s in trace}
    started: set[str] = set()
    finished: set[str] = set()
    steps: list[Step] = []
    for step in range(max_steps):
        while pending and pending[0].arrival <= step:
            request = make_request(pending.pop(0))
            rm.add_request(request)
            for future in request.async_process_futures:  # its preprocessing (nothing to download) done first,
                future.result(timeout=30)  # so scheduling never depends on a thread's timing
        decoding = [r for r in rm.running if r.status == RequestStatus.RUNNING_DECODE]
        batch, errors = rm.schedule()
        assert errors == [], errors
        scheduled, hits, preempted = [], [], []
        for task in batch.requests:
            if isinstance(task, ScheduledPreemptTask):
                scheduled.append((task.request_id, "preempt", 0))
                preempted.append(task.request_id)
                started.discard(task.request_id)
            elif isinstance(task, ScheduledDecodeTask):
                scheduled.append((task.request_id, "blocks", len(rm.requests[task.request_id].block_tables)))
            else:
                scheduled.append((task.request_id, "prefill", task.prefill_end_index - task.prefill_start_index))
                if task.request_id not in started:
                    started.add(task.request_id)
                    hits.append((task.request_id, task.num_cached_tokens))
                if task.prefill_end_index >= task.need_prefill_tokens:
                    decoding.append(task)
        running = set(map(id, rm.running))
        for request in decoding:
            if id(request) in running:
                request.output_token_ids.append(next_token(request.request_id, request.num_total_tokens))
                request.status = RequestStatus.RUNNING_DECODE
        for request_id in preempted:
            rm.reschedule_preempt_task(request_id)
        done = [r for r in list(rm.running) if len(r.output_token_ids) >= specs[r.request_id].max_tokens]
        for request in done:
            rm.cache_output_tokens(request)
            rm.finish_requests(request.request_id)
            finished.add(request.request_id)
        check(rm)
        in_use = set()
        for request in rm.requests.values():
            in_use.update(request.block_tables)
        steps.append(Step(tuple(scheduled), tuple(hits), len(in_use)))
        if len(finished) == len(trace):
            return steps
    raise AssertionError(f"{len(trace) - len(finished)} requests unfinished after {max_steps} steps")


def daemon_scheduler(endpoint: str, **options: object) -> ResourceManagerV1:
    """``make_scheduler`` as a deployment builds it: ``install(daemon=endpoint)`` makes FastDeploy's own
    ``PrefixCacheManager`` name build kvcache's manager on that daemon; uninstalled once it is built."""
    adapter.install(daemon=endpoint)
    try:
        return make_scheduler(prefix_cache_manager.PrefixCacheManager, **options)
    finally:
        adapter.uninstall()


def close(rm: ResourceManagerV1) -> None:
    rm.need_block_num_signal.clear()
    rm.finish_execution_pool.shutdown(wait=True)
    rm.async_preprocess_pool.shutdown(wait=True)


def run_both(trace: list[Spec], manager_class: type | None = None,
             **options: object) -> tuple[list[Step], list[Step], ResourceManagerV1]:
    """The trace on kvcache's manager (``manager_class``, ``FastDeployCacheManager`` by default), then on
    FastDeploy's own; returns both step lists and kvcache's scheduler."""
    ours = make_scheduler(manager_class or adapter.FastDeployCacheManager, **options)
    try:
        kv_steps = run(ours, trace)
    finally:
        close(ours)
    theirs = make_scheduler(fastdeploy_manager(), **options)
    try:
        fd_steps = run(theirs, trace)
    finally:
        close(theirs)
    return kv_steps, fd_steps, ours


@fastdeploy_test
@pytest.mark.parametrize("output_caching", [False, True], ids=["prompt-caching", "output-caching"])
def test_same_schedule_as_fastdeploy_when_nothing_is_evicted(output_caching: bool) -> None:
    """With room for every prefix, kvcache's manager gives FastDeploy's scheduler the same steps as FastDeploy's
    own: the same work scheduled, the same prefix hits, the same number of blocks held after every step."""
    trace = make_trace(300, seed=1)
    kv_steps, fd_steps, ours = run_both(trace, num_blocks=4000, output_caching=output_caching)
    assert ours.cache_manager.stats().evicted_blocks == 0
    assert len(kv_steps) == len(fd_steps)
    for i, (kv, fd) in enumerate(zip(kv_steps, fd_steps)):
        assert kv == fd, f"step {i} differs"
    hit_tokens = sum(tokens for step in kv_steps for _, tokens in step.hits)
    assert hit_tokens > 1000, "the shared system prompts should hit"
    assert ours.cache_manager.num_allocatable_gpu_blocks == 4000


@fastdeploy_test
def test_chunked_prefill_preemption_and_eviction_under_pressure() -> None:
    """A pool too small for the load: prompts are prefilled in chunks, decodes preempt others, cached blocks are
    evicted; every step keeps kvcache's invariants, every request finishes, and the steps equal FastDeploy's
    up to the first eviction (after it, each manager keeps the prefixes its eviction rule leaves)."""
    trace = make_trace(300, seed=2, per_step=4)
    kv_steps, fd_steps, ours = run_both(trace, num_blocks=48, max_num_seqs=12, max_num_batched_tokens=24)
    kinds = {kind for step in kv_steps for _, kind, _ in step.scheduled}
    assert "preempt" in kinds
    chunked = [n for step in kv_steps for _, kind, n in step.scheduled if kind == "prefill" and n < 24]
    assert chunked
    stats = ours.cache_manager.stats()
    assert stats.evicted_blocks > 0 and stats.hit_tokens > 0
    first_eviction = _first_eviction_step(trace)
    assert first_eviction > 0
    for i in range(first_eviction):
        assert kv_steps[i] == fd_steps[i], f"step {i} differs before any eviction"
    assert ours.cache_manager.num_allocatable_gpu_blocks == 48  # everything released at the end


@fastdeploy_test
def test_with_fastdeploys_eviction_rule_the_pressured_trace_is_identical() -> None:
    """Evicting as FastDeploy does (``n`` cached blocks as soon as fewer than ``n`` free ones are left, through
    the manager's ``free_block_ids``), kvcache gives the pressured trace exactly FastDeploy's steps, preemptions
    and hits included: the eviction rule is the whole difference."""

    class EagerEviction(adapter.FastDeployCacheManager):
        def can_allocate_gpu_blocks(self, num_blocks: int, try_free_gpu_blocks: bool = True) -> bool:
            if try_free_gpu_blocks and self.num_free_gpu_blocks < num_blocks:
                self.free_block_ids(num_blocks)
            return self.num_free_gpu_blocks >= num_blocks

    trace = make_trace(300, seed=2, per_step=4)
    kv_steps, fd_steps, ours = run_both(trace, EagerEviction, num_blocks=48, max_num_seqs=12,
                                        max_num_batched_tokens=24)
    assert ours.cache_manager.stats().evicted_blocks > 0
    assert len(kv_steps) == len(fd_steps)
    for i, (kv, fd) in enumerate(zip(kv_steps, fd_steps)):
        assert kv == fd, f"step {i} differs"


@fastdeploy_test
def test_fastdeploys_scheduler_over_a_daemon_takes_the_steps_it_takes_in_process(daemon) -> None:
    """``install(daemon=...)``: FastDeploy's ResourceManagerV1 builds a manager on a `kvcache serve` daemon, and
    the pressured trace (chunked prefill, preemption, eviction) takes exactly the steps it takes in process,
    every step checked against the daemon's pool and index and the scheduler's block lists."""
    trace = make_trace(300, seed=2, per_step=4)
    options = dict(num_blocks=48, max_num_seqs=12, max_num_batched_tokens=24)
    local = make_scheduler(adapter.FastDeployCacheManager, **options)
    try:
        local_steps = run(local, trace)
    finally:
        close(local)
    d = daemon("--num-blocks", "48", "--block-size", str(BLOCK))
    shared = daemon_scheduler(d.endpoint, **options)
    try:
        assert shared.cache_manager.daemon == d.endpoint
        shared_steps = run(shared, trace)
        assert shared.cache_manager.stats() == local.cache_manager.stats()
        assert shared.cache_manager.num_allocatable_gpu_blocks == 48
    finally:
        close(shared)
    assert len(shared_steps) == len(local_steps)
    for i, (ours, theirs) in enumerate(zip(shared_steps, local_steps)):
        assert ours == theirs, f"step {i} differs"


def fastdeploy_window_kv_heads(monkeypatch, ratio: float, num_heads: int, num_kv_heads: int, head_dim: int,
                               tp: int) -> frozenset[int]:
    """The kv heads FastDeploy's own attention code windows: per TP rank its ``AppendAttentionBackend`` is built
    as the GPU model runner builds it (``num_attention_heads // tp`` query heads, ``max(1, kv heads // tp)`` kv
    heads: gpu_model_runner.py:1707-1711) and its ``append_attention`` op runs with a stand-in for the CUDA kernel
    that fills its output with 1 when called with a window and 0 without: the op's own column merge
    (ops/append_attention.py:210-211) then says which query heads read through the window. A kv head is windowed
    when all its query heads are; rank r's kv heads are the global ones ``rank_rows`` gives (split or replicated)."""
    import importlib
    import types

    import numpy as np
    import paddle

    from kvcache.allocator.table import rank_rows

    # The attention package's __init__ imports every backend, MLA's needing triton (not on a CPU): load the
    # append-attention backend's own module from the package's folder instead.
    name = "fastdeploy.model_executor.layers.attention"
    if name not in sys.modules:
        import fastdeploy.model_executor.layers as layers

        package = types.ModuleType(name)
        package.__path__ = [os.path.join(os.path.dirname(layers.__file__), "attention")]
        monkeypatch.setitem(sys.modules, name, package)
    from fastdeploy.platforms import current_platform

    with monkeypatch.context() as cpu:  # import as on a CPU (no CUDA ops to load), whatever other tests patched
        cpu.setattr(current_platform, "is_cuda", lambda: False)
        backend_module = importlib.import_module(f"{name}.append_attn_backend")
        op_module = importlib.import_module(f"{name}.ops.append_attention")
    heads, kv_heads = num_heads // tp, max(1, num_kv_heads // tp)

    def kernel(qkv, *args):  # the CUDA kernel's output [tokens, heads * head_dim]: 1 from a windowed call
        sliding_window = args[-2]
        return paddle.full([qkv.shape[0], heads * head_dim], 1.0 if sliding_window > 0 else 0.0, dtype="float32")

    monkeypatch.setattr(op_module, "current_platform", SimpleNamespace(is_cuda=lambda: True))
    monkeypatch.setattr(op_module, "append_attention_gpu", kernel, raising=False)
    windowed: set[int] = set()
    for rank in range(tp):
        config = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=64),
            model_config=SimpleNamespace(max_model_len=128, rope_theta=None, head_dim=head_dim, num_hidden_layers=1,
                                         window_size=64, sink_size=0, window_attn_skip_freq=0,
                                         head_wise_swa_ratio=ratio, start_layer_index=0),
            enable_rope_3d_runtime=False,
            speculative_config=SimpleNamespace(model_type="main", method=None, num_speculative_tokens=0),
            parallel_config=SimpleNamespace(pd_disaggregation_mode="mixed", expert_parallel_rank=0,
                                            tensor_parallel_rank=rank, tensor_parallel_size=tp,
                                            local_data_parallel_id=0),
            graph_opt_config=SimpleNamespace(full_cuda_graph=True))
        backend = backend_module.AppendAttentionBackend(config, kv_num_heads=kv_heads, num_heads=heads,
                                                        head_dim=head_dim)
        assert not backend.use_output, "full_cuda_graph: the backend calls append_attention, which splits heads"
        qkv = paddle.zeros([1, (heads + 2 * kv_heads) * head_dim], dtype="float32")
        # forward_mixed's call (append_attn_backend.py:496-498): the backend's window, sink and full columns
        out = op_module.append_attention(qkv, *[None] * 19, sliding_window=backend.window_size,
                                         sink_size=backend.sink_size,
                                         head_wise_full_hidden=backend.head_wise_full_hidden
                                         if backend.head_wise_swa_ratio > 0 else 0)
        query_windowed = (np.asarray(out.numpy()).reshape(heads, head_dim) == 1).all(axis=1)
        group = heads // kv_heads
        mine = range(num_kv_heads)[rank_rows(num_kv_heads, tp, rank)]
        windowed |= {mine[k] for k in range(kv_heads) if query_windowed[k * group:(k + 1) * group].all()}
    return frozenset(windowed)


@needs_fastdeploy
def test_window_kv_heads_are_the_heads_fastdeploys_attention_windows(monkeypatch) -> None:
    """For FastDeploy configs at several ratios (0 and 1, tiny and partly covered heads), GQA groups and TP sizes,
    the kv heads kvcache's rows window (``window_kv_heads``) are exactly those FastDeploy's attention backend and
    op window, run here on the CPU; test_rows.py restates the same cases from FastDeploy's source."""
    from test_rows import FASTDEPLOY_WINDOW_HEADS

    from kvcache.allocator.rows import window_kv_heads

    cases = FASTDEPLOY_WINDOW_HEADS + [(0.5, 64, 8, 128, 8, set()), (0.125, 64, 8, 128, 2, set()),
                                       (0.875, 32, 4, 128, 1, {1, 2, 3}), (0.7, 12, 6, 64, 3, {1, 3, 5})]
    for ratio, q, kv, head_dim, tp, expected in cases:
        theirs = fastdeploy_window_kv_heads(monkeypatch, ratio, q, kv, head_dim, tp)
        ours = window_kv_heads({"head_wise_swa_ratio": ratio, "head_dim": head_dim}, q, kv, tp)
        assert ours == theirs == frozenset(expected), (ratio, q, kv, head_dim, tp, sorted(theirs))


def run_head_wise(rm: ResourceManagerV1, trace: list[Spec]) -> tuple[list[Step], int]:
    """``run`` with head-wise tables; also counts the steps after which a scheduled request's
    ``block_tables_headwise`` has a window head's -1."""
    original, seen = rm.schedule, {"steps": 0}

    def schedule():
        out = original()
        if any(-1 in row for r in rm.requests.values() if r.block_tables for row in r.block_tables_headwise):
            seen["steps"] += 1
        return out

    rm.schedule = schedule
    return run(rm, trace), seen["steps"]


@fastdeploy_test
def test_fastdeploys_scheduler_serves_head_wise_tables_with_prefix_hits(monkeypatch, daemon, tmp_path) -> None:
    """FD_HEAD_WISE_KV_CACHE=1 and a model config with head_wise_swa_ratio 0.5 (4 kv heads, the last 2 with an
    8-token window): FastDeploy's ResourceManagerV1 with prefix caching on (which FastDeploy's head-wise patches
    refuse) schedules the pressured trace on kvcache's head-wise tables: prefix hits, chunked prefill,
    preemption, eviction, window heads' blocks given back (-1 in the requests' block_tables_headwise), every
    step checked; over a daemon (install(daemon=...)) the steps are exactly those in process."""
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    trace = make_trace(300, seed=2, per_step=4)
    options = dict(num_blocks=48, max_num_seqs=12, max_num_batched_tokens=24, **HEAD_WISE)
    local = make_scheduler(adapter.FastDeployCacheManager, **options)
    try:
        assert isinstance(local.cache_manager, HeadWiseCacheManager)
        local_steps, with_holes = run_head_wise(local, trace)
    finally:
        close(local)
    stats = local.cache_manager.stats()
    kinds = {kind for step in local_steps for _, kind, _ in step.scheduled}
    assert "preempt" in kinds and stats.hit_requests > 50 and stats.evicted_blocks > 0, (kinds, stats)
    assert with_holes > 100, "window heads give blocks back during the run"
    assert local.cache_manager._cache.stats().recycled_blocks > 0
    assert local.cache_manager.num_allocatable_gpu_blocks == 48
    d = daemon("--num-blocks", "48", "--block-size", str(BLOCK), "--model", head_wise_config_file(tmp_path),
               "--head-wise")
    shared = daemon_scheduler(d.endpoint, **options)
    try:
        assert isinstance(shared.cache_manager, HeadWiseCacheManager) and shared.cache_manager.daemon == d.endpoint
        shared_steps, shared_holes = run_head_wise(shared, trace)
        assert shared.cache_manager.stats() == stats and shared_holes == with_holes
    finally:
        close(shared)
        shared.cache_manager.close()
    assert len(shared_steps) == len(local_steps)
    for i, (ours, theirs) in enumerate(zip(shared_steps, local_steps)):
        assert ours == theirs, f"step {i} differs"


def _first_eviction_step(trace: list[Spec]) -> int:
    """The first step (0-based) in which either manager evicted a cached block, on a fresh run of both."""
    ours = make_scheduler(adapter.FastDeployCacheManager, num_blocks=48, max_num_seqs=12, max_num_batched_tokens=24)
    theirs = make_scheduler(fastdeploy_manager(), num_blocks=48, max_num_seqs=12, max_num_batched_tokens=24)
    try:
        first = []
        for rm, evicted in ((ours, lambda m: m.stats().evicted_blocks), (theirs, _fastdeploy_evictions)):
            seen = {"n": 0, "step": None}
            original = rm.schedule

            def schedule(rm=rm, original=original, evicted=evicted, seen=seen):
                out = original()
                if seen["step"] is None and evicted(rm.cache_manager) > 0:
                    seen["step"] = seen["n"]
                seen["n"] += 1
                return out

            rm.schedule = schedule
            run(rm, trace)
            first.append(seen["step"] if seen["step"] is not None else seen["n"])
        return min(first)
    finally:
        close(ours)
        close(theirs)


def _fastdeploy_evictions(manager: object) -> int:
    """Tree nodes FastDeploy's manager has freed: node ids it returned to its pool beyond those never used."""
    return len(manager.node_id_pool) + len(manager.node_map) - manager.num_gpu_blocks


@fastdeploy_test
def test_install_patches_the_module_attribute(monkeypatch) -> None:
    """install() makes FastDeploy's ResourceManager build kvcache's manager, uninstall() puts FastDeploy's back,
    and install() refuses FastDeploy's v1 cache manager, which it could not replace."""
    from fastdeploy import envs

    original = fastdeploy_manager()
    adapter.install()
    try:
        assert prefix_cache_manager.PrefixCacheManager is adapter.FastDeployCacheManager
        rm = make_scheduler(prefix_cache_manager.PrefixCacheManager, num_blocks=64)
        close(rm)
        assert isinstance(rm.cache_manager, adapter.FastDeployCacheManager)
        assert rm.cache_manager.num_gpu_blocks == rm.total_block_number() == 64
        with pytest.raises(KVCacheError, match="request_block_ids"):
            rm.cache_manager.request_block_ids(make_request(Spec("x", 0, (1, 2, 3), 1)), BLOCK, 0)
    finally:
        adapter.uninstall()
    assert prefix_cache_manager.PrefixCacheManager is original
    monkeypatch.setattr(envs, "ENABLE_V1_KVCACHE_MANAGER", 1)
    with pytest.raises(KVCacheError, match="ENABLE_V1_KVCACHE_MANAGER"):
        adapter.install()
    assert prefix_cache_manager.PrefixCacheManager is original

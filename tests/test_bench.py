"""`kvcache bench allocator`: the vLLM peer is a correct allocator, and the benchmark runs end to end."""
from __future__ import annotations

import json

import pytest

from kvcache.bench import allocator as bench
from kvcache.bench.hashing import _vllm_request_hashes, _vllm_sha256
from kvcache.bench.vllm_peer import (
    BlockHashToBlockMap,
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    KVCacheManager,
    make_block_hash_with_group_id,
)
from kvcache.cli import main

NONE_HASH = _vllm_sha256("0")


def block_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """vLLM's chained sha256 (pickle) hashes of the full blocks of tokens."""
    return _vllm_request_hashes(_vllm_sha256, NONE_HASH, tokens, block_size)


def make_manager(usable_blocks: int, block_size: int = 2) -> KVCacheManager:
    """A peer manager with `usable_blocks` blocks besides vLLM's null block 0."""
    return KVCacheManager(usable_blocks + 1, block_size)


def admit(manager: KVCacheManager, request_id: str, tokens: list[int]) -> tuple[int, list[int]] | None:
    """Admit tokens; (cached tokens, block ids) or None."""
    admitted = manager.admit(request_id, block_hashes(tokens, manager.block_size), len(tokens))
    if admitted is None:
        return None
    return admitted[0], [b.block_id for b in admitted[1]]


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


# --------------------------------------------------------------------------- the peer's pieces


def test_free_queue_pops_in_order_and_removes_from_the_middle() -> None:
    """popleft_n takes from the front; remove unlinks in O(1); append_n/prepend_n keep the given order."""
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue.popleft_n(2)] == [0, 1]
    assert [b.block_id for b in queue.get_all_free_blocks()] == [3, 4, 5]
    queue.append_n([blocks[1], blocks[0]])
    queue.prepend_n([blocks[2]])
    assert [b.block_id for b in queue.get_all_free_blocks()] == [2, 3, 4, 5, 1, 0]
    assert queue.num_free_blocks == 6
    assert queue.popleft().block_id == 2


def test_hash_map_keeps_duplicates_and_pops_by_block_id() -> None:
    """Two blocks under one key: the first is found; popping it leaves the other."""
    key = make_block_hash_with_group_id(b"h" * 32, 0)
    first, second = KVCacheBlock(1), KVCacheBlock(2)
    table = BlockHashToBlockMap()
    table.insert(key, first)
    table.insert(key, second)
    assert table.get_one_block(key) is first
    assert table.pop(key, 1) is first
    assert table.get_one_block(key) is second
    assert table.pop(key, 7) is None and len(table) == 1


def test_pool_reserves_block_zero_and_reuses_uncached_blocks_first() -> None:
    """Block 0 is the null block; freed blocks without a hash go to the front of the queue."""
    pool = BlockPool(5)
    assert pool.null_block.block_id == 0 and pool.get_num_free_blocks() == 4
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3] and all(b.ref_cnt == 1 for b in blocks)
    pool.free_blocks(reversed(blocks))
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()] == [3, 2, 1, 4]
    with pytest.raises(ValueError):
        pool.get_new_blocks(5)


# --------------------------------------------------------------------------- the peer as an allocator


def test_hit_after_free_reuses_the_same_blocks_and_leaves_the_last_token() -> None:
    """A freed prompt's full blocks are found again; the hit stops before the last token."""
    manager = make_manager(6)
    assert admit(manager, "a", [1, 2, 3, 4, 5]) == (0, [1, 2, 3])
    manager.free("a")
    assert manager.num_cached_hashes() == 2
    assert admit(manager, "b", [1, 2, 3, 4, 5]) == (4, [1, 2, 3])  # uncached block 3 came back first
    manager.free("b")
    assert admit(manager, "c", [1, 2, 3, 4]) == (2, [1, 3])


def test_shared_prefix_counts_references_and_frees_only_at_zero() -> None:
    """Two live requests share a cached block (ref_cnt 2); it is free only when both end."""
    manager = make_manager(6)
    admit(manager, "a", [1, 2, 3, 4])
    assert admit(manager, "b", [1, 2, 9, 9, 9]) == (2, [1, 3, 4])
    shared = manager.block_pool.blocks[1]
    assert shared.ref_cnt == 2
    manager.free("a")
    assert shared.ref_cnt == 1 and 1 not in free_ids(manager)
    manager.free("b")
    assert shared.ref_cnt == 0 and 1 in free_ids(manager)


def test_eviction_is_lru_and_tail_first() -> None:
    """Uncached blocks go first, then cached ones oldest first, a prompt's tail before its head."""
    manager = make_manager(4)
    admit(manager, "a", [1, 2, 3, 4])  # blocks 1, 2
    manager.free("a")
    assert free_ids(manager) == [3, 4, 2, 1]
    admit(manager, "b", [5, 6, 7, 8])  # blocks 3, 4: no eviction yet
    manager.free("b")
    assert free_ids(manager) == [2, 1, 4, 3] and manager.num_cached_hashes() == 4
    assert admit(manager, "c", [9, 9]) == (0, [2])  # evicts a's tail
    assert manager.num_cached_hashes() == 4 - 1 + 1
    manager.free("c")
    assert admit(manager, "d", [1, 2, 3, 4, 0]) == (2, [1, 4, 3])  # a's head still hits
    manager.free("d")
    assert admit(manager, "e", [5, 6, 7, 8, 0]) == (0, [3, 2, 4])  # b's blocks were evicted by d


def test_admit_that_does_not_fit_changes_nothing() -> None:
    """allocate_slots counts revived hit blocks; a request too big returns None and changes nothing."""
    manager = make_manager(3)
    admit(manager, "a", [1, 2, 3, 4])
    manager.free("a")
    before = (free_ids(manager), manager.num_cached_hashes())
    assert admit(manager, "b", [1, 2, 3, 4, 5, 6, 7, 8]) is None
    assert (free_ids(manager), manager.num_cached_hashes()) == before
    assert "b" not in manager.req_to_blocks
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks[1:])


# --------------------------------------------------------------------------- the benchmark


def test_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "allocator", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--json", "--quick", "--repeat"):
        assert flag in text


def test_quick_json_run_reports_every_section(capsys: pytest.CaptureFixture[str]) -> None:
    """Structure and positivity only: no assertion here is about speed."""
    assert main(["bench", "allocator", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["quick"] is True

    alloc = result["block_alloc"]
    assert {(r["batch"], r["rows"]) for r in alloc} == {(n, k) for n in (10, 100, 1000) for k in (1, 8)}
    for r in alloc:
        assert r["ours_ns_per_block"] > 0 and r["peer_ns_per_block"] > 0 and r["peer_over_ours"] > 0

    hashing = result["hashing"]
    assert {(r["algorithm"], r["block_size"]) for r in hashing} == {
        (a, b) for a in ("sha256", "sha256_cbor") for b in (16, 64)
    }
    for r in hashing:
        assert r["ours_ms"] > 0 and r["ours_ns_per_token"] > 0 and r["peer_ms"] > 0 and r["peer_over_ours"] > 0
        assert isinstance(r["ok"], bool)

    e2e = result["end_to_end"]
    ours = [r for r in e2e if r["impl"] == "kvcache"]
    assert {(r["block_size"], r["mode"], r["input"].split("[")[0]) for r in ours} == {
        (16, "uniform", "ndarray"), (16, "uniform", "list"), (16, "head-wise 8", "ndarray"),
        (64, "uniform", "ndarray"), (64, "head-wise 8", "ndarray"),
    }
    assert {r["block_size"] for r in e2e if r["impl"] != "kvcache"} == {16, 64}
    for r in e2e:
        assert r["ms"] > 0
        assert r["hit_tokens_min"] == r["hit_tokens_max"] == bench.SHARED_TOKENS, "every iteration a 50% hit"
        assert r["evictions"] and r["evicted_hashes"] > 0, "steady state must evict"
    for r in ours:
        assert r["peer_ms"] > 0 and r["peer_over_ours"] > 0 and isinstance(r["ok"], bool)
        if r["mode"] != "uniform":
            assert r["head_wise_over_uniform"] > 0

    assert len(result["targets"]) == len(hashing) + len(ours)
    text = bench.render(result)
    for heading in ("1. block allocate + free", "2. hashing", "3. end to end", "targets met"):
        assert heading in text

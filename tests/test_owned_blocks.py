"""Scheduler-owned block lists over the wire: CacheClient gives KVCacheManager's results, and a daemon keeps them
across a kill -9 (journal replay) and in its snapshots."""
from __future__ import annotations

import random
import re
import time

import numpy as np
import pytest

from kvcache.allocator import KVCacheError, KVCacheManager
from kvcache.client import CacheClient
from kvcache.durability import STATE_CODEC

BS = 4
FLAGS = ("--num-blocks", "24", "--block-size", str(BS))


def outcome(call):
    """A call's result in plain values, or the refusal's message without the client's prefix."""
    try:
        result = call()
    except KVCacheError as exc:
        return ("refused", str(exc).split(": ", 1)[-1] if str(exc).startswith("ops[") else str(exc))
    if isinstance(result, np.ndarray):
        return result.tolist()
    if isinstance(result, (tuple, list)):
        return [r.tolist() if isinstance(r, np.ndarray) else r for r in result]
    return result


def random_ops(rng: random.Random, n: int) -> list[tuple]:
    """``n`` owned-block calls over three prompts sharing prefixes, some of them bad."""
    prompts = [list(range(1000 * p, 1000 * p + 20)) for p in range(2)] + [list(range(10))]
    ops = []
    for step in range(n):
        req = f"r{rng.randrange(4)}"
        kind = rng.choice(["match", "blank", "commit", "release", "release_blank", "evict", "lookup", "owned"])
        prompt = rng.choice(prompts)[: rng.randrange(1, 21)]
        if kind == "match":
            ops.append(("match_blocks", req, prompt))
        elif kind == "blank":
            ops.append(("allocate_blank", "pool", rng.randrange(0, 5)))
        elif kind == "commit":
            ops.append(("commit", req, rng.randrange(24), rng.choice(prompts)))
        elif kind == "release":
            ops.append(("release_blocks", req))
        elif kind == "release_blank":
            ops.append(("release_blank", rng.randrange(24)))
        elif kind == "evict":
            ops.append(("evict_cached", rng.randrange(3)))
        elif kind == "lookup":
            ops.append(("lookup", prompt))
        else:
            ops.append(("owned_blocks", req))
    return ops


def apply(cache, op: tuple):
    """One call of ``random_ops`` on a KVCacheManager or a CacheClient."""
    kind = op[0]
    if kind == "commit":  # commit one of the pool's blank blocks as the request's next block of a prompt
        _, req, block, prompt = op
        committed = cache.owned_blocks(req)[0].size
        return outcome(lambda: cache.commit_blocks(req, [block], prompt[committed * BS:(committed + 1) * BS],
                                                   blank_from="pool"))
    if kind == "release_blank":
        return outcome(lambda: cache.release_blocks("pool", [op[1]]))
    if kind == "lookup":
        return outcome(lambda: cache.lookup(op[1], whole_prompt=True))
    return outcome(lambda: getattr(cache, kind)(*op[1:]))


def test_a_client_gives_the_managers_results_call_for_call(daemon) -> None:
    """The same 300 random calls (matches, blank allocations, commits, releases, evictions, some refused) on a
    KVCacheManager and through a CacheClient to `kvcache serve`: the same results, refusals and counts."""
    d = daemon(*FLAGS)
    manager = KVCacheManager(24, BS)
    rng = random.Random(7)
    with CacheClient(d.endpoint) as client:
        for i, op in enumerate(random_ops(rng, 300)):
            ours, theirs = apply(manager, op), apply(client, op)
            assert theirs == ours, f"call {i} {op[:2]}: daemon {theirs!r}, manager {ours!r}"
            manager.check_integrity()
        client.check_integrity()
        assert client.num_free_blocks.tolist() == manager.num_free_blocks.tolist()
        assert client.num_cached_free_blocks.tolist() == manager.num_cached_free_blocks.tolist()
        assert client.uncached_free_blocks().tolist() == manager.uncached_free_blocks().tolist()
        assert client.stats()["evicted_blocks"] == manager.stats().evicted_blocks


def test_owned_blocks_survive_kill_9_and_a_restart_from_the_journal(daemon, tmp_path) -> None:
    """A daemon killed after a match, a blank allocation and a commit comes back from its journal with the same
    owners, the same committed prefix (found whole) and the same free blocks."""
    journal = tmp_path / "journal"
    d = daemon(*FLAGS, "--journal", str(journal))
    prompt = list(range(50, 62))
    with CacheClient(d.endpoint) as client:
        assert client.match_blocks("a", prompt).tolist() == []
        blank = client.allocate_blank("pool", 3)
        assert client.commit_blocks("a", blank[:2], prompt[:8], blank_from="pool") == 2
        before = (client.owned_blocks("a"), client.owned_blocks("pool"), client.uncached_free_blocks())
    d.kill()
    d = daemon(*FLAGS, "--journal", str(journal), folder=d.folder)
    with CacheClient(d.endpoint) as client:
        after = (client.owned_blocks("a"), client.owned_blocks("pool"), client.uncached_free_blocks())
        assert [a.tolist() for a in (*after[0], *after[1], after[2])] == \
            [b.tolist() for b in (*before[0], *before[1], before[2])]
        assert client.lookup(prompt[:8], whole_prompt=True) == 8
        client.check_integrity()
        client.release_blocks("a")
        client.release_blocks("pool", blank[2:])
        assert client.num_free_blocks.tolist() == [24]
        client.check_integrity()


def test_a_snapshot_keeps_the_owners() -> None:
    """A journal snapshot of a manager with owned blocks loads back with the same owners and prefix index."""
    manager = KVCacheManager(8, BS)
    manager.match_blocks("a", list(range(8)))
    manager.commit_blocks("a", manager.allocate_blank("a", 2), list(range(8)))
    manager.allocate_blank("pool", 1)
    data = bytearray(b"".join(bytes(p) for p in STATE_CODEC.chunks(manager)))
    loaded = STATE_CODEC.loads(data)
    assert [b.tolist() for b in loaded.owned_blocks("a")] == [[0, 1], []]
    assert [b.tolist() for b in loaded.owned_blocks("pool")] == [[], [2]]
    assert loaded.lookup(list(range(8)), whole_prompt=True) == 8
    loaded.check_integrity()
    with pytest.raises(KVCacheError, match="^request_id"):
        loaded.match_blocks("a", list(range(8)))


@pytest.mark.parametrize("op, field", [
    ({"op": "allocate_blank", "req": "a", "num_blocks": -1}, "ops[1].num_blocks"),
    ({"op": "allocate_blank", "req": "a", "num_blocks": 25}, "ops[1].num_blocks"),
    ({"op": "allocate_blank", "req": 1.5, "num_blocks": 1}, "ops[1].req"),
    ({"op": "commit_blocks", "req": "a", "blocks": [24], "tokens": [1, 2, 3, 4]}, "ops[1].blocks"),
    ({"op": "commit_blocks", "req": "a", "tokens": [1, 2, 3, 4]}, "ops[1].blocks"),
    ({"op": "commit_blocks", "req": "a", "blocks": [0], "tokens": [1, 2, 3, 4], "blank_from": [1]},
     "ops[1].blank_from"),
    ({"op": "release_blocks", "req": "a", "blocks": ["x"]}, "ops[1].blocks"),
    ({"op": "match_blocks", "req": "a", "tokens": [-1]}, "ops[1].tokens"),
    ({"op": "lookup", "tokens": [1], "whole_prompt": 1}, "ops[1].whole_prompt"),
    ({"op": "evict_cached"}, "ops[1].num_blocks"),
])
def test_a_malformed_owned_op_refuses_its_message_and_changes_nothing(daemon, op, field) -> None:
    """A bad field refuses the whole message with one line naming it; the blank allocation before it in the same
    message is not applied."""
    from kvcache.client import DaemonError

    d = daemon(*FLAGS)
    with CacheClient(d.endpoint) as client:
        batch = client.batch().op("allocate_blank", req="p", num_blocks=2).op(op.pop("op"), **op)
        with pytest.raises(DaemonError, match="^" + re.escape(field) + r"\b"):
            batch.send()
        assert client.num_free_blocks.tolist() == [24] and client.owned_blocks("p")[1].tolist() == []


LEASE_FLAGS = (*FLAGS, "--lease-timeout", "1")


def take_blocks(client: CacheClient, req: str, pool: str, prompt: list[int]) -> None:
    """Match ``req``'s prompt, take 4 blank blocks under ``pool``, commit 2 of them as ``req``'s first blocks."""
    client.match_blocks(req, prompt)
    blank = client.allocate_blank(pool, 4)
    client.commit_blocks(req, blank[:2], prompt[:8], blank_from=pool)


def wait_for_expiry(steady: CacheClient, expired: int) -> None:
    """Ping as ``steady`` (keeping its lease) until the daemon has expired ``expired`` requests (10 s at most)."""
    deadline = time.monotonic() + 10
    while steady.stats()["expired_requests"] < expired:
        assert time.monotonic() < deadline, "the silent scheduler's lease never expired"
        time.sleep(0.1)


def test_a_silent_schedulers_owned_blocks_are_released_with_its_lease(daemon) -> None:
    """A scheduler that took blank blocks, committed some and admitted a request goes silent: after the lease
    timeout the daemon frees its request and releases its owned blocks alike (committed prefixes stay cached), and
    a scheduler that keeps talking keeps its own."""
    d = daemon(*LEASE_FLAGS)
    mine, theirs = list(range(100, 112)), list(range(200, 212))
    with CacheClient(d.endpoint, name="steady") as steady:
        take_blocks(steady, "s", "steady-pool", mine)
        held = (steady.owned_blocks("s"), steady.owned_blocks("steady-pool"))
        silent = CacheClient(d.endpoint, name="silent")
        take_blocks(silent, "a", "silent-pool", theirs)
        silent.allocate_blank("b", 1)
        silent.match_blocks("c", [7])  # a live committed part of no blocks
        silent.admit("x", list(range(300, 309)))
        assert sorted(silent.owned()) == ["a", "b", "c", "silent-pool", "x"]
        assert steady.num_free_blocks.tolist() == [24 - 4 - 4 - 1 - 3]
        silent.close()
        wait_for_expiry(steady, 5)
        assert steady.num_free_blocks.tolist() == [24 - 4]
        steady.check_integrity()
        for req in ("a", "b", "c", "silent-pool"):
            assert [b.tolist() for b in steady.owned_blocks(req)] == [[], []]
        assert [[b.tolist() for b in pair] for pair in (steady.owned_blocks("s"), steady.owned_blocks("steady-pool"))] \
            == [[b.tolist() for b in pair] for pair in held]
        assert steady.lookup(theirs, whole_prompt=True) == 8       # released like a freed request: still cached
        assert steady.lookup(list(range(300, 309))) == 8
        assert sorted(steady.owned()) == ["s", "steady-pool"]
        assert steady.match_blocks("c", [7]).tolist() == []        # the released ids are free to take again
    assert "lease of scheduler 'silent' expired" in d.log() and "released the owned blocks of 4" in d.log()


def test_owned_blocks_keep_their_lease_across_kill_9_and_a_journal_restart(daemon, tmp_path) -> None:
    """The owner of blocks survives a kill -9: after the restart the silent scheduler still owns its blocks, and
    its lease expiry releases them while the scheduler that keeps talking keeps its own."""
    flags = (*LEASE_FLAGS, "--journal", str(tmp_path / "journal"))
    d = daemon(*flags)
    with CacheClient(d.endpoint, name="steady") as steady:
        take_blocks(steady, "s", "steady-pool", list(range(100, 112)))
    with CacheClient(d.endpoint, name="silent") as silent:
        take_blocks(silent, "a", "silent-pool", list(range(200, 212)))
    d.kill()
    d = daemon(*flags, folder=d.folder)
    with CacheClient(d.endpoint, name="silent") as silent:
        assert sorted(silent.owned()) == ["a", "silent-pool"]
    with CacheClient(d.endpoint, name="steady") as steady:
        assert sorted(steady.owned()) == ["s", "steady-pool"]
        assert steady.num_free_blocks.tolist() == [24 - 8]
        wait_for_expiry(steady, 2)
        assert steady.num_free_blocks.tolist() == [24 - 4]
        assert steady.owned_blocks("s")[0].size == 2
        steady.check_integrity()
        steady.release_blocks("s")
        steady.release_blocks("steady-pool", steady.owned_blocks("steady-pool")[1])
        assert steady.num_free_blocks.tolist() == [24] and steady.owned() == []
        steady.check_integrity()

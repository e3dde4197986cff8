"""Scheduler-owned block lists over the wire: CacheClient gives KVCacheManager's results, and a daemon keeps them
across a kill -9 (journal replay) and in its snapshots."""
from __future__ import annotations

import random
import re

import numpy as np
import pytest

from kvcache.allocator import KVCacheError, KVCacheManager
from kvcache.client import CacheClient
from kvcache.server import STATE_CODEC

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

"""The prefix hashes' root across daemons and restarts: vLLM's default seed unless --hash-seed, kept by a journal."""
from __future__ import annotations

import itertools
import time

import msgpack
import pytest
import zmq

from kvcache.allocator.prefix import BlockHasher
from kvcache.client import CacheClient

BS = 4
FLAGS = ("--num-blocks", "64", "--block-size", str(BS))
TIMEOUT_S = 5.0


def low64(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & (2**64 - 1)


def published_hashes(client: CacheClient, prompt: list[int]) -> list[int]:
    """The block hashes of the events storing ``prompt``, admitted once the events subscription has joined (fresh
    probe prompts until one's batch arrives)."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(client.info()["events_endpoint"])
    try:
        deadline = time.monotonic() + TIMEOUT_S
        for n in itertools.count():
            assert time.monotonic() < deadline, "no event batch arrived"
            client.admit(f"probe-{n}", [20_000_000 + 4 * n + i for i in range(4)])
            if sub.poll(100):
                break
        client.admit("published", prompt)
        while True:
            assert sub.poll(max(0, int(1000 * (deadline + TIMEOUT_S - time.monotonic())))), "no batch for the prompt"
            _, events, _ = msgpack.unpackb(sub.recv_multipart()[2], raw=False)
            for event in events:
                if event["type"] == "BlockStored" and event["token_ids"] == prompt[:len(event["token_ids"])]:
                    return event["block_hashes"]
    finally:
        sub.close()


def test_a_journal_hashed_with_another_root_restores_and_still_hits_its_prefixes(daemon, tmp_path):
    """A journal written under another root (another seed, or a random root from before the default was fixed) keeps
    it: the restarted default daemon still finds the cached prefixes and hashes new prompts under the same root, and
    says in its log that a router sees its hashes differ from other daemons'."""
    journal = str(tmp_path / "journal")
    prompt = list(range(100, 113))
    d = daemon(*FLAGS, "--journal", journal, "--hash-seed", "written-before")
    with CacheClient(d.endpoint) as client:
        client.admit("a", prompt)
        client.free("a")
        assert client.lookup(prompt + [1]) == 12
    d.stop()
    d = daemon(*FLAGS, "--journal", journal, "--events", folder=d.folder)
    with CacheClient(d.endpoint) as client:
        assert client.lookup(prompt + [1]) == 12
        later = list(range(300, 308))
        assert published_hashes(client, later) == [low64(h) for h in
                                                   BlockHasher(BS, seed="written-before").hash_blocks(later)]
        client.admit("b", prompt + [1, 2, 3])
        assert client.lookup(prompt + [1, 2, 3, 4]) == 16
    assert "keeps the hash root its cached prefixes were hashed with" in d.log()


def test_a_journal_refuses_an_explicit_seed_other_than_its_own(daemon, tmp_path):
    """--hash-seed names the root to use: a journal hashed under another root is refused, naming the setting, rather
    than losing every cached prefix silently."""
    journal = str(tmp_path / "journal")
    d = daemon(*FLAGS, "--journal", journal)
    with CacheClient(d.endpoint) as client:
        client.admit("a", list(range(9)))
    d.stop()
    with pytest.raises(RuntimeError, match="hash_seed differs"):
        daemon(*FLAGS, "--journal", journal, "--hash-seed", "tenant-b", folder=d.folder)
    d = daemon(*FLAGS, "--journal", journal, "--hash-seed", "vllm-none-hash", folder=d.folder)
    with CacheClient(d.endpoint) as client:
        assert client.lookup(list(range(9))) == 8


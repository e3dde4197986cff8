"""A KV-aware router restarted beside running daemons: Dynamo's indexer (``make dynamo``) is only a reader of the
daemons' KV events, so requests in flight never notice it, and a new indexer rebuilds its tree from the batches
each daemon keeps for replay (``--replay-bytes``; at most 10,000 batches): every prefix stored while the replay
buffer still holds its batch is credited again, one stored earlier only once it is stored again."""
from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from kvcache.client import CacheClient

from test_dynamo import BS, _core, agreed, join, overlap_tokens

EVENTS = ("--num-blocks", "512", "--block-size", str(BS), "--events")


async def router(clients: dict[tuple[int, int], CacheClient]) -> Any:
    """A fresh Dynamo selection service subscribed to each daemon (worker ids from 1), once it credits each one."""
    service = _core.SelectionService(indexer_threads=2)
    for (worker_id, _), client in clients.items():
        info = client.info()
        record = await service.upsert_worker({
            "worker_id": worker_id, "endpoint": client.endpoint, "block_size": BS,
            "kv_events_endpoint": info["events_endpoint"], "replay_endpoint": info["events_replay_endpoint"]})
        assert record["lifecycle"] == "schedulable", record
    await join(service, clients)
    return service


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 150_000, 40).tolist() for _ in range(n)]


def test_a_restarted_router_credits_every_prefix_the_replay_buffer_holds_and_requests_in_flight_go_on(daemon):
    """Router 1 indexes two daemons; it stops while requests run and new prompts are admitted; router 2 starts
    from nothing. Its overlap for every prompt, stored before it started or after, equals each daemon's own lookup,
    and the requests admitted all along keep their tables and extend as if no router had come or gone."""
    d1, d2 = daemon(*EVENTS), daemon(*EVENTS)
    before, meanwhile, after = prompts(1, 3), prompts(2, 3), prompts(3, 3)

    async def scenario() -> list[tuple[dict, dict]]:
        with CacheClient(d1.endpoint) as c1, CacheClient(d2.endpoint) as c2:
            clients = {(1, 0): c1, (2, 0): c2}
            first = await router(clients)
            for i, p in enumerate(before):
                (c1 if i % 2 else c2).admit(f"before-{i}", p)
            tables = {f"before-{i}": (c1 if i % 2 else c2).table(f"before-{i}").copy() for i in range(3)}
            first.shutdown()  # the router goes away with requests in flight
            for i, p in enumerate(meanwhile):
                (c1 if i % 2 else c2).admit(f"meanwhile-{i}", p)
            for i in range(3):
                client = c1 if i % 2 else c2
                assert np.array_equal(client.table(f"before-{i}"), tables[f"before-{i}"])
                assert client.extend(f"before-{i}", list(range(30))) is not None  # decoding goes on
            second = await router(clients)
            try:
                for i, p in enumerate(after):
                    (c1 if i % 2 else c2).admit(f"after-{i}", p)
                queries = [p + [7] for p in before + meanwhile + after]
                pairs = await agreed(second, clients, queries)
            finally:
                second.shutdown()
            c1.check_integrity()
            c2.check_integrity()
            return pairs

    pairs = asyncio.run(scenario())
    assert all(sum(want.values()) == 40 for _, want in pairs)  # each prompt is cached on one daemon
    assert [got for got, _ in pairs] == [want for _, want in pairs], "the restarted router misses a prefix"


def test_a_prefix_stored_before_the_replay_buffer_is_credited_only_once_stored_again(daemon):
    """With a replay buffer of one batch (``--replay-bytes 1``), a router started late credits only what was stored
    after the buffer's batch: an older prefix scores 0 there while the daemon still hits it, until a new request
    stores it again (the router then sees it)."""
    d = daemon(*EVENTS, "--replay-bytes", "1")
    old, filler = prompts(4, 2)

    async def scenario() -> tuple[int, int, int]:
        with CacheClient(d.endpoint) as c:
            c.admit("old", old)
            c.free("old")  # cached, no longer held
            c.admit("filler", filler)  # a later batch: the buffer keeps only this one
            service = await router({(1, 0): c})
            try:
                missed = overlap_tokens(await service.overlap_scores({"token_ids": old + [7]})).get((1, 0), 0)
                hit = c.lookup(old + [7])
                c.admit("again", old)  # a hit: the daemon stores nothing new, so nothing is sent
                c.free("again")
                c.evict_cached(512)  # the prefix goes (BlockRemoved) ...
                c.admit("stored", old)  # ... and is stored again (BlockStored): the router learns it
                (got, want), = await agreed(service, {(1, 0): c}, [old + [7]])
                return missed, hit, got[(1, 0)] if got == want else -1
            finally:
                service.shutdown()

    missed, hit, later = asyncio.run(scenario())
    assert (missed, hit, later) == (0, 40, 40)

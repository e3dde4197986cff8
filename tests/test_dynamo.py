"""NVIDIA Dynamo's own KV indexer indexes a cluster of `kvcache serve --events` daemons right.

Dynamo's selection service (``dynamo._core.SelectionService`` of ``ai-dynamo-runtime`` 1.6.1, ``make dynamo``;
no etcd or NATS) subscribes to each daemon's events as it would to vLLM's and keeps one radix tree for all
workers: it hashes the token ids of every store itself and links a store to its parent by the engine's parent
hash. So its overlap for a prompt equals a daemon's own prefix hit only if daemons serving one model hash
alike (one default root) and each data-parallel rank names itself in its batches.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import numpy as np
import pytest

from kvcache.client import CacheClient

try:
    from dynamo import _core
except ImportError as exc:  # not installed, or a wheel that does not load here
    pytest.skip(f"Dynamo's indexer is not importable ({exc}); `make dynamo` installs ai-dynamo-runtime==1.6.1",
                allow_module_level=True)

BS = 4
TIMEOUT_S = 20.0
FLAGS = ("--num-blocks", "512", "--block-size", str(BS), "--events")
_fresh = itertools.count(1_000_000, 16)


def fresh_tokens(n: int) -> list[int]:
    """Tokens no other prompt of this test run holds."""
    start = next(_fresh)
    assert n <= 16
    return list(range(start, start + n))


def overlap_tokens(scores: dict[str, Any]) -> dict[tuple[int, int], int]:
    """Dynamo's overlap_scores reply as {(worker_id, dp_rank): cached tokens on the device}."""
    return {(w["worker_id"], w["dp_rank"]): w["device_blocks"] * scores["block_size"] for w in scores["workers"]}


async def join(service: Any, clients: dict[tuple[int, int], CacheClient]) -> None:
    """Wait until Dynamo has subscribed to every daemon: admit prompts of fresh tokens on each until Dynamo credits
    that (worker, rank) with one (a subscription joins asynchronously: batches before it are not seen live)."""
    deadline = time.monotonic() + TIMEOUT_S
    for key, client in clients.items():
        while True:
            probe = fresh_tokens(8)
            client.admit(f"probe-{probe[0]}", probe)
            for _ in range(5):
                credited = overlap_tokens(await service.overlap_scores({"token_ids": probe + [0]}))
                if credited.get(key) == 8:
                    break
                await asyncio.sleep(0.05)
            else:
                assert time.monotonic() < deadline, (f"Dynamo never credited worker {key[0]} rank {key[1]} with a "
                                                     f"prompt admitted there; it credited {credited}")
                continue
            break


async def agreed(service: Any, clients: dict[tuple[int, int], CacheClient],
                 queries: list[list[int]]) -> list[tuple[dict, dict]]:
    """Poll until Dynamo's overlap for every query equals each daemon's own lookup, or the deadline passes; returns
    the last (Dynamo's, the daemons') pair per query."""
    want = [{key: client.lookup(q) for key, client in clients.items()} for q in queries]
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        pairs = []
        for q, w in zip(queries, want):
            got = overlap_tokens(await service.overlap_scores({"token_ids": q}))
            pairs.append(({key: got.get(key, 0) for key in w}, w))
        if all(got == w for got, w in pairs) or time.monotonic() > deadline:
            return pairs
        await asyncio.sleep(0.1)


def shared_prefix_prompts() -> tuple[list[int], list[list[int]]]:
    """A 40-token prefix and prompts that extend it; each query is a prompt with one more token (so a hit never
    covers the whole query: a daemon's lookup leaves the last token to compute, Dynamo does not)."""
    rng = np.random.default_rng(11)
    prefix = rng.integers(0, 150_000, 40).tolist()
    a = prefix + rng.integers(0, 150_000, 8).tolist()
    b = prefix + rng.integers(0, 150_000, 21).tolist()
    c = b[:52] + rng.integers(0, 150_000, 27).tolist()
    return prefix, [a, b, c]


def test_dynamos_overlap_for_two_default_daemons_is_each_daemons_own_prefix_hit(daemon):
    """Two daemons with default flags share a prefix across prompts admitted on either; Dynamo's overlap for each
    query, per worker, is that daemon's lookup. A per-daemon root would make Dynamo drop the second daemon's
    stores under the first's blocks (it keeps one engine hash per tree position)."""
    d1, d2 = daemon(*FLAGS), daemon(*FLAGS)
    prefix, (a, b, c) = shared_prefix_prompts()

    async def scenario() -> list[tuple[dict, dict]]:
        service = _core.SelectionService(indexer_threads=2)
        with CacheClient(d1.endpoint) as c1, CacheClient(d2.endpoint) as c2:
            try:
                for worker_id, client in ((1, c1), (2, c2)):
                    info = client.info()
                    record = await service.upsert_worker({
                        "worker_id": worker_id, "endpoint": client.endpoint, "block_size": BS,
                        "kv_events_endpoint": info["events_endpoint"],
                        "replay_endpoint": info["events_replay_endpoint"]})
                    assert record["lifecycle"] == "schedulable", record
                clients = {(1, 0): c1, (2, 0): c2}
                await join(service, clients)
                c1.admit("a", a)
                c2.admit("b", b)
                c2.admit("c", c)
                c1.admit("c-head", c[:60])
                c1.free("a")  # freed blocks stay cached
                queries = [p + [7] for p in (prefix, a, b, c, c[:60])] + [fresh_tokens(12)]
                return await agreed(service, clients, queries)
            finally:
                service.shutdown()

    pairs = asyncio.run(scenario())
    assert [w for _, w in pairs] == [{(1, 0): 40, (2, 0): 40}, {(1, 0): 48, (2, 0): 40}, {(1, 0): 52, (2, 0): 60},
                                     {(1, 0): 60, (2, 0): 76}, {(1, 0): 60, (2, 0): 60}, {(1, 0): 0, (2, 0): 0}]
    assert [got for got, _ in pairs] == [w for _, w in pairs], "Dynamo's overlap differs from the daemons' lookups"


def test_dynamo_credits_each_data_parallel_rank_and_selects_it(daemon):
    """Two daemons as ranks 0 and 1 of one data-parallel worker (--data-parallel-rank): Dynamo credits each rank
    with its own daemon's blocks, and select() sends each rank's prompts to that rank. Batches that all said rank 0
    would credit rank 0 with both daemons' blocks."""
    ranks = [daemon(*FLAGS, "--data-parallel-rank", str(r)) for r in (0, 1)]
    prefix, (a, b, c) = shared_prefix_prompts()

    async def scenario() -> tuple[list[tuple[dict, dict]], list[int]]:
        service = _core.SelectionService(indexer_threads=2)
        c0, c1 = (CacheClient(d.endpoint) for d in ranks)
        try:
            record = await service.upsert_worker({
                "worker_id": 5, "endpoint": "kvcache-dp", "block_size": BS,
                "data_parallel_start_rank": 0, "data_parallel_size": 2,
                "kv_events_endpoints": {r: client.info()["events_endpoint"] for r, client in enumerate((c0, c1))}})
            assert record["lifecycle"] == "schedulable", record
            clients = {(5, 0): c0, (5, 1): c1}
            await join(service, clients)
            c0.admit("a", a)
            c1.admit("b", b)
            c1.admit("c", c)
            queries = [p + [7] for p in (a, b, c)]
            pairs = await agreed(service, clients, queries)
            chosen = [(await service.select({"token_ids": q}))["dp_rank"] for q in queries]
            return pairs, chosen
        finally:
            service.shutdown()
            c0.close()
            c1.close()

    pairs, chosen = asyncio.run(scenario())
    assert [w for _, w in pairs] == [{(5, 0): 48, (5, 1): 40}, {(5, 0): 40, (5, 1): 60}, {(5, 0): 40, (5, 1): 76}]
    assert [got for got, _ in pairs] == [w for _, w in pairs], "Dynamo's overlap differs from the daemons' lookups"
    assert chosen == [0, 1, 1]

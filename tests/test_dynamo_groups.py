"""NVIDIA Dynamo's own KV indexer follows a hybrid model's daemon whichever way it numbers its groups.

Dynamo 1.6.1 (``make dynamo``) indexes the main attention group of an engine's KV events: it takes stores of kind
``full_attention``, learns their ``group_idx`` and applies removals of that group, ignoring the sliding groups'.
A `kvcache serve --model gemma-3-4b` daemon numbers its groups as vLLM does (six sliding groups, then the full one,
each block stored once per group) or, with ``--events-groups policy``, one per row policy: Dynamo's overlap for a
prompt is the daemon's own prefix hit either way, after evictions too.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvcache.client import CacheClient
from test_dynamo import BS, _core, agreed, join


@pytest.mark.parametrize("numbering", ["vllm", "policy"])
def test_dynamos_overlap_for_a_gemma_daemon_is_its_prefix_hit_after_evictions(daemon, numbering):
    d = daemon("--model", "gemma-3-4b", "--num-blocks", "32", "--block-size", str(BS), "--events",
               "--events-groups", numbering)
    rng = np.random.default_rng(5)
    a, b, c = (rng.integers(0, 150_000, n).tolist() for n in (48, 60, 60))

    async def scenario() -> list[tuple[dict, dict]]:
        service = _core.SelectionService(indexer_threads=2)
        with CacheClient(d.endpoint) as client:
            try:
                info = client.info()
                assert info.get("event_groups", [[0], [1]]) == ([[0, 1, 2, 3, 4, 5], [6]] if numbering == "vllm"
                                                                 else [[0], [1]])
                record = await service.upsert_worker({
                    "worker_id": 1, "endpoint": client.endpoint, "block_size": BS,
                    "kv_events_endpoint": info["events_endpoint"],
                    "replay_endpoint": info["events_replay_endpoint"]})
                assert record["lifecycle"] == "schedulable", record
                clients = {(1, 0): client}
                await join(service, clients)
                client.admit("a", a)
                client.free("a")                 # a's 12 blocks stay cached
                client.admit("b", b)
                client.free("b")
                client.admit("c", c)             # 15 blocks: evicts a's blocks (freed first) and the probes'
                return await agreed(service, clients, [p + [7] for p in (a, b, c)])
            finally:
                service.shutdown()

    pairs = asyncio.run(scenario())
    wants = [w[(1, 0)] for _, w in pairs]
    assert wants[2] == 60 and wants[0] < 48, "the third prompt evicted some of the first one's blocks"
    assert [got for got, _ in pairs] == [w for _, w in pairs], "Dynamo's overlap differs from the daemon's lookups"

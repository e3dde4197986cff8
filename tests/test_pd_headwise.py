"""PD with tables of several rows over real daemons and NIXL: one row per kv head (sliding-window heads keeping
sink and window only), and a model's layer groups (sliding layers in one row, full layers in another, per kv head
within each group with --head-wise) with pools of their own.

A decode reservation gives its window rows' blocks behind the window back at once (uncached where
they would have arrived, as the prefill node may not hold them after its own prefix hit); each
row's blocks move to the same row's decode blocks, layer by layer, re-sliced across TP sizes.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from kvcache.client import CacheClient
from kvcache.pd.cluster import Cluster, run_batch, scenario
from kvcache.transfer.nixl import nixl_available

needs_nixl = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pip install nixl-cu12 --no-deps)")

# A loaded machine can hold a whole check_integrity of a busy node past the client's default 5 s; a hang still fails.
CALL_TIMEOUT_S = 30.0

# 4 kv heads: two sliding-window heads (32 tokens, a 16-token sink) and two full ones.
ROWS = "window:32:16*2,full*2"


def nothing_held(prefill: CacheClient, decode: CacheClient) -> None:
    assert (prefill.usage.max, decode.usage.max) == (0.0, 0.0)
    assert prefill.stats()["in_transfer"] == decode.stats()["in_transfer"] == 0
    prefill.check_integrity()
    decode.check_integrity()


@needs_nixl
@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 1), (2, 1), (1, 2)])
def test_head_wise_requests_arrive_head_by_head_with_prefix_hits_on_either_side(prefill_tp, decode_tp):
    """Fresh prompts, hits on both nodes, on prefill only (its window heads skip blocks), on decode only."""
    from kvcache.pd import PDProxy

    with Cluster(layers=3, kv_heads=4, head_dim=32, prefill_tp=prefill_tp, decode_tp=decode_tp, rows=ROWS) as cluster:
        prefill, decode = (CacheClient(cluster.cfg[role], timeout=CALL_TIMEOUT_S) for role in ("prefill", "decode"))
        proxy = PDProxy(prefill, decode)
        for name, prompts, clear in scenario(np.random.default_rng(3), cluster.spec.block_size):
            if clear:
                (prefill if clear == "prefill" else decode).reset_prefix_cache()
            result = run_batch(cluster, proxy, prompts)
            assert result["problems"] == [], name
            if name == "prefix hits on prefill only":
                assert all(v > 0 for v in result["prefill_cached"].values())
            if name == "prefix hits on decode only":
                assert all(v > 0 for v in result["decode_cached"].values())
        nothing_held(prefill, decode)


# Gemma-shaped: layers 0 and 2 slide over 32 tokens (with a 16-token sink, so a decode-side hit can keep its first
# block), 1 and 3 attend in full.
GEMMA_SHAPED = {"model_type": "gemma3_text", "num_hidden_layers": 4, "num_attention_heads": 8,
                "num_key_value_heads": 4, "head_dim": 32, "sliding_window": 32, "sink_size": 16,
                "sliding_window_pattern": 2}


@needs_nixl
@pytest.mark.parametrize("prefill_tp, decode_tp, head_wise", [(1, 1, False), (2, 1, True), (1, 2, False)])
def test_layer_group_rows_arrive_layer_by_layer_from_their_own_pools(prefill_tp, decode_tp, head_wise):
    """Daemons serving a Gemma-shaped config: the sliding layers' row has a smaller pool than the full layers'
    (sized from the memory for requests of 2,048 tokens); fresh prompts and prefix hits on either node move each
    layer's blocks from its own row to the same row on the decode node, and every decode byte is the model's."""
    from kvcache.pd import PDProxy

    with Cluster(model=GEMMA_SHAPED, head_wise=head_wise, memory="32MiB", max_model_len=2048,
                 max_num_batched_tokens=1040, prefill_tp=prefill_tp, decode_tp=decode_tp) as cluster:
        prefill, decode = (CacheClient(cluster.cfg[role], timeout=CALL_TIMEOUT_S) for role in ("prefill", "decode"))
        rows = prefill.info()["rows"]
        assert len(rows) == (8 if head_wise else 2)
        assert [r["layers"] for r in rows[:: len(rows) // 2]] == [[0, 2], [1, 3]]
        assert rows[0]["num_blocks"] < rows[-1]["num_blocks"]
        layer_blocks = cluster.cfg["layer_blocks"]["decode"]
        assert layer_blocks[0] == layer_blocks[2] < layer_blocks[1] == layer_blocks[3]
        proxy = PDProxy(prefill, decode)
        for name, prompts, clear in scenario(np.random.default_rng(5), cluster.spec.block_size):
            if clear:
                (prefill if clear == "prefill" else decode).reset_prefix_cache()
            result = run_batch(cluster, proxy, prompts)
            assert result["problems"] == [], name
            if name == "prefix hits on decode only":
                assert all(v > 0 for v in result["decode_cached"].values())
        nothing_held(prefill, decode)


def test_a_decode_reservation_keeps_only_what_its_window_heads_read(daemon):
    """1,000 tokens, block 16: window heads hold the sink block and the last window's blocks; full heads every block."""
    d = daemon("--num-blocks", "256", "--block-size", "16", "--role", "decode", "--rows", ROWS)
    with CacheClient(d.endpoint, name="sched") as c:
        c.attach(0, "tcp://127.0.0.1:1")
        table = c.reserve("a", np.arange(1000)).table
        assert table.shape == (4, 63)
        assert (table[2:] >= 0).all()
        window = table[:2]
        kept = np.flatnonzero(window[0] >= 0).tolist()
        assert kept == [0, 60, 61, 62]  # sink; tokens 969.. (the next query, at 1000, sees 969..1000)
        assert (window[1] == window[0]).all()  # one policy, one pool: the same blocks
        assert c.usage.per_row.tolist() == pytest.approx([4 / 256, 4 / 256, 63 / 256, 63 / 256])
        c.cancel("a", release=True)
        assert c.usage.max == 0.0
        c.check_integrity()


@needs_nixl
def test_blocks_the_prefill_node_never_sent_are_never_a_decode_prefix_hit():
    """The prefill node hits a prompt's head (its window heads skip the blocks behind their window), the decode
    node does not: those decode blocks stay unwritten, so a later prompt sharing a shorter head must not hit them."""
    from kvcache.pd import PDProxy

    rng = np.random.default_rng(4)
    head = rng.integers(0, 50_000, 400)
    with Cluster(layers=2, kv_heads=4, head_dim=32, rows=ROWS) as cluster:
        prefill, decode = (CacheClient(cluster.cfg[role], timeout=CALL_TIMEOUT_S) for role in ("prefill", "decode"))
        proxy = PDProxy(prefill, decode)
        assert run_batch(cluster, proxy, {"p": head})["problems"] == []
        decode.reset_prefix_cache()
        longer = run_batch(cluster, proxy, {"q": np.concatenate([head, rng.integers(0, 50_000, 200)])})
        assert longer["problems"] == [] and longer["prefill_cached"]["q"] > 0 and longer["decode_cached"]["q"] == 0
        shorter = run_batch(cluster, proxy, {"r": np.concatenate([head[:200], rng.integers(0, 50_000, 100)])})
        assert shorter["problems"] == []
        # Its window heads would need blocks 10, 11 of the head: "q" held them unwritten, so no hit reaches them.
        assert shorter["decode_cached"]["r"] < 12 * cluster.spec.block_size
        nothing_held(prefill, decode)


@needs_nixl
def test_chunked_prefill_with_window_heads_recycling_between_chunks():
    """700 tokens in three chunks; the prefill node's window heads give blocks back between chunks (they went out
    with their chunk, or the decode node never wanted them); the decode node holds the first 256 tokens already."""
    from kvcache.pd.cluster import check_request, wait_outcomes
    from kvcache.pd import PDProxy

    with Cluster(layers=3, kv_heads=4, head_dim=32, rows=ROWS) as cluster:
        prefill, decode = (CacheClient(cluster.cfg[role], timeout=CALL_TIMEOUT_S) for role in ("prefill", "decode"))
        proxy = PDProxy(prefill, decode)
        tokens = np.random.default_rng(8).integers(0, 50_000, 700)
        assert run_batch(cluster, proxy, {"seed": tokens[:257]})["problems"] == []
        prefill.reset_prefix_cache()
        reservation = decode.reserve("c", tokens)
        assert reservation.num_cached_tokens == 256
        prefill.admit("c", tokens, num_tokens=200, dest=reservation.dest(decode.endpoint))
        table = lambda: np.asarray(prefill.table("c")).copy()  # noqa: E731
        cluster.step([("c", tokens, table(), 0, 200, False)])
        prefill.extend("c", tokens[200:450])
        cluster.step([("c", tokens, table(), 200, 450, False)])
        prefill.extend("c", tokens[450:])
        whole = table()
        assert (whole[:2, 1:20] == -1).all()  # the window heads recycled behind each chunk
        cluster.step([("c", tokens, whole, 450, 700, True)])
        ready, failed = wait_outcomes(decode, {"c"}, 10)
        sent, _ = wait_outcomes(prefill, {"c"}, 10)
        assert set(ready) == set(sent) == {"c"}, failed
        assert check_request(cluster, tokens, np.asarray(reservation.table), whole, 16) == []
        decode.free("c")
        nothing_held(prefill, decode)


def test_a_prefill_daemon_refuses_a_destination_table_of_another_row_layout(daemon):
    from kvcache.client import DaemonError

    head_wise = daemon("--num-blocks", "64", "--block-size", "16", "--role", "prefill", "--rows", ROWS)
    uniform = daemon("--num-blocks", "64", "--block-size", "16", "--role", "prefill")
    dest = {"receivers": ["tcp://127.0.0.1:1"], "cached": 0, "decode": "ipc:///x"}
    with CacheClient(head_wise.endpoint) as c:
        rows = [{k: v for k, v in row.items() if k != "num_blocks"} for row in c.info()["rows"]]
        with pytest.raises(DaemonError, match=r"dest.table: must be the decode side's int table \[4, blocks\]"):
            c.admit("a", np.arange(40), dest={**dest, "rows": rows, "table": np.zeros((1, 3), np.int32)})
        holes = np.array([[0, -1, 2]] * 2 + [[0, 1, 2]] * 2, np.int32)
        with pytest.raises(DaemonError, match=r"dest.rows: missing; this daemon has 4 rows"):
            c.admit("b", np.arange(40), dest={**dest, "table": holes})
        assert c.admit("b", np.arange(40), dest={**dest, "rows": rows, "table": holes}) is not None
        assert c.stats()["in_transfer"] == 1 and c.usage.max == 3 / 64
    with CacheClient(uniform.endpoint) as c:
        with pytest.raises(DaemonError, match=r"dest.table: block ids must be in \[0, 2\*\*31\)"):
            c.admit("a", np.arange(40), dest={**dest, "table": np.array([[0, -1, 2]], np.int32)})
        assert c.usage.max == 0.0


# FastDeploy's head-wise window: half of each TP rank's query heads (its last ones) keep a 32-token window on the
# odd layers. One rank windows kv heads 2 and 3; two ranks window kv head 1 (rank 0's last) and 3 (rank 1's).
FASTDEPLOY_HEAD_WISE = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
                        "sliding_window": 32, "window_attn_skip_freq": 2, "head_wise_swa_ratio": 0.5}


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1)])
def test_a_prefill_admit_refuses_a_decode_daemon_whose_head_wise_rows_hold_other_kv_heads(
        daemon, tmp_path, prefill_tp, decode_tp):
    """Both daemons serve the same FastDeploy config with --head-wise at different TP sizes: as many rows, but
    not the same kv heads in each. The prefill admit names the first row that differs and changes nothing; at
    one TP size the same destination is taken."""
    from kvcache.client import DaemonError

    config = tmp_path / "config.json"
    config.write_text(json.dumps(FASTDEPLOY_HEAD_WISE))

    def serve(role: str, tp: int):
        return daemon("--num-blocks", "64", "--block-size", "16", "--role", role, "--tp", str(tp),
                      "--model", str(config), "--head-wise")

    prefill, decode, same = serve("prefill", prefill_tp), serve("decode", decode_tp), serve("prefill", decode_tp)
    with CacheClient(prefill.endpoint) as p, CacheClient(decode.endpoint) as d, CacheClient(same.endpoint) as s:
        assert p.info()["num_rows"] == d.info()["num_rows"] == 6
        for rank in range(decode_tp):
            d.attach(rank, f"tcp://127.0.0.1:{rank + 1}")
        reservation = d.reserve("a", np.arange(40))
        heads = {1: "(0, 1, 2, 3)", 2: "(0, 2)"}  # row 1 is kv head 1's full row: all layers at TP 1, even at TP 2
        with pytest.raises(DaemonError, match=re.escape(
                "ops[0].dest: the decode daemon's rows differ from this daemon's: row 1 holds "
                f"layers {heads[decode_tp]}, kv heads (1,) there; layers {heads[prefill_tp]}, kv heads (1,) here")):
            p.admit("a", np.arange(40), dest=reservation.dest(decode.endpoint))
        assert p.usage.max == 0.0 and p.stats()["in_transfer"] == 0 and p.lookup(np.arange(40)) == 0
        p.check_integrity()
        assert s.admit("a", np.arange(40), dest=reservation.dest(decode.endpoint)) is not None
        assert s.stats()["in_transfer"] == 1

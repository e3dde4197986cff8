"""The messager writes a request only into decode ranks whose cache holds the same rows as its own.

A prefill daemon refuses a destination whose rows differ (``check_same_rows``), but a plan can reach a messager
without that check (a scheduler hands plans to its workers with the step). The messager compares each decode
rank's rows, as the rank's region describes them in its NIXL hello, with its own cache's, and fails the request
naming the first row that differs, before it writes a byte. Real `kvcache serve` daemons, real workers, real NIXL.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from kvcache.client import CacheClient
from kvcache.pd.cluster import Cluster, table_of, wait_outcomes
from kvcache.transfer.nixl import nixl_available

from test_pd_headwise import FASTDEPLOY_HEAD_WISE

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pip install nixl-cu12 --no-deps)")


def test_a_forged_plan_into_a_decode_rank_of_other_head_wise_rows_fails_naming_the_first_row_and_writes_nothing():
    """FastDeploy's head-wise window at prefill TP 2 and decode TP 1: as many rows, but kv head 1's rows hold other
    layers. A plan built by hand (a decode reservation, a plain prefill admit) goes to the prefill workers with the
    step: both ranks fail it with one line naming row 1, the decode node hears of it, and no decode block changes."""
    with Cluster(model=FASTDEPLOY_HEAD_WISE, head_wise=True, prefill_tp=2, decode_tp=1, num_blocks=128,
                 timeout=10.0) as cluster:
        prefill = CacheClient(cluster.cfg["prefill"], timeout=10)
        decode = CacheClient(cluster.cfg["decode"], timeout=10)
        tokens = np.random.default_rng(3).integers(0, 50_000, 200)
        reservation = decode.reserve("forged", tokens)
        admission = prefill.admit("forged", tokens)  # no dest: the daemon's row check never runs
        assert reservation is not None and admission is not None
        plan = {"req": "forged", "src_table": np.asarray(admission.table), "table": np.asarray(reservation.table),
                "first_block": 0, "receivers": list(reservation.receivers), "deadline_s": 10.0,
                "decode": cluster.cfg["decode"]}
        dst = np.asarray(reservation.table)
        before = cluster.read(cluster.decode_workers, dst)
        cluster.step([("forged", tokens, table_of(admission), 0)], plans={"forged": plan})
        done, failed = wait_outcomes(decode, {"forged"}, 20)
        assert not done and set(failed) == {"forged"}, (done, failed)
        assert re.fullmatch(
            r"prefill rank [01]: decode rank 0 at tcp://\S+: its cache's rows differ from this prefill rank's: "
            + re.escape("row 1 holds layers (0, 1, 2, 3), kv heads (1,) there; layers (0, 2), kv heads (1,) here"),
            failed["forged"]), failed["forged"]
        after = cluster.read(cluster.decode_workers, dst)
        assert all(np.array_equal(a, b) for a, b in zip(before, after))  # not a byte written
        assert [w.call("posted", "forged") for w in cluster.prefill_workers] == [0, 0]
        prefill.free("forged")
        assert (prefill.usage.max, decode.usage.max) == (0.0, 0.0)
        prefill.check_integrity()
        decode.check_integrity()

"""Leases in a real daemon: a silent scheduler's requests are freed and reported; reclaim keeps them."""
from __future__ import annotations

import time

import numpy as np

from kvcache.client import CacheClient
from kvcache.worker import TableSubscriber

FLAGS = ("--num-blocks", "64", "--block-size", "4", "--lease-timeout", "0.5")


def test_a_silent_scheduler_loses_its_requests_and_workers_see_them_freed(daemon):
    d = daemon(*FLAGS)
    with CacheClient(d.endpoint, name="steady") as steady:
        steady.admit("s", np.arange(5))
        silent = CacheClient(d.endpoint, name="silent")
        silent.admit("x1", np.arange(9))
        silent.admit("x2", np.arange(9) + 100)
        silent.close()
        sub = TableSubscriber(d.endpoint, max_slots=8, max_blocks=8)
        assert set(sub.requests) == {"s", "x1", "x2"}
        deadline = time.monotonic() + 5
        while steady.stats()["num_requests"] != 1:  # steady's messages keep its own lease alive
            assert time.monotonic() < deadline, "the silent scheduler's lease never expired"
            time.sleep(0.1)
        stats = steady.stats()
        assert stats["expired_requests"] == 2
        sub.wait_for(steady.last_seq, epoch=steady.last_epoch)
        assert set(sub.requests) == {"s"}
        assert steady.num_free_blocks.tolist() == [64 - 2]
        steady.check_integrity()
        sub.close()
    assert "lease of scheduler 'silent' expired" in d.log()


def test_a_restarted_scheduler_resumes_by_name_or_reclaims_by_id(daemon):
    d = daemon(*FLAGS)
    first = CacheClient(d.endpoint, name="sched-1")
    first.admit("a", np.arange(9))
    first.admit("b", np.arange(9) + 50)
    first.close()
    again = CacheClient(d.endpoint, name="sched-1")     # same name: it still owns them
    assert sorted(again.owned()) == ["a", "b"]
    other = CacheClient(d.endpoint, name="sched-2")     # a new name takes one over by id
    assert other.reclaim(["a", "zz"]) == ["a"]
    assert again.owned() == ["b"] and other.owned() == ["a"]
    for _ in range(12):                                  # both keep talking for longer than the timeout
        again.ping()
        other.ping()
        time.sleep(0.1)
    assert other.stats()["num_requests"] == 2
    again.close()
    other.close()


def test_an_expired_lease_stays_expired_after_kill_9_and_live_leases_survive(daemon, tmp_path):
    """The expiry is journaled like any free: a crash after it neither revives the silent scheduler's
    requests nor drops the ones of a scheduler that kept talking."""
    flags = (*FLAGS, "--journal", str(tmp_path / "journal"))
    d = daemon(*flags)
    with CacheClient(d.endpoint, name="steady") as steady:
        kept = steady.admit("s", np.arange(5))
        silent = CacheClient(d.endpoint, name="silent")
        silent.admit("x1", np.arange(9))
        silent.close()
        deadline = time.monotonic() + 5
        while steady.stats()["num_requests"] != 1:
            assert time.monotonic() < deadline, "the silent scheduler's lease never expired"
            time.sleep(0.1)
    d.kill()
    d = daemon(*flags, folder=d.folder)
    with CacheClient(d.endpoint, name="steady") as steady:
        stats = steady.stats()
        assert stats["num_requests"] == 1 and steady.owned() == ["s"]
        assert np.array_equal(steady.table("s"), kept.table)
        assert steady.num_free_blocks.tolist() == [64 - 2]
        steady.check_integrity()
        assert steady.extend("s", [7, 7, 7, 7]) is not None  # the survivor goes on

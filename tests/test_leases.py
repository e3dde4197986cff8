"""Leases: owners of requests, silence past the timeout, reclaiming by id."""
from __future__ import annotations


from kvcache.durability import STATE_CODEC
from kvcache.leases import Leases


def test_a_silent_owner_expires_with_its_requests_and_a_talking_one_does_not():
    leases = Leases(timeout=2.0)
    leases.touch("a", 0.0)
    leases.touch("b", 0.0)
    for rid in ("a1", "a2"):
        leases.own("a", rid)
    leases.own("b", "b1")
    leases.touch("b", 1.5)
    assert leases.expired(2.0) == []
    assert leases.expired(2.5) == [("a", ["a1", "a2"])]
    leases.touch("b", 3.0)
    assert leases.expired(4.4) == [("a", ["a1", "a2"])]


def test_an_owner_with_nothing_live_never_expires():
    leases = Leases(timeout=1.0)
    leases.touch("a", 0.0)
    leases.own("a", "r")
    leases.release("r")
    assert leases.expired(10.0) == [] and leases.owned("a") == []


def test_reclaim_moves_live_requests_to_the_new_owner():
    leases = Leases(timeout=1.0)
    leases.touch("old", 0.0)
    leases.own("old", "r1")
    leases.own("old", "r2")
    assert leases.reclaim("new", ["r1", "gone"], now=5.0) == ["r1"]
    assert leases.owner("r1") == "new" and leases.owned("old") == ["r2"]
    assert leases.expired(5.5) == [("old", ["r2"])]


def test_zero_timeout_turns_expiry_off():
    leases = Leases(timeout=0)
    leases.touch("a", 0.0)
    leases.own("a", "r")
    assert leases.expired(1e9) == []


def test_a_snapshot_keeps_owners_but_restarts_every_clock():
    leases = Leases(timeout=1.0)
    leases.touch("a", 0.0)
    leases.own("a", "r")
    restored = STATE_CODEC.loads(STATE_CODEC.dumps(leases))
    assert restored.owner("r") == "a"
    assert restored.expired(100.0) == []  # first sight after a restart starts its clock
    assert restored.expired(101.5) == [("a", ["r"])]

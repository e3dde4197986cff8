"""The daemon's state machine driven directly: messages in, replies and staged deltas out, no socket anywhere.

``DaemonState.process`` is what every socket of the daemon calls; these tests
call it with packed messages as a scheduler would send them and read the
replies, the manager and the staged deltas it leaves.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvcache.allocator.manager import KVCacheManager
from kvcache.allocator.swa import Full, Window
from kvcache.config import ServeConfig
from kvcache.daemon_state import DaemonState
from kvcache.durability import Durability
from kvcache.protocol import PROTOCOL_VERSION, pack, unpack

_ids = itertools.count(1)


def make_state(**settings) -> DaemonState:
    """A state machine over a 64-block manager of block size 4: a window row (8 tokens) and a full row."""
    manager = KVCacheManager(64, 4, [Window(8, 4), Full()], hash_seed=b"s")
    return DaemonState(ServeConfig(**settings).resolved(), manager)


def message(ops, *, client: str = "c", request_id: int | None = None) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "client": client, "id": next(_ids) if request_id is None else request_id,
                 "ops": ops})


def send(state: DaemonState, ops, **kwargs) -> dict:
    return unpack(state.process(message(ops, **kwargs)), 1 << 30)


def admit(req, n: int = 10) -> dict:
    return {"op": "admit", "req": req, "tokens": np.arange(n, dtype=np.uint32)}


def published(state: DaemonState) -> list[dict]:
    """The staged deltas, encoded as the daemon does once they are durable."""
    return [unpack(payload, 1 << 30) for _, payload in state.deltas.encode_staged(state.manager.num_rows)]


def test_a_message_applies_its_ops_and_stages_their_table_changes_as_one_delta():
    state = make_state()
    reply = send(state, [admit("a", 10), admit("b", 6)])
    assert reply["ok"] and reply["seq"] == 0 and reply["epoch"] == state.deltas.epoch
    a, b = reply["results"]
    assert (a["slot"], a["num_tokens"], a["table"].shape) == (0, 10, (2, 3))
    assert (b["slot"], b["num_tokens"], b["table"].shape) == (1, 6, (2, 2))
    assert np.array_equal(a["table"], state.manager.table("a")) and np.array_equal(b["table"], state.manager.table("b"))
    (delta,) = published(state)
    changes = delta["changes"]
    assert delta["seq"] == 0 and delta["freed"] == [] and changes["reqs"] == ["a", "b"]
    assert changes["slots"].tolist() == [0, 1] and changes["lens"].tolist() == [3, 2]
    assert changes["offsets"].tolist() == [0, 3, 5] and changes["cols"].tolist() == [0, 1, 2, 0, 1]
    assert np.array_equal(changes["vals"], np.concatenate([a["table"], b["table"]], axis=1))
    assert state.deltas.staged == [] and state.deltas.since(0) == [state.deltas.history[0][1]]
    state.manager.check_integrity()


def test_a_free_of_a_request_changed_in_the_same_message_starts_a_new_delta():
    """Workers apply a delta's frees before its changes: admit-then-free must reach them in that order."""
    state = make_state()
    reply = send(state, [admit("a", 5), {"op": "free", "req": "a"}, admit("b", 3)])
    assert reply["ok"] and reply["seq"] == 1 and reply["results"][1] is True
    first, second = published(state)
    assert (first["seq"], first["changes"]["reqs"], first["freed"]) == (0, ["a"], [])
    assert (second["seq"], second["changes"]["reqs"], second["freed"]) == (1, ["b"], ["a"])
    assert "a" not in state.manager and state.slots.of == {"b": 0}  # a's slot went back and b took it


def test_a_refused_message_changes_nothing():
    """Every op is validated before any applies: a bad op late in a message leaves the earlier ones unapplied."""
    state = make_state()
    send(state, [admit("a", 5)])
    published(state)
    before = (state.manager.num_free_blocks.tolist(), state.manager.num_tokens("a"), state.deltas.seq,
              dict(state.slots.of))
    reply = send(state, [{"op": "extend", "req": "a", "tokens": [1, 2, 3, 4, 5]}, admit("b"), admit("a")])
    assert not reply["ok"] and reply["error"] == "ops[2].req: request 'a' is already admitted"
    assert (state.manager.num_free_blocks.tolist(), state.manager.num_tokens("a"), state.deltas.seq,
            dict(state.slots.of)) == before
    assert "b" not in state.manager and state.deltas.staged == []


def test_a_retried_message_gets_its_kept_reply_and_is_not_applied_again():
    state = make_state()
    payload = message([admit("a", 9)], request_id=7)
    first = state.process(payload)
    assert state.process(payload) == first
    assert len(state.manager) == 1 and state.deltas.seq == 0 and len(state.deltas.staged) == 1
    reused = unpack(state.process(message([admit("b", 9)], request_id=7)), 1 << 20)
    assert not reused["ok"] and reused["error"].startswith("id: request id 7 of client 'c' was answered before for "
                                                           "a different request")
    assert "b" not in state.manager


def test_only_the_daemon_itself_may_send_its_own_ops():
    """tier_expire is the daemon's (protocol.OP_CALLERS): a client's is refused whole, the daemon's own passes."""
    state = make_state()
    refused = send(state, [admit("a", 5), {"op": "tier_expire", "jobs": [0]}])
    assert not refused["ok"]
    assert refused["error"] == ("ops[1].op: tier_expire is the daemon's own op (who may send it: the daemon itself, "
                                "never a client)")
    assert len(state.manager) == 0 and state.deltas.seq == -1
    own = unpack(state.process(message([{"op": "tier_expire", "jobs": [0]}]), own=True), 1 << 20)
    assert own["ok"] and own["results"] == [
        {"error": "tier_expire: this daemon has no host tier (start it with --host-memory)"}]


def test_deltas_past_the_replay_buffer_are_gone_and_since_says_a_snapshot_is_needed():
    state = make_state(replay_buffer=4)
    for i in range(6):
        send(state, [admit(f"r{i}", 3)])
    published(state)
    assert [unpack(p, 1 << 20)["seq"] for p in state.deltas.since(2)] == [2, 3, 4, 5]
    assert state.deltas.since(1) is None  # seq 1 is no longer kept
    assert state.deltas.since(6) == []  # nothing after the last one yet
    snapshot = unpack(state.snapshot(), 1 << 20)
    assert snapshot["seq"] == 5 and sorted(t["req"] for t in snapshot["tables"]) == [f"r{i}" for i in range(6)]


def test_a_restart_of_the_state_from_its_journal_gives_the_same_tables_seq_and_epoch(tmp_path):
    """Durability drives the state machine too: the committed messages replay to the same block ids."""
    folder = str(tmp_path / "journal")
    state = make_state(journal=folder)
    durability = Durability(state)
    durability.open()
    send(state, [admit("a", 10), admit("b", 6)])
    send(state, [{"op": "extend", "req": "a", "tokens": [1, 2, 3]}, {"op": "free", "req": "b"}])
    durability.commit()
    published(state)
    tables, seq, epoch = {r: state.manager.table(r).copy() for r in ("a",)}, state.deltas.seq, state.deltas.epoch
    durability.close()

    again = make_state(journal=folder)
    assert again.deltas.epoch != epoch  # a new incarnation, until its journal says otherwise
    recovered = Durability(again)
    recovered.open()
    try:
        assert (again.deltas.seq, again.deltas.epoch) == (seq, epoch)
        assert list(again.slots.of) == ["a"] and np.array_equal(again.manager.table("a"), tables["a"])
        assert again.manager.num_tokens("a") == 13
        assert [unpack(p, 1 << 20)["seq"] for p in again.deltas.since(0)] == [0, 1]  # kept for replay, not resent
        again.manager.check_integrity()
    finally:
        recovered.close()


@pytest.mark.parametrize("field, value, error", [
    ("tokens", [], "ops[0].tokens: must hold at least one token"),
    ("req", 1.5, "ops[0].req"),
])
def test_a_malformed_admit_names_its_field(field, value, error):
    state = make_state()
    op = {**admit("a", 4), field: value}
    reply = send(state, [op])
    assert not reply["ok"] and reply["error"].startswith(error)
    assert len(state.manager) == 0 and state.deltas.seq == -1

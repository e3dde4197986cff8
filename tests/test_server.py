"""The daemon's message handling: validation before any change, dedupe of retries, slots, deltas, replay."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from typing import Iterator

import numpy as np
import pytest
import zmq

from kvcache.allocator import Full, KVCacheError, KVCacheManager, Window
from kvcache.config import ServeConfig, derive_endpoints, parse_rows
from kvcache.protocol import PROTOCOL_VERSION, ProtocolError, pack, seq_frame, unpack
from kvcache.server import CacheServer


@pytest.fixture
def server(tmp_path):
    rows = [Window(8, 4), Full()]
    manager = KVCacheManager(64, 4, rows, hash_seed=b"s")
    srv = CacheServer(ServeConfig(endpoint=f"ipc://{tmp_path}/k.sock", replay_buffer=4), manager)
    yield srv
    srv.close()


def call(server: CacheServer, ops, request_id: int = 1, client: str = "c") -> dict:
    return unpack(server.handle(pack({"v": PROTOCOL_VERSION, "client": client, "id": request_id, "ops": ops})),
                  1 << 30)


def admit(req, n=10, **extra):
    return {"op": "admit", "req": req, "tokens": np.arange(n, dtype=np.uint32), **extra}


def test_a_step_applies_every_op_and_returns_results_in_order(server):
    reply = call(server, [admit("a"), admit("b", 6), {"op": "extend", "req": "a", "tokens": [1, 2, 3]},
                          {"op": "free", "req": "b"}, {"op": "ping"}])
    assert reply["ok"] and reply["seq"] == 1  # b was admitted, then freed: two deltas keep that order
    first, second, ext, freed, pong = reply["results"]
    assert first["table"].shape == (2, 3) and first["slot"] == 0 and second["slot"] == 1
    assert ext["len"] == 4 and ext["cols"].tolist() == [3]
    assert freed is True and pong == "pong"
    assert "b" not in server.manager and server.manager.num_tokens("a") == 13


def test_a_bad_op_anywhere_rejects_the_whole_message(server):
    before = server.manager.num_free_blocks.copy()
    reply = call(server, [admit("a"), {"op": "extend", "req": "a", "tokens": [1, -5]}])
    assert not reply["ok"]
    assert reply["error"] == "ops[1].tokens: token id -5 is outside [0, 2**32)"
    assert "a" not in server.manager
    assert server.manager.num_free_blocks.tolist() == before.tolist()


@pytest.mark.parametrize(
    "ops, message",
    [
        ([{"op": "extend", "req": "zz", "tokens": [1]}], "ops[0].req: request 'zz' is not admitted"),
        ([admit("a"), admit("a")], "ops[1].req: request 'a' is already admitted"),
        ([admit("a"), {"op": "free", "req": "a"}, {"op": "free", "req": "a"}], "ops[2].req"),
        ([{"op": "admit", "req": 1.5, "tokens": [1]}], "ops[0].req: request id must be a str or int"),
        ([{"op": "admit", "req": "x" * 300, "tokens": [1]}], "longer than 256"),
        ([{"op": "admit", "req": "a", "tokens": []}], "at least one token"),
        ([{"op": "admit", "req": "a", "tokens": "abc"}], "ops[0].tokens"),
        ([{"op": "admit", "req": "a", "tokens": [1.0]}], "expected integers"),
        ([{"op": "admit", "req": "a", "tokens": [2**40]}], "outside [0, 2**32)"),
        ([admit("a", num_tokens=11)], "ops[0].num_tokens: 11 is outside [1, 10]"),
        ([admit("a", slot=-1)], "ops[0].slot"),
        ([admit("a", slot=3), admit("b", slot=3)], "ops[1].slot: slot 3 is in use"),
        ([admit("a", salt=7)], "ops[0].salt"),
        ([admit("a", mm=[["img", 0]])], "ops[0].mm[0]"),
        ([{"op": "explode"}], "ops[0].op: unknown operation 'explode'"),
        ([{"op": "x" * 10_000}], "ops[0].op: unknown operation 'xxxxxxxxxxxxxxxxxxxxxxxxxxx...xxx"),
        ([{"op": [[[[[[[[["deep"]]]]]]]]]}], "ops[0].op: must be a str, got list"),
        (["admit"], "ops[0]: must be a map"),
        ([{"op": "can_admit", "num_tokens": -1}], "ops[0].num_tokens"),
    ],
)
def test_malformed_ops_get_an_error_naming_the_field_and_change_nothing(server, ops, message):
    call(server, [admit("keep")], request_id=99)
    before = (server.manager.num_free_blocks.tolist(), len(server.manager), server.state.deltas.seq)
    reply = call(server, ops)
    assert not reply["ok"] and message in reply["error"]
    assert (server.manager.num_free_blocks.tolist(), len(server.manager), server.state.deltas.seq) == before


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\xc1", "not valid msgpack"),
        (b"\x92\x01", "not valid msgpack"),
        (pack([1, 2]), "must be a map"),
        (pack({"v": 99, "id": 1, "ops": []}), "protocol version 99"),
        (pack({"v": 1, "id": 1, "ops": []}), "protocol version 1 is not supported (expected 2)"),
        (pack({"v": 2.0, "id": 1, "ops": []}), "protocol version 2.0 is not supported"),
        (pack({"v": np.array([2]), "id": 1, "ops": []}), "protocol version array([2]"),
        (pack({"v": PROTOCOL_VERSION, "id": "x", "ops": []}), "id: must be an integer"),
        (pack({"v": PROTOCOL_VERSION, "id": 1, "ops": {}}), "ops: must be a list"),
        (pack({"v": PROTOCOL_VERSION, "id": 1, "ops": [], "client": 5}), "client"),
        (b"\xc7\x03\x01\x01\x01\x01", "array"),
    ],
)
def test_undecodable_messages_get_an_error_reply(server, payload, message):
    reply = unpack(server.handle(payload), 1 << 20)
    assert reply["ok"] is False and message in reply["error"]


def test_oversized_messages_are_refused_before_decoding(tmp_path):
    manager = KVCacheManager(8, 4)
    srv = CacheServer(ServeConfig(endpoint=f"ipc://{tmp_path}/k.sock", max_message_bytes=100), manager)
    try:
        reply = unpack(srv.handle(b"\x00" * 101), 1 << 20)
        assert "101 bytes exceeds the limit of 100" in reply["error"]
    finally:
        srv.close()


def test_a_retried_request_is_answered_once_not_applied_twice(server):
    payload = pack({"v": PROTOCOL_VERSION, "client": "c", "id": 7, "ops": [admit("a")]})
    first = server.handle(payload)
    assert server.handle(payload) == first
    assert len(server.manager) == 1 and server.state.deltas.seq == 0
    other_client = call(server, [admit("a")], request_id=7, client="other")
    assert not other_client["ok"] and "already admitted" in other_client["error"]


def test_named_slots_are_kept_and_free_slots_reused_lowest_first(server):
    reply = call(server, [admit("a", slot=5), admit("b"), admit("c")])
    assert [r["slot"] for r in reply["results"]] == [5, 0, 1]
    call(server, [{"op": "free", "req": "b"}], request_id=2)
    assert call(server, [admit("d")], request_id=3)["results"][0]["slot"] == 0


def test_no_room_is_a_none_result_not_an_error(server):
    reply = call(server, [admit("big", 64 * 4 + 1), admit("small", 3)])
    assert reply["ok"] and reply["results"][0] is None and reply["results"][1]["slot"] == 0


def test_an_op_on_a_request_whose_admit_found_no_room_fails_alone(server):
    reply = call(server, [admit("big", 64 * 4 + 1), {"op": "extend", "req": "big", "tokens": [1]}, {"op": "ping"}])
    assert reply["results"][0] is None
    assert "not admitted" in reply["results"][1]["error"]
    assert reply["results"][2] == "pong"


def _drain(sock: zmq.Socket, timeout_ms: int = 2000) -> list[list[bytes]]:
    out = []
    while sock.poll(timeout_ms if not out else 50):
        out.append(sock.recv_multipart())
    return out


@contextlib.contextmanager
def _joined_subscriber(server: CacheServer) -> Iterator[zmq.Socket]:
    """A SUB on the daemon's deltas that has surely joined (PUB/SUB joins asynchronously), drained."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"T")
    sub.connect(server.config.pub_endpoint)
    try:
        for i in range(200):  # publish until the first message arrives
            call(server, [{"op": "ping"}, admit(f"warm{i}", 1)], request_id=1000 + i)
            if sub.poll(10):
                break
        last = seq_frame(server.state.deltas.seq)
        while sub.poll(5000) and sub.recv_multipart()[1] != last:  # drain through the last warm-up delta
            pass
        yield sub
    finally:
        sub.close(0)


def test_deltas_are_published_with_contiguous_sequence_numbers(server):
    with _joined_subscriber(server) as sub:
        start = server.state.deltas.seq
        call(server, [admit("a", 9)], request_id=1)
        call(server, [{"op": "extend", "req": "a", "tokens": [1, 2, 3, 4]}], request_id=2)
        call(server, [{"op": "free", "req": "a"}], request_id=3)
        messages = _drain(sub)
        seqs = [int.from_bytes(m[1], "big", signed=True) for m in messages]
        assert seqs == [start + 1, start + 2, start + 3]
        bodies = [unpack(m[2], 1 << 20) for m in messages]
        assert bodies[0]["changes"]["reqs"] == ["a"] and bodies[0]["changes"]["cols"].tolist() == [0, 1, 2]
        assert bodies[1]["changes"]["cols"].tolist() == [3] and bodies[1]["changes"]["lens"].tolist() == [4]
        assert bodies[2]["freed"] == ["a"] and bodies[2]["changes"]["reqs"] == []
        assert bodies[2]["changes"]["vals"].shape == (2, 0)


def test_a_delta_holds_every_change_of_a_message_in_compressed_rows(server):
    """Change k of a delta: reqs[k] at slots[k], lens[k] wide, columns offsets[k]:offsets[k+1] of cols and vals."""
    b_blocks = call(server, [admit("a", 3), admit("b", 4)], request_id=1)["results"][1]["table"][:, 0].tolist()
    with _joined_subscriber(server) as sub:  # its warm-up admits take a timing-dependent number of blocks
        call(server, [{"op": "free", "req": "b"}, admit("c", 9),
                      {"op": "extend_many", "reqs": ["a", "c"], "tokens": np.array([1, 2, 3, 4, 5, 6]),
                       "counts": np.array([2, 4])}], request_id=2)
        (message,) = _drain(sub)
        delta = unpack(message[2], 1 << 20)
        changes = delta["changes"]
        assert delta["freed"] == ["b"] and changes["reqs"] == ["c", "a", "c"]
        assert changes["slots"].tolist() == [1, 0, 1] and changes["lens"].tolist() == [3, 2, 4]
        assert changes["offsets"].tolist() == [0, 3, 4, 5] and changes["cols"].tolist() == [0, 1, 2, 1, 3]
        a, c = server.manager.table("a"), server.manager.table("c")
        # c's admit (its first block is b's, cached), a's new block, c's new block
        assert np.array_equal(changes["vals"], np.concatenate([c[:, :3], a[:, 1:2], c[:, 3:4]], axis=1))
        assert changes["vals"][:, 0].tolist() == b_blocks and len(set(changes["vals"][0].tolist())) == 5


def test_a_delta_is_stamped_when_sent_not_when_staged(server):
    """A delta's t is CLOCK_MONOTONIC at its send: one staged, then held (journal commit), gets the later time."""
    with _joined_subscriber(server) as sub:
        server.state.process(pack({"v": PROTOCOL_VERSION, "client": "c", "id": 1, "ops": [admit("a")]}))
        time.sleep(0.05)
        before_send = time.monotonic_ns()
        server.durability.commit()
        server._publish_staged()
        (message,) = _drain(sub)
        assert before_send <= unpack(message[2], 1 << 20)["t"] <= time.monotonic_ns()


def test_deltas_encoded_after_the_turn_carry_each_message_s_own_tables(server):
    """A turn's deltas are encoded once its messages are applied and answered: each still holds its own
    message's tables, not what a later message of the turn made of them (a wider table, a window's -1)."""
    state = server.state
    with _joined_subscriber(server) as sub:
        first = unpack(state.process(pack({"v": PROTOCOL_VERSION, "client": "c", "id": 1, "ops": [admit("a")]})),
                       1 << 20)
        admitted = first["results"][0]["table"].copy()
        grow = [{"op": "extend", "req": "a", "tokens": np.arange(30, dtype=np.uint32)},
                {"op": "extend", "req": "a", "tokens": [7]}]  # the window row now gives its first blocks back
        second = unpack(state.process(pack({"v": PROTOCOL_VERSION, "client": "c", "id": 2, "ops": grow})), 1 << 20)
        assert not state.deltas.history or state.deltas.history[-1][0] < first["seq"]  # staged, not yet encoded
        server.durability.commit()
        server._publish_staged()
        deltas = [unpack(m[2], 1 << 20) for m in _drain(sub)]
    assert [d["seq"] for d in deltas] == [first["seq"], second["seq"]]
    assert deltas[0]["changes"]["vals"].tolist() == admitted.tolist()
    changes = deltas[1]["changes"]
    assert changes["reqs"] == ["a", "a"]
    for k, result in enumerate(second["results"]):
        a, b = changes["offsets"][k], changes["offsets"][k + 1]
        assert changes["cols"][a:b].tolist() == result["cols"].tolist()
        assert changes["vals"][:, a:b].tolist() == result["vals"].tolist()
    assert (server.manager.table("a")[0] == -1).any() and (admitted >= 0).all()  # the window did give back


def _replay(server: CacheServer, start: int) -> list[bytes]:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(server.config.replay_endpoint)
    try:
        dealer.send(pack({"v": PROTOCOL_VERSION, "from": start}))
        for _ in range(100):
            server.endpoints.handle_replay()
            if dealer.poll(20):
                return dealer.recv_multipart()
        raise AssertionError("no replay answer")
    finally:
        dealer.close(0)


def test_replay_returns_buffered_deltas_then_a_snapshot_when_they_are_gone(server):
    for i in range(3):
        call(server, [admit(f"r{i}", 5)], request_id=i)
    kind, *payloads = _replay(server, 1)
    assert kind == b"D" and [unpack(p, 1 << 20)["seq"] for p in payloads] == [1, 2]
    for i in range(3, 8):
        call(server, [admit(f"r{i}", 5)], request_id=i)
    kind, payload = _replay(server, 0)  # only the last 4 deltas are kept
    snap = unpack(payload, 1 << 20)
    assert kind == b"S" and snap["seq"] == 7
    assert sorted(t["req"] for t in snap["tables"]) == [f"r{i}" for i in range(8)]
    assert all(np.array_equal(t["table"], server.manager.table(t["req"])) for t in snap["tables"])
    assert _replay(server, 8) == [b"D"]


def test_a_journal_written_by_protocol_1_still_replays(tmp_path):
    """Requests did not change in protocol 2: a restart replays version-1 records; live ones are refused."""
    from kvcache.journal import Journal

    def start() -> CacheServer:
        rows = [Window(8, 4), Full()]
        return CacheServer(ServeConfig(endpoint=f"ipc://{tmp_path}/k.sock", journal=str(tmp_path / "journal")),
                           KVCacheManager(64, 4, rows, hash_seed=b"s"))

    start().close()  # a new journal: its snapshot
    journal = Journal(tmp_path / "journal")
    journal.open()
    journal.append(pack({"v": 1, "client": "old", "id": 1, "ops": [admit("a")]}))
    journal.commit()
    journal.close()
    srv = start()
    try:
        assert srv.manager.num_tokens("a") == 10 and srv.state.deltas.seq == 0
        assert "protocol version 1" in unpack(srv.handle(pack({"v": 1, "client": "old", "id": 2, "ops": []})),
                                              1 << 20)["error"]
    finally:
        srv.close()


def test_config_helpers():
    assert derive_endpoints("tcp://127.0.0.1:5555")["replay_endpoint"] == "tcp://127.0.0.1:5557"
    assert derive_endpoints("ipc:///run/k.sock")["pub_endpoint"] == "ipc:///run/k-pub.sock"
    assert parse_rows("window:4096:64*6,full*2") == [Window(4096, 64)] * 6 + [Full()] * 2
    assert parse_rows("full", 4) == [Full()] * 4
    for bad in ("window", "window:x", "full*0", "sliding"):
        with pytest.raises(Exception, match="rows"):
            parse_rows(bad)
    for bad in (0, 65):
        with pytest.raises(KVCacheError, match=r"io_threads: must be an integer in \[1, 64\]"):
            ServeConfig(io_threads=bad)
    for bad in (True, 2.0):
        with pytest.raises(KVCacheError, match=r"io_threads: must be an integer, got"):
            ServeConfig(io_threads=bad)
    assert ServeConfig(io_threads=4).io_threads == 4


def test_a_daemon_with_several_io_threads_serves_and_publishes(daemon):
    """`kvcache serve --io-threads 3`: a step's reply and its delta both arrive, and the daemon stops cleanly."""
    from kvcache.client import CacheClient
    from kvcache.worker import TableSubscriber

    d = daemon("--num-blocks", "64", "--block-size", "16", "--io-threads", "3")
    with CacheClient(d.endpoint) as c:
        sub = TableSubscriber(d.endpoint, timeout=10)
        try:
            c.admit("a", np.arange(40))
            sub.wait_for(c.last_seq, timeout=10)
            assert np.array_equal(sub.table("a"), c.table("a"))
        finally:
            sub.close()
    d.stop()
    assert d.process.returncode == 0, d.log()


def test_protocol_errors_are_the_package_error():
    with pytest.raises(ProtocolError):
        unpack(b"\xc1", 10)


def test_extend_many_reports_lengths_and_only_changed_tables(server):
    """Changed request index[k] set cols[offsets[k]:offsets[k+1]] to those columns of vals; the rest did not change."""
    call(server, [admit("a", 3), admit("b", 4)], request_id=1)
    reply = call(server, [{"op": "extend_many", "reqs": ["a", "b", "a"], "tokens": np.array([1, 2, 3, 4]),
                           "counts": np.array([1, 2, 1])}], request_id=2)
    result = reply["results"][0]
    assert result["lens"].tolist() == [1, 2, 2]
    changed = result["changed"]
    assert changed["index"].tolist() == [1, 2] and changed["offsets"].tolist() == [0, 1, 2]
    assert changed["cols"].tolist() == [1, 1]
    assert changed["vals"].tolist() == [[server.manager.table("b")[0, 1], server.manager.table("a")[0, 1]],
                                        [server.manager.table("b")[1, 1], server.manager.table("a")[1, 1]]]


def test_extend_many_without_changes_sends_empty_rows(server):
    call(server, [admit("a", 3)], request_id=1)
    result = call(server, [{"op": "extend_many", "reqs": ["a"], "tokens": np.array([], dtype=np.int64),
                            "counts": np.array([0])}], request_id=2)["results"][0]
    assert result["lens"].tolist() == [1] and result["changed"]["index"].tolist() == []
    assert result["changed"]["offsets"].tolist() == [0] and result["changed"]["vals"].shape == (2, 0)


def test_extend_many_sees_the_frees_and_admits_earlier_in_its_message(server):
    """Liveness is checked in op order: a request freed earlier is refused, one admitted earlier is extended."""
    call(server, [admit("a", 3), admit("b", 3)], request_id=1)
    refused = call(server, [{"op": "free", "req": "b"},
                            {"op": "extend_many", "reqs": ["a", "b"], "tokens": np.array([1, 2]),
                             "counts": np.array([1, 1])}], request_id=2)
    assert refused["error"] == "ops[1].reqs[1]: request 'b' is not admitted"
    reply = call(server, [admit("c", 3), {"op": "extend_many", "reqs": ["a", "c"], "tokens": np.array([1, 2]),
                                          "counts": np.array([1, 1])}], request_id=3)
    assert reply["ok"] and reply["results"][1]["lens"].tolist() == [1, 1]


@pytest.fixture
def one_row_server(tmp_path, request):
    """A uniform daemon (one row): its decode steps take the manager's one C pass, with the rows validation found."""
    rows = [Full()]
    srv = CacheServer(ServeConfig(endpoint=f"ipc://{tmp_path}/k.sock", role=getattr(request, "param", "both")),
                      KVCacheManager(64, 4, rows, hash_seed=b"s"))
    yield srv
    srv.close()


def test_rows_found_at_validation_still_hold_when_the_extend_many_applies(one_row_server, monkeypatch):
    """"c" is freed and "d" admitted into its manager row before the extend; "b" is freed and admitted again in
    between and extended as the new request. The decode pass gets the rows validation found for "a" and "x" (not
    for a message that re-admits an id it names)."""
    from kvcache.allocator import _tables

    given: list[bool] = []
    real = _tables.extend_decode
    monkeypatch.setattr(_tables, "extend_decode", lambda first, *rest: given.append(not isinstance(first, dict))
                        or real(first, *rest))
    server = one_row_server
    m = server.manager
    call(server, [admit("a", 3), admit("b", 3), admit("c", 3), admit("x", 3)], request_id=1)
    row_of_c = m._slot_of["c"]
    reply = call(server, [{"op": "free", "req": "c"}, admit("d", 2),
                          {"op": "extend_many", "reqs": ["a", "x"], "tokens": np.array([7, 8, 9]),
                           "counts": np.array([2, 1])}], request_id=2)
    assert reply["ok"], reply
    assert m._slot_of["d"] == row_of_c and given == [True]
    reply = call(server, [{"op": "free", "req": "b"}, admit("b", 5),
                          {"op": "extend_many", "reqs": ["a", "b"], "tokens": np.array([7, 8, 9]),
                           "counts": np.array([2, 1])}], request_id=3)
    assert reply["ok"], reply
    assert given == [True, False]
    assert [m.num_tokens(r) for r in ("a", "b", "d", "x")] == [7, 6, 2, 4]
    m.check_integrity()


@pytest.mark.parametrize("one_row_server", ["prefill"], indirect=True)
def test_an_extend_many_after_a_pd_op_that_frees_one_of_its_requests_is_refused_alone(one_row_server):
    """A PD op that ends a transfer frees its request when applied, so an extend_many after it in the message gets
    no rows from validation: it finds the request gone, refuses (its own result) and extends nothing, and the admit
    that took the freed row is left as it was."""
    server = one_row_server
    m = server.manager
    dest = {"receivers": ["tcp://127.0.0.1:1"], "table": np.arange(3, dtype=np.int32)[None, :], "cached": 0,
            "decode": "ipc:///nowhere"}
    assert call(server, [admit("a", 9, dest=dest), admit("x", 3), {"op": "attach", "rank": 0, "key": 1}],
                request_id=1)["ok"]
    row_of_a = m._slot_of["a"]
    reply = call(server, [{"op": "sent", "req": "a", "rank": 0, "key": 1}, admit("z", 2),
                          {"op": "extend_many", "reqs": ["x", "a"], "tokens": np.array([7, 8]),
                           "counts": np.array([1, 1])}], request_id=2)
    assert reply["ok"], reply
    assert "error" in reply["results"][2] and "a" not in m._slot_of
    assert m._slot_of["z"] == row_of_a
    assert [m.num_tokens(r) for r in ("x", "z")] == [3, 2]
    m.check_integrity()


@pytest.mark.parametrize(
    "op, message",
    [
        ({"op": "extend_many", "reqs": ["a", "zz"], "tokens": np.array([1, 2]), "counts": np.array([1, 1])},
         "ops[0].reqs[1]: request 'zz' is not admitted"),
        ({"op": "extend_many", "reqs": ["a", True], "tokens": np.array([1, 2]), "counts": np.array([1, 1])},
         "ops[0].reqs[1]: request id must be a str or int, got bool"),
        ({"op": "extend_many", "reqs": ["a", 2**64 - 1], "tokens": np.array([1, 2]), "counts": np.array([1, 1])},
         "ops[0].reqs[1]: request id 18446744073709551615 outside int64"),
        ({"op": "extend_many", "reqs": ["a", [1]], "tokens": np.array([1, 2]), "counts": np.array([1, 1])},
         "ops[0].reqs[1]: request id must be a str or int, got list"),
        ({"op": "extend_many", "reqs": ["a"], "tokens": np.array([1]), "counts": np.array([-1])}, "non-negative"),
        ({"op": "extend_many", "reqs": ["a"] * 4, "tokens": np.zeros(0, np.uint32),
          "counts": np.array([2**62] * 4)}, "sum to the 0 tokens"),  # wraps to 0 in int64
        ({"op": "extend_many", "reqs": ["a"] * 2, "tokens": np.zeros(0, np.uint32),
          "counts": np.array([2**63] * 2, np.uint64)}, "sum to the 0 tokens"),  # wraps to 0 in uint64
        ({"op": "extend_many", "reqs": ["a"], "tokens": np.array([1, 2]), "counts": np.array([1])}, "sum to"),
        ({"op": "extend_many", "reqs": ["a"], "tokens": np.array([1]), "counts": [1]}, "counts: must be"),
        ({"op": "extend_many", "reqs": "a", "tokens": np.array([1]), "counts": np.array([1])}, "reqs: must be"),
    ],
)
def test_malformed_extend_many_changes_nothing(server, op, message):
    call(server, [admit("a", 3)], request_id=1)
    reply = call(server, [op], request_id=2)
    assert not reply["ok"] and message in reply["error"]
    assert server.manager.num_tokens("a") == 3


def test_metrics_count_a_busy_daemons_messages_once_per_interval_and_catch_up(server):
    """Answered messages and published deltas reach the metrics at most every METRICS_INTERVAL_S, in one go;
    a stats op and the serve loop's idle turns flush what is pending, so nothing is lost or counted twice."""
    from test_metrics import scrape, value

    metrics = server.state.metrics
    assert metrics is not None
    ops = lambda s: value(s, "kvcache_operations_total", op="admit") if ("kvcache_operations_total",
                                                                         (("op", "admit"),)) in s else 0
    call(server, [admit("a")], request_id=1)  # the first message: counted at once
    s = scrape(metrics.render())
    assert ops(s) == 1 and value(s, "kvcache_deltas_published_total") == 1
    server.state._next_observe = float("inf")  # inside the interval from here on
    call(server, [admit("b")], request_id=2)
    call(server, [admit("c"), {"op": "free", "req": "a"}], request_id=3)
    s = scrape(metrics.render())
    assert ops(s) == 1 and value(s, "kvcache_step_seconds_count") == 1
    assert value(s, "kvcache_live_requests") == 1  # gauges wait too
    call(server, [{"op": "stats"}], request_id=4)  # stats flushes before it answers
    s = scrape(metrics.render())
    assert ops(s) == 3 and value(s, "kvcache_step_seconds_count") == 3
    assert value(s, "kvcache_deltas_published_total") == 3  # a, b, then c with the free of a
    assert value(s, "kvcache_operations_total", op="free") == 1
    assert value(s, "kvcache_prefix_queries_total") == 3
    call(server, [admit("d")], request_id=5)
    assert ops(scrape(metrics.render())) == 3
    server.state._next_observe = 0.0  # the interval is over: the serve loop's next turn counts it
    server.serve(should_stop=iter([False, True]).__next__, poll_ms=1)
    s = scrape(metrics.render())
    assert ops(s) == 4 and value(s, "kvcache_step_seconds_count") == 5
    assert value(s, "kvcache_live_requests") == 3


def test_lora_travels_as_a_name_or_a_name_and_path_and_anything_else_is_refused(server):
    """On the wire a LoRA is a str or [name, path]; a name alone never hits a (name, path)'s blocks."""
    reply = call(server, [admit("a", 9, lora=["sql", "/v1"]),
                          {"op": "lookup", "tokens": np.arange(9, dtype=np.uint32), "lora": ["sql", "/v1"]},
                          {"op": "lookup", "tokens": np.arange(9, dtype=np.uint32), "lora": ["sql", "/v2"]},
                          {"op": "lookup", "tokens": np.arange(9, dtype=np.uint32), "lora": "sql"}])
    assert reply["ok"] and reply["results"][1:] == [8, 0, 0]
    for bad in (["sql"], ["sql", 3], 7, ["a", "b", "c"]):
        refused = call(server, [admit("b", 9, lora=bad)], request_id=2 + len(str(bad)))
        assert not refused["ok"] and refused["error"].startswith("ops[0].lora: must be a LoRA name or [name, path]")
    assert server.manager.stats().num_requests == 1


def test_a_reservation_with_a_destination_is_refused(tmp_path):
    rows = [Full()]
    srv = CacheServer(ServeConfig(endpoint=f"ipc://{tmp_path}/k.sock", role="decode"), KVCacheManager(64, 4, rows))
    try:
        reply = call(srv, [{"op": "reserve", "req": "a", "tokens": np.arange(9, dtype=np.uint32),
                            "dest": {"receivers": ["x"]}}])
        assert not reply["ok"] and reply["error"].startswith("ops[0].dest: a reservation takes no destination")
    finally:
        srv.close()


def test_an_internal_error_is_answered_with_the_requests_id_and_the_daemon_goes_on(server, monkeypatch):
    """A bug while applying (injected here) gets an error reply the client can match to its request."""
    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(server.manager, "lookup", broken)
    reply = call(server, [{"op": "lookup", "tokens": np.arange(9, dtype=np.uint32)}], request_id=41)
    assert reply["id"] == 41 and not reply["ok"] and reply["error"] == "internal error: RuntimeError: injected"
    monkeypatch.undo()
    assert call(server, [{"op": "ping"}], request_id=42)["results"] == ["pong"]


def test_a_retry_cache_of_no_replies_is_refused():
    with pytest.raises(KVCacheError, match="dedupe_window: must be a positive integer"):
        ServeConfig(dedupe_window=0)


@pytest.mark.parametrize("toml, message", [
    ('num_blocks = "abc"', "num_blocks: must be an integer, got 'abc'"),
    ("events = 1", "events: must be true or false, got 1"),
    ("utilization = true", "utilization: must be a number, got True"),
    ('rows = 7', "rows: must be a string, got 7"),
])
def test_a_wrongly_typed_setting_in_a_config_file_is_one_clear_line(tmp_path, toml, message):
    path = tmp_path / "kvcache.toml"
    path.write_text(f"[serve]\n{toml}\n")
    result = subprocess.run([sys.executable, "-m", "kvcache", "serve", "--config", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and result.stderr == f"kvcache serve: error: {message}\n"


def test_plan_into_a_closed_pipe_exits_quietly():
    """`kvcache plan --json | head -c 1` with the reader gone before the output is written: no traceback."""
    read, write = os.pipe()
    os.close(read)
    result = subprocess.run([sys.executable, "-m", "kvcache", "plan", "--json"], stdout=write, stderr=subprocess.PIPE,
                            text=True, timeout=60)
    os.close(write)
    assert result.returncode == 141 and result.stderr == ""


def test_a_journal_of_other_row_pools_is_refused_naming_row_blocks():
    """Same id space, rows and block size, but the window row's pool differs: the journal's blocks may not exist."""
    from kvcache.durability import check_compatible

    journaled = KVCacheManager(8, 4, [Window(8), Full()], row_blocks=[4, 8], hash_seed=b"s")
    configured = KVCacheManager(8, 4, [Window(8), Full()], row_blocks=[6, 8], hash_seed=b"s")
    with pytest.raises(KVCacheError, match=r"^journal: row_blocks is \[4, 8\] in the journal but \[6, 8\]"):
        check_compatible(journaled, configured, ServeConfig())

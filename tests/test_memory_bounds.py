"""What a peer can make a real `kvcache serve` hold stays within its byte budgets: replies, kept replies, a subscriber
that never reads. Retries are answered once, told from reused ids, and refused once their reply is gone."""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import zmq

from kvcache.protocol import PROTOCOL_VERSION, pack, unpack

MiB = 1 << 20
ALLOWANCE = 48 * MiB  # what the daemon may grow by beyond its budgets: allocator slack, transient copies


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Raw:
    """A scheduler speaking the wire protocol directly, so every id and byte is the test's choice."""

    def __init__(self, endpoint: str, client: str = "raw") -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.client = client
        self.ids = itertools.count(1)

    def payload(self, ops, request_id: int | None = None) -> tuple[int, bytes]:
        request_id = next(self.ids) if request_id is None else request_id
        return request_id, pack({"v": PROTOCOL_VERSION, "client": self.client, "id": request_id, "ops": ops})

    def send(self, payload: bytes, timeout: float = 30.0) -> dict:
        return unpack(self.send_bytes(payload, timeout), 1 << 31)

    def send_bytes(self, payload: bytes, timeout: float = 30.0) -> bytes:
        self.sock.send(payload)
        assert self.sock.poll(int(timeout * 1000)), "no reply"
        return self.sock.recv()

    def call(self, ops, request_id: int | None = None) -> dict:
        return self.send(self.payload(ops, request_id)[1])

    def close(self) -> None:
        self.sock.close(0)


def test_table_replies_are_bounded_and_kept_replies_stay_within_dedupe_bytes(daemon):
    """1,000 tables of a 62,500-block request are refused before anything applies; 25 MB replies are answered but
    not kept past --dedupe-bytes, so the daemon does not grow by what it sent."""
    d = daemon("--num-blocks", "70000", "--block-size", "16", "--max-reply-bytes", str(32 * MiB),
               "--dedupe-bytes", str(16 * MiB), "--local-endpoint", "off")
    raw = Raw(d.endpoint)
    try:
        reply = raw.call([{"op": "admit", "req": "big", "tokens": np.arange(1_000_000, dtype=np.uint32)}])
        assert reply["ok"] and reply["results"][0]["table"].shape == (1, 62_500)
        refused = raw.call([{"op": "table", "req": "big"}] * 1000)
        assert not refused["ok"] and refused["error"].startswith("reply: could take up to 251,")
        assert "--max-reply-bytes" in refused["error"]
        for _ in range(3):  # warm up the allocator with the largest reply
            assert raw.call([{"op": "table", "req": "big"}] * 100)["ok"]
        before = rss(d.process.pid)
        for _ in range(40):  # 40 x 25 MB of replies: 1 GB if every one were kept
            assert len(raw.call([{"op": "table", "req": "big"}] * 100)["results"]) == 100
        grown = rss(d.process.pid) - before
        # Each reply also exists as the socket's copy, freed by ZMQ's I/O thread whenever it is scheduled: in
        # whichever order the two are freed, glibc may keep up to two replies at the top of its heap, untrimmed.
        in_flight = 2 * 100 * 62_500 * 4
        assert grown < 16 * MiB + in_flight + ALLOWANCE, f"the daemon grew by {grown / MiB:.0f} MiB"
    finally:
        raw.close()


def test_a_retry_is_answered_once_a_reused_id_is_refused_and_a_dropped_reply_is_never_applied_again(daemon):
    d = daemon("--num-blocks", "100", "--block-size", "4", "--dedupe-window", "2", "--local-endpoint", "off")
    raw = Raw(d.endpoint)
    try:
        _, first = raw.payload([{"op": "admit", "req": "a", "tokens": np.arange(9, dtype=np.uint32)}], 1)
        answer = raw.send_bytes(first)
        assert unpack(answer, 1 << 20)["ok"] and raw.send_bytes(first) == answer  # a retry: the same answer, once
        reused = raw.call([{"op": "admit", "req": "b", "tokens": np.arange(9, dtype=np.uint32)}], 1)
        assert not reused["ok"] and "request id 1 of client 'raw' was answered before for a different request" in \
            reused["error"]
        for i in range(2, 5):  # the window keeps the last two replies
            assert raw.call([{"op": "ping"}], i)["ok"]
        late = raw.send(first)
        assert not late["ok"] and "retry window passed" in late["error"] and "not applied again" in late["error"]
        stats = raw.call([{"op": "stats"}], 5)["results"][0]
        assert stats["num_requests"] == 1
        assert raw.call([{"op": "free", "req": "a"}], 6)["ok"]
        assert not raw.send(first)["ok"]  # still refused: "a" is not admitted again
        assert raw.call([{"op": "stats"}], 7)["results"][0]["num_requests"] == 0
    finally:
        raw.close()


def test_a_subscriber_that_never_reads_costs_at_most_pub_bytes(daemon):
    """Deltas of 56 KB, 3,000 of them (168 MB), to a SUB that never reads: the daemon holds --pub-bytes of them for
    it (and --replay-bytes for replay, --dedupe-bytes of replies), not all of them."""
    d = daemon("--num-blocks", "8000", "--block-size", "1", "--pub-bytes", str(4 * MiB), "--replay-bytes",
               str(4 * MiB), "--dedupe-bytes", str(MiB), "--local-endpoint", "off", "--no-enable-prefix-caching")
    raw = Raw(d.endpoint)
    info = raw.call([{"op": "info"}])["results"][0]
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(info["pub_endpoint"])
    try:
        # The subscription has reached the PUB once a heartbeat (sent after --heartbeat-ms of silence) arrives.
        assert sub.poll(30_000), "no heartbeat reached the subscriber"
        sub.recv_multipart()
        tokens = np.arange(7_000, dtype=np.uint32)  # a delta of its columns and blocks: 56 KB
        for i in range(50):
            raw.call([{"op": "admit", "req": i, "tokens": tokens}, {"op": "free", "req": i}])
        before = rss(d.process.pid)
        for i in range(50, 3050):
            reply = raw.call([{"op": "admit", "req": i, "tokens": tokens}, {"op": "free", "req": i}])
            assert reply["ok"] and reply["results"][0]["table"].shape == (1, 7_000)
        grown = rss(d.process.pid) - before
        assert grown < 9 * MiB + ALLOWANCE, f"the daemon grew by {grown / MiB:.0f} MiB"
    finally:
        sub.close(0)
        raw.close()

"""KV events: a router written only from vLLM's KV-event format mirrors the manager's prefix index.

The subscriber below knows nothing of kvcache's publisher: it follows vLLM 0.33's
``vllm/distributed/kv_events.py`` field lists and its example subscriber (SUB socket,
``[topic, seq, payload]``, msgpack ``[ts, events, dp_rank]`` with tagged events,
replay over the ROUTER with an end marker of seq -1 and an empty payload), and keeps
one hash set per ``group_idx``. The encoding itself is checked against batches vLLM
0.33 encoded (tests/vectors/vllm-0.33-kv-events.json).
"""
from __future__ import annotations

import itertools
import json
import os
import random
import time
from typing import Callable

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import zmq

from kvcache.allocator import Full, KVCacheManager, Window
from kvcache.allocator.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcache.allocator.prefix import BlockHasher
from kvcache.events import END_SEQ, LIVE_BATCH_BYTES, OLDER_ARRAY_WIRE, EventWire, KVEventPublisher, encode_batch

BS = 4
SEED = b"events-test"
TIMEOUT_S = 5.0

# Field order of vLLM's structs (BlockStored/BlockRemoved, later fields have defaults).
VLLM_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def decode_event(event: list | dict) -> tuple[str, dict]:
    """A msgspec tagged struct: ``[tag, field, ...]`` (array_like) or ``{"type": tag, ...}`` (map)."""
    if isinstance(event, list):
        tag, *values = event
        return tag, dict(zip(VLLM_FIELDS[tag], values))
    fields = dict(event)
    return fields.pop("type"), fields


def low64(digest: bytes) -> int:
    """vLLM's int block hash: the digest's low 64 bits."""
    return int.from_bytes(digest, "big") & (2**64 - 1)


class VLLMRouterIndex:
    """What a KV-aware router keeps: per group, the set of block hashes an engine holds, fed by its KV events."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay_endpoint: str, *,
                 topic: bytes = b"", wire: EventWire = EventWire(), hasher: BlockHasher | None = None,
                 pump: Callable[[], None] = lambda: None) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay = ctx.socket(zmq.DEALER)  # a DEALER receives every reply of a streamed replay
        self.replay.connect(replay_endpoint)
        self.topic = topic
        self.wire = wire
        self.hasher = hasher
        self.pump = pump  # runs the publisher's side while we wait (the daemon's poll loop, in one thread)
        self.hashes: dict[int, set[bytes | int]] = {}  # group_idx -> hashes
        self.kinds: dict[int, tuple[str, int | None]] = {}  # group_idx -> (kv_cache_spec_kind, sliding window)
        self.last_seq = -1
        self.applied: list[tuple[int, str]] = []  # (seq, "live" | "replay")
        self.tags: set[str] = set()
        self.lora_names: set[str | None] = set()

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)

    def sync(self, until_seq: int) -> None:
        """Apply batches up to ``until_seq``: live ones, and replayed ones for any gap or silence."""
        deadline = time.monotonic() + TIMEOUT_S
        while self.last_seq < until_seq:
            assert time.monotonic() < deadline, f"stuck at seq {self.last_seq}, waiting for {until_seq}"
            if not self.sub.poll(50):
                self.fetch_replay(self.last_seq + 1)  # joined late, or the batch never came live
                continue
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == self.topic and len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.last_seq + 1:
                self.fetch_replay(self.last_seq + 1)
            if seq == self.last_seq + 1:
                self.apply(seq, payload, "live")

    def fetch_replay(self, start: int) -> list[int]:
        """Ask the replay ROUTER for batches from ``start``; apply the ones next in line; returns the seqs sent."""
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        seqs = []
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            while not self.replay.poll(10):
                assert time.monotonic() < deadline, "replay: no end marker"
                self.pump()
            empty, *frames = self.replay.recv_multipart()
            assert empty == b""
            if self.wire.replay_topic:
                topic, *frames = frames
                assert topic in (self.topic, b"")
            seq_bytes, payload = frames
            if seq_bytes == END_SEQ:
                assert payload == b""
                return seqs
            seq = int.from_bytes(seq_bytes, "big")
            seqs.append(seq)
            if seq == self.last_seq + 1:
                self.apply(seq, payload, "replay")

    def apply(self, seq: int, payload: bytes, origin: str) -> None:
        ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and abs(ts - time.time()) < 60 and dp_rank == 0
        for event in events:
            tag, fields = decode_event(event)
            self.tags.add(tag)
            group = fields.get("group_idx", 0)  # the array layout has one set: every group's events in it
            if tag == "BlockStored":
                hashes = fields["block_hashes"]
                assert len(fields["token_ids"]) == len(hashes) * fields["block_size"]
                assert fields["medium"] == "GPU" and fields["lora_id"] is None
                self.lora_names.add(fields["lora_name"])
                if isinstance(event, dict):
                    extra = fields["extra_keys"]
                    assert len(extra) == len(hashes), "one extra_keys entry per block"
                    kind = (fields["kv_cache_spec_kind"], fields.get("kv_cache_spec_sliding_window"))
                    assert self.kinds.setdefault(group, kind) == kind, "a group changed its kind"
                if self.hasher is not None:
                    parent = fields["parent_block_hash"]
                    if self.wire.int_hashes:  # the parent's low 64 bits do not chain: check from the root only
                        if parent is None:
                            expected = self.hasher.hash_blocks(fields["token_ids"], lora=fields["lora_name"])
                            assert hashes == [low64(h) for h in expected], "block hashes do not follow from tokens"
                    else:
                        expected = self.hasher.hash_blocks(fields["token_ids"], lora=fields["lora_name"],
                                                           parent=parent, start_block=0 if parent is None else 1)
                        assert hashes == expected, "block hashes do not follow from parent and tokens"
                self.hashes.setdefault(group, set()).update(hashes)
            elif tag == "BlockRemoved":
                assert fields["medium"] == "GPU"
                self.hashes.setdefault(group, set()).difference_update(fields["block_hashes"])
            else:
                assert tag == "AllBlocksCleared" and fields == {}
                self.hashes.clear()
        self.last_seq = seq
        self.applied.append((seq, origin))


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def endpoints(tmp_path) -> tuple[str, str]:
    return f"ipc://{tmp_path}/ev.sock", f"ipc://{tmp_path}/evr.sock"


def make_manager(num_blocks: int = 12, rows=(Full(),)) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, rows, hash_seed=SEED, enable_events=True)


def indexed(manager: KVCacheManager, wire: EventWire) -> dict[int, set[bytes | int]]:
    """Per row group, the hashes the manager's prefix index holds (as the wire sends them)."""
    groups, blocks = manager._index.held_pairs()
    hashes, _ = manager._index.hashes_at(groups, blocks)
    out: dict[int, set[bytes | int]] = {}
    for g, h in zip(groups.tolist(), hashes):
        out.setdefault(0 if wire.layout == "array" else g, set()).add(low64(bytes(h)) if wire.int_hashes
                                                                      else bytes(h))
    return out


def assert_mirrors(router: VLLMRouterIndex, manager: KVCacheManager) -> None:
    """Per group, the router's hashes are exactly what the manager's index holds for that group."""
    assert {g: h for g, h in router.hashes.items() if h} == indexed(manager, router.wire)


def run_step(pub: KVEventPublisher, router: VLLMRouterIndex, manager: KVCacheManager, published: list[int]) -> None:
    seq = pub.publish(manager.take_events())
    if seq >= 0:
        published.append(seq)
        router.sync(seq)
    assert_mirrors(router, manager)


# -- the router's index follows the manager ------------------------------------------------------

def test_router_index_follows_admits_frees_evictions_and_reset(ctx, tmp_path):
    """Every event type reaches the router, and after each step its hashes are the manager's index."""
    endpoint, replay = endpoints(tmp_path)
    pub = KVEventPublisher(ctx, endpoint, replay, topic="kv")
    router = VLLMRouterIndex(ctx, endpoint, replay, topic=b"kv", hasher=BlockHasher(BS, seed=SEED),
                             pump=pub.handle_replay)
    m = make_manager(num_blocks=12)
    published: list[int] = []
    try:
        assert m.admit("a", list(range(10))) is not None              # 2 full blocks stored
        run_step(pub, router, m, published)
        assert m.admit("b", list(range(8)) + [100, 101, 102, 103, 104]).num_cached_tokens == 8  # 1 more stored
        run_step(pub, router, m, published)
        m.extend("a", [7, 7, 7, 7, 7, 7])                                # a reaches 16 tokens: 2 more
        run_step(pub, router, m, published)
        m.free("a")
        m.free("b")
        run_step(pub, router, m, published)                             # frees keep blocks cached: no batch
        assert m.admit("c", list(range(1000, 1040))) is not None        # 10 blocks: evicts cached ones
        run_step(pub, router, m, published)
        m.reset_prefix_cache()
        run_step(pub, router, m, published)
        m.free("c")
        assert m.admit("d", list(range(500, 509)), lora="adapter-1") is not None
        run_step(pub, router, m, published)
        assert router.tags == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
        assert router.lora_names == {None, "adapter-1"}
        assert published == [0, 1, 2, 3, 4, 5], "seqs start at 0 and grow by one per batch"
        assert [seq for seq, _ in router.applied] == published
    finally:
        router.close()
        pub.close()


def test_late_router_catches_up_through_replay_then_follows_live(ctx, tmp_path):
    """A router that connects after three batches asks the replay socket for 0..2, then takes the rest live."""
    endpoint, replay = endpoints(tmp_path)
    pub = KVEventPublisher(ctx, endpoint, replay)
    m = make_manager(num_blocks=24)
    published: list[int] = []
    for i in range(3):
        m.admit(i, list(range(10 * i, 10 * i + 9)))
        published.append(pub.publish(m.take_events()))
    router = VLLMRouterIndex(ctx, endpoint, replay, hasher=BlockHasher(BS, seed=SEED), pump=pub.handle_replay)
    try:
        router.sync(published[-1])
        assert_mirrors(router, m)
        assert router.applied == [(0, "replay"), (1, "replay"), (2, "replay")]
        deadline = time.monotonic() + TIMEOUT_S
        while router.applied[-1][1] == "replay":  # until the subscription has reached the PUB socket
            assert time.monotonic() < deadline, "no batch ever arrived live"
            n = len(published)
            assert m.admit(n, list(range(100 * n, 100 * n + 9))) is not None
            m.free(n)
            run_step(pub, router, m, published)
        assert [seq for seq, _ in router.applied] == published == list(range(len(published)))
    finally:
        router.close()
        pub.close()


UNIFORM, HEAD_WISE = (Full(),), (Full(), Window(8), Window(8, 4))


@pytest.mark.parametrize("rows, wire", [(UNIFORM, EventWire()), (HEAD_WISE, EventWire()),
                                        (HEAD_WISE, EventWire(int_hashes=False)), (UNIFORM, OLDER_ARRAY_WIRE)],
                         ids=["uniform", "head-wise", "head-wise-bytes-hashes", "uniform-array"])
def test_router_index_follows_random_workload(ctx, tmp_path, rows, wire):
    """Random admits, extends, frees and resets: after every step the router holds exactly the indexed hashes of
    each group (the array layout, which has no groups, serves a uniform cache)."""
    endpoint, replay = endpoints(tmp_path)
    pub = KVEventPublisher(ctx, endpoint, replay, wire=wire)
    router = VLLMRouterIndex(ctx, endpoint, replay, wire=wire, hasher=BlockHasher(BS, seed=SEED),
                             pump=pub.handle_replay)
    m = make_manager(num_blocks=24, rows=rows)
    rng = random.Random(7)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    live: list[str] = []
    published: list[int] = []
    try:
        for step in range(300):
            action = rng.random()
            if action < 0.45 or not live:
                prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
                if m.admit(f"r{step}", prompt) is not None:
                    live.append(f"r{step}")
            elif action < 0.75:
                m.extend(rng.choice(live), [rng.randrange(50) for _ in range(rng.randrange(1, 6))])
            elif action < 0.98:
                m.free(live.pop(rng.randrange(len(live))))
            else:
                m.reset_prefix_cache()
            seq = pub.publish(m.take_events())
            if seq >= 0:
                published.append(seq)
                router.sync(seq)
            assert_mirrors(router, m)
        assert router.tags == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
        assert published == list(range(len(published)))
        assert [seq for seq, _ in router.applied] == published
        if wire.layout == "map":  # each group announced its policy
            windows = m.group_windows
            assert router.kinds == {g: ("full_attention", None) if w is None else ("sliding_window", w)
                                    for g, w in enumerate(windows)}
    finally:
        router.close()
        pub.close()


# -- replay --------------------------------------------------------------------------------------

def publish_n(pub: KVEventPublisher, n: int) -> list[bytes]:
    """Publish n one-event batches; returns the hash each stored."""
    hashes = []
    for i in range(n):
        h = i.to_bytes(32, "big")
        hashes.append(h)
        assert pub.publish([BlockStored((h,), None, np.arange(BS, dtype=np.uint32), BS)]) == i
    return hashes


def replay_client(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A DEALER: it receives every message of a streamed replay (a REQ takes only one)."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    return sock


def ask_replay(pub: KVEventPublisher, client: zmq.Socket, start: int) -> None:
    """Send vLLM's replay request ([empty delimiter, start seq]) and let the publisher answer it."""
    client.send_multipart([b"", start.to_bytes(8, "big")])
    serve_one_replay(pub)


def serve_one_replay(pub: KVEventPublisher) -> None:
    assert pub.replay_socket is not None and pub.replay_socket.poll(int(TIMEOUT_S * 1000)), "no replay request"
    pub.handle_replay()


def recv(sock: zmq.Socket) -> list[bytes]:
    assert sock.poll(int(TIMEOUT_S * 1000)), "no reply"
    return sock.recv_multipart()


def collect(sock: zmq.Socket) -> list[tuple[int, bytes]]:
    """Replayed (seq, payload) pairs up to the end marker [b"", (b"",) seq -1, b""], with or without the topic."""
    out = []
    while True:
        empty, *frames = recv(sock)
        assert empty == b""
        seq_bytes, payload = frames[-2:]
        if seq_bytes == END_SEQ:
            assert payload == b""
            return out
        out.append((int.from_bytes(seq_bytes, "big"), payload))


def replay_from(replay_endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """A daemon's buffered batches from ``start`` on, asked of its events replay socket: unlike a SUB, which joins
    asynchronously and misses what is published before it has, this gets every batch published so far."""
    client = replay_client(zmq.Context.instance(), replay_endpoint)
    try:
        client.send_multipart([b"", start.to_bytes(8, "big")])
        return collect(client)
    finally:
        client.close(linger=0)


def test_replay_sends_missed_batches_then_end_marker(ctx, tmp_path):
    """A subscriber that missed batches 2.. asks from 2 and gets 2, 3, 4 with their payloads, then seq -1."""
    endpoint, replay = endpoints(tmp_path)
    pub = KVEventPublisher(ctx, endpoint, replay, topic="kv")
    client = replay_client(ctx, replay)
    try:
        hashes = publish_n(pub, 5)  # nobody subscribed: every batch missed live
        for start, expected in [(2, [2, 3, 4]), (0, [0, 1, 2, 3, 4]), (5, []), (99, [])]:
            ask_replay(pub, client, start)
            replayed = collect(client)
            assert [seq for seq, _ in replayed] == expected
            for seq, payload in replayed:
                _, events, _ = msgpack.unpackb(payload, raw=False)
                assert decode_event(events[0])[0] == "BlockStored"
                assert events[0]["block_hashes"] == [low64(hashes[seq])]
        pub.handle_replay()  # nothing pending: returns at once
    finally:
        client.close(linger=0)
        pub.close()


def test_replay_keeps_only_the_last_buffer_steps_batches(ctx, tmp_path):
    """With buffer_steps=3, after 6 batches a replay from 0 returns 3, 4, 5: older ones are gone."""
    endpoint, replay = endpoints(tmp_path)
    pub = KVEventPublisher(ctx, endpoint, replay, buffer_steps=3)
    client = replay_client(ctx, replay)
    try:
        publish_n(pub, 6)
        ask_replay(pub, client, 0)
        assert [seq for seq, _ in collect(client)] == [3, 4, 5]
    finally:
        client.close(linger=0)
        pub.close()


def test_replay_keeps_at_most_buffer_bytes_of_batches_but_always_the_last(ctx, tmp_path):
    """The replay buffer is bounded in bytes too: the oldest batches go first, the newest always stays."""
    endpoint, replay = endpoints(tmp_path)
    pub = KVEventPublisher(ctx, endpoint, replay, buffer_bytes=1)
    client = replay_client(ctx, replay)
    try:
        publish_n(pub, 4)
        ask_replay(pub, client, 0)
        assert [seq for seq, _ in collect(client)] == [3]
    finally:
        client.close(linger=0)
        pub.close()


def test_a_batch_too_big_to_send_live_is_only_replayed(ctx, tmp_path):
    """A batch over LIVE_BATCH_BYTES is numbered and buffered but not queued on the PUB: a subscriber sees the gap
    at the next batch and replays it, and a slow one never holds more than the PUB's byte budget."""
    endpoint, replay = endpoints(tmp_path)
    pub = KVEventPublisher(ctx, endpoint, replay)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    client = replay_client(ctx, replay)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not sub.poll(20):  # the subscription reaches the PUB
            assert time.monotonic() < deadline, "the subscriber never joined"
            pub.publish([AllBlocksCleared()])
        while sub.poll(50):
            sub.recv_multipart()
        first = pub.next_seq
        big = np.arange(LIVE_BATCH_BYTES // 4, dtype=np.uint32) + 2**31  # 5 bytes a token id in msgpack
        pub.publish([BlockStored((b"\x01" * 32,), None, big, BS, None)])
        pub.publish([AllBlocksCleared()])
        _, seq, _ = recv(sub)
        assert int.from_bytes(seq, "big") == first + 1 and pub.num_dropped >= 1
        ask_replay(pub, client, first)
        replayed = collect(client)
        assert [s for s, _ in replayed] == [first, first + 1] and len(replayed[0][1]) > LIVE_BATCH_BYTES
    finally:
        client.close(linger=0)
        sub.close(linger=0)
        pub.close()


def test_replay_with_topic_frame_matches_newer_vllm(ctx, tmp_path):
    """replay_topic: each reply is (topic, seq, payload) and the end marker (b"", -1, b"")."""
    endpoint, replay = endpoints(tmp_path)
    pub = KVEventPublisher(ctx, endpoint, replay, topic="kv", wire=EventWire(replay_topic=True))
    client = replay_client(ctx, replay)
    try:
        publish_n(pub, 2)
        ask_replay(pub, client, 0)
        frames = [recv(client) for _ in range(3)]
        assert [f[:3] for f in frames] == [[b"", b"kv", (0).to_bytes(8, "big")], [b"", b"kv", (1).to_bytes(8, "big")],
                                           [b"", b"", END_SEQ]]
        assert frames[2][3] == b"" and frames[0][3] and frames[1][3]
    finally:
        client.close(linger=0)
        pub.close()


def test_req_client_as_in_vllm_example_gets_the_first_missed_batch(ctx, tmp_path):
    """vLLM's example subscriber replays over REQ: a REQ socket takes one reply per request, the first missed batch."""
    endpoint, replay = endpoints(tmp_path)
    pub = KVEventPublisher(ctx, endpoint, replay)
    client = ctx.socket(zmq.REQ)
    client.connect(replay)
    try:
        publish_n(pub, 4)
        client.send((1).to_bytes(8, "big"))
        serve_one_replay(pub)
        topic, seq_bytes, payload = recv(client)  # vLLM 0.33 sends the topic frame in replay replies
        assert topic == b"" and int.from_bytes(seq_bytes, "big") == 1 and payload
    finally:
        client.close(linger=0)
        pub.close()


def test_malformed_replay_request_gets_no_reply_and_changes_nothing(ctx, tmp_path):
    """A request without the empty delimiter frame is ignored, as vLLM's publisher does."""
    endpoint, replay = endpoints(tmp_path)
    pub = KVEventPublisher(ctx, endpoint, replay)
    client = replay_client(ctx, replay)
    try:
        publish_n(pub, 2)
        client.send((0).to_bytes(8, "big"))
        serve_one_replay(pub)
        assert not client.poll(200)
        ask_replay(pub, client, 1)
        assert [seq for seq, _ in collect(client)] == [1]
    finally:
        client.close(linger=0)
        pub.close()


# -- the exact encoding --------------------------------------------------------------------------

H1, H2, H0 = b"\x01" * 32, b"\x02" * 32, b"\x00" * 24 + (2**64 - 1).to_bytes(8, "big")
STORED = BlockStored((H1, H2), H0, np.arange(8, dtype=np.uint32), 4, group=1, window=16, lora=("ad", "/a"),
                     extra_keys=(("ad", ("img", 3), "salt"), ("ad",)))


def test_array_layout_is_msgspec_array_like_tagged_structs():
    """Array form: [ts, [[tag, fields in vLLM's declaration order up to lora_name]], dp_rank]."""
    payload = encode_batch([STORED, BlockRemoved((H1,)), AllBlocksCleared()], ts=1.5, dp_rank=3,
                           wire=OLDER_ARRAY_WIRE)
    assert msgpack.unpackb(payload, raw=False) == [1.5, [
        ["BlockStored", [H1, H2], H0, list(range(8)), 4, None, "GPU", "ad"],
        ["BlockRemoved", [H1], "GPU"],
        ["AllBlocksCleared"],
    ], 3]
    assert payload[:2] == b"\x93\xcb", "a 3-element array whose ts is a float64, as msgspec writes it"
    assert b"\xc4\x20" + H1 in payload, "hashes travel as msgpack bin 8"


def test_the_default_is_vllm_0_33s_map_layout_with_groups_and_extra_keys():
    """Map form: tag under "type", fields without defaults always present, then extra_keys, group_idx and the
    group's spec; hashes as the digest's low 64 bits."""
    payload = encode_batch([STORED, BlockRemoved((H1,), group=1), AllBlocksCleared()], ts=2.0, dp_rank=0)
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    assert (ts, rank) == (2.0, 0)
    assert events == [
        {"type": "BlockStored", "block_hashes": [low64(H1), low64(H2)], "parent_block_hash": 2**64 - 1,
         "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": "ad",
         "extra_keys": [["ad", ["img", 3], "salt"], ["ad"]], "group_idx": 1, "kv_cache_spec_kind": "sliding_window",
         "kv_cache_spec_sliding_window": 16},
        {"type": "BlockRemoved", "block_hashes": [low64(H1)], "medium": "GPU", "group_idx": 1},
        {"type": "AllBlocksCleared"},
    ]
    assert list(events[0])[0] == "type", "the tag comes first, as msgspec writes it"


def vllm_event_vectors() -> dict:
    """Batches vLLM 0.33 encoded itself (tests/vectors/README.md says how)."""
    with open(os.path.join(os.path.dirname(__file__), "vectors", "vllm-0.33-kv-events.json")) as f:
        return json.load(f)


def _vector_event(fields: dict, digests: dict[str, str]) -> tuple[object, bool]:
    """A vector's event as a CacheEvent, and whether its hashes travel as ints."""
    def digest(h):
        return bytes.fromhex(h["hex"]) if isinstance(h, dict) else bytes.fromhex(digests[str(h)])

    def keys(entry):
        return None if entry is None else tuple(tuple(k) if isinstance(k, list) else k for k in entry)

    tag = fields["type"]
    if tag == "AllBlocksCleared":
        return AllBlocksCleared(), True
    ints = not isinstance(fields["block_hashes"][0], dict)
    hashes = tuple(digest(h) for h in fields["block_hashes"])
    if tag == "BlockRemoved":
        return BlockRemoved(hashes, group=fields["group_idx"], medium=fields["medium"]), ints
    parent = fields["parent_block_hash"]
    window = fields["kv_cache_spec_sliding_window"]
    assert fields["kv_cache_spec_kind"] == ("full_attention" if window is None else "sliding_window")
    return BlockStored(hashes, None if parent is None else digest(parent), np.array(fields["token_ids"], np.uint32),
                       fields["block_size"], group=fields["group_idx"], window=window, lora=fields["lora_name"],
                       extra_keys=tuple(keys(e) for e in fields["extra_keys"]), medium=fields["medium"]), ints


@pytest.mark.parametrize("index", range(4))
def test_batches_are_byte_for_byte_what_vllm_0_33_encodes(index):
    """Our encoder writes exactly the payload vLLM 0.33's ZmqEventPublisher sends for the same events."""
    vectors = vllm_event_vectors()
    batch = vectors["batches"][index]
    decoded = [_vector_event(e, vectors["digests"]) for e in batch["events"]]
    ints = {i for _, i in decoded}
    assert len(ints) == 1
    payload = encode_batch([e for e, _ in decoded], ts=batch["ts"], dp_rank=batch["data_parallel_rank"],
                           wire=EventWire(int_hashes=ints.pop()))
    assert payload.hex() == batch["payload"]


def _reference_payload(events, ts, dp_rank, wire):
    """The batch as msgpack-python writes the plain structure (token ids as a list of Python ints)."""
    def hash_of(h):
        return low64(h) if wire.int_hashes else bytes(h)

    out = []
    for e in events:
        if isinstance(e, BlockStored):
            lora = e.lora if e.lora is None or isinstance(e.lora, str) else e.lora[0]
            fields = [("block_hashes", [hash_of(h) for h in e.block_hashes]),
                      ("parent_block_hash", None if e.parent_block_hash is None else hash_of(e.parent_block_hash)),
                      ("token_ids", e.token_ids.tolist()), ("block_size", e.block_size), ("lora_id", None),
                      ("medium", e.medium), ("lora_name", lora)]
            if wire.layout == "map":
                fields += [("extra_keys", e.extra_keys)] if e.extra_keys is not None else []
                fields += [("group_idx", e.group),
                           ("kv_cache_spec_kind", "full_attention" if e.window is None else "sliding_window")]
                fields += [("kv_cache_spec_sliding_window", e.window)] if e.window is not None else []
        elif isinstance(e, BlockRemoved):
            fields = [("block_hashes", [hash_of(h) for h in e.block_hashes]), ("medium", e.medium)]
            fields += [("group_idx", e.group)] if wire.layout == "map" else []
        else:
            fields = []
        tag = type(e).__name__
        out.append([tag, *(v for _, v in fields)] if wire.layout == "array" else {"type": tag, **dict(fields)})
    def pack(value) -> bytes:  # msgspec writes BlockStored's map (a tag and 15 fields) with a map 16 header
        if isinstance(value, dict) and value["type"] == "BlockStored":
            return b"\xde" + len(value).to_bytes(2, "big") + b"".join(pack(k) + pack(v) for k, v in value.items())
        return msgpack.packb(value, use_bin_type=True)

    events_header = msgpack.packb([None] * len(out))[: -len(out) or None]
    return (b"\x93" + msgpack.packb(float(ts)) + events_header + b"".join(pack(e) for e in out)
            + msgpack.packb(dp_rank))


_digests = st.binary(min_size=32, max_size=32)
_keys = st.none() | st.tuples(st.text(max_size=4), st.tuples(st.text(max_size=4), st.integers(-5, 70)))
_events = st.lists(st.one_of(
    st.builds(lambda hashes, parent, tokens, lora, group, window, keyed: BlockStored(
        tuple(hashes), parent, np.array(tokens, np.uint32), 4, group=group, window=window, lora=lora,
        extra_keys=tuple(keyed[: len(hashes)]) + (None,) * max(0, len(hashes) - len(keyed))),
        st.lists(_digests, min_size=1, max_size=20), st.none() | _digests,
        st.lists(st.integers(0, 2**32 - 1), max_size=80), st.none() | st.text(max_size=8)
        | st.tuples(st.text(max_size=4), st.text(max_size=4)), st.integers(0, 3), st.none() | st.integers(1, 2**20),
        st.lists(_keys, max_size=20)),
    st.builds(lambda hashes, group: BlockRemoved(tuple(hashes), group=group),
              st.lists(_digests, min_size=1, max_size=20), st.integers(0, 3)),
    st.just(AllBlocksCleared())), max_size=8)


@settings(max_examples=200, deadline=None)
@given(events=_events, ts=st.floats(allow_nan=False), dp_rank=st.integers(0, 2**31),
       wire=st.sampled_from([EventWire(), EventWire(int_hashes=False), OLDER_ARRAY_WIRE]))
def test_encoding_is_msgpack_pythons_bytes_for_the_plain_structure(events, ts, dp_rank, wire):
    """The C codec writes token ids straight from their array: byte for byte what msgpack-python writes for the
    same batch with the ids as a list of Python ints (so msgspec decodes it as vLLM's structs)."""
    assert encode_batch(events, ts=ts, dp_rank=dp_rank, wire=wire) == _reference_payload(events, ts, dp_rank, wire)


def test_publish_without_events_sends_nothing(ctx, tmp_path):
    endpoint, _ = endpoints(tmp_path)
    pub = KVEventPublisher(ctx, endpoint)
    try:
        assert pub.publish([]) == -1 and pub.next_seq == 0 and pub.replay_socket is None
        pub.handle_replay()
    finally:
        pub.close()


def test_a_daemons_stream_decodes_as_vllm_0_33_events_with_the_hashers_hashes(daemon):
    """A real `kvcache serve --events` (its default format), read with the field list above: each group's store
    names its kind and window, and every stored hash is the low 64 bits of what the sha256_cbor hasher gives the
    prompt with its LoRA, salt and multimodal item; extra_keys are vLLM's untagged keys per block."""
    from kvcache.client import CacheClient

    d = daemon("--num-blocks", "64", "--block-size", "4", "--rows", "window:8,full", "--events",
               "--hash-algorithm", "sha256_cbor")
    prompt = list(range(1000, 1013))
    request = {"lora": ("sql", "/adapters/sql"), "cache_salt": "tenant", "mm": [("img-1", 5, 4)]}
    with CacheClient(d.endpoint) as client:
        client.admit("r0", prompt, **request)
        # Replayed from seq 0 rather than read live: a SUB joins asynchronously and would miss the only batch.
        replayed = replay_from(client.info()["events_replay_endpoint"], 0)
    assert [seq for seq, _ in replayed] == [0], "one batch: the admit's"
    _, events, _ = msgpack.unpackb(replayed[0][1], raw=False)
    stored = [dict(decode_event(e)[1], type=decode_event(e)[0]) for e in events]
    want = [low64(h) for h in BlockHasher(4, "sha256_cbor").hash_blocks(prompt, **request)]
    assert [(e["type"], e["group_idx"], e["kv_cache_spec_kind"], e.get("kv_cache_spec_sliding_window"))
            for e in stored] == [("BlockStored", 0, "sliding_window", 8), ("BlockStored", 1, "full_attention", None)]
    for e in stored:
        assert e["block_hashes"] == want and e["parent_block_hash"] is None and e["lora_name"] == "sql"
        assert e["token_ids"] == prompt[:12] and e["block_size"] == 4 and e["medium"] == "GPU"
        assert e["extra_keys"] == [["sql", "tenant"], ["sql", ["img-1", 1]], ["sql", ["img-1", -3]]]


# -- a daemon's events, as a router across several daemons reads them --------------------------------------------

def events_subscriber(client, topic: bytes = b"") -> zmq.Socket:
    """A SUB on the daemon's events endpoint that has joined: prompts of fresh tokens are admitted until one's batch
    arrives (a subscription joins asynchronously; a repeated prompt would hit the cache and store nothing)."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(client.info()["events_endpoint"])
    deadline = time.monotonic() + TIMEOUT_S
    for n in itertools.count():
        assert time.monotonic() < deadline, "no event batch arrived"
        client.admit(f"probe-{n}", [10_000_000 + 8 * n + i for i in range(8)])
        if sub.poll(100):
            return sub
    raise AssertionError("unreachable")


def stored_batch(client, sub: zmq.Socket, prompt: list[int]) -> tuple[bytes, list, int]:
    """Admit ``prompt`` and return the (topic, events, data_parallel_rank) of the batch storing its blocks."""
    client.admit(f"req-{prompt[0]}-{len(prompt)}", prompt)
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        assert sub.poll(max(0, int(1000 * (deadline - time.monotonic())))), "the prompt's batch never arrived"
        topic, _, payload = sub.recv_multipart()
        _, events, dp_rank = msgpack.unpackb(payload, raw=False)
        stored = [fields for tag, fields in map(decode_event, events) if tag == "BlockStored"]
        if any(fields["token_ids"] == prompt[start:start + len(fields["token_ids"])]
               for fields in stored for start in range(0, len(prompt), BS)):
            return topic, events, dp_rank


def test_two_default_daemons_publish_the_same_block_hashes_for_a_prompt(daemon):
    """Daemons started without --hash-seed share vLLM's default root, so a router indexing both finds a prompt's
    blocks under the same hashes on either (one hash per tree position: a second root would cut one daemon off)."""
    from kvcache.client import CacheClient

    prompt = list(range(500, 521))
    hashes = []
    for _ in range(2):
        d = daemon("--num-blocks", "64", "--block-size", str(BS), "--events")
        with CacheClient(d.endpoint) as client:
            sub = events_subscriber(client)
            try:
                _, events, _ = stored_batch(client, sub, prompt)
            finally:
                sub.close()
        hashes.append([h for tag, fields in map(decode_event, events) if tag == "BlockStored"
                       for h in fields["block_hashes"]])
    assert hashes[0] == hashes[1] == [low64(h) for h in BlockHasher(BS).hash_blocks(prompt)]


def test_events_carry_the_configured_topic_and_data_parallel_rank(daemon):
    """--events-topic is every message's topic frame (llm-d's indexer subscribes to "kv@" and reads the pod and
    model from kv@POD@MODEL) and --data-parallel-rank the batch's rank, live and in replay."""
    from kvcache.client import CacheClient

    d = daemon("--num-blocks", "64", "--block-size", str(BS), "--events", "--events-topic", "kv@pod-3@llama-8b",
               "--data-parallel-rank", "3")
    with CacheClient(d.endpoint) as client:
        sub = events_subscriber(client, topic=b"kv@")
        try:
            topic, _, dp_rank = stored_batch(client, sub, list(range(700, 712)))
        finally:
            sub.close()
        assert (topic, dp_rank) == (b"kv@pod-3@llama-8b", 3)
        replay = zmq.Context.instance().socket(zmq.DEALER)
        replay.setsockopt(zmq.LINGER, 0)
        replay.connect(client.info()["events_replay_endpoint"])
        try:
            replay.send_multipart([b"", (0).to_bytes(8, "big")])
            assert replay.poll(int(TIMEOUT_S * 1000)), "no replay"
            empty, topic, seq, payload = replay.recv_multipart()
        finally:
            replay.close()
    assert (empty, topic, seq) == (b"", b"kv@pod-3@llama-8b", (0).to_bytes(8, "big"))
    assert msgpack.unpackb(payload, raw=False)[2] == 3


def test_array_format_with_int_hashes_sends_64_bit_hashes(daemon):
    """--events-format array --events-hashes int: the array layout with vLLM's 64-bit int hashes (what routers
    decode), the parent's too; --events-hashes bytes keeps the 32-byte digests in the map layout."""
    from kvcache.client import CacheClient

    prompt = list(range(900, 913))
    want = BlockHasher(BS).hash_blocks(prompt)
    for flags, hashes in ((("--events-format", "array", "--events-hashes", "int"), [low64(h) for h in want]),
                          (("--events-hashes", "bytes"), want)):
        d = daemon("--num-blocks", "64", "--block-size", str(BS), "--events", *flags)
        with CacheClient(d.endpoint) as client:
            sub = events_subscriber(client)
            try:
                stored_batch(client, sub, prompt[:8])
                _, events, _ = stored_batch(client, sub, prompt)
            finally:
                sub.close()
        (tag, fields), = map(decode_event, events)
        assert isinstance(events[0], list) == (flags[0] == "--events-format")
        assert tag == "BlockStored" and fields["token_ids"] == prompt[8:12]
        assert (fields["parent_block_hash"], fields["block_hashes"]) == (hashes[1], [hashes[2]])

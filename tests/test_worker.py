"""TableSubscriber against real `kvcache serve` daemons: tables equal the daemon's after every step."""
from __future__ import annotations

import itertools
import multiprocessing
import queue
import random
import time
import traceback
from typing import Any, Callable

import numpy as np
import pytest
import zmq

from kvcache.allocator.errors import KVCacheError
from kvcache.client import CacheClient, DaemonError, DaemonUnavailable
from kvcache.protocol import DELTA_TOPIC
from kvcache.worker import SyncTimeout, TableCapacityError, TableSubscriber

HEADWISE = ("--model", "llama-3.1-8b", "--head-wise", "--tp", "4", "--block-size", "16", "--num-blocks", "1200",
            "--rows", "window:64:16,full,window:48,full,window:64:16,full,window:32,full", "--max-slots", "48")
SHARED_PREFIX = list(range(1000, 1064))  # four blocks of 16 that some prompts share, for prefix hits


class RandomScheduler:
    """Random admit/extend/free steps through one CacheClient, remembering which requests are live."""

    def __init__(self, endpoint: str, index: int, seed: int, max_live: int = 8, max_tokens: int = 900) -> None:
        self.client = CacheClient(endpoint, timeout=10)
        self.index = index
        self.rng = random.Random(seed)
        self.max_live = max_live
        self.max_tokens = max_tokens
        self.live: dict[Any, int] = {}  # request -> tokens its table covers
        self._ids = itertools.count()

    def _new_id(self) -> Any:
        n = next(self._ids)
        return f"s{self.index}-{n}" if n % 2 else self.index * 1_000_000 + n

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(50_000) for _ in range(n)]

    def step(self) -> int:
        """One scheduling step in one message; returns the reply's seq."""
        rng, batch, ops = self.rng, self.client.batch(), []
        for req in list(self.live):
            r = rng.random()
            if r < 0.12 or self.live[req] > self.max_tokens:
                batch.free(req)
                ops.append(("free", req, 0))
            elif r < 0.7:
                n = rng.choice([1, 1, 1, 3, 16, 37])
                batch.extend(req, self._tokens(n))
                ops.append(("extend", req, n))
        for _ in range(rng.choice([0, 1, 1, 2])):
            if len(self.live) + sum(op[0] == "admit" for op in ops) >= self.max_live:
                break
            req = self._new_id()
            prompt = SHARED_PREFIX[: rng.choice([0, 16, 64])] + self._tokens(rng.randint(1, 200))
            batch.admit(req, prompt, num_tokens=rng.randint(1, len(prompt)) if rng.random() < 0.3 else None)
            ops.append(("admit", req, 0))
            if rng.random() < 0.1:  # admitted and freed within one step
                batch.free(req)
                ops.append(("free", req, 0))
        for (kind, req, n), result in zip(ops, batch.send()):
            if result is None or isinstance(result, DaemonError):
                continue
            if kind == "admit":
                self.live[req] = result.num_tokens
            elif kind == "extend":
                self.live[req] += n
        for kind, req, _ in ops:
            if kind == "free":
                self.live.pop(req, None)
        return self.client.last_seq

    def slots(self) -> dict[Any, int]:
        return {req: self.client.slot(req) for req in self.live}


def _scheduler_process(endpoint: str, index: int, seed: int, go: Any, done: Any) -> None:
    """A scheduler in its own process: one step per ``go`` message, reporting (index, seq, live slots)."""
    try:
        scheduler = RandomScheduler(endpoint, index, seed)
        while go.get(timeout=60):
            seq = scheduler.step()
            done.put((index, seq, scheduler.slots()))
    except Exception:
        done.put((index, None, traceback.format_exc()))


def daemon_tables(client: CacheClient, live: dict[Any, int]) -> dict[Any, np.ndarray]:
    """Every live request's full table, fetched from the daemon in one message."""
    batch = client.batch()
    for req in live:
        batch.op("table", req=req)
    return dict(zip(live, batch.send())) if live else {}


def expected_tables(sub: TableSubscriber, live: dict[Any, int], tables: dict[Any, np.ndarray]) -> np.ndarray:
    """What ``sub.tables`` must hold: each live table's rows of this rank at its slot, -1 elsewhere."""
    out = np.full((sub.max_slots, len(sub.row_ids), sub.max_blocks), -1, dtype=np.int32)
    for req, slot in live.items():
        out[slot, :, : tables[req].shape[1]] = tables[req][sub.rows]
    return out


def assert_follows(sub: TableSubscriber, client: CacheClient, live: dict[Any, int],
                   tables: dict[Any, np.ndarray] | None = None) -> None:
    tables = daemon_tables(client, live) if tables is None else tables
    assert dict(sub.requests) == live
    np.testing.assert_array_equal(sub.tables, expected_tables(sub, live, tables))
    for req in live:
        assert sub.num_blocks(req) == tables[req].shape[1]
        np.testing.assert_array_equal(sub.table(req), tables[req][sub.rows])


def _report(done: Any, procs: list[Any], timeout: float = 60.0) -> tuple[int, int | None, Any]:
    """The next scheduler report; fails at once when a scheduler process has died."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return done.get(timeout=0.5)
        except queue.Empty:
            dead = [p.exitcode for p in procs if not p.is_alive()]
            assert not dead and time.monotonic() < deadline, f"scheduler processes gone (exit codes {dead})"


def follow(endpoint: str, subs: list[TableSubscriber], rounds: int, clients: int,
           on_round: Callable[[int, list[TableSubscriber]], None] | None = None) -> None:
    """Scheduler processes step together each round; after it every subscriber must equal the daemon."""
    ctx = multiprocessing.get_context("spawn")
    go = [ctx.Queue() for _ in range(clients)]
    done = ctx.Queue()
    procs = [ctx.Process(target=_scheduler_process, args=(endpoint, i, 1000 + i, go[i], done), daemon=True)
             for i in range(clients)]
    for p in procs:
        p.start()
    checker = CacheClient(endpoint, timeout=10)
    try:
        for rnd in range(rounds):
            if on_round is not None:
                on_round(rnd, subs)
            for q in go:
                q.put(True)
            live: dict[Any, int] = {}
            for _ in range(clients):
                index, seq, slots = _report(done, procs)
                assert seq is not None, f"scheduler {index} failed:\n{slots}"
                for sub in subs:
                    sub.wait_for(seq, timeout=10)
                live.update(slots)
            tables = daemon_tables(checker, live)
            for sub in subs:
                assert_follows(sub, checker, live, tables)
    finally:
        for q in go:
            q.put(False)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        checker.close()


# -- following concurrent schedulers --------------------------------------------------------------

def test_headwise_ranks_follow_three_scheduler_processes_and_a_restarted_one_catches_up(daemon):
    """Ranks of a tp=4 (and a tp=16, heads replicated) engine hold exactly their heads' tables after every step.

    Mid-run one subscriber is closed and a new one for its rank starts: the
    replay buffer no longer reaches seq 0, so it loads a snapshot and follows
    on; another joins late the same way.
    """
    d = daemon(*HEADWISE, "--replay-buffer", "32")
    subs = [TableSubscriber(d.endpoint, rank=0, max_slots=48, max_blocks=64),
            TableSubscriber(d.endpoint, rank=3, max_slots=48, max_blocks=64),
            TableSubscriber(d.endpoint, rank=5, tp_size=16, max_slots=48, max_blocks=64)]
    assert [s.rows for s in subs] == [slice(0, 2), slice(6, 8), slice(2, 3)]
    assert [p["kind"] for p in subs[0].row_policies] == ["window", "full"]

    def restart(rnd: int, subs: list[TableSubscriber]) -> None:
        if rnd == 40:
            subs[1].close()
            subs[1] = TableSubscriber(d.endpoint, rank=3, max_slots=48, max_blocks=64)
            assert subs[1].snapshots == 1 and subs[1].seq > 32
        if rnd == 70:
            subs.append(TableSubscriber(d.endpoint, rank=2, max_slots=48, max_blocks=64))
            assert subs[-1].snapshots == 1

    try:
        follow(d.endpoint, subs, rounds=100, clients=3, on_round=restart)
    finally:
        for s in subs:
            s.close()


def test_uniform_mode_gives_every_rank_row_zero(daemon):
    """With one row (uniform mode) every TP rank holds the same single-row tables."""
    d = daemon("--rows", "full", "--tp", "2", "--block-size", "16", "--num-blocks", "500", "--max-slots", "32")
    subs = [TableSubscriber(d.endpoint, rank=r, max_slots=32, max_blocks=64) for r in (0, 1)]
    assert [s.rows for s in subs] == [slice(0, 1), slice(0, 1)] and subs[0].tables.shape == (32, 1, 64)
    try:
        follow(d.endpoint, subs, rounds=80, clients=2)
        np.testing.assert_array_equal(subs[0].tables, subs[1].tables)
    finally:
        for s in subs:
            s.close()


GEMMA_SHAPED = {"model_type": "gemma3_text", "num_hidden_layers": 6, "num_attention_heads": 8,
                "num_key_value_heads": 4, "head_dim": 64, "sliding_window": 64, "sliding_window_pattern": 3}


def test_layer_group_rows_head_wise_give_each_rank_its_heads_of_every_group(daemon, tmp_path):
    """A Gemma-shaped config served --head-wise at tp 2: rows are (layer group, kv head), so a rank's rows are
    not contiguous; each rank holds exactly its rows' tables after every step of two schedulers, and
    ``cell_rows`` sends every (layer, head) of the rank to the row of its group and head."""
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps(GEMMA_SHAPED))
    d = daemon("--model", str(config), "--head-wise", "--tp", "2", "--block-size", "16", "--num-blocks", "900",
               "--max-slots", "32")
    subs = [TableSubscriber(d.endpoint, rank=r, max_slots=32, max_blocks=64) for r in (0, 1)]
    try:
        windowed, full = (0, 1, 3, 4), (2, 5)
        assert [r.layers for r in subs[0].layout] == [windowed] * 4 + [full] * 4
        assert subs[0].row_ids == (0, 1, 4, 5) and subs[1].row_ids == (2, 3, 6, 7)
        assert isinstance(subs[1].rows, np.ndarray) and subs[1].tables.shape == (32, 4, 64)
        assert [p["kind"] for p in subs[1].row_policies] == ["window", "window", "full", "full"]
        expected = np.array([[0, 1] if layer in windowed else [2, 3] for layer in range(6)])
        for sub in subs:
            np.testing.assert_array_equal(sub.cell_rows, expected)
        follow(d.endpoint, subs, rounds=60, clients=2)
    finally:
        for s in subs:
            s.close()


def test_layer_group_rows_with_pools_of_their_own_hand_out_ids_within_each_pool(daemon, tmp_path):
    """Served from a memory budget with --max-model-len, the window row gets a smaller pool than the full row
    (as ``kvcache plan`` sizes it); both ranks hold both rows, a long request's window row gives blocks back
    (-1) while the full row keeps every block, and every id is inside its row's pool."""
    import json

    from kvcache.allocator import CacheSpec
    from kvcache.plan import Load, make_plan

    config = tmp_path / "config.json"
    config.write_text(json.dumps(GEMMA_SHAPED))
    d = daemon("--model", str(config), "--tp", "2", "--block-size", "16", "--gpu-memory", "64MiB",
               "--utilization", "1", "--max-model-len", "1024", "--max-num-batched-tokens", "256", "--max-slots", "8")
    spec = CacheSpec.from_hf_config(GEMMA_SHAPED, block_size=16, tp_size=2)
    plan = make_plan(spec, gpu_memory=64 << 20, utilization=1.0, load=Load(1024, 1, 256))
    with CacheClient(d.endpoint) as c, TableSubscriber(d.endpoint, rank=1, max_slots=8, max_blocks=64) as sub:
        info = c.info()
        sizes = [r["num_blocks"] for r in info["rows"]]
        assert sizes == [r.num_blocks for r in plan.rows] and sizes[0] < sizes[1]
        assert [r["kind"] for r in info["rows"]] == ["window", "full"] and sub.row_ids == (0, 1)
        assert sub.cell_rows[:, 0].tolist() == [0, 0, 1, 0, 0, 1]
        c.admit("long", list(range(600)))
        for _ in range(40):
            c.extend("long", list(range(10)))
        sub.wait_for(c.last_seq)
        table = sub.table("long")
        assert table.shape[1] == -(-1000 // 16)
        assert (table[0] == -1).sum() >= (1000 - 64) // 16 - 1 and (table[1] >= 0).all()
        for row, size in enumerate(sizes):
            assert table[row][table[row] >= 0].max() < size


# -- ordering within one step ------------------------------------------------------------------------

def test_one_step_mixing_frees_admits_and_extends_of_the_same_requests(daemon):
    """Frees travel apart from changes in a delta; every interleaving in one step still ends as on the daemon."""
    d = daemon("--rows", "window:32,full", "--block-size", "4", "--num-blocks", "200", "--max-slots", "16")
    with CacheClient(d.endpoint) as c, TableSubscriber(d.endpoint, max_slots=16, max_blocks=64) as sub:
        for req in ("a", "y", "z", "v"):
            c.admit(req, list(range(10)))
        batch = c.batch()
        batch.free("a").admit("b", list(range(50, 70)))  # b takes a's slot
        batch.admit("x", [1, 2, 3]).free("x")  # admitted and freed
        batch.extend("y", [7] * 9).free("y")  # grown, then freed
        batch.free("z").admit("z", list(range(30, 33)))  # re-admitted under the same id, shorter
        batch.admit("w", [5] * 6).extend("w", [6] * 40)  # admitted, then grown with window recycling
        batch.extend("v", [1] * 40).free("v").admit("v", [2] * 5).extend("v", [3] * 3)
        batch.send()
        sub.wait_for(c.last_seq)
        live = {req: c.slot(req) for req in ("b", "z", "w", "v")}
        assert live["b"] == 0
        assert_follows(sub, c, live)
        c.reset_prefix_cache()  # a delta of its own that changes no table
        sub.wait_for(c.last_seq)
        assert_follows(sub, c, live)
        with TableSubscriber(d.endpoint, max_slots=16, max_blocks=64) as late:  # replays every delta from 0
            assert late.snapshots == 0 and late.seq == sub.seq
            assert_follows(late, c, live)


# -- recovering missed deltas ----------------------------------------------------------------------------

def _burst(client: CacheClient, steps: int, tokens: int, start: int) -> None:
    """Steps that each free the last big request and admit a new one into its slot: large deltas, fast."""
    for i in range(start, start + steps):
        batch = client.batch()
        if i > start:
            batch.free(f"big{i - 1}")
        batch.admit(f"big{i}", np.arange(tokens, dtype=np.uint32) + i).send()
    client.free(f"big{start + steps - 1}")


def test_a_subscriber_that_misses_deltas_replays_them_or_loads_a_snapshot(daemon):
    """Deltas the PUB drops for a slow worker come back from the replay socket; too old ones by a snapshot."""
    d = daemon("--rows", "window:256:16,full", "--block-size", "16", "--num-blocks", "2100", "--max-slots", "16",
               "--pub-bytes", "65536", "--replay-buffer", "100", "--no-enable-prefix-caching")
    tiny = zmq.Context()
    tiny.setsockopt(zmq.RCVHWM, 2)  # the worker's SUB queue holds two deltas: the rest wait in the daemon or drop
    with CacheClient(d.endpoint) as c, \
            TableSubscriber(d.endpoint, max_slots=16, max_blocks=1024, context=tiny) as slow, \
            TableSubscriber(d.endpoint, max_slots=16, max_blocks=1024) as steady:
        c.admit("keep", list(range(100)))
        for sub in (slow, steady):
            sub.wait_for(c.last_seq)
        _burst(c, 60, 16_000, 0)  # 8 KB deltas: far more than the socket buffers hold
        slow.wait_for(c.last_seq)
        assert slow.replays >= 1 and slow.snapshots == 0
        _burst(c, 400, 16_000, 100)  # more than the 100 deltas the daemon keeps
        c.extend("keep", [1] * 20)
        for sub in (slow, steady):
            sub.wait_for(c.last_seq)
            assert_follows(sub, c, {"keep": 0})
        assert slow.snapshots >= 1
    tiny.term()


def test_wait_for_fetches_a_lost_last_delta_from_the_replay_socket(daemon):
    """A delta the PUB dropped with nothing published after it would stall a pure subscriber; wait_for asks replay."""
    d = daemon("--rows", "window:32,full", "--block-size", "16", "--num-blocks", "100")
    with CacheClient(d.endpoint) as c, TableSubscriber(d.endpoint, max_slots=8, max_blocks=16) as sub:
        c.admit("a", [1])
        sub.wait_for(c.last_seq)
        sub._sub.setsockopt(zmq.UNSUBSCRIBE, DELTA_TOPIC)  # from now on the PUB drops every delta for this worker
        c.extend("a", [2] * 40)
        c.admit("b", [3] * 5)
        deadline = time.monotonic() + 30
        while True:
            start = time.monotonic()
            sub.wait_for(c.last_seq, timeout=3)
            assert time.monotonic() - start < 2.0
            if sub.replays:
                break
            # Applied live: the unsubscription (asynchronous) had not reached the PUB yet. Again, with new deltas.
            assert time.monotonic() < deadline, "the PUB still sends this worker deltas"
            c.free("b")
            c.admit("b", [3] * 5)
        assert sub.replays == 1
        assert_follows(sub, c, {"a": 0, "b": 1})


def test_poll_applies_what_is_waiting_and_counts_it(daemon):
    """poll() applies every delta that has arrived and returns how many; a freed slot is all -1 again."""
    d = daemon("--rows", "full", "--block-size", "16", "--num-blocks", "100")
    with CacheClient(d.endpoint) as c, TableSubscriber(d.endpoint, max_slots=8, max_blocks=16) as sub:
        assert sub.poll() == 0 and sub.seq == -1
        c.admit("warm", [1])
        sub.wait_for(c.last_seq)  # the subscription is live from here on
        c.admit("a", list(range(20)))
        c.extend("a", [1] * 20)
        c.free("a")
        applied, deadline = 0, time.monotonic() + 5
        while sub.seq < c.last_seq and time.monotonic() < deadline:
            applied += sub.poll(timeout=0.5)
        assert applied == 3 and sub.seq == 3 and dict(sub.requests) == {"warm": 0}
        assert (sub.tables[1:] == -1).all()


# -- deltas as datagrams from the local endpoint ------------------------------------------------------------

def _local_worker(endpoint: str, ready: Any) -> None:
    """A worker process taking deltas from the local endpoint until it is killed."""
    sub = TableSubscriber(endpoint, max_slots=48, max_blocks=64, local=True)
    ready.put(sub.local)
    while True:
        sub.poll(0.1)


def test_local_subscribers_follow_scheduler_processes_beside_pub_ones_and_gone_ones_are_forgotten(daemon):
    """Ranks taking datagrams hold what PUB ranks hold after every step; the daemon drops workers that left."""
    d = daemon(*HEADWISE, "--replay-buffer", "32")
    subs = [TableSubscriber(d.endpoint, rank=0, max_slots=48, max_blocks=64, local=True),
            TableSubscriber(d.endpoint, rank=3, max_slots=48, max_blocks=64, local=True),
            TableSubscriber(d.endpoint, rank=3, max_slots=48, max_blocks=64)]
    assert [s.local for s in subs] == [True, True, False]
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Queue()
    worker = ctx.Process(target=_local_worker, args=(d.endpoint, ready), daemon=True)
    worker.start()
    try:
        assert ready.get(timeout=60) is True
        with CacheClient(d.endpoint) as c:
            assert c.stats()["local_subscribers"] == 3

            def churn(rnd: int, subs: list[TableSubscriber]) -> None:
                if rnd == 10:
                    worker.kill()  # no goodbye: the next delta finds its address gone
                    worker.join(10)
                if rnd == 20:
                    assert c.stats()["local_subscribers"] == 2
                    subs[1].close()  # says goodbye
                    subs[1] = TableSubscriber(d.endpoint, rank=3, max_slots=48, max_blocks=64, local=True)
                    assert subs[1].local and subs[1].snapshots == 1  # the buffer of 32 no longer reaches seq 0

            follow(d.endpoint, subs, rounds=40, clients=3, on_round=churn)
            assert c.stats()["local_subscribers"] == 2
            np.testing.assert_array_equal(subs[1].tables, subs[2].tables)
    finally:
        worker.kill()
        for s in subs:
            s.close()


@pytest.mark.parametrize("local", [True, False])
def test_a_delta_too_big_for_a_datagram_reaches_a_subscriber_by_replay(daemon, local):
    """A 136 KB delta comes as a heartbeat of its seq, on the local endpoint and on the PUB (whose queue for a slow
    subscriber is bounded in bytes that way); the worker fetches it from the replay socket."""
    d = daemon("--rows", "full", "--block-size", "1", "--num-blocks", "20000", "--max-slots", "4")
    with CacheClient(d.endpoint) as c, TableSubscriber(d.endpoint, max_slots=4, max_blocks=20000, local=local) as sub:
        assert sub.local == local
        c.admit("small", [1, 2, 3])
        sub.wait_for(c.last_seq)
        assert sub.replays == 0
        c.admit("big", np.arange(17_000, dtype=np.uint32))  # 17,000 columns of 4 bytes
        sub.wait_for(c.last_seq, timeout=5)
        assert sub.replays == 1
        assert_follows(sub, c, {"small": 0, "big": 1})


def test_local_false_or_a_daemon_without_the_endpoint_takes_the_pub(daemon):
    """local=True where the daemon has no local endpoint is the PUB, as is the default."""
    d = daemon("--rows", "full", "--block-size", "16", "--num-blocks", "100", "--local-endpoint", "off")
    with CacheClient(d.endpoint) as c, TableSubscriber(d.endpoint, max_slots=4, max_blocks=8, local=True) as sub:
        assert not sub.local
        c.admit("a", [1] * 20)
        sub.wait_for(c.last_seq)
        assert_follows(sub, c, {"a": 0})


# -- framework tensors ---------------------------------------------------------------------------------

def _drive(endpoint: str, subs: list[TableSubscriber], steps: int,
           check: Callable[[TableSubscriber, np.ndarray], None]) -> None:
    """One in-process scheduler; after each step ``check(sub, expected tables)`` for every subscriber."""
    scheduler = RandomScheduler(endpoint, 0, seed=7)
    try:
        for _ in range(steps):
            seq = scheduler.step()
            live = scheduler.slots()
            tables = daemon_tables(scheduler.client, live)
            for sub in subs:
                sub.wait_for(seq)
                check(sub, expected_tables(sub, live, tables))
    finally:
        scheduler.client.close()


def test_paddle_tensor_shares_the_tables_memory(daemon):
    """``out="paddle"`` gives a CPU int32 paddle.Tensor seeing every delta without a copy; so does a caller's own."""
    paddle = pytest.importorskip("paddle")
    d = daemon(*HEADWISE)
    own = paddle.to_tensor(np.zeros((48, 2, 64), dtype=np.int32), place=paddle.CPUPlace())
    with TableSubscriber(d.endpoint, rank=1, max_slots=48, max_blocks=64, out="paddle") as made, \
            TableSubscriber(d.endpoint, rank=2, out=own) as given:
        assert isinstance(made.tensor, paddle.Tensor) and made.tensor.dtype == paddle.int32
        assert made.tensor.place.is_cpu_place() and made.zero_copy and given.zero_copy and given.tensor is own
        assert (own.numpy() == -1).all() and given.max_slots == 48 and given.max_blocks == 64

        def check(sub: TableSubscriber, expected: np.ndarray) -> None:
            np.testing.assert_array_equal(sub.tensor.numpy(), expected)

        _drive(d.endpoint, [made, given], 80, check)


def test_torch_tensor_shares_the_tables_memory(daemon):
    """``out="torch"`` gives a CPU int32 torch.Tensor over the same memory (skipped without PyTorch)."""
    torch = pytest.importorskip("torch")
    d = daemon(*HEADWISE)
    with TableSubscriber(d.endpoint, rank=0, max_slots=48, max_blocks=64, out="torch") as sub:
        assert isinstance(sub.tensor, torch.Tensor) and sub.tensor.dtype == torch.int32 and sub.zero_copy
        _drive(d.endpoint, [sub], 30, lambda s, expected: np.testing.assert_array_equal(s.tensor.numpy(), expected))


class DeviceArray:
    """An int32 array that says it lives on a GPU (DLPack device 2): reachable only through ``[a:b] = ...``."""

    def __init__(self, shape: tuple[int, int, int]) -> None:
        self.data = np.zeros(shape, dtype=np.int32)
        self.shape = shape
        self.dtype = "int32"
        self.writes: list[tuple[int, int]] = []

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise BufferError("device memory")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)

    def __setitem__(self, index: slice, value: np.ndarray) -> None:
        self.data[index] = value
        self.writes.append((index.start, index.stop))


def test_a_device_tensor_gets_only_changed_slots_copied(daemon):
    """A tensor off the host is filled once, then gets only the runs of slots a step changed."""
    d = daemon(*HEADWISE)
    device = DeviceArray((48, 2, 64))
    with TableSubscriber(d.endpoint, rank=3, out=device) as sub:
        assert not sub.zero_copy and sub.tensor is device and device.writes == [(0, 48)]
        assert (device.data == -1).all()

        def check(s: TableSubscriber, expected: np.ndarray) -> None:
            np.testing.assert_array_equal(device.data, expected)
            np.testing.assert_array_equal(s.tables, expected)

        _drive(d.endpoint, [sub], 40, check)
        assert all(stop - start < 48 for start, stop in device.writes[1:])


# -- errors ----------------------------------------------------------------------------------------------

def test_tables_too_small_are_a_clear_error_naming_the_numbers(daemon):
    """A delta that does not fit raises, naming slot or blocks and the limit, and changes nothing."""
    d = daemon("--rows", "full", "--block-size", "16", "--num-blocks", "100")
    with CacheClient(d.endpoint) as c, TableSubscriber(d.endpoint, max_slots=2, max_blocks=8) as few_slots, \
            TableSubscriber(d.endpoint, max_slots=8, max_blocks=4) as few_blocks:
        for req in ("a", "b", "c"):
            c.admit(req, [1, 2, 3])
        with pytest.raises(TableCapacityError, match=r"request 'c' is in slot 2, but the tables hold max_slots=2"):
            few_slots.wait_for(c.last_seq)
        assert few_slots.seq == 1 and set(few_slots.requests) == {"a", "b"}
        few_blocks.wait_for(c.last_seq)
        c.extend("a", [0] * 80)
        with pytest.raises(TableCapacityError, match=r"request 'a' needs 6 blocks, but the tables hold max_blocks=4"):
            few_blocks.wait_for(c.last_seq)
        assert few_blocks.seq == 2 and few_blocks.num_blocks("a") == 1
        with pytest.raises(TableCapacityError, match="max_slots=2"):  # joining replays a delta that does not fit
            TableSubscriber(d.endpoint, max_slots=2, max_blocks=8)


@pytest.mark.parametrize("local", [False, True])
def test_wait_for_on_a_dead_daemon_fails_within_its_timeout(daemon, local):
    """A killed daemon gives SyncTimeout (a DaemonUnavailable) within the wait's timeout, never a hang."""
    d = daemon("--rows", "full", "--block-size", "16", "--num-blocks", "100")
    sub = TableSubscriber(d.endpoint, max_slots=4, max_blocks=4, local=local)
    assert sub.local == local
    d.kill()
    start = time.monotonic()
    with pytest.raises(SyncTimeout, match="seq"):
        sub.wait_for(0, timeout=0.5)
    assert time.monotonic() - start < 1.5
    sub.close()
    start = time.monotonic()
    with pytest.raises(DaemonUnavailable):
        TableSubscriber(d.endpoint, timeout=0.3)
    assert time.monotonic() - start < 1.3


@pytest.mark.parametrize("local", [False, True])
def test_a_restarted_daemon_is_noticed_and_its_tables_replace_the_old_ones(daemon, local):
    """A new daemon on the same endpoint has a new epoch: the worker drops the old tables, loads the new.

    A local subscriber is unknown to the new daemon: polling into silence, it subscribes again.
    """
    flags = ("--rows", "full", "--block-size", "4", "--num-blocks", "100")
    d = daemon(*flags)
    sub = TableSubscriber(d.endpoint, max_slots=8, max_blocks=16, local=local)
    assert sub.local == local
    with CacheClient(d.endpoint, timeout=5) as client:
        for i in range(5):
            client.admit(f"old{i}", list(range(10)))
        sub.wait_for(client.last_seq, timeout=5)
    assert set(sub.requests) == {f"old{i}" for i in range(5)}
    d.kill()
    d2 = daemon(*flags, folder=d.folder)
    with CacheClient(d2.endpoint, timeout=5) as client:
        admission = client.admit("new", list(range(6)))
        assert client.last_seq == 0  # the new daemon counts from 0 again
        deadline = time.monotonic() + 5
        while set(sub.requests) != {"new"}:
            sub.poll(0.05)
            assert time.monotonic() < deadline, f"worker still holds {set(sub.requests)}"
    assert np.array_equal(sub.table("new"), admission.table)
    assert (sub.tables[1:] == -1).all()
    sub.close()


def test_bad_rank_and_bad_out_are_refused(daemon):
    """Caller mistakes are KVCacheErrors naming the argument, raised at construction."""
    d = daemon(*HEADWISE)
    with pytest.raises(KVCacheError, match="rank must be in"):
        TableSubscriber(d.endpoint, rank=4)
    with pytest.raises(KVCacheError, match="shape"):
        TableSubscriber(d.endpoint, out=np.zeros((4, 3, 8), dtype=np.int32))
    with pytest.raises(KVCacheError, match="int32"):
        TableSubscriber(d.endpoint, out=np.zeros((4, 2, 8), dtype=np.int64))
    with pytest.raises(KVCacheError, match="out"):
        TableSubscriber(d.endpoint, out="jax")
    with TableSubscriber(d.endpoint, max_slots=4, max_blocks=8) as sub, pytest.raises(KVCacheError, match="no table"):
        sub.table("nobody")

"""The host tier in the daemon: a real `kvcache serve --host-block-budget`, its workers' TierAgents copying their
caches to host and back, byte for byte, with TP ranks, failures, restarts and a full tier."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from kvcache.allocator.prefix import BlockHasher
from kvcache.allocator.errors import KVCacheError
from kvcache.client import CacheClient, DaemonError
from kvcache.tier_agent import TierAgent
from kvcache.transfer import TransferStatus
from kvcache.worker import TableSubscriber

from test_tier import Memory, make_spec, pattern, read, write

SEED = "host-tier"
BS = 4


class Node:
    """A daemon with a host tier, a scheduler's client, and per TP rank a cache, a subscriber and an agent."""

    def __init__(self, daemon: Callable[..., Any], *flags: str, tp: int = 1, num_blocks: int = 8,
                 host_blocks: int = 32, agents: bool = True) -> None:
        self.daemon = daemon("--num-blocks", str(num_blocks), "--block-size", str(BS), "--host-block-budget",
                             str(host_blocks), "--hash-seed", SEED, "--tp", str(tp), *flags)
        self.endpoint = self.daemon.endpoint
        self.spec = make_spec("bf16", tp_size=tp)
        self.client = CacheClient(self.endpoint, timeout=5)
        self.hasher = BlockHasher(BS, "sha256", SEED.encode())
        self.memory = [Memory(self.spec, num_blocks, seed=rank) for rank in range(tp)]
        self.subs = [TableSubscriber(self.endpoint, rank=rank, tp_size=tp) for rank in range(tp)]
        self.agents: list[TierAgent | None] = [TierAgent(s, m.region) if agents else None
                                               for s, m in zip(self.subs, self.memory)]

    def keys(self, tokens: list[int]) -> list[bytes]:
        return self.hasher.hash_blocks(np.asarray(tokens, dtype=np.uint32))

    def step(self) -> None:
        """What a worker does before a step: its tables current, and every copy ordered so far landed."""
        for sub, agent in zip(self.subs, self.agents):
            sub.wait_for(self.client.last_seq)
            if agent is not None:
                for layer in range(self.spec.num_layers):
                    assert agent.wait(layer, timeout=10) is TransferStatus.DONE

    def compute(self, table: np.ndarray, tokens: list[int], start: int) -> None:
        """Write each full block from ``start`` on as its hash's bytes, on every rank (its kv heads' part)."""
        keys = self.keys(tokens)
        for col in range(start, len(keys)):
            for m in self.memory:
                write(m.region, int(table[0, col]), None, keys[col])

    def holds(self, table: np.ndarray, tokens: list[int], cols: range) -> bool:
        keys = self.keys(tokens)
        for col in cols:
            for m in self.memory:
                got = read(m.region, int(table[0, col]), None)
                if got != pattern(keys[col], None, len(got)):
                    return False
        return True

    def serve(self, rid: Any, tokens: list[int]) -> Any:
        """Admit, wait for the step's copies, compute the uncached blocks, free: a request's whole life."""
        adm = self.client.admit(rid, tokens)
        assert adm is not None
        self.step()
        assert self.holds(adm.table, tokens, range(adm.num_cached_tokens // BS)), f"{rid}: cached blocks differ"
        self.compute(adm.table, tokens, adm.num_cached_tokens // BS)
        self.client.free(rid)
        self.step()
        return adm

    def failed_loads(self, timeout: float = 10) -> list[Any]:
        """The requests the daemon names in tier_failed, once it names any (a copy's deadline may pass first)."""
        deadline = time.monotonic() + timeout
        failed: list[Any] = []
        while not failed and time.monotonic() < deadline:
            time.sleep(0.05)
            failed = self.client.tier_failed()
        return failed

    def settle(self, timeout: float = 10) -> dict[str, Any]:
        """Every agent's copies reported; the daemon's host-tier stats then."""
        for agent in self.agents:
            if agent is not None:
                assert agent.drain(timeout)
        return self.client.stats()["host_tier"]

    def evict_gpu(self, base: int) -> None:
        """Fill every GPU block with another prompt and free it: earlier prefixes survive only on host."""
        tokens = list(range(base, base + self.daemon_blocks * BS))
        self.serve(f"filler{base}", tokens)

    @property
    def daemon_blocks(self) -> int:
        return self.client.info()["num_blocks"]

    def close(self) -> None:
        for agent in self.agents:
            if agent is not None:
                agent.close()
        for sub in self.subs:
            sub.close()
        self.client.close()


@pytest.fixture
def node(daemon: Callable[..., Any]) -> Any:
    made: list[Node] = []

    def make(*flags: str, **kw: Any) -> Node:
        made.append(Node(daemon, *flags, **kw))
        return made[-1]

    yield make
    for n in made:
        n.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_freed_prefix_comes_back_from_host_byte_for_byte(node: Any, tp: int) -> None:
    """Freed blocks are offloaded by every rank's agent; once the GPU copies are evicted, a later admit hits them
    on host (the admit says how many tokens), and the agents copy them back before the step reads them."""
    n = node(tp=tp)
    prompt = list(range(100, 113))  # three full blocks and one token
    n.serve("a", prompt)
    stats = n.settle()
    assert stats["offloaded_blocks"] == 3 and stats["cached_blocks"] == 3 and stats["ranks"] == tp
    n.evict_gpu(1000)
    adm = n.serve("b", prompt + [7, 8, 9])
    assert (adm.num_cached_tokens, adm.num_host_tokens) == (12, 12), "the GPU copies are gone: all from host"
    stats = n.settle()
    assert stats["loaded_blocks"] == 3 and stats["hit_tokens"] == 12 and stats["failed_loads"] == 0
    assert all(agent.failed == 0 for agent in n.agents)
    n.client.check_integrity()


def test_nothing_goes_to_host_until_every_rank_is_attached(node: Any) -> None:
    n = node(tp=2, agents=False)
    n.agents[0] = TierAgent(n.subs[0], n.memory[0].region)
    n.serve("a", list(range(100, 113)))
    stats = n.settle()
    assert stats["ranks"] == 1 and stats["offloaded_blocks"] == 0 and stats["pending_offloads"] == 0
    n.agents[1] = TierAgent(n.subs[1], n.memory[1].region)
    n.serve("b", list(range(200, 213)))
    assert n.settle()["offloaded_blocks"] == 3


def test_a_rank_that_never_reports_fails_the_copy_and_its_load_fails_the_request(node: Any) -> None:
    """Rank 1's agent stops (a worker hung or gone): its copies time out. An offload's blocks are never served; a
    load's request is named by tier_failed and its blocks leave the prefix cache."""
    n = node("--tier-timeout", "1", tp=2)
    prompt = list(range(100, 113))
    n.serve("a", prompt)
    assert n.settle()["cached_blocks"] == 3
    n.evict_gpu(1000)
    n.agents[1].close()
    n.agents[1] = None
    adm = n.client.admit("b", prompt + [1])
    assert adm.num_host_tokens == 12
    n.subs[1].wait_for(n.client.last_seq)
    assert n.failed_loads() == ["b"]
    stats = n.client.stats()["host_tier"]
    assert stats["failed_loads"] == 1 and stats["pending_loads"] == 0
    n.client.free("b")
    again = n.client.admit("c", prompt + [2])
    assert again.num_host_tokens == 12, "the blocks the failed load was filling are not served from the GPU"
    n.client.check_integrity()


def test_an_agent_that_restarts_makes_the_daemon_forget_every_host_block(node: Any) -> None:
    n = node()
    n.serve("a", list(range(100, 113)))
    assert n.settle()["cached_blocks"] == 3
    n.agents[0].close()
    n.agents[0] = TierAgent(n.subs[0], n.memory[0].region)  # a new host buffer: the old blocks are gone
    stats = n.client.stats()["host_tier"]
    assert stats["cached_blocks"] == 0 and stats["ranks"] == 1
    n.evict_gpu(1000)
    assert n.client.admit("b", list(range(100, 114))).num_host_tokens == 0


def test_an_agent_restarted_on_its_host_file_brings_the_blocks_back_and_another_file_does_not(node: Any,
                                                                                             tmp_path: Any) -> None:
    """Host blocks in a shared file outlive the agent that wrote them: a new agent on the same file attaches
    with the same buffer, the daemon keeps the ready blocks, and a reload brings their bytes back from the file."""
    n = node()
    path = tmp_path / "host-rank0"
    n.agents[0].close()
    n.agents[0] = TierAgent(n.subs[0], n.memory[0].region, host_file=path)
    assert path.stat().st_size > 3 * n.spec.bytes_per_block
    prompt = list(range(100, 113))
    n.serve("a", prompt)
    assert n.settle()["cached_blocks"] == 3
    n.agents[0].close()
    n.agents[0] = TierAgent(n.subs[0], n.memory[0].region, host_file=path)  # the worker restarted
    assert n.client.stats()["host_tier"]["cached_blocks"] == 3
    n.evict_gpu(1000)
    assert n.serve("b", prompt + [1]).num_host_tokens == 12  # serve() checks the reloaded bytes
    n.agents[0].close()
    n.agents[0] = TierAgent(n.subs[0], n.memory[0].region, host_file=tmp_path / "another")
    assert n.client.stats()["host_tier"]["cached_blocks"] == 0
    n.evict_gpu(2000)
    assert n.client.admit("c", prompt + [2]).num_host_tokens == 0


def test_host_files_keep_their_id_for_the_same_geometry_and_start_over_for_another(tmp_path: Any) -> None:
    from kvcache.transfer.manager import HOST_FILE_DATA_OFFSET, map_host_file

    spec = make_spec("bf16")
    path = tmp_path / "host"
    region, first = map_host_file(path, spec, 4)
    write(region, 2, None, b"kept")
    assert path.stat().st_size == HOST_FILE_DATA_OFFSET + spec.cache_bytes(4)
    again, same = map_host_file(path, spec, 4)
    assert same == first and read(again, 2, None) == pattern(b"kept", None, len(read(again, 2, None)))
    bigger, other = map_host_file(path, spec, 5)
    assert other != first and path.stat().st_size == HOST_FILE_DATA_OFFSET + spec.cache_bytes(5)
    _, after = map_host_file(path, spec, 5)
    assert after == other
    path.write_bytes(b"not a host file")
    assert map_host_file(path, spec, 5)[1] not in (first, other)
    with pytest.raises(KVCacheError, match="host_file: cannot open '/nonexistent/dir/h'"):
        map_host_file("/nonexistent/dir/h", spec, 4)


def test_a_host_file_that_cannot_get_its_space_is_refused_by_name(tmp_path: Any) -> None:
    """No room for the file (here a file-size limit; on a full /dev/shm, the space reserved up front): one line
    naming the file, its size and why, instead of a SIGBUS at the first copy into it."""
    import subprocess
    import sys

    code = f"""
import resource, signal, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from test_tier import make_spec
from kvcache.allocator.errors import KVCacheError
from kvcache.transfer.manager import map_host_file
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
try:
    map_host_file({str(tmp_path / "host")!r}, make_spec("bf16"), 64)
except KVCacheError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith(f"host_file: cannot size '{tmp_path / 'host'}' ("), out.stdout + out.stderr


def test_a_full_tier_drops_its_least_recent_blocks_with_cpu_events(node: Any) -> None:
    """Host blocks announce themselves as vLLM KV events with medium CPU: stored when a copy lands, removed when
    the full tier reuses the least recent ones."""
    import msgpack

    from test_events import decode_event, replay_from

    n = node("--events", host_blocks=4)
    n.serve("a", list(range(100, 113)))  # 3 blocks
    n.settle()
    n.serve("b", list(range(200, 213)))  # 3 more: a's two least recent go
    stats = n.settle()
    assert stats["cached_blocks"] == 4 and stats["evicted_blocks"] == 2
    # Every batch from seq 0, replayed: the events of the copies counted above are published by now.
    cpu: dict[str, list[bytes]] = {"BlockStored": [], "BlockRemoved": []}
    for _seq, payload in replay_from(n.client.info()["events_replay_endpoint"], 0):
        for event in msgpack.unpackb(payload, raw=False)[1]:
            tag, fields = decode_event(event)
            if fields.get("medium") == "CPU":
                cpu[tag] += fields["block_hashes"]
    assert len(cpu["BlockStored"]) == 6 and len(set(cpu["BlockRemoved"])) == 2
    assert set(cpu["BlockRemoved"]) <= set(cpu["BlockStored"][:3]), "the first request's blocks went first"


@pytest.mark.parametrize("snapshots", [False, True])
def test_a_daemon_killed_and_restarted_from_its_journal_still_serves_its_host_blocks(node: Any, daemon: Any,
                                                                                  tmp_path: Any, snapshots: bool) -> None:
    """The host index is journaled with the manager (replayed from the log, or in a snapshot after every message):
    after kill -9 the agents (same epoch, same buffers) keep their blocks and a later admit still finds them."""
    journal = str(tmp_path / "journal")
    n = node("--journal", journal, *(("--snapshot-bytes", "1") if snapshots else ()))
    prompt = list(range(100, 113))
    n.serve("a", prompt)
    assert n.settle()["cached_blocks"] == 3
    n.evict_gpu(1000)
    assert n.settle()["cached_blocks"] == 3 + 8, "the filler's eight blocks are on host too"
    n.daemon.kill()
    restarted = daemon("--num-blocks", "8", "--block-size", str(BS), "--host-block-budget", "32", "--hash-seed", SEED,
                       "--journal", journal, folder=n.daemon.folder)
    assert restarted.endpoint == n.endpoint
    stats = n.client.stats()["host_tier"]
    assert stats["cached_blocks"] == 3 + 8 and stats["ranks"] == 1
    adm = n.serve("b", prompt + [5])
    assert adm.num_host_tokens == 12


def test_host_tier_ops_are_refused_by_name(node: Any, daemon: Any) -> None:
    n = node(tp=2)
    with pytest.raises(DaemonError, match="rank"):
        n.client.tier_attach(2, 1)
    with pytest.raises(DaemonError, match="ok"):
        n.client._single(n.client.batch().op("tier_done", job=0, rank=0, ok="yes"))
    plain = daemon("--num-blocks", "8", "--block-size", str(BS))
    with CacheClient(plain.endpoint, timeout=5) as other:
        with pytest.raises(DaemonError, match="no host tier"):
            other.tier_failed()


def test_stats_and_metrics_show_the_host_tier(node: Any) -> None:
    import subprocess
    import sys
    import urllib.request

    from test_metrics import free_port, scrape, value

    port = free_port()
    n = node("--metrics-port", str(port))
    prompt = list(range(100, 113))
    n.serve("a", prompt)
    n.settle()
    n.evict_gpu(1000)
    n.serve("b", prompt + [1])
    n.settle()
    out = subprocess.run([sys.executable, "-m", "kvcache", "stats", "--endpoint", n.endpoint], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert "host tier since start: offloaded 11   loaded 3   hit tokens 12" in out, out
    assert "1 rank(s) attached" in out
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        s = scrape(reply.read())
    assert value(s, "kvcache_host_tier_blocks_total", event="loaded") == 3
    assert value(s, "kvcache_host_tier_blocks_total", event="hit_tokens") == 12
    assert value(s, "kvcache_host_tier_state_blocks", state="cached") == 11
    assert value(s, "kvcache_host_tier_copies_in_flight", kind="load") == 0
    assert value(s, "kvcache_host_tier_held_gpu_blocks") == 0


# ---------------------------------------------------------------------- the daemon's decisions, as a state machine

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

from kvcache.allocator import Full, KVCacheManager, Window  # noqa: E402
from kvcache.host_tier import DaemonTier  # noqa: E402


class DaemonTierMachine(RuleBasedStateMachine):
    """A manager with a DaemonTier and two ranks that copy when they like, fail, restart or never report.

    Each rank's memory is modelled by what each (row, block) holds: the hash whose KV it is. Copies run in order
    per rank, and every rank runs what it was ordered before a step writes (the workers' rule). Checked: a
    request's cached blocks hold their hashes on every rank; a findable host block holds its hash on every rank;
    the tier's and the manager's books agree.
    """

    ROWS: list[Any] = [Full()]
    UNORDERED = False  # a new request's blocks are written before the workers run earlier copies (PD decode)
    BLOCKS = 10

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(self.BLOCKS, 2, self.ROWS, hash_seed=b"machine")
        self.tier = DaemonTier(self.manager, 8, tp=2, unordered_writes=self.UNORDERED)
        self.manager.attach_tier(self.tier)
        self.hasher = BlockHasher(2, "sha256", b"machine")
        rows = self.manager.num_rows
        self.gpu = [np.full((rows, self.BLOCKS), None, dtype=object) for _ in range(2)]
        self.host = [np.full((rows, 8), None, dtype=object) for _ in range(2)]
        self.pending: list[list[dict[str, Any]]] = [[], []]
        self.agents = [1, 2]
        self.buffers = [1, 2]
        for rank in range(2):
            self.tier.attach(rank, self.agents[rank], self.buffers[rank])
        self.live: dict[str, list[int]] = {}
        self.count = 0

    def _orders(self) -> None:
        for order in self.tier.take_orders():
            for rank in range(2):
                self.pending[rank].append(order)

    def _run(self, rank: int, order: dict[str, Any]) -> None:
        src, dst = order["src"], order["dst"]
        r, c = np.nonzero(src >= 0)
        source, target = (self.gpu, self.host) if order["kind"] == "offload" else (self.host, self.gpu)
        target[rank][r, dst[r, c]] = source[rank][r, src[r, c]]
        self.tier.report(order["job"], rank, True)

    def _catch_up(self) -> None:
        for rank in range(2):
            while self.pending[rank]:
                self._run(rank, self.pending[rank].pop(0))

    def _forget_failed(self) -> None:
        for rid in self.tier.take_failed():
            if rid in self.live:
                del self.live[rid]
                self.manager.free(rid)
                self._orders()

    @rule(prefix=st.sampled_from([(), (1, 2), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6), (7, 8, 9)]),
          tail=st.lists(st.integers(1, 9), min_size=1, max_size=3), fail_load=st.sampled_from([None, 0, 1]))
    def admit_and_step(self, prefix: tuple[int, ...], tail: list[int], fail_load: int | None) -> None:
        """Admit, then the step: every copy ordered so far runs first. ``fail_load``: that rank fails the load
        this admit ordered, if any (the request must then come back from tier_failed, never be stepped)."""
        tokens = list(prefix) + tail
        rid = f"r{self.count}"
        self.count += 1
        adm = self.manager.admit(rid, tokens)
        self._orders()
        if adm is None:
            return
        self.live[rid] = tokens
        if fail_load is not None and adm.num_host_tokens:
            order = self.pending[fail_load].pop()
            assert order["kind"] == "load"
            self.tier.report(order["job"], fail_load, False, "copy failed")
            assert rid in self.tier._failed
        keys = self.hasher.hash_blocks(np.asarray(tokens, dtype=np.uint32))
        cached = adm.num_cached_tokens // 2
        table = adm.table
        if self.UNORDERED:  # the prefill node's KV lands before the workers run what was ordered earlier
            self._write_new(table, keys, cached, rid)
        self._catch_up()
        self._forget_failed()
        if rid not in self.live:
            return
        for col in range(cached):
            for row in range(table.shape[0]):
                block = int(table[row, col])
                for rank in range(2):
                    if block >= 0:
                        assert self.gpu[rank][row, block] == keys[col], f"{rid} col {col} rank {rank}: stale KV"
        if self.UNORDERED:
            new = [self.gpu[rank][row, int(table[row, col])] for col in range(cached, table.shape[1])
                   for row in range(table.shape[0]) if table[row, col] >= 0 for rank in range(2)]
            self._write_new(table, keys, cached, rid)
            assert new == [self.gpu[rank][row, int(table[row, col])] for col in range(cached, table.shape[1])
                           for row in range(table.shape[0]) if table[row, col] >= 0 for rank in range(2)], \
                f"{rid}: a copy ordered earlier overwrote what the prefill node sent"
        else:
            self._write_new(table, keys, cached, rid)

    def _write_new(self, table: np.ndarray, keys: list[bytes], cached: int, rid: str) -> None:
        """The request's KV from column ``cached`` on, on every rank (a step's writes, or the prefill node's)."""
        for col in range(cached, table.shape[1]):
            for row in range(table.shape[0]):
                block = int(table[row, col])
                if block >= 0:
                    for rank in range(2):
                        self.gpu[rank][row, block] = keys[col] if col < len(keys) else ("partial", rid)

    @rule(prefix=st.sampled_from([(1, 2), (1, 2, 3, 4), (7, 8, 9)]), tail=st.lists(st.integers(1, 9), max_size=2))
    def admit_and_cancel(self, prefix: tuple[int, ...], tail: list[int]) -> None:
        """A request admitted and dropped before any step (a cancelled reservation: nothing was computed or sent
        past its hit): its load, if it has one, is still to run when its blocks go back."""
        rid = f"r{self.count}"
        self.count += 1
        adm = self.manager.admit(rid, list(prefix) + tail)
        if adm is not None:
            self.manager.discard(rid, adm.num_cached_tokens // 2)
        self._orders()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: Any) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        del self.live[rid]
        self.manager.free(rid)
        self._orders()

    @precondition(lambda self: any(self.pending))
    @rule(rank=st.integers(0, 1), data=st.data())
    def copy_some(self, rank: int, data: Any) -> None:
        for _ in range(data.draw(st.integers(1, max(1, len(self.pending[rank]))))):
            if self.pending[rank]:
                self._run(rank, self.pending[rank].pop(0))

    @precondition(lambda self: any(self.pending))
    @rule(rank=st.integers(0, 1))
    def fail_next(self, rank: int) -> None:
        if self.pending[rank]:
            order = self.pending[rank].pop(0)
            self.tier.report(order["job"], rank, False, "copy failed")

    @precondition(lambda self: any(self.pending))
    @rule(rank=st.integers(0, 1))
    def expire_next(self, rank: int) -> None:
        """A rank's oldest copy passes its deadline (the rank never runs it: it hung)."""
        if self.pending[rank]:
            order = self.pending[rank].pop(0)
            self.tier.expire([order["job"]])

    @rule(rank=st.integers(0, 1), host_file=st.booleans())
    def worker_restarts(self, rank: int, host_file: bool) -> None:
        """A restarted worker: its GPU cache holds nothing, it never runs the old agent's orders, and its host
        buffer is empty, or (``host_file``) the file it shares with the old one, bytes as they were."""
        self.agents[rank] += 2
        self.gpu[rank][:] = None
        if not host_file:
            self.host[rank][:] = None
            self.buffers[rank] = self.agents[rank]
        self.pending[rank] = []
        self.tier.attach(rank, self.agents[rank], self.buffers[rank])

    @rule()
    def reset(self) -> None:
        self.manager.reset_prefix_cache()

    @rule()
    def take_failed(self) -> None:
        self._forget_failed()

    @invariant()
    def books_agree(self) -> None:
        self.tier.check_integrity()
        self.manager.check_integrity()

    @invariant()
    def findable_host_blocks_hold_their_hash_on_every_rank(self) -> None:
        rows, blocks = self.tier._index.held_pairs()
        if not rows.size:
            return
        hashes, _ = self.tier._index.hashes_at(rows, blocks)
        for r, b, h in zip(rows.tolist(), blocks.tolist(), hashes):
            if self.tier._ready[b]:
                for rank in range(2):
                    assert self.host[rank][r, b] == bytes(h), f"host block {b} row {r} rank {rank}: not its hash"


class HeadWiseDaemonTierMachine(DaemonTierMachine):
    ROWS = [Full(), Window(3, 1)]


TestDaemonTier = DaemonTierMachine.TestCase
TestDaemonTier.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestHeadWiseDaemonTier = HeadWiseDaemonTierMachine.TestCase
TestHeadWiseDaemonTier.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_a_host_hit_cancelled_twice_before_the_workers_run_loads_twice_into_the_same_blocks() -> None:
    """A reservation with a host hit dropped before its load ran frees its blocks uncached; the next admit's load
    takes the same blocks while the first is still ordered. The books allow it (workers run the loads in order),
    and the request that finally steps reads the host's KV on every rank."""
    m = HeadWiseDaemonTierMachine()
    m.admit_and_step(fail_load=None, prefix=(1, 2, 3, 4), tail=[1])
    m.free(data=_Draws(["r0"]))
    m._catch_up()
    m.worker_restarts(host_file=True, rank=0)  # the GPU prefixes are forgotten, the host blocks stay
    m.admit_and_cancel(prefix=(1, 2, 3, 4), tail=[])
    first = set(m.tier._jobs)
    m.admit_and_cancel(prefix=(1, 2, 3, 4), tail=[])
    assert len(m.tier._jobs) == len(first) + 1, "the second admit did not order a load of its own"
    (second,) = set(m.tier._jobs) - first
    (earlier,) = first
    assert np.array_equal(m.tier._jobs[earlier].gpu >= 0, m.tier._jobs[second].gpu >= 0)
    assert (m.tier._jobs[earlier].gpu == m.tier._jobs[second].gpu).any(), "the loads share no GPU block"
    m.books_agree()
    m.admit_and_step(fail_load=None, prefix=(1, 2, 3, 4), tail=[5])  # asserts each cached column's KV, per rank
    m.manager.check_integrity()
    assert not m.tier._jobs
    m.findable_host_blocks_hold_their_hash_on_every_rank()


class _Draws:
    """Hypothesis's ``data`` for a rule called by hand: the values to draw, in order."""

    def __init__(self, values: list[Any]) -> None:
        self.values = list(values)

    def draw(self, strategy: Any) -> Any:
        return self.values.pop(0)


class DecodeDaemonTierMachine(DaemonTierMachine):
    """A PD decode daemon: a reservation's blocks are written over NIXL before its workers run what was ordered
    earlier, so an offload still reading a block it took keeps nothing of it, and a load whose request ended first
    keeps its blocks until every rank is done with it."""

    UNORDERED = True
    BLOCKS = 6  # few: a reservation takes blocks freed a moment ago


TestDecodeDaemonTier = DecodeDaemonTierMachine.TestCase
TestDecodeDaemonTier.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("unordered", [False, True])
def test_on_a_decode_daemon_an_offload_keeps_nothing_of_a_block_a_reservation_took_before_it_ran(unordered) -> None:
    """On a PD decode daemon the prefill node writes reserved blocks over NIXL, outside the workers' order: an
    offload that had not run when its source blocks got a new owner keeps nothing of them. Elsewhere the workers
    run the offload before the new owner writes, and the copies stay."""
    manager = KVCacheManager(4, 2, [Full()], hash_seed=b"decode")
    tier = DaemonTier(manager, 8, tp=1, unordered_writes=unordered)
    manager.attach_tier(tier)
    tier.attach(0, 1)
    manager.admit("a", [1, 2, 3, 4, 5])
    manager.free("a")
    (offload,) = tier.take_orders()
    assert offload["kind"] == "offload" and (offload["src"] >= 0).sum() == 2
    state = tier.__getstate__()
    del state["_reading"]  # a journal snapshot from before the tier kept it: rebuilt from the offloads in flight
    older = DaemonTier.__new__(DaemonTier)
    older.__setstate__(state)
    assert np.array_equal(older._reading, tier._reading) and (tier._reading >= 0).sum() == 2
    assert manager.admit("b", [9] * 8) is not None  # every GPU block: the two the offload reads among them
    tier.report(offload["job"], 0, True)
    stats = tier.stats()
    assert (stats.cached_blocks, stats.offloaded_blocks) == ((0, 0) if unordered else (2, 2)), stats
    manager.free("b")
    assert manager.lookup_tiers([1, 2, 3, 4, 5]) == (0, 0 if unordered else 4)
    manager.check_integrity()


@pytest.mark.parametrize("unordered", [False, True])
def test_on_a_decode_daemon_a_load_whose_request_ended_first_keeps_its_blocks_until_it_ends(unordered) -> None:
    """A reservation cancelled before its workers ran its load: on a decode daemon the load's GPU blocks stay out
    of the pool until the load is reported (the next owner's KV comes over NIXL, and the late load would overwrite
    it); a load that timed out keeps them while its rank may still run it. Elsewhere the workers' order makes the
    blocks free at once."""
    manager = KVCacheManager(4, 2, [Full()], hash_seed=b"decode")
    tier = DaemonTier(manager, 16, tp=1, unordered_writes=unordered)
    manager.attach_tier(tier)
    tier.attach(0, 1)
    prompt = [1, 2, 3, 4, 5]
    for rid, tokens in (("a", prompt), ("f", [9] * 8)):  # a's blocks to host, then every GPU block taken over
        manager.admit(rid, tokens)
        manager.free(rid)
        for order in tier.take_orders():
            tier.report(order["job"], 0, True)
    assert manager.admit("b", prompt).num_host_tokens == 4
    (load,) = tier.take_orders()
    manager.free("b")
    held = 2 if unordered else 0
    assert int(manager.num_free_blocks.min()) == 4 - held
    assert (manager.admit("c", [7] * 8) is None) == unordered
    manager.check_integrity()
    if not unordered:
        manager.free("c")
        for order in tier.take_orders():
            tier.report(order["job"], 0, True)
    tier.report(load["job"], 0, True)
    assert int(manager.num_free_blocks.min()) == 4
    manager.check_integrity()
    assert manager.admit("d", prompt).num_host_tokens == 4  # the host copy still serves
    (late,) = tier.take_orders()
    manager.free("d")
    tier.expire([late["job"]])
    assert int(manager.num_free_blocks.min()) == 4 - held
    manager.check_integrity()


@pytest.mark.parametrize("then", ["the other rank reports", "the other rank restarts", "its deadline passes"])
def test_on_a_decode_daemon_a_failed_load_keeps_its_blocks_until_every_rank_is_done_with_it(then: str) -> None:
    """One rank fails a load the other has not run yet: the request fails at once, but the load's GPU blocks stay
    out of the pool until the other rank is done with it (reports, or restarts); past the deadline too."""
    manager = KVCacheManager(4, 2, [Full()], hash_seed=b"decode")
    tier = DaemonTier(manager, 16, tp=2, unordered_writes=True)
    manager.attach_tier(tier)
    tier.attach(0, 1)
    tier.attach(1, 2)
    prompt = [1, 2, 3, 4, 5]
    for rid, tokens in (("a", prompt), ("f", [9] * 8)):
        manager.admit(rid, tokens)
        manager.free(rid)
        for order in tier.take_orders():
            for rank in (0, 1):
                tier.report(order["job"], rank, True)
    assert manager.admit("b", prompt).num_host_tokens == 4
    (load,) = tier.take_orders()
    tier.report(load["job"], 0, False, "copy failed")
    assert tier.take_failed() == ["b"]
    manager.free("b")
    assert int(manager.num_free_blocks.min()) == 2 and tier.pending_jobs() == [load["job"]]
    manager.check_integrity()
    if then == "the other rank reports":
        tier.report(load["job"], 1, True)
    elif then == "the other rank restarts":
        tier.attach(1, 3)
    else:
        tier.expire([load["job"]])
    assert int(manager.num_free_blocks.min()) == (2 if then == "its deadline passes" else 4)
    assert tier.pending_jobs() == [] and tier.stats().held_gpu_blocks == (2 if then == "its deadline passes" else 0)
    manager.check_integrity()


@pytest.mark.parametrize("then", ["reports late", "restarts"])
def test_a_timed_out_copys_blocks_come_back_once_the_rank_that_hung_is_done_with_it(then: str) -> None:
    """A decode daemon's load and an offload pass their deadline while rank 1 hangs: the load's GPU blocks stay held
    and the offload's host blocks retired while rank 1 may still write them. Once it reports them late, or restarts
    (a new agent), they come back: both pools whole, the books agree."""
    manager = KVCacheManager(4, 2, [Full()], hash_seed=b"decode")
    tier = DaemonTier(manager, 16, tp=2, unordered_writes=True)
    manager.attach_tier(tier)
    tier.attach(0, 1)
    tier.attach(1, 2)
    prompt = [1, 2, 3, 4, 5]
    for rid, tokens in (("a", prompt), ("f", [9] * 8)):
        manager.admit(rid, tokens)
        manager.free(rid)
        for order in tier.take_orders():
            for rank in (0, 1):
                tier.report(order["job"], rank, True)
    assert manager.admit("b", prompt).num_host_tokens == 4
    manager.free("b")
    jobs = [order["job"] for order in tier.take_orders()]  # the load, and nothing new to offload
    assert manager.admit("c", [6] * 4) is not None
    manager.free("c")
    jobs += [order["job"] for order in tier.take_orders()]  # c's offload: what was not on host yet
    before = tier.stats()
    for job in jobs:
        tier.report(job, 0, True)
    tier.expire(jobs)
    stats = tier.stats()
    assert stats.held_gpu_blocks == 2 and stats.retired_blocks == 2 and int(manager.num_free_blocks.min()) == 2
    manager.check_integrity()
    tier.check_integrity()
    for job in jobs:
        if then == "reports late":
            tier.report(job, 1, True)
    if then == "restarts":
        tier.attach(1, 3, 2)  # the same buffer: its ready blocks stay
    stats = tier.stats()
    assert (stats.held_gpu_blocks, stats.retired_blocks, int(manager.num_free_blocks.min())) == (0, 0, 4)
    assert stats.free_blocks == 16 and stats.cached_blocks == before.cached_blocks  # cached ones count as free
    manager.check_integrity()
    tier.check_integrity()


WORKER = """
import sys, time
sys.path.insert(0, {tests!r})
from test_tier import Memory, make_spec
from kvcache.tier_agent import TierAgent
from kvcache.worker import TableSubscriber

sub = TableSubscriber({endpoint!r}, rank={rank}, tp_size=2)
agent = TierAgent(sub, Memory(make_spec("bf16", tp_size=2), 8, seed={rank}).region, host_file={host_file!r})
print("attached", flush=True)
while True:
    sub.poll(0.05)
"""


def test_a_worker_killed_with_sigkill_fails_its_copies_and_the_daemon_serves_on(node: Any) -> None:
    """Rank 1 is a worker process of its own; SIGKILL it with copies ordered: they time out, the load's request
    comes back from tier_failed, and a new worker on that rank (a new host buffer) starts the tier over."""
    import subprocess
    import sys
    from pathlib import Path

    n = node("--tier-timeout", "1", tp=2, agents=False)
    n.agents[0] = TierAgent(n.subs[0], n.memory[0].region)
    tests = str(Path(__file__).resolve().parent)

    def worker() -> subprocess.Popen:
        code = WORKER.format(tests=tests, endpoint=n.endpoint, rank=1, host_file=None)
        process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert process.stdout.readline().strip() == "attached"
        return process

    rank1 = worker()
    try:
        prompt = list(range(100, 113))
        n.memory = n.memory[:1]  # this process computes rank 0's part; the worker's memory is its own
        n.subs, n.agents = n.subs[:1], n.agents[:1]
        n.serve("a", prompt)
        deadline = time.monotonic() + 10
        while n.client.stats()["host_tier"]["cached_blocks"] < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert n.client.stats()["host_tier"]["cached_blocks"] == 3, "both ranks reported the offload"
        n.evict_gpu(1000)
        rank1.kill()
        rank1.wait(5)
        adm = n.client.admit("b", prompt + [1])
        assert adm.num_host_tokens == 12
        assert n.failed_loads() == ["b"]
        n.client.free("b")
        rank1 = worker()  # a new agent on rank 1: the old host blocks are gone
        stats = n.client.stats()["host_tier"]
        assert stats["cached_blocks"] == 0 and stats["ranks"] == 2 and stats["pending_loads"] == 0
        n.serve("c", list(range(300, 313)))
        deadline = time.monotonic() + 10
        while n.client.stats()["host_tier"]["cached_blocks"] < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert n.client.stats()["host_tier"]["cached_blocks"] == 3
        n.client.check_integrity()
    finally:
        rank1.kill()
        rank1.wait(5)


def test_a_worker_killed_and_restarted_on_its_host_file_fails_the_copies_in_flight_at_once_and_keeps_the_rest(
        node: Any, tmp_path: Any) -> None:
    """Rank 1 is a worker process keeping its host blocks in a file; SIGKILL it with a load ordered, start it again
    on the same file: the load fails at its attach (not at the 60 s deadline), the blocks that were ready stay,
    and the next hit reloads them on both ranks."""
    import subprocess
    import sys
    from pathlib import Path

    n = node("--tier-timeout", "60", tp=2, agents=False)
    n.agents[0] = TierAgent(n.subs[0], n.memory[0].region)
    tests = str(Path(__file__).resolve().parent)
    host_file = str(tmp_path / "host-rank1")

    def worker() -> subprocess.Popen:
        code = WORKER.format(tests=tests, endpoint=n.endpoint, rank=1, host_file=host_file)
        process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert process.stdout.readline().strip() == "attached"
        return process

    def cached(count: int) -> dict[str, Any]:
        """The tier's stats once it holds ``count`` blocks and no copy is in flight (rank 1 reports on its own)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = n.client.stats()["host_tier"]
            if stats["cached_blocks"] >= count and stats["pending_loads"] == stats["pending_offloads"] == 0:
                break
            time.sleep(0.02)
        return stats

    rank1 = worker()
    try:
        prompt = list(range(100, 113))
        n.memory, n.subs, n.agents = n.memory[:1], n.subs[:1], n.agents[:1]  # rank 1's memory is the worker's
        n.serve("a", prompt)
        assert cached(3)["cached_blocks"] == 3
        n.evict_gpu(1000)
        before = cached(3 + n.daemon_blocks)
        rank1.kill()
        rank1.wait(5)
        adm = n.client.admit("b", prompt + [1])
        assert adm.num_host_tokens == 12
        started = time.monotonic()
        rank1 = worker()  # the same file: the same buffer
        assert n.failed_loads(timeout=5) == ["b"] and time.monotonic() - started < 30
        stats = n.client.stats()["host_tier"]
        assert stats["cached_blocks"] == before["cached_blocks"] and stats["pending_loads"] == 0
        n.client.free("b")
        again = n.serve("c", prompt + [2])  # rank 0's reloaded bytes are checked; rank 1 reports its part
        assert again.num_host_tokens == 12
        stats = cached(0)
        assert stats["loaded_blocks"] == before["loaded_blocks"] + 3
        assert stats["failed_loads"] == before["failed_loads"] + 1
        assert n.client.tier_failed() == []
        n.client.check_integrity()
    finally:
        rank1.kill()
        rank1.wait(5)

"""Who may send which op, against a real `kvcache serve`: the daemon's own ops from no client, a host-tier report
only from the agent attached as its rank, a decode rank's endpoint only from the worker that attached it, a revoke
that says when the daemon did not take it, and a SIGHUP during start-up that does not end the daemon."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcache.cli import main
from kvcache.client import CacheClient, DaemonError, DaemonUnavailable
from kvcache.protocol import OP_CALLERS
from kvcache.tier_agent import TierAgent

from test_auth import start_curve_daemon
from test_host_tier import WORKER, node  # noqa: F401 (node: the fixture)

PROMPT = list(range(100, 113))  # three full blocks and one token


def orders_of(sub: Any) -> list[dict[str, Any]]:
    """The host-tier copies ordered in the deltas ``sub`` applies from now on (its rank's agent is elsewhere)."""
    orders: list[dict[str, Any]] = []
    sub.on_delta = lambda msg: orders.extend(msg.get("tier") or [])
    return orders


def wait_until(check: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.05)


def test_every_op_has_a_declared_caller() -> None:
    """Each op the protocol describes names who may send it, in one table."""
    import kvcache.protocol as protocol

    described = set(re.findall(r'"op": "(\w+)"', protocol.__doc__))
    described |= {"usage", "stats", "info", "ping", "reset_prefix_cache", "tier_attach", "tier_done", "tier_expire",
                  "tier_failed"}
    assert described - set(OP_CALLERS) == set()
    assert {op for op, caller in OP_CALLERS.items() if caller == "daemon"} == {"tier_expire"}


def test_no_client_may_send_the_daemons_own_tier_expire_and_retired_blocks_come_back_at_a_new_attach(node) -> None:
    """tier_expire is the daemon's own op (its deadline for host-tier copies): a client's, even one naming itself
    after the daemon's expiry, is refused by name and retires nothing. The daemon's own expiry still retires a late
    copy's host blocks, and they come back once the rank that never reported attaches anew."""
    n = node("--tier-timeout", "4", agents=False)
    rank0 = CacheClient(n.endpoint, timeout=5)
    rank0.tier_attach(0, 11)  # an agent that never copies: its offloads stay in flight
    orders = orders_of(n.subs[0])
    n.serve("a", PROMPT)
    assert [o["kind"] for o in orders] == ["offload"]
    job = orders[0]["job"]
    for name in (None, "kvcache-tier-expiry"):
        with CacheClient(n.endpoint, timeout=5, name=name) as intruder:
            with pytest.raises(DaemonError, match="tier_expire is the daemon's own op"):
                intruder.batch().op("tier_expire", jobs=[job]).send()
    stats = n.client.stats()["host_tier"]
    assert (stats["retired_blocks"], stats["pending_offloads"], stats["free_blocks"]) == (0, 1, 29)
    wait_until(lambda: n.client.stats()["host_tier"]["retired_blocks"] == 3)  # the daemon's own, at the deadline
    assert n.client.stats()["host_tier"]["free_blocks"] == 29
    n.client.check_integrity()
    rank0.tier_attach(0, 12)  # the worker restarted: the old agent writes nothing late
    stats = n.client.stats()["host_tier"]
    assert (stats["retired_blocks"], stats["free_blocks"], stats["pending_offloads"]) == (0, 32, 0)
    n.client.check_integrity()
    rank0.close()


def test_a_host_tier_report_counts_only_from_the_agent_attached_as_its_rank(node) -> None:
    """Rank 1's copy is reported done by rank 0's agent, by a client that never attached and by rank 1's agent
    after its replacement: each is refused, naming who may send it, and the offload stays unfindable. Rank 1's
    current agent's report makes it findable."""
    n = node("--tier-timeout", "60", tp=2, agents=False)
    n.agents[0] = TierAgent(n.subs[0], n.memory[0].region)
    rank1 = CacheClient(n.endpoint, timeout=5)
    rank1.tier_attach(1, 21)
    orders = orders_of(n.subs[1])
    n.serve("a", PROMPT)
    assert n.agents[0].drain(10)
    job = orders[-1]["job"]
    stats = n.client.stats()["host_tier"]
    assert (stats["pending_offloads"], stats["cached_blocks"]) == (1, 0)
    refusal = "tier_done for rank 1 counts only from the agent attached as rank 1 now"
    def report(client: CacheClient, agent: int | None) -> None:
        fields = {} if agent is None else {"agent": agent}
        client.batch().op("tier_done", job=job, rank=1, ok=True, **fields).send()

    with pytest.raises(DaemonError, match=refusal):  # rank 0's agent, for rank 1
        report(n.agents[0]._client, n.agents[0].agent_id)
    with CacheClient(n.endpoint, timeout=5) as stranger:
        with pytest.raises(DaemonError, match=refusal):
            report(stranger, 0)
        with pytest.raises(DaemonError, match=refusal):  # no key at all
            report(stranger, None)
    stats = n.client.stats()["host_tier"]
    assert (stats["pending_offloads"], stats["cached_blocks"]) == (1, 0), "a refused report changed nothing"
    rank1.tier_attach(1, 22)  # rank 1's worker restarted: the old agent (21) is stale
    n.serve("b", list(range(200, 213)))
    assert n.agents[0].drain(10)
    job = orders[-1]["job"]
    with pytest.raises(DaemonError, match=refusal):
        report(rank1, 21)
    assert n.client.stats()["host_tier"]["cached_blocks"] == 0
    report(rank1, 22)
    assert n.client.stats()["host_tier"]["cached_blocks"] == 3
    n.client.check_integrity()
    rank1.close()


def test_a_rank_that_hangs_past_the_deadline_and_returns_leaves_the_pools_whole(node) -> None:
    """Rank 1 is a worker process, stopped (SIGSTOP) while an offload is ordered: the copy times out and its host
    blocks are retired, since a late write may land. The worker continues (SIGCONT), copies late and reports: the
    blocks come back, and the GPU pool and the host tier are whole (free counts, check_integrity)."""
    n = node("--tier-timeout", "1", tp=2, agents=False)
    n.agents[0] = TierAgent(n.subs[0], n.memory[0].region)
    code = WORKER.format(tests=str(Path(__file__).resolve().parent), endpoint=n.endpoint, rank=1, host_file=None)
    rank1 = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert rank1.stdout.readline().strip() == "attached"
        n.memory, n.subs, n.agents = n.memory[:1], n.subs[:1], n.agents[:1]  # rank 1's part is the worker's
        adm = n.client.admit("a", PROMPT)
        n.step()
        n.compute(adm.table, PROMPT, 0)
        rank1.send_signal(signal.SIGSTOP)
        n.client.free("a")  # the offload is ordered while rank 1 hangs
        n.step()
        wait_until(lambda: n.client.stats()["host_tier"]["retired_blocks"] == 3)
        stats = n.client.stats()["host_tier"]
        assert (stats["free_blocks"], stats["cached_blocks"], stats["pending_offloads"]) == (29, 0, 0)
        rank1.send_signal(signal.SIGCONT)
        wait_until(lambda: n.client.stats()["host_tier"]["retired_blocks"] == 0)
        stats = n.client.stats()["host_tier"]
        assert (stats["free_blocks"], stats["cached_blocks"], stats["held_gpu_blocks"]) == (32, 0, 0)
        assert n.client.stats()["free_blocks"] == n.daemon_blocks
        n.client.check_integrity()
        n.serve("b", list(range(300, 313)))  # the tier serves on: both ranks report the next offload
        wait_until(lambda: n.client.stats()["host_tier"]["cached_blocks"] == 3)
        n.client.check_integrity()
    finally:
        rank1.send_signal(signal.SIGCONT)
        rank1.kill()
        rank1.wait(5)


def test_a_decode_ranks_endpoint_changes_only_for_the_worker_that_attached_it(daemon, tmp_path) -> None:
    """The first attach of a decode rank claims it with the attaching client's key. Another client, with its own
    key or none, cannot point the prefill writers elsewhere; the worker that attached it can, after the daemon's
    kill -9 and restart from its journal too."""
    flags = ("--num-blocks", "32", "--block-size", "4", "--role", "decode", "--tp", "2", "--journal",
             str(tmp_path / "journal"))
    d = daemon(*flags)
    with CacheClient(d.endpoint, timeout=5) as worker, CacheClient(d.endpoint, timeout=5) as intruder:
        worker.attach(0, "tcp://127.0.0.1:1")
        worker.attach(1, "tcp://127.0.0.1:2")
        refusal = ("attach of decode rank 0 refused: the rank is attached already; who may change its endpoint: the "
                   "worker that attached it")
        with pytest.raises(DaemonError, match=refusal):
            intruder.attach(0, "tcp://10.0.0.66:1")
        with pytest.raises(DaemonError, match=refusal):
            intruder.batch().op("attach", rank=0, endpoint="tcp://10.0.0.66:1").send()
        with pytest.raises(DaemonError, match=refusal):
            intruder.attach(0, "tcp://10.0.0.66:1", key=0)
        assert list(worker.reserve("r", list(range(9))).receivers) == ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]
        worker.attach(0, "tcp://127.0.0.1:3")
        assert worker.reserve("s", list(range(9))).receivers[0] == "tcp://127.0.0.1:3"
        d.kill()
        daemon(*flags, folder=d.folder)
        with pytest.raises(DaemonError, match=refusal):
            intruder.attach(0, "tcp://10.0.0.66:1")
        worker.attach(0, "tcp://127.0.0.1:4")
        assert worker.reserve("t", list(range(9))).receivers[0] == "tcp://127.0.0.1:4"


def test_with_curve_a_decode_rank_is_owned_by_the_certificate_that_attached_it(daemon, tmp_path,
                                                                               tcp_endpoint) -> None:
    """A CURVE client claims a decode rank with a key derived from its secret certificate: a worker restarted with
    the same certificate (a new client) changes its rank's endpoint; a client of another allowed certificate
    cannot."""
    curve = start_curve_daemon(daemon, tmp_path, tcp_endpoint, "worker", "other",
                               flags=("--num-blocks", "32", "--block-size", "4", "--role", "decode")).allowed
    with CacheClient(tcp_endpoint, timeout=5, curve=curve["worker"]) as first:
        first.attach(0, "tcp://127.0.0.1:1")
    with CacheClient(tcp_endpoint, timeout=5, curve=curve["worker"]) as restarted:
        restarted.attach(0, "tcp://127.0.0.1:2")
    with CacheClient(tcp_endpoint, timeout=5, curve=curve["other"]) as other:
        with pytest.raises(DaemonError, match="attach of decode rank 0 refused"):
            other.attach(0, "tcp://10.0.0.66:1")
        assert list(other.reserve("r", list(range(9))).receivers) == ["tcp://127.0.0.1:2"]


def test_keys_revoke_fails_naming_the_reason_when_the_daemon_does_not_take_the_folder(daemon, tmp_path, tcp_endpoint,
                                                                                   capsys) -> None:
    """A stray file that is no certificate in clients/ makes the daemon refuse to read the folder again: revoke
    exits non-zero naming the daemon's reason, and says the client stays allowed (it does). Once the folder is
    fixed, a revoke waits for the daemon's reload and succeeds, and the client is refused."""
    c = start_curve_daemon(daemon, tmp_path, tcp_endpoint, "gone", "kept")
    clients = c.keys / "clients"
    pid = str(c.daemon.process.pid)
    with CacheClient(tcp_endpoint, timeout=5, curve=c.allowed["gone"]) as gone:
        assert gone.ping()
        (clients / "stray.key").write_text("not a certificate\n")
        assert main(["keys", "revoke", str(c.keys), "--name", "gone", "--pid", pid]) == 2
        err = capsys.readouterr().err
        assert f"kvcache serve pid {pid} refused to read {clients} again" in err and "stray.key" in err, err
        assert "client 'gone' stays allowed" in err
        assert gone.ping(), "the daemon kept the keys it had: the revoked client is still allowed"
        (clients / "stray.key").unlink()
        with CacheClient(tcp_endpoint, timeout=5, curve=c.allowed["kept"]) as kept:
            assert main(["keys", "revoke", str(c.keys), "--name", "kept", "--pid", pid]) == 0
            assert f"read {clients} again" in capsys.readouterr().out
            kept.timeout = 0.5
            with pytest.raises(DaemonUnavailable):  # taken at once: revoke returned after the daemon's reload
                kept.ping()


def test_keys_revoke_fails_when_the_daemon_never_reports_a_reload(daemon, tmp_path, capsys, monkeypatch) -> None:
    """A daemon without a clients folder reads nothing on SIGHUP: revoke waits for its report, then fails saying
    so, instead of printing success."""
    from kvcache.keys import create_keys

    import kvcache.keys as keys

    create_keys(tmp_path / "keys", "a")
    d = daemon("--num-blocks", "8", "--block-size", "4")
    monkeypatch.setattr(keys, "REVOKE_WAIT_S", 1.0, raising=False)
    assert main(["keys", "revoke", str(tmp_path / "keys"), "--name", "a", "--pid", str(d.process.pid)]) == 2
    assert f"did not report reading {tmp_path / 'keys' / 'clients'} again" in capsys.readouterr().err
    assert d.process.poll() is None


def _catches_sighup(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGHUP (/proc's SigCgt mask)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, re.M).group(1), 16)
    return bool(caught >> (signal.SIGHUP - 1) & 1)


def test_a_sighup_during_start_up_does_not_end_the_daemon(tmp_path) -> None:
    """The daemon catches SIGHUP before it builds its pool and binds its sockets (a start can take seconds); SIGHUPs
    sent from then on, while it starts, neither end it nor stop it from serving."""
    endpoint = f"ipc://{tmp_path}/k.sock"
    process = subprocess.Popen([sys.executable, "-m", "kvcache", "serve", "--endpoint", endpoint, "--num-blocks",
                                "4000000", "--block-size", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        deadline = time.monotonic() + 30
        while not _catches_sighup(process.pid):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate(timeout=5)
            time.sleep(0.001)
        assert not (tmp_path / "k.sock").exists(), "SIGHUP was caught only once the daemon had bound its sockets"
        sent = 0
        while not (tmp_path / "k.sock").exists() and time.monotonic() < deadline:
            process.send_signal(signal.SIGHUP)
            sent += 1
            time.sleep(0.02)
        assert process.poll() is None and sent >= 1
        assert "ready" in process.stdout.readline()
        with CacheClient(endpoint, timeout=10) as client:
            assert client.ping()
        process.send_signal(signal.SIGHUP)
        with CacheClient(endpoint, timeout=10) as client:
            assert client.ping()
        assert process.poll() is None
    finally:
        process.terminate()
        process.wait(10)


def test_kvcache_serve_catches_sighup_before_it_imports_numpy() -> None:
    """`import kvcache` is light and the command's entry catches SIGHUP first: the window in which a SIGHUP ends a
    starting daemon is the interpreter's own start, not numpy's and the allocator's imports."""
    probe = (
        "import signal, sys\n"
        "class Spy:\n"
        "    seen = None\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'numpy' and Spy.seen is None:\n"
        "            Spy.seen = signal.getsignal(signal.SIGHUP)\n"
        "sys.meta_path.insert(0, Spy())\n"
        "import kvcache\n"
        "assert 'numpy' not in sys.modules, 'import kvcache loaded numpy'\n"
        "from kvcache.__main__ import main\n"
        "sys.argv = ['kvcache', 'serve', '--help']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('caught' if callable(Spy.seen) else f'default: {Spy.seen}', file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "caught"


# -- PD reports and rank claims, bound to the key that attached the rank --------------------------------------------

def _cpu_region(blocks: int = 32) -> Any:
    from kvcache.pd.cluster import Cache, spec_of
    from kvcache.transfer import KVRegion

    spec = spec_of(dict(layers=2, kv_heads=2, head_dim=16, block_size=16), 1)
    return KVRegion.from_tensors(spec, Cache(spec, blocks, "cpu").layers)


def test_a_received_report_counts_only_from_the_receiver_attached_as_its_rank(daemon) -> None:
    """A decode rank's `received` counts only from the worker attached as that rank, naming its key: another client
    (no key, a wrong one, or one that attached another rank) is refused by name, and the reservation stays in
    transfer (its blocks are never handed to the scheduler unwritten). The receiver's own report lands it."""
    d = daemon("--num-blocks", "32", "--block-size", "4", "--role", "decode", "--tp", "2")
    with CacheClient(d.endpoint, timeout=5) as worker0, CacheClient(d.endpoint, timeout=5) as worker1, \
            CacheClient(d.endpoint, timeout=5) as scheduler:
        worker0.attach(0, "tcp://127.0.0.1:1")
        worker1.attach(1, "tcp://127.0.0.1:2")
        scheduler.reserve("r", list(range(9)))
        refusal = r"received for rank 0 counts only from the receiver attached as rank 0"
        with pytest.raises(DaemonError, match=refusal):
            scheduler.batch().op("received", req="r", rank=0).send()  # no key
        with pytest.raises(DaemonError, match=refusal):
            scheduler.received("r", 0)  # its own key, which claimed nothing
        with pytest.raises(DaemonError, match=refusal):
            worker1.received("r", 0)  # rank 1's worker, for rank 0
        worker1.received("r", 1)
        assert scheduler.pd_poll().done == {}, "a refused report marked the transfer done"
        worker0.received("r", 0)
        assert list(scheduler.pd_poll().done) == ["r"]
        scheduler.check_integrity()


def test_a_sent_report_counts_only_from_the_messager_attached_as_its_rank(daemon) -> None:
    """A prefill rank's messager claims its rank (`attach` with no endpoint); `sent` then counts only from it: a
    report for a rank no messager attached, or from another client, is refused and the request stays in transfer."""
    p = daemon("--num-blocks", "32", "--block-size", "16", "--role", "prefill")
    dest = {"receivers": ["tcp://127.0.0.1:1"], "table": np.arange(3, dtype=np.int32)[None, :], "cached": 0,
            "decode": "ipc:///nowhere"}
    with CacheClient(p.endpoint, timeout=5) as scheduler, CacheClient(p.endpoint, timeout=5) as messager:
        scheduler.admit("a", np.arange(40), dest=dest)
        refusal = "sent for rank 0 counts only from the messager attached as rank 0"
        with pytest.raises(DaemonError, match=refusal):  # no messager attached yet
            messager.sent("a", 0)
        messager.attach(0)
        with pytest.raises(DaemonError, match=refusal):
            scheduler.sent("a", 0)
        with pytest.raises(DaemonError, match=refusal):
            scheduler.batch().op("sent", req="a", rank=0).send()
        with pytest.raises(DaemonError, match="attach of prefill rank 0 refused"):
            scheduler.attach(0)
        assert scheduler.pd_poll().done == {} and scheduler.plans(["a"])[0] is not None
        messager.sent("a", 0)
        assert list(scheduler.pd_poll().done) == ["a"]
        scheduler.check_integrity()


def test_a_restarted_decode_link_attaches_its_rank_again_with_its_key_file_and_an_admin_takes_any_rank(daemon):
    """Without CURVE a DecodeLink claims its rank with a key it keeps in a 0600 file beside the daemon's socket: a
    link restarted by the same user (a new process would read the same file) attaches the rank again and its
    reports count; a client with another key cannot attach it. The daemon's admin key (a 0600 file it writes there)
    takes the rank over, and from then on only the new owner reports for it."""
    from kvcache.pd.links import DecodeLink
    from kvcache.rank_keys import admin_key

    d = daemon("--num-blocks", "32", "--block-size", "16", "--role", "decode")
    region = _cpu_region()
    socket_file = Path(d.endpoint[len("ipc://"):])
    DecodeLink(d.endpoint, region, 0).close()  # the worker; then the same user's worker restarted:
    with DecodeLink(d.endpoint, region, 0) as link, CacheClient(d.endpoint, timeout=5) as c:
        key_file = socket_file.with_name(f"{socket_file.name}.rank-0.key")
        first = int(key_file.read_text())
        assert key_file.stat().st_mode & 0o777 == 0o600 and link.key == first
        another_process = subprocess.run([sys.executable, "-c", "import sys; from kvcache.rank_keys import rank_key; "
                                          "print(rank_key(sys.argv[1], 0))", d.endpoint],
                                         capture_output=True, text=True, timeout=120)
        assert another_process.stdout.strip() == str(first), another_process.stderr
        c.reserve("a", np.arange(40))
        link._received(["a"])
        assert list(c.pd_poll().done) == ["a"]
        with pytest.raises(DaemonError, match="attach of decode rank 0 refused"):
            c.attach(0, "tcp://10.0.0.66:1")
        admin = admin_key(d.endpoint)
        assert admin is not None and socket_file.with_name(f"{socket_file.name}.admin.key").stat().st_mode & 0o777 \
            == 0o600
        with pytest.raises(DaemonError, match="attach of decode rank 0 refused"):
            c.attach(0, "tcp://10.0.0.66:1", admin=admin ^ 1)
        c.attach(0, "tcp://127.0.0.1:7", admin=admin)  # the operator moves the rank to a new worker (c's key)
        assert list(c.reserve("b", np.arange(40) + 1000).receivers) == ["tcp://127.0.0.1:7"]
        link._received(["b"])  # the old owner's report is refused (logged), the transfer stays
        assert c.pd_poll().done == {}
        c.received("b", 0)
        assert list(c.pd_poll().done) == ["b"]


def test_a_host_tier_rank_is_taken_only_with_its_key_or_the_daemons_admin_key(node) -> None:
    """An agent claims its rank with a key from its 0600 key file: an agent restarted by the same user attaches the
    rank again and serves byte for byte; another client cannot take the rank (the agent's copies go on), unless it
    holds the daemon's admin key."""
    from kvcache.rank_keys import admin_key

    n = node()
    n.serve("a", PROMPT)
    assert n.settle()["cached_blocks"] == 3
    with CacheClient(n.endpoint, timeout=5) as stranger:
        with pytest.raises(DaemonError, match="tier_attach of rank 0 refused"):
            stranger.tier_attach(0, 99)
        with pytest.raises(DaemonError, match="tier_attach of rank 0 refused"):
            stranger.batch().op("tier_attach", rank=0, agent=99).send()
        n.serve("b", list(range(200, 213)))
        assert n.settle()["cached_blocks"] == 6, "the refused attach took the rank from its agent"
        n.agents[0].close()
        n.agents[0] = TierAgent(n.subs[0], n.memory[0].region)  # the worker restarted: same user, same key file
        n.serve("c", list(range(300, 313)))
        assert n.settle()["offloaded_blocks"] >= 3
        stranger.tier_attach(0, 98, admin=admin_key(n.endpoint))
        assert n.client.stats()["host_tier"]["ranks"] == 1
    n.client.check_integrity()


def test_a_tier_agent_reaches_a_daemon_that_requires_curve(daemon, tmp_path, tcp_endpoint) -> None:
    """TierAgent passes its CURVE keys to its own client: it attaches to a tcp:// daemon that requires CURVE and its
    copies land (offloaded and cached on host); a restarted agent with the same certificate attaches its rank again,
    one of another allowed certificate cannot."""
    from kvcache.worker import TableSubscriber

    from test_tier import Memory, make_spec

    curve = start_curve_daemon(daemon, tmp_path, tcp_endpoint, "worker", "other",
                               flags=("--num-blocks", "8", "--block-size", "4", "--host-block-budget", "32")).allowed
    memory = Memory(make_spec("bf16", tp_size=1), 8, seed=0)
    with CacheClient(tcp_endpoint, timeout=5, curve=curve["worker"]) as client, \
            TableSubscriber(tcp_endpoint, rank=0, tp_size=1, curve=curve["worker"]) as sub:
        agent = TierAgent(sub, memory.region, curve=curve["worker"])
        try:
            client.admit("a", PROMPT)
            sub.wait_for(client.last_seq)
            client.free("a")
            sub.wait_for(client.last_seq)
            assert agent.drain(10)
            stats = client.stats()["host_tier"]
            assert (stats["ranks"], stats["offloaded_blocks"], stats["cached_blocks"]) == (1, 3, 3)
        finally:
            agent.close()
        agent = TierAgent(sub, memory.region, curve=curve["worker"])
        agent.close()
        with CacheClient(tcp_endpoint, timeout=5, curve=curve["other"]) as other:
            with pytest.raises(DaemonError, match="tier_attach of rank 0 refused"):
                other.tier_attach(0, 5)


def test_a_prefill_link_claims_its_rank_before_it_reports_and_again_after_a_restart_without_journal(daemon,
                                                                                                 tmp_path) -> None:
    """A PrefillLink claims its rank on the prefill daemon before its first report, so its `sent` counts and
    another client's is refused; restarted without a journal (the claim forgotten), the daemon counts the link's
    next report once the link has claimed its rank again."""
    from kvcache.pd.links import PrefillLink
    from kvcache.transfer.signal import LayerSignal

    flags = ("--num-blocks", "32", "--block-size", "16", "--role", "prefill")
    p = daemon(*flags)
    dest = {"receivers": ["tcp://127.0.0.1:1"], "table": np.arange(3, dtype=np.int32)[None, :], "cached": 0,
            "decode": "ipc:///nowhere"}
    region = _cpu_region()
    with LayerSignal.create(f"kvcache-claim-{tmp_path.name}", 2, replace=True) as sig, \
            PrefillLink(p.endpoint, region, sig, 0) as link:
        with CacheClient(p.endpoint, timeout=5) as scheduler:
            scheduler.admit("a", np.arange(40), dest=dest)
            assert link._plans(["a"])[0] is not None  # the messager's first call: it claims the rank first
            with pytest.raises(DaemonError, match="attach of prefill rank 0 refused"):
                scheduler.attach(0)
            with pytest.raises(DaemonError, match="sent for rank 0 counts only from the messager"):
                scheduler.sent("a", 0)
            assert scheduler.pd_poll().done == {}
            link._sent("a")
            assert list(scheduler.pd_poll().done) == ["a"]
        p.kill()
        again = daemon(*flags, folder=p.folder)
        with CacheClient(again.endpoint, timeout=5) as scheduler:
            scheduler.admit("b", np.arange(40), dest=dest)
            link._sent("b")
            assert list(scheduler.pd_poll().done) == ["b"]
            scheduler.check_integrity()

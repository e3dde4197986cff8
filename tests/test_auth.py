"""CURVE on tcp://: only clients whose key the daemon allows get answers; refusals are logged; ipc is owner-only."""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import signal
import stat
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple

import numpy as np
import pytest
import zmq
import zmq.auth

from kvcache.allocator import KVCacheManager
from kvcache.allocator.errors import KVCacheError
from kvcache.auth import (
    CurveConfig,
    check_ipc_permissions,
    secure_client_socket,
    secure_server_socket,
    start_authenticator,
)
from kvcache.cli import main
from kvcache.client import CacheClient, DaemonUnavailable
from kvcache.config import ServeConfig, parse_rows
from kvcache.keys import create_keys
from kvcache.protocol import PROTOCOL_VERSION, pack, unpack
from kvcache.server import CacheServer

if TYPE_CHECKING:
    from conftest import Daemon

    from kvcache.auth import KeyAuthenticator

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
NO_ANSWER_S = 1.0  # a refused client is given this long to get anything through


class Secured(NamedTuple):
    """A CURVE ROUTER on 127.0.0.1 in front of a real CacheServer, and the keys around it."""

    router: zmq.Socket
    endpoint: str
    server: CacheServer
    auth: KeyAuthenticator
    allowed: CurveConfig  # a client the daemon allows
    intruder: CurveConfig  # a client with its own keys (and the daemon's public key), not allowed


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[Secured]:
    """The daemon's message handling behind a CURVE ROUTER; ``serve`` answers what arrives."""
    keys = create_keys(tmp_path / "keys", "scheduler")
    other = create_keys(tmp_path / "other", "intruder")
    ctx = zmq.Context()
    auth = start_authenticator(ctx, keys.client_public.parent)
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    secure_server_socket(router, CurveConfig.for_server(keys.server_secret, keys.client_public.parent))
    port = router.bind_to_random_port("tcp://127.0.0.1")
    folder = Path(tempfile.mkdtemp(prefix="kv-", dir="/tmp"))  # short: unix socket paths are limited
    rows = parse_rows("window:8:4,full")
    server = CacheServer(ServeConfig(endpoint=f"ipc://{folder}/k.sock"), KVCacheManager(64, 4, rows))
    try:
        yield Secured(router, f"tcp://127.0.0.1:{port}", server, auth,
                      CurveConfig.for_client(keys.client_secret, keys.server_public),
                      CurveConfig.for_client(other.client_secret, keys.server_public))
    finally:
        server.close()
        router.close(0)
        auth.stop()
        ctx.term()
        shutil.rmtree(folder, ignore_errors=True)


def connect(ctx: zmq.Context, endpoint: str, curve: CurveConfig | None) -> zmq.Socket:
    """A DEALER whose send gives up after 1 s: once a refused handshake drops its only peer, a send would block."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndtimeo = 1000
    if curve is not None:
        secure_client_socket(sock, curve)
    sock.connect(endpoint)
    return sock


def send_refused(dealer: zmq.Socket, message: bytes) -> None:
    """A refused client's send: if the refusal already dropped the connection, the message cannot even leave."""
    with contextlib.suppress(zmq.Again):
        dealer.send(message)


def serve(s: Secured, timeout: float) -> int:
    """Answer every message reaching the ROUTER within ``timeout`` seconds; returns how many arrived."""
    handled = 0
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        if s.router.poll(int(remaining * 1000) + 1):
            *envelope, payload = s.router.recv_multipart()
            s.router.send_multipart([*envelope, s.server.handle(payload)])
            handled += 1
    return handled


def admit_message(req: str) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "client": "t", "id": 1,
                 "ops": [{"op": "admit", "req": req, "tokens": np.arange(9, dtype=np.uint32)}]})


def state(server: CacheServer) -> tuple:
    return len(server.manager), server.manager.num_free_blocks.tolist(), server.stats()["seq"]


def wait_for_log(caplog: pytest.LogCaptureFixture, *words: str, timeout: float = 5.0) -> logging.LogRecord:
    """The first WARNING of kvcache.auth holding every word (refusals are logged from the auth threads)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for record in caplog.records:
            if record.name == "kvcache.auth" and record.levelno == logging.WARNING and all(
                    w in record.getMessage() for w in words):
                return record
        time.sleep(0.02)
    raise AssertionError(f"no refusal logged with {words}; got {[r.getMessage() for r in caplog.records]}")


def test_a_client_with_an_allowed_key_gets_answers(secured):
    """The allowed client's admit reaches the daemon and its reply comes back, encrypted both ways."""
    with zmq.Context() as ctx:
        dealer = connect(ctx, secured.endpoint, secured.allowed)
        dealer.send(admit_message("a"))
        assert serve(secured, 2.0) == 1
        assert dealer.poll(2000), "no reply for the allowed client"
        reply = unpack(dealer.recv(), 1 << 20)
        dealer.close(0)
    assert reply["ok"] and reply["results"][0]["table"].shape == (2, 3)
    assert "a" in secured.server.manager
    assert secured.auth.refused == 0


@pytest.mark.parametrize("who", ["no keys", "keys not allowed", "wrong server key"])
def test_a_refused_client_gets_no_answer_changes_nothing_and_is_logged(secured, caplog, who):
    """Without the keys the daemon allows, a message never reaches the socket: no reply, no state change, a log line."""
    caplog.set_level(logging.DEBUG, logger="kvcache.auth")
    curve = {"no keys": None, "keys not allowed": secured.intruder,
             "wrong server key": CurveConfig.for_client(secured.allowed.client_secret,
                                                        secured.intruder.client_secret.parent / "server.key")}[who]
    before = state(secured.server)
    with zmq.Context() as ctx:
        dealer = connect(ctx, secured.endpoint, curve)
        send_refused(dealer, admit_message("intruder"))
        assert serve(secured, NO_ANSWER_S) == 0, "a refused client's message reached the daemon"
        assert not dealer.poll(100), "a refused client got an answer"
        dealer.close(0)
    assert state(secured.server) == before
    if who == "keys not allowed":
        key = zmq.auth.load_certificate(secured.intruder.client_secret)[0].decode()
        record = wait_for_log(caplog, "127.0.0.1", key, "not in")
    elif who == "no keys":
        record = wait_for_log(caplog, secured.endpoint, "handshake")
    else:
        record = wait_for_log(caplog, secured.endpoint, "wrong server public key")
    assert record.getMessage().startswith("refused ")
    assert secured.auth.refused >= 1


def test_repeated_refusals_of_one_peer_are_counted_not_flooded(secured, caplog):
    """A client with a wrong server key retries every 100 ms; the log gets one WARNING per 10 s, the rest at DEBUG."""
    caplog.set_level(logging.DEBUG, logger="kvcache.auth")
    wrong = CurveConfig.for_client(secured.allowed.client_secret, secured.intruder.client_secret.parent / "server.key")
    with zmq.Context() as ctx:
        dealer = connect(ctx, secured.endpoint, wrong)
        send_refused(dealer, admit_message("x"))
        deadline = time.monotonic() + 5.0
        while secured.auth.refused < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        dealer.close(0)
    warnings = [r for r in caplog.records if r.name == "kvcache.auth" and r.levelno == logging.WARNING]
    assert secured.auth.refused >= 3 and len(warnings) == 1


def test_revoking_a_key_refuses_its_client_after_reload(secured, caplog):
    """Deleting a client's public key from the folder and reloading locks it out."""
    caplog.set_level(logging.DEBUG, logger="kvcache.auth")
    public = zmq.auth.load_certificate(secured.allowed.client_secret)[0].decode()
    (secured.auth.clients_dir / "scheduler.key").unlink()
    secured.auth.reload()
    with zmq.Context() as ctx:
        dealer = connect(ctx, secured.endpoint, secured.allowed)
        send_refused(dealer, admit_message("revoked"))
        assert serve(secured, NO_ANSWER_S) == 0
        dealer.close(0)
    wait_for_log(caplog, public, "not in")


def test_a_socket_cannot_be_secured_before_the_authenticator_runs(tmp_path):
    """libzmq admits anyone holding the server key when no ZAP handler runs, so securing first is an error."""
    keys = create_keys(tmp_path / "keys", "c")
    with zmq.Context() as ctx:
        sock = ctx.socket(zmq.ROUTER)
        with pytest.raises(KVCacheError, match="start_authenticator"):
            secure_server_socket(sock, CurveConfig.for_server(keys.server_secret, keys.client_public.parent))
        sock.close(0)


def test_a_secret_certificate_readable_by_others_is_refused(tmp_path):
    keys = create_keys(tmp_path / "keys", "c")
    os.chmod(keys.client_secret, 0o644)
    with zmq.Context() as ctx:
        sock = ctx.socket(zmq.DEALER)
        with pytest.raises(KVCacheError, match="mode 0644"):
            secure_client_socket(sock, CurveConfig.for_client(keys.client_secret, keys.server_public))
        sock.close(0)


def test_an_allowed_clients_folder_writable_by_others_is_refused(tmp_path):
    keys = create_keys(tmp_path / "keys", "c")
    os.chmod(keys.client_public.parent, 0o777)
    with zmq.Context() as ctx, pytest.raises(KVCacheError, match="writable by other users"):
        start_authenticator(ctx, keys.client_public.parent)


def test_keys_command_makes_owner_only_files_and_adds_clients(tmp_path, capsys):
    """`kvcache keys DIR --name N`: the daemon's pair once, one pair per client, secrets 0600, folders 0700."""
    folder = tmp_path / "keys"
    assert main(["keys", str(folder), "--name", "sched"]) == 0
    first = (folder / "server.key_secret").read_bytes()
    assert main(["keys", str(folder), "--name", "worker-0"]) == 0
    out = capsys.readouterr().out
    assert "--curve-server-cert" in out and "kept" in out
    assert (folder / "server.key_secret").read_bytes() == first  # the daemon's key survives adding clients
    for path, mode in [(folder, 0o700), (folder / "clients", 0o700), (folder / "server.key_secret", 0o600),
                       (folder / "sched.key_secret", 0o600), (folder / "worker-0.key_secret", 0o600)]:
        assert stat.S_IMODE(path.stat().st_mode) == mode, path
    assert sorted(p.name for p in (folder / "clients").iterdir()) == ["sched.key", "worker-0.key"]
    assert len(zmq.auth.load_certificates(folder / "clients")) == 2
    assert main(["keys", str(folder), "--name", "sched"]) == 2  # never overwrites a client's keys
    assert "already has keys" in capsys.readouterr().err


def test_the_daemons_ipc_sockets_are_owner_only(daemon):
    """`kvcache serve` binds its ipc sockets under umask 077: no other user may connect."""
    d = daemon("--num-blocks", "16", "--block-size", "4")
    for name in ("k.sock", "k-pub.sock", "k-replay.sock"):
        check_ipc_permissions(d.folder / name)
    check_ipc_permissions(d.endpoint)
    os.chmod(d.folder / "k.sock", 0o666)
    with pytest.raises(KVCacheError, match="mode 0666"):
        check_ipc_permissions(d.folder / "k.sock")


def test_without_a_running_authenticator_even_allowed_clients_get_nothing(secured):
    """ZAP_ENFORCE_DOMAIN: a secured socket whose ZAP handler stopped refuses everyone instead of admitting all."""
    secured.auth.stop()
    with zmq.Context() as ctx:
        dealer = connect(ctx, secured.endpoint, secured.allowed)
        send_refused(dealer, admit_message("a"))
        assert serve(secured, NO_ANSWER_S) == 0
        dealer.close(0)
    assert len(secured.server.manager) == 0


def test_a_refused_client_and_worker_get_errors_within_their_timeouts_not_hangs(daemon, tmp_path, tcp_endpoint):
    """Keyless sockets to a CURVE daemon: once the failed handshake dropped their only peer, a send has nowhere to
    queue. Each call (and the worker's replay request) still ends within its timeout."""
    import numpy as np

    from kvcache.cli import main
    from kvcache.client import CacheClient, DaemonUnavailable
    from kvcache.worker import TableSubscriber

    keys = tmp_path / "keys"
    assert main(["keys", str(keys), "--name", "sched"]) == 0
    endpoint = tcp_endpoint
    daemon("--endpoint", endpoint, "--num-blocks", "64", "--block-size", "4",
           "--curve-server-cert", str(keys / "server.key_secret"), "--curve-clients-dir", str(keys / "clients"))
    with CacheClient(endpoint, timeout=0.5, retries=1) as stranger:
        time.sleep(0.5)  # the handshake has failed by now: no peer left to queue the first request for
        for _ in range(2):
            start = time.monotonic()
            with pytest.raises(DaemonUnavailable):
                stranger.admit("b", np.arange(9))
            assert time.monotonic() - start < 2 * 0.5 + 1.0  # two attempts of 0.5 s, and slack
    start = time.monotonic()
    with pytest.raises(DaemonUnavailable):  # its info request (a CacheClient's) gets no answer either
        TableSubscriber(endpoint, timeout=0.5)
    assert time.monotonic() - start < 1.5


def test_kvcache_serve_over_tcp_with_curve_admits_only_keyed_clients_and_workers(daemon, tmp_path, tcp_endpoint):
    """A real daemon with --curve-*: a keyed client and worker work; a keyless client gets nothing."""
    import numpy as np

    from kvcache.auth import CurveConfig
    from kvcache.cli import main
    from kvcache.client import CacheClient, DaemonUnavailable
    from kvcache.worker import TableSubscriber

    keys = tmp_path / "keys"
    assert main(["keys", str(keys), "--name", "sched"]) == 0
    endpoint = tcp_endpoint
    d = daemon("--endpoint", endpoint, "--num-blocks", "64", "--block-size", "4",
               "--curve-server-cert", str(keys / "server.key_secret"), "--curve-clients-dir", str(keys / "clients"))
    curve = CurveConfig.for_client(keys / "sched.key_secret", keys / "server.key")
    with CacheClient(endpoint, timeout=5, curve=curve) as client:
        table = client.admit("a", np.arange(9)).table
        sub = TableSubscriber(endpoint, curve=curve, max_slots=4, max_blocks=8)
        sub.wait_for(client.last_seq, epoch=client.last_epoch)
        assert np.array_equal(sub.table("a"), table)
        sub.close()
        with CacheClient(endpoint, timeout=0.5) as stranger:
            with pytest.raises(DaemonUnavailable):
                stranger.admit("b", np.arange(9))
        assert client.stats()["num_requests"] == 1
    deadline = time.monotonic() + 5
    while "refused" not in d.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "refused" in d.log(), d.log()


# ---------------------------------------------------------------- every socket of a daemon, and revocation

FIELDS = ("endpoint", "pub_endpoint", "replay_endpoint", "events_endpoint", "events_replay_endpoint")
PING = pack({"v": PROTOCOL_VERSION, "client": "probe", "id": 1, "ops": [{"op": "ping"}]})
SILENCE_S = 2.0  # how long a refused peer is watched for anything arriving


class CurveDaemon(NamedTuple):
    """A `kvcache serve` on tcp with CURVE and KV events, its endpoints by ServeConfig name, and client keys."""

    daemon: Daemon
    endpoints: dict[str, str]
    keys: Path
    allowed: dict[str, CurveConfig]  # by client name, as on its host: keys in the daemon's clients folder
    intruder: CurveConfig  # its own key pair with the daemon's public key; not in the clients folder


def start_curve_daemon(daemon, tmp_path: Path, tcp_endpoint: str, *names: str,
                       flags: tuple[str, ...] = ("--num-blocks", "64", "--block-size", "4", "--events")) -> CurveDaemon:
    """A CURVE daemon on ``tcp_endpoint`` started with ``flags``, with an allowed key pair for each of ``names``."""
    keys, hosts = tmp_path / "keys", tmp_path / "hosts"
    hosts.mkdir()
    for name in names:
        shutil.copy2(create_keys(keys, name).client_secret, hosts)  # each client keeps a copy of its secret
    other = create_keys(tmp_path / "other", "intruder")
    d = daemon("--endpoint", tcp_endpoint, *flags,
               "--curve-server-cert", str(keys / "server.key_secret"), "--curve-clients-dir", str(keys / "clients"))
    resolved = ServeConfig(endpoint=tcp_endpoint).resolved()
    return CurveDaemon(d, {f: getattr(resolved, f) for f in FIELDS}, keys,
                       {n: CurveConfig.for_client(hosts / f"{n}.key_secret", keys / "server.key") for n in names},
                       CurveConfig.for_client(other.client_secret, keys / "server.key"))


class Probe:
    """One peer on each of a daemon's five sockets (SUB on the PUBs, DEALER on the ROUTERs), with some keys or none;
    counts the messages each socket receives."""

    def __init__(self, ctx: zmq.Context, endpoints: dict[str, str], curve: CurveConfig | None) -> None:
        self.socks: dict[str, zmq.Socket] = {}
        for field, where in endpoints.items():
            sock = ctx.socket(zmq.SUB if field in ("pub_endpoint", "events_endpoint") else zmq.DEALER)
            sock.linger = 0
            if sock.type == zmq.SUB:
                sock.subscribe(b"")
            if curve is not None:
                secure_client_socket(sock, curve)
            sock.connect(where)
            self.socks[field] = sock
        self.got = dict.fromkeys(endpoints, 0)

    def ask(self) -> None:
        """A request on each ROUTER: a ping, deltas from seq 0, KV events from seq 0 (each is answered)."""
        for field, frames in (("endpoint", [PING]), ("replay_endpoint", [pack({"from": 0})]),
                              ("events_replay_endpoint", [b"", bytes(8)])):
            with contextlib.suppress(zmq.Again):  # no connection (refused): nowhere to queue it
                self.socks[field].send_multipart(frames, zmq.NOBLOCK)

    def read(self) -> None:
        for field, sock in self.socks.items():
            while sock.poll(0):
                sock.recv_multipart()
                self.got[field] += 1

    def reached(self) -> list[str]:
        """The sockets that received anything."""
        return [f for f, n in self.got.items() if n]

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close(0)


def exchange(client: CacheClient, probes: list[Probe], seconds: float, until: Callable[[], bool]) -> None:
    """Admit and free a request (deltas, KV events), ask on every ROUTER and read every probe, every 50 ms, for at
    least ``seconds`` and until ``until()`` holds, or 15 s (the caller's asserts then say what never came)."""
    start = time.monotonic()
    for i in itertools.count():
        elapsed = time.monotonic() - start
        if (elapsed >= seconds and until()) or elapsed > 15.0:
            return
        client.admit(f"r{i}", np.arange(9) + 100 * i)  # two full blocks: a BlockStored event
        client.free(f"r{i}")
        for probe in probes:
            probe.ask()
        time.sleep(0.05)
        for probe in probes:
            probe.read()


def test_every_socket_of_a_curve_daemon_serves_allowed_clients_only(daemon, tmp_path, tcp_endpoint):
    """The scheduler ROUTER, deltas PUB, replay ROUTER, KV-events PUB and KV-events replay ROUTER all use the
    daemon's key and its clients folder: a keyless peer and one whose key is not in the folder get nothing from
    any of them, while an allowed peer gets answers, deltas and events from each."""
    c = start_curve_daemon(daemon, tmp_path, tcp_endpoint, "sched")
    with zmq.Context() as ctx, CacheClient(tcp_endpoint, timeout=5, curve=c.allowed["sched"]) as client:
        probes = {"allowed": Probe(ctx, c.endpoints, c.allowed["sched"]), "no keys": Probe(ctx, c.endpoints, None),
                  "key not allowed": Probe(ctx, c.endpoints, c.intruder)}
        try:
            exchange(client, list(probes.values()), SILENCE_S, lambda: len(probes["allowed"].reached()) == 5)
        finally:
            for probe in probes.values():
                probe.close()
    assert probes["allowed"].reached() == list(FIELDS)
    assert probes["no keys"].reached() == [] and probes["key not allowed"].reached() == [], c.daemon.log()


def wait_for_line(d: Daemon, text: str, count: int = 1, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while d.log().count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} not logged {count} time(s):\n{d.log()}"
        time.sleep(0.02)


def test_revoking_a_client_cuts_off_its_open_connections_and_keeps_the_others(daemon, tmp_path, tcp_endpoint):
    """`kvcache keys revoke DIR --name N --pid PID`: the daemon reads its clients folder again on SIGHUP. The revoked
    client's connections, open since before, get no more replies, deltas or events, and a new connection with its
    key is refused; another allowed client goes on getting all of them, and its worker's tables stay current."""
    from kvcache.worker import TableSubscriber

    c = start_curve_daemon(daemon, tmp_path, tcp_endpoint, "revoked", "kept")
    with zmq.Context() as ctx, CacheClient(tcp_endpoint, timeout=5, curve=c.allowed["kept"]) as kept, \
            CacheClient(tcp_endpoint, timeout=0.5, curve=c.allowed["revoked"]) as revoked:
        assert revoked.ping() and kept.ping()
        worker = TableSubscriber(tcp_endpoint, curve=c.allowed["kept"], max_slots=4, max_blocks=8)
        r, k = Probe(ctx, c.endpoints, c.allowed["revoked"]), Probe(ctx, c.endpoints, c.allowed["kept"])
        try:
            exchange(kept, [r, k], 0, lambda: len(r.reached()) == len(k.reached()) == 5)
            assert r.reached() == k.reached() == list(FIELDS)
            assert main(["keys", "revoke", str(c.keys), "--name", "revoked", "--pid", str(c.daemon.process.pid)]) == 0
            wait_for_line(c.daemon, "revoked 1:")
            time.sleep(0.3)
            r.read()  # what was sent before the cut
            r.got, k.got = dict.fromkeys(FIELDS, 0), dict.fromkeys(FIELDS, 0)
            exchange(kept, [r, k], SILENCE_S, lambda: len(k.reached()) == 5)
            table = kept.admit("after", np.arange(9)).table
            worker.wait_for(kept.last_seq, epoch=kept.last_epoch)  # over its new connection
            assert np.array_equal(worker.table("after"), table)
        finally:
            r.close()
            k.close()
            worker.close()
        assert r.reached() == [], c.daemon.log()
        assert k.reached() == list(FIELDS)
        with pytest.raises(DaemonUnavailable):  # the connection it kept open: its request times out
            revoked.ping()
        with CacheClient(tcp_endpoint, timeout=0.5, curve=c.allowed["revoked"]) as again:
            with pytest.raises(DaemonUnavailable):  # a new connection: refused by its key
                again.ping()
        assert kept.ping()
    assert c.daemon.process.poll() is None
    assert "its key was revoked" in c.daemon.log() and "not in" in c.daemon.log()


def test_a_bad_clients_folder_on_reload_keeps_the_allowed_keys_and_logs_one_line(daemon, tmp_path, tcp_endpoint):
    """A reload that fails (a key file that is no certificate, a folder others may write) changes nothing: the
    daemon keeps running with the keys it had and logs why, once per SIGHUP."""
    c = start_curve_daemon(daemon, tmp_path, tcp_endpoint, "sched")
    clients = c.keys / "clients"
    with CacheClient(tcp_endpoint, timeout=5, curve=c.allowed["sched"]) as client:
        assert client.ping()
        (clients / "broken.key").write_text("not a certificate\n")
        os.kill(c.daemon.process.pid, signal.SIGHUP)
        wait_for_line(c.daemon, "reload refused")
        assert client.ping()
        (clients / "broken.key").unlink()
        os.chmod(clients, 0o777)
        os.kill(c.daemon.process.pid, signal.SIGHUP)
        wait_for_line(c.daemon, "reload refused", count=2)
        assert client.ping()
        with CacheClient(tcp_endpoint, timeout=5, curve=c.allowed["sched"]) as fresh:
            assert fresh.ping()  # its key is still allowed on new connections too
    assert c.daemon.process.poll() is None
    lines = [line for line in c.daemon.log().splitlines() if "reload refused" in line]
    assert len(lines) == 2, lines
    assert "broken.key" in lines[0] and "1 client key(s) allowed so far" in lines[0]
    assert "writable by other users" in lines[1]


def test_keys_revoke_deletes_the_clients_keys_and_checks_the_pid_first(tmp_path, capsys):
    """`kvcache keys revoke` deletes clients/NAME.key and NAME.key_secret; a pid that is no `kvcache serve` is refused
    before anything is deleted, and a name that has no key is an error naming the file."""
    folder = tmp_path / "keys"
    create_keys(folder, "a")
    create_keys(folder, "b")
    assert main(["keys", "revoke", str(folder), "--name", "a", "--pid", str(os.getpid())]) == 2
    assert f"--pid: process {os.getpid()} is not a kvcache serve" in capsys.readouterr().err
    assert (folder / "clients" / "a.key").exists()
    assert main(["keys", "revoke", str(folder), "--name", "a"]) == 0
    assert "kill -HUP" in capsys.readouterr().out
    assert sorted(p.name for p in (folder / "clients").iterdir()) == ["b.key"]
    assert not (folder / "a.key_secret").exists() and (folder / "b.key_secret").exists()
    assert main(["keys", "revoke", str(folder), "--name", "a"]) == 2
    assert f"{folder / 'clients' / 'a.key'} does not exist" in capsys.readouterr().err
    assert main(["keys", "revoke", "--name", "b"]) == 2
    assert "give the keys folder" in capsys.readouterr().err
    assert main(["keys", str(folder), "--name", "a"]) == 0  # the name may get new keys


def test_stats_reaches_a_curve_daemon_with_key_flags_and_fails_in_one_line_without(daemon, tmp_path, tcp_endpoint,
                                                                                    capsys):
    """`kvcache stats --endpoint tcp://... --curve-client-cert ... --curve-server-public ...` prints the summary;
    without keys it fails with one line within its --timeout."""
    c = start_curve_daemon(daemon, tmp_path, tcp_endpoint, "sched")
    keyed = ["stats", "--endpoint", tcp_endpoint, "--curve-client-cert", str(c.allowed["sched"].client_secret),
             "--curve-server-public", str(c.keys / "server.key")]
    assert main(keyed) == 0
    assert "64 blocks x 1 row(s), block_size 4" in capsys.readouterr().out
    start = time.monotonic()
    assert main(["stats", "--endpoint", tcp_endpoint, "--timeout", "1"]) == 2
    assert time.monotonic() - start < 2.0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"kvcache stats: error: daemon at {tcp_endpoint} did not answer "
                                                   "within 1 s"), err
    assert main(keyed[:5]) == 2  # a client certificate without the daemon's public one
    assert "--curve-client-cert and --curve-server-public: give both" in capsys.readouterr().err


def test_a_curve_daemon_stops_on_sigterm_cleanly(daemon, tmp_path, tcp_endpoint):
    """SIGTERM stops a CURVE daemon with exit status 0 and nothing on stderr but its log: its handshake watchers end
    before their sockets close, also after peers with and without keys came and went."""
    c = start_curve_daemon(daemon, tmp_path, tcp_endpoint, "sched")
    with zmq.Context() as ctx, CacheClient(tcp_endpoint, timeout=5, curve=c.allowed["sched"]) as client:
        probes = [Probe(ctx, c.endpoints, c.allowed["sched"]), Probe(ctx, c.endpoints, None)]
        try:
            exchange(client, probes, 0.5, lambda: len(probes[0].reached()) == 5)
        finally:
            for probe in probes:
                probe.close()
    c.daemon.stop()
    assert c.daemon.process.returncode == 0, c.daemon.log()
    err = (c.daemon.folder / "stderr").read_text()
    assert "stopped (signal 15)" in err
    assert "Exception in thread" not in err and "Traceback" not in err, err


def test_a_curve_daemon_counts_its_keyed_subscribers_and_logs_keyless_ones(daemon, tmp_path, tcp_endpoint):
    """The deltas PUB's one monitor serves the subscriber count and the handshake log: an allowed worker counts as
    a subscriber (stats and the kvcache_subscribers gauge), and a keyless one is refused and named in the log."""
    c = start_curve_daemon(daemon, tmp_path, tcp_endpoint, "sched")
    pub = c.endpoints["pub_endpoint"]
    with zmq.Context() as ctx, CacheClient(tcp_endpoint, timeout=5, curve=c.allowed["sched"]) as client:
        keyed, keyless = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)
        try:
            secure_client_socket(keyed, c.allowed["sched"])
            for sock in (keyed, keyless):
                sock.linger = 0
                sock.subscribe(b"")
                sock.connect(pub)
            deadline = time.monotonic() + 5.0
            while client.stats()["subscribers"] != 1:
                assert time.monotonic() < deadline, f"subscribers: {client.stats()['subscribers']}\n{c.daemon.log()}"
                time.sleep(0.05)
            wait_for_line(c.daemon, f"refused a client of {pub}")
        finally:
            keyed.close(0)
            keyless.close(0)

"""CURVE authentication for the daemon's tcp:// sockets, and the owner-only check for its ipc:// ones.

Server side, in this order (libzmq lets a CURVE socket whose context has no
ZAP handler accept every client that knows the server's public key, so
``secure_server_socket`` refuses to run before ``start_authenticator``)::

    cfg = CurveConfig.for_server("keys/server.key_secret", "keys/clients")
    auth = start_authenticator(ctx, cfg.clients_dir)  # ZAP handler: only these keys; refusals logged
    secure_server_socket(router, cfg)                 # before bind; also watches its handshakes
    router.bind("tcp://*:5555")
    ...
    auth.stop()

Client side, before connect::

    secure_client_socket(dealer, CurveConfig.for_client("keys/NAME.key_secret", "keys/server.key"))

A refused peer gets no reply: its handshake fails and nothing reaches the
socket. ``auth.reload()`` reads the folder again (``kvcache serve`` does on
SIGHUP); libzmq keeps a revoked client's open connections, so the daemon drops
their messages (``recv_allowed``) and reconnects its subscribers
(kvcache.listeners). ipc:// endpoints need no CURVE: the daemon binds them under
umask 077, so only its user can connect; ``check_ipc_permissions`` verifies
that. Key files come from ``kvcache keys DIR``.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from kvcache.allocator.errors import KVCacheError
from kvcache.paths import check_socket_path


def open_monitor(sock: zmq.Socket, events: int) -> zmq.Socket:
    """``sock``'s monitor for ``events``, on an inproc address of its own.

    pyzmq's default address is named after the socket's file descriptor, which a socket closed a moment ago may
    still hold in the context: the new monitor would then fail to bind (EADDRINUSE).
    """
    return sock.get_monitor_socket(events, addr=f"inproc://kvcache-monitor-{secrets.token_hex(8)}")


log = logging.getLogger("kvcache.auth")
ZAP_DOMAIN = "kvcache"
REPEAT_S = 10.0  # the same peer refused for the same reason is logged at WARNING at most this often
HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
WATCH_JOIN_S = 1.0  # how long stopping waits for a socket watcher (each polls its monitor every 100 ms)
_PROTOCOL_REASONS = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "its handshake offered no CURVE keys (NULL or PLAIN mechanism)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "its handshake did not decrypt: it holds a wrong server public key",
}
# A client without keys reads the daemon's ERROR and hangs up, often before the daemon names the mismatch.
_BROKEN_OFF = "its handshake broke off (the peer hung up, as a client without CURVE keys does)"
_running: dict[int, KeyAuthenticator] = {}  # id(context) -> its ZAP handler (the handler keeps the context alive)
_running_lock = threading.Lock()


@dataclasses.dataclass(frozen=True, slots=True)
class CurveConfig:
    """CURVE key files: the daemon's secret cert and allowed-clients folder, or a client's secret cert and the
    daemon's public cert."""

    server_secret: Path | None = None  # daemon: its secret certificate (server.key_secret)
    clients_dir: Path | None = None  # daemon: folder of the allowed clients' public certificates (*.key)
    client_secret: Path | None = None  # client: its secret certificate (NAME.key_secret)
    server_public: Path | None = None  # client: the daemon's public certificate (server.key)

    @classmethod
    def for_server(cls, server_secret: str | os.PathLike, clients_dir: str | os.PathLike) -> CurveConfig:
        return cls(server_secret=Path(server_secret), clients_dir=Path(clients_dir))

    @classmethod
    def for_client(cls, client_secret: str | os.PathLike, server_public: str | os.PathLike) -> CurveConfig:
        return cls(client_secret=Path(client_secret), server_public=Path(server_public))


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise KVCacheError("curve: this libzmq was built without CURVE (libsodium); tcp:// cannot be authenticated")


def load_secret_cert(path: Path | None, field: str) -> tuple[bytes, bytes]:
    """(public, secret) key of a secret certificate that only its owner can read."""
    if path is None:
        raise KVCacheError(f"{field}: no secret certificate given")
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise KVCacheError(f"{field}: cannot read {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise KVCacheError(f"{field}: {path} is open to other users (mode {stat.S_IMODE(mode):04o}); "
                           f"chmod 600 {path}")
    public, secret = _load_cert(path, field)
    if not secret:
        raise KVCacheError(f"{field}: {path} holds no secret key (a public .key file?)")
    return public, secret


def load_public_cert(path: Path | None, field: str) -> bytes:
    """The public key of a certificate file."""
    if path is None:
        raise KVCacheError(f"{field}: no public certificate given")
    return _load_cert(path, field)[0]


def _load_cert(path: Path, field: str) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KVCacheError(f"{field}: cannot load a CURVE certificate from {path}: {exc}") from None
    if public is None or len(public) != 40:
        raise KVCacheError(f"{field}: {path} holds no CURVE public key")
    return public, secret


def secure_server_socket(sock: zmq.Socket, cfg: CurveConfig) -> KeyAuthenticator:
    """Make ``sock`` a CURVE server checked by its context's authenticator (returned); call before ``bind``.

    ZAP_ENFORCE_DOMAIN makes libzmq refuse clients, rather than let them all
    in, should the handler ever be missing.
    """
    _require_curve()
    auth = _running.get(id(sock.context))
    if auth is None or not auth.is_alive():
        raise KVCacheError("curve: start_authenticator(context, clients_dir) must run before securing a socket; "
                           "without a ZAP handler libzmq admits any client that knows the server key")
    public, secret = load_secret_cert(cfg.server_secret, "curve_server_cert")
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    auth.watch(sock)
    return auth


def secure_client_socket(sock: zmq.Socket, cfg: CurveConfig) -> None:
    """Give ``sock`` a client's CURVE keys and the daemon's public key; call before ``connect``."""
    _require_curve()
    public, secret = load_secret_cert(cfg.client_secret, "curve_client_cert")
    sock.curve_serverkey = load_public_cert(cfg.server_public, "curve_server_public")
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def start_authenticator(context: zmq.Context, allowed_clients_dir: str | os.PathLike) -> KeyAuthenticator:
    """Start the ZAP handler of ``context``: CURVE clients whose public key is in the folder, nobody else."""
    _require_curve()
    auth = KeyAuthenticator(context, Path(allowed_clients_dir))
    auth.start()
    return auth


class _Refusals:
    """Counts refusals and logs them: the first of each (peer, reason) at WARNING, repeats within
    REPEAT_S at DEBUG, and the next WARNING says how many repeats it stands for.

    A client with wrong keys retries every 100 ms; one line per attempt would bury the log.
    """

    def __init__(self, repeat_s: float) -> None:
        self.repeat_s = repeat_s
        self.total = 0
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def report(self, peer: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.total += 1
            if len(self._last) > 4096:  # a scan from many addresses must not grow this without bound
                self._last = {k: v for k, v in self._last.items() if now - v[0] < self.repeat_s}
            last, repeats = self._last.get((peer, reason), (-math.inf, 0))
            if now - last < self.repeat_s:
                self._last[(peer, reason)] = (last, repeats + 1)
                level, note = logging.DEBUG, ""
            else:
                self._last[(peer, reason)] = (now, 0)
                level, note = logging.WARNING, f" ({repeats} more refusals since the last report)" if repeats else ""
        log.log(level, "refused %s: %s%s", peer, reason, note)


@dataclasses.dataclass(frozen=True, slots=True)
class _Watcher:
    """A thread logging one socket's failed handshakes from its monitor."""

    sock: zmq.Socket
    thread: threading.Thread
    stop: threading.Event

    def end(self) -> None:
        """End the socket's monitor and wait for the thread (at most WATCH_JOIN_S), which then closes its end.

        The monitor's last event (MONITOR_STOPPED) ends the thread. Its end is
        closed only after that: libzmq blocks on an event for a closed one.
        """
        if not self.sock.closed:  # closing a socket ends its monitor too
            self.sock.disable_monitor()
        self.thread.join(WATCH_JOIN_S)
        if self.thread.is_alive():
            self.stop.set()
            log.warning("curve: a socket watcher missed its monitor's end within %.1f s; stopped it", WATCH_JOIN_S)


class KeyAuthenticator(ThreadAuthenticator):
    """The ZAP handler of one context: allows the CURVE public keys in ``clients_dir`` and logs every refusal.

    Refusals by key (ZAP) name the peer's address and key; refusals during the
    handshake (no keys, wrong server key) come from socket monitors and name
    the endpoint, since libzmq's monitor does not give the peer's address.
    """

    def __init__(self, context: zmq.Context, clients_dir: Path, *, repeat_s: float = REPEAT_S) -> None:
        super().__init__(context, log=logging.getLogger("kvcache.auth.zap"))
        self.clients_dir = clients_dir
        self.allowed: frozenset[str] = frozenset()  # the allowed public keys, z85 (as the User-Id of their messages)
        self._refusals = _Refusals(repeat_s)
        self._request: list[bytes] | None = None
        self._watchers: dict[int, _Watcher] = {}  # id(socket) -> its watcher

    @property
    def refused(self) -> int:
        """Refusals so far (ZAP and handshake)."""
        return self._refusals.total

    def start(self) -> None:
        """Load the allowed keys, register as the context's handler and start the ZAP thread."""
        with _running_lock:
            if id(self.context) in _running:
                raise KVCacheError("curve: this context already has an authenticator")
            self.reload()
            super().start()
            _running[id(self.context)] = self

    def reload(self) -> frozenset[str]:
        """Read the allowed public keys again (after adding or revoking a client's ``.key`` file).

        Returns the keys allowed before and not now (z85). A folder that fails a
        check raises and leaves the keys allowed so far in force.
        """
        folder = self.clients_dir
        if not folder.is_dir():
            raise KVCacheError(f"curve_clients_dir: {folder} is not a folder")
        mode = folder.stat().st_mode
        if mode & 0o022:
            raise KVCacheError(f"curve_clients_dir: {folder} is writable by other users (mode "
                               f"{stat.S_IMODE(mode):04o}), who could add their own key; chmod 700 {folder}")
        try:
            files = sorted(folder.glob("*.key"))
        except OSError as exc:
            raise KVCacheError(f"curve_clients_dir: cannot list {folder}: {exc.strerror}") from None
        keys = {_load_cert(path, "curve_clients_dir")[0] for path in files}  # a bad file raises, naming it
        revoked = self.allowed - {key.decode() for key in keys}
        self.certs[ZAP_DOMAIN] = dict.fromkeys(keys, True)  # what pyzmq's ZAP handler looks keys up in
        self.allowed = frozenset(key.decode() for key in keys)
        if not keys:
            log.warning("curve: %s holds no client public keys (*.key): every client will be refused", folder)
        log.info("curve: %d client key(s) allowed from %s%s", len(keys), folder,
                 f"; revoked {len(revoked)}: {', '.join(sorted(revoked))}" if revoked else "")
        return frozenset(revoked)

    def recv_allowed(self, sock: zmq.Socket, flags: int = 0) -> list[bytes] | None:
        """A message of ``sock`` (a CURVE server), or None for one of a client whose key is no longer allowed.

        libzmq keeps a connection open after its key is revoked; each message
        carries the key it was admitted with as its ``User-Id``, which this
        handler set, so a revoked client's messages are dropped (and logged) here.
        """
        frames = sock.recv_multipart(flags, copy=False)
        try:
            user = frames[0].get("User-Id")
        except zmq.ZMQError:  # no ZAP handler admitted this peer: not ours to answer
            user = None
        if user in self.allowed:
            return [frame.bytes for frame in frames]
        self._refusals.report(f"CURVE client with public key {user}",
                              f"its key was revoked (no longer in {self.clients_dir}); its message was dropped")
        return None

    def watch(self, sock: zmq.Socket) -> None:
        """Log handshake failures of ``sock`` (no keys, wrong server key), which never reach the ZAP handler.

        A thread reads the socket's monitor. libzmq gives a socket one monitor,
        so a caller that needs the socket's events takes it over with ``hand_over``.
        """
        monitor = open_monitor(sock, HANDSHAKE_FAILURES | zmq.EVENT_MONITOR_STOPPED)
        stop = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(monitor, stop), name="kvcache-auth-watch", daemon=True)
        self._watchers[id(sock)] = _Watcher(sock, watcher, stop)
        watcher.start()

    def hand_over(self, sock: zmq.Socket) -> Callable[[dict[str, Any]], bool] | None:
        """Stop watching ``sock`` so the caller can monitor it; None if it was not watched.

        The caller's monitor must include ``HANDSHAKE_FAILURES`` and pass every
        event to the returned ``report_handshake``, which logs the refusals.
        Call it from the thread that owns ``sock``.
        """
        watcher = self._watchers.pop(id(sock), None)
        if watcher is None:
            return None
        watcher.end()
        return self.report_handshake

    def report_handshake(self, event: dict[str, Any]) -> bool:
        """Log a monitor event of a CURVE server socket if it is a failed handshake; says whether it was one."""
        kind = event["event"]
        if not kind & HANDSHAKE_FAILURES:
            return False
        endpoint = event["endpoint"].decode(errors="replace")
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            reason = _PROTOCOL_REASONS.get(event["value"], f"ZMTP protocol error {event['value']:#x}")
        else:
            reason = _BROKEN_OFF
        self._refusals.report(f"a client of {endpoint}", reason)
        return True

    def stop(self) -> None:
        """Stop the socket watchers (each within WATCH_JOIN_S), then the ZAP thread.

        Call it from the thread that owns the watched sockets, before closing
        them or after: each watcher ends on its monitor's last event and only
        then closes its monitor socket, which nobody else closes.
        """
        with _running_lock:
            if _running.get(id(self.context)) is self:
                del _running[id(self.context)]
        watchers, self._watchers = self._watchers, {}
        for watcher in watchers.values():
            watcher.end()
        super().stop()

    def _watch(self, monitor: zmq.Socket, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                if not monitor.poll(100):
                    continue
                event = recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                self.report_handshake(event)
        except zmq.ContextTerminated:
            pass  # the context ended under a watcher whose stop did not wait for it
        finally:
            monitor.close(0)


    async def handle_zap_message(self, msg: list[bytes]) -> None:
        """Answer one ZAP request (pyzmq decides); the request is kept so a refusal can name the peer."""
        self._request = msg
        try:
            await super().handle_zap_message(msg)
        finally:
            self._request = None

    def _send_zap_reply(self, request_id: bytes, status_code: bytes, status_text: bytes,
                        user_id: Any = "anonymous") -> None:
        if status_code != b"200":
            self._refusals.report(*_describe_zap(self._request, self.clients_dir, status_text))
        super()._send_zap_reply(request_id, status_code, status_text, user_id)


def _describe_zap(request: list[bytes] | None, clients_dir: Path, status: bytes) -> tuple[str, str]:
    """(peer, reason) of a refused ZAP request: frames are version, id, domain, address, identity, mechanism, key."""
    if request is None or len(request) < 6:
        return "a peer", f"malformed ZAP request ({status.decode(errors='replace')})"
    address, mechanism = request[3].decode(errors="replace"), request[5].decode(errors="replace")
    if mechanism == "CURVE" and len(request) > 6 and len(request[6]) == 32:
        key = z85.encode(request[6]).decode()
        if status == b"Unknown key":
            return f"CURVE client at {address} with public key {key}", f"the key is not in {clients_dir}"
        return f"CURVE client at {address} with public key {key}", status.decode(errors="replace")
    return f"{mechanism} client at {address}", status.decode(errors="replace")


def check_ipc_permissions(path: str | os.PathLike) -> None:
    """Raise unless the ipc socket (a path or ``ipc://PATH``) belongs to this user and only this user may use it.

    Group or other bits on the socket let other users in; a folder above it that
    kvcache.paths refuses lets them replace it.
    """
    text = os.fspath(path)
    target = Path(text[len("ipc://"):] if text.startswith("ipc://") else text)
    try:
        info = target.stat()
    except OSError as exc:
        raise KVCacheError(f"ipc: cannot stat {target}: {exc.strerror}") from None
    if not stat.S_ISSOCK(info.st_mode):
        raise KVCacheError(f"ipc: {target} is not a socket")
    if info.st_uid != os.geteuid():
        raise KVCacheError(f"ipc: {target} belongs to uid {info.st_uid}, not this user ({os.geteuid()})")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise KVCacheError(f"ipc: {target} has mode {mode:04o}; other users can connect (want 0600 or 0700)")
    check_socket_path(target, "ipc")  # and its folders: this user's or root's, writable by their owner alone


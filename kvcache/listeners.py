"""The daemon's bound sockets: ipc files owner-only and locked against a second daemon, CURVE on every other one.

An ipc:// socket (and the local endpoint's datagram socket) is created under
umask 077, in a folder that only this user (or root) owns and may write
(kvcache.paths: one another user made or may write is refused), beside a
lock file ``PATH.lock`` that holds the daemon's pid and that it keeps locked
(``flock``) while it runs. A second daemon on the same path is refused, naming
the first, instead of replacing its socket; the lock of a daemon that died
(kill -9) is free again, and the next start replaces its stale files. ``close`` removes every socket and lock file.

With CURVE, every other socket (tcp://) uses the daemon's key and lets in only
the allowed clients; a ROUTER's messages from a client revoked since it
connected are dropped (``receiver``), and ``drop_subscribers`` makes every PUB
peer connect and authenticate again.
"""
from __future__ import annotations

import fcntl
import functools
import logging
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import zmq

from kvcache.allocator.errors import KVCacheError
from kvcache.auth import secure_server_socket
from kvcache.paths import make_socket_folder

if TYPE_CHECKING:
    from kvcache.auth import CurveConfig, KeyAuthenticator

log = logging.getLogger("kvcache.listeners")
REBIND_S = 2.0  # how long a re-bind waits for its port: libzmq closes the old listener asynchronously


class Listeners:
    """Binds one daemon's sockets and, on ``close``, removes their files and releases their locks.

    The sockets themselves belong to their callers, who close them before calling ``close``.
    """

    def __init__(self, curve: CurveConfig | None = None) -> None:
        self.curve = curve
        self._checked: dict[int, KeyAuthenticator] = {}  # id(ROUTER) -> the authenticator that admitted its peers
        self._publishers: list[tuple[zmq.Socket, str]] = []  # CURVE PUB sockets and the endpoints they are bound to
        self._files: list[Path] = []
        self._locks: list[tuple[Path, int]] = []

    def bind(self, sock: zmq.Socket, endpoint: str, field: str) -> None:
        """Bind ``sock`` (its options set) to ``endpoint``; errors name ``field`` (a ServeConfig name)."""
        path = Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None
        if path is not None:
            self._claim(path, field, endpoint)
        elif self.curve is not None:
            auth = secure_server_socket(sock, self.curve)
            if sock.type == zmq.ROUTER:
                self._checked[id(sock)] = auth
        old_umask = os.umask(0o077)  # ipc sockets: owner-only
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise KVCacheError(_bind_error(field, endpoint, exc)) from None
        finally:
            os.umask(old_umask)
        if path is not None:
            self._files.append(path)
        elif self.curve is not None and sock.type == zmq.PUB:
            self._publishers.append((sock, sock.last_endpoint.decode()))

    def bind_datagram(self, path: Path, field: str) -> socket.socket:
        """A Unix datagram socket bound at ``path``, owner-only and locked like the ipc ones."""
        self._claim(path, field, str(path))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        old_umask = os.umask(0o077)
        try:
            sock.bind(str(path))
        except OSError as exc:
            sock.close()
            raise KVCacheError(f"{field}: cannot bind {path}: {exc.strerror}") from None
        finally:
            os.umask(old_umask)
        self._files.append(path)
        return sock

    def receiver(self, sock: zmq.Socket) -> Callable[[int], list[bytes] | None]:
        """``sock.recv_multipart``; on a CURVE ROUTER, one that returns None for a message of a revoked client."""
        auth = self._checked.get(id(sock))
        if auth is None:
            return sock.recv_multipart
        return functools.partial(auth.recv_allowed, sock)

    def drop_subscribers(self) -> None:
        """Disconnect every peer of the CURVE PUB sockets, so each connects and passes the key check again.

        A PUB cannot refuse one peer's traffic, and libzmq keeps a connection
        open after its key is revoked; unbinding closes every connection the
        listener accepted. Allowed subscribers reconnect within a few hundred
        ms and see the messages they missed as a gap in the sequence numbers.
        """
        for sock, endpoint in self._publishers:
            try:
                sock.unbind(endpoint)
            except zmq.ZMQError:  # its bind again failed last time: nothing to unbind
                pass
            deadline = time.monotonic() + REBIND_S
            while True:
                try:
                    sock.bind(endpoint)
                    break
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                        log.error("cannot bind %s again after dropping its subscribers: %s; no subscriber reaches "
                                  "it until the daemon restarts", endpoint, exc)
                        break
                    time.sleep(0.01)
        if self._publishers:
            log.info("dropped the connections of every subscriber of %s; allowed ones reconnect",
                     ", ".join(endpoint for _, endpoint in self._publishers))

    def close(self) -> None:
        """Remove the socket files, then the lock files, then release the locks (once the sockets are closed)."""
        for path in self._files:
            path.unlink(missing_ok=True)
        self._files.clear()
        for lock, fd in self._locks:
            lock.unlink(missing_ok=True)  # while still locked: a starting daemon then locks a new file, not this one
            os.close(fd)
        self._locks.clear()
        self._checked.clear()
        self._publishers.clear()

    def _claim(self, path: Path, field: str, endpoint: str) -> None:
        """Check ``path``'s folder (kvcache.paths), lock its lock file (refused while a live daemon holds it), then
        remove a stale socket file."""
        make_socket_folder(path.parent, field)  # refuses a folder another user made or may write
        lock = path.with_name(path.name + ".lock")
        if any(lock == held for held, _ in self._locks):
            raise KVCacheError(f"{field}: {endpoint} is already one of this daemon's sockets; give each its own path")
        self._locks.append((lock, _lock(lock, field, endpoint)))
        path.unlink(missing_ok=True)  # left by a daemon that died: nobody holds its lock


class LockHeld(KVCacheError):
    """A lock file another live process holds; ``holder`` is the pid it wrote there."""

    def __init__(self, lock: Path, holder: str) -> None:
        super().__init__(f"{lock} is held by process {holder}")
        self.holder = holder


def pid_lock(lock: Path) -> int:
    """An open, exclusively locked (flock) ``lock`` file holding this pid; ``LockHeld`` while another process has it.

    A holder that removes the file removes it before it unlocks, so a lock taken on a file
    that is no longer at ``lock`` is dropped and taken again on the new one.
    """
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LockHeld(lock, holder) from None
        try:
            found = os.stat(lock)
        except FileNotFoundError:
            found = None
        held = os.fstat(fd)
        if found is not None and (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino):
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError:
                os.close(fd)
                raise
            return fd
        os.close(fd)


def _lock(lock: Path, field: str, endpoint: str) -> int:
    """``pid_lock`` of an endpoint's lock file, its refusals naming the endpoint and the running daemon."""
    try:
        return pid_lock(lock)
    except LockHeld as exc:
        raise KVCacheError(f"{field}: {endpoint} is in use by a running kvcache serve (pid {exc.holder}, lock "
                           f"{lock}); stop it or choose another path") from None
    except OSError as exc:
        raise KVCacheError(f"{field}: cannot use the lock file {lock}: {exc.strerror}") from None


def _bind_error(field: str, endpoint: str, exc: zmq.ZMQError) -> str:
    """One line for a failed bind; an address in use says who may hold it."""
    if exc.errno == zmq.EADDRINUSE:
        return (f"{field}: cannot bind {endpoint}: the address is in use (another kvcache serve, or another "
                "program, listens there); stop it or choose another port")
    return f"{field}: cannot bind {endpoint}: {exc.strerror}"

"""Rank keys: what proves to a daemon that a worker owns a TP rank, and the daemon's admin key that overrides them.

The first claim of a rank (``attach`` of a decode receiver or a prefill messager, ``tier_attach`` of a host-tier
agent) sets the rank's owner key; the daemon then lets a claim of that rank, and a report for it (``received``,
``sent``), through only with the same key. A worker restarted by the same user must find the same key:

    rank_key(endpoint, rank, curve=..., key_file=...)

takes it, in this order, from ``key_file`` (the operator's path: created 0600 with a random key if missing), from
the CURVE client secret certificate (a keyed hash of it and the rank), or from a file created 0600 next to the
daemon's ``ipc://`` socket (``SOCKET.rank-R.key``, in the socket's folder, which only the daemon's user may write).
A ``tcp://`` daemon without CURVE or a key file gives a random key: a restarted worker cannot claim its rank again.

The daemon's admin key takes a rank over whatever its owner (``admin=`` on the claim): a keyed hash of the daemon's
CURVE server secret certificate when it has one, else a random key the daemon writes 0600 next to its ``ipc://``
socket (``SOCKET.admin.key``) at start. Holding either is holding the daemon's keys.
"""
from __future__ import annotations

import hashlib
import os
import secrets
import stat
import time
from pathlib import Path

from kvcache.allocator.errors import KVCacheError
from kvcache.auth import CurveConfig, load_secret_cert
from kvcache.paths import check_socket_folder, ipc_path

KEY_BITS = 63  # a key fits a msgpack int64


def _derived(secret: bytes, purpose: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(purpose, digest_size=8, key=secret).digest(), "big") >> 1


def curve_rank_key(curve: CurveConfig, rank: int) -> int:
    """Rank ``rank``'s key derived from ``curve``'s client secret certificate (the same for every restart)."""
    secret = load_secret_cert(curve.client_secret, "curve_client_cert")[1]
    return _derived(secret, b"kvcache rank owner %d" % rank)


def key_file_of(endpoint: str, name: str) -> Path | None:
    """The default key file ``SOCKET.NAME.key`` beside an ``ipc://`` endpoint's socket (its folder checked private),
    or None for another transport."""
    if not endpoint.startswith("ipc://"):
        return None
    path = Path(os.path.abspath(ipc_path(endpoint)))
    check_socket_folder(path.parent, "endpoint")
    return path.with_name(f"{path.name}.{name}.key")


def read_key_file(path: str | os.PathLike, field: str, *, create: bool = True) -> int:
    """The key in ``path``; created 0600 with a random key when missing (``create``). A symbolic link, a file of
    another user or one that others may read is refused, naming the path and the fix."""
    path = Path(path)
    flags = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    deadline = time.monotonic() + 5.0
    while True:
        if create:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                pass
            except OSError as exc:
                raise KVCacheError(f"{field}: cannot create the key file {path}: {exc.strerror}") from None
            else:
                key = secrets.randbits(KEY_BITS)
                with os.fdopen(fd, "w") as out:
                    out.write(f"{key}\n")
                return key
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise KVCacheError(f"{field}: cannot read the key file {path}: {exc.strerror}") from None
        with os.fdopen(fd) as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
                raise KVCacheError(f"{field}: the key file {path} is not a plain file of this user readable by it "
                                   f"alone (uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o}); remove it, "
                                   "or chmod 600 it if it is yours")
            text = f.read()
        if text.endswith("\n"):
            try:
                key = int(text)
            except ValueError:
                key = -1
            if not 0 <= key < 1 << KEY_BITS:
                raise KVCacheError(f"{field}: the key file {path} holds no key (one integer in [0, 2**63)); remove it")
            return key
        if time.monotonic() > deadline:  # another worker creating it never finished writing it
            raise KVCacheError(f"{field}: the key file {path} is empty; remove it")
        time.sleep(0.01)


def rank_key(endpoint: str, rank: int, *, curve: CurveConfig | None = None,
             key_file: str | os.PathLike | None = None) -> int:
    """The key rank ``rank``'s worker claims its rank with at the daemon at ``endpoint`` (see the module doc)."""
    if key_file is not None:
        return read_key_file(key_file, "key_file")
    if curve is not None and curve.client_secret is not None:
        return curve_rank_key(curve, rank)
    path = key_file_of(endpoint, f"rank-{rank}")
    return secrets.randbits(KEY_BITS) if path is None else read_key_file(path, "key_file")


def admin_key(endpoint: str, server_secret: str | os.PathLike | None = None, *, create: bool = False) -> int | None:
    """The daemon's admin key (see the module doc), or None where it has none (a tcp:// daemon without CURVE).

    ``create``: the daemon's side, which writes the ipc key file when missing."""
    if server_secret:
        return _derived(load_secret_cert(Path(server_secret), "curve_server_cert")[1], b"kvcache admin")
    path = key_file_of(endpoint, "admin")
    return None if path is None else read_key_file(path, "admin key", create=create)

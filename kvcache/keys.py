"""`kvcache keys DIR`: CURVE key pairs for the daemon and its clients, readable only by their owner;
`kvcache keys revoke DIR`: take one client's key back.

Layout (the daemon's pair is made once and kept; each ``--name`` adds a client)::

    DIR/server.key_secret    the daemon's secret certificate      (daemon only, 0600)
    DIR/server.key           the daemon's public certificate      (copy to every client)
    DIR/NAME.key_secret      client NAME's secret certificate     (client NAME only, 0600)
    DIR/clients/NAME.key     client NAME's public certificate     (the daemon allows every key here)

Revoking a client is deleting its ``clients/NAME.key`` and sending the daemon
SIGHUP (``kvcache keys revoke DIR --name NAME --pid PID`` does both): the daemon
reads the folder again, drops the client's messages on its open connections,
reconnects its subscribers, and refuses its new connections.

After every reading of the folder (at start and on each SIGHUP) the daemon writes
its outcome to ``clients/reload-status.json`` (not a ``*.key`` file, so never read
as one)::

    {"pid": int, "reloads": int (0 at start, +1 per SIGHUP), "ok": bool, "error": str, "allowed": [z85 public keys]}

``revoke --pid`` waits for the reload its SIGHUP caused (``REVOKE_WAIT_S`` at most)
and fails, naming the reason, when the daemon refused the folder, did not answer, or
still allows the key.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import zmq
import zmq.auth

from kvcache.allocator.errors import KVCacheError

SERVER = "server"
CLIENTS = "clients"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
RELOAD_STATUS = "reload-status.json"
REVOKE_WAIT_S = 10.0  # how long `revoke --pid` waits for the daemon to report reading the folder again


def write_reload_status(clients_dir: str | os.PathLike, reloads: int, error: str | None,
                        allowed: frozenset[str]) -> None:
    """The daemon's side: the outcome of its ``reloads``-th reading of ``clients_dir`` (``error``: it refused the
    folder and keeps ``allowed``), replaced atomically; OSError when it cannot be written."""
    folder = Path(clients_dir)
    status = {"pid": os.getpid(), "reloads": reloads, "ok": error is None, "error": error or "",
              "allowed": sorted(allowed)}
    fd, tmp = tempfile.mkstemp(prefix=".reload-status-", dir=folder)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(status, out)
        os.replace(tmp, folder / RELOAD_STATUS)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_reload_status(clients_dir: str | os.PathLike) -> dict | None:
    """The last reload status a daemon wrote in ``clients_dir``, or None (none, or not readable as one)."""
    try:
        status = json.loads((Path(clients_dir) / RELOAD_STATUS).read_text())
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None


class KeyFiles(NamedTuple):
    """Where ``create_keys`` put each certificate, and whether the daemon's pair was made now."""

    server_secret: Path
    server_public: Path
    client_secret: Path
    client_public: Path
    server_created: bool


def create_keys(folder: str | os.PathLike, name: str = "client") -> KeyFiles:
    """Make the daemon's key pair (unless ``folder`` has it) and client ``name``'s; folders 0700, secrets 0600.

    Files are created under umask 077, so a secret is never readable by others,
    not even for a moment. An existing client of the same name is an error,
    not overwritten: its holder would be locked out.
    """
    if not zmq.has("curve"):
        raise KVCacheError("keys: this libzmq was built without CURVE (libsodium)")
    if not _NAME.fullmatch(name) or name == SERVER:
        raise KVCacheError(f"--name: {name!r} must be 1-64 letters, digits, '_', '.' or '-' (not {SERVER!r})")
    root = Path(folder)
    clients = root / CLIENTS
    files = KeyFiles(root / f"{SERVER}.key_secret", root / f"{SERVER}.key", root / f"{name}.key_secret",
                     clients / f"{name}.key", server_created=False)
    if files.client_secret.exists() or files.client_public.exists():
        raise KVCacheError(f"--name: client {name!r} already has keys in {root}; delete {files.client_secret} and "
                           f"{files.client_public} first to replace them")
    old_umask = os.umask(0o077)
    try:
        for path in (root, clients):
            path.mkdir(parents=True, exist_ok=True)
            os.chmod(path, 0o700)
        created = not files.server_secret.exists()
        if created:
            zmq.auth.create_certificates(root, SERVER)
        elif not files.server_public.exists():
            raise KVCacheError(f"keys: {files.server_secret} exists without {files.server_public}")
        zmq.auth.create_certificates(root, name)
        os.replace(root / f"{name}.key", files.client_public)
    except OSError as exc:
        raise KVCacheError(f"keys: cannot write in {root}: {exc.strerror}") from None
    finally:
        os.umask(old_umask)
    for path in (files.server_secret, files.client_secret):
        os.chmod(path, 0o600)
    for path in (files.server_public, files.client_public):
        os.chmod(path, 0o644)
    return files._replace(server_created=created)


def revoke_key(folder: str | os.PathLike, name: str) -> list[Path]:
    """Delete client ``name``'s public key from ``folder``/clients, and its secret certificate in ``folder``.

    Returns the files deleted. The daemon refuses the client once it reads the
    folder again (SIGHUP); the name can then be given new keys.
    """
    if not _NAME.fullmatch(name) or name == SERVER:
        raise KVCacheError(f"--name: {name!r} is not a client's name")
    root = Path(folder)
    public, secret = root / CLIENTS / f"{name}.key", root / f"{name}.key_secret"
    if not public.exists():
        raise KVCacheError(f"--name: {public} does not exist: client {name!r} is not allowed by {root / CLIENTS}")
    deleted = []
    for path in (public, secret):
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise KVCacheError(f"keys: cannot delete {path}: {exc.strerror}") from None
        deleted.append(path)
    return deleted


def check_daemon_pid(pid: int) -> None:
    """Raise unless ``pid`` is a running `kvcache serve` (read from /proc where there is one)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except FileNotFoundError:
        raise KVCacheError(f"--pid: no process {pid} is running") from None
    except OSError:  # no /proc on this system: os.kill still checks the process exists
        return
    if not any(a == "serve" and (b == "kvcache" or b.endswith("/kvcache")) for b, a in zip(argv, argv[1:])):
        raise KVCacheError(f"--pid: process {pid} is not a kvcache serve ({' '.join(argv).strip()[:100]})")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `kvcache keys` (and its `revoke` form)."""
    p = sub.add_parser("keys", help="make CURVE keys for a daemon on tcp:// and its clients, or revoke a client's",
                       usage="kvcache keys [-h] DIR [--name NAME]\n       kvcache keys revoke DIR --name NAME "
                       "[--pid PID]",
                       description="Create CURVE key pairs: the daemon's (once) and one client's, with owner-only "
                       "permissions, and print how to use them. With `revoke`: delete client NAME's public key "
                       "(DIR/clients/NAME.key) and its secret certificate (DIR/NAME.key_secret), and with --pid "
                       "send that daemon SIGHUP, so it refuses the client from now on, on the connections it has "
                       "open too.", allow_abbrev=False)
    p.add_argument("folder", metavar="DIR", help="folder for the keys (created with mode 0700)")
    p.add_argument("revoke_folder", nargs="?", help=argparse.SUPPRESS)  # `keys revoke DIR`: DIR lands here
    p.add_argument("--name", help="the client's name, one per scheduler or worker host (default client; "
                   "revoke: required)")
    p.add_argument("--pid", type=int, help="revoke: the pid of the `kvcache serve` that uses DIR/clients (its "
                   "ready line names it), sent SIGHUP to read the folder again; without it, send SIGHUP yourself")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    if args.folder == "revoke" and args.revoke_folder is not None:
        return _revoke(args.revoke_folder, args.name, args.pid)
    if args.revoke_folder is not None:
        raise KVCacheError(f"keys: one folder only, got {args.folder!r} and {args.revoke_folder!r} (to revoke a "
                           "client: kvcache keys revoke DIR --name NAME)")
    if args.folder == "revoke":
        raise KVCacheError("keys revoke: give the keys folder: kvcache keys revoke DIR --name NAME [--pid PID]")
    if args.pid is not None:
        raise KVCacheError("--pid: only with revoke (kvcache keys revoke DIR --name NAME --pid PID)")
    name = args.name or "client"
    files = create_keys(args.folder, name)
    server = "created" if files.server_created else "kept (already there)"
    allowed = files.client_public.parent
    rows = [("daemon secret", files.server_secret, f"{server}; keep on the daemon's host only"),
            ("daemon public", files.server_public, "copy to every client"),
            ("client secret", files.client_secret, f"copy to client {name!r} only"),
            ("client public", files.client_public, f"allowed: the daemon accepts every key in {allowed}")]
    width = max(len(str(path)) for _, path, _ in rows)
    print(f"kvcache keys: CURVE keys in {Path(args.folder)}")
    for label, path, note in rows:
        print(f"  {label}  {str(path):<{width}}  {note}")
    print(f"daemon:\n  kvcache serve --endpoint tcp://0.0.0.0:5555 --curve-server-cert {files.server_secret} "
          f"--curve-clients-dir {allowed}\n"
          f"client {name!r} (copy {files.client_secret} and {files.server_public} to its host):\n"
          f"  CacheClient(\"tcp://DAEMON:5555\", curve=CurveConfig.for_client(\"{files.client_secret}\", "
          f"\"{files.server_public}\"))\n"
          f"  kvcache stats --endpoint tcp://DAEMON:5555 --curve-client-cert {files.client_secret} "
          f"--curve-server-public {files.server_public}\n"
          f"more clients: kvcache keys {args.folder} --name OTHER; revoke one: kvcache keys revoke {args.folder} "
          "--name NAME --pid DAEMON_PID")
    return 0


def _revoke(folder: str, name: str | None, pid: int | None) -> int:
    if not name:
        raise KVCacheError("--name: revoke needs the client's name (kvcache keys revoke DIR --name NAME)")
    clients = Path(folder) / CLIENTS
    key, before = None, -1
    if pid is not None:
        check_daemon_pid(pid)  # before deleting anything: a wrong pid changes nothing
        try:
            key = zmq.auth.load_certificate(clients / f"{name}.key")[0].decode()
        except (OSError, ValueError):  # revoke_key names a missing file; a broken one is deleted all the same
            key = None
        status = read_reload_status(clients)
        if status is not None and status.get("pid") == pid:
            before = status.get("reloads", -1)
    for path in revoke_key(folder, name):
        print(f"kvcache keys: deleted {path}")
    if pid is None:
        print(f"kvcache keys: client {name!r} is revoked once the daemon reads {Path(folder) / CLIENTS} again: "
              "kill -HUP DAEMON_PID")
        return 0
    try:
        os.kill(pid, signal.SIGHUP)
    except OSError as exc:
        raise KVCacheError(f"--pid: cannot signal {pid}: {exc.strerror}; the key is deleted, send SIGHUP to the "
                           "daemon yourself") from None
    _await_reload(clients, pid, before, name, key)
    print(f"kvcache keys: kvcache serve pid {pid} read {clients} again: it refuses client {name!r} from now on")
    return 0


def _await_reload(clients: Path, pid: int, before: int, name: str, key: str | None) -> None:
    """Wait (``REVOKE_WAIT_S`` at most) for daemon ``pid`` to report a reload after ``before``; raise naming the
    reason unless it took the folder and no longer allows ``key``."""
    deadline = time.monotonic() + REVOKE_WAIT_S
    while True:
        status = read_reload_status(clients)
        if status is not None and status.get("pid") == pid and status.get("reloads", -1) > before:
            break
        if time.monotonic() > deadline:
            raise KVCacheError(f"--pid: kvcache serve pid {pid} did not report reading {clients} again within "
                               f"{REVOKE_WAIT_S:g} s (no {clients / RELOAD_STATUS} from it: is it serving "
                               f"--curve-clients-dir {clients}?); the key file is deleted, but client {name!r} may "
                               "still be allowed")
        time.sleep(0.05)
    if not status.get("ok"):
        raise KVCacheError(f"--pid: kvcache serve pid {pid} refused to read {clients} again: {status.get('error')}; "
                           f"client {name!r} stays allowed until a reload succeeds (fix the folder, then kill -HUP "
                           f"{pid})")
    if key is not None and key in status.get("allowed", ()):
        raise KVCacheError(f"--pid: kvcache serve pid {pid} still allows client {name!r}'s key: another *.key file in "
                           f"{clients} holds the same public key; delete it and kill -HUP {pid}")

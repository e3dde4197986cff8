"""`kvcache keys DIR`: CURVE key pairs for the daemon and its clients, readable only by their owner.

Layout (the daemon's pair is made once and kept; each ``--name`` adds a client)::

    DIR/server.key_secret    the daemon's secret certificate      (daemon only, 0600)
    DIR/server.key           the daemon's public certificate      (copy to every client)
    DIR/NAME.key_secret      client NAME's secret certificate     (client NAME only, 0600)
    DIR/clients/NAME.key     client NAME's public certificate     (the daemon allows every key here)

Revoking a client is deleting its ``clients/NAME.key`` and restarting the daemon.
"""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import NamedTuple

import zmq
import zmq.auth

from kvcache.allocator.errors import KVCacheError

SERVER = "server"
CLIENTS = "clients"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


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


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `kvcache keys`."""
    p = sub.add_parser("keys", help="make CURVE keys for a daemon on tcp:// and its clients",
                       description="Create CURVE key pairs: the daemon's (once) and one client's, with owner-only "
                       "permissions, and print how to use them.")
    p.add_argument("folder", metavar="DIR", help="folder for the keys (created with mode 0700)")
    p.add_argument("--name", default="client", help="the client's name, one per scheduler or worker host "
                   "(default client)")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    files = create_keys(args.folder, args.name)
    server = "created" if files.server_created else "kept (already there)"
    allowed = files.client_public.parent
    rows = [("daemon secret", files.server_secret, f"{server}; keep on the daemon's host only"),
            ("daemon public", files.server_public, "copy to every client"),
            ("client secret", files.client_secret, f"copy to client {args.name!r} only"),
            ("client public", files.client_public, f"allowed: the daemon accepts every key in {allowed}")]
    width = max(len(str(path)) for _, path, _ in rows)
    print(f"kvcache keys: CURVE keys in {Path(args.folder)}")
    for label, path, note in rows:
        print(f"  {label}  {str(path):<{width}}  {note}")
    print(f"daemon:\n  kvcache serve --endpoint tcp://0.0.0.0:5555 --curve-server-cert {files.server_secret} "
          f"--curve-clients-dir {allowed}\n"
          f"client {args.name!r} (copy {files.client_secret} and {files.server_public} to its host):\n"
          f"  CacheClient(\"tcp://DAEMON:5555\", curve=CurveConfig.for_client(\"{files.client_secret}\", "
          f"\"{files.server_public}\"))\n"
          f"more clients: kvcache keys {args.folder} --name OTHER; revoke one: delete its {CLIENTS}/NAME.key and "
          "restart the daemon")
    return 0

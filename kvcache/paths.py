"""Who may touch a daemon's socket paths: this user or root, and nobody else.

A process that reaches ``kvcache serve`` over ipc:// (or the local endpoint's
datagram socket) trusts whoever can put a socket at that path. So the daemon
before it binds, and every client and worker before it connects, checks the
path the way OpenSSH's ``safe_path`` checks its files:

- the socket's folder is a real folder (not a symbolic link), owned by this
  user or root, that neither group nor others may write;
- every folder above it (of the path as given and of its real path) is owned
  by this user or root and not writable by group or others, except a
  root-owned sticky folder such as /tmp or /dev/shm, where others cannot
  rename or remove what is ours;
- a socket already there is not a symbolic link, is owned by this user or
  root, and is not writable by group or others.

Otherwise another local user could bind their own socket there and answer in
the daemon's place. A refusal is one line naming the path, its owner, its mode
and the fix.
"""
from __future__ import annotations

import os
import pwd
import secrets
import socket
import stat
from pathlib import Path

from kvcache.allocator.errors import KVCacheError

FOLDER_MODE = 0o700
"""The mode of the socket folders the daemon creates."""


def ipc_path(endpoint: str | os.PathLike) -> Path:
    """The file path of ``ipc://PATH`` (or of a plain path, such as the local endpoint's)."""
    text = os.fspath(endpoint)
    return Path(text[len("ipc://"):] if text.startswith("ipc://") else text)


def check_socket_path(endpoint: str | os.PathLike, field: str) -> None:
    """Raise KVCacheError unless only this user (or root) can have put a socket at ``endpoint``; see the module doc.

    ``endpoint`` is ``ipc://PATH`` or a socket's path; ``field`` names it in the error. A socket
    that is not there yet is fine: the check of its folder says that only we can create it.
    """
    path = Path(os.path.abspath(ipc_path(endpoint)))
    check_socket_folder(path.parent, field)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise KVCacheError(f"{field}: cannot use {path}: {exc.strerror}") from None
    if stat.S_ISLNK(info.st_mode):
        raise KVCacheError(f"{field}: {path} is a symbolic link (to {os.readlink(path)}), not the daemon's socket; "
                           f"remove it or choose another path")
    _check_owner_and_mode(path, info, field, "socket", sticky_ok=False)


def check_socket_folder(folder: Path, field: str) -> None:
    """Raise KVCacheError unless ``folder`` and every folder above it are safe to hold sockets; see the module doc."""
    folder = Path(os.path.abspath(folder))
    try:
        info = os.lstat(folder)
    except OSError as exc:
        raise KVCacheError(f"{field}: cannot use the folder {folder}: {exc.strerror}") from None
    if stat.S_ISLNK(info.st_mode):
        raise KVCacheError(f"{field}: the socket folder {folder} is a symbolic link (to {os.readlink(folder)}), "
                           f"which another user may have made; give the real folder's path")
    if not stat.S_ISDIR(info.st_mode):
        raise KVCacheError(f"{field}: {folder} is not a folder")
    _check_owner_and_mode(folder, info, field, "socket folder", sticky_ok=False)
    for above in _folders_above(folder):
        try:
            info = os.stat(above)
        except OSError as exc:
            raise KVCacheError(f"{field}: cannot use the folder {above}: {exc.strerror}") from None
        _check_owner_and_mode(above, info, field, "folder above the socket folder", sticky_ok=True)


def make_socket_folder(folder: Path, field: str) -> None:
    """Create ``folder`` and any missing folder above it owner-only (0700), then ``check_socket_path`` it.

    A folder that already exists keeps its owner and mode: one another user made is refused, not adopted.
    """
    folder = Path(os.path.abspath(folder))
    missing = [p for p in (folder, *folder.parents) if not os.path.lexists(p)]
    old_umask = os.umask(0o077)
    try:
        for path in reversed(missing):
            try:
                os.mkdir(path, FOLDER_MODE)
            except FileExistsError:  # made meanwhile (another daemon starting): checked below like any other
                pass
    except OSError as exc:
        raise KVCacheError(f"{field}: cannot create the folder {path}: {exc.strerror}") from None
    finally:
        os.umask(old_umask)
    check_socket_folder(folder, field)


def owner_name(uid: int) -> str:
    """``name (uid N)``, or ``uid N`` for a uid with no user."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def bind_beside(sock: socket.socket, endpoint: str) -> str:
    """Bind ``sock`` to a new socket file (0600, random name) in the folder of the local ``endpoint``; its path.

    That folder is the daemon user's alone (checked before), so only that user or root can ever bind this
    address, also once we are gone; anyone may bind an abstract name, a dead worker's included.
    """
    folder = os.path.dirname(os.path.abspath(endpoint))
    # No longer than the default endpoint's name, so the path fits where the endpoint's does (108 bytes at most).
    path = os.path.join(folder, f"worker-{secrets.token_hex(5)}")
    os.fchmod(sock.fileno(), 0o600)  # the file's mode at bind, whatever the umask (which other threads share)
    sock.bind(path)
    try:
        owner = os.stat(folder)
        if os.geteuid() == 0 and owner.st_uid != 0:  # a root worker of another user's daemon: that user sends to it
            os.chown(path, owner.st_uid, owner.st_gid)
    except OSError:
        remove_socket_file(path)
        raise
    return path


def remove_socket_file(path: str | None) -> None:
    """Remove the socket file at ``path`` (None: nothing), if it is one: never another kind of file."""
    if path is None:
        return
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass


def _folders_above(folder: Path) -> list[Path]:
    """Every folder above ``folder``, in the path as given and in its real path (symbolic links resolved)."""
    seen: dict[Path, None] = {}  # ordered, without repeats
    for path in (folder, Path(os.path.realpath(folder))):
        for above in path.parents:
            seen.setdefault(above)
    return list(seen)


def _check_owner_and_mode(path: Path, info: os.stat_result, field: str, what: str, *, sticky_ok: bool) -> None:
    """Raise unless ``path`` (its ``info``) is this user's or root's and writable by its owner alone.

    With ``sticky_ok``, a root-owned sticky folder (/tmp, /dev/shm) may be writable by others.
    """
    me = os.geteuid()
    mode = stat.S_IMODE(info.st_mode)
    owned = info.st_uid in (me, 0)
    shared = bool(mode & 0o022) and not (sticky_ok and info.st_uid == 0 and mode & stat.S_ISVTX)
    if owned and not shared:
        return
    if not owned:
        fix = "remove it (as its owner or root) or choose another path"
    else:
        fix = f"chmod go-w {path}, or remove it and choose another path"
    trusted = "root" if me == 0 else f"{owner_name(me)} or root"
    raise KVCacheError(f"{field}: refusing the {what} {path}: owned by {owner_name(info.st_uid)} with mode "
                       f"{mode:04o}, so another user could answer in the daemon's place; it must be owned by {trusted} "
                       f"and writable by its owner alone: {fix}")

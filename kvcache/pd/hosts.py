"""Two nodes on one machine: each PD node in a network namespace of its own, so the KV takes the cross-node path.

Within one host NIXL moves KV by paths no network has: the kernel's process_vm_writev (``KernelCopy``),
UCX's shared memory and CMA, cuda_ipc. ``Hosts`` gives each node (its daemon, its workers and their links) a
network namespace of its own, joined to this one by a bridge, so every byte between the nodes, the control
plane's too, crosses a veth pair as it would cross a wire::

    this namespace: the proxy (PDProxy), the tests
    bridge kvb-TAG  10.A.B.1/24
        |                        |
    veth 10.A.B.2            veth 10.A.B.3
    node "prefill"           node "decode"
    (netns kv-TAG-p)         (netns kv-TAG-d)

Namespaces alone do not make a second host: UCX still finds the other node's processes through shared memory
(the same boot id and hostname), so ``env`` restricts UCX to TCP on the node's veth (``UCX_TLS=tcp``,
``UCX_NET_DEVICES``) and turns the kernel copy off (``KVCACHE_KERNEL_COPY=0``; a peer at another namespace's
address is not proven to be on this host anyway). ``cut(role)`` takes a node's link down as a pulled cable does
(packets dropped, no reset), ``restore(role)`` brings it back; ``pids(role)`` lists the processes in a node.

Needs root and iproute2's ``ip``: ``unavailable()`` says why not, in one line.
"""
from __future__ import annotations

import ctypes
import json
import os
import random
import shutil
import subprocess
import uuid
from typing import NamedTuple

from kvcache.allocator.errors import KVCacheError

__all__ = ["Hosts", "Node", "enter_netns", "unavailable"]

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_REC = 0x4000
MS_SLAVE = 1 << 19
MNT_DETACH = 2
NETNS_DIR = "/run/netns"


class Node(NamedTuple):
    """One node: its role, network namespace, address, and its veth pair's ends (at the bridge, inside the node)."""

    role: str
    netns: str
    address: str
    outer: str
    inner: str


class LinkBytes(NamedTuple):
    """Bytes a node's veth sent and received (its end inside the node)."""

    sent: int
    received: int


def unavailable() -> str:
    """Why network namespaces cannot be made here ("" when they can): not root, or no ``ip`` command."""
    if not os.path.isdir("/proc/self/ns") or not os.path.exists("/proc/self/ns/net"):
        return "this system has no network namespaces"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2's ip command is not installed"
    return ""


def enter_netns(name: str) -> None:
    """Move this process into network namespace ``name`` as ``ip netns exec`` does: the namespace, and /sys mounted
    anew in a mount namespace of its own, so what lists network interfaces (UCX) sees the namespace's. Call it
    before the process starts a thread."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]

    def check(result: int, what: str) -> None:
        if result != 0:
            raise KVCacheError(f"netns: cannot enter {name!r}: {what}: {os.strerror(ctypes.get_errno())}")

    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        check(libc.setns(fd, CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(CLONE_NEWNS), "unshare")
    check(libc.mount(None, b"/", None, MS_REC | MS_SLAVE, None), "mount --make-rslave /")  # nothing leaks back
    libc.umount2(b"/sys", MNT_DETACH)  # the host's view of /sys, if mounted
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")


def _ip(*args: str, netns: str = "") -> str:
    command = ["ip", *(["-n", netns] if netns else []), *args]
    run = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if run.returncode != 0:
        raise KVCacheError(f"netns: `{' '.join(command)}` failed: {run.stderr.strip() or run.returncode}")
    return run.stdout


class Hosts:
    """The bridge and one namespace per role (see the module); ``close`` removes them all, also after errors."""

    def __init__(self, roles: tuple[str, ...] = ("prefill", "decode")) -> None:
        why = unavailable()
        if why:
            raise KVCacheError(f"netns: {why}")
        tag = uuid.uuid4().hex[:6]
        subnet = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
        self.bridge = f"kvb-{tag}"
        self.gateway = f"{subnet}.1"
        self.nodes: dict[str, Node] = {}
        self._made: list[tuple[str, str]] = []  # ("link" | "netns", name), removed in reverse
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, role in enumerate(roles):
                node = Node(role, f"kv-{tag}-{role[:1]}{i}", f"{subnet}.{i + 2}", f"kv{tag}o{i}", f"kv{tag}i{i}")
                _ip("netns", "add", node.netns)
                self._made.append(("netns", node.netns))
                _ip("link", "add", node.outer, "type", "veth", "peer", "name", node.inner)
                self._made.append(("link", node.outer))
                _ip("link", "set", node.inner, "netns", node.netns)
                _ip("link", "set", node.outer, "master", self.bridge)
                _ip("link", "set", node.outer, "up")
                _ip("addr", "add", f"{node.address}/24", "dev", node.inner, netns=node.netns)
                _ip("link", "set", node.inner, "up", netns=node.netns)
                _ip("link", "set", "lo", "up", netns=node.netns)
                self.nodes[role] = node
        except BaseException:
            self.close()
            raise

    def env(self, role: str) -> dict[str, str]:
        """What a node's processes run with: UCX over TCP on the node's veth alone, and no kernel copy."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.nodes[role].inner, "KVCACHE_KERNEL_COPY": "0"}

    def command(self, role: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``role``'s namespace (``ip netns exec`` replaces itself with the command)."""
        return ["ip", "netns", "exec", self.nodes[role].netns, *argv]

    def cut(self, role: str) -> None:
        """Take ``role``'s link down at the bridge, as a pulled cable: its packets are dropped, nobody is told."""
        _ip("link", "set", self.nodes[role].outer, "down")

    def restore(self, role: str) -> None:
        """Bring ``role``'s link back up."""
        _ip("link", "set", self.nodes[role].outer, "up")

    def pids(self, role: str) -> list[int]:
        """The processes in ``role``'s namespace."""
        return [int(p) for p in _ip("netns", "pids", self.nodes[role].netns).split()]

    def link_bytes(self, role: str) -> LinkBytes:
        """What ``role``'s end of its veth has sent and received so far."""
        out = _ip("-s", "-j", "link", "show", self.nodes[role].inner, netns=self.nodes[role].netns)
        stats = json.loads(out)[0]["stats64"]
        return LinkBytes(int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"]))

    def close(self) -> None:
        """Remove every namespace and link made (a namespace's processes should have ended first). Idempotent."""
        while self._made:
            kind, name = self._made.pop()
            try:
                _ip(kind, "del", name)
            except KVCacheError:
                pass  # a veth goes with its peer's namespace

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

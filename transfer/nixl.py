"""NixlEngine: write KV blocks into another process's registered region through NIXL (UCX underneath).

NIXL is the transfer library vLLM and Dynamo use: RDMA where the hardware has it, TCP and shared
memory otherwise. Each engine is one NIXL agent. A receiver registers its regions and ``serve``s
its agent metadata and region descriptions on a ZMQ socket; a sender ``connect``s to it (a REQ
round trip with a deadline), gets a ``Peer`` whose regions live in the receiver's address space,
and ``write``s blocks from its own registered regions into them:

    receiver                                   sender
    engine.register(region)                    engine.register(region)
    endpoint = engine.serve("tcp://*:5600")    peer = engine.connect(endpoint)
                                               h = engine.write(region, ids, peer.regions[0], their_ids)
    engine.notifications() -> {sender: [tag]}  h.wait() -> DONE / FAILED (peer died) / TIMEOUT

A large write is cut into chunks that ``threads`` UCX workers post in parallel (on one host the
kernel's cost is per range, so one thread moves scattered 32 KiB blocks at about half the speed of
one big range). Host memory into a peer process on this host that the kernel lets us write is
copied by the kernel directly, many ranges a call (``KernelCopy``), instead of UCX's one call per
range; its notification still goes over NIXL, after the data. ``connect`` makes sure of the peer
before it lets the kernel write (``_unproven``): the hello says the same host as ours (boot id and pid
namespace) and came from an address of this host; the peer answered our fresh nonce with an HMAC, over
the nonce and the very hello we got, keyed by a secret the peer holds in a memfd that we read through
``/proc/<pid>/fd`` (so the key is that process's own, not bytes someone planted in its memory, and a
relayed or replayed hello fails); and the kernel lets us read that process. Every kernel write then lies
inside the memory that hello says the peer registered (the check NIXL makes), or none of it is written.
Any other peer is written through NIXL alone. ``kernel_copy=False`` sends every write through NIXL, as does
``KVCACHE_KERNEL_COPY=0`` in the environment for every engine that is not told otherwise (the links' and
benchmarks' engines too): with UCX restricted to the transports a network has (``UCX_TLS=tcp``, or ``rc`` with
RDMA), two processes of one host then take the path two nodes take.
All NIXL calls that post or poll transfers run on the engine's one worker thread (a post over shared
memory copies inside the call, so the caller's ``write`` must not make it), except a post its caller
asks to make itself (``submit(inline=True)``, when nothing else waits); a handle's ``wait`` returns
at its deadline even if that thread is stuck inside NIXL. A peer that dies makes its transfers FAILED
(UCX reports the disconnect) or TIMEOUT, never a hang, and ``close`` releases every transfer, remote
agent and registration the engine made. A write that timed out may still land later (TCP retransmits
what a downed link held once it is back); a receiver that must be sure it will not cuts the writer off
(``cut_off``: the TCP connections its writes come over are reset).

Who drives UCX (``progress``): ``thread`` (the default), NIXL's progress thread, which sleeps in
poll() between events for up to PROGRESS_DELAY_US (whole milliseconds: poll()'s unit), so a
completion that raises no event (a CUDA copy over cuda_ipc) is seen up to that late; ``poll``, no
such thread: the engine's worker progresses UCX itself, every _POLL_MAX while any write is in
flight (each check of a transfer's state progresses it) and every _IDLE_PROGRESS otherwise, and a
caller's ``notifications()`` progresses it too. Idle, both cost a wake-up per millisecond.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import socket
import stat
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np
import zmq

from kvcache.allocator.errors import KVCacheError
from kvcache.transfer.engines import DEFAULT_TIMEOUT, TransferEngine, TransferHandle, TransferStatus
from kvcache.transfer.regions import ByteRanges, CopyRanges, KVRegion, copy_ranges

log = logging.getLogger("kvcache.nixl")

__all__ = ["KERNEL_COPY_ENV", "PROGRESS_MODES", "KernelCopy", "NixlEngine", "Peer", "default_threads", "host_identity",
           "is_local_endpoint", "kernel_copy_default", "nixl_available", "spread"]

PROTOCOL = 2
KEY_NAME = "kvcache-transfer-key"
"""The memfd an engine keeps its hello key in; a peer reads it through /proc/<pid>/fd to check our answers."""
KEY_BYTES = 32
NONCE_BYTES = 32
PROGRESS_DELAY_US = 1000
"""NIXL's progress thread waits for UCX events in poll() with this timeout (µs, rounded up to ms).
NIXL's Python API fixes it at 0, which makes the thread spin: 80% of a core per idle agent here,
taken from the transfers themselves on a small host. Events still wake it at once."""
SPLIT_DESCRIPTORS = 8
"""With ``threads`` > 1, a write of at least this many descriptors is cut into up to ``threads``
chunks, each posted by its own UCX worker and thread (NIXL's thread-pool engine). On one host UCX
moves data with process_vm_writev, whose kernel cost is per range (pinning the pages of each),
so one thread reaches about half the speed of a single range there; chunks run in parallel."""
SPREAD_MIN_BYTES = 32 << 20
"""Host writes of at least this many bytes are spread over the UCX workers (``spread``); smaller ones stay whole."""
SPREAD_PIECE_BYTES = 1 << 20
"""``spread`` cuts no piece smaller than this."""
_POLL_MAX = 50e-6  # the worker polls transfers in flight at least this often (seconds); idle, it blocks
_IDLE_PROGRESS = 1e-3  # with progress="poll", an idle worker still progresses UCX this often (seconds)
PROGRESS_MODES = ("thread", "poll")
VM_BATCH = 1024
"""process_vm_writev takes at most this many ranges a call (IOV_MAX)."""
MERGE_MAX = 64
"""The worker posts writes that queued up behind a busy one (same peer and memory kinds) as one NIXL
transfer of at most this many writes: each transfer() call has a fixed CPU cost (about 0.6 ms with
GPU memory over cuda_ipc on the H100), so a producer posting a layer at a time must not fall behind."""
KERNEL_COPY_ENV = "KVCACHE_KERNEL_COPY"
"""``0`` turns the kernel copy off in engines made without ``kernel_copy`` (``1``, or unset: on where it can be)."""
_STOP = object()
_AGENT_LOCK = threading.Lock()



def _import_nixl() -> Any:
    """The NIXL Python API module (nixl_cu12, nixl_cu13 or nixl), or None where none is installed."""
    for name in ("nixl_cu12", "nixl_cu13", "nixl._api"):
        try:
            module = __import__(name, fromlist=["nixl_agent"])
        except Exception:
            continue
        if hasattr(module, "nixl_agent"):
            return module
    return None


def nixl_available() -> bool:
    """True where a NIXL wheel imports (install ``kvcache[nixl]``)."""
    return _import_nixl() is not None


class Peer(NamedTuple):
    """A connected receiver: its agent name, where it answered, its process, and its regions."""

    agent: str
    endpoint: str
    host: str
    pid: int
    regions: tuple[KVRegion, ...]


class _KernelPeer(NamedTuple):
    """A peer the kernel may write (``connect`` proved it): its process and the host memory it registered."""

    pid: int
    extents: ByteRanges


class _NixlHandle(TransferHandle):
    """A NIXL write; the engine's worker posts and polls it, then sets ``event``."""

    def __init__(self, ranges: CopyRanges, peer: str, local_mem: str, remote_mem: str, local_dev: int,
                 remote_dev: int, notify: bytes, deadline: float, after: tuple[TransferHandle, ...] = ()) -> None:
        super().__init__(ranges.nbytes, ranges.num_ranges, deadline)
        self.ranges = ranges
        self.peer = peer
        self.local_mem, self.remote_mem = local_mem, remote_mem
        self.local_dev, self.remote_dev = local_dev, remote_dev
        self.notify = notify
        self.after = after  # writes that must be DONE before ``notify`` goes out
        self.held = b""  # ``notify``, held back by the worker until ``after`` are DONE
        self.landed = False  # NIXL reported the data written; a held notification may still be due
        self.xfer: Any = None
        self.cancelled = False
        self.event = threading.Event()
        self.followers: list[_NixlHandle] = []  # later writes merged into this one's transfer; end with it
        self.submitted_ns = time.monotonic_ns()  # when the caller queued it, for benchmarks
        self.picked_ns = 0  # when the worker took it up (time.monotonic_ns)
        self.posted_ns = 0  # when NIXL's transfer() returned
        self.done_ns = 0  # when the worker saw it finish

    def _poll(self) -> None:
        pass  # the worker finishes it

    def _expire(self) -> None:
        self.cancelled = True  # the worker releases (cancels) it on its next pass

    def _sleep(self, seconds: float) -> None:
        self.event.wait(seconds)


class _Posted(NamedTuple):
    """A write its caller posted (``submit(inline=True)``), handed to the worker to poll until it ends."""

    handle: _NixlHandle


class NixlEngine(TransferEngine):
    """One NIXL agent: registers regions, serves and fetches metadata over ZMQ, writes blocks to peers.

    ``threads`` (default ``default_threads()``; 0 or 1 for none) UCX workers, each on its own
    thread, share every write of SPLIT_DESCRIPTORS ranges or more (as many threads share a kernel
    copy). ``progress`` (one of PROGRESS_MODES) says which thread drives UCX: NIXL's own, or the
    engine's worker (see the module).
    """

    def __init__(self, name: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 backends: tuple[str, ...] = ("UCX",), connect_timeout: float = 5.0,
                 threads: int | None = None, progress: str = "thread", kernel_copy: bool | None = None) -> None:
        nixl = _import_nixl()
        if nixl is None:
            raise KVCacheError("NIXL is not installed: pip install nixl-cu12 (or nixl-cu13), without the 'nixl' "
                               "meta package, which pulls in PyTorch")
        if threads is None:
            threads = default_threads()
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise KVCacheError(f"threads must be a whole number >= 0, got {threads!r}")
        if progress not in PROGRESS_MODES:
            raise KVCacheError(f"progress: unknown {progress!r}; expected one of {', '.join(PROGRESS_MODES)}")
        if kernel_copy is None:
            kernel_copy = kernel_copy_default()
        self.progress = progress
        self.name = name or f"kvcache-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.threads = threads if threads > 1 else 0
        # Host memory of a peer process on this host that lets us write it: copied by the kernel (KernelCopy).
        self._kernel = KernelCopy(max(1, self.threads)) if kernel_copy and KernelCopy.supported() else None
        self._kernel_peers: dict[str, _KernelPeer] = {}
        config = nixl.nixl_agent_config(enable_prog_thread=progress == "thread", backends=[],
                                        sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        try:
            self.agent = _make_agent(nixl, self.name, config, PROGRESS_DELAY_US)
            for backend in backends:
                if backend in self.agent.get_plugin_list():
                    self.agent.create_backend(backend, _backend_params(backend, self.threads))
        except Exception as exc:
            raise KVCacheError(f"NIXL agent {self.name!r} could not start backends {list(backends)}: {exc}") from None
        missing = [b for b in backends if b not in self.agent.backends]
        if missing:
            raise KVCacheError(f"NIXL backends {missing} are not available (plugins: {self.agent.get_plugin_list()})")
        # The key our hello answers are signed with, kept where only this process can have put it (a memfd
        # a peer reads through /proc) and in memory at a known address (a peer's read of it through the
        # kernel shows the kernel lets it write here).
        self._key = np.frombuffer(os.urandom(KEY_BYTES), dtype=np.uint8).copy()
        self._key_fd = _key_file(self._key.tobytes())
        self._lock = threading.Lock()
        self._registered: dict[int, tuple[KVRegion, Any]] = {}
        self._peers: dict[str, Peer] = {}
        self._snapshot = b""
        self._refresh_snapshot()
        self._ctx = zmq.Context()
        self._server: threading.Thread | None = None
        self._stopping = threading.Event()
        self._endpoint: str | None = None
        self._hello_from: dict[str, str] = {}  # agent -> the address its hello came from (``cut_off``)
        # The worker never calls SimpleQueue.get(timeout): CPython re-arms that wait with the time left, and a
        # thread preempted past its deadline then waits with a negative timeout, i.e. until the next put (3.11
        # to 3.13 at least). Waiting 50 µs at a time, the worker hit it: a write in flight went unpolled until
        # its 20 s deadline. It waits on ``_wake`` instead, a lock each put releases (a lock's timed acquire
        # handles that case); a queue.Queue would too, at twice an idle engine's CPU.
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Lock()
        self._wake.acquire()  # held: nothing put since the worker last woke
        self._held_job: _NixlHandle | _Posted | None = None  # taken from the queue but not mergeable: next to post
        self._post_lock = threading.Lock()  # held while a write is posted (by the worker or an inline caller)
        self._count_lock = threading.Lock()
        self._unposted = 0  # writes queued for the worker and not yet posted
        self.merged_writes = 0  # writes that shared another's transfer (see MERGE_MAX)
        self._leaked: list[Any] = []
        self._notifs: dict[str, list[bytes]] = {}  # progress="poll": what the worker's progress calls collected
        self._notifs_lock = threading.Lock()
        self._worker = threading.Thread(target=self._run, name=f"nixl-{self.name}", daemon=True)
        self._worker.start()
        self._closed = False

    # ----------------------------------------------------------------- memory

    @property
    def registered(self) -> tuple[KVRegion, ...]:
        """The regions this engine has registered with NIXL, in registration order."""
        with self._lock:
            return tuple(region for region, _ in self._registered.values())

    def register(self, region: KVRegion) -> None:
        """Register a local region's memory with NIXL (idempotent); peers that connect later can write it."""
        self._check_open()
        if region.owner:
            raise KVCacheError(f"region belongs to peer {region.owner!r}; only local memory can be registered")
        if id(region) in self._registered:
            return
        ext = region.extents()
        descs = np.stack([ext.addr, ext.length, np.full_like(ext.addr, region.device_index)], axis=1).astype(np.uint64)
        try:
            reg = self.agent.register_memory(descs, _mem_type(region))
        except Exception as exc:
            raise KVCacheError(f"NIXL could not register {ext.nbytes:,} bytes of {region.device} memory: {exc}") from None
        with self._lock:
            self._registered[id(region)] = (region, reg)
        self._refresh_snapshot()

    def deregister(self, region: KVRegion) -> None:
        """Release a region's NIXL registration; transfers still using it should have finished."""
        with self._lock:
            entry = self._registered.pop(id(region), None)
        if entry is not None:
            self.agent.deregister_memory(entry[1])
            self._refresh_snapshot()

    def _refresh_snapshot(self) -> None:
        """The hello answer peers get: our metadata (it lists registered memory) and region descriptions."""
        body = {"v": PROTOCOL, "agent": self.name, "host": socket.gethostname(), "host_id": host_identity(),
                "pid": os.getpid(), "metadata": self.agent.get_agent_metadata(),
                "regions": [region.describe() for region in self.registered],
                "key": [self._key_fd, self._key.ctypes.data] if self._key_fd >= 0 else None}
        with self._lock:
            self._snapshot = msgpack.packb(body, use_bin_type=True)

    # ----------------------------------------------------------------- control plane

    def serve(self, endpoint: str = "tcp://127.0.0.1:*") -> str:
        """Answer peers' hello requests on a ZMQ ROUTER socket in a background thread; returns the bound endpoint."""
        self._check_open()
        if self._server is not None:
            raise KVCacheError(f"already serving on {self._endpoint}")
        sock = self._ctx.socket(zmq.ROUTER)
        sock.linger = 0
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            raise KVCacheError(f"cannot bind {endpoint}: {exc}") from None
        self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._server = threading.Thread(target=self._answer, args=(sock,), name=f"nixl-md-{self.name}", daemon=True)
        self._server.start()
        return self._endpoint

    def _answer(self, sock: zmq.Socket) -> None:
        """The server thread: one reply per request, from the snapshot; it never calls NIXL."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                if not poller.poll(100):
                    continue
                frames = sock.recv_multipart(copy=False)
                try:
                    request = msgpack.unpackb(frames[-1].bytes, raw=False)
                    if not isinstance(request, dict) or request.get("op") != "hello":
                        raise ValueError(f"unknown request {request!r:.80}")
                    agent, address = request.get("agent"), _peer_address(frames[-1])
                    if isinstance(agent, str) and address:
                        with self._lock:
                            self._hello_from.pop(agent, None)
                            if len(self._hello_from) >= 4096:  # peers come and go: forget the oldest
                                self._hello_from.pop(next(iter(self._hello_from)))
                            self._hello_from[agent] = address
                    if request.get("v") != PROTOCOL:
                        raise ValueError(f"v: protocol {request.get('v')!r} is not ours ({PROTOCOL})")
                    nonce = request.get("nonce")
                    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
                        raise ValueError(f"nonce: must be {NONCE_BYTES} bytes")
                    with self._lock:
                        body = self._snapshot
                    reply = msgpack.packb({"v": PROTOCOL, "body": body, "proof": _proof(self._key, nonce, body)},
                                          use_bin_type=True)
                except Exception as exc:
                    reply = msgpack.packb({"v": PROTOCOL, "error": str(exc)}, use_bin_type=True)
                sock.send_multipart([*(f.bytes for f in frames[:-1]), reply])
        finally:
            sock.close()

    def connect(self, endpoint: str, timeout: float | None = None) -> Peer:
        """Fetch a receiver's metadata and regions over ZMQ (within ``timeout``) and load them into our agent.

        Host memory of a peer that proves it is a process on this host (see the module) is written by the
        kernel from then on, inside the memory it registered; any other peer through NIXL alone.
        """
        self._check_open()
        seconds = self.connect_timeout if timeout is None else timeout
        nonce = os.urandom(NONCE_BYTES)
        sock = self._ctx.socket(zmq.REQ)
        sock.linger = 0
        sock.sndtimeo = max(1, int(seconds * 1000))  # a REQ with no peer blocks in send
        try:
            sock.connect(endpoint)
            try:
                sock.send(msgpack.packb({"v": PROTOCOL, "op": "hello", "agent": self.name, "nonce": nonce},
                                        use_bin_type=True))
            except zmq.Again:
                raise KVCacheError(f"no peer at {endpoint} took the hello within {seconds:g} s") from None
            if not sock.poll(int(seconds * 1000)):
                raise KVCacheError(f"no answer from {endpoint} within {seconds:g} s")
            reply = msgpack.unpackb(sock.recv(), raw=False)
        finally:
            sock.close()
        if not isinstance(reply, dict) or reply.get("v") != PROTOCOL or "error" in reply:
            raise KVCacheError(f"{endpoint} refused hello: {reply.get('error') if isinstance(reply, dict) else reply!r}")
        body, proof = reply.get("body"), reply.get("proof")
        try:
            hello = msgpack.unpackb(body, raw=False)
            if not isinstance(hello, dict) or hello.get("v") != PROTOCOL:
                raise ValueError(f"v: protocol {hello.get('v') if isinstance(hello, dict) else None!r}")
            metadata, descriptions = hello["metadata"], hello["regions"]
            pid, host = hello["pid"], hello["host"]
            if not isinstance(pid, int) or isinstance(pid, bool) or not isinstance(descriptions, list):
                raise TypeError("pid must be a whole number and regions a list")
        except Exception as exc:
            raise KVCacheError(f"{endpoint} sent a malformed hello: {exc}") from None
        try:
            agent = self.agent.add_remote_agent(metadata)
        except Exception as exc:
            raise KVCacheError(f"could not load the metadata of {hello.get('agent')!r}: {exc}") from None
        agent = agent.decode() if isinstance(agent, bytes) else str(agent)
        regions = tuple(KVRegion.from_description(d, owner=agent) for d in descriptions)
        peer = Peer(agent, endpoint, str(host), pid, regions)
        kernel = None
        if self._kernel is not None and pid != os.getpid():
            why = self._unproven(endpoint, hello, body, nonce, proof)
            if why:
                log.info("NIXL engine %s: %s (process %d at %s) is written through NIXL, not the kernel: %s",
                         self.name, agent, pid, endpoint, why)
            else:
                kernel = _KernelPeer(pid, ByteRanges.union(r.extents() for r in regions if not r.is_cuda))
        with self._lock:
            self._peers[agent] = peer
            if kernel is not None:
                self._kernel_peers[agent] = kernel
            else:
                self._kernel_peers.pop(agent, None)
        return peer

    def _unproven(self, endpoint: str, hello: dict, body: bytes, nonce: bytes, proof: Any) -> str:
        """Why the kernel may not write the process a hello names ("" when it may): the hello must come from
        this host (its identity and the address we reached), signed for our ``nonce`` by that process."""
        ours = host_identity()
        if not ours or hello.get("host_id") != ours:
            return f"its host {hello.get('host_id')!r} is not this one ({ours!r})"
        if not is_local_endpoint(endpoint):
            return "its address is not one of this host's"
        key_at = hello.get("key")
        if not (isinstance(key_at, list) and len(key_at) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) for v in key_at)):
            return "it names no key"
        key = _peer_key(hello["pid"], key_at[0])
        if key is None:
            return f"no key of process {hello['pid']} could be read here"
        if not isinstance(proof, bytes) or not hmac.compare_digest(proof, _proof(key, nonce, body)):
            return "its answer to our nonce does not match that process's key (relayed, replayed or forged)"
        assert self._kernel is not None
        if not self._kernel.finds(hello["pid"], key_at[1], key):
            return "the kernel does not let this process read (so write) it"
        return ""

    @property
    def kernel_copy(self) -> bool:
        """Whether this engine may copy host memory to proven peers on this host with the kernel (see the module)."""
        return self._kernel is not None

    def uses_kernel_copy(self, peer: Peer | str) -> bool:
        """Whether writes of host memory to ``peer`` go through the kernel (KernelCopy), not NIXL."""
        with self._lock:
            return (peer.agent if isinstance(peer, Peer) else peer) in self._kernel_peers

    def disconnect(self, peer: Peer | str) -> None:
        """Forget a peer: NIXL drops its metadata and connection; later writes to its regions are refused."""
        agent = peer.agent if isinstance(peer, Peer) else peer
        with self._lock:
            known = self._peers.pop(agent, None)
            self._kernel_peers.pop(agent, None)
        if known is not None:
            try:
                self.agent.remove_remote_agent(agent)
            except Exception:
                pass  # already gone with its process; nothing left to release

    def cut_off(self, agent: str) -> int:
        """Reset every TCP connection a peer that said hello as ``agent`` has into this engine's UCX listeners, so
        nothing it still sends (a write it posted before it stopped, retransmitted by its TCP once a link comes
        back) can land here; returns how many were reset.

        Over NIXL's TCP transport our UCX writes a peer's bytes as they arrive, whatever the peer did with its
        endpoint since (dropping it, as ``disconnect`` does, leaves its socket retransmitting): only the
        connection stops them. The reset drops what the connection holds unread and answers whatever comes later
        with a reset; the peer's UCX sees its endpoint fail and connects afresh for later writes. Connections
        are picked by the peer's address (where its hello came from) and by a local port on which this process
        listens other than our metadata socket: on one host, where every peer shares the address, every peer's
        NIXL connections into this engine go. No hello from ``agent``: 0. Over RDMA there is none to reset.
        """
        with self._lock:
            address = self._hello_from.get(agent)
        if address is None:
            return 0
        served = int(self._endpoint.rsplit(":", 1)[1]) if self._endpoint and self._endpoint.startswith("tcp") else -1
        return _reset_connections(address, exclude_port=served)

    # ----------------------------------------------------------------- transfers

    def write(self, src_region: KVRegion, src_blocks: Any, dst_region: KVRegion, dst_blocks: Any,
              layers: Any = None, rows: Any = None, *, timeout: float | None = None,
              notify: bytes = b"") -> TransferHandle:
        """Write blocks of a local region into a peer's region (or another local one, as loopback).

        ``notify``, if given, reaches the peer (``notifications()``) after the data has landed.
        """
        self._check_open()
        if src_region.owner:
            raise KVCacheError(f"src_region belongs to peer {src_region.owner!r}; NixlEngine writes from local memory")
        peer = dst_region.owner or self.name
        if dst_region.owner and dst_region.owner not in self._peers:
            raise KVCacheError(f"dst_region belongs to {dst_region.owner!r}, which is not connected")
        deadline = self._deadline(timeout)
        ranges = copy_ranges(src_region, src_blocks, dst_region, dst_blocks, layers, rows)
        self.register(src_region)
        if not dst_region.owner:
            self.register(dst_region)
        return self.submit(ranges, peer, src_region, dst_region, deadline=deadline, notify=notify)

    def submit(self, ranges: CopyRanges, peer: str, src_region: KVRegion, dst_region: KVRegion, *,
               deadline: float | None = None, notify: bytes = b"", after: Sequence[TransferHandle] = (),
               inline: bool = False) -> TransferHandle:
        """Post precomputed ranges (inside registered memory of both sides) to ``peer``.

        ``notify`` reaches the peer once this write and every write in ``after`` (earlier handles of
        this engine) are DONE: it rides on this write when those have landed by the time it is posted,
        otherwise the worker sends it the moment the last of them lands. The handle is DONE only after
        the notification went out; FAILED, without one, if any of ``after`` failed.

        ``inline``: when no other write is queued or being posted, post from the calling thread (it
        blocks for the post; over shared memory that copies the data) instead of waking the worker,
        which saves a thread hand-off (0.1-0.3 ms on a busy 2-core host). Otherwise it queues as usual,
        so posts keep their order either way.
        """
        self._check_open()
        handle = _NixlHandle(ranges, peer, _mem_type(src_region), _mem_type(dst_region), src_region.device_index,
                             dst_region.device_index, bytes(notify), deadline or self._deadline(None),
                             tuple(h for h in after if h is not None))
        if inline and self._post_lock.acquire(blocking=False):
            try:
                with self._count_lock:
                    idle = self._unposted == 0  # nothing queued or being posted (the worker posts under this lock)
                if idle:
                    self._post(handle)
                    if not handle.event.is_set():
                        self._put(_Posted(handle))  # the worker polls it from here on
                    return handle
            finally:
                self._post_lock.release()
        with self._count_lock:
            self._unposted += 1
        self._put(handle)
        return handle

    def notify(self, agent: str, message: bytes) -> None:
        """Send ``message`` to a connected peer's ``notifications()``, on its own (no data); KVCacheError if it fails.

        Sent once the caller's writes to that peer are DONE, it tells the peer they have landed.
        """
        self._check_open()
        if agent not in self._peers:
            raise KVCacheError(f"notify: {agent!r} is not connected")
        try:
            self.agent.send_notif(agent, bytes(message))
        except Exception as exc:
            raise KVCacheError(f"NIXL notification to {agent!r} failed: {exc}") from None

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sender agent name."""
        self._check_open()
        with self._notifs_lock:
            out, self._notifs = self._notifs, {}
            _add_notifs(out, self.agent.get_new_notifs())
        return out

    def _progress_idle(self) -> None:
        """progress="poll" with nothing in flight: progress UCX (answer peers, take in notices) and keep what came."""
        try:
            with self._notifs_lock:
                _add_notifs(self._notifs, self.agent.get_new_notifs())
        except Exception:
            log.exception("NIXL engine %s: progressing UCX failed", self.name)

    def _run(self) -> None:
        """The worker: post new transfers, poll those in flight, release finished and expired ones."""
        inflight: list[_NixlHandle] = []
        delay = 20e-6
        idle_wait = 0.5 if self.progress == "thread" else _IDLE_PROGRESS
        while True:
            job, self._held_job = self._held_job, None
            if job is None:
                try:
                    job = self._next_job(delay if inflight else idle_wait)
                except queue.Empty:
                    job = None
                    if not inflight and self.progress == "poll":
                        self._progress_idle()
            if job is _STOP:
                for handle in inflight:
                    handle.cancelled = True
                    self._settle(handle)
                return
            if isinstance(job, _Posted):
                inflight.append(job.handle)
                job = None
            if job is not None:
                delay = 20e-6
                with self._post_lock:
                    job, stop = self._merge_queued(job)
                    posted = 1 + len(job.followers)
                    self._post(job)
                    with self._count_lock:
                        self._unposted -= posted
                if not job.event.is_set():
                    inflight.append(job)
                if stop:
                    self._put(_STOP)
            else:
                delay = min(delay * 2, _POLL_MAX)
            for handle in list(inflight):
                if self._settle(handle):
                    inflight.remove(handle)

    def _put(self, job: Any) -> None:
        """Queue a job for the worker and wake it."""
        self._jobs.put(job)
        try:
            self._wake.release()
        except RuntimeError:
            pass  # already released by another put the worker has not woken for yet

    def _next_job(self, timeout: float) -> Any:
        """The next queued job, waiting up to ``timeout`` seconds for one; queue.Empty if none came."""
        try:
            return self._jobs.get_nowait()
        except queue.Empty:
            self._wake.acquire(timeout=timeout)
        return self._jobs.get_nowait()

    def _merge_queued(self, first: _NixlHandle) -> tuple[_NixlHandle, bool]:
        """``first`` with the writes queued right behind it that can share its transfer; and whether a stop came.

        Writes merge while they go to the same peer between the same kinds of memory and none but the
        last carries a notification (NIXL sends a transfer's one notification after all of its data).
        A write that cannot join is kept for the worker's next turn, so posts keep their order.
        """
        group = [first]
        stop = False
        key = (first.peer, first.local_mem, first.remote_mem, first.local_dev, first.remote_dev)
        now = time.monotonic()
        while not group[-1].notify and len(group) < MERGE_MAX and not group[-1].cancelled and now < group[-1].deadline:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is _STOP:
                stop = True
                break
            if isinstance(job, _Posted):
                self._held_job = job  # polled from the worker's next turn
                break
            if (job.peer, job.local_mem, job.remote_mem, job.local_dev, job.remote_dev) != key or job.cancelled or (
                    now >= job.deadline):
                self._held_job = job  # posted (or timed out) on its own, next
                break
            group.append(job)
        return (first if len(group) == 1 else self._lead(group)), stop

    def _lead(self, group: list[_NixlHandle]) -> _NixlHandle:
        """One handle that posts the whole group's ranges; the others end when it ends."""
        leader = group[0]
        leader.followers = group[1:]
        leader.ranges = CopyRanges.concat([h.ranges for h in group])
        leader.notify = group[-1].notify
        members = {id(h) for h in group}
        leader.after = tuple(a for h in group for a in h.after if id(a) not in members)
        leader.deadline = min(h.deadline for h in group)
        self.merged_writes += len(group) - 1
        return leader

    def _post(self, handle: _NixlHandle) -> None:
        handle.picked_ns = time.monotonic_ns()
        for follower in handle.followers:
            follower.picked_ns = handle.picked_ns
        if handle.cancelled or time.monotonic() >= handle.deadline:
            self._end(handle, TransferStatus.TIMEOUT, "its deadline passed before it was posted")
            return
        notify = handle.notify
        if notify and any(a.status() is not TransferStatus.DONE for a in handle.after):
            handle.held, notify = notify, b""  # earlier writes still in flight: send it once they land
        r = handle.ranges
        kernel = self._kernel_peers.get(handle.peer) if handle.local_mem == handle.remote_mem == "DRAM" else None
        if kernel is not None:
            self._post_kernel(handle, kernel, notify)
            return
        if self.threads and handle.local_mem == handle.remote_mem == "DRAM":
            r = spread(r, SPLIT_DESCRIPTORS * self.threads)  # enough for every worker, however NIXL cuts
        local = np.stack([r.src, r.length, np.full_like(r.src, handle.local_dev)], axis=1).astype(np.uint64)
        remote = np.stack([r.dst, r.length, np.full_like(r.dst, handle.remote_dev)], axis=1).astype(np.uint64)
        try:
            handle.xfer = self.agent.initialize_xfer(
                "WRITE", self.agent.get_xfer_descs(local, handle.local_mem),
                self.agent.get_xfer_descs(remote, handle.remote_mem), handle.peer, notify)
            state = self.agent.transfer(handle.xfer)
            handle.posted_ns = time.monotonic_ns()
            for follower in handle.followers:
                follower.posted_ns = handle.posted_ns
        except Exception as exc:
            self._end(handle, TransferStatus.FAILED, f"NIXL write to {handle.peer!r} failed: {exc}")
            return
        if state == "DONE":
            self._land(handle)
        elif state == "ERR":
            self._end(handle, TransferStatus.FAILED, f"NIXL write to {handle.peer!r} failed when posted")

    def _post_kernel(self, handle: _NixlHandle, peer: _KernelPeer, notify: bytes) -> None:
        """Host memory into a peer process on this host: the kernel copies (KernelCopy), then ``notify`` goes
        out over NIXL, after the data as NIXL would send it. A range outside the memory the peer registered
        fails the whole write before any byte moves (NIXL refuses such a write the same way)."""
        assert self._kernel is not None
        pid, r = peer.pid, handle.ranges
        outside = np.flatnonzero(~peer.extents.covers(r.dst, r.length))
        if outside.size:
            i = int(outside[0])
            self._end(handle, TransferStatus.FAILED,
                      f"write to {handle.peer!r}: {outside.size} of its {r.num_ranges} ranges (the first "
                      f"{int(r.length[i]):,} bytes at {int(r.dst[i]):#x}) lie outside the memory it registered; "
                      "nothing written")
            return
        try:
            self._kernel.write(pid, handle.ranges, handle.deadline)
        except TimeoutError:
            self._end(handle, TransferStatus.TIMEOUT, f"not finished by its deadline ({handle.nbytes:,} bytes to "
                                                      f"{handle.peer!r})")
            return
        except OSError as exc:
            self._end(handle, TransferStatus.FAILED, f"write to {handle.peer!r} (process {pid}) failed: "
                                                     f"{exc.strerror or exc}")
            return
        handle.posted_ns = time.monotonic_ns()
        for follower in handle.followers:
            follower.posted_ns = handle.posted_ns
        if notify:
            try:
                self.agent.send_notif(handle.peer, notify)
            except Exception as exc:
                self._end(handle, TransferStatus.FAILED, f"NIXL notification to {handle.peer!r} failed: {exc}")
                return
        self._land(handle)

    def _settle(self, handle: _NixlHandle) -> bool:
        """Poll one transfer in flight; True once it is finished and released."""
        if handle.event.is_set():
            return True
        if handle.cancelled or time.monotonic() >= handle.deadline:
            self._end(handle, TransferStatus.TIMEOUT, f"not finished by its deadline ({handle.nbytes:,} bytes to "
                                                      f"{handle.peer!r})")
            return True
        if handle.landed:
            return self._land(handle)
        try:
            state = self.agent.check_xfer_state(handle.xfer)
        except Exception as exc:  # e.g. NIXL_ERR_REMOTE_DISCONNECT: the peer died
            self._end(handle, TransferStatus.FAILED, f"NIXL write to {handle.peer!r} failed: {exc}")
            return True
        if state == "PROC":
            return False
        if state == "DONE":
            return self._land(handle)
        self._end(handle, TransferStatus.FAILED, f"NIXL write to {handle.peer!r} failed")
        return True

    def _land(self, handle: _NixlHandle) -> bool:
        """The write's data landed: DONE, once its held notification (if any) went out; True once finished."""
        handle.landed = True
        if handle.held:
            statuses = [a.status() for a in handle.after]
            if any(s.finished and s is not TransferStatus.DONE for s in statuses):
                self._end(handle, TransferStatus.FAILED, "an earlier write it waited for failed; no notification sent")
                return True
            if any(not s.finished for s in statuses):
                return False  # polled again on the worker's next pass
            try:
                self.agent.send_notif(handle.peer, handle.held)
            except Exception as exc:
                self._end(handle, TransferStatus.FAILED, f"NIXL notification to {handle.peer!r} failed: {exc}")
                return True
            handle.held = b""
        self._end(handle, TransferStatus.DONE)
        return True

    def _end(self, handle: _NixlHandle, status: TransferStatus, error: str | None = None) -> None:
        """Finish a handle and release its NIXL request (cancelling it if still active)."""
        handle._finish(status, error)
        handle.done_ns = time.monotonic_ns()
        for follower in handle.followers:
            follower._finish(status, error)
            follower.done_ns = handle.done_ns
            follower.after = ()
        handle.followers = []
        handle.after = ()  # drop the references to earlier handles (and their ranges)
        if handle.xfer is not None:
            try:
                handle.xfer.release()
            except Exception:
                self._leaked.append(handle.xfer)  # could not cancel now; retried at close
            handle.xfer = None
        handle.event.set()

    # ----------------------------------------------------------------- lifetime

    def _check_open(self) -> None:
        if getattr(self, "_closed", False):
            raise KVCacheError(f"NIXL engine {self.name!r} is closed")

    def close(self) -> None:
        """Stop serving, end every transfer, drop peers, deregister all memory, end the agent. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        if self._server is not None:
            self._server.join(timeout=2.0)
        self._put(_STOP)
        self._worker.join(timeout=5.0)
        for xfer in self._leaked:
            try:
                xfer.release()
            except Exception:
                pass  # NIXL frees what is left with the agent
        self._leaked.clear()
        for agent in list(self._peers):
            self.disconnect(agent)
        for region in self.registered:
            self.deregister(region)
        self._ctx.term()
        if self._kernel is not None:
            self._kernel.close()
        if self._key_fd >= 0:
            os.close(self._key_fd)
            self._key_fd = -1
        self.agent = None  # the last reference: NIXL stops its progress and UCX worker threads now, not at GC

    def __repr__(self) -> str:
        return (f"NixlEngine({self.name!r}, {len(self._registered)} regions, {len(self._peers)} peers"
                f"{', closed' if self._closed else ''})")


class KernelCopy:
    """Copy ranges of this process's memory into another process on this host with Linux's process_vm_writev.

    UCX moves NIXL's host-to-host writes on one host with this very call (its CMA transport), but one call
    per range: at 32 KiB blocks (block 16 of a typical layer) that reaches about 70% of one large range, against
    91% for the same ranges VM_BATCH a call (`kvcache bench transfer`, GPU host, 4 threads). NixlEngine writes
    host memory of a peer on this host through this copy where the kernel lets it (same user, ptrace allowed),
    through NIXL otherwise. The ranges, a large one cut as ``spread`` cuts it, are shared over ``threads``.
    """

    def __init__(self, threads: int = 1) -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        self._ctypes = ctypes
        args = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
        self._writev, self._readv = libc.process_vm_writev, libc.process_vm_readv
        for fn in (self._writev, self._readv):
            fn.argtypes, fn.restype = args, ctypes.c_ssize_t
        self.threads = max(1, int(threads))
        self._pool: Any = None
        self._pool_lock = threading.Lock()

    @staticmethod
    def supported() -> bool:
        """Whether this system has process_vm_writev (Linux with glibc)."""
        if not sys.platform.startswith("linux"):
            return False
        import ctypes

        return hasattr(ctypes.CDLL(None), "process_vm_writev")

    def finds(self, pid: int, addr: int, expected: bytes) -> bool:
        """Whether process ``pid`` holds ``expected`` at ``addr`` and the kernel lets this process read it (the
        same permission check as a write)."""
        if not 0 < len(expected) <= 4096 or addr <= 0:
            return False
        ctypes = self._ctypes
        found = ctypes.create_string_buffer(len(expected))
        local = (ctypes.c_uint64 * 2)(ctypes.addressof(found), len(expected))
        remote = (ctypes.c_uint64 * 2)(addr, len(expected))
        got = self._readv(pid, ctypes.addressof(local), 1, ctypes.addressof(remote), 1, 0)
        return got == len(expected) and found.raw == expected

    def write(self, pid: int, ranges: CopyRanges, deadline: float) -> None:
        """Copy ``ranges`` (src here, dst in ``pid``); OSError if the kernel refuses (the process is gone),
        TimeoutError once ``deadline`` (time.monotonic()) passes between calls (what was copied stays)."""
        if self.threads == 1:
            self._write_part(pid, ranges, deadline)
            return
        r = spread(ranges, SPLIT_DESCRIPTORS * self.threads)
        cuts = np.linspace(0, r.num_ranges, self.threads + 1).astype(np.intp)
        parts = [CopyRanges(r.src[a:b], r.dst[a:b], r.length[a:b]) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
        if len(parts) == 1:
            self._write_part(pid, parts[0], deadline)
            return
        with self._pool_lock:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kernel-copy")
        futures = [self._pool.submit(self._write_part, pid, part, deadline) for part in parts]
        errors = [f.exception() for f in futures]  # waits for every part: none is left writing
        for error in errors:
            if error is not None:
                raise error

    def _write_part(self, pid: int, r: CopyRanges, deadline: float) -> None:
        """One thread's ranges, VM_BATCH a call; a call that copies less (the kernel stops at 2 GiB) goes on
        from where it stopped."""
        local = np.stack([r.src, r.length], axis=1).astype(np.uint64)  # struct iovec: base, length
        remote = np.stack([r.dst, r.length], axis=1).astype(np.uint64)
        i, n = 0, r.num_ranges
        while i < n:
            if time.monotonic() >= deadline:
                raise TimeoutError("deadline passed")
            k = min(VM_BATCH, n - i)
            lengths = local[i:i + k, 1]
            want = int(lengths.sum())
            got = self._writev(pid, local[i:].ctypes.data, k, remote[i:].ctypes.data, k, 0)  # the GIL is let go
            if got == want:
                i += k
                continue
            if got <= 0:
                errno = self._ctypes.get_errno() if got < 0 else 0
                raise OSError(errno, os.strerror(errno) if errno else f"copied nothing of {want} bytes")
            ends = np.cumsum(lengths)
            whole = int(np.searchsorted(ends, got, side="right"))  # ranges copied in full
            part = got - (int(ends[whole - 1]) if whole else 0)
            i += whole
            for iov in (local, remote):  # the rest of the range it stopped in
                iov[i, 0] += np.uint64(part)
                iov[i, 1] -= np.uint64(part)

    def close(self) -> None:
        """Stop the copy threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def kernel_copy_default() -> bool:
    """Whether an engine made without ``kernel_copy`` copies host memory to proven peers on this host with the kernel:
    yes unless KVCACHE_KERNEL_COPY is ``0``."""
    value = os.environ.get(KERNEL_COPY_ENV, "1").strip()
    if value not in ("0", "1", ""):
        raise KVCacheError(f"{KERNEL_COPY_ENV}: must be 0 (off) or 1 (on), got {value!r}")
    return value != "0"


def host_identity() -> str:
    """This host as a peer on it sees it: the kernel's boot id and our pid namespace ("" where unreadable).

    Two processes with the same identity share one kernel and one pid numbering, so a pid one names is the
    process the other reaches through the kernel.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{boot}/pidns:{ns.st_dev}:{ns.st_ino}" if boot else ""


def is_local_endpoint(endpoint: str) -> bool:
    """Whether a ZMQ endpoint reaches this host: ipc:// and inproc://, or tcp:// to addresses bound here."""
    scheme, _, where = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp" or ":" not in where:
        return False
    host = where.rsplit(":", 1)[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # ZMQ resolves names to IPv4 unless told otherwise
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, family, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return False
    for address in addresses:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((address, 0))  # only an address of this host's interfaces can be bound
        except OSError:
            return False
    return bool(addresses)


def _key_file(key: bytes) -> int:
    """A memfd holding ``key`` (KEY_NAME), sealed against change; its descriptor, -1 where memfds cannot be made
    (then no peer's kernel copy writes to us)."""
    import fcntl

    try:
        fd = os.memfd_create(KEY_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (AttributeError, OSError):
        return -1
    try:
        os.write(fd, key)
        seals = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except (AttributeError, OSError):
        os.close(fd)
        return -1
    return fd


def _peer_key(pid: int, fd: int) -> bytes | None:
    """The key process ``pid`` keeps in its memfd ``fd`` (``_key_file``), read through /proc; None if it holds none.

    Only that process can have made a memfd of that name among its descriptors: bytes others wrote into its
    memory (its registered regions, say) cannot stand in for it. The name is checked before the open (no
    device or pipe of it is opened) and after (the file opened is that memfd).
    """
    if not (0 < pid and 0 <= fd < 1 << 31):
        return None
    name = f"/memfd:{KEY_NAME} (deleted)"
    path = f"/proc/{pid}/fd/{fd}"
    try:
        if os.readlink(path) != name:
            return None
        opened = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(opened)
        if os.readlink(f"/proc/self/fd/{opened}") != name or not stat.S_ISREG(info.st_mode) or (
                info.st_size != KEY_BYTES):
            return None
        key = os.pread(opened, KEY_BYTES, 0)
    except OSError:
        return None
    finally:
        os.close(opened)
    return key if len(key) == KEY_BYTES else None


def _proof(key: Any, nonce: bytes, body: bytes) -> bytes:
    """A hello's answer to ``nonce``: HMAC-SHA256 under ``key`` of the nonce and the hello's exact bytes."""
    return hmac.new(bytes(key), nonce + body, hashlib.sha256).digest()


def _add_notifs(into: dict[str, list[bytes]], new: dict) -> None:
    """Append NIXL's notifications (agent name, as bytes or str -> messages) to ``into``."""
    for agent, messages in new.items():
        into.setdefault(agent.decode() if isinstance(agent, bytes) else agent, []).extend(messages)


def spread(ranges: CopyRanges, pieces: int, least: int = SPREAD_PIECE_BYTES, total_least: int = SPREAD_MIN_BYTES
           ) -> CopyRanges:
    """``ranges`` of ``total_least`` bytes or more cut into about ``pieces`` equal ranges (none under ``least``).

    Host to host, UCX copies inside the post, one range on one thread; a write of SPLIT_DESCRIPTORS
    ranges or more is shared by the engine's UCX workers. Paged-cache blocks that sit side by side
    make a few long ranges, so a large write is cut to reach them. A small one is left whole: waking
    the workers costs about what sharing a 16 MiB copy saves (measured on the H100 host).
    """
    total = ranges.nbytes
    if ranges.num_ranges >= pieces or total < max(total_least, 2 * least):
        return ranges
    size = max(least, -(-total // pieces))
    cuts = -(-ranges.length // size)  # pieces per range
    which = np.repeat(np.arange(ranges.num_ranges), cuts)
    first = np.cumsum(cuts) - cuts
    offset = (np.arange(which.size) - first[which]) * size
    length = np.minimum(size, ranges.length[which] - offset)
    return CopyRanges(ranges.src[which] + offset, ranges.dst[which] + offset, length)


def default_threads() -> int:
    """Threads a NixlEngine posts one large write with: a quarter of this host's CPUs, 2 to 4 of them."""
    return max(2, min(4, (os.cpu_count() or 1) // 4))


def _backend_params(backend: str, threads: int) -> dict[str, str]:
    """Init parameters of one NIXL backend: UCX splits a write of SPLIT_DESCRIPTORS or more over ``threads`` workers."""
    if backend != "UCX" or threads < 2:
        return {}
    return {"num_threads": str(threads), "split_batch_size": str(SPLIT_DESCRIPTORS)}


def _make_agent(nixl: Any, name: str, config: Any, progress_delay_us: int) -> Any:
    """``nixl.nixl_agent(name, config)`` with the progress thread's poll timeout set to ``progress_delay_us``.

    The Python API writes ``pthrDelay = 0`` into the agent config it builds; for the one call, its
    module sees a config class that keeps at least our delay. Where the API is laid out otherwise
    (another NIXL version), the agent is made as the API makes it.
    """
    api = sys.modules.get(nixl.nixl_agent.__module__)
    bind = getattr(api, "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    if base is None or not hasattr(base, "pthrDelay"):
        return nixl.nixl_agent(name, config)

    class Config(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:
            base.pthrDelay.__set__(self, max(int(value), progress_delay_us))

    class Bind:
        nixlAgentConfig = Config

        def __getattr__(self, attr: str) -> Any:
            return getattr(bind, attr)

    with _AGENT_LOCK:
        api.nixlBind = Bind()
        try:
            return nixl.nixl_agent(name, config)
        finally:
            api.nixlBind = bind


def _mem_type(region: KVRegion) -> str:
    return "VRAM" if region.is_cuda else "DRAM"


def _peer_address(frame: zmq.Frame) -> str:
    """The address a ZMQ message came from ("" when the transport has none, as ipc://)."""
    try:
        return frame.get("Peer-Address") or ""
    except (zmq.ZMQError, AttributeError, KeyError):
        return ""


def _tcp_sockets() -> list[tuple[int, socket.socket]]:
    """This process's TCP sockets: (fd, a socket object over a duplicate of it, to close after use)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            out.append((fd, sock))
        else:
            sock.close()
    return out


def _reset_connections(address: str, exclude_port: int) -> int:
    """Reset (as a TCP RST: unread bytes dropped, later segments refused) every connection of this process from
    ``address`` into a port this process listens on, but ``exclude_port``; how many.

    ``connect(AF_UNSPEC)`` on a connected TCP socket is Linux's ``tcp_disconnect``: it drops both queues, sends a
    reset and leaves the socket unconnected, while its owner (UCX) still holds the descriptor and sees the
    connection fail.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    unspec = (ctypes.c_ushort * 8)()  # a struct sockaddr of family AF_UNSPEC (0)
    sockets = _tcp_sockets()
    try:
        listening = set()
        for _, sock in sockets:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                listening.add(sock.getsockname()[1])
        listening.discard(exclude_port)
        reset = 0
        for _, sock in sockets:
            try:
                peer, local = sock.getpeername(), sock.getsockname()
            except OSError:
                continue  # not connected
            if peer[0] != address or local[1] not in listening:
                continue
            if libc.connect(sock.fileno(), ctypes.byref(unspec), ctypes.sizeof(unspec)) == 0:
                reset += 1
            else:
                log.warning("could not reset the connection from %s:%d: %s", peer[0], peer[1],
                            os.strerror(ctypes.get_errno()))
        return reset
    finally:
        for _, sock in sockets:
            sock.close()

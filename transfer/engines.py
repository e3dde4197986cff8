"""Transfer engines: move lists of KV blocks between registered regions, in the background, with a deadline.

``TransferEngine`` is the interface every engine keeps; its docstring states the guarantees.
``LocalEngine`` copies within one process: host to host with one C copy loop over all ranges
(from the engine's worker thread, GIL released, streaming stores, the bytes shared among a few
threads); with CUDA, device to host, host to device and device to device with one launch per
transfer on the engine's own stream (a gather/scatter copy kernel through CuPy, else
``cudaMemcpyBatchAsync``), never one call per block. ``kvcache.transfer.nixl.NixlEngine`` moves
blocks to other processes and nodes. Pick one by name with ``create_engine("local" | "nixl", ...)``.

    engine = LocalEngine()
    handle = engine.write(gpu, table_row, host, host_ids, layers=[layer])
    if handle.wait() is not TransferStatus.DONE: ...handle.error...
"""
from __future__ import annotations

import contextlib
import ctypes
import enum
import os
import queue
import sys
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Sequence

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.transfer._copy import copy as _host_copy
from kvcache.transfer.regions import CopyRanges, KVRegion, copy_ranges

__all__ = ["CUDA_METHODS", "HOST_METHODS", "LocalEngine", "TransferEngine", "TransferHandle", "TransferStatus",
           "create_engine", "default_copy_threads"]

DEFAULT_TIMEOUT = 30.0
CUDA_METHODS = ("auto", "kernel", "kernel_unrolled", "batch", "loop")
"""How LocalEngine moves ranges touching a GPU: ``kernel_unrolled`` = one CuPy copy-kernel launch (SMs
read and write pinned host memory directly), each thread issuing four 16-byte loads before its four
stores; ``kernel`` = the same one load at a time; ``batch`` = cudaMemcpyBatchAsync (CUDA 12.8+);
``loop`` = one cudaMemcpyAsync per range (the slow baseline). ``auto`` takes the first of
kernel_unrolled, batch, loop that this process can run. On an H100 (PCIe 5, 4,096-token request,
block 16, against one pinned cudaMemcpyAsync of the same bytes, 52 GB/s): kernel_unrolled 87% host to
device and 89% device to host, kernel 85% / 87%, batch 67% / 55%, loop 19% / 21%."""
_KERNELS = {"kernel": "copy_ranges", "kernel_unrolled": "copy_ranges_unrolled"}


HOST_METHODS = ("stream", "memcpy")
"""How LocalEngine copies host to host: ``stream`` (the default) = streaming (non-temporal) stores
for ranges of 4 KiB or more, which skip reading the destination lines first; ``memcpy`` = glibc's
memcpy per range, which streams only copies of several MiB, so a 32 KiB block costs a read of its
destination too. On the 2-core AMD EPYC dev VM streaming moved scattered 32 KiB blocks 1.3-1.6x
faster than memcpy, and faster than glibc's one memcpy of the same bytes. An earlier hand-written
streaming copy (not kept) was reported half as fast on the H100 host: `kvcache bench transfer`
prints both methods side by side, so check there before relying on either."""
_STREAM_MIN = 4096
_MIN_SHARE = 4 << 20  # bytes: a host copy uses no more threads than it has shares of this size


class TransferStatus(str, enum.Enum):
    """Where a transfer stands; every status but PENDING is final."""

    PENDING = "pending"
    DONE = "done"  # every byte has landed
    FAILED = "failed"  # an error stopped it; TransferHandle.error says which
    TIMEOUT = "timeout"  # its deadline passed first

    @property
    def finished(self) -> bool:
        return self is not TransferStatus.PENDING


class TransferHandle(ABC):
    """One transfer in flight: poll it with ``done()``/``status()``, or ``wait`` for it; it never outlives its deadline.

    Once the deadline (``time.monotonic()`` seconds) passes, a transfer that has not finished
    is TIMEOUT; a FAILED or TIMEOUT transfer may have written part of its destination blocks.
    """

    max_poll_interval = 1e-3  # seconds between looks while waiting, reached by doubling from 20 µs

    def __init__(self, nbytes: int, num_ranges: int, deadline: float) -> None:
        self.nbytes = nbytes
        self.num_ranges = num_ranges
        self.deadline = deadline
        self._status = TransferStatus.PENDING
        self._error: str | None = None
        # Threads may look at one handle together (a worker waiting on a layer while the tier's owner settles
        # it): one look at a time, so a finished copy's resources (a CUDA event) are released once, never used after.
        self._looking = threading.Lock()

    @abstractmethod
    def _poll(self) -> None:
        """Look at the transfer once; on completion call ``_finish``."""

    def _expire(self) -> None:
        """The deadline passed unfinished: stop what can be stopped and release what it holds."""

    def _finish(self, status: TransferStatus, error: str | None = None) -> None:
        if self._status is TransferStatus.PENDING:
            self._status, self._error = status, error

    def _sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    @property
    def error(self) -> str | None:
        """Why the transfer FAILED or timed out; None while pending or when DONE."""
        return self._error

    def status(self) -> TransferStatus:
        """The current status, without blocking; safe from several threads."""
        if self._status is TransferStatus.PENDING:
            with self._looking:
                if self._status is TransferStatus.PENDING:
                    self._poll()
                if self._status is TransferStatus.PENDING and time.monotonic() >= self.deadline:
                    self._expire()
                    self._finish(TransferStatus.TIMEOUT, f"not finished by its deadline ({self.nbytes:,} bytes in "
                                                         f"{self.num_ranges:,} ranges)")
        return self._status

    def done(self) -> bool:
        """True once the transfer has finished, well or not."""
        return self.status().finished

    def wait(self, timeout: float | None = None) -> TransferStatus:
        """Block until finished, ``timeout`` seconds pass (then PENDING), or the deadline (then TIMEOUT)."""
        end = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
        delay = 20e-6
        while True:
            status = self.status()
            now = time.monotonic()
            if status.finished or now >= end:
                return status
            self._sleep(min(delay, end - now))
            delay = min(delay * 2, self.max_poll_interval)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._status.value}, {self.nbytes:,} bytes, {self.num_ranges:,} ranges)"


class TransferEngine(ABC):
    """Moves lists of KV blocks from one registered region to another.

    Guarantees of every engine:
    - ``write`` checks its arguments (ids, rows, layers, matching specs) and raises KVCacheError
      before anything moves; otherwise it returns a handle at once and the copy runs in the
      background. Only the listed (block, row) units of the listed layers are written.
    - Every transfer has a deadline (``timeout`` seconds, or the engine's default); a handle's
      ``wait`` never blocks past it, and a transfer not done by then is TIMEOUT. Errors, such as a
      peer that died, make it FAILED with a message; neither hangs the caller.
    - ``close`` releases whatever the engine registered, pinned or connected; it is idempotent.
    """

    timeout: float = DEFAULT_TIMEOUT

    def register(self, region: KVRegion) -> None:
        """Prepare a local region for transfers (pin or register its memory); writes do it when needed."""

    def deregister(self, region: KVRegion) -> None:
        """Undo ``register`` for a region that is about to be freed."""

    @abstractmethod
    def write(self, src_region: KVRegion, src_blocks: Any, dst_region: KVRegion, dst_blocks: Any,
              layers: Any = None, rows: Any = None, *, timeout: float | None = None) -> TransferHandle:
        """Copy ``src_blocks`` of ``src_region`` onto ``dst_blocks`` of ``dst_region`` (see ``copy_ranges``)."""

    def close(self) -> None:
        """Release everything the engine holds."""

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _deadline(self, timeout: float | None) -> float:
        seconds = self.timeout if timeout is None else timeout
        if not seconds > 0:
            raise KVCacheError(f"timeout must be positive seconds, got {timeout!r}")
        return time.monotonic() + seconds


def create_engine(kind: str, **options: Any) -> TransferEngine:
    """The engine a config string names: ``local`` or ``nixl``; ``options`` go to its constructor."""
    if kind == "local":
        return LocalEngine(**options)
    if kind == "nixl":
        from kvcache.transfer.nixl import NixlEngine

        return NixlEngine(**options)
    raise KVCacheError(f"transfer engine: unknown kind {kind!r}; expected local or nixl")


class _Finished(TransferHandle):
    """A transfer that finished (or failed) before it could start in the background."""

    def __init__(self, ranges: CopyRanges, deadline: float, status: TransferStatus, error: str | None = None) -> None:
        super().__init__(ranges.nbytes, ranges.num_ranges, deadline)
        self._finish(status, error)

    def _poll(self) -> None:
        pass


# --------------------------------------------------------------------------- host copies


class _HostHandle(TransferHandle):
    """A host-to-host copy queued on the engine's worker thread."""

    def __init__(self, ranges: CopyRanges, deadline: float) -> None:
        super().__init__(ranges.nbytes, ranges.num_ranges, deadline)
        self.ranges = ranges
        self.cancelled = False
        self.event = threading.Event()

    def _poll(self) -> None:
        pass  # the worker calls _finish, then sets the event

    def _expire(self) -> None:
        self.cancelled = True  # a copy not yet started is skipped; one running stops at its own deadline check

    def _sleep(self, seconds: float) -> None:
        self.event.wait(seconds)


def default_copy_threads() -> int:
    """Threads for one host copy: a quarter of this host's CPUs, 1 to 4 (one core's copy is latency-bound)."""
    return max(1, min(4, (os.cpu_count() or 1) // 4))


def _host_worker(jobs: queue.SimpleQueue, threads: int, stream_min: int) -> None:
    """Run queued host copies in order until the None sentinel, each on up to ``threads`` threads, to its deadline."""
    while True:
        handle = jobs.get()
        if handle is None:
            return
        try:
            r = handle.ranges
            if handle.cancelled or time.monotonic() >= handle.deadline:
                handle._finish(TransferStatus.TIMEOUT, "its deadline passed before the copy started")
            else:
                copied = _host_copy(r.src, r.dst, r.length, int(handle.deadline * 1e9), threads, _MIN_SHARE,
                                    stream_min)
                if copied == r.num_ranges:
                    handle._finish(TransferStatus.DONE)
                else:
                    handle._finish(TransferStatus.TIMEOUT, f"deadline passed after {copied:,} of {r.num_ranges:,} ranges")
        except Exception as exc:  # report, never kill the worker
            handle._finish(TransferStatus.FAILED, f"host copy failed: {exc}")
        finally:
            handle.event.set()


# --------------------------------------------------------------------------- CUDA


class _MemcpyAttributes(ctypes.Structure):
    """cudaMemcpyAttributes (CUDA 12.8+): access order, source and destination location hints, flags."""

    _fields_ = [("src_access_order", ctypes.c_uint), ("src_type", ctypes.c_uint), ("src_id", ctypes.c_int),
                ("dst_type", ctypes.c_uint), ("dst_id", ctypes.c_int), ("flags", ctypes.c_uint)]


class _PointerAttributes(ctypes.Structure):
    """cudaPointerAttributes (CUDA 11+), with spare room in case a runtime writes a longer struct."""

    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("device_pointer", ctypes.c_void_p),
                ("host_pointer", ctypes.c_void_p), ("spare", ctypes.c_byte * 128)]


class IpcMemHandle(ctypes.Structure):
    """cudaIpcMemHandle_t: 64 opaque bytes naming a device allocation to other processes."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


_SUCCESS, _NOT_READY, _ALREADY_REGISTERED = 0, 600, 712
_MEMCPY_DEFAULT = 4
_MEMCPY_HOST_TO_DEVICE = 1
_HOST_ALLOC_PORTABLE = 1
_ACCESS_ORDER_STREAM = 1
_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02
_STREAM_NON_BLOCKING = 0x01
_EVENT_DISABLE_TIMING = 0x02
_BATCH_CHUNK = 1 << 16  # ranges per cudaMemcpyBatchAsync call

_KERNEL_SOURCE = r"""
struct alignas(16) Chunk { unsigned long long lo, hi; };

extern "C" __global__ void copy_ranges(const long long* __restrict__ src, const long long* __restrict__ dst,
                                       const long long* __restrict__ len, long long n) {
    for (long long r = blockIdx.x; r < n; r += gridDim.x) {
        const char* s = reinterpret_cast<const char*>(src[r]);
        char* d = reinterpret_cast<char*>(dst[r]);
        long long bytes = len[r];
        if (((src[r] | dst[r] | bytes) & 15LL) == 0) {
            const Chunk* s4 = reinterpret_cast<const Chunk*>(s);
            Chunk* d4 = reinterpret_cast<Chunk*>(d);
            for (long long i = threadIdx.x; i < (bytes >> 4); i += blockDim.x) d4[i] = s4[i];
        } else {
            for (long long i = threadIdx.x; i < bytes; i += blockDim.x) d[i] = s[i];
        }
    }
}

// Four independent 16-byte loads per thread before its four stores: each thread keeps four reads of
// (host) memory in flight instead of one; a warp's accesses stay contiguous (stride = blockDim.x).
extern "C" __global__ void __launch_bounds__(256) copy_ranges_unrolled(
        const long long* __restrict__ src, const long long* __restrict__ dst, const long long* __restrict__ len,
        long long n) {
    const long long stride = blockDim.x;
    for (long long r = blockIdx.x; r < n; r += gridDim.x) {
        const long long bytes = len[r];
        if (((src[r] | dst[r] | bytes) & 15LL) == 0) {
            const uint4* __restrict__ s = reinterpret_cast<const uint4*>(src[r]);
            uint4* __restrict__ d = reinterpret_cast<uint4*>(dst[r]);
            const long long chunks = bytes >> 4;
            long long i = threadIdx.x;
            for (; i + 3 * stride < chunks; i += 4 * stride) {
                const uint4 a = s[i], b = s[i + stride], c = s[i + 2 * stride], e = s[i + 3 * stride];
                d[i] = a;
                d[i + stride] = b;
                d[i + 2 * stride] = c;
                d[i + 3 * stride] = e;
            }
            for (; i < chunks; i += stride) d[i] = s[i];
        } else {
            const char* s = reinterpret_cast<const char*>(src[r]);
            char* d = reinterpret_cast<char*>(dst[r]);
            for (long long i = threadIdx.x; i < bytes; i += stride) d[i] = s[i];
        }
    }
}
"""


class CudaRuntime:
    """The few CUDA runtime calls the engine needs, through ctypes on the libcudart the process uses.

    The library is the one ``kvcache.ops.cuda_runtime()`` finds (the framework's own), so streams,
    events and pinned memory are shared with PyTorch/Paddle/CuPy in the same process.
    """

    def __init__(self) -> None:
        from kvcache.ops import cuda_runtime

        path = cuda_runtime()
        if not path:
            raise RuntimeError("no CUDA runtime (libcudart) found in this process")
        lib = ctypes.CDLL(path)
        self.path = path
        self.lib = lib
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self._fn("cudaRuntimeGetVersion", [ctypes.POINTER(i)])
        self._fn("cudaGetErrorString", [i], ctypes.c_char_p)
        self._fn("cudaGetDevice", [ctypes.POINTER(i)])
        self._fn("cudaSetDevice", [i])
        self._fn("cudaStreamCreateWithFlags", [ctypes.POINTER(vp), ctypes.c_uint])
        self._fn("cudaStreamSynchronize", [vp])
        self._fn("cudaStreamDestroy", [vp])
        self._fn("cudaEventCreateWithFlags", [ctypes.POINTER(vp), ctypes.c_uint])
        self._fn("cudaEventRecord", [vp, vp])
        self._fn("cudaEventQuery", [vp])
        self._fn("cudaEventSynchronize", [vp])
        self._fn("cudaEventDestroy", [vp])
        self._fn("cudaMemcpyAsync", [vp, vp, sz, i, vp])
        self._fn("cudaMemcpyPeer", [vp, i, vp, i, sz])
        self._fn("cudaDeviceCanAccessPeer", [ctypes.POINTER(i), i, i])
        self._fn("cudaDeviceEnablePeerAccess", [i, ctypes.c_uint])
        self._fn("cudaHostRegister", [vp, sz, ctypes.c_uint])
        self._fn("cudaHostAlloc", [ctypes.POINTER(vp), sz, ctypes.c_uint])
        self._fn("cudaFreeHost", [vp])
        self._fn("cudaHostUnregister", [vp])
        self._fn("cudaPointerGetAttributes", [ctypes.POINTER(_PointerAttributes), vp])
        self._fn("cudaIpcGetMemHandle", [ctypes.POINTER(IpcMemHandle), vp])
        self._fn("cudaIpcOpenMemHandle", [ctypes.POINTER(vp), IpcMemHandle, ctypes.c_uint])
        self._fn("cudaIpcCloseMemHandle", [vp])
        self._fn("cudaGetLastError", [])
        version = ctypes.c_int()
        self.check(lib.cudaRuntimeGetVersion(ctypes.byref(version)), "cudaRuntimeGetVersion")
        self.version = version.value
        self.batch = getattr(lib, "cudaMemcpyBatchAsync", None) if self.version >= 12080 else None
        if self.batch is not None:
            # CUDA 12.8/12.9 pass a failIdx pointer before the stream; 13.0 dropped it.
            fail_idx = [ctypes.POINTER(sz)] if self.version < 13000 else []
            self.batch.argtypes = [vp, vp, vp, sz, ctypes.POINTER(_MemcpyAttributes), ctypes.POINTER(sz), sz,
                                   *fail_idx, vp]
            self.batch.restype = i

    def _fn(self, name: str, argtypes: list, restype: Any = ctypes.c_int) -> None:
        fn = getattr(self.lib, name)
        fn.argtypes, fn.restype = argtypes, restype

    def check(self, code: int, what: str) -> None:
        if code != _SUCCESS:
            self.lib.cudaGetLastError()  # clear a non-sticky error so the next call starts clean
            message = self.lib.cudaGetErrorString(code)
            raise RuntimeError(f"{what} failed: CUDA error {code} ({message.decode() if message else '?'})")

    def new_event(self) -> int:
        """A fresh event without timing (the cheapest kind to record and query)."""
        event = ctypes.c_void_p()
        self.check(self.lib.cudaEventCreateWithFlags(ctypes.byref(event), _EVENT_DISABLE_TIMING),
                   "cudaEventCreateWithFlags")
        return event.value or 0

    def device(self) -> int:
        d = ctypes.c_int()
        self.check(self.lib.cudaGetDevice(ctypes.byref(d)), "cudaGetDevice")
        return d.value

    def is_pinned(self, addr: int) -> bool:
        attrs = _PointerAttributes()
        code = self.lib.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(addr))
        if code != _SUCCESS:
            self.lib.cudaGetLastError()
            return False
        return attrs.type == 1  # cudaMemoryTypeHost: page-locked host memory

    def memcpy_batch(self, r: CopyRanges, stream: int) -> None:
        """All ranges through cudaMemcpyBatchAsync, stream-ordered, in chunks of _BATCH_CHUNK."""
        attrs = _MemcpyAttributes(src_access_order=_ACCESS_ORDER_STREAM)
        index = ctypes.c_size_t(0)
        fail = ctypes.c_size_t(0)
        extra = [ctypes.byref(fail)] if self.version < 13000 else []
        for lo in range(0, r.num_ranges, _BATCH_CHUNK):
            hi = min(lo + _BATCH_CHUNK, r.num_ranges)
            dst, src, size = (np.ascontiguousarray(a[lo:hi], dtype=np.uint64) for a in (r.dst, r.src, r.length))
            code = self.batch(dst.ctypes.data, src.ctypes.data, size.ctypes.data, hi - lo, ctypes.byref(attrs),
                              ctypes.byref(index), 1, *extra, ctypes.c_void_p(stream))
            self.check(code, f"cudaMemcpyBatchAsync of {hi - lo} ranges")

    def memcpy_loop(self, r: CopyRanges, stream: int) -> None:
        """One cudaMemcpyAsync per range: the baseline the batched methods are measured against."""
        fn, s = self.lib.cudaMemcpyAsync, ctypes.c_void_p(stream)
        for src, dst, n in zip(r.src.tolist(), r.dst.tolist(), r.length.tolist()):
            self.check(fn(dst, src, n, _MEMCPY_DEFAULT, s), "cudaMemcpyAsync")


class _CudaHandle(TransferHandle):
    """Copies enqueued on an engine stream, finished when the event recorded behind them completes.

    A look is one ``cudaEventQuery`` (about a µs), so waiting looks every 100 µs at most: a worker
    waiting on a layer-by-layer load learns of each layer within that, not within a millisecond.
    """

    max_poll_interval = 1e-4

    def __init__(self, cuda: CudaRuntime, ranges: CopyRanges, event: int, deadline: float, keep: tuple) -> None:
        super().__init__(ranges.nbytes, ranges.num_ranges, deadline)
        self.cuda = cuda
        self.event = event
        self.keep = keep  # device copies of the range arrays (kernel method) live until the copy ends

    def _poll(self) -> None:
        code = self.cuda.lib.cudaEventQuery(ctypes.c_void_p(self.event))
        if code == _NOT_READY:
            return
        if code == _SUCCESS:
            self._finish(TransferStatus.DONE)
        else:
            self.cuda.lib.cudaGetLastError()
            self._finish(TransferStatus.FAILED, f"CUDA error {code} while copying")
        self._release()

    def _expire(self) -> None:
        self._release()  # the event is freed once the copies behind it end; the caller has its answer now

    def _release(self) -> None:
        if self.event:
            self.cuda.lib.cudaEventDestroy(ctypes.c_void_p(self.event))
            self.event = 0
            self.keep = ()


class LocalEngine(TransferEngine):
    """Copies between regions of this process: host memcpy, and CUDA copies batched per transfer.

    ``cuda_method`` is one of CUDA_METHODS. Host regions that take part in a CUDA copy are pinned
    (cudaHostRegister) the first time, unless their memory already is; ``close`` unpins them.
    A host-to-host copy runs on up to ``threads`` threads (default ``default_copy_threads()``),
    each with at least 4 MiB of it, the way ``host_method`` (one of HOST_METHODS) says.
    """

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT, cuda_method: str = "auto",
                 threads: int | None = None, host_method: str = "stream") -> None:
        if cuda_method not in CUDA_METHODS:
            raise KVCacheError(f"cuda_method: unknown {cuda_method!r}; expected one of {', '.join(CUDA_METHODS)}")
        if host_method not in HOST_METHODS:
            raise KVCacheError(f"host_method: unknown {host_method!r}; expected one of {', '.join(HOST_METHODS)}")
        if threads is None:
            threads = default_copy_threads()
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise KVCacheError(f"threads must be a whole number >= 0, got {threads!r}")
        self.timeout = timeout
        self.cuda_method = cuda_method
        self.threads = max(threads, 1)
        self.host_method = host_method
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        stream_min = _STREAM_MIN if host_method == "stream" else 0
        self._worker = threading.Thread(target=_host_worker, args=(self._jobs, self.threads, stream_min),
                                        name="kvcache-copy", daemon=True)
        self._worker.start()
        self._cuda: CudaRuntime | None = None
        self._streams: dict[int, int] = {}
        self._kernels: dict[str, Any] = {}
        self._cupy_contexts: dict[tuple[int, int], tuple[Any, Any]] = {}  # (device, stream) -> CuPy Device, stream
        self._staging: dict[int, _Staging] = {}  # per device: pinned buffers for range tables on their way
        self._pinned: dict[int, list[int]] = {}  # id(region) -> addresses this engine registered
        self._lock = threading.Lock()
        self._closed = False

    # ----------------------------------------------------------------- public

    @property
    def cuda(self) -> CudaRuntime:
        """The CUDA runtime binding, loaded on first use (RuntimeError where there is none)."""
        if self._cuda is None:
            self._cuda = CudaRuntime()
        return self._cuda

    def resolved_cuda_method(self) -> str:
        """The method CUDA copies use here: ``auto`` resolved against this process's runtime and CuPy."""
        if self.cuda_method != "auto":
            return self.cuda_method
        if _cupy() is not None:
            return "kernel_unrolled"
        return "batch" if self.cuda.batch is not None else "loop"

    def register(self, region: KVRegion) -> None:
        """Pin a host region's memory for CUDA copies (no-op for GPU regions, pinned memory, or no CUDA)."""
        self._check_local(region, "region")
        if region.is_cuda or region.pinned or id(region) in self._pinned:
            return
        cuda = self.cuda
        mine = []
        for addr, length in zip(*(a.tolist() for a in region.extents())):
            if cuda.is_pinned(addr):
                continue
            code = cuda.lib.cudaHostRegister(ctypes.c_void_p(addr), length, _HOST_REGISTER_PORTABLE_MAPPED)
            if code == _ALREADY_REGISTERED:
                cuda.lib.cudaGetLastError()
                continue
            cuda.check(code, f"cudaHostRegister of {length:,} bytes")
            mine.append(addr)
        with self._lock:
            self._pinned[id(region)] = mine

    def deregister(self, region: KVRegion) -> None:
        """Unpin what ``register`` pinned for this region, after the engine's streams drain."""
        with self._lock:
            mine = self._pinned.pop(id(region), [])
        if mine:
            self._synchronize()
            for addr in mine:
                self.cuda.lib.cudaHostUnregister(ctypes.c_void_p(addr))

    def write(self, src_region: KVRegion, src_blocks: Any, dst_region: KVRegion, dst_blocks: Any,
              layers: Any = None, rows: Any = None, *, timeout: float | None = None) -> TransferHandle:
        """Copy blocks between two regions of this process (any mix of host and CUDA memory)."""
        self._check_local(src_region, "src_region")
        self._check_local(dst_region, "dst_region")
        deadline = self._deadline(timeout)
        ranges = copy_ranges(src_region, src_blocks, dst_region, dst_blocks, layers, rows)
        gpu = dst_region if dst_region.is_cuda else src_region if src_region.is_cuda else None
        if gpu is None:
            return self._submit_host(ranges, deadline)
        try:
            for region in (src_region, dst_region):
                if not region.is_cuda:
                    self.register(region)
        except RuntimeError as exc:
            return _Finished(ranges, deadline, TransferStatus.FAILED, str(exc))
        return self._submit_cuda(ranges, [(0, ranges.num_ranges)], gpu.device_index, deadline)[0]

    def submit(self, ranges: CopyRanges, *, device: str = "cpu", timeout: float | None = None) -> TransferHandle:
        """Copy ranges computed elsewhere: ``device`` ``cpu`` for host memory, ``cuda:N`` to use that GPU's stream.

        The caller vouches for the addresses (host memory must be pinned for the kernel method).
        """
        if self._closed:
            raise KVCacheError("the engine is closed")
        deadline = self._deadline(timeout)
        if device == "cpu":
            return self._submit_host(ranges, deadline)
        return self._submit_cuda(ranges, [(0, ranges.num_ranges)], int(device.split(":")[1]), deadline)[0]

    def submit_parts(self, ranges: CopyRanges, cuts: Sequence[int] | np.ndarray, *, device: str = "cpu",
                     timeout: float | None = None) -> list[TransferHandle]:
        """``submit`` of each part ``ranges[cuts[i]:cuts[i + 1]]`` in turn, one handle per part, in one call.

        Parts finish in order (one queue, or one stream). On a GPU the kernel methods send every
        part's range arrays to the device in one copy and launch one kernel per part, so a
        layer-by-layer transfer costs one upload, not one per layer.
        """
        if self._closed:
            raise KVCacheError("the engine is closed")
        edges = np.asarray(cuts)
        if (edges.ndim != 1 or edges.size < 2 or edges.dtype.kind not in "iu" or int(edges[0]) != 0
                or int(edges[-1]) != ranges.num_ranges or (np.diff(edges) < 0).any()):
            raise KVCacheError(f"cuts: need ascending integers from 0 to the {ranges.num_ranges} ranges, "
                               f"got {edges.tolist() if edges.size <= 8 else edges.shape}")
        bounds = list(zip(edges[:-1].tolist(), edges[1:].tolist()))
        deadline = self._deadline(timeout)
        if device == "cpu":
            return [self._submit_host(_part(ranges, a, b), deadline) for a, b in bounds]
        return self._submit_cuda(ranges, bounds, int(device.split(":")[1]), deadline)

    def close(self) -> None:
        """Stop the worker, drain and destroy the streams, unpin what this engine pinned. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._worker.join(timeout=5.0)
        if self._cuda is not None:
            self._synchronize()
            for addrs in self._pinned.values():
                for addr in addrs:
                    self._cuda.lib.cudaHostUnregister(ctypes.c_void_p(addr))
            self._pinned.clear()
            for staging in self._staging.values():
                staging.close()  # after the streams drained: no copy still reads a buffer
            self._staging.clear()
            self._cupy_contexts.clear()
            for stream in self._streams.values():
                self._cuda.lib.cudaStreamDestroy(ctypes.c_void_p(stream))
            self._streams.clear()

    # ----------------------------------------------------------------- internals

    def _check_local(self, region: KVRegion, name: str) -> None:
        if self._closed:
            raise KVCacheError("the engine is closed")
        if region.owner:
            raise KVCacheError(f"{name} belongs to peer {region.owner!r}; LocalEngine copies within this process "
                               "(use NixlEngine for other processes)")

    def _submit_host(self, ranges: CopyRanges, deadline: float) -> TransferHandle:
        if ranges.num_ranges == 0:
            return _Finished(ranges, deadline, TransferStatus.DONE)
        handle = _HostHandle(ranges, deadline)
        self._jobs.put(handle)
        return handle

    def _stream(self, device: int) -> int:
        stream = self._streams.get(device)
        if stream is None:
            s = ctypes.c_void_p()
            self.cuda.check(self.cuda.lib.cudaStreamCreateWithFlags(ctypes.byref(s), _STREAM_NON_BLOCKING),
                            "cudaStreamCreateWithFlags")
            stream = self._streams[device] = s.value or 0
        return stream

    def _submit_cuda(self, ranges: CopyRanges, bounds: list[tuple[int, int]], device: int,
                     deadline: float) -> list[TransferHandle]:
        """``_enqueue_cuda``, a CUDA error making every part a FAILED handle (the arguments were fine)."""
        try:
            return self._enqueue_cuda(ranges, bounds, device, deadline)
        except RuntimeError as exc:
            return [_Finished(_part(ranges, a, b), deadline, TransferStatus.FAILED, str(exc)) for a, b in bounds]

    def _enqueue_cuda(self, ranges: CopyRanges, bounds: list[tuple[int, int]], device: int,
                      deadline: float) -> list[TransferHandle]:
        """Enqueue each part ``ranges[a:b]`` of ``bounds`` on the device's stream, an event behind each."""
        cuda = self.cuda
        method = self.resolved_cuda_method()
        previous = cuda.device()
        handles: list[TransferHandle] = []
        with self._lock:
            try:
                if previous != device:
                    cuda.check(cuda.lib.cudaSetDevice(device), f"cudaSetDevice({device})")
                stream = self._stream(device)
                if method == "batch" and cuda.batch is None and ranges.num_ranges:
                    raise KVCacheError(f"cuda_method batch: the CUDA runtime ({cuda.version}) has no "
                                       "cudaMemcpyBatchAsync (needs 12.8 or later)")
                with contextlib.ExitStack() as scope:  # closed before the device is set back
                    launch = None
                    keep: tuple = ()
                    if method in _KERNELS and ranges.num_ranges:
                        launch, keep = self._kernel_launcher(_KERNELS[method], ranges, device, stream, scope)
                    self._enqueue_parts(ranges, bounds, stream, method, launch, keep, deadline, handles)
            except BaseException:
                for handle in handles:  # parts already enqueued still run; their events go with them
                    handle._release()
                raise
            finally:
                if previous != device:
                    cuda.lib.cudaSetDevice(previous)
        return handles

    def _enqueue_parts(self, ranges: CopyRanges, bounds: list[tuple[int, int]], stream: int, method: str,
                       launch: Any, keep: tuple, deadline: float, handles: list[TransferHandle]) -> None:
        """Each part's copies (the kernel ``launch``, else the method's runtime calls), then its event."""
        cuda = self.cuda
        for a, b in bounds:
            part = _part(ranges, a, b)
            if b > a:
                if launch is not None:
                    launch(a, b)
                elif method == "batch":
                    cuda.memcpy_batch(part, stream)
                else:
                    cuda.memcpy_loop(part, stream)
            event = cuda.new_event()
            handles.append(_CudaHandle(cuda, part, event, deadline, keep))
            cuda.check(cuda.lib.cudaEventRecord(ctypes.c_void_p(event), ctypes.c_void_p(stream)), "cudaEventRecord")

    def _kernel_launcher(self, name: str, ranges: CopyRanges, device: int, stream: int,
                         scope: contextlib.ExitStack) -> tuple[Any, tuple]:
        """Send the range arrays to the device once ([3, n] int64: src, dst, length); returns a launcher of the
        copy kernel over ranges ``[a, b)`` of them, and what must live until the copies end.

        The device and stream contexts stay entered in ``scope`` while the parts launch, and the kernel gets
        raw pointers into the uploaded table: a part costs one launch and no array objects.
        """
        cp = _cupy()
        if cp is None:
            raise KVCacheError(f"cuda_method {self.cuda_method} needs CuPy (pip install cupy-cuda12x)")
        kernel = self._kernels.get(name)
        if kernel is None:
            kernel = self._kernels[name] = cp.RawKernel(_KERNEL_SOURCE, name)
        contexts = self._cupy_contexts.get((device, stream))
        if contexts is None:  # made once: building them took a tenth of a millisecond before each first copy
            contexts = self._cupy_contexts[(device, stream)] = (cp.cuda.Device(device), cp.cuda.ExternalStream(stream))
        for context in contexts:
            scope.enter_context(context)
        n = ranges.num_ranges
        table = cp.empty((3, n), dtype=np.int64)
        staging = self._staging.get(device)
        if staging is None:
            staging = self._staging[device] = _Staging(self.cuda)
        staging.upload(table.data.ptr, (ranges.src, ranges.dst, ranges.length), stream)
        base = table.data.ptr

        def launch(a: int, b: int) -> None:
            count = b - a
            kernel((min(count, 65535),), (256,), (np.uint64(base + 8 * a), np.uint64(base + 8 * (n + a)),
                                                  np.uint64(base + 8 * (2 * n + a)), np.int64(count)))

        return launch, (table,)

    def _synchronize(self) -> None:
        if self._cuda is None:
            return
        for stream in self._streams.values():
            self._cuda.lib.cudaStreamSynchronize(ctypes.c_void_p(stream))


def _cupy() -> Any:
    """CuPy when importable (the copy kernel's compiler), else None."""
    if "cupy" in sys.modules:
        return sys.modules["cupy"]
    try:
        import cupy
    except Exception:
        return None
    return cupy


def _part(ranges: CopyRanges, a: int, b: int) -> CopyRanges:
    """Ranges ``[a, b)`` of a copy (views, no copy)."""
    if a == 0 and b == ranges.num_ranges:
        return ranges
    return ranges.select(slice(a, b))


class _Staging:
    """Pinned host buffers that carry range tables to one GPU, each reused only once the copy reading it has ended.

    ``cupy.asarray`` of a host array took 0.1-0.3 ms a call on the H100 host, before the first copy
    of a host-tier transfer could start; a recycled buffer and one ``cudaMemcpyAsync`` take a few
    µs. A buffer's reuse waits on its own event, recorded right behind its upload, never on the
    transfer it serves, so a transfer that times out cannot hand back a buffer still being read.
    """

    MAX_BUFFERS = 16  # beyond this, a busy ring allocates nothing more: the caller waits on the oldest

    def __init__(self, cuda: CudaRuntime) -> None:
        self.cuda = cuda
        self._buffers: list[list[Any]] = []  # [address, bytes, event of its last upload or 0, int64 view]

    def upload(self, device_ptr: int, rows: tuple[np.ndarray, ...], stream: int) -> None:
        """Copy ``rows`` (int64 arrays of one length) one after another to ``device_ptr``, stream-ordered."""
        n = rows[0].size
        nbytes = len(rows) * n * 8
        buf = self._take(nbytes)
        host = buf[3][: len(rows) * n].reshape(len(rows), n)
        for i, row in enumerate(rows):
            host[i] = row
        cuda, s = self.cuda, ctypes.c_void_p(stream)
        cuda.check(cuda.lib.cudaMemcpyAsync(ctypes.c_void_p(device_ptr), ctypes.c_void_p(buf[0]), nbytes,
                                            _MEMCPY_HOST_TO_DEVICE, s), "cudaMemcpyAsync of a range table")
        if not buf[2]:
            buf[2] = cuda.new_event()
        cuda.check(cuda.lib.cudaEventRecord(ctypes.c_void_p(buf[2]), s), "cudaEventRecord")

    def _take(self, nbytes: int) -> list[Any]:
        """An idle buffer of at least ``nbytes`` (its last upload done), or a new one."""
        lib = self.cuda.lib
        for buf in self._buffers:
            if buf[1] >= nbytes and (not buf[2] or lib.cudaEventQuery(ctypes.c_void_p(buf[2])) == _SUCCESS):
                return buf
        if len(self._buffers) >= self.MAX_BUFFERS:  # all busy: wait for the oldest, then grow it if small
            buf = self._buffers.pop(0)
            if buf[2]:
                self.cuda.check(lib.cudaEventSynchronize(ctypes.c_void_p(buf[2])), "cudaEventSynchronize")
            if buf[1] >= nbytes:
                self._buffers.append(buf)
                return buf
            lib.cudaFreeHost(ctypes.c_void_p(buf[0]))
            if buf[2]:
                lib.cudaEventDestroy(ctypes.c_void_p(buf[2]))
        size = max(1 << 16, 1 << (nbytes - 1).bit_length())
        addr = ctypes.c_void_p()
        self.cuda.check(lib.cudaHostAlloc(ctypes.byref(addr), size, _HOST_ALLOC_PORTABLE),
                        f"cudaHostAlloc of {size} bytes")
        view = np.frombuffer((ctypes.c_byte * size).from_address(addr.value or 0), dtype=np.int64)  # made once
        buf = [addr.value or 0, size, 0, view]
        self._buffers.append(buf)
        return buf

    def close(self) -> None:
        """Free every buffer (call once no copy can still read one: the streams have drained)."""
        for addr, _, event, _ in self._buffers:
            if event:
                self.cuda.lib.cudaEventDestroy(ctypes.c_void_p(event))
            self.cuda.lib.cudaFreeHost(ctypes.c_void_p(addr))
        self._buffers.clear()

"""The CUDA runtime through ctypes, the range copy kernel, and what CUDA copies share: handles and range-table uploads.

``CudaRuntime`` binds the few runtime calls the transfer layer makes, on the libcudart the process
already uses. ``COPY_KERNEL_SOURCE`` is the gather/scatter kernel (compiled by CuPy, found with
``cupy_module()``) that moves a table of (src, dst, length) ranges in one launch. ``CudaHandle`` is a
transfer finished by a CUDA event, and ``RangeTableStaging`` carries range tables to a GPU through
recycled pinned buffers. ``LocalEngine`` (``engines.py``) and ``StagedCopier`` (``staged.py``) both
copy with them.
"""
from __future__ import annotations

import ctypes
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcache.transfer.base import TransferHandle, TransferStatus

if TYPE_CHECKING:
    from kvcache.transfer.regions import CopyRanges

__all__ = ["COPY_KERNEL_SOURCE", "CudaHandle", "CudaRuntime", "IpcMemHandle", "RangeTableStaging", "cupy_module"]


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


_SUCCESS, _NOT_READY = 0, 600
_MEMCPY_DEFAULT = 4
_MEMCPY_HOST_TO_DEVICE = 1
_HOST_ALLOC_PORTABLE = 1
_ACCESS_ORDER_STREAM = 1
_EVENT_DISABLE_TIMING = 0x02
_BATCH_CHUNK = 1 << 16  # ranges per cudaMemcpyBatchAsync call

COPY_KERNEL_SOURCE = r"""
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


class CudaHandle(TransferHandle):
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


def cupy_module() -> Any:
    """CuPy when importable (the copy kernel's compiler), else None."""
    if "cupy" in sys.modules:
        return sys.modules["cupy"]
    try:
        import cupy
    except Exception:
        return None
    return cupy


class RangeTableStaging:
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

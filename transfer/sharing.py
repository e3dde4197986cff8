"""A worker's KV cache opened in another process: CUDA IPC for device memory, the backing file for host memory.

A messager or receiver in a process of its own (``kvcache.pd.process``) must register the worker's
cache with NIXL from its own address space. ``share_region(region)`` says, in a picklable form,
where the region's memory lives; ``SharedRegion.open(shared)`` maps it into this process and
rebases every address; ``close()`` unmaps it.

    device memory  one cudaIpcGetMemHandle per allocation the region touches (PyTorch's and Paddle's
                   allocators hand out ordinary cudaMalloc memory), opened with cudaIpcOpenMemHandle
    host memory    must be a shared file mapping (``SharedHostBuffer``, or any MAP_SHARED file still
                   linked, as found in /proc/self/maps); private memory such as numpy's cannot be
                   reached from another process, and sharing it is refused with the reason
"""
from __future__ import annotations

import ctypes
import mmap
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.transfer.cuda import CudaRuntime, IpcMemHandle
from kvcache.transfer.regions import KVRegion

__all__ = ["RegionShare", "SharedHostBuffer", "SharedRegion", "share_region"]

_SHM_DIR = "/dev/shm"
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")
# Page tables filled at map time: else every first touch of a 4 KiB page in this process faults, and the
# first transfer through a fresh mapping pays for it (VM: one 16 MiB layer alone took 3.0 ms against 1.5).
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class SharedHostBuffer:
    """Host memory another process can map: a file in /dev/shm, mapped shared, viewed as a uint8 numpy array.

    ``close()`` removes the file (processes that mapped it keep their mapping); the memory goes
    when the last mapping does. Use it for CPU caches that a ``MessagerProcess`` must reach.
    """

    def __init__(self, nbytes: int, name: str | None = None) -> None:
        if not isinstance(nbytes, int) or nbytes < 1:
            raise KVCacheError(f"nbytes: must be a positive int, got {nbytes!r}")
        if name is not None and not _NAME.fullmatch(name):
            raise KVCacheError(f"name: {name!r} must be 1-200 letters, digits, '.', '_' or '-', not starting "
                               f"with '.' (a file in {_SHM_DIR})")
        self.path = os.path.join(_SHM_DIR, name or f"kvcache-host-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes, _MAP_FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def close(self) -> None:
        """Remove the file (idempotent); the array stays usable while referenced."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> SharedHostBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class _Segment:
    """One piece of shared memory in the sharing process: ``[start, end)`` there, and how to open it elsewhere."""

    start: int
    end: int
    path: str = ""  # host: the file, mapped from ``offset``
    offset: int = 0
    handle: bytes = b""  # device: the cudaIpcMemHandle of the allocation that starts at ``start``


@dataclass(frozen=True)
class RegionShare:
    """What ``share_region`` returns, for ``SharedRegion.open`` elsewhere: the region and its segments (picklable)."""

    description: dict[str, Any]
    segments: tuple[_Segment, ...]
    cudart: str = ""  # the sharing process's CUDA runtime, so the opener uses the same one
    pid: int = field(default_factory=os.getpid)


def share_region(region: KVRegion) -> RegionShare:
    """Describe where ``region``'s memory lives so another process can open it (``SharedRegion.open``).

    Raises KVCacheError naming the problem when it cannot be shared (host memory that is not a
    shared file mapping, a region that already belongs to a peer).
    """
    if region.owner:
        raise KVCacheError(f"region: belongs to peer {region.owner!r}; only this process's memory can be shared")
    ext = region.extents()
    if region.is_cuda:
        segments, cudart = _device_segments(region.device_index, ext.addr, ext.length), _cudart_path()
    else:
        segments, cudart = _host_segments(ext.addr, ext.length), ""
    starts = np.array([s.start for s in segments], dtype=np.int64)
    ends = np.array([s.end for s in segments], dtype=np.int64)
    span = region.spans()
    index = np.searchsorted(starts, region.addrs, side="right") - 1
    if (region.addrs + span > ends[index]).any():
        layer, t = (int(i) for i in np.argwhere(region.addrs + span > ends[index])[0])
        raise KVCacheError(f"region: layer {layer} tensor {region.tensors[t].name!r} spans two allocations; "
                           "each cache tensor must lie in one")
    return RegionShare(region.describe(), tuple(segments), cudart)


class SharedRegion:
    """A region shared by another process, mapped into this one; ``region`` has this process's addresses."""

    def __init__(self, region: KVRegion, closers: list[Any]) -> None:
        self.region = region
        self._closers = closers

    @classmethod
    def open(cls, shared: RegionShare) -> SharedRegion:
        """Map every segment of ``shared`` (from ``share_region`` in another process) and rebase the region."""
        description = shared.description
        closers: list[Any] = []
        bases = np.zeros(len(shared.segments), dtype=np.int64)
        try:
            if str(description["device"]).startswith("cuda"):
                runtime = _runtime(shared.cudart)
                device = int(str(description["device"]).split(":")[1])
                runtime.check(runtime.lib.cudaSetDevice(device), f"cudaSetDevice({device})")
                for i, seg in enumerate(shared.segments):
                    bases[i] = runtime.ipc_open(seg.handle)
                    closers.append(lambda addr=int(bases[i]): runtime.ipc_close(addr))
            else:
                for i, seg in enumerate(shared.segments):
                    view, keep = _map_file(seg)
                    bases[i] = view.ctypes.data
                    closers.append(keep)
            starts = np.array([s.start for s in shared.segments], dtype=np.int64)
            addrs = np.asarray(description["addrs"], dtype=np.int64)
            index = np.searchsorted(starts, addrs, side="right") - 1
            rebased = bases[index] + (addrs - starts[index])
            desc = dict(description, addrs=rebased.tolist())
            region = KVRegion.from_description(desc, owner="")
        except BaseException:
            _close_all(closers)
            raise
        return cls(region, closers)

    def close(self) -> None:
        """Unmap every segment (idempotent); the region must not be used afterwards."""
        _close_all(self._closers)
        self._closers = []

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_all(closers: list[Any]) -> None:
    for closer in reversed(closers):
        if callable(closer):
            closer()
        else:  # a host mapping: drop the view, then the map
            closer[0] = None
            closer[1].close()
    closers.clear()


# --------------------------------------------------------------------------- host memory


def _host_segments(addr: np.ndarray, length: np.ndarray) -> list[_Segment]:
    """The shared file mapping holding each extent, from /proc/self/maps."""
    maps = _file_mappings()
    segments = []
    for a, n in zip(addr.tolist(), length.tolist()):
        hit = next((m for m in maps if m[0] <= a and a + n <= m[1]), None)
        if hit is None:
            raise KVCacheError(
                f"region: host memory at {a:#x} ({n:,} bytes) is not one shared file mapping, so another "
                "process cannot map it; allocate the cache in SharedHostBuffer (kvcache.transfer.sharing)")
        start, end, path, offset = hit
        segments.append(_Segment(a, a + n, path=path, offset=offset + (a - start)))
    return segments


def _file_mappings() -> list[tuple[int, int, str, int]]:
    """(start, end, path, file offset) of this process's shared mappings of files that still exist."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or parts[1][3] != "s":
                continue
            path = parts[5].rstrip("\n")
            if not path.startswith("/") or path.endswith(" (deleted)"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, path, int(parts[2], 16)))
    return out


def _map_file(seg: _Segment) -> tuple[np.ndarray, list[Any]]:
    """Map ``seg``'s bytes of its file shared; returns a view of exactly those bytes and what keeps it open."""
    lead = seg.offset % mmap.ALLOCATIONGRANULARITY
    size = seg.end - seg.start
    try:
        fd = os.open(seg.path, os.O_RDWR)
    except OSError as exc:
        raise KVCacheError(f"region: cannot open the shared cache file {seg.path}: {exc.strerror}") from None
    try:
        m = mmap.mmap(fd, lead + size, _MAP_FLAGS, mmap.PROT_READ | mmap.PROT_WRITE,
                      offset=seg.offset - lead)
    finally:
        os.close(fd)
    view = np.frombuffer(m, dtype=np.uint8)[lead:]
    return view, [view, m]


# --------------------------------------------------------------------------- device memory


class _IpcRuntime:
    """cudaIpc* through the process's CUDA runtime, and the allocation range through the driver."""

    def __init__(self, path: str) -> None:
        if path and not os.environ.get("KVCACHE_CUDART"):
            os.environ["KVCACHE_CUDART"] = path  # read once, at the runtime's first lookup: use the sharer's
        runtime = CudaRuntime()
        self.lib, self.check = runtime.lib, runtime.check
        self.driver = ctypes.CDLL("libcuda.so.1")
        self.driver.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                         ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]

    def allocation(self, addr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        code = self.driver.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(addr))
        if code != 0:
            raise KVCacheError(f"region: cuMemGetAddressRange({addr:#x}) failed with CUDA driver error {code}")
        return base.value, size.value

    def ipc_handle(self, base: int) -> bytes:
        handle = IpcMemHandle()
        self.check(self.lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(base)),
                   f"cudaIpcGetMemHandle({base:#x}) (memory from cudaMallocAsync or virtual memory management "
                   "cannot be shared this way)")
        return ctypes.string_at(ctypes.addressof(handle), ctypes.sizeof(handle))

    def ipc_open(self, handle: bytes) -> int:
        ptr = ctypes.c_void_p()
        raw = IpcMemHandle.from_buffer_copy(handle)
        self.check(self.lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), raw, 1), "cudaIpcOpenMemHandle")
        return int(ptr.value or 0)

    def ipc_close(self, addr: int) -> None:
        self.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(addr))


_RUNTIME: _IpcRuntime | None = None


def _runtime(path: str = "") -> _IpcRuntime:
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = _IpcRuntime(path)
    return _RUNTIME


def _cudart_path() -> str:
    from kvcache.ops import cuda_runtime

    return cuda_runtime() or ""


def _device_segments(device: int, addr: np.ndarray, length: np.ndarray) -> list[_Segment]:
    """One segment per CUDA allocation the extents touch (each opened once elsewhere), in address order."""
    runtime = _runtime()
    runtime.check(runtime.lib.cudaSetDevice(device), f"cudaSetDevice({device})")
    found: dict[int, int] = {}
    for a, n in zip(addr.tolist(), length.tolist()):
        pos = a
        while pos < a + n:  # an extent may span allocations that happen to sit side by side
            base, size = runtime.allocation(pos)
            found[base] = size
            pos = base + size
    return [_Segment(base, base + size, handle=runtime.ipc_handle(base)) for base, size in sorted(found.items())]

"""Copies between scattered GPU blocks and runs of host blocks, staged in GPU memory: SMs gather, a DMA engine moves.

A copy kernel that reads or writes pinned host memory itself (``LocalEngine``'s kernel method)
moves a request's scattered 32 KiB blocks at 85-90% of one ``cudaMemcpyAsync`` of the same bytes
on an H200. A host tier's blocks are mostly runs of neighbouring host blocks, so each piece of a
layer is gathered on the GPU (device memory, several hundred GB/s) into a slot of a small ring of
GPU buffers, and the slot goes to host as one ``cudaMemcpyAsync`` per host run, on a second
stream, while the next piece is gathered. Loads run the other way (DMA into a slot, then a
scatter kernel)::

    offload   gather stream:  [gather 0][gather 1][gather 2] ...      (waits for a slot's DMA before reusing it)
              DMA stream:          [ DMA piece 0 ][ DMA piece 1 ][ DMA piece 2 ] ...  -> layer events
    load      DMA stream:     [ DMA piece 0 ][ DMA piece 1 ] ...      (waits for a slot's scatter before reusing it)
              scatter stream:               [scatter 0]   [scatter 1] ...          -> layer events

One copier keeps the order one engine stream would: every gather and scatter runs on one stream
and every DMA on the other, in the order submitted, so a later copy writing a GPU block runs after
an earlier one read it, and a later copy reading a host block after an earlier one wrote it.
"""
from __future__ import annotations

import ctypes
import warnings
from typing import Any

import numpy as np

from kvcache.transfer import _ranges
from kvcache.transfer.base import TransferHandle
from kvcache.transfer.cuda import COPY_KERNEL_SOURCE, CudaHandle, CudaRuntime, RangeTableStaging, cupy_module
from kvcache.transfer.engines import LocalEngine
from kvcache.transfer.regions import CopyRanges

__all__ = ["SLOT_BYTES", "StagedCopier"]

SLOT_BYTES = 16 << 20
"""Bytes of one staging slot: a piece of a layer moves through one slot."""
SLOTS = 4
"""Slots in the ring: how far gathers may run ahead of the DMAs (GPU memory: SLOTS x (SLOT_BYTES + CHUNK_BYTES))."""
CHUNK_BYTES = 1 << 20
"""Longer ranges are cut to this (a range never straddles two pieces by more)."""
MIN_RUN_BYTES = 256 << 10
"""Host runs shorter than this on average: the direct kernel copy is the better one (a DMA each costs µs)."""

_MEMCPY_DEFAULT = 4
_STREAM_NON_BLOCKING = 0x01


class StagedCopier:
    """Staged GPU<->host copies on ``engine``'s CUDA runtime, for GPU ``device``; ``submit_parts`` as the engine's.

    Needs CuPy (the gather/scatter kernel); ``available()`` says whether it can run here. The
    slots are allocated at the first copy and freed by ``close``.
    """

    def __init__(self, engine: LocalEngine, device: int) -> None:
        self.engine = engine
        self.device = int(device)
        self._cuda: CudaRuntime | None = None
        self._streams: tuple[int, int] | None = None  # (kernel stream, DMA stream)
        self._slots: Any = None  # CuPy uint8 [SLOTS, SLOT_BYTES + CHUNK_BYTES]
        self._free: list[int] = []  # per slot: an event recorded when its last user is done with it (0: never used)
        self._filled: list[int] = []  # per slot: an event recorded when its first half (gather, or DMA in) is done
        self._next = 0  # the slot the next piece takes
        self._kernel: Any = None  # the compiled copy kernel (a CuPy Function): launched without RawKernel's lookups
        self._device_table: Any = None  # CuPy int64: range tables, one copy's after another (``_table``)
        self._staging: RangeTableStaging | None = None
        self._contexts: tuple[Any, Any] | None = None

    @staticmethod
    def available() -> bool:
        """Whether staged copies can run in this process (CuPy compiles the gather/scatter kernel)."""
        return cupy_module() is not None

    @staticmethod
    def suits(ranges: CopyRanges, to_host: bool) -> bool:
        """Whether a copy whose first ranges are ``ranges`` moves long runs of host memory (else the kernel wins)."""
        if ranges.num_ranges == 0:
            return True
        runs, total = _ranges.host_runs(np.ascontiguousarray(ranges.dst if to_host else ranges.src, dtype=np.int64),
                                        np.ascontiguousarray(ranges.length, dtype=np.int64))
        return total // runs >= MIN_RUN_BYTES

    def submit_parts(self, ranges: CopyRanges, cuts: np.ndarray, *, to_host: bool, direct: bool = False,
                     timeout: float | None = None) -> list[TransferHandle]:
        """One handle per part ``ranges[cuts[i]:cuts[i + 1]]`` (a layer), ended in order; GPU -> host with
        ``to_host``, else host -> GPU. ``direct``: the copy kernel moves the ranges itself (host runs too short to
        stage), still in order with every copy submitted here before and after."""
        deadline = self.engine._deadline(timeout)
        cuda = self._ready()
        previous = cuda.device()
        if previous != self.device:
            cuda.check(cuda.lib.cudaSetDevice(self.device), f"cudaSetDevice({self.device})")
        entered: list[Any] = []  # try/finally, not an ExitStack: this runs before a copy's first kernel or DMA
        try:
            for context in self._contexts or ():
                context.__enter__()
                entered.append(context)
            if direct:
                return self._enqueue_direct(ranges, np.asarray(cuts, dtype=np.int64), deadline)
            return self._enqueue(ranges, np.asarray(cuts, dtype=np.int64), to_host, deadline)
        finally:
            try:
                for context in reversed(entered):
                    context.__exit__(None, None, None)
            finally:
                if previous != self.device:
                    cuda.lib.cudaSetDevice(previous)

    def close(self) -> None:
        """Wait for the streams, free the slots and events. Idempotent."""
        cuda = self._cuda
        if cuda is None or self._streams is None:
            return
        for stream in self._streams:
            cuda.lib.cudaStreamSynchronize(ctypes.c_void_p(stream))
        for event in self._free + self._filled:
            if event:
                cuda.lib.cudaEventDestroy(ctypes.c_void_p(event))
        if self._staging is not None:
            self._staging.close()
        for stream in self._streams:
            cuda.lib.cudaStreamDestroy(ctypes.c_void_p(stream))
        self._streams, self._slots, self._free, self._filled, self._contexts = None, None, [], [], None
        self._device_table = None

    # ------------------------------------------------------------------ internals

    def _ready(self) -> CudaRuntime:
        """The runtime, with the streams, slots and kernel made on first use."""
        cuda = self._cuda = self._cuda or self.engine.cuda
        if self._streams is not None:
            return cuda
        cp = cupy_module()
        if cp is None:
            raise RuntimeError("staged copies need CuPy (pip install cupy-cuda12x)")
        fn = cuda.lib.cudaStreamWaitEvent
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint], ctypes.c_int
        previous = cuda.device()
        cuda.check(cuda.lib.cudaSetDevice(self.device), f"cudaSetDevice({self.device})")
        try:
            streams = []
            for _ in range(2):
                s = ctypes.c_void_p()
                cuda.check(cuda.lib.cudaStreamCreateWithFlags(ctypes.byref(s), _STREAM_NON_BLOCKING),
                           "cudaStreamCreateWithFlags")
                streams.append(s.value or 0)
            with cp.cuda.Device(self.device):
                self._slots = cp.empty((SLOTS, SLOT_BYTES + CHUNK_BYTES), dtype=np.uint8)
                self._kernel = cp.RawKernel(COPY_KERNEL_SOURCE, "copy_ranges_unrolled").kernel  # compiled for this GPU
            with warnings.catch_warnings():  # CuPy 14 prefers Stream.from_external; both wrap the same raw stream
                warnings.simplefilter("ignore", DeprecationWarning)
                self._contexts = (cp.cuda.Device(self.device), cp.cuda.ExternalStream(streams[0]))
            self._staging = RangeTableStaging(cuda)
            self._free, self._filled = [0] * SLOTS, [0] * SLOTS
            self._streams = (streams[0], streams[1])
        finally:
            cuda.lib.cudaSetDevice(previous)
        return cuda

    def _enqueue(self, ranges: CopyRanges, cuts: np.ndarray, to_host: bool, deadline: float) -> list[TransferHandle]:
        cuda = self._cuda
        assert cuda is not None and self._streams is not None
        kernel_stream, dma_stream = self._streams
        plan = _plan(ranges, cuts, to_host)
        first = self._next
        self._next = (first + plan.num_pieces) % SLOTS
        rows, dma_staged = _slot_table(plan, self._slots.data.ptr, self._slots.shape[1], first, to_host)
        table = None
        if plan.num_ranges:
            table = self._table(plan.num_ranges)
            self._staging.upload(table.data.ptr, (rows,), kernel_stream)
        handles: list[TransferHandle] = []
        done_stream = dma_stream if to_host else kernel_stream
        dma_kind = _MEMCPY_DEFAULT
        k, d = ctypes.c_void_p(kernel_stream), ctypes.c_void_p(dma_stream)
        piece_starts = plan.piece_starts.tolist()
        dma_starts = plan.dma_starts.tolist()
        dma_host, dma_len = plan.dma_host.tolist(), plan.dma_length.tolist()
        dma_staged = dma_staged.tolist()
        layer_end = plan.layer_end_piece.tolist()
        bounds = cuts.tolist()
        p = 0
        for layer in range(cuts.size - 1):
            while p < layer_end[layer]:
                s = (first + p) % SLOTS
                a, b = piece_starts[p], piece_starts[p + 1]
                waiting, moving = (k, d) if to_host else (d, k)
                if self._free[s]:
                    cuda.check(cuda.lib.cudaStreamWaitEvent(waiting, ctypes.c_void_p(self._free[s]), 0),
                               "cudaStreamWaitEvent")
                else:
                    self._free[s], self._filled[s] = cuda.new_event(), cuda.new_event()
                step = self._filled[s]
                if to_host:
                    self._launch(table, a, b, plan.num_ranges)
                else:
                    for j in range(dma_starts[p], dma_starts[p + 1]):
                        cuda.check(cuda.lib.cudaMemcpyAsync(ctypes.c_void_p(dma_staged[j]), ctypes.c_void_p(dma_host[j]),
                                                            dma_len[j], dma_kind, d), "cudaMemcpyAsync")
                cuda.check(cuda.lib.cudaEventRecord(ctypes.c_void_p(step), waiting), "cudaEventRecord")
                cuda.check(cuda.lib.cudaStreamWaitEvent(moving, ctypes.c_void_p(step), 0), "cudaStreamWaitEvent")
                if to_host:
                    for j in range(dma_starts[p], dma_starts[p + 1]):
                        cuda.check(cuda.lib.cudaMemcpyAsync(ctypes.c_void_p(dma_host[j]), ctypes.c_void_p(dma_staged[j]),
                                                            dma_len[j], dma_kind, d), "cudaMemcpyAsync")
                else:
                    self._launch(table, a, b, plan.num_ranges)
                cuda.check(cuda.lib.cudaEventRecord(ctypes.c_void_p(self._free[s]), moving), "cudaEventRecord")
                p += 1
            event = cuda.new_event()
            cuda.check(cuda.lib.cudaEventRecord(ctypes.c_void_p(event), ctypes.c_void_p(done_stream)), "cudaEventRecord")
            part = ranges.select(slice(bounds[layer], bounds[layer + 1]))
            handles.append(CudaHandle(cuda, part, event, deadline, (table,)))
        return handles

    def _enqueue_direct(self, ranges: CopyRanges, cuts: np.ndarray, deadline: float) -> list[TransferHandle]:
        """The kernel over each part on the kernel stream, after everything on the DMA stream and before what comes
        next on it: one order for all copies."""
        cuda = self._cuda
        assert cuda is not None and self._streams is not None
        kernel_stream, dma_stream = self._streams
        self._join(kernel_stream, dma_stream)
        table = None
        if ranges.num_ranges:
            table = self._table(ranges.num_ranges)
            self._staging.upload(table.data.ptr, (ranges.src, ranges.dst, ranges.length), kernel_stream)
        handles: list[TransferHandle] = []
        bounds = cuts.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            self._launch(table, a, b, ranges.num_ranges)
            event = cuda.new_event()
            cuda.check(cuda.lib.cudaEventRecord(ctypes.c_void_p(event), ctypes.c_void_p(kernel_stream)),
                       "cudaEventRecord")
            handles.append(CudaHandle(cuda, CopyRanges(*(x[a:b] for x in ranges)), event, deadline, (table,)))
        self._join(dma_stream, kernel_stream)
        return handles

    def _join(self, waiting: int, stream: int) -> None:
        """Make ``waiting`` wait for what is enqueued on ``stream`` so far."""
        cuda = self._cuda
        event = cuda.new_event()
        cuda.check(cuda.lib.cudaEventRecord(ctypes.c_void_p(event), ctypes.c_void_p(stream)), "cudaEventRecord")
        cuda.check(cuda.lib.cudaStreamWaitEvent(ctypes.c_void_p(waiting), ctypes.c_void_p(event), 0),
                   "cudaStreamWaitEvent")
        cuda.lib.cudaEventDestroy(ctypes.c_void_p(event))

    def _table(self, n: int) -> Any:
        """GPU room for a range table [3, n]: one buffer, reused by every copy and grown as needed.

        Reuse is safe without waiting: tables are uploaded and read only on the kernel stream, so an upload runs
        after every kernel reading the table before it. Handles keep the buffer they read alive (a grown one
        replaces it here), as they kept a table of their own."""
        if self._device_table is None or self._device_table.size < 3 * n:
            self._device_table = cupy_module().empty(max(3 * n, 1 << 15), dtype=np.int64)
        return self._device_table

    def _launch(self, table: Any, a: int, b: int, n: int) -> None:
        """The copy kernel over ranges ``[a, b)`` of the uploaded ``table`` [3, n], on the kernel stream."""
        count = b - a
        if count <= 0:
            return
        ptr = table.data.ptr
        self._kernel((min(count, 65535),), (256,), (np.uint64(ptr + 8 * a), np.uint64(ptr + 8 * (n + a)),
                                                   np.uint64(ptr + 8 * (2 * n + a)), np.int64(count)))


def _slot_table(plan: _Plan, slots: int, stride: int, first: int, to_host: bool) -> tuple[np.ndarray, np.ndarray]:
    """``plan`` placed in the ring from slot ``first`` (slots ``stride`` bytes apart from address ``slots``): the copy
    kernel's table rows one after another (int64 [3 x ranges]: gpu -> slot with ``to_host``, else slot -> gpu) and
    each DMA's address in its slot. One C pass (``_ranges.slot_table``)."""
    rows = np.empty(3 * plan.num_ranges, dtype=np.int64)
    staged = np.empty(plan.dma_piece.size, dtype=np.int64)
    _ranges.slot_table(plan.piece, plan.offset, plan.gpu, plan.length, plan.dma_piece, plan.dma_offset, slots, stride,
                       first, SLOTS, to_host, rows, staged)
    return rows, staged


class _Plan:
    """A group of layers' ranges cut into pieces of at most a slot, each range's place in its piece's slot, and the
    DMA ranges (host runs) of each piece. Ranges are in piece order; pieces in layer order."""

    __slots__ = ("gpu", "offset", "length", "piece", "piece_starts", "num_pieces", "num_ranges", "layer_end_piece",
                 "dma_host", "dma_offset", "dma_length", "dma_piece", "dma_starts")


def _plan(ranges: CopyRanges, cuts: np.ndarray, to_host: bool) -> _Plan:
    """Lay a group of layers' ranges out in slot-sized pieces: mirrored where each layer's host side is one span
    (no sorting, one DMA a piece), else sorted by host address. One C pass (``_ranges.stage_plan``), the plan
    ``_numpy_plan`` makes: a bench-sized layer of 512 ranges in 6 µs, not numpy's 34 µs (2 CPUs of a VM)."""
    gpu_addr, host_addr = (ranges.src, ranges.dst) if to_host else (ranges.dst, ranges.src)
    length = np.ascontiguousarray(ranges.length, dtype=np.int64)
    room = _ranges.chunked(length, CHUNK_BYTES)
    out = np.empty((10, room + 1), dtype=np.int64)
    plan = _Plan()
    plan.layer_end_piece = np.empty(cuts.size - 1, dtype=np.int64)
    n, pieces, dmas = _ranges.stage_plan(np.ascontiguousarray(gpu_addr, dtype=np.int64),
                                         np.ascontiguousarray(host_addr, dtype=np.int64), length,
                                         np.ascontiguousarray(cuts, dtype=np.int64), to_host, SLOT_BYTES, CHUNK_BYTES,
                                         *out[:5], plan.layer_end_piece, *out[5:])
    plan.gpu, plan.offset, plan.length, plan.piece = out[0, :n], out[1, :n], out[2, :n], out[3, :n]
    plan.piece_starts, plan.num_pieces, plan.num_ranges = out[4, :pieces + 1], pieces, n
    plan.dma_host, plan.dma_offset, plan.dma_length = out[5, :dmas], out[6, :dmas], out[7, :dmas]
    plan.dma_piece, plan.dma_starts = out[8, :dmas], out[9, :pieces + 1]
    return plan


def _numpy_plan(ranges: CopyRanges, cuts: np.ndarray, to_host: bool) -> _Plan:
    """``_plan`` in numpy: the reference the C plan is tested against."""
    gpu_addr, host_addr = (ranges.src, ranges.dst) if to_host else (ranges.dst, ranges.src)
    length = ranges.length.astype(np.int64)
    layers = cuts.size - 1
    layer = np.repeat(np.arange(layers), np.diff(cuts))
    # Cut ranges longer than a chunk (vectorised): a range then overhangs its piece's slot by less than a chunk.
    pieces_per = -(-length // CHUNK_BYTES)
    if (pieces_per > 1).any():
        pieces_per = np.maximum(pieces_per, 1)
        idx = np.repeat(np.arange(length.size), pieces_per)
        step = (np.arange(idx.size) - (np.cumsum(pieces_per) - pieces_per)[idx]) * CHUNK_BYTES
        gpu_addr, host_addr, layer = gpu_addr[idx] + step, host_addr[idx] + step, layer[idx]
        length = np.minimum(length[idx] - step, CHUNK_BYTES)
    plan = _mirrored_plan(gpu_addr, host_addr, length, layer, layers, to_host)
    return plan if plan is not None else _sorted_plan(gpu_addr, host_addr, length, layer, layers)


def _mirrored_plan(gpu_addr: np.ndarray, host_addr: np.ndarray, length: np.ndarray, layer: np.ndarray, layers: int,
                   to_host: bool) -> _Plan | None:
    """Each layer's host span [lo, hi) cut into windows of a slot, each slot holding its window's bytes where the host
    holds them: a range goes where its host address says (no sort) and a window moves in one DMA. Offloads need the
    ranges to tile the span exactly (a DMA writes all of it); a load may read up to a quarter more. None: not so."""
    n = length.size
    counts = np.bincount(layer, minlength=layers)
    has = counts > 0
    lo, hi, total = (np.zeros(layers, dtype=np.int64) for _ in range(3))
    if n:
        firsts = (np.cumsum(counts) - counts)[has]
        lo[has] = np.minimum.reduceat(host_addr, firsts)
        hi[has] = np.maximum.reduceat(host_addr + length, firsts)
        total[has] = np.add.reduceat(length, firsts)
    span = hi - lo
    if not ((span == total).all() if to_host else (4 * span <= 5 * total).all()):
        return None
    windows = -(-span // SLOT_BYTES)
    piece_base = np.concatenate(([0], np.cumsum(windows)))
    num_pieces = int(piece_base[-1])
    rel = host_addr - lo[layer]
    local = rel // SLOT_BYTES
    piece = piece_base[layer] + local
    # What the ranges starting in each window carry past its end: that window's DMA takes it along.
    over = np.zeros(num_pieces, dtype=np.int64)
    past = rel + length - (local + 1) * SLOT_BYTES
    beyond = past > 0
    if beyond.any():
        np.maximum.at(over, piece[beyond], past[beyond])
    w_layer = np.repeat(np.arange(layers), windows)
    w_local = np.arange(num_pieces) - piece_base[w_layer]
    w_start = lo[w_layer] + w_local * SLOT_BYTES
    # An offload's window starts after what the previous one carried over (that DMA wrote it); a load's reads it again.
    head = np.where(w_local > 0, np.concatenate(([0], over[:-1])), 0) if to_host else np.zeros(num_pieces, np.int64)
    if (windows > 1).any():
        order = np.argsort(piece, kind="stable")
        gpu_addr, host_addr, length, piece = gpu_addr[order], host_addr[order], length[order], piece[order]
    plan = _Plan()
    plan.gpu, plan.length, plan.piece = gpu_addr, length, piece
    plan.offset = host_addr - w_start[piece] if n else np.zeros(0, dtype=np.int64)
    plan.num_pieces, plan.num_ranges = num_pieces, n
    plan.piece_starts = np.searchsorted(piece, np.arange(num_pieces + 1))
    plan.layer_end_piece = piece_base[1:]
    plan.dma_host = w_start + head
    plan.dma_offset = head
    plan.dma_length = np.minimum(w_start + SLOT_BYTES + over, hi[w_layer]) - plan.dma_host
    plan.dma_piece = np.arange(num_pieces)
    plan.dma_starts = np.arange(num_pieces + 1)
    return plan


def _sorted_plan(gpu_addr: np.ndarray, host_addr: np.ndarray, length: np.ndarray, layer: np.ndarray,
                 layers: int) -> _Plan:
    """Each layer's ranges sorted by host address and packed into slots, one DMA per host run in a piece."""
    order = np.lexsort((host_addr, layer))
    gpu_addr, host_addr, length, layer = gpu_addr[order], host_addr[order], length[order], layer[order]
    n = length.size
    # Bytes before each range within its layer, then the layer's pieces of SLOT_BYTES.
    ends = np.cumsum(length)
    layer_first = np.searchsorted(layer, np.arange(layers))
    layer_base = np.concatenate(([0], ends))[layer_first]
    within = ends - length - layer_base[layer]
    local_piece = within // SLOT_BYTES
    per_layer = np.zeros(layers, dtype=np.int64)
    if n:
        np.maximum.at(per_layer, layer, local_piece + 1)
    piece_base = np.concatenate(([0], np.cumsum(per_layer)))
    piece = piece_base[layer] + local_piece
    plan = _Plan()
    plan.gpu, plan.length, plan.piece = gpu_addr, length, piece
    plan.offset = within - local_piece * SLOT_BYTES
    plan.num_pieces = int(piece_base[-1])
    plan.num_ranges = n
    plan.piece_starts = np.searchsorted(piece, np.arange(plan.num_pieces + 1))
    plan.layer_end_piece = piece_base[1:]
    # DMA ranges: runs contiguous on host within a piece (their slot offsets are contiguous by construction).
    joined = np.zeros(n, dtype=bool)
    if n > 1:
        joined[1:] = (host_addr[1:] == host_addr[:-1] + length[:-1]) & (piece[1:] == piece[:-1])
    starts = np.flatnonzero(~joined)
    plan.dma_host = host_addr[starts]
    plan.dma_offset = plan.offset[starts]
    plan.dma_length = np.add.reduceat(length, starts) if n else length
    plan.dma_piece = piece[starts]
    plan.dma_starts = np.searchsorted(plan.dma_piece, np.arange(plan.num_pieces + 1))
    return plan

"""Staged host-tier copies move the right bytes: StagedCopier run on the CPU over a CUDA runtime and CuPy that act
in host memory, in the order the copies are enqueued (one valid order of the two streams).

The GPU tests (tests/test_transfer_gpu.py, kvcache bench tier) run the same copier on a real GPU; here its planning,
slot placement, range tables and DMA addresses are checked byte for byte where CuPy is absent.
"""
from __future__ import annotations

import ctypes
import itertools
import sys
import types
from contextlib import nullcontext
from typing import Any

import numpy as np
import pytest

from kvcache.bench.transfer import make_spec
from kvcache.transfer import staged
from kvcache.transfer.engines import CudaRuntime, LocalEngine, TransferStatus
from kvcache.transfer.manager import copy_layers
from kvcache.transfer.regions import KVRegion


def _value(x: Any) -> int:
    return int(getattr(x, "value", x) or 0)


class HostCuda:
    """The CUDA runtime calls the copier makes, done at once in host memory; ``trace`` records the copies."""

    def __init__(self) -> None:
        self.trace: list[tuple] = []
        self.keep: list[np.ndarray] = []
        ids = itertools.count(1)

        def fn(body: Any) -> Any:
            def call(*args: Any) -> int:
                return body(*args) or 0
            return call  # a plain function: the copier sets argtypes on some

        def out(ref: Any, value: int) -> None:
            ref._obj.value = value

        def host_alloc(ref: Any, size: int, flags: int) -> None:
            buf = np.zeros(size, dtype=np.uint8)
            self.keep.append(buf)
            out(ref, buf.ctypes.data)

        def memcpy(dst: Any, src: Any, n: int, kind: int, stream: Any) -> None:
            self.trace.append(("memcpy", _value(dst), _value(src), int(n), int(kind)))
            ctypes.memmove(_value(dst), _value(src), int(n))

        calls = {
            "cudaMemcpyAsync": memcpy,
            "cudaHostAlloc": host_alloc,
            "cudaEventCreateWithFlags": lambda ref, flags: out(ref, next(ids)),
            "cudaStreamCreateWithFlags": lambda ref, flags: out(ref, next(ids)),
            "cudaGetDevice": lambda ref: out(ref, 0),
            "cudaGetErrorString": lambda code: None,
        }
        for name in ("cudaEventRecord", "cudaEventQuery", "cudaEventSynchronize", "cudaEventDestroy",
                     "cudaStreamWaitEvent", "cudaStreamSynchronize", "cudaStreamDestroy", "cudaSetDevice",
                     "cudaFreeHost", "cudaGetLastError"):
            calls[name] = lambda *args: None
        self.lib = types.SimpleNamespace(**{name: fn(body) for name, body in calls.items()})


class HostArray:
    """cupy.ndarray's few parts the copier uses, over host memory."""

    def __init__(self, shape: Any, dtype: Any) -> None:
        self.host = np.zeros(shape, dtype=dtype)
        self.shape, self.size = self.host.shape, self.host.size
        self.data = types.SimpleNamespace(ptr=self.host.ctypes.data)


def host_cupy(trace: list[tuple]) -> Any:
    """A CuPy whose copy kernel moves each range of its table at once, in host memory."""

    def launch(grid: tuple, block: tuple, args: tuple) -> None:
        src, dst, length, count = (int(a) for a in args)
        rows = [np.ctypeslib.as_array((ctypes.c_int64 * count).from_address(p)).copy() for p in (src, dst, length)]
        trace.append(("kernel", count))
        for s, d, n in zip(*(r.tolist() for r in rows)):
            ctypes.memmove(d, s, n)

    class RawKernel:
        kernel = staticmethod(launch)  # the compiled function

        def __init__(self, source: str, name: str) -> None:
            pass

        def __call__(self, grid: tuple, block: tuple, args: tuple) -> None:
            launch(grid, block, args)

    cuda = types.SimpleNamespace(Device=lambda device: nullcontext(), ExternalStream=lambda stream: nullcontext())
    return types.SimpleNamespace(empty=HostArray, cuda=cuda, RawKernel=RawKernel)


@pytest.fixture
def copier(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A StagedCopier over the host-memory runtime, with small slots so a layer takes several pieces."""
    cuda = CudaRuntime.__new__(CudaRuntime)
    fake = HostCuda()
    cuda.lib, cuda.version, cuda.batch = fake.lib, 12040, None
    monkeypatch.setitem(sys.modules, "cupy", host_cupy(fake.trace))
    monkeypatch.setattr(staged, "SLOT_BYTES", 256 << 10)
    monkeypatch.setattr(staged, "CHUNK_BYTES", 64 << 10)
    engine = LocalEngine(timeout=30.0, cuda_method="loop")
    engine._cuda = cuda
    copier = staged.StagedCopier(engine, 0)
    copier.trace = fake.trace
    yield copier
    copier.close()
    engine._cuda = None
    engine.close()


def regions(block_size: int, layers: int, gpu_blocks: int, host_blocks: int, seed: int) -> tuple:
    """A 'GPU' region (host memory labelled cuda:0) with random bytes, and a zeroed host region; their buffers."""
    spec = make_spec(block_size, layers)
    gpu_buf = np.random.default_rng(seed).integers(0, 256, spec.cache_bytes(gpu_blocks), dtype=np.uint8)
    host_buf = np.zeros(spec.cache_bytes(host_blocks), dtype=np.uint8)
    gpu = KVRegion.from_buffer(spec, gpu_blocks, gpu_buf.ctypes.data, device="cuda:0", keep=(gpu_buf,))
    host = KVRegion.from_buffer(spec, host_blocks, host_buf.ctypes.data, keep=(host_buf,))
    return spec, gpu, host


def block_bytes(region: KVRegion, layer: int, tensor: int, block: int) -> bytes:
    size = int(region.block_bytes[tensor])
    return ctypes.string_at(int(region.addrs[layer, tensor] + block * region.block_strides[layer, tensor]), size)


@pytest.mark.parametrize("host_order", ["run", "scattered"])
@pytest.mark.parametrize("block_size", [16, 64])
def test_a_staged_offload_and_reload_move_every_block_byte_exact(copier, block_size, host_order) -> None:
    """Scattered GPU blocks offloaded to a run of host blocks (staged through slots) or to scattered host blocks (the
    kernel directly), then loaded back into other GPU blocks: every layer's handle ends DONE and every block's bytes
    arrive, through several slot-sized pieces per layer and the ring wrapping around."""
    layers, n = 6, 48
    spec, gpu, host = regions(block_size, layers, 4 * n, 3 * n, seed=block_size)
    rng = np.random.default_rng(7)
    gpu_ids = rng.permutation(4 * n)[:n].astype(np.int32)
    host_ids = np.arange(n, dtype=np.int32) + 5 if host_order == "run" else rng.permutation(3 * n)[:n].astype(np.int32)
    cells = np.zeros((layers, gpu.heads), dtype=np.int64)
    for round_ in range(2):  # a second copy reuses the slots, the range table and the staging buffers
        handles = copy_layers(copier.engine, gpu, gpu_ids[None, :], host, host_ids[None, :], cells, timeout=10.0,
                              staged=copier)
        assert [h.wait() for h in handles] == [TransferStatus.DONE] * layers
        back = rng.permutation(np.setdiff1d(np.arange(4 * n), gpu_ids))[:n].astype(np.int32)
        handles = copy_layers(copier.engine, host, host_ids[None, :], gpu, back[None, :], cells, timeout=10.0,
                              staged=copier)
        assert [h.wait() for h in handles] == [TransferStatus.DONE] * layers
        for layer in range(layers):
            for tensor in range(len(spec.tensors())):
                for g, h, b in zip(gpu_ids.tolist(), host_ids.tolist(), back.tolist()):
                    want = block_bytes(gpu, layer, tensor, g)
                    assert block_bytes(host, layer, tensor, h) == want, (round_, layer, tensor, g)
                    assert block_bytes(gpu, layer, tensor, b) == want, (round_, layer, tensor, g)
        gpu_ids = back
    kernels = [t for t in copier.trace if t[0] == "kernel"]
    dmas = [t for t in copier.trace if t[0] == "memcpy" and t[4] == staged._MEMCPY_DEFAULT]
    assert kernels, "the copy kernel ran"
    assert bool(dmas) == (host_order == "run"), "runs of host blocks go through slots and DMAs, scattered ones not"

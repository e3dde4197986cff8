"""LocalEngine on a GPU: device/host block swaps with every batched method, byte for byte, PyTorch caches standing in for Paddle's."""
from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvcache.allocator import CacheSpec  # noqa: E402
from kvcache.transfer import KVRegion, LocalEngine, TransferStatus  # noqa: E402
from kvcache.transfer.cuda import cupy_module  # noqa: E402
from kvcache.transfer.regions import copy_ranges  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

METHODS = ("batch", "kernel", "kernel_unrolled", "loop")
DIRECTIONS = ("device->host", "host->device", "device->device")
BLOCKS = 96


def make_spec(**overrides) -> CacheSpec:
    fields = dict(num_layers=3, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    fields.update(overrides)
    return CacheSpec(**fields)


def random_caches(spec: CacheSpec, device: str, seed: int, pinned: bool = False) -> list[list["torch.Tensor"]]:
    """Per layer, per spec tensor: random bytes viewed as the tensor's dtype, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
              "uint8": torch.uint8, "int8": torch.int8, "float8_e4m3fn": torch.uint8}
    out = []
    for _ in range(spec.num_layers):
        row = []
        for t in spec.tensors():
            raw = torch.randint(0, 256, (BLOCKS, t.bytes_per_block), dtype=torch.uint8, generator=g)
            tensor = raw.view(dtypes[t.dtype]).reshape(t.shape(BLOCKS))
            tensor = tensor.pin_memory() if pinned else tensor.to(device)
            row.append(tensor)
        out.append(row)
    return out


def expected(dst: list[list["torch.Tensor"]], src: list[list["torch.Tensor"]], src_ids: np.ndarray,
             dst_ids: np.ndarray, rows: np.ndarray | None = None, layers: tuple[int, ...] | None = None
             ) -> list[list["torch.Tensor"]]:
    """dst's bytes after the copy, by torch indexing of uint8 views on the CPU, pairs with a -1 skipped."""
    out = []
    for layer, (src_row, dst_row) in enumerate(zip(src, dst)):
        new = []
        for s, d in zip(src_row, dst_row):
            want = d.cpu().contiguous().view(torch.uint8).clone()
            if layers is not None and layer not in layers:
                new.append(want)
                continue
            have = s.cpu().contiguous().view(torch.uint8)
            if rows is None:
                keep = (src_ids >= 0) & (dst_ids >= 0)
                want[torch.from_numpy(dst_ids[keep]).long()] = have[torch.from_numpy(src_ids[keep]).long()]
            else:
                r = np.repeat(rows, src_ids.shape[1])
                si, di = src_ids.ravel(), dst_ids.ravel()
                keep = (si >= 0) & (di >= 0)
                rr = torch.from_numpy(r[keep]).long()
                want[torch.from_numpy(di[keep]).long(), rr] = have[torch.from_numpy(si[keep]).long(), rr]
            new.append(want)
        out.append(new)
    return out


def same_bytes(a: list[list["torch.Tensor"]], b: list[list["torch.Tensor"]]) -> bool:
    return all(torch.equal(x.cpu().contiguous().view(torch.uint8), y.cpu().contiguous().view(torch.uint8))
               for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def engine_for(method: str) -> LocalEngine:
    engine = LocalEngine(timeout=60.0, cuda_method=method)
    if method == "batch" and engine.cuda.batch is None:
        engine.close()
        pytest.skip(f"CUDA runtime {engine.cuda.version} has no cudaMemcpyBatchAsync")
    if method.startswith("kernel") and cupy_module() is None:
        engine.close()
        pytest.skip("the kernel method needs CuPy")
    return engine


def scattered(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(BLOCKS)[:n].astype(np.int32)


def test_the_engine_uses_the_processs_cuda_runtime():
    with LocalEngine() as engine:
        assert "cudart" in engine.cuda.path
        assert engine.resolved_cuda_method() in METHODS


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("method", METHODS)
def test_swap_of_scattered_blocks_is_byte_exact(method, direction):
    spec = make_spec()
    src_dev, dst_dev = direction.split("->")
    src = random_caches(spec, "cuda", 1, pinned=src_dev == "host")
    dst = random_caches(spec, "cuda", 2, pinned=dst_dev == "host")
    src_ids, dst_ids = scattered(3, 40), scattered(4, 40)
    src_ids[5] = -1
    want = expected(dst, src, src_ids, dst_ids)
    with engine_for(method) as engine:
        handle = engine.write(KVRegion.from_tensors(spec, src), src_ids, KVRegion.from_tensors(spec, dst), dst_ids)
        assert handle.wait() is TransferStatus.DONE, handle.error
    assert same_bytes(dst, want)


@pytest.mark.parametrize("geometry", [dict(block_size=48, head_dim=40), dict(block_size=3, head_dim=8, num_kv_heads=1,
                                                                              quant="int8")])
@pytest.mark.parametrize("method", ("kernel", "kernel_unrolled"))
def test_kernels_copy_ranges_of_any_length_and_alignment(method, geometry):
    """30,720-byte blocks (unrolled body plus tail) and 24-byte blocks (byte by byte), host to device."""
    spec = make_spec(**geometry)
    src = random_caches(spec, "cuda", 11, pinned=True)
    dst = random_caches(spec, "cuda", 12)
    src_ids, dst_ids = scattered(13, 50), scattered(14, 50)
    want = expected(dst, src, src_ids, dst_ids)
    with engine_for(method) as engine:
        handle = engine.write(KVRegion.from_tensors(spec, src), src_ids, KVRegion.from_tensors(spec, dst), dst_ids)
        assert handle.wait() is TransferStatus.DONE, handle.error
    assert same_bytes(dst, want)


@pytest.mark.parametrize("method", METHODS)
def test_parts_of_one_copy_finish_in_order_each_with_its_own_handle(method):
    """A layer-by-layer swap in one call: one part per layer, every byte where one write would put it."""
    spec = make_spec()
    src = random_caches(spec, "cuda", 21, pinned=True)
    dst = random_caches(spec, "cuda", 22)
    src_ids, dst_ids = scattered(23, 40), scattered(24, 40)
    want = expected(dst, src, src_ids, dst_ids)
    src_region, dst_region = KVRegion.from_tensors(spec, src), KVRegion.from_tensors(spec, dst)
    ranges = copy_ranges(src_region, src_ids, dst_region, dst_ids)
    cuts = np.linspace(0, ranges.num_ranges, spec.num_layers + 1).astype(np.int64)
    with engine_for(method) as engine:
        handles = engine.submit_parts(ranges, cuts, device="cuda:0")
        assert len(handles) == spec.num_layers
        assert handles[-1].wait() is TransferStatus.DONE, handles[-1].error
        assert all(h.done() for h in handles)  # one stream: the last part done means every part is
        assert [h.status() for h in handles] == [TransferStatus.DONE] * spec.num_layers
    assert same_bytes(dst, want)


@pytest.mark.parametrize("method", ("kernel", "kernel_unrolled"))
def test_range_tables_staged_in_a_few_recycled_pinned_buffers_copy_every_write_exactly(method, monkeypatch):
    """Many writes in a row, each with its own range table, through a ring held to 2 pinned buffers."""
    from kvcache.transfer import cuda

    monkeypatch.setattr(cuda.RangeTableStaging, "MAX_BUFFERS", 2)
    spec = make_spec()
    src = random_caches(spec, "cuda", 31, pinned=True)
    dst = random_caches(spec, "cuda", 32)
    src_region, dst_region = KVRegion.from_tensors(spec, src), KVRegion.from_tensors(spec, dst)
    want = dst
    with engine_for(method) as engine:
        handles = []
        for i in range(24):  # tables of growing size: buffers are outgrown and replaced while others are busy
            n = 1 + (i * 7) % (BLOCKS // 2)
            src_ids, dst_ids = scattered(100 + i, n), scattered(200 + i, n)
            want = expected(want, src, src_ids, dst_ids)
            handles.append(engine.write(src_region, src_ids, dst_region, dst_ids))
        assert [h.wait() for h in handles] == [TransferStatus.DONE] * 24
        assert len(engine._staging[0]._buffers) <= 2
    assert same_bytes(dst, want)


@pytest.mark.parametrize("method", ("batch", "kernel", "kernel_unrolled"))
def test_head_wise_swap_out_of_some_heads_in_some_layers(method):
    spec = make_spec()
    src = random_caches(spec, "cuda", 5)
    dst = random_caches(spec, "cuda", 6, pinned=True)
    rows = np.array([0, 3, 7])
    src_ids = np.stack([scattered(10 + r, 20) for r in rows])
    dst_ids = np.stack([scattered(20 + r, 20) for r in rows])
    want = expected(dst, src, src_ids, dst_ids, rows, layers=(0, 2))
    with engine_for(method) as engine:
        for layer in (0, 2):
            handle = engine.write(KVRegion.from_tensors(spec, src), src_ids, KVRegion.from_tensors(spec, dst),
                                  dst_ids, layers=[layer], rows=rows)
            assert handle.wait() is TransferStatus.DONE, handle.error
    assert same_bytes(dst, want)


def test_block_wise_fp8_scales_and_kv_swap_in_from_unpinned_numpy_which_the_engine_pins_and_unpins():
    spec = make_spec(quant="block_wise_fp8")
    raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32}  # numpy has no bfloat16: its bytes in a raw type
    host = [[t.view(raw[t.element_size()]).numpy() for t in row] for row in random_caches(spec, "cpu", 7)]
    gpu = random_caches(spec, "cuda", 8)
    host_t = [[torch.from_numpy(a) for a in row] for row in host]
    src_ids, dst_ids = scattered(9, 30), scattered(10, 30)
    want = expected(gpu, host_t, src_ids, dst_ids)
    region = KVRegion.from_tensors(spec, host)
    engine = LocalEngine(timeout=60.0)
    handle = engine.write(region, src_ids, KVRegion.from_tensors(spec, gpu), dst_ids)
    assert handle.wait() is TransferStatus.DONE, handle.error
    assert same_bytes(gpu, want)
    addr = int(region.extents().addr[0])
    assert engine.cuda.is_pinned(addr)
    engine.close()
    assert not engine.cuda.is_pinned(addr)


def test_a_swap_past_its_deadline_times_out_by_then_and_the_engine_keeps_working():
    spec = make_spec(num_layers=8, block_size=64)
    blocks = 512
    gpu = [[torch.empty(t.shape(blocks), dtype=torch.bfloat16, device="cuda") for t in spec.tensors()]
           for _ in range(spec.num_layers)]
    host = [[torch.empty(t.shape(blocks), dtype=torch.bfloat16, pin_memory=True) for t in spec.tensors()]
            for _ in range(spec.num_layers)]
    ids = np.arange(blocks)
    with LocalEngine() as engine:
        a, b = KVRegion.from_tensors(spec, gpu), KVRegion.from_tensors(spec, host)
        handle = engine.write(a, ids, b, ids[::-1], timeout=0.0005)
        start = time.monotonic()
        status = handle.wait()
        assert time.monotonic() - start < 0.2
        assert status in (TransferStatus.TIMEOUT, TransferStatus.DONE)
        assert engine.write(a, ids[:4], b, ids[:4]).wait() is TransferStatus.DONE

"""KVRegion: a worker's registered KV-cache memory, and the byte ranges that a list of blocks occupies.

A region records, for every layer and every tensor the CacheSpec lists (key, value, scales,
latent), the base address and the block stride of that tensor on one device. Registration
reads framework tensors through DLPack, ``__cuda_array_interface__``, ``__array_interface__``
or ``data_ptr()`` (NumPy, Paddle, PyTorch, CuPy alike) and checks each against the spec; raw
addresses work too (memory that an engine allocated itself, or a peer's region described over
the wire). Below the block dimension every tensor must be C-contiguous, as the spec's layout
is; the block stride may be larger than a block (key and value as views of one joint tensor).

What moves for a block list, per layer and tensor, with ``[blocks, heads, block_size, dim]``::

    whole blocks (rows=None, 1-D ids):  | block 3 |  | block 7 | block 8 |   -> 2 ranges (7, 8 merge)
    head-wise (rows, ids per row):      one range per (block, head): head h of block b is
                                        contiguous, its neighbours in the block belong to other heads

Ranges that touch are merged (vectorised over blocks, rows, layers and tensors at once; no
Python step per block), so a request whose ids are consecutive moves in one range per tensor.
"""
from __future__ import annotations

import ctypes
import dataclasses
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.layout import DTYPE_BYTES, CacheSpec, TensorSpec
from kvcache.allocator.rows import Row, layer_classes, rows_blocks
from kvcache.transfer import _ranges

__all__ = ["ByteRanges", "CopyRanges", "KVRegion", "TensorInfo", "copy_ranges", "describe_tensor"]

_ADDR_MAX = (1 << 63) - 1
_FLOAT_NAMES = {"bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"}
# Storage types that say nothing about the values: a spec dtype of the same width may live in them.
_RAW_NAMES = {1: {"uint8", "int8", "bool"}, 2: {"uint16", "int16"}, 4: {"uint32", "int32"}}


class ByteRanges(NamedTuple):
    """Disjoint byte ranges in one address space, ascending within each (layer, tensor)."""

    addr: np.ndarray
    """int64 [n]: first byte of each range."""
    length: np.ndarray
    """int64 [n]: bytes in each range."""

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    @classmethod
    def union(cls, parts: Iterable[ByteRanges]) -> ByteRanges:
        """The bytes any of ``parts`` holds, as ascending disjoint ranges (overlapping or touching ones merged)."""
        parts = list(parts)
        if not parts:
            return cls(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
        lo = np.concatenate([p.addr for p in parts]).astype(np.int64)
        hi = lo + np.concatenate([p.length for p in parts]).astype(np.int64)
        order = np.argsort(lo, kind="stable")
        lo, hi = lo[order], np.maximum.accumulate(hi[order])
        start = np.flatnonzero(np.concatenate(([True], lo[1:] > hi[:-1])))
        ends = np.append(hi[start[1:] - 1], hi[-1])
        return cls(lo[start], ends - lo[start])

    def covers(self, addr: np.ndarray, length: np.ndarray) -> np.ndarray:
        """bool [n]: whether each range ``[addr, addr + length)`` lies whole inside one of these ranges.

        These ranges must be ascending and disjoint (``union`` makes them so); a negative length is never covered.
        """
        addr, length = np.asarray(addr, dtype=np.int64), np.asarray(length, dtype=np.int64)
        i = np.searchsorted(self.addr, addr, side="right") - 1  # the last range starting at or before each addr
        if not self.addr.size:
            return np.zeros(addr.shape, dtype=bool)
        j = np.maximum(i, 0)
        end = self.addr[j] + self.length[j]
        return (i >= 0) & (length >= 0) & (addr >= self.addr[j]) & (length <= end - addr)


class CopyRanges(NamedTuple):
    """Paired ranges of a copy: ``length[i]`` bytes from ``src[i]`` to ``dst[i]``; destinations never overlap."""

    src: np.ndarray
    """int64 [n]: source addresses."""
    dst: np.ndarray
    """int64 [n]: destination addresses."""
    length: np.ndarray
    """int64 [n]: bytes of each range."""

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    @property
    def num_ranges(self) -> int:
        return int(self.length.size)

    def select(self, index: Any) -> CopyRanges:
        """The ranges at ``index`` (a slice, an index array or a mask), in that order."""
        return CopyRanges(self.src[index], self.dst[index], self.length[index])

    @classmethod
    def concat(cls, parts: Sequence[CopyRanges]) -> CopyRanges:
        """Several copies as one, their ranges in the parts' order."""
        if not parts:
            return cls(*(np.empty(0, dtype=np.int64) for _ in cls._fields))
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in cls._fields))

    @classmethod
    def joined(cls, parts: Sequence[CopyRanges]) -> CopyRanges:
        """Several copies as one: a single part as it is; more in source order, neighbours merged where both sides continue."""
        if len(parts) == 1:
            return parts[0]
        src, dst, length = cls.concat(parts)
        order = np.argsort(src, kind="stable")
        (src, dst), length = _merge((src[order], dst[order]), length[order])
        return cls(src, dst, length)


class TensorInfo(NamedTuple):
    """What registration needs to know of one framework tensor: where it is and how it is laid out."""

    addr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    """Bytes between neighbours along each dimension."""
    itemsize: int
    dtype: str | None
    """Our dtype name (``bfloat16``, ``uint8``, ...), None when the producer's type is unknown to us."""
    device: str
    """``cpu`` or ``cuda:N``."""
    pinned: bool
    """Page-locked host memory (CUDA host allocations), which GPU copies can read and write directly."""


# --------------------------------------------------------------------------- tensor introspection


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13
# DLPack (code, bits) -> our dtype name; float8 codes are DLPack 1.1's.
_DL_DTYPES = {
    (0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
    (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
    (2, 16): "float16", (2, 32): "float32", (2, 64): "float64",
    (4, 16): "bfloat16", (6, 8): "bool", (10, 8): "float8_e4m3fn", (12, 8): "float8_e5m2",
}
_TYPESTR = {"i": "int", "u": "uint", "f": "float", "b": "bool"}


def _dtype_name(text: str) -> str | None:
    """Our name for a framework's dtype spelling ('torch.bfloat16', 'paddle.float8_e4m3fn', 'uint8')."""
    name = str(text).lower().rsplit(".", 1)[-1]
    known = set(DTYPE_BYTES) | _FLOAT_NAMES | {n for names in _RAW_NAMES.values() for n in names} | {"int64", "uint64"}
    return name if name in known else None


def _contiguous_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _from_dlpack(obj: Any) -> TensorInfo:
    capsule = obj.__dlpack__()
    pointer = _capsule_pointer(capsule, b"dltensor")
    t = ctypes.cast(pointer, ctypes.POINTER(_DLTensor)).contents
    ndim, itemsize = t.ndim, max(1, t.dtype.bits // 8) * t.dtype.lanes
    shape = tuple(t.shape[i] for i in range(ndim))
    strides = (tuple(t.strides[i] * itemsize for i in range(ndim)) if t.strides
               else _contiguous_strides(shape, itemsize))
    kind = t.device.device_type
    if kind not in (_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED):
        raise TypeError(f"DLPack device type {kind} is neither host nor CUDA memory")
    device = f"cuda:{t.device.device_id}" if kind in (_DL_CUDA, _DL_CUDA_MANAGED) else "cpu"
    dtype = _DL_DTYPES.get((t.dtype.code, t.dtype.bits)) if t.dtype.lanes == 1 else None
    addr = (t.data or 0) + t.byte_offset
    return TensorInfo(addr, shape, strides, itemsize, dtype, device, kind == _DL_CUDA_HOST)


def _from_array_interface(obj: Any, cuda: bool) -> TensorInfo:
    face = obj.__cuda_array_interface__ if cuda else obj.__array_interface__
    if face.get("mask") is not None:
        raise TypeError("masked arrays cannot be registered")
    typestr = face["typestr"]
    itemsize = int(typestr[2:])
    kind = _TYPESTR.get(typestr[1])
    dtype = None if kind is None else "bool" if kind == "bool" else _dtype_name(f"{kind}{itemsize * 8}")
    shape = tuple(int(s) for s in face["shape"])
    strides = tuple(face["strides"]) if face.get("strides") else _contiguous_strides(shape, itemsize)
    addr = int(face["data"][0] or 0)
    device = f"cuda:{_cuda_index(obj)}" if cuda else "cpu"
    return TensorInfo(addr, shape, strides, itemsize, dtype, device, False)


def _cuda_index(obj: Any) -> int:
    """The CUDA device of an array-interface tensor: PyTorch's ``device.index``, CuPy's ``device.id``. The
    interface itself names no device, and a wrong guess sends its copies to another GPU, so none is guessed."""
    dev = getattr(obj, "device", None)
    for name in ("index", "id"):
        index = getattr(dev, name, None)
        if isinstance(index, int) and not isinstance(index, bool):
            return index
    raise TypeError(f"its CUDA device cannot be read (device {dev!r})")


def _from_data_ptr(obj: Any) -> TensorInfo:
    """PyTorch- and Paddle-like tensors: data_ptr(), shape, stride()/strides (elements), element_size()."""
    itemsize = int(obj.element_size())
    shape = tuple(int(s) for s in obj.shape)
    stride = obj.stride() if callable(getattr(obj, "stride", None)) else getattr(obj, "strides", None)
    strides = (tuple(int(s) * itemsize for s in stride) if stride is not None
               else _contiguous_strides(shape, itemsize))
    device = "cpu"
    place = getattr(obj, "device", None) or getattr(obj, "place", None)
    text = str(place).lower()
    if "pinned" in text:  # Paddle's CUDAPinnedPlace: page-locked host memory
        return TensorInfo(int(obj.data_ptr()), shape, strides, itemsize, _dtype_name(str(obj.dtype)), "cpu", True)
    if "cuda" in text or "gpu" in text:
        digits = "".join(c for c in text.split(":")[-1] if c.isdigit()) if ":" in text else ""
        if not digits:
            raise TypeError(f"its CUDA device cannot be read (device {place!r})")
        device = f"cuda:{int(digits)}"
    pinned = bool(getattr(obj, "is_pinned", lambda: False)()) if device == "cpu" else False
    return TensorInfo(int(obj.data_ptr()), shape, strides, itemsize, _dtype_name(str(obj.dtype)), device, pinned)


def describe_tensor(obj: Any) -> TensorInfo:
    """Address, shape, byte strides, dtype and device of any framework tensor; TypeError if none can be read.

    Tries DLPack first (NumPy, PyTorch, Paddle, CuPy, JAX), then the CUDA and NumPy array
    interfaces, then ``data_ptr()``: the first that answers wins, so nothing assumes one framework.
    """
    errors = []
    readers: list[tuple[str, Any]] = []
    if hasattr(obj, "__dlpack__"):
        readers.append(("__dlpack__", _from_dlpack))
    if hasattr(obj, "__cuda_array_interface__"):
        readers.append(("__cuda_array_interface__", lambda o: _from_array_interface(o, cuda=True)))
    if hasattr(obj, "__array_interface__"):
        readers.append(("__array_interface__", lambda o: _from_array_interface(o, cuda=False)))
    if callable(getattr(obj, "data_ptr", None)):
        readers.append(("data_ptr()", _from_data_ptr))
    for name, read in readers:
        try:
            return read(obj)
        except Exception as exc:  # a producer refusing one protocol (read-only, exotic dtype) may accept the next
            errors.append(f"{name}: {exc}")
    why = "; ".join(errors) if errors else "it has no __dlpack__, array interface or data_ptr()"
    raise TypeError(f"cannot read the memory of a {type(obj).__qualname__}: {why}")


def _pinned_by_torch(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and isinstance(obj, torch.Tensor) and not obj.is_cuda and obj.is_pinned())


# --------------------------------------------------------------------------- the region


def _layer_ids(layers: int | Sequence[int] | slice | np.ndarray | None, num_layers: int) -> np.ndarray:
    """Layer selection as int64 indices, each checked to be in range."""
    if layers is None:
        return np.arange(num_layers, dtype=np.int64)
    if isinstance(layers, slice):
        return np.arange(num_layers, dtype=np.int64)[layers]
    arr = np.atleast_1d(np.asarray(layers))
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise KVCacheError(f"layers must be an int, a slice or a 1-D list of ints, got {layers!r}")
    arr = arr.astype(np.int64)
    bad = (arr < 0) | (arr >= num_layers)
    if bad.any():
        raise KVCacheError(f"layers: {int(arr[bad][0])} is out of range for {num_layers} layers")
    return arr


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class KVRegion:
    """One worker's KV cache on one device: every (layer, tensor)'s base address and block stride.

    ``addrs`` and ``block_strides`` are int64 ``[num_layers, len(spec.tensors())]``. ``owner``
    is ``""`` for memory of this process, or the agent name of the peer whose address space the
    addresses belong to. ``keep`` holds the framework tensors so the memory outlives the region.
    ``layer_blocks`` (int64 ``[num_layers]``) gives each layer's block count where rows of layer
    groups have pools of their own (a sliding-window group's layers hold fewer blocks); ``num_blocks``
    is the most of them, and by default every layer's.
    """

    spec: CacheSpec
    num_blocks: int
    device: str
    addrs: np.ndarray
    block_strides: np.ndarray
    pinned: bool = False
    owner: str = ""
    keep: tuple = ()
    layer_blocks: np.ndarray = None  # type: ignore[assignment]  # set in __post_init__ when not given

    def __post_init__(self) -> None:
        if self.layer_blocks is None:
            object.__setattr__(self, "layer_blocks", np.full(self.spec.num_layers, self.num_blocks, dtype=np.int64))

    @property
    def tensors(self) -> tuple[TensorSpec, ...]:
        return self.spec.tensors()

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def heads(self) -> int:
        """kv heads per block on this rank: the rows a head-wise table addresses."""
        return self.tensors[0].block_shape[0]

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def device_index(self) -> int:
        return int(self.device.split(":")[1]) if self.is_cuda else 0

    @property
    def block_bytes(self) -> np.ndarray:
        """int64 [tensors]: bytes of one block of each tensor."""
        return np.array([t.bytes_per_block for t in self.tensors], dtype=np.int64)

    def spans(self) -> np.ndarray:
        """int64 [num_layers, tensors]: bytes from each tensor's first block to the end of its last."""
        return (self.layer_blocks[:, None] - 1) * self.block_strides + self.block_bytes[None, :]

    def extents(self) -> ByteRanges:
        """The memory the region spans, overlapping tensors merged: what an engine registers or pins."""
        lo, hi = self.addrs.ravel(), (self.addrs + self.spans()).ravel()
        order = np.argsort(lo, kind="stable")
        lo, hi = lo[order], np.maximum.accumulate(hi[order])
        start = np.flatnonzero(np.concatenate(([True], lo[1:] > hi[:-1])))
        ends = np.append(hi[start[1:] - 1], hi[-1])
        return ByteRanges(lo[start], ends - lo[start])

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_tensors(cls, spec: CacheSpec, caches: Sequence[Any] | Mapping[str, Any], *,
                     device: str | None = None) -> KVRegion:
        """Register framework tensors, checked against ``spec``: clear errors name the layer and tensor.

        ``caches`` is either one entry per layer (a mapping tensor name -> tensor, a sequence in
        ``spec.tensors()`` order, or the tensor itself when the spec has one, as MLA does), or a
        mapping tensor name -> per-layer tensors (a list, or one tensor stacked
        ``[num_layers, num_blocks, ...]``), the way engines keep ``key_caches``/``value_caches``.
        """
        names = [t.name for t in spec.tensors()]
        grid = _tensor_grid(spec, caches, names)
        infos = [[_describe(obj, spec.tensors()[t], layer) for t, obj in enumerate(row)] for layer, row in enumerate(grid)]
        layer_blocks = np.array([row[0].shape[0] if row[0].shape else 0 for row in infos], dtype=np.int64)
        devices = {info.device for row in infos for info in row}
        if len(devices) != 1:
            raise KVCacheError(f"cache tensors live on several devices ({', '.join(sorted(devices))}); "
                               "a region is one device")
        found = devices.pop()
        if device is not None and device != found:
            raise KVCacheError(f"device: the tensors are on {found}, not {device}")
        addrs = np.zeros((spec.num_layers, len(names)), dtype=np.int64)
        strides = np.zeros_like(addrs)
        for layer, row in enumerate(infos):
            num_blocks = int(layer_blocks[layer])
            for t, info in enumerate(row):
                _check_tensor(info, spec.tensors()[t], layer, num_blocks)
                addrs[layer, t] = info.addr
                strides[layer, t] = info.strides[0] if num_blocks > 1 else spec.tensors()[t].bytes_per_block
        pinned = all(info.pinned for row in infos for info in row) or all(
            _pinned_by_torch(obj) for row in grid for obj in row)
        return cls(spec, int(layer_blocks.max()), found, addrs, strides, pinned and found == "cpu", "", tuple(
            obj for row in grid for obj in row), layer_blocks)

    @classmethod
    def from_addresses(cls, spec: CacheSpec, num_blocks: int | Sequence[int], addrs: Any, *, device: str = "cpu",
                       block_strides: Any = None, pinned: bool = False, owner: str = "", keep: tuple = ()) -> KVRegion:
        """A region over raw memory: ``addrs`` int [num_layers, tensors]; strides default to dense blocks.

        ``num_blocks`` is every layer's block count, or one count per layer. The caller vouches that the
        memory exists and stays alive; ``keep`` may hold its owners.
        """
        layer_blocks = _layer_blocks(num_blocks, spec.num_layers)
        tensors = spec.tensors()
        shape = (spec.num_layers, len(tensors))
        arr = np.asarray(addrs)
        if arr.shape != shape or (arr.size and arr.dtype.kind not in "iuO"):
            raise KVCacheError(f"addrs must be integers of shape {shape} (layers, tensors "
                               f"{', '.join(t.name for t in tensors)}), got shape {arr.shape}")
        bpb = np.array([t.bytes_per_block for t in tensors], dtype=np.int64)
        strides = np.broadcast_to(bpb, shape) if block_strides is None else np.asarray(block_strides)
        try:
            strides = np.broadcast_to(strides, shape).astype(np.int64)
        except ValueError:
            raise KVCacheError(f"block_strides must broadcast to {shape}, got shape {np.shape(block_strides)}") from None
        values = [int(a) for a in arr.ravel()]
        if any(a <= 0 or a > _ADDR_MAX for a in values):
            raise KVCacheError("addrs: every address must be a positive 63-bit integer")
        if ((strides < bpb[None, :]) & (layer_blocks[:, None] > 1)).any():
            layer, t = (int(i) for i in np.argwhere((strides < bpb[None, :]) & (layer_blocks[:, None] > 1))[0])
            raise KVCacheError(f"layer {layer} tensor {tensors[t].name!r}: block stride {strides[layer, t]} is "
                               f"smaller than a block ({bpb[t]} bytes): blocks would overlap")
        _check_device(device)
        return cls(spec, int(layer_blocks.max()), device, np.array(values, dtype=np.int64).reshape(shape), strides,
                   pinned, owner, keep, layer_blocks)

    @classmethod
    def from_buffer(cls, spec: CacheSpec, num_blocks: int | Sequence[int], addr: int, *, device: str = "cpu",
                    pinned: bool = False, keep: tuple = ()) -> KVRegion:
        """A region over one buffer of ``buffer_bytes(spec, num_blocks)`` at ``addr``: layer-major, then tensor, then
        block; ``num_blocks`` is every layer's block count, or one per layer."""
        layer_blocks = _layer_blocks(num_blocks, spec.num_layers)
        sizes = [t.nbytes(int(n)) for n in layer_blocks for t in spec.tensors()]
        offsets = np.cumsum([0] + sizes)[:-1].reshape(spec.num_layers, len(spec.tensors()))
        return cls.from_addresses(spec, layer_blocks.tolist(), int(addr) + offsets, device=device, pinned=pinned,
                                  keep=keep)

    # ----------------------------------------------------------------- wire form

    def describe(self) -> dict[str, Any]:
        """A msgpack/JSON-ready description a peer turns back into a region with ``from_description``."""
        spec = self.spec.describe()
        spec.pop("kv_heads_per_rank")
        return {
            "spec": spec,
            "num_blocks": self.num_blocks,
            "layer_blocks": self.layer_blocks.tolist(),
            "device": self.device,
            "pinned": self.pinned,
            "addrs": self.addrs.tolist(),
            "block_strides": self.block_strides.tolist(),
        }

    @classmethod
    def from_description(cls, description: Mapping[str, Any], owner: str) -> KVRegion:
        """The region a peer described, its addresses in that peer's (``owner``'s) address space."""
        try:
            fields = dict(description["spec"])
            if fields.get("rows") is not None:
                fields["rows"] = tuple(Row.from_description(r, f"spec.rows[{i}]") for i, r in enumerate(fields["rows"]))
            spec = CacheSpec(**fields)
            return cls.from_addresses(spec, description.get("layer_blocks", description["num_blocks"]),
                                      description["addrs"],
                                      device=description["device"], block_strides=description["block_strides"],
                                      pinned=bool(description.get("pinned", False)), owner=owner)
        except (KeyError, TypeError) as exc:
            raise KVCacheError(f"region description from {owner!r} is malformed: {exc}") from None

    # ----------------------------------------------------------------- byte ranges

    def ranges(self, blocks: Any, rows: Any = None, layers: Any = None) -> ByteRanges:
        """The merged byte ranges holding ``blocks`` (and ``rows``) in ``layers``; ``-1`` ids are skipped.

        ``blocks`` is 1-D (whole blocks; with ``rows``, only those heads of each block) or
        2-D ``[len(rows), n]``: a head-wise table, row ``i`` giving the block ids of head
        ``rows[i]`` (default: every head of this rank, in order). Duplicates count once.
        """
        block, row, per_row = _units(self, blocks, rows, "blocks")
        keep = block >= 0
        width = self.heads if per_row else 1
        key = np.unique(block[keep] * width + row[keep])
        addr, length = _addresses(self, key // width, key % width, per_row, _layer_ids(layers, self.num_layers))
        (addr,), length = _merge((addr,), length)
        return ByteRanges(addr, length)


def copy_ranges(src: KVRegion, src_blocks: Any, dst: KVRegion, dst_blocks: Any,
                layers: Any = None, rows: Any = None, cell_rows: Any = None) -> CopyRanges:
    """Merged (src, dst, length) ranges that copy ``src_blocks`` of ``src`` onto ``dst_blocks`` of ``dst``.

    Both block arrays have one shape (see ``KVRegion.ranges``); position ``i`` of one pairs with
    position ``i`` of the other. A pair where either id is ``-1`` moves nothing (a recycled
    sliding-window block, or one the receiver does not need). Two pairs writing the same
    destination block (and head) are an error; the same source may go to several destinations.
    Ranges are merged where both sides continue, so consecutive ids on both sides move as one.

    ``cell_rows`` (int ``[num_layers, heads]``) reads both block arrays as tables ``[rows, n]`` whose
    rows are layer groups (or groups and heads): layer l's head h moves the blocks of row
    ``cell_rows[l, h]`` (``TableSubscriber.cell_rows``, ``kvcache.allocator.rows.cell_rows``).
    """
    return CopyRanges.concat([_pair_ranges(src, dst, pairs, group) for group, pairs in
                              _row_pairs(src, src_blocks, dst, dst_blocks, rows, cell_rows, layers)])


def copy_ranges_by_layers(src: KVRegion, src_blocks: Any, dst: KVRegion, dst_blocks: Any,
                          groups: Iterable[Any], rows: Any = None, cell_rows: Any = None) -> Iterator[CopyRanges]:
    """``copy_ranges`` of each layer selection in ``groups`` in turn, the block pairs checked and sorted once.

    Lazy: a group's ranges are computed when the caller asks for them, so the caller can start
    copying one group while the next is worked out. The pairs are checked before the first yield.
    """
    classes = _row_pairs(src, src_blocks, dst, dst_blocks, rows, cell_rows, None)

    def each() -> Iterator[CopyRanges]:
        for layers in groups:
            wanted = _layer_ids(layers, src.num_layers)
            yield CopyRanges.concat([_pair_ranges(src, dst, pairs, wanted[np.isin(wanted, group)])
                                     for group, pairs in classes])

    return each()


def copy_ranges_per_layer(src: KVRegion, src_blocks: Any, dst: KVRegion, dst_blocks: Any, bounds: Sequence[int],
                          cell_rows: Any = None) -> Iterator[tuple[CopyRanges, np.ndarray]]:
    """For each group of layers ``[bounds[i], bounds[i + 1])``, its layers' ``copy_ranges`` in layer order and where
    each layer's begin (int64 ``[layers + 1]``, from 0).

    A range never crosses a layer, so each layer's part can go on its own; one C pass over
    (layer, tensor, pair) works a group out. Lazy, like ``copy_ranges_by_layers``: a caller copies
    one group while the next is worked out; the pairs are checked before the first yield.
    """
    classes = _row_pairs(src, src_blocks, dst, dst_blocks, None, cell_rows, None)
    edges = [int(b) for b in bounds]
    if edges[0] != 0 or edges[-1] != src.num_layers or any(b <= a for a, b in zip(edges, edges[1:])):
        raise KVCacheError(f"bounds: need rising layer indices from 0 to {src.num_layers}, got {edges}")

    def each() -> Iterator[tuple[CopyRanges, np.ndarray]]:
        if len(classes) == 1:  # every layer reads the same rows: in order already
            ranges = _LayerRanges(src, dst, classes[0][1])
            for a, b in zip(edges, edges[1:]):
                yield ranges.between(a, b)
            return
        each_class = [(group, _LayerRanges(src, dst, pairs)) for group, pairs in classes]
        for a, b in zip(edges, edges[1:]):
            parts, layer = [], []
            for group, ranges_of in each_class:
                mine = group[(group >= a) & (group < b)]
                if mine.size:
                    ranges, cuts = ranges_of.layers(mine)
                    parts.append(ranges)
                    layer.append(np.repeat(mine, np.diff(cuts)))
            order = np.argsort(np.concatenate(layer), kind="stable")
            yield (CopyRanges.concat(parts).select(order),
                   np.searchsorted(np.concatenate(layer)[order], np.arange(a, b + 1)).astype(np.int64))

    return each()


class _LayerRanges:
    """One class of pairs' ranges (``_pair_ranges``, merged within each layer only, in C) for the layers that read
    them, and where each layer's ranges begin: what does not depend on the layers (flat addresses, units, the
    highest block ids) is worked out once."""

    def __init__(self, src: KVRegion, dst: KVRegion, pairs: _Pairs) -> None:
        assert pairs.src_row is pairs.dst_row or np.array_equal(pairs.src_row, pairs.dst_row), \
            "a pair moves one head to the same head"
        # Python lists and no ufunc: the submit thread meets this path with cold caches, where numpy's first
        # reduction costs tens of µs
        self.src, self.dst, self.tensors = src, dst, src.addrs.shape[1]
        self.unit = _spec_units(src.spec)[2 if pairs.per_row else 1]
        self.flat = [np.ascontiguousarray(x, dtype=np.int64).reshape(-1) for x in (src.addrs, src.block_strides,
                                                                                   dst.addrs, dst.block_strides)]
        self.pairs = [np.ascontiguousarray(x, dtype=np.int64) for x in (pairs.src_block, pairs.dst_block,
                                                                        pairs.src_row)]
        self.top = (pairs.src_top, pairs.dst_top)
        self.limits = (src.layer_blocks.tolist(), dst.layer_blocks.tolist())

    def between(self, a: int, b: int) -> tuple[CopyRanges, np.ndarray]:
        """The ranges of layers ``[a, b)``."""
        t = self.tensors
        return self._ranges(range(a, b), slice(a * t, b * t))

    def layers(self, layers: np.ndarray) -> tuple[CopyRanges, np.ndarray]:
        """The ranges of ``layers`` (int64, ascending)."""
        t = self.tensors
        return self._ranges(layers.tolist(), (layers[:, None] * t + np.arange(t)).ravel())

    def _ranges(self, layers: Sequence[int], part: slice | np.ndarray) -> tuple[CopyRanges, np.ndarray]:
        """The ranges of ``layers``, whose (layer, tensor) entries of the flat arrays ``part`` selects; raises if a
        block id is past a (windowed) layer's blocks, naming the first such layer."""
        for region, top, limits in zip((self.src, self.dst), self.top, self.limits):
            held = [limits[layer] for layer in layers]
            if top >= 0 and top >= min(held):
                _short_layer(region, top, layers[next(i for i, n in enumerate(held) if n <= top)])
        unit = self.unit[part]
        out = np.empty((3, unit.size * self.pairs[0].size), dtype=np.int64)
        starts = np.empty(len(layers) + 1, dtype=np.int64)
        n = _ranges.pair_ranges(*(x[part] for x in self.flat), unit, unit, *self.pairs, self.tensors, out[0], out[1],
                                out[2], starts)
        return CopyRanges(out[0, :n], out[1, :n], out[2, :n]), starts


_SPEC_UNITS: dict[int, tuple[CacheSpec, int, np.ndarray, np.ndarray]] = {}


def _spec_units(spec: CacheSpec) -> tuple[int, np.ndarray, np.ndarray]:
    """``spec``'s kv heads per block, and int64 [num_layers * tensors] (layer-major) bytes of one unit of each
    (layer, tensor): a whole block, and one head of it. Read-only arrays, worked out once per spec object: found by
    identity, as hashing a spec (every field) costs more on the submit thread's cold path than the rest."""
    hit = _SPEC_UNITS.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1], hit[2], hit[3]
    tensors = spec.tensors()
    heads = tensors[0].block_shape[0]
    units = [np.array([t.bytes_per_block // width for t in tensors] * spec.num_layers, dtype=np.int64)
             for width in (1, heads)]
    for unit in units:
        unit.flags.writeable = False
    if len(_SPEC_UNITS) >= 64:  # a process holds a few specs; this only bounds a long test run
        _SPEC_UNITS.pop(next(iter(_SPEC_UNITS)))
    _SPEC_UNITS[id(spec)] = (spec, heads, units[0], units[1])  # holding the spec keeps its id from being reused
    return heads, units[0], units[1]


def _row_pairs(src: KVRegion, src_blocks: Any, dst: KVRegion, dst_blocks: Any, rows: Any, cell_rows: Any,
               layers: Any) -> list[tuple[np.ndarray, _Pairs]]:
    """The checked pairs of each class of layers that read the same table rows, with the class's (selected) layers."""
    selected = _layer_ids(layers, src.num_layers)
    if cell_rows is None:
        return [(selected, _copy_pairs(src, src_blocks, dst, dst_blocks, rows))]
    if rows is not None:
        raise KVCacheError("rows: give either rows (heads of a head-wise table) or cell_rows, not both")
    cells = np.asarray(cell_rows)
    heads = _spec_units(src.spec)[0]  # src.heads
    if cells.shape != (src.num_layers, heads) or (cells.size and cells.dtype.kind not in "iu"):
        raise KVCacheError(f"cell_rows: must be integers [{src.num_layers} layers, {heads} kv heads], "
                           f"got shape {cells.shape}")
    tables = []
    for name, blocks in (("src_blocks", src_blocks), ("dst_blocks", dst_blocks)):
        arr = np.asarray(blocks)
        if arr.ndim != 2:
            raise KVCacheError(f"{name}: with cell_rows, a table [rows, n]; got shape {arr.shape}")
        tables.append(arr)
    if tables[0].shape != tables[1].shape:
        raise KVCacheError(f"src_blocks {tables[0].shape} and dst_blocks {tables[1].shape}: tables pair up one to one")
    # Every layer reads the same rows (one class) when each layer's row of bytes repeats the first: no ufunc, which
    # the submit thread meets with cold caches (tens of µs for numpy's first reduction there)
    raw = cells.tobytes()
    same = cells.size > 0 and raw == raw[: len(raw) // cells.shape[0]] * cells.shape[0]
    row = cells[0].tolist() if same else None
    if cells.size and ((min(row) < 0 or max(row) >= tables[0].shape[0]) if same else
                       (cells.min() < 0 or cells.max() >= tables[0].shape[0])):
        raise KVCacheError(f"cell_rows: names a row outside the tables' {tables[0].shape[0]} rows")
    classes = {tuple(row): selected} if same and selected.size else layer_classes(cells, selected.tolist())
    return [(np.array(group, dtype=np.int64),
             _copy_pairs(src, rows_blocks(tables[0], picks), dst, rows_blocks(tables[1], picks), None))
            for picks, group in classes.items()]


class _Pairs(NamedTuple):
    """A copy's (block, row) units on both sides, checked and in source order."""

    src_block: np.ndarray
    src_row: np.ndarray
    dst_block: np.ndarray
    dst_row: np.ndarray
    per_row: bool
    src_top: int
    """The highest source block id (-1: no pairs)."""
    dst_top: int
    """The highest destination block id (-1: no pairs)."""


def _copy_pairs(src: KVRegion, src_blocks: Any, dst: KVRegion, dst_blocks: Any, rows: Any) -> _Pairs:
    """``copy_ranges``'s checks and pairing, which do not depend on the layers: one C pass (``_ranges.copy_pairs``)
    where both sides are whole blocks (1-D ids), else after ``_units``; where C refuses, ``_numpy_copy_pairs`` raises
    the error naming what is wrong. The pairs are those ``_numpy_copy_pairs`` makes."""
    _check_compatible(src, dst)
    sb, db = np.asarray(src_blocks), np.asarray(dst_blocks)
    sr = dr = None
    per_row = not (rows is None and sb.ndim == 1 and db.ndim == 1 and sb.dtype.kind in "iu" and db.dtype.kind in "iu")
    if per_row:
        sb, sr, per_row = _units(src, src_blocks, rows, "src_blocks")
        db, dr, _ = _units(dst, dst_blocks, rows, "dst_blocks")
    out = np.empty((4, sb.size), dtype=np.int64)
    got = _ranges.copy_pairs(np.ascontiguousarray(sb, dtype=np.int64), sr, np.ascontiguousarray(db, dtype=np.int64),
                             dr, src.heads if per_row else 1, src.num_blocks, dst.num_blocks, *out)
    if got is None:
        _numpy_copy_pairs(src, src_blocks, dst, dst_blocks, rows)
        raise AssertionError("_ranges.copy_pairs refused pairs that the numpy checks accept")
    n, src_top, dst_top = got
    row = out[1, :n]
    return _Pairs(out[0, :n], row, out[2, :n], out[3, :n] if per_row else row, per_row, src_top, dst_top)


def _numpy_copy_pairs(src: KVRegion, src_blocks: Any, dst: KVRegion, dst_blocks: Any, rows: Any) -> _Pairs:
    """``_copy_pairs`` in numpy: the reference the C pass is tested against, and the errors it names."""
    _check_compatible(src, dst)
    sb, sr, per_row = _units(src, src_blocks, rows, "src_blocks")
    db, dr, _ = _units(dst, dst_blocks, rows, "dst_blocks")
    if sb.shape != db.shape:
        raise KVCacheError(f"src_blocks has {np.shape(src_blocks)} ids but dst_blocks has {np.shape(dst_blocks)}; "
                           "they pair up one to one")
    keep = (sb >= 0) & (db >= 0)
    sb, sr, db, dr = sb[keep], sr[keep], db[keep], dr[keep]
    width = src.heads if per_row else 1
    dkey = db * width + dr
    if np.unique(dkey).size != dkey.size:
        values, counts = np.unique(dkey, return_counts=True)
        dup = int(values[counts > 1][0])
        where = f"block {dup // width}" + (f" head {dup % width}" if per_row else "")
        raise KVCacheError(f"dst_blocks: {where} is written twice in one copy")
    order = np.argsort(sb * width + sr, kind="stable")
    return _Pairs(sb[order], sr[order], db[order], dr[order], per_row, int(sb.max()) if sb.size else -1,
                  int(db.max()) if db.size else -1)


def _pair_ranges(src: KVRegion, dst: KVRegion, pairs: _Pairs, layers: Any) -> CopyRanges:
    """The merged ranges of ``pairs`` in the selected layers."""
    layer_ids = _layer_ids(layers, src.num_layers)
    s_addr, length = _addresses(src, pairs.src_block, pairs.src_row, pairs.per_row, layer_ids)
    d_addr, _ = _addresses(dst, pairs.dst_block, pairs.dst_row, pairs.per_row, layer_ids)
    (s_addr, d_addr), length = _merge((s_addr, d_addr), length)
    return CopyRanges(s_addr, d_addr, length)


# --------------------------------------------------------------------------- helpers


def buffer_bytes(spec: CacheSpec, num_blocks: int | Sequence[int]) -> int:
    """Bytes of one buffer holding every layer's tensors at ``num_blocks`` (a count, or one per layer)."""
    return sum(t.nbytes(int(n)) for n in _layer_blocks(num_blocks, spec.num_layers) for t in spec.tensors())


def _layer_blocks(num_blocks: int | Sequence[int], num_layers: int) -> np.ndarray:
    """int64 [num_layers]: a count for every layer, or one per layer; each at least 1."""
    if isinstance(num_blocks, (int, np.integer)) and not isinstance(num_blocks, bool):
        counts = np.full(num_layers, int(num_blocks), dtype=np.int64)
    else:
        counts = np.asarray(num_blocks)
        if counts.shape != (num_layers,) or counts.dtype.kind not in "iu":
            raise KVCacheError(f"num_blocks: must be an integer or one integer per layer ({num_layers}), "
                               f"got {num_blocks!r}")
        counts = counts.astype(np.int64)
    if (counts < 1).any():
        raise KVCacheError(f"num_blocks must be >= 1, got {int(counts.min())}")
    return counts


def _check_device(device: str) -> None:
    if device != "cpu" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise KVCacheError(f"device must be 'cpu' or 'cuda:N', got {device!r}")


def _check_compatible(src: KVRegion, dst: KVRegion) -> None:
    """Raise unless both regions store the same tensors per block in the same number of layers."""
    if src.spec is dst.spec:
        return
    if src.num_layers != dst.num_layers:
        raise KVCacheError(f"src has {src.num_layers} layers but dst has {dst.num_layers}")
    if src.tensors != dst.tensors:
        raise KVCacheError(f"src and dst store different tensors per block ({src.tensors} vs {dst.tensors}); "
                           "copies need the same spec (quant, heads per rank, block size)")


def _units(region: KVRegion, blocks: Any, rows: Any, name: str) -> tuple[np.ndarray, np.ndarray, bool]:
    """Flatten a block selection to (block ids, row ids, per_row) int64 arrays; ids checked, -1 kept."""
    arr = np.asarray(blocks)
    if arr.size and arr.dtype.kind not in "iu":
        raise KVCacheError(f"{name} must hold integer block ids, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = (arr < -1) | (arr >= region.num_blocks)
    if bad.any():
        raise KVCacheError(f"{name}: {int(arr[bad][0])} is not a block id of a region with "
                           f"{region.num_blocks} blocks (or -1)")
    heads = region.heads
    if arr.ndim == 1 and rows is None:
        return arr, np.zeros_like(arr), False
    if rows is None:
        rows_arr = np.arange(heads, dtype=np.int64)
    else:
        rows_arr = np.atleast_1d(np.asarray(rows))
        if rows_arr.ndim != 1 or (rows_arr.size and rows_arr.dtype.kind not in "iu"):
            raise KVCacheError(f"rows must be a 1-D list of head indices, got {rows!r}")
        rows_arr = rows_arr.astype(np.int64)
        out = (rows_arr < 0) | (rows_arr >= heads)
        if out.any():
            raise KVCacheError(f"rows: head {int(rows_arr[out][0])} is out of range for {heads} kv heads per rank")
    if arr.ndim == 1:
        return np.tile(arr, rows_arr.size), np.repeat(rows_arr, arr.size), True
    if arr.ndim != 2 or arr.shape[0] != rows_arr.size:
        raise KVCacheError(f"{name} has shape {arr.shape}; a head-wise selection is [rows, blocks] with "
                           f"{rows_arr.size} rows")
    return arr.ravel(), np.repeat(rows_arr, arr.shape[1]), True


def _addresses(region: KVRegion, block: np.ndarray, row: np.ndarray, per_row: bool, layers: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """Flat (addr, length) of every unit in (layer, tensor, unit) order, vectorised over all three."""
    _check_layer_blocks(region, block, layers)
    unit = region.block_bytes // (region.heads if per_row else 1)
    base = region.addrs[layers]
    stride = region.block_strides[layers]
    addr = base[:, :, None] + block[None, None, :] * stride[:, :, None] + (row[None, None, :] * unit[None, :, None])
    length = np.broadcast_to(unit[None, :, None], addr.shape)
    return addr.ravel(), length.ravel()


def _check_layer_blocks(region: KVRegion, block: np.ndarray, layers: np.ndarray) -> None:
    """Raise unless every id of ``block`` is a block of each of ``layers`` (a windowed layer may hold fewer)."""
    limit = region.layer_blocks[layers]
    if block.size and limit.size and int(block.max()) >= int(limit.min()):
        _short_layer(region, int(block.max()), int(layers[np.argmax(limit <= int(block.max()))]))


def _short_layer(region: KVRegion, block: int, layer: int) -> None:
    """Raise: ``block`` is past the blocks of ``layer`` (a windowed layer may hold fewer)."""
    raise KVCacheError(f"blocks: {block} is not a block id of layer {layer}, which holds "
                       f"{int(region.layer_blocks[layer])} blocks")


def _merge(addrs: tuple[np.ndarray, ...], length: np.ndarray) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """Join each unit to the previous one where every address array continues it; vectorised."""
    if length.size == 0:
        return tuple(np.empty(0, dtype=np.int64) for _ in addrs), np.empty(0, dtype=np.int64)
    cont = np.ones(length.size - 1, dtype=bool)
    for a in addrs:
        cont &= a[1:] == a[:-1] + length[:-1]
    first = np.flatnonzero(np.concatenate(([True], ~cont)))
    return tuple(a[first] for a in addrs), np.add.reduceat(length, first)


def _tensor_grid(spec: CacheSpec, caches: Any, names: list[str]) -> list[list[Any]]:
    """``caches`` in any accepted form as a [num_layers][tensors] grid of framework tensors."""
    L = spec.num_layers
    if isinstance(caches, Mapping):
        unknown = [k for k in caches if k not in names]
        missing = [n for n in names if n not in caches]
        if unknown or missing:
            raise KVCacheError(f"caches names {', '.join(map(repr, caches))}; the spec lists {', '.join(names)}")
        columns = []
        for n in names:
            per_layer = caches[n]
            items = [per_layer[i] for i in range(_length(per_layer))] if _is_tensor(per_layer) else list(per_layer)
            if len(items) != L:
                raise KVCacheError(f"caches[{n!r}] has {len(items)} layers; the spec has {L}")
            columns.append(items)
        return [list(row) for row in zip(*columns)]
    layers = list(caches)
    if len(layers) != L:
        raise KVCacheError(f"caches has {len(layers)} layers; expected one entry per layer ({L}) or a mapping of "
                           f"{', '.join(names)} to per-layer tensors")
    grid = []
    for layer, entry in enumerate(layers):
        if isinstance(entry, Mapping):
            missing = [n for n in names if n not in entry]
            if missing:
                raise KVCacheError(f"layer {layer} lacks {', '.join(map(repr, missing))}")
            grid.append([entry[n] for n in names])
        elif _is_tensor(entry):
            if len(names) != 1:
                raise KVCacheError(f"layer {layer} is one tensor but the spec lists {', '.join(names)}")
            grid.append([entry])
        else:
            row = list(entry)
            if len(row) != len(names):
                raise KVCacheError(f"layer {layer} has {len(row)} tensors; the spec lists {', '.join(names)}")
            grid.append(row)
    return grid


def _is_tensor(obj: Any) -> bool:
    return any(hasattr(obj, a) for a in ("__dlpack__", "__cuda_array_interface__", "__array_interface__",
                                         "data_ptr"))


def _length(obj: Any) -> int:
    """Size of a stacked tensor's first (layer) dimension."""
    return int(tuple(obj.shape)[0])


def _describe(obj: Any, tensor: TensorSpec, layer: int) -> TensorInfo:
    try:
        return describe_tensor(obj)
    except TypeError as exc:
        raise KVCacheError(f"layer {layer} tensor {tensor.name!r}: {exc}") from None


def _check_tensor(info: TensorInfo, tensor: TensorSpec, layer: int, num_blocks: int) -> None:
    """Raise naming the layer and tensor unless ``info`` matches the spec's shape, dtype and layout."""
    where = f"layer {layer} tensor {tensor.name!r}"
    want = tensor.shape(num_blocks)
    if info.shape != want:
        raise KVCacheError(f"{where}: shape {list(info.shape)}, but the spec needs {list(want)} "
                           f"(num_blocks, {', '.join(map(str, tensor.block_shape))}) for {num_blocks} blocks")
    size = DTYPE_BYTES[tensor.dtype]
    if info.itemsize != size:
        raise KVCacheError(f"{where}: {info.dtype or 'unknown dtype'} has {info.itemsize}-byte elements, "
                           f"but the spec stores {tensor.dtype} ({size} bytes)")
    if info.dtype is not None and info.dtype != tensor.dtype and info.dtype not in _RAW_NAMES.get(size, ()) and not (
            tensor.dtype in _RAW_NAMES.get(size, ()) and info.dtype not in _FLOAT_NAMES):
        raise KVCacheError(f"{where}: dtype {info.dtype}, but the spec stores {tensor.dtype}")
    inner = _contiguous_strides(want[1:], size)
    if any(s != c for s, c, n in zip(info.strides[1:], inner, want[1:]) if n > 1):
        raise KVCacheError(f"{where}: each block must be C-contiguous (byte strides {list(inner)} below the block "
                           f"dimension), got {list(info.strides[1:])}")
    if num_blocks > 1 and info.strides[0] < tensor.bytes_per_block:
        raise KVCacheError(f"{where}: block stride {info.strides[0]} bytes is smaller than a block "
                           f"({tensor.bytes_per_block} bytes)")
    if info.addr <= 0 or info.addr > _ADDR_MAX:
        raise KVCacheError(f"{where}: has no memory (address {info.addr:#x})")

"""The daemon's state as bytes for journal snapshots: msgpack with raw numpy arrays, and no code run on load.

Unlike pickle, decoding can build nothing but msgpack's plain values, numpy
arrays of plain dtypes (never ``object``) and instances of the classes the
codec was given. Those are restored from their state as pickle would (the
class's ``__setstate__``, else attribute by attribute), so a class keeps one
description of what it saves (``__getstate__``/``__setstate__``). An unknown
class name, an object dtype or a malformed value is a ``KVCacheError``.

Values::

    None, bool, int (any size), float, str, bytes, list, dict   as themselves (dict keys of any of these types)
    tuple, set, frozenset, range, bytearray, OrderedDict, deque  tagged lists
    numpy arrays                                                 ExtType: dtype descr, shape, where its bytes lie
    numpy scalars                                                ExtType: dtype descr, shape (), the bytes
    instances of a given class                                   [tag, state]; a second reference to the same
                                                                 instance or array refers back to the first

The encoding is ``u64 length | msgpack of the value | the arrays' C-order
bytes``, each array starting on a 64-byte boundary; ``chunks`` gives it as
pieces (the arrays' own memory, no copy) for a file, and ``loads`` of a
writable buffer (a bytearray) makes the arrays views of it.

Shared references to an instance or array stay shared after decoding (the
manager's requests sit in a dict and in a list by slot). Lists, dicts and
sets come back as copies: one held by two attributes of instances is an
error, not two lists.
"""
from __future__ import annotations

import collections
import struct
from typing import Any, Iterable

import msgpack
import numpy as np

from kvcache.allocator.errors import KVCacheError

_ARRAY, _SCALAR, _TAG = 1, 2, 3  # ExtType codes
# Tags: the first item of a tagged list, an ExtType(_TAG) whose data is one of these bytes (and, for an
# instance, its index and class name).
_TUPLE, _SET, _FROZENSET, _RANGE, _BYTEARRAY, _ORDERED, _DEQUE, _BIGINT, _OBJECT, _REF = range(10)
_LENGTH = struct.Struct("<Q")  # the msgpack part's length, first
_ALIGN = 64  # each array's bytes start on a multiple of this, from the start of the encoding
_OBJECT_HEAD = struct.Struct("<BI")  # tag, instance index; the class name follows


class _Tag:
    """A decoded tag: which kind of tagged list follows (and, for instances, their index and class name)."""

    __slots__ = ("kind", "index", "name")

    def __init__(self, kind: int, index: int = -1, name: str = "") -> None:
        self.kind, self.index, self.name = kind, index, name


def _state_of(obj: Any) -> Any:
    """What pickle would save of ``obj``: a NamedTuple's fields, its ``__getstate__``, else its attributes."""
    if isinstance(obj, tuple):
        return list(obj)
    getstate = getattr(type(obj), "__getstate__", None)
    if getstate is not None and getstate is not getattr(object, "__getstate__", None):
        return getstate(obj)
    state = dict(getattr(obj, "__dict__", {}))
    for klass in type(obj).__mro__:
        for name in klass.__dict__.get("__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                state[name] = getattr(obj, name)
    return state


def _restore(cls: type, state: Any) -> Any:
    """An instance of ``cls`` from ``_state_of``'s value, as unpickling would build it (without calling ``__init__``)."""
    if issubclass(cls, tuple):  # a NamedTuple: its fields
        return cls(*state)
    obj = cls.__new__(cls)
    setstate = getattr(cls, "__setstate__", None)
    if setstate is not None:
        setstate(obj, state)
    elif isinstance(state, dict):
        for name, value in state.items():
            object.__setattr__(obj, name, value)
    else:
        raise KVCacheError(f"snapshot: {cls.__qualname__}'s state is a {type(state).__name__}, not a map")
    return obj


def _dtype_head(array: np.ndarray) -> list[Any]:
    if array.dtype.hasobject:
        raise KVCacheError(f"snapshot: an array of dtype {array.dtype} holds Python objects; it cannot be saved")
    return [np.lib.format.dtype_to_descr(array.dtype), list(array.shape)]


def _dtype_of(descr: Any) -> np.dtype:
    dtype = np.lib.format.descr_to_dtype(descr if isinstance(descr, str) else [tuple(f) for f in descr])
    if dtype.hasobject:
        raise KVCacheError(f"snapshot: an array of dtype {dtype} would hold Python objects; refused")
    return dtype


def _scalar_ext(value: np.generic) -> msgpack.ExtType:
    array = np.asarray(value)
    return msgpack.ExtType(_SCALAR, msgpack.packb([*_dtype_head(array), array.tobytes()]))


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class StateCodec:
    """Encodes and decodes values made of plain data, numpy arrays and instances of ``classes``."""

    def __init__(self, classes: Iterable[type]) -> None:
        self._classes: dict[str, type] = {}
        for cls in classes:
            assert cls.__qualname__ not in self._classes, f"two classes named {cls.__qualname__}"
            self._classes[cls.__qualname__] = cls

    # ------------------------------------------------------------------ encoding

    def dumps(self, value: Any) -> bytes:
        """``value`` encoded, as one bytes object (``chunks`` joined)."""
        return b"".join(self.chunks(value))

    def chunks(self, value: Any) -> list[bytes | memoryview]:
        """``value`` encoded, as pieces to write one after another; the arrays' pieces are their own memory.

        A value of a type the codec does not know raises ``KVCacheError``.
        """
        shared: dict[int, int] = {}  # id of an instance or array -> its index
        seen: set[int] = set()  # ids of the lists and dicts that instances hold
        keep: list[Any] = []  # what ``shared`` and ``seen`` name stays alive until the end (ids are not reused)
        arrays: list[np.ndarray] = []  # C-contiguous, in the order their bytes follow the msgpack part
        placed = [0]  # where the next array's bytes go, from the start of the arrays' part

        def tagged(kind: int, items: Iterable[Any]) -> list[Any]:
            return [msgpack.ExtType(_TAG, bytes([kind])), *items]

        def reference(obj: Any) -> msgpack.ExtType | None:
            index = shared.get(id(obj))
            return None if index is None else msgpack.ExtType(_TAG, _OBJECT_HEAD.pack(_REF, index))

        def default(obj: Any) -> Any:
            if isinstance(obj, np.generic):
                return _scalar_ext(obj)
            if isinstance(obj, np.ndarray):
                ref = reference(obj)
                if ref is not None:
                    return ref
                shared[id(obj)] = len(shared)
                keep.append(obj)
                head = _dtype_head(obj)
                flat = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
                arrays.append(flat)
                ext = msgpack.ExtType(_ARRAY, msgpack.packb([*head, placed[0], flat.size]))
                placed[0] = _align(placed[0] + flat.size)
                return [msgpack.ExtType(_TAG, _OBJECT_HEAD.pack(_OBJECT, shared[id(obj)])), ext]
            cls = type(obj)
            name = cls.__qualname__
            if self._classes.get(name) is cls:
                ref = reference(obj)
                if ref is not None:
                    return ref
                shared[id(obj)] = len(shared)
                keep.append(obj)
                head = _OBJECT_HEAD.pack(_OBJECT, shared[id(obj)]) + name.encode()
                state = _state_of(obj)
                for item in state.values() if isinstance(state, dict) else ():
                    if type(item) in (list, dict):
                        if id(item) in seen:
                            raise KVCacheError(f"snapshot: a {type(item).__name__} of {name} is held twice; "
                                               "it would come back as two")
                        seen.add(id(item))
                        keep.append(item)
                return [msgpack.ExtType(_TAG, head), state]
            if cls is int:  # beyond msgpack's 64 bits
                return tagged(_BIGINT, [str(obj)])
            if cls is tuple:
                return tagged(_TUPLE, obj)
            if cls is set:
                return tagged(_SET, obj)
            if cls is frozenset:
                return tagged(_FROZENSET, obj)
            if cls is range:
                return tagged(_RANGE, [obj.start, obj.stop, obj.step])
            if cls is bytearray:
                return tagged(_BYTEARRAY, [bytes(obj)])
            if cls is collections.OrderedDict:
                return tagged(_ORDERED, [[k, v] for k, v in obj.items()])
            if cls is collections.deque:
                return tagged(_DEQUE, [obj.maxlen, list(obj)])
            if cls is float or cls is bool or cls is str or cls is bytes:  # subclasses of them
                return cls(obj)
            raise KVCacheError(f"snapshot: cannot save a {cls.__module__}.{name}")

        packer = msgpack.Packer(default=default, strict_types=True, use_bin_type=True, autoreset=True)
        try:
            meta = packer.pack(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise KVCacheError(f"snapshot: cannot encode the state: {exc}") from None
        head = _LENGTH.size + len(meta)
        out: list[bytes | memoryview] = [_LENGTH.pack(len(meta)), meta, bytes(_align(head) - head)]
        position = 0
        for flat in arrays:
            out.append(memoryview(flat))
            position += flat.size
            out.append(bytes(_align(position) - position))
            position = _align(position)
        return out

    # ------------------------------------------------------------------ decoding

    def loads(self, data: bytes | bytearray | memoryview) -> Any:
        """The value ``chunks`` encoded; anything else raises ``KVCacheError``, having built no object of a class
        the codec was not given. The arrays are views of ``data`` where it is writable, else copies."""
        built: dict[int, Any] = {}
        buffer = memoryview(data).cast("B")
        if len(buffer) < _LENGTH.size:
            raise KVCacheError("snapshot: too short to hold a state")
        (size,) = _LENGTH.unpack_from(buffer)
        base = _align(_LENGTH.size + size)  # where the arrays' bytes start
        if _LENGTH.size + size > len(buffer):
            raise KVCacheError("snapshot: its state is cut short")
        writable = not buffer.readonly

        def array_at(descr: Any, shape: list[int], offset: int, nbytes: int) -> np.ndarray:
            dtype = _dtype_of(descr)
            count = int(np.prod(shape, dtype=np.int64))
            if count * dtype.itemsize != nbytes or offset < 0 or base + offset + nbytes > len(buffer):
                raise KVCacheError(f"snapshot: an array of shape {shape} and dtype {dtype} does not match its bytes")
            array = np.frombuffer(buffer, dtype=dtype, count=count, offset=base + offset).reshape(shape)
            return array if writable else array.copy()

        def ext_hook(code: int, data: bytes) -> Any:
            if code == _ARRAY:
                return array_at(*msgpack.unpackb(data))
            if code == _SCALAR:
                descr, shape, raw = msgpack.unpackb(data)
                if shape != []:
                    raise KVCacheError("snapshot: a scalar with a shape")
                return np.frombuffer(raw, dtype=_dtype_of(descr), count=1)[0]
            if code != _TAG or not data:
                raise KVCacheError(f"snapshot: unknown extension type {code}")
            kind = data[0]
            if kind in (_OBJECT, _REF):
                _, index = _OBJECT_HEAD.unpack_from(data)
                if kind == _REF:
                    if index not in built:
                        raise KVCacheError(f"snapshot: a reference to object {index} before it is complete")
                    return built[index]
                return _Tag(kind, index, data[_OBJECT_HEAD.size:].decode())
            if kind > _BIGINT or len(data) != 1:
                raise KVCacheError(f"snapshot: unknown tag {kind}")
            return _Tag(kind)

        def list_hook(items: list[Any]) -> Any:
            if not items or type(items[0]) is not _Tag:
                return items
            tag, rest = items[0], items[1:]
            kind = tag.kind
            try:
                if kind == _OBJECT:
                    if len(rest) != 1:
                        raise KVCacheError("snapshot: an object entry must hold one state")
                    (state,) = rest
                    if tag.name:
                        cls = self._classes.get(tag.name)
                        if cls is None:
                            raise KVCacheError(f"snapshot: unknown class {tag.name!r}; nothing of it is loaded")
                        try:
                            value = _restore(cls, state)
                        except KVCacheError:
                            raise
                        except Exception as exc:  # a class's own restore given a state it never saved
                            raise KVCacheError(f"snapshot: a malformed {tag.name} ({type(exc).__name__}: {exc})"
                                               ) from None
                    elif isinstance(state, np.ndarray):
                        value = state
                    else:
                        raise KVCacheError("snapshot: a shared entry that is neither an object nor an array")
                    built[tag.index] = value
                    return value
                if kind == _TUPLE:
                    return tuple(rest)
                if kind == _SET:
                    return set(rest)
                if kind == _FROZENSET:
                    return frozenset(rest)
                if kind == _RANGE:
                    return range(*rest)
                if kind == _BYTEARRAY:
                    return bytearray(*rest)
                if kind == _ORDERED:
                    return collections.OrderedDict((k, v) for k, v in rest)
                if kind == _DEQUE:
                    maxlen, values = rest
                    return collections.deque(values, maxlen)
                if kind == _BIGINT:
                    (text,) = rest
                    return int(text)
            except KVCacheError:
                raise
            except (TypeError, ValueError) as exc:
                raise KVCacheError(f"snapshot: a malformed entry ({exc})") from None
            raise KVCacheError(f"snapshot: unknown tag {kind}")

        try:
            return msgpack.unpackb(buffer[_LENGTH.size:_LENGTH.size + size], ext_hook=ext_hook, list_hook=list_hook,
                                   strict_map_key=False, raw=False, use_list=True)
        except KVCacheError:
            raise
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise KVCacheError(f"snapshot: not a valid state encoding: {exc}") from None

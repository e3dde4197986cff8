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
    numpy arrays and scalars                                     ExtType: dtype descr, shape, C-order bytes
    instances of a given class                                   [tag, state]; a second reference to the same
                                                                 instance or array refers back to the first

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
_U32 = struct.Struct("<I")
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


def _array_ext(code: int, array: np.ndarray) -> msgpack.ExtType:
    if array.dtype.hasobject:
        raise KVCacheError(f"snapshot: an array of dtype {array.dtype} holds Python objects; it cannot be saved")
    head = msgpack.packb([np.lib.format.dtype_to_descr(array.dtype), list(array.shape)])
    return msgpack.ExtType(code, _U32.pack(len(head)) + head + np.ascontiguousarray(array).tobytes())


def _array_from(data: bytes) -> np.ndarray:
    (size,) = _U32.unpack_from(data)
    descr, shape = msgpack.unpackb(data[4:4 + size])
    dtype = np.lib.format.descr_to_dtype(descr if isinstance(descr, str) else [tuple(f) for f in descr])
    if dtype.hasobject:
        raise KVCacheError(f"snapshot: an array of dtype {dtype} would hold Python objects; refused")
    count = int(np.prod(shape, dtype=np.int64))
    if count * dtype.itemsize != len(data) - 4 - size:
        raise KVCacheError(f"snapshot: an array of shape {shape} and dtype {dtype} does not match its bytes")
    return np.frombuffer(data, dtype=dtype, count=count, offset=4 + size).reshape(shape).copy()


class StateCodec:
    """Encodes and decodes values made of plain data, numpy arrays and instances of ``classes``."""

    def __init__(self, classes: Iterable[type]) -> None:
        self._classes: dict[str, type] = {}
        for cls in classes:
            assert cls.__qualname__ not in self._classes, f"two classes named {cls.__qualname__}"
            self._classes[cls.__qualname__] = cls

    # ------------------------------------------------------------------ encoding

    def dumps(self, value: Any) -> bytes:
        """``value`` as bytes; a value of a type the codec does not know raises ``KVCacheError``."""
        shared: dict[int, int] = {}  # id of an instance or array -> its index
        seen: set[int] = set()  # ids of the lists and dicts that instances hold
        keep: list[Any] = []  # what ``shared`` and ``seen`` name stays alive until the end (ids are not reused)

        def tagged(kind: int, items: Iterable[Any]) -> list[Any]:
            return [msgpack.ExtType(_TAG, bytes([kind])), *items]

        def default(obj: Any) -> Any:
            if isinstance(obj, (np.ndarray, np.generic)):
                if isinstance(obj, np.generic):
                    return _array_ext(_SCALAR, np.asarray(obj))
                index = shared.get(id(obj))
                if index is not None:
                    return msgpack.ExtType(_TAG, _OBJECT_HEAD.pack(_REF, index))
                shared[id(obj)] = len(shared)
                keep.append(obj)
                return [msgpack.ExtType(_TAG, _OBJECT_HEAD.pack(_OBJECT, shared[id(obj)])), _array_ext(_ARRAY, obj)]
            cls = type(obj)
            name = cls.__qualname__
            if self._classes.get(name) is cls:
                index = shared.get(id(obj))
                if index is not None:
                    return msgpack.ExtType(_TAG, _OBJECT_HEAD.pack(_REF, index))
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
            return packer.pack(value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise KVCacheError(f"snapshot: cannot encode the state: {exc}") from None

    # ------------------------------------------------------------------ decoding

    def loads(self, data: bytes | memoryview) -> Any:
        """The value ``dumps`` encoded; anything else raises ``KVCacheError``, having built no object of a class
        the codec was not given."""
        built: dict[int, Any] = {}

        def ext_hook(code: int, data: bytes) -> Any:
            if code == _ARRAY or code == _SCALAR:
                array = _array_from(data)
                return array if code == _ARRAY else array[()]
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
                        value = _restore(cls, state)
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
            return msgpack.unpackb(data, ext_hook=ext_hook, list_hook=list_hook, strict_map_key=False, raw=False,
                                   use_list=True)
        except KVCacheError:
            raise
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise KVCacheError(f"snapshot: not a valid state encoding: {exc}") from None

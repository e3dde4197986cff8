"""The daemon's state as bytes for journal snapshots: msgpack with raw numpy arrays, and no code run on load.

Unlike pickle, decoding can build nothing but msgpack's plain values, numpy
arrays of plain dtypes (never ``object``) and instances of the classes the
codec was given. Those are restored from their state as pickle would (the
class's ``__setstate__``, else attribute by attribute), so a class keeps one
description of what it saves (``__getstate__``/``__setstate__``). An unknown
class name, a dtype the codec does not write or a malformed value is a
``KVCacheError``, and every size an encoding declares is checked against the
bytes present before anything of that size is built: a damaged snapshot costs
no more memory than its own size.

Array dtypes are plain numbers (``bool``, ints and floats of either byte
order), fixed-size bytes (``|V<n>``) and records of plain numbers; a dtype
descr is looked up in that list, never parsed.

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
import math
import re
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
_MAX_DIMS = 32  # numpy's own limit is 64; the daemon's arrays have at most 2
_MAX_VOID = 1 << 16  # bytes in one |V item at most (the daemon's hashes are 32)
_MAX_FIELDS = 16  # fields of a record dtype at most
# The dtypes the codec writes and reads: plain numbers of either byte order, by their descr. Each is built from
# its descr, so this machine's order comes back native ('=', a buffer format of "i", not "<i", as C code expects).
_PLAIN = {descr: np.dtype(descr) for descr in (np.lib.format.dtype_to_descr(np.dtype(t).newbyteorder(o)) for o in "<>"
                                               for t in (np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32,
                                                         np.uint32, np.int64, np.uint64, np.float16, np.float32,
                                                         np.float64))}
_VOID = re.compile(r"\|V([1-9][0-9]{0,5})")


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
    descr = np.lib.format.dtype_to_descr(array.dtype)
    if _known_dtype(descr) != array.dtype:
        raise KVCacheError(f"snapshot: an array of dtype {array.dtype} cannot be saved (only plain numbers, "
                           "fixed-size bytes and records of plain numbers)")
    return [descr, list(array.shape)]


def _known_dtype(descr: Any) -> np.dtype | None:
    """The dtype of a descr the codec writes, or None: a plain number, ``|V<n>``, or a record of plain numbers."""
    if isinstance(descr, str):
        if descr in _PLAIN:
            return _PLAIN[descr]
        void = _VOID.fullmatch(descr)
        return np.dtype((np.void, int(void[1]))) if void and int(void[1]) <= _MAX_VOID else None
    if not isinstance(descr, (list, tuple)) or not 0 < len(descr) <= _MAX_FIELDS:
        return None
    fields = []
    for field in descr:
        if (not isinstance(field, (list, tuple)) or len(field) != 2 or not isinstance(field[0], str)
                or not 0 < len(field[0]) <= 64 or not isinstance(field[1], str) or field[1] not in _PLAIN):
            return None
        fields.append((field[0], _PLAIN[field[1]]))
    if len({name for name, _ in fields}) != len(fields):
        return None
    return np.dtype(fields)


def _dtype_of(descr: Any) -> np.dtype:
    dtype = _known_dtype(descr)
    if dtype is None:
        shown = repr(descr) if len(repr(descr)) <= 80 else repr(descr)[:77] + "..."
        raise KVCacheError(f"snapshot: an array's dtype {shown} is not one the codec writes "
                           "(plain numbers, fixed-size bytes, records of plain numbers)")
    return dtype


def _count(shape: Any) -> int:
    """The number of items of a declared ``shape`` (a list of sizes), or a ``KVCacheError``."""
    if (not isinstance(shape, list) or len(shape) > _MAX_DIMS
            or not all(type(n) is int and n >= 0 for n in shape)):
        raise KVCacheError("snapshot: an array's shape is not a list of sizes")
    return math.prod(shape)


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

        def head(data: bytes, what: str, size: int) -> list[Any]:
            items = msgpack.unpackb(data)
            if not isinstance(items, list) or len(items) != size:
                raise KVCacheError(f"snapshot: {what} is not a list of {size} items")
            return items

        def array_at(descr: Any, shape: Any, offset: Any, nbytes: Any) -> np.ndarray:
            dtype = _dtype_of(descr)
            count = _count(shape)
            if (type(offset) is not int or type(nbytes) is not int or count * dtype.itemsize != nbytes
                    or offset < 0 or base + offset + nbytes > len(buffer)):
                raise KVCacheError(f"snapshot: an array of shape {shape} and dtype {dtype} does not match its bytes")
            array = np.frombuffer(buffer, dtype=dtype, count=count, offset=base + offset).reshape(shape)
            return array if writable else array.copy()

        def ext_hook(code: int, data: bytes) -> Any:
            if code == _ARRAY:
                return array_at(*head(data, "an array's head", 4))
            if code == _SCALAR:
                descr, shape, raw = head(data, "a scalar", 3)
                dtype = _dtype_of(descr)
                if shape != [] or not isinstance(raw, bytes) or len(raw) != dtype.itemsize:
                    raise KVCacheError(f"snapshot: a scalar of dtype {dtype} does not match its bytes")
                return np.frombuffer(raw, dtype=dtype, count=1)[0]
            if code != _TAG or not data:
                raise KVCacheError(f"snapshot: unknown extension type {code}")
            kind = data[0]
            if kind in (_OBJECT, _REF):
                if len(data) < _OBJECT_HEAD.size or (kind == _REF and len(data) != _OBJECT_HEAD.size):
                    raise KVCacheError(f"snapshot: an object tag of {len(data)} bytes")
                _, index = _OBJECT_HEAD.unpack_from(data)
                if kind == _REF:
                    if index not in built:
                        raise KVCacheError(f"snapshot: a reference to object {index} before it is complete")
                    return built[index]
                try:
                    name = data[_OBJECT_HEAD.size:].decode()
                except UnicodeDecodeError:
                    raise KVCacheError("snapshot: a class name that is not UTF-8") from None
                return _Tag(kind, index, name)
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
                    if len(rest) != 3 or not all(type(n) is int for n in rest):
                        raise KVCacheError("snapshot: a range is not three integers")
                    return range(*rest)
                if kind == _BYTEARRAY:  # its bytes, never a size: bytearray(n) would allocate n bytes
                    if len(rest) != 1 or not isinstance(rest[0], bytes):
                        raise KVCacheError("snapshot: a bytearray entry does not hold bytes")
                    return bytearray(rest[0])
                if kind == _ORDERED:
                    return collections.OrderedDict((k, v) for k, v in rest)
                if kind == _DEQUE:
                    maxlen, values = rest
                    if not (maxlen is None or type(maxlen) is int and 0 <= maxlen < 2**63) or type(values) is not list:
                        raise KVCacheError("snapshot: a deque entry is not a length and a list")
                    return collections.deque(values, maxlen)
                if kind == _BIGINT:
                    (text,) = rest
                    if not isinstance(text, str):
                        raise KVCacheError("snapshot: a big integer that is not text")
                    return int(text)
            except KVCacheError:
                raise
            except (TypeError, ValueError, OverflowError) as exc:
                raise KVCacheError(f"snapshot: a malformed entry ({exc})") from None
            raise KVCacheError(f"snapshot: unknown tag {kind}")

        try:
            return msgpack.unpackb(buffer[_LENGTH.size:_LENGTH.size + size], ext_hook=ext_hook, list_hook=list_hook,
                                   strict_map_key=False, raw=False, use_list=True)
        except KVCacheError:
            raise
        except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
            raise KVCacheError(f"snapshot: not a valid state encoding: {exc}") from None

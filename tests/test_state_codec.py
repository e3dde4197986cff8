"""StateCodec: what journal snapshots are made of. Values come back equal, shared instances stay shared, and no input
builds anything but plain data, arrays and the classes the codec was given."""
from __future__ import annotations

import collections
import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.allocator.errors import KVCacheError
from kvcache.state_codec import StateCodec


@dataclasses.dataclass
class Plain:
    a: object
    b: object = None


@dataclasses.dataclass(frozen=True, slots=True)
class Frozen:
    x: int


class Custom:
    """Saves a derived form of itself, as BlockHasher does."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.double = lambda: 2 * self.n  # not saveable: rebuilt on load

    def __getstate__(self) -> dict:
        return {"n": self.n}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["n"])


class Pair(collections.namedtuple("Pair", "left right")):
    __slots__ = ()


CODEC = StateCodec([Plain, Frozen, Custom, Pair])
DTYPES = ["<i4", "<u4", "<i8", "|b1", "<f8", "|u1", "|V32", [("tag", "<u4"), ("entry", "<i4")]]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                    st.text(max_size=8), st.binary(max_size=8))
keys = st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=6), st.tuples(st.integers(0, 9), st.text(max_size=3)))


@st.composite
def arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    raw = draw(st.binary(min_size=int(np.prod(shape)) * dtype.itemsize, max_size=int(np.prod(shape)) * dtype.itemsize))
    array = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if draw(st.booleans()) and array.ndim == 2 and array.shape[1] > 1:
        array = array[:, ::2]  # not contiguous
    return array


values = st.recursive(
    st.one_of(scalars, arrays(), st.builds(np.int64, st.integers(-(2**63), 2**63 - 1)),
              st.builds(range, st.integers(-5, 5), st.integers(-5, 5))),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.tuples(inner, inner), st.dictionaries(keys, inner, max_size=4),
        st.sets(keys, max_size=4), st.frozensets(st.integers(), max_size=4),
        st.builds(collections.deque, st.lists(inner, max_size=3), st.sampled_from([None, 5])),
        st.builds(lambda kv: collections.OrderedDict(kv), st.lists(st.tuples(keys, inner), max_size=3)),
        st.builds(Plain, inner, inner), st.builds(Frozen, st.integers()), st.builds(Pair, inner, inner)),
    max_leaves=12)


def same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return type(a) is type(b) and a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple, collections.deque)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b)) and getattr(a, "maxlen", 0) == getattr(
            b, "maxlen", 0)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, Plain):
        return same(a.a, b.a) and same(a.b, b.b)
    return a == b


@settings(max_examples=300, deadline=None)
@given(values, st.booleans())
def test_every_value_comes_back_equal(value, writable):
    data = CODEC.dumps(value)
    back = CODEC.loads(bytearray(data) if writable else data)
    assert same(value, back)


def test_arrays_load_as_writable_views_of_a_bytearray_and_as_copies_of_bytes():
    data = CODEC.dumps([np.arange(5, dtype=np.int32)])
    buffer = bytearray(data)
    (view,) = CODEC.loads(buffer)
    view[0] = 42
    assert CODEC.loads(buffer)[0][0] == 42 and view.flags.aligned
    (copy,) = CODEC.loads(data)
    copy[1] = 7  # writable, and bytes stay as they were
    assert CODEC.loads(data)[0].tolist() == [0, 1, 2, 3, 4]


def test_shared_instances_and_arrays_stay_shared_and_custom_state_is_rebuilt():
    array = np.zeros(3)
    item = Plain(array)
    back = CODEC.loads(bytearray(CODEC.dumps({"by_id": {1: item}, "by_slot": [item, None], "raw": array,
                                              "custom": Custom(21)})))
    assert back["by_id"][1] is back["by_slot"][0] and back["by_slot"][0].a is back["raw"]
    assert back["custom"].double() == 42


def test_a_list_held_by_two_instances_is_refused_rather_than_split():
    shared = [1, 2]
    with pytest.raises(KVCacheError, match="held twice"):
        CODEC.dumps([Plain(shared), Plain(shared)])


@pytest.mark.parametrize("value, name", [(object(), "builtins.object"), (lambda: 1, "function"),
                                         (np.array([object()], dtype=object), "Python objects")])
def test_what_the_codec_was_not_given_is_refused_when_saving(value, name):
    with pytest.raises(KVCacheError, match=name):
        CODEC.dumps([value])


def crafted(meta: bytes) -> bytes:
    return len(meta).to_bytes(8, "little") + meta


@pytest.mark.parametrize("meta, reason", [
    (msgpack.packb([msgpack.ExtType(3, bytes([8]) + bytes(4) + b"os.system"), ["touch x"]]), "unknown class"),
    (msgpack.packb([msgpack.ExtType(3, bytes([8]) + bytes(4) + b"Plain"), "not a map"]), "not a map"),
    (msgpack.packb([msgpack.ExtType(3, bytes([8]) + bytes(4) + b"Custom"), {"m": 1}]), "a malformed Custom"),
    (msgpack.packb([msgpack.ExtType(3, bytes([9]) + (5).to_bytes(4, "little"))]), "before it is complete"),
    (msgpack.packb(msgpack.ExtType(1, msgpack.packb(["|O", [1], 0, 8]))), "Python objects"),
    (msgpack.packb(msgpack.ExtType(1, msgpack.packb(["<i4", [4], 0, 16]))), "does not match its bytes"),
    (msgpack.packb(msgpack.ExtType(9, b"")), "unknown extension"),
    (msgpack.packb([msgpack.ExtType(3, bytes([77]))]), "unknown tag"),
])
def test_crafted_input_is_refused_naming_why(meta, reason):
    with pytest.raises(KVCacheError, match=reason):
        CODEC.loads(crafted(meta))


@settings(max_examples=300, deadline=None)
@given(values, st.data())
def test_damaged_encodings_raise_only_the_codec_error(value, data):
    """Flipped or cut bytes either decode to something or raise KVCacheError: never another exception."""
    raw = bytearray(CODEC.dumps(value))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        CODEC.loads(bytes(raw[:cut]))
    except KVCacheError:
        pass

"""kvcache._wire, the protocol's C msgpack codec, against msgpack-python with the Python array hooks."""
from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.protocol import ProtocolError, encode_array, pack, pack_reference, unpack, unpack_reference

WIRE_DTYPES = ["<i4", "<u4", "<i8", "<u8", "<f8", "u1", "<i2", "<u2", "i1", "<f4"]


@st.composite
def arrays(draw) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(WIRE_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=4)))
    raw = draw(st.binary(min_size=int(np.prod(shape)) * dtype.itemsize, max_size=int(np.prod(shape)) * dtype.itemsize))
    arr = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if arr.ndim == 2 and draw(st.booleans()):
        arr = arr.T  # not C-contiguous: the fallback copies it
    return arr


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
    st.text(max_size=40), st.binary(max_size=300), st.integers(-(2**31), 2**31).map(np.int64),
    st.floats(allow_nan=False, width=32).map(np.float32), arrays(),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=20), st.tuples(inner, inner),
                            st.dictionaries(st.one_of(st.text(max_size=10), st.integers(-5, 300)), inner, max_size=20)),
    max_leaves=60,
)


def same(a, b) -> bool:
    """Equal values of equal types; arrays by dtype, shape and bytes."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)  # NaN payloads too
    return a == b


@settings(max_examples=400, deadline=None)
@given(values)
def test_pack_writes_msgpack_pythons_bytes_and_unpack_reads_them_back(value):
    wire = pack(value)
    assert wire == pack_reference(value)
    assert same(unpack(wire, len(wire)), unpack_reference(wire))


@settings(max_examples=400, deadline=None)
@given(values, st.data())
def test_unpack_of_cut_or_damaged_messages_fails_as_the_reference_does(value, data):
    """A damaged message decodes to what msgpack-python reads, or fails as ProtocolError where it fails."""
    wire = bytearray(pack(value))
    if wire and data.draw(st.booleans()):
        wire = wire[:data.draw(st.integers(0, len(wire) - 1))]
    elif wire:
        wire[data.draw(st.integers(0, len(wire) - 1))] = data.draw(st.integers(0, 255))
    try:
        want = unpack_reference(bytes(wire))
    except Exception:  # noqa: BLE001 - any failure of the reference
        want = ProtocolError
    if want is ProtocolError or isinstance(want, msgpack.Timestamp):  # ext -1: the reference makes a Timestamp
        with pytest.raises(ProtocolError):
            unpack(bytes(wire), len(wire))
    else:
        assert same(unpack(bytes(wire), len(wire)), want)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_never_crash_and_agree_with_the_reference(blob):
    try:
        want = unpack_reference(blob)
    except Exception:  # noqa: BLE001
        want = ProtocolError
    if want is ProtocolError or isinstance(want, msgpack.Timestamp):
        with pytest.raises(ProtocolError):
            unpack(blob, len(blob))
    else:
        assert same(unpack(blob, len(blob)), want)


def test_bad_arrays_and_limits_are_named():
    header = bytes([2, 1]) + (3).to_bytes(4, "little")
    cases = [
        (msgpack.ExtType(1, b"\x02"), "array: truncated header"),
        (msgpack.ExtType(1, bytes([99, 1])), "array: unknown dtype code 99"),
        (msgpack.ExtType(1, bytes([2, 5]) + bytes(20)), "array: 5 dimensions, at most 4 allowed"),
        (msgpack.ExtType(1, bytes([2, 2, 1])), "array: truncated shape"),
        (msgpack.ExtType(1, header + bytes(8)), "needs 12 bytes, got 8"),
        (msgpack.ExtType(7, b"x"), "unknown ext type 7"),
    ]
    for ext, message in cases:
        with pytest.raises(ProtocolError, match=message):
            unpack(msgpack.packb({"a": ext}), 1 << 20)
    with pytest.raises(ProtocolError, match="not valid msgpack.*max_array_len"):
        unpack(msgpack.packb(list(range(10))), 1 << 20, max_items=9)
    with pytest.raises(ProtocolError, match="not valid msgpack.*max_map_len"):
        unpack(msgpack.packb({i: i for i in range(10)}), 1 << 20, max_items=9)
    assert unpack(msgpack.packb(list(range(9))), 1 << 20, max_items=9) == list(range(9))
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        unpack(bytes(10), 9)
    with pytest.raises(ProtocolError, match="extra data"):
        unpack(b"\x01\x02", 2)


def test_decoded_arrays_own_their_bytes_and_are_read_only():
    """A kept array pins only its own bytes, never the whole message, as with msgpack-python's ext hook."""
    big = np.arange(1000, dtype=np.int32)
    msg = unpack(pack({"a": big, "pad": bytes(100_000)}), 1 << 20)
    assert msg["a"].tolist() == big.tolist() and not msg["a"].flags.writeable
    assert len(msg["a"].base) == 4000


def test_what_the_codec_cannot_encode_raises_as_before():
    for value in (object(), {1, 2}, np.array([True])):
        with pytest.raises((TypeError, ProtocolError)):
            pack(value)
        with pytest.raises((TypeError, ProtocolError)):
            pack_reference(value)
    with pytest.raises(OverflowError):
        pack(2**64)
    with pytest.raises(OverflowError):
        pack(-(2**63) - 1)
    nested: list = []
    for _ in range(600):
        nested = [nested]
    with pytest.raises(ValueError):
        pack(nested)
    assert pack(np.arange(6, dtype=">i4").reshape(2, 3)) == msgpack.packb(encode_array(
        np.arange(6, dtype="<i4").reshape(2, 3)), use_bin_type=True)

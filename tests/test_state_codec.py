"""StateCodec: what journal snapshots are made of. Values come back equal, shared instances stay shared, and no input
builds anything but plain data, arrays and the classes the codec was given."""
from __future__ import annotations

import collections
import dataclasses
import random
import tracemalloc
import zlib

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


def test_arrays_come_back_in_this_machines_byte_order_as_native_code_reads_them():
    """A saved int32 array decodes to a buffer of format "i" (not "<i"): the allocator's C code takes only that."""
    for dtype, fmt in [(np.int32, "i"), (np.int64, "l"), (np.uint8, "B"), (np.bool_, "?")]:
        (back,) = CODEC.loads(bytearray(CODEC.dumps([np.zeros((2, 3), dtype=dtype)])))
        assert back.dtype.isnative and memoryview(back).format == fmt


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
    (msgpack.packb(msgpack.ExtType(1, msgpack.packb(["|O", [1], 0, 8]))), "not one the codec writes"),
    (msgpack.packb(msgpack.ExtType(1, msgpack.packb(["<i4", [4], 0, 16]))), "does not match its bytes"),
    (msgpack.packb(msgpack.ExtType(9, b"")), "unknown extension"),
    (msgpack.packb([msgpack.ExtType(3, bytes([77]))]), "unknown tag"),
    (msgpack.packb([msgpack.ExtType(3, bytes([8])), {}]), "an object tag of 1 bytes"),
    (msgpack.packb([msgpack.ExtType(3, bytes([9, 0]))]), "an object tag of 2 bytes"),
    (msgpack.packb([msgpack.ExtType(3, bytes([8]) + bytes(4) + b"\xff"), {}]), "not UTF-8"),
    (msgpack.packb(msgpack.ExtType(1, msgpack.packb(["(,)i4", [1], 0, 4]))), "not one the codec writes"),
    (msgpack.packb(msgpack.ExtType(1, msgpack.packb(["<M8[s]", [1], 0, 8]))), "not one the codec writes"),
    (msgpack.packb(msgpack.ExtType(1, msgpack.packb(["|V9999999", [0], 0, 0]))), "not one the codec writes"),
    (msgpack.packb(msgpack.ExtType(1, msgpack.packb(["<i4", [-1, -1], 0, 4]))), "shape is not a list of sizes"),
    (msgpack.packb(msgpack.ExtType(1, msgpack.packb(["<i4", [2**40, 2**40], 0, 0]))), "does not match its bytes"),
    (msgpack.packb(msgpack.ExtType(1, msgpack.packb(["<i4", [1], 0]))), "not a list of 4 items"),
    (msgpack.packb(msgpack.ExtType(2, msgpack.packb(["<i8", [], b"\0"]))), "does not match its bytes"),
    (msgpack.packb([msgpack.ExtType(3, bytes([4])), 2**45]), "does not hold bytes"),  # bytearray(2**45)
    (msgpack.packb([msgpack.ExtType(3, bytes([4])), 1 << 30]), "does not hold bytes"),
    (msgpack.packb([msgpack.ExtType(3, bytes([6])), 2**64 - 1, []]), "not a length and a list"),
    (msgpack.packb([msgpack.ExtType(3, bytes([3])), 0, "9", 1]), "not three integers"),
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


# ---------------------------------------------------------------- a real daemon's snapshot, damaged on purpose

class Pairs(list):
    """A map's [key, value] items, as ``unpack_tree`` gives them (so that keys can be damaged too)."""


def unpack_tree(meta: bytes):
    """The msgpack part as plain lists, ``Pairs`` and ``ExtType``s: what the codec reads, before it reads it."""
    return msgpack.unpackb(meta, ext_hook=msgpack.ExtType, object_pairs_hook=lambda p: Pairs([k, v] for k, v in p),
                           strict_map_key=False, raw=False)


def pack_tree(value) -> bytes:
    if type(value) is Pairs:
        return b"\xdf" + len(value).to_bytes(4, "big") + b"".join(pack_tree(k) + pack_tree(v) for k, v in value)
    if type(value) is list:
        return b"\xdd" + len(value).to_bytes(4, "big") + b"".join(pack_tree(v) for v in value)
    return msgpack.packb(value, use_bin_type=True)


# What a hostile or damaged snapshot might put in place of any value: sizes past any buffer, dtypes numpy would
# have to parse, tags of every kind with the wrong contents.
HOSTILE = [-1, 0, 7, 2**31, 2**45, 2**63 - 1, -(2**63), 1.5, None, True, "", "(,)i4", "|O", "<M8[s]", "|V99999",
           "<i4", "O", b"", bytes(5), [], Pairs(), [[1]], *([msgpack.ExtType(3, bytes([k])), 2**30] for k in range(11)),
           *(msgpack.ExtType(3, bytes([k])) for k in range(11)), msgpack.ExtType(3, bytes([8, 1])),
           msgpack.ExtType(1, b""), msgpack.ExtType(2, msgpack.packb(["<i8", [], b"\0"]))]


def damage_tree(tree, rng: random.Random):
    """``tree`` with one value (possibly inside an array's or a scalar's head) replaced by a hostile one."""
    slots = []

    def walk(value) -> None:
        if type(value) is Pairs:  # a map's items stay pairs; their keys and values are damaged
            for pair in value:
                walk(pair)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                slots.append((value, i))
                walk(item)

    walk(tree)
    container, i = rng.choice(slots)
    old = container[i]
    if isinstance(old, msgpack.ExtType) and old.code in (1, 2) and rng.random() < 0.8:
        head = unpack_tree(old.data)
        container[i] = msgpack.ExtType(old.code, pack_tree(damage_tree([head], rng)[0]))
    elif isinstance(old, msgpack.ExtType) and old.code == 3 and rng.random() < 0.5:
        data = bytearray(old.data)
        data[rng.randrange(len(data))] = rng.choice([0, 1, 4, 8, 9, 10, 255])
        container[i] = msgpack.ExtType(3, bytes(data[:rng.randrange(len(data) + 1)]))
    else:
        container[i] = rng.choice(HOSTILE)
    return tree


def damage_bytes(meta: bytearray, rng: random.Random) -> bytearray:
    """``meta`` with a few bytes flipped or set to msgpack's type markers."""
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(meta))
        meta[i] = meta[i] ^ (1 << rng.randrange(8)) if rng.random() < 0.5 else rng.choice(
            [0x00, 0x7F, 0xFF, 0xC4, 0xC7, 0xCE, 0xCF, 0xD4, 0xD5, 0xD6, 0xDD, 0xDF, 0x91, 0x93, 0x03, 0x04, 0x08])
    return meta


def test_a_damaged_real_snapshot_is_refused_with_one_error_and_bounded_memory(daemon, tmp_path):
    """3,000 damaged copies of a real daemon's snapshot, each sealed with a valid checksum: every one loads or raises
    KVCacheError (never another exception), and none makes the loader allocate more than a few times its size."""
    from kvcache.journal import read_snapshot
    from kvcache.durability import load_state

    journal = tmp_path / "j"
    d = daemon("--num-blocks", "64", "--block-size", "16", "--journal", str(journal), "--snapshot-bytes", "1")
    from kvcache.client import CacheClient

    with CacheClient(d.endpoint) as client:
        for i in range(6):
            client.admit(f"r{i}" if i % 2 else i, np.arange(i * 1000, i * 1000 + 40))
        client.free(2)
    d.stop()
    original = (journal / "snapshot").read_bytes()
    head, state = original[:6 + 8], original[6 + 12:]  # magic and lsn, then the state after the crc
    size = int.from_bytes(state[:8], "little")
    meta, arrays = state[8:8 + size], state[-(-(8 + size) // 64) * 64:]
    assert load_state(bytearray(state))["manager"].num_blocks == 64
    folder = tmp_path / "damaged"
    folder.mkdir()
    rng = random.Random(20261128)
    failures: list[str] = []
    refused = 0
    bound = 8 * len(original) + (4 << 20)
    for _ in range(3000):
        if rng.random() < 0.5:
            new_meta = bytes(damage_bytes(bytearray(meta), rng))
        else:
            new_meta = pack_tree(damage_tree([unpack_tree(meta)], rng)[0])
        pad = -(8 + len(new_meta)) % 64
        damaged = len(new_meta).to_bytes(8, "little") + new_meta + bytes(pad) + arrays
        (folder / "snapshot").unlink(missing_ok=True)  # a new file: ext4 flushes one truncated and rewritten
        (folder / "snapshot").write_bytes(head + zlib.crc32(damaged).to_bytes(4, "little") + damaged)
        sealed, _ = read_snapshot(folder)
        tracemalloc.start()
        try:
            load_state(sealed)
        except KVCacheError:
            refused += 1
        except Exception as exc:  # noqa: BLE001 - what the test looks for
            failures.append(f"{type(exc).__name__}: {exc}"[:200])
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        if peak > bound:
            failures.append(f"allocated {peak:,} bytes for a snapshot of {len(damaged):,}")
    assert not failures, f"{len(failures)} of 3000: {sorted(set(failures))[:10]}"
    assert refused > 1000

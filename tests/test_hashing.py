"""Chained block hashing for the prefix cache: BlockHasher, the C chain loops, the vLLM format."""
from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections.abc import Iterator, Sequence

import cbor2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.allocator import KVCacheError
from kvcache.allocator import _chainhash as native
from kvcache.allocator.prefix import (
    BlockHasher,
    MMPlaceholder,
    _block_extras,
    _pick_chain,
    _reference_chain_cbor,
    _reference_chain_raw,
    as_token_array,
    cbor_encode,
)

INT_WIDTHS = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1]
BLOCK_SIZES = [1, 16, 23, 24, 64, 256]
SEED = "1234"


# --------------------------------------------------------------------------- independent references


def vllm_mm_keys(
    mm: Sequence[tuple[str, int, int]], start: int, end: int, start_idx: int
) -> tuple[list[tuple[str, int]], int]:
    """vLLM's _gen_mm_extra_hash_keys walk (vllm/v1/core/kv_cache_utils.py), its logic as it stands."""
    keys: list[tuple[str, int]] = []
    if not mm:
        return keys, start_idx
    last_offset, last_length = mm[-1][1], mm[-1][2]
    if last_offset + last_length <= start:
        return keys, start_idx
    idx = start_idx
    while idx < len(mm):
        ident, offset, length = mm[idx]
        if end > offset:
            if start >= offset + length:
                idx += 1
                continue
            keys.append((ident, offset - start))
            if end >= offset + length:
                idx += 1
            else:
                break
        else:
            break
    return keys, idx


def vllm_block_hashes(
    tokens: Sequence[int],
    block_size: int,
    seed: str = "vllm-none-hash",
    *,
    lora: tuple[str, str] | str | None = None,
    salt: str | None = None,
    mm: Sequence[tuple[str, int, int]] = (),
) -> list[bytes]:
    """vLLM 0.33's request block hasher with sha256_cbor, from cbor2 and hashlib only: tagged extra keys
    ("lora", name, path), ("mm", identifier, offset - block_start), ("cache_salt", salt) on block 0.

    The reference the random tests compare against; ``test_the_reference_reproduces_vllms_own_hashes``
    grounds it in hashes vLLM itself computed. A LoRA given by name alone is keyed ("lora", name).
    """
    none_hash = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    lora_keys = [] if lora is None else [("lora", lora)] if isinstance(lora, str) else [("lora", *lora)]
    hashes: list[bytes] = []
    prev: bytes | None = None
    mm_idx = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        end = start + block_size
        mm_keys, mm_idx = vllm_mm_keys(mm, start, end, mm_idx)
        keys = lora_keys + [("mm", *k) for k in mm_keys] + ([("cache_salt", salt)] if start == 0 and salt else [])
        extra = tuple(keys) if keys else None
        parent = prev if prev else none_hash
        prev = hashlib.sha256(cbor2.dumps((parent, tuple(tokens[start:end]), extra), canonical=True)).digest()
        hashes.append(prev)
    return hashes


def vllm_vectors() -> list[dict]:
    """The 40 cases vLLM 0.33 hashed itself (tests/vectors/README.md says how)."""
    path = os.path.join(os.path.dirname(__file__), "vectors", "vllm-0.33-sha256_cbor.json")
    with open(path) as f:
        return json.load(f)["cases"]


def vector_request(case: dict) -> dict:
    """A vector case's request as BlockHasher takes it."""
    return {"cache_salt": case["cache_salt"] or None,
            "lora": (case["lora_name"], case["lora_path"]) if case["lora_name"] is not None else None,
            "mm": [tuple(item) for item in case["mm"]] or None}


def raw_block_hashes(
    tokens: Sequence[int],
    block_size: int,
    seed: bytes,
    *,
    lora: str | None = None,
    salt: str | None = None,
    mm: Sequence[tuple[str, int, int]] = (),
) -> list[bytes]:
    """The "sha256" framing by hand: SHA256(prev || uint32 LE tokens || cbor([salt, lora, mm]))."""
    prev = hashlib.sha256(b"kvcache-sha256-v1" + struct.pack("<I", block_size) + seed).digest()
    hashes: list[bytes] = []
    for b in range(len(tokens) // block_size):
        start, end = b * block_size, (b + 1) * block_size
        mm_keys = [[ident, off - start] for ident, off, length in mm if off < end and off + length > start]
        block_salt = salt if b == 0 and salt else None
        extra = b""
        if block_salt is not None or lora is not None or mm_keys:
            extra = cbor2.dumps([block_salt, lora, mm_keys], canonical=True)
        prev = hashlib.sha256(prev + struct.pack(f"<{block_size}I", *tokens[start:end]) + extra).digest()
        hashes.append(prev)
    return hashes


def widths_prompt(block_size: int, num_blocks: int = 3, tail: int = 5) -> list[int]:
    """A prompt cycling through every CBOR integer width, with a partial tail block."""
    n = block_size * num_blocks + min(tail, block_size - 1)
    return [INT_WIDTHS[i % len(INT_WIDTHS)] for i in range(n)]


@pytest.fixture
def each_backend() -> Iterator[tuple[str, ...]]:
    """The backends to run under; the test switches between them, this restores 'auto'."""
    yield native.available_backends()
    native.set_backend("auto")


def make_mm_layout(data: st.DataObject, max_tokens: int) -> list[tuple[str, int, int]]:
    """Sorted, disjoint multimodal placeholders within max_tokens (hypothesis helper)."""
    items = []
    pos = data.draw(st.integers(0, 20))
    for i in range(data.draw(st.integers(0, 4))):
        length = data.draw(st.integers(1, 40))
        if pos + length > max_tokens:
            break
        items.append((data.draw(st.sampled_from(["img-a", "img-b", "aud-c"])) + str(i), pos, length))
        pos += length + data.draw(st.integers(0, 30))
    return items


# --------------------------------------------------------------------------- the native module


def test_native_module_is_built_and_used() -> None:
    """The C extension imports in this repo (CI catches a broken build) and BlockHasher uses it."""
    assert BlockHasher(16).native
    assert BlockHasher(16, "sha256_cbor").native


def test_sha_ni_is_detected_where_the_cpu_has_it() -> None:
    """CPUID detection agrees with the kernel's cpu flags, and 'auto' picks SHA-NI when present."""
    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    has = " sha_ni" in flags
    assert ("sha_ni" in native.available_backends()) == has
    assert native.backend() == ("sha_ni" if has else "portable")


def test_backend_can_be_forced_and_restored(each_backend: tuple[str, ...]) -> None:
    """set_backend switches the compress function; unknown names are refused."""
    native.set_backend("portable")
    assert native.backend() == "portable"
    native.set_backend("auto")
    assert native.backend() == each_backend[0]
    with pytest.raises(ValueError, match="backend must be"):
        native.set_backend("openssl")


def test_sha256_matches_hashlib_at_every_padding_boundary(each_backend: tuple[str, ...]) -> None:
    """Every message length up to 300 bytes (all padding cases) plus long ones, on every backend."""
    messages = [os.urandom(n) for n in [*range(300), 1000, 4096, 100_003]]
    for backend in each_backend:
        native.set_backend(backend)
        for msg in messages:
            assert native.sha256(msg) == hashlib.sha256(msg).digest(), (backend, len(msg))


def test_chain_functions_validate_their_arguments() -> None:
    """Wrong buffer types, parent lengths, block sizes and extras raise TypeError/ValueError."""
    toks = np.arange(32, dtype=np.uint32)
    parent = bytes(32)
    for fn in (native.chain_raw, native.chain_cbor):
        with pytest.raises(TypeError, match="uint32"):
            fn(toks.astype(np.int64), 16, parent)
        with pytest.raises(TypeError, match="uint32"):
            fn(toks.astype(np.int32), 16, parent)
        with pytest.raises(TypeError, match="uint32"):
            fn((1, 2, 3), 16, parent)
        with pytest.raises(TypeError, match="uint32"):
            fn(toks.reshape(2, 16), 16, parent)
        with pytest.raises(ValueError, match="parent must be 32 bytes"):
            fn(toks, 16, bytes(31))
        with pytest.raises(ValueError, match="block_size"):
            fn(toks, 0, parent)
        with pytest.raises(ValueError, match="extras has 1 items but there are 2 full blocks"):
            fn(toks, 16, parent, [b""])
        with pytest.raises(TypeError, match=r"extras\[1\] must be bytes or None"):
            fn(toks, 16, parent, [b"", "x"])
        with pytest.raises(TypeError, match="extras must be"):
            fn(toks, 16, parent, 5)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_a_list_is_hashed_from_its_items_or_declined(data: st.DataObject) -> None:
    """chain_raw hashes a list of ints as the uint32 array of them (SHA-NI, no extras, block_size % 4 == 0 and
    <= 64); a list with an item that is no token id, anywhere (the partial block too), or any other case gives
    None; BlockHasher turns both into the array's hashes or a KVCacheError naming the tokens."""
    block_size = data.draw(st.sampled_from([1, 4, 12, 16, 32, 64, 68, 100]))
    values = data.draw(st.lists(st.integers(0, 2**32 - 1), max_size=400))
    split = data.draw(st.booleans())
    parent = data.draw(st.binary(min_size=32, max_size=32))
    array = np.array(values, dtype=np.uint32)
    fused = native.backend() == "sha_ni" and block_size % 4 == 0 and block_size <= 64
    got = native.chain_raw(values, block_size, parent, split=split)
    assert got == (native.chain_raw(array, block_size, parent, split=split) if fused else None)
    assert native.chain_cbor(values, block_size, parent, split=split) is None
    assert native.chain_raw(values, block_size, parent, [None] * (len(values) // block_size)) is None
    for algorithm in ("sha256", "sha256_cbor"):
        hasher = BlockHasher(block_size, algorithm, seed=SEED)
        assert hasher.hash_blocks(values) == hasher.hash_blocks(array)
        assert hasher.hash_blocks_packed(values) == hasher.hash_blocks_packed(array)
    if values:
        bad = list(values)
        bad[data.draw(st.integers(0, len(values) - 1))] = data.draw(st.sampled_from([-1, 2**32, 1.5, "7", None]))
        assert native.chain_raw(bad, block_size, parent, split=split) is None
        with pytest.raises(KVCacheError, match="tokens"):
            BlockHasher(block_size, "sha256", seed=SEED).hash_blocks(bad)


def test_chain_split_returns_one_bytes_per_block() -> None:
    """split=True gives the same digests as a list of 32-byte bytes."""
    toks = np.arange(40, dtype=np.uint32)
    for fn in (native.chain_raw, native.chain_cbor):
        joined = fn(toks, 8, bytes(32))
        parts = fn(toks, 8, bytes(32), split=True)
        assert len(parts) == 5 and all(len(p) == 32 for p in parts)
        assert b"".join(parts) == joined


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_native_chains_equal_the_hashlib_reference(data: st.DataObject) -> None:
    """For random tokens, block sizes and extras, C == Python reference, both algorithms, both backends."""
    block_size = data.draw(st.integers(1, 70))
    toks = np.array(data.draw(st.lists(st.integers(0, 2**32 - 1), max_size=300)), dtype=np.uint32)
    n = len(toks) // block_size
    extras = data.draw(
        st.none() | st.lists(st.none() | st.binary(max_size=150), min_size=n, max_size=n + 2)
    )
    parent = data.draw(st.binary(min_size=32, max_size=32))
    expected_raw = _reference_chain_raw(toks, block_size, parent, extras)
    expected_cbor = _reference_chain_cbor(toks, block_size, parent, extras)
    try:
        for backend in native.available_backends():
            native.set_backend(backend)
            assert native.chain_raw(toks, block_size, parent, extras) == expected_raw
            assert native.chain_cbor(toks, block_size, parent, extras) == expected_cbor
    finally:
        native.set_backend("auto")


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
def test_pure_python_fallback_gives_the_native_hashes(algorithm: str) -> None:
    """Without the C extension BlockHasher chains with hashlib; the hashes are the same."""
    hasher = BlockHasher(16, algorithm, seed=SEED)
    toks = np.arange(100, 260, dtype=np.uint32)
    mm = [MMPlaceholder("img", 20, 50)]
    extras = _block_extras(algorithm, 16, 10, 0, "salt", "lora", mm)
    fallback = _pick_chain(algorithm, native=False)(toks, 16, hasher.root, extras, split=True)
    assert fallback == _pick_chain(algorithm, native=True)(toks, 16, hasher.root, extras, split=True)
    assert fallback == hasher.hash_blocks(toks, cache_salt="salt", lora="lora", mm=mm)


def test_native_chains_read_any_uint32_layout() -> None:
    """Big-endian and little-endian-explicit uint32 buffers hash as their values, not their bytes."""
    toks = np.array(INT_WIDTHS * 6, dtype=np.uint32)
    parent = bytes(range(32))
    for fn in (native.chain_raw, native.chain_cbor):
        expected = fn(toks, 16, parent)
        assert fn(toks.astype(">u4"), 16, parent) == expected
        assert fn(toks.astype("<u4"), 16, parent) == expected
        assert fn(memoryview(toks), 16, parent) == expected


def test_chains_release_the_gil_safely_under_threads() -> None:
    """Hashing from several threads at once gives each the single-threaded result."""
    toks = np.random.default_rng(0).integers(0, 2**32, size=20_000, dtype=np.uint32)
    expected = native.chain_raw(toks, 16, bytes(32))
    results: list[bytes] = []

    def work() -> None:
        for _ in range(20):
            results.append(native.chain_raw(toks, 16, bytes(32)))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 80 and all(r == expected for r in results)


def test_every_block_size_byte_order_and_result_shape_matches_the_reference(each_backend: tuple[str, ...]) -> None:
    """Each C loop (tokens read in place for block_size % 4 == 0 without extras, assembled
    messages otherwise, cbor) equals the reference, packed and split, for 0 to 9 blocks."""
    rng = np.random.default_rng(7)
    parent = bytes(range(32))
    for block_size in [*range(1, 41), 44, 48, 52, 56, 60, 64, 68, 72, 100, 128]:
        for num_blocks in (0, 1, 2, 3, 4, 7, 9):
            n_tok = block_size * num_blocks + int(rng.integers(0, block_size))
            toks = np.array([INT_WIDTHS[k] for k in rng.integers(0, len(INT_WIDTHS), n_tok)], dtype=np.uint32)
            extras = [None if k % 3 else bytes(rng.integers(0, 256, k % 70, dtype=np.uint8)) for k in range(num_blocks)]
            for ex in (None, extras):
                want = {
                    native.chain_raw: _reference_chain_raw(toks, block_size, parent, ex, split=True),
                    native.chain_cbor: _reference_chain_cbor(toks, block_size, parent, ex, split=True),
                }
                for backend in each_backend:
                    native.set_backend(backend)
                    for fn, expected in want.items():
                        for layout in (toks, toks.astype(">u4")):
                            where = (backend, fn.__name__, block_size, num_blocks, ex is not None, layout.dtype.str)
                            assert fn(layout, block_size, parent, ex) == b"".join(expected), where
                            assert fn(layout, block_size, parent, ex, split=True) == expected, where


@pytest.mark.parametrize("fn_name", ["chain_raw", "chain_cbor"])
def test_split_results_over_many_blocks(fn_name: str, each_backend: tuple[str, ...]) -> None:
    """split=True makes its bytes objects as the loop goes (GIL held, released every 4096 blocks):
    past those points the list still equals the packed digests, item by item."""
    fn = getattr(native, fn_name)
    toks = np.random.default_rng(3).integers(0, 2**32, size=9_001, dtype=np.uint32)
    for backend in each_backend:
        native.set_backend(backend)
        for block_size in (1, 4):
            packed = fn(toks, block_size, bytes(32))
            parts = fn(toks, block_size, bytes(32), split=True)
            assert len(parts) == len(toks) // block_size
            assert all(type(p) is bytes and len(p) == 32 for p in parts)
            assert b"".join(parts) == packed
    assert native.chain_raw(toks, 1, bytes(32), split=True) == _reference_chain_raw(toks, 1, bytes(32), split=True)


def test_split_chains_from_several_threads() -> None:
    """split=True holds the GIL but offers it every 4096 blocks; threads still get their own results."""
    toks = np.random.default_rng(1).integers(0, 2**32, size=80_000, dtype=np.uint32)
    expected = {bs: native.chain_raw(toks, bs, bytes(32), split=True) for bs in (1, 16)}
    results: list[bool] = []

    def work(bs: int) -> None:
        for _ in range(5):
            results.append(native.chain_raw(toks, bs, bytes(32), split=True) == expected[bs])

    threads = [threading.Thread(target=work, args=(bs,)) for bs in (1, 16, 1, 16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 20 and all(results)


# --------------------------------------------------------------------------- CBOR encoder


@settings(max_examples=300, deadline=None)
@given(
    value=st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**64), 2**64 - 1)
        | st.text(max_size=300)
        | st.binary(max_size=300),
        lambda inner: st.lists(inner, max_size=30) | st.lists(inner, max_size=5).map(tuple),
        max_leaves=40,
    )
)
def test_cbor_encoder_is_byte_identical_to_cbor2_canonical(value: object) -> None:
    """The tiny encoder writes exactly what cbor2.dumps(..., canonical=True) writes."""
    assert cbor_encode(value) == cbor2.dumps(value, canonical=True)


# --------------------------------------------------------------------------- sha256_cbor == vLLM


@pytest.mark.parametrize("case", vllm_vectors(), ids=lambda c: f"bs{c['block_size']}-{len(c['tokens'])}")
def test_sha256_cbor_reproduces_every_hash_vllm_computed(case: dict, each_backend: tuple[str, ...]) -> None:
    """Byte for byte what vLLM 0.33 computed, whole prompts and chunk by chunk (the parent carried over)."""
    bs, tokens, request = case["block_size"], case["tokens"], vector_request(case)
    want = [bytes.fromhex(h) for h in case["hashes"]]
    for backend in each_backend:
        native.set_backend(backend)
        hasher = BlockHasher(bs, "sha256_cbor")
        assert hasher.hash_blocks(tokens, **request) == want
        got = hasher.hash_blocks(tokens[:bs], **request)
        for b in range(1, len(want)):  # one block at a time, as a decode step hashes a block that fills
            got += hasher.hash_blocks(tokens[b * bs:(b + 1) * bs], parent=got[-1], start_block=b, **request)
        assert got == want


def test_the_reference_reproduces_vllms_own_hashes() -> None:
    """The by-hand reference of the random tests below gives every hash vLLM computed."""
    for case in vllm_vectors():
        request = vector_request(case)
        assert [h.hex() for h in vllm_block_hashes(case["tokens"], case["block_size"], lora=request["lora"],
                                                   salt=request["cache_salt"], mm=request["mm"] or ())
                ] == case["hashes"]


def test_sha256_cbor_root_is_vllms_none_hash() -> None:
    """vLLM's NONE_HASH: sha256_cbor of PYTHONHASHSEED where set, else of "vllm-none-hash"."""
    assert BlockHasher(16, "sha256_cbor").root == hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()
    assert BlockHasher(16, "sha256_cbor", seed=SEED).root == hashlib.sha256(cbor2.dumps(SEED, canonical=True)).digest()


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_sha256_cbor_matches_vllm_without_extras(block_size: int, each_backend: tuple[str, ...]) -> None:
    """Plain prompts over every CBOR int width and array-header width hash exactly as vLLM does."""
    prompt = widths_prompt(block_size)
    expected = vllm_block_hashes(prompt, block_size, SEED)
    for backend in each_backend:
        native.set_backend(backend)
        assert BlockHasher(block_size, "sha256_cbor", seed=SEED).hash_blocks(prompt) == expected


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
def test_a_lora_name_alone_never_shares_a_hash_with_a_name_and_path(algorithm: str) -> None:
    """Two adapters under one name differ by path; a name alone is a third key, equal to neither."""
    hasher = BlockHasher(4, algorithm, seed=SEED)
    tokens = list(range(12))
    keyed = {repr(lora): hasher.hash_blocks(tokens, lora=lora)
             for lora in ("sql", ("sql", ""), ("sql", "/a"), ("sql", "/b"), ["sql", "/a"], None)}
    assert keyed[repr(("sql", "/a"))] == keyed[repr(["sql", "/a"])]  # a list is taken as the pair
    distinct = {tuple(v) for k, v in keyed.items() if k != repr(["sql", "/a"])}
    assert len(distinct) == 5 and all(len(v) == 3 for v in distinct)


@pytest.mark.parametrize("lora", [("a",), ("a", "b", "c"), ("a", 1), 5, b"a"])
def test_a_lora_that_is_neither_a_name_nor_a_pair_is_refused(lora: object) -> None:
    with pytest.raises(KVCacheError, match="lora: must be a LoRA name"):
        BlockHasher(4, seed=SEED).hash_blocks(list(range(8)), lora=lora)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_sha256_cbor_matches_vllm_for_random_requests(data: st.DataObject) -> None:
    """Random prompts, block sizes, LoRA, salt and multimodal layouts hash as the vector-checked reference does."""
    block_size = data.draw(st.integers(1, 40))
    prompt = data.draw(st.lists(st.integers(0, 2**32 - 1), max_size=200))
    lora = data.draw(st.none() | st.text(max_size=5) | st.tuples(st.text(max_size=5), st.text(max_size=5)))
    salt = data.draw(st.none() | st.text(max_size=5))
    mm = make_mm_layout(data, len(prompt))
    got = BlockHasher(block_size, "sha256_cbor", seed=SEED).hash_blocks(prompt, lora=lora, cache_salt=salt, mm=mm)
    assert got == vllm_block_hashes(prompt, block_size, SEED, lora=lora, salt=salt, mm=mm)


# --------------------------------------------------------------------------- sha256 (raw framing)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_sha256_matches_its_framing_computed_by_hand(block_size: int, each_backend: tuple[str, ...]) -> None:
    """h_i = SHA256(h_{i-1} || tokens as uint32 LE || extra), root from tag, block size and seed."""
    prompt = widths_prompt(block_size, num_blocks=5)
    n = len(prompt)
    mm = [("img-a", 1, max(1, n // 3)), ("img-b", n // 2, max(1, n // 4))]
    for backend in each_backend:
        native.set_backend(backend)
        hasher = BlockHasher(block_size, "sha256", seed=b"seed")
        assert hasher.hash_blocks(prompt) == raw_block_hashes(prompt, block_size, b"seed")
        got = hasher.hash_blocks(prompt, lora="l", cache_salt="s", mm=mm)
        assert got == raw_block_hashes(prompt, block_size, b"seed", lora="l", salt="s", mm=mm)


def test_sha256_str_seed_is_its_utf8_bytes() -> None:
    """A str seed and its UTF-8 bytes give the same raw root."""
    assert BlockHasher(16, seed="sé").root == BlockHasher(16, seed="sé".encode()).root


def test_sha256_extras_cannot_be_confused_between_salt_and_lora() -> None:
    """Unlike vLLM's flat tuple, the raw framing tells a salt 'x' from a LoRA named 'x'."""
    hasher = BlockHasher(4, seed="s")
    assert hasher.hash_blocks([1, 2, 3, 4], cache_salt="x") != hasher.hash_blocks([1, 2, 3, 4], lora="x")


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_sha256_matches_its_framing_for_random_requests(data: st.DataObject) -> None:
    """Random prompts, block sizes and extra keys match the by-hand framing."""
    block_size = data.draw(st.integers(1, 40))
    prompt = data.draw(st.lists(st.integers(0, 2**32 - 1), max_size=200))
    lora = data.draw(st.none() | st.text(max_size=5))
    salt = data.draw(st.none() | st.text(max_size=5))
    mm = make_mm_layout(data, len(prompt))
    got = BlockHasher(block_size, seed=b"k").hash_blocks(prompt, lora=lora, cache_salt=salt, mm=mm)
    assert got == raw_block_hashes(prompt, block_size, b"k", lora=lora, salt=salt, mm=mm)


# --------------------------------------------------------------------------- chaining rules


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
def test_partial_trailing_block_is_never_hashed(algorithm: str) -> None:
    """Only full blocks get hashes; extra tokens short of a block change nothing."""
    hasher = BlockHasher(16, algorithm, seed=SEED)
    full = list(range(32))
    assert len(hasher.hash_blocks(full)) == 2
    assert hasher.hash_blocks(full + [7] * 15) == hasher.hash_blocks(full)
    assert hasher.hash_blocks(list(range(15))) == []
    assert hasher.hash_blocks([]) == []


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
def test_identical_prompts_give_identical_hashes_and_shared_prefixes_share_hashes(algorithm: str) -> None:
    """Same tokens, same hashes; two prompts agree exactly on the blocks before they diverge."""
    hasher = BlockHasher(16, algorithm, seed=SEED)
    a = list(range(64))
    b = list(range(40)) + [9999] * 24
    assert hasher.hash_blocks(a) == hasher.hash_blocks(list(a))
    ha, hb = hasher.hash_blocks(a), hasher.hash_blocks(b)
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2] and ha[3] != hb[3]
    assert all(len(h) == 32 and isinstance(h, bytes) for h in ha)


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
def test_numpy_and_list_tokens_hash_the_same(algorithm: str) -> None:
    """Any integer dtype, contiguous or not, hashes as the same values as a list."""
    hasher = BlockHasher(8, algorithm, seed=SEED)
    values = [0, 1, 23, 24, 255, 256, 65535, 65536] * 4
    expected = hasher.hash_blocks(values)
    big = np.array(values + [2**32 - 1], dtype=np.uint64)
    assert hasher.hash_blocks(big)[:4] == expected
    for dtype in (np.uint32, np.int64, np.uint64, np.int32, ">u4"):
        assert hasher.hash_blocks(np.array(values, dtype=dtype)) == expected
    assert hasher.hash_blocks(np.repeat(np.array(values, dtype=np.uint32), 2)[::2]) == expected
    assert hasher.hash_blocks(tuple(values)) == expected
    assert hasher.hash_blocks([np.int64(v) for v in values]) == expected
    assert hasher.hash_blocks(np.array([v % 256 for v in values], dtype=np.uint8)) == hasher.hash_blocks(
        [v % 256 for v in values]
    )


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
def test_salt_changes_the_first_block_hash_and_therefore_the_whole_chain(algorithm: str) -> None:
    """A salt is an extra key of block 0 only, but every later hash chains through block 0's."""
    hasher = BlockHasher(16, algorithm, seed=SEED)
    prompt = list(range(64))
    plain = hasher.hash_blocks(prompt)
    salted = hasher.hash_blocks(prompt, cache_salt="tenant-a")
    assert salted[0] != plain[0]
    assert all(s != p for s, p in zip(salted, plain))
    assert hasher.hash_blocks(prompt, cache_salt="tenant-b")[0] != salted[0]
    assert hasher.hash_blocks(prompt, cache_salt="") == plain


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
def test_chunk_with_a_parent_does_not_see_the_salt(algorithm: str) -> None:
    """Blocks after block 0 carry no salt: a chunk from block 1 on depends only on its parent."""
    hasher = BlockHasher(16, algorithm, seed=SEED)
    prompt = list(range(64))
    salted = hasher.hash_blocks(prompt, cache_salt="tenant-a")
    chunk = hasher.hash_blocks(prompt[16:], parent=salted[0], start_block=1)
    assert chunk == salted[1:]
    assert hasher.hash_blocks(prompt[16:], parent=salted[0], start_block=1, cache_salt="other") == chunk


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
def test_hashing_in_chunks_equals_hashing_the_whole_prompt(algorithm: str) -> None:
    """Chunks continued with parent/start_block give the whole prompt's hashes, mm crossing chunks."""
    hasher = BlockHasher(16, algorithm, seed=SEED)
    prompt = list(range(1000, 1160))
    mm = [("img-a", 5, 40), ("img-b", 60, 50), ("img-c", 130, 3)]
    kwargs = {"cache_salt": "s", "lora": "l", "mm": mm}
    whole = hasher.hash_blocks(prompt, **kwargs)
    assert len(whole) == 10
    got = hasher.hash_blocks(prompt[:48], **kwargs)
    got += hasher.hash_blocks(prompt[48:112], parent=got[-1], start_block=3, **kwargs)
    got += hasher.hash_blocks(prompt[112:], parent=got[-1], start_block=7, **kwargs)
    assert got == whole


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
def test_multimodal_item_changes_only_blocks_it_overlaps_and_their_descendants(algorithm: str) -> None:
    """Blocks before an image keep their hashes; the image's blocks and everything after change."""
    hasher = BlockHasher(16, algorithm, seed=SEED)
    prompt = [7] * 80
    plain = hasher.hash_blocks(prompt)
    img_a = hasher.hash_blocks(prompt, mm=[("img-a", 35, 20)])
    img_b = hasher.hash_blocks(prompt, mm=[("img-b", 35, 20)])
    assert img_a[:2] == plain[:2]
    assert img_a[2] != plain[2] and img_a[2] != img_b[2]
    moved = hasher.hash_blocks(prompt, mm=[("img-a", 36, 20)])
    assert moved[:2] == plain[:2] and moved[2] != img_a[2]


# --------------------------------------------------------------------------- seeds


@pytest.mark.parametrize("algorithm", ["sha256", "sha256_cbor"])
def test_same_seed_gives_same_hashes_and_different_seeds_differ(algorithm: str) -> None:
    """Seeded hashers agree across instances (and processes); different seeds never collide here."""
    prompt = list(range(48))
    a = BlockHasher(16, algorithm, seed="alpha").hash_blocks(prompt)
    assert BlockHasher(16, algorithm, seed="alpha").hash_blocks(prompt) == a
    assert BlockHasher(16, algorithm, seed="beta").hash_blocks(prompt)[0] != a[0]
    assert BlockHasher(16, algorithm, seed=b"alpha").root != BlockHasher(16, algorithm, seed=b"beta").root


def test_unseeded_sha256_hashers_take_vllms_default_seed() -> None:
    """seed=None stands for vLLM's default seed "vllm-none-hash" under "sha256" too, as under "sha256_cbor": two
    unseeded hashers (two daemons) give a prompt the same hashes, which a router indexing both needs; the root
    follows the framing with that seed, so a seeded hasher's hashes are what they were."""
    prompt = list(range(32))
    first, second = BlockHasher(16), BlockHasher(16)
    assert first.root == second.root == BlockHasher(16, seed="vllm-none-hash").root
    assert first.hash_blocks(prompt) == second.hash_blocks(prompt) == raw_block_hashes(prompt, 16, b"vllm-none-hash")
    assert BlockHasher(16, seed="tenant-a").hash_blocks(prompt) != first.hash_blocks(prompt)


def test_raw_root_depends_on_block_size() -> None:
    """The same seed gives different roots for different block sizes under "sha256"."""
    assert BlockHasher(16, seed="s").root != BlockHasher(32, seed="s").root


# --------------------------------------------------------------------------- caller mistakes


@pytest.mark.parametrize(
    ("tokens", "shown"),
    [
        ([1, 2, -1, 4], "-1"),
        ([1, 2, 2**32, 4], "4294967296"),
        ([1, 2.0, 3, 4], "2.0"),
        ([1, "7", 3, 4], "'7'"),
        (np.array([3, -5, 1, 1], dtype=np.int64), "-5"),
        (np.array([3, 2**33, 1, 1], dtype=np.uint64), "8589934592"),
        (np.array([1.0, 2.0, 3.0, 4.0]), "float64"),
        (np.array(["a", "b", "c", "d"]), "<U1"),
        (np.zeros((2, 4), dtype=np.uint32), "shape"),
        ("abcd", "str"),
        (5, "int"),
    ],
)
def test_bad_tokens_raise_kvcache_error_naming_tokens(tokens: object, shown: str) -> None:
    """Negative, >= 2**32, float and string tokens are refused with the field and the value."""
    with pytest.raises(KVCacheError, match="tokens") as err:
        BlockHasher(4, seed="s").hash_blocks(tokens)
    assert shown in str(err.value)


@pytest.mark.parametrize("block_size", [0, -16, 1.5, "16", True, None])
def test_bad_block_size_raises(block_size: object) -> None:
    """block_size must be a positive int."""
    with pytest.raises(KVCacheError, match="block_size"):
        BlockHasher(block_size)


@pytest.mark.parametrize("algorithm", ["md5", "xxhash", "SHA256", ""])
def test_unknown_algorithm_raises(algorithm: str) -> None:
    """Only "sha256" and "sha256_cbor" exist."""
    with pytest.raises(KVCacheError, match="algorithm"):
        BlockHasher(16, algorithm)


def test_bad_seed_raises() -> None:
    """seed is bytes, str or None."""
    with pytest.raises(KVCacheError, match="seed"):
        BlockHasher(16, seed=1234)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"parent": b"short"}, "parent"),
        ({"parent": "x" * 32, "start_block": 1}, "parent"),
        ({"parent": bytes(32)}, "start_block"),
        ({"start_block": 2}, "parent"),
        ({"start_block": -1}, "start_block"),
        ({"cache_salt": b"bytes"}, "cache_salt"),
        ({"lora": 3}, "lora"),
        ({"mm": [("img", -1, 4)]}, "offset"),
        ({"mm": [("img", 0, 0)]}, "length"),
        ({"mm": [(123, 0, 4)]}, "identifier"),
        ({"mm": [("img", 0)]}, "mm"),
        ({"mm": [("a", 10, 4), ("b", 2, 4)]}, "overlaps"),
        ({"mm": [("a", 0, 10), ("b", 5, 4)]}, "overlaps"),
    ],
)
def test_bad_hash_blocks_arguments_raise_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    """Malformed parent, start_block, salt, LoRA and multimodal placeholders are refused."""
    with pytest.raises(KVCacheError, match=field):
        BlockHasher(4, seed="s").hash_blocks([1, 2, 3, 4], **kwargs)


@settings(max_examples=60, deadline=None)
@given(algorithm=st.sampled_from(["sha256", "sha256_cbor"]), block_size=st.sampled_from([1, 3, 16, 32, 64]),
       count=st.integers(0, 9), seed=st.integers(0, 2**32 - 1))
def test_hash_each_is_each_requests_next_block_hash(algorithm, block_size, count, seed):
    """hash_each (one C call for a decode step's full blocks) equals hash_blocks_packed of each block after its parent."""
    hasher = BlockHasher(block_size, algorithm, seed=b"each")
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 2**32, (count, block_size), dtype=np.uint32)
    parents = [rng.bytes(32) for _ in range(count)]
    want = b"".join(hasher.hash_blocks_packed(b, parent=p, start_block=1) for b, p in zip(blocks, parents))
    assert hasher.hash_each(blocks, b"".join(parents)) == want
    with pytest.raises(ValueError, match="parent"):
        native.each_raw(blocks.reshape(-1), block_size, b"\0" * (32 * count + 1))


def test_int32_tokens_read_as_the_same_uint32_ids_contiguous_or_strided():
    """int32 ids >= 0 convert without changing a value (a view when contiguous); a negative one is named."""
    ids = np.random.default_rng(5).integers(0, 2**31, size=64, dtype=np.int32)
    for tokens in (ids, ids[::2]):
        got = as_token_array(tokens)
        assert got.dtype == np.uint32 and got.flags.c_contiguous
        assert got.tolist() == tokens.tolist()
    with pytest.raises(KVCacheError, match=r"prompt: token id -3 is outside \[0, 2\*\*32\)"):
        as_token_array(np.array([1, -3], dtype=np.int32), "prompt")

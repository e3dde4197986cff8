"""Prefix cache: chained block hashes (`BlockHasher`) that identify cached full blocks.

A block's hash covers its parent's hash, its tokens and its extra keys (cache salt, LoRA,
multimodal items), so equal hashes mean equal prefixes:

    tokens   | t0 .. t15 | t16 .. t31 | t32 .. t47 | t48 t49   (partial: never hashed)
    hashes   |    h0     |    h1      |    h2      |
    h0 = H(root, block 0, extra 0), h1 = H(h0, block 1, extra 1), ...

The per-block loop runs in C (`_chainhash`); `_reference_chain_raw` / `_reference_chain_cbor`
are the hashlib baseline it is tested against and the fallback when the extension is missing.
"""
from __future__ import annotations

import array
import hashlib
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, NewType, Tuple, Union

import numpy as np

from kvcache.allocator import _hashtable, _tables
from kvcache.allocator.errors import KVCacheError

if TYPE_CHECKING:
    from collections.abc import Callable

try:
    from kvcache.allocator import _chainhash
except ImportError:  # a broken or missing build; tests assert the native module imports
    _chainhash = None

BlockHash = NewType("BlockHash", bytes)

ALGORITHMS = ("sha256", "sha256_cbor")
HASH_BYTES = 32
_RAW_ROOT_TAG = b"kvcache-sha256-v1"
VLLM_NONE_HASH_SEED = "vllm-none-hash"  # vLLM's root seed when PYTHONHASHSEED is unset; both algorithms' default
LoRA = Union[str, Tuple[str, str]]  # a LoRA adapter as hashes key it: its name, or (name, path)
_UINT32_LIMIT = 2**32

assert array.array("I").itemsize == 4, "array('I') must hold uint32 on this platform"


class MMPlaceholder(NamedTuple):
    """A multimodal item: its identifier (e.g. the image's content hash) and token range.

    `offset` and `length` are token positions in the whole request; the item covers
    [offset, offset + length). Items of one request are sorted by offset and never overlap.
    """

    identifier: str
    offset: int
    length: int


# --------------------------------------------------------------------------- canonical CBOR


def cbor_encode(obj: object) -> bytes:
    """Canonical CBOR (RFC 8949 shortest form) of None/bool/int/str/bytes/tuple/list.

    Byte-identical to `cbor2.dumps(obj, canonical=True)` for these types, so hashes over it
    match vLLM's `sha256_cbor` without cbor2 at run time.
    """
    out = bytearray()
    _cbor_into(out, obj)
    return bytes(out)


def _cbor_head(out: bytearray, major: int, value: int) -> None:
    """Append a CBOR head: major type and argument in the shortest form."""
    mt = major << 5
    if value < 24:
        out.append(mt | value)
    elif value < 0x100:
        out += bytes((mt | 24, value))
    elif value < 0x10000:
        out.append(mt | 25)
        out += value.to_bytes(2, "big")
    elif value < 0x100000000:
        out.append(mt | 26)
        out += value.to_bytes(4, "big")
    else:
        out.append(mt | 27)
        out += value.to_bytes(8, "big")


def _cbor_into(out: bytearray, obj: object) -> None:
    """Append the canonical CBOR of obj to out."""
    if obj is None:
        out.append(0xF6)
    elif obj is True:
        out.append(0xF5)
    elif obj is False:
        out.append(0xF4)
    elif isinstance(obj, int):
        if not -(2**64) <= obj < 2**64:
            raise KVCacheError(f"extra key {obj} does not fit a 64-bit CBOR integer")
        if obj >= 0:
            _cbor_head(out, 0, obj)
        else:
            _cbor_head(out, 1, -1 - obj)
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        _cbor_head(out, 3, len(data))
        out += data
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        data = bytes(obj)
        _cbor_head(out, 2, len(data))
        out += data
    elif isinstance(obj, (tuple, list)):
        _cbor_head(out, 4, len(obj))
        for item in obj:
            _cbor_into(out, item)
    else:
        raise KVCacheError(f"cannot CBOR-encode an extra key of type {type(obj).__name__}")


# --------------------------------------------------------------------------- reference chains


def _reference_chain_raw(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    parent: bytes,
    extras: Sequence[bytes | None] | None = None,
    *,
    split: bool = False,
) -> bytes | list[bytes]:
    """hashlib baseline of `_chainhash.chain_raw`: SHA256(prev || tokens as uint32 LE || extra)."""
    toks = np.asarray(tokens, dtype="<u4")
    prev = bytes(parent)
    digests = []
    for i in range(len(toks) // block_size):
        extra = (extras[i] if extras is not None else None) or b""
        prev = hashlib.sha256(prev + toks[i * block_size : (i + 1) * block_size].tobytes() + extra).digest()
        digests.append(prev)
    return digests if split else b"".join(digests)


def _reference_chain_cbor(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    parent: bytes,
    extras: Sequence[bytes | None] | None = None,
    *,
    split: bool = False,
) -> bytes | list[bytes]:
    """hashlib baseline of `_chainhash.chain_cbor`: SHA256(cbor((prev, tuple(tokens), extra)))."""
    toks = [int(t) for t in tokens]
    prev = bytes(parent)
    digests = []
    for i in range(len(toks) // block_size):
        extra = extras[i] if extras is not None else None
        head = cbor_encode(prev) + cbor_encode(tuple(toks[i * block_size : (i + 1) * block_size]))
        prev = hashlib.sha256(b"\x83" + head + (b"\xf6" if extra is None else extra)).digest()
        digests.append(prev)
    return digests if split else b"".join(digests)



# --------------------------------------------------------------------------- BlockHasher


class BlockHasher:
    """Chained hashes of a request's full blocks for the prefix cache; immutable, thread-safe.

    algorithm "sha256" (default, fast): h_i = SHA256(h_{i-1} || block_i as uint32 LE || extra_i),
    extra_i being the canonical CBOR of [salt, lora, [[mm_id, mm_offset - block_start], ...]]
    when the block has any of them, else nothing (lora: its name, or [name, path]). root =
    SHA256(b"kvcache-sha256-v1" || block_size as uint32 LE || seed), seed None standing for
    vLLM's default seed "vllm-none-hash" as under sha256_cbor: hashers (and daemons) of one
    block size agree on a prompt's hashes unless given different seeds.

    algorithm "sha256_cbor": byte-identical to what vLLM 0.33 computes with ``sha256_cbor``:
    h_i = SHA256(cbor2.dumps((h_{i-1}, tuple(block_i), extra_keys_i), canonical=True)) with
    vLLM's tagged extra keys (``_vllm_extra_keys``), and root = vLLM's NONE_HASH:
    sha256_cbor(seed), seed being the PYTHONHASHSEED string vLLM runs with, or vLLM's
    default "vllm-none-hash" when seed is None. vLLM's prompt-embeds keys are not produced.
    Checked against hashes vLLM 0.33 computed (tests/vectors/vllm-0.33-sha256_cbor.json).
    """

    __slots__ = ("block_size", "algorithm", "root", "native", "_chain")

    def __init__(self, block_size: int, algorithm: str = "sha256", seed: bytes | str | None = None) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
            raise KVCacheError(f"block_size must be a positive int, got {block_size!r}")
        if algorithm not in ALGORITHMS:
            raise KVCacheError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {algorithm!r}")
        if seed is not None and not isinstance(seed, (bytes, str)):
            raise KVCacheError(f"seed must be bytes, str or None, got {type(seed).__name__}")
        self.block_size: int = int(block_size)
        self.algorithm: str = algorithm
        self.root: BlockHash = _make_root(self.block_size, algorithm, seed)
        self.native: bool = _chainhash is not None
        self._chain: Callable[..., bytes | list[bytes]] = _pick_chain(algorithm, self.native)

    def __getstate__(self) -> dict[str, object]:
        """What a journal snapshot saves: the geometry, algorithm and root (the chain function is looked up again)."""
        return {"block_size": self.block_size, "algorithm": self.algorithm, "root": self.root}

    def __setstate__(self, state: dict[str, object]) -> None:
        for name in ("block_size", "algorithm", "root"):
            object.__setattr__(self, name, state[name])
        if self.algorithm not in ALGORITHMS or not isinstance(self.root, bytes) or len(self.root) != HASH_BYTES:
            raise KVCacheError(f"hasher: a saved state of algorithm {self.algorithm!r} is not valid")
        self.native = _chainhash is not None
        self._chain = _pick_chain(self.algorithm, self.native)

    def __repr__(self) -> str:
        return (
            f"BlockHasher(block_size={self.block_size}, algorithm={self.algorithm!r}, "
            f"root={self.root.hex()[:16]}…, native={self.native})"
        )

    def hash_blocks(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        cache_salt: str | None = None,
        lora: LoRA | None = None,
        mm: Sequence[MMPlaceholder | tuple[str, int, int]] | None = None,
        parent: bytes | None = None,
        start_block: int = 0,
    ) -> list[BlockHash]:
        """One 32-byte hash per full block of tokens; a trailing partial block is not hashed.

        `mm` lists the request's multimodal items as (identifier, offset, length) in request
        token positions (`MMPlaceholder`), sorted and disjoint; each block's extra keys name
        the items overlapping it. To continue a request chunk by chunk, pass the last hash so
        far as `parent` and the request's index of the chunk's first block as `start_block`
        (>= 1): the salt belongs to block 0 of the request only, and `mm` offsets still count
        from the request's first token. An empty `cache_salt` counts as none, as in vLLM.
        """
        return self._hash(tokens, cache_salt, lora, mm, parent, start_block, split=True)  # type: ignore[return-value]

    def hash_blocks_packed(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        cache_salt: str | None = None,
        lora: LoRA | None = None,
        mm: Sequence[MMPlaceholder | tuple[str, int, int]] | None = None,
        parent: bytes | None = None,
        start_block: int = 0,
    ) -> bytes:
        """``hash_blocks`` as one ``bytes`` of ``32 * num_full_blocks``: no object per block (what PrefixIndex takes)."""
        return self._hash(tokens, cache_salt, lora, mm, parent, start_block, split=False)  # type: ignore[return-value]

    def hash_each(self, blocks: np.ndarray, parents: bytes) -> bytes:
        """Packed hashes of full blocks of different requests: row j of ``blocks`` (uint32 ``[m, block_size]``) after parent j.

        ``parents`` packs one 32-byte parent per row (the root for a request's block 0).
        A decode step's newly full blocks, one per request; none may carry extra keys
        (cache salt at block 0, LoRA, multimodal items): the caller checks.
        """
        if self.native:
            each = _chainhash.each_raw if self.algorithm == "sha256" else _chainhash.each_cbor
            return each(np.ascontiguousarray(blocks, dtype=np.uint32).reshape(-1), self.block_size, parents)
        chain, bs = self._chain, self.block_size
        return b"".join([chain(row, bs, parents[j * HASH_BYTES:(j + 1) * HASH_BYTES], None, split=False)
                         for j, row in enumerate(blocks)])

    def _hash(
        self,
        tokens: Sequence[int] | np.ndarray,
        cache_salt: str | None,
        lora: LoRA | None,
        mm: Sequence[MMPlaceholder | tuple[str, int, int]] | None,
        parent: bytes | None,
        start_block: int,
        *,
        split: bool,
    ) -> list[BlockHash] | bytes:
        plain = (cache_salt is None and lora is None and mm is None and parent is None and type(start_block) is int
                 and start_block == 0)  # a prompt without extra keys, from the root: the chain call alone
        if plain and type(tokens) is list and self.native:
            hashed = self._chain(tokens, self.block_size, self.root, None, split=split)  # from the items, or None
            if hashed is not None:
                return hashed
        toks = as_token_array(tokens)
        if plain:
            if toks.size < self.block_size:
                return [] if split else b""
            return self._chain(toks, self.block_size, self.root, None, split=split)
        if isinstance(start_block, bool) or not isinstance(start_block, (int, np.integer)) or start_block < 0:
            raise KVCacheError(f"start_block must be an int >= 0, got {start_block!r}")
        start_block = int(start_block)
        if parent is None:
            if start_block:
                raise KVCacheError(f"parent is required when start_block is {start_block} (> 0)")
            parent = self.root
        else:
            if not isinstance(parent, (bytes, bytearray)) or len(parent) != HASH_BYTES:
                raise KVCacheError(f"parent must be {HASH_BYTES} bytes, got {_describe(parent)}")
            if start_block == 0:
                raise KVCacheError("start_block must be >= 1 when parent is given (block 0 has no parent)")
            parent = bytes(parent)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise KVCacheError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        lora = check_lora(lora)
        items = _check_mm(mm)
        num_blocks = len(toks) // self.block_size
        if num_blocks == 0:
            return [] if split else b""
        extras = _block_extras(self.algorithm, self.block_size, num_blocks, start_block, cache_salt, lora, items)
        return self._chain(toks, self.block_size, parent, extras, split=split)


def _pick_chain(algorithm: str, native: bool) -> Callable[..., bytes | list[bytes]]:
    """The chain function for an algorithm: the C loop, or the hashlib reference without it."""
    if algorithm == "sha256":
        return _chainhash.chain_raw if native else _reference_chain_raw
    return _chainhash.chain_cbor if native else _reference_chain_cbor


def _make_root(block_size: int, algorithm: str, seed: bytes | str | None) -> BlockHash:
    """The hash standing in for block 0's parent (vLLM's NONE_HASH for sha256_cbor).

    Without a seed both algorithms take vLLM 0.33's default seed, as vLLM's init_none_hash does:
    hash_fn(PYTHONHASHSEED) where it is set, else (for a cryptographic hash) hash_fn("vllm-none-hash"),
    so processes serving one model agree on its hashes and a router indexing several finds them equal.
    """
    if seed is None:
        seed = VLLM_NONE_HASH_SEED
    if algorithm == "sha256_cbor":
        return BlockHash(hashlib.sha256(cbor_encode(seed)).digest())
    seed_bytes = seed.encode("utf-8") if isinstance(seed, str) else seed
    return BlockHash(hashlib.sha256(_RAW_ROOT_TAG + block_size.to_bytes(4, "little") + seed_bytes).digest())


def _describe(value: object) -> str:
    """A short description of a bad argument for error messages."""
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes"
    return type(value).__name__


def as_token_array(tokens: Sequence[int] | np.ndarray, field: str = "tokens") -> np.ndarray:
    """Tokens as a C-contiguous uint32 array, or KVCacheError naming ``field`` and the first bad value.

    The one token check of the package (hasher, manager, wire protocol). uint32
    arrays pass without a scan, int32 ones as a view after one; lists of ints
    convert and range-check in one C pass.
    """
    if type(tokens) is np.ndarray:  # uint32, or int32 ids >= 0, 1-D and contiguous: one C call
        usual = _tables.token_array(tokens)
        if usual is not None:
            return usual
    elif type(tokens) is list:  # exact ints in range: one C pass
        usual = _tables.token_list(tokens)
        if usual is not None:
            return usual
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise KVCacheError(f"{field}: expected a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}")
        if tokens.dtype == np.uint32:
            return np.ascontiguousarray(tokens)
        # Narrow unsigned ids cannot leave the range; narrow signed ones can only be negative.
        narrow = tokens.dtype.itemsize <= 4
        if tokens.size and not (narrow and tokens.dtype.kind == "u"):
            bounds = _tables.bounds(tokens)  # one C pass; None for a strided array or a sum past int64
            low, high = bounds[:2] if bounds is not None else (int(tokens.min()), int(tokens.max()))
            if low < 0 or high >= _UINT32_LIMIT:
                bad = int(tokens[(tokens < 0) | (tokens > _UINT32_LIMIT - 1)][0])
                raise KVCacheError(f"{field}: token id {bad} is outside [0, 2**32)")
        if tokens.dtype == np.int32 and tokens.flags.c_contiguous:  # ids checked >= 0: the same bits, no copy
            return tokens.view(np.uint32)
        return tokens.astype(np.uint32)
    if isinstance(tokens, (str, bytes, bytearray)) or not isinstance(tokens, Sequence):
        raise KVCacheError(f"{field}: expected an integer array or a list of integers, got {type(tokens).__name__}")
    try:
        return np.frombuffer(array.array("I", tokens), dtype=np.uint32)
    except (TypeError, OverflowError, ValueError):
        pass
    for tok in tokens:  # error path only: find the value to name
        if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
            raise KVCacheError(f"{field}: expected integers, got {tok!r}") from None
        if not 0 <= tok < _UINT32_LIMIT:
            raise KVCacheError(f"{field}: token id {tok} is outside [0, 2**32)") from None
    raise KVCacheError(f"{field}: could not be read as uint32 token ids")


def _check_mm(mm: Sequence[MMPlaceholder | tuple[str, int, int]] | None) -> list[MMPlaceholder]:
    """Validated multimodal placeholders: str ids, offset >= 0, length >= 1, sorted, disjoint."""
    if mm is None:
        return []
    if isinstance(mm, (str, bytes)) or not isinstance(mm, Sequence):
        raise KVCacheError(f"mm must be a sequence of (identifier, offset, length), got {type(mm).__name__}")
    items: list[MMPlaceholder] = []
    end_prev = 0
    for i, item in enumerate(mm):
        if not isinstance(item, Sequence) or isinstance(item, (str, bytes)) or len(item) != 3:
            raise KVCacheError(f"mm[{i}] must be (identifier, offset, length), got {item!r}")
        ident, offset, length = item
        if not isinstance(ident, str):
            raise KVCacheError(f"mm[{i}].identifier must be a str, got {type(ident).__name__}")
        for name, value, low in (("offset", offset, 0), ("length", length, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise KVCacheError(f"mm[{i}].{name} must be an int >= {low}, got {value!r}")
        if offset < end_prev:
            raise KVCacheError(
                f"mm[{i}] at offset {offset} overlaps or precedes the item before it (ends at {end_prev})"
            )
        end_prev = int(offset) + int(length)
        items.append(MMPlaceholder(ident, int(offset), int(length)))
    return items


def _block_extras(
    algorithm: str,
    block_size: int,
    num_blocks: int,
    start_block: int,
    cache_salt: str | None,
    lora: LoRA | None,
    mm: list[MMPlaceholder],
) -> list[bytes | None] | None:
    """Per-block pre-encoded extra keys (None = no extra), or None when no block has any.

    Only blocks that overlap a multimodal item, and block 0 with a salt, get their own
    encoding; the rest share one object, so a LoRA-only request costs no per-block work.
    """
    # Block b (request index) overlaps item [o, o+l) when b*bs < o+l and (b+1)*bs > o,
    # the same set vLLM's _gen_mm_extra_hash_keys walks for sorted, disjoint items.
    mm_keys: dict[int, list[tuple[str, int]]] = {}
    first_token = start_block * block_size
    end_token = (start_block + num_blocks) * block_size
    for ident, offset, length in mm:
        if offset + length <= first_token or offset >= end_token:
            continue
        first = max(offset // block_size, start_block)
        last = min((offset + length - 1) // block_size, start_block + num_blocks - 1)
        for b in range(first, last + 1):
            mm_keys.setdefault(b - start_block, []).append((ident, offset - b * block_size))
    salt = cache_salt if (cache_salt and start_block == 0) else None
    if salt is None and lora is None and not mm_keys:
        return None
    special = set(mm_keys)
    if salt is not None:
        special.add(0)
    if algorithm == "sha256_cbor":
        base = cbor_encode(_vllm_extra_keys(lora, [], None)) if lora is not None else None
    else:
        base = cbor_encode([None, lora, []]) if lora is not None else None
    extras: list[bytes | None] = [base] * num_blocks
    for i in special:
        keys = mm_keys.get(i, [])
        block_salt = salt if i == 0 else None
        if algorithm == "sha256_cbor":
            extras[i] = cbor_encode(_vllm_extra_keys(lora, keys, block_salt))
        else:
            extras[i] = cbor_encode([block_salt, lora, [list(k) for k in keys]])
    return extras


def _vllm_extra_keys(lora: LoRA | None, mm_keys: list[tuple[str, int]], salt: str | None) -> tuple[object, ...]:
    """vLLM 0.33's extra keys of one block, tagged: the LoRA, then each overlapping multimodal item, then the salt.

    vLLM 0.33 (vllm/v1/core/kv_cache_utils.py, generate_block_hash_extra_keys) keys a LoRA by
    ``("lora", lora_name, lora_path)``, an item by ``("mm", identifier, offset - block_start)`` and the
    salt (block 0 only) by ``("cache_salt", salt)``. A LoRA given by name alone is ``("lora", name)``:
    never equal to any (name, path) key. vLLM's prompt-embeds digests are not produced.
    """
    keys: list[object] = []
    if lora is not None:
        keys.append(("lora", lora) if isinstance(lora, str) else ("lora", *lora))
    keys.extend(("mm", ident, offset) for ident, offset in mm_keys)
    if salt is not None:
        keys.append(("cache_salt", salt))
    return tuple(keys)


def check_lora(lora: object, field: str = "lora") -> LoRA | None:
    """A LoRA as the hasher keys it: None, its name, or (name, path) (a list of two str is taken as the pair).

    The path tells two adapters under one name apart, as vLLM keys them; a name
    alone is its own key, never equal to a (name, path).
    """
    if lora is None or isinstance(lora, str):
        return lora
    if isinstance(lora, (tuple, list)) and len(lora) == 2 and all(isinstance(x, str) for x in lora):
        return (lora[0], lora[1])
    raise KVCacheError(f"{field}: must be a LoRA name (str) or (name, path), got {_describe(lora)}")


# --------------------------------------------------------------------------- PrefixIndex


_PACKED = np.dtype(f"V{HASH_BYTES}")  # one packed hash as a numpy item
PRESIZED_ENTRIES = 1 << 20  # PrefixIndex sizes its table for this many hashes at most before it grows
# A hash-table slot (allocator/_hashtable.c): 32 bits of the key's mixed hash and the entry holding the key
# (-1 = empty); the key itself is the entry's hash_of.
SLOT_DTYPE = np.dtype([("tag", "<u4"), ("entry", "<i4")])


class Inserted(NamedTuple):
    """What ``PrefixIndex.insert`` changed: pairs newly registered, and hashes new to the index."""

    added: np.ndarray  # bool [n, rows]: row r now holds hash i with the given block
    new: np.ndarray  # bool [n]: hash i was not in the index before
    everything: bool = False  # every pair added and every hash new (an admit without a prefix hit)


class RemovedBlocks(NamedTuple):
    """(row, block) pairs the index dropped and the hash each held (parallel, pair order).

    ``hashes`` holds one packed hash per pair (numpy ``V32`` items; ``bytes(hashes[i])`` is
    one); ``gone`` the hashes no row holds any more, which left the index.
    """

    rows: np.ndarray
    blocks: np.ndarray
    hashes: np.ndarray
    gone: np.ndarray


class PrefixIndex:
    """Chained block hash → the block each row holds for it (``-1`` where a row has none).

    Hashes travel packed: ``bytes`` of ``32 * n`` (what ``BlockHasher.hash_blocks_packed``
    returns), looked up in batches by a C hash table, so no per-block Python object is made.
    The index knows nothing of reference counts or policies: the manager asks which blocks
    a chain maps to and reports which (row, block) pairs gained or lost their KV. A hash
    lives while at least one row holds a block for it; a pair holds at most one hash.
    """

    def __init__(self, num_rows: int, num_blocks: int) -> None:
        self._rows = num_rows
        self._seed = int.from_bytes(os.urandom(8), "little")
        # Sized up front for a hash per block (what a uniform pool holds when full, up to PRESIZED_ENTRIES),
        # so filling the cache never stops a step to rebuild the table or grow the entry arrays.
        entries = max(64, min(num_blocks, PRESIZED_ENTRIES))
        capacity = 1 << (2 * entries - 1).bit_length()
        self._slots = _empty_slots(capacity)
        self._hash_of = np.zeros(entries, dtype=_PACKED)  # entry -> hash
        self._blocks = np.full((entries, num_rows), -1, dtype=np.int32)  # entry -> block per row
        self._holders = np.zeros(entries, dtype=np.int32)  # entry -> rows holding a block
        self._entry_at = np.full((num_rows, num_blocks), -1, dtype=np.int32)  # (row, block) -> entry
        self._num_entries = 0  # entry ids ever handed out: [0, _num_entries)
        self._spare = np.empty(64, dtype=np.intp)  # stack of unused entry ids below _num_entries
        self._num_spare = 0
        self._count = 0

    def __len__(self) -> int:
        """Number of hashes with at least one row's block."""
        return self._count

    def __contains__(self, block_hash: object) -> bool:
        if not isinstance(block_hash, bytes) or len(block_hash) != HASH_BYTES:
            return False
        return len(self._find(block_hash, stop_at_miss=True)) == 1

    def any_known(self, hashes: bytes) -> bool:
        """Whether any of the packed hashes is in the index."""
        return bool((self._find(hashes, stop_at_miss=False) >= 0).any())

    def match(self, hashes: bytes) -> np.ndarray:
        """Blocks (int32 ``[k, num_rows]``, -1 = row lacks it) of the longest run of known leading hashes."""
        entries = self._find(hashes, stop_at_miss=True)
        return self._blocks[entries] if entries.size else self._blocks[:0]  # a miss: no gather

    def match_ready(self, hashes: bytes, ready: np.ndarray) -> np.ndarray:
        """Blocks (int32 ``[k, num_rows]``) of the longest run of leading hashes some row holds in a block that
        ``ready`` (bool, per block) marks; -1 where a row lacks the hash or its block is unmarked (a lower tier's
        findable copies: ``match`` and the mask in one C pass)."""
        found = _hashtable.find_ready(self._slots, self._hash_of, self._seed, hashes, self._blocks, ready)
        return np.frombuffer(found, dtype=np.int32).reshape(-1, self._rows)

    def blocks_of(self, hashes: bytes) -> np.ndarray:
        """Blocks (int32 ``[n, num_rows]``, -1 = row lacks it) of every packed hash, found or not (no run cut)."""
        entries = self._find(hashes, stop_at_miss=False)
        out = self._blocks[np.maximum(entries, 0)]
        out[entries < 0] = -1
        return out

    def hashes_at(self, rows: np.ndarray, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The packed hash (``V32``) each (row, block) pair holds, and whether it holds one (bool)."""
        entries = self._entry_at[np.asarray(rows, dtype=np.intp), np.asarray(blocks, dtype=np.intp)]
        return self._hash_of[np.maximum(entries, 0)], entries >= 0

    def insert(self, hashes: bytes, blocks: np.ndarray) -> Inserted:
        """Record that row r's block ``blocks[i, r]`` (int32 ``[n, rows]``, -1 = none) holds hash i.

        A row that already holds a block for a hash keeps it (the new block stays
        unregistered, a duplicate). Hashes in one call must be distinct (a chain's are).
        Returns the pairs newly registered (the caller marks them cached) and which hashes are new.
        """
        if len(hashes) == HASH_BYTES:
            return self._insert_one(hashes, blocks[0])
        if self._put_new(hashes, blocks, fresh_only=True):
            # Every hash new and every row holding a block (an admit's blocks past its hit): no merging.
            n = len(hashes) // HASH_BYTES
            return Inserted(np.ones((n, self._rows), dtype=bool), np.ones(n, dtype=bool), True)
        found = self._find(hashes, stop_at_miss=False)
        entries = found.astype(np.intp)
        fresh = np.flatnonzero(entries < 0)
        packed = np.frombuffer(hashes, dtype=_PACKED)
        if fresh.size:
            new_ids = self._take_entries(fresh.size)
            entries[fresh] = new_ids
            self._hash_of[new_ids] = packed[fresh]
        added = (self._blocks[entries] < 0) & (blocks >= 0)
        i, r = np.nonzero(added)
        b = blocks[i, r]
        taken = self._entry_at[r, b]
        assert (taken < 0).all(), f"block {b[taken >= 0][0]} of row {r[taken >= 0][0]} already holds a hash"
        self._blocks[entries[i], r] = b
        self._entry_at[r, b] = entries[i]
        self._holders[entries] += added.sum(axis=1, dtype=np.int32)
        new = np.zeros(len(entries), dtype=bool)
        if fresh.size:
            kept = self._holders[entries[fresh]] > 0
            if not kept.all():
                self._push_spare(entries[fresh[~kept]])
                fresh = fresh[kept]
            self._add_keys(entries[fresh], packed[fresh])
            new[fresh] = True
        return Inserted(added, new)

    def insert_new(self, hashes: bytes, blocks: np.ndarray) -> None:
        """``insert`` of distinct hashes, none in the index, each held by a block on every row (``blocks >= 0``).

        A decode step's newly full blocks once ``any_known`` said none is known:
        no lookup and no duplicate handling; every pair is newly registered.
        """
        self._put_new(hashes, blocks, fresh_only=False)

    def _put_new(self, hashes: bytes, blocks: np.ndarray, *, fresh_only: bool) -> bool:
        """``insert_new``'s one C pass; with ``fresh_only`` it first checks that no hash is known and no block
        is -1, and returns False, changing nothing, where one is (the caller takes the general path)."""
        count = len(hashes) // HASH_BYTES
        if count == 0:
            return True
        entries = self._take_entries(count)
        self._reserve_keys(count)
        try:  # checks every pair is free (AssertionError, nothing written), then writes and keys
            added = _hashtable.insert_new(
                self._slots, self._seed, hashes, entries.astype(np.int64, copy=False),
                np.ascontiguousarray(blocks, dtype=np.int32), self._hash_of, self._blocks, self._entry_at,
                self._holders, fresh_only)
        except AssertionError:
            self._push_spare(entries[::-1])
            raise
        if added < 0:
            self._push_spare(entries[::-1])
            return False
        self._count += added
        return True

    def _insert_one(self, block_hash: bytes, blocks: np.ndarray) -> Inserted:
        """``insert`` of a single hash (a decode step filling one block) with scalar steps, not array passes."""
        entry = int(self._find(block_hash, stop_at_miss=False)[0])
        new = entry < 0
        if new:
            if self._num_spare:
                self._num_spare -= 1
                entry = int(self._spare[self._num_spare])
            else:
                entry = int(self._take_entries(1)[0])
            self._hash_of[entry] = np.frombuffer(block_hash, dtype=_PACKED)[0]
        added = (self._blocks[entry] < 0) & (blocks >= 0)
        rows = np.flatnonzero(added)
        if rows.size:
            b = blocks[rows]
            assert (self._entry_at[rows, b] < 0).all(), f"a block of rows {rows.tolist()} already holds a hash"
            self._blocks[entry, rows] = b
            self._entry_at[rows, b] = entry
            self._holders[entry] += rows.size
        if new:
            if rows.size:
                self._add_keys(np.array([entry], dtype=np.intp), np.frombuffer(block_hash, dtype=_PACKED))
            else:
                self._push_spare(np.array([entry], dtype=np.intp))
        return Inserted(added[None, :], np.array([new and rows.size > 0]))

    def remove(self, rows: np.ndarray, blocks: np.ndarray) -> RemovedBlocks:
        """Forget what the given distinct (row, block) pairs hold (their KV is about to be overwritten).

        Pairs holding no hash are ignored. A hash no row holds any more is gone.
        """
        rows = np.asarray(rows, dtype=np.intp).ravel()
        blocks = np.asarray(blocks, dtype=np.intp).ravel()
        entries = self._entry_at[rows, blocks]
        held = entries >= 0
        if not held.all():
            rows, blocks, entries = rows[held], blocks[held], entries[held]
        hashes = self._hash_of[entries]
        gone = bytearray(entries.size * HASH_BYTES)
        count = self._drop(rows, blocks, gone)
        return RemovedBlocks(rows.astype(np.int32), blocks.astype(np.int32), hashes,
                             np.frombuffer(gone, dtype=_PACKED)[:count])

    def remove_gone(self, rows: np.ndarray, blocks: np.ndarray) -> int:
        """``remove`` of an eviction's pairs, answering only how many hashes left the index."""
        return self._drop(rows, blocks)

    def _drop(self, rows: np.ndarray, blocks: np.ndarray, gone: bytearray | None = None) -> int:
        """``remove``'s work in one C pass: the pairs' hashes dropped, those no row holds leave the index (their
        hashes written to ``gone``, in order, if given); returns how many left."""
        rows = np.ascontiguousarray(rows, dtype=np.int32).ravel()
        blocks = np.ascontiguousarray(blocks, dtype=np.int32).ravel()
        self.reserve(0, rows.size)
        arrays = (*self._c_arrays(), rows, blocks) + (() if gone is None else (gone,))
        self._num_spare, count = _tables.drop_gone(*arrays)
        self._count -= count
        return count

    def clear(self) -> int:
        """Forget everything; returns how many hashes there were."""
        count = self._count
        self._slots["entry"] = -1
        self._blocks[:] = -1
        self._holders[:] = 0
        self._entry_at[:] = -1
        self._num_spare = 0
        self._push_spare(np.arange(self._num_entries - 1, -1, -1, dtype=np.intp))
        self._count = 0
        return count

    def held_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (row, block) pair holding a hash, row-major (int32)."""
        rows, blocks = np.nonzero(self._entry_at >= 0)
        return rows.astype(np.int32), blocks.astype(np.int32)

    def check_integrity(self) -> None:
        """Raise AssertionError with the numbers if the hash table and block maps disagree."""
        n = self._num_entries
        live = np.sort(self._live_entries())
        spare = np.sort(self._spare[: self._num_spare])
        assert live.size == self._count, f"table holds {live.size} hashes, count says {self._count}"
        assert np.unique(spare).size == spare.size, "spare entry listed twice"
        assert np.intersect1d(live, spare).size == 0, "spare entry still in the table"
        assert live.size + spare.size == n, f"{live.size} live + {spare.size} spare != {n} entries"
        if live.size:
            found = self._find(self._hash_of[live].tobytes(), stop_at_miss=False)
            assert (found == live).all(), "a live entry's hash does not find the entry"
        holders = (self._blocks[:n] >= 0).sum(axis=1)
        assert (holders == self._holders[:n]).all(), "holder counts disagree with blocks"
        assert (holders[live] > 0).all(), "a live hash is held by no row"
        assert (holders[spare] == 0).all(), "a spare entry still holds blocks"
        e, r = np.nonzero(self._blocks[:n] >= 0)
        assert (self._entry_at[r, self._blocks[e, r]] == e).all(), "entry_at disagrees with blocks"
        pairs = int((self._entry_at >= 0).sum())
        assert pairs == e.size, f"{pairs} pairs hold a hash, entries list {e.size}"

    def _find(self, hashes: bytes, *, stop_at_miss: bool) -> np.ndarray:
        """Entry id (int32) of each packed hash, -1 if absent; with stop_at_miss only the leading hits."""
        return np.frombuffer(
            _hashtable.find(self._slots, self._hash_of, self._seed, hashes, stop_at_miss), dtype=np.int32
        )

    def _add_keys(self, entries: np.ndarray, packed: np.ndarray) -> None:
        """Put ``entries`` under their hashes (``V32`` array), growing the table to keep its load <= 1/2."""
        self._reserve_keys(entries.size)
        self._count += _hashtable.insert(self._slots, self._hash_of, self._seed, packed.tobytes(),
                                         entries.astype(np.int32).tobytes())

    def _reserve_keys(self, extra: int) -> None:
        """Grow (and rebuild) the table if ``extra`` more keys would push its load past 1/2."""
        needed = 2 * (self._count + extra)
        if needed <= self._slots.size:
            return
        self._count = self._rebuild_table(1 << (needed - 1).bit_length(), self._live_entries())

    def _rebuild_table(self, capacity: int, live: np.ndarray) -> int:
        """A fresh table of ``capacity`` slots holding entries ``live`` (their keys from hash_of); returns their count."""
        self._slots = _empty_slots(capacity)
        return _hashtable.insert(self._slots, self._hash_of, self._seed, self._hash_of[live].tobytes(),
                                 live.astype(np.int32).tobytes())

    def _live_entries(self) -> np.ndarray:
        """Entry ids (intp) the hash table holds, in slot order."""
        entries = self._slots["entry"]
        return entries[entries >= 0].astype(np.intp)

    def _c_arrays(self) -> tuple:
        """What the C passes over the index take after the pool's arrays, in their order: the table, its seed, the
        entry arrays (``_hashtable.h``'s ``open_index``), the spare stack and its count. Read per call: the arrays
        grow."""
        return (self._slots, self._seed, self._hash_of, self._blocks, self._entry_at, self._holders, self._spare,
                self._num_spare)

    def reserve(self, keys: int, spare: int) -> None:
        """Room for ``keys`` more hashes (table and entry arrays) and ``spare`` more spare ids, without changing
        what the index holds: what a C pass that inserts and drops hashes itself needs beforehand."""
        if (2 * (self._count + keys) <= self._slots.size and self._num_entries + keys <= len(self._holders)
                and self._num_spare + spare <= self._spare.size):
            return  # the usual case: room already (one check, no calls)
        self._reserve_keys(keys)
        self._grow_entries(self._num_entries + keys)
        self._grow_spare(self._num_spare + spare)

    def _push_spare(self, entries: np.ndarray) -> None:
        """Return entry ids to the spare stack (the last pushed is reused first)."""
        end = self._num_spare + entries.size
        self._grow_spare(end)
        self._spare[self._num_spare:end] = entries
        self._num_spare = end

    def _grow_spare(self, size: int) -> None:
        if size > self._spare.size:
            self._spare = np.concatenate([self._spare, np.empty(max(size, self._spare.size), dtype=np.intp)])

    def _grow_entries(self, size: int) -> None:
        """Entry arrays (blocks, holders, hash_of) of at least ``size`` entries, doubling."""
        if size > len(self._holders):
            extra = max(size, 2 * len(self._holders)) - len(self._holders)
            self._blocks = np.concatenate([self._blocks, np.full((extra, self._rows), -1, dtype=np.int32)])
            self._holders = np.concatenate([self._holders, np.zeros(extra, dtype=np.int32)])
            self._hash_of = np.concatenate([self._hash_of, np.zeros(extra, dtype=_PACKED)])

    def _take_entries(self, count: int) -> np.ndarray:
        """``count`` unused entry ids: spare ones first (most recently freed first), then new ones."""
        reuse = min(count, self._num_spare)
        self._num_spare -= reuse
        ids = self._spare[self._num_spare:self._num_spare + reuse][::-1]
        grow = count - reuse
        if not grow:
            return ids.copy()  # a view of the spare stack, which later pushes overwrite
        start = self._num_entries
        self._num_entries += grow
        self._grow_entries(self._num_entries)
        fresh = np.arange(start, self._num_entries, dtype=np.intp)
        return np.concatenate([ids, fresh]) if reuse else fresh  # a filling cache has no spares


def _empty_slots(capacity: int) -> np.ndarray:
    """A hash table of ``capacity`` (a power of two) empty slots."""
    slots = np.zeros(capacity, dtype=SLOT_DTYPE)
    slots["entry"] = -1
    return slots

"""Writes vllm-0.33-kv-events.json: KV event batches encoded by vLLM 0.33's own structs and msgspec encoder.

Run it where vLLM 0.33 is installed (it runs on a CPU): ``python make_kv_event_vectors.py > vllm-0.33-kv-events.json``.
Each batch lists its events as plain JSON (hashes as ints, or as {"hex": ...} for 32-byte digests; tuples as lists)
and the payload vLLM's ZmqEventPublisher sends for it (``msgspec.msgpack.Encoder().encode(KVEventBatch(...))``);
"digests" maps each int hash (as a string) to the 32-byte digest it is the low 64 bits of.
"""
from __future__ import annotations

import hashlib
import json

import msgspec
import vllm
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


DIGESTS: dict[str, str] = {}


def digest(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def low64(h: bytes) -> int:
    value = int.from_bytes(h, "big") & ((1 << 64) - 1)
    DIGESTS[str(value)] = h.hex()
    return value


def plain(value):
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def describe(event) -> dict:
    fields = {f: plain(getattr(event, f)) for f in event.__struct_fields__}
    return {"type": type(event).__name__, **fields}


BATCHES = [
    (1764000000.25, 0, [
        BlockStored(block_hashes=[low64(digest(1)), low64(digest(2))], parent_block_hash=None,
                    token_ids=list(range(32)), block_size=16, lora_id=None, medium="GPU", lora_name=None,
                    extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention"),
    ]),
    (1764000001.5, 0, [
        BlockRemoved(block_hashes=[low64(digest(7))], medium="GPU", group_idx=0),
        BlockStored(block_hashes=[low64(digest(3)), low64(digest(4))], parent_block_hash=low64(digest(2)),
                    token_ids=[70000, 5, 2**31 + 7, 0, 255, 256, 65535, 65536], block_size=4, lora_id=None,
                    medium="GPU", lora_name="sql-adapter",
                    extra_keys=[("sql-adapter", ("img-1", 3), "tenant-a"), ("sql-adapter",)], group_idx=1,
                    kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=4096),
        BlockRemoved(block_hashes=[low64(digest(3)), low64(digest(4))], medium="GPU", group_idx=1),
    ]),
    (1764000002.0, 3, [
        BlockStored(block_hashes=[low64(digest(5))], parent_block_hash=low64(digest(4)), token_ids=[1, 2, 3, 4],
                    block_size=4, lora_id=None, medium="CPU", lora_name=None, extra_keys=[None], group_idx=0,
                    kv_cache_spec_kind="full_attention"),
        BlockRemoved(block_hashes=[low64(digest(5))], medium="CPU", group_idx=0),
        AllBlocksCleared(),
    ]),
    (1764000003.125, 0, [  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: the 32-byte digests
        BlockStored(block_hashes=[digest(8)], parent_block_hash=digest(7), token_ids=[9, 9, 9, 9], block_size=4,
                    lora_id=None, medium="GPU", lora_name=None, extra_keys=[None], group_idx=0,
                    kv_cache_spec_kind="full_attention"),
        BlockRemoved(block_hashes=[digest(8)], medium="GPU", group_idx=0),
    ]),
]

encoder = msgspec.msgpack.Encoder()
out = {"source": f"vLLM {vllm.__version__}: vllm.distributed.kv_events structs, msgspec.msgpack.Encoder().encode"
                 " of a KVEventBatch, as ZmqEventPublisher sends it",
       "batches": [{"ts": ts, "data_parallel_rank": rank, "events": [describe(e) for e in events],
                    "payload": encoder.encode(KVEventBatch(ts=ts, events=events, data_parallel_rank=rank)).hex()}
                   for ts, rank, events in BATCHES],
       "digests": DIGESTS}
print(json.dumps(out, indent=1))

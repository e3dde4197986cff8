"""Pure data structures for paged KV caches: layouts, pools, prefix index, manager. No I/O."""
from __future__ import annotations

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.layout import CacheSpec, QuantType, ScaleLayout, TensorSpec
from kvcache.allocator.manager import Admission, KVCacheManager
from kvcache.allocator.prefix import BlockHasher, PrefixIndex
from kvcache.allocator.swa import Chunked, Full, Window

__all__ = [
    "Admission",
    "BlockHasher",
    "CacheSpec",
    "Chunked",
    "Full",
    "KVCacheError",
    "KVCacheManager",
    "PrefixIndex",
    "QuantType",
    "ScaleLayout",
    "TensorSpec",
    "Window",
]

"""Pure data structures for paged KV caches: layouts, pools, prefix index, manager. No I/O."""
from __future__ import annotations

from kvcache.allocator.errors import KVCacheError
from kvcache.allocator.layout import CacheSpec, QuantType, ScaleLayout, TensorSpec

__all__ = ["CacheSpec", "KVCacheError", "QuantType", "ScaleLayout", "TensorSpec"]

"""kvcache: paged KV-cache allocation and transfer service for LLM inference engines."""
from __future__ import annotations

from kvcache.allocator import CacheSpec, KVCacheError

__version__ = "0.1.0"
__all__ = ["CacheSpec", "KVCacheError", "__version__"]

"""Moving KV blocks: layer signals, registered memory, transfer engines, cache messager."""
from __future__ import annotations

from kvcache.ops import begin_step, send_cache
from kvcache.transfer.engines import (
    CUDA_METHODS,
    LocalEngine,
    TransferEngine,
    TransferHandle,
    TransferStatus,
    create_engine,
)
from kvcache.transfer.manager import HostTierConfig, Load, TierStats, TransferManager
from kvcache.transfer.regions import ByteRanges, CopyRanges, KVRegion, copy_ranges, describe_tensor
from kvcache.transfer.sharing import SharedHostBuffer, SharedRegion, share_region
from kvcache.transfer.signal import LayerSignal, LayerTimes, Progress, WaitStatus, signal_name

__all__ = [
    "CUDA_METHODS",
    "ByteRanges",
    "CopyRanges",
    "HostTierConfig",
    "KVRegion",
    "LayerSignal",
    "LayerTimes",
    "Load",
    "LocalEngine",
    "Progress",
    "SharedHostBuffer",
    "SharedRegion",
    "TierStats",
    "TransferEngine",
    "TransferHandle",
    "TransferManager",
    "TransferStatus",
    "WaitStatus",
    "begin_step",
    "copy_ranges",
    "create_engine",
    "describe_tensor",
    "send_cache",
    "share_region",
    "signal_name",
]

"""Moving KV blocks: layer signals, registered memory, transfer engines, cache messager."""
from __future__ import annotations

from kvcache.ops import begin_step, send_cache
from kvcache.transfer.signal import LayerSignal, LayerTimes, Progress, WaitStatus, signal_name

__all__ = ["LayerSignal", "LayerTimes", "Progress", "WaitStatus", "begin_step", "send_cache", "signal_name"]

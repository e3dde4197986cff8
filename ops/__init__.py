"""Native ops: the send_cache layer-completion signal and its CPU fallback.

After a layer's KV is written on a CUDA stream, the worker calls ``send_cache(stream, signal,
layer)``: a host function queued behind that work marks the layer complete in a shared-memory
record and wakes the cache messager (another process) within microseconds. ``stream=None``
(CPU engines, tests) marks it at once. Only ``None`` means "now": the int 0 is CUDA's legacy
default stream, and is queued on like any other stream.

The stream may be a raw ``cudaStream_t`` int (fastest), or what a framework hands out: a
PyTorch, Paddle or CuPy stream, anything with ``__cuda_stream__``, or a tensor, which stands for
its device's current stream (a CPU tensor means "now").
"""
from __future__ import annotations

import sys
from typing import Any, Protocol, Union

from kvcache.ops._send_cache import Record, cuda_runtime, unlink
from kvcache.ops._send_cache import send_cache as _send

__all__ = ["Record", "begin_step", "cuda_runtime", "raw_stream", "send_cache", "unlink"]


class HasRecord(Protocol):
    """Anything that carries a Record, such as kvcache.transfer.LayerSignal."""

    record: Record


Signal = Union[Record, HasRecord]


def _record(signal: Signal) -> Record:
    """The Record itself, or the one a LayerSignal carries (anything else fails in C with a TypeError)."""
    return signal if type(signal) is Record else getattr(signal, "record", signal)


def raw_stream(stream: Any) -> int | None:
    """The cudaStream_t (an int) behind a stream or tensor; None for CPU work, which signals at once.

    Accepts None, an int, an object with ``__cuda_stream__`` (the CUDA stream protocol: Paddle,
    recent PyTorch and CuPy), ``cuda_stream`` (torch.cuda.Stream, Paddle's core.CUDAStream),
    ``stream_base`` (paddle.device.Stream), ``ptr`` (cupy.cuda.Stream), or a PyTorch or Paddle
    tensor, meaning the current stream of the tensor's device.
    """
    if stream is None or type(stream) is int:
        return stream
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        return int(protocol()[1])
    for attribute in ("cuda_stream", "raw_stream"):
        value = getattr(stream, attribute, None)
        if isinstance(value, int):
            return value
    if hasattr(stream, "stream_base"):
        return raw_stream(stream.stream_base)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(stream, torch.Tensor):
        return torch.cuda.current_stream(stream.device).cuda_stream if stream.is_cuda else None
    paddle = sys.modules.get("paddle")
    if paddle is not None and isinstance(stream, paddle.Tensor):
        place = stream.place
        return raw_stream(paddle.device.current_stream(place)) if place.is_gpu_place() else None
    if isinstance(getattr(stream, "ptr", None), int):
        return stream.ptr
    raise TypeError(f"cannot find a CUDA stream in {type(stream).__qualname__}: pass an int cudaStream_t, "
                    "a PyTorch/Paddle/CuPy stream or tensor, or None to signal at once")


def send_cache(stream: Any, signal: Signal, layer_id: int) -> None:
    """Mark layer ``layer_id`` of the current step complete once ``stream``'s queued work is done.

    The step is the one current now, on the calling thread, even if the GPU reaches this point
    after the worker has begun the next step. Costs a cudaLaunchHostFunc (a few microseconds);
    raises RuntimeError if a stream is given and no CUDA runtime can be found.
    """
    _send(stream if stream is None or type(stream) is int else raw_stream(stream), _record(signal), layer_id)


def begin_step(signal: Signal) -> int:
    """Start the next step (the counter wraps at 2**32): no layer of it is complete yet. Returns it."""
    return _record(signal).begin_step()

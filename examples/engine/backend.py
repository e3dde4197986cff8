"""The few tensor operations the model needs, in Paddle (CPU, the engines kvcache serves) or PyTorch (GPU).

Both frameworks spell them differently; the model calls them through one of these, so one model definition runs
on either (``Model(config, backend=torch_backend("cuda:0"))``).
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np


class PaddleBackend:
    """Paddle on the CPU."""

    name = "paddle"

    def __init__(self) -> None:
        # Paddle warns at import when ccache, which only its C++ extension builds use, is not on PATH. This one
        # warning only: catch_warnings() would also drop the filters Paddle sets as it imports.
        warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning,
                                module=r"paddle\.utils\.cpp_extension")
        import paddle

        self.paddle, self.F = paddle, paddle.nn.functional
        self.fp8 = paddle.float8_e4m3fn

    def tensor(self, array: Any) -> Any:
        return self.paddle.to_tensor(np.asarray(array))

    def matmul(self, a: Any, b: Any, transpose_b: bool = False) -> Any:
        return self.paddle.matmul(a, b, transpose_y=transpose_b)

    def permute(self, x: Any, perm: list[int]) -> Any:
        return x.transpose(perm)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return self.paddle.where(cond, a, b)

    def fill_like(self, x: Any, value: float) -> Any:
        return self.paddle.full_like(x, value)

    def softmax(self, x: Any) -> Any:
        return self.F.softmax(x, axis=-1)

    def silu(self, x: Any) -> Any:
        return self.F.silu(x)

    def gelu_tanh(self, x: Any) -> Any:
        return self.F.gelu(x, approximate=True)

    def tanh(self, x: Any) -> Any:
        return self.paddle.tanh(x)

    def rsqrt(self, x: Any) -> Any:
        return self.paddle.rsqrt(x)

    def mean_last(self, x: Any) -> Any:
        return x.mean(axis=-1, keepdim=True)

    def absmax_last(self, x: Any) -> Any:
        return self.paddle.abs(x).max(axis=-1, keepdim=True)

    def argmax_last(self, x: Any) -> Any:
        return self.paddle.argmax(x, axis=-1)

    def cat(self, xs: list[Any], axis: int) -> Any:
        return self.paddle.concat(xs, axis=axis)

    def stack(self, xs: list[Any], axis: int) -> Any:
        return self.paddle.stack(xs, axis=axis)

    def rows(self, x: Any, index: Any) -> Any:
        return self.paddle.gather(x, self.tensor(np.asarray(index, dtype=np.int64)))

    def expand(self, x: Any, shape: list[int]) -> Any:
        return self.paddle.expand(x, shape)

    def cast(self, x: Any, dtype: Any) -> Any:
        return x.astype(dtype)

    def numpy(self, x: Any) -> np.ndarray:
        return x.numpy()

    def write_stream(self) -> None:
        """Where ``send_cache`` waits for a layer's writes: nowhere, they are done when the call returns."""
        return None


class TorchBackend:
    """PyTorch on ``device`` (a GPU, or the CPU)."""

    name = "torch"

    def __init__(self, device: str = "cuda:0") -> None:
        import torch

        self.torch, self.device = torch, torch.device(device)
        self.fp8 = torch.float8_e4m3fn
        self._dtypes = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                        "float16": torch.float16}

    def tensor(self, array: Any) -> Any:
        return self.torch.as_tensor(np.asarray(array), device=self.device)

    def matmul(self, a: Any, b: Any, transpose_b: bool = False) -> Any:
        return self.torch.matmul(a, b.transpose(-1, -2) if transpose_b else b)

    def permute(self, x: Any, perm: list[int]) -> Any:
        return x.permute(*perm)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return self.torch.where(cond, a, b)

    def fill_like(self, x: Any, value: float) -> Any:
        return self.torch.full_like(x, value)

    def softmax(self, x: Any) -> Any:
        return self.torch.softmax(x, dim=-1)

    def silu(self, x: Any) -> Any:
        return self.torch.nn.functional.silu(x)

    def gelu_tanh(self, x: Any) -> Any:
        return self.torch.nn.functional.gelu(x, approximate="tanh")

    def tanh(self, x: Any) -> Any:
        return self.torch.tanh(x)

    def rsqrt(self, x: Any) -> Any:
        return self.torch.rsqrt(x)

    def mean_last(self, x: Any) -> Any:
        return x.mean(dim=-1, keepdim=True)

    def absmax_last(self, x: Any) -> Any:
        return x.abs().amax(dim=-1, keepdim=True)

    def argmax_last(self, x: Any) -> Any:
        return x.argmax(dim=-1)

    def cat(self, xs: list[Any], axis: int) -> Any:
        return self.torch.cat(xs, dim=axis)

    def stack(self, xs: list[Any], axis: int) -> Any:
        return self.torch.stack(xs, dim=axis)

    def rows(self, x: Any, index: Any) -> Any:
        return self.torch.index_select(x, 0, self.tensor(np.asarray(index, dtype=np.int64)))

    def expand(self, x: Any, shape: list[int]) -> Any:
        return x.expand(*shape)

    def cast(self, x: Any, dtype: Any) -> Any:
        return x.to(self._dtypes.get(dtype, dtype))

    def numpy(self, x: Any) -> np.ndarray:
        return x.detach().float().cpu().numpy() if x.dtype == self.torch.bfloat16 else x.detach().cpu().numpy()

    def write_stream(self) -> Any:
        """Where ``send_cache`` waits for a layer's writes: the device's current CUDA stream (None on the CPU,
        where they are done when the call returns)."""
        return self.torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None


_PADDLE: PaddleBackend | None = None


def paddle_backend() -> PaddleBackend:
    """The Paddle backend (one per process)."""
    global _PADDLE
    if _PADDLE is None:
        _PADDLE = PaddleBackend()
    return _PADDLE

"""The one place that decides how a frozen quantized weight meets an activation.

Every quantized layer calls `base_matmul` (forward) and `base_matmul_grad_input`
(backward). The plain-torch path dequantizes and multiplies, so it runs on any
device. GPU kernels register themselves with `register_backend`; the first one
whose `supports(x, fmt)` accepts the call handles it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..formats import WeightFormat


@dataclass
class Backend:
    name: str
    supports: Callable[[torch.Tensor, WeightFormat], bool]
    # (x [..., in], fmt, tensors, shape, bias or None, lora or None) -> x @ W^T + bias [+ LoRA]  [..., out]
    # lora = (xa = x @ A^T [..., r], B [out, r], scaling): the adapter's expand, fused where the backend can.
    matmul: Callable
    # (grad_y [..., out], fmt, tensors, shape) -> grad_y @ W  [..., in]
    matmul_grad_input: Callable


_BACKENDS: list[Backend] = []
_DISABLED = False


def register_backend(backend: Backend) -> None:
    _BACKENDS[:] = [b for b in _BACKENDS if b.name != backend.name] + [backend]


def set_enabled(enabled: bool) -> None:
    """Force the plain-torch path (for tests and A/B measurements)."""
    global _DISABLED
    _DISABLED = not enabled


def _pick(x: torch.Tensor, fmt: WeightFormat) -> Backend | None:
    if _DISABLED:
        return None
    for b in _BACKENDS:
        if b.supports(x, fmt):
            return b
    return None


def torch_matmul(x, fmt, tensors, shape, bias=None, lora=None):
    # F.linear adds the bias inside the GEMM (one rounding), as nn.Linear does.
    y = torch.nn.functional.linear(x, fmt.dequantize(tensors, shape, x.dtype), None if bias is None else bias.to(x.dtype))
    return y if lora is None else y + lora_expand(lora, y.dtype)


def lora_expand(lora, dtype):
    xa, b, scaling = lora
    return (torch.nn.functional.linear(xa, b) * scaling).to(dtype)


def torch_matmul_grad_input(gy, fmt, tensors, shape):
    return gy @ fmt.dequantize(tensors, shape, gy.dtype)


def base_matmul(x, fmt, tensors, shape, bias=None, lora=None):
    b = _pick(x, fmt)
    return (b.matmul if b else torch_matmul)(x, fmt, tensors, shape, bias, lora)


def base_matmul_grad_input(gy, fmt, tensors, shape):
    b = _pick(gy, fmt)
    return (b.matmul_grad_input if b else torch_matmul_grad_input)(gy, fmt, tensors, shape)

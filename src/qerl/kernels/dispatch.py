"""The one place that decides how a frozen quantized weight meets an activation.

Every quantized layer calls `base_matmul` (forward) and `base_matmul_grad_input`
(backward). The plain-torch path dequantizes and multiplies, so it runs on any
device. GPU kernels register themselves with `register_backend`; the first one
whose `supports(x, fmt)` accepts the call handles it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from ..formats import WeightFormat


@dataclass
class Backend:
    name: str
    supports: Callable[[torch.Tensor, WeightFormat], bool]
    # (x [..., in], fmt, tensors, shape, bias or None, lora: LoraTerm or None) -> x @ W^T + bias [+ LoRA]  [..., out]
    matmul: Callable
    # (grad_y [..., out], fmt, tensors, shape) -> grad_y @ W  [..., in]
    matmul_grad_input: Callable


@dataclass
class LoraTerm:
    """The adapter's expand, added to a base matmul where a kernel can fuse it:
    out[:, rows of segment s] += scaling * xa[:, s*r:(s+1)*r] @ b[rows of s].T

    A fused group (q|k|v, gate|up) passes one shrink over its concatenated A matrices
    (xa [..., S*r]) and its members' B stacked by rows (b [out, r]); `seg_starts` are
    the first rows of segments 1..S-1 (empty for a single projection). Instead of xa a
    caller may pass `a` (the A matrices stacked, [S*r, in]): the backend then computes the
    shrink x @ a.T itself (the MMA kernel does it inside the same launch)."""

    xa: torch.Tensor | None
    b: torch.Tensor
    scaling: float
    seg_starts: tuple[int, ...] = ()
    a: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return self.b.shape[1]

    def shrunk(self, x: torch.Tensor) -> "LoraTerm":
        """This term with xa computed (x @ a.T in the adapter's dtype) if it was not given."""
        if self.xa is not None:
            return self
        return LoraTerm(torch.nn.functional.linear(x.to(self.a.dtype), self.a), self.b, self.scaling, self.seg_starts)


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


# Set inside `dequantized_cache()`: id(first quant tensor) -> (that tensor, dequantized weight).
_CACHE: dict | None = None


@contextlib.contextmanager
def dequantized_cache():
    """Keep each weight's dequantized copy for the duration (the torch path only).

    For CPU rollouts, where no kernel decodes in registers: a rollout calls every
    frozen weight once per token, and dequantizing it each time costs more than the
    matmul. The copies live only inside the block (the frozen weights cannot change
    there; LoRA and norm weights stay live), so training memory is unaffected.
    """
    global _CACHE
    outer = _CACHE
    _CACHE = {} if outer is None else outer
    try:
        yield
    finally:
        _CACHE = outer


def _dequantized(fmt, tensors, shape, dtype):
    if _CACHE is None:
        return fmt.dequantize(tensors, shape, dtype)
    key_t = next(iter(tensors.values()))
    hit = _CACHE.get((id(key_t), dtype))
    if hit is None or hit[0] is not key_t:
        hit = _CACHE[(id(key_t), dtype)] = (key_t, fmt.dequantize(tensors, shape, dtype))
    return hit[1]


def torch_matmul(x, fmt, tensors, shape, bias=None, lora=None):
    # F.linear adds the bias inside the GEMM (one rounding), as nn.Linear does.
    y = torch.nn.functional.linear(x, _dequantized(fmt, tensors, shape, x.dtype), None if bias is None else bias.to(x.dtype))
    return y if lora is None else y + lora_expand(lora.shrunk(x), y.dtype)


def lora_expand(lora: LoraTerm, dtype):
    """scaling * xa @ b.T per segment, in the adapter's dtype, then cast (the unfused reference;
    xa must be given: `lora.shrunk(x)`)."""
    r, n = lora.rank, lora.b.shape[0]
    bounds = (0, *lora.seg_starts, n)
    parts = [torch.nn.functional.linear(lora.xa[..., s * r:(s + 1) * r], lora.b[bounds[s]:bounds[s + 1]])
             for s in range(len(bounds) - 1)]
    return (torch.cat(parts, -1) * lora.scaling).to(dtype)


def torch_matmul_grad_input(gy, fmt, tensors, shape):
    return gy @ _dequantized(fmt, tensors, shape, gy.dtype)


def base_matmul(x, fmt, tensors, shape, bias=None, lora=None):
    b = _pick(x, fmt)
    return (b.matmul if b else torch_matmul)(x, fmt, tensors, shape, bias, lora)


def base_matmul_grad_input(gy, fmt, tensors, shape):
    b = _pick(gy, fmt)
    return (b.matmul_grad_input if b else torch_matmul_grad_input)(gy, fmt, tensors, shape)

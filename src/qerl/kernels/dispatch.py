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
from . import settings


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


def register_backend(backend: Backend) -> None:
    _BACKENDS[:] = [b for b in _BACKENDS if b.name != backend.name] + [backend]


def _pick(x: torch.Tensor, fmt: WeightFormat) -> Backend | None:
    if not settings.current().kernels:  # the plain-torch path (tests, A/B measurements)
        return None
    for b in _BACKENDS:
        if b.supports(x, fmt):
            return b
    return None


# Set inside `dequantized_cache()`: id(first quant tensor) -> (that tensor, dequantized weight).
# Inside it, settings.fold_and_pack folds unshrunk adapters into the copies and packs them for oneDNN
# (`_merged`, `frozen_linear`); off: the separate LoRA GEMMs and plain weights (bench/cpu_rollout.py).
_CACHE: dict | None = None


@contextlib.contextmanager
def dequantized_cache():
    """Keep each weight's dequantized copy for the duration (the torch path only).

    For CPU rollouts, where no kernel decodes in registers: a rollout calls every
    frozen weight once per token, and dequantizing it each time costs more than the
    matmul. The copies live only inside the block (the frozen weights cannot change
    there; norm weights stay live), so training memory is unaffected. An adapter handed
    over unshrunk (LoraTerm.a) is folded into its copy (`_merged`): on two cores the
    separate shrink, expands and casts cost about as much as the base GEMMs.
    """
    global _CACHE
    outer = _CACHE
    _CACHE = {} if outer is None else outer
    try:
        yield
    finally:
        _CACHE = outer


def drop_folded() -> int:
    """Free the cache's adapter-folded copies (`_merged`); returns the bytes freed. The trainer calls it before
    an update: the update changes every adapter, so the next rollout rebuilds each copy anyway, and meanwhile
    they are a second dequantized model beside the update's activations (fp32 SmolLM2-135M: 405 MB of the
    default run's peak, which is the update's)."""
    if _CACHE is None:
        return 0
    keys = [k for k in _CACHE if k[0] == "merged"]
    freed = sum(_CACHE[k][4].w.nbytes if isinstance(_CACHE[k][4], _Packed) else _CACHE[k][4].nbytes for k in keys)
    for k in keys:
        del _CACHE[k]
    return freed


def _dequantized(fmt, tensors, shape, dtype):
    if _CACHE is None:
        return fmt.dequantize(tensors, shape, dtype)
    key_t = next(iter(tensors.values()))
    hit = _CACHE.get((id(key_t), dtype))
    if hit is None or hit[0] is not key_t:
        hit = _CACHE[(id(key_t), dtype)] = (key_t, fmt.dequantize(tensors, shape, dtype))
    return hit[1]


def _packable(w: torch.Tensor) -> bool:
    return (w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available())


def _pack(w: torch.Tensor):
    """w in oneDNN's blocked layout when this CPU build has it, else w. A plain [N, K] weight is
    re-laid-out inside every oneDNN GEMM; done once, decode-sized GEMMs run 1.3-3x faster on two
    cores (bf16 results bit-identical). Only for weights reused across many calls (the cache)."""
    if _packable(w):
        try:
            return _Packed(torch.ops.mkldnn._reorder_linear_weight(w))
        except (RuntimeError, AttributeError):  # a build without the op: the plain GEMM
            pass
    return w


@dataclass(frozen=True)
class _Packed:
    w: torch.Tensor  # an opaque oneDNN tensor: only _linear may use it


def _linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(w, _Packed):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w.w, bias, "none", [], "")
    return torch.nn.functional.linear(x, w, bias)


def _merged(fmt, tensors, shape, dtype, lora: LoraTerm):
    """The dequantized weight with the adapter folded in, W + scaling·B·A per segment (computed in fp32,
    rounded once to dtype) and packed (`_pack`), kept in the rollout's cache: inside a rollout the adapter
    cannot change either, so one GEMM per projection replaces the base GEMM, the shrink, the expands and
    their casts. An adapter that changed since (an optimizer step between rollouts: its version moved)
    replaces its entry, so the cache holds one copy per weight."""
    key_t = next(iter(tensors.values()))
    k = ("merged", id(key_t), dtype, id(lora.a), id(lora.b))
    stamp = (lora.a._version, lora.b._version, lora.scaling, lora.seg_starts)
    hit = _CACHE.get(k)
    if hit is not None and hit[0] is key_t and hit[1] is lora.a and hit[2] is lora.b and hit[3] == stamp:
        return hit[4]
    w = fmt.dequantize(tensors, shape, torch.float32)
    r, n = lora.rank, lora.b.shape[0]
    bounds = (0, *lora.seg_starts, n)
    for s in range(len(bounds) - 1):
        rows = slice(bounds[s], bounds[s + 1])
        w[rows] += lora.scaling * (lora.b[rows].float() @ lora.a[s * r:(s + 1) * r].float())
    w = _pack(w.to(dtype))
    _CACHE[k] = (key_t, lora.a, lora.b, stamp, w)
    return w


def frozen_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """module(x) for a frozen dense layer (the lm_head in rollouts): inside the cache with its weight packed."""
    if _CACHE is None or not settings.current().fold_and_pack or type(module) is not torch.nn.Linear:
        return module(x)  # (checked before .weight: a 4-bit head's weight is a dequantize, not for a graph)
    w = module.weight
    if w.requires_grad or not _packable(w) or x.dtype != w.dtype:
        return module(x)
    k = ("dense", id(w))
    hit = _CACHE.get(k)
    if hit is None or hit[0] is not w or hit[1] != w._version:
        hit = _CACHE[k] = (w, w._version, _pack(w.detach()))
    return _linear(x, hit[2], module.bias)


def torch_matmul(x, fmt, tensors, shape, bias=None, lora=None):
    b = None if bias is None else bias.to(x.dtype)
    if lora is not None and _CACHE is not None and settings.current().fold_and_pack and lora.xa is None and lora.a is not None:
        return _linear(x, _merged(fmt, tensors, shape, x.dtype, lora), b)
    # F.linear adds the bias inside the GEMM (one rounding), as nn.Linear does.
    y = torch.nn.functional.linear(x, _dequantized(fmt, tensors, shape, x.dtype), b)
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

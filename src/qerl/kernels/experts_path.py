"""Which path an MoE's 4-bit experts run (layers/quant_experts.py), decided here for the layer and the engine.

  gemv     no-grad calls of at most MOE_GEMV_MAX_TOKENS tokens on CUDA (decode): one grouped 4-bit GEMV a
           projection over the hit experts (kernels/moe_gemv.py); the only path a CUDA graph can hold
           (the others read the routing on the host), so the engine bounds its MoE graphs by it
  grouped  other calls on CUDA (prefill, the update): tokens sorted by expert, the hit experts dequantized
           a chunk at a time, one grouped matmul a projection
  loop     transformers' loop over the hit experts, each dequantized (the CPU, and `kernels` off)

Each follows KernelSettings (moe_gemv, moe_grouped, kernels); a module's own `grouped` overrides the
grouped/loop choice (tests force one path).
"""

from __future__ import annotations

import torch

from . import settings, triton_backend
from .m_thresholds import MOE_GEMV_MAX_TOKENS
from .settings import KernelSettings

GEMV, GROUPED, LOOP = "gemv", "grouped", "loop"


def gemv_on(ks: KernelSettings | None = None) -> bool:
    """The GEMV path is switched on and can run here (Triton present)."""
    ks = ks or settings.current()
    return ks.moe_gemv and ks.kernels and triton_backend.HAVE_TRITON


def gemv_max_tokens(ks: KernelSettings | None = None) -> int:
    """The largest call the GEMV path takes (the engine's MoE graph batch), 0 where it is off."""
    return MOE_GEMV_MAX_TOKENS if gemv_on(ks) else 0


def experts_path(x: torch.Tensor, fmt, grouped: bool | None = None) -> str:
    """GEMV, GROUPED or LOOP for a call on activations x [T, H] of experts in format fmt, under the
    settings in force; grouped: the module's override of the grouped/loop choice (None: the settings)."""
    ks = settings.current()
    if gemv_on(ks) and not torch.is_grad_enabled():  # the GEMV kernel has no backward
        from . import moe_gemv

        if moe_gemv.supports(x, fmt):
            return GEMV
    if grouped is None:
        grouped = ks.moe_grouped and ks.kernels and x.is_cuda
    return GROUPED if grouped else LOOP


def fast_dequant(device: torch.device, fmt) -> bool:
    """Whether the hit experts are dequantized in one launch (kernels/moe_dequant.py) rather than one by one."""
    if not (device.type == "cuda" and settings.current().kernels and triton_backend.triton_runs(device)):
        return False
    from . import moe_dequant

    return fmt.name in moe_dequant.FMT_IDS

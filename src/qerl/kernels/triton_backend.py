"""The Triton backend: NVFP4 / MXFP4 / NF4 weight-only matmuls on CUDA.

Registered with `dispatch` at import of `qerl.kernels` (only the registration;
Triton itself is imported on the first CUDA call). Per weight it keeps a small
prepared state (1/global-scale on the device and as a host float, NF4's
dequantized absmax) in a weak cache keyed on the packed tensor, so no call syncs
with the host after the first.
"""

from __future__ import annotations

import importlib.util
import warnings

import torch

from .dispatch import lora_expand
from .m_thresholds import TRITON_FUSED_MAX_M
from .weight_state import WeightState
from .w4_decode_consts import ASM_SHIFT

FMT_IDS = {"nvfp4": 0, "mxfp4": 1, "nf4": 2}
# Rows (tokens) up to which the fused decode kernel beats dequantize + cuBLAS (kernels/m_thresholds.py;
# benchmarks/kernels.md). NVFP4 in the MMA layout never comes here (mma_backend).
FUSED_MAX_M = TRITON_FUSED_MAX_M
# Debug aid for the kernels' own CPU tests: send CPU tensors to the Triton interpreter (far slower
# than the torch path it would replace). Tests set it; nothing else should.
RUN_ON_CPU_INTERPRETER = False
HAVE_TRITON = importlib.util.find_spec("triton") is not None  # optional: the CPU install has none
_STATE: WeightState[tuple] = WeightState()
_SAID_NO_TRITON = False


def triton_runs(device: torch.device) -> bool:
    """Whether Triton is installed. Every Triton kernel's `supports` asks, so that a CUDA machine without it
    takes the torch paths (dequantize + cuBLAS, cuBLAS LoRA, SDPA) instead of failing; said once a process."""
    global _SAID_NO_TRITON
    if not HAVE_TRITON and device.type == "cuda" and not _SAID_NO_TRITON:
        _SAID_NO_TRITON = True
        warnings.warn("qerl: triton is not installed; its CUDA kernels are off and their torch fallbacks run "
                      "(slower): pip install triton", stacklevel=3)
    return HAVE_TRITON


def supports(x: torch.Tensor, fmt) -> bool:
    if not triton_runs(x.device) or fmt.layout != "standard" or fmt.name not in FMT_IDS or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return x.is_cuda or (RUN_ON_CPU_INTERPRETER and x.device.type == "cpu")


def prepare(fmt, tensors, shape):
    """(fmt_id, packed [N, K/2], scale [N, K/G], lut, 1/gs tensor or None, 1/gs float, asm).

    asm = (epilogue factor tensor, MXFP4 shift) for the PTX decode, whose values carry 2^-7
    (NVFP4) or 2^-shift (MXFP4, chosen so the largest scale stays finite in bf16)."""
    key = tensors["weight_packed"] if "weight_packed" in tensors else tensors["weight"]
    return _STATE.get(key, lambda: _build(fmt, tensors, shape))


def _build(fmt, tensors, shape):
    n, k = shape
    fid = FMT_IDS[fmt.name]
    if fid == 2:
        from ..formats.nf4 import NF4_CODE

        packed = tensors["weight"].view(n, k // 2)
        scale = fmt.absmax(tensors).to(torch.float32).reshape(n, k // 64).contiguous()
        st = (fid, packed, scale, NF4_CODE.to(packed.device), None, 1.0, None)
    else:
        packed, scale = tensors["weight_packed"], tensors["weight_scale"].view(torch.uint8)
        if fid == 0:
            inv = 1.0 / tensors["weight_global_scale"].to(torch.float32).reshape(1)
            st = (fid, packed, scale, None, inv, float(inv), (inv * 2.0**ASM_SHIFT, 0))
        else:
            shift = max(0, int(scale.max()) - 128)
            st = (fid, packed, scale, None, None, 1.0, (torch.full((1,), 2.0**shift, device=scale.device), shift))
    return st


def matmul(x, fmt, tensors, shape, bias=None, lora=None):
    from . import w4_matmul as K

    n, k = shape
    fid, packed, scale, lut, inv, inv_host, asm = prepare(fmt, tensors, shape)
    x2d = x.reshape(-1, k)
    if x2d.stride(-1) != 1 or x2d.stride(0) != k:
        x2d = x2d.contiguous()
    b = None if bias is None else bias.to(x.dtype)
    lora = None if lora is None else lora.shrunk(x2d)
    fused_lora = lora is not None and not lora.seg_starts  # the Triton epilogue takes one segment
    if x2d.shape[0] <= FUSED_MAX_M:
        y = K.fused_matmul(x2d, fid, packed, scale, lut, inv, n, bias=b, asm=asm,
                           lora=(lora.xa, lora.b, lora.scaling) if fused_lora else None)
        if lora is not None and not fused_lora:
            y = y + lora_expand(lora, y.dtype).reshape(y.shape)
    else:
        y = K.dequant_matmul(x2d, fid, packed, scale, lut, inv_host, n, bias=b)
        if lora is not None:
            y = y + lora_expand(lora, y.dtype).reshape(y.shape)
    return y.view(*x.shape[:-1], n)


def matmul_grad_input(gy, fmt, tensors, shape):
    from . import w4_matmul as K

    n, k = shape
    fid, packed, scale, lut, _, inv_host, _ = prepare(fmt, tensors, shape)
    g2d = gy.reshape(-1, n).contiguous()
    return K.dequant_matmul_grad_input(g2d, fid, packed, scale, lut, inv_host, n, k).view(*gy.shape[:-1], k)

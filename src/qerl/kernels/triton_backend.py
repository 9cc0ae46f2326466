"""The Triton backend: NVFP4 / MXFP4 / NF4 weight-only matmuls on CUDA.

Registered with `dispatch` at import of `qerl.kernels` (only the registration;
Triton itself is imported on the first CUDA call). Per weight it keeps a small
prepared state (1/global-scale on the device and as a host float, NF4's
dequantized absmax) in a weak cache keyed on the packed tensor, so no call syncs
with the host after the first.
"""

from __future__ import annotations

import importlib.util
import os
import weakref

import torch

from .w4_decode_consts import ASM_SHIFT

FMT_IDS = {"nvfp4": 0, "mxfp4": 1, "nf4": 2}
# Rows (tokens) up to which the fused decode kernel beats dequantize + cuBLAS (H200 sweep).
FUSED_MAX_M = int(os.environ.get("QERL_FUSED_MAX_M", "16"))
# Rows up to which NVFP4/MXFP4 go to the tensor-core-free GEMV (w4_gemv; at most its MAX_M = 4).
# 0 = off until measured on the GPU (scripts/gemv_bench.py).
GEMV_MAX_M = int(os.environ.get("QERL_GEMV_MAX_M", "0"))
HAVE_TRITON = importlib.util.find_spec("triton") is not None
# id(packed tensor) -> (weakref to it, state); tensors compare elementwise, so no WeakKeyDictionary.
_STATE: dict[int, tuple] = {}


def _cpu_interpreter() -> bool:
    # CPU tensors go to the kernels only when asked (tests of the kernels themselves):
    # the interpreter is far slower than the torch path it would replace.
    return os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("QERL_TRITON_ON_CPU") == "1"


def supports(x: torch.Tensor, fmt) -> bool:
    if not HAVE_TRITON or fmt.name not in FMT_IDS or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return x.is_cuda or (_cpu_interpreter() and x.device.type == "cpu")


def prepare(fmt, tensors, shape):
    """(fmt_id, packed [N, K/2], scale [N, K/G], lut, 1/gs tensor or None, 1/gs float, asm).

    asm = (epilogue factor tensor, MXFP4 shift) for the PTX decode, whose values carry 2^-7
    (NVFP4) or 2^-shift (MXFP4, chosen so the largest scale stays finite in bf16)."""
    key = tensors["weight_packed"] if "weight_packed" in tensors else tensors["weight"]
    hit = _STATE.get(id(key))
    if hit is not None and hit[0]() is key:
        return hit[1]
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
    kid = id(key)
    _STATE[kid] = (weakref.ref(key, lambda _, kid=kid: _STATE.pop(kid, None)), st)
    return st


def matmul(x, fmt, tensors, shape, bias=None, lora=None):
    from . import w4_matmul as K

    n, k = shape
    fid, packed, scale, lut, inv, inv_host, asm = prepare(fmt, tensors, shape)
    x2d = x.reshape(-1, k)
    if x2d.stride(-1) != 1 or x2d.stride(0) != k:
        x2d = x2d.contiguous()
    b = None if bias is None else bias.to(x.dtype)
    if x2d.shape[0] <= GEMV_MAX_M and fid != 2:
        from . import w4_gemv as G

        if G.supported(x2d, fid, packed):
            y = G.gemv(x2d, fid, packed, scale, inv, n, bias=b, lora=lora)
            return y.view(*x.shape[:-1], n)
    if x2d.shape[0] <= FUSED_MAX_M:
        y = K.fused_matmul(x2d, fid, packed, scale, lut, inv, n, bias=b, lora=lora, asm=asm)
    else:
        y = K.dequant_matmul(x2d, fid, packed, scale, lut, inv_host, n, bias=b)
        if lora is not None:
            from .dispatch import lora_expand

            y = y + lora_expand((lora[0].reshape(-1, lora[0].shape[-1]), *lora[1:]), y.dtype)
    return y.view(*x.shape[:-1], n)


def matmul_grad_input(gy, fmt, tensors, shape):
    from . import w4_matmul as K

    n, k = shape
    fid, packed, scale, lut, _, inv_host, _ = prepare(fmt, tensors, shape)
    g2d = gy.reshape(-1, n).contiguous()
    return K.dequant_matmul_grad_input(g2d, fid, packed, scale, lut, inv_host, n, k).view(*gy.shape[:-1], k)

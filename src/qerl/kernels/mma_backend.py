"""The backend for weights in the MMA layout (formats/nvfp4_mma.py) on CUDA.

One path per range of M, all on the same bytes: `w4_wgmma` for w4_wgmma.ROUTE_MIN_M..MAX_M tokens where
it is available (sm_90a, and KernelSettings.wgmma, on by default); else `w4_mma` (mma.sync,
decode in registers, bias and LoRA expand in its epilogue) up to w4_mma.MAX_M; larger M and
grad_input: dequantize the same bytes once + cuBLAS. Per weight
it keeps 2^7/gs on the device and 1/gs as a host float (weak cache on the packed tensor),
so no call syncs with the host after the first.
"""

from __future__ import annotations

import warnings

import torch

from . import humming_backend, lora_shrink, routes, settings, w4_mma, w4_wgmma
from .dispatch import lora_expand
from .weight_state import WeightState

_STATE: WeightState[tuple] = WeightState()
_HUMMING: WeightState = WeightState()
_KSPLIT: dict[int, WeightState] = {s: WeightState() for s in routes.KSPLIT.values()}


def supports(x: torch.Tensor, fmt) -> bool:
    return getattr(fmt, "layout", None) == "mma" and x.is_cuda and w4_mma.available(x.device)


def _prepare(tensors):
    """(2^7/gs on the device, 1/gs as a host float), once per weight."""
    gs = tensors["weight_global_scale"]
    return _STATE.get(tensors["weight_packed"], lambda: (w4_mma.out_factor(gs), 1.0 / float(gs)))


def matmul(x, fmt, tensors, shape, bias=None, lora=None):
    n, k = shape
    factor, inv_gs = _prepare(tensors)
    dtype = x.dtype
    x2d = x.reshape(-1, k).to(torch.bfloat16)
    b = None if bias is None else bias.to(torch.bfloat16)
    packed, scale = tensors["weight_packed"], tensors["weight_scale"]
    m = x2d.shape[0]
    route = routes.pick(m, x2d.device, shape) if settings.current().humming else "own"
    hw = _humming(tensors, shape, route, x2d.device) if route in routes.HUMMING else \
        _ksplit(tensors, shape, route, x2d.device) if route in routes.KSPLIT else None
    if hw is not None:  # the shrink (beside the GEMM under lora_overlap) and the expand: humming_backend's
        return hw.matmul(x2d.contiguous(), bias=b, lora=lora, backend=route).view(*x.shape[:-1], n).to(dtype)
    if w4_wgmma.ROUTE_MIN_M <= m <= w4_wgmma.MAX_M and w4_wgmma.available(x2d.device):
        # The shrink inside the launch only where the measured policy says it finishes in time
        # (w4_mma.shrink_in_launch), else its own GEMM first; the expand runs in the epilogue.
        fuse = lora is not None and w4_mma.lora_fusable(lora, k) and w4_mma.shrink_in_launch(m, n, k)
        if lora is not None and not fuse:
            lora = lora_shrink.shrunk(lora, x2d)
            fuse = w4_mma.lora_fusable(lora, k)
        y = w4_wgmma.matmul(x2d, packed, scale, factor, n, bias=b, lora=lora if fuse else None)
        if lora is not None and not fuse:
            y = y + lora_expand(lora, y.dtype).reshape(y.shape)
    elif m <= w4_mma.MAX_M:
        if lora is not None and not w4_mma.shrink_in_launch(x2d.shape[0], n, k):
            lora = lora_shrink.shrunk(lora, x2d)
        fuse = lora is not None and w4_mma.lora_fusable(lora, k)
        if lora is not None and not fuse:
            lora = lora.shrunk(x2d)
            fuse = w4_mma.lora_fusable(lora, k)
        y = w4_mma.matmul(x2d, packed, scale, factor, n, bias=b, lora=lora if fuse else None)
        if lora is not None and not fuse:
            y = y + lora_expand(lora, y.dtype).reshape(y.shape)
    else:
        y = w4_mma.dequant_matmul(x2d, packed, scale, inv_gs, n, bias=b)
        if lora is not None:
            y = y + lora_expand(lora.shrunk(x2d), y.dtype).reshape(y.shape)
    return y.view(*x.shape[:-1], n).to(dtype)


def _humming(tensors, shape, route, device):
    """The humming-kernels copy of this weight where the measured table routes M tokens to it, else None.
    Built from these bytes on first use (a second copy of the weight, until humming's layout is the stored one)."""
    if not (route in routes.HUMMING and humming_backend.supports_shape(shape)
            and humming_backend.available(device)):
        return None

    def build():
        from ..formats.nvfp4_mma import NVFP4Mma

        if not humming_backend.copy_fits(shape, tensors["weight_packed"].device):
            return None
        try:
            return humming_backend.HummingWeight.build("nvfp4", NVFP4Mma().to_checkpoint(tensors, shape), shape)
        except Exception as e:  # its JIT or heuristics refuse this shape: this weight stays on qerl's kernels
            warnings.warn(f"qerl: humming-kernels cannot take a {shape[0]}x{shape[1]} weight "
                          f"({type(e).__name__}: {str(e)[:120]}); it stays on qerl's kernels", stacklevel=3)
            return None
    return _HUMMING.get(tensors["weight_packed"], build)


def _ksplit(tensors, shape, route, device):
    """The K-sliced grouped copy of this weight (kernels/humming_ksplit.py) where the table routes M tokens to it,
    else None (humming absent, the shape does not slice, or the card lacks room for a second copy)."""
    if not (humming_backend.supports_shape(shape) and humming_backend.available(device)):
        return None
    splits = routes.KSPLIT[route]

    def build():
        from ..formats.nvfp4_mma import NVFP4Mma
        from .humming_ksplit import KSplitWeight

        if not humming_backend.copy_fits(shape, tensors["weight_packed"].device):
            return None
        try:  # the heuristics and the JIT fail, if at all, at the first product: run one here
            w = KSplitWeight.build(NVFP4Mma().to_checkpoint(tensors, shape), shape, splits)
            w.matmul(torch.zeros(1, shape[1], dtype=torch.bfloat16, device=tensors["weight_packed"].device))
            return w
        except Exception as e:  # its JIT or heuristics refuse this shape or split: qerl's own kernels serve it
            warnings.warn(f"qerl: humming split-K ({splits}) cannot take a {shape[0]}x{shape[1]} weight "
                          f"({type(e).__name__}: {str(e)[:120]}); it stays on qerl's kernels", stacklevel=3)
            return None
    return _KSPLIT[splits].get(tensors["weight_packed"], build)


def matmul_grad_input(gy, fmt, tensors, shape):
    n, k = shape
    _, inv_gs = _prepare(tensors)
    g2d = gy.reshape(-1, n).to(torch.bfloat16).contiguous()
    g = w4_mma.dequant_matmul_grad_input(g2d, tensors["weight_packed"], tensors["weight_scale"], inv_gs, n, k)
    return g.view(*gy.shape[:-1], k).to(gy.dtype)

"""The backend for weights in the MMA layout (formats/nvfp4_mma.py) on CUDA.

It runs the kernel the routes table names for M tokens of this weight shape (kernels/routes.py): `mma`
(w4_mma, mma.sync, decode in registers, bias and LoRA expand in its epilogue), `wgmma` (w4_wgmma, Hopper),
`dequant_cublas` (dequantize the same bytes once + cuBLAS; also grad_input), or a humming-kernels mode on its
copy of the weight (`runnable` says once where a named kernel cannot run on this card). Per weight
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
    route = runnable(routes.pick(m, x2d.device, shape), m, x2d.device)
    hw = _humming(tensors, shape, route, x2d.device) if route in routes.HUMMING else \
        _ksplit(tensors, shape, route, x2d.device) if route in routes.KSPLIT else None
    if route in routes.STORED and hw is None:  # no humming copy of this weight (refused at load, or its shape)
        route = runnable(own_route(m), m, x2d.device)
    if hw is not None:  # the shrink (beside the GEMM under lora_overlap) and the expand: humming_backend's
        return hw.matmul(x2d.contiguous(), bias=b, lora=lora, backend=route).view(*x.shape[:-1], n).to(dtype)
    if route == "wgmma":
        if lora is not None:  # the shrink as its own GEMM first (lora_shrink's kernels), the expand in the epilogue
            lora = lora_shrink.shrunk(lora, x2d)
        fuse = lora is not None and w4_mma.lora_fusable(lora, k)
        y = w4_wgmma.matmul(x2d, packed, scale, factor, n, bias=b, lora=lora if fuse else None)
        if lora is not None and not fuse:
            y = y + lora_expand(lora, y.dtype).reshape(y.shape)
    elif route == "mma":
        if lora is not None and not w4_mma.shrink_in_launch(m, n, k):
            lora = lora_shrink.shrunk(lora, x2d)
        fuse = lora is not None and w4_mma.lora_fusable(lora, k)
        if lora is not None and not fuse:
            lora = lora.shrunk(x2d)
            fuse = w4_mma.lora_fusable(lora, k)
        y = w4_mma.matmul(x2d, packed, scale, factor, n, bias=b, lora=lora if fuse else None)
        if lora is not None and not fuse:
            y = y + lora_expand(lora, y.dtype).reshape(y.shape)
    else:  # dequant_cublas
        y = w4_mma.dequant_matmul(x2d, packed, scale, inv_gs, n, bias=b)
        if lora is not None:
            y = y + lora_expand(lora.shrunk(x2d), y.dtype).reshape(y.shape)
    return y.view(*x.shape[:-1], n).to(dtype)


def own_route(m: int) -> str:
    """qerl's own kernel for M tokens where the table's kernel cannot serve this weight (routes.DEFAULT)."""
    return routes.first_bucket([routes.Bucket(mm, name) for mm, name in routes.DEFAULT], m)


_SAID: set = set()


def runnable(route: str, m: int, device: torch.device) -> str:
    """`route`, or the kernel that serves it on this card where it cannot run here: wgmma off or not on this card
    (sm_90a) or M past its tiles -> mma.sync to M 64, else dequantize + cuBLAS; mma.sync past M 64 -> dequantize +
    cuBLAS; humming absent (or KernelSettings.humming off) -> routes.DEFAULT. Said once per (asked, served)."""
    got = route
    if route in routes.STORED and not (settings.current().humming and humming_backend.available(device)):
        got = own_route(m)
    if got == "wgmma" and not (settings.current().wgmma and w4_wgmma.MIN_M <= m <= w4_wgmma.MAX_M
                               and w4_wgmma.available(device)):
        got = "mma"
    if got == "mma" and m > w4_mma.MAX_M:
        got = "dequant_cublas"
    if got != route and (route, got) not in _SAID and not (route == "mma" and m > w4_mma.MAX_M):
        _SAID.add((route, got))
        warnings.warn(f"qerl: the kernel routes name {route} where it cannot run here (M {m}); {got} serves it",
                      stacklevel=3)
    return got


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

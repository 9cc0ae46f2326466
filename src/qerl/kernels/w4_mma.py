"""The Hopper NVFP4 kernels (w4_mma.cu): mma.sync with weights decoded in registers, M = 1..64.

Why CUDA C++ through NVRTC and not Triton: the kernel must decode each thread's 16 bytes
straight into its MMA A-fragment registers. Triton picks the register layout of a dot
operand itself, so its decoded tile goes through shared memory to be re-laid out (measured:
~0.9 shared-memory instructions per weight, 17 % of DRAM bandwidth; benchmarks/kernels.md).
`torch.cuda._compile_kernel` (NVRTC, in torch >= 2.8) compiles the source at first use, with
no new dependency and no nvcc; the launches go through cuLaunchKernel on the current stream,
so CUDA graphs capture them.

Above `MAX_M` tokens the weights are dequantized (same layout, one pass) and cuBLAS multiplies.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ..formats.nvfp4_mma import OUT_SHIFT
from . import counters, nvrtc
from .m_thresholds import W4_MMA_MAX_M

log = logging.getLogger(__name__)

MAX_M = W4_MMA_MAX_M  # 8 token tiles of 8; above it dequantize + cuBLAS (kernels/m_thresholds.py)
MAX_SEGMENTS = 3  # LoRA segments a launch takes (q|k|v)
_COUNTERS = counters.SIZE  # row blocks a launch may use (N / (16 * rows per block)), then the sync words
_SYNC = 4  # a fused-shrink launch's ticket / xa-ready / finished counters, at the end of the buffer


@dataclass(frozen=True)
class MmaConfig:
    """One launch shape. mt: 8-token tiles; rt: 16-row tiles per warp; warps per CTA;
    stages: 64-input chunks of weights in flight per warp; xsm: activations staged in shared memory
    (0: each warp loads its own); splits: CTAs along K (partial sums added in order)."""

    mt: int
    rt: int
    warps: int
    stages: int
    splits: int
    chunks_per_split: int
    xsm: int = 0

    def rows_per_block(self) -> int:
        return 16 * self.rt * self.warps


# Launch shape per number of 8-token tiles (mt): warps per CTA, CTAs wanted per SM, row tiles
# per warp, chunks in flight per warp. Chosen by `qerl bench kernels --sweep` on the H200
# (benchmarks/kernels.md); `plan` turns them into a grid for each weight shape.
TUNING: dict[int, dict] = {
    1: dict(warps=8, ctas_per_sm=8, rt=1, stages=2, xsm=0),
    2: dict(warps=4, ctas_per_sm=16, rt=1, stages=2, xsm=0),
    4: dict(warps=4, ctas_per_sm=4, rt=1, stages=2, xsm=0),
    8: dict(warps=4, ctas_per_sm=2, rt=2, stages=2, xsm=3),
}


def plan(M: int, N: int, K: int, sms: int, *, min_chunks: int = 4, **override) -> MmaConfig:
    """The launch for M tokens of an [N, K] weight: about `ctas_per_sm` CTAs per SM, split along K
    when the row blocks alone are too few, each split at least `min_chunks` chunks of 64 inputs."""
    mt = max(1, math.ceil(M / 8))
    tune = {**TUNING[min(b for b in TUNING if b >= mt)], **override}
    if tune["stages"] % 2:
        raise ValueError(f"stages must be even (the activation buffers alternate), got {tune['stages']}")
    rows = 16 * tune["rt"] * tune["warps"]
    blocks = math.ceil(N / rows)
    kch = K // 64
    want = max(1, round(sms * tune["ctas_per_sm"] / blocks))
    splits = max(1, min(want, kch // min_chunks))
    cps = math.ceil(kch / splits)
    return MmaConfig(mt, tune["rt"], tune["warps"], tune["stages"], math.ceil(kch / cps), cps, tune.get("xsm", 0))


_AVAILABLE: dict = {}


def _compile(name: str, defines: dict, device: torch.device):
    return nvrtc.kernel("w4_mma.cu", name, defines, device)


def _matmul_kernel(cfg: MmaConfig, has_bias: bool, has_lora: bool, device, fuse_shrink: bool = False):
    return _compile("w4_mma_matmul", dict(MT=cfg.mt, RT=cfg.rt, WARPS=cfg.warps, ST=cfg.stages, XSM=int(cfg.xsm > 0),
                                          XST=max(2, cfg.xsm), DUAL=int(cfg.mt * cfg.rt <= 2), HAS_BIAS=int(has_bias),
                                          HAS_LORA=int(has_lora), FUSE_SHRINK=int(fuse_shrink)), device)


def available(device: torch.device) -> bool:
    """Whether this device runs the kernels: sm_80+ (bf16 mma.sync) and NVRTC compiles them.
    A failure is logged once and the caller keeps the standard layout (Triton / torch paths)."""
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _AVAILABLE:
        ok = torch.cuda.get_device_capability(idx) >= (8, 0) and hasattr(torch.cuda, "_compile_kernel")
        if ok:
            try:
                _matmul_kernel(plan(1, 16, 64, 1), False, False, torch.device("cuda", idx))
            except Exception as e:  # no NVRTC, driver too old, ...
                log.warning("qerl: the NVFP4 MMA kernel does not compile here (%s); using the Triton/torch paths", e)
                ok = False
        _AVAILABLE[idx] = ok
    return _AVAILABLE[idx]


def _counters(device) -> torch.Tensor:
    return counters.split_counters(device, _COUNTERS)


def _sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _aligned(t: torch.Tensor) -> torch.Tensor:
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and t.stride(0) % 8 == 0
    return t if ok else t.contiguous()


def matmul(x2d: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, out_factor: torch.Tensor, N: int,
           bias: torch.Tensor | None = None, lora=None, config: MmaConfig | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x2d [M <= MAX_M, K] bf16 -> [M, N] bf16 = x @ W^T (* out_factor = 2^7/gs) + bias + LoRA.

    packed/scale: NVFP4 in the MMA layout. lora: a dispatch.LoraTerm the caller checked with
    `lora_fusable`; without xa (with `a`), extra CTAs of the same launch compute the shrink, and the
    epilogues wait for it (roles go by a ticket in start order, so the wait cannot deadlock)."""
    M, K = x2d.shape
    dev = x2d.device
    cfg = config or plan(M, N, K, _sms(dev))
    x2d = _aligned(x2d)
    y = out if out is not None else torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    nt = N // 16
    part = (torch.empty(cfg.splits * nt * cfg.mt * 32 * 4, device=dev, dtype=torch.float32)
            if cfg.splits > 1 else out_factor)
    fuse_shrink = lora is not None and lora.xa is None
    shrink_ctas = 0
    if lora is not None:
        lb = lora.b.contiguous()
        if fuse_shrink:  # the launch computes xa = x @ a.T into this buffer first
            xa = torch.empty(M, lora.a.shape[0], device=dev, dtype=torch.bfloat16)
            shrink_ctas = math.ceil(lora.a.shape[0] / 16)
        else:
            xa = lora.xa.reshape(M, -1)
            if xa.stride(-1) != 1 or xa.data_ptr() % 4 or xa.stride(0) % 2:
                xa = xa.contiguous()
        segs = list(lora.seg_starts) + [N] * (2 - len(lora.seg_starts))
        lora_args = [xa, lb, float(lora.scaling), lb.shape[1], segs[0], segs[1]]
        ldxa = xa.stride(0)
    else:
        lora_args = [x2d, x2d, 0.0, 0, N, N]
        ldxa = 0
    kern = _matmul_kernel(cfg, bias is not None, lora is not None, dev, fuse_shrink)
    blocks = math.ceil(N / cfg.rows_per_block())
    if blocks > _COUNTERS - _SYNC:
        raise ValueError(f"N = {N} needs {blocks} row blocks; the kernel's counters hold {_COUNTERS - _SYNC}")
    grid = (blocks * cfg.splits + shrink_ctas, 1, 1) if fuse_shrink else (blocks, cfg.splits, 1)
    kern(grid=grid, block=(32 * cfg.warps, 1, 1),
         args=[packed, scale, x2d, y, part, _counters(dev), out_factor, bias if bias is not None else x2d,
               *lora_args, M, N, K, x2d.stride(0), y.stride(0), ldxa, cfg.chunks_per_split,
               lora.a if fuse_shrink else x2d, shrink_ctas, cfg.splits, _COUNTERS - _SYNC])
    return y


def shrink_in_launch(M: int, N: int, K: int) -> bool:
    """Whether the LoRA shrink runs inside the matmul's launch or as its own GEMM first. Measured on the
    H200 (benchmarks/kernels.md, 3fc7b36): the in-launch shrink (16 rows of A per CTA over all of K) is
    ready in time only when the matmul is long next to K: gate|up at M <= 8 (-10 % of its LoRA time);
    for q|k|v, o and down it finishes last and costs more than a separate GEMM (down 7B M = 1: 46.9 vs
    26.2 µs)."""
    return N >= 8 * K and M <= 8


def lora_fusable(lora, k: int) -> bool:
    """Whether the epilogue takes this LoRA term: bf16, even rank, <= 3 segments on 16-row tiles, and
    either xa given or the stacked A to shrink in the launch ([S*r, k], rows of 4-byte-aligned bf16)."""
    src = lora.xa if lora.xa is not None else lora.a
    ok = (lora.b.dtype == torch.bfloat16 and src.dtype == torch.bfloat16 and lora.rank % 2 == 0
          and len(lora.seg_starts) < MAX_SEGMENTS and all(s % 16 == 0 for s in lora.seg_starts))
    if ok and lora.xa is None:
        ok = lora.a.shape == (lora.rank * (len(lora.seg_starts) + 1), k) and lora.a.is_contiguous()
    return ok


DEQUANT_DEFINES = dict(MT=1, RT=1, WARPS=1, ST=2, XSM=0, XST=2, DUAL=0, HAS_BIAS=0, HAS_LORA=0, FUSE_SHRINK=0)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, N: int, K: int, out: torch.Tensor | None = None):
    """bf16 [N, K] = W * gs (the 1/gs is the GEMM's alpha), standard row order, from the MMA layout."""
    w = out if out is not None else torch.empty(N, K, device=packed.device, dtype=torch.bfloat16)
    threads = N // 16 * (K // 64) * 32
    kern = _compile("w4_mma_dequantize", DEQUANT_DEFINES, packed.device)
    kern(grid=(math.ceil(threads / 256), 1, 1), block=(256, 1, 1), args=[packed, scale, w, N, K])
    return w


class _Scratch:
    """One reused dense-weight buffer per (device): a single layer's worth, for the large-M path."""

    def __init__(self):
        self._bufs: dict = {}

    def get(self, n: int, k: int, device) -> torch.Tensor:
        buf = self._bufs.get(device)
        if buf is None or buf.numel() < n * k:
            buf = self._bufs[device] = torch.empty(n * k, device=device, dtype=torch.bfloat16)
        return buf[: n * k].view(n, k)


SCRATCH = _Scratch()


def dequant_matmul(x2d, packed, scale, inv_gs: float, N: int, bias=None):
    """Large M: dequantize into the scratch buffer, then cuBLAS with alpha = 1/gs (one rounding)."""
    M, K = x2d.shape
    w = dequantize(packed, scale, N, K, out=SCRATCH.get(N, K, x2d.device))
    if bias is not None:
        return torch.addmm(bias.to(x2d.dtype), x2d, w.t(), alpha=inv_gs)
    y = torch.empty(M, N, device=x2d.device, dtype=x2d.dtype)
    return torch.addmm(y, x2d, w.t(), beta=0, alpha=inv_gs, out=y)


def dequant_matmul_grad_input(gy2d, packed, scale, inv_gs: float, N: int, K: int):
    w = dequantize(packed, scale, N, K, out=SCRATCH.get(N, K, gy2d.device))
    g = torch.empty(gy2d.shape[0], K, device=gy2d.device, dtype=gy2d.dtype)
    return torch.addmm(g, gy2d, w, beta=0, alpha=inv_gs, out=g)


def out_factor(global_scale: torch.Tensor) -> torch.Tensor:
    """2^7 / gs on the weight's device: the epilogue's one multiply (undoes the decode's 2^-7)."""
    return (2.0**OUT_SHIFT / global_scale.to(torch.float32)).reshape(1).contiguous()

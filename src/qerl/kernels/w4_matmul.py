"""Weight-only 4-bit matmul kernels (Triton): y = x·Ŵᵀ·(1/gs) + b [+ s·(x·Aᵀ)·Bᵀ].

Two paths, chosen per call by the number of rows M of x (tokens):

* small M (decode): `fused` — each program owns BLOCK_N output features and
  streams their packed weights once, decoding in registers. The weight tile is
  the left operand of the dot (swap-AB: yᵀ = Ŵ·xᵀ), so tensor-core M is the
  weight rows and the few tokens become the narrow N side. When N alone gives
  too few programs, K is split; partial sums go to an fp32 workspace and a second
  kernel adds them in a fixed order (deterministic, no float atomics). The
  epilogue applies 1/global-scale to the fp32 accumulator, adds the bias and the
  LoRA expand (B·(x·Aᵀ)) in fp32, and rounds once.
* large M (prefill, training, grad_input): `dequantize` writes bf16 Ŵ (without
  the 1/gs) into one reused buffer and cuBLAS does the GEMM, with 1/gs as its
  alpha, so both paths see identical operands and agree to fp32 rounding.
"""

from __future__ import annotations

import torch

from . import settings, w4_decode
from .w4_decode import GROUP, next_pow2
from .w4_decode import cdiv as _cdiv

_built = False  # _build() ran


def _build():
    """Define the @triton.jit kernels, once, at first use: importing this module needs no Triton
    (the CPU install has none)."""
    # Module globals, not closures: Triton's interpreter (the CPU tests) runs a kernel's source against
    # its module's globals alone.
    global _built, triton, tl, decode_tile, decode_even_odd_asm
    global _epilogue, _fused_kernel, _splitk_reduce_kernel, _dequant_kernel
    if _built:
        return
    import triton
    import triton.language as tl
    w4_decode._build()
    decode_tile, decode_even_odd_asm = w4_decode.decode_tile, w4_decode.decode_even_odd_asm

    @triton.jit
    def _epilogue(acc, offs_n, offs_m, N, M, y_ptr, stride_ym, gsinv_ptr, bias_ptr, xa_ptr, lb_ptr, scaling, R,
                  HAS_GS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK_R: tl.constexpr):
        n_mask = offs_n < N
        m_mask = offs_m < M
        if HAS_GS:
            acc = acc * tl.load(gsinv_ptr)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0).to(tl.float32)[:, None]
        if HAS_LORA:
            offs_r = tl.arange(0, BLOCK_R)
            r_mask = offs_r < R
            b = tl.load(lb_ptr + offs_n[:, None] * R + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0)
            a = tl.load(xa_ptr + offs_m[None, :] * R + offs_r[:, None], mask=r_mask[:, None] & m_mask[None, :], other=0)
            acc += tl.dot(b, a.to(b.dtype)) * scaling
        ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])

    @triton.jit
    def _fused_kernel(x_ptr, q_ptr, s_ptr, lut_ptr, ws_ptr, y_ptr, gsinv_ptr, bias_ptr, xa_ptr, lb_ptr,
                      M, N, K, stride_xm, stride_ym, k_split, scaling, R, MX_SHIFT,
                      FMT: tl.constexpr, BF16: tl.constexpr, USE_WS: tl.constexpr, ASM: tl.constexpr,
                      HAS_GS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        G: tl.constexpr = 16 if FMT == 0 else (32 if FMT == 1 else 64)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_kh = tl.arange(0, BLOCK_K // 2)
        offs_kg = tl.arange(0, BLOCK_K // G)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        m_mask = offs_m < M
        rows = offs_n.to(tl.int64)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        k_lo = pid_k * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kh = k0 // 2 + offs_kh
            p = tl.load(q_ptr + rows[:, None] * (K // 2) + kh[None, :],
                        mask=n_mask[:, None] & (kh[None, :] < k_hi // 2), other=0, eviction_policy="evict_first")
            kg = k0 // G + offs_kg
            s = tl.load(s_ptr + rows[:, None] * (K // G) + kg[None, :],
                        mask=n_mask[:, None] & (kg[None, :] < k_hi // G), other=0, eviction_policy="evict_first")
            if ASM:  # GPU: PTX decode, even and odd k in two dots (no interleave shuffle)
                w_even, w_odd = decode_even_odd_asm(p, s, FMT, MX_SHIFT, BLOCK_N, BLOCK_K)
                ke = k0 + 2 * offs_kh
                xmask = m_mask[:, None] & (ke[None, :] < k_hi)
                xe = tl.load(x_ptr + offs_m[:, None] * stride_xm + ke[None, :], mask=xmask, other=0)
                xo = tl.load(x_ptr + offs_m[:, None] * stride_xm + ke[None, :] + 1, mask=xmask, other=0)
                acc += tl.dot(w_even, tl.trans(xe))
                acc += tl.dot(w_odd, tl.trans(xo))
            else:
                w = decode_tile(p, s, lut_ptr, FMT, BF16, BLOCK_N, BLOCK_K)
                kk = k0 + offs_k
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                            mask=m_mask[:, None] & (kk[None, :] < k_hi), other=0)
                acc += tl.dot(w, tl.trans(x.to(w.dtype)))
        if not USE_WS:
            _epilogue(acc, offs_n, offs_m, N, M, y_ptr, stride_ym, gsinv_ptr, bias_ptr, xa_ptr, lb_ptr, scaling, R,
                      HAS_GS, HAS_BIAS, HAS_LORA, BLOCK_R)
        else:
            ptrs = ws_ptr + pid_k * M * N + offs_m[None, :] * N + offs_n[:, None]
            tl.store(ptrs, acc, mask=n_mask[:, None] & m_mask[None, :])

    @triton.jit
    def _splitk_reduce_kernel(ws_ptr, y_ptr, gsinv_ptr, bias_ptr, xa_ptr, lb_ptr, M, N, stride_ym, scaling, R, SPLIT_K,
                              HAS_GS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
                              BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for s in range(SPLIT_K):  # fixed order: the same bits every run
            acc += tl.load(ws_ptr + s * M * N + offs_m[None, :] * N + offs_n[:, None], mask=mask, other=0)
        _epilogue(acc, offs_n, offs_m, N, M, y_ptr, stride_ym, gsinv_ptr, bias_ptr, xa_ptr, lb_ptr, scaling, R,
                  HAS_GS, HAS_BIAS, HAS_LORA, BLOCK_R)

    @triton.jit
    def _dequant_kernel(q_ptr, s_ptr, lut_ptr, w_ptr, N, K, FMT: tl.constexpr, BF16: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        G: tl.constexpr = 16 if FMT == 0 else (32 if FMT == 1 else 64)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        rows = offs_n.to(tl.int64)
        n_mask = offs_n < N
        kh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        kg = k0 // G + tl.arange(0, BLOCK_K // G)
        p = tl.load(q_ptr + rows[:, None] * (K // 2) + kh[None, :], mask=n_mask[:, None] & (kh[None, :] < K // 2),
                    other=0)
        s = tl.load(s_ptr + rows[:, None] * (K // G) + kg[None, :], mask=n_mask[:, None] & (kg[None, :] < K // G),
                    other=0)
        w = decode_tile(p, s, lut_ptr, FMT, BF16, BLOCK_N, BLOCK_K)
        kk = k0 + tl.arange(0, BLOCK_K)
        tl.store(w_ptr + rows[:, None] * K + kk[None, :], w.to(w_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & (kk[None, :] < K))

    _built = True


# ---- launchers ---------------------------------------------------------------------------
_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


# Tiles per M bucket: (BLOCK_N, BLOCK_K, num_warps, num_stages, waves). Chosen from the H200 sweep
# (`python -m qerl.bench.kernels --sweep`, notes in benchmarks/kernels.md).
TILES = {4: (64, 128, 4, 3, 4), 16: (128, 128, 8, 3, 4), 32: (128, 128, 8, 3, 4), 64: (128, 128, 8, 3, 4)}


def make_config(M, N, K, fmt_id, device, block_n, block_k, num_warps, num_stages, waves):
    """Split K until the grid has about `waves` programs per SM (each split at least one K tile)."""
    block_m = min(64, max(16, next_pow2(M)))
    block_k = max(block_k, GROUP[fmt_id])
    k_steps = _cdiv(K, block_k)
    tiles = _cdiv(N, block_n) * _cdiv(M, block_m)
    want = waves * _num_sms(device)
    split = max(1, min(k_steps, want // tiles)) if tiles < want else 1
    k_split = _cdiv(k_steps, split) * block_k
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=_cdiv(K, k_split), k_split=k_split,
                num_warps=num_warps, num_stages=num_stages)


def fused_config(M: int, N: int, K: int, fmt_id: int, device: torch.device) -> dict:
    bucket = min((b for b in TILES if M <= b), default=max(TILES))
    return make_config(M, N, K, fmt_id, device, *TILES[bucket])


def use_asm(x2d, fmt_id) -> bool:
    return settings.current().ptx_decode and x2d.is_cuda and x2d.dtype == torch.bfloat16 and fmt_id in (0, 1)




def lora_args(lora, M):
    """(xa [M, r], B [N, r], scaling, r, BLOCK_R) for a kernel's LoRA-expand epilogue (r = 0: none)."""
    if lora is None:
        return None, None, 0.0, 0, 16
    xa, lb, scaling = lora
    R = lb.shape[1]
    return xa.reshape(M, -1).contiguous(), lb.contiguous(), scaling, R, max(16, next_pow2(R))


def fused_matmul(x2d, fmt_id, packed, scale, lut, gs_inv, N, bias=None, lora=None, config=None, out=None,
                 asm=None):
    """x2d [M, K] (contiguous rows) -> [M, N]. packed [N, K/2] uint8, scale [N, K/G].

    gs_inv: the epilogue factor, a 1-element fp32 tensor or None. With the PTX decode it is
    asm[0] (2^7/gs for NVFP4, 2^shift for MXFP4), passed as asm = (factor tensor, mx_shift).
    """
    M, K = x2d.shape
    cfg = dict(config or fused_config(M, N, K, fmt_id, x2d.device))
    split, k_split = cfg.pop("SPLIT_K"), cfg.pop("k_split")
    on_asm = asm is not None and use_asm(x2d, fmt_id)
    mx_shift = 0
    if on_asm:
        gs_inv, mx_shift = asm
    y = out if out is not None else torch.empty(M, N, device=x2d.device, dtype=x2d.dtype)
    bf16 = x2d.dtype == torch.bfloat16
    xa, lb, scaling, R, block_r = lora_args(lora, M)
    dummy = x2d  # unused pointer arguments (their branch is compiled out)
    ws = torch.empty(split, M, N, device=x2d.device, dtype=torch.float32) if split > 1 else dummy
    flags = dict(HAS_GS=gs_inv is not None, HAS_BIAS=bias is not None, HAS_LORA=lora is not None, BLOCK_R=block_r)
    ptrs = (gs_inv if gs_inv is not None else dummy, bias if bias is not None else dummy,
            xa if xa is not None else dummy, lb if lb is not None else dummy)
    grid = (_cdiv(N, cfg["BLOCK_N"]), split, _cdiv(M, cfg["BLOCK_M"]))
    _build()
    _fused_kernel[grid](x2d, packed, scale, lut if lut is not None else dummy, ws, y, *ptrs,
                        M, N, K, x2d.stride(0), y.stride(0), k_split, float(scaling), R, mx_shift,
                        FMT=fmt_id, BF16=bf16, USE_WS=split > 1, ASM=on_asm, **flags, **cfg)
    if split > 1:
        bm, bn = min(cfg["BLOCK_M"], 64), 64
        _splitk_reduce_kernel[(_cdiv(N, bn), _cdiv(M, bm))](ws, y, *ptrs, M, N, y.stride(0), float(scaling), R, split,
                                                              **flags, BLOCK_M=bm, BLOCK_N=bn)
    return y


def dequantize(fmt_id, packed, scale, lut, N, K, dtype, out=None, block_n=32, block_k=256, num_warps=4):
    """bf16/fp16/fp32 [N, K] weights without the NVFP4 1/global-scale."""
    w = out if out is not None else torch.empty(N, K, device=packed.device, dtype=dtype)
    block_k = min(block_k, max(GROUP[fmt_id], next_pow2(K)))
    grid = (_cdiv(N, block_n), _cdiv(K, block_k))
    _build()
    _dequant_kernel[grid](packed, scale, lut if lut is not None else packed, w, N, K, FMT=fmt_id,
                          BF16=dtype == torch.bfloat16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return w


class ScratchBuffer:
    """One reused dense-weight buffer per (device, dtype): a single layer's worth."""

    def __init__(self):
        self._bufs: dict[tuple, torch.Tensor] = {}

    def get(self, n: int, k: int, device, dtype) -> torch.Tensor:
        key = (torch.device(device), dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n * k:
            buf = torch.empty(n * k, device=device, dtype=dtype)
            self._bufs[key] = buf
        return buf[: n * k].view(n, k)


SCRATCH = ScratchBuffer()


def dequant_matmul(x2d, fmt_id, packed, scale, lut, gs_inv_host, N, bias=None):
    """Large M: dequantize into the scratch buffer, then cuBLAS with alpha = 1/gs (one rounding)."""
    M, K = x2d.shape
    w = dequantize(fmt_id, packed, scale, lut, N, K, x2d.dtype, out=SCRATCH.get(N, K, x2d.device, x2d.dtype))
    if bias is not None:
        return torch.addmm(bias.to(x2d.dtype), x2d, w.t(), alpha=gs_inv_host)
    y = torch.empty(M, N, device=x2d.device, dtype=x2d.dtype)
    return torch.addmm(y, x2d, w.t(), beta=0, alpha=gs_inv_host, out=y)


def dequant_matmul_grad_input(gy2d, fmt_id, packed, scale, lut, gs_inv_host, N, K):
    w = dequantize(fmt_id, packed, scale, lut, N, K, gy2d.dtype, out=SCRATCH.get(N, K, gy2d.device, gy2d.dtype))
    g = torch.empty(gy2d.shape[0], K, device=gy2d.device, dtype=gy2d.dtype)
    return torch.addmm(g, gy2d, w, beta=0, alpha=gs_inv_host, out=g)


def roofline_bytes(M: int, N: int, K: int, fmt_id: int, act_bytes: int = 2) -> int:
    """Fewest bytes a W4 matmul must move: packed weights + scales + x + y."""
    scale_bytes = {0: 1, 1: 1, 2: 4}[fmt_id]
    return N * K // 2 + N * K // GROUP[fmt_id] * scale_bytes + (M * K + M * N) * act_bytes


__all__ = ["fused_matmul", "dequantize", "dequant_matmul", "dequant_matmul_grad_input", "fused_config",
           "roofline_bytes", "SCRATCH"]

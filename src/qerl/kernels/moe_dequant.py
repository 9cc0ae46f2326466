"""Chosen experts' 4-bit weights dequantized in one launch: [c, N, K] in the activations' dtype.

QuantExperts' grouped path (prefill and update: many tokens an expert) dequantizes a chunk of hit
experts and multiplies with one torch._grouped_mm. The format's torch dequantize takes ~10 ops with
fp32 temporaries per expert: measured on an H100 (qerl bench moe, 2026-12-06), a Qwen3-30B-A3B
layer of 128 experts took 35 ms that way, ~275 µs an expert whose 4-bit bytes are 2.65 MB. This kernel
reads each expert's codes and scales once and writes its weights once: per expert 2.65 MB read + 9.4 MB
written, ~3.6 µs at 3.35 TB/s (H100), so the layer's 128 experts ~0.5 ms.

Bit-exact with the formats' own `dequantize` (tests/test_moe_dequant.py): codes decoded to fp32
(w4_decode's bit arithmetic), NVFP4's block scale divided by the expert's global scale in fp32 with
IEEE rounding (`div_rn`, as torch divides) before the product, MXFP4's 2^(e-127) exact, one rounding
to the output dtype. Experts are picked by an index tensor, so the chunk is never gathered first.
"""

from __future__ import annotations

import torch

from . import w4_decode
from .w4_decode import cdiv

FMT_IDS = {"nvfp4": 0, "mxfp4": 1}
BLOCK_N, BLOCK_K = 32, 256
_built = False  # _build() ran


def _build():
    """Define the @triton.jit kernels, once, at first use: importing this module needs no Triton
    (the CPU install has none)."""
    # Module globals, not closures: Triton's interpreter (the CPU tests) runs a kernel's source against
    # its module's globals alone.
    global _built, triton, tl, _e2m1_f32, _dequant_experts_kernel, _TWO_POW_M127
    if _built:
        return
    import triton
    import triton.language as tl
    w4_decode._build()
    _e2m1_f32 = w4_decode._e2m1_f32

    # E8M0 code 0: 2^-127, a subnormal the bit shift below cannot make
    _TWO_POW_M127 = tl.constexpr(5.877471754111438e-39)

    @triton.jit
    def _dequant_experts_kernel(q_ptr, s_ptr, gs_ptr, ids_ptr, w_ptr, N, K, FMT: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        G: tl.constexpr = 16 if FMT == 0 else 32
        j = tl.program_id(2)  # the j-th chosen expert: output slab j
        e = tl.load(ids_ptr + j).to(tl.int64)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = offs_n.to(tl.int64)
        n_mask = offs_n < N
        k0 = tl.program_id(1) * BLOCK_K
        kh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        kg = k0 // G + tl.arange(0, BLOCK_K // G)
        p = tl.load(q_ptr + (e * N + rows[:, None]) * (K // 2) + kh[None, :],
                    mask=n_mask[:, None] & (kh[None, :] < K // 2), other=0).to(tl.uint32)
        s = tl.load(s_ptr + (e * N + rows[:, None]) * (K // G) + kg[None, :],
                    mask=n_mask[:, None] & (kg[None, :] < K // G), other=0)
        if FMT == 0:
            sc = tl.math.div_rn(s.to(tl.float8e4nv, bitcast=True).to(tl.float32), tl.load(gs_ptr + e))
        else:
            b = s.to(tl.uint32)
            sc = tl.where(b == 0, _TWO_POW_M127, (b << 23).to(tl.float32, bitcast=True))
        vals = tl.join(_e2m1_f32(p & 15), _e2m1_f32(p >> 4)).reshape(BLOCK_N, BLOCK_K // G, G)
        w = (vals * sc[:, :, None]).reshape(BLOCK_N, BLOCK_K)
        kk = k0 + tl.arange(0, BLOCK_K)
        tl.store(w_ptr + (j * N + rows[:, None]) * K + kk[None, :], w.to(w_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & (kk[None, :] < K))

    _built = True


def dequantize_experts(fmt, tensors: dict[str, torch.Tensor], ids: torch.Tensor, shape: tuple[int, int],
                       dtype: torch.dtype) -> torch.Tensor:
    """[len(ids), N, K]: experts `ids` of the stacked format tensors ([E, N, K/2] codes, [E, N, K/G] scales,
    NVFP4's [E, 1] global scales) dequantized, as fmt.dequantize gives each one."""
    n, k = shape
    fid = FMT_IDS[fmt.name]
    g = 16 if fid == 0 else 32
    packed, scale = tensors["weight_packed"], tensors["weight_scale"].view(torch.uint8)
    if packed.shape[1:] != (n, k // 2) or scale.shape[1:] != (n, k // g) or k % g:
        raise ValueError(f"{fmt.name} experts of shape {shape}: expected codes [E, {n}, {k // 2}] and scales "
                         f"[E, {n}, {k // g}], got {tuple(packed.shape)} and {tuple(scale.shape)}")
    gs = tensors["weight_global_scale"].to(torch.float32).reshape(-1).contiguous() if fid == 0 else packed
    ids = ids.to(device=packed.device, dtype=torch.int32).contiguous()
    out = torch.empty(ids.numel(), n, k, device=packed.device, dtype=dtype)
    grid = (cdiv(n, BLOCK_N), cdiv(k, BLOCK_K), ids.numel())
    _build()
    _dequant_experts_kernel[grid](packed.contiguous(), scale.contiguous(), gs, ids, out, n, k, FMT=fid,
                                  BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    return out

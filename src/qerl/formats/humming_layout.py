"""humming-kernels' weight layout (0.1.20, bf16 activations, sm_90) for NVFP4 and MXFP4, in torch and back.

Why: qerl keeps ONE copy of each frozen weight. When that copy is in humming's layout, the training
backward (dX = dY @ W) and the large-M paths need W [N, K] in bf16, which humming does not offer. This
module holds (1) a pure-torch, CPU-runnable reimplementation of what `HummingLayer.transform()` makes of
compressed-tensors NVFP4/MXFP4 tensors, (2) its exact inverse, (3) a Triton kernel that dequantizes
straight from humming's layout, bit-equal to `get_format(...).dequantize` of the original tensors.

What `HummingLayer.transform()` chooses for our two cases (traced through humming 0.1.20; a bf16
HummingLayer on sm_90, no input quantization, num_experts None, no padding):

* schema/compressed_tensors.py `_convert_humming`: `weight_packed` uint8 [N, K/2] is only *viewed* as
  int32 [N, K/8] (8 codes a word, code k at bits 4*(k%8): our low-nibble-first bytes, little endian).
  `weight_scale` is only *viewed*: NVFP4 stays float8_e4m3fn, MXFP4's uint8 becomes float8_e8m0fnu; no
  scale is re-encoded. NVFP4's `weight_global_scale` becomes `weight_scale_2` = 1 / global_scale, fp32,
  shape [1] (schema/base.py `_may_process_global_scale` keeps one value), weight_scale_2_type TENSOR.
* transform.py `prepare_layer_config` -> config/config.py LayerConfig: a=bf16, b=e2m1, c=bf16,
  bs=e4m3 (NVFP4) / e8m0 (MXFP4), group 16 / 32 (powers of two: no regrouping). With 16-bit
  activations use_fused_e8m0_scale, use_int_weight_scale, use_packed_k_layout, use_raw_weight,
  use_flat_weight, use_ldmatrix_dequant, use_native_dequant (sm_9x), use_block_scaled_mma (no
  mxmma/umma on sm_90) are all False; should_apply_bs_on_c is False (group scales).
  `prepare_fp16_e8m0_scale` is a no-op (c is bf16, not fp16), and so is `pack_e8m0_scale_for_fp16`.
* transform.py `transform_humming_tensors`: interleave_mode = 3 (2 only for fused E8M0 with fp8
  activations); `transform_humming_weight` -> ops/weight.py `_repack_weight_op` -> the CUDA kernel
  `weight_repack_nk<4, 16, packed=1, int2fp=0, zp=0, transpose_mini_block=0, 0, packed_k=0, native=0>`
  (include/humming/kernel/process.cuh). Output int32 [K/16, 2N]. `transform_humming_weight_scale(ws,
  to_apply_on_c=False)`: scale transposed to [K/G, N], then an 8x8 transpose inside every 64 channels.
  weight_scale_2 (TENSOR) passes through unchanged.

The weight permutation, derived from `weight_repack_nk` + `humming_pack_weight` (mode 3, which reorders
both the sign bit and the magnitude bits with `get_interleaved_index`: nibble p of a word takes element
2*(p%4) + p//4 of its 8-element run). Word (R, C) of the output, nibble p (bits 4p..4p+3), holds code

    n = 64*(C // 128) + 16*(C % 4) + 8*((p >> 1) & 1) + (C % 128) // 16
    k = 16*R + 8*(p & 1) + 2*((C % 16) // 4) + (p >> 2)

i.e. with C = 128*bx + 16*l_hi + 4*l_lo + J (lane = 4*l_hi + l_lo of the repack warp) and
p = 4*p2 + 2*p1 + p0:  n = 64*bx + 16*J + 8*p1 + l_hi,  k = 16*R + 8*p0 + 2*l_lo + p2
(the m16n8k16 B-fragment order: lane//4 picks the channel, lane%4 the k pair, p0 the k+8 half).
The scale permutation (transform.py `transform_humming_weight_scale`, perm [0, 8, ..., 56] + i):
    weight_scale_h[g, 64*b + 8*i + c] = weight_scale[64*b + 8*c + i, g].

Our layout dict ("humming tensors"): `weight` int32 [K/16, 2N], `weight_scale` [K/G, N] (float8_e4m3fn
or float8_e8m0fnu), NVFP4 also `weight_scale_2` fp32 [1] (= 1/gs, humming's) and `weight_global_scale`
fp32 [1] (ours). The last one is kept because 1/(1/gs) is not always gs in fp32 (the reciprocal is
not injective), and the formats' dequantize divides by gs itself; it is 4 bytes a weight.
"""

from __future__ import annotations

import torch

from .e2m1 import pack_codes, unpack_codes

GROUP = {"nvfp4": 16, "mxfp4": 32}
_SCALE_DTYPE = {"nvfp4": torch.float8_e4m3fn, "mxfp4": torch.float8_e8m0fnu}


def _check_shape(fmt_name: str, shape: tuple[int, int]) -> tuple[int, int]:
    if fmt_name not in GROUP:
        raise ValueError(f"humming layout: format {fmt_name!r} is not one of {sorted(GROUP)}")
    n, k = shape
    # transform.py transform_humming_weight: padded_shape_n % 64, padded_shape_k % (2 * 256 / a_bits).
    if n % 64 or k % 32:
        raise ValueError(f"humming layout needs N % 64 == 0 and K % 32 == 0 (no padding), got {shape}")
    return n, k


# ---------------------------------------------------------------------------------------------------
# 1. Forward: compressed-tensors tensors -> humming's tensors (pure torch, any device)
# ---------------------------------------------------------------------------------------------------

# Axes of the [N, K] code matrix split as n = (bx, J, p1, l_hi), k = (R, p0, l_lo, p2); reordered to
# humming's word order (R, bx, l_hi, l_lo, J) and nibble order (p2, p1, p0). Mirrors process.cuh
# weight_repack_nk (tmp[i1][i2][i3][i4][i5][i6] indexing, out col = 128*bx + 4*lane + J, row = 4*by + I)
# and humming_pack_weight (interleave_mode 3, get_interleaved_index with N=8, stride=2).
_CODES_TO_WORDS = (4, 0, 3, 6, 1, 7, 2, 5)  # from (bx, J, p1, l_hi, R, p0, l_lo, p2)
_WORDS_TO_CODES = tuple(_CODES_TO_WORDS.index(i) for i in range(8))


def repack_weight(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """weight_packed uint8 [N, K/2] -> humming's weight int32 [K/16, 2N]."""
    n, k = shape
    codes = unpack_codes(packed.view(torch.uint8)).reshape(n // 64, 4, 2, 8, k // 16, 2, 4, 2)
    nib = codes.permute(*_CODES_TO_WORDS).reshape(k // 16, 2 * n * 8)
    # Nibble p at bits 4p of a little-endian int32 = byte p//2, low nibble first: our pack_codes.
    return pack_codes(nib).contiguous().view(torch.int32)


def unrepack_weight(weight: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """humming's weight int32 [K/16, 2N] -> weight_packed uint8 [N, K/2]."""
    n, k = shape
    nib = unpack_codes(weight.contiguous().view(torch.uint8)).reshape(k // 16, n // 64, 8, 4, 4, 2, 2, 2)
    return pack_codes(nib.permute(*_WORDS_TO_CODES).reshape(n, k)).contiguous()


def _swap8x8(s: torch.Tensor) -> torch.Tensor:
    """[G, N] -> an 8x8 transpose inside each run of 64 (transform.py transform_humming_weight_scale,
    perm [0, 8, 16, ..., 56] shifted by 0..7, applied to the flattened transposed scale). Its own inverse."""
    g, n = s.shape
    return s.reshape(g * n // 64, 8, 8).transpose(1, 2).reshape(g, n)


def repack_scale(scale: torch.Tensor, fmt_name: str) -> torch.Tensor:
    """weight_scale [N, K/G] -> humming's [K/G, N], in humming's dtype (e4m3 / e8m0; bytes unchanged)."""
    s = scale.view(torch.uint8).t().contiguous()
    return _swap8x8(s).contiguous().view(_SCALE_DTYPE[fmt_name])


def unrepack_scale(scale_h: torch.Tensor, fmt_name: str) -> torch.Tensor:
    """humming's weight_scale [K/G, N] -> ours [N, K/G] (NVFP4 float8_e4m3fn, MXFP4 uint8)."""
    s = _swap8x8(scale_h.contiguous().view(torch.uint8)).t().contiguous()
    return s.view(torch.float8_e4m3fn) if fmt_name == "nvfp4" else s


def to_humming(fmt_name: str, t: dict[str, torch.Tensor], shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """compressed-tensors tensors -> the tensors `HummingLayer.transform()` holds (+ our global scale)."""
    n, k = _check_shape(fmt_name, shape)
    g = GROUP[fmt_name]
    packed, scale = t["weight_packed"], t["weight_scale"]
    if tuple(packed.shape) != (n, k // 2) or tuple(scale.shape) != (n, k // g):
        raise ValueError(f"{fmt_name} {shape}: expected weight_packed [{n}, {k // 2}] and weight_scale "
                         f"[{n}, {k // g}], got {tuple(packed.shape)} and {tuple(scale.shape)}")
    out = {"weight": repack_weight(packed, shape), "weight_scale": repack_scale(scale, fmt_name)}
    if fmt_name == "nvfp4":
        gs = t["weight_global_scale"].to(torch.float32).reshape(1)
        # schema/compressed_tensors.py _convert_humming: `1 / weight_global_scale`, kept as fp32 [1].
        out["weight_scale_2"] = (1 / gs).float()
        out["weight_global_scale"] = gs.clone()
    return out


def recover_global_scale(weight_scale_2: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """gs from humming's 1/gs alone: (candidate, exact) where exact says no other fp32 x near it has
    fl(1/x) == weight_scale_2 (then the candidate is certainly the original gs)."""
    r = weight_scale_2.to(torch.float32).reshape(1)
    c = (1 / r).float()
    up, down = c.clone(), c.clone()
    hits = [c] if bool(((1 / c).float() == r).all()) else []
    for _ in range(3):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.zeros_like(down))
        hits += [x for x in (up, down) if bool(((1 / x).float() == r).all())]
    if not hits:
        return c, False
    return hits[0], len(hits) == 1


def from_humming(fmt_name: str, h: dict[str, torch.Tensor], shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """humming's tensors -> compressed-tensors tensors, byte for byte. NVFP4's weight_global_scale is
    taken as stored when present, else recovered from weight_scale_2 (exact unless 1/gs is shared by
    two fp32 values; `recover_global_scale` tells)."""
    _check_shape(fmt_name, shape)
    out = {"weight_packed": unrepack_weight(h["weight"], shape),
           "weight_scale": unrepack_scale(h["weight_scale"], fmt_name)}
    if fmt_name == "nvfp4":
        gs = h.get("weight_global_scale")
        out["weight_global_scale"] = (gs.to(torch.float32).reshape(1).clone() if gs is not None
                                      else recover_global_scale(h["weight_scale_2"])[0])
    return out


# ---------------------------------------------------------------------------------------------------
# 3. Dequantize straight from humming's layout (Triton; TRITON_INTERPRET=1 on the CPU)
# ---------------------------------------------------------------------------------------------------

BLOCK_R = 16  # k-tiles of 16 a program: a [64, 256] output tile from 16 rows x 512 B of words
_built = False  # _build() ran


def _build():
    """Define the dequantize kernel, once, at first use: importing this module needs no Triton (the CPU
    install has none, and its torch functions above are all the CPU uses)."""
    # Module globals, not closures: Triton's interpreter (the CPU tests) runs a kernel's source against
    # its module's globals alone.
    global _built, triton, tl, _e2m1_f32, _dequant_humming_kernel, _TWO_POW_M127
    if _built:
        return
    import triton
    import triton.language as tl

    _TWO_POW_M127 = tl.constexpr(5.877471754111438e-39)  # E8M0 code 0: 2^-127, which the bit shift cannot make

    @triton.jit
    def _e2m1_f32(c):
        """uint32 codes 0..15 -> fp32 (qerl.kernels.w4_decode's bit arithmetic, repeated so formats/ does not
        import kernels/)."""
        mag = c & 7
        bits = (mag << 22) + (126 << 23)
        bits = tl.where(mag == 1, 0x3F000000, bits)
        bits = tl.where(mag == 0, 0, bits)
        bits = bits | ((c & 8) << 28)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _dequant_humming_kernel(w_ptr, s_ptr, gs_ptr, out_ptr, N, K, FMT: tl.constexpr, BLOCK_R: tl.constexpr,
                                PERMUTE: tl.constexpr):
        """One program: channels [64*bx, 64*bx + 64) x k [16*R0, 16*R0 + 16*BLOCK_R). Output tile [64, BK]."""
        G: tl.constexpr = 16 if FMT == 0 else 32
        BK: tl.constexpr = 16 * BLOCK_R
        bx = tl.program_id(0)
        r0 = tl.program_id(1) * BLOCK_R
        n_l = tl.arange(0, 64)
        k_l = tl.arange(0, BK)
        k_ok = (r0 * 16 + k_l) < K
        if PERMUTE:
            # Words of the tile as they lie: BLOCK_R rows of 128 consecutive int32 (512 B each, coalesced),
            # split into nibbles and reordered to [n, k] in registers/shared memory by tl.permute.
            rr = tl.arange(0, BLOCK_R)
            cc = tl.arange(0, 128)
            words = tl.load(w_ptr + (r0 + rr)[:, None].to(tl.int64) * (2 * N) + bx * 128 + cc[None, :],
                            mask=((r0 + rr) < K // 16)[:, None], other=0).to(tl.uint32)
            nib = (words[:, :, None] >> (4 * tl.arange(0, 8)).to(tl.uint32)[None, None, :]) & 15
            vals = _e2m1_f32(nib).reshape(BLOCK_R, 8, 4, 4, 2, 2, 2)  # (r, l_hi, l_lo, J, p2, p1, p0)
            vals = tl.permute(vals, (3, 5, 1, 0, 6, 2, 4)).reshape(64, BK)  # (J, p1, l_hi | r, p0, l_lo, p2)
        else:
            # Each output element gathers its word (L1 serves the 8 reads of a word; DRAM reads it once).
            J = n_l // 16
            p1 = (n_l // 8) % 2
            l_hi = n_l % 8
            R = r0 + k_l // 16
            p0 = (k_l // 8) % 2
            l_lo = (k_l % 8) // 2
            p2 = k_l % 2
            row_part = bx * 128 + 16 * l_hi + J
            col_part = R.to(tl.int64) * (2 * N) + 4 * l_lo
            words = tl.load(w_ptr + col_part[None, :] + row_part[:, None], mask=k_ok[None, :], other=0)
            shift = (8 * p1)[:, None] + (16 * p2 + 4 * p0)[None, :]
            vals = _e2m1_f32((words.to(tl.uint32) >> shift.to(tl.uint32)) & 15)
        # Scales: humming's [K/G, N] with an 8x8 transpose inside each 64 channels (transform.py
        # transform_humming_weight_scale): channel 64*bx + n_l sits at column 64*bx + 8*(n_l % 8) + n_l // 8.
        gg = r0 * 16 // G + tl.arange(0, BK // G)
        s = tl.load(s_ptr + gg[None, :].to(tl.int64) * N + (bx * 64 + 8 * (n_l % 8) + n_l // 8)[:, None],
                    mask=(gg < K // G)[None, :], other=0)
        if FMT == 0:
            # qerl.formats.nvfp4 dequantize: scale / gs in fp32 (IEEE, as torch divides), then the product.
            sc = tl.math.div_rn(s.to(tl.float8e4nv, bitcast=True).to(tl.float32), tl.load(gs_ptr))
        else:
            b = s.to(tl.uint32)
            sc = tl.where(b == 0, _TWO_POW_M127, (b << 23).to(tl.float32, bitcast=True))
        w = (vals.reshape(64, BK // G, G) * sc[:, :, None]).reshape(64, BK)
        n_g = (bx * 64 + n_l).to(tl.int64)
        tl.store(out_ptr + n_g[:, None] * K + (r0 * 16 + k_l)[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=k_ok[None, :])

    _built = True


def dequantize_bf16(fmt_name: str, h: dict[str, torch.Tensor], shape: tuple[int, int],
                    dtype: torch.dtype = torch.bfloat16, permute: bool = True,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """W [N, K] in `dtype` (bf16 by default) read straight from humming's tensors, equal bit for bit to
    `get_format(fmt_name).dequantize(original tensors, shape, dtype)`. NVFP4 needs the exact global
    scale: `weight_global_scale` when stored, else recovered from `weight_scale_2`.
    `permute` picks the load scheme: True (default) loads the tile's words as they lie (16-B vector loads
    on sm_90) and reorders them with tl.permute; False gathers each element's word (scalar loads, L1
    serves the repeats). Both write 16-B vector stores along K; both are bit-exact."""
    n, k = _check_shape(fmt_name, shape)
    g = GROUP[fmt_name]
    w, s = h["weight"], h["weight_scale"]
    if tuple(w.shape) != (k // 16, 2 * n) or tuple(s.shape) != (k // g, n):
        raise ValueError(f"humming {fmt_name} {shape}: expected weight [{k // 16}, {2 * n}] and weight_scale "
                         f"[{k // g}, {n}], got {tuple(w.shape)} and {tuple(s.shape)}")
    if fmt_name == "nvfp4":
        gs = h.get("weight_global_scale")
        gs = recover_global_scale(h["weight_scale_2"])[0] if gs is None else gs
        gs = gs.to(device=w.device, dtype=torch.float32).reshape(1).contiguous()
    else:
        gs = w  # unused
    if out is None:
        out = torch.empty(n, k, device=w.device, dtype=dtype)
    grid = (n // 64, -(-(k // 16) // BLOCK_R))
    _build()
    _dequant_humming_kernel[grid](w.contiguous(), s.contiguous().view(torch.uint8), gs, out, n, k,
                                  FMT=0 if fmt_name == "nvfp4" else 1, BLOCK_R=BLOCK_R, PERMUTE=permute,
                                  num_warps=4)
    return out

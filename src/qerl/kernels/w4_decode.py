"""Decoding 4-bit weights in registers (Triton helpers shared by every W4 kernel).

Hopper has no FP4 instructions, so codes are turned into floats with integer
bit arithmetic (no lookup table, no float conversion per weight):

* E2M1 -> bf16 bits: the 3 magnitude bits (e e m) go to bf16 bits 8..6 and the
  exponent is re-biased (+126); the two codes with e = 0 (0 and 0.5) are fixed
  up with selects. Exact.
* E2M1 -> fp32 bits: the same with the fp32 field positions; used for fp16/fp32
  activations and by the CPU interpreter, whose bf16 support is broken.

NVFP4 block scales (E4M3) and MXFP4 scales (E8M0) multiply the decoded values;
e2m1 x e4m3 needs at most 6 significant bits, so the product is exact in bf16.
The NVFP4 global scale is applied to the fp32 accumulator by the caller.
NF4 has no closed form: its 16 code values come from a small table in memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

NVFP4, MXFP4, NF4 = 0, 1, 2
GROUP = {NVFP4: 16, MXFP4: 32, NF4: 64}


@triton.jit
def _e2m1_bf16(c):
    """c: uint32 codes 0..15 -> bf16 values."""
    mag = c & 7
    bits = (mag << 6) + (126 << 7)
    bits = tl.where(mag == 1, 0x3F00, bits)  # 0.5
    bits = tl.where(mag == 0, 0, bits)
    bits = bits | ((c & 8) << 12)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _e2m1_f32(c):
    """c: uint32 codes 0..15 -> fp32 values."""
    mag = c & 7
    bits = (mag << 22) + (126 << 23)
    bits = tl.where(mag == 1, 0x3F000000, bits)
    bits = tl.where(mag == 0, 0, bits)
    bits = bits | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def decode_tile(p, s, lut_ptr, FMT: tl.constexpr, BF16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed bytes p [BLOCK_N, BLOCK_K/2] and their scales s [BLOCK_N, BLOCK_K/GROUP] -> weights [BLOCK_N, BLOCK_K].

    s holds raw bytes for NVFP4 (E4M3) and MXFP4 (E8M0), fp32 for NF4.

    Values are in bf16 if BF16 else fp32, in natural k order (NVFP4/MXFP4 keep the
    even k in the low nibble, NF4 in the high one). NVFP4 values lack the 1/global-scale.
    """
    G: tl.constexpr = 16 if FMT == 0 else (32 if FMT == 1 else 64)
    p = p.to(tl.uint32)
    if FMT == 2:
        even = tl.load(lut_ptr + (p >> 4))
        odd = tl.load(lut_ptr + (p & 15))
        sc = s.to(tl.float32)
    elif BF16:
        even = _e2m1_bf16(p & 15)
        odd = _e2m1_bf16(p >> 4)
        if FMT == 0:
            sc = s.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        else:
            sc = (s.to(tl.uint32) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        even = _e2m1_f32(p & 15)
        odd = _e2m1_f32(p >> 4)
        if FMT == 0:
            sc = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            sc = (s.to(tl.uint32) << 23).to(tl.float32, bitcast=True)
    w = tl.join(even, odd).reshape(BLOCK_N, BLOCK_K // G, G)
    w = (w * sc[:, :, None]).reshape(BLOCK_N, BLOCK_K)
    if BF16:
        w = w.to(tl.bfloat16)
    return w

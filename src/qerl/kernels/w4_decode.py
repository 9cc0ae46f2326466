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

from .w4_decode_consts import ASM_SHIFT  # noqa: F401

NVFP4, MXFP4, NF4 = 0, 1, 2
GROUP = {NVFP4: 16, MXFP4: 32, NF4: 64}


def next_pow2(n: int) -> int:
    """triton.next_power_of_2 for the launchers' host arithmetic, without importing Triton."""
    return 1 << (n - 1).bit_length() if n > 1 else n


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- the GPU fast path: PTX on packed registers ---------------------------------------------
# Four packed bytes (8 codes) in one 32-bit register become 8 bf16 values with shifts, masks and
# byte permutes, two lanes per instruction: the e/m bits go to bf16 bits 8..6, the sign to bit
# 15, which reads as code·2^-126 (the subnormal case 0.5 included). The block scale comes in
# pre-multiplied by 2^(126-7) so one bf16x2 multiply per pair gives code·scale·2^-7 exactly;
# the caller's epilogue restores the 2^7. Outputs: the even-k (low nibble) and odd-k values.
E2M1X8_ASM = """
{
.reg .b32 l02, h02, l13, h13, t, u;
shl.b32 t, $4, 6;  and.b32 t, t, 0x01C001C0; shl.b32 u, $4, 12; and.b32 u, u, 0x80008000; or.b32 l02, t, u;
shl.b32 t, $4, 2;  and.b32 t, t, 0x01C001C0; shl.b32 u, $4, 8;  and.b32 u, u, 0x80008000; or.b32 h02, t, u;
shr.u32 t, $4, 2;  and.b32 t, t, 0x01C001C0; shl.b32 u, $4, 4;  and.b32 u, u, 0x80008000; or.b32 l13, t, u;
shr.u32 t, $4, 6;  and.b32 t, t, 0x01C001C0; and.b32 u, $4, 0x80008000; or.b32 h13, t, u;
prmt.b32 t, l02, l13, 0x5410; mul.rn.bf16x2 $0, t, $5;
prmt.b32 t, l02, l13, 0x7632; mul.rn.bf16x2 $1, t, $6;
prmt.b32 t, h02, h13, 0x5410; mul.rn.bf16x2 $2, t, $5;
prmt.b32 t, h02, h13, 0x7632; mul.rn.bf16x2 $3, t, $6;
}
"""
_built = False  # _build() ran


def _build():
    """Define the @triton.jit helpers every W4 kernel shares (decode_tile, decode_even_odd_asm, ...), once, at
    first use: importing this module needs no Triton (the CPU install has none)."""
    # Module globals, not closures: Triton's interpreter (the CPU tests) runs a kernel's source against
    # its module's globals alone.
    global _built, triton, tl, _e2m1_bf16, _e2m1_f32, decode_tile, group_scale_bf16, decode_even_odd_asm
    global _E2M1X8_ASM
    if _built:
        return
    import triton
    import triton.language as tl

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
    def decode_tile(p, s, lut_ptr, FMT: tl.constexpr, BF16: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        """Packed bytes p [BLOCK_N, BLOCK_K/2] and their scales s [BLOCK_N, BLOCK_K/GROUP] -> weights
        [BLOCK_N, BLOCK_K].

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

    _E2M1X8_ASM = tl.constexpr(E2M1X8_ASM)

    @triton.jit
    def group_scale_bf16(s, FMT: tl.constexpr, MX_SHIFT):
        """Raw block scales -> bf16 scale·2^(126-shift): 2^119·E4M3 for NVFP4, 2^(e-1-MX_SHIFT) for MXFP4."""
        if FMT == 0:
            v = s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 6.64613997892457936451903530140172288e35  # 2^119
        else:
            e = s.to(tl.int32) - 1 - MX_SHIFT + 127
            v = tl.where(e > 0, (tl.maximum(e, 1) << 23).to(tl.float32, bitcast=True), 0.0)
        return v.to(tl.bfloat16)

    @triton.jit
    def decode_even_odd_asm(p, s, FMT: tl.constexpr, MX_SHIFT, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """(even-k, odd-k) bf16 weights [BLOCK_N, BLOCK_K/2] each, from bytes p and raw scales s
        [BLOCK_N, BLOCK_K/G]."""
        G: tl.constexpr = 16 if FMT == 0 else 32
        sc = group_scale_bf16(s, FMT, MX_SHIFT)
        sc = tl.broadcast_to(sc[:, :, None], (BLOCK_N, BLOCK_K // G, G // 2)).reshape(BLOCK_N, BLOCK_K // 2)
        return tl.inline_asm_elementwise(_E2M1X8_ASM, "=r,=r,=r,=r,r,r,r", [p, sc],
                                         dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)

    _built = True

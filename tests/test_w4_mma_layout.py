"""The MMA layout of NVFP4 (formats/nvfp4_mma.py) and the kernel's index maps, on the CPU.

The kernel itself needs a GPU (tests/test_w4_mma_gpu.py). Here: the repack and its inverse
are bit-exact; a fragment emulator that walks the kernel's (lane, register) -> (row, k) maps
as the PTX ISA defines them for mma.m16n8k16 rebuilds W equal to `dequantize`; the decode
bit formulas are checked on every code and every scale byte; and an emulated matmul through
those fragments equals x @ W^T in float64.
"""

import pytest
import torch

from qerl.formats import get_format
from qerl.formats.base import QuantizationError
from qerl.formats.e2m1 import E2M1_VALUES
from qerl.formats.nvfp4_mma import (BIT_SOURCES, OUT_SHIFT, SCALE_ENCODE, NVFP4Mma, code_bits_bf16, place_bits, repack,
                                    scale_bits_bf16, unrepack)

NV = get_format("nvfp4")


def _exact(t, n, k):
    """fp4 value x block scale in float64 (NVFP4's dequantize without its float32 1/gs rounding)."""
    from qerl.formats.e2m1 import codes_to_float, unpack_codes

    v = codes_to_float(unpack_codes(t["weight_packed"])).double().view(n, k // 16, 16)
    return (v * t["weight_scale"].double()[..., None]).view(n, k)
SHAPES = [(16, 64), (48, 128), (32, 576), (64, 192)]


def _weights(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1
    w[0, :16] = 0  # a zero block (scale 0.125 by compressed-tensors' rule)
    w[1, 5] = 3.0  # an outlier
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("n,k", SHAPES)
def test_repack_inverse_is_bit_exact(n, k):
    t = NV.quantize(_weights(n, k, n + k))
    p, s = repack(t["weight_packed"], t["weight_scale"], (n, k))
    assert p.shape == t["weight_packed"].shape and s.shape == t["weight_scale"].shape  # 0.5625 B/weight
    p2, s2 = unrepack(p, s, (n, k))
    assert torch.equal(p2, t["weight_packed"])
    assert torch.equal(s2.view(torch.uint8), t["weight_scale"].view(torch.uint8))
    # A real permutation, not the identity.
    assert not torch.equal(p, t["weight_packed"])


def _mma_a_fragment(lane, reg):
    """PTX ISA, mma.m16n8k16 .bf16, operand A (row-major 16 x 16): the (row, k) of the two halves of
    32-bit register `reg` (0..3) of `lane`."""
    g, q = lane // 4, lane % 4
    row = g + 8 * (reg % 2)
    k = 2 * q + 8 * (reg // 2)
    return row, (k, k + 1)


def _logical_to_input(t, q_of_lane, logical_k):
    """The kernel's input index (within a 64-input chunk) behind MMA k `logical_k` of step t, as its
    activation loads define it: lane q's b0 = x[16q + 4t + {0,1}], b1 = x[16q + 4t + {2,3}], and the
    B operand gives lane q the logical rows 2q+{0,1} (b0) and 2q+8+{0,1} (b1)."""
    q = (logical_k % 8) // 2
    assert q == q_of_lane or q_of_lane is None
    return 16 * q + 4 * t + 2 * (logical_k // 8) + logical_k % 2


def _words(packed_mma, n, k):
    b = packed_mma.reshape(n // 16, k // 64, 32, 4, 4).to(torch.int64)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)  # little-endian u32


def _emulate_weight(packed_mma, scale_mma, n, k):
    """W * 2^-7 (no 1/gs) rebuilt lane by lane from the kernel's decode, float64 [n, k]."""
    words = _words(packed_mma, n, k)  # [NT, KCH, 32, 4]
    sc = scale_mma.view(torch.uint8).reshape(n // 16, k // 64, 32, 2)
    w = torch.full((n, k), float("nan"), dtype=torch.float64)
    wv = w.view(n // 16, 16, k // 64, 64)
    for lane in range(32):
        q = lane % 4
        s_rows = [scale_bits_bf16(sc[:, :, lane, j]).double() for j in range(2)]  # rows g, g+8
        for t in range(4):
            for reg in range(4):
                lo, hi = code_bits_bf16(words[:, :, lane, t], reg)
                row, ks = _mma_a_fragment(lane, reg)
                for half, kk in zip((lo, hi), ks):
                    prod = half.double() * s_rows[reg % 2]
                    assert torch.equal(prod, (half * s_rows[reg % 2].bfloat16()).double())  # exact in bf16
                    wv[:, row, :, _logical_to_input(t, q, kk)] = prod
    return w


@pytest.mark.parametrize("n,k", SHAPES)
def test_fragment_emulator_rebuilds_the_dequantized_weight(n, k):
    t = NV.quantize(_weights(n, k, 7 * n + k))
    p, s = repack(t["weight_packed"], t["weight_scale"], (n, k))
    w = _emulate_weight(p, s, n, k)
    assert not torch.isnan(w).any()  # every (row, k) reached exactly once per lane map
    assert torch.equal(w * 2.0**OUT_SHIFT, _exact(t, n, k))
    gs = float(t["weight_global_scale"])
    torch.testing.assert_close(w * 2.0**OUT_SHIFT / gs, NV.dequantize(t, (n, k), torch.float64), rtol=1e-6, atol=0)


@pytest.mark.parametrize("bits", [1, 2])
def test_decode_formula_on_every_code_and_scale_byte(bits):
    codes = torch.arange(16, dtype=torch.uint8)
    # A word holding code c in all 8 slots (bits placed as `bits` orders them): every register half decodes it.
    b = place_bits(codes[:, None].expand(16, 8), BIT_SOURCES[bits]).to(torch.int64)
    word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
    vals = [code_bits_bf16(word, i, bits) for i in range(4)]
    for lo, hi in vals:
        assert torch.equal(lo.double() * 2.0**126, E2M1_VALUES.double()) and torch.equal(hi, lo)
    # And slot by slot: a word with one code set decodes it in exactly its register half, zeros elsewhere.
    for p in range(8):
        one = torch.zeros(16, 8, dtype=torch.uint8)
        one[:, p] = codes
        b = place_bits(one, BIT_SOURCES[bits]).to(torch.int64)
        word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
        i, h = 3 - p % 4, p // 4
        for r in range(4):
            for hh, half in enumerate(code_bits_bf16(word, r, bits)):
                want = E2M1_VALUES.double() if (r, hh) == (i, h) else E2M1_VALUES.double() * 0
                assert torch.equal(half.double().abs() * 2.0**126, want.abs())
    e4m3 = torch.arange(256, dtype=torch.uint8)
    real = e4m3.view(torch.float8_e4m3fn).double()
    ok = SCALE_ENCODE >= 0
    assert int(ok.sum()) == 126  # the positive finite E4M3 values
    assert torch.equal(ok, (real > 0) & torch.isfinite(real))
    s = scale_bits_bf16(SCALE_ENCODE[ok].to(torch.uint8)).double() * 2.0**-119
    assert torch.equal(s, real[ok])  # every positive finite scale, exactly
    for lo, _ in vals:  # code x scale in bf16 = value x scale x 2^-7 for all 16 x 126 pairs
        prod = (lo[:, None] * scale_bits_bf16(SCALE_ENCODE[ok].to(torch.uint8))[None, :]).double()
        assert torch.equal(prod * 2.0**OUT_SHIFT, E2M1_VALUES.double()[:, None] * real[ok][None, :])


def test_bad_scales_and_shapes_are_refused_with_the_layer_named():
    t = NV.quantize(_weights(16, 64, 1))
    s = t["weight_scale"].clone()
    s.view(torch.uint8)[3, 2] = 0x80  # -0.0
    with pytest.raises(QuantizationError, match=r"layers.3.q_proj.*row 3, block 2"):
        repack(t["weight_packed"], s, (16, 64), "layers.3.q_proj")
    with pytest.raises(QuantizationError, match="16 x 64"):
        repack(t["weight_packed"][:8], t["weight_scale"][:8], (8, 64))


@pytest.mark.parametrize("m", [1, 5, 8, 13])
def test_emulated_mma_matmul_equals_x_wt(m):
    """The kernel's arithmetic (decode, fragments, per-step MMA, epilogue factor) in float64."""
    n, k = 32, 128
    t = NV.quantize(_weights(n, k, 99))
    p, s = repack(t["weight_packed"], t["weight_scale"], (n, k))
    x = torch.randn(m, k).to(torch.bfloat16).double()
    words = _words(p, n, k)
    sc = s.view(torch.uint8).reshape(n // 16, k // 64, 32, 2)
    y = torch.zeros(m, n, dtype=torch.float64)
    for rt in range(n // 16):
        for c in range(k // 64):
            for t_ in range(4):
                a = torch.zeros(16, 16, dtype=torch.float64)  # logical A of this MMA
                mt = -(-m // 8)
                b = torch.zeros(16, 8 * mt, dtype=torch.float64)  # logical B (k x tokens), 8 per tile
                for lane in range(32):
                    g, q = lane // 4, lane % 4
                    for reg in range(4):
                        lo, hi = code_bits_bf16(words[rt, c, lane, t_], reg)
                        srow = scale_bits_bf16(sc[rt, c, lane, reg % 2]).double()
                        row, ks = _mma_a_fragment(lane, reg)
                        a[row, ks[0]], a[row, ks[1]] = lo.double() * srow, hi.double() * srow
                    for tile in range(mt):  # b0: logical 2q+{0,1}; b1: 2q+8+{0,1}; token 8*tile + g
                        for breg in range(2):
                            for j in range(2):
                                kk, tok = 2 * q + 8 * breg + j, 8 * tile + g
                                if tok < m:
                                    b[kk, tok] = x[tok, 64 * c + _logical_to_input(t_, q, kk)]
                y[:, rt * 16:(rt + 1) * 16] += (a @ b[:, :m]).T
    y = y * 2.0**OUT_SHIFT / float(t["weight_global_scale"])
    ref = x @ (_exact(t, n, k) / float(t["weight_global_scale"])).T
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-12)


def test_mma_format_matches_nvfp4_through_checkpoint_round_trip():
    w = _weights(48, 128, 5)
    mma = NVFP4Mma()
    t = mma.quantize(w)
    std = NV.quantize(w)
    back = mma.to_checkpoint(t, (48, 128))
    assert torch.equal(back["weight_packed"], std["weight_packed"])
    assert torch.equal(back["weight_scale"].view(torch.uint8), std["weight_scale"].view(torch.uint8))
    assert torch.equal(mma.dequantize(t, (48, 128)), NV.dequantize(std, (48, 128)))
    again = mma.from_checkpoint(back, (48, 128))
    assert torch.equal(again["weight_packed"], t["weight_packed"])


def test_row_tiles_are_contiguous_so_row_slices_are_members():
    """A fused group (q|k|v) in the MMA layout: rows [a, b) of the group at multiples of 16 are
    exactly the MMA layout of that member."""
    ws = [_weights(n, 128, n) for n in (32, 16, 16)]
    gs = NV.global_scale(ws)
    cat = torch.cat(ws)
    t = NVFP4Mma().quantize(cat, gs)
    r0 = 0
    for w in ws:
        own = NVFP4Mma().quantize(w, gs)
        assert torch.equal(t["weight_packed"][r0:r0 + w.shape[0]], own["weight_packed"])
        assert torch.equal(t["weight_scale"][r0:r0 + w.shape[0]].view(torch.uint8), own["weight_scale"].view(torch.uint8))
        r0 += w.shape[0]


@pytest.mark.skipif(not __import__("qerl.kernels.nvrtc", fromlist=["x"]).nvcc_available(), reason="nvcc not installed")
@pytest.mark.parametrize("mt", [1, 2, 4, 8])
def test_mma_kernel_builds_for_sm90a_without_spills(mt):
    """The mma.sync kernel with the v2 decode, every tuned launch shape, bias + LoRA, shrink in the launch."""
    from qerl.kernels import nvrtc, w4_mma

    cfg = w4_mma.plan(8 * mt, 4608, 3584, 132)
    for fuse in (0, 1):
        d = dict(MT=cfg.mt, RT=cfg.rt, WARPS=cfg.warps, ST=cfg.stages, XSM=int(cfg.xsm > 0), XST=max(2, cfg.xsm),
                 DUAL=int(cfg.mt * cfg.rt <= 2), HAS_BIAS=1, HAS_LORA=1, FUSE_SHRINK=fuse)
        rep = nvrtc.ptxas_report("w4_mma.cu", d)
        assert set(rep) == {"w4_mma_matmul", "w4_mma_dequantize"}
        for r in rep.values():
            assert r.spill_stores == 0 and r.spill_loads == 0 and r.registers > 0, r

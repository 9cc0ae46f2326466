"""The wgmma kernel (kernels/w4_wgmma.cu) on the CPU: its index maps, its arithmetic, its build.

The kernel needs an H200 (tests/test_w4_wgmma_gpu.py). Here, each map is written the way the CUDA
code computes it and checked against an independent definition: the activation staging (`permute_x`
and the 128-byte swizzle) read back through the address a wgmma B descriptor generates must give the
MMA's logical k order that the weights' layout defines (PTX ISA: K-major B, swizzle of 16-byte chunks
by row mod 8); a whole launch emulated in float64 (cp.async slots, register-A decode, descriptors per
k-step, split-K in order, the epilogue's fragment map) equals x @ W^T; and where nvcc is installed,
ptxas builds every tile for sm_90a with no spills and no wgmma serialization, and the SASS holds
register-sourced HGMMAs.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qerl.formats import get_format
from qerl.formats.e2m1 import codes_to_float, unpack_codes
from qerl.formats.nvfp4_mma import OUT_SHIFT, code_bits_bf16, repack, scale_bits_bf16
from qerl.kernels import nvrtc, w4_wgmma

NV = get_format("nvfp4")


def _exact(t, n, k):
    """fp4 value x block scale in float64 (NVFP4's dequantize rounds 1/gs to float32 first)."""
    v = codes_to_float(unpack_codes(t["weight_packed"])).double().view(n, k // 16, 16)
    return (v * t["weight_scale"].double()[..., None]).view(n, k)


def _logical_to_input(t, kk):
    """Independent of the kernel: the MMA layout's permutation (formats/nvfp4_mma.py docstring), logical k
    kk of k-step t -> input within the chunk; lane q = (kk % 8) // 2 holds it in register i = 2 (kk // 8) + ..."""
    q, i2, h = (kk % 8) // 2, kk // 8, kk % 2
    return 16 * q + 4 * t + 2 * i2 + h


def _swz(n, p):  # the kernel's swz(): where logical 16-byte piece p of token row n goes
    return n * 128 + ((p ^ (n & 7)) << 4)


def _permute_x(raw: torch.Tensor, bn: int) -> torch.Tensor:
    """The kernel's permute_x on one chunk: raw [bn, 64] bf16 (token rows, inputs) -> the swizzled B tile
    as bytes, written the way the CUDA code writes it (32-bit word w of raw block 2q + s -> word q of piece 4s + w)."""
    words = raw.contiguous().view(torch.int32).view(bn, 8, 4)  # [n, block j, word w]
    tile = torch.full((bn * 128 // 4,), -1, dtype=torch.int32)
    for n in range(bn):
        for s in range(2):
            for w in range(4):
                base = _swz(n, 4 * s + w) // 4
                for qq in range(4):
                    tile[base + qq] = words[n, 2 * qq + s, w]
    return tile


def _wgmma_fetch_b(tile: torch.Tensor, t: int, bn: int) -> torch.Tensor:
    """What wgmma reads as B (16 x bn, logical k x token) for k-step t from a descriptor whose start is
    tile + 32 t: K-major, 128-byte swizzle (PTX ISA): logical byte offset (n // 8) * SBO + (n % 8) * 128 + 2 kk,
    then bits 4..6 XORed with bits 7..9, inside 1024-byte-aligned atoms. SBO = 1024."""
    halves = tile.view(torch.int16)
    b = torch.empty(16, bn, dtype=torch.int16)
    for n in range(bn):
        for kk in range(16):
            addr = 32 * t + (n // 8) * 1024 + (n % 8) * 128 + 2 * kk
            phys = addr ^ (((addr >> 7) & 7) << 4)
            b[kk, n] = halves[phys // 2]
    return b.view(torch.bfloat16)


@pytest.mark.parametrize("bn", [8, 16, 24])
def test_staged_activations_read_back_in_the_mma_logical_k_order(bn):
    g = torch.Generator().manual_seed(bn)
    raw = torch.randn(bn, 64, generator=g).to(torch.bfloat16)
    tile = _permute_x(raw, bn)
    assert not (tile == -1).any()  # every word of the tile written exactly once (a permutation)
    for t in range(4):
        b = _wgmma_fetch_b(tile, t, bn)
        for kk in range(16):
            assert torch.equal(b[kk], raw[:, _logical_to_input(t, kk)])


def _a_fragment(word, sc2, wi):
    """Register-sourced A (64 rows x 16 k, one warpgroup) of one k-step from each lane's word and scale
    bytes, as the PTX ISA maps wgmma's A fragments (per warp: mma.m16n8k16's A layout on rows 16 wi..)."""
    a = torch.zeros(16, 16, dtype=torch.float64)
    for lane in range(32):
        g, q = lane // 4, lane % 4
        s = [scale_bits_bf16(sc2[lane, h]).double() for h in range(2)]
        for i in range(4):
            lo, hi = code_bits_bf16(word[lane], i)
            row, k = g + 8 * (i % 2), 2 * q + 8 * (i // 2)
            a[row, k], a[row, k + 1] = lo.double() * s[i % 2], hi.double() * s[i % 2]
    return a


def _emulate_launch(x, packed, scale, n, k, cfg: w4_wgmma.WgmmaConfig, factor, bias=None):
    """y [M, n] in float64 through the kernel's steps for every CTA of the grid."""
    m = x.shape[0]
    nt, kch = n // 16, k // 64
    words = packed.view(torch.int32).view(nt, kch, 32, 4)
    sc = scale.view(torch.uint8).view(nt, kch, 32, 2)
    gx, gy, gz = cfg.grid(m, n)
    y = torch.full((m, n), float("nan"), dtype=torch.float64)
    part = {}
    for bx in range(gx):
        for by in range(gy):
            rt0, tok0 = bx * cfg.wg * 4, by * cfg.bn
            for z in range(gz):
                c_begin = z * cfg.chunks_per_split
                nch = min(c_begin + cfg.chunks_per_split, kch) - c_begin
                acc = torch.zeros(64 * cfg.wg, cfg.bn, dtype=torch.float64)  # D: CTA rows x tokens
                for c in range(nch):
                    gc = c_begin + c
                    rows = [min(tok0 + r, m - 1) for r in range(cfg.bn)]
                    tile = _permute_x(x[rows, gc * 64:(gc + 1) * 64], cfg.bn)
                    for wi in range(4 * cfg.wg):
                        rt = min(rt0 + wi, nt - 1)
                        for t in range(4):
                            a = _a_fragment(words[rt, gc, :, t], sc[rt, gc], wi)
                            acc[16 * wi:16 * wi + 16] += a @ _wgmma_fetch_b(tile, t, cfg.bn).double()
                part[(bx, by, z)] = acc
            acc = sum(part[(bx, by, z)] for z in range(gz))  # split order
            for wi in range(4 * cfg.wg):  # the epilogue's fragment map: acc[4j + e] -> (row, token)
                rt = rt0 + wi
                if rt >= nt:
                    continue
                for lane in range(32):
                    g, q = lane // 4, lane % 4
                    for j in range(cfg.bn // 8):
                        for e in range(4):
                            row, tok = rt * 16 + g + 8 * (e >= 2), tok0 + 8 * j + 2 * q + (e & 1)
                            if tok < m:
                                v = acc[16 * wi + g + 8 * (e >= 2), 8 * j + 2 * q + (e & 1)] * factor
                                y[tok, row] = v + (0.0 if bias is None else float(bias[row]))
    return y


@pytest.mark.parametrize("m,n,k,bn,splits", [(9, 80, 192, 16, 2), (20, 48, 128, 24, 1), (5, 144, 256, 8, 3)])
def test_emulated_launch_equals_x_wt(m, n, k, bn, splits):
    g = torch.Generator().manual_seed(m * n)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    t = NV.quantize(w)
    packed, scale = repack(t["weight_packed"], t["weight_scale"], (n, k))
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    kch = k // 64
    cps = -(-kch // splits)
    cfg = w4_wgmma.WgmmaConfig(bn=bn, wg=1, stages=2, splits=-(-kch // cps), chunks_per_split=cps)
    gs = float(t["weight_global_scale"])
    bias = torch.randn(n, generator=g).double()
    y = _emulate_launch(x, packed, scale, n, k, cfg, 2.0**OUT_SHIFT / gs, bias)
    assert not torch.isnan(y).any()  # every (token, row) stored, by exactly the fragment map
    ref = x.double() @ (_exact(t, n, k) / gs).T + bias
    torch.testing.assert_close(y, ref, rtol=1e-9, atol=1e-9)


def test_plans_fit_shared_memory_and_cover_k():
    for m in (9, 16, 32, 64, 100, 128, 256):
        for n, k in ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (7168, 5120)):
            cfg = w4_wgmma.plan(m, n, k, 132)
            assert cfg.bn >= min(m, w4_wgmma.MAX_M) and cfg.smem_bytes() <= w4_wgmma.SMEM_LIMIT
            assert cfg.splits * cfg.chunks_per_split >= k // 64 > (cfg.splits - 1) * cfg.chunks_per_split
            gx, gy, gz = cfg.grid(m, n)
            assert gx * 64 * cfg.wg >= n and gy * cfg.bn >= m


def test_fused_shrink_roles_cover_every_tile_once():
    """Tickets past the shrink CTAs map to (bx, by, split) as the kernel computes them: each exactly once."""
    for gx, gy, gz in ((36, 1, 3), (5, 2, 4), (1, 1, 1)):
        seen = {(m % gx, (m // gx) % gy, m // (gx * gy)) for m in range(gx * gy * gz)}
        assert seen == {(x, y, z) for x in range(gx) for y in range(gy) for z in range(gz)}


def test_launcher_passes_the_kernels_parameters_in_order():
    w4_wgmma._check_arity()  # raises if Args and the kernel's signature differ
    assert nvrtc.parameters("w4_wgmma.cu", "w4_wgmma_matmul")[0] == "wq"


needs_nvcc = pytest.mark.skipif(not nvrtc.nvcc_available(), reason="nvcc not installed")


@needs_nvcc
@pytest.mark.parametrize("fuse_shrink", [False, True])
@pytest.mark.parametrize("bn", sorted(w4_wgmma.TUNING))
def test_ptxas_builds_every_tile_without_spills_or_serialized_wgmma(bn, fuse_shrink):
    if fuse_shrink and bn > w4_wgmma.FUSE_SHRINK_MAX_BN:
        pytest.skip("the launcher shrinks separately past FUSE_SHRINK_MAX_BN")
    cfg = w4_wgmma.plan(bn, 4608, 3584, 132)
    rep = nvrtc.ptxas_report(w4_wgmma.FILE, cfg.defines(True, True, fuse_shrink), generated=w4_wgmma.generated(cfg))
    r = rep[w4_wgmma.NAME]
    assert r.spill_stores == 0 and r.spill_loads == 0, r
    assert r.advisories == [], r.advisories
    per_warp = -(-r.registers * 32 // 256) * 256  # the register file is handed out per warp, 256 at a time
    assert 0 < r.registers <= 255 and per_warp * (cfg.threads // 32) * cfg.ctas_per_sm <= 65536, (r, cfg)


def _nvdisasm():
    found = shutil.which("nvdisasm")
    if found:
        return found
    for base in map(Path, sys.path):
        for p in base.glob("nvidia/cu*/bin/nvdisasm"):
            return str(p)
    return None


@needs_nvcc
@pytest.mark.skipif(_nvdisasm() is None, reason="nvdisasm not installed (the nvidia-cuda-nvdisasm wheel)")
def test_sass_holds_register_sourced_hgmma(tmp_path):
    cfg = w4_wgmma.plan(64, 4608, 3584, 132)
    src = tmp_path / "k.cu"
    src.write_text(nvrtc.source(w4_wgmma.FILE, cfg.defines(True, True), w4_wgmma.generated(cfg)))
    subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90a", "-cubin", "-o", str(tmp_path / "k.cubin"), str(src)], check=True)
    exe = _nvdisasm()
    if not Path(exe).stat().st_mode & 0o111:  # the wheel ships it without the execute bit for others
        Path(exe).chmod(0o755)
    sass = subprocess.run([exe, str(tmp_path / "k.cubin")], capture_output=True, text=True, check=True).stdout
    hg = re.findall(r"HGMMA\.64x(\d+)x16\.F32\.BF16 R\d+, (\S+), gdesc", sass)
    # 4 k-steps a chunk, in each copy of the consumer (the loop is unrolled by two, plus the odd tail)
    assert len(hg) > 0 and len(hg) % 4 == 0, hg
    assert all(n == str(cfg.bn) and a.startswith("R") for n, a in hg)  # A from registers

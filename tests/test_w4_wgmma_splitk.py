"""The wgmma kernel's workspace split-K (w4_wgmma.plan_splits / choose_splits, SPLITK_WS in w4_wgmma.cu) on the CPU.

The K slices and workspace offsets are the index header's own functions (w4_wgmma_index.cuh), compiled for the
host with g++ and called through ctypes: every chunk in exactly one slice, slices contiguous, in split order and
never empty; the workspace map a bijection onto part_floats, 16-byte aligned. The S-choosing rule, the plans, a
float64 emulation of "sum the S slice partials in split order" against one matmul, and (where nvcc is installed)
ptxas builds both launches of every token tile with no spills. On the GPU: tests/test_w4_wgmma_splitk_gpu.py.
"""

import ctypes
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from qerl.kernels import nvrtc, w4_wgmma

HEADER = Path(w4_wgmma.__file__).with_name(w4_wgmma.INDEX)
SHAPES_7B = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
_LIBS: dict = {}


def _lib(bn: int, tmp: Path):
    cfg = w4_wgmma.plan_splits(bn, 4608, 3584, 2)
    if bn in _LIBS:
        return _LIBS[bn], cfg
    src = (f"#define WG {cfg.wg}\n#define PW {cfg.pw}\n#define BN {cfg.bn}\n#define ST {cfg.stages}\n"
           f'#include "{HEADER}"\n'
           'extern "C" int f_slice_begin(int z, int s, int k) { return slice_begin(z, s, k); }\n'
           'extern "C" int f_slice_count(int z, int s, int k) { return slice_count(z, s, k); }\n'
           'extern "C" long long f_part_index(int z, int t, int nt, int ct, int i) {\n'
           '  return part_index(z, t, nt, ct, i);\n}\n'
           'extern "C" long long f_part_floats(int s, int nt) { return part_floats(s, nt); }\n'
           'extern "C" int c_nacc(void) { return NACC; }\nextern "C" int c_cthreads(void) { return CTHREADS; }\n')
    (tmp / f"s{bn}.cpp").write_text(src)
    so = tmp / f"s{bn}.so"
    subprocess.run(["g++", "-O1", "-std=c++17", "-shared", "-fPIC", "-o", str(so), str(tmp / f"s{bn}.cpp")], check=True)
    lib = ctypes.CDLL(str(so))
    lib.f_part_index.restype = lib.f_part_floats.restype = ctypes.c_longlong
    _LIBS[bn] = lib
    return lib, cfg


@needs_gxx
def test_slices_cover_every_chunk_once_contiguous_ordered_and_never_empty(tmp_path):
    lib, _ = _lib(64, tmp_path)
    for kch in list(range(1, 130)) + [296, 433, 462]:  # 296: K 18944 (down); 462: K 29568
        for s in range(1, min(kch, 70) + 1):
            begins = [lib.f_slice_begin(z, s, kch) for z in range(s + 1)]
            counts = [lib.f_slice_count(z, s, kch) for z in range(s)]
            assert begins[0] == 0 and begins[-1] == kch
            assert all(begins[z] + counts[z] == begins[z + 1] for z in range(s))  # contiguous, in order
            assert sum(counts) == kch and min(counts) >= 1  # each chunk exactly once, no empty slice
            assert max(counts) - min(counts) <= 1 and min(counts) == kch // s  # balanced
            if s <= kch // w4_wgmma.SPLIT_MIN_CHUNKS:
                assert min(counts) >= w4_wgmma.SPLIT_MIN_CHUNKS


@needs_gxx
@pytest.mark.parametrize("bn", sorted(w4_wgmma.TUNING))
def test_workspace_offsets_are_a_bijection_onto_the_launchers_workspace(bn, tmp_path):
    lib, cfg = _lib(bn, tmp_path)
    nacc, ct = lib.c_nacc(), lib.c_cthreads()
    assert nacc == bn // 2 and ct == 128 * cfg.wg
    m, n, s = bn + 3, 200, 3  # a partial token tile and a partial row block
    gx, gy, gz = w4_wgmma.plan_splits(m, n, 64 * 16, s, bn=bn).grid(m, n)
    ntiles = gx * gy
    size = lib.f_part_floats(s, ntiles)
    assert size == w4_wgmma.plan_splits(m, n, 64 * 16, s, bn=bn).part_floats(m, n) == gz * ntiles * ct * nacc
    idx = torch.tensor([lib.f_part_index(z, t, ntiles, c, i) for z in range(s) for t in range(ntiles)
                        for c in range(ct) for i in range(0, nacc, 4)])
    assert (idx % 4 == 0).all() and idx.min() == 0  # float4 stores: 16-byte aligned
    # each float4 its own 4 floats: the starts, plus 0..3, cover [0, size) exactly once
    every = (idx[:, None] + torch.arange(4)).flatten()
    assert every.numel() == size and torch.equal(every.sort().values, torch.arange(size))


def _tiles(m, n):
    bn = w4_wgmma.token_tile(m)
    return math.ceil(n / 64) * math.ceil(m / bn)


def test_choose_splits_is_the_smallest_one_wave_split_capped_at_4_chunks_a_slice():
    sms = 132
    for m in (1, 9, 16, 32, 64, 100, 128, 256):
        for n, k in list(SHAPES_7B.values()) + [(7168, 5120), (512, 256), (64, 512)]:
            s = w4_wgmma.choose_splits(m, n, k, sms)
            tiles, kch = _tiles(m, n), k // 64
            cap = max(1, kch // 4)
            assert 1 <= s <= cap
            if s < cap:  # not capped: the smallest S filling one wave
                assert tiles * s >= sms and (s == 1 or tiles * (s - 1) < sms)
            assert s == w4_wgmma.choose_splits(m, n, k, sms)  # a function of the shape: repeatable
    # the 7B layer set on an H100 (132 SMs): q|k|v 72 tiles -> 2, o and down 56 -> 3, gate|up 592 -> 1 (M <= 256)
    for m in (32, 64, 128, 256):
        got = {g: w4_wgmma.choose_splits(m, n, k, sms) for g, (n, k) in SHAPES_7B.items()}
        assert got == {"qkv": 2, "o": 3, "gate_up": 1, "down": 3}, (m, got)
    assert w4_wgmma.choose_splits(64, 512, 256, sms) == 1  # K 256: 4 chunks, one slice
    assert w4_wgmma.choose_splits(64, 4608, 3584, sms, ctas_per_sm=2) == 4  # two CTAs a SM: 264 / 72


def test_plan_splits_one_is_todays_unsplit_launch_and_more_use_the_workspace():
    for m in (16, 64, 256):
        n, k = SHAPES_7B["gate_up"]
        today = w4_wgmma.plan(m, n, k, 132)
        assert today.splits == 1
        one = w4_wgmma.plan_splits(m, n, k, 1)
        assert one == today and not one.ws  # same fields, so the same compile and the same bits
        assert one.defines(True, True) == today.defines(True, True) and "SPLITK_WS" not in one.defines(False, False)
        four = w4_wgmma.plan_splits(m, n, k, 4)
        assert four.ws and four.splits == 4 and four.grid(m, n)[2] == 4 and four.defines(True, False)["SPLITK_WS"] == 1
        with pytest.raises(ValueError):
            four.defines(False, True, fuse_shrink=True)
    with pytest.raises(ValueError):
        w4_wgmma.plan_splits(64, 512, 256, 5)  # 4 chunks: at most 4 slices


def test_launcher_passes_both_kernels_parameters_in_order():
    w4_wgmma._check_arity()
    assert nvrtc.parameters(w4_wgmma.FILE, w4_wgmma.REDUCE)[0] == "part"


@pytest.mark.parametrize("s", [1, 2, 3, 4, 7])
def test_sum_of_slice_partials_in_split_order_equals_one_matmul(s):
    """The arithmetic of a workspace split, emulated: fp32 partials of K slices (slice_begin's rule, 64-input
    chunks), added in split order in fp32 from 0, equal one matmul within fp32 accumulation noise (float64)."""
    g = torch.Generator().manual_seed(s)
    m, n, k = 37, 96, 64 * 29
    w = torch.randn(n, k, generator=g, dtype=torch.float64) * 0.05
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    kch = k // 64
    bounds = [64 * (z * kch // s) for z in range(s + 1)]
    acc = torch.zeros(m, n, dtype=torch.float32)
    for z in range(s):  # each partial as the kernel keeps it: fp32
        acc = acc + (x[:, bounds[z]:bounds[z + 1]] @ w[:, bounds[z]:bounds[z + 1]].T).float()
    ref = x @ w.T
    assert float((acc.double() - ref).norm() / ref.norm()) < 1e-6
    again = torch.zeros(m, n, dtype=torch.float32)
    for z in range(s):
        again = again + (x[:, bounds[z]:bounds[z + 1]] @ w[:, bounds[z]:bounds[z + 1]].T).float()
    assert torch.equal(acc, again)  # a fixed order: the same bits


@pytest.mark.skipif(not nvrtc.nvcc_available(), reason="nvcc not installed")
@pytest.mark.parametrize("bn", sorted(w4_wgmma.TUNING))
def test_ptxas_builds_both_launches_of_a_workspace_split_without_spills(bn):
    cfg = w4_wgmma.plan_splits(bn, 4608, 3584, 2)
    for has_bias, has_lora in ((False, False), (True, True)):
        rep = nvrtc.ptxas_report(w4_wgmma.FILE, cfg.defines(has_bias, has_lora), generated=w4_wgmma.generated(cfg))
        for name in (w4_wgmma.NAME, w4_wgmma.REDUCE):
            r = rep[name]
            assert r.spill_stores == 0 and r.spill_loads == 0 and r.advisories == [], (name, r)
            assert 0 < r.registers <= 255

"""The wgmma kernel (kernels/w4_wgmma.cu) on the CPU: its plans and its build.

Its address arithmetic and weight gather are compiled for the host and checked, with a whole launch
emulated through them, in tests/test_w4_wgmma_index.py; the kernel itself runs in tests/test_w4_wgmma_gpu.py
(an H100/H200). Here: every plan fits shared memory and covers K, and where nvcc is installed ptxas
builds every tile for sm_90a with no spills and no wgmma serialization, and the SASS holds
register-sourced HGMMAs.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from qerl.kernels import nvrtc, w4_wgmma


def test_plans_fit_shared_memory_and_cover_k():
    for m in (9, 16, 32, 64, 100, 128, 256):
        for n, k in ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (7168, 5120)):
            cfg = w4_wgmma.plan(m, n, k, 132)
            assert cfg.bn >= min(m, w4_wgmma.MAX_M) and cfg.smem_bytes() <= w4_wgmma.SMEM_LIMIT
            assert cfg.splits * cfg.chunks_per_split >= k // 64 > (cfg.splits - 1) * cfg.chunks_per_split
            gx, gy, gz = cfg.grid(m, n)
            assert gx * 64 * cfg.wg >= n and gy * cfg.bn >= m


def test_wave_plans_fit_cover_k_and_cut_the_modelled_chunk_steps():
    for m in (9, 16, 32, 64, 100, 128, 256):
        for n, k in ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (7168, 5120)):
            fill, waves = w4_wgmma.plan(m, n, k, 132), w4_wgmma.plan(m, n, k, 132, waves=True)
            assert waves.smem_bytes() <= w4_wgmma.SMEM_LIMIT and (waves.chunks_per_split >= 8 or waves.splits == 1)
            assert waves.splits * waves.chunks_per_split >= k // 64 > (waves.splits - 1) * waves.chunks_per_split
            slots = 132 * fill.ctas_per_sm
            blocks = -(-n // 64) * -(-m // fill.bn)

            def steps(c):  # the model, written out: waves x (chunks a CTA + the split's extra)
                extra = w4_wgmma.split_cost_chunks(c.bn) if c.splits > 1 else 0
                return -(-blocks * c.splits // slots) * (c.chunks_per_split + extra)
            assert steps(waves) <= steps(fill)
    # gate|up at M 64: 592 tiles on 264 slots fill 2.24 waves; the fill rule runs them unsplit in 3
    g = w4_wgmma.plan(64, 37888, 3584, 132, waves=True)
    assert w4_wgmma.plan(64, 37888, 3584, 132).splits == 1 and g.splits > 1


def test_wave_splits_leave_full_waves_alone_and_respect_min_chunks():
    assert w4_wgmma.wave_splits(264 * 3, 56, 264, 64) == 1  # whole waves: nothing to gain
    assert w4_wgmma.wave_splits(10, 56, 264, 64, min_chunks=8) <= 7
    assert w4_wgmma.wave_splits(10, 7, 264, 64, min_chunks=8) == 1  # K too short to split
    assert [w4_wgmma.split_cost_chunks(bn) for bn in (16, 64, 256)] == [2, 4, 4]


def test_launcher_passes_the_kernels_parameters_in_order():
    w4_wgmma._check_arity()  # raises if Args and the kernel's signature differ
    assert nvrtc.parameters("w4_wgmma.cu", "w4_wgmma_matmul")[0] == "wq"


needs_nvcc = pytest.mark.skipif(not nvrtc.nvcc_available(), reason="nvcc not installed")


@needs_nvcc
@pytest.mark.parametrize("bn", sorted(w4_wgmma.TUNING))
def test_ptxas_builds_every_tile_without_spills_or_serialized_wgmma(bn):
    cfg = w4_wgmma.plan(bn, 4608, 3584, 132)
    rep = nvrtc.ptxas_report(w4_wgmma.FILE, cfg.defines(True, True), generated=w4_wgmma.generated(cfg))
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

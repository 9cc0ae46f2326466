"""humming's NVFP4/MXFP4 layout reimplemented in torch (formats/humming_layout.py), on the CPU.

* The fast permutation equals a literal, loop-by-loop emulation of humming's CUDA repack kernel
  (process.cuh weight_repack_nk + humming_pack_weight, interleave_mode 3) and of its scale transform
  (transform.py transform_humming_weight_scale), both written here from reading that code.
* to_humming / from_humming are mutual inverses, byte for byte, on random codes and scales.
* The Triton dequant reading humming's layout (interpreter here; both load schemes) equals the formats'
  own dequantize bit for bit (fp32 and fp16 outputs: the interpreter's bf16 is broken).
The GPU file (test_humming_layout_gpu.py) checks all of this against humming itself."""

import os

import pytest
import torch

from qerl.formats import get_format
from qerl.formats import humming_layout as hl
from qerl.formats.e2m1 import unpack_codes

KERNEL = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
SHAPES = [(64, 32), (128, 96), (64, 256), (192, 288)]


def _random_ct(fmt_name, n, k, seed, finite=False):
    """Random bytes everywhere (any code, any scale byte); `finite` keeps scales off NaN/inf."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    hi = 255 if not finite else (0x7F if fmt_name == "nvfp4" else 255)
    scale = torch.randint(0, hi, (n, k // hl.GROUP[fmt_name]), generator=g, dtype=torch.uint8)
    if fmt_name == "mxfp4":
        return {"weight_packed": packed, "weight_scale": scale}
    if finite:  # e4m3 bytes 0x00..0x7E and their negatives, no NaN (0x7F / 0xFF)
        scale = scale | (torch.randint(0, 2, scale.shape, generator=g, dtype=torch.uint8) << 7)
    gs = torch.rand(1, generator=g) * 1000 + 0.01
    return {"weight_packed": packed, "weight_scale": scale.view(torch.float8_e4m3fn), "weight_global_scale": gs}


def _emulate_repack_kernel(packed, n, k):
    """weight_repack_nk<4 bits B, 16 bits A, packed input, no int2fp/zp, no mini-block transpose> with
    interleave_mode 3, one (blockIdx.x, blockIdx.y) and lane at a time, as the kernel runs."""
    words = packed.view(torch.int32).tolist()  # [N][K/8]
    out = [[0] * (2 * n) for _ in range(k // 16)]
    for bx in range(n // 64):
        for by in range((k + 63) // 64):
            for lane in range(32):
                tmp = [0] * 128  # tmp[4][1][4][2][2][2] flattened
                for i in range(8):
                    row = 64 * bx + i * 8 + lane // 4
                    for j in range(8):
                        for kk in range(2):
                            index = j * 8 + (lane % 4) * 2 + kk
                            col = 64 * by + index
                            val = 0
                            if col < k:
                                val = (words[row][col // 8] >> (4 * (col % 8))) & 15
                            i1, i3, i4, i5, i6 = j // 2, i // 2, i % 2, j % 2, kk
                            tmp[i1 * 32 + i3 * 8 + i4 * 4 + i5 * 2 + i6] = val
                out_arr = [0] * 16
                for i in range(4):
                    for j in range(4):
                        val = 0
                        for kk in range(8):
                            new_k = (kk % 4) * 2 + kk // 4  # get_interleaved_index: N=8, stride=2
                            single = tmp[i * 32 + j * 8 + new_k]
                            val |= (single & 7) << (4 * kk)  # mode % 2 == 1: magnitude from new_k
                            val |= (single & 8) << (4 * kk)  # mode / 2 == 1: sign from new_k
                        out_arr[i * 4 + j] = val
                for i in range(4):
                    if by * 64 + i * 16 >= k:
                        continue
                    r = by * 4 + i
                    for kk in range(4):
                        out[r][128 * bx + lane * 4 + kk] = out_arr[i * 4 + kk]
    t = torch.tensor(out, dtype=torch.int64)
    return torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)


def _emulate_scale_transform(scale_u8):
    """transform_humming_weight_scale(ws, to_apply_on_c=False): perm [0, 8, .., 56] repeated with +1 .. +7
    over the flattened transposed scale."""
    perm = [0, 8, 16, 24, 32, 40, 48, 56]
    perm_new = [x + i for i in range(8) for x in perm]
    t = scale_u8.t().contiguous()
    return t.view(-1, 64)[:, torch.tensor(perm_new)].reshape(t.shape)


@pytest.mark.parametrize("n,k", [(64, 32), (64, 96), (128, 64)])
def test_weight_permutation_equals_the_kernel_emulation(n, k):
    t = _random_ct("mxfp4", n, k, seed=n * k)
    want = _emulate_repack_kernel(t["weight_packed"], n, k)
    got = hl.repack_weight(t["weight_packed"], (n, k))
    assert got.dtype == torch.int32 and got.shape == (k // 16, 2 * n)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt_name", ["nvfp4", "mxfp4"])
def test_scale_permutation_equals_the_transform_emulation(fmt_name):
    t = _random_ct(fmt_name, 192, 256, seed=3)
    got = hl.repack_scale(t["weight_scale"], fmt_name)
    assert got.dtype == hl._SCALE_DTYPE[fmt_name] and got.shape == (256 // hl.GROUP[fmt_name], 192)
    assert torch.equal(got.view(torch.uint8), _emulate_scale_transform(t["weight_scale"].view(torch.uint8)))


def test_documented_index_formula():
    """The closed form in the module docstring: word (R, C), nibble p holds code (n, k)."""
    n, k = 128, 64
    t = _random_ct("mxfp4", n, k, seed=5)
    codes = unpack_codes(t["weight_packed"])
    w = hl.repack_weight(t["weight_packed"], (n, k))
    for r in range(k // 16):
        for c in range(2 * n):
            word = int(w[r, c]) & 0xFFFFFFFF
            for p in range(8):
                nn = 64 * (c // 128) + 16 * (c % 4) + 8 * ((p >> 1) & 1) + (c % 128) // 16
                kk = 16 * r + 8 * (p & 1) + 2 * ((c % 16) // 4) + (p >> 2)
                assert (word >> (4 * p)) & 15 == int(codes[nn, kk])


@pytest.mark.parametrize("fmt_name", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_round_trip_is_byte_exact(fmt_name, n, k):
    t = _random_ct(fmt_name, n, k, seed=n + k)
    h = hl.to_humming(fmt_name, t, (n, k))
    assert h["weight"].shape == (k // 16, 2 * n) and h["weight"].dtype == torch.int32
    back = hl.from_humming(fmt_name, h, (n, k))
    assert set(back) == set(t)
    for key in t:
        assert back[key].dtype == t[key].dtype and back[key].shape == t[key].shape, key
        assert torch.equal(back[key].view(torch.uint8), t[key].view(torch.uint8)), key
    # and the other way: humming's tensors -> ours -> humming's
    again = hl.to_humming(fmt_name, back, (n, k))
    for key in h:
        assert torch.equal(again[key].view(torch.uint8), h[key].view(torch.uint8)), key
    if fmt_name == "nvfp4":
        assert h["weight_scale_2"].dtype == torch.float32 and h["weight_scale_2"].shape == (1,)
        assert torch.equal(h["weight_scale_2"], 1 / t["weight_global_scale"])


def test_round_trip_of_quantized_weights():
    for fmt_name in ("nvfp4", "mxfp4"):
        fmt = get_format(fmt_name)
        w = (torch.randn(128, 256) * torch.rand(128, 1)).to(torch.bfloat16)
        t = fmt.quantize(w)
        back = hl.from_humming(fmt_name, hl.to_humming(fmt_name, t, (128, 256)), (128, 256))
        for key in t:
            assert torch.equal(back[key].view(torch.uint8), t[key].view(torch.uint8)), (fmt_name, key)


def test_global_scale_recovery_without_the_stored_copy():
    """1/(1/gs) is not always gs in fp32; the stored copy makes the inverse exact, the recovery says
    when it is sure."""
    gs = torch.linspace(1.4, 2.0, 4001, dtype=torch.float32)
    twice = (1 / (1 / gs)).float()
    assert (twice != gs).any()  # the reason weight_global_scale is kept
    sure = wrong = 0
    for x in gs[::40]:
        got, exact = hl.recover_global_scale((1 / x.reshape(1)).float())
        sure += exact
        if exact:
            assert torch.equal(got, x.reshape(1))
        wrong += not torch.equal(got, x.reshape(1))
    assert sure > 0
    t = _random_ct("nvfp4", 64, 32, seed=1)
    t["weight_global_scale"] = gs[(twice != gs).nonzero()[0]].clone()
    back = hl.from_humming("nvfp4", hl.to_humming("nvfp4", t, (64, 32)), (64, 32))
    assert torch.equal(back["weight_global_scale"], t["weight_global_scale"])


def test_bad_shapes_are_named():
    t = _random_ct("nvfp4", 64, 32, seed=0)
    with pytest.raises(ValueError, match="N % 64"):
        hl.to_humming("nvfp4", t, (48, 32))
    with pytest.raises(ValueError, match="expected weight_packed"):
        hl.to_humming("nvfp4", t, (64, 64))


@pytest.mark.skipif(not KERNEL, reason="no GPU and not in the Triton interpreter")
@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")  # E8M0 254 x 6 is inf, in torch too
@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt_name", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("n,k", [(64, 32), (128, 96), (64, 288)])
def test_triton_dequant_equals_the_format(fmt_name, n, k, dtype, permute):
    """Random codes and every finite scale byte (E8M0 code 0 = 2^-127 included); K tails inside a tile."""
    t = _random_ct(fmt_name, n, k, seed=7 * n + k, finite=True)
    h = hl.to_humming(fmt_name, t, (n, k))
    got = hl.dequantize_bf16(fmt_name, h, (n, k), dtype=dtype, permute=permute)
    want = get_format(fmt_name).dequantize(t, (n, k), dtype)
    assert got.shape == (n, k) and got.dtype == dtype
    iv = torch.int32 if dtype == torch.float32 else torch.int16
    diff = (got.view(iv) != want.view(iv)).nonzero()
    assert diff.numel() == 0, f"first mismatch at {diff[0].tolist()}: {got[tuple(diff[0])]} vs {want[tuple(diff[0])]}"


@pytest.mark.skipif(not KERNEL, reason="no GPU and not in the Triton interpreter")
def test_triton_dequant_of_quantized_weights_without_the_stored_global_scale():
    fmt = get_format("nvfp4")
    w = torch.randn(64, 64) * 0.03
    t = fmt.quantize(w)
    h = hl.to_humming("nvfp4", t, (64, 64))
    del h["weight_global_scale"]
    gs, exact = hl.recover_global_scale(h["weight_scale_2"])
    got = hl.dequantize_bf16("nvfp4", h, (64, 64), dtype=torch.float32)
    want = fmt.dequantize({**t, "weight_global_scale": gs}, (64, 64), torch.float32)
    assert torch.equal(got, want)
    if exact:
        assert torch.equal(got, fmt.dequantize(t, (64, 64), torch.float32))


_AOT = r"""
import re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qerl.formats import humming_layout as hl
hl._build()  # the kernel is defined at first use
sig = {"w_ptr": "*i32", "s_ptr": "*u8", "gs_ptr": "*fp32", "out_ptr": "*bf16", "N": "i32", "K": "i32",
       "FMT": "constexpr", "BLOCK_R": "constexpr", "PERMUTE": "constexpr"}
try:
    for fmt in (0, 1):
        for perm in (False, True):
            src = ASTSource(fn=hl._dequant_humming_kernel, signature=sig,
                            constexprs={"FMT": fmt, "BLOCK_R": hl.BLOCK_R, "PERMUTE": perm},
                            attrs={(i,): [["tt.divisibility", 16]] for i in range(6)})
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
            print(fmt, int(perm), len(re.findall(r"ld\.global[^\n]*v4", ptx)),
                  len(re.findall(r"st\.global[^\n]*v4", ptx)), len(re.findall(r"st\.global", ptx)))
except (ImportError, AttributeError, TypeError, KeyError) as e:  # Triton's AOT API moved
    print("API", type(e).__name__, e)
"""


def test_kernel_compiles_for_sm90_with_vector_stores():
    """Ahead-of-time compile for sm_90 (Triton's bundled ptxas, no GPU needed): both schemes build, all
    stores are 16-B vectors, and the permute scheme's word loads are 16-B vectors."""
    import subprocess
    import sys

    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _AOT], env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and ("ptxas" in r.stderr or "NVIDIA" in r.stderr):
        pytest.skip(f"no CUDA toolchain for an AOT compile: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    if r.stdout.startswith("API"):
        pytest.skip(f"Triton's AOT compile API differs here: {r.stdout.strip()}")
    for line in r.stdout.strip().splitlines():
        fmt, perm, v4_loads, v4_stores, stores = map(int, line.split())
        assert v4_stores == stores > 0, line
        if perm:
            assert v4_loads > 0, line

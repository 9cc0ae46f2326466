"""The M <= 4 GEMV (w4_gemv) against the formats' own dequantize and a float64 matmul.

On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1 and QERL_TRITON_ON_CPU=1,
as tests/test_w4_kernels.py sets them) at small sizes with fp32/fp16 activations (the interpreter's
bf16 is broken) and the plain-Triton fp16 -> fp32 conversion; on a GPU the same checks run in
bf16/fp16 with the inline-PTX conversion. Outputs are poisoned with NaN first.
"""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
from qerl.formats import get_format  # noqa: E402
from qerl.kernels import triton_backend  # noqa: E402
from qerl.kernels import w4_gemv as G  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and not in the Triton interpreter", allow_module_level=True)
ACT = [torch.bfloat16, torch.float16] if CUDA else [torch.float32, torch.float16]
TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
FORMATS = ["nvfp4", "mxfp4"]


def _weight(fmt, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1
    f = get_format(fmt)
    return f, f.quantize(w.to(DEV, torch.bfloat16))


def _ref(f, t, shape, x, bias=None, lora=None):
    """The independent reference: the format's dequantize (float64), then a float64 matmul."""
    y = x.double() @ f.dequantize(t, shape, torch.float64).t()
    if bias is not None:
        y = y + bias.double()
    if lora is not None:
        xa, b, s = lora
        y = y + s * (xa.double() @ b.double().t())
    return y


def _rel(a, b):
    assert not torch.isnan(a).any(), "NaN (an output element was never written?)"
    return ((a.double() - b).norm() / b.norm().clamp(min=1e-30)).item()


def _gemv(f, t, shape, x, **kw):
    fid, packed, scale, _, inv, _, _ = triton_backend.prepare(f, t, shape)
    out = torch.full((x.shape[0], shape[0]), float("nan"), device=x.device, dtype=x.dtype)
    return G.gemv(x, fid, packed, scale, inv, shape[0], out=out, **kw)


def _lora(m, n, k, r, dt, seed):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(r, k, generator=g) * 0.1).to(DEV, dt)
    b = (torch.randn(n, r, generator=g) * 0.1).to(DEV, dt)
    return a, b


# M, N, K: N off the block sizes; K = one tile, several tiles, and a K whose largest power-of-two
# divisor is small (384 = 3·128), so BLOCK_K is lowered to fit.
CASES = [(1, 40, 256), (2, 72, 384), (3, 33, 128), (4, 24, 512)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ACT)
@pytest.mark.parametrize("m,n,k", CASES)
@pytest.mark.parametrize("epilogue", ["plain", "bias_lora"])
def test_gemv_matches_dequantize_reference(fmt, dtype, m, n, k, epilogue):
    f, t = _weight(fmt, n, k, seed=m * 1000 + n + k)
    x = torch.randn(m, k, device=DEV).to(dtype)
    bias = lora = None
    if epilogue == "bias_lora":
        bias = torch.randn(n, device=DEV).to(dtype)
        a, b = _lora(m, n, k, 8, dtype, seed=n)
        lora = ((x.float() @ a.float().t()).to(dtype), b, 0.5)
    y = _gemv(f, t, (n, k), x, bias=bias, lora=lora, config=(16, 512, 4, 1, 1))  # BLOCK_K lowered to divide K
    assert y.dtype == dtype and y.shape == (m, n)
    assert _rel(y, _ref(f, t, (n, k), x, bias, lora)) < TOL[dtype]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_decodes_exactly(fmt):
    """Random bytes (all 16 codes, -0 included) and one-hot rows of x: y is a column of Ŵ."""
    n, k = 32, 64
    f = get_format(fmt)
    g = torch.Generator().manual_seed(7)
    t = {"weight_packed": torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8).to(DEV)}
    if fmt == "nvfp4":  # E4M3 scales from 2^-6 to 2^4 (no NaN), and a global scale
        t["weight_scale"] = torch.randint(0x18, 0x60, (n, k // 16), generator=g, dtype=torch.uint8).to(DEV).view(
            torch.float8_e4m3fn)
        t["weight_global_scale"] = torch.tensor([3.0], device=DEV)
    else:
        t["weight_scale"] = torch.randint(120, 134, (n, k // 32), generator=g, dtype=torch.uint8).to(DEV)
    cols = [0, 17, 38, 63]
    x = torch.zeros(4, k, device=DEV)
    x[range(4), cols] = 1.0
    y = _gemv(f, t, (n, k), x, config=(8, 64, 1, 1, 0))
    w = f.dequantize(t, (n, k), torch.float64)
    ref = w[:, cols].t()
    assert not torch.isnan(y).any()
    # exact up to the rounding of 1/gs (one fp32 ulp)
    assert (y.double() - ref).abs().max().item() <= 2.5e-7 * ref.abs().max().item()


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_split_k_is_exact_and_deterministic(mode, prefetch):
    n, k, m = 40, 2560, 3
    f, t = _weight("nvfp4", n, k, seed=3)
    dt = ACT[0]
    x = torch.randn(m, k, device=DEV).to(dt)
    bias = torch.randn(n, device=DEV).to(dt)
    a, b = _lora(m, n, k, 4, dt, seed=1)
    lora = ((x.float() @ a.float().t()).to(dt), b, 2.0)
    cfg = (32, 512, 4, 3, prefetch)  # 5 K tiles of the GPU tile width in 3 splits of 2, 2, 1 tiles
    y1 = _gemv(f, t, (n, k), x, bias=bias, lora=lora, config=cfg, split_mode=mode)
    y2 = _gemv(f, t, (n, k), x, bias=bias, lora=lora, config=cfg, split_mode=mode)
    assert torch.equal(y1, y2)
    assert _rel(y1, _ref(f, t, (n, k), x, bias, lora)) < TOL[dt]
    one = _gemv(f, t, (n, k), x, bias=bias, lora=lora, config=(32, 512, 4, 1, prefetch))
    assert _rel(y1, one.double()) < TOL[dt]
    # the split tickets are back to 0 for the next call
    assert int(G._weight_state(t["weight_packed"], n)[1].abs().sum()) == 0


def test_dispatch_routes_small_m_to_the_gemv(monkeypatch):
    monkeypatch.setenv("QERL_TRITON_ON_CPU", "1")
    n, k = 48, 256
    f, t = _weight("nvfp4", n, k, seed=9)
    dt = ACT[0]
    calls = []
    real = G.gemv
    monkeypatch.setattr(G, "gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    monkeypatch.setattr(triton_backend, "GEMV_MAX_M", 4)
    bias = torch.randn(n, device=DEV).to(dt)
    a, b = _lora(5, n, k, 8, dt, seed=2)
    for m in (1, 4, 5):
        x = torch.randn(1, m, k, device=DEV).to(dt)
        lora = ((x.float() @ a.float().t()).to(dt), b, 0.25)
        assert triton_backend.supports(x, f)
        y = triton_backend.matmul(x, f, t, (n, k), bias=bias, lora=lora)
        assert y.shape == (1, m, n)
        assert _rel(y[0], _ref(f, t, (n, k), x[0], bias, (lora[0][0], b, 0.25))) < TOL[dt]
    assert calls == [1, 4]  # M = 5 took the fused kernel
    monkeypatch.setattr(triton_backend, "GEMV_MAX_M", 0)
    triton_backend.matmul(torch.randn(1, k, device=DEV).to(dt), f, t, (n, k))
    assert calls == [1, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("n,k", [(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944)])
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("fmt", FORMATS)
def test_real_shapes_bf16(n, k, m, fmt):
    f, t = _weight(fmt, n, k, seed=n + k + m)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    a, b = _lora(m, n, k, 32, torch.bfloat16, seed=m)
    lora = ((x.float() @ a.float().t()).bfloat16(), b, 2.0)
    assert _rel(_gemv(f, t, (n, k), x, lora=lora), _ref(f, t, (n, k), x, lora=lora)) < 1e-2

"""Triton W4 kernels against a float64 dequantize-then-matmul reference.

On the CPU they run in Triton's interpreter at small sizes with fp32/fp16
activations (its bf16 is broken); on a GPU the same checks run in bf16 and at the
7B/32B shapes. Outputs are poisoned with NaN first, so an unwritten element fails.
"""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
from qerl.formats import get_format  # noqa: E402
from qerl.kernels import settings, triton_backend  # noqa: E402
from qerl.kernels import w4_matmul as K  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and not in the Triton interpreter", allow_module_level=True)
ACT = [torch.bfloat16, torch.float16] if CUDA else [torch.float32, torch.float16]
FORMATS = ["nvfp4", "mxfp4", "nf4"]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 1e-2}


def _weight(fmt, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1
    f = get_format(fmt)
    return f, f.quantize(w.to(DEV, torch.bfloat16))


def _ref(f, t, shape, x, bias=None, lora=None):
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


def _run_fused(f, t, shape, x, use_asm=True, **kw):
    fid, packed, scale, lut, inv, _, asm = triton_backend.prepare(f, t, shape)
    out = torch.full((x.shape[0], shape[0]), float("nan"), device=x.device, dtype=x.dtype)
    return K.fused_matmul(x, fid, packed, scale, lut, inv, shape[0], out=out, asm=asm if use_asm else None, **kw)


SMALL = [(1, 48, 64), (3, 96, 128), (5, 80, 16 * 24), (17, 64, 192)]  # M, N, K: N and M off the block sizes


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ACT)
@pytest.mark.parametrize("m,n,k", SMALL)
@pytest.mark.parametrize("use_asm", [True, False] if CUDA else [False])
def test_fused_matches_float64(fmt, dtype, m, n, k, use_asm):
    if k % get_format(fmt).block_size:
        pytest.skip("K below this format's block")
    f, t = _weight(fmt, n, k, seed=m * 1000 + n + k)
    x = torch.randn(m, k, device=DEV).to(dtype)
    assert _rel(_run_fused(f, t, (n, k), x, use_asm=use_asm), _ref(f, t, (n, k), x)) < TOL[dtype]


@pytest.mark.skipif(not CUDA, reason="the PTX decode needs a GPU")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_ptx_decode_equals_portable_decode(fmt):
    f, t = _weight(fmt, 200, 512, seed=21)
    x = torch.randn(9, 512, device=DEV, dtype=torch.bfloat16)
    a = _run_fused(f, t, (200, 512), x, use_asm=True)
    b = _run_fused(f, t, (200, 512), x, use_asm=False)
    assert _rel(a, b.double()) < 1e-3


@pytest.mark.parametrize("split", [1, 2, 3])
def test_split_k_is_exact_and_deterministic(split):
    f, t = _weight("nvfp4", 64, 16 * 24, seed=split)
    x = torch.randn(2, 16 * 24, device=DEV).to(ACT[0])
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=split, k_split=_ks(16 * 24, split, 128),
               num_warps=4, num_stages=2)
    cfg["SPLIT_K"] = -(-16 * 24 // cfg["k_split"])
    a = _run_fused(f, t, (64, 16 * 24), x, config=cfg)
    b = _run_fused(f, t, (64, 16 * 24), x, config=cfg)
    assert torch.equal(a, b)
    assert _rel(a, _ref(f, t, (64, 16 * 24), x)) < TOL[x.dtype]


def _ks(k, split, bk):
    return -(-(-(-k // bk)) // split) * bk


def test_minimum_k_is_one_block():
    f, t = _weight("nvfp4", 40, 16, seed=3)
    x = torch.randn(3, 16, device=DEV).to(ACT[0])
    assert _rel(_run_fused(f, t, (40, 16), x), _ref(f, t, (40, 16), x)) < TOL[x.dtype]


@pytest.mark.parametrize("fmt", FORMATS)
def test_bias_and_fused_lora_epilogue(fmt):
    n, k, r = 72, 128, 8
    f, t = _weight(fmt, n, k, seed=11)
    dt = ACT[0]
    x = torch.randn(4, k, device=DEV).to(dt)
    bias = torch.randn(n, device=DEV).to(dt)
    a = torch.randn(r, k, device=DEV).to(dt) * 0.1
    b = torch.randn(n, r, device=DEV).to(dt) * 0.1
    xa = (x.float() @ a.float().t()).to(dt)
    lora = (xa, b, 0.5)
    y = _run_fused(f, t, (n, k), x, bias=bias, lora=lora)
    assert _rel(y, _ref(f, t, (n, k), x, bias, lora)) < TOL[dt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_kernel_is_exact(fmt):
    n, k = 50, 256
    f, t = _weight(fmt, n, k, seed=5)
    fid, packed, scale, lut, inv, inv_host, _ = triton_backend.prepare(f, t, (n, k))
    w = K.dequantize(fid, packed, scale, lut, n, k, torch.float32,
                     out=torch.full((n, k), float("nan"), device=DEV))
    ref = f.dequantize(t, (n, k), torch.float64) / inv_host  # the kernel leaves 1/gs to the GEMM
    assert not torch.isnan(w).any()
    tol = 0 if fmt != "nf4" else 1e-6
    assert (w.double() - ref).abs().max().item() <= tol * ref.abs().max().item()


@pytest.mark.parametrize("fmt", FORMATS)
def test_small_and_large_m_paths_agree(fmt):
    n, k, m = 96, 256, 6
    f, t = _weight(fmt, n, k, seed=8)
    dt = ACT[0]
    x = torch.randn(m, k, device=DEV).to(dt)
    fid, packed, scale, lut, inv, inv_host, _ = triton_backend.prepare(f, t, (n, k))
    small = _run_fused(f, t, (n, k), x)
    large = K.dequant_matmul(x, fid, packed, scale, lut, inv_host, n)
    assert _rel(small, large.double()) < 1e-3


def test_dispatch_uses_the_kernel_in_a_layer_and_grads_match_torch_path(monkeypatch):
    from qerl.layers import QLoRALinear

    monkeypatch.setattr(triton_backend, "RUN_ON_CPU_INTERPRETER", True)

    dt = ACT[0]
    w = (torch.randn(64, 128) * 0.05).to(DEV, torch.bfloat16)
    layer = QLoRALinear.from_weight(w, "nvfp4", r=8, lora_alpha=16, dtype=dt)
    torch.nn.init.normal_(layer.lora_B.weight, std=0.1)
    x = torch.randn(3, 5, 128, device=DEV, dtype=dt, requires_grad=True)
    assert triton_backend.supports(x, layer.fmt)
    y = layer(x)
    y.float().square().sum().backward()
    got = (y.detach(), x.grad.clone(), layer.lora_A.weight.grad.clone())
    x.grad = None
    layer.zero_grad()
    with settings.use(kernels=False):
        y2 = layer(x)
        y2.float().square().sum().backward()
    tol = 5e-2 if dt == torch.bfloat16 else 5e-3
    for a, b in zip(got, (y2.detach(), x.grad, layer.lora_A.weight.grad)):
        assert _rel(a, b.double()) < tol
    with torch.no_grad():  # rollout path: LoRA expand fused in the epilogue
        assert _rel(layer(x), y2.detach().double()) < tol


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("n,k", [(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944), (5120, 5120),
                                 (27648, 5120), (5120, 27648)])
@pytest.mark.parametrize("m", [1, 7, 16, 33, 64, 300])
def test_real_shapes_bf16(n, k, m):
    f, t = _weight("nvfp4", n, k, seed=n + k + m)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    y = triton_backend.matmul(x, f, t, (n, k))
    assert _rel(y, _ref(f, t, (n, k), x)) < 1e-2

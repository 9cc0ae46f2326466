"""The NVFP4 MMA kernel (kernels/w4_mma.cu) on the GPU, against a float64 dequantize-then-matmul.

Fresh random inputs per case, outputs poisoned with NaN before each run (an unwritten element
fails), every M from 1 to 80 on the 7B fused shapes, the 14B/32B/72B group shapes, odd N;
the small-M and large-M paths agree; two runs give identical bits; with LoRA (fused groups'
segments too) it equals base + the unfused expand.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

from qerl.formats import get_format  # noqa: E402
from qerl.formats.nvfp4_mma import NVFP4Mma  # noqa: E402
from qerl.kernels import dispatch, mma_backend, settings, w4_mma  # noqa: E402

NV, MMA = get_format("nvfp4"), NVFP4Mma()
# (N, K) of fused groups: 7B q|k|v, o, gate|up, down; 14B/32B/72B q|k|v and gate|up; odd N.
SHAPES_7B = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]
SHAPES_BIG = [(7168, 5120), (27648, 5120), (5120, 27648), (7168, 5120), (55296, 5120), (10240, 8192),
              (59136, 8192), (8192, 29568)]
ODD = [(16, 64), (48, 192), (400, 576), (1040, 1536)]


def _quant(n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=g) * torch.rand(n, 1, device="cuda", generator=g) * 0.05)
    t = MMA.quantize(w.to(torch.bfloat16))
    return t


def _ref(t, shape, x, bias=None):
    w = MMA.dequantize(t, shape, torch.float64)
    y = x.double() @ w.T
    return y if bias is None else y + bias.double()


def _rel(a, b):
    a, b = a.double(), b.double()
    assert not torch.isnan(a).any(), "NaN (an unwritten or poisoned element)"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _run(t, shape, x, bias=None, lora=None, config=None):
    n, _ = shape
    y = torch.full((x.shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
    factor, _ = mma_backend._prepare(t)
    return w4_mma.matmul(x, t["weight_packed"], t["weight_scale"], factor, n, bias=bias, lora=lora, config=config, out=y)


def test_available():
    assert w4_mma.available(torch.device("cuda"))


@pytest.mark.parametrize("n,k", SHAPES_7B)
def test_every_m_1_to_80_on_7b_groups(n, k):
    t = _quant(n, k, n + k)
    for m in range(1, 81):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if m % 3 == 0 else None
        if m <= w4_mma.MAX_M:
            y = _run(t, (n, k), x, bias)
        else:
            y = mma_backend.matmul(x, MMA, t, (n, k), bias)
        assert _rel(y, _ref(t, (n, k), x, bias)) < 1e-2, f"M={m}"


@pytest.mark.parametrize("n,k", SHAPES_BIG + ODD)
@pytest.mark.parametrize("m", [1, 8, 17, 64])
def test_large_group_shapes_and_odd_n(n, k, m):
    t = _quant(n, k, n * 3 + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert _rel(_run(t, (n, k), x), _ref(t, (n, k), x)) < 1e-2


@pytest.mark.parametrize("m", [1, 16, 64])
def test_small_and_large_paths_agree_and_runs_are_bitwise_deterministic(m):
    n, k = 3584, 18944  # down: split along K, so the in-kernel reduction runs
    t = _quant(n, k, 11)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    small = _run(t, (n, k), x)
    assert w4_mma.plan(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count).splits > 1
    for _ in range(3):
        assert torch.equal(_run(t, (n, k), x), small)
    _, inv = mma_backend._prepare(t)
    large = w4_mma.dequant_matmul(x, t["weight_packed"], t["weight_scale"], inv, n)
    assert _rel(small, large) < 1e-3


@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("segments", [1, 3])
@pytest.mark.parametrize("in_launch_shrink", [False, True])
def test_lora_epilogue_equals_base_plus_unfused_expand(m, segments, in_launch_shrink):
    rows = [3584, 512, 512][:segments] if segments == 3 else [3584]
    n, k, r = sum(rows), 3584, 32
    t = _quant(n, k, m + segments)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(segments * r, k, device="cuda", dtype=torch.bfloat16) * 0.02
    xa = torch.nn.functional.linear(x, a)
    b = torch.randn(n, r, device="cuda", dtype=torch.bfloat16) * 0.05
    starts = tuple(int(v) for v in torch.tensor(rows).cumsum(0)[:-1])
    lora = dispatch.LoraTerm(None if in_launch_shrink else xa, b, 2.0, starts, a=a)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = _run(t, (n, k), x, bias, lora)
    ref_lora = dispatch.LoraTerm(x.double() @ a.double().T, b.double(), 2.0, starts)
    ref = _ref(t, (n, k), x, bias) + dispatch.lora_expand(ref_lora, torch.float64)
    assert _rel(y, ref) < 1e-2
    base = _ref(t, (n, k), x, bias)
    assert _rel(y.double() - base, ref - base) < 2e-2  # the LoRA term itself, not drowned by the base
    if in_launch_shrink:  # the launch's counters reset themselves: repeat runs give the same bits
        for _ in range(3):
            assert torch.equal(_run(t, (n, k), x, bias, lora), y)


def test_dequantize_equals_the_standard_format():
    n, k = 4608, 3584
    t = _quant(n, k, 5)
    w = w4_mma.dequantize(t["weight_packed"], t["weight_scale"], n, k)
    ref = NV.dequantize(MMA.to_checkpoint(t, (n, k)), (n, k), torch.float64) * float(t["weight_global_scale"])
    assert torch.equal(w.double(), ref.to(torch.bfloat16).double())


def test_layer_on_mma_layout_matches_torch_path_with_grads():
    from qerl.layers import QLoRALinear

    w = (torch.randn(512, 1024, device="cuda") * 0.05).to(torch.bfloat16)
    layer = QLoRALinear.from_weight(w, MMA, r=16, lora_alpha=32, dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.lora_B.weight, std=0.1)
    for m in (3, 200):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = layer(x)
        y.float().square().sum().backward()
        got = (y.detach(), x.grad.clone())
        x.grad = None
        with settings.use(kernels=False):
            y2 = layer(x)
            y2.float().square().sum().backward()
        for a, b in zip(got, (y2.detach(), x.grad)):
            assert _rel(a, b) < 2e-2
        with torch.no_grad():
            assert _rel(layer(x), y2.detach()) < 2e-2


def test_graph_capture_replays_the_kernel():
    n, k = 3584, 3584
    t = _quant(n, k, 3)
    x = torch.randn(4, k, device="cuda", dtype=torch.bfloat16)
    y = _run(t, (n, k), x)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        _run(t, (n, k), x)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        out = _run(t, (n, k), x)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _run(t, (n, k), x)) and not torch.equal(out, y)

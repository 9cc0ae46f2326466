"""The wgmma kernel's workspace split-K (w4_wgmma.matmul(..., splits=S)) on an H100/H200 (sm_90a).

For S in 1, 2, 4 and M in 1 .. 256 on the 7B layer set (q|k|v, o, gate|up, down; bias on): against a dequantize
+ fp32 matmul within the wgmma GPU tests' tolerance; 20 calls give the same bits; a CUDA graph replays eager's
bits; the same call on two streams at once, different inputs, gives each the bits it gives alone. With S dividing
K / 64 the workspace path (split launch + w4_wgmma_reduce) gives the bits of the last-CTA path at the same
slices, with bias and LoRA too. `pytest tests/test_w4_wgmma_splitk_gpu.py` (skips without an sm_90 GPU).
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU")]

from qerl.formats.nvfp4_mma import NVFP4Mma  # noqa: E402
from qerl.kernels import dispatch, mma_backend, w4_wgmma  # noqa: E402

MMA = NVFP4Mma()
SHAPES_7B = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]
MS = [1, 16, 32, 64, 128, 256]
SPLITS = [1, 2, 4]
_W: dict = {}


def _weights(n, k):
    """(MMA-layout tensors, 2^7/gs, bias, the dequantized fp32 weight), once per shape."""
    if (n, k) not in _W:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        w = torch.randn(n, k, device="cuda", generator=g) * torch.rand(n, 1, device="cuda", generator=g) * 0.05
        t = MMA.quantize(w.to(torch.bfloat16))
        factor, _ = mma_backend._prepare(t)
        bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
        _W[(n, k)] = (t, factor, bias, MMA.dequantize(t, (n, k), torch.float32))
    return _W[(n, k)]


def _call(n, k, x, s, out=None, lora=None, config=None):
    t, factor, bias, _ = _weights(n, k)
    return w4_wgmma.matmul(x, t["weight_packed"], t["weight_scale"], factor, n, bias=bias, lora=lora, out=out,
                           splits=None if config is not None else s, config=config)


def _poisoned(m, n):
    return torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)


def _rel(a, b):
    a, b = a.double(), b.double()
    assert not torch.isnan(a).any(), "NaN (an unwritten or poisoned element)"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("s", SPLITS)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n,k", SHAPES_7B)
def test_matches_the_dequantized_reference_and_repeats_20_times(n, k, m, s):
    _, _, bias, wf = _weights(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = _call(n, k, x, s, out=_poisoned(m, n))
    ref = x.float() @ wf.T + bias.float()
    assert _rel(y, ref) < 1e-2, (m, s)
    for i in range(20):
        assert torch.equal(_call(n, k, x, s, out=_poisoned(m, n)), y), (m, s, i)


@pytest.mark.parametrize("s", SPLITS)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n,k", SHAPES_7B)
def test_a_cuda_graph_replays_eagers_bits(n, k, m, s):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    eager = _call(n, k, x, s)  # compiles (and sets shared memory) outside the capture
    static_x = x.clone()
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _call(n, k, static_x, s, out=out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x2 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)  # new inputs through the same graph
    static_x.copy_(x2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _call(n, k, x2, s))


@pytest.mark.parametrize("s", SPLITS)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n,k", SHAPES_7B)
def test_two_streams_at_once_each_give_the_bits_they_give_alone(n, k, m, s):
    xa = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xb = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    alone_a, alone_b = _call(n, k, xa, s), _call(n, k, xb, s)
    torch.cuda.synchronize()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    s1.wait_stream(torch.cuda.current_stream())
    s2.wait_stream(torch.cuda.current_stream())
    outs_a, outs_b = [], []
    for _ in range(6):  # issued alternately: the two streams' launches overlap on the card
        with torch.cuda.stream(s1):
            outs_a.append(_call(n, k, xa, s))
        with torch.cuda.stream(s2):
            outs_b.append(_call(n, k, xb, s))
    torch.cuda.synchronize()
    assert all(torch.equal(o, alone_a) for o in outs_a)
    assert all(torch.equal(o, alone_b) for o in outs_b)


@pytest.mark.parametrize("s", [2, 4])
@pytest.mark.parametrize("m", [16, 64, 256])
@pytest.mark.parametrize("n,k,lora", [(4608, 3584, True), (3584, 18944, False)])
def test_the_workspace_path_gives_the_last_cta_paths_bits_at_the_same_slices(n, k, lora, m, s):
    """S divides K / 64 here, so slice_begin's slices are chunk_begin's: the reduce kernel's sum (0 + p0 + p1 ...)
    and its copy of the epilogue must give the in-kernel last-CTA path's bits exactly, bias and LoRA included."""
    kch = k // 64
    assert kch % s == 0
    ws = w4_wgmma.plan_splits(m, n, k, s)
    last = w4_wgmma.WgmmaConfig(ws.bn, ws.wg, ws.stages, s, kch // s, ws.pw, ws.ctas_per_sm)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    term = None
    if lora:
        r = 32
        a = torch.randn(3 * r, k, device="cuda", dtype=torch.bfloat16) * 0.02
        b = torch.randn(n, r, device="cuda", dtype=torch.bfloat16) * 0.02
        term = dispatch.LoraTerm(None, b, 2.0, (3584, 4096), a=a).shrunk(x)
    y_ws = _call(n, k, x, s, out=_poisoned(m, n), lora=term, config=ws)
    y_last = _call(n, k, x, s, out=_poisoned(m, n), lora=term, config=last)
    assert torch.equal(y_ws, y_last)
    _, _, bias, wf = _weights(n, k)
    ref = x.float() @ wf.T + bias.float()
    if lora:
        ref = ref + dispatch.lora_expand(dispatch.LoraTerm(x.float() @ a.float().T, b.float(), 2.0, (3584, 4096)),
                                         torch.float32)
        # the xa-less term: the launcher shrinks first, the same bits as given xa
        again = _call(n, k, x, s, lora=dispatch.LoraTerm(None, b, 2.0, (3584, 4096), a=a), config=ws)
        assert torch.equal(again, y_ws)
    assert _rel(y_ws, ref) < 1e-2

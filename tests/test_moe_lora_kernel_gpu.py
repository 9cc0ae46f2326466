"""The expert LoRA kernels of MoE decode (kernels/moe_lora.py) captured in a CUDA graph and replayed with
new inputs (new tokens, new routing, "no expert" pairs), against a float64 loop over the pairs; and a
QuantExperts decode call with LoRA captured whole (torch._grouped_mm, which it used before, fails there)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from qerl.kernels import moe_gemv, moe_lora, settings  # noqa: E402
from qerl.layers.quant_experts import QuantExperts  # noqa: E402

EPS = {torch.float32: 2e-6, torch.bfloat16: 8e-3}


def _ref_delta(x, rows, expert, valid, a, b, scaling):
    """[P, N] float64 by a loop over pairs: scaling·(x_row·A_eᵀ)·B_eᵀ, x rounded to the adapters' dtype."""
    out = torch.full((expert.numel(), b.shape[1]), float("nan"), dtype=torch.float64)
    xs, a64, b64 = x.cpu().to(a.dtype).double(), a.cpu().double(), b.cpu().double()
    for i in range(expert.numel()):
        if valid[i]:
            e = int(expert[i])
            out[i] = scaling * (b64[e] @ (a64[e] @ xs[i if rows is None else int(rows[i])]))
    return out


def _routing(g, e, t, k):
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    idx[torch.rand(idx.shape, generator=g) < 0.15] = e  # "no expert"
    return idx


def _capture(fn):
    """Warm up on a side stream (Triton compiles there, not during capture), then capture fn."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("lora", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("r", [8, 16, 32])
def test_lora_kernels_replay_in_a_cuda_graph(lora, r):
    e, k_in, n, t, k, scaling = 16, 1000, 700, 6, 4, 2.0  # K, N off the 256 / 64 blocks
    g = torch.Generator().manual_seed(r)
    a = (torch.randn(e, r, k_in, generator=g) / k_in**0.5).to("cuda", lora)
    b = torch.randn(e, n, r, generator=g).to("cuda", lora)
    x = torch.zeros(t, k_in, device="cuda", dtype=torch.bfloat16)  # static inputs, refilled before each replay
    xp = torch.zeros(t * k, k_in, device="cuda", dtype=torch.bfloat16)
    y0 = torch.zeros(t * k, n, device="cuda", dtype=torch.bfloat16)
    idx = torch.zeros(t, k, device="cuda", dtype=torch.long)

    def step():
        rt = moe_gemv.route(idx, e)
        y = moe_lora.add_expert_lora(y0.clone(), x, rt.token, rt.expert, a, b, scaling)  # gathered rows (gate_up)
        y2 = moe_lora.add_expert_lora(y0.clone(), xp, None, rt.expert, a, b, scaling)  # pair-ordered rows (down)
        return y, y2, rt.token, rt.expert, rt.valid

    graph, (y, y2, token, expert, valid) = _capture(step)
    for trial in range(3):
        x.copy_(torch.randn(t, k_in, generator=g).to("cuda", torch.bfloat16))
        xp.copy_(torch.randn(t * k, k_in, generator=g).to("cuda", torch.bfloat16))
        y0.copy_(torch.randn(t * k, n, generator=g).to("cuda", torch.bfloat16))
        new_idx = _routing(g, e, t, k)
        idx.copy_(new_idx)
        graph.replay()
        torch.cuda.synchronize()
        rt = moe_gemv.route(new_idx, e)  # eager, on the CPU: the graph's routing must be this one
        assert torch.equal(expert.cpu(), rt.expert) and torch.equal(valid.cpu(), rt.valid)
        ok = rt.valid
        for got, rows, xin in ((y, rt.token, x), (y2, None, xp)):
            want = _ref_delta(xin, rows, rt.expert, ok, a, b, scaling)[ok]
            delta = got.double().cpu()[ok] - y0.double().cpu()[ok]
            err = ((delta - want).norm() / want.norm()).item()
            assert err < EPS[lora] + EPS[torch.bfloat16], (trial, rows is None, err)


def _glu(y):
    gt, u = y.chunk(2, -1)
    return torch.nn.functional.silu(gt) * u


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quant_experts_decode_with_lora_runs_in_a_cuda_graph(fmt):
    """The decode path whole (route, GEMV, LoRA kernels, biases, combine), captured, replayed on new tokens
    and routing, against the loop run eagerly."""
    g = torch.Generator().manual_seed(5)
    e, h, i, t, k = 16, 256, 128, 4, 4
    gate_up, down = torch.randn(e, 2 * i, h, generator=g) * 0.05, torch.randn(e, h, i, generator=g) * 0.05
    biases = {"gate_up_proj": torch.randn(e, 2 * i, generator=g) * 0.1,
              "down_proj": torch.randn(e, h, generator=g) * 0.1}
    q = QuantExperts.quantize(gate_up, down, fmt, _glu, torch.bfloat16, biases=biases).to("cuda")
    q.add_lora(16, 32.0, torch.bfloat16)
    with torch.no_grad():
        for p in q.lora_B.values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    x = torch.zeros(t, h, device="cuda", dtype=torch.bfloat16)
    idx = torch.zeros(t, k, device="cuda", dtype=torch.long)
    wts = torch.zeros(t, k, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad(), settings.use(moe_gemv=True):
        graph, out = _capture(lambda: q(x, idx, wts))
    for _ in range(3):
        x.copy_(torch.randn(t, h, generator=g))
        idx.copy_(_routing(g, e, t, k))
        wts.copy_(torch.rand(t, k, generator=g))
        graph.replay()
        with torch.no_grad(), settings.use(moe_gemv=False):
            want = q(x, idx, wts)
        err = ((out.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 2e-2, err  # bf16: the GEMV's decode and sums against dequantize + cuBLAS

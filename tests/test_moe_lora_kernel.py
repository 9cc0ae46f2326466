"""The per-pair expert LoRA kernels of MoE decode (kernels/moe_lora.py) against a float64 loop over the
pairs, and QuantExperts' decode path with them on against the loop. On the CPU the kernels run in
Triton's interpreter, as tests/test_moe_gemv.py runs the grouped GEMV."""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
from qerl.kernels import moe_gemv, moe_lora, settings  # noqa: E402
from qerl.layers.quant_experts import QuantExperts  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and not in the Triton interpreter", allow_module_level=True)
ACT = [torch.bfloat16, torch.float16] if CUDA else [torch.float32, torch.float16, torch.bfloat16]
EPS = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # ~ a rounding or two


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    if not CUDA:
        monkeypatch.setattr(moe_gemv, "RUN_ON_CPU_INTERPRETER", True)
        monkeypatch.setattr(moe_lora, "RUN_ON_CPU_INTERPRETER", True)


def _ref_delta(x, rows, expert, valid, a, b, scaling):
    """[P, N] float64, by a plain loop over the pairs: scaling·(x_row·A_eᵀ)·B_eᵀ with x first rounded to the
    adapters' dtype (as the loop path's x.to(a.dtype)); NaN for invalid pairs (their rows are dropped)."""
    p, n = expert.numel(), b.shape[1]
    out = torch.full((p, n), float("nan"), dtype=torch.float64)
    xs, a64, b64 = x.cpu().to(a.dtype).double(), a.cpu().double(), b.cpu().double()
    for i in range(p):
        if valid[i]:
            row = i if rows is None else int(rows[i])
            e = int(expert[i])
            out[i] = scaling * (b64[e] @ (a64[e] @ xs[row]))
    return out


def _case(seed, e, r, k, n, t, topk, act, lora, gather, none_frac=0.2):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(t)])
    idx[torch.rand(idx.shape, generator=g) < none_frac] = e  # the "no expert" index: invalid pairs
    rt = moe_gemv.route(idx.to(DEV), e)
    p = t * topk
    x = torch.randn(t if gather else p, k, generator=g).to(DEV, act)
    a = (torch.randn(e, r, k, generator=g) / k**0.5).to(DEV, lora)
    b = torch.randn(e, n, r, generator=g).to(DEV, lora)
    y0 = torch.randn(p, n, generator=g).to(DEV, act)
    return rt, x, a, b, y0


@pytest.mark.parametrize("r", [8, 16, 32, 12])  # 12: not a multiple of the shrink's 8-row block
@pytest.mark.parametrize("k,n", [(40, 24), (300, 70)])  # 300 > BLOCK_K = 256, 70 > BLOCK_N = 64, neither multiples
@pytest.mark.parametrize("lora", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize("act", ACT)
def test_add_expert_lora_matches_float64_per_pair(r, k, n, lora, gather, act):
    e, t, topk, scaling = 7, 5, 3, 2.5
    rt, x, a, b, y0 = _case(r * 1000 + k + n, e, r, k, n, t, topk, act, lora, gather)
    rows = rt.token if gather else None
    y = moe_lora.add_expert_lora(y0.clone(), x, rows, rt.expert, a, b, scaling)
    assert y.dtype == act and y.shape == y0.shape
    want = _ref_delta(x, None if rows is None else rows.cpu(), rt.expert.cpu(), rt.valid.cpu(), a, b, scaling)
    ok = rt.valid.cpu()
    assert (~ok).any() and ok.any()
    got = y.double().cpu()[ok] - y0.double().cpu()[ok]  # the added term, so y0 cannot hide its error
    w = want[ok]
    # Rounding: x and both products in the adapter dtype, the sum in y's dtype (|y0| ~ |delta| here).
    tol = EPS[lora] + EPS[act]
    assert ((got - w).norm() / w.norm()).item() < tol


def test_add_expert_lora_all_invalid_and_empty_are_harmless():
    """Every pair "no expert" (clamped index, in range): no out-of-bounds read; zero pairs: no launch."""
    e, r, k, n = 3, 8, 32, 16
    rt = moe_gemv.route(torch.full((2, 2), e, device=DEV), e)
    assert not rt.valid.any()
    a, b = torch.randn(e, r, k, device=DEV), torch.randn(e, n, r, device=DEV)
    y = moe_lora.add_expert_lora(torch.zeros(4, n, device=DEV), torch.randn(2, k, device=DEV), rt.token, rt.expert, a, b, 1.0)
    assert torch.isfinite(y).all()
    empty = torch.zeros(0, n, device=DEV)
    assert moe_lora.add_expert_lora(empty, torch.zeros(0, k, device=DEV), None, torch.zeros(0, dtype=torch.long, device=DEV),
                             a, b, 1.0) is empty


def test_add_expert_lora_refuses_mismatched_shapes():
    a, b = torch.zeros(3, 8, 32, device=DEV), torch.zeros(3, 16, 8, device=DEV)
    ex = torch.zeros(4, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match="expected B"):
        moe_lora.add_expert_lora(torch.zeros(4, 16, device=DEV), torch.zeros(4, 32, device=DEV), None, ex, a,
                          b.to(torch.float64), 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        moe_lora.add_expert_lora(torch.zeros(4, 16, device=DEV), torch.zeros(4, 24, device=DEV), None, ex, a, b, 1.0)


def _glu(y):
    g, u = y.chunk(2, -1)
    return torch.nn.functional.silu(g) * u


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("lora", [torch.float32, torch.bfloat16])
def test_quant_experts_decode_with_lora_kernels_equals_the_loop(fmt, lora, monkeypatch):
    """The whole decode path (_gemv_forward: GEMV, LoRA kernels, biases, "no expert" pairs) against the loop;
    bf16 factors under an fp32 model (lora_dtype != the model's) too."""
    g = torch.Generator().manual_seed(11)
    e, h, i = 5, 64, 32
    gate_up, down = torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1
    biases = {"gate_up_proj": torch.randn(e, 2 * i, generator=g) * 0.1,
              "down_proj": torch.randn(e, h, generator=g) * 0.1}
    q = QuantExperts.quantize(gate_up, down, fmt, _glu, torch.float32, biases=biases).to(DEV)
    q.add_lora(8, 16.0, lora)
    with torch.no_grad():
        for p in q.lora_B.values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(6, h, generator=g).to(DEV)
    idx = torch.tensor([[0, 3], [3, 5], [4, 0], [3, 1], [5, 5], [0, 3]], device=DEV)  # 5 = E: no expert
    wts = torch.rand(6, 2, generator=g).to(DEV)
    calls = [0]
    real = moe_lora.add_expert_lora

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(moe_lora, "add_expert_lora", counted)
    with torch.no_grad():
        with settings.use(moe_gemv=False):
            want = q(x, idx, wts)
        with settings.use(moe_gemv=True):
            got = q(x, idx, wts)
    assert calls == [2]  # both projections' LoRA by the kernels, not grouped_mm
    # bf16 factors: the kernels round as the loop does (equal to ~1e-6 here), but another accumulation
    # order (cuBLAS) may flip a bf16 rounding of the LoRA term, ~2^-8 of it.
    lora_term = 0.3 * 16.0 / 8
    atol = 1e-5 if lora == torch.float32 else 1e-2 * lora_term
    assert torch.allclose(got, want, atol=atol), (got - want).abs().max()

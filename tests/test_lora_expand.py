"""The one-launch LoRA expand of a fused group (kernels/lora_expand.py) against a float64 loop over the
segments. On the CPU it runs in Triton's interpreter (fp32/fp16); on a GPU in bf16, where it must also
equal the per-segment addmm it replaces to a rounding, and read B afresh on each CUDA-graph replay."""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
from qerl.kernels import lora_expand  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and not in the Triton interpreter", allow_module_level=True)
DTYPES = [torch.bfloat16, torch.float16] if CUDA else [torch.float32, torch.float16]


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    if not CUDA:
        monkeypatch.setattr(lora_expand, "RUN_ON_CPU_INTERPRETER", True)


def _reference(y, xa, b, scaling, starts, bias=None):
    """float64: y (+ bias) + scaling · xa_s @ b_sᵀ for each segment s, by a loop (inputs first rounded to y's dtype)."""
    n, r = b.shape
    bounds = (0, *starts, n)
    out = y.double().clone()
    if bias is not None:
        out += bias.double()
    xa64, b64 = xa.to(y.dtype).double(), b.to(y.dtype).double()
    for s in range(len(bounds) - 1):
        lo, hi = bounds[s], bounds[s + 1]
        out[:, lo:hi] += scaling * xa64[:, s * r:(s + 1) * r] @ b64[lo:hi].T
    return out


@pytest.mark.parametrize("m", [1, 5, 70])           # 70: two M tiles of 64 on the large-M blocks
@pytest.mark.parametrize("n,r,starts", [
    (96, 16, ()),                                     # a single projection
    (200, 8, (70, 150)),                              # q|k|v with boundaries inside tiles; r below 16 padded
    (300, 32, (150,)),                                # gate|up
    (130, 12, (10, 20, 129)),                         # four segments, one of a single row
])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_expand_add_equals_the_per_segment_reference(m, n, r, starts, dtype, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + r)
    s = len(starts) + 1
    y = torch.randn(m, n + 7, generator=g).to(DEV, dtype)[:, :n]   # a row stride other than N
    xa = torch.randn(m, s * r, generator=g).to(DEV, dtype)
    b = (torch.randn(n, r, generator=g) * 0.3).to(DEV, torch.float32)  # fp32 adapter, cast to y's dtype
    bias = torch.randn(n, generator=g).to(DEV, dtype) if with_bias else None
    ref = _reference(y.cpu(), xa.cpu(), b.cpu(), 0.5, starts, None if bias is None else bias.cpu())
    assert lora_expand.supports(y, xa, b, s)
    out = lora_expand.expand_add(y, xa, b, 0.5, starts, bias)
    assert out.data_ptr() == y.data_ptr()
    eps = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert (out.cpu().double() - ref).abs().max() <= eps * ref.abs().max()


def test_supports_refuses_what_the_kernel_cannot_take():
    y = torch.zeros(4, 64, device=DEV)
    b = torch.zeros(64, 8, device=DEV)
    assert not lora_expand.supports(y, torch.zeros(4, 16, device=DEV), b, 1)   # xa width is not S·r
    assert not lora_expand.supports(y.t(), torch.zeros(64, 8, device=DEV), torch.zeros(4, 8, device=DEV), 1)
    assert not lora_expand.supports(y, torch.zeros(4, 40, device=DEV), b, 5)   # above MAX_SEGMENTS


@pytest.mark.parametrize("lora", [torch.bfloat16, torch.float32])
def test_the_per_row_expert_form_reads_each_rows_own_b(lora):
    """The MoE form (expert=, rounding="loop"): rows in no expert order, over three 16-row tiles, each
    against b[expert[p]], as a float64 loop over the rows; a bias is refused there."""
    g = torch.Generator().manual_seed(5)
    p, e, n, r, dtype = 40, 6, 70, 12, DTYPES[-1]
    expert = torch.randint(0, e, (p,), generator=g)
    xa = torch.randn(p, r, generator=g).to(lora).float()  # the shrink's output: adapter-dtype values, fp32
    b = torch.randn(e, n, r, generator=g).to(lora)
    y0 = torch.randn(p, n, generator=g).to(dtype)
    want = torch.stack([xa[i].double() @ b[expert[i]].double().T for i in range(p)]) * 1.5
    y = lora_expand.expand_add(y0.clone().to(DEV), xa.to(DEV), b.to(DEV), 1.5, expert=expert.to(DEV),
                               rounding="loop")
    got = y.cpu().double() - y0.double()
    assert ((got - want).norm() / want.norm()).item() < {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    with pytest.raises(ValueError, match="rounding"):
        lora_expand.expand_add(y, xa.to(DEV), b.to(DEV), 1.5, bias=y[0], expert=expert.to(DEV), rounding="loop")


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.gpu
def test_bf16_equals_per_segment_addmm_and_a_graph_sees_the_new_b():
    m, n, r, starts = 64, 4608, 32, (3584, 4096)
    y0 = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    xa = torch.randn(m, 3 * r, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, r, device="cuda", dtype=torch.bfloat16) * 0.02
    addmm = y0.clone()
    for s, (lo, hi) in enumerate(zip((0, *starts), (*starts, n))):
        addmm[:, lo:hi].addmm_(xa[:, s * r:(s + 1) * r], b[lo:hi].t(), alpha=2.0)
    y = lora_expand.expand_add(y0.clone(), xa, b, 2.0, starts)
    # both round once from fp32; only the accumulation order differs
    assert (y.double() - addmm.double()).abs().max() <= 2 ** -7 * addmm.double().abs().max()
    buf = y0.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_expand.expand_add(buf, xa, b, 2.0, starts)
    b.mul_(-1.0)  # an optimizer step in place
    buf.copy_(y0)
    graph.replay()
    torch.cuda.synchronize()
    ref = _reference(y0.cpu(), xa.cpu(), b.cpu(), 2.0, starts)
    assert (buf.cpu().double() - ref).abs().max() <= 2 ** -7 * ref.abs().max()

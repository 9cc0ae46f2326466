"""The chosen-experts dequantize kernel (kernels/moe_dequant.py) bit for bit against the formats' own
dequantize, and the frozen grouped matmul (layers/grouped_mm.frozen_grouped_mm: weights made again in
the backward, not saved) against autograd through per-group matmuls. On the CPU the kernel runs in
Triton's interpreter (fp32 and fp16 outputs: the interpreter's bf16 is broken); on a GPU in bf16 too."""

import os

import pytest
import torch

from qerl.formats import get_format
from qerl.layers.grouped_mm import frozen_grouped_mm

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
KERNEL = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32] if CUDA else [torch.float16, torch.float32]


def _stacked(fmt, e, n, k, seed):
    """E experts of very different magnitudes quantized one by one and stacked (QuantExperts' layout)."""
    g = torch.Generator().manual_seed(seed)
    per = []
    for i in range(e):
        w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 10.0 ** (i % 5 - 3)
        per.append(fmt.quantize(w, fmt.global_scale([w]) if fmt.has_global_scale else None))
    return {key: torch.stack([t[key] for t in per]).to(DEV) for key in per[0]}


@pytest.mark.skipif(not KERNEL, reason="no GPU and not in the Triton interpreter")
@pytest.mark.parametrize("dtype", OUT_DTYPES)
@pytest.mark.parametrize("fmt_name,n,k", [("nvfp4", 48, 96), ("nvfp4", 40, 272), ("mxfp4", 33, 320)])
def test_dequantize_experts_bit_equal_to_the_format(fmt_name, n, k, dtype):
    """Row and column tails (N not a multiple of the block, K past one 256-wide block), picked experts in
    any order and repeated."""
    from qerl.kernels.moe_dequant import dequantize_experts

    fmt = get_format(fmt_name)
    t = _stacked(fmt, 6, n, k, seed=n + k)
    ids = torch.tensor([4, 0, 5, 4, 2])
    got = dequantize_experts(fmt, t, ids, (n, k), dtype)
    want = torch.stack([fmt.dequantize({key: v[e] for key, v in t.items()}, (n, k), dtype) for e in ids.tolist()])
    assert got.shape == (5, n, k) and got.dtype == dtype
    assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_dequantize_experts_names_the_bad_shape():
    if not KERNEL:
        pytest.skip("no GPU and not in the Triton interpreter")
    from qerl.kernels.moe_dequant import dequantize_experts

    fmt = get_format("nvfp4")
    t = _stacked(fmt, 2, 16, 32, seed=0)
    with pytest.raises(ValueError, match=r"nvfp4 experts of shape \(16, 64\)"):
        dequantize_experts(fmt, t, torch.tensor([0]), (16, 64), torch.float32)


def test_frozen_grouped_mm_gradient_and_weights_made_again():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 8, 16, generator=g)  # [G, N, K]
    x = torch.randn(10, 16, generator=g, requires_grad=True)
    ends = torch.tensor([4, 4, 10], dtype=torch.int32)  # an empty group
    made = [0]

    def weights():
        made[0] += 1
        return w.clone()  # a fresh tensor each time, as a dequantize gives

    y = frozen_grouped_mm(x, weights, ends)
    ref = torch.cat([x[:4] @ w[0].t(), x[4:] @ w[2].t()])
    assert torch.allclose(y, ref, atol=1e-6) and made == [1]
    gy = torch.randn(y.shape, generator=g)
    (y * gy).sum().backward()
    gx = x.grad.clone()
    x.grad = None
    (ref * gy).sum().backward()
    assert torch.allclose(gx, x.grad, atol=1e-5) and made == [2]  # made again for the backward, not saved

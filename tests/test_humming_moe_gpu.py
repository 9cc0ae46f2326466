"""humming-kernels' MoE GEMM on an MoE layer's NVFP4 experts (kernels/humming_moe.py) against QuantExperts' loop
(transformers' loop over the hit experts, each dequantized by qerl's own NVFP4): Qwen3-30B-A3B's expert shapes,
top-8 of 128, decode and prefill token counts."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
humming = pytest.importorskip("humming")

from qerl.kernels import settings  # noqa: E402
from qerl.kernels.humming_moe import HummingExperts  # noqa: E402
from qerl.layers.quant_experts import QuantExperts  # noqa: E402


@pytest.mark.parametrize("t", [1, 8, 64, 300])
def test_humming_experts_equal_the_loop(t):
    e, h, i, k = 128, 2048, 768, 8
    g = torch.Generator(device="cuda").manual_seed(t)
    q = QuantExperts.quantize(torch.randn(e, 2 * i, h, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02,
                              torch.randn(e, h, i, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02, "nvfp4",
                              lambda y: torch.nn.functional.silu(y[..., :i]) * y[..., i:], torch.bfloat16)
    hum = HummingExperts.from_quant_experts(q)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(e, device="cuda", generator=g)[:k] for _ in range(t)])
    wts = torch.softmax(torch.randn(t, k, device="cuda", generator=g), -1).to(torch.bfloat16)
    with torch.no_grad(), settings.use(moe_gemv=False, moe_grouped=False):
        want = q(x, idx, wts).float()
    got = hum(x, idx, wts).float()
    assert got.shape == want.shape
    assert float((got - want).norm() / want.norm()) < 2e-2

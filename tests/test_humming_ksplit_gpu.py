"""The split-K-through-a-grouped-GEMM candidate (kernels/humming_ksplit.py) on the GPU: against a float64
dequantize-then-matmul of the same compressed-tensors bytes (qerl's own NVFP4), and the same bits on every call
(what it is for: humming's stream-K gives other bits each call)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
humming = pytest.importorskip("humming")

from qerl.formats import get_format  # noqa: E402
from qerl.formats.nvfp4_humming import NVFP4Humming  # noqa: E402
from qerl.kernels import humming_backend  # noqa: E402
from qerl.kernels.humming_ksplit import KSplitWeight, stored_product  # noqa: E402


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 18944), (3584, 3584)])
@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("m", [1, 64, 256])
def test_split_k_matches_the_dequantized_reference_and_repeats(n, k, splits, m):
    g = torch.Generator(device="cuda").manual_seed(n + k + m + splits)
    w = (torch.randn(n, k, device="cuda", generator=g) * torch.rand(n, 1, device="cuda", generator=g) * 0.05)
    t = get_format("nvfp4").quantize(w.to(torch.bfloat16))
    ks = KSplitWeight.build(t, (n, k), splits)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = ks.matmul(x)
    ref = x.double() @ get_format("nvfp4").dequantize(t, (n, k), torch.float64).T
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert _rel(y, ref) < 8e-3
    assert all(torch.equal(y, ks.matmul(x)) for _ in range(6))


@pytest.mark.parametrize("n,k,splits", [(4608, 3584, 4), (3584, 18944, 2)])
@pytest.mark.parametrize("m", [1, 64])
def test_the_stored_layouts_rows_are_the_slices_humming_makes(n, k, splits, m):
    """A weight stored in humming's dense layout, its rows viewed as S slices, gives the bits of humming's own
    grouped transform of the sliced checkpoint (KSplitWeight): no copy is needed for split-K on the one copy."""
    g = torch.Generator(device="cuda").manual_seed(n + k + splits)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.03
    t = get_format("nvfp4").quantize(w.to(torch.bfloat16))
    stored = NVFP4Humming().from_checkpoint(t, (n, k))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    got = stored_product(x, stored, (n, k), splits, humming_backend._locks(x.device))
    assert torch.equal(got, KSplitWeight.build(t, (n, k), splits).matmul(x))

"""The split-K-through-a-grouped-GEMM candidate (kernels/humming_ksplit.py), its index arithmetic on the CPU: the
slices of the NVFP4 tensors are the slices of the weight, and regrouping the activations, multiplying slice by
slice and combining gives x @ W.T (float64 references from qerl's own NVFP4 dequantize)."""

import pytest
import torch

from qerl.formats import get_format
from qerl.kernels.humming_ksplit import combine, regroup, slices, split_tensors


def _nvfp4(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.05
    return get_format("nvfp4").quantize(w.to(torch.bfloat16))


@pytest.mark.parametrize("n,k,splits", [(256, 512, 2), (384, 1024, 4), (128, 1536, 3)])
def test_each_slice_dequantizes_to_its_columns_of_the_weight(n, k, splits):
    nv = get_format("nvfp4")
    t = _nvfp4(n, k, seed=n + k)
    full = nv.dequantize(t, (n, k), torch.float64)
    parts = split_tensors(t, (n, k), splits)
    kk = slices(k, splits)
    assert parts["weight_packed"].shape == (splits, n, kk // 2) and parts["weight_scale"].shape == (splits, n, kk // 16)
    assert parts["weight_global_scale"].shape == (splits,)
    for s in range(splits):
        one = {name: v[s] for name, v in parts.items()}
        one["weight_global_scale"] = parts["weight_global_scale"][s].reshape(t["weight_global_scale"].shape)
        assert torch.equal(nv.dequantize(one, (n, kk), torch.float64), full[:, s * kk:(s + 1) * kk]), s


@pytest.mark.parametrize("m,splits", [(1, 2), (5, 4), (64, 3)])
def test_regrouped_slices_multiplied_and_combined_give_the_product(m, splits):
    n, k = 256, 384 * splits
    nv = get_format("nvfp4")
    t = _nvfp4(n, k, seed=m)
    w = nv.dequantize(t, (n, k), torch.float64)
    x = torch.randn(m, k, dtype=torch.float64)
    xs = regroup(x, splits)
    kk = k // splits
    assert xs.shape == (splits * m, kk)
    # what the grouped GEMM does: expert s multiplies its rows by its slice of the weight
    partials = torch.cat([xs[s * m:(s + 1) * m] @ w[:, s * kk:(s + 1) * kk].T for s in range(splits)])
    got = combine(partials, splits, torch.float64)  # summed in fp32 (as on the GPU), then cast
    assert torch.allclose(got, x @ w.T, rtol=1e-5, atol=1e-6)
    if m > 1:  # the slice-major order matters: the row-major cut of the same values is another product
        naive = x.reshape(splits * m, kk)
        wrong = torch.cat([naive[s * m:(s + 1) * m] @ w[:, s * kk:(s + 1) * kk].T for s in range(splits)])
        assert not torch.allclose(combine(wrong, splits, torch.float64), x @ w.T, rtol=1e-3)


def test_a_split_that_does_not_cut_k_into_aligned_parts_is_refused_with_the_numbers():
    assert slices(3584, 4) == 896
    for k, s in ((3584, 8), (18944, 8), (1000, 2), (512, 0)):
        with pytest.raises(ValueError, match=f"K = {k} .* {s} slices"):
            slices(k, s)
    with pytest.raises(ValueError, match="not those of a 256x1024 weight"):
        split_tensors(_nvfp4(256, 512, 0), (256, 1024), 2)

"""The one-kernel decode LoRA shrink against torch's x @ A.T (Triton interpreter on the CPU, native on CUDA)."""

import os

import pytest
import torch

from qerl.kernels import lora_shrink

CUDA = torch.cuda.is_available()


@pytest.fixture
def dev(monkeypatch):
    if not CUDA:
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs TRITON_INTERPRET=1 on the CPU")
        monkeypatch.setattr(lora_shrink, "RUN_ON_CPU_INTERPRETER", True)
    return torch.device("cuda" if CUDA else "cpu")


@pytest.mark.parametrize("m,k,r", [(1, 3584, 96), (3, 1000, 32), (8, 2048, 64), (16, 520, 8)])
def test_shrink_matches_matmul(dev, m, k, r):
    dt = torch.bfloat16 if CUDA else torch.float32
    g = torch.Generator().manual_seed(m * 7 + r)
    x = torch.randn(m, k, generator=g).to(dev, dt)
    a = (torch.randn(r, k, generator=g) * 0.02).to(dev, dt)
    got = lora_shrink.shrink(x, a)
    want = x.double() @ a.double().T
    assert got.shape == (m, r) and got.dtype == dt
    tol = 2 ** -7 if dt == torch.bfloat16 else 1e-5
    assert ((got.double() - want).abs() <= tol * want.abs() + 1e-4).all()


def test_supports_only_small_contiguous_same_dtype(dev):
    a = torch.zeros(32, 64, device=dev)
    assert lora_shrink.supports(torch.zeros(16, 64, device=dev), a)
    assert not lora_shrink.supports(torch.zeros(17, 64, device=dev), a)  # prefill: cuBLAS
    big = torch.zeros(32, 8192, device=dev)
    assert lora_shrink.supports(torch.zeros(1, 8192, device=dev), big)  # one token: any K
    assert not lora_shrink.supports(torch.zeros(8, 8192, device=dev), big)  # 8 tokens, long K: cuBLAS
    assert not lora_shrink.supports(torch.zeros(4, 128, device=dev)[:, ::2], a)  # strided rows
    assert not lora_shrink.supports(torch.zeros(4, 64, device=dev, dtype=torch.float16), a)


@pytest.mark.parametrize("m,k,r", [(1, 3584, 96), (5, 1000, 32), (40, 2100, 8), (70, 600, 48), (256, 300, 32)])
def test_split_k_shrink_matches_matmul_and_leaves_its_tickets_at_zero(dev, m, k, r):
    """The split-K shrink (any M to 256): odd K (not a multiple of its 256 block), r below the 16-row tile,
    several M tiles; run twice, as a graph replay would, with the same bits both times."""
    dt = torch.bfloat16 if CUDA else torch.float32
    g = torch.Generator().manual_seed(m * 11 + k + r)
    x = torch.randn(m, k, generator=g).to(dev, dt)
    a = (torch.randn(r, k, generator=g) * 0.02).to(dev, dt)
    assert lora_shrink.split_supports(x, a)
    got = lora_shrink.shrink_split(x, a)
    want = x.double() @ a.double().T
    assert got.shape == (m, r) and got.dtype == dt
    tol = 2 ** -7 if dt == torch.bfloat16 else 1e-5
    assert ((got.double() - want).abs() <= tol * want.abs() + 1e-4).all()
    assert torch.equal(lora_shrink.shrink_split(x, a), got)
    assert int(lora_shrink._counters(x.device, 1).abs().sum()) == 0


def test_split_plan_fills_the_card_and_covers_k():
    for m, k, r in ((1, 3584, 96), (64, 18944, 32), (256, 3584, 96), (64, 256, 32)):
        bm, br, splits = lora_shrink._split_plan(m, k, r, sms=132)
        tiles = -(-m // bm) * -(-r // br)
        assert 1 <= splits <= -(-k // lora_shrink.SPLIT_BLOCK_K)
        assert tiles * splits <= max(2 * 132, tiles)



def test_split_k_routes_only_where_it_was_measured_faster():
    # H100 shrink bench (kernels/m_thresholds.py): the one-row kernel won at one token, cuBLAS at 128-256 tokens,
    # split-K at 16 and 64
    assert [lora_shrink.split_routes(m) for m in (1, 16, 64, 128, 256)] == [False, True, True, False, False]

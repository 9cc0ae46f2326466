"""One matmul over many experts' rows: `grouped_mm(x [M, K], w [G, K, N], ends [G]) -> [M, N]`, rows
ends[g-1]:ends[g] times w[g] (torch._grouped_mm, which runs on the CPU and on Hopper GPUs).

Its own backward (dx = g·wᵀ per group, dw = xᵀ·g per group, both grouped too) because torch's
fails on the CPU for a non-contiguous incoming gradient (an expanded one, as `sum()` gives)."""

from __future__ import annotations

import torch


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, ends):
        ctx.save_for_backward(x, w, ends)
        return torch._grouped_mm(x, w, offs=ends)

    @staticmethod
    def backward(ctx, g):
        x, w, ends = ctx.saved_tensors
        g = g.contiguous()
        gx = torch._grouped_mm(g, w.transpose(-2, -1), offs=ends) if ctx.needs_input_grad[0] else None
        gw = torch._grouped_mm(x.t(), g, offs=ends) if ctx.needs_input_grad[1] else None
        return gx, gw, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """ends: int32 cumulative row counts (the last equals x.shape[0])."""
    return _GroupedMM.apply(x, w, ends)


class _FrozenGroupedMM(torch.autograd.Function):
    """x times frozen weights that `weights()` makes, made again in the backward instead of saved: an MoE
    layer's dequantized experts are 1.2 GB (Qwen3-30B-A3B) to 6.4 GB (gpt-oss-120b) in bf16, more than the
    tokens' activations, and the 4-bit copy is at hand to decode again."""

    @staticmethod
    def forward(ctx, x, ends, weights):
        ctx.save_for_backward(ends)
        ctx.weights = weights
        return torch._grouped_mm(x, weights().transpose(-2, -1), offs=ends)

    @staticmethod
    def backward(ctx, g):
        (ends,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return torch._grouped_mm(g.contiguous(), ctx.weights(), offs=ends), None, None


def frozen_grouped_mm(x: torch.Tensor, weights, ends: torch.Tensor) -> torch.Tensor:
    """Rows ends[g-1]:ends[g] of x [M, K] times w[g]ᵀ, where weights() -> w [G, N, K] (frozen: no gradient)."""
    return _FrozenGroupedMM.apply(x, ends, weights)

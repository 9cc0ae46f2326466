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

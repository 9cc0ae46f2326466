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


class _ChunkedFrozenGroupedMM(torch.autograd.Function):
    """frozen_grouped_mm over row chunks, each with its own weights: one autograd node for a whole MoE projection
    instead of a slice, a matmul and a concatenation node a chunk (the update is bound by the host's per-op cost,
    benchmarks/profiles/moe_update_qwen3_h200_b8030c1.txt). Each chunk's weights are made again in the backward."""

    @staticmethod
    def forward(ctx, x, chunks, weights):
        ctx.chunks, ctx.weights = chunks, weights
        ys = [torch._grouped_mm(x[c.lo:c.hi], weights(c).transpose(-2, -1), offs=c.ends) for c in chunks]
        return ys[0] if len(ys) == 1 else torch.cat(ys)

    @staticmethod
    def backward(ctx, g):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        g = g.contiguous()
        gs = [torch._grouped_mm(g[c.lo:c.hi], ctx.weights(c), offs=c.ends) for c in ctx.chunks]
        return (gs[0] if len(gs) == 1 else torch.cat(gs)), None, None


def frozen_grouped_mm_chunks(x: torch.Tensor, chunks: list, weights) -> torch.Tensor:
    """x [M, K] in row chunks (each with lo, hi and int32 ends local to it, the chunks covering 0..M in order),
    chunk c's rows times weights(c) -> w [G_c, N, K] transposed per group (frozen: no gradient)."""
    return _ChunkedFrozenGroupedMM.apply(x, chunks, weights)

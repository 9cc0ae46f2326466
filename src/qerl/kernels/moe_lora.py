"""The expert LoRA term of MoE decode, per routed pair, as two Triton launches that CUDA graphs can capture:
the shrink here, the expand by the one LoRA expand kernel (kernels/lora_expand.py, its per-row expert form).

For each token-expert pair p (moe_gemv.route's sorted order, P = T·k rows):
    y[p] += scaling · (x[row(p)]·A[e_p]ᵀ)·B[e_p]ᵀ,   A [E, r, K], B [E, N, r].

Why. QuantExperts' decode path (`_gemv_project`) ran this as torch._grouped_mm over the slots, which
makes a CPU-to-GPU copy: under CUDA-graph capture it fails ("Cannot copy between CPU and CUDA
tensors during CUDA graph capture"), so decode with expert LoRA could not run in graphs. Here the
launch shapes depend on (P, r, K, N) only and the kernels read the routing on the device: no host sync,
no CPU tensor.

How. Shrink: grid (pair, block of BLOCK_R adapter rows), each program streams its rows of A[e_p] over K
against the pair's x row, fp32 accumulation, into s [P, r] fp32. Expand: lora_expand.expand_add with
expert=e: a tile of pairs runs one dot per expert present in it against B[e], added into y in place.
Pairs of one expert are adjacent, and a step's hit adapters are small (Qwen3-30B-A3B, r = 32, bf16:
0.4 MB an expert for both projections, 52 MB a layer if all 128 are hit), so re-reading A per pair is
cheap; no per-slot grouping. BLOCK_R is small so that batch 1 (8 pairs) still has r/8 programs a pair to
stream A.

Rounding follows the loop (`_project`): x in the adapter dtype, the shrink's and the expand's outputs
rounded to the adapter dtype, then to y's dtype, times scaling, added in y's dtype (the expand's
rounding="loop"); only the fp32 accumulation order differs. Invalid pairs ("no expert", rt.valid False)
compute with rt.expert's clamped index (in range) and produce values that the caller drops.

Status: tested on the CPU in Triton's interpreter (tests/test_moe_lora_kernel.py); the CUDA-graph
capture test (tests/test_moe_lora_kernel_gpu.py) and the block sizes (here and the expand's expert
tiles, 16 pairs x 64 outputs) are not yet run or measured on a GPU since the expand moved into
lora_expand.py (issue 60).
"""

from __future__ import annotations

import torch

from . import lora_expand
from .triton_backend import triton_runs
from .w4_decode import cdiv, next_pow2

BLOCK_R, BLOCK_K = 8, 256  # shrink: adapter rows x inputs a step
# Debug aid for the CPU tests: run on CPU tensors in the Triton interpreter. Tests set it; nothing else should.
RUN_ON_CPU_INTERPRETER = False
_built = False  # _build() ran


def supports(x: torch.Tensor) -> bool:
    return (x.is_cuda or (RUN_ON_CPU_INTERPRETER and x.device.type == "cpu")) and triton_runs(x.device)


def _build():
    """Define the @triton.jit kernels, once, at first use: importing this module needs no Triton
    (the CPU install has none)."""
    # Module globals, not closures: Triton's interpreter (the CPU tests) runs a kernel's source against
    # its module's globals alone.
    global _built, triton, tl, _round, _shrink_kernel
    if _built:
        return
    import triton
    import triton.language as tl

    lora_expand._build()
    _round = lora_expand._round  # the shrink rounds as the shared expand does

    @triton.jit
    def _shrink_kernel(x_ptr, rows_ptr, expert_ptr, a_ptr, s_ptr, R, K, stride_xm, stride_ae, stride_ar, stride_sm,
                       GATHER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        p = tl.program_id(0)
        offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        e = tl.load(expert_ptr + p).to(tl.int64)
        if GATHER:  # gate_up reads the token's hidden state
            xr = tl.load(rows_ptr + p).to(tl.int64)
        else:  # down reads the gated gate_up output, already in pair order
            xr = p.to(tl.int64)
        a_rows = a_ptr + e * stride_ae + offs_r.to(tl.int64)[:, None] * stride_ar
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_mask = kk < K
            # x cast to the adapter dtype first, as the loop's x.to(a.dtype)
            x = _round(tl.load(x_ptr + xr * stride_xm + kk, mask=k_mask, other=0).to(tl.float32),
                       a_ptr.dtype.element_ty)
            a = tl.load(a_rows + kk[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        # The loop's shrink output is in the adapter dtype: round to it, keep fp32 storage.
        s = _round(acc, a_ptr.dtype.element_ty)
        tl.store(s_ptr + p.to(tl.int64) * stride_sm + offs_r, s, mask=r_mask)

    _built = True


def add_expert_lora(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor | None, expert: torch.Tensor, a: torch.Tensor,
                    b: torch.Tensor, scaling: float) -> torch.Tensor:
    """y [P, N] += scaling·(x[row(p)]·A[expert[p]]ᵀ)·B[expert[p]]ᵀ in place, and returned. x [M, K] (rows [P]
    its row of each pair; None: x is [P, K] in pair order); expert [P], every entry in [0, E) (route's
    rt.expert is clamped so); a [E, r, K], b [E, N, r] of one dtype. All on one device; nothing read on the
    host, so it can be captured in a CUDA graph."""
    pairs, n = y.shape
    e, r, k = a.shape
    if b.shape != (e, n, r) or b.dtype != a.dtype:
        raise ValueError(f"adapters A {tuple(a.shape)} {a.dtype} and B {tuple(b.shape)} {b.dtype}: expected "
                         f"B [{e}, {n}, {r}] of A's dtype")
    if x.shape[-1] != k or expert.shape != (pairs,) or (rows is None and x.shape[0] != pairs) or \
            (rows is not None and rows.shape != (pairs,)):
        raise ValueError(f"x {tuple(x.shape)}, rows {None if rows is None else tuple(rows.shape)}, expert "
                         f"{tuple(expert.shape)} do not fit y [{pairs}, {n}] and A [{e}, {r}, {k}]")
    if pairs == 0:
        return y
    if x.stride(-1) != 1:
        x = x.contiguous()
    if y.stride(-1) != 1:
        raise ValueError("y is added into in place: its rows must be contiguous")
    a = a if a.stride(-1) == 1 else a.contiguous()
    s = torch.empty(pairs, r, device=y.device, dtype=torch.float32)
    block_r = min(BLOCK_R, next_pow2(r))
    block_k = min(BLOCK_K, max(16, next_pow2(k)))
    _build()
    _shrink_kernel[(pairs, cdiv(r, block_r))](
        x, rows if rows is not None else expert, expert, a, s, r, k, x.stride(0), a.stride(0), a.stride(1),
        s.stride(0), GATHER=rows is not None, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    return lora_expand.expand_add(y, s, b, scaling, expert=expert, rounding="loop")


__all__ = ["add_expert_lora", "supports"]

"""The LoRA shrink xa = x @ A.T of a decode step, as one small Triton kernel.

At decode (M <= 16 tokens) the shrink is a GEMV over K = 3.5k-19k inputs into r·S = 32-96 outputs:
well under a microsecond of bytes, so its cost is launches. cuBLAS runs it as a split-K GEMV plus
a reduce (two kernels, ~6 µs per projection on the H200; 84 per 7B step = ~0.5 ms, 15 % of a
batch-1 step: benchmarks/rollout.md). Here one program per output row streams its row of A once,
for all M tokens, accumulating in fp32: one kernel, no reduce, no workspace.
"""

from __future__ import annotations

import torch

MAX_M = 16
BLOCK_K = 1024
# Debug aid for the CPU tests: run on CPU tensors in the Triton interpreter.
RUN_ON_CPU_INTERPRETER = False
_kernel = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def shrink_kernel(x_ptr, a_ptr, out_ptr, M, K, sx, sa, so, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        r = tl.program_id(0)
        m = tl.arange(0, BLOCK_M)
        mm = m < M
        acc = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < K
            a = tl.load(a_ptr + r * sa + k, mask=km, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + m[:, None] * sx + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            acc += x.to(tl.float32) * a[None, :]
        tl.store(out_ptr + m * so + r, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=mm)

    return shrink_kernel


def supports(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Where it beats cuBLAS on the H200 (scripts/profile_decode.py --shrink, 15bc42d): one token at any
    K (5.2 vs 6.7-7.0 µs; 6.6 vs 6.9 at K = 18944), or up to 16 tokens at K <= 4096 (6.6-6.7 vs 6.9-7.4
    at 8 tokens). At 8 tokens and K = 18944 (down) one program per row is too little parallelism:
    23.7 vs 7.1 µs, so cuBLAS keeps it."""
    ok_dev = x.is_cuda or (RUN_ON_CPU_INTERPRETER and x.device.type == "cpu")
    if not (ok_dev and x.dim() == 2 and a.dim() == 2 and a.stride(-1) == 1 and x.stride(-1) == 1
            and x.dtype == a.dtype):
        return False
    m, k = x.shape
    return m == 1 or (m <= MAX_M and k <= 4096)


def shrink(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """x [M <= 16, K], a [R, K] (same dtype, rows contiguous) -> x @ a.T [M, R] in that dtype."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    m, k = x.shape
    out = torch.empty(m, a.shape[0], dtype=x.dtype, device=x.device)
    bm = 1 << max(0, (m - 1).bit_length())
    _kernel[(a.shape[0],)](x, a, out, m, k, x.stride(0), a.stride(0), out.stride(0),
                           BLOCK_M=bm, BLOCK_K=BLOCK_K if bm <= 4 else BLOCK_K // 2, num_warps=4)
    return out

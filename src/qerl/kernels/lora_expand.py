"""The LoRA expand of a fused group, added into the base output in place, as one Triton launch.

    y[:, rows of segment s] += scaling · xa[:, s·r:(s+1)·r] @ b[rows of s]ᵀ      (S segments, S ≤ 4)

Why. Beside a library GEMM (humming-kernels) the expand ran as one cuBLAS addmm per segment: q|k|v
three launches, gate|up two. At RL batch sizes those small launches, not their bytes, are the LoRA
cost (+49 % over humming's layer set at M 64 on the H100: 4 shrinks + 7 expands ≈ 4 µs each). One
launch per group does all segments: grid (M tiles, N tiles); a tile that straddles a segment boundary
runs one small dot per segment it touches and keeps each column's own.

Rounding is addmm's: fp32 accumulation of xa·bᵀ, times scaling, plus y in fp32, rounded once to y's
dtype. It reads B on every call (no cached copy), so a CUDA graph replayed after an optimizer step
changed B in place computes with the new B.
"""

from __future__ import annotations

import torch

from .triton_backend import triton_runs
from .w4_decode import cdiv, next_pow2

MAX_SEGMENTS = 4
# Debug aid for the CPU tests: run on CPU tensors in Triton's interpreter. Tests set it; nothing else should.
RUN_ON_CPU_INTERPRETER = False
_built = False  # _build() ran


def supports(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, n_segments: int) -> bool:
    ok_dev = y.is_cuda or (RUN_ON_CPU_INTERPRETER and y.device.type == "cpu")
    return (ok_dev and triton_runs(y.device) and y.dim() == 2 and xa.dim() == 2 and b.dim() == 2
            and n_segments <= MAX_SEGMENTS
            and y.stride(1) == 1 and xa.stride(1) == 1 and b.stride(1) == 1
            and xa.shape[1] == n_segments * b.shape[1] and y.shape[1] == b.shape[0])


def _build():
    """Define the @triton.jit kernels, once, at first use: importing this module needs no Triton
    (the CPU install has none)."""
    # Module globals, not closures: Triton's interpreter (the CPU tests) runs a kernel's source against
    # its module's globals alone.
    global _built, triton, tl, _expand_kernel
    if _built:
        return
    import triton
    import triton.language as tl

    @triton.jit
    def _expand_kernel(y_ptr, xa_ptr, b_ptr, bias_ptr, M, N, R, s1, s2, s3, scaling, stride_ym, stride_xm, stride_bn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
                       HAS_BIAS: tl.constexpr):
        dt = y_ptr.dtype.element_ty
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        j = tl.arange(0, BLOCK_R)
        mm, nm, jm = m < M, n < N, j < R
        # each column's segment, and the range of segments this tile touches
        seg = (n >= s1).to(tl.int32) + (n >= s2).to(tl.int32) + (n >= s3).to(tl.int32)
        n0 = pid_n * BLOCK_N
        n1 = tl.minimum(n0 + BLOCK_N, N) - 1
        lo = (n0 >= s1).to(tl.int32) + (n0 >= s2).to(tl.int32) + (n0 >= s3).to(tl.int32)
        hi = (n1 >= s1).to(tl.int32) + (n1 >= s2).to(tl.int32) + (n1 >= s3).to(tl.int32)
        bt = tl.load(b_ptr + n[None, :] * stride_bn + j[:, None], mask=jm[:, None] & nm[None, :], other=0.0).to(dt)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for s in range(lo, hi + 1):
            xa = tl.load(xa_ptr + m[:, None] * stride_xm + s * R + j[None, :], mask=mm[:, None] & jm[None, :],
                         other=0.0)
            part = tl.dot(xa.to(dt), bt, out_dtype=tl.float32, input_precision=PRECISION)
            acc = tl.where((seg == s)[None, :], part, acc)
        ptrs = y_ptr + m[:, None] * stride_ym + n[None, :]
        mask = mm[:, None] & nm[None, :]
        y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
        tl.store(ptrs, (y + scaling * acc).to(dt), mask=mask)

    _built = True


def expand_add(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scaling: float,
               seg_starts: tuple[int, ...] = (), bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] += scaling · xa_s @ b_sᵀ per segment (xa [M, S·r], b [N, r]) (+ bias [N]), in place; returns y.
    With a bias the sum is rounded once (a broadcast bias add was a launch of its own: 28 a 7B step).
    xa and b are cast to y's dtype inside the kernel, as the per-segment addmm did."""
    m, n = y.shape
    r = b.shape[1]
    starts = list(seg_starts) + [n] * (MAX_SEGMENTS - 1 - len(seg_starts))
    block_m = 16 if m <= 16 else 64
    block_n = 128 if m <= 16 else 64
    block_r = max(16, next_pow2(r))
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    _build()
    _expand_kernel[grid](y, xa, b, y if bias is None else bias, m, n, r, starts[0], starts[1], starts[2], float(scaling),
                         y.stride(0), xa.stride(0), b.stride(0),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
                         PRECISION="ieee" if y.dtype == torch.float32 else "tf32", HAS_BIAS=bias is not None,
                         num_warps=4)
    return y

"""The one LoRA expand kernel: a fused group's dense expand and MoE decode's per-pair expand, added into the
base output in place, as one Triton launch.

    dense:   y[:, rows of segment s] += scaling · xa[:, s·r:(s+1)·r] @ b[rows of s]ᵀ    (S segments, S ≤ 4)
    expert:  y[p] += scaling · xa[p] @ b[expert[p]]ᵀ                                    (b [E, N, r], one segment)

Why. Beside a library GEMM (humming-kernels) the expand ran as one cuBLAS addmm per segment: q|k|v
three launches, gate|up two. At RL batch sizes those small launches, not their bytes, are the LoRA
cost (+49 % over humming's layer set at M 64 on the H100: 4 shrinks + 7 expands ≈ 4 µs each). One
launch per group does all segments. MoE decode (kernels/moe_lora.py) needs the same expand with each row's
own expert, read on the device (no host sync: CUDA graphs capture it).

How. Grid (M tiles, N tiles). A tile loops over the groups it touches and runs one small dot per group,
keeping each output's own: a group is a segment (columns; xa's s-th r-block against the same b) or, with
a per-row expert index, an expert (rows; b[e]). Pairs of one expert are adjacent in moe_gemv.route's
order, so a tile meets few experts; the loop walks only those present (any order stays correct).

Rounding, a constexpr switch (`rounding`):
- "addmm" (dense): xa and b cast to y's dtype, fp32 accumulation, times scaling, plus y (and the bias)
  in fp32, rounded once to y's dtype, as addmm.
- "loop" (MoE, its `_project` loop): xa holds values of the adapter dtype; the dot runs on them exactly
  (fp32 operands: products of 16-bit values are exact even in tf32), its fp32 sum rounded to the
  adapter dtype, then to y's dtype, times scaling (rounded to y's dtype), added in y's dtype. Only the
  fp32 accumulation order differs from the loop.
It reads B on every call (no cached copy), so a CUDA graph replayed after an optimizer step changed B in
place computes with the new B.
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
    """Whether expand_add takes this dense group (the expert form's caller checks its own inputs)."""
    ok_dev = y.is_cuda or (RUN_ON_CPU_INTERPRETER and y.device.type == "cpu")
    return (ok_dev and triton_runs(y.device) and y.dim() == 2 and xa.dim() == 2 and b.dim() == 2
            and n_segments <= MAX_SEGMENTS
            and y.stride(1) == 1 and xa.stride(1) == 1
            and xa.shape[1] == n_segments * b.shape[1] and y.shape[1] == b.shape[0])


def _build():
    """Define the @triton.jit kernels, once, at first use: importing this module needs no Triton
    (the CPU install has none)."""
    # Module globals, not closures: Triton's interpreter (the CPU tests) runs a kernel's source against
    # its module's globals alone.
    global _built, triton, tl, _round, _expand_kernel
    if _built:
        return
    import triton
    import triton.language as tl

    @triton.jit
    def _round(v, DT: tl.constexpr):
        """fp32 v rounded to DT (to nearest even), kept in fp32. bf16 by integer ops (NaN payloads aside): the
        GPU's cvt rounds so, Triton's interpreter truncates, and the CPU tests should see the GPU's rounding."""
        if DT == tl.bfloat16:
            u = v.to(tl.uint32, bitcast=True)
            u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
            out = u.to(tl.float32, bitcast=True)
        else:
            out = v.to(DT).to(tl.float32)
        return out

    @triton.jit
    def _expand_kernel(y_ptr, xa_ptr, b_ptr, bias_ptr, expert_ptr, M, N, R, s1, s2, s3, scaling,
                       stride_ym, stride_xm, stride_be, stride_bn, stride_br,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
                       HAS_BIAS: tl.constexpr, PER_ROW_EXPERT: tl.constexpr, LOOP_ROUNDING: tl.constexpr):
        ydt = y_ptr.dtype.element_ty
        if LOOP_ROUNDING:
            odt = tl.float32  # the adapter dtype's values, held exactly
        else:
            odt = ydt  # addmm's operands are y's dtype
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        j = tl.arange(0, BLOCK_R)
        mm, nm, jm = m < M, n < N, j < R
        m64 = m.to(tl.int64)
        NONE = 1073741824  # 2**30: above any expert index
        if PER_ROW_EXPERT:
            # each row's expert; the first and last present in this tile
            e = tl.load(expert_ptr + m, mask=mm, other=0).to(tl.int32)
            g = tl.min(tl.where(mm, e, NONE), axis=0)
            last = tl.max(tl.where(mm, e, -1), axis=0)
        else:
            # each column's segment, and the range of segments this tile touches
            seg = (n >= s1).to(tl.int32) + (n >= s2).to(tl.int32) + (n >= s3).to(tl.int32)
            n0 = pid_n * BLOCK_N
            n1 = tl.minimum(n0 + BLOCK_N, N) - 1
            g = (n0 >= s1).to(tl.int32) + (n0 >= s2).to(tl.int32) + (n0 >= s3).to(tl.int32)
            last = (n1 >= s1).to(tl.int32) + (n1 >= s2).to(tl.int32) + (n1 >= s3).to(tl.int32)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        while g <= last:
            if PER_ROW_EXPERT:
                b_base = b_ptr + g.to(tl.int64) * stride_be
                xa_col = 0
                mine = (e == g)[:, None]
                nxt = tl.min(tl.where(mm & (e > g), e, NONE), axis=0)  # the next expert present
            else:
                b_base = b_ptr
                xa_col = g * R
                mine = (seg == g)[None, :]
                nxt = g + 1
            bt = tl.load(b_base + n[None, :] * stride_bn + j[:, None] * stride_br, mask=jm[:, None] & nm[None, :],
                         other=0.0).to(odt)
            xa = tl.load(xa_ptr + m64[:, None] * stride_xm + xa_col + j[None, :], mask=mm[:, None] & jm[None, :],
                         other=0.0).to(odt)
            part = tl.dot(xa, bt, out_dtype=tl.float32, input_precision=PRECISION)
            acc = tl.where(mine, part, acc)
            g = nxt
        ptrs = y_ptr + m64[:, None] * stride_ym + n[None, :]
        mask = mm[:, None] & nm[None, :]
        y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        if LOOP_ROUNDING:
            d = _round(_round(_round(acc, b_ptr.dtype.element_ty), ydt) * scaling, ydt)
            out = _round(y + d, ydt)  # so the store's .to is exact
        else:
            if HAS_BIAS:
                y += tl.load(bias_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
            out = y + scaling * acc
        tl.store(ptrs, out.to(ydt), mask=mask)

    _built = True


def expand_add(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scaling: float,
               seg_starts: tuple[int, ...] = (), bias: torch.Tensor | None = None, *,
               expert: torch.Tensor | None = None, rounding: str = "addmm") -> torch.Tensor:
    """y [M, N] += scaling · xa_s @ b_sᵀ per segment (xa [M, S·r], b [N, r]) (+ bias [N]), in place; returns y.
    With a bias the sum is rounded once (a broadcast bias add was a launch of its own: 28 a 7B step).
    expert [M] (int, every entry in [0, E)): row p reads b[expert[p]] of b [E, N, r] instead, one segment,
    read on the device (CUDA-graph capturable). rounding: "addmm" (xa, b cast to y's dtype, rounded once)
    or "loop" (MoE's, see the module docstring; no bias)."""
    if rounding not in ("addmm", "loop") or (rounding == "loop" and bias is not None):
        raise ValueError(f"rounding {rounding!r}, bias {bias is not None}: expected 'addmm', or 'loop' without bias")
    m, n = y.shape
    r = b.shape[-1]
    starts = list(seg_starts) + [n] * (MAX_SEGMENTS - 1 - len(seg_starts))
    if expert is not None:
        # routed rows change expert every few rows: small tiles waste fewer dot rows
        block_m, block_n = 16, 64
        stride_be = b.stride(0)
    else:
        block_m = 16 if m <= 16 else 64
        block_n = 128 if m <= 16 else 64
        stride_be = 0
    block_r = max(16, next_pow2(r))
    loop = rounding == "loop"
    # fp32 operands need ieee; 16-bit values (the "loop" operands are exact in tf32) take tf32 or ignore it
    exact_dt = b.dtype if loop else y.dtype
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    _build()
    _expand_kernel[grid](y, xa, b, y if bias is None else bias, y if expert is None else expert, m, n, r,
                         starts[0], starts[1], starts[2], float(scaling),
                         y.stride(0), xa.stride(0), stride_be, b.stride(-2), b.stride(-1),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
                         PRECISION="ieee" if exact_dt == torch.float32 else "tf32", HAS_BIAS=bias is not None,
                         PER_ROW_EXPERT=expert is not None, LOOP_ROUNDING=loop, num_warps=4)
    return y

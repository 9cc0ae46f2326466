"""Weight-only NVFP4 / MXFP4 GEMV for decode (M = 1..4 rows): y = x·Ŵᵀ·(1/gs) + b [+ s·(x·Aᵀ)·Bᵀ].

No tensor cores: at M <= 4 an MMA wastes >= 75 % of its width and its operand layout costs a
shared-memory round trip per tile. Here every weight is decoded in registers and FMA'd with x in
fp32, and each output is a plain reduction along K.

Roofline (per weight, H200: ~4.2 TB/s copy, 132 SMs at ~1.8 GHz, 4 warp-instructions/clock/SM)
-----------------------------------------------------------------------------------------------
* Bytes: 0.5 (nibble) + 1/16 (E4M3 scale, NVFP4) or 1/32 (E8M0, MXFP4) = 0.5625 / 0.53 B
  (this kernel reads MXFP4 scales per 16 too, see Layout). At 4.2 TB/s
  that is ~7.5e12 weights/s, i.e. ~31 weights per SM per clock, against 128 thread-instructions per
  SM per clock: the whole budget is ~4 instructions per weight at 100 % of bandwidth, ~6 at 70 %.
* Instructions per weight (M = 1), as ptxas emits them for sm_90:
  - decode 2: one 32-bit word holds 8 codes; nibbles j and j+4 (the two 16-bit halves) are decoded
    together with 2 shifts + 2 LOP3 into two fp16 bit patterns: magnitude bits e e m at fp16 bits
    11..9, the sign at bit 15. Read as fp16 that is exactly code·2^-14 (code 0.5 lands on the fp16
    subnormal 2^-15, which fp16 keeps); the 2^14 is folded into the epilogue factor (exact).
  - convert 1: fp16 -> fp32 (HADD2.F32 on each half in place, FMA pipe).
  - FMA 1 per row of x: fp32 products, chained in fp32 over the 16 weights of a sub-group (one scale).
  - per sub-group (1/16 per weight): scale byte -> fp32 and one FMA of the group sum into the accumulator.
  - per K column and thread, amortised over the rows a thread holds: x bf16 -> fp32 (1 op).
  Counted in the SASS ptxas emits for sm_90 (BLOCK_N=32, BLOCK_K=512, 4 warps, 96 registers), the
  loop body is 4.7 instructions per weight at M = 1 (decode + convert 2.9, FFMA 1.06, the rest is
  x, scales, addresses), 5.9 at M = 2 and 8.4 at M = 4; no shared memory, no barriers. At M = 1
  that allows ~85 % of the copy bandwidth if issue were the only limit. (w4_matmul's fused kernel,
  at its M <= 4 tile 64x128, 4 warps: 8.5 per weight, with shared-memory stores and loads.)
* Layout: warp w of a program holds rows r·NW + w (r < BLOCK_N/NW), and each lane one 16-weight
  sub-group (2 words, one scale byte) of each of those rows per 512-wide K tile, so the x values a
  lane converts serve all its rows. Words load as 8-byte vectors (consecutive lanes on consecutive
  sub-groups of a row: fully coalesced, evict_first), x as 16-byte vectors, one copy per warp.
  Every load is 2-D with a single contiguous axis, and the row strides are left unspecialised
  (alignment known: 8 bytes), so Triton's coalescing pass lands on exactly this layout whatever its
  tie-breaking between axes; 3.6 and 3.9 give the same SASS (no layout conversion in the loop; an
  earlier 3-D formulation put lanes across rows on 3.6 and repeated the x loads per row).
  MXFP4's per-32 scale bytes are repeated per 16 once per weight (+3 % bytes read) for one kernel.

Parallelism: each program owns BLOCK_N rows and a K range. When N/BLOCK_N programs are too few for
the GPU, K is split; each split writes its fp32 partials to a workspace and the last split to finish
a row block (an atomic ticket per row block) adds all partials in split order and runs the epilogue.
The sum order is fixed, so the result is bitwise deterministic, and there is one launch. The
tickets return to 0 after each use. (SPLIT_MODE 2 leaves the sum to w4_matmul's reduce kernel.)

Epilogue as w4_matmul's: acc · 2^14 · (1/gs), + bias, + scaling · (xa · Bᵀ) in fp32, one rounding.
"""

from __future__ import annotations

import os
import weakref

import torch
import triton
import triton.language as tl
from .w4_matmul import _num_sms as num_sms, lora_args

POST = 16384.0  # 2^14: the fp16 decode yields code·2^-14

# fp16x2 bits -> two fp32 (HADD2.F32 on each half in place). As inline PTX because LLVM's SLP
# vectorizer otherwise packs the halves of different words into new registers first (PRMT).
_H2F_ASM = tl.constexpr("{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }")


@triton.jit
def _f16x2_to_f32(t, ASM: tl.constexpr):
    """uint32 holding two fp16 bit patterns -> (fp32 of the low half, fp32 of the high half)."""
    if ASM:
        return tl.inline_asm_elementwise(_H2F_ASM, "=r,=r,r", [t], dtype=(tl.float32, tl.float32), is_pure=True,
                                         pack=1)
    else:  # the interpreter (no inline PTX)
        lo = t.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (t >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi


@triton.jit
def _pair(q, J: tl.constexpr, ASM: tl.constexpr):
    """Codes J and J+4 of uint32 words q -> fp32 (code_J·2^-14, code_(J+4)·2^-14): 2 shifts + 2 LOP3."""
    if J <= 2:
        em = q << (9 - 4 * J)  # bits e e m of both nibbles to fp16 bits 11..9 of their half
    else:
        em = q >> (4 * J - 9)
    t = (em & 0x0E000E00) | ((q << (12 - 4 * J)) & 0x80008000)  # the signs to bit 15 of each half
    return _f16x2_to_f32(t, ASM)


@triton.jit
def _x2(v, XKIND: tl.constexpr, ASM: tl.constexpr):
    """int32 words of x -> fp32 values: bf16/fp16 pairs (XKIND 0/1) give (low, high); fp32 (2) gives itself."""
    if XKIND == 0:
        return (v << 16).to(tl.float32, bitcast=True), (v & -65536).to(tl.float32, bitcast=True)
    elif XKIND == 1:
        return _f16x2_to_f32(v.to(tl.uint32, bitcast=True), ASM)
    else:
        return v.to(tl.float32, bitcast=True), v.to(tl.float32, bitcast=True)


@triton.jit
def _split4(v, D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr):
    """[D0, D1, D2, 4] -> its 4 trailing columns (in registers)."""
    e0, e1 = tl.split(v.reshape(D0, D1, D2, 2, 2))  # column 2a + b: split b, then a
    c0, c2 = tl.split(e0)
    c1, c3 = tl.split(e1)
    return c0, c1, c2, c3


@triton.jit
def _x8(x_ptr, off, XKIND: tl.constexpr, ASM: tl.constexpr, NW: tl.constexpr, BKS: tl.constexpr):
    """The 8 x values of one word of each sub-group: off [NW, BKS*4] int32 offsets (16-byte vectors, one
    copy per warp) -> 8 fp32 [1, NW, BKS] tensors, which broadcast over the rows a thread holds."""
    v = tl.load(x_ptr + off).reshape(1, NW, BKS, 4)
    v0, v1, v2, v3 = _split4(v, 1, NW, BKS)
    if XKIND == 2:  # fp32: 4 values per 16 bytes, a second load for k 4..7
        u = tl.load(x_ptr + off + 4).reshape(1, NW, BKS, 4)
        u0, u1, u2, u3 = _split4(u, 1, NW, BKS)
        return (v0.to(tl.float32, bitcast=True), v1.to(tl.float32, bitcast=True),
                v2.to(tl.float32, bitcast=True), v3.to(tl.float32, bitcast=True),
                u0.to(tl.float32, bitcast=True), u1.to(tl.float32, bitcast=True),
                u2.to(tl.float32, bitcast=True), u3.to(tl.float32, bitcast=True))
    else:
        x0, x1 = _x2(v0, XKIND, ASM)
        x2, x3 = _x2(v1, XKIND, ASM)
        x4, x5 = _x2(v2, XKIND, ASM)
        x6, x7 = _x2(v3, XKIND, ASM)
        return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _dot_word(t, l0, h0, l1, h1, l2, h2, l3, h3, x_ptr, off, XKIND: tl.constexpr, ASM: tl.constexpr,
              NW: tl.constexpr, BKS: tl.constexpr):
    """t + the dot of one decoded word (l_j = code j, h_j = code j+4) with its 8 x values."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _x8(x_ptr, off, XKIND, ASM, NW, BKS)
    t += l0 * x0  # one FFMA each (the multiply and add contract)
    t += h0 * x4
    t += l1 * x1
    t += h1 * x5
    t += l2 * x2
    t += h2 * x6
    t += l3 * x3
    t += h3 * x7
    return t


@triton.jit
def _word(q, t0, t1, t2, t3, x_ptr, stride_xm, off, M: tl.constexpr, XKIND: tl.constexpr, ASM: tl.constexpr,
          NW: tl.constexpr, BKS: tl.constexpr):
    """Decode one word of every (row, sub-group) of q once; add its dot with each row of x to t0..t3."""
    l0, h0 = _pair(q, 0, ASM)
    l1, h1 = _pair(q, 1, ASM)
    l2, h2 = _pair(q, 2, ASM)
    l3, h3 = _pair(q, 3, ASM)
    t0 = _dot_word(t0, l0, h0, l1, h1, l2, h2, l3, h3, x_ptr, off, XKIND, ASM, NW, BKS)
    if M > 1:
        t1 = _dot_word(t1, l0, h0, l1, h1, l2, h2, l3, h3, x_ptr + stride_xm, off, XKIND, ASM, NW, BKS)
    if M > 2:
        t2 = _dot_word(t2, l0, h0, l1, h1, l2, h2, l3, h3, x_ptr + 2 * stride_xm, off, XKIND, ASM, NW, BKS)
    if M > 3:
        t3 = _dot_word(t3, l0, h0, l1, h1, l2, h2, l3, h3, x_ptr + 3 * stride_xm, off, XKIND, ASM, NW, BKS)
    return t0, t1, t2, t3


@triton.jit
def _finish(acc, offs, m, N, y_ptr, stride_ym, factor, bias_ptr, xa_ptr, lb_ptr, scaling, R,
            HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, BLOCK_R: tl.constexpr):
    """Row m of the output: raw sums acc [ROWS, NW] of the output features offs [ROWS, NW] -> y[m, offs]."""
    n_mask = offs < N
    acc = acc * factor
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=n_mask, other=0).to(tl.float32)
    if HAS_LORA:
        offs_r = tl.arange(0, BLOCK_R)[None, None, :]
        r_mask = offs_r < R
        b = tl.load(lb_ptr + offs[:, :, None] * R + offs_r, mask=n_mask[:, :, None] & r_mask, other=0)
        a = tl.load(xa_ptr + m * R + offs_r, mask=r_mask, other=0).to(b.dtype)
        acc += tl.sum(b.to(tl.float32) * a.to(tl.float32), axis=2) * scaling
    tl.store(y_ptr + m * stride_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _tile(p, sc, acc0, acc1, acc2, acc3, x_ptr, stride_xm, xk, FMT: tl.constexpr, M: tl.constexpr,
          XKIND: tl.constexpr, ASM: tl.constexpr, XW: tl.constexpr, ROWS: tl.constexpr, NW: tl.constexpr,
          BKS: tl.constexpr):
    """One K tile: words p [BN, 2·BKS], raw sub-group scales sc [BN, BKS] (row n = r·NW + w);
    acc_m [ROWS, NW, BKS] += scale · (the 16-weight dot of each sub-group)."""
    if FMT == 0:
        sc = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        sc = (sc.to(tl.uint32) << 23).to(tl.float32, bitcast=True)  # E8M0 2^(e-127); e = 0 reads as 0
    sc = sc.reshape(ROWS, NW, BKS)
    q0, q1 = tl.split(p.to(tl.uint32, bitcast=True).reshape(ROWS, NW, BKS, 2))
    t0 = tl.zeros((ROWS, NW, BKS), dtype=tl.float32)
    t1 = tl.zeros((ROWS, NW, BKS), dtype=tl.float32)
    t2 = tl.zeros((ROWS, NW, BKS), dtype=tl.float32)
    t3 = tl.zeros((ROWS, NW, BKS), dtype=tl.float32)
    t0, t1, t2, t3 = _word(q0, t0, t1, t2, t3, x_ptr, stride_xm, xk, M, XKIND, ASM, NW, BKS)
    t0, t1, t2, t3 = _word(q1, t0, t1, t2, t3, x_ptr, stride_xm, xk + 8 // XW, M, XKIND, ASM, NW, BKS)
    acc0 += t0 * sc
    if M > 1:
        acc1 += t1 * sc
    if M > 2:
        acc2 += t2 * sc
    if M > 3:
        acc3 += t3 * sc
    return acc0, acc1, acc2, acc3


@triton.jit(do_not_specialize=["stride_q2", "stride_s"])
def _gemv_kernel(x_ptr, q_ptr, s_ptr, ws_ptr, cnt_ptr, y_ptr, gsinv_ptr, bias_ptr, xa_ptr, lb_ptr,
                 N, K, stride_q2, stride_s, stride_xm, stride_ym, k_split, SPLIT_K, scaling, R, post,
                 FMT: tl.constexpr, M: tl.constexpr, XKIND: tl.constexpr, ASM: tl.constexpr,
                 SPLIT_MODE: tl.constexpr, PREFETCH: tl.constexpr,
                 HAS_GS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
                 BLOCK_R: tl.constexpr, ROWS: tl.constexpr, NW: tl.constexpr, BLOCK_K: tl.constexpr):
    """q: int32 words [N, K/8] (row stride 2·stride_q2 = K/8), s: one scale byte per 16 weights [N, K/16]
    (row stride stride_s; MXFP4's are repeated per 16). The program owns BN = ROWS·NW rows: warp w
    holds rows r·NW + w (r < ROWS) and each lane one 16-weight sub-group of each of them per tile.

    Every load is 2-D with one contiguous axis, so the coalescing pass puts the lanes on K whatever
    its tie-breaking: words [BN, BLOCK_K/8] as 8-byte vectors (the row strides are left
    unspecialised, so 8 bytes is all the alignment known), scale bytes [BN, BLOCK_K/16], and x
    [NW, BLOCK_K/4] words as 16-byte vectors, one copy per warp, shared by the ROWS rows.
    x: [M, K] seen as int32 words (stride_xm in words): bf16 (XKIND 0) or fp16 (1) pairs, or fp32 (2).
    ASM: the fp16 -> fp32 conversions as inline PTX (GPU); else plain Triton (the interpreter).
    K and k_split are multiples of BLOCK_K (no masks in the loop).
    PREFETCH: load the next tile's words and scales before decoding this one (twice the bytes in flight).
    SPLIT_MODE: 0 = one split (epilogue here), 1 = workspace + last split reduces (ticket in cnt_ptr),
    2 = workspace only (w4_matmul._splitk_reduce_kernel finishes).
    """
    BN: tl.constexpr = ROWS * NW
    BKS: tl.constexpr = BLOCK_K // 16  # 16-weight sub-groups (2 words, one scale byte) per tile
    XW: tl.constexpr = 1 if XKIND == 2 else 2  # x values per int32 word
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N re-read the last one; never stored
    q_base = q_ptr + (rows * stride_q2 * 2)[:, None] + tl.arange(0, 2 * BKS)[None, :]
    s_base = s_ptr + (rows * stride_s)[:, None] + tl.arange(0, BKS)[None, :]
    # x words of the first 8 k of each sub-group, [NW, 4·BKS], the same for every warp
    j = tl.arange(0, 4 * BKS)
    x_off = (tl.arange(0, NW) * 0)[:, None] + ((j // 4) * (16 // XW) + j % 4)[None, :]

    acc0 = tl.zeros((ROWS, NW, BKS), dtype=tl.float32)
    acc1 = tl.zeros((ROWS, NW, BKS), dtype=tl.float32)
    acc2 = tl.zeros((ROWS, NW, BKS), dtype=tl.float32)
    acc3 = tl.zeros((ROWS, NW, BKS), dtype=tl.float32)
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    if PREFETCH:
        p = tl.load(q_base + k_lo // 8, eviction_policy="evict_first")
        sc = tl.load(s_base + k_lo // 16, eviction_policy="evict_first")
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kn = tl.minimum(k0 + BLOCK_K, k_hi - BLOCK_K)  # the last tile re-reads itself (cache hit)
            p_next = tl.load(q_base + kn // 8, eviction_policy="evict_first")
            sc_next = tl.load(s_base + kn // 16, eviction_policy="evict_first")
            acc0, acc1, acc2, acc3 = _tile(p, sc, acc0, acc1, acc2, acc3, x_ptr, stride_xm, k0 // XW + x_off,
                                           FMT, M, XKIND, ASM, XW, ROWS, NW, BKS)
            p = p_next
            sc = sc_next
    else:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            p = tl.load(q_base + k0 // 8, eviction_policy="evict_first")
            sc = tl.load(s_base + k0 // 16, eviction_policy="evict_first")
            acc0, acc1, acc2, acc3 = _tile(p, sc, acc0, acc1, acc2, acc3, x_ptr, stride_xm, k0 // XW + x_off,
                                           FMT, M, XKIND, ASM, XW, ROWS, NW, BKS)
    y0 = tl.sum(acc0, axis=2)  # [ROWS, NW]
    y1 = tl.sum(acc1, axis=2)
    y2 = tl.sum(acc2, axis=2)
    y3 = tl.sum(acc3, axis=2)
    offs = pid_n * BN + tl.arange(0, ROWS)[:, None] * NW + tl.arange(0, NW)[None, :]  # feature of y_m[r, w]

    factor = post
    if HAS_GS:
        factor = factor * tl.load(gsinv_ptr)
    if SPLIT_MODE == 0:
        _finish(y0, offs, 0, N, y_ptr, stride_ym, factor, bias_ptr, xa_ptr, lb_ptr, scaling, R, HAS_BIAS, HAS_LORA, BLOCK_R)
        if M > 1:
            _finish(y1, offs, 1, N, y_ptr, stride_ym, factor, bias_ptr, xa_ptr, lb_ptr, scaling, R, HAS_BIAS, HAS_LORA, BLOCK_R)
        if M > 2:
            _finish(y2, offs, 2, N, y_ptr, stride_ym, factor, bias_ptr, xa_ptr, lb_ptr, scaling, R, HAS_BIAS, HAS_LORA, BLOCK_R)
        if M > 3:
            _finish(y3, offs, 3, N, y_ptr, stride_ym, factor, bias_ptr, xa_ptr, lb_ptr, scaling, R, HAS_BIAS, HAS_LORA, BLOCK_R)
    else:
        n_mask = offs < N
        ws = ws_ptr + pid_k * M * N + offs
        if SPLIT_MODE == 2:  # the reduce kernel applies 1/gs only: the 2^14 goes in here (exact)
            y0 = y0 * post
            y1 = y1 * post
            y2 = y2 * post
            y3 = y3 * post
        tl.store(ws, y0, mask=n_mask)
        if M > 1:
            tl.store(ws + N, y1, mask=n_mask)
        if M > 2:
            tl.store(ws + 2 * N, y2, mask=n_mask)
        if M > 3:
            tl.store(ws + 3 * N, y3, mask=n_mask)
        if SPLIT_MODE == 1:
            tl.debug_barrier()  # every thread's partials are written before the ticket is taken
            ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
            if ticket == SPLIT_K - 1:  # the last split of this row block: sum all, in split order
                tl.store(cnt_ptr + pid_n, 0)  # ready for the next call
                z0 = tl.zeros((ROWS, NW), dtype=tl.float32)
                z1 = tl.zeros((ROWS, NW), dtype=tl.float32)
                z2 = tl.zeros((ROWS, NW), dtype=tl.float32)
                z3 = tl.zeros((ROWS, NW), dtype=tl.float32)
                for s in range(SPLIT_K):
                    part = ws_ptr + s * M * N + offs
                    z0 += tl.load(part, mask=n_mask, other=0, cache_modifier=".cg")
                    if M > 1:
                        z1 += tl.load(part + N, mask=n_mask, other=0, cache_modifier=".cg")
                    if M > 2:
                        z2 += tl.load(part + 2 * N, mask=n_mask, other=0, cache_modifier=".cg")
                    if M > 3:
                        z3 += tl.load(part + 3 * N, mask=n_mask, other=0, cache_modifier=".cg")
                _finish(z0, offs, 0, N, y_ptr, stride_ym, factor, bias_ptr, xa_ptr, lb_ptr, scaling, R,
                        HAS_BIAS, HAS_LORA, BLOCK_R)
                if M > 1:
                    _finish(z1, offs, 1, N, y_ptr, stride_ym, factor, bias_ptr, xa_ptr, lb_ptr, scaling, R,
                            HAS_BIAS, HAS_LORA, BLOCK_R)
                if M > 2:
                    _finish(z2, offs, 2, N, y_ptr, stride_ym, factor, bias_ptr, xa_ptr, lb_ptr, scaling, R,
                            HAS_BIAS, HAS_LORA, BLOCK_R)
                if M > 3:
                    _finish(z3, offs, 3, N, y_ptr, stride_ym, factor, bias_ptr, xa_ptr, lb_ptr, scaling, R,
                            HAS_BIAS, HAS_LORA, BLOCK_R)


# ---- launcher ------------------------------------------------------------------------------
GROUP = {0: 16, 1: 32}
# Largest M (rows of x) the kernel takes; triton_backend routes rows <= QERL_GEMV_MAX_M here.
MAX_M = 4
# (N, K) or (M, N, K) -> (BLOCK_N, BLOCK_K, num_warps, split_k, prefetch); an (M, N, K) entry overrides
# the (N, K) one for that M. From the H200 sweep (`python3 scripts/gemv_bench.py` prints this line);
# shapes not listed use `heuristic_config`.
TILES: dict[tuple, tuple[int, int, int, int, int]] = {}
SPLIT_MODE = int(os.environ.get("QERL_GEMV_SPLIT_MODE", "1"))  # 1: last split reduces; 2: reduce kernel
USE_ASM = os.environ.get("QERL_GEMV_ASM", "1") == "1"  # inline-PTX fp16 -> fp32 on CUDA (else plain Triton)
XKIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def _cdiv(a, b):
    return -(-a // b)


def split_for(N: int, K: int, block_n: int, block_k: int, device, waves: float = 2.0) -> int:
    """Split K until about `waves` programs per SM (each split at least one K tile)."""
    tiles = _cdiv(N, block_n)
    want = int(waves * num_sms(device))
    return max(1, min(K // block_k, _cdiv(want, tiles))) if tiles < want else 1


def heuristic_config(M: int, N: int, K: int, fmt_id: int, device) -> tuple:
    """Tile and split for a shape not in TILES."""
    block_n, block_k, num_warps = 32, 512, 4
    return (block_n, block_k, num_warps, split_for(N, K, block_n, fit_block_k(K, block_k), device), 1)


def gemv_config(M: int, N: int, K: int, fmt_id: int, device) -> tuple:
    return TILES.get((M, N, K)) or TILES.get((N, K)) or heuristic_config(M, N, K, fmt_id, device)


def fit_block_k(K: int, block_k: int, fmt_id: int = 0) -> int:
    """The largest power of two <= block_k that divides K (at least 16, which divides K).

    512 (one 16-weight sub-group per lane) and its multiples keep every lane on K; smaller tiles
    (K not a multiple of 512) are correct but put lanes across rows, which costs layout conversions."""
    bk = max(16, triton.next_power_of_2(block_k))
    while K % bk:
        bk //= 2
    return bk


# id(packed) -> (weakref to it, (int32 view [N, K/8], split tickets)): made once per weight.
_STATE: dict[int, tuple] = {}
# id(MXFP4 scale) -> (weakref, its bytes repeated per 16 weights [N, K/16]): made once per weight.
_SCALE16: dict[int, tuple] = {}


def _weight_state(packed: torch.Tensor, N: int):
    hit = _STATE.get(id(packed))
    if hit is not None and hit[0]() is packed:
        return hit[1]
    q32 = packed.view(torch.int32)
    tickets = torch.zeros(_cdiv(N, 4) + 1, device=packed.device, dtype=torch.int32)  # BLOCK_N >= 4
    kid = id(packed)
    _STATE[kid] = (weakref.ref(packed, lambda _, kid=kid: _STATE.pop(kid, None)), (q32, tickets))
    return q32, tickets


def _scale16(scale: torch.Tensor) -> torch.Tensor:
    """MXFP4's per-32 scale bytes, each repeated for both 16-weight halves (+3 % bytes per weight):
    the kernel then reads one scale byte per lane for either format."""
    hit = _SCALE16.get(id(scale))
    if hit is not None and hit[0]() is scale:
        return hit[1]
    s16 = scale.repeat_interleave(2, dim=1).contiguous()
    kid = id(scale)
    _SCALE16[kid] = (weakref.ref(scale, lambda _, kid=kid: _SCALE16.pop(kid, None)), s16)
    return s16


def supported(x2d: torch.Tensor, fmt_id: int, packed: torch.Tensor) -> bool:
    """Shapes and layouts the GEMV handles (else the caller keeps the fused kernel)."""
    M, K = x2d.shape
    return (fmt_id in GROUP and 1 <= M <= MAX_M and K % GROUP[fmt_id] == 0 and x2d.dtype in XKIND
            and packed.is_contiguous() and packed.data_ptr() % 16 == 0 and x2d.stride(-1) == 1
            and (x2d.stride(0) * x2d.element_size()) % 16 == 0 and x2d.data_ptr() % 16 == 0)


def gemv(x2d, fmt_id, packed, scale, gs_inv, N, bias=None, lora=None, config=None, out=None, split_mode=None):
    """x2d [M <= 4, K] -> [M, N] in x's dtype. packed [N, K/2] uint8, scale [N, K/G] raw bytes (uint8 view).

    gs_inv: NVFP4's 1/global-scale as a 1-element fp32 tensor (None for MXFP4).
    lora = (xa [M, r], B [N, r], scaling). config = (BLOCK_N, BLOCK_K, num_warps, split_k, prefetch):
    each of the num_warps warps holds BLOCK_N / num_warps rows; BLOCK_K is lowered to divide K.
    """
    M, K = x2d.shape
    assert 1 <= M <= MAX_M and fmt_id in GROUP, (M, fmt_id)
    block_n, block_k, num_warps, split, prefetch = config or gemv_config(M, N, K, fmt_id, x2d.device)
    assert block_n >= 4 and block_n % num_warps == 0 and triton.next_power_of_2(block_n) == block_n
    block_k = fit_block_k(K, block_k)
    mode = SPLIT_MODE if split_mode is None else split_mode
    k_steps = K // block_k
    split = max(1, min(split, k_steps))
    k_split = _cdiv(k_steps, split) * block_k
    split = _cdiv(K, k_split)
    q32, tickets = _weight_state(packed, N)
    if fmt_id == 1:
        scale = _scale16(scale)
    y = out if out is not None else torch.empty(M, N, device=x2d.device, dtype=x2d.dtype)
    xa, lb, scaling, R, block_r = lora_args(lora, M)
    dummy = x2d  # pointer arguments whose branch is compiled out
    ws = torch.empty(split, M, N, device=x2d.device, dtype=torch.float32) if split > 1 else dummy
    flags = dict(HAS_GS=gs_inv is not None, HAS_BIAS=bias is not None, HAS_LORA=lora is not None, BLOCK_R=block_r)
    ptrs = (gs_inv if gs_inv is not None else dummy, bias if bias is not None else dummy,
            xa if xa is not None else dummy, lb if lb is not None else dummy)
    xkind = XKIND[x2d.dtype]
    xw = 1 if xkind == 2 else 2  # x values per int32 word
    _gemv_kernel[(_cdiv(N, block_n), split)](
        x2d.view(torch.int32), q32, scale, ws, tickets, y, *ptrs,
        N, K, K // 16, K // 16, x2d.stride(0) // xw, y.stride(0), k_split, split, float(scaling), R, POST,
        FMT=fmt_id, M=M, XKIND=xkind, ASM=USE_ASM and x2d.is_cuda, SPLIT_MODE=mode if split > 1 else 0,
        PREFETCH=bool(prefetch) and k_split > block_k, **flags,
        ROWS=block_n // num_warps, NW=num_warps, BLOCK_K=block_k, num_warps=num_warps, num_stages=1)
    if split > 1 and mode == 2:
        from .w4_matmul import _splitk_reduce_kernel

        _splitk_reduce_kernel[(_cdiv(N, 64), 1)](ws, y, *ptrs, M, N, y.stride(0), float(scaling), R, split,
                                                 **flags, BLOCK_M=16, BLOCK_N=64)
    return y


def gemv_bytes(M: int, N: int, K: int, fmt_id: int, act_bytes: int = 2) -> int:
    """Fewest bytes the GEMV must move: packed weights + scales + x + y."""
    return N * K // 2 + N * K // GROUP[fmt_id] + (M * K + M * N) * act_bytes


__all__ = ["gemv", "gemv_config", "heuristic_config", "supported", "gemv_bytes", "TILES", "MAX_M"]

"""The LoRA shrink xa = x @ A.T of a decode step, as one small Triton kernel.

At decode (M <= 16 tokens) the shrink is a GEMV over K = 3.5k-19k inputs into r·S = 32-96 outputs:
well under a microsecond of bytes, so its cost is launches. cuBLAS runs it as a split-K GEMV plus
a reduce (two kernels, ~6 µs per projection on the H200; 84 per 7B step = ~0.5 ms, 15 % of a
batch-1 step: benchmarks/rollout.md). Here one program per output row streams its row of A once,
for all M tokens, accumulating in fp32: one kernel, no reduce, no workspace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import settings
from .dispatch import LoraTerm
from .m_thresholds import (LORA_SHRINK_MAX_M, LORA_SHRINK_SPLIT_MAX_M, LORA_SHRINK_SPLIT_ROUTE_MAX_M,
                           LORA_SHRINK_SPLIT_ROUTE_MIN_M)
from .triton_backend import triton_runs

MAX_M = LORA_SHRINK_MAX_M  # kernels/m_thresholds.py
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
    ok_dev = (x.is_cuda or (RUN_ON_CPU_INTERPRETER and x.device.type == "cpu")) and triton_runs(x.device)
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


# ---- The shrink at any M up to SPLIT_MAX_M, split over K, in one launch ----
# Beside a library GEMM (humming, M > 16) cuBLAS ran the shrink in ~6-7 µs a projection on the H100 (7B decode
# step at batch 64: 112 shrinks and expands, 1.2 ms of 6.3: scripts/profile_decode.py, ae245f7): a
# [M, 3.5k-19k] x [3.5k-19k, 32-96] product moves ~1 MB, so its time is launches and too few CTAs. Here the K
# range is split over enough programs to fill the card; each writes its fp32 partial tile, and the last program
# of a tile (a ticket counter) sums the partials in split order and writes xa rounded once: one launch, no
# memset, the same bits on every run, and the counter is left at 0 for the next call or graph replay.
SPLIT_MAX_M = LORA_SHRINK_SPLIT_MAX_M  # kernels/m_thresholds.py
SPLIT_BLOCK_K = 256
_split_kernel = None
_WORKSPACES: dict = {}
_CPU_COUNTERS: dict = {}
_RETIRED: list = []


def _build_split():
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(x_ptr, a_ptr, out_ptr, ws_ptr, cnt_ptr, M, K, R, K_PER, sx, sa, so,
                     BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr,
                     PRECISION: tl.constexpr):
        pm, pr, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        m = pm * BM + tl.arange(0, BM)
        r = pr * BR + tl.arange(0, BR)
        mm, rm = m < M, r < R
        acc = tl.zeros([BM, BR], tl.float32)
        k_lo = ps * K_PER
        for k0 in range(k_lo, k_lo + K_PER, BK):
            k = k0 + tl.arange(0, BK)
            km = k < K
            x = tl.load(x_ptr + m[:, None] * sx + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
            a = tl.load(a_ptr + r[None, :] * sa + k[:, None], mask=km[:, None] & rm[None, :], other=0.0)
            acc += tl.dot(x, a, out_dtype=tl.float32, input_precision=PRECISION)
        tile = pm * tl.num_programs(1) + pr
        ws = ws_ptr + (tile * SPLITS) * BM * BR + tl.arange(0, BM)[:, None] * BR + tl.arange(0, BR)[None, :]
        tl.store(ws + ps * BM * BR, acc)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken (release below)
        ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLITS - 1:  # the last program of this tile: sum the partials in split order
            total = tl.zeros([BM, BR], tl.float32)
            for s in range(SPLITS):
                total += tl.load(ws + s * BM * BR, cache_modifier=".cg")
            tl.store(out_ptr + m[:, None] * so + r[None, :], total.to(out_ptr.dtype.element_ty),
                     mask=mm[:, None] & rm[None, :])
            tl.atomic_xchg(cnt_ptr + tile, 0)

    return split_kernel


def split_supports(x: torch.Tensor, a: torch.Tensor) -> bool:
    ok_dev = (x.is_cuda or (RUN_ON_CPU_INTERPRETER and x.device.type == "cpu")) and triton_runs(x.device)
    return (ok_dev and x.dim() == 2 and a.dim() == 2 and a.stride(-1) == 1 and x.stride(-1) == 1
            and x.dtype == a.dtype and x.shape[0] <= SPLIT_MAX_M and x.shape[1] == a.shape[1])


def split_routes(m: int) -> bool:
    """Whether the measured table sends an M-token shrink to split-K: not at one token (the one-row kernel is
    faster there), not above LORA_SHRINK_SPLIT_ROUTE_MAX_M (cuBLAS is), see kernels/m_thresholds.py."""
    return LORA_SHRINK_SPLIT_ROUTE_MIN_M <= m <= LORA_SHRINK_SPLIT_ROUTE_MAX_M


def _split_plan(m: int, k: int, r: int, sms: int) -> tuple[int, int, int]:
    """(BM, BR, splits): tiles of 16-64 tokens by 16-32 adapter rows, K split so the grid covers ~2 waves of SMs."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    br = 16 if r <= 16 or m > 64 else 32
    tiles = -(-m // bm) * -(-r // br)
    k_blocks = -(-k // SPLIT_BLOCK_K)
    splits = max(1, min(k_blocks, (2 * sms) // tiles, 64))
    return bm, br, splits


def _workspace(device, need: int) -> torch.Tensor:
    """The fp32 partials of the current stream (as kernels/counters.py owns the ticket counters per stream: calls on
    one stream run in order; a rollout beside an update gets its own). A buffer that grows is kept alive, not
    freed: a CUDA graph captured earlier still points at it."""
    key = (device.index, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.numel() < need:
        if ws is not None:
            _RETIRED.append(ws)
        ws = _WORKSPACES[key] = torch.empty(-(-need // 65536) * 65536, dtype=torch.float32, device=device)
    return ws


def _counters(device, tiles: int) -> torch.Tensor:
    if device.type == "cuda":
        from .counters import split_counters

        return split_counters(device, tiles)
    buf = _CPU_COUNTERS.get(device)  # the CPU interpreter's tests
    if buf is None:
        buf = _CPU_COUNTERS[device] = torch.zeros(1 << 16, dtype=torch.int32)
    return buf


def shrink_split(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """x [M <= SPLIT_MAX_M, K], a [R, K] (same dtype, rows contiguous) -> x @ a.T [M, R] in that dtype."""
    global _split_kernel
    if _split_kernel is None:
        _split_kernel = _build_split()
    m, k = x.shape
    r = a.shape[0]
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 8
    bm, br, splits = _split_plan(m, k, r, sms)
    k_per = -(-(-(-k // splits)) // SPLIT_BLOCK_K) * SPLIT_BLOCK_K
    splits = -(-k // k_per)
    grid = (-(-m // bm), -(-r // br), splits)
    ws = _workspace(x.device, grid[0] * grid[1] * splits * bm * br)
    cnt = _counters(x.device, grid[0] * grid[1])
    out = torch.empty(m, r, dtype=x.dtype, device=x.device)
    _split_kernel[grid](x, a, out, ws, cnt, m, k, r, k_per, x.stride(0), a.stride(0), out.stride(0),
                        BM=bm, BR=br, BK=SPLIT_BLOCK_K, SPLITS=splits,
                        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4)
    return out


def shrunk(lora, x2d):
    """The term with xa computed by the measured fastest shrink: split-K (one launch) where the table routes M to
    it, else the one-row decode shrink where it applies (one token), else cuBLAS."""
    if lora.xa is None and lora.a is not None:
        if (settings.current().lora_shrink_split and split_routes(x2d.shape[0])
                and split_supports(x2d, lora.a)):
            return LoraTerm(shrink_split(x2d, lora.a), lora.b, lora.scaling, lora.seg_starts)
        if supports(x2d, lora.a):
            return LoraTerm(shrink(x2d, lora.a), lora.b, lora.scaling, lora.seg_starts)
    return lora.shrunk(x2d)


# ---- The shrink beside the base GEMM (KernelSettings.lora_overlap) ----
# The shrink needs only x, the base GEMM only x and W: on a side stream the shrink's launches and its small grid
# overlap the base GEMM instead of preceding it. The side stream forks from the current one (so it sees x) and the
# current stream waits for it before the expand; in a CUDA graph capture the fork and join become graph edges. Each
# (device, stream) has its own side stream, made at the first (eager) call, and the split shrink's workspace and
# counters are per stream already.
_SIDE: dict = {}


@dataclass
class Pending:
    term: LoraTerm
    side: torch.cuda.Stream


def begin(lora: LoraTerm, x2d: torch.Tensor) -> Pending:
    """Start xa = x @ A.T on the side stream of the current one; `finish` before using it."""
    cur = torch.cuda.current_stream(x2d.device)
    side = _SIDE.get((x2d.device.index, cur.cuda_stream))
    if side is None:
        side = _SIDE[(x2d.device.index, cur.cuda_stream)] = torch.cuda.Stream(x2d.device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        term = shrunk(lora, x2d)
    return Pending(term, side)


def finish(p: Pending) -> LoraTerm:
    """The current stream waits for the side stream's shrink; xa's memory is kept until the current stream is done
    with it. (x, read on the side stream, stays referenced by the caller until after this join.)"""
    cur = torch.cuda.current_stream(p.term.xa.device)
    cur.wait_stream(p.side)
    if not torch.cuda.is_current_stream_capturing():  # a capture's pool keeps its blocks for the graph's life
        p.term.xa.record_stream(cur)
    return p.term

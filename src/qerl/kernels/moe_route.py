"""moe_gemv's route() as one Triton launch: a MoE decode step's token-expert pairs sorted by expert, every
Routing field bit-equal to moe_gemv._route_counting's (dtypes included).

What it does. One program holds all P = T·k pairs. Each pair's class is its expert clamped to [0, E] (E:
"no expert"); one bitonic tl.sort of the keys class·P_PAD + index (unique, so the order is stable by
construction) gives order, token, expert and valid in sorted order. A tl.histogram of the classes gives each
expert's count, its exclusive cumsum each expert's start; each expert's slot rank (hit experts ascending,
then unhit ones) comes from a cumsum of the hit flags, and the expert scatters its slot_expert, slot_start,
slot_count and ends (its inclusive end if hit, else the valid pairs' total) to that rank when it is < S.
No gather, no scratch memory, nothing read back to the host: the output shapes come from T, k and E alone,
so it can be captured in a CUDA graph.

Why. _route_counting is 18 kernel-launching aten ops (its docstring; tests/test_moe_route.py counts them),
each on a few hundred elements at decode sizes, so mostly launch latency: tens of µs a MoE layer on an H100
(the argsort route's 36 launches were 81 µs). Here: one launch plus the outputs' allocation (4 torch.empty,
no kernel).

Bounds (supports()): int32 or int64 indices, 1 <= P <= MAX_PAIRS = 1024 and 1 <= E <= MAX_EXPERTS = 256,
one program of 4 warps: 128..1024 sort keys and 32..512 histogram bins (powers of two) in registers.
Indices should be contiguous (topk's are): others cost reshape's copy, one more launch.

Status: the default (KernelSettings.moe_route_fused; outside these bounds moe_gemv.route falls back to the
counting sort, or to the two argsorts where moe_route_counting is off). On an H100 at daff6d8 its GPU tests (tests/test_moe_route_kernel.py: bit-equal to the counting
sort, a CUDA-graph replay) passed, and from a graph it took 4.1 µs at 64 tokens, top-8 of 128 experts, against
the counting sort's 40.6 (`qerl bench moe --route`; benchmarks/kernels.md).
"""

from __future__ import annotations

import torch

from .moe_gemv import Routing
from .w4_decode import next_pow2

MAX_PAIRS, MAX_EXPERTS = 1024, 256
NUM_WARPS = 4
# The GPU histogram counts every lane of a replicated layout: pad the keys to at least one per thread.
MIN_PAD = 32 * NUM_WARPS
# Debug aid for the CPU tests: run on CPU tensors in the Triton interpreter. Tests set it; nothing else should.
RUN_ON_CPU_INTERPRETER = False
_built = False  # _build() ran


def supports(top_k_index: torch.Tensor, num_experts: int) -> bool:
    """int32/int64 indices of 1..MAX_PAIRS pairs over 1..MAX_EXPERTS experts, on CUDA (or the interpreter)."""
    if top_k_index.dtype not in (torch.int32, torch.int64) or top_k_index.dim() == 0:
        return False
    if not 1 <= top_k_index.numel() <= MAX_PAIRS or not 1 <= num_experts <= MAX_EXPERTS:
        return False
    from .triton_backend import HAVE_TRITON

    return HAVE_TRITON and (top_k_index.is_cuda or (RUN_ON_CPU_INTERPRETER and top_k_index.device.type == "cpu"))


def route_fused(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """moe_gemv._route_counting(top_k_index, num_experts) in one launch; the caller checks supports()."""
    e, k, p = num_experts, top_k_index.shape[-1], top_k_index.numel()
    s, dev = min(e, p), top_k_index.device
    # int64 rows padded to 16 bytes, as _route_counting's: Triton specializes the GEMV's pointers on alignment.
    i64 = torch.empty(2, p + (p & 1), dtype=torch.int64, device=dev)
    i32 = torch.empty(4, (s + 4) & ~3, dtype=torch.int32, device=dev)
    expert = torch.empty(p, dtype=top_k_index.dtype, device=dev)
    valid = torch.empty(p, dtype=torch.bool, device=dev)
    order, token = i64[0, :p], i64[1, :p]
    slot_expert, slot_start, slot_count, ends = i32[0, :s], i32[1, :s], i32[2, :s], i32[3, :s + 1]
    _build()
    _route_kernel[(1,)](top_k_index.reshape(-1), order, token, expert, valid, slot_expert, slot_start, slot_count,
                        ends, p, k, e, s, P_PAD=max(MIN_PAD, next_pow2(p)), E_PAD=max(32, next_pow2(e + 2)),
                        num_warps=NUM_WARPS)
    return Routing(order, token, expert, valid, slot_expert, slot_start, slot_count, ends, p // k)


def _build():
    """Define the @triton.jit kernel, once, at first use: importing this module needs no Triton."""
    # Module globals, not closures: Triton's interpreter runs a kernel's source against its module's globals.
    global _built, triton, tl, _route_kernel
    if _built:
        return
    import triton
    import triton.language as tl

    @triton.jit
    def _route_kernel(idx_ptr, order_ptr, token_ptr, expert_ptr, valid_ptr, slot_expert_ptr, slot_start_ptr,
                      slot_count_ptr, ends_ptr, P, K, E, S, P_PAD: tl.constexpr, E_PAD: tl.constexpr):
        # Pairs: class in [0, E]; padding lanes get class E + 1 (sorted last, counted in a bin nobody reads,
        # so every histogram value is in range).
        i = tl.arange(0, P_PAD)
        raw = tl.load(idx_ptr + i, mask=i < P, other=0)
        cls = tl.minimum(tl.maximum(raw, 0), E).to(tl.int32)
        cls = tl.where(i < P, cls, E + 1)
        # Sorted by (class, index): the keys are unique, so an unstable sort is stable here.
        key = tl.sort(cls * P_PAD + i)
        klass = key // P_PAD
        pair = (key - klass * P_PAD).to(tl.int64)
        m = i < P
        tl.store(order_ptr + i, pair, mask=m)
        tl.store(token_ptr + i, pair // K, mask=m)
        tl.store(expert_ptr + i, tl.minimum(klass, E - 1).to(expert_ptr.dtype.element_ty), mask=m)
        tl.store(valid_ptr + i, klass < E, mask=m)
        # Experts: count, start (pairs of smaller class), and slot rank: hit ones first, each group ascending.
        ex = tl.arange(0, E_PAD)
        real = ex < E
        count = tl.where(real, tl.histogram(cls, E_PAD), 0)
        incl = tl.cumsum(count, 0)
        hit = (count > 0).to(tl.int32)
        hits_before = tl.cumsum(hit, 0) - hit
        n_hit = tl.sum(hit, 0)
        rank = tl.where(hit != 0, hits_before, n_hit + ex - hits_before)
        # ends = cumsum of the slots' counts: a hit expert's inclusive end (the unhit ones before it add 0);
        # past the hit slots, every valid pair.
        end = tl.where(hit != 0, incl, tl.sum(count, 0))
        m = real & (rank < S)
        tl.store(slot_expert_ptr + rank, ex, mask=m)
        tl.store(slot_start_ptr + rank, incl - count, mask=m)
        tl.store(slot_count_ptr + rank, count, mask=m)
        tl.store(ends_ptr + rank, end, mask=m)
        tl.store(ends_ptr + S, P)

    _built = True


__all__ = ["route_fused", "supports", "MAX_PAIRS", "MAX_EXPERTS"]

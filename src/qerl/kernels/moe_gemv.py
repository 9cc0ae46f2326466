"""A grouped 4-bit GEMV for MoE decode: y = x_t·W_eᵀ for every (token t, chosen expert e), one launch
per projection, reading only the chosen experts' packed bytes.

What it does. The token-expert pairs of a step (top_k_index [T, k]) are sorted by expert (`route`: one
Triton launch by default, kernels/moe_route.py; no host sync). The grid is (slot, N block): a slot is one hit expert, and each program
streams its BLOCK_N rows of that expert's NVFP4 (or MXFP4) codes and block scales once, decoding them
in registers (w4_decode, as the dense W4 kernel in w4_matmul does), and multiplies them against all of
that expert's tokens at once (at most BLOCK_M = 64 a chunk; decode has a handful), in fp32. NVFP4's
per-expert 1/global-scale multiplies the accumulator. The slots are padded to min(E, T·k), the most
experts a step can hit, so the grid is known without reading the routing on the host; a padding slot
has no tokens and its programs do nothing. QuantExperts keeps the rest in torch (the LoRA shrink and
expand, biases, the gating, the combine with routing weights).

Why. QuantExperts' loop (transformers' own) dequantizes each hit expert to bf16 and then multiplies:
the 4-bit bytes are read, 2 bytes a weight written, and read again by the matmul, 3.6 + 3.6 + 1 =
~8.1x the bytes of the 4-bit expert (more in practice: the torch dequantize makes fp32 temporaries),
and one host sync per layer to list the hit experts. Decode is bandwidth-bound, so the bytes are the time.

Roofline for one decode step of Qwen3-30B-A3B (48 MoE layers, 128 experts, top-8, hidden 2048, expert
intermediate 768), NVFP4 experts (0.5 byte a weight + 1/16 byte of FP8 scale):
  one expert: gate_up [1536, 2048] 1.77 MB + down [2048, 768] 0.88 MB = 2.65 MB (bf16: 9.44 MB).
  batch 1: 8 experts x 48 layers = 384 expert reads = 1.02 GB -> 0.21 ms at 4.8 TB/s (H200).
           Dequantize-per-hit moves >= 384 x (2.65 + 2 x 9.44) MB = 8.3 GB -> >= 1.7 ms.
  batch 64: 512 pairs a layer; uniform routing hits 128·(1 - (120/128)^64) = 125.9 experts a layer
           (nearly all), 125.9 x 2.65 MB x 48 = 16.0 GB -> 3.3 ms, each expert read once for its ~4
           tokens. Per hit it would be >= 130 GB -> >= 27 ms. FLOPs: 512 x 2 x 4.72 M x 48 = 0.23 TFLOP,
           ~0.25 ms of the H200's bf16 tensor cores: still bandwidth-bound.
Activations (x, y: at most 64 x 2048 x 2 bytes a projection) are under 1 % of these bytes.

Status: on by default (KernelSettings.moe_gemv; kernels/experts_path.py picks it for no-grad calls of
at most MAX_TOKENS tokens on CUDA). Tested on the CPU in Triton's interpreter (tests/test_moe_gemv.py:
float64 reference, NVFP4 and MXFP4, and QuantExperts with the switch on equal to off) and on the H100
(its GPU tests against a float64 reference; one Qwen3-30B-A3B expert layer 0.86 / 0.69 / 0.98 ms at
1 / 8 / 64 tokens against the per-expert loop's 6.2 / 34.4 / 102.4). No split-K: at batch 1, 8 experts
x 24-32 N blocks give 192-256 programs for the 132 SMs of an H100/H200.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import w4_decode
from .m_thresholds import MOE_GEMV_MAX_TOKENS
from .w4_decode import GROUP, cdiv, next_pow2
from .w4_decode_consts import ASM_SHIFT
from .weight_state import WeightState

FMT_IDS = {"nvfp4": 0, "mxfp4": 1}
MAX_TOKENS = MOE_GEMV_MAX_TOKENS  # decode batches (kernels/m_thresholds.py)
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 128  # the largest token tile; the weight tile's rows and K
# Debug aid for the CPU tests: run on CPU tensors in the Triton interpreter. Tests set it; nothing else should.
RUN_ON_CPU_INTERPRETER = False
_STATE: WeightState[tuple] = WeightState()
_built = False  # _build_kernel() ran


def supports(x: torch.Tensor, fmt) -> bool:
    """Standard-layout NVFP4/MXFP4 experts, a decode-sized batch, on CUDA (or the interpreter in tests)."""
    if fmt.layout != "standard" or fmt.name not in FMT_IDS:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    if x.dim() != 2 or not 0 < x.shape[0] <= MAX_TOKENS:
        return False
    return x.is_cuda or (RUN_ON_CPU_INTERPRETER and x.device.type == "cpu")


@dataclass
class Routing:
    """Token-expert pairs sorted by expert (P = T·k pairs, S = min(E, P) slots), all on the device.

    A pair whose index is E (transformers' "no expert" class, which its loop skips) sorts last, is in no
    slot and has valid = False: its rows of a projection's output are never written."""

    order: torch.Tensor        # [P] the pair's flat index into top_k_index
    token: torch.Tensor        # [P] its token
    expert: torch.Tensor       # [P] its expert (clamped to E-1 for invalid pairs, so gathers stay in range)
    valid: torch.Tensor        # [P] bool
    slot_expert: torch.Tensor  # [S] int32: hit experts ascending, then unhit ones (count 0)
    slot_start: torch.Tensor   # [S] int32: first sorted pair of the slot
    slot_count: torch.Tensor   # [S] int32
    ends: torch.Tensor         # [S + 1] int32: cumulative slot counts, then P (grouped_mm's offsets)
    tokens: int                # T: no expert has more pairs (top-k picks an expert at most once a token)


@dataclass(frozen=True)
class Tiles:
    """One launch's tile sizes. block_m is the token tile: an expert's pairs run in chunks of it, and each
    chunk re-reads that expert's weights, so it should cover the most pairs an expert gets."""

    block_m: int = 16
    block_n: int = 64  # 64 rows, 4 warps, x read contiguous (x_mode 1): the H100 sweep at daff6d8 (`qerl bench moe
    block_k: int = BLOCK_K  # --sweep`, benchmarks/kernels.md) at 64 tokens: Qwen3-30B-A3B 307.0 µs (best 305.0;
    num_warps: int = 4  # the f049130 default, 128 rows, 8 warps, stride-2 x: 316.8), gpt-oss-20b 368.9 (the best;
    num_stages: int = 3  # old 468.1); Qwen3 at 8 tokens 144.9 (best 136.1, old 143.8)
    x_mode: int = 1  # GPU decode only: 0 two dots over even / odd k with x read at stride 2; 1 x read contiguous
    # and split in registers; 2 x read contiguous and the decoded halves joined back into k order, one dot
    maxnreg: int = 0  # GPU only: a register cap a thread (0: the compiler's choice). ncu found the kernel at 25 %
    # occupancy, limited by its 107 registers (benchmarks/kernels.md): a lever for the sweep, not yet measured


def default_tiles(pairs: int, num_experts: int) -> Tiles:
    """The token tile from the mean pairs a hit expert gets (twice it, for the unlucky experts), not from T.

    Why: at 64 tokens, top-8 of 128 experts, an expert has ~4 pairs, and a 64-token tile (next_pow2(T), as
    before) made every program load 16x the activations it used: 16 KB of x per 4 KB of weights each K step.
    An expert past the tile loops over chunks (correct; it re-reads its weights for the next chunk)."""
    mean = -(-pairs // max(1, min(num_experts, pairs)))
    return Tiles(block_m=min(BLOCK_M, max(16, next_pow2(2 * mean))))  # 16: tl.dot's least N


def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """Sort a step's pairs by expert with no host sync (decode stays asynchronous): two argsorts, the counting sort
    (KernelSettings.moe_route_counting) or one Triton launch (moe_route_fused); the same Routing bit for bit."""
    from . import moe_route, settings

    ks = settings.current()
    if ks.moe_route_fused and moe_route.supports(top_k_index, num_experts):
        return moe_route.route_fused(top_k_index, num_experts)
    if ks.moe_route_counting:
        return _route_counting(top_k_index, num_experts)
    return _route_sorted(top_k_index, num_experts)


def _route_sorted(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1).clamp(0, num_experts)
    p = flat.numel()
    order = torch.argsort(flat, stable=True)
    # Not bincount: on CUDA it reads the largest index back to the host to size its output.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts = counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))[:num_experts]
    starts = torch.cumsum(counts, 0) - counts
    slots = min(num_experts, p)
    # Stable sort on "unhit": the hit experts first, in ascending order, so the slots' rows are consecutive.
    slot_expert = torch.argsort((counts == 0).to(torch.uint8), stable=True)[:slots]
    slot_count = counts[slot_expert].to(torch.int32)
    expert = flat[order]
    ends = torch.cat([torch.cumsum(slot_count, 0, dtype=torch.int32), slot_count.new_full((1,), p)])
    return Routing(order, order // k, expert.clamp(max=num_experts - 1), expert < num_experts,
                   slot_expert.to(torch.int32), starts[slot_expert].to(torch.int32), slot_count, ends, p // k)


def _route_counting(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """route() as a counting sort: no argsort, no host sync and no size read from the data. T >= 1.
    Used where the one-launch kernel (kernels/moe_route.py, the default) is off or out of its bounds
    (KernelSettings.moe_route_counting; its GPU graph tests passed on an H100 at 700f1db).

    A counting sort. Why: the H100 profile of a Qwen3-30B-A3B decode step at 64 sequences (f049130,
    benchmarks/profiles/moe_decode_qwen3_b64_f049130.txt) put the argsort version at 36 launches and 81 us
    a MoE layer (3.9 ms of a 31.7 ms step): a radix sort of the 512 int64 keys took 27 us, a bitonic sort
    of the unhit flags 4.5 us, the rest ~2 us launches. Here one cumsum over a one-hot of the pairs'
    classes (expert, or E for "no expert") gives each pair's sorted position and each class's start, one
    scatter permutes, and the slots come from a second counting sort (hit, then unhit) sharing that cumsum:
    18 kernel-launching aten ops against the argsort version's 22, whose two sorts count one op each
    (tests/test_moe_route.py counts them at T=64, k=8, E=128). No bincount: on
    CUDA it reads the largest index back to the host to size its output."""
    e, k, p = num_experts, top_k_index.shape[-1], top_k_index.numel()
    c, s, dev, i64 = e + 1, min(num_experts, p), top_k_index.device, torch.int64
    # What the scatter moves, a column a pair (column 0 spare): the pair's index, its token, its class.
    # Row 0 runs from -1 so that it also serves as the one-hot's class ids (-1 first) and searchsorted's values.
    src = torch.empty(3, max(c + 1, p + s + 1), dtype=i64, device=dev)
    ar = torch.arange(-1, src.shape[1] - 1, out=src[0])
    torch.floor_divide(ar, k, out=src[1])
    flat = top_k_index.reshape(-1)
    flat = torch.clamp(flat if flat.dtype == i64 else flat.to(i64), 0, e, out=src[2, 1:p + 1])
    # One buffer, one cumsum: the one-hot [class -1..E, pair] (class -1 matches no pair: a zero row, so
    # that "the cumsum one element before" needs no pad), then the experts' one-hot [hit; unhit], whose
    # cumsum, offset by the P pairs, ranks the hit experts first. int64 throughout: no casts inside the
    # cumsum, gather, scatter or searchsorted.
    buf = torch.empty((c + 1) * p + 2 * e, dtype=i64, device=dev)
    hot = buf[:(c + 1) * p].view(c + 1, p)
    torch.eq(ar[:c + 1, None], flat, out=hot)
    two = buf[(c + 1) * p:].view(2, e)
    torch.amax(hot[1:c], 1, out=two[0])
    torch.eq(two[0], 0, out=two[1])
    cs = buf.cumsum(0)
    # The cumsum one before (class x, pair i) counts the pairs sorted before it: pair i's position where x
    # is its class; at i = 0, class x's start (and the next class's start is x's end).
    pos = cs.as_strided((c, p), (p, 1), p - 1).gather(0, flat.view(1, p))
    bounds = cs.as_strided((2, c), (p, p), p - 1)  # [start; end] of each class
    # Rows of even length: each output row starts 16-byte aligned (Triton specializes pointers on it).
    out = torch.empty(3, p + (p & 1), dtype=i64, device=dev)[:, :p]
    order, token, klass = out.scatter_(1, pos.expand(3, p), src[:, 1:p + 1])
    # Slot j's expert: the column (mod E) of the (j+1)-th one of [hit; unhit], where its cumsum first
    # passes P + j.
    slot_expert = torch.searchsorted(cs[(c + 1) * p:], ar[p + 1:p + s + 1], right=True, out_int32=True)
    slot_expert.remainder_(e)
    start_end = bounds.index_select(1, slot_expert).to(torch.int32)
    slot_count = start_end[1] - start_end[0]
    ends = torch.full((s + 1,), p, dtype=torch.int32, device=dev)
    torch.cumsum(slot_count, 0, dtype=torch.int32, out=ends[:s])
    expert = klass.clamp(max=e - 1)
    expert = expert if top_k_index.dtype == i64 else expert.to(top_k_index.dtype)
    return Routing(order, token, expert, klass < e, slot_expert, start_end[0], slot_count, ends, p // k)


def prepare(fmt, tensors: dict[str, torch.Tensor]) -> tuple:
    """(fmt_id, packed [E, N, K/2], raw scales [E, N, K/G], factor [E] or None, asm factor [E], MXFP4 shift),
    once per stacked weight: the epilogue factor is NVFP4's 1/global-scale per expert, times 2^ASM_SHIFT
    (NVFP4) or 2^shift (MXFP4) for the PTX decode (w4_decode), as triton_backend prepares dense weights."""
    return _STATE.get(tensors["weight_packed"], lambda: _build(fmt, tensors))


def _build(fmt, tensors):
    fid = FMT_IDS[fmt.name]
    packed, scale = tensors["weight_packed"], tensors["weight_scale"].view(torch.uint8)
    if fid == 0:
        inv = 1.0 / tensors["weight_global_scale"].to(torch.float32).reshape(-1)
        return fid, packed, scale, inv, inv * 2.0**ASM_SHIFT, 0
    shift = max(0, int(scale.max()) - 128)  # one sync per weight, as the dense MXFP4 path
    return fid, packed, scale, None, torch.full((packed.shape[0],), 2.0**shift, device=packed.device), shift


def _build_kernel():
    """Define the @triton.jit kernel, once, at first use: importing this module needs no Triton
    (the CPU install has none)."""
    # Module globals, not closures: Triton's interpreter (the CPU tests) runs a kernel's source against
    # its module's globals alone.
    global _built, triton, tl, decode_tile, decode_even_odd_asm, _grouped_gemv_kernel
    if _built:
        return
    import triton
    import triton.language as tl
    w4_decode._build()
    decode_tile, decode_even_odd_asm = w4_decode.decode_tile, w4_decode.decode_even_odd_asm

    @triton.jit
    def _grouped_gemv_kernel(x_ptr, rows_ptr, q_ptr, s_ptr, fac_ptr, y_ptr, slot_expert_ptr, slot_start_ptr,
                             slot_count_ptr, N, K, stride_xm, stride_ym, MX_SHIFT,
                             FMT: tl.constexpr, BF16: tl.constexpr, ASM: tl.constexpr, HAS_FAC: tl.constexpr,
                             GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             X_MODE: tl.constexpr):
        G: tl.constexpr = 16 if FMT == 0 else 32
        slot = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        e = tl.load(slot_expert_ptr + slot).to(tl.int64)
        start = tl.load(slot_start_ptr + slot)
        count = tl.load(slot_count_ptr + slot)
        rows_n = offs_n.to(tl.int64)
        q_rows = q_ptr + e * N * (K // 2) + rows_n[:, None] * (K // 2)
        s_rows = s_ptr + e * N * (K // G) + rows_n[:, None] * (K // G)
        offs_kh = tl.arange(0, BLOCK_K // 2)
        offs_kg = tl.arange(0, BLOCK_K // G)
        offs_k = tl.arange(0, BLOCK_K)
        for m0 in range(0, count, BLOCK_M):  # one pass in decode (count <= T <= BLOCK_M); none for a padding slot
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_mask = offs_m < count
            pair = start + offs_m
            if GATHER:  # x row of each pair (gate_up reads the token's hidden state)
                xr = tl.load(rows_ptr + pair, mask=m_mask, other=0).to(tl.int64)
            else:  # x already in pair order (down reads the gated gate_up output)
                xr = pair.to(tl.int64)
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kh = k0 // 2 + offs_kh
                p = tl.load(q_rows + kh[None, :], mask=n_mask[:, None] & (kh[None, :] < K // 2), other=0,
                            eviction_policy="evict_first")
                kg = k0 // G + offs_kg
                s = tl.load(s_rows + kg[None, :], mask=n_mask[:, None] & (kg[None, :] < K // G), other=0,
                            eviction_policy="evict_first")
                if ASM:  # GPU bf16: PTX decode into even-k and odd-k halves
                    w_even, w_odd = decode_even_odd_asm(p, s, FMT, MX_SHIFT, BLOCK_N, BLOCK_K)
                    if X_MODE == 0:  # two dots, x gathered at stride 2 (as w4_matmul's fused kernel)
                        ke = k0 + 2 * offs_kh
                        xmask = m_mask[:, None] & (ke[None, :] < K)
                        xe = tl.load(x_ptr + xr[:, None] * stride_xm + ke[None, :], mask=xmask, other=0)
                        xo = tl.load(x_ptr + xr[:, None] * stride_xm + ke[None, :] + 1, mask=xmask, other=0)
                        acc += tl.dot(w_even, tl.trans(xe))
                        acc += tl.dot(w_odd, tl.trans(xo))
                    else:  # x rows loaded contiguous (vector loads)
                        kk = k0 + offs_k
                        x = tl.load(x_ptr + xr[:, None] * stride_xm + kk[None, :],
                                    mask=m_mask[:, None] & (kk[None, :] < K), other=0)
                        if X_MODE == 1:  # split into even and odd k in registers, two dots
                            xe, xo = tl.split(x.reshape(BLOCK_M, BLOCK_K // 2, 2))
                            acc += tl.dot(w_even, tl.trans(xe))
                            acc += tl.dot(w_odd, tl.trans(xo))
                        else:  # the weight halves joined back into k order, one dot
                            w = tl.join(w_even, w_odd).reshape(BLOCK_N, BLOCK_K)
                            acc += tl.dot(w, tl.trans(x))
                else:
                    w = decode_tile(p, s, s_ptr, FMT, BF16, BLOCK_N, BLOCK_K)  # (lut unused for FP4)
                    kk = k0 + offs_k
                    x = tl.load(x_ptr + xr[:, None] * stride_xm + kk[None, :], mask=m_mask[:, None] & (kk[None, :] < K),
                                other=0)
                    if BF16:
                        acc += tl.dot(w, tl.trans(x.to(w.dtype)))
                    else:  # fp32 weights (fp16/fp32 activations): full fp32 products, as cuBLAS's default (no TF32)
                        acc += tl.dot(w, tl.trans(x.to(w.dtype)), input_precision="ieee")
            if HAS_FAC:
                acc = acc * tl.load(fac_ptr + e)
            ptrs = y_ptr + pair.to(tl.int64)[None, :] * stride_ym + rows_n[:, None]
            tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])

    _built = True


def _use_asm(x: torch.Tensor) -> bool:
    from . import settings

    return settings.current().ptx_decode and x.is_cuda and x.dtype == torch.bfloat16


def grouped_gemv(x: torch.Tensor, rows: torch.Tensor | None, routing: Routing, fmt, tensors: dict[str, torch.Tensor],
                 shape: tuple[int, int], out: torch.Tensor | None = None, tiles: Tiles | None = None) -> torch.Tensor:
    """y [P, N] in x's dtype, row p = x[rows[p]]·W_{e(p)}ᵀ for each sorted pair p in a slot (other rows
    untouched). x [M, K] with contiguous rows; rows [P] (None: x is already [P, K] in pair order);
    tensors: the format's tensors stacked over experts; shape: one expert's (N, K); tiles: the launch's
    tile sizes (None: default_tiles; benchmarks sweep others)."""
    n, k = shape
    fid, packed, scale, fac, fac_asm, mx_shift = prepare(fmt, tensors)
    g = GROUP[fid]
    if k % g or packed.shape[1:] != (n, k // 2) or scale.shape[1:] != (n, k // g):
        raise ValueError(f"{fmt.name} experts of shape {shape}: expected packed [E, {n}, {k // 2}] and scales "
                         f"[E, {n}, {k // g}] with K a multiple of {g} "
                         f"(got {tuple(packed.shape)}, {tuple(scale.shape)})")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the experts take {k}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    asm = _use_asm(x)
    factor = fac_asm if asm else fac
    pairs = routing.order.numel()
    y = out if out is not None else torch.empty(pairs, n, device=x.device, dtype=x.dtype)
    tiles = tiles or default_tiles(pairs, int(packed.shape[0]))
    grid = (routing.slot_expert.numel(), cdiv(n, tiles.block_n))
    block_k = min(tiles.block_k, max(g, next_pow2(k)))
    _build_kernel()
    cap = {"maxnreg": tiles.maxnreg} if tiles.maxnreg and x.is_cuda else {}
    _grouped_gemv_kernel[grid](
        x, rows if rows is not None else routing.order, packed, scale, factor if factor is not None else x, y,
        routing.slot_expert, routing.slot_start, routing.slot_count, n, k, x.stride(0), y.stride(0), mx_shift,
        FMT=fid, BF16=x.dtype == torch.bfloat16, ASM=asm, HAS_FAC=factor is not None, GATHER=rows is not None,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k, X_MODE=tiles.x_mode, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **cap)
    return y


def roofline_bytes(num_hit: int, fmt_id: int, shapes: list[tuple[int, int]]) -> int:
    """Fewest weight bytes one layer's decode moves: codes + block scales of each hit expert, all projections."""
    return num_hit * sum(n * k // 2 + n * k // GROUP[fmt_id] for n, k in shapes)


__all__ = ["route", "grouped_gemv", "supports", "prepare", "Routing", "Tiles", "default_tiles", "roofline_bytes",
           "MAX_TOKENS"]

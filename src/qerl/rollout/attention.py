"""Decode attention: one query token per slot against its cached keys, split over the keys.

Why our own kernel: the image has no flash-attn package, and SDPA's decode path either expands
K/V to every query head (a copy of the whole cache per layer) or cannot take a per-slot length.
This is the FlashDecoding shape: the grid is (slot, KV head, key split); each program streams
its share of one head's K/V once, for all the query heads that share it (GQA: the r = H / Hkv
queries ride the MMA's row dimension, padded to 16), keeps an online softmax, and writes an
unnormalized partial; a second small kernel merges the splits. Enough splits are launched to
fill the GPU at batch 1; at batch 64 the slots alone do. The cache may be FP8 (E4M3) with a
scale per (slot, KV head): its K/V are converted in registers, so it reads half the bytes.

Roofline: bytes = 2 · Hkv · keys · d · (2 or 1) per slot and layer, FLOPs ≈ 4 · H · keys · d
per slot and layer: ~1 FLOP/byte at r = 7, far below the ridge, so the target is copy bandwidth.
"""

from __future__ import annotations

import math

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# (keys per inner tile, pipeline stages) for bf16 / FP8 caches
TILES = {False: (64, 2), True: (128, 3)}  # H200 sweep (scripts/profile_decode.py, 06ea5f6)
MIN_KEYS_PER_SPLIT = 128  # a split smaller than this costs more in its merge than it saves
# Debug aid for CPU tests: run the Triton kernels on CPU tensors in the interpreter.
RUN_ON_CPU_INTERPRETER = False

_kernels = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, len_ptr, acc_ptr, ml_ptr,
                     sq_s, sq_h, sk_s, sk_h, sk_l, ss_s, chunk, scaling, SPLITS,
                     R: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                     FP8: tl.constexpr):
        s = tl.program_id(0)
        g = tl.program_id(1)
        sp = tl.program_id(2)
        n_kv = tl.num_programs(1)
        length = tl.load(len_ptr + s).to(tl.int32)
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, length)
        rows = tl.arange(0, BLOCK_R)
        d = tl.arange(0, D)
        rmask = rows < R
        q = tl.load(q_ptr + s * sq_s + (g * R + rows)[:, None] * sq_h + d[None, :], mask=rmask[:, None], other=0.0)
        kb = k_ptr + s.to(tl.int64) * sk_s + g * sk_h
        vb = v_ptr + s.to(tl.int64) * sk_s + g * sk_h
        if FP8:
            # E4M3 -> fp16 is one conversion per pair; the per-(slot, head) scales are constant over
            # the program, so K's folds into the score scale and V's into the output
            q = q.to(tl.float16)
            qk_scale = scaling * tl.load(ks_ptr + s * ss_s + g)
            v_out = tl.load(vs_ptr + s * ss_s + g)
        else:
            qk_scale = scaling
            v_out = 1.0
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            nm = n < hi
            k = tl.load(kb + n[:, None] * sk_l + d[None, :], mask=nm[:, None], other=0.0)
            v = tl.load(vb + n[:, None] * sk_l + d[None, :], mask=nm[:, None], other=0.0)
            if FP8:
                k = k.to(tl.float16)
                v = v.to(tl.float16)
            sc = tl.dot(q, tl.trans(k)).to(tl.float32) * qk_scale
            sc = tl.where(nm[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            p = tl.exp(sc - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
        acc = acc * v_out
        h = g * R + rows
        base = (s * (n_kv * R) + h) * SPLITS + sp
        tl.store(acc_ptr + base[:, None] * D + d[None, :], acc, mask=rmask[:, None])
        tl.store(ml_ptr + base * 2, m_i, mask=rmask)
        tl.store(ml_ptr + base * 2 + 1, l_i, mask=rmask)

    @triton.jit
    def merge_kernel(acc_ptr, ml_ptr, o_ptr, SPLITS, D: tl.constexpr, BLOCK_S: tl.constexpr):
        sh = tl.program_id(0)  # slot * H + head
        sp = tl.arange(0, BLOCK_S)
        smask = sp < SPLITS
        d = tl.arange(0, D)
        m = tl.load(ml_ptr + (sh * SPLITS + sp) * 2, mask=smask, other=float("-inf"))
        l_ = tl.load(ml_ptr + (sh * SPLITS + sp) * 2 + 1, mask=smask, other=0.0)
        big = tl.max(m, 0)
        w = tl.where(m > float("-inf"), tl.exp(m - big), 0.0)
        a = tl.load(acc_ptr + (sh * SPLITS + sp)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
        out = tl.sum(a * w[:, None], 0) / tl.sum(l_ * w, 0)
        tl.store(o_ptr + sh * D + d, out.to(o_ptr.dtype.element_ty))

    return split_kernel, merge_kernel


def _sm_count(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def n_splits(n_slots: int, n_kv: int, n_keys: int, sms: int) -> int:
    """Key splits per (slot, KV head): enough programs for two waves of the GPU, none shorter than
    MIN_KEYS_PER_SPLIT keys. A function of the graph's static shape only, so a graph can bake it in."""
    want = -(-2 * sms // max(1, n_slots * n_kv))
    most = max(1, n_keys // MIN_KEYS_PER_SPLIT)
    return int(max(1, min(want, most)))


def supports(q: torch.Tensor, head_dim: int) -> bool:
    from ..kernels.triton_backend import triton_runs  # says once where CUDA lacks Triton (then SDPA's path runs)

    if head_dim & (head_dim - 1) or head_dim < 16 or not triton_runs(q.device):
        return False
    return q.is_cuda or (RUN_ON_CPU_INTERPRETER and q.device.type == "cpu")


def decode_attention(q, k_cache, v_cache, lengths, n_keys: int, scaling: float, k_scale=None, v_scale=None,
                     block_n: int | None = None, stages: int | None = None):
    """q [S, H, d] (the S slots' query tokens), caches [>=S, Hkv, L, d] (bf16/fp16/fp32, or FP8
    with scales [>=S, Hkv] fp32), lengths [S]: slot i attends to keys [0, lengths[i]) (at most
    n_keys, the static bound). Returns [S, H, d] in q's dtype."""
    global _kernels
    if _kernels is None:
        _kernels = _build()
    split_kernel, merge_kernel = _kernels
    s, h, d = q.shape
    n_kv = k_cache.shape[1]
    r = h // n_kv
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    bn, st = TILES[fp8] if block_n is None else (block_n, stages or 2)
    splits = n_splits(s, n_kv, n_keys, _sm_count(q.device))
    chunk = -(-n_keys // splits)
    chunk = -(-chunk // bn) * bn
    q = q.contiguous()
    acc = torch.empty(s * h * splits * d, dtype=torch.float32, device=q.device)
    ml = torch.empty(s * h * splits * 2, dtype=torch.float32, device=q.device)
    out = torch.empty(s, h, d, dtype=q.dtype, device=q.device)
    ks = k_scale if fp8 else lengths  # unused pointers when not FP8
    vs = v_scale if fp8 else lengths
    split_kernel[(s, n_kv, splits)](
        q, k_cache, v_cache, ks, vs, lengths, acc, ml,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        ks.stride(0) if fp8 else 0, chunk, scaling, splits,
        R=r, BLOCK_R=max(16, triton_next_pow2(r)), D=d, BLOCK_N=bn, FP8=fp8,
        num_warps=4, num_stages=st)
    merge_kernel[(s * h,)](acc, ml, out, splits, D=d, BLOCK_S=max(2, triton_next_pow2(splits)), num_warps=4)
    return out


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def reference(q, k_cache, v_cache, lengths, n_keys: int, scaling: float, k_scale=None, v_scale=None):
    """The same attention in torch (the CPU path and the kernel's test reference): queries grouped
    per KV head, so the cache is read in place; FP8 caches are dequantized first."""
    s, h, d = q.shape
    n_kv = k_cache.shape[1]
    k, v = k_cache[:s, :, :n_keys], v_cache[:s, :, :n_keys]
    if k.dtype == torch.float8_e4m3fn:
        k = (k.float() * k_scale[:s, :, None, None]).to(q.dtype)
        v = (v.float() * v_scale[:s, :, None, None]).to(q.dtype)
    mask = torch.arange(n_keys, device=q.device)[None, :] < lengths[:, None]  # [S, L]
    qg = q.view(s, n_kv, h // n_kv, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scaling  # [S, Hkv, r, L]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, -1).to(v.dtype)
    return torch.matmul(probs, v).reshape(s, h, d)

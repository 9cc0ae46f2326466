"""Rotary embedding and the KV-cache write of a decode step, in one kernel.

Unfused, this is ~10 kernels a layer (views, two rotate-halfs, the products, two scatters into
the cache); here one program per (slot, head) reads its row of the q|k|v projection once,
rotates q or k in fp32 (rounded once, where HF rounds each product: within one bf16 ulp) and
writes q to a fresh [S, H, d] tensor and k, v into the slot's cache row at its position
(quantized to FP8 with the slot's per-head scale when the cache is FP8).
"""

from __future__ import annotations

import torch

from .attention import FP8_MAX

_kernel = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, qo_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                       sq, sk, sv, s_tab, sc_s, sc_h, sc_l, ss_s,
                       H: tl.constexpr, HALF: tl.constexpr, FP8: tl.constexpr, FP8_LIM: tl.constexpr):
        s = tl.program_id(0)
        j = tl.program_id(1)  # 0..H-1: a query head; H..H+Hkv-1: a KV head
        pos = tl.load(pos_ptr + s)
        i = tl.arange(0, HALF)
        c1 = tl.load(cos_ptr + pos * s_tab + i).to(tl.float32)
        c2 = tl.load(cos_ptr + pos * s_tab + HALF + i).to(tl.float32)
        s1 = tl.load(sin_ptr + pos * s_tab + i).to(tl.float32)
        s2 = tl.load(sin_ptr + pos * s_tab + HALF + i).to(tl.float32)
        if j < H:
            src = q_ptr + s * sq + j * (2 * HALF)
            x1 = tl.load(src + i).to(tl.float32)
            x2 = tl.load(src + HALF + i).to(tl.float32)
            dst = qo_ptr + (s * H + j) * (2 * HALF)
            tl.store(dst + i, (x1 * c1 - x2 * s1).to(qo_ptr.dtype.element_ty))
            tl.store(dst + HALF + i, (x2 * c2 + x1 * s2).to(qo_ptr.dtype.element_ty))
        else:
            g = j - H
            src = k_ptr + s * sk + g * (2 * HALF)
            x1 = tl.load(src + i).to(tl.float32)
            x2 = tl.load(src + HALF + i).to(tl.float32)
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
            vsrc = v_ptr + s * sv + g * (2 * HALF)
            v1 = tl.load(vsrc + i).to(tl.float32)
            v2 = tl.load(vsrc + HALF + i).to(tl.float32)
            off = s.to(tl.int64) * sc_s + g * sc_h + pos.to(tl.int64) * sc_l
            if FP8:
                ik = 1.0 / tl.load(ks_ptr + s * ss_s + g)
                iv = 1.0 / tl.load(vs_ptr + s * ss_s + g)
                y1 = tl.minimum(tl.maximum(y1 * ik, -FP8_LIM), FP8_LIM)
                y2 = tl.minimum(tl.maximum(y2 * ik, -FP8_LIM), FP8_LIM)
                v1 = tl.minimum(tl.maximum(v1 * iv, -FP8_LIM), FP8_LIM)
                v2 = tl.minimum(tl.maximum(v2 * iv, -FP8_LIM), FP8_LIM)
            ty = kc_ptr.dtype.element_ty
            tl.store(kc_ptr + off + i, y1.to(ty))
            tl.store(kc_ptr + off + HALF + i, y2.to(ty))
            tl.store(vc_ptr + off + i, v1.to(ty))
            tl.store(vc_ptr + off + HALF + i, v2.to(ty))

    return rope_kv_kernel


def supports(q: torch.Tensor, head_dim: int) -> bool:
    from . import attention

    half = head_dim // 2
    return half >= 16 and not half & (half - 1) and attention.supports(q, head_dim)  # (which asks for Triton)


def rope_kv_write(q, k, v, cos, sin, pos, k_cache, v_cache, k_scale=None, v_scale=None):
    """q [S, H·d], k, v [S, Hkv·d] (rows may be strided views of one projection), cos/sin [L, d],
    pos [S]. Writes rotated k and v at cache[slot, :, pos[slot]]; returns rotated q [S, H, d]."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    s = q.shape[0]
    n_kv, d = k_cache.shape[1], k_cache.shape[3]
    h = q.shape[-1] // d
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("rope_kv_write: projection rows must be contiguous")
    qo = torch.empty(s, h, d, dtype=q.dtype, device=q.device)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    ks = k_scale if fp8 else cos
    vs = v_scale if fp8 else cos
    _kernel[(s, h + n_kv)](
        q, k, v, cos, sin, pos, qo, k_cache, v_cache, ks, vs,
        q.stride(0), k.stride(0), v.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), ks.stride(0) if fp8 else 0,
        H=h, HALF=d // 2, FP8=fp8, FP8_LIM=FP8_MAX, num_warps=1)
    return qo


def reference(q, k, v, cos, sin, pos, k_cache, v_cache, k_scale=None, v_scale=None):
    """The same in torch (HF's rotate-half form), writing through KVCache-style indexing."""
    s = q.shape[0]
    n_kv, d = k_cache.shape[1], k_cache.shape[3]
    q, k, v = q.reshape(s, -1, d), k.reshape(s, n_kv, d), v.reshape(s, n_kv, d)
    c, sn = cos[pos][:, None].float(), sin[pos][:, None].float()

    def rot(x):
        x = x.float()
        h = d // 2
        return x * c + torch.cat((-x[..., h:], x[..., :h]), -1) * sn

    qo, ko = rot(q).to(q.dtype), rot(k)
    vv = v.float()
    rows = torch.arange(s, device=q.device)
    if k_cache.dtype == torch.float8_e4m3fn:
        ko = (ko * (1.0 / k_scale[:s, :, None])).clamp(-FP8_MAX, FP8_MAX)  # as the kernel: times 1/scale
        vv = (vv * (1.0 / v_scale[:s, :, None])).clamp(-FP8_MAX, FP8_MAX)
    k_cache[rows, :, pos] = ko.to(k_cache.dtype)
    v_cache[rows, :, pos] = vv.to(v_cache.dtype)
    return qo

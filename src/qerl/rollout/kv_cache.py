"""A static, slot-indexed KV cache: one slot per sequence in flight, bf16 or FP8.

Static slots (not paged blocks) keep every decode step at fixed shapes, so a
CUDA graph per batch bucket can replay it. Slots are sized from a memory budget;
a finished sequence frees its slot at the next sync and a waiting one takes it.

FP8 (E4M3) halves the bytes decode attention reads at long context. Each (slot, KV head)
of a layer has its own scale, set when the prompt is written: the prompt's largest |k| (or
|v|) times HEADROOM maps to E4M3's largest value, so the completion's values, which come
from the same head, almost never saturate (they are clamped if they do). E4M3 keeps ~3
significant bits at any magnitude, so the headroom costs no precision, only range at the
bottom (2^-9 of the scale), which attention cannot see next to the large values.
"""

from __future__ import annotations

import torch

from .attention import FP8_MAX

KV_DTYPES = ("auto", "fp8")
HEADROOM = 4.0


def _storage_dtype(view, kv_dtype: str):
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype: {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    return torch.float8_e4m3fn if kv_dtype == "fp8" else view.dtype


def bytes_per_slot(view, max_len: int, kv_dtype: str = "auto") -> int:
    el = torch.empty((), dtype=_storage_dtype(view, kv_dtype)).element_size()
    scales = 2 * view.n_layers * view.n_kv * 4 if kv_dtype == "fp8" else 0
    return 2 * view.n_layers * view.n_kv * max_len * view.head_dim * el + scales


def slots_for_budget(view, max_len: int, budget_bytes: int, max_slots: int, kv_dtype: str = "auto") -> int:
    per = bytes_per_slot(view, max_len, kv_dtype)
    n = budget_bytes // per
    if n < 1:
        raise ValueError(f"KV cache budget of {budget_bytes / 2**20:.0f} MiB holds no sequence of {max_len} tokens "
                         f"({per / 2**20:.1f} MiB each); raise the budget or lower max length")
    return int(min(n, max_slots))


class KVCache:
    def __init__(self, view, n_slots: int, max_len: int, kv_dtype: str = "auto"):
        shape = (n_slots, view.n_kv, max_len, view.head_dim)
        dt = _storage_dtype(view, kv_dtype)
        self.fp8 = dt == torch.float8_e4m3fn
        kw = dict(device=view.device, dtype=dt)
        self.k = [torch.zeros(shape, **kw) for _ in range(view.n_layers)]
        self.v = [torch.zeros(shape, **kw) for _ in range(view.n_layers)]
        # per (slot, KV head) scales of an FP8 cache; None for bf16
        ones = lambda: torch.ones(n_slots, view.n_kv, device=view.device, dtype=torch.float32)  # noqa: E731
        self.k_scale = [ones() for _ in range(view.n_layers)] if self.fp8 else [None] * view.n_layers
        self.v_scale = [ones() for _ in range(view.n_layers)] if self.fp8 else [None] * view.n_layers
        self.n_slots, self.max_len = n_slots, max_len
        self._rows = torch.arange(n_slots, device=view.device)
        self._heads = torch.arange(view.n_kv, device=view.device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def layer(self, i: int):
        """(k, v, k_scale, v_scale) of layer i; the scales are None for a bf16 cache."""
        return self.k[i], self.v[i], self.k_scale[i], self.v_scale[i]

    def write_prefix(self, layer: int, slots: list[int], k, v, length: int) -> None:
        """k, v [Hkv, T, d] of one prompt into positions [0, length) of each slot."""
        k, v = k[:, :length], v[:, :length]
        if self.fp8:
            ks = _scale(k)
            vs = _scale(v)
            k, v = _quantize(k, ks), _quantize(v, vs)
        for s in slots:
            self.k[layer][s, :, :length] = k
            self.v[layer][s, :, :length] = v
            if self.fp8:
                self.k_scale[layer][s] = ks
                self.v_scale[layer][s] = vs

    def write_token(self, layer: int, n: int, pos, k, v):
        """k, v [n, Hkv, d] at position pos[i] of slot i (i < n); returns the layer's cache tensors."""
        if self.fp8:
            k, v = _quantize(k, self.k_scale[layer][:n]), _quantize(v, self.v_scale[layer][:n])
        # row (slot i, head h, position pos[i]) of the cache seen as [slots x heads x max_len, d]: one
        # index_copy_ of n x heads rows. cache[rows, :, pos] = k (advanced indexing over two split dims)
        # took 0.36-0.41 ms a layer on two cores, 8 % of a CPU rollout (issue 50); this is 5-20x less
        heads = self._heads
        idx = ((self._rows[:n, None] * heads.numel() + heads) * self.max_len + pos[:, None]).reshape(-1)
        d = k.shape[-1]
        bits = (lambda t: t.view(torch.uint8)) if self.fp8 else (lambda t: t)  # index_copy_ has no E4M3 kernel
        bits(self.k[layer]).view(-1, d).index_copy_(0, idx, bits(k.reshape(-1, d)))
        bits(self.v[layer]).view(-1, d).index_copy_(0, idx, bits(v.reshape(-1, d)))
        return self.k[layer], self.v[layer]

    def write_span(self, layer: int, slot: int, k, v, start: int) -> None:
        """k, v [Hkv, T, d] at positions [start, start + T) of one slot (FP8: with the slot's scales)."""
        t = k.shape[1]
        if self.fp8:
            k, v = _quantize(k, self.k_scale[layer][slot]), _quantize(v, self.v_scale[layer][slot])
        self.k[layer][slot, :, start:start + t] = k
        self.v[layer][slot, :, start:start + t] = v

    def read_span(self, layer: int, slot: int, end: int, dtype):
        """The slot's K/V at positions [0, end) as [Hkv, end, d] in dtype."""
        k, v = self.k[layer][slot, :, :end], self.v[layer][slot, :, :end]
        if self.fp8:
            return (dequantize(k[None], self.k_scale[layer][slot][None], dtype)[0],
                    dequantize(v[None], self.v_scale[layer][slot][None], dtype)[0])
        return k.to(dtype), v.to(dtype)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        for t in self.k + self.v:
            t[dst, :, :length] = t[src, :, :length]
        if self.fp8:
            for t in self.k_scale + self.v_scale:
                t[dst] = t[src]


def _scale(x):
    """Per-head scale [Hkv] of x [Hkv, T, d]: the head's largest magnitude, with headroom, onto FP8_MAX."""
    amax = x.detach().abs().float().amax(dim=(1, 2))
    return (amax * HEADROOM / FP8_MAX).clamp(min=1e-12)


def _quantize(x, scale):
    """x / scale (scale's dims lead x's), saturated, as E4M3 (times 1/scale, as the kernels)."""
    inv = 1.0 / scale.reshape(scale.shape + (1,) * (x.dim() - scale.dim()))
    return (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize(x, scale, dtype):
    """An FP8 cache slice x [S, Hkv, ...] back to dtype with scale [S, Hkv]."""
    return (x.float() * scale.reshape(scale.shape + (1,) * (x.dim() - 2))).to(dtype)

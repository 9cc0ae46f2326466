"""A static, slot-indexed KV cache: one slot per sequence in flight.

Static slots (not paged blocks) keep every decode step at fixed shapes, so a
CUDA graph per batch bucket can replay it. Slots are sized from a memory budget;
a finished sequence frees its slot at the next sync and a waiting one takes it.
"""

from __future__ import annotations

import torch


def bytes_per_slot(view, max_len: int, dtype=None) -> int:
    el = torch.empty((), dtype=dtype or view.dtype).element_size()
    return 2 * view.n_layers * view.n_kv * max_len * view.head_dim * el


def slots_for_budget(view, max_len: int, budget_bytes: int, max_slots: int) -> int:
    n = budget_bytes // bytes_per_slot(view, max_len)
    if n < 1:
        raise ValueError(f"KV cache budget of {budget_bytes / 2**20:.0f} MiB holds no sequence of {max_len} tokens "
                         f"({bytes_per_slot(view, max_len) / 2**20:.1f} MiB each); raise the budget or lower max length")
    return int(min(n, max_slots))


class KVCache:
    def __init__(self, view, n_slots: int, max_len: int):
        shape = (n_slots, view.n_kv, max_len, view.head_dim)
        kw = dict(device=view.device, dtype=view.dtype)
        self.k = [torch.zeros(shape, **kw) for _ in range(view.n_layers)]
        self.v = [torch.zeros(shape, **kw) for _ in range(view.n_layers)]
        self.n_slots, self.max_len = n_slots, max_len
        self._rows = torch.arange(n_slots, device=view.device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write_prefix(self, layer: int, slots: list[int], k, v, length: int) -> None:
        """k, v [Hkv, T, d] of one prompt into positions [0, length) of each slot."""
        for s in slots:
            self.k[layer][s, :, :length] = k[:, :length]
            self.v[layer][s, :, :length] = v[:, :length]

    def write_token(self, layer: int, n: int, pos, k, v):
        """k, v [n, Hkv, d] at position pos[i] of slot i (i < n); returns the layer's cache tensors."""
        rows = self._rows[:n]
        self.k[layer][rows, :, pos] = k
        self.v[layer][rows, :, pos] = v
        return self.k[layer], self.v[layer]

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        for t in self.k + self.v:
            t[dst, :, :length] = t[src, :, :length]

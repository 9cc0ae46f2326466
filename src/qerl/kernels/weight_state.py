"""Per-weight prepared state kept beside a frozen packed tensor, for as long as that tensor lives.

The backends derive small things from a weight once (1 / global scale on the device and as a host
float, an epilogue factor, NF4's dequantized absmax) so that no later call syncs with the host.
Keyed on the tensor's id, with a weak reference to check it is still the same tensor and to drop the
entry when it dies (tensors compare elementwise, so a WeakKeyDictionary cannot hold them).
"""

from __future__ import annotations

import weakref
from typing import Callable, Generic, TypeVar

import torch

T = TypeVar("T")


class WeightState(Generic[T]):
    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, T]] = {}

    def get(self, key: torch.Tensor, build: Callable[[], T]) -> T:
        """The state of `key`, built by `build()` on first use."""
        hit = self._entries.get(id(key))
        if hit is not None and hit[0]() is key:
            return hit[1]
        state = build()
        kid = id(key)
        self._entries[kid] = (weakref.ref(key, lambda _, kid=kid: self._entries.pop(kid, None)), state)
        return state

    def __len__(self) -> int:
        return len(self._entries)

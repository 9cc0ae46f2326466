"""The split-K arrival counters the kernels' last-arriving CTAs use, one buffer per (device, stream).

Each launch's last CTA of a tile resets its counter to zero, so a buffer stays valid across launches
and graph replays in stream order. Two streams running kernels at once (a rollout beside an update)
must not share one: a CTA of one launch would count arrivals of the other's.
"""

from __future__ import annotations

import torch

_BUFS: dict = {}


def split_counters(device: torch.device, size: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least `size` counters owned by the current stream of `device`."""
    stream = torch.cuda.current_stream(device)
    key = (device.index, stream.cuda_stream)
    buf = _BUFS.get(key)
    if buf is None or buf.numel() < size:
        buf = _BUFS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return buf

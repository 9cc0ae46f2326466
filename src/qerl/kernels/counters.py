"""The split-K arrival counters the kernels' last-arriving CTAs use, one buffer per (device, stream).

Each launch's last CTA of a tile resets its counter to zero, so a buffer stays valid across launches
and graph replays in stream order. Two streams running kernels at once (a rollout beside an update)
must not share one: a CTA of one launch would count arrivals of the other's. A captured graph keeps the
buffer of its capture stream, so each owner of graphs captures on a stream of its own (the engine's
ModelRunner does): torch's default capture stream is shared by every graph.
"""

from __future__ import annotations

import torch

SIZE = 1 << 16  # counters a buffer holds; fixed, so a buffer is never replaced under a captured graph
_BUFS: dict = {}


def split_counters(device: torch.device, need: int = SIZE) -> torch.Tensor:
    """The zeroed int32 buffer of SIZE counters owned by the current stream of `device` (kernels on one
    stream run in order, so the kernels may share it)."""
    if need > SIZE:
        raise ValueError(f"a launch needs {need} split-K counters; the buffers hold {SIZE}")
    stream = torch.cuda.current_stream(device)
    key = (device.index, stream.cuda_stream)
    buf = _BUFS.get(key)
    if buf is None:
        buf = _BUFS[key] = torch.zeros(SIZE, dtype=torch.int32, device=device)
    return buf

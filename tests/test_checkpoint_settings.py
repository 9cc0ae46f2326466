"""Gradient checkpointing's recompute runs under the kernel choices its forward ran under
(train/levers.checkpoint_kwargs). KernelSettings live in a ContextVar that autograd's CUDA thread does
not see; here the forward's scope is left before the backward, which shows the same loss on the CPU."""

import torch
from torch.utils.checkpoint import checkpoint

from qerl.kernels import settings
from qerl.train.levers import checkpoint_kwargs


class _Recorder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.seen = []

    def forward(self, x):
        self.seen.append(settings.current().moe_grouped)
        return self.lin(x).relu()


def _run(kwargs):
    m = _Recorder()
    x = torch.randn(3, 4, requires_grad=True)
    with settings.use(moe_grouped=not settings.KernelSettings().moe_grouped):
        y = checkpoint(m, x, **kwargs)
    y.sum().backward()  # outside the forward's scope
    return m.seen


def test_recompute_sees_the_forward_settings():
    flipped = not settings.KernelSettings().moe_grouped
    assert _run(checkpoint_kwargs()) == [flipped, flipped]
    assert _run({"use_reentrant": False}) == [flipped, not flipped]  # without it, the recompute's differ

"""The rollout engine's own copy of the adapter: the policy it samples from, frozen while the update trains.

With max_staleness 1 the rollout of step k+1 runs while step k's update steps the optimizer in place,
so the engine must not read the live LoRA tensors. `AdapterSnapshot(model, params)` builds a second
module tree over the same objects' frozen tensors (4-bit weights, embeddings, lm_head, norms that do
not train are shared, not copied) whose trainable tensors (LoRA factors, and norms under
train_norms) are its own: one adapter's worth of memory (~160 MB at 7B r32). Fused groups (q|k|v,
gate|up) are rebuilt over the copies, so the engine runs the same fused computation on them. Its
norm modules are copies too: the rollout's AQN noise lives on them and never reaches the trainer's
forward, and `adapters_disabled` or `.train()` on the live model leave the snapshot alone.

`refresh()` copies the live adapter in place (version k), between rollouts only: the tensors keep
their addresses, so CUDA graphs captured on them stay valid. `tensors()` / `load()` carry it through a
checkpoint (the adapter a rollout in flight samples from).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..layers.fused_group import _REGISTRY, register

_OWN_ATTRS = ("aqn_noise", "forward")  # per-module state AQN puts on a norm: never shared with the copy


def _copy_tree(module: nn.Module, trainable: set[int], memo: dict[int, nn.Module]) -> nn.Module:
    """A shallow copy of every module (fresh child, parameter and buffer dicts); trainable
    parameters are cloned (frozen, no grad), everything else is the same tensor."""
    if id(module) in memo:
        return memo[id(module)]
    c = copy.copy(module)
    memo[id(module)] = c
    for a in _OWN_ATTRS:
        c.__dict__.pop(a, None)
    c._modules = type(module._modules)((k, None if v is None else _copy_tree(v, trainable, memo))
                                       for k, v in module._modules.items())
    c._parameters = type(module._parameters)(
        (k, nn.Parameter(p.detach().clone(), requires_grad=False) if p is not None and id(p) in trainable else p)
        for k, p in module._parameters.items())
    c._buffers = type(module._buffers)(module._buffers)
    return c


class AdapterSnapshot:
    def __init__(self, model: nn.Module, params: list[torch.Tensor]):
        trainable = {id(p) for p in params}
        memo: dict[int, nn.Module] = {}
        self.model = _copy_tree(model, trainable, memo)
        # fused groups: a copy per group over the copied members, with its own A_cat / B_cat
        for live in model.modules():
            groups = live.__dict__.get(_REGISTRY)
            if not groups:
                continue
            shadow = memo[id(live)]
            shadow.__dict__[_REGISTRY] = {}
            for attrs, g in groups.items():
                g2 = copy.copy(g)
                g2.members = tuple(memo[id(m)] for m in g.members)
                for m in g2.members:
                    m.group = g2
                g2.attach_lora()  # A_cat / B_cat from the copied factors; the members' factors become views
                register(shadow, attrs, g2)
        live_named = dict(model.named_parameters())
        shadow_named = dict(self.model.named_parameters())
        self.names = [n for n, p in live_named.items() if id(p) in trainable]
        self._live = [live_named[n] for n in self.names]
        self._own = [shadow_named[n] for n in self.names]
        self.version = 0  # the adapter version last copied in (the caller's count of trained steps)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._own)

    @torch.no_grad()
    def refresh(self, version: int) -> None:
        """Copy the live adapter in (in place). Call it only while no rollout reads the snapshot."""
        for own, live in zip(self._own, self._live):
            own.copy_(live)
        self.version = version

    def tensors(self) -> dict[str, torch.Tensor]:
        """name (the live model's parameter name) -> a standalone copy of the snapshot's tensor."""
        return {n: t.detach().clone().contiguous() for n, t in zip(self.names, self._own)}

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor], version: int, where: str = "snapshot") -> None:
        if set(tensors) != set(self.names):
            miss, extra = sorted(set(self.names) - set(tensors))[:3], sorted(set(tensors) - set(self.names))[:3]
            raise ValueError(f"{where}: the saved rollout adapter does not match the model's trainable tensors "
                             f"(missing {miss}, unexpected {extra})")
        for n, own in zip(self.names, self._own):
            t = tensors[n]
            if t.shape != own.shape:
                raise ValueError(f"{where}: {n} has shape {tuple(t.shape)}, the model {tuple(own.shape)}")
            own.copy_(t)
        self.version = version

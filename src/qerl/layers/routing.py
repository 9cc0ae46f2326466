"""What the routers chose, recorded: the check that the rollout and the update route alike.

An MoE's importance ratios compare the rollout's logprobs with the update's; if a token went to other
experts on the two paths (a perturbed norm, a router computed in another dtype) the ratio drifts
without any weight having changed. `record_routing(model)` logs each experts module's top-k indices
per call, in call order; `routing_mismatch` gives the fraction of tokens whose expert sets differ
between two logs of the same tokens (the engine's prefill and decode steps concatenated, against the
trainer's forward over the whole sequence)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from .quant_experts import QuantExperts


@dataclass
class RoutingLog:
    calls: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # experts module -> [T, k] per call

    def tokens(self, name: str) -> torch.Tensor:
        """Every call's choices for one experts module, in call order: [sum of T, k]."""
        return torch.cat(self.calls[name])


@contextlib.contextmanager
def record_routing(model: nn.Module):
    experts = {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts)}
    log = RoutingLog({n: [] for n in experts})
    for n, m in experts.items():
        m.routing_log = log.calls[n]
    try:
        yield log
    finally:
        for m in experts.values():
            m.routing_log = None


def routing_mismatch(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of tokens (rows of [T, k] choices) routed to a different set of experts."""
    if a.shape != b.shape:
        raise ValueError(f"routing logs of {tuple(a.shape)} and {tuple(b.shape)} choices: not the same tokens")
    same = (a.sort(-1).values == b.sort(-1).values).all(-1)
    return float((~same).float().mean()) if same.numel() else 0.0

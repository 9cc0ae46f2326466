"""Rewards to advantages: group-relative scaling, DAPO's soft overlong penalty and dynamic sampling."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """rewards [P, G] -> advantages [P, G]: r - mean of its group, divided by the group's std
    (scale='group'), the whole batch's std ('batch') or nothing ('none')."""
    centered = rewards - rewards.mean(1, keepdim=True)
    if scale == "group":
        return centered / (rewards.std(1, keepdim=True) + eps)
    if scale == "batch":
        return centered / (rewards.std() + eps)
    if scale == "none":
        return centered
    raise ValueError(f"scale_rewards: unknown {scale!r}")


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to max_len - buffer, then a linear ramp to -factor at
    max_len (and -factor beyond)."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_len - buffer)).clamp(min=0)
    return -(over / buffer).clamp(max=1.0) * factor


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[P] bool: groups whose rewards are not all equal (dynamic sampling keeps these)."""
    return (rewards.max(1).values - rewards.min(1).values) > 0


def rollout_batch(groups, G: int, scale_rewards: str, dist):
    """The advantages phase: the chosen (round, group) pairs -> a flat RolloutBatch. 'batch' scaling
    divides by the std of the whole step's chosen rewards, over all ranks."""
    from ..train.batch import RolloutBatch

    comp, adv = [], []
    for r, g in groups:
        a = group_advantages(r.rewards[g: g + 1], scale_rewards if scale_rewards != "batch" else "none")
        for j in range(G):
            comp.append(r.completions[g * G + j])
            adv.append(float(a[0, j]))
    adv_t = torch.tensor(adv)
    if scale_rewards == "batch":
        mine = [float(x) for r, g in groups for x in r.rewards[g]]
        allr = torch.tensor([x for part in dist.gather(mine) for x in part])
        if len(allr) > 1:
            adv_t = adv_t / (allr.std() + 1e-4)
    truncated = torch.tensor([c.finish_reason == "length" for c in comp])
    return RolloutBatch(comp, adv_t, truncated)

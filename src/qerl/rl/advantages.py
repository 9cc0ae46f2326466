"""Rewards to advantages: group-relative scaling, DAPO's soft overlong penalty and dynamic sampling.

A NaN reward is an unscorable completion (every reward function returned None for it: rl/rewards.py).
TRL's rule, kept here: it is left out of its group's mean and std (and of the batch's std) and its
advantage is 0; a group is informative when its scored rewards are not all equal."""

from __future__ import annotations

import torch


def nan_std(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The sample std (n - 1) of the numbers that are not NaN (TRL's nanstd); NaN with fewer than 2."""
    n = (~torch.isnan(x)).sum() if dim is None else (~torch.isnan(x)).sum(dim, keepdim=keepdim)
    mean = torch.nanmean(x) if dim is None else torch.nanmean(x, dim, keepdim=True)
    sq = torch.nansum((x - mean) ** 2) if dim is None else torch.nansum((x - mean) ** 2, dim, keepdim=keepdim)
    return (sq / (n - 1)).sqrt()


def group_advantages(rewards: torch.Tensor, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """rewards [P, G] -> advantages [P, G]: r - mean of its group, divided by the group's std
    (scale='group'), the whole batch's std ('batch') or nothing ('none'). NaN rewards (unscorable) are
    left out of the mean and std and get advantage 0."""
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards: unknown {scale!r}")
    if not torch.isnan(rewards).any():  # every completion scored: the plain statistics
        centered = rewards - rewards.mean(1, keepdim=True)
        if scale == "group":
            return centered / (rewards.std(1, keepdim=True) + eps)
        return centered / (rewards.std() + eps) if scale == "batch" else centered
    centered = rewards - torch.nanmean(rewards, 1, keepdim=True)
    if scale == "group":
        centered = centered / (nan_std(rewards, 1, keepdim=True) + eps)
    elif scale == "batch":
        centered = centered / (nan_std(rewards) + eps)
    return torch.nan_to_num(centered, nan=0.0)  # unscorable, or alone in its group: no signal


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to max_len - buffer, then a linear ramp to -factor at
    max_len (and -factor beyond)."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_len - buffer)).clamp(min=0)
    return -(over / buffer).clamp(max=1.0) * factor


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[P] bool: groups whose scored rewards are not all equal (dynamic sampling keeps these)."""
    scored = ~torch.isnan(rewards)
    hi = torch.where(scored, rewards, -torch.inf).max(1).values
    lo = torch.where(scored, rewards, torch.inf).min(1).values
    return (hi - lo) > 0


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
        mine = [float(x) for r, g in groups for x in r.rewards[g] if x == x]  # the scored ones
        allr = torch.tensor([x for part in dist.gather(mine) for x in part])
        if len(allr) > 1:
            adv_t = adv_t / (allr.std() + 1e-4)
    truncated = torch.tensor([c.finish_reason == "length" for c in comp])
    return RolloutBatch(comp, adv_t, truncated)

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

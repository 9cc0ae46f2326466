"""A rollout round: what one round of a step's rollouts passes to the next phases (the chosen batch the
update trains on is train/batch.py's RolloutBatch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RolloutRound:
    """One round of this rank's rollouts, scored (dynamic sampling may run several per step)."""
    completions: list          # completion.Completion, prompt-major (G per prompt)
    texts: list[str]
    scores: object             # rewards.Scores
    rewards: torch.Tensor      # [prompts, G], overlong penalty included
    lengths: torch.Tensor      # [prompts * G] completion tokens
    stats: object              # rollout.RolloutStats of the round


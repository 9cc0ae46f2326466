"""What the policy update trains on: the step's chosen completions (rollouts, or SFT examples laid out as
completions) and the padded micro-batches cut from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .logprobs import pad_batch


@dataclass
class RolloutBatch:
    """The step's chosen completions on this rank, flattened, with their advantages."""
    completions: list
    advantages: torch.Tensor   # [N]
    truncated: torch.Tensor    # [N] bool: cut at max_completion_length

    def __len__(self) -> int:
        return len(self.completions)


@dataclass
class MicroBatch:
    """Right-padded prompt + completion rows (logprobs.pad_batch) and their per-row training data."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor              # [B, T] bool: completion tokens the model sampled (not tool output)
    rollout_logprobs: torch.Tensor  # [B, T] the engine's logprob of each completion token (0 elsewhere)
    advantages: torch.Tensor        # [B]
    truncated: torch.Tensor         # [B] bool

    def model_inputs(self) -> dict:
        """The keyword arguments of logprobs.completion_logprobs."""
        return dict(ids=self.input_ids, att=self.attention_mask, pos=self.position_ids, targets=self.targets,
                    mask=self.mask)


def micro_batches(batch: RolloutBatch, size: int, pad_id: int, device) -> list[MicroBatch]:
    """Consecutive micro-batches of `size` completions (the last may be smaller)."""
    out = []
    for s in range(0, len(batch), size):
        comp = batch.completions[s:s + size]
        ids, att, pos, tg, mask = pad_batch([c.prompt_ids for c in comp], [c.token_ids for c in comp], pad_id=pad_id)
        mask, rl = loss_mask_and_logprobs(comp, mask)
        out.append(MicroBatch(ids, att, pos, tg, mask, rl.to(device), batch.advantages[s:s + size],
                              batch.truncated[s:s + size]))
    return out


def loss_mask_and_logprobs(comp: list, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """mask [B, L] True on each completion's tokens -> (the loss mask, the rollout logprobs [B, L])."""
    rl = torch.zeros(mask.shape).masked_scatter(
        mask, torch.tensor([x for c in comp for x in c.logprobs], dtype=torch.float32))
    if any(getattr(c, "tool_spans", None) for c in comp):
        # multi-turn: tool output appended between turns is context the model did not sample; it
        # stays in the sequence but out of the loss, the logprobs and the mismatch statistics
        own = torch.zeros_like(mask).masked_scatter(
            mask, torch.tensor([x for c in comp for x in c.model_token_mask()], dtype=torch.bool))
        mask = mask & own
    return mask, rl

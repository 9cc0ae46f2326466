"""SFT's objective in the policy update (train/update.py): the token-mean negative log-likelihood.

    loss = -sum over the update's trained tokens of log p(token) / norm_tokens

norm_tokens is the update's trained tokens over all ranks / world size (the update's token normaliser), so
with gradient accumulation and several ranks the update minimises the mean NLL of all its trained tokens
(TRL's SFT loss), and its "loss" metric is that mean. No clipping, no reference, no importance weights.
"""

from __future__ import annotations

import torch

from ..train.update import MicroLoss, Objective


def token_nll(logp: torch.Tensor, mask: torch.Tensor, norm_tokens: float) -> torch.Tensor:
    """-(sum of logp over the masked tokens) / norm_tokens: this micro-batch's share of the update's mean NLL."""
    return -(logp * mask.to(logp.dtype)).sum() / norm_tokens


class TokenNLL(Objective):
    def loss(self, x: MicroLoss) -> tuple[torch.Tensor, dict]:
        return token_nll(x.logp, x.mask, x.norm_tokens), {}

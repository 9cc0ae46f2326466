"""The clipped policy-gradient loss of GRPO / DAPO / Dr. GRPO, with optional KL and importance weights."""

from __future__ import annotations

import torch


def policy_loss(logp, old_logp, adv, mask, *, loss_type: str, epsilon: float, epsilon_high: float | None,
                beta: float = 0.0, ref_logp=None, is_weights=None, norm_tokens: float | None = None,
                max_completion_length: int | None = None):
    """Loss of one micro-batch (already divided for its share of the update) and its statistics.

    logp, old_logp [B, L] (old is the policy that sampled, detached), adv [B] (one advantage a
    completion), mask [B, L] bool. loss_type aggregates the per-token terms:
      grpo     mean over each completion's tokens, then over completions
      bnpo     mean over the micro-batch's tokens
      dapo     sum over tokens / norm_tokens (the tokens of the whole update: every token counts the same)
      dr_grpo  sum over tokens / (completions x max_completion_length)
    """
    m = mask.float()
    ratio = torch.exp(logp - old_logp)
    hi = epsilon if epsilon_high is None else epsilon_high
    a = adv[:, None]
    un, cl = ratio * a, torch.clamp(ratio, 1 - epsilon, 1 + hi) * a
    per_tok = -torch.min(un, cl)
    if is_weights is not None:
        per_tok = per_tok * is_weights
    kl = None
    if beta:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1  # k3 estimator, >= 0
        per_tok = per_tok + beta * kl
    if loss_type == "grpo":
        loss = ((per_tok * m).sum(1) / m.sum(1).clamp(min=1)).mean()
    elif loss_type == "bnpo":
        loss = (per_tok * m).sum() / m.sum().clamp(min=1)
    elif loss_type == "dapo":
        loss = (per_tok * m).sum() / (norm_tokens if norm_tokens else m.sum().clamp(min=1))
    elif loss_type == "dr_grpo":
        loss = (per_tok * m).sum() / (m.shape[0] * (max_completion_length or m.shape[1]))
    else:
        raise ValueError(f"loss_type: unknown {loss_type!r}")
    with torch.no_grad():
        n = m.sum().clamp(min=1)
        clipped = ((ratio < 1 - epsilon) & (a < 0)) | ((ratio > 1 + hi) & (a > 0))
        stats = {"clip_fraction": float((clipped.float() * m).sum() / n),
                 "ratio_mean": float((ratio * m).sum() / n)}
        if kl is not None:
            stats["kl"] = float((kl * m).sum() / n)
    return loss, stats

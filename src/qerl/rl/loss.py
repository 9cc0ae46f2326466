"""The policy-gradient losses of GRPO / DAPO / Dr. GRPO / GSPO / CISPO, with TRL's names and meanings.

Optional: KL to a reference, truncated importance weights (rollout vs trainer), training only on the
highest-entropy tokens (TRL's top_entropy_quantile) and an entropy bonus (verl's entropy_coeff).
"""

from __future__ import annotations

import torch

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def high_entropy_mask(entropies, mask, quantile: float):
    """TRL's top_entropy_quantile: True on the tokens whose entropy is at or above the (1 - quantile)
    quantile of the masked tokens' entropies (quantile 1.0 keeps every token, 0.2 the top fifth)."""
    if quantile >= 1.0:
        return mask.bool()
    values = entropies.detach()[mask.bool()]
    values = values if values.dtype == torch.float64 else values.float()  # never round the threshold down a dtype
    if values.numel() == 0:
        return mask.bool()
    threshold = torch.quantile(values, 1.0 - quantile)
    return (entropies.detach() >= threshold) & mask.bool()


def policy_loss(logp, old_logp, adv, mask, *, loss_type: str, epsilon: float, epsilon_high: float | None,
                beta: float = 0.0, ref_logp=None, is_weights=None, norm_tokens: float | None = None,
                max_completion_length: int | None = None, importance_sampling_level: str = "token",
                entropies=None, top_entropy_quantile: float = 1.0, entropy_coeff: float = 0.0):
    """Loss of one micro-batch (already divided for its share of the update) and its statistics.

    logp, old_logp [B, L] (old is the policy that sampled, detached), adv [B] (one advantage a
    completion), mask [B, L] bool. The importance ratio is, per importance_sampling_level,
      token     exp(logp - old_logp) per token
      sequence  exp(mean over the completion's tokens of (logp - old_logp)), one per completion (GSPO)
    loss_type gives the per-token term and its aggregation:
      grpo     clipped surrogate; mean over each completion's tokens, then over completions
      bnpo     clipped surrogate; mean over the micro-batch's tokens
      dapo     clipped surrogate; sum over tokens / norm_tokens (the tokens of the whole update)
      dr_grpo  clipped surrogate; sum over tokens / (completions x max_completion_length)
      cispo    -sg(min(ratio, epsilon_high)) * adv * logp (MiniMax-M1: the IS weight is clipped and
               carries no gradient, so no token's gradient is dropped); aggregated as dapo
    epsilon / epsilon_high: the surrogate clips the ratio to [1 - epsilon, 1 + epsilon_high]; for
    cispo epsilon_high is the cap of the weight itself (TRL: 5.0 recommended) and epsilon is unused.
    entropies [B, L] (the policy's per-token entropy, with gradient when entropy_coeff is used):
    top_entropy_quantile < 1 zeroes the policy term of all but the highest-entropy tokens (the
    normaliser still counts every token, as TRL); entropy_coeff subtracts coeff x entropy per token.
    """
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level: unknown {importance_sampling_level!r}")
    m = mask.float()
    log_ratio = logp - old_logp
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * m).sum(1) / m.sum(1).clamp(min=1))[:, None]  # [B, 1]
    ratio = torch.exp(log_ratio)
    hi = epsilon if epsilon_high is None else epsilon_high
    a = adv[:, None]
    if loss_type == "cispo":
        weight = torch.clamp(ratio, max=hi).detach()
        per_tok = -weight * a * logp
        clipped = (ratio > hi).expand_as(m)
    else:
        un, cl = ratio * a, torch.clamp(ratio, 1 - epsilon, 1 + hi) * a
        per_tok = -torch.min(un, cl)
        clipped = (((ratio < 1 - epsilon) & (a < 0)) | ((ratio > 1 + hi) & (a > 0))).expand_as(m)
    if top_entropy_quantile < 1.0:
        if entropies is None:
            raise ValueError("top_entropy_quantile < 1 needs the per-token entropies")
        per_tok = per_tok * high_entropy_mask(entropies, mask, top_entropy_quantile).float()
    if is_weights is not None:
        per_tok = per_tok * is_weights
    kl = None
    if beta:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1  # k3 estimator, >= 0
        per_tok = per_tok + beta * kl
    if entropy_coeff:
        if entropies is None:
            raise ValueError("entropy_coeff needs the per-token entropies")
        per_tok = per_tok - entropy_coeff * entropies
    if loss_type == "grpo":
        loss = ((per_tok * m).sum(1) / m.sum(1).clamp(min=1)).mean()
    elif loss_type == "bnpo":
        loss = (per_tok * m).sum() / m.sum().clamp(min=1)
    elif loss_type in ("dapo", "cispo"):
        loss = (per_tok * m).sum() / (norm_tokens if norm_tokens else m.sum().clamp(min=1))
    elif loss_type == "dr_grpo":
        loss = (per_tok * m).sum() / (m.shape[0] * (max_completion_length or m.shape[1]))
    else:
        raise ValueError(f"loss_type: unknown {loss_type!r}")
    with torch.no_grad():
        n = m.sum().clamp(min=1)
        stats = {"clip_fraction": float((clipped.float() * m).sum() / n),
                 "ratio_mean": float((ratio.expand_as(m) * m).sum() / n)}
        if kl is not None:
            stats["kl"] = float((kl * m).sum() / n)
        if top_entropy_quantile < 1.0:
            stats["entropy_mask_fraction"] = float((high_entropy_mask(entropies, mask, top_entropy_quantile).float()
                                                    ).sum() / n)
    return loss, stats

"""The policy-gradient losses of GRPO / DAPO / Dr. GRPO / GSPO / CISPO / SAPO / LUSPO, with TRL 1.16's
names and meanings (trl/trainer/grpo_trainer.py, `_compute_loss`; tests/test_trl_parity.py runs it).

Optional: KL to a reference (TRL's bias-corrected k3), importance weights for the rollout-vs-trainer
mismatch (TRL's four modes), DeepSeek-V3.2's off-policy sequence mask, training only on the
highest-entropy tokens (top_entropy_quantile) and an entropy bonus (TRL's entropy_coef).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
TOKEN_SUM_LOSSES = ("dapo", "cispo", "vespo")  # sum over tokens / norm_tokens (the update's share of the tokens)


@dataclass(frozen=True)
class LossSettings:
    """What the policy loss is, fixed for a run (policy_loss's doc says what each field does): a GRPO
    config's loss fields (`LossSettings.of`)."""
    loss_type: str
    epsilon: float
    epsilon_high: float | None
    beta: float = 0.0
    max_completion_length: int | None = None
    importance_sampling_level: str = "token"
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    use_bias_correction_kl: bool = True
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    off_policy_mask_threshold: float | None = None
    vespo: tuple = (2.0, 3.0, 3.0, 2.0)  # (k_pos, lambda_pos, k_neg, lambda_neg)

    @classmethod
    def of(cls, cfg) -> "LossSettings":
        """A GRPOConfig's loss."""
        return cls(cfg.loss_type, cfg.epsilon, cfg.epsilon_high, cfg.beta, cfg.max_completion_length,
                   cfg.importance_sampling_level, cfg.top_entropy_quantile, cfg.entropy_coef,
                   cfg.use_bias_correction_kl, cfg.delta, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg,
                   cfg.off_policy_mask_threshold, (cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg,
                                                   cfg.vespo_lambda_neg))


def rollout_is_weights(old_logp, rollout_logp, mask, mode: str, cap: float | None, cap_min: float | None = None):
    """TRL's vllm_importance_sampling_mode: weights pi_trainer / pi_rollout of the sampled tokens,
    [B, L] for token_* and [B, 1] for sequence_* (exp of the completion's summed log-ratio);
    *_truncate clips them to [cap_min, cap], *_mask zeroes those outside it. Detached."""
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"importance_sampling_mode: unknown {mode!r} (one of {IMPORTANCE_SAMPLING_MODES})")
    d = ((old_logp - rollout_logp) * mask).detach()
    if mode.startswith("sequence"):
        d = d.sum(-1, keepdim=True)
    w = torch.exp(d)
    if mode.endswith("truncate"):
        return w.clamp(min=cap_min, max=cap)
    lo = -math.inf if cap_min is None else cap_min
    hi = math.inf if cap is None else cap
    return w.masked_fill((w < lo) | (w > hi), 0.0)


def off_policy_mask(adv, logp, rollout_logp, mask, threshold: float):
    """DeepSeek-V3.2's off-policy sequence mask (eq. 9; TRL's off_policy_mask_threshold): [B, 1],
    0 for a completion with a negative advantage whose mean KL(rollout || trainer) over its tokens,
    estimated as the mean of log pi_rollout - log pi_theta, exceeds `threshold`; else 1."""
    m = mask.to(logp.dtype)
    kl = ((rollout_logp - logp.detach()) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
    return ((adv[:, None] >= 0) | (kl <= threshold)).to(logp.dtype)


@torch.no_grad()
def vespo_weights(adv, log_ratio, mask, is_weights, k_pos: float, lam_pos: float, k_neg: float, lam_neg: float):
    """VESPO's gamma weight of each completion (arXiv 2602.10693; TRL's vespo): [B, 1], detached,
    phi(w) = exp(lam + k log w - lam w) (so phi(1) = 1), w = prod over the completion's tokens of
    pi_theta / pi_old, times the rollout correction's token weights when given; k and lam by the sign
    of the advantage. In log space, with TRL's bounds: token log-ratios within [-20, 20], log w and the
    correction's log-weights within [log 1e-8, 20]."""
    lo = math.log(1e-8)
    log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
    if is_weights is not None:
        log_w = log_w + torch.log(is_weights).clamp(lo, 20.0).sum(-1, keepdim=True)
    log_w = log_w.clamp(lo, 20.0)
    pos = adv[:, None] >= 0
    k = torch.where(pos, k_pos, k_neg)
    lam = torch.where(pos, lam_pos, lam_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def high_entropy_mask(entropies, mask, quantile: float, pool=None):
    """TRL's top_entropy_quantile: True on the tokens whose entropy is at or above the (1 - quantile)
    quantile of `pool` (the masked tokens' entropies of this micro-batch on every rank, as TRL
    gathers them; None: this micro-batch's). quantile 1.0 keeps every token, 0.2 the top fifth."""
    if quantile >= 1.0:
        return mask.bool()
    values = entropies.detach()[mask.bool()] if pool is None else pool.detach()
    values = values if values.dtype == torch.float64 else values.float()  # never round the threshold down a dtype
    if values.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)  # TRL: nothing to rank, nothing trains
    threshold = torch.quantile(values.to(entropies.device), 1.0 - quantile)
    return (entropies.detach() >= threshold) & mask.bool()


def policy_loss(logp, old_logp, adv, mask, settings: LossSettings | None = None, *, ref_logp=None, is_weights=None,
                norm_tokens: float | None = None, entropies=None, entropy_pool=None, accumulation: float = 1.0,
                rollout_logp=None, **fields):
    """Loss of one micro-batch (already divided for its share of the update) and its statistics.

    settings: the run's LossSettings; or, for a one-off call, its fields as keywords (loss_type=...,
    epsilon=..., epsilon_high=..., ...). The other keywords are this micro-batch's inputs.

    logp, old_logp [B, L] (old is the policy that sampled, detached), adv [B] (one advantage a
    completion), mask [B, L] bool. The importance ratio is, per importance_sampling_level,
      token     exp(logp - old_logp) per token
      sequence  exp(mean over the completion's tokens of (logp - old_logp)), one per completion (GSPO)
    loss_type gives the per-token term and its aggregation (TRL 1.16's list):
      grpo     clipped surrogate; mean over each completion's tokens, then over completions
      bnpo     clipped surrogate; mean over the micro-batch's tokens
      dapo     clipped surrogate; sum over tokens / norm_tokens (the update's tokens, see train/update.py)
      dr_grpo  clipped surrogate; sum over tokens / (completions x max_completion_length)
      cispo    -sg(min(ratio, epsilon_high)) * adv * logp (MiniMax-M1, arXiv 2506.13585: the IS weight
               is clipped and carries no gradient, so no token's gradient is dropped); aggregated as dapo
      sapo     -(4 / tau) sigmoid(tau (ratio - 1)) * adv, tau = sapo_temperature_pos if adv > 0 else _neg
               (SAPO, arXiv 2511.20347: a soft, temperature-controlled gate instead of the hard clip);
               aggregated as grpo
      luspo    clipped surrogate summed over each completion's tokens, then the mean over completions
               (LUSPO, arXiv 2602.05261: GSPO scaled by each sequence's length; meant for the sequence level)
      vespo    -phi(w) * adv * logp, phi the completion's gamma weight (vespo_weights; VESPO, arXiv
               2602.10693: a smooth, asymmetric weighting instead of the clip; vespo = (k_pos, lam_pos,
               k_neg, lam_neg)); aggregated as dapo. Token level only; it takes the rollout correction's
               token weights inside phi instead of multiplying the loss by them
    epsilon / epsilon_high: the surrogate clips the ratio to [1 - epsilon, 1 + epsilon_high]; for
    cispo epsilon_high is the cap of the weight itself (TRL: 5.0 recommended) and epsilon is unused.
    delta (INTELLECT-2's two-sided clipping, TRL's delta): the unclipped ratio is also capped at delta.
    beta: + beta x k3(ref || pi) per token, times the ratio when use_bias_correction_kl (TRL's default:
    DeepSeek-V3.2's unbiased reverse-KL gradient; the ratio carries gradient even where it is 1).
    is_weights ([B, L] or [B, 1], rollout_is_weights) multiply the policy term; off_policy_mask_threshold
    (with rollout_logp) drops negative-advantage completions that drifted (off_policy_mask).
    entropies [B, L] (the policy's per-token entropy, with gradient when entropy_coef is used):
    top_entropy_quantile < 1 zeroes the policy term of all but the highest-entropy tokens (threshold
    over entropy_pool, all ranks' tokens; the normaliser still counts every token, as TRL);
    entropy_coef subtracts coef x the mean entropy over the (entropy-selected) tokens, the same for
    every loss_type (TRL's). accumulation: the micro-batches of the update (all ranks' / world size);
    every loss but dapo/cispo and the entropy bonus are divided by it.
    """
    if settings is None:
        settings = LossSettings(**fields)
    elif fields:
        raise TypeError(f"policy_loss: settings and its fields {sorted(fields)} both given")
    s = settings
    loss_type, epsilon, epsilon_high, beta = s.loss_type, s.epsilon, s.epsilon_high, s.beta
    importance_sampling_level, delta, vespo = s.importance_sampling_level, s.delta, s.vespo
    top_entropy_quantile, entropy_coef = s.top_entropy_quantile, s.entropy_coef
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level: unknown {importance_sampling_level!r}")
    m = mask.to(logp.dtype)
    log_ratio = logp - old_logp
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * m).sum(1) / m.sum(1).clamp(min=1))[:, None]  # [B, 1]
    ratio = torch.exp(log_ratio)
    hi = epsilon if epsilon_high is None else epsilon_high
    a = adv[:, None]
    if loss_type == "cispo":
        per_tok = -torch.clamp(ratio, max=hi).detach() * a * logp
        clipped = (ratio > hi).expand_as(m)
    elif loss_type == "sapo":
        tau = torch.where(a > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)
        per_tok = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a
        clipped = (((ratio < 1 - epsilon) & (a < 0)) | ((ratio > 1 + hi) & (a > 0))).expand_as(m)
    elif loss_type == "vespo":
        if importance_sampling_level != "token" or (is_weights is not None and is_weights.shape[-1] != m.shape[-1]):
            raise ValueError("loss_type vespo: needs importance_sampling_level token (and a token_* "
                             "importance_sampling_mode): its weight is built from per-token ratios")
        per_tok = -vespo_weights(adv, log_ratio, m, is_weights, *vespo) * a * logp
        clipped = torch.zeros_like(m, dtype=torch.bool)
    elif loss_type in ("grpo", "bnpo", "dapo", "dr_grpo", "luspo"):
        cl = torch.clamp(ratio, 1 - epsilon, 1 + hi) * a
        un = (ratio if delta is None else torch.clamp(ratio, max=delta)) * a
        per_tok = -torch.min(un, cl)
        clipped = (((ratio < 1 - epsilon) & (a < 0)) | ((ratio > 1 + hi) & (a > 0))).expand_as(m)
    else:
        raise ValueError(f"loss_type: unknown {loss_type!r}")
    if s.off_policy_mask_threshold is not None:
        if rollout_logp is None:
            raise ValueError("off_policy_mask_threshold needs the rollout's logprobs")
        per_tok = per_tok * off_policy_mask(adv, logp, rollout_logp, mask, s.off_policy_mask_threshold)
    emask = None
    if top_entropy_quantile < 1.0:
        if entropies is None:
            raise ValueError("top_entropy_quantile < 1 needs the per-token entropies")
        emask = high_entropy_mask(entropies, mask, top_entropy_quantile, entropy_pool)
        per_tok = per_tok * emask.to(per_tok.dtype)
    if is_weights is not None and loss_type != "vespo":
        per_tok = per_tok * is_weights
    kl = None
    if beta:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1  # k3 estimator, >= 0
        if s.use_bias_correction_kl:
            kl = kl * ratio
        per_tok = per_tok + beta * kl
    if loss_type in ("grpo", "sapo"):
        loss = ((per_tok * m).sum(1) / m.sum(1).clamp(min=1)).mean() / accumulation
    elif loss_type == "bnpo":
        loss = (per_tok * m).sum() / m.sum().clamp(min=1) / accumulation
    elif loss_type in TOKEN_SUM_LOSSES:
        loss = (per_tok * m).sum() / (norm_tokens if norm_tokens else m.sum().clamp(min=1))
    elif loss_type == "dr_grpo":
        loss = (per_tok * m).sum() / (m.shape[0] * (s.max_completion_length or m.shape[1])) / accumulation
    else:  # luspo
        loss = (per_tok * m).sum(1).mean() / accumulation
    if entropy_coef:
        if entropies is None:
            raise ValueError("entropy_coef needs the per-token entropies")
        em = m if emask is None else m * emask.to(m.dtype)
        loss = loss - entropy_coef * (entropies * em).sum() / em.sum().clamp(min=1) / accumulation
    with torch.no_grad():
        n = m.sum().clamp(min=1)
        stats = {"clip_fraction": float((clipped.to(m.dtype) * m).sum() / n),
                 "ratio_mean": float((ratio.expand_as(m) * m).sum() / n)}
        if loss_type in ("grpo", "bnpo", "dapo", "dr_grpo", "luspo", "sapo"):  # TRL's clip_ratio/low, /high
            stats["clip_low"] = float((((ratio < 1 - epsilon) & (a < 0)).expand_as(m).to(m.dtype) * m).sum() / n)
            stats["clip_high"] = float((((ratio > 1 + hi) & (a > 0)).expand_as(m).to(m.dtype) * m).sum() / n)
        if kl is not None:
            stats["kl"] = float((kl.expand_as(m) * m).sum() / n)
        if emask is not None:
            stats["entropy_mask_fraction"] = float(emask.to(m.dtype).sum() / n)
    return loss, stats

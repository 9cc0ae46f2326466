"""GRPO's objective in the policy update (train/update.py): the policy loss (rl/loss.py) with the run's
LossSettings, the KL reference's logprobs (the base: adapters off) when beta > 0, the rollout correction's
importance weights, the step's AQN noise in the training passes (aqn_in_training), the entropy pool of
top_entropy_quantile over the ranks, and the statistics of all of it (qerl's names and TRL's).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from ..layers import adapters_disabled
from ..train.update import MicroLoss, Objective, UpdateSettings
from .loss import LossSettings, policy_loss, rollout_is_weights


@dataclass(frozen=True)
class PolicySettings:
    """What GRPO's loss reads of a config besides the update's own settings."""
    loss: LossSettings
    aqn_in_training: bool = False
    importance_sampling_correction: bool = False
    importance_sampling_mode: str = "sequence_mask"
    importance_sampling_cap: float | None = 3.0
    importance_sampling_cap_min: float | None = None

    @classmethod
    def of(cls, cfg) -> "PolicySettings":
        return cls(LossSettings.of(cfg), cfg.aqn_in_training, cfg.importance_sampling_correction,
                   cfg.importance_sampling_mode, cfg.importance_sampling_cap, cfg.importance_sampling_cap_min)


def update_settings(cfg) -> UpdateSettings:
    """A GRPOConfig's update settings."""
    return UpdateSettings(cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, cfg.num_iterations,
                          cfg.token_normalizer, cfg.packed_update, cfg.logprob_chunk_size, cfg.temperature,
                          cfg.mask_truncated_completions)


class PolicyObjective(Objective):
    """GRPO / DAPO / ...'s loss of one micro-batch, and its step's statistics."""

    def __init__(self, settings: PolicySettings, aqn=None, dist=None, device=None):
        """aqn: rl.aqn.AQN on the live norms (aqn_in_training), or None; dist and device: the ranks the
        top-entropy threshold gathers over."""
        self.s, self.aqn, self.dist, self.device = settings, aqn, dist, device
        self.entropy_grad = settings.loss.entropy_coef > 0
        self._noise = False
        self.ref = None
        self.tally = _Tally()

    def start(self, sigma: float = 0.0, seed: int = 0) -> None:
        """The step's AQN noise: the same Z as its rollout's, entered per training pass (aqn_in_training)."""
        self._noise = self.s.aqn_in_training and self.aqn is not None and sigma > 0
        self.sigma, self.seed = sigma, seed
        self.ref = None
        self.tally = _Tally()

    def scope(self):
        return self.aqn.applied(self.sigma, self.seed) if self._noise else contextlib.nullcontext()

    def prepare(self, update, batches, single) -> None:
        if self.s.loss.beta:  # the KL reference: the base, adapters off
            with adapters_disabled(update.inp.model):
                self.ref = [update.logprobs(b, grad=False)[0] for b in batches]

    def begin_update(self, n_micro: int) -> None:
        # top_entropy_quantile takes its threshold over every rank's micro-batch at the same place
        # (TRL); a rank with fewer micro-batches joins the rest of the gathers with none
        D = self.dist
        world = D.world if D is not None else 1
        self.slots = int(D.max(n_micro, self.device)) if self.s.loss.top_entropy_quantile < 1.0 and world > 1 else 0

    def end_update(self, n_micro: int) -> None:
        for _ in range(self.slots - n_micro):
            self.dist.gather(torch.zeros(0))

    def loss(self, x: MicroLoss):
        s, t, b = self.s, self.tally, x.batch
        dev = x.logp.device
        if x.first_pass:  # once per micro-batch: the pre-update policy vs the rollout's numbers
            t.add_mismatch((x.old_logp - b.rollout_logprobs)[b.mask.to(dev)])
        isw = None
        if s.importance_sampling_correction:
            isw = rollout_is_weights(x.old_logp, b.rollout_logprobs, x.mask, s.importance_sampling_mode,
                                     s.importance_sampling_cap, s.importance_sampling_cap_min)
            t.add_is_weights(isw.expand_as(x.mask)[x.mask], x.mask.any())
        pool = None  # None: this micro-batch's tokens, all there are on one rank
        if self.slots:
            pool = torch.cat([p.to(dev) for p in self.dist.gather(x.entropies.detach()[x.mask].cpu())])
        loss, st = policy_loss(x.logp, x.old_logp, b.advantages.to(dev), x.mask, s.loss,
                               ref_logp=self.ref[x.index] if self.ref is not None else None, is_weights=isw,
                               norm_tokens=x.norm_tokens, accumulation=x.accumulation, entropies=x.entropies,
                               entropy_pool=pool, rollout_logp=b.rollout_logprobs)
        if torch.isfinite(loss.detach()):  # the statistics of the micro-batches that train
            t.add_loss_stats(st)
        return loss, st

    def metrics(self, dist) -> dict:
        t = self.tally
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        allm = torch.cat(t.mism) if t.mism else torch.zeros(0)
        rat = torch.cat(t.ratios).double() if t.ratios else torch.zeros(0, dtype=torch.float64)
        ratio = (float(rat.sum()), rat.numel(), float(rat.min()) if rat.numel() else math.inf,
                 float(rat.max()) if rat.numel() else -math.inf)
        parts = dist.gather({"ratio": ratio, "clip": t.clip_fraction, "kl": t.kl,
                             "emask": t.entropy_mask_fraction, "clip_low": t.clip_low,
                             "clip_high": t.clip_high, "is_min": t.is_min, "is_max": t.is_max,
                             "is": t.is_mean, "mism": (float(allm.sum()), allm.numel()), "mism_max": t.mism_max})
        cat = lambda k: [x for q in parts for x in q[k]]  # noqa: E731
        ms, mn = sum(q["mism"][0] for q in parts), sum(q["mism"][1] for q in parts)
        out = {"clip_fraction": mean(cat("clip")), "logprob_mismatch_mean": ms / mn if mn else 0.0,
               "logprob_mismatch_max": max(q["mism_max"] for q in parts)}
        if cat("kl"):
            out["kl"] = mean(cat("kl"))
        if cat("emask"):  # top_entropy_quantile: the share of tokens the policy term trained on
            out["entropy_mask_fraction"] = mean(cat("emask"))
        if cat("is"):
            out["is_weight_mean"] = mean(cat("is"))
        out.update(trl_names(out, cat, mean))
        n_ratio = sum(q["ratio"][1] for q in parts)
        if n_ratio:  # exp(trainer's pre-update logprob - the sampler's), per model token: noise, numerics, staleness
            out.update(policy_ratio_mean=sum(q["ratio"][0] for q in parts) / n_ratio,
                       policy_ratio_min=min(q["ratio"][2] for q in parts),
                       policy_ratio_max=max(q["ratio"][3] for q in parts))
        return out


@dataclass
class _Tally:
    """What a step's updates collect across their micro-batches, for its loss statistics (this rank's)."""
    clip_fraction: list = field(default_factory=list)
    kl: list = field(default_factory=list)
    entropy_mask_fraction: list = field(default_factory=list)
    clip_low: list = field(default_factory=list)
    clip_high: list = field(default_factory=list)
    is_mean: list = field(default_factory=list)       # a micro-batch's mean rollout-correction weight
    is_min: list = field(default_factory=list)
    is_max: list = field(default_factory=list)
    mism: list = field(default_factory=list)          # |pre-update policy - rollout| logprob, a token
    mism_max: float = 0.0
    ratios: list = field(default_factory=list)        # policy / behaviour probability, a token

    def add_loss_stats(self, st: dict) -> None:
        self.clip_fraction.append(st["clip_fraction"])
        for k in ("entropy_mask_fraction", "kl", "clip_low", "clip_high"):
            if k in st:
                getattr(self, k).append(st[k])

    def add_mismatch(self, diff: torch.Tensor) -> None:
        d = diff.abs()
        if d.numel():
            self.mism.append(d)
            self.mism_max = max(self.mism_max, float(d.max()))
            self.ratios.append(diff.detach().float().exp())

    def add_is_weights(self, w: torch.Tensor, any_token) -> None:
        self.is_mean.append(float(w.mean()) if any_token else 1.0)
        if w.numel():  # TRL's sampling/importance_sampling_ratio/min and /max
            self.is_min.append(float(w.min()))
            self.is_max.append(float(w.max()))


def trl_names(out: dict, cat, mean) -> dict:
    """The update's metrics under TRL's GRPOTrainer names (qerl's own stay beside them): clip ratios over
    the micro-batches of every rank, the rollout correction's weights, the sampler/trainer logprob gap."""
    m = {"clip_ratio/region_mean": out["clip_fraction"],
         "sampling/sampling_logp_difference/mean": out["logprob_mismatch_mean"],
         "sampling/sampling_logp_difference/max": out["logprob_mismatch_max"]}
    if cat("clip_low"):
        m.update({"clip_ratio/low_mean": mean(cat("clip_low")), "clip_ratio/low_min": min(cat("clip_low")),
                  "clip_ratio/high_mean": mean(cat("clip_high")), "clip_ratio/high_max": max(cat("clip_high"))})
    if cat("is"):
        m["sampling/importance_sampling_ratio/mean"] = out["is_weight_mean"]
    if cat("is_min"):
        m["sampling/importance_sampling_ratio/min"] = min(cat("is_min"))
        m["sampling/importance_sampling_ratio/max"] = max(cat("is_max"))
    return m

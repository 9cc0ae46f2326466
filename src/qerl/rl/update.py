"""The update phase: num_iterations passes of clipped policy-gradient updates over micro-batches.

Logprobs of the old policy (PPO's, when there is more than one update per rollout) and of the KL
reference (the base: adapters off) come first, timed as `logprob`; then the optimizer updates,
timed as `update`. The ranks average gradients once per update and step their optimizers together.
With packed_update each micro-batch is packed (rl/packing.py: a group's prompt once, no padding);
the loss sees the same per-completion [B, L] tensors either way.

The phase reads explicit inputs (`UpdateInputs`: the live model, config, ranks, the live AQN) and
the step's noise; it computes gradients and hands each update to the trainer's optimizer step
(`UpdateInputs.optimizer_step`: rank averaging, clipping, the step, the schedule), which it does not own.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..layers import adapters_disabled, unfused_lora
from ..train.optim import TrainingError, step_optimizer  # noqa: F401 - re-exported
from .batch import MicroBatch, RolloutBatch, micro_batches
from .logprobs import completion_logprobs
from .loss import LossSettings, policy_loss, rollout_is_weights
from .packing import FLEX, PackedBatch, attention_kind, has_sliding_window, packed_micro_batches, use_flex_attention


@dataclass(frozen=True)
class UpdateSettings:
    """What the update reads of a configuration, fixed for a run: a GRPOConfig's (`UpdateSettings.of`), or
    the one SFT builds for itself (sft/trainer.py)."""
    loss: LossSettings
    per_device_train_batch_size: int
    gradient_accumulation_steps: int = 1
    num_iterations: int = 1
    token_normalizer: str = "generation"
    packed_update: bool = True
    logprob_chunk_size: int | None = None
    temperature: float = 1.0
    mask_truncated_completions: bool = False
    aqn_in_training: bool = False
    importance_sampling_correction: bool = False
    importance_sampling_mode: str = "sequence_mask"
    importance_sampling_cap: float | None = 3.0
    importance_sampling_cap_min: float | None = None

    @classmethod
    def of(cls, cfg) -> "UpdateSettings":
        return cls(LossSettings.of(cfg), cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps,
                   cfg.num_iterations, cfg.token_normalizer, cfg.packed_update, cfg.logprob_chunk_size,
                   cfg.temperature, cfg.mask_truncated_completions, cfg.aqn_in_training,
                   cfg.importance_sampling_correction, cfg.importance_sampling_mode, cfg.importance_sampling_cap,
                   cfg.importance_sampling_cap_min)


@dataclass(frozen=True)
class UpdateInputs:
    """What the update reads that does not change from step to step."""
    model: torch.nn.Module      # the live policy (trained in place)
    cfg: UpdateSettings
    device: torch.device
    dtype: torch.dtype
    pad_id: int
    dist: object                # rl.distributed.Dist
    profiler: object            # rl.profiling.Profiler: times "logprob" and "update"
    aqn: object | None          # rl.aqn.AQN on the live norms (aqn_in_training), or None
    # the trainer's optimizer step: (why the update's loss is bad, or None) -> gradient norm; averages the
    # gradients over the ranks, clips, steps the optimizer and the schedule; raises TrainingError instead
    optimizer_step: Callable[[str | None], float]


class PolicyUpdate:
    def __init__(self, inputs: UpdateInputs):
        self.inp = inputs
        self._kind = None  # the mask kind packed rows need (packing.attention_kind), found on first use

    def packed_kind(self) -> str | None:
        """The attention-mask kind for packed rows, or None: padded micro-batches (packed_update off, or
        an attention that takes no packed mask)."""
        inp = self.inp
        if not inp.cfg.packed_update:
            return None
        if self._kind is None:
            # the GPU needs FlexAttention's block sparsity: a dense mask would compute the masked-out
            # blocks of a row's other completions (a long row costs more attention than padded rows)
            if inp.device.type == "cuda":
                self._kind = FLEX if not has_sliding_window(inp.model) and use_flex_attention(inp.model) else ""
            else:
                self._kind = attention_kind(inp.model) or ""
            if not self._kind:
                print(f"qerl: packed_update: attention {inp.model.config._attn_implementation!r} takes no "
                      "packed mask here; training on padded micro-batches", flush=True)
        return self._kind or None

    def micro_batches(self, batch: RolloutBatch) -> list:
        inp = self.inp
        size, pad, kind = inp.cfg.per_device_train_batch_size, inp.pad_id, self.packed_kind()
        if kind is None:
            return micro_batches(batch, size, pad, inp.device)
        return packed_micro_batches(batch, size, pad, inp.device, kind, inp.dtype)

    def logprobs(self, mb: MicroBatch | PackedBatch, grad: bool):
        cfg = self.inp.cfg
        with torch.set_grad_enabled(grad), unfused_lora():
            # the entropy bonus differentiates the entropies; otherwise they are statistics (and the
            # top-entropy token selection's input), detached
            return completion_logprobs(self.inp.model, **mb.model_inputs(), temperature=cfg.temperature,
                                       chunk=cfg.logprob_chunk_size, entropy_grad=grad and cfg.loss.entropy_coef > 0)

    def __call__(self, batch: RolloutBatch, sigma: float, seed: int) -> dict:
        """Train on `batch`, sampled under AQN noise (sigma, seed): metrics of the update.

        Named steps: plan the updates, the reference logprobs (old policy, KL reference), the token
        normaliser, then each update (its micro-batches' losses and backward, the optimizer step)."""
        inp = self.inp
        cfg, prof = inp.cfg, inp.profiler
        n_updates = self._n_updates(len(batch))
        single = cfg.num_iterations == 1 and n_updates == 1
        noise = _Noise(inp, sigma, seed)
        tally = _Tally()
        with prof.phase("logprob"):
            batches = self.micro_batches(batch)  # MicroBatch or packing.PackedBatch: the same [B, L] data
            old, ref = self._reference_logprobs(batches, single, noise, tally)
        gen_tokens = self._tokens(batches)
        with prof.phase("update"):
            inp.model.train()
            for it in range(cfg.num_iterations):
                for u in range(n_updates):
                    group = list(range(len(batches)))[u * cfg.gradient_accumulation_steps:
                                                      (u + 1) * cfg.gradient_accumulation_steps]
                    norm_tokens = (gen_tokens / n_updates if cfg.token_normalizer == "generation"
                                   else self._tokens([batches[k] for k in group]))
                    self._one_update(batches, group, old, ref, norm_tokens, first_pass=it == 0, single=single,
                                     noise=noise, tally=tally)
            inp.model.eval()
        return self._metrics(tally, cfg.num_iterations * n_updates)

    def _n_updates(self, n: int) -> int:
        """Optimizer updates this step: the ranks step together, as many as the rank with the most completions."""
        cfg, D = self.inp.cfg, self.inp.dist
        return int(D.max(max(1, math.ceil(math.ceil(n / cfg.per_device_train_batch_size) /
                                          cfg.gradient_accumulation_steps)), self.inp.device))

    def _reference_logprobs(self, batches, single: bool, noise: "_Noise", tally: "_Tally"):
        """The sampling policy's logprobs before any update (PPO's old policy; not needed for one update of
        one pass, whose ratio is 1 at its own detached logprobs) and the KL reference's (adapters off)."""
        inp = self.inp
        old, ref = [None] * len(batches), None
        with noise():
            if not single:
                for k, b in enumerate(batches):
                    lp, en = self.logprobs(b, grad=False)
                    old[k] = lp
                    tally.ent.append(en[b.mask.to(inp.device)])
        if inp.cfg.loss.beta:
            with adapters_disabled(inp.model):
                ref = [self.logprobs(b, grad=False)[0] for b in batches]
        return old, ref

    def _loss_mask(self, b):
        """The tokens the loss counts: mask_truncated_completions drops the cut completions."""
        mask = b.mask.to(self.inp.device)
        return mask & ~b.truncated.to(self.inp.device)[:, None] if self.inp.cfg.mask_truncated_completions else mask

    def _tokens(self, batches) -> float:
        """dapo's (and cispo's) token normaliser over all ranks: gradients are averaged over the ranks, so each
        rank divides its token sum by (tokens / world size). "generation" takes the generation batch's tokens /
        its updates (TRL >= 1.9.2, every update of a generation weighs its tokens alike), "update" each update's
        own; both count only the loss mask's tokens (TRL 1.9.0's fix)."""
        D = self.inp.dist
        return D.sum(sum(int(self._loss_mask(b).sum()) for b in batches), self.inp.device) / D.world

    def _one_update(self, batches, group, old, ref, norm_tokens, *, first_pass, single, noise, tally):
        """One optimizer update: the losses and backward of the micro-batches in `group`, then the step."""
        inp = self.inp
        cfg, D = inp.cfg, inp.dist
        # the other losses (and the entropy bonus) average over the update's micro-batches, all
        # ranks' (a rank with fewer or none must not weigh its own more): their count / world size
        n_micro = D.sum(len(group), inp.device) / D.world
        upd_loss, bad = 0.0, None
        # top_entropy_quantile takes its threshold over every rank's micro-batch at the same place
        # (TRL); a rank with fewer micro-batches joins the rest of the gathers with none
        slots = int(D.max(len(group), inp.device)) if cfg.loss.top_entropy_quantile < 1.0 and D.world > 1 else 0
        for k in group:
            with noise():  # forward and backward see the same weights
                loss, st = self._micro_batch_loss(batches[k], old[k], ref[k] if ref is not None else None,
                                                  norm_tokens, n_micro, slots, first_pass, single, tally)
                if not torch.isfinite(loss.detach()):
                    bad = f"loss is {float(loss.detach())}"
                    continue  # no backward; all ranks learn of it below and stop together
                loss.backward()
                upd_loss += float(loss.detach())
            tally.add_loss_stats(st)
        for _ in range(slots - len(group)):
            D.gather(torch.zeros(0))
        tally.grad_norm.append(inp.optimizer_step(bad))
        tally.loss.append(upd_loss)

    def _micro_batch_loss(self, b, old_k, ref_k, norm_tokens, n_micro, slots, first_pass, single, tally):
        """The loss of one micro-batch (with gradient) and its statistics; on the first pass also how far the
        pre-update policy is from the rollout's numbers."""
        inp = self.inp
        cfg, dev = inp.cfg, inp.device
        lp, en = self.logprobs(b, grad=True)
        old_k = lp.detach() if single else old_k
        if first_pass:  # once per micro-batch: the pre-update policy vs the rollout's numbers
            mask = b.mask.to(dev)
            tally.add_mismatch((old_k - b.rollout_logprobs)[mask])
            if single:
                tally.ent.append(en[mask].detach())
        lmask = self._loss_mask(b)
        isw = None
        if cfg.importance_sampling_correction:
            isw = rollout_is_weights(old_k, b.rollout_logprobs, lmask, cfg.importance_sampling_mode,
                                     cfg.importance_sampling_cap, cfg.importance_sampling_cap_min)
            tally.add_is_weights(isw.expand_as(lmask)[lmask], lmask.any())
        pool = None  # None: this micro-batch's tokens, all there are on one rank
        if slots:
            pool = torch.cat([t.to(dev) for t in inp.dist.gather(en.detach()[lmask].cpu())])
        return policy_loss(lp, old_k, b.advantages.to(dev), lmask, cfg.loss, ref_logp=ref_k, is_weights=isw,
                           norm_tokens=norm_tokens, accumulation=n_micro, entropies=en, entropy_pool=pool,
                           rollout_logp=b.rollout_logprobs)

    def _metrics(self, t: "_Tally", updates: int) -> dict:
        """The update's metrics over every rank."""
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        allm = torch.cat(t.mism) if t.mism else torch.zeros(0)
        ent_t = torch.cat(t.ent) if t.ent else torch.zeros(0)
        rat = torch.cat(t.ratios).double() if t.ratios else torch.zeros(0, dtype=torch.float64)
        ratio = (float(rat.sum()), rat.numel(), float(rat.min()) if rat.numel() else math.inf,
                 float(rat.max()) if rat.numel() else -math.inf)
        parts = self.inp.dist.gather({"ratio": ratio,
                                      "loss": t.loss, "clip": t.clip_fraction, "kl": t.kl,
                                      "emask": t.entropy_mask_fraction, "clip_low": t.clip_low,
                                      "clip_high": t.clip_high, "is_min": t.is_min, "is_max": t.is_max,
                                      "is": t.is_mean, "ent": (float(ent_t.sum()), ent_t.numel()),
                                      "mism": (float(allm.sum()), allm.numel()), "mism_max": t.mism_max})
        # each rank's update loss is its share of the global mean (gradients are averaged): average them
        losses = [mean([q["loss"][i] for q in parts]) for i in range(len(t.loss))]
        cat = lambda k: [x for q in parts for x in q[k]]  # noqa: E731
        tot = lambda k: (sum(q[k][0] for q in parts), sum(q[k][1] for q in parts))  # noqa: E731
        (es, en), (ms, mn) = tot("ent"), tot("mism")
        out = {"loss": mean(losses), "clip_fraction": mean(cat("clip")), "grad_norm": mean(t.grad_norm),
               "entropy": es / en if en else 0.0,
               "logprob_mismatch_mean": ms / mn if mn else 0.0,
               "logprob_mismatch_max": max(q["mism_max"] for q in parts), "updates": updates}
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

class _Noise:
    """The step's AQN noise for training passes (aqn_in_training): the same Z as the rollout's, entered per pass."""

    def __init__(self, inp: UpdateInputs, sigma: float, seed: int):
        self.on = inp.cfg.aqn_in_training and inp.aqn is not None and sigma > 0
        self.aqn, self.sigma, self.seed = inp.aqn, sigma, seed

    def __call__(self):
        return self.aqn.applied(self.sigma, self.seed) if self.on else contextlib.nullcontext()


@dataclass
class _Tally:
    """What a step's updates collect across their micro-batches, for its metrics (this rank's)."""
    loss: list = field(default_factory=list)          # an update's summed micro-batch losses
    grad_norm: list = field(default_factory=list)
    clip_fraction: list = field(default_factory=list)
    kl: list = field(default_factory=list)
    entropy_mask_fraction: list = field(default_factory=list)
    clip_low: list = field(default_factory=list)
    clip_high: list = field(default_factory=list)
    is_mean: list = field(default_factory=list)       # a micro-batch's mean rollout-correction weight
    is_min: list = field(default_factory=list)
    is_max: list = field(default_factory=list)
    ent: list = field(default_factory=list)           # token entropies of the pre-update policy
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

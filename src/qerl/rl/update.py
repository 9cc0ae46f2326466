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
from dataclasses import dataclass
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
        """Train on `batch`, sampled under AQN noise (sigma, seed): metrics of the update."""
        inp = self.inp
        cfg, dev, D, prof, model = inp.cfg, inp.device, inp.dist, inp.profiler, inp.model
        N = len(batch)
        # the ranks step the optimizer together: as many updates as the rank with the most completions
        n_updates = int(D.max(max(1, math.ceil(math.ceil(N / cfg.per_device_train_batch_size) /
                                               cfg.gradient_accumulation_steps)), dev))
        single = cfg.num_iterations == 1 and n_updates == 1

        def noise_train():  # the step's noise, the same Z as the rollout's, entered per pass
            if cfg.aqn_in_training and inp.aqn is not None and sigma > 0:
                return inp.aqn.applied(sigma, seed)
            return contextlib.nullcontext()

        with prof.phase("logprob"):
            batches = self.micro_batches(batch)  # MicroBatch or packing.PackedBatch: the same [B, L] data
            old, ref, ent = [None] * len(batches), None, []
            with noise_train():
                if not single:  # the sampling policy's logprobs before any update (PPO's old policy)
                    for k, b in enumerate(batches):
                        lp, en = self.logprobs(b, grad=False)
                        old[k] = lp
                        ent.append(en[b.mask.to(dev)])
            if cfg.loss.beta:
                with adapters_disabled(model):
                    ref = [self.logprobs(b, grad=False)[0] for b in batches]

        def loss_mask(b):  # the tokens the loss counts: mask_truncated_completions drops the cut completions
            mask = b.mask.to(dev)
            return mask & ~b.truncated.to(dev)[:, None] if cfg.mask_truncated_completions else mask

        # dapo's (and cispo's) token normaliser, all ranks: gradients are averaged over the ranks, so each
        # rank divides its token sum by (tokens / world size). "generation": the generation batch's tokens
        # / its updates (TRL >= 1.9.2, every update of a generation weighs its tokens alike); "update":
        # each update's own tokens. Both count only the loss mask's tokens (TRL 1.9.0's fix).
        gen_tokens = D.sum(sum(int(loss_mask(b).sum()) for b in batches), dev) / D.world

        with prof.phase("update"):
            model.train()
            stats = {"clip_fraction": [], "kl": [], "loss": [], "grad_norm": [], "entropy_mask_fraction": [],
                     "clip_low": [], "clip_high": [], "is_min": [], "is_max": []}
            mism, mism_max, is_mean, ratios = [], 0.0, [], []
            for it in range(cfg.num_iterations):
                for u in range(n_updates):
                    group = list(range(len(batches)))[u * cfg.gradient_accumulation_steps:
                                                      (u + 1) * cfg.gradient_accumulation_steps]
                    if cfg.token_normalizer == "generation":
                        norm_tokens = gen_tokens / n_updates
                    else:
                        norm_tokens = D.sum(sum(int(loss_mask(batches[k]).sum()) for k in group), dev) / D.world
                    # the other losses (and the entropy bonus) average over the update's micro-batches, all
                    # ranks' (a rank with fewer or none must not weigh its own more): their count / world size
                    n_micro = D.sum(len(group), dev) / D.world
                    upd_loss, bad = 0.0, None
                    # top_entropy_quantile takes its threshold over every rank's micro-batch at the same place
                    # (TRL); a rank with fewer micro-batches joins the rest of the gathers with none
                    slots = int(D.max(len(group), dev)) if cfg.loss.top_entropy_quantile < 1.0 and D.world > 1 else 0
                    for k in group:
                        b = batches[k]
                        mask = b.mask.to(dev)
                        with noise_train():  # forward and backward see the same weights
                            lp, en = self.logprobs(b, grad=True)
                            old_k = lp.detach() if single else old[k]
                            if it == 0:  # once per micro-batch: the pre-update policy vs the rollout's numbers
                                diff = (old_k - b.rollout_logprobs)[mask]
                                d = diff.abs()
                                if d.numel():
                                    mism.append(d)
                                    mism_max = max(mism_max, float(d.max()))
                                    ratios.append(diff.detach().float().exp())  # policy / behaviour, a token
                                if single:
                                    ent.append(en[mask].detach())
                            lmask = loss_mask(b)
                            isw = None
                            if cfg.importance_sampling_correction:
                                isw = rollout_is_weights(old_k, b.rollout_logprobs, lmask,
                                                         cfg.importance_sampling_mode, cfg.importance_sampling_cap,
                                                         cfg.importance_sampling_cap_min)
                                w = isw.expand_as(lmask)[lmask]
                                is_mean.append(float(w.mean()) if lmask.any() else 1.0)
                                if w.numel():  # TRL's sampling/importance_sampling_ratio/min and /max
                                    stats["is_min"].append(float(w.min()))
                                    stats["is_max"].append(float(w.max()))
                            pool = None  # None: this micro-batch's tokens, all there are on one rank
                            if slots:
                                pool = torch.cat([t.to(dev) for t in D.gather(en.detach()[lmask].cpu())])
                            loss, st = policy_loss(lp, old_k, b.advantages.to(dev), lmask, cfg.loss,
                                                   ref_logp=ref[k] if ref is not None else None, is_weights=isw,
                                                   norm_tokens=norm_tokens, accumulation=n_micro, entropies=en,
                                                   entropy_pool=pool, rollout_logp=b.rollout_logprobs)
                            if not torch.isfinite(loss.detach()):
                                bad = f"loss is {float(loss.detach())}"
                                continue  # no backward; all ranks learn of it below and stop together
                            loss.backward()
                            upd_loss += float(loss.detach())
                        stats["clip_fraction"].append(st["clip_fraction"])
                        if "entropy_mask_fraction" in st:
                            stats["entropy_mask_fraction"].append(st["entropy_mask_fraction"])
                        if "kl" in st:
                            stats["kl"].append(st["kl"])
                        if "clip_low" in st:
                            stats["clip_low"].append(st["clip_low"])
                            stats["clip_high"].append(st["clip_high"])
                    for _ in range(slots - len(group)):
                        D.gather(torch.zeros(0))
                    stats["grad_norm"].append(inp.optimizer_step(bad))
                    stats["loss"].append(upd_loss)
            model.eval()
        return self._metrics(stats, mism, mism_max, is_mean, ent, ratios, cfg.num_iterations * n_updates)

    def _metrics(self, stats, mism, mism_max, is_mean, ent, ratios, updates) -> dict:
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        allm = torch.cat(mism) if mism else torch.zeros(0)
        ent_t = torch.cat(ent) if ent else torch.zeros(0)
        rat = torch.cat(ratios).double() if ratios else torch.zeros(0, dtype=torch.float64)
        ratio = (float(rat.sum()), rat.numel(), float(rat.min()) if rat.numel() else math.inf,
                 float(rat.max()) if rat.numel() else -math.inf)
        parts = self.inp.dist.gather({"ratio": ratio,
                                      "loss": stats["loss"], "clip": stats["clip_fraction"], "kl": stats["kl"],
                                      "emask": stats["entropy_mask_fraction"], "clip_low": stats["clip_low"],
                                      "clip_high": stats["clip_high"], "is_min": stats["is_min"],
                                      "is_max": stats["is_max"],
                                      "is": is_mean, "ent": (float(ent_t.sum()), ent_t.numel()),
                                      "mism": (float(allm.sum()), allm.numel()), "mism_max": mism_max})
        # each rank's update loss is its share of the global mean (gradients are averaged): average them
        losses = [mean([q["loss"][i] for q in parts]) for i in range(len(stats["loss"]))]
        cat = lambda k: [x for q in parts for x in q[k]]  # noqa: E731
        tot = lambda k: (sum(q[k][0] for q in parts), sum(q[k][1] for q in parts))  # noqa: E731
        (es, en), (ms, mn) = tot("ent"), tot("mism")
        out = {"loss": mean(losses), "clip_fraction": mean(cat("clip")), "grad_norm": mean(stats["grad_norm"]),
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

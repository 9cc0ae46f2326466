"""The policy update: micro-batches of completions -> their logprobs -> a loss -> backward -> optimizer updates.

The update owns what every trainer's does alike: micro-batches (padded, or packed with the prompt once:
train/packing.py), chunked logprobs, the old policy's logprobs when a batch feeds several updates (PPO's),
the token normaliser, gradient accumulation, the check of a non-finite loss, and the hand-off of each
update to the trainer's optimizer step (rank averaging, clipping, the step, the schedule: train/optim.py),
which it does not own. What is minimised comes in as an `Objective`: GRPO's policy loss with its settings
(rl/objective.py), SFT's token NLL (sft/loss.py). Timed as `logprob` (passes before the updates) and `update`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..device_memory import release_host_memory
from ..layers import unfused_lora
from .batch import MicroBatch, RolloutBatch, micro_batches
from .logprobs import completion_logprobs
from .packing import FLEX, PackedBatch, attention_kind, has_sliding_window, packed_micro_batches, use_flex_attention


@dataclass(frozen=True)
class UpdateSettings:
    """What the update reads of a configuration, fixed for a run (the loss's own settings are its objective's)."""
    per_device_train_batch_size: int
    gradient_accumulation_steps: int = 1
    num_iterations: int = 1
    token_normalizer: str = "generation"
    packed_update: bool = True
    logprob_chunk_size: int | None = None
    temperature: float = 1.0
    mask_truncated_completions: bool = False


@dataclass(frozen=True)
class UpdateInputs:
    """What the update reads that does not change from step to step."""
    model: torch.nn.Module      # the live policy (trained in place)
    cfg: UpdateSettings
    device: torch.device
    dtype: torch.dtype
    pad_id: int
    dist: object                # train.distributed.Dist
    profiler: object            # train.profiling.Profiler: times "logprob" and "update"
    # the trainer's optimizer step: (why the update's loss is bad, or None) -> gradient norm; averages the
    # gradients over the ranks, clips, steps the optimizer and the schedule; raises TrainingError instead
    optimizer_step: Callable[[str | None], float]


@dataclass
class MicroLoss:
    """One micro-batch's inputs to the objective's loss."""
    batch: MicroBatch | PackedBatch
    logp: torch.Tensor          # [B, L] with gradient
    entropies: torch.Tensor     # [B, L] (with gradient when the objective asks for it)
    old_logp: torch.Tensor      # [B, L] the policy before this step's updates (logp detached when single)
    mask: torch.Tensor          # [B, L] bool: the tokens the loss counts
    norm_tokens: float          # the token normaliser's count (train/update.py `_tokens`)
    accumulation: float         # the update's micro-batches, all ranks' / world size
    index: int                  # the micro-batch's place in the step's batches
    first_pass: bool            # the first of num_iterations passes
    single: bool                # one update of one pass: old_logp is logp's own value


class Objective:
    """What the update minimises. The defaults add nothing: an objective overrides `loss` and what it needs."""
    entropy_grad: bool = False  # the loss differentiates the per-token entropies (an entropy bonus)

    def start(self, *step) -> None:
        """Take the step's own arguments (GRPO: its AQN noise level and seed)."""

    def scope(self):
        """What each forward (and its backward) runs under (GRPO: the step's AQN noise in training)."""
        return contextlib.nullcontext()

    def prepare(self, update: "PolicyUpdate", batches: list, single: bool) -> None:
        """Passes before the updates, in the `logprob` phase (GRPO: the KL reference's logprobs)."""

    def begin_update(self, n_micro: int) -> None:
        """An optimizer update of `n_micro` micro-batches on this rank starts."""

    def loss(self, x: MicroLoss) -> tuple[torch.Tensor, dict]:
        raise NotImplementedError

    def end_update(self, n_micro: int) -> None:
        """The update's micro-batches are done (collectives the other ranks still wait for go here)."""

    def metrics(self, dist) -> dict:
        """The step's statistics of the loss over every rank (after the generic loss, grad_norm, entropy)."""
        return {}


class PolicyUpdate:
    def __init__(self, inputs: UpdateInputs, objective: Objective):
        self.inp = inputs
        self.objective = objective
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
            # the entropies are statistics (and the top-entropy selection's input), detached, unless the
            # objective differentiates them
            return completion_logprobs(self.inp.model, **mb.model_inputs(), temperature=cfg.temperature,
                                       chunk=cfg.logprob_chunk_size, entropy_grad=grad and self.objective.entropy_grad)

    def __call__(self, batch: RolloutBatch, *step) -> dict:
        """Train on `batch`; `step`: the objective's arguments for this step (GRPO: sigma, seed). Metrics of the update.

        Named steps: plan the updates, the reference passes (old policy, the objective's own), the token
        normaliser, then each update (its micro-batches' losses and backward, the optimizer step)."""
        inp, obj = self.inp, self.objective
        cfg, prof = inp.cfg, inp.profiler
        obj.start(*step)
        n_updates = self._n_updates(len(batch))
        single = cfg.num_iterations == 1 and n_updates == 1
        tally = _Tally()
        with prof.phase("logprob"):
            batches = self.micro_batches(batch)  # MicroBatch or packing.PackedBatch: the same [B, L] data
            old = self._old_logprobs(batches, single, tally)
            obj.prepare(self, batches, single)
        gen_tokens = self._tokens(batches)
        if inp.device.type == "cpu":  # the rollout's and logprob pass's freed tensors, before the update's
            release_host_memory()
        with prof.phase("update"):
            inp.model.train()
            for it in range(cfg.num_iterations):
                for u in range(n_updates):
                    group = list(range(len(batches)))[u * cfg.gradient_accumulation_steps:
                                                      (u + 1) * cfg.gradient_accumulation_steps]
                    norm_tokens = (gen_tokens / n_updates if cfg.token_normalizer == "generation"
                                   else self._tokens([batches[k] for k in group]))
                    self._one_update(batches, group, old, norm_tokens, first_pass=it == 0, single=single, tally=tally)
            inp.model.eval()
        return self._metrics(tally, cfg.num_iterations * n_updates)

    def _n_updates(self, n: int) -> int:
        """Optimizer updates this step: the ranks step together, as many as the rank with the most completions."""
        cfg, D = self.inp.cfg, self.inp.dist
        return int(D.max(max(1, math.ceil(math.ceil(n / cfg.per_device_train_batch_size) /
                                          cfg.gradient_accumulation_steps)), self.inp.device))

    def _old_logprobs(self, batches, single: bool, tally: "_Tally") -> list:
        """The sampling policy's logprobs before any update (PPO's old policy; not needed for one update of
        one pass, whose ratio is 1 at its own detached logprobs), with the pre-update entropies."""
        old = [None] * len(batches)
        if single:
            return old
        with self.objective.scope():
            for k, b in enumerate(batches):
                lp, en = self.logprobs(b, grad=False)
                old[k] = lp
                tally.ent.append(en[b.mask.to(self.inp.device)])
        return old

    def loss_mask(self, b):
        """The tokens the loss counts: mask_truncated_completions drops the cut completions."""
        mask = b.mask.to(self.inp.device)
        return mask & ~b.truncated.to(self.inp.device)[:, None] if self.inp.cfg.mask_truncated_completions else mask

    def _tokens(self, batches) -> float:
        """dapo's (and cispo's, and the NLL's) token normaliser over all ranks: gradients are averaged over the
        ranks, so each rank divides its token sum by (tokens / world size). "generation" takes the generation
        batch's tokens / its updates (TRL >= 1.9.2, every update of a generation weighs its tokens alike),
        "update" each update's own; both count only the loss mask's tokens (TRL 1.9.0's fix)."""
        D = self.inp.dist
        return D.sum(sum(int(self.loss_mask(b).sum()) for b in batches), self.inp.device) / D.world

    def _one_update(self, batches, group, old, norm_tokens, *, first_pass, single, tally):
        """One optimizer update: the losses and backward of the micro-batches in `group`, then the step."""
        inp, obj = self.inp, self.objective
        D = inp.dist
        # the other losses (and the entropy bonus) average over the update's micro-batches, all
        # ranks' (a rank with fewer or none must not weigh its own more): their count / world size
        n_micro = D.sum(len(group), inp.device) / D.world
        upd_loss, bad = 0.0, None
        obj.begin_update(len(group))
        for k in group:
            b = batches[k]
            with obj.scope():  # forward and backward see the same weights
                lp, en = self.logprobs(b, grad=True)
                if first_pass and single:  # the pre-update entropies are this pass's own
                    tally.ent.append(en[b.mask.to(inp.device)].detach())
                loss, st = obj.loss(MicroLoss(b, lp, en, lp.detach() if single else old[k], self.loss_mask(b),
                                              norm_tokens, n_micro, k, first_pass, single))
                if not torch.isfinite(loss.detach()):
                    bad = f"loss is {float(loss.detach())}"
                    continue  # no backward; all ranks learn of it below and stop together
                loss.backward()
                if inp.device.type == "cpu":  # the micro-batch's freed activations back to the OS (device_memory)
                    release_host_memory()
                upd_loss += float(loss.detach())
        obj.end_update(len(group))
        tally.grad_norm.append(inp.optimizer_step(bad))
        tally.loss.append(upd_loss)

    def _metrics(self, t: "_Tally", updates: int) -> dict:
        """The update's metrics over every rank: the loss, gradient norm and entropy, then the objective's."""
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        ent_t = torch.cat(t.ent) if t.ent else torch.zeros(0)
        parts = self.inp.dist.gather({"loss": t.loss, "ent": (float(ent_t.sum()), ent_t.numel())})
        # each rank's update loss is its share of the global mean (gradients are averaged): average them
        losses = [mean([q["loss"][i] for q in parts]) for i in range(len(t.loss))]
        es, en = sum(q["ent"][0] for q in parts), sum(q["ent"][1] for q in parts)
        out = {"loss": mean(losses), "grad_norm": mean(t.grad_norm), "entropy": es / en if en else 0.0,
               "updates": updates}
        out.update(self.objective.metrics(self.inp.dist))
        return out


@dataclass
class _Tally:
    """What a step's updates collect for the generic metrics (this rank's)."""
    loss: list = field(default_factory=list)          # an update's summed micro-batch losses
    grad_norm: list = field(default_factory=list)
    ent: list = field(default_factory=list)           # token entropies of the pre-update policy

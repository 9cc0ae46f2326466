"""The optimizer, its learning-rate schedule (counted in optimizer updates) and the step that applies an
update's gradients."""

from __future__ import annotations

import math
from typing import Callable

import torch

from .config import TrainConfig


def warmup_steps(ratio: float, total: int) -> int:
    """transformers' warm-up of warmup_ratio: that fraction of the run's optimizer updates, rounded up
    (TrainingArguments.get_warmup_steps); one rule for qerl.trl's GRPO and SFT and `qerl sft` of a TRL file."""
    return math.ceil(ratio * total)


def lr_lambda(cfg: TrainConfig, total: int):
    def f(u: int) -> float:
        if u < cfg.warmup_steps:
            return (u + 1) / cfg.warmup_steps
        t = (u - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        if cfg.lr_scheduler_type == "linear":
            return max(0.0, 1 - t)
        if cfg.lr_scheduler_type == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
        return 1.0

    return f


class MasterWeights(torch.optim.Optimizer):
    """An optimizer over fp32 master copies of low-precision trainable tensors.

    bf16 keeps 8 significant bits: an Adam step (~lr) below half the spacing at a factor's magnitude
    rounds away (|A| ~ 1/sqrt(in) at r32: at lr 1e-5 most of A cannot move). Where the factors must
    stay in the compute dtype (the CUDA kernels read the adapters there), `inner` steps fp32 copies
    and each step is copied into the live tensors in place (fused groups hold views of them).
    The masters travel in state_dict() as a "master" entry per parameter, so a checkpoint restores
    them exactly; param_groups are the inner optimizer's (the LR schedule drives it)."""

    def __init__(self, params, make_inner):
        self.live = [p for p in params]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.live]
        self.inner = make_inner(self.masters)
        # no super().__init__: the groups, defaults and state are the inner optimizer's own
        self.defaults, self.param_groups, self.state = self.inner.defaults, self.inner.param_groups, self.inner.state
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = {}, {}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}

    @torch.no_grad()
    def step(self, closure=None):
        for m, p in zip(self.masters, self.live):
            m.grad = None if p.grad is None else p.grad.float()
        loss = self.inner.step(closure)
        for m, p in zip(self.masters, self.live):
            p.copy_(m)
        return loss

    def zero_grad(self, set_to_none: bool = True):
        self.inner.zero_grad(set_to_none)
        for p in self.live:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def state_dict(self):
        sd = self.inner.state_dict()
        state = dict(sd["state"])
        for i, m in enumerate(self.masters):
            state[i] = {**state.get(i, {}), "master": m.detach().clone()}
        return {**sd, "state": state}

    @torch.no_grad()
    def load_state_dict(self, sd):
        # checked whole before anything changes: a refused state leaves the masters as they were
        if len(sd["state"]) != len(self.masters):
            raise ValueError(f"optimizer state holds {len(sd['state'])} master copies, the model "
                             f"{len(self.masters)} trainable tensors")
        for k, v in sd["state"].items():
            if "master" not in v or not 0 <= int(k) < len(self.masters):
                raise ValueError(f"optimizer state of parameter {k} lacks its fp32 master copy "
                                 "(saved without lora_dtype: float32?)")
        state = {}
        for k, v in sd["state"].items():
            self.masters[int(k)].copy_(v["master"])
            rest = {n: t for n, t in v.items() if n != "master"}
            if rest:
                state[int(k)] = rest
        self.inner.load_state_dict({**sd, "state": state})
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        for m, p in zip(self.masters, self.live):
            p.copy_(m)


def make_optimizer(cfg: TrainConfig, params, device: torch.device, master_weights: bool = False):
    """(optimizer, its name). master_weights: step fp32 copies of the (low-precision) params."""
    if master_weights:
        made = {}

        def inner(masters):
            made["opt"], made["name"] = make_optimizer(cfg, masters, device)
            return made["opt"]

        opt = MasterWeights(params, inner)
        return opt, made["name"] + " on fp32 master weights"
    kw = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
              weight_decay=cfg.weight_decay)
    if cfg.optim == "adamw_8bit":
        if device.type == "cuda":
            try:
                import bitsandbytes as bnb

                return bnb.optim.AdamW8bit(params, **kw), "adamw_8bit (bitsandbytes)"
            except Exception as e:  # noqa: BLE001
                why = f"bitsandbytes unavailable ({type(e).__name__})"
        else:
            why = "8-bit AdamW needs CUDA"
        print(f"qerl: optim adamw_8bit: {why}; using torch AdamW (fp32 states)")
    return torch.optim.AdamW(params, **kw), "adamw_torch"


class TrainingError(RuntimeError):
    pass


def step_optimizer(params, optimizer, scheduler, dist, device, max_grad_norm: float, bad: str | None,
                   bad_step: Callable[[str], str]) -> float:
    """Apply one update's gradients (the update phase computed them): average over the ranks, clip, step
    the optimizer and the schedule. A non-finite loss on any rank (`bad`) or gradient norm discards them
    and raises TrainingError(bad_step(what)). Returns the gradient norm. (GRPO's and SFT's trainers.)"""
    if dist.max(1.0 if bad else 0.0, device):
        optimizer.zero_grad(set_to_none=True)
        raise TrainingError(bad_step(bad or "the loss is not finite on another rank"))
    dist.mean_grads_(params)
    gn = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    if not torch.isfinite(gn):
        optimizer.zero_grad(set_to_none=True)
        raise TrainingError(bad_step(f"gradient norm is {float(gn)}"))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(gn)

"""The optimizer and its learning-rate schedule (counted in optimizer updates)."""

from __future__ import annotations

import math

import torch

from .config import GRPOConfig


def lr_lambda(cfg: GRPOConfig, total: int):
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


def make_optimizer(cfg: GRPOConfig, params, device: torch.device):
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

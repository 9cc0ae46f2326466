"""Adaptive Quantization Noise (AQN): scheduled Gaussian noise folded into RMSNorm weights.

Per step, every RMSNorm that feeds LoRA/quantized projections gets w + Z, Z ~ N(0, sigma^2) of
the layer's input size (input_layernorm -> q/k/v, post_attention_layernorm -> gate/up): row-wise
multiplicative noise (1 + Z/w) on those weights with no change to the 4-bit kernels
(../shared/docs/paper.md). The weights are restored from an exact copy afterwards, so the noise
never accumulates into a random walk. Works for every weight format, bf16 included.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

# which norm feeds which projections (Llama / Qwen2 / Qwen3 decoder layers)
NORM_FEEDS = {"input_layernorm": ("q_proj", "k_proj", "v_proj"), "post_attention_layernorm": ("gate_proj", "up_proj")}


def sigma_at(step: int, total_steps: int, stages: int = 10, sigma_start: float = 1e-2, sigma_end: float = 5e-4,
             schedule: str = "exponential") -> tuple[float, int]:
    """(sigma, stage) for a 0-based step. K stages split the steps evenly; stage 0 has sigma 0;
    stages 1..K-1 decay from sigma_start to sigma_end with t = (k-1)/(K-2):
      exponential  sigma_start * (sigma_end/sigma_start)^t            (the paper's default)
      linear       sigma_start + (sigma_end - sigma_start) * t
      cosine       sigma_end + (sigma_start - sigma_end) * (1 + cos(pi t)) / 2
      logarithmic  sigma_start - (sigma_start - sigma_end) * ln(1 + 9t) / ln(10)   (fast early decay)
    """
    if not 0 <= step < total_steps:
        raise ValueError(f"step {step} outside 0..{total_steps - 1}")
    stage = min(step * stages // total_steps, stages - 1)
    if stage == 0:
        return 0.0, 0
    t = (stage - 1) / (stages - 2) if stages > 2 else 0.0
    if schedule == "exponential":
        s = sigma_start * (sigma_end / sigma_start) ** t
    elif schedule == "linear":
        s = sigma_start + (sigma_end - sigma_start) * t
    elif schedule == "cosine":
        s = sigma_end + (sigma_start - sigma_end) * (1 + math.cos(math.pi * t)) / 2
    elif schedule == "logarithmic":
        s = sigma_start - (sigma_start - sigma_end) * math.log(1 + 9 * t) / math.log(10)
    else:
        raise ValueError(f"unknown AQN schedule {schedule!r}")
    return s, stage


def noised_norms(model: nn.Module) -> dict[str, nn.Parameter]:
    """name -> weight of each decoder-layer RMSNorm that feeds a LoRA (or quantized) projection."""
    out = {}
    for name, mod in model.named_modules():
        for norm_name, projs in NORM_FEEDS.items():
            norm = getattr(mod, norm_name, None)
            if norm is None or getattr(norm, "weight", None) is None:
                continue
            children = [getattr(getattr(mod, a, None), p, None) for a in ("self_attn", "mlp") for p in projs]
            if any(c is not None and (getattr(c, "r", 0) or hasattr(c, "fmt")) for c in children):
                out[f"{name}.{norm_name}" if name else norm_name] = norm.weight
    return out


class AQN:
    """Draws the step's noise and applies it around a block: `with aqn.applied(sigma, seed): ...`."""

    def __init__(self, model: nn.Module):
        self.weights = noised_norms(model)
        # RMS of the change actually applied: in bf16, w + Z rounds to a 2^-7 grid near |w| = 1, so
        # noise much below ~4e-3 mostly vanishes; this says how much of sigma survived.
        self.last_effective_sigma = 0.0
        if not self.weights:
            raise ValueError("AQN: found no RMSNorm feeding q/k/v or gate/up projections in this model")

    @contextlib.contextmanager
    def applied(self, sigma: float, seed: int):
        if sigma <= 0:
            self.last_effective_sigma = 0.0
            yield
            return
        g = torch.Generator(device="cpu").manual_seed(seed)
        saved = {}
        try:
            with torch.no_grad():
                for name, w in self.weights.items():
                    saved[name] = w.detach().clone()
                    z = torch.randn(w.shape, generator=g, dtype=torch.float32).mul_(sigma)
                    w.add_(z.to(device=w.device, dtype=w.dtype))
                sq = sum(float((w - saved[n]).float().pow(2).sum()) for n, w in self.weights.items())
                self.last_effective_sigma = math.sqrt(sq / sum(w.numel() for w in self.weights.values()))
            yield
        finally:
            with torch.no_grad():
                for name, w0 in saved.items():
                    self.weights[name].copy_(w0)

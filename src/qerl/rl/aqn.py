"""Adaptive Quantization Noise (AQN): scheduled Gaussian noise on the RMSNorm weights.

Per step, every RMSNorm that feeds LoRA/quantized projections computes with w + Z, Z ~ N(0, sigma^2)
of the layer's input size (input_layernorm -> q/k/v, post_attention_layernorm -> gate/up): row-wise
multiplicative noise (1 + Z/w) on those weights with no change to the 4-bit kernels
(../shared/docs/paper.md).

Z is added in fp32 inside the norm (rollout/forward.py `rms_norm`), never folded into the stored
weight: in bf16, w + Z rounds back to w once sigma is below half an ulp of w (~2e-3 for |w| ~ 1), so
the schedule's late stages (sigma_end = 5e-4) would do nothing. The weights are never written: they
are bit-identical afterwards and the noise cannot accumulate into a random walk. Both paths see the
same Z: the engine's decode glue reads each norm's `aqn_noise` buffer, and while the noise is applied
the norm modules' forward (prefill, the trainer's passes) is the same `rms_norm` with that buffer.
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
    """Draws the step's noise and applies it around a block: `with aqn.applied(sigma, seed): ...`.

    Build it before the engine captures CUDA graphs: the graphs read the noise buffers made here."""

    def __init__(self, model: nn.Module):
        self.weights = noised_norms(model)  # never written: the noise lives in `self.noise`
        if not self.weights:
            raise ValueError("AQN: found no RMSNorm feeding q/k/v or gate/up projections in this model")
        self.norms = {name: model.get_submodule(name) for name in self.weights}
        self.eps = {name: _llama_eps(name, norm) for name, norm in self.norms.items()}
        # name -> the fp32 Z its norm adds to its weight: zeros outside `applied`, filled in place
        self.noise = {name: _noise_buffer(norm) for name, norm in self.norms.items()}
        # RMS of the fp32 noise of the last noisy block (0 after a noiseless one), measured on the
        # buffers the norms read: the trainer logs it as aqn_sigma_effective
        self.last_effective_sigma = 0.0

    @contextlib.contextmanager
    def applied(self, sigma: float, seed: int):
        if sigma <= 0:
            self.last_effective_sigma = 0.0
            yield
            return
        g = torch.Generator(device="cpu").manual_seed(seed)
        try:
            sq, n = 0.0, 0
            for name, norm in self.norms.items():
                buf = self.noise[name]
                buf.copy_(torch.randn(buf.shape, generator=g, dtype=torch.float32).mul_(sigma))
                sq, n = sq + float(buf.double().pow(2).sum()), n + buf.numel()
                norm.forward = _noisy_forward(norm, self.eps[name])
            self.last_effective_sigma = math.sqrt(sq / n)
            yield
        finally:
            for name, norm in self.norms.items():
                self.noise[name].zero_()
                norm.__dict__.pop("forward", None)  # back to the class's own forward


def _llama_eps(name: str, norm: nn.Module) -> float:
    from ..rollout.forward import _rms_eps

    eps = _rms_eps(norm)
    if eps is None:
        raise ValueError(f"AQN: {name} ({type(norm).__name__}) is not a Llama-style RMSNorm (weight * x / rms(x))")
    return eps


def _noise_buffer(norm: nn.Module) -> torch.Tensor:
    """A zero fp32 tensor beside the norm's weight, kept for the model's lifetime and reused by every
    noisy block (a plain attribute, not a buffer: no state_dict or checkpoint sees it)."""
    w, buf = norm.weight, getattr(norm, "aqn_noise", None)
    if buf is None or buf.shape != w.shape or buf.device != w.device:
        buf = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        norm.aqn_noise = buf
    return buf


def _noisy_forward(norm: nn.Module, eps: float):
    from ..rollout.forward import rms_norm

    def forward(x):
        return rms_norm(x, norm.weight, eps, norm.aqn_noise)
    return forward

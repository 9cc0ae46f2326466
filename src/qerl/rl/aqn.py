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
from dataclasses import asdict, dataclass

import torch
from torch import nn

# which norm feeds which projections (Llama / Qwen2 / Qwen3 decoder layers)
# (Phi-3 keeps q|k|v and gate|up fused in one projection each: qkv_proj, gate_up_proj)
NORM_FEEDS = {"input_layernorm": ("q_proj", "k_proj", "v_proj", "qkv_proj"),
              "post_attention_layernorm": ("gate_proj", "up_proj", "gate_up_proj")}


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
    elif schedule == "adaptive":
        raise ValueError("AQN schedule 'adaptive' has no fixed sigma per step: AdaptiveSigma gives it")
    else:
        raise ValueError(f"unknown AQN schedule {schedule!r}")
    return s, stage


ADAPTIVE_SIGNALS = ("entropy", "zero_variance")


@dataclass
class AdaptiveSigma:
    """Closed-loop AQN (aqn_schedule: adaptive): sigma follows a target for a signal measured on each
    step's rollout, instead of the fixed stage schedule.

      entropy        mean token entropy of the rollout (the trainer's rollout_entropy): below the
                     target, exploration is collapsing and sigma rises (AQN raises entropy, paper §3.3)
      zero_variance  fraction of groups whose rewards are all equal (no learning signal): above the
                     target, sigma rises

    An integral controller in log sigma: log sigma += gain * error, error the signal's relative distance
    from its target (sign chosen per signal as above), clipped to +-max_log_step a step (bounded
    rate) and sigma kept in [sigma_min, sigma_max]. Deterministic; its whole state is the plain
    numbers of this dataclass (`state_dict` / `load_state_dict` for checkpoints).
    """

    target: float | None  # None: the first measurement becomes the target (hold the starting level)
    signal: str = "entropy"
    sigma_min: float = 5e-4
    sigma_max: float = 1e-2
    gain: float = 1.0
    max_log_step: float = math.log(2.0)  # at most x2 or /2 a step
    sigma: float | None = None  # current sigma; None: starts at sigma_max (the schedule's first noisy stage)
    last_measured: float | None = None
    updates: int = 0

    def __post_init__(self):
        if self.signal not in ADAPTIVE_SIGNALS:
            raise ValueError(f"AdaptiveSigma: signal {self.signal!r} is not one of {ADAPTIVE_SIGNALS}")
        if not 0 < self.sigma_min <= self.sigma_max:
            raise ValueError(f"AdaptiveSigma: need 0 < sigma_min <= sigma_max, got {self.sigma_min}, {self.sigma_max}")
        if self.gain < 0 or self.max_log_step <= 0:
            raise ValueError("AdaptiveSigma: gain must be >= 0 and max_log_step > 0")
        if self.sigma is None:
            self.sigma = self.sigma_max
        self.sigma = min(max(self.sigma, self.sigma_min), self.sigma_max)

    def error(self, measured: float) -> float:
        """Relative distance from the target, > 0 when sigma should rise."""
        scale = max(abs(self.target), 1e-6)
        return (self.target - measured) / scale if self.signal == "entropy" else (measured - self.target) / scale

    def update(self, measured: float | None) -> float:
        """The sigma of the next step, after this step's measured signal (None or NaN: no measurement,
        sigma unchanged)."""
        if measured is None or not math.isfinite(measured):
            return self.sigma
        if self.target is None:  # the first step sets the level to hold; sigma stays where it started
            self.target = float(measured)
            self.last_measured = float(measured)
            self.updates += 1
            return self.sigma
        step = max(-self.max_log_step, min(self.max_log_step, self.gain * self.error(measured)))
        self.sigma = min(max(self.sigma * math.exp(step), self.sigma_min), self.sigma_max)
        self.last_measured = float(measured)
        self.updates += 1
        return self.sigma

    def log_row(self) -> dict:
        """What the trainer logs each step: sigma, its target and the measured signal."""
        return {"aqn_sigma": self.sigma, "aqn_target": self.target, "aqn_signal": self.last_measured}

    # the settings come from the config, not the checkpoint; a target set by the first step is state
    _STATE = ("sigma", "last_measured", "updates", "target")

    def state_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k in self._STATE}

    def load_state_dict(self, state: dict) -> None:
        unknown = set(state) - set(self._STATE)
        if unknown:
            raise ValueError(f"AdaptiveSigma: unknown state fields {sorted(unknown)}")
        self.sigma = float(state["sigma"])
        self.last_measured = None if state.get("last_measured") is None else float(state["last_measured"])
        self.updates = int(state.get("updates", 0))
        if self.target is None and state.get("target") is not None:  # set by the run's first step
            self.target = float(state["target"])
        self.__post_init__()  # a resumed run with narrower bounds keeps sigma inside them


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
    """eps of a Llama-form RMSNorm (its family's `llama_norm`, model/family.py); another norm is refused."""
    from ..model.family import llama_norm_classes

    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if type(norm).__name__ not in llama_norm_classes() or eps is None or getattr(norm, "weight", None) is None:
        raise ValueError(f"AQN: {name} ({type(norm).__name__}) is not a Llama-style RMSNorm (weight * x / rms(x))")
    return float(eps)


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

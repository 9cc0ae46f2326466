"""Adaptive Quantization Noise (AQN): scheduled Gaussian noise on the RMSNorm weights.

Per step, every RMSNorm that feeds LoRA/quantized projections computes with w + Z, Z ~ N(0, sigma^2)
of the layer's input size (the family's attention-input norm -> q/k/v, its MLP-input norm ->
gate/up): row-wise multiplicative noise (1 + Z/w) on those weights with no change to the 4-bit
kernels (../shared/docs/paper.md). Every family gets the same factor on the same projection inputs:
  - a Llama-form norm (w * x_hat.to(dtype)) or Olmo/gpt-oss's (w * x_hat).to(dtype): w + Z;
  - Gemma 3's (x_hat * (1 + w)): its effective weight is 1 + w, so 1 + w + Z (the factor 1 + Z/(1 + w));
  - no norm before the group (Olmo 2's post-norm layers): the attention's or MLP's input times (1 + Z),
    which is a norm of weight 1 noised; the paper's noise is relative to the input's scale, which a
    norm-less input keeps, so sigma means the same relative size as on a Llama model with w ~ 1.

Z is added in fp32 inside the norm (rollout/forward.py `rms_norm`, `noisy_norm`, `input_noise`), never
folded into the stored weight: in bf16, w + Z rounds back to w once sigma is below half an ulp of w
(~2e-3 for |w| ~ 1), so the schedule's late stages (sigma_end = 5e-4) would do nothing. The weights are never written: they
are bit-identical afterwards and the noise cannot accumulate into a random walk. Both paths see the
same Z: the engine's decode glue reads each site's `aqn_noise` buffer, and while the noise is applied
the site modules' forward (prefill, the trainer's passes) is the same arithmetic with that buffer.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..model.family import family_of_model
from ..rollout.forward import input_noise, noisy_norm, norm_eps, rms_norm

# the projections whose input AQN noises, by the block they sit in (Phi-3 keeps q|k|v and gate|up fused
# in one projection each: qkv_proj, gate_up_proj); an MoE block has none of them: its router and experts
# are left clean, as before every family ran AQN
FEEDS = {"self_attn": ("q_proj", "k_proj", "v_proj", "qkv_proj"), "mlp": ("gate_proj", "up_proj", "gate_up_proj")}


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


@dataclass(frozen=True)
class Site:
    """Where one noise vector enters: a norm feeding a projection group (form: the family's norm_form),
    or, where the family has no norm there, the block (self_attn or mlp) whose input is noised."""
    name: str           # the module's path
    module: nn.Module   # it holds the `aqn_noise` buffer and, while noise is applied, a noisy forward
    form: str           # "llama" | "offset" | "fp32" (a norm) | "input" (the block's input)
    eps: float | None   # a norm's eps


def noise_sites(model: nn.Module) -> list[Site]:
    """Each decoder layer's sites before a LoRA (or quantized) q/k/v and gate/up, read from the family's
    norms (model/family.py): attn_in feeds attention, mlp_in the MLP (Gemma 3's post_attention_layernorm
    is an output norm, so names alone would pick the wrong one)."""
    fam = family_of_model(model)
    out = []
    for i, layer in enumerate(model.model.layers):
        for block, norm_name in (("self_attn", fam.norms.attn_in), ("mlp", fam.norms.mlp_in)):
            mod = getattr(layer, block, None)
            children = [getattr(mod, p, None) for p in FEEDS[block]]
            if not any(c is not None and (getattr(c, "r", 0) or hasattr(c, "fmt")) for c in children):
                continue
            if norm_name is None:
                out.append(Site(f"model.layers.{i}.{block}", mod, "input", None))
                continue
            norm = getattr(layer, norm_name)
            eps = norm_eps(norm)
            if eps is None or getattr(norm, "weight", None) is None:
                raise ValueError(f"AQN: model.layers.{i}.{norm_name} ({type(norm).__name__}) has no RMSNorm "
                                 f"weight and eps to noise")
            out.append(Site(f"model.layers.{i}.{norm_name}", norm, fam.norm_form, eps))
    return out


def noised_norms(model: nn.Module) -> dict[str, nn.Parameter]:
    """name -> weight of each norm AQN noises (sites that are blocks' inputs have no weight)."""
    return {s.name: s.module.weight for s in noise_sites(model) if s.form != "input"}


class AQN:
    """Draws the step's noise and applies it around a block: `with aqn.applied(sigma, seed): ...`.

    Build it before the engine captures CUDA graphs: the graphs read the noise buffers made here."""

    def __init__(self, model: nn.Module):
        self.sites = {s.name: s for s in noise_sites(model)}
        if not self.sites:
            raise ValueError("AQN: found no LoRA or quantized q/k/v or gate/up projection to noise in this model")
        self.norms = {name: s.module for name, s in self.sites.items()}  # every site's module
        # the norms' weights, never written (the noise lives in `self.noise`), and eps
        self.weights = {name: s.module.weight for name, s in self.sites.items() if s.form != "input"}
        self.eps = {name: s.eps for name, s in self.sites.items() if s.form != "input"}
        # name -> the fp32 Z its site applies: zeros outside `applied`, filled in place
        self.noise = {name: _noise_buffer(s.module, _width(s)) for name, s in self.sites.items()}
        # RMS of the fp32 noise of the last noisy block (0 after a noiseless one), measured on the
        # buffers the sites read: the trainer logs it as aqn_sigma_effective
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
            for name, site in self.sites.items():
                buf = self.noise[name]
                buf.copy_(torch.randn(buf.shape, generator=g, dtype=torch.float32).mul_(sigma))
                sq, n = sq + float(buf.double().pow(2).sum()), n + buf.numel()
                site.module.forward = _noisy_forward(site)
            self.last_effective_sigma = math.sqrt(sq / n)
            yield
        finally:
            for name, site in self.sites.items():
                self.noise[name].zero_()
                site.module.__dict__.pop("forward", None)  # back to the class's own forward


def _width(site: Site) -> int:
    """The noise vector's size: the norm's width, or the hidden size a block's projections read."""
    if site.form != "input":
        return site.module.weight.shape[0]
    proj = next(getattr(site.module, p) for p in FEEDS["self_attn"] + FEEDS["mlp"] if hasattr(site.module, p))
    return proj.in_features


def _noise_buffer(module: nn.Module, width: int) -> torch.Tensor:
    """A zero fp32 vector on the site's device, kept for the model's lifetime and reused by every
    noisy block (a plain attribute, not a buffer: no state_dict or checkpoint sees it)."""
    dev = next(module.parameters()).device
    buf = getattr(module, "aqn_noise", None)
    if buf is None or buf.shape != (width,) or buf.device != dev:
        buf = torch.zeros(width, dtype=torch.float32, device=dev)
        module.aqn_noise = buf
    return buf


def _noisy_forward(site: Site):
    """The site module's forward with its noise: the same functions the engine's decode glue calls."""
    mod = site.module
    if site.form == "input":
        cls_forward = type(mod).forward

        def forward(*args, **kw):  # HF calls attention with hidden_states=..., the MLP positionally
            if args:
                args = (input_noise(args[0], mod.aqn_noise), *args[1:])
            else:
                kw["hidden_states"] = input_noise(kw["hidden_states"], mod.aqn_noise)
            return cls_forward(mod, *args, **kw)
        return forward
    if site.form == "llama":
        return lambda x: rms_norm(x, mod.weight, site.eps, mod.aqn_noise)
    return lambda x: noisy_norm(x, mod.weight, site.eps, mod.aqn_noise, site.form)

"""The parity gate: does the rollout engine run the policy the trainer trains?

At the start of a run and every `parity_check_steps` steps, on a fixed probe batch (the first
training prompts, one seeded sample each, no AQN noise):
  (a) the engine's logprobs of the tokens it sampled vs the trainer's for the same sequences;
  (b) the adapter's effect, adapter-on minus adapter-off logprobs, on the engine path (its own
      prefill and decode, teacher-forced) vs the same on the trainer path. The adapter is the
      trained one plus a fixed, seeded probe on the LoRA B factors (restored bit for bit after), so
      the check means something at step 0, where B = 0 and the adapter changes nothing;
and, to tell the sides apart, the adapters-off logprobs of both paths (the base weights).
All go to the metrics (`parity_*`); a mean |difference| past `parity_max_logprob_diff` stops the
run with a message naming the side and the part that diverged.

For an MoE, also (c): the experts each path's routers chose for the same tokens (the engine's
teacher-forced prefill and decode against the trainer's forward, trained adapter on; layers/routing.py).
The update re-routes rather than replaying the rollout's choices, so a token sent to other experts on
the two paths moves its importance ratio with no weight changed; past MAX_ROUTING_MISMATCH of the
(token, layer) choices the gate stops the run.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from ..layers import QLoRALinear, adapters_disabled, unfused_lora
from ..layers.quant_experts import QuantExperts
from ..layers.routing import record_routing
from ..rollout import SamplingParams, processed_logprobs
from ..rollout.forward import decode, prefill
from ..train.logprobs import completion_logprobs, pad_batch
from ..train.optim import TrainingError

PROBE_PROMPTS = 4
PROBE_TOKENS = 32
PROBE_RELATIVE_SIZE = 0.1  # the probe adapter's starting ||scaling·B·A|| relative to a typical ||W||
PROBE_EFFECT = 5.0  # the probe is scaled until it moves the trainer's logprobs by this many times the limit
# (c): fraction of (token, MoE layer) expert sets allowed to differ between the paths. Their bf16 roundings
# differ (decode GEMV against the update's grouped matmul), so a router with near-tied scores may flip a
# rare choice; a path that routes from other hidden states flips most of them.
MAX_ROUTING_MISMATCH = 0.05


class ParityError(TrainingError):
    pass


@dataclass
class ParityReport:
    logprob_diff_mean: float   # (a) engine's sampling logprobs vs trainer's, the trained adapter on
    logprob_diff_max: float
    adapter_diff_mean: float   # (b) |engine's (on - off) - trainer's (on - off)|, probe adapter on
    adapter_diff_max: float
    adapter_effect_engine: float   # mean |on - off| on each path: how much the probe adapter moves it
    adapter_effect_trainer: float
    base_diff_mean: float      # adapters off: engine path vs trainer path (the base weights)
    base_diff_max: float
    routing_mismatch: float | None = None  # (c) MoE: fraction of (token, layer) expert sets that differ

    def metrics(self) -> dict:
        return {f"parity_{k}": v for k, v in asdict(self).items() if v is not None}

    def failure(self, limit: float) -> str | None:
        """What diverged, by side, or None."""
        why = []
        if self.base_diff_mean > limit:
            why.append(f"the base weights: with adapters off the engine path's logprobs differ from the trainer's "
                       f"by {self.base_diff_mean:.3g} on average (max {self.base_diff_max:.3g}), so the engine does "
                       f"not run the trainer's base model (a stale or perturbed engine weight)")
        if self.adapter_diff_mean > limit:
            e, t = self.adapter_effect_engine, self.adapter_effect_trainer
            side = ("the adapter does not reach the engine" if e < 0.5 * t else
                    "the adapter does not reach the trainer's forward" if t < 0.5 * e else
                    "the adapter acts differently on the engine path and the trainer path")
            why.append(f"{side}: the probe adapter moves logprobs by {e:.3g} on the engine path and {t:.3g} on the "
                       f"trainer path (mean |difference| {self.adapter_diff_mean:.3g})")
        if self.logprob_diff_mean > limit and not why:
            why.append(f"the engine's sampling: the logprobs it reports for its samples differ from the trainer's by "
                       f"{self.logprob_diff_mean:.3g} on average (max {self.logprob_diff_max:.3g}) although its "
                       f"teacher-forced forward agrees (decode graphs, kernels or sampling logprobs)")
        elif self.logprob_diff_mean > limit:
            why.append(f"engine vs trainer logprobs of the engine's samples: mean |difference| "
                       f"{self.logprob_diff_mean:.3g} (max {self.logprob_diff_max:.3g})")
        if self.routing_mismatch is not None and self.routing_mismatch > MAX_ROUTING_MISMATCH:
            why.append(f"the MoE routing: {100 * self.routing_mismatch:.1f} % of the tokens' expert choices differ "
                       f"between the engine path and the trainer path (at most {100 * MAX_ROUTING_MISMATCH:g} %): "
                       f"the two run the routers on different hidden states")
        return "; ".join(why) or None


def routing_by_token(log, name: str, rows: int, width: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One experts module's choices on the engine path, split as `engine_logprobs` made them: the prefill's
    calls ([rows, chunk] tokens each, row-major, chunk by chunk along the prompt: [rows, width, k]) and then
    one decode call per step ([steps, rows, k])."""
    calls, pre, used = log.calls[name], [], 0
    while used < width:
        c = calls[len(pre)]
        pre.append(c.view(rows, -1, c.shape[-1]))
        used += pre[-1].shape[1]
    dec = calls[len(pre):]
    if used != width or len(dec) != steps:
        raise ValueError(f"{name}: {len(calls)} routing calls do not split into a prefill of {width} tokens and "
                         f"{steps} decode steps")
    k = calls[0].shape[-1]
    return torch.cat(pre, 1), (torch.stack(dec) if dec else torch.zeros(0, rows, k, dtype=calls[0].dtype))


def routing_mismatch_of(engine_log, trainer_log, prompts: list, completions: list) -> float:
    """Fraction of (token, MoE layer) expert sets that differ: each prompt token and each completion token
    the engine fed back (all but the last), on the engine path against the trainer's one forward over
    prompt + completion rows (pad_batch's right-padded layout)."""
    from ..layers.routing import routing_mismatch

    rows, width, steps = len(prompts), max(map(len, prompts)), max(map(len, completions)) - 1
    differ = total = 0
    for name, calls in trainer_log.calls.items():
        pre, dec = routing_by_token(engine_log, name, rows, width, steps)
        t = calls[0].view(rows, -1, calls[0].shape[-1])
        for r, (p, c) in enumerate(zip(prompts, completions)):
            e = torch.cat([pre[r, :len(p)], dec[:len(c) - 1, r]])
            n = e.shape[0]
            differ += routing_mismatch(e, t[r, :n]) * n
            total += n
    return differ / max(1, total)


@torch.no_grad()
def engine_logprobs(engine, prompts: list[list[int]], completions: list[list[int]], params: SamplingParams) -> list:
    """Teacher-forced logprobs of `completions` on the engine's own path: its prefill writes the
    prompts' K/V into slots 0..B-1, then its decode step runs one given token at a time (eager);
    logprobs as its sampler reports them (rollout.processed_logprobs: temperature, top-k, top-p)."""
    view, dev = engine.view, engine.view.device
    B = len(prompts)
    if B > engine.n_slots:
        raise ValueError(f"{B} probe sequences for an engine of {engine.n_slots} slots")
    T, L = max(len(p) for p in prompts), max(len(c) for c in completions)
    ids = torch.zeros(B, T, dtype=torch.long, device=dev)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = torch.tensor(p, device=dev)
    pos = torch.tensor([len(p) for p in prompts], device=dev)
    n_keys = min(engine.max_len, -(-(T + L) // 128) * 128)
    run = engine.runner
    logits = prefill(view, engine.cache, ids, pos, [[r] for r in range(B)], run.rope)
    out = [[] for _ in range(B)]
    for t in range(L):
        lp = processed_logprobs(logits, params)
        for r, c in enumerate(completions):
            if t < len(c):
                out[r].append(float(lp[r, c[t]]))
        if t + 1 < L:
            tok = torch.tensor([c[t] if t < len(c) else 0 for c in completions], device=dev)
            logits = decode(view, engine.cache, tok, pos, B, n_keys, run.rope, run.ops, run.fused_attention)
            pos = pos + 1
    return out


@dataclass(frozen=True)
class ParityInputs:
    """What the gate reads: the two paths, the probe prompts, and the run's settings it checks under."""
    model: torch.nn.Module      # the trainer's live policy
    engine: object              # rollout.Engine (on the live policy, or an AdapterSnapshot's copy)
    prompts: list               # the probe prompts' token ids (the first training prompts)
    pad_id: int
    temperature: float
    logprob_chunk_size: int | None
    max_completion_length: int
    seed: int
    limit: float | None         # parity_max_logprob_diff (None: log only)
    dist: object                # train.distributed.Dist: every rank stops together
    device: torch.device
    sync_engine: Callable[[], None]  # let the engine read the live adapter now (max_staleness 1's copy)

    @classmethod
    def of(cls, trainer) -> "ParityInputs":
        """A GRPOTrainer's."""
        cfg = trainer.cfg
        rows = trainer.train_rows[:min(PROBE_PROMPTS, trainer.engine.n_slots)]
        return cls(trainer.model, trainer.engine, [trainer.encode_prompt(r) for r in rows],
                   trainer.tok.pad_token_id or 0, cfg.temperature, cfg.logprob_chunk_size, cfg.max_completion_length,
                   cfg.seed, cfg.parity_max_logprob_diff, trainer.dist, trainer.device,
                   trainer.sync_rollout_adapter)


class ParityGate:
    """The gate's own state across checks (the seeded probe adapter, its calibrated scale); each check
    reads the trainer's present state through the ParityInputs it is given."""

    def __init__(self):
        self._probe = None  # per LoRA layer: the B added while probing
        self._scale = 1.0   # of the probe, calibrated on the trainer path at each check
        self._checked = False

    def due(self, step: int, every: int) -> bool:
        """every: parity_check_steps (0: off)."""
        n = every
        return bool(n) and (step % n == 0 or not self._checked)  # and the first step of a resumed run

    @staticmethod
    def _params(inp: ParityInputs) -> SamplingParams:
        return SamplingParams(max_new_tokens=min(inp.max_completion_length, PROBE_TOKENS),
                              temperature=inp.temperature, top_p=1.0, top_k=0, seed=inp.seed)

    def _trainer_logprobs(self, inp: ParityInputs, comp) -> list:
        ids, att, pos, tg, mask = pad_batch([c.prompt_ids for c in comp], [c.token_ids for c in comp],
                                            pad_id=inp.pad_id)
        with torch.no_grad(), unfused_lora():
            lp, _ = completion_logprobs(inp.model, ids, att, pos, tg, mask, temperature=inp.temperature,
                                        chunk=inp.logprob_chunk_size)
        lp = lp.float().cpu()
        return [lp[i, :len(c.token_ids)].tolist() for i, c in enumerate(comp)]

    def _layers(self, inp: ParityInputs):
        return [m for m in inp.model.modules() if isinstance(m, QLoRALinear) and m.r]

    def _probe_adapter(self, inp: ParityInputs):
        """Seeded B factors, sized per layer as if each update were PROBE_RELATIVE_SIZE of a weight
        of RMS 0.02 (typical of LLM linears; reading the real norms would dequantize every weight),
        then scaled as one by the calibration in `check`."""
        if self._probe is None:
            g = torch.Generator().manual_seed(inp.seed + 12345)
            self._probe = []
            for m in self._layers(inp):
                b = m.lora_B.weight
                a = float(m.lora_A.weight.detach().float().norm())
                w = 0.02 * math.sqrt(m.in_features * m.out_features)
                sd = PROBE_RELATIVE_SIZE * w / max(1e-12, m.scaling * math.sqrt(b.shape[0]) * a)
                self._probe.append((torch.randn(b.shape, generator=g) * sd).to(b.device, b.dtype))
        return self._probe

    @contextlib.contextmanager
    def _with_probe(self, inp: ParityInputs, scale: float):
        layers, probe = self._layers(inp), self._probe_adapter(inp)
        saved = [m.lora_B.weight.detach().clone() for m in layers]
        try:
            with torch.no_grad():
                for m, p in zip(layers, probe):
                    m.lora_B.weight.add_(p, alpha=scale)
            inp.sync_engine()  # the engine's own adapter copy (max_staleness 1) gets the probe too
            yield
        finally:
            with torch.no_grad():
                for m, s in zip(layers, saved):
                    m.lora_B.weight.copy_(s)  # bit for bit: training continues from the same adapter
            inp.sync_engine()

    def check(self, inp: ParityInputs) -> ParityReport:
        self._checked = True
        inp.sync_engine()
        params = self._params(inp)
        comp = [c for c in inp.engine.generate(inp.prompts, n=1, params=params) if c.token_ids]
        if not comp:
            raise ParityError("parity gate: every probe completion is empty")
        prompts, toks = [c.prompt_ids for c in comp], [c.token_ids for c in comp]
        routing = None
        if any(isinstance(m, QuantExperts) for m in inp.model.modules()):
            with record_routing(inp.model) as tlog:
                trained = _flat(self._trainer_logprobs(inp, comp))
            with record_routing(inp.engine.model) as elog:
                engine_logprobs(inp.engine, prompts, toks, params)
            routing = routing_mismatch_of(elog, tlog, prompts, toks)
        else:
            trained = _flat(self._trainer_logprobs(inp, comp))
        sampled = _flat([c.logprobs for c in comp])
        with adapters_disabled(inp.model), adapters_disabled(inp.engine.model):  # (one model unless max_staleness 1)
            e_off = _flat(engine_logprobs(inp.engine, prompts, toks, params))
            t_off = _flat(self._trainer_logprobs(inp, comp))
        # a probe that moves the trainer's logprobs well past the limit, so that an adapter missing on
        # either path cannot hide under it (a few rescalings; the effect grows about linearly)
        target = PROBE_EFFECT * (inp.limit or 0.1)
        for i in range(4):
            with self._with_probe(inp, self._scale):
                t_on = _flat(self._trainer_logprobs(inp, comp))
            effect = float((t_on - t_off).abs().mean())
            if 0.5 * target <= effect <= 2 * target or effect == 0 or i == 3:
                break  # t_on stays the one measured at the scale the engine gets
            self._scale *= min(8.0, max(0.125, target / effect))
        with self._with_probe(inp, self._scale):
            e_on = _flat(engine_logprobs(inp.engine, prompts, toks, params))
        de, dt = e_on - e_off, t_on - t_off
        a, b, base = (sampled - trained).abs(), (de - dt).abs(), (e_off - t_off).abs()
        return ParityReport(float(a.mean()), float(a.max()), float(b.mean()), float(b.max()),
                            float(de.abs().mean()), float(dt.abs().mean()), float(base.mean()), float(base.max()),
                            routing)

    def __call__(self, step: int, inp: ParityInputs) -> dict:
        """Check, log, and stop (every rank together) past the threshold."""
        rep = self.check(inp)
        limit = inp.limit
        why = rep.failure(limit) if limit is not None else None
        if inp.dist.max(1.0 if why else 0.0, inp.device):
            raise ParityError(f"step {step}: parity gate: the rollout engine and the trainer disagree past "
                              f"parity_max_logprob_diff = {limit}: " + (why or "on another rank") +
                              ". Training stops: its rollouts would not come from the policy it trains.")
        return rep.metrics()


def _flat(rows: list) -> torch.Tensor:
    return torch.tensor([x for r in rows for x in r], dtype=torch.float64)

"""The rollout and rewards phases: this rank's prompts -> G completions each from the noisy behaviour
policy -> scored rounds, with DAPO's dynamic sampling topping up uninformative groups.

`collect(inputs, ctx, sampler)` is a function of what it is given: the run's fixed rollout inputs
(engine, rows, reward functions...), the step's frozen context (its noise level and seeds) and the
prompt sampler it draws from. It touches no trainer, so it can run on a worker thread while the
update of the previous step runs (max_staleness 1: rl/staleness.py).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..rollout import SamplingParams
from .advantages import informative_groups, overlong_penalty
from .rollout_round import RolloutRound
from .config import GRPOConfig
from ..train.profiling import Profiler
from .reward_hooks import RewardHooks, environments
from .rewards import score
from ..train.sampler import PromptSampler
from .step_context import StepContext


@dataclass
class StepRollouts:
    rounds: list[RolloutRound]
    groups: list[tuple[RolloutRound, int]]  # chosen for the update: (round, group index)
    n_informative: int                      # this rank's groups whose rewards are not all equal
    effective_sigma: float                  # the AQN noise the first round measured
    ctx: StepContext | None = None          # the step and adapter version they were sampled for
    seconds: float = 0.0                    # wall time of the whole collection (all rounds, rewards)
    logged: dict | None = None              # the reward functions' log_metric values (rl/reward_hooks.py)
    extra: dict | None = None               # their log_extra columns


@dataclass(frozen=True)
class RolloutInputs:
    """What a rollout reads that does not change from step to step."""
    cfg: GRPOConfig
    engine: object                      # rollout.Engine (on the live policy, or an AdapterSnapshot's)
    tokenizer: object
    rows: list                          # the training rows
    reward_funcs: list
    reward_weights: list | None
    dist: object                        # train.distributed.Dist
    device: torch.device
    encode: Callable                    # row -> prompt token ids
    turns_for: Callable                 # rows -> multi-turn handler or None
    aqn: object | None                  # rl.aqn.AQN on the engine's norms, or None
    profiler: Profiler                  # times the "rewards" sub-phase
    sample_max_new_tokens: Callable | None = None  # (prompt key, sample) -> its own limit (SamplingParams)
    trainer_state: object = None        # the trainer's TrainerState, handed to reward functions (TRL's)
    environment_factory: Callable | None = None  # the user's: reward functions get each sample's `environments`


def noise(aqn, sigma: float, seed: int):
    """The AQN noise of (sigma, seed) on `aqn`'s norms for the duration of a block (none when off)."""
    return aqn.applied(sigma, seed) if aqn is not None and sigma > 0 else contextlib.nullcontext()


def rollout_round(inp: RolloutInputs, rows_idx, sigma: float, seed: int, key_offset: int = 0,
                  hooks: RewardHooks | None = None) -> RolloutRound:
    """Roll out this rank's prompts. The AQN noise uses `seed` on every rank (all ranks perturb
    the same policy); samples are keyed by their index in the global batch on the CPU (the same
    tokens in any split over ranks), and on CUDA come from a per-rank generator stream."""
    cfg = inp.cfg
    rows = [inp.rows[i] for i in rows_idx]
    prompts = [inp.encode(r) for r in rows]
    rseed = seed if inp.device.type != "cuda" else seed + 7919 * inp.dist.rank
    params = SamplingParams(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                            top_p=cfg.top_p, top_k=cfg.top_k, seed=rseed,
                            sample_max_new_tokens=inp.sample_max_new_tokens)
    turns = inp.turns_for(rows)
    outs = inp.engine.generate(prompts, n=cfg.num_generations, params=params, perturb=noise(inp.aqn, sigma, seed),
                               prompt_keys=[key_offset + i for i in range(len(prompts))], turns=turns)
    with inp.profiler.phase("rewards"):
        texts = [inp.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in outs]
        G = cfg.num_generations
        cols = {k: [r[k] for r in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
        cols["prompts"] = [r["prompt"] for r in rows for _ in range(G)]
        envs = environments(turns, len(rows), G) if inp.environment_factory is not None else None
        sc = score(inp.reward_funcs, inp.reward_weights, texts, cols, hooks.kwargs() if hooks is not None else None,
                   completion_ids=[list(c.token_ids) for c in outs], environments=envs)
        lengths = torch.tensor([len(c.token_ids) for c in outs])
        total = torch.tensor(sc.total, dtype=torch.float32)
        total = total + overlong_penalty(lengths, cfg.max_completion_length, cfg.overlong_buffer_len,
                                         cfg.overlong_penalty_factor)
    return RolloutRound(list(outs), texts, sc, total.view(-1, G), lengths, outs.stats)


def select(rounds: list[RolloutRound], P: int, dynamic_sampling: bool):
    """Groups for the update: informative ones first (dynamic sampling), then fill with the rest."""
    keep, rest = [], []
    for r in rounds:
        info = informative_groups(r.rewards) if dynamic_sampling else torch.ones(len(r.rewards), dtype=torch.bool)
        for g in range(len(r.rewards)):
            (keep if info[g] else rest).append((r, g))
    return (keep + rest)[:P], len(keep)


def collect(inp: RolloutInputs, ctx: StepContext, sampler: PromptSampler, P: int) -> StepRollouts:
    """This rank's rounds of the step (P prompts a rank) and the groups chosen for the update."""
    t0 = time.perf_counter()
    cfg, D = inp.cfg, inp.dist
    off, mine = D.shard(sampler.take(P * D.world))  # every rank draws the same global prompts
    hooks = RewardHooks(inp.trainer_state)
    rounds = [rollout_round(inp, mine, ctx.sigma, ctx.seed, off, hooks)]
    eff_sigma = inp.aqn.last_effective_sigma if inp.aqn is not None else 0.0  # the step's noise, as applied
    _, n_info = select(rounds, P, cfg.dynamic_sampling)
    while cfg.dynamic_sampling and len(rounds) <= cfg.max_resample_rounds:
        # DAPO: every rank tops up its own share; the ranks agree on how many prompts to draw
        need = int(D.sum(max(0, P - n_info), inp.device))  # a rank with a surplus needs none
        if need <= 0:
            break
        off, mine = D.shard(sampler.take(-(-need // D.world) * D.world))
        rounds.append(rollout_round(inp, mine, ctx.sigma, ctx.seed + len(rounds), off, hooks))
        _, n_info = select(rounds, P, cfg.dynamic_sampling)
    groups, n_info = select(rounds, P, cfg.dynamic_sampling)
    if cfg.dynamic_sampling:
        # DAPO trains on informative groups only; an all-equal group has zero advantage and would
        # only dilute the token mean (and cost a forward and backward)
        groups = groups[:n_info]
    return StepRollouts(rounds, groups, n_info, eff_sigma, ctx, time.perf_counter() - t0, hooks.metrics, hooks.extra)

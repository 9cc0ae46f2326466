"""The rollout and rewards phases: this rank's prompts -> G completions each from the noisy
behaviour policy -> scored rounds, with DAPO's dynamic sampling topping up uninformative groups."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..rollout import SamplingParams
from .advantages import informative_groups, overlong_penalty
from .batch import RolloutRound
from .rewards import score


@dataclass
class StepRollouts:
    rounds: list[RolloutRound]
    groups: list[tuple[RolloutRound, int]]  # chosen for the update: (round, group index)
    n_informative: int                      # this rank's groups whose rewards are not all equal
    effective_sigma: float                  # the AQN noise the first round measured


class RolloutPhase:
    """Rolls out and scores rounds for one trainer (its engine, prompts, reward functions)."""

    def __init__(self, trainer):
        self.tr = trainer

    def round(self, rows_idx, sigma, seed, key_offset: int = 0) -> RolloutRound:
        """Roll out this rank's prompts. The AQN noise uses `seed` on every rank (all ranks perturb
        the same policy); samples are keyed by their index in the global batch on the CPU (the same
        tokens in any split over ranks), and on CUDA come from a per-rank generator stream."""
        tr, cfg = self.tr, self.tr.cfg
        rows = [tr.train_rows[i] for i in rows_idx]
        prompts = [tr.encode_prompt(r) for r in rows]
        rseed = seed if tr.device.type != "cuda" else seed + 7919 * tr.dist.rank
        params = SamplingParams(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                                top_p=cfg.top_p, top_k=cfg.top_k, seed=rseed)
        outs = tr.engine.generate(prompts, n=cfg.num_generations, params=params, perturb=tr.noise(sigma, seed),
                                  prompt_keys=[key_offset + i for i in range(len(prompts))], turns=tr.turns_for(rows))
        with tr.profiler.phase("rewards"):
            texts = [tr.tok.decode(c.token_ids, skip_special_tokens=True) for c in outs]
            G = cfg.num_generations
            cols = {k: [r[k] for r in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
            cols["prompts"] = [r["prompt"] for r in rows for _ in range(G)]
            sc = score(tr.reward_funcs, tr.reward_weights, texts, cols)
            lengths = torch.tensor([len(c.token_ids) for c in outs])
            total = torch.tensor(sc.total, dtype=torch.float32)
            total = total + overlong_penalty(lengths, cfg.max_completion_length, cfg.overlong_buffer_len,
                                             cfg.overlong_penalty_factor)
        return RolloutRound(outs, texts, sc, total.view(-1, G), lengths, tr.engine.stats)

    def select(self, rounds: list[RolloutRound], P: int):
        """Groups for the update: informative ones first (dynamic sampling), then fill with the rest."""
        keep, rest = [], []
        for r in rounds:
            info = informative_groups(r.rewards) if self.tr.cfg.dynamic_sampling else \
                torch.ones(len(r.rewards), dtype=torch.bool)
            for g in range(len(r.rewards)):
                (keep if info[g] else rest).append((r, g))
        return (keep + rest)[:P], len(keep)

    def collect(self, P: int, sigma: float, base_seed: int) -> "StepRollouts":
        """This rank's rounds of the step and the groups chosen for the update."""
        tr, cfg, D = self.tr, self.tr.cfg, self.tr.dist
        off, mine = D.shard(tr.sampler.take(P * D.world))  # every rank draws the same global prompts
        rounds = [self.round(mine, sigma, base_seed, off)]
        eff_sigma = tr.aqn.last_effective_sigma if tr.aqn is not None else 0.0  # the step's noise, as applied
        _, n_info = self.select(rounds, P)
        while cfg.dynamic_sampling and len(rounds) <= cfg.max_resample_rounds:
            # DAPO: every rank tops up its own share; the ranks agree on how many prompts to draw
            need = int(D.sum(max(0, P - n_info), tr.device))  # a rank with a surplus needs none
            if need <= 0:
                break
            off, mine = D.shard(tr.sampler.take(-(-need // D.world) * D.world))
            rounds.append(self.round(mine, sigma, base_seed + len(rounds), off))
            _, n_info = self.select(rounds, P)
        groups, n_info = self.select(rounds, P)
        if cfg.dynamic_sampling:
            # DAPO trains on informative groups only; an all-equal group has zero advantage and would
            # only dilute the token mean (and cost a forward and backward)
            groups = groups[:n_info]
        return StepRollouts(rounds, groups, n_info, eff_sigma)

"""TRL's GRPO evaluation (eval_strategy="steps"): num_generations completions of each eval prompt from the
current adapter (no AQN noise), scored by the reward functions, logged under TRL's names with its eval_
prefix: eval_reward, eval_reward_std, eval_rewards/<fn>/mean and /std, eval_completions/mean_length,
eval_frac_reward_zero_std. TRL also logs an eval_loss, the policy loss on those completions; with one
pass over fresh samples its ratio is 1, so it is -mean(advantage) (0 up to rounding) plus beta x KL:
not computed here. qerl's own held-out pass@1 (eval_on_start / eval_on_end / qerl's eval_steps) stays,
as eval_pass_at_1."""

from __future__ import annotations

import dataclasses
import math
import time

import torch


def _nan_stats(vals: list[float]) -> tuple[float, float]:
    t = torch.tensor(vals, dtype=torch.float64)
    t = t[~torch.isnan(t)]
    if not t.numel():
        return math.nan, math.nan
    return float(t.mean()), float(t.std()) if t.numel() > 1 else 0.0


def trl_evaluate(trainer, rows: list[dict], prefix: str = "eval") -> dict:
    """The metrics of one evaluation on this rank's share of `rows` (rank 0 evaluates every row)."""
    from ..rl.rewards import AsMessages
    from ..rl.rollout_phase import rollout_round

    t0 = time.perf_counter()
    trainer.sync_rollout_adapter()
    inp = trainer.rollout_inputs()
    if rows and isinstance(rows[0]["prompt"], list) and not any(isinstance(f, AsMessages) for f in inp.reward_funcs):
        inp = dataclasses.replace(inp, reward_funcs=[AsMessages(f) for f in inp.reward_funcs])
    inp = dataclasses.replace(inp, rows=rows, aqn=None)
    rnd = rollout_round(inp, list(range(len(rows))), 0.0, trainer.cfg.seed + 104729 * (trainer.step + 1))
    rewards = rnd.rewards  # [prompts, G]
    out = {f"{prefix}_reward": float(rewards.mean()), f"{prefix}_reward_std": float(rewards.flatten().std()),
           f"{prefix}_frac_reward_zero_std": float((rewards.std(1) < 1e-12).float().mean()),
           f"{prefix}_completions/mean_length": float(rnd.lengths.float().mean())}
    for key, vals in rnd.scores.per_func.items():
        name = rnd.scores.names.get(key, key)
        out[f"{prefix}_rewards/{name}/mean"], out[f"{prefix}_rewards/{name}/std"] = _nan_stats(vals)
    out[f"{prefix}_runtime"] = time.perf_counter() - t0
    return out

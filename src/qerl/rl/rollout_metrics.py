"""The metrics phase: what the step sampled (before filtering), aggregated over all ranks.

qerl's own names (reward_mean, completion_length_mean, accuracy, rewards/<fn>...) and, beside them,
TRL's GRPOTrainer names for the same quantities (reward, reward_std, rewards/<fn>/mean and /std,
completions/*, frac_reward_zero_std), so dashboards built on TRL's names read a qerl run."""

from __future__ import annotations

import math

import torch

from .advantages import informative_groups, nan_std
from .reward_hooks import logged_metrics


def scored_mean(xs: list[float]) -> float:
    """The mean of the values that are not NaN (a reward function's None), NaN when none is."""
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else math.nan


def scored_std(xs: list[float]) -> float:
    """The sample standard deviation (as torch's and TRL's nanstd) of the values that are not NaN; 0 with one,
    NaN with none."""
    xs = [x for x in xs if x == x]
    if len(xs) < 2:
        return math.nan if not xs else 0.0
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def rollout_metrics(rounds, n_info: int, dist, tools_offered: bool = False, logged: dict | None = None) -> dict:
    """Rewards, lengths, truncation, filtering, reward errors, rollout entropy and speed of every
    round of the step, all ranks' (rank 0 logs them). tools_offered: the rollouts could call tools,
    so tool_call_rate is logged, 0 when none was called. logged: this rank's log_metric values from the
    reward functions (rl/reward_hooks.py), averaged over the ranks into the metrics."""
    mine = {"r": [float(x) for r in rounds for x in r.rewards.flatten()],
            "len": [int(x) for r in rounds for x in r.lengths],
            "trunc": sum((c.finish_reason == "length") for r in rounds for c in r.completions),
            "trunc_mask": [c.finish_reason == "length" for r in rounds for c in r.completions],
            "groups": sum(len(r.rewards) for r in rounds), "info": n_info, "rounds": len(rounds),
            # groups whose scored rewards are all equal (no learning signal), whether or not dynamic sampling drops them
            "zero_var": sum(int((~informative_groups(r.rewards)).sum()) for r in rounds),
            "tool_turns": sum(len(getattr(c, "tool_spans", ())) for r in rounds for c in r.completions),
            "tool_users": sum(bool(getattr(c, "tool_spans", ())) for r in rounds for c in r.completions),
            "errors": sum(r.scores.errors for r in rounds),
            "tokens": sum(r.stats.new_tokens for r in rounds), "seconds": sum(r.stats.seconds for r in rounds),
            "nll": sum(-x for r in rounds for c in r.completions for x in c.logprobs),
            "per_func": {k: [v for r in rounds for v in r.scores.per_func[k]] for k in rounds[0].scores.per_func},
            "first_error": next((r.scores.first_error for r in rounds if r.scores.first_error), None),
            "names": {k: v for r in rounds for k, v in r.scores.names.items()},
            "in_tokens": sum(len(c.prompt_ids) + len(c.token_ids) for r in rounds for c in r.completions),
            "logged": logged or {}}
    parts = dist.gather(mine)
    all_r = torch.tensor([x for q in parts for x in q["r"]])
    all_len = torch.tensor([x for q in parts for x in q["len"]], dtype=torch.float32)
    m = {"reward_mean": float(torch.nanmean(all_r)), "reward_std": float(nan_std(all_r)),
         "completion_length_mean": float(all_len.mean()), "completion_length_max": float(all_len.max()),
         "truncated_fraction": sum(q["trunc"] for q in parts) / len(all_len),
         "rollout_rounds": max(q["rounds"] for q in parts),
         "filtered_group_fraction": 1 - sum(q["info"] for q in parts) / sum(q["groups"] for q in parts),
         "zero_variance_fraction": sum(q["zero_var"] for q in parts) / sum(q["groups"] for q in parts),
         "reward_errors": sum(q["errors"] for q in parts),
         # mean -log p of the sampled tokens: the behaviour policy's entropy (AQN noise included) as
         # sampled, an estimate of `entropy` (the noiseless training forward's) when top-p/top-k are off
         "rollout_entropy": sum(q["nll"] for q in parts) / max(1, sum(q["tokens"] for q in parts)),
         # all ranks' new tokens over the slowest rank's rollout time
         "rollout_tokens_per_s": sum(q["tokens"] for q in parts) / max(1e-9, max(q["seconds"] for q in parts))}
    for name in parts[0]["per_func"]:
        vals = [v for q in parts for v in q["per_func"][name]]
        key = {"accuracy": "accuracy", "format": "format_rate"}.get(name, f"rewards/{name}")
        m[key] = scored_mean(vals)
        trl = parts[0]["names"].get(name, name)
        m[f"rewards/{trl}/mean"], m[f"rewards/{trl}/std"] = scored_mean(vals), scored_std(vals)
    m.update(trl_completion_metrics(all_r, all_len, [q["trunc_mask"] for q in parts], m))
    # this step's prompt + completion tokens, all ranks (the trainer's running sum is TRL's num_tokens)
    m["rollout_input_tokens"] = sum(q["in_tokens"] for q in parts)
    m.update(logged_metrics([q["logged"] for q in parts]))
    if tools_offered or any(q["tool_turns"] for q in parts):  # how much the policy uses its tools
        m["tool_call_rate"] = sum(q["tool_users"] for q in parts) / len(all_len)
        m["tool_turns_mean"] = sum(q["tool_turns"] for q in parts) / len(all_len)
    errs = [q["first_error"] for q in parts if q["first_error"]]
    if errs:
        m["reward_first_error"] = errs[0]
    return m


def trl_completion_metrics(rewards: torch.Tensor, lengths: torch.Tensor, trunc_masks: list[list[bool]], m: dict) -> dict:
    """TRL's names of the step's reward and completion statistics (all ranks' completions); the reward's
    mean and std are over the scored completions (NaN: unscorable), as TRL's nanmean and nanstd."""
    clipped = torch.tensor([t for q in trunc_masks for t in q], dtype=torch.bool)
    ended = lengths[~clipped]
    out = {"reward": float(torch.nanmean(rewards)), "reward_std": float(nan_std(rewards)),
           "frac_reward_zero_std": m["zero_variance_fraction"],
           "completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
           "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float(clipped.float().mean()),
           # of the completions that ended by themselves (0 when none did, as TRL)
           "completions/mean_terminated_length": float(ended.mean()) if ended.numel() else 0.0,
           "completions/min_terminated_length": float(ended.min()) if ended.numel() else 0.0,
           "completions/max_terminated_length": float(ended.max()) if ended.numel() else 0.0}
    return out

"""The metrics phase: what the step sampled (before filtering), aggregated over all ranks."""

from __future__ import annotations

import torch


def rollout_metrics(rounds, n_info: int, dist, tools_offered: bool = False) -> dict:
    """Rewards, lengths, truncation, filtering, reward errors, rollout entropy and speed of every
    round of the step, all ranks' (rank 0 logs them). tools_offered: the rollouts could call tools,
    so tool_call_rate is logged, 0 when none was called."""
    mine = {"r": [float(x) for r in rounds for x in r.rewards.flatten()],
            "len": [int(x) for r in rounds for x in r.lengths],
            "trunc": sum((c.finish_reason == "length") for r in rounds for c in r.completions),
            "groups": sum(len(r.rewards) for r in rounds), "info": n_info, "rounds": len(rounds),
            # groups whose rewards are all equal (no learning signal), whether or not dynamic sampling drops them
            "zero_var": sum(int((r.rewards.max(1).values == r.rewards.min(1).values).sum()) for r in rounds),
            "tool_turns": sum(len(getattr(c, "tool_spans", ())) for r in rounds for c in r.completions),
            "tool_users": sum(bool(getattr(c, "tool_spans", ())) for r in rounds for c in r.completions),
            "errors": sum(r.scores.errors for r in rounds),
            "tokens": sum(r.stats.new_tokens for r in rounds), "seconds": sum(r.stats.seconds for r in rounds),
            "nll": sum(-x for r in rounds for c in r.completions for x in c.logprobs),
            "per_func": {k: [v for r in rounds for v in r.scores.per_func[k]] for k in rounds[0].scores.per_func},
            "first_error": next((r.scores.first_error for r in rounds if r.scores.first_error), None)}
    parts = dist.gather(mine)
    all_r = torch.tensor([x for q in parts for x in q["r"]])
    all_len = torch.tensor([x for q in parts for x in q["len"]], dtype=torch.float32)
    m = {"reward_mean": float(all_r.mean()), "reward_std": float(all_r.std()),
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
        m[key] = sum(vals) / len(vals)
    if tools_offered or any(q["tool_turns"] for q in parts):  # how much the policy uses its tools
        m["tool_call_rate"] = sum(q["tool_users"] for q in parts) / len(all_len)
        m["tool_turns_mean"] = sum(q["tool_turns"] for q in parts) / len(all_len)
    errs = [q["first_error"] for q in parts if q["first_error"]]
    if errs:
        m["reward_first_error"] = errs[0]
    return m

"""TRL's GRPO evaluation (eval_strategy="steps"): num_generations completions of each eval prompt from the
current adapter (no AQN noise), scored by the reward functions, logged under TRL's names with its eval_
prefix: eval_reward, eval_reward_std, eval_rewards/<fn>/mean and /std, eval_completions/mean_length,
eval_frac_reward_zero_std, eval_loss. qerl's own held-out pass@1 (eval_on_start / eval_on_end / qerl's
eval_steps) stays, as eval_pass_at_1.

eval_loss is TRL's: transformers' evaluation loop runs GRPOTrainer.compute_loss on each eval batch
(per_device_eval_batch_size completions, advantages computed within it) and logs the mean of the
batches' losses. One pass over fresh samples has ratio 1 (the policy is the one that sampled), so the
clipped term is -advantage on every trained token, aggregated as loss_type does; it needs no forward
pass. Where TRL's loss needs the model's own numbers at ratio 1 (beta > 0: the KL; entropy_coef or
top_entropy_quantile: the entropies; cispo, vespo: the logprobs; sapo: its temperatures) it is left out
rather than approximated.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..rl.advantages import group_advantages, informative_groups, nan_std
from ..rl.rollout_metrics import scored_mean, scored_std

RATIO_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the loss at ratio 1 is -advantage per token


def batch_loss(adv: torch.Tensor, tokens: torch.Tensor, loss_type: str, max_completion_length: int) -> float:
    """TRL's loss of one batch at ratio 1: adv and tokens (trained tokens of each completion) flat."""
    adv, tokens = adv.flatten(), tokens.flatten().double()
    per_seq = -adv * tokens  # the sum of -advantage over each completion's trained tokens
    if loss_type == "grpo":
        return float((per_seq / tokens.clamp(min=1)).mean())
    if loss_type in ("bnpo", "dapo"):
        return float(per_seq.sum() / tokens.sum().clamp(min=1))
    if loss_type == "dr_grpo":
        return float(per_seq.sum() / (len(per_seq) * max_completion_length))
    if loss_type == "luspo":
        return float(per_seq.mean())
    raise ValueError(f"loss_type {loss_type!r}: no eval_loss at ratio 1")


def eval_loss(rewards: torch.Tensor, tokens: torch.Tensor, cfg, batch_size: int) -> float | None:
    """The mean over eval batches of `batch_size` completions (prompt-major, whole groups) of TRL's loss;
    None where TRL's loss needs more than the advantages (see the module's doc)."""
    if (cfg.loss_type not in RATIO_LOSSES or cfg.beta or getattr(cfg, "entropy_coef", 0.0)
            or getattr(cfg, "top_entropy_quantile", 1.0) < 1.0):
        return None
    per = max(1, batch_size // rewards.shape[1])  # prompts a batch
    tokens = tokens.view(rewards.shape)
    losses = [batch_loss(group_advantages(rewards[i:i + per].double(), cfg.scale_rewards), tokens[i:i + per],
                         cfg.loss_type, cfg.max_completion_length) for i in range(0, rewards.shape[0], per)]
    return sum(losses) / len(losses)


def trained_tokens(completions, mask_truncated: bool) -> torch.Tensor:
    """Each completion's tokens in TRL's loss mask: the model's own (not tool output); none for a completion
    cut at the limit when mask_truncated_completions is on."""
    return torch.tensor([0 if mask_truncated and c.finish_reason == "length" else sum(c.model_token_mask())
                         for c in completions])


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
    rewards = rnd.rewards  # [prompts, G]; NaN: unscorable (no function scored it)
    out = {f"{prefix}_reward": float(torch.nanmean(rewards.double())),
           f"{prefix}_reward_std": float(nan_std(rewards.double())),
           f"{prefix}_frac_reward_zero_std": float((~informative_groups(rewards)).float().mean()),
           f"{prefix}_completions/mean_length": float(rnd.lengths.float().mean())}
    for key, vals in rnd.scores.per_func.items():
        name = rnd.scores.names.get(key, key)
        out[f"{prefix}_rewards/{name}/mean"] = scored_mean(vals)
        out[f"{prefix}_rewards/{name}/std"] = scored_std(vals)
    loss = eval_loss(rewards, trained_tokens(rnd.completions, trainer.cfg.mask_truncated_completions), trainer.cfg,
                     trainer.trl.per_device_eval_batch_size)
    if loss is not None:
        out[f"{prefix}_loss"] = loss
    out[f"{prefix}_runtime"] = time.perf_counter() - t0
    return out

"""TRL's extra arguments to reward functions, as TRL 1.16's GRPOTrainer passes them.

`trainer_state` is the trainer's live transformers TrainerState (global_step, max_steps, epoch...: a
reward can change with training progress); `log_metric(name, value)` adds a scalar to the step's metrics
(its mean over the step's calls, averaged over the ranks, as TRL does); `log_extra(column, values)` adds
a column to TRL's completions table, which qerl has none of: the values are kept on the step's
rollouts (`StepRollouts.extra`) and not logged. One RewardHooks collects one step's rollout, so a
rollout on a worker thread (max_staleness 1) writes only its own.

`environments` (TRL's, only where the trainer has an environment_factory; TRL passes none otherwise): each
completion's environment instance, prompt-major as the completions, after its rollout, so a reward can
read the state the episode left (a solved puzzle, a final score).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RewardHooks:
    trainer_state: object = None
    metrics: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, list] = field(default_factory=dict)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.extra.setdefault(column, []).extend(values)

    def kwargs(self) -> dict:
        return {"trainer_state": self.trainer_state, "log_extra": self.log_extra, "log_metric": self.log_metric}


def environments(turns, prompts: int, G: int) -> list:
    """Each completion's environment from the rollout's multi-turn handler (tools/handler.py): the one its
    turns talked to, or one built and reset now for a sample that made no call (TRL resets every sample's
    before generating); None for one that could not start (its failure was the sample's tool message)."""
    out = []
    for p in range(prompts):
        for s in range(G):
            env = turns.envs.get((p, s))
            if env is None:
                try:
                    env = turns.env(p, s)
                except Exception:  # noqa: BLE001 - the user's factory or reset: no environment, as a failed start
                    env = None
            out.append(env if not isinstance(env, (str, BaseException)) else None)
    return out


def logged_metrics(per_rank: list[dict[str, list[float]]]) -> dict[str, float]:
    """The step's log_metric values: each name's mean over every rank's calls."""
    names = sorted({k for d in per_rank for k in d})
    out = {}
    for k in names:
        vals = [v for d in per_rank for v in d.get(k, [])]
        out[k] = sum(vals) / len(vals)
    return out

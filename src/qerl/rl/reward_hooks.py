"""TRL's extra arguments to reward functions, as TRL 1.16's GRPOTrainer passes them.

`trainer_state` is the trainer's live transformers TrainerState (global_step, max_steps, epoch...: a
reward can change with training progress); `log_metric(name, value)` adds a scalar to the step's metrics
(its mean over the step's calls, averaged over the ranks, as TRL does); `log_extra(column, values)` adds
a column to TRL's completions table, which qerl has none of: the values are kept on the step's
rollouts (`StepRollouts.extra`) and not logged. One RewardHooks collects one step's rollout, so a
rollout on a worker thread (max_staleness 1) writes only its own.
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


def logged_metrics(per_rank: list[dict[str, list[float]]]) -> dict[str, float]:
    """The step's log_metric values: each name's mean over every rank's calls."""
    names = sorted({k for d in per_rank for k in d})
    out = {}
    for k in names:
        vals = [v for d in per_rank for v in d.get(k, [])]
        out[k] = sum(vals) / len(vals)
    return out

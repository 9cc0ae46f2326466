"""TRL's log_completions: at each logging step, the step's prompts, completions, each reward function's
reward, the advantage and the reward functions' log_extra columns, printed as TRL prints them (a rich
table titled "Step N", num_completions_to_print of them at random; plain text without rich), written to
output_dir/completions/completions_NNNNN.jsonl (TRL writes the same rows as parquet), and given to
wandb / trackio as a table when they are the run's trackers. This rank's completions (rank 0 logs)."""

from __future__ import annotations

import importlib.util
import json
import random
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class CompletionsTable:
    step: int
    prompts: list[str]
    completions: list[str]
    rewards: dict[str, list[float]]             # TRL's name of each reward function -> its rewards
    advantages: list[float]
    extra: dict[str, list] = field(default_factory=dict)

    @classmethod
    def of(cls, ro, tok, scale_rewards: str, step: int) -> "CompletionsTable":
        """From a step's rollouts (rl/rollout_phase.StepRollouts): every round, in order."""
        from ..rl.advantages import group_advantages

        prompts, completions, rewards, adv = [], [], {}, []
        for r in ro.rounds:
            prompts += [tok.decode(c.prompt_ids, skip_special_tokens=True) for c in r.completions]
            completions += list(r.texts)
            for key, vals in r.scores.per_func.items():
                rewards.setdefault(r.scores.names.get(key, key), []).extend(vals)
            adv += group_advantages(r.rewards, scale_rewards).flatten().tolist()
        extra = {k: list(v) for k, v in (ro.extra or {}).items() if len(v) == len(completions)}
        return cls(step, prompts, completions, rewards, adv, extra)

    def sample(self, n: int | None) -> "CompletionsTable":
        """TRL's subsample: n rows at random (all when n is None or not smaller)."""
        if n is None or n >= len(self.prompts):
            return self
        idx = random.sample(range(len(self.prompts)), max(0, n))
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        return CompletionsTable(self.step, pick(self.prompts), pick(self.completions),
                                {k: pick(v) for k, v in self.rewards.items()}, pick(self.advantages),
                                {k: pick(v) for k, v in self.extra.items()})

    def rows(self) -> list[dict]:
        return [{"step": self.step, "prompt": p, "completion": c, **{k: v[i] for k, v in self.rewards.items()},
                 **{k: v[i] for k, v in self.extra.items()}, "advantage": self.advantages[i]}
                for i, (p, c) in enumerate(zip(self.prompts, self.completions))]

    def print(self) -> None:
        if importlib.util.find_spec("rich") is None:
            for r in self.rows():
                print(" | ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v!r}" for k, v in r.items()))
            return
        from rich.console import Console
        from rich.panel import Panel
        from rich.table import Table

        table = Table(show_header=True, header_style="bold white", expand=True)
        table.add_column("Prompt", style="bright_yellow")
        table.add_column("Completion", style="bright_green")
        for name in self.rewards:
            table.add_column(name, style="bold cyan", justify="right")
        table.add_column("Advantage", style="bold magenta", justify="right")
        for name in self.extra:
            table.add_column(name, style="bright_white")
        for i in range(len(self.prompts)):
            table.add_row(self.prompts[i], self.completions[i], *[f"{v[i]:.2f}" for v in self.rewards.values()],
                          f"{self.advantages[i]:.2f}", *[str(v[i]) for v in self.extra.values()])
            table.add_section()
        Console().print(Panel(table, expand=False, title=f"Step {self.step}", border_style="bold white"))

    def write(self, output_dir) -> Path:
        folder = Path(output_dir) / "completions"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"completions_{self.step:05d}.jsonl"
        path.write_text("".join(json.dumps(r, default=str) + "\n" for r in self.rows()))
        return path

    def to_trackers(self, trackers: list, step: int) -> None:
        """A table to the run's wandb and trackio trackers (train/trackers.py: each holds its `run`), at the
        step their metrics row was logged at."""
        rows = self.rows()
        if not rows:
            return
        cols = list(rows[0])
        data = [[r[c] if isinstance(r[c], (int, float, str)) else str(r[c]) for c in cols] for r in rows]
        for t in trackers:
            kind = type(t).__name__
            if kind == "Wandb":
                import wandb

                t.run.log({"completions": wandb.Table(columns=cols, data=data)}, step=step)
            elif kind == "Trackio":
                import trackio

                t.run.log({"completions": trackio.Table(columns=cols, data=data)}, step=step)

"""TRL's step semantics over qerl's steps.

TRL counts optimizer steps: `max_steps` and `trainer.state.global_step` are optimizer updates, and one
generation (a batch of num_generations completions per prompt) feeds
steps_per_generation x num_iterations / gradient_accumulation_steps of them. A qerl step is one
generation and all its updates (num_iterations passes of steps_per_generation / gradient_accumulation
updates each), so TRL's max_steps is a number of qerl steps times that. Without max_steps TRL trains
num_train_epochs passes, each floor(prompts / prompts per generation) generations (its RepeatSampler
drops a last partial batch), in transformers' count of updates per epoch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StepPlan:
    qerl_steps: int          # generations (qerl's max_steps)
    optimizer_steps: int     # TRL's max_steps: trainer.state.max_steps, the last global_step
    updates_per_generation: int
    note: str | None = None  # what differs from TRL, said once at start


def updates_per_generation(cfg, world: int = 1) -> int:
    from ..rl.batch_sizes import batch_plan

    return cfg.num_iterations * batch_plan(cfg, world).updates_per_rank


def plan(cfg, max_steps: int, epochs: float, prompts: int, world: int = 1) -> StepPlan:
    """qerl's steps for TRL's max_steps (optimizer steps; -1: num_train_epochs over `prompts`)."""
    from ..rl.batch_sizes import batch_plan

    bp = batch_plan(cfg, world)
    per_gen = cfg.num_iterations * bp.updates_per_rank
    if max_steps in (-1, None):
        per_gen_prompts = bp.generation_batch_size // cfg.num_generations
        # transformers: len(dataloader) per epoch = generations x num_iterations x steps_per_generation
        batches = (prompts // per_gen_prompts) * cfg.num_iterations * bp.steps_per_generation
        ga = cfg.gradient_accumulation_steps
        per_epoch = max(batches // ga + int(batches % ga > 0), 1)
        max_steps = math.ceil(epochs * per_epoch)
    gens = -(-max_steps // per_gen)
    note = None
    if gens * per_gen != max_steps:
        note = (f"max_steps={max_steps} optimizer steps is not a whole number of generations of {per_gen} updates "
                f"(num_iterations x steps_per_generation / gradient_accumulation_steps): qerl finishes the last "
                f"generation, {gens * per_gen} optimizer steps (TRL stops after {max_steps})")
    return StepPlan(gens, gens * per_gen, per_gen, note)


class TRLNumbering:
    """TRL's step numbering for a GRPO trainer whose step is one generation: `global_step` counts optimizer
    steps (a generation makes `updates_per_generation` of them), so printed lines, metrics.jsonl, the trackers,
    trainer.state, the bar and checkpoint-N folders carry TRL's numbers (train/loop.py numbers everything by
    `global_steps_per_step`). Mixed in before qerl's GRPOTrainer by qerl.trl's GRPOTrainer and, through
    `numbered_as_trl`, by `qerl train` of a `trl grpo --config` file: one numbering for TRL's inputs.

    The native `qerl train` (flags or a qerl config) keeps its own: its max_steps, save_steps, logging_steps and
    eval_steps count generations, and with its defaults (num_iterations 1, steps_per_generation =
    gradient_accumulation_steps) a generation is one optimizer step, so the two numberings are the same there."""

    @property
    def global_steps_per_step(self) -> int:
        return updates_per_generation(self.cfg, self.dist.world)


def numbered_as_trl(trainer_cls: type) -> type:
    """`trainer_cls` (qerl's GRPOTrainer) numbering its steps as TRL does (TRLNumbering)."""
    if issubclass(trainer_cls, TRLNumbering):
        return trainer_cls
    return type(f"TRLNumbered{trainer_cls.__name__}", (TRLNumbering, trainer_cls), {"__module__": __name__})

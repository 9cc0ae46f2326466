"""`trainer.state`: transformers' TrainerState, kept by the run loop as transformers' Trainer keeps it.

Scripts, notebooks and callbacks read `trainer.state.global_step` and `trainer.state.log_history`; the
loop appends one entry a step (the step's metrics, `epoch`, and TRL's `step`: global_step, optimizer
steps so far, 1 after the first; the same number as the step's metrics.jsonl row) and a summary entry
at the end of train() (train_runtime, train_loss, ...), as transformers does. A resumed run rebuilds the entries before its checkpoint from
its metrics.jsonl, which holds the same rows.
"""

from __future__ import annotations

import math
import numbers

from transformers import TrainerControl, TrainerState

__all__ = ["TrainerControl", "TrainerState", "log_entry", "new_state", "summary_entry"]


def new_state(max_steps: int, logging_steps: int, save_steps: int, train_batch_size: int,
              is_main: bool, is_local_main: bool) -> TrainerState:
    return TrainerState(max_steps=max_steps, logging_steps=logging_steps or 1, save_steps=save_steps,
                        train_batch_size=train_batch_size, global_step=0, epoch=0.0,
                        is_world_process_zero=is_main, is_local_process_zero=is_local_main)


def log_entry(row: dict, step: int, epoch: float | None) -> dict:
    """TRL's log_history entry of a metrics row: its numbers (NaN as None, as TRL logs a mean over
    nothing), `epoch`, `step` (global_step)."""
    out = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()
           if k != "step" and isinstance(v, numbers.Number) and not isinstance(v, bool)}
    if epoch is not None:
        out["epoch"] = epoch
    out["step"] = step
    return out


def summary_entry(rows: list[dict], seconds: float, step: int, epoch: float | None) -> dict:
    """transformers' end-of-training entry over this call's steps."""
    losses = [r["loss"] for r in rows if isinstance(r.get("loss"), float) and math.isfinite(r["loss"])]
    out = {"train_runtime": seconds, "train_steps_per_second": len(rows) / seconds if seconds > 0 else 0.0,
           "total_flos": 0.0, "train_loss": sum(losses) / len(losses) if losses else 0.0}
    if epoch is not None:
        out["epoch"] = epoch
    out["step"] = step
    return out

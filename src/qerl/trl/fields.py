"""TRL / transformers config fields that qerl's configs do not hold: those the TRL surface uses itself
(steps, epochs, completions table, run name, evaluation strategy, hub) and new names of qerl fields; the
others (ignored, or refused by name with the nearest supported one) are train/trl_table.py's.

`split(kw)` takes them out of a TRL config's keyword arguments; what is left goes to qerl's config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

TRL_EPOCHS = 3.0  # TrainingArguments' num_train_epochs default


@dataclass
class TRLArgs:
    """The fields the TRL surface (qerl.trl) reads; a config carries them as `cfg.trl`."""
    max_steps: int = -1                 # TRL's: optimizer steps (-1: num_train_epochs)
    num_train_epochs: float = TRL_EPOCHS
    log_completions: bool = False
    num_completions_to_print: int | None = None
    log_unique_prompts: bool = False
    run_name: str | None = None
    eval_strategy: str = "no"
    eval_steps: float | None = None     # TRL's: None means logging_steps
    per_device_eval_batch_size: int = 8  # TrainingArguments': completions an eval batch (TRL's eval_loss)
    warmup_ratio: float = 0.0
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_token: str | None = None
    hub_private_repo: bool | None = None
    resume_from_checkpoint: str | None = None  # TrainingArguments': read by scripts, not by Trainer
    max_prompt_length: int | None = None       # qerl's field, when the script sets it (TRL 1.16 has none)


RENAMED = {"activation_checkpointing": "gradient_checkpointing"}  # transformers 5's name -> qerl's field

# TRL's fields that would change training and that qerl lacks: train/trl_table.py (NEAREST), refused there by name
EVAL_STRATEGIES = ("no", "steps")


def refuse(name: str, value, nearest: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not supported by qerl; nearest: {nearest}")


def split(kw: dict) -> tuple[TRLArgs, dict]:
    """(the TRL surface's fields, the rest for qerl's config) of a TRL config's keyword arguments."""
    kw = dict(kw)
    mine = {f.name: kw.pop(f.name) for f in dataclasses.fields(TRLArgs) if f.name in kw}
    trl = TRLArgs(**mine)
    if trl.max_prompt_length is not None:
        kw["max_prompt_length"] = trl.max_prompt_length
    kw = renamed(kw)
    if trl.eval_strategy not in EVAL_STRATEGIES:
        raise refuse("eval_strategy", trl.eval_strategy, "eval_strategy='steps' with eval_steps")
    if trl.warmup_ratio and "warmup_steps" in kw and kw["warmup_steps"]:
        raise ValueError("warmup_ratio and warmup_steps: set one")
    if trl.log_unique_prompts:
        raise refuse("log_unique_prompts", True, "log_completions (every completion of the printed prompts)")
    return trl, kw


def renamed(kw: dict) -> dict:
    """`kw` with transformers 5's names as qerl's fields (a config file's fields too); the fields qerl lacks are
    train/trl_table.py's, sorted out where qerl's config is built."""
    kw = dict(kw)
    for old, new in RENAMED.items():
        if old in kw:
            v = kw.pop(old)
            if v is None:  # unset, transformers 5's default: the other name decides, as in TrainingArguments
                continue
            if kw.get(new) is not None and kw[new] != v:
                raise ValueError(f"{old}={v!r} and {new}={kw[new]!r}: one field under two names; set one")
            kw[new] = v
    return kw

"""TRL / transformers config fields that qerl's configs do not hold: those the TRL surface uses itself
(steps, epochs, completions table, run name, evaluation strategy, hub) and new names of qerl fields; the
others (ignored, or refused by name with the nearest supported one) are train/trl_table.py's.

`split(kw)` takes them out of a TRL config's keyword arguments; what is left goes to qerl's config.
"""

from __future__ import annotations

import dataclasses
import sys
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


def split(kw: dict, source: str = "config") -> tuple[TRLArgs, dict]:
    """(the TRL surface's fields, the rest for qerl's config) of a TRL config's keyword arguments."""
    kw = dict(kw)
    mine = {f.name: kw.pop(f.name) for f in dataclasses.fields(TRLArgs) if f.name in kw and f.name != "warmup_ratio"}
    trl = TRLArgs(**mine)
    if trl.max_prompt_length is not None:
        kw["max_prompt_length"] = trl.max_prompt_length
    kw = renamed(kw)
    if trl.eval_strategy not in EVAL_STRATEGIES:
        raise refuse("eval_strategy", trl.eval_strategy, "eval_strategy='steps' with eval_steps")
    trl.warmup_ratio, kw = warmup_ratio(kw, source)
    if trl.log_unique_prompts:
        raise refuse("log_unique_prompts", True, "log_completions (every completion of the printed prompts)")
    return trl, kw


_SAID: set[str] = set()  # what is said once a process


def warmup_ratio(kw: dict, source: str) -> tuple[float, dict]:
    """(TRL's warm-up ratio, `kw` without it): the one rule for TRL's warm-up names, in qerl.trl's GRPOConfig
    and SFTConfig and in `qerl train` / `qerl sft` of a TRL config file. transformers 5 writes the ratio as
    `warmup_steps` below 1 (0.1: a tenth of the run's optimizer steps); transformers 4's `warmup_ratio` is
    read as the same ratio, its deprecation said once. Both set is refused; a whole warmup_steps stays (optimizer
    steps). The caller turns the ratio into steps once the run's optimizer steps are known (train/optim.py
    warmup_steps: transformers' ceil(ratio x steps))."""
    kw = dict(kw)
    old = kw.pop("warmup_ratio", None)
    steps = kw.get("warmup_steps")
    if old is not None and (isinstance(old, bool) or not isinstance(old, (int, float)) or not 0 <= old <= 1):
        raise ValueError(f"{source}: warmup_ratio={old!r} must be a number from 0 to 1 (the fraction of the run's "
                         f"optimizer steps that warm up), e.g. warmup_steps: 0.1 as transformers 5 writes it")
    ratio = 0.0
    if isinstance(steps, float) and 0 < steps < 1:  # transformers 5: the ratio
        ratio = kw.pop("warmup_steps")
    if old:
        if ratio or steps:
            raise ValueError(f"{source}: warmup_ratio={old!r} and warmup_steps={steps!r} both set the warm-up; set "
                             f"one (transformers 5: warmup_steps={old!r}, a float below 1, is the ratio)")
        if "warmup_ratio" not in _SAID:
            _SAID.add("warmup_ratio")
            print(f"qerl: {source}: warmup_ratio is transformers 4's name, deprecated in transformers 5 (which writes "
                  f"it warmup_steps={old!r}, a float below 1); read as that ratio of the run's optimizer steps",
                  file=sys.stderr, flush=True)  # a warning: stdout stays --print_config's file
        ratio = float(old)
    return ratio, kw


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

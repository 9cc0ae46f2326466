"""TRL / transformers config fields that qerl's configs do not hold: those the TRL surface uses itself
(steps, epochs, completions table, run name, evaluation strategy, hub), new names of qerl fields, and
fields that would change training and that qerl lacks, refused by name with the nearest supported one.

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

# field: (values that change nothing, the nearest supported field and what to do instead)
REFUSED = {
    "lr_scheduler_kwargs": ((None, {}), "lr_scheduler_type (constant | linear | cosine) with warmup_steps"),
    "data_seed": ((None,), "seed (it seeds the data order too)"),
    "load_best_model_at_end": ((False,), "save_total_limit: every checkpoint is kept under output_dir/checkpoint-N "
                                          "and the last adapter in output_dir/adapter"),
    "metric_for_best_model": ((None,), "none: qerl keeps no best model (see load_best_model_at_end)"),
    "greater_is_better": ((None,), "none: qerl keeps no best model (see load_best_model_at_end)"),
    "torch_compile": ((False, None), "none: qerl runs its own kernels"),
    "label_smoothing_factor": ((0, 0.0), "none: the loss is TRL's GRPO/SFT loss"),
    "optim_args": ((None, ""), "optim (adamw_torch | adamw_8bit) with adam_beta1, adam_beta2, adam_epsilon, "
                               "weight_decay"),
    "gradient_checkpointing_kwargs": ((None, {}, {"use_reentrant": False}, {"use_reentrant": True}),
                                      "gradient_checkpointing"),
    "activation_checkpointing_kwargs": ((None, {}, {"use_reentrant": False}, {"use_reentrant": True}),
                                        "gradient_checkpointing"),
}
EVAL_STRATEGIES = ("no", "steps")


def refuse(name: str, value, nearest: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not supported by qerl; nearest: {nearest}")


def split(kw: dict, data_seed_ok=42) -> tuple[TRLArgs, dict]:
    """(the TRL surface's fields, the rest for qerl's config) of a TRL config's keyword arguments;
    data_seed equal to the seed (default 42, TRL's and qerl's) changes nothing."""
    kw = dict(kw)
    mine = {f.name: kw.pop(f.name) for f in dataclasses.fields(TRLArgs) if f.name in kw}
    trl = TRLArgs(**mine)
    if trl.max_prompt_length is not None:
        kw["max_prompt_length"] = trl.max_prompt_length
    kw = renamed_or_refused(kw, data_seed_ok)
    if trl.eval_strategy not in EVAL_STRATEGIES:
        raise refuse("eval_strategy", trl.eval_strategy, "eval_strategy='steps' with eval_steps")
    if trl.warmup_ratio and "warmup_steps" in kw and kw["warmup_steps"]:
        raise ValueError("warmup_ratio and warmup_steps: set one")
    if trl.log_unique_prompts:
        raise refuse("log_unique_prompts", True, "log_completions (every completion of the printed prompts)")
    return trl, kw


def renamed_or_refused(kw: dict, data_seed_ok=42) -> dict:
    """`kw` with transformers 5's names as qerl's fields, and a field that would change training and that
    qerl lacks refused by name (one at its no-op value dropped); a config file's fields too."""
    kw = dict(kw)
    for old, new in RENAMED.items():
        if old in kw:
            if new in kw and kw[new] != kw[old]:
                raise ValueError(f"{old}={kw[old]!r} and {new}={kw[new]!r}: one field under two names; set one")
            kw[new] = kw.pop(old)
    for name, (fine, nearest) in REFUSED.items():
        if name in kw:
            v = kw.pop(name)
            if v not in fine and not (name == "data_seed" and v == kw.get("seed", data_seed_ok)):
                raise refuse(name, v, nearest)
    return kw

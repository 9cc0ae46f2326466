"""What `qerl train` checks before the model loads: the inputs a run would otherwise discover
minutes (or a whole training run) later. The task is built here once and handed to the trainer."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def check_run_folder(cfg, resuming: bool) -> None:
    """output_dir usable before anything loads: not a file (nor under one), not locked by a live run,
    and, for a fresh run, holding no earlier run unless overwrite_output_dir (the trainer checks again
    under its lock; these fail in a second instead of after the model's load)."""
    from ..train.run_folder import RunFolderError, check_unlocked, earlier_run

    out = Path(cfg.output_dir).expanduser()
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                raise ValueError(f"config field 'output_dir': {out}: {'is' if p == out else f'{p} is'} a file, "
                                 "not a folder; choose another --output_dir")
            break
    if not main_rank():  # under torchrun rank 0 owns the folder (the others would see its lock)
        return
    check_unlocked(out)
    if not resuming and not cfg.overwrite_output_dir and earlier_run(out):
        raise RunFolderError(earlier_run_message(out))
    if resuming:
        from ..train.checkpoints import checkpoints

        if not checkpoints(out):
            raise RunFolderError(f"{out}: no checkpoint to resume from ({', '.join(earlier_run(out)[:4]) or 'empty'}"
                                 f"); start afresh there with --overwrite_output_dir (deletes what it holds), or "
                                 f"choose another --output_dir")


def earlier_run_message(out: Path, command: str = "train") -> str:
    """A fresh run into a folder holding an earlier one: continue it (only when it has a checkpoint:
    the hint and `--resume` must agree), start afresh, or go elsewhere."""
    from ..train.run_folder import earlier_run
    from ..train.checkpoints import checkpoints
    from ..invocation import qerl_command

    found = earlier_run(out)
    shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
    if checkpoints(out):
        how = f"continue it with `{qerl_command()} {command} --resume {out}`, start afresh there"
    else:
        how = "it has no checkpoint to continue from (save_steps was not reached); start afresh there"
    return (f"{out} already holds a run ({shown}); {how} with --overwrite_output_dir (deletes that run), or choose "
            f"another --output_dir")


def check_device(cfg) -> None:
    """The device and dtype the machine can run (cuda without a GPU was an AssertionError, float16 on
    the CPU a traceback from inside a kernel)."""
    import torch

    dev = cfg.device
    if dev.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"config field 'device': {dev}, but CUDA is not available on this machine (use --device "
                             "cpu, or auto)")
        idx = int(dev.partition(":")[2] or 0)
        if idx >= torch.cuda.device_count():
            raise ValueError(f"config field 'device': {dev}, but this machine has {torch.cuda.device_count()} GPU(s)")
    on_cpu = dev == "cpu" or (dev == "auto" and not torch.cuda.is_available())
    for name in ("dtype", "lora_dtype"):
        if on_cpu and getattr(cfg, name) == "float16":
            raise ValueError(f"config field '{name}': float16 is not supported on the CPU (use float32, or bfloat16)")


def model_to_check(name: str) -> str:
    """The model folder (or hub id) behind `model_name_or_path`: an adapter folder (`qerl sft`'s
    runs/sft/adapter) is its base, after its adapter_config.json is read (the trainer starts from the
    adapter on that base; the folder itself has no config.json)."""
    from ..model.adapter_start import adapter_folder, base_to_load

    folder = adapter_folder(name)
    if folder is None:
        return name
    from ..checkpoint.peft_adapter import read_adapter_config as _read_config

    _read_config(folder)
    return base_to_load(name)


def preflight(cfg, make_task=None):
    """The run's task, after checking the model folder's tokenizer and that the task has rows to
    train on and, when the config evaluates, rows to evaluate on; its notes (skipped rows) printed.
    make_task: cfg -> the task, instead of the dataset_name task (a `trl grpo --config` file's)."""
    from ..model.load import require_tokenizer
    from ..tasks import get_task

    check_device(cfg)
    from ..model.resolve import ALIASES, resolve_model
    from .policy import max_positions

    name = model_to_check(cfg.model_name_or_path)
    model = Path(name).expanduser()
    if model.is_dir() or name.lower() in ALIASES:  # hub ids: checked after their download
        folder = resolve_model(name)
        require_tokenizer(folder)
        # a warning: the limits are upper bounds (prompts are often shorter, completions stop at EOS);
        # generate and eval, which know their prompts and lengths, refuse
        positions, new = max_positions(folder), max(cfg.max_completion_length, cfg.eval_max_completion_length or 0)
        if positions and cfg.max_prompt_length + new > positions and main_rank():
            print(f"qerl train: warning: max_prompt_length {cfg.max_prompt_length} + max_completion_length {new} "
                  f"exceed the model's {positions} positions (max_position_embeddings): a sequence longer than that "
                  "runs past what the model was trained on", file=sys.stderr)
    task = make_task(cfg) if make_task is not None else get_task(cfg.dataset_name, **cfg.dataset_config)
    main = os.environ.get("RANK", "0") == "0"
    for note in task.notes if main else ():
        print(f"qerl train: dataset {cfg.dataset_name}: {note}", file=sys.stderr)
    if not task.train:
        raise ValueError(f"dataset_name {cfg.dataset_name!r}: no training rows"
                         + (" (an evaluation-only set)" if task.eval else ""))
    evaluates = cfg.eval_steps or cfg.eval_on_start or cfg.eval_on_end
    if evaluates:
        name, rows = cfg.dataset_name, task.eval
        if cfg.eval_dataset_name:
            try:
                name, rows = cfg.eval_dataset_name, get_task(cfg.eval_dataset_name, **cfg.eval_dataset_config).eval
            except ValueError as e:  # the task names its options dataset_config: here they are eval_dataset_config's
                if not str(e).startswith("dataset_config"):
                    raise
                raise ValueError(f"eval_{e}") from None
        if not rows:
            raise ValueError(f"dataset {name!r} has no held-out problems ({len(task.train)} training rows), and "
                             "the config evaluates (eval_on_start / eval_on_end / eval_steps): set "
                             "dataset_config.eval_size or eval_file, name an eval_dataset_name, or turn evaluation off")
    return task

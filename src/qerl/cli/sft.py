"""qerl sft [CONFIG.yaml] [--field value ...] | qerl sft --resume DIR: supervised LoRA fine-tuning on the 4-bit base.

Every SFTConfig field (TRL's SFTConfig names) is a flag, with its type, default and help in
`qerl sft --help`; values apply on top of CONFIG.yaml, whose missing fields take the defaults.
The run folder is `qerl train`'s: metrics.jsonl, checkpoints (atomic, exact resume), curves.png
and adapter/, which `qerl train --model_name_or_path DIR/adapter` and PEFT start from.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

USAGE = "qerl sft [CONFIG.yaml] [--field value ...] | qerl sft --resume DIR [--field value ...]"
HELP = "supervised fine-tuning of the LoRA on the 4-bit base (TRL's SFTConfig names; every config field is a --flag)"
DESCRIPTION = (HELP + ". Rows are conversations (messages), plain text or prompt + completion; the default dataset is "
               "the tool task's own transcripts (tool_arithmetic). The adapter in OUTPUT_DIR/adapter starts "
               "`qerl train --model_name_or_path OUTPUT_DIR/adapter` or PEFT.")
GROUPS = {
    "model": ("model_name_or_path", "quant", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "dtype",
              "lora_dtype", "device", "trust_remote_code", "modules_to_not_convert", "lm_head_4bit", "embed_4bit"),
    "data": ("dataset_name", "dataset_config", "dataset_text_field", "max_length", "packing", "assistant_only_loss",
             "completion_only_loss"),
    "optimization": ("learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2",
                     "adam_epsilon", "max_grad_norm", "optim", "num_train_epochs", "max_steps",
                     "per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing",
                     "logprob_chunk_size", "seed"),
    "run": ("output_dir", "overwrite_output_dir", "logging_steps", "save_strategy", "save_steps", "save_total_limit",
            "report_to", "run_name"),
    "distributed": ("ddp_timeout", "ddp_backend"),
}
PREFIX = "sft__"


def add_arguments(p):
    from ..sft import SFTConfig
    from .config_help import type_name

    # CONFIG.yaml (optional, first) and unknown --field pairs arrive as free arguments (see cli.main)
    p.set_defaults(overrides=[])
    from ..train.run_folder import ALLOW_HELP

    p.add_argument("--resume", metavar="DIR", help="continue the SFT run in DIR from its latest checkpoint, on the "
                   "run's record (DIR/config.yaml: its model, quant and data)")
    p.add_argument("--allow_changed", metavar="FIELD", action="append", default=[], help=ALLOW_HELP)
    p.add_argument("--print_config", action="store_true", help="print the documented YAML config and exit")
    hints = typing.get_type_hints(SFTConfig)
    fields = {f.name: f for f in dataclasses.fields(SFTConfig)}
    for group, names in GROUPS.items():
        g = p.add_argument_group(f"{group} (config fields)")
        for name in names:
            f = fields[name]
            d = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            t = type_name(hints[name])
            kw = dict(nargs="?", const="true") if t == "bool" else {}
            flags = [f"--{name}"] + (["--model"] if name == "model_name_or_path" else [])  # as `qerl train`
            g.add_argument(*flags, dest=PREFIX + name, default=argparse.SUPPRESS, metavar=t.split()[0].upper(),
                           help=f"{f.metadata.get('help', '')} [{t}; default: {'null' if d is None else repr(d)}]"
                           .replace("%", "%%"), **kw)


def sft_config(args):
    """The SFTConfig of the command line (cli/run_config.py): CONFIG.yaml (a `trl sft --config` file too), or
    the defaults, or `--resume DIR`'s record."""
    from ..sft import SFTConfig
    from ..train.optim import warmup_steps
    from ..train.trl_fields import TRLArgs
    from .run_config import command_line, config_file, refuse_allow_changed, resumed_config

    config, ov = command_line(args, {k[len(PREFIX):]: v for k, v in vars(args).items() if k.startswith(PREFIX)})
    if args.resume:
        return resumed_config(args, config, ov, SFTConfig, "sft", lambda c, o: c.with_overrides(o))[0]
    refuse_allow_changed(args)
    if config:
        mapping = config_file(config)
        from ..trl.sft import trl_fields

        trl_file(mapping, ov)
        # a `trl sft --config` file runs as it is: TRL's fields carried out here (CARRIED_OUT), the rest of
        # the TRL surface's named in the ignored line (TRL's script evaluates and pushes; `qerl sft` does not)
        unused = {f.name for f in dataclasses.fields(TRLArgs)} - CARRIED_OUT
        trl, d = trl_fields(mapping, source=str(config), not_carried_out=unused)
        if trl.run_name is not None:
            d["run_name"] = trl.run_name  # the trackers' name, as from SFTConfig(run_name=...)
        cfg = SFTConfig.from_dict(d, source=str(config)).with_overrides(ov)
        if trl.warmup_ratio:  # TrainingArguments': a fraction of the run's updates (train/optim.warmup_steps)
            if "warmup_steps" in ov:
                raise ValueError(f"warmup_ratio ({config}) and --warmup_steps: set one")
            if cfg.max_steps > 0:  # known now (--print_config shows it); else the trainer's, once it has the data
                cfg = dataclasses.replace(cfg, warmup_steps=warmup_steps(trl.warmup_ratio, cfg.max_steps))
            cfg.trl = trl
        return cfg
    return SFTConfig().with_overrides(ov)


# TRL surface fields (train/trl_fields.TRLArgs) that `qerl sft` of a `trl sft --config` file acts on
CARRIED_OUT = {"max_steps", "num_train_epochs", "run_name", "warmup_ratio", "resume_from_checkpoint"}


def trl_file(mapping: dict, ov: dict) -> None:
    """A TRL field whose script's behaviour `qerl sft` would not reproduce and whose loss would change the
    run: refused by name with qerl's way (TRL's script resumes from resume_from_checkpoint)."""
    import shlex

    from ..invocation import qerl_command
    from ..train.trl_fields import refuse

    r = mapping.get("resume_from_checkpoint")
    if r not in (None, False, ""):
        out = ov.get("output_dir", mapping.get("output_dir", "OUTPUT_DIR"))
        raise refuse("resume_from_checkpoint", r, f"{qerl_command()} sft --resume {shlex.quote(str(out))} "
                     "(the run folder; its latest checkpoint)")


def data_file(name) -> None:
    """A local dataset that is a FIFO, a device or a folder: said by name before the model loads (reading
    a FIFO would wait for a writer, /dev/zero would never end)."""
    import os
    from pathlib import Path

    from ..tasks.data import regular_file

    path = Path(str(name)).expanduser()
    if path.suffix.lower() in (".jsonl", ".json", ".parquet") or os.path.lexists(path):
        regular_file(path, "dataset_name")


def run(args):
    cfg = sft_config(args)
    if args.print_config:  # as written (a portable file to start from); the run's record is absolute
        print(cfg.to_yaml(), end="")
        return 0
    from pathlib import Path

    from ..train.paths import normalise

    cfg = normalise(cfg)  # `~`, relative paths and links, checked before anything loads (train/paths.py)

    from ..train.run_folder import RunFolderError, earlier_run
    from ..sft import SFTTrainer
    from .preflight import earlier_run_message

    data_file(cfg.dataset_name)
    from ..sft.data import check_rows

    check_rows(cfg.dataset_name, dict(cfg.dataset_config), cfg.dataset_text_field)  # before the model loads
    if args.resume and cfg.max_steps > 0:  # max_steps below the run's step: nothing to train, as `qerl train`
        from .run_config import check_resume_steps

        check_resume_steps(cfg, "sft")
    if not args.resume and not cfg.overwrite_output_dir and earlier_run(cfg.output_dir):
        # before minutes of model loading
        raise RunFolderError(earlier_run_message(Path(cfg.output_dir), "sft"))
    from ..train.run_folder import check_clear, run_inputs

    if not args.resume:  # never clear a folder that is, holds or lies inside what the run reads
        check_clear(cfg.output_dir, cfg.overwrite_output_dir, run_inputs(cfg), "sft")
    import sys

    from . import check_interrupted
    from .stopped_run import interrupted, interruptible, write_refused

    with interruptible() as stop:
        trainer = None
        try:
            trainer = SFTTrainer(cfg)
            if args.resume:
                step = trainer.resume()
                print(f"qerl sft: resuming {args.resume} at step {step}/{trainer.max_steps}")
            check_interrupted()  # a Ctrl-C swallowed while the model loaded: not a whole run later
            rows = trainer.train()
        except KeyboardInterrupt:  # one line, as `qerl train` says it: the step, what is saved, how to go on
            from . import after_interrupt

            after_interrupt()
            if trainer is None or trainer.dist.is_main:
                print(interrupted(cfg, trainer, stop.signal, "sft"), file=sys.stderr, flush=True)
            return 130 if stop.signal == "SIGINT" else 143
        except Exception as e:  # a full disk or a file past `ulimit -f`: the folder, what is kept, how to go on
            if (refused := write_refused(e, cfg, "sft")) is not None:
                raise refused from None
            raise
    if not trainer.dist.is_main:
        return 0
    if rows:
        print(f"qerl sft: {len(rows)} steps to step {trainer.step} ({len(trainer.examples)} examples); last loss "
              f"{rows[-1].get('loss', float('nan')):.4f}; adapter in {cfg.output_dir}/adapter")
    from .plot import plot

    try:
        print(f"curves: {plot(cfg.output_dir)}")
    except ValueError as e:
        print(f"qerl sft: no curves ({e})")
    return 0

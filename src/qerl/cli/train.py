"""qerl train [CONFIG.yaml] [--field value ...] | qerl train --resume DIR: GRPO/DAPO + AQN training.

With no CONFIG.yaml, `qerl train` is the embedded default run (`qerl.rl.default_run`): SmolLM2
in NVFP4 + LoRA + AQN, DAPO on a reasoning-gym task, held-out accuracy before and after, a
summary table and the curves as a PNG. `--field value` pairs still apply on top of it.
"""

from __future__ import annotations

import shlex
import sys

USAGE = "qerl train [CONFIG.yaml] [--field value ...] | qerl train --resume DIR [--field value ...]"
HELP = "train a LoRA policy on 4-bit weights with GRPO/DAPO and AQN (every config field is a --flag)"
DESCRIPTION = (HELP + ". Values apply on top of CONFIG.yaml, whose missing fields take the defaults below; with "
               "no CONFIG.yaml they apply on top of the embedded default run (`qerl train --print_config` shows its "
               "values).")


def add_arguments(p):
    # CONFIG.yaml (optional, first) and --field value pairs arrive as free arguments (see cli.main)
    from ..train.run_folder import ALLOW_HELP

    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint, on the run's "
                   "record (DIR/config.yaml, DIR/run_record.json: its model, quant, data and reward functions)")
    p.add_argument("--allow_changed", metavar="FIELD", action="append", default=[], help=ALLOW_HELP)
    p.add_argument("--print_config", action="store_true", help="print the documented YAML config and exit")
    p.set_defaults(overrides=[])  # CONFIG.yaml and unknown --field pairs, collected by the main parser
    from .config_help import add_config_arguments

    add_config_arguments(p)


def in_file(msg: str, options_from: dict[str, str]) -> str:
    """A dataset's option error, prefixed by the config file that set the options (options_from: field -> file)."""
    field = next((f for f in sorted(options_from, key=len, reverse=True) if msg.startswith(f)), None)
    return f"{options_from[field]}: {msg}" if field else msg


def train_config(args):
    """The GRPOConfig of the command line (cli/run_config.py): CONFIG.yaml (a `trl grpo --config` file too, its
    reward functions in args.trl_rewards), or the embedded default run, or `--resume DIR`'s record."""
    from ..rl import GRPOConfig
    from .config_help import config_values
    from .run_config import command_line, config_file, refuse_allow_changed, resumed_config

    config, ov = command_line(args, config_values(args))
    args.trl_rewards = None
    if args.resume:
        cfg, record = resumed_config(args, config, ov, GRPOConfig, "train", resumed_apply(ov))
        if record:  # a `trl grpo --config` file's run: its reward functions, from where they were imported
            from .trl_config import ScriptRewards

            use_record_roots(record)
            args.trl_rewards = ScriptRewards([r.name for r in record.reward_funcs], record.reward_model_name_or_path)
            args.trl_record = record
        return cfg
    refuse_allow_changed(args)
    if config:
        mapping = config_file(config)
        from .trl_config import split

        fields, args.trl_rewards = split(mapping, str(config))  # a `trl grpo --config` file's reward_funcs
        # the dataset options the file set (and the command line did not): a task's error names the file
        args.options_from = {f: str(config) for f in ("dataset_config", "eval_dataset_config") if f in fields
                             and f not in ov}
        epochs = None
        if args.trl_rewards and fields.get("max_steps", -1) in (-1, None) and "max_steps" not in ov:
            # TRL's max_steps -1 (its default): num_train_epochs (TRL's default 3) over the data decides
            epochs = float(fields.pop("num_train_epochs", 3.0))
            fields["max_steps"] = 1  # for now: the data's count sets it (trl_max_steps)
        cfg = apply(GRPOConfig.from_dict(fields, source=str(config)), ov)
        if args.trl_rewards and "max_steps" in ov:  # TRL's numbering on the command line too: optimizer steps
            cfg = trl_max_steps(cfg, "--max_steps")
        elif args.trl_rewards and "max_steps" in fields:
            cfg = trl_max_steps(cfg, config, epochs)
    else:
        from ..rl.default_run import default_run_config

        dev = ov.get("device")
        cfg = apply(batch_shape_reset(default_run_config(None if dev in (None, "auto") else dev), ov), ov)
    return cfg


def resumed_apply(ov: dict[str, str]):
    """`apply` for a resume: a `trl grpo --config` file's run (its record names reward functions) takes
    --max_steps in TRL's optimizer steps, as its file did, turned into generations (the record's config.yaml)."""
    def apply_ov(cfg, values):
        from ..train.run_folder import read_record

        cfg = apply(cfg, values)
        if "max_steps" in ov and read_record(values["output_dir"]):
            cfg = trl_max_steps(cfg, "--max_steps")
        return cfg

    return apply_ov


def use_record_roots(record) -> None:
    """The folders the run's reward modules were imported from go first on sys.path (before the working
    folder, which TRL's rule adds), so a resume from anywhere imports the run's own functions."""
    import os
    import sys

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # kept behind the run's folders (trl_config adds it only when absent)
    for root in dict.fromkeys(r.root for r in record.reward_funcs if r.root):
        if root in sys.path:
            sys.path.remove(root)
        sys.path.insert(0, root)


def check_reward_sources(record, folder) -> None:
    """After the reward functions are imported: each from the folder the run's record names (a module of
    the same name elsewhere, imported first or found first, is refused by name)."""
    from pathlib import Path

    from ..train.run_folder import RECORD, import_root

    for r in record.reward_funcs:
        now = import_root(r.name)
        if r.root and now and Path(now) != Path(r.root):
            raise ValueError(f"{Path(folder) / RECORD}: reward function {r.name} was imported from {r.root}, but "
                             f"{r.name.rsplit('.', 1)[0]} now comes from {now}; run the resume in a fresh process "
                             f"without that module on the path, or restore {r.root}")


def trl_max_steps(cfg, source, epochs=None):
    """A `trl grpo --config` file's max_steps (and --max_steps with it, new or resumed) counts TRL's optimizer
    steps: qerl's steps (generations) by qerl.trl's translation (trl/steps.plan), said in one line when they
    differ. Its run numbers its lines, metrics and checkpoints by TRL's global_step, as qerl.trl
    (trl/steps.numbered_as_trl; `last_step`).
    epochs: the file's max_steps is -1 (TRL's default): num_train_epochs over the data's prompts, said in one line."""
    import dataclasses
    import os

    from ..train.distributed import world_size
    from ..trl.steps import plan

    world = world_size()
    if epochs is not None:
        from ..sft.data import load_rows

        prompts = len(load_rows(cfg.dataset_name, dict(cfg.dataset_config)))
        p = plan(cfg, -1, epochs, prompts, world)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"qerl: {source}: max_steps=-1: num_train_epochs={epochs:g} of {prompts} prompts is "
                  f"{p.optimizer_steps} optimizer steps, {p.qerl_steps} generations (TRL's count)", flush=True)
        return dataclasses.replace(cfg, max_steps=p.qerl_steps)
    p = plan(cfg, cfg.max_steps, 0, 0, world)
    if p.updates_per_generation != 1 and int(os.environ.get("RANK", "0")) == 0:
        print(f"qerl: {source}: max_steps={cfg.max_steps} counts TRL's optimizer steps: {p.qerl_steps} generations of "
              f"{p.updates_per_generation} updates (num_iterations x steps_per_generation / gradient_accumulation_steps)"
              f"; qerl train numbers its steps, metrics and checkpoints by TRL's global_step, 1 to "
              f"{p.optimizer_steps}", flush=True)
    if p.note:
        print(f"qerl: {p.note}", flush=True)
    return dataclasses.replace(cfg, max_steps=p.qerl_steps)


# The fields that shape a step's batch. The default run's values are one unit (on the CPU 4 micro-batches of 16 for
# its 64 completions): a command line that sets one of them starts the others from the trainer's defaults, as TRL
# would, rather than from the default run's split of its own batch.
BATCH_SHAPE = ("per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
               "steps_per_generation")


def batch_shape_reset(cfg, ov: dict[str, str]):
    if not any(f in ov for f in BATCH_SHAPE):
        return cfg
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(cfg) if f.name in BATCH_SHAPE and f.name not in ov}
    return dataclasses.replace(cfg, **defaults)


def apply(cfg, ov: dict[str, str]):
    """cfg with the command line's values. A dataset named there starts with no options unless they
    are given too: the base's options belong to the base's dataset (the default run's reasoning-gym
    options mean nothing to a .jsonl file)."""
    for name in ("dataset", "eval_dataset"):
        if f"{name}_name" in ov and f"{name}_config" not in ov and ov[f"{name}_name"] != getattr(cfg, f"{name}_name"):
            ov = {**ov, f"{name}_config": "{}"}
    return cfg.with_overrides(ov)


def run(args):
    cfg = train_config(args)
    if args.print_config:  # as written (a portable file to start from); the run's record is absolute
        print(cfg.to_yaml(), end="")
        return 0
    from ..train.paths import normalise

    cfg = normalise(cfg)  # `~`, relative paths and links, checked before anything loads (train/paths.py)
    from . import check_interrupted
    from .preflight import check_run_folder, preflight
    from .run_config import check_resume_steps
    from .stopped_run import interrupted, interruptible, write_refused

    check_run_folder(cfg, resuming=bool(args.resume))  # the lock, an earlier run, a file in the way
    from ..train.run_folder import RecordCallback, check_clear, run_inputs

    if not args.resume:  # never clear a folder that is, holds or lies inside what the run reads
        check_clear(cfg.output_dir, cfg.overwrite_output_dir, run_inputs(cfg))
    rewards = getattr(args, "trl_rewards", None)  # a `trl grpo --config` file's reward_funcs
    last = last_step(cfg, bool(rewards))  # the run's last step number, in its numbering
    if args.resume:
        check_resume_steps(cfg, last=last)  # max_steps below the run's step: nothing to train, said before anything
    if args.resume and (done := finished_run(cfg, last)):
        print(done)
        return 0
    from ..rl import GRPOTrainer

    trainer_cls = GRPOTrainer
    if rewards:  # a TRL file's run, TRL's numbering: global_step, optimizer steps (trl/steps.py), as qerl.trl's
        from ..trl.steps import numbered_as_trl

        trainer_cls = numbered_as_trl(GRPOTrainer)
    if rewards:
        from .trl_config import trl_task

        task = preflight(cfg, lambda c: trl_task(c, rewards))
        if getattr(args, "trl_record", None) is not None:
            check_reward_sources(args.trl_record, cfg.output_dir)
    else:
        try:
            task = preflight(cfg)  # the device, the model's config and positions, the data: before the model loads
        except ValueError as e:
            said = in_file(str(e), getattr(args, "options_from", {}))
            if said == str(e):
                raise
            raise ValueError(said) from None
    with interruptible() as stop:
        trainer = None
        try:
            record = RecordCallback(rewards.names, rewards.reward_model) if rewards else RecordCallback()
            trainer = trainer_cls(cfg, task=task, callbacks=[record])  # the run's record, once the folder is claimed
            if trainer.dist.world > 1 and trainer.dist.is_main:
                import torch.distributed as dist

                print(f"qerl train: {trainer.dist.world} ranks ({dist.get_backend()}); each samples and trains on "
                      f"1/{trainer.dist.world} of a step's {trainer.plan.generation_batch_size} completions",
                      flush=True)
            if args.resume:
                trainer.resume()
                if trainer.dist.is_main:
                    print(f"qerl train: resuming {args.resume} at step {trainer.global_step}/"
                          f"{trainer.global_max_steps}")
            import time

            t0 = time.perf_counter()
            check_interrupted()  # a Ctrl-C swallowed while the model loaded: not a whole run later
            rows = trainer.train()
            wall = time.perf_counter() - t0
        except KeyboardInterrupt:
            from . import after_interrupt

            after_interrupt()
            if trainer is None or trainer.dist.is_main:  # one line for the job, not one per rank
                print(interrupted(cfg, numbered(trainer), stop.signal), file=sys.stderr, flush=True)
            return 130 if stop.signal == "SIGINT" else 143
        except Exception as e:
            if (refused := write_refused(e, cfg)) is not None:
                raise refused from None
            raise
    if not trainer.dist.is_main:  # under torchrun, rank 0 reports
        trainer.dist.close()
        return 0
    if rows:
        final = rows[-1]
        # a TRL file's step (global_step) is an optimizer step: its rows are generations of several
        what = "steps" if trainer.global_steps_per_step == 1 else "generations"
        print(f"qerl train: {len(rows)} {what} to step {trainer.global_step}; last reward {final['reward_mean']:.3f}, "
              f"accuracy {final.get('accuracy', float('nan')):.3f}; adapter in {cfg.output_dir}/adapter")
        if (idle := untrained_steps(rows)):
            print(f"qerl train: {idle} of the {len(rows)} {what} made no update: every group's rewards tied or "
                  f"unscorable (no advantage to learn from){'; the adapter is unchanged' if idle == len(rows) else ''}")
    evals = run_evals(cfg.output_dir) or trainer.evals  # a resumed run's earlier evaluations too
    if evals:
        print(summary_table(evals, wall))
    from .plot import plot

    try:
        print(f"curves: {plot(cfg.output_dir)}")
    except ValueError as e:  # no metrics rows (nothing ran)
        print(f"qerl train: no curves ({e})")
    trainer.dist.close()
    return 0


def last_step(cfg, trl_numbered: bool) -> int:
    """The run's last step number in its numbering, the one rule for checkpoint-N, the evaluation rows and the
    lines that compare with it (trainer.global_max_steps once the trainer is built): cfg.max_steps counts
    generations; a `trl grpo --config` file's run numbers by TRL's global_step, `updates_per_generation`
    optimizer steps a generation on this launch's ranks; qerl's own run by generation."""
    if not trl_numbered:
        return cfg.max_steps
    from ..train.distributed import world_size
    from ..trl.steps import updates_per_generation

    return cfg.max_steps * updates_per_generation(cfg, world_size())


def numbered(trainer):
    """The trainer as stopped_run.interrupted reads it (`step` of `max_steps`), in the run's numbering
    (global_step of global_max_steps); None stays None."""
    if trainer is None:
        return None
    from types import SimpleNamespace

    return SimpleNamespace(step=trainer.global_step, max_steps=trainer.global_max_steps)


def untrained_steps(rows: list[dict]) -> int:
    """Steps whose rollouts gave no update (dynamic sampling dropped every tied or unscorable group: m["updates"] == 0)."""
    return sum(1 for r in rows if r.get("updates") == 0)


def finished_run(cfg, last: int | None = None) -> str | None:
    """The message for `--resume` of a run that has nothing left to do (its last checkpoint at its last step,
    `last` in its numbering: `last_step`; its final evaluation and adapter written); None when there is work
    left."""
    from pathlib import Path

    from ..train.checkpoints import CorruptCheckpoint, checkpoints, read_checkpoint
    from ..invocation import qerl_command
    from .stopped_run import resume_command

    out = Path(cfg.output_dir)
    found = checkpoints(out)
    last = cfg.max_steps if last is None else last
    if not found or int(found[-1].name.rpartition("-")[2]) < last:
        return None
    try:
        read_checkpoint(found[-1])
    except CorruptCheckpoint:
        return None  # the trainer falls back to an earlier checkpoint and trains again from there
    evals = run_evals(out)  # numbered as the run's steps (metrics.jsonl), whatever its eval/ files are named
    if not (out / "adapter").is_dir() or (cfg.eval_on_end and not any(e["step"] == last for e in evals)):
        return None  # killed after its last checkpoint: the trainer finishes it
    lines = [f"qerl train: {out} is finished (step {last}/{last}); its adapter is {out / 'adapter'}. "
             f"To train further: {resume_command(cfg)} --max_steps N (N > {last}); to evaluate it: "
             f"{qerl_command()} eval {shlex.quote(str(out))}"]
    if evals:
        lines.append(summary_table(evals, None))
    return "\n".join(lines)


def run_evals(output_dir) -> list[dict]:
    """The run's evaluation rows from metrics.jsonl (earlier sessions' too), one per step, in order."""
    from ..train.metrics import read_metrics

    try:
        rows = read_metrics(output_dir)
    except (OSError, ValueError):
        return []
    by_step = {r["step"]: r for r in rows if "eval_pass_at_1" in r}
    return [by_step[s] for s in sorted(by_step)]


def summary_table(evals: list[dict], wall_s: float | None) -> str:
    """Held-out pass@1 at each evaluation, and the change from the first to the last."""
    lines = ["", "| held-out | step | pass@1 (%) | ± s.e. | problems × samples |", "|---|---|---|---|---|"]
    for i, e in enumerate(evals):
        name = "before" if i == 0 and e["step"] == 0 else ("after" if i == len(evals) - 1 else "during")
        lines.append(f"| {name} | {e['step']} | {100 * e['eval_pass_at_1']:.1f} | {100 * e['eval_stderr']:.1f} | "
                     f"{e['eval_problems']} × {e['eval_samples']} |")
    if len(evals) > 1:
        d = evals[-1]["eval_pass_at_1"] - evals[0]["eval_pass_at_1"]
        se = (evals[-1]["eval_stderr"] ** 2 + evals[0]["eval_stderr"] ** 2) ** 0.5
        lines.append(f"| change | | {100 * d:+.1f} points | {100 * se:.1f} | |")
    if wall_s is not None:
        lines.append(f"training + evaluation wall time: {wall_s / 60:.1f} min")
    return "\n".join(lines)

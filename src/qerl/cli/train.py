"""qerl train [CONFIG.yaml] [--field value ...] | qerl train --resume DIR: GRPO/DAPO + AQN training.

With no CONFIG.yaml, `qerl train` is the embedded default run (`qerl.rl.default_run`): SmolLM2
in NVFP4 + LoRA + AQN, DAPO on a reasoning-gym task, held-out accuracy before and after, a
summary table and the curves as a PNG. `--field value` pairs still apply on top of it.
"""

from __future__ import annotations

USAGE = "qerl train [CONFIG.yaml] [--field value ...] | qerl train --resume DIR [--field value ...]"
HELP = "train a LoRA policy on 4-bit weights with GRPO/DAPO and AQN (every config field is a --flag)"
DESCRIPTION = (HELP + ". Values apply on top of CONFIG.yaml, whose missing fields take the defaults below; with "
               "no CONFIG.yaml they apply on top of the embedded default run (`qerl train --print_config` shows its "
               "values).")


def add_arguments(p):
    # CONFIG.yaml (optional, first) and --field value pairs arrive as free arguments (see cli.main)
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint")
    p.add_argument("--print_config", action="store_true", help="print the documented YAML config and exit")
    p.set_defaults(overrides=[])  # CONFIG.yaml and unknown --field pairs, collected by the main parser
    from .config_help import add_config_arguments

    add_config_arguments(p)


def parse_overrides(tokens: list[str]) -> dict[str, str]:
    out, i = {}, 0
    while i < len(tokens):
        t = tokens[i]
        if not t.startswith("--"):
            raise ValueError(f"expected --field value, got {t!r}")
        key = t[2:].replace("-", "_")
        if "=" in key:
            key, val = key.split("=", 1)
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            val = tokens[i + 1]
            i += 2
        else:  # a bare flag: a boolean set to true
            val = "true"
            i += 1
        out[key] = val
    return out


def build_config(args):
    from pathlib import Path

    from ..rl import GRPOConfig

    tokens = list(args.overrides or [])
    config = tokens.pop(0) if tokens and not tokens[0].startswith("--") else None
    from .config_help import config_values

    ov = {**config_values(args), **parse_overrides(tokens)}
    if args.resume:
        saved = Path(args.resume) / "config.yaml"
        if not saved.exists():
            raise FileNotFoundError(f"{saved}: not found (is {args.resume} a qerl run directory?)")
        cfg = GRPOConfig.from_yaml(saved)
        cfg = apply(cfg, {"output_dir": args.resume, **ov})
    elif config:
        if not Path(config).is_file():
            raise FileNotFoundError(f"config file {config} not found")
        cfg = apply(GRPOConfig.from_yaml(config), ov)
    else:
        from ..rl.default_run import default_run_config

        dev = ov.get("device")
        cfg = apply(default_run_config(None if dev in (None, "auto") else dev), ov)
    return cfg


def apply(cfg, ov: dict[str, str]):
    """cfg with the command line's values. A dataset named there starts with no options unless they
    are given too: the base's options belong to the base's dataset (the default run's reasoning-gym
    options mean nothing to a .jsonl file)."""
    for name in ("dataset", "eval_dataset"):
        if f"{name}_name" in ov and f"{name}_config" not in ov and ov[f"{name}_name"] != getattr(cfg, f"{name}_name"):
            ov = {**ov, f"{name}_config": "{}"}
    return cfg.with_overrides(ov)


def run(args):
    cfg = build_config(args)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    from ..rl import GRPOTrainer
    from ..rl.run_folder import earlier_run

    if not args.resume and not cfg.overwrite_output_dir and earlier_run(cfg.output_dir):
        # the trainer refuses it too; here before minutes of model loading
        from ..rl.run_folder import refuse_or_clear

        refuse_or_clear(cfg.output_dir, overwrite=False)
    from .preflight import preflight

    trainer = GRPOTrainer(cfg, task=preflight(cfg))
    if args.resume:
        step = trainer.resume()
        if trainer.dist.is_main:
            print(f"qerl train: resuming {args.resume} at step {step}/{cfg.max_steps}")
    import time

    t0 = time.perf_counter()
    rows = trainer.train()
    wall = time.perf_counter() - t0
    if not trainer.dist.is_main:  # under torchrun, rank 0 reports
        trainer.dist.close()
        return 0
    if rows:
        last = rows[-1]
        print(f"qerl train: {len(rows)} steps to step {trainer.step}; last reward {last['reward_mean']:.3f}, "
              f"accuracy {last.get('accuracy', float('nan')):.3f}; adapter in {cfg.output_dir}/adapter")
    if trainer.evals:
        print(summary_table(trainer.evals, wall))
    from .plot import plot

    try:
        print(f"curves: {plot(cfg.output_dir)}")
    except ValueError as e:  # no metrics rows (nothing ran)
        print(f"qerl train: no curves ({e})")
    trainer.dist.close()
    return 0


def summary_table(evals: list[dict], wall_s: float) -> str:
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
    lines.append(f"training + evaluation wall time: {wall_s / 60:.1f} min")
    return "\n".join(lines)

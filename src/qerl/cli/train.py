"""qerl train [CONFIG.yaml] [--field value ...] | qerl train --resume DIR: GRPO/DAPO + AQN training."""

from __future__ import annotations

USAGE = "qerl train [CONFIG.yaml] [--field value ...] | qerl train --resume DIR [--field value ...]"
HELP = "train a LoRA policy on 4-bit weights with GRPO/DAPO and AQN (every config field is a --flag)"


def add_arguments(p):
    # CONFIG.yaml (optional, first) and --field value pairs arrive as free arguments (see cli.main)
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its latest checkpoint")
    p.add_argument("--print_config", action="store_true", help="print the documented YAML config and exit")
    p.set_defaults(overrides=[])  # --field value pairs (any GRPOConfig field), collected by the main parser


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
    ov = parse_overrides(tokens)
    if args.resume:
        saved = Path(args.resume) / "config.yaml"
        if not saved.exists():
            raise FileNotFoundError(f"{saved}: not found (is {args.resume} a qerl run directory?)")
        cfg = GRPOConfig.from_yaml(saved)
        cfg = cfg.with_overrides({"output_dir": args.resume, **ov})
    elif config:
        if not Path(config).is_file():
            raise FileNotFoundError(f"config file {config} not found")
        cfg = GRPOConfig.from_yaml(config).with_overrides(ov)
    else:
        cfg = GRPOConfig().with_overrides(ov)
    return cfg


def run(args):
    cfg = build_config(args)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    from ..rl import GRPOTrainer

    trainer = GRPOTrainer(cfg)
    if args.resume:
        step = trainer.resume()
        print(f"qerl train: resuming {args.resume} at step {step}/{cfg.max_steps}")
    rows = trainer.train()
    if rows:
        last = rows[-1]
        print(f"qerl train: {len(rows)} steps to step {trainer.step}; last reward {last['reward_mean']:.3f}, "
              f"accuracy {last.get('accuracy', float('nan')):.3f}; adapter in {cfg.output_dir}/adapter")
    return 0

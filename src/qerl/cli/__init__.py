"""The `qerl` command line: one subcommand a module."""

from __future__ import annotations

import argparse
import os
import sys

from . import bench, evaluate, export, generate, inspect, plot, quantize, sft, study, train
from .examples import epilog
from .spelling import both_spellings

COMMANDS = {"inspect": inspect, "quantize": quantize, "export": export, "generate": generate, "bench": bench,
            "train": train, "sft": sft, "eval": evaluate, "plot": plot, "study": study}


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def glue_negative_numbers(argv: list[str]) -> list[str]:
    """`--learning_rate -1e-3` as `--learning_rate=-1e-3`: argparse takes a negative number with an exponent
    for an option ("expected one argument"); glued to its flag, the value reaches the field's own check."""
    out: list[str] = []
    for t in argv:
        if out and t.startswith("-") and _is_number(t) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={t}"
        else:
            out.append(t)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = glue_negative_numbers(list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(prog="qerl", description="RL of LLMs on 4-bit weights (QeRL).")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, mod in COMMANDS.items():
        # train: no prefix matching, so a misspelt field reaches the config's "did you mean"
        p = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           usage=getattr(mod, "USAGE", None), epilog=epilog(name),
                           formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=name not in ("train", "sft"))
        mod.add_arguments(p)
        both_spellings(p, skip_dest_prefixes=("config__", "sft__"))  # --max_new_tokens and --max-new-tokens
    args, extra = parser.parse_known_args(argv)
    if extra:  # only `train` (and `study run`, for its runs) take free --field value pairs (any config field)
        if args.command in ("train", "sft"):
            args.overrides = extra
        elif args.command == "study":
            args.train_args = [a for a in extra if a != "--"]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return COMMANDS[args.command].run(args) or 0
    except KeyboardInterrupt:  # `qerl train` says what was saved itself; the others have nothing to save
        print(f"qerl {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, KeyError, ModuleNotFoundError) as e:
        if os.environ.get("QERL_DEBUG"):  # the traceback, for bug reports
            raise
        print(f"qerl {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

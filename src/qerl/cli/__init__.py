"""The `qerl` command line: one subcommand a module."""

from __future__ import annotations

import argparse
import os
import sys

from . import bench, evaluate, export, generate, inspect, plot, quantize, sft, study, train
from .examples import epilog
from .spelling import both_spellings
from .vocabulary import apply as trl_vocabulary

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
    command = next((a for a in argv if not a.startswith("-")), "")
    try:  # Ctrl-C while the parser is built (it imports torch): one line too, no traceback
        return _main(argv)
    except KeyboardInterrupt:  # `qerl train` and `qerl sft` say what was saved themselves, once training started
        after_interrupt()
        print(interrupted_line(command if command in COMMANDS else ""), file=sys.stderr, flush=True)
        return 130


def after_interrupt() -> None:
    """Once a Ctrl-C is caught and reported: the process ends with status 130, as it says.

    - CPython kills itself with SIGINT at exit when a KeyboardInterrupt last left code run through
      PyRun_String (as pybind11's eval runs it, inside torch and transformers' start-up), even when
      the program caught it: exit status -2 instead of 130. One trivial PyRun_String resets that flag.
    - Cleanup (locks, worker processes) runs next; another Ctrl-C ends the process at once with 130
      instead of a traceback from inside that cleanup."""
    import signal

    try:
        import ctypes

        ctypes.pythonapi.PyRun_SimpleStringFlags(b"pass", None)
    except (ImportError, AttributeError, OSError):  # not CPython: nothing to reset
        pass
    try:
        signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    except ValueError:  # not the main thread
        pass


def interrupted_line(command: str) -> str:
    """The line a command stopped by Ctrl-C before it wrote anything ends with: `qerl train`'s shape."""
    if command in ("train", "sft"):
        return (f"qerl {command}: stopped by SIGINT before training started; no checkpoint saved yet; start again "
                f"with the same command (add --overwrite_output_dir if the folder holds its metrics)")
    what = {"export": "nothing written (the output folder is unchanged)",
            "quantize": "nothing written (the output folder is unchanged)",
            "eval": "no report written"}.get(command, "nothing written")
    return f"qerl{' ' + command if command else ''}: stopped by SIGINT; {what}"


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="qerl", description="RL of LLMs on 4-bit weights (QeRL).")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, mod in COMMANDS.items():
        # train: no prefix matching, so a misspelt field reaches the config's "did you mean"
        p = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           usage=getattr(mod, "USAGE", None), epilog=epilog(name),
                           formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=name not in ("train", "sft"))
        mod.add_arguments(p)
        both_spellings(p, skip_dest_prefixes=("config__", "sft__"))  # --max_new_tokens and --max-new-tokens
        trl_vocabulary(name, p)  # TRL's names shown, one spelling each; the others are hidden aliases
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
    except (ValueError, OSError, KeyError, ModuleNotFoundError) as e:
        if os.environ.get("QERL_DEBUG"):  # the traceback, for bug reports
            raise
        from .hub import with_offline_choices

        print(f"qerl {args.command}: error: {with_offline_choices(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""One flag vocabulary across `qerl train`, `sft`, `eval`, `generate` and `export`: TRL's names, spelt as TRL
spells them (underscores: --model_name_or_path, --dataset_name, --dataset_config, --max_completion_length,
--top_p ...). qerl's older flags and the hyphenated spellings stay as hidden aliases: they parse, and
--help shows each option once, under its TRL name."""

from __future__ import annotations

import argparse

# per command: qerl's older flag -> TRL's name for it
RENAMED = {
    "eval": {"--dataset": "--dataset_name", "--max-new-tokens": "--max_completion_length"},
    "generate": {"--max-new-tokens": "--max_completion_length"},
}
MODEL_FLAGS = ("--model_name_or_path", "--model")  # the model as a flag too, where it is a positional


def _underscored(opt: str) -> str:
    return "--" + opt[2:].replace("-", "_") if opt.startswith("--") else opt


def rename(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """`new` becomes the shown flag of the option `old` names; every spelling of `old` still parses."""
    action = parser._option_string_actions[old]
    if action.metavar is None and action.nargs != 0:
        action.metavar = new[2:].upper()
    for spelling in (new, _underscored(new), new.replace("_", "-")):
        parser._option_string_actions.setdefault(spelling, action)
    action.option_strings = [o for o in action.option_strings if not o.startswith("--")] + [new] + \
        [o for o in action.option_strings if o.startswith("--")]


def show_one_spelling(parser: argparse.ArgumentParser) -> None:
    """--help lists each option once (its short flag, if any, and its first long flag in TRL's
    underscore spelling); the other spellings stay registered and parse."""
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if len(longs) < 2 and all(_underscored(o) == o for o in longs):
            continue
        shown = _underscored(longs[0])
        parser._option_string_actions.setdefault(shown, action)
        action.option_strings = [o for o in action.option_strings if not o.startswith("--")] + [shown]


def add_model_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(*MODEL_FLAGS, dest="model_flag", default=None, metavar="MODEL",
                        help="the model (TRL's name for the MODEL argument)")


def take_model_flag(args, positional_default=None) -> None:
    """--model_name_or_path given: it is the model (with a MODEL argument too, they must agree)."""
    flag = getattr(args, "model_flag", None)
    if flag is None:
        return
    if args.model not in (None, positional_default, flag):
        raise ValueError(f"the model is given twice: {args.model} and --model_name_or_path {flag}")
    args.model = flag


def apply(command: str, parser: argparse.ArgumentParser) -> None:
    for old, new in RENAMED.get(command, {}).items():
        rename(parser, old, new)
    show_one_spelling(parser)

"""One flag convention for every subcommand: both spellings of a flag are the same flag
(`--max_new_tokens` and `--max-new-tokens` in eval, generate, quantize, study...; `qerl train` and
`qerl sft` took both for their config fields already). --help shows the flag as defined first,
then the other spelling."""

from __future__ import annotations

import argparse


def _spellings(opt: str) -> list[str]:
    """'--max-new-tokens' -> ['--max-new-tokens', '--max_new_tokens'] (as defined first); short flags as they are."""
    if not opt.startswith("--") or not any(c in opt[2:] for c in "-_"):
        return [opt]
    name = opt[2:]
    return list(dict.fromkeys([opt, f"--{name.replace('-', '_')}", f"--{name.replace('_', '-')}"]))


def both_spellings(parser: argparse.ArgumentParser, skip_dest_prefixes: tuple[str, ...] = ()) -> None:
    """Give every long flag of `parser` both spellings, the defined one first (shown first in --help).
    Actions whose dest starts with one of `skip_dest_prefixes` are left alone (train's config fields
    take both spellings through their own path)."""
    for action in parser._actions:
        if not action.option_strings or action.dest.startswith(skip_dest_prefixes):
            continue
        if all(len(_spellings(o)) == 1 for o in action.option_strings):
            continue  # nothing to spell two ways (--help, --seed, -k)
        opts: list[str] = []
        for o in action.option_strings:
            for s in _spellings(o):
                if s not in opts:
                    opts.append(s)
        for o in opts:
            owner = parser._option_string_actions.get(o)
            if owner is None:
                parser._option_string_actions[o] = action
            elif owner is not action:  # another flag already has this spelling: keep it theirs
                opts.remove(o)
        action.option_strings = opts

"""One flag convention for every subcommand: the underscore spelling (TRL's field names, `qerl train`'s
flags) is the documented one and the dash spelling is accepted too (`--max_new_tokens` and
`--max-new-tokens` are the same flag in eval, generate, train, sft, ...)."""

from __future__ import annotations

import argparse


def _spellings(opt: str) -> list[str]:
    """'--max-new-tokens' -> ['--max_new_tokens', '--max-new-tokens'] (underscores first); short flags as they are."""
    if not opt.startswith("--") or not any(c in opt[2:] for c in "-_"):
        return [opt]
    name = opt[2:]
    return [f"--{name.replace('-', '_')}", f"--{name.replace('_', '-')}"]


def both_spellings(parser: argparse.ArgumentParser, skip_dest_prefixes: tuple[str, ...] = ()) -> None:
    """Give every long flag of `parser` both spellings, the underscore one first (shown first in --help).
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
        opts.sort(key=lambda o: (not o.startswith("--"), "-" in o[2:]))  # --under_score, --da-sh, -k
        for o in opts:
            owner = parser._option_string_actions.get(o)
            if owner is None:
                parser._option_string_actions[o] = action
            elif owner is not action:  # another flag already has this spelling: keep it theirs
                opts.remove(o)
        action.option_strings = opts

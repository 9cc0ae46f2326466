"""The `qerl` command as the user typed it, for the hints qerl prints (`... continue with: CMD train
--resume DIR`): `qerl` when that is what the shell finds, else the path the user ran
(`.venv/bin/qerl`), or `python -m qerl`. A hint that says `qerl` to a user whose shell has no `qerl`
on its PATH (the README runs `.venv/bin/qerl`) does not work when pasted."""

from __future__ import annotations

import os
import shlex
import shutil
import sys


def qerl_command(argv0: str | None = None) -> str:
    argv0 = sys.argv[0] if argv0 is None else argv0
    base = os.path.basename(argv0)
    if base == "__main__.py" and os.path.basename(os.path.dirname(argv0)) == "qerl":
        return f"{shlex.quote(os.path.basename(sys.executable) or 'python')} -m qerl"
    if base != "qerl":
        return "qerl"  # called from Python (a test, a notebook): the console script's name
    found = shutil.which("qerl")
    if found and os.path.realpath(found) == os.path.realpath(argv0):
        return "qerl"
    try:
        shown = os.path.relpath(argv0)
    except ValueError:
        shown = argv0
    if os.sep not in shown:
        shown = f".{os.sep}{shown}"  # a bare name would be looked up on the PATH, where it is not
    return shlex.quote(shown)

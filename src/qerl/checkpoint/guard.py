"""One guard for every command that writes a whole folder (`qerl export`, `qerl quantize`): nothing
the user keeps is replaced by mistake.

- a file where the folder goes is refused;
- the current folder, or a folder holding it, is refused (the shell would be left in a deleted folder);
- a folder that is, holds or lies inside something the command reads (`protected`: the base model, the
  adapter; links followed) is refused: `own_input`, the one rule of this and of a training run's folder
  (train/run_folder.py check_inputs);
- a folder holding a training run anywhere below it (a run folder: checkpoints, metrics, config, lock,
  adapter, at any depth) is refused, even with `--overwrite`;
- any other folder that holds anything needs `--overwrite`.
All before the model loads.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable


class OutputFolderError(ValueError):  # the CLI reports ValueErrors as one line, no traceback
    pass


def own_input(folder, inputs: dict[str, str | os.PathLike | None] | Iterable[tuple[str, str | os.PathLike | None]]
              ) -> tuple[str, str, str] | None:
    """The first of `inputs` ({what: path} or (what, path) pairs; None or a path that is not there: nothing to
    protect) that `folder`
    is, holds or lies inside, links and `~` followed, as (how: "is" | "holds" | "is inside", what, path as
    given); None when the folder is clear of them all. The one rule of every command that replaces or clears
    a folder: `qerl export`, `qerl quantize` (check_output_folder), `qerl train` / `qerl sft` and the trainers'
    run folders (train/run_folder.py check_inputs)."""
    out = Path(os.path.realpath(os.path.expanduser(str(folder))))
    for what, path in inputs.items() if isinstance(inputs, dict) else inputs:
        if path is None or not os.path.lexists(os.path.expanduser(str(path))):
            continue
        p = Path(os.path.realpath(os.path.expanduser(str(path))))
        how = "is" if out == p else "holds" if out in p.parents else "is inside" if p in out.parents else None
        if how:
            return how, what, str(path)
    return None


def run_below(folder: Path) -> tuple[Path, list[str]] | None:
    """The first folder at or below `folder` that holds a training run, with the run's names in it; None if none.
    Symbolic links are not followed (what they point to is not deleted with the folder)."""
    from .run_files import LOCK, earlier_run

    for top, dirs, _ in os.walk(folder):
        here = Path(top)
        found = earlier_run(here) + [n for n in ("config.yaml", LOCK) if (here / n).exists()]
        if found:
            return here, found
        dirs.sort()
    return None


def check_output_folder(out_dir, *, overwrite: bool, protected: dict[str, str | os.PathLike | None],
                        command: str = "the export") -> None:
    """Refuse a write of the whole folder `out_dir` that would destroy something (see the module's list).
    protected: {what: path} the command reads (None or a missing path: nothing to protect)."""
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise OutputFolderError(f"{out}: exists and is a file; {command} writes a folder there")
    o = out.resolve()
    cwd = Path.cwd().resolve()
    if o == cwd or o in cwd.parents:
        raise OutputFolderError(f"{out}: is {'the current folder' if o == cwd else 'a folder holding the current one'} "
                                f"({cwd}); {command} replaces the whole folder: choose a new output folder")
    hit = own_input(out, protected)
    if hit:
        how, what, path = hit
        harm = "would delete it" if how != "is inside" else "would write into it (and a later --overwrite delete it)"
        raise OutputFolderError(f"{out}: {how} the {what} ({path}); {command} there {harm}: choose another output "
                                f"folder")
    if not out.is_dir() or not any(out.iterdir()):
        return
    run = run_below(out)
    if run:
        where, names = run
        at = "" if where == out else f" (in {where})"
        raise OutputFolderError(f"{out}: holds a training run{at}: {', '.join(names[:4])}; {command} would delete "
                                f"it, --overwrite or not: choose another output folder")
    if not overwrite:
        names = sorted(p.name for p in out.iterdir())
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise OutputFolderError(f"{out}: not empty ({shown}); {command} replaces the whole folder: pass --overwrite "
                                f"to replace it, or choose another output folder")

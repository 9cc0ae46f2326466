"""One guard for every command that writes a whole folder (`qerl export`, `qerl quantize`): nothing
the user keeps is replaced by mistake.

- a file where the folder goes is refused;
- the current folder, or a folder holding it, is refused (the shell would be left in a deleted folder);
- a folder that is, or holds, something the command reads (`protected`: the base model, the adapter)
  is refused;
- a folder holding a training run anywhere below it (a run folder: checkpoints, metrics, config, lock,
  adapter, at any depth) is refused, even with `--overwrite`;
- any other folder that holds anything needs `--overwrite`.
All before the model loads.
"""

from __future__ import annotations

import os
from pathlib import Path


class OutputFolderError(ValueError):  # the CLI reports ValueErrors as one line, no traceback
    pass


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
    for what, path in protected.items():
        if path is None or not Path(path).expanduser().exists():
            continue
        p = Path(path).expanduser().resolve()
        if o == p or o in p.parents:
            raise OutputFolderError(f"{out}: is {'' if o == p else 'a folder holding '}the {what} ({path}); "
                                    f"{command} there would delete it: choose another output folder")
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

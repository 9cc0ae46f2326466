"""What a run folder holds, by name: its lock file, the files a run writes and its checkpoint folders.

The one description of a run folder that the trainers (train/run_folder.py, train/checkpoints.py), the
command line and the folder guard of `qerl export` / `qerl quantize` (checkpoint/guard.py) read.
"""

from __future__ import annotations

import re
from pathlib import Path

LOCK = ".qerl.lock"
# what a run writes; an output_dir holding any of these (but a config alone) holds a run
RUN_FILES = ("metrics.jsonl", "adapter", "eval", "tensorboard", "curves.png")
STATE_NAME = "trainer_state.json"  # a checkpoint's state file, written last: a checkpoint without it is incomplete
_CKPT = re.compile(r"^checkpoint-(\d+)$")


def checkpoints(output_dir, complete: bool = True) -> list[Path]:
    """Checkpoints in a run directory, oldest first (complete: those with their trainer_state.json)."""
    out = Path(output_dir)
    found = [(int(m.group(1)), p) for p in out.glob("checkpoint-*") if (m := _CKPT.match(p.name))
             and p.is_dir() and (not complete or (p / STATE_NAME).exists())]
    return [p for _, p in sorted(found)]


def earlier_run(folder) -> list[str]:
    """The names in `folder` that belong to an earlier run (empty: the folder is free to use)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [n for n in RUN_FILES if (folder / n).exists()]
    return found + [p.name for p in checkpoints(folder, complete=False)]

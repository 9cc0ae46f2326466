"""Per-step metrics: metrics.jsonl always, and the trackers report_to names (train/trackers.py).

A row's `step` is TRL's global_step: optimizer steps so far, 1 after the first step (an evaluation's row
carries the step it followed; one before training, 0). Run folders written before numbered their step
rows from 0; `read_rows` renumbers them, so resume, the plot and the summaries read one numbering.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..checkpoint.atomic import atomic_text


FOLDER_NAME = object()  # MetricsLog's run_name default: the output folder's name


class MetricsLog:
    def __init__(self, output_dir, report_to: str = "auto", resume_step: int | None = None,
                 config: dict | None = None, run_name=FOLDER_NAME):
        """resume_step: the checkpoint's global_step (its rows and those before it are kept); config: the
        run's settings, which the trackers store beside the metrics; run_name: the trackers' name of the
        run (transformers' run_name; None: each tracker names it, as transformers leaves it; by default the
        output folder's name)."""
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            # a resumed run repeats the steps after its checkpoint: drop their old lines (an old folder's
            # rows are rewritten in this numbering)
            keep = [json.dumps(r) for r in read_rows(self.path) if r["step"] <= resume_step]
            atomic_text(self.path, "".join(ln + "\n" for ln in keep))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        from .config import trackers
        from .trackers import open_trackers

        out = Path(output_dir)
        name = out.resolve().name if run_name is FOLDER_NAME else run_name
        # the trackers drop a killed run's points from the first step logged again: the one after the checkpoint
        self.trackers = open_trackers(trackers(report_to), out, config or {}, name,
                                      resume_step=None if resume_step is None else resume_step + 1)

    def write(self, row: dict) -> None:
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in row.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
        if self.trackers:
            from .trackers import scalars

            numbers = scalars(row)
            for t in self.trackers:
                t.log(numbers, row["step"])

    def close(self):
        for t in self.trackers:
            t.close()
        self.trackers = []


def read_metrics(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no metrics (is {run_dir} a qerl run directory?)")
    return read_rows(path)


def read_rows(path) -> list[dict]:
    """The rows of a metrics.jsonl. A run killed while writing leaves a partial last line: it is
    dropped with a note. A bad line elsewhere is an error naming the file and line."""
    path = Path(path)
    lines = path.read_text(errors="replace").splitlines()
    rows = []
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            row = json.loads(ln)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not a metrics row with an integer 'step'")
        except ValueError as e:
            if all(not x.strip() for x in lines[i + 1:]):
                print(f"qerl: {path}: dropped its last line, cut short when a run was killed ({ln[:60]!r}...)")
                break
            raise ValueError(f"{path}:{i + 1}: not a metrics row ({e})") from None
        rows.append(row)
    return renumbered(rows)


def is_step_row(row: dict) -> bool:
    """A training step's row (an evaluation's has no step time)."""
    return "time_step" in row


def renumbered(rows: list[dict]) -> list[dict]:
    """Rows in global_step numbering. A folder written before numbered its step rows from 0 (a step row
    at 0, which global_step never has): each becomes the count of steps done after it, the TRL surface's
    own count where the row kept one (`global_step`)."""
    if not any(is_step_row(r) and r["step"] == 0 for r in rows):
        return rows
    return [{**r, "step": r.get("global_step", r["step"] + 1)} if is_step_row(r) else r for r in rows]

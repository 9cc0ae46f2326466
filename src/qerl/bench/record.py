"""Append measured figures to the benchmark record and re-render its table.

One JSON object per figure in <results_dir>/<bench>.jsonl (append-only; default
./benchmarks/results); benchmarks/README.md shows the latest row of each (bench, case, metric).
Logs go to each bench's --out folder, never into git (benchmarks/logs is ignored).
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# relative: resolved in the current directory (the repository root when run from a checkout), so an
# installed package never writes into its own source tree; every bench takes --results_dir
RESULTS = Path("benchmarks") / "results"


def _commit() -> str | None:
    import os

    if os.environ.get("QERL_COMMIT"):  # the device machine gets the tree without .git
        return os.environ["QERL_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return None


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    import os

    return f"CPU {platform.machine()} ({os.cpu_count()} cores)"


def met(value: float, target: str | None) -> bool | None:
    if not target:
        return None
    for op in (">=", "<=", ">", "<", "=="):
        if target.startswith(op):
            t = float(target[len(op):])
            return {">=": value >= t, "<=": value <= t, ">": value > t, "<": value < t, "==": value == t}[op]
    raise ValueError(f"bad target {target!r}")


def record(bench: str, case: str, metric: str, value: float, unit: str, target: str | None = None,
           device: str | None = None, command: str | None = None, results_dir: Path = RESULTS,
           note: str | None = None) -> dict:
    row = {
        "bench": bench, "case": case, "metric": metric, "value": value, "unit": unit, "target": target,
        "met": met(value, target), "device": device or device_name(),
        "date": _dt.date.today().isoformat(), "command": command or " ".join(map(shlex.quote, sys.argv)),
        "commit": _commit(),
    }
    if note:  # e.g. what else ran on the machine (a wall time counts only measured alone)
        row["note"] = note
    results_dir.mkdir(parents=True, exist_ok=True)
    with open(results_dir / f"{bench}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def tee_log(path: Path):
    """A log function that prints and appends to `path`, flushed per line (a run cut off keeps its log)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        f.write(msg + "\n")
        f.flush()

    return log


def render(results_dir: Path = RESULTS, out: Path | None = None) -> str:
    latest: dict[tuple, dict] = {}
    for f in sorted(results_dir.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                latest[(r["bench"], r["case"], r["metric"], r.get("device"))] = r
    head = ["| bench | case | metric | value | unit | target | met | device | date | commit |",
            "|---|---|---|---|---|---|---|---|---|---|"]

    def row(r):
        v = r["value"]
        v = f"{v:.4g}" if isinstance(v, float) else v
        m = {True: "yes", False: "**no**", None: ""}[r["met"]]
        return (f"| {r['bench']} | {r['case']} | {r['metric']} | {v} | {r['unit']} | {r['target'] or ''} | {m} "
                f"| {r['device']} | {r['date']} | {r['commit'] or ''} |")

    rows = list(latest.values())
    lines = ["# Benchmark record", "",
             "Latest measured value of each figure; every row ever measured is in `results/*.jsonl`",
             "(append-only). Regenerate this file with `python -m qerl.bench.record`.", "",
             "## Figures with a target", "", *head, *[row(r) for r in rows if r.get("target")], "",
             "## All figures", "", *head, *[row(r) for r in rows if not r.get("target")]]
    text = "\n".join(lines) + "\n\nCommands: see the `command` field of each row.\n"
    (out or results_dir.parent / "README.md").write_text(text)
    return text


if __name__ == "__main__":
    print(render())

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


STAMP = ".qerl_commit"  # {"commit", "digest"} of a checkout, carried to a machine that gets the tree without .git


def source_digest() -> str:
    """The build's own hash: sha256 over src/qerl's files (relative path and bytes), what a bench runs."""
    import hashlib

    h = hashlib.sha256()
    src = ROOT / "src" / "qerl"
    # routes.json left out: the kernels bench rewrites it on the card it measures, and the rows after it still
    # ran the stamped code (the table they ran under is the bench's own record, $OUT/routes.json)
    for f in sorted(p for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                    and p.relative_to(src).as_posix() != "kernels/routes.json"):
        h.update(f.relative_to(src).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _git(*args: str) -> str | None:
    try:
        return subprocess.check_output(["git", *args], cwd=ROOT, text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return None


def commit() -> str:
    """The commit a bench runs at, read off the tree it runs, never given by hand:
    - the stamp `write_stamp` left (a copy carried to the device machine), only while the tree's digest matches it;
    - a git checkout: HEAD, with `+src-<digest>` when src/ differs from HEAD (uncommitted code ran);
    - else `src-<digest>`, the exact source that ran."""
    digest = source_digest()
    stamp = ROOT / STAMP
    if stamp.is_file():
        try:
            s = json.loads(stamp.read_text())
            if s.get("digest") == digest and s.get("commit"):
                return s["commit"]
        except ValueError:
            pass
    if (ROOT / ".git").exists():
        head = _git("rev-parse", "--short", "HEAD")
        if head:
            return f"{head}+src-{digest}" if _git("status", "--porcelain", "--", "src") else head
    return f"src-{digest}"


def write_stamp() -> dict:
    """Write ROOT/.qerl_commit for a clean checkout (refused with uncommitted src/: the stamp would lie)."""
    head = _git("rev-parse", "--short", "HEAD")
    if not head:
        raise SystemExit("record --stamp: not a git checkout")
    if _git("status", "--porcelain", "--", "src"):
        raise SystemExit("record --stamp: src/ has uncommitted changes; commit them first")
    s = {"commit": head, "digest": source_digest()}
    (ROOT / STAMP).write_text(json.dumps(s) + "\n")
    return s


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
           note: str | None = None, mode: str | None = None, transcribed_from: str | None = None) -> dict:
    """Append one figure. `mode`: the mode the figure was measured in where the case does not say it (e.g.
    "repeatable", "stream-K", "projection": a figure computed on the CPU, not measured on its card).
    `transcribed_from`: the log a figure was copied from by a program other than its bench (never by hand)."""
    row = {
        "bench": bench, "case": case, "metric": metric, "value": value, "unit": unit, "target": target,
        "met": met(value, target), "device": device or device_name(),
        "date": _dt.date.today().isoformat(), "command": command or " ".join(map(shlex.quote, sys.argv)),
        "commit": commit(),
    }
    if note:  # e.g. what else ran on the machine (a wall time counts only measured alone)
        row["note"] = note
    if mode:
        row["mode"] = mode
    if transcribed_from:
        row["transcribed_from"] = transcribed_from
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


def mode_of(r: dict) -> str:
    """The mode a figure was measured in: its own `mode` field, else read off its case and metric (rows from
    before the field). A CPU projection is never a measurement of the card it speaks of."""
    if r.get("mode"):
        return r["mode"]
    text = f"{r['case']} {r['metric']}".lower()
    if "projection" in text or "predict" in text:
        return "projection"
    if str(r.get("device", "")).startswith("CPU"):
        return "CPU"
    for key, mode in (("streamk", "stream-K (not repeatable)"), ("stream-k", "stream-K (not repeatable)"),
                      ("batch_invariant", "batch-invariant"), ("eager", "eager")):
        if key in text:
            return mode
    return "default"


def render(results_dir: Path = RESULTS, out: Path | None = None) -> str:
    latest: dict[tuple, dict] = {}
    for f in sorted(results_dir.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                latest[(r["bench"], r["case"], r["metric"], r.get("device"))] = r
    head = ["| bench | case | metric | value | unit | target | met | mode | card | date | commit |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]

    def row(r):
        v = r["value"]
        v = f"{v:.4g}" if isinstance(v, float) else v
        projected = mode_of(r) == "projection"
        m = "(projection)" if projected and r["met"] is not None else {True: "yes", False: "**no**", None: ""}[r["met"]]
        c = (r["commit"] or "") + (f" (from {r['transcribed_from']})" if r.get("transcribed_from") else "")
        return (f"| {r['bench']} | {r['case']} | {r['metric']} | {v} | {r['unit']} | {r['target'] or ''} | {m} "
                f"| {mode_of(r)} | {r['device']} | {r['date']} | {c} |")

    rows = list(latest.values())
    measured = [r for r in rows if r.get("target") and mode_of(r) != "projection"]
    projected = [r for r in rows if r.get("target") and mode_of(r) == "projection"]
    lines = ["# Benchmark record", "",
             "Latest measured value of each figure; every row ever measured is in `results/*.jsonl`",
             "(append-only). Regenerate this file with `python -m qerl.bench.record`. `mode` is the mode a figure",
             "was measured in, `card` the device it ran on; `commit` is what the bench read off the tree it ran",
             "(`+src-<hash>`: with uncommitted source; `src-<hash>`: a copy whose commit is unknown).", "",
             "## Figures with a target", "", *head, *[row(r) for r in measured], "",
             "## Projections with a target (computed on the CPU, not measurements)", "", *head,
             *[row(r) for r in projected], "",
             "## All figures", "", *head, *[row(r) for r in rows if not r.get("target")]]
    text = "\n".join(lines) + "\n\nCommands: see the `command` field of each row.\n"
    (out or results_dir.parent / "README.md").write_text(text)
    return text


if __name__ == "__main__":
    if sys.argv[1:] == ["--stamp"]:  # before a device run: name the commit the copied tree is at
        print(write_stamp())
    else:
        print(render())

"""Run the study's grid: loss x arm x seed, each a `qerl train` process, several at once.

A run whose directory already holds its final adapter and end-of-run evaluation is skipped, so
the study can be split over several device calls (`--max-minutes` stops launching new runs in
time for the call to end, `--stop-minutes` stops the running ones) and resumed: a run stopped
after a checkpoint continues from it (`qerl train --resume`). The grid runs seed by seed, so a
study cut short still has every arm at the same seeds. Each run appends one line to summary.jsonl.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from . import ARMS, LOSSES


def _arg(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def jobs(losses, arms, seeds, out: Path, extra: list[str], lr: float | None = None):
    """(run directory, qerl train argument list) of every run of the grid."""
    from . import COMMON_LR

    for loss in losses:
        if loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}; losses: {', '.join(LOSSES)}")
        for arm in arms:
            if arm not in ARMS:
                raise ValueError(f"unknown arm {arm!r}; arms: {', '.join(ARMS)}")
        for seed in seeds:
            for arm in arms:
                ov = {"learning_rate": lr or COMMON_LR, **LOSSES[loss], **ARMS[arm][1]}
                d = out / loss / arm / f"seed{seed}"
                args = ["--seed", str(seed), "--output_dir", str(d), "--report_to", "none"]
                for k, v in ov.items():
                    args += [f"--{k}", _arg(v)]
                yield d, args + list(extra)


def command(run_dir: Path, args: list[str]) -> list[str]:
    """`qerl train` for a run: from its latest checkpoint when an earlier call stopped it."""
    from ..train.checkpoints import checkpoints

    # No checkpoint yet: a fresh start over what a killed earlier call left (its metrics), which
    # `qerl train` otherwise refuses to mix with a new run.
    resume = ["--resume", str(run_dir)] if checkpoints(run_dir) else ["--overwrite_output_dir", "true"]
    return [sys.executable, "-m", "qerl", "train", *resume, *args]


def _wall_so_far(run_dir: Path) -> float:
    f = run_dir / "study_wall_s"  # earlier calls' share of a resumed run
    return float(f.read_text()) if f.exists() else 0.0


def finished(run_dir: Path) -> bool:
    """The run trained to its end and evaluated there (its adapter, or the runner's mark when the
    weights were left behind on the device)."""
    m = run_dir / "metrics.jsonl"
    if not m.exists() or not ((run_dir / "adapter" / "adapter_model.safetensors").exists()
                              or (run_dir / "study_done").exists()):
        return False
    from ..train.metrics import read_rows

    rows = read_rows(m)  # in global_step numbering: the last step's row and its evaluation share the step
    steps = max((r["step"] for r in rows if "reward_mean" in r), default=0)
    return any("eval_pass_at_1" in r and r["step"] == steps for r in rows)


def run_grid(losses, arms, seeds, out, parallel: int = 1, extra=(), max_minutes: float | None = None,
             lr: float | None = None, dry_run: bool = False, log=print, stop_minutes: float | None = None) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    todo = [(d, a) for d, a in jobs(losses, arms, seeds, out, list(extra), lr) if not finished(d)]
    total = len(list(jobs(losses, arms, seeds, out, list(extra), lr)))
    log(f"study: {total} runs, {total - len(todo)} already finished, {len(todo)} to run, {parallel} at a time")
    if dry_run:
        for d, a in todo:
            log(" ".join(map(shlex.quote, command(d, a)[2:])))
        return {"total": total, "todo": len(todo), "ran": 0, "failed": 0, "stopped": 0}
    t_start, running, ran, failed, stopped = time.perf_counter(), [], 0, 0, 0
    deadline = t_start + 60 * max_minutes if max_minutes else None
    hard = t_start + 60 * stop_minutes if stop_minutes else None

    def note(d, a, rc, wall, ok, was_stopped=False):
        row = {"run": str(d.relative_to(out)), "ok": ok, "returncode": rc, "wall_s": round(wall, 1),
               "parallel": parallel, "args": a, **({"stopped": True} if was_stopped else {})}
        with open(out / "summary.jsonl", "a") as s:
            s.write(json.dumps(row) + "\n")

    while todo or running:
        while todo and len(running) < parallel and (deadline is None or time.perf_counter() < deadline):
            d, a = todo.pop(0)
            d.mkdir(parents=True, exist_ok=True)
            cmd = command(d, a)
            if "--resume" not in cmd:  # a fresh start: an earlier call's share (its checkpoint lost) does not count
                (d / "study_wall_s").unlink(missing_ok=True)
            f = open(d / "stdout.log", "a" if "--resume" in cmd else "w")
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
            running.append((p, d, a, time.perf_counter(), f))
        if deadline is not None and time.perf_counter() >= deadline and todo:
            log(f"study: --max-minutes reached; {len(todo)} runs left for a later call")
            todo = []
        if hard is not None and time.perf_counter() >= hard and running:
            log(f"study: --stop-minutes reached; stopping {len(running)} runs (they resume from their checkpoints)")
            for p, d, a, t0, f in running:
                p.terminate()
            for p, d, a, t0, f in running:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                f.close()
                wall = _wall_so_far(d) + time.perf_counter() - t0
                (d / "study_wall_s").write_text(f"{wall:.1f}\n")
                note(d, a, p.returncode, wall, False, was_stopped=True)
                stopped += 1
            running = []
            break
        for item in list(running):
            p, d, a, t0, f = item
            if p.poll() is None:
                continue
            running.remove(item)
            f.close()
            wall = _wall_so_far(d) + time.perf_counter() - t0
            ok = p.returncode == 0 and finished(d)
            if ok:
                (d / "study_done").write_text(f"{wall:.1f}\n")
            ran += ok
            failed += not ok
            note(d, a, p.returncode, wall, ok)
            log(f"  {'done' if ok else 'FAILED'} {d.relative_to(out)} in {wall / 60:.1f} min"
                + ("" if ok else f" (exit {p.returncode}; see {d}/stdout.log)"))
        time.sleep(0.5)
    log(f"study: {ran} runs finished, {failed} failed, {stopped} stopped, "
        f"{(time.perf_counter() - t_start) / 60:.1f} min")
    return {"total": total, "todo": len(todo), "ran": ran, "failed": failed, "stopped": stopped}

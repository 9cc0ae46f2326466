"""The embedded default run, timed and scored over seeds, as a user runs it.

    python -m qerl.bench.default_run [--seeds 0,1,2] [--record] [--out DIR] [-- extra qerl train args]

Each seed is one `qerl train --seed S` process (model load, both evaluations and the
plot included in its wall time). Records per seed and the mean over seeds: wall time and the
held-out pass@1 change (points, absolute), with a 95 % interval of the mean change. Targets
(issue 42): CPU (2 cores) <= 10 min, >= +10 points and the interval's lower end >= +5; GPU
(issue 23, H200) <= 3 min and >= +12 points. A timing counts only if nothing else ran on the
machine: each row's note carries the 1-minute load average when the seed started.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ..study.report import T95
from .record import RESULTS, record, render, tee_log


def gain_interval(rows: list[dict]) -> tuple[float, float]:
    """95 % t interval of the mean held-out change over seeds. Its standard error is the larger of
    the seeds' spread and the evaluations' own sampling error (a few seeds that happen to agree
    must not hide that each evaluation of 200 problems is ±2-3 points)."""
    n = len(rows)
    if n < 2:
        return float("nan"), float("nan")
    m = statistics.mean(r["gain"] for r in rows)
    se = max(statistics.stdev(r["gain"] for r in rows), 0.0) / math.sqrt(n)
    se = max(se, math.sqrt(sum(r["se"] ** 2 for r in rows)) / n)
    t = T95[min(n - 1, len(T95)) - 1]
    return m - t * se, m + t * se


CPUINFO = Path("/proc/cpuinfo")


def cpu_model() -> str:
    """The CPU's model name (CPUINFO's first "model name"), for rows whose figure depends on it; the platform
    where unknown (no such file, or no such line: ARM kernels name no model there)."""
    try:
        for line in CPUINFO.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def run_measured(cmd: list[str], logs: Path) -> tuple[int, str, str, float]:
    """Run cmd with its output in files under `logs`: (return code, stdout, stderr, its peak resident memory
    in GiB). os.wait4 gives that one child's own rusage (RUSAGE_CHILDREN would mix in earlier seeds)."""
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "stdout.txt", "w") as o, open(logs / "stderr.txt", "w") as e:
        p = subprocess.Popen(cmd, stdout=o, stderr=e, text=True)
        _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    out, err = (logs / "stdout.txt").read_text(), (logs / "stderr.txt").read_text()
    return p.returncode, out, err, usage.ru_maxrss / 2**20  # Linux: kilobytes


def main(argv=None):
    ap = argparse.ArgumentParser(prog="qerl bench default_run")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default="runs/bench_default")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--results-dir", "--results_dir", default=str(RESULTS), help="where the jsonl goes")
    ap.add_argument("extra", nargs=argparse.REMAINDER, help="more `qerl train` arguments after --")
    args = ap.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    case = "gpu" if gpu else "cpu"
    target_time, target_gain, target_low = ("<=180", ">=12", None) if gpu else ("<=600", ">=10", ">=5")
    out = Path(args.out)
    log = tee_log(out / "bench.log")
    extra = [a for a in args.extra if a != "--"]
    if extra:  # a variant of the default run is its own case, never mixed with the default's rows
        case += " " + " ".join(extra)
    rows = []
    cmd_text = "python -m qerl.bench.default_run " + " ".join(map(shlex.quote, argv if argv is not None else sys.argv[1:]))
    rd = Path(args.results_dir)
    for seed in [int(s) for s in args.seeds.split(",")]:
        run_dir = out / f"seed{seed}"
        cmd = [sys.executable, "-m", "qerl", "train", "--seed", str(seed), "--output_dir", str(run_dir), *extra]
        log(f"$ {' '.join(map(shlex.quote, cmd))}")
        load = os.getloadavg()[0]  # others' work beside the run shows here
        t0 = time.perf_counter()
        rc, stdout, stderr, rss = run_measured(cmd, out / f"logs_seed{seed}")
        wall = time.perf_counter() - t0
        (run_dir / "stdout.log").parent.mkdir(parents=True, exist_ok=True)
        (run_dir / "stdout.log").write_text(stdout + "\n--- stderr ---\n" + stderr)
        if rc:
            log(f"seed {seed}: failed ({rc}); see {run_dir}/stdout.log\n{stderr[-2000:]}")
            return 1
        evals = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if "eval_pass_at_1" in x]
        before, after = evals[0], evals[-1]
        gain = 100 * (after["eval_pass_at_1"] - before["eval_pass_at_1"])
        r = dict(seed=seed, wall_s=wall, before=100 * before["eval_pass_at_1"], after=100 * after["eval_pass_at_1"],
                 gain=gain, se=100 * (before["eval_stderr"] ** 2 + after["eval_stderr"] ** 2) ** 0.5,
                 steps=after["step"])
        r["peak_rss_gib"] = rss
        r["note"] = f"1-min load average {load:.2f} at the start (the run alone: ~0-1); CPU {cpu_model()}"
        rows.append(r)
        log(f"seed {seed}: peak RSS {rss:.2f} GiB on {cpu_model()}")
        log(f"seed {seed}: {wall / 60:.1f} min, held-out {r['before']:.1f} -> {r['after']:.1f} % "
            f"({gain:+.1f} ± {r['se']:.1f} points), {r['steps']} steps")
        if args.record:  # each seed as soon as it is measured (a run cut off keeps its finished seeds)
            record("default_run", f"{case} seed {seed}", "wall_time", round(wall, 1), "s", None, command=cmd_text,
                   results_dir=rd, note=r["note"])
            record("default_run", f"{case} seed {seed}", "heldout_gain", round(gain, 2), "points", None,
                   command=cmd_text, results_dir=rd, note=r["note"])
            record("default_run", f"{case} seed {seed}", "peak_rss", round(rss, 2), "GiB",
                   None if gpu else "<=4", command=cmd_text, results_dir=rd, note=r["note"])
    n = len(rows)
    mean_wall = statistics.mean(r["wall_s"] for r in rows)
    mean_gain = statistics.mean(r["gain"] for r in rows)
    lo, hi = gain_interval(rows)
    log("")
    log("| seed | wall (min) | before (%) | after (%) | change (points) |")
    log("|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['seed']} | {r['wall_s'] / 60:.1f} | {r['before']:.1f} | {r['after']:.1f} | {r['gain']:+.1f} ± {r['se']:.1f} |")
    log(f"| mean of {n} | {mean_wall / 60:.1f} | {statistics.mean(r['before'] for r in rows):.1f} | "
        f"{statistics.mean(r['after'] for r in rows):.1f} | {mean_gain:+.1f} [95 % CI {lo:+.1f}, {hi:+.1f}] |")
    if args.record:
        cmd = cmd_text
        note = "; ".join(f"seed {r['seed']}: {r['note']}" for r in rows)
        record("default_run", f"{case} mean of {n} seeds", "wall_time", round(mean_wall, 1), "s", target_time,
               command=cmd, results_dir=rd, note=note)
        record("default_run", f"{case} mean of {n} seeds", "heldout_gain", round(mean_gain, 2), "points", target_gain,
               command=cmd, results_dir=rd, note=note)
        record("default_run", f"{case} mean of {n} seeds", "peak_rss", round(max(r["peak_rss_gib"] for r in rows), 2),
               "GiB", None if gpu else "<=4", command=cmd, results_dir=rd, note=note)
        record("default_run", f"{case} mean of {n} seeds", "heldout_before", round(statistics.mean(r["before"] for r in rows), 2),
               "%", None, command=cmd, results_dir=rd)
        record("default_run", f"{case} mean of {n} seeds", "heldout_after", round(statistics.mean(r["after"] for r in rows), 2),
               "%", None, command=cmd, results_dir=rd)
        for what, v in (("low", lo), ("high", hi)):
            if math.isfinite(v):
                record("default_run", f"{case} mean of {n} seeds", f"heldout_gain_ci95_{what}", round(v, 2), "points",
                       target_low if what == "low" else None, command=cmd, results_dir=rd)
        if rd == RESULTS:
            render()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The study's report: per-run figures, arm means over seeds, paired claims with t intervals, plots.

Each claim of the paper becomes a paired comparison over seeds (the same seed gives both arms
the same data order): the mean difference d, its standard error, a 95 % t interval, and a
verdict — "holds" when the interval lies above 0, "contradicted" when below, else "not shown".
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from . import ARMS, LOSSES
from .runner import finished

# two-sided 95 % quantiles of Student's t (df = 1..12), a constant table rather than a SciPy dependency
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179]

CLAIMS = [  # (claim, metric, arm, baseline)
    ("NVFP4 raises the policy's token entropy at the start", "entropy_start", "nvfp4", "bf16"),
    ("NVFP4 makes the training reward grow faster (mean reward over the run)", "reward_mean", "nvfp4", "bf16"),
    ("AQN adds sampling entropy on top of NVFP4 (noisy steps of the first half)", "rollout_entropy_noisy",
     "nvfp4_aqn", "nvfp4"),
    ("AQN adds reward on top of NVFP4", "reward_mean", "nvfp4_aqn", "nvfp4"),
    ("noise without quantization (bf16 + AQN) raises the reward", "reward_mean", "bf16_aqn", "bf16"),
    ("QeRL (NVFP4 + AQN) ends at least as accurate on held-out problems as bf16 LoRA", "heldout_after", "nvfp4_aqn",
     "bf16"),
    ("closed-loop AQN gains more held-out accuracy than the fixed schedule", "heldout_gain", "nvfp4_aqn_adaptive",
     "nvfp4_aqn"),
    ("closed-loop AQN makes the training reward grow faster than the fixed schedule", "reward_mean",
     "nvfp4_aqn_adaptive", "nvfp4_aqn"),
    ("QeRL gains more held-out accuracy than bf16 LoRA", "heldout_gain", "nvfp4_aqn", "bf16"),
    ("NVFP4 LoRA ends more accurate than NF4 LoRA (QLoRA)", "heldout_after", "nvfp4", "nf4"),
    ("QeRL gains more than bf16 LoRA at the paper's bf16 rate 5e-6 (rates differ, as in the paper)", "heldout_gain",
     "nvfp4_aqn", "bf16_lr5e-6"),
]
METRICS = [("entropy_start", "entropy at step 0", 3),
           ("rollout_entropy_noisy", "sampling entropy, AQN steps of the first half", 3),
           ("reward_mean", "reward, mean over steps", 3), ("reward_late", "reward, last 1/4", 3),
           ("heldout_before", "held-out before (%)", 1), ("heldout_after", "held-out after (%)", 1),
           ("heldout_gain", "change (points)", 1), ("wall_min", "wall (min)", 1)]


def _mean(xs):
    xs = [x for x in xs if x is not None]  # a non-finite metric is logged as null
    return sum(xs) / len(xs) if xs else float("nan")


def _problem_scores(run_dir: Path, step: int) -> dict | None:
    """{problem index: pass rate over its samples, in %} of the evaluation at `step`, if it kept them."""
    f = run_dir / "eval" / f"step_{step}.json"
    if not f.exists():
        return None
    rep = json.loads(f.read_text())
    pp = rep.get("per_problem")
    return {p["index"]: 100 * statistics.mean(p["scores"]) for p in pp} if pp else None


def _paired_eval_se(x: dict, y: dict) -> float:
    """Standard error of mean(x - y) over the problems both evaluations scored: the two share the
    problem set, so problem difficulty cancels and only the sampling disagreement is left."""
    common = sorted(x.keys() & y.keys())
    d = [x[i] - y[i] for i in common]
    return statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")


def run_figures(run_dir: Path, wall_s: float | None = None) -> dict:
    from ..train.metrics import read_rows

    rows = read_rows(run_dir / "metrics.jsonl")  # a step's row: steps done, 1 after the first
    train = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval_pass_at_1" in r]
    q = max(1, len(train) // 4)
    # AQN's stage 0 is noiseless: its noisy steps start at ceil(max_steps / aqn_stages) (sigma_at)
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").exists() else {}
    n_steps = cfg.get("max_steps", len(train))
    first_noisy = -(-n_steps // max(1, min(cfg.get("aqn_stages", 1), n_steps)))
    noisy = [r["rollout_entropy"] for r in train  # a row's step counts itself: its index is step - 1
             if first_noisy <= r["step"] - 1 < n_steps / 2 and "rollout_entropy" in r]
    ent = [r for r in train if r.get("entropy") is not None and r.get("updates", 1)]
    out = {"steps": len(train),
           "entropy_start": ent[0]["entropy"] if ent else float("nan"),
           "rollout_entropy_noisy": _mean(noisy),
           "reward_mean": _mean([r["reward_mean"] for r in train]),
           "reward_late": _mean([r["reward_mean"] for r in train[-q:]]),
           "curves": {k: [(r["step"], r.get(k)) for r in train] for k in ("reward_mean", "entropy", "rollout_entropy")},
           "wall_min": wall_s / 60 if wall_s else float("nan")}
    if evals:
        b, a = evals[0], evals[-1]
        out.update(heldout_before=100 * b["eval_pass_at_1"], heldout_after=100 * a["eval_pass_at_1"],
                   heldout_gain=100 * (a["eval_pass_at_1"] - b["eval_pass_at_1"]),
                   # within-run sampling error of the evaluations (pass@1 over a finite set and samples)
                   heldout_after_se=100 * a["eval_stderr"],
                   heldout_gain_se=100 * math.hypot(a["eval_stderr"], b["eval_stderr"]))
        pb, pa = _problem_scores(run_dir, b["step"]), _problem_scores(run_dir, a["step"])
        if pb and pa:  # per-problem pass rates (%): paired comparisons on the same problems
            out["problems"] = {"heldout_before": pb, "heldout_after": pa,
                               "heldout_gain": {i: pa[i] - pb[i] for i in pa.keys() & pb.keys()}}
    return out


def collect(outs: Path | list[Path]) -> dict:
    """{loss: {arm: {seed: figures}}} of the finished runs under `outs` (one study directory, or
    several: grids run in different calls). The same run finished in two directories is ambiguous."""
    res: dict = {}
    for out in [outs] if isinstance(outs, (str, Path)) else outs:
        out = Path(out)
        if not out.is_dir():
            raise FileNotFoundError(f"study directory {out} does not exist")
        walls = {}
        if (out / "summary.jsonl").exists():
            for line in (out / "summary.jsonl").read_text().splitlines():
                r = json.loads(line)
                if r["ok"]:
                    walls[r["run"]] = r["wall_s"]
        for loss in LOSSES:
            for arm in ARMS:
                for d in sorted((out / loss / arm).glob("seed*")):
                    if finished(d):
                        seed = int(d.name[4:])
                        runs = res.setdefault(loss, {}).setdefault(arm, {})
                        if seed in runs:
                            raise ValueError(f"{loss}/{arm}/{d.name} is finished in more than one study directory "
                                             f"(the second: {out}); keep one")
                        runs[seed] = run_figures(d, walls.get(str(d.relative_to(out))))
    return res


def mean_se(xs) -> tuple[float, float, int]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return float("nan"), float("nan"), 0
    return statistics.mean(xs), (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")), len(xs)


def paired(a: dict, b: dict, metric: str) -> dict:
    """Mean difference a - b over the seeds both have, its standard error, 95 % t interval, verdict."""
    seeds = [s for s in sorted(set(a) & set(b)) if metric in a[s] and metric in b[s]
             and not math.isnan(a[s][metric] - b[s][metric])]
    d = [a[s][metric] - b[s][metric] for s in seeds]
    m, se, n = mean_se(d)
    if n and all(metric in x[s].get("problems", {}) for x in (a, b) for s in seeds):
        # the evaluations' own sampling error, paired problem by problem within each seed
        within = math.sqrt(sum(_paired_eval_se(a[s]["problems"][metric], b[s]["problems"][metric]) ** 2
                               for s in seeds)) / n
        se = within if math.isnan(se) else max(se, within)
    elif n and all(f"{metric}_se" in x[s] for x in (a, b) for s in seeds):
        # seeds that happen to agree must not hide the evaluations' own sampling error
        within = math.sqrt(sum(a[s][f"{metric}_se"] ** 2 + b[s][f"{metric}_se"] ** 2 for s in seeds)) / n
        se = within if math.isnan(se) else max(se, within)
    if n < 2 or math.isnan(se):
        return {"n": n, "diff": m, "se": se, "lo": float("nan"), "hi": float("nan"), "verdict": "not shown (fewer than 2 seeds)"}
    t = T95[min(n - 1, len(T95)) - 1]
    lo, hi = m - t * se, m + t * se
    verdict = "holds" if lo > 0 else "contradicted" if hi < 0 else "not shown"
    return {"n": n, "diff": m, "se": se, "lo": lo, "hi": hi, "verdict": verdict}


def plot(res_loss: dict, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("reward_mean", "training reward"), ("entropy", "token entropy (training forward)"),
            ("rollout_entropy", "sampling entropy (rollout, with AQN)")]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    for i, arm in enumerate(a for a in ARMS if a in res_loss):
        runs = list(res_loss[arm].values())
        color = plt.cm.tab10(i % 10)
        for ax, (k, _) in zip(axes, keys):
            by_step: dict = {}
            for r in runs:
                for s, v in r["curves"][k]:
                    if v is not None:
                        by_step.setdefault(s, []).append(v)
            st = sorted(by_step)
            mu = [statistics.mean(by_step[s]) for s in st]
            se = [statistics.stdev(by_step[s]) / math.sqrt(len(by_step[s])) if len(by_step[s]) > 1 else 0 for s in st]
            ax.plot(st, mu, color=color, lw=1.3, label=arm)
            ax.fill_between(st, [m - e for m, e in zip(mu, se)], [m + e for m, e in zip(mu, se)], color=color, alpha=0.15)
        m, se, _ = mean_se([r.get("heldout_after") for r in runs])
        b, _, _ = mean_se([r.get("heldout_before") for r in runs])
        axes[3].bar(i, m, yerr=0 if math.isnan(se) else se, color=color, capsize=3)
        axes[3].plot([i - 0.4, i + 0.4], [b, b], color="k", lw=1)
    for ax, (_, t) in zip(axes, keys + [(None, "held-out pass@1 after (%); line: before")]):
        ax.set_title(t, fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    axes[3].set_xticks(range(len([a for a in ARMS if a in res_loss])))
    axes[3].set_xticklabels([a for a in ARMS if a in res_loss], rotation=45, fontsize=7, ha="right")
    axes[0].legend(fontsize=7)
    for ax in axes[:3]:
        ax.set_xlabel("step", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fmt(m, se, digits):
    if math.isnan(m):
        return "–"
    return f"{m:.{digits}f}" + ("" if math.isnan(se) else f" ± {se:.{digits}f}")


UNITS = {"entropy_start": "nats", "rollout_entropy_noisy": "nats", "reward_mean": "reward", "reward_late": "reward",
         "heldout_before": "%", "heldout_after": "%", "heldout_gain": "points", "wall_min": "min"}


def figures(res: dict) -> list[tuple[str, str, float, str]]:
    """The report's figures as (case, metric, value, unit) rows for benchmarks/results/study.jsonl: each arm's
    mean over seeds, each claim's difference and the ends of its 95 % interval."""
    out = []
    for loss, arms in res.items():
        for arm, runs in arms.items():
            for k, _, _ in METRICS:
                m, _, seeds = mean_se([r.get(k) for r in runs.values()])
                if seeds:
                    out.append((f"{loss} {arm} ({seeds} seeds)", k, round(m, 4), UNITS[k]))
        for _, metric, a, b in CLAIMS:
            if a in arms and b in arms:
                p = paired(arms[a], arms[b], metric)
                if math.isnan(p["lo"]):
                    continue
                for what in ("diff", "lo", "hi"):
                    out.append((f"{loss} {a} - {b} ({p['n']} seeds)", f"{metric}_{what}" if what == "diff"
                                else f"{metric}_diff_ci95_{what}", round(p[what], 4), UNITS[metric]))
    return out


def write_report(out: Path | list[Path], doc: Path, header: str = "") -> str:
    """The report of the runs under `out` (one directory or several) in `doc`, its plots and
    figures.json in a folder named after it (docs/study.md: docs/study/)."""
    res = collect(out)
    fig_dir = doc.parent / doc.stem
    lines = [header.rstrip(), ""] if header else []
    for loss, arms in res.items():
        png = plot(arms, fig_dir / f"{loss}.png", f"{loss.upper()}: mean over seeds, bands ± s.e.")
        lines += [f"## {loss.upper()}", "", f"![{loss}]({doc.stem}/{png.name})", "",
                  "| arm | seeds | " + " | ".join(t for _, t, _ in METRICS) + " |",
                  "|---|---|" + "---|" * len(METRICS)]
        for arm, runs in arms.items():
            cells = [_fmt(*mean_se([r.get(k) for r in runs.values()])[:2], dg) for k, _, dg in METRICS]
            lines.append(f"| {ARMS[arm][0]} | {len(runs)} | " + " | ".join(cells) + " |")
        lines += ["", "Claims (paired over seeds; difference = arm − baseline, 95 % t interval):", "",
                  "| claim | metric | difference | 95 % interval | seeds | verdict |", "|---|---|---|---|---|---|"]
        for claim, metric, a, b in CLAIMS:
            if a not in arms or b not in arms:
                continue
            p = paired(arms[a], arms[b], metric)
            iv = "–" if math.isnan(p["lo"]) else f"[{p['lo']:+.3g}, {p['hi']:+.3g}]"
            diff = "–" if math.isnan(p["diff"]) else f"{p['diff']:+.3g}"
            lines.append(f"| {claim} | {metric} | {diff} | {iv} | {p['n']} | **{p['verdict']}** |")
        lines.append("")
    if not res:
        lines.append("No finished runs yet.")
    text = "\n".join(lines) + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    fig_dir.mkdir(parents=True, exist_ok=True)
    (fig_dir / "figures.json").write_text(json.dumps(
        {loss: {arm: {s: {k: v for k, v in r.items() if k not in ("curves", "problems")} for s, r in runs.items()}
                for arm, runs in arms.items()} for loss, arms in res.items()}, indent=1))
    return text

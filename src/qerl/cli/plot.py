"""qerl plot RUN_DIR: a training run's curves as one PNG that reads at a glance.

A grid of titled panels with units: held-out pass@1 before/after with error bars, rewards, the
AQN sigma with its stages shaded (and, for adaptive AQN, its target and measured signal),
entropies, lengths, the engine/trainer logprob gap, loss, filtered groups and step time. Every
time-series panel marks the AQN stage boundaries, so an effect can be read against the noise.
Panels without data are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

HELP = "plot a training run's curves (held-out accuracy, reward, AQN sigma, entropy, ...) to RUN_DIR/curves.png"
COLUMNS = 3


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    series: tuple[tuple[str, str], ...]  # (metrics key, legend label)
    scale: float = 1.0  # e.g. 100 for fractions shown in %


SERIES_PANELS = [
    Panel("training reward", "mean reward", (("reward_mean", "mean reward"),)),
    Panel("training accuracy", "% correct", (("accuracy", "rollout accuracy"),), 100.0),
    Panel("token entropy", "nats / token", (("entropy", "policy (training pass)"), ("rollout_entropy", "as sampled"))),
    Panel("completion length", "tokens", (("completion_length_mean", "mean"), ("completion_length_max", "max"))),
    Panel("engine vs trainer logprobs", "|Δ log p| (nats)", (("logprob_mismatch_mean", "mean"),
                                                            ("logprob_mismatch_max", "max"))),
    Panel("loss and gradient", "loss / grad norm", (("loss", "loss"), ("grad_norm", "grad norm"))),
    Panel("groups without reward variance", "% of groups", (("filtered_group_fraction", "filtered"),), 100.0),
    Panel("step time", "seconds", (("time_step", "step"), ("time_rollout", "rollout"), ("time_update", "update"))),
]


def add_arguments(p):
    p.add_argument("run_dir")
    p.add_argument("--out", help="PNG path (default RUN_DIR/curves.png)")


def _has(rows, key):
    return any(r.get(key) is not None for r in rows if "eval_pass_at_1" not in r)


def _stage_bounds(rows) -> list[tuple[int, int, int]]:
    """(first step, last step, stage) of each AQN stage, from the rows' aqn_stage."""
    out: list[list[int]] = []
    for r in rows:
        st = r.get("aqn_stage")
        if st is None or "eval_pass_at_1" in r:
            continue
        if out and out[-1][2] == st:
            out[-1][1] = r["step"]
        else:
            out.append([r["step"], r["step"], st])
    return [tuple(x) for x in out]


def _mark_stages(ax, stages, label=False):
    for i, (lo, hi, st) in enumerate(stages):
        if i % 2:
            ax.axvspan(lo - 0.5, hi + 0.5, color="0.92", zorder=0)
        if label:
            ax.text((lo + hi) / 2, 0.97, f"stage {st}", transform=ax.get_xaxis_transform(), ha="center", va="top",
                    fontsize=6, color="0.35")


def _eval_panel(ax, evals):
    """Held-out pass@1: before / after as bars with ±1 standard error, intermediate evaluations as points."""
    first, last = evals[0], evals[-1]
    pts = [first, last] if len(evals) > 1 else [first]
    names = [f"before\n(step {first['step']})", f"after\n(step {last['step']})"][:len(pts)]
    vals = [100 * e["eval_pass_at_1"] for e in pts]
    errs = [100 * (e.get("eval_stderr") or 0.0) for e in pts]
    bars = ax.bar(names, vals, yerr=errs, capsize=5, color=["0.6", "tab:green"][:len(pts)], width=0.55)
    for b, v, e in zip(bars, vals, errs):
        ax.text(b.get_x() + b.get_width() / 2, v + e, f"{v:.1f}±{e:.1f}", ha="center", va="bottom", fontsize=7)
    if len(pts) == 2:
        ax.set_title(f"held-out pass@1: {vals[1] - vals[0]:+.1f} points", fontsize=9)
    else:
        ax.set_title("held-out pass@1", fontsize=9)
    ax.set_ylabel("% correct (±1 s.e.)", fontsize=8)
    ax.set_ylim(0, max(v + e for v, e in zip(vals, errs)) * 1.25 + 1)


def _sigma_panel(ax, rows, stages):
    train = [r for r in rows if "eval_pass_at_1" not in r]
    for key, label, style in (("sigma", "scheduled σ", "-"), ("aqn_sigma_effective", "effective σ (measured)", "--")):
        pts = [(r["step"], r[key]) for r in train if r.get(key) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, lw=1.2, label=label)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.15)  # room for the stage labels
    ax.set_ylabel("σ (relative noise)", fontsize=8)
    ax.set_title("AQN noise σ by stage", fontsize=9)
    _mark_stages(ax, stages, label=True)
    if _has(rows, "aqn_signal"):  # adaptive AQN: what σ steers, against its target
        tw = ax.twinx()
        pts = [(r["step"], r["aqn_signal"], r.get("aqn_target")) for r in train if r.get("aqn_signal") is not None]
        tw.plot([p[0] for p in pts], [p[1] for p in pts], color="tab:red", lw=1, label="signal")
        tw.plot([p[0] for p in pts], [p[2] for p in pts], color="tab:red", lw=1, ls=":", label="target")
        tw.set_ylabel("controlled signal", fontsize=8, color="tab:red")
        tw.tick_params(labelsize=7)


def figure(rows, title: str = ""):
    """The matplotlib figure of a run's metrics rows (the grid `plot` saves)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [r for r in rows if r.get("eval_pass_at_1") is not None]
    stages = _stage_bounds(rows)
    series = [p for p in SERIES_PANELS if any(_has(rows, k) for k, _ in p.series)]
    sigma = _has(rows, "sigma") or _has(rows, "aqn_sigma_effective")
    n = bool(evals) + sigma + len(series)
    if n == 0:
        raise ValueError("no metrics to plot")
    nrows = -(-n // COLUMNS)
    fig, axes = plt.subplots(nrows, COLUMNS, figsize=(4.2 * COLUMNS, 3.0 * nrows), squeeze=False)
    flat = list(axes.flat)
    i = 0
    if evals:
        _eval_panel(flat[i], evals)
        i += 1
    if sigma:
        _sigma_panel(flat[i], rows, stages)
        i += 1
    train = [r for r in rows if "eval_pass_at_1" not in r]
    for p in series:
        ax = flat[i]
        i += 1
        for key, label in p.series:
            pts = [(r["step"], r[key] * p.scale) for r in train if r.get(key) is not None]
            if pts:
                ax.plot([q[0] for q in pts], [q[1] for q in pts], lw=1.2, label=label)
        _mark_stages(ax, stages)
        ax.set_title(p.title, fontsize=9)
        ax.set_ylabel(p.ylabel, fontsize=8)
    for j, ax in enumerate(flat):
        if j >= i:
            ax.set_visible(False)
            continue
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0] and len(ax.get_legend_handles_labels()[0]) > 1:
            ax.legend(fontsize=6, loc="best")
        if j > 0 or not evals:
            ax.set_xlabel("step", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot(run_dir, out=None):
    from pathlib import Path

    import matplotlib.pyplot as plt

    from ..train.metrics import read_metrics

    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl is empty")
    fig = figure(rows, title=str(run_dir))
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def run(args):
    print(plot(args.run_dir, args.out))
    return 0

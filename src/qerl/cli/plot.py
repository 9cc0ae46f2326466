"""qerl plot RUN_DIR: reward, accuracy, entropy, completion length and AQN sigma curves as a PNG."""

from __future__ import annotations

HELP = "plot a training run's curves (reward, entropy, length, sigma) to RUN_DIR/curves.png"

PANELS = [("reward_mean", "reward"), ("accuracy", "accuracy"), ("eval_pass_at_1", "held-out pass@1"), ("entropy", "token entropy"),
          ("rollout_entropy", "sampling entropy"),
          ("completion_length_mean", "completion length"), ("sigma", "AQN sigma"), ("logprob_mismatch_mean",
                                                                                   "|logprob engine - trainer|")]


def add_arguments(p):
    p.add_argument("run_dir")
    p.add_argument("--out", help="PNG path (default RUN_DIR/curves.png)")


def plot(run_dir, out=None):
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..rl.metrics import read_metrics

    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}/metrics.jsonl is empty")
    panels = [(k, t) for k, t in PANELS if any(r.get(k) is not None for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 2.8), squeeze=False)
    for ax, (k, title) in zip(axes[0], panels):
        pts = [(r["step"], r[k], r.get("eval_stderr")) for r in rows if r.get(k) is not None]
        if k == "eval_pass_at_1":  # a few points with their standard errors
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] or 0 for p in pts], marker="o", capsize=3)
        else:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def run(args):
    print(plot(args.run_dir, args.out))
    return 0

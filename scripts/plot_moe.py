"""One MoE expert layer's time against tokens, as `qerl bench moe` records it in benchmarks/results/moe.jsonl (the
latest run of each case): transformers' loop, the grouped path and the decode GEMV, log-log, one panel a model shape.

    python scripts/plot_moe.py [--results benchmarks/results/moe.jsonl] [--out benchmarks/moe_expert_layer.png]
"""

import argparse
import json
import re
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--results", default="benchmarks/results/moe.jsonl")
ap.add_argument("--out", default="benchmarks/moe_expert_layer.png")
a = ap.parse_args()
rows = [json.loads(line) for line in open(a.results) if line.strip()]
latest = {}
for r in rows:  # later rows replace earlier ones of the same case and metric
    latest[(r["case"], r["metric"])] = r
series = defaultdict(lambda: defaultdict(list))  # shape -> metric -> [(tokens, µs, commit)]
for (case, metric), r in latest.items():
    shape, tokens = re.fullmatch(r"(.*) T=(\d+)", case).groups()
    commit = r["commit"] + (", torch dequantize" if "before moe_dequant" in r.get("note", "") else "")
    series[shape][metric].append((int(tokens), r["value"], commit))
labels = {"loop_us": "transformers' loop (each hit expert dequantized)", "grouped_us": "grouped (one grouped_mm a projection)",
          "gemv_us": "grouped 4-bit GEMV (decode)"}
fig, axes = plt.subplots(1, len(series), figsize=(6.5 * len(series), 4.6), squeeze=False)
for ax, (shape, ms) in zip(axes[0], sorted(series.items())):
    for metric in ("loop_us", "grouped_us", "gemv_us"):
        pts = sorted(ms.get(metric, []))
        if pts:
            commits = ", ".join(sorted({c for *_, c in pts}))
            ax.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], "o-", label=f"{labels[metric]} [{commits}]")
    ax.set(xscale="log", yscale="log", xlabel="tokens in the call", ylabel="ms a layer call", title=shape)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
fig.suptitle(f"One MoE expert layer on the {rows[-1]['device']} (qerl bench moe)")
fig.tight_layout()
fig.savefig(a.out, dpi=110)
print(a.out)

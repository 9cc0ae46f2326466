"""Data-parallel scaling of a GRPO step: speedup and efficiency over GPU counts (issue 9).

    torchrun --standalone --nproc_per_node N -m qerl bench step ... --json dpN.json   # N = 1, 2, 4, 8
    qerl bench scaling dp1.json dp2.json dp4.json dp8.json [--record]

Each JSON is one `qerl bench step` case run under torchrun with the same global batch (the step
splits the prompts over the ranks). Speedup is the one-GPU step time over the N-GPU one;
efficiency is speedup / N. The targets (>= 85 % at 2 GPUs, >= 75 % at 8) are the issue's.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from .record import RESULTS, record

TARGETS = {2: ">=0.85", 8: ">=0.75"}  # scaling efficiency; other GPU counts have none


def _base_case(case: str) -> str:
    return re.sub(r" dp\d+", "", case)


def load(paths) -> list[dict]:
    """The step cases, ordered by world size; they must be one case at different GPU counts."""
    cases = []
    for p in paths:
        r = json.loads(Path(p).read_text())
        if isinstance(r, list):
            raise ValueError(f"{p}: a lever sweep; give one case per file")
        if "world_size" not in r:
            raise ValueError(f"{p}: no world_size field (written by an older qerl bench step)")
        r["_path"] = str(p)
        cases.append(r)
    cases.sort(key=lambda r: r["world_size"])
    worlds = [r["world_size"] for r in cases]
    if len(set(worlds)) != len(worlds):
        raise ValueError(f"two files at the same GPU count: {worlds}")
    if cases and cases[0]["world_size"] != 1:
        raise ValueError(f"no one-GPU case among {', '.join(map(str, paths))}: speedups need it")
    base = {_base_case(r["case"]) for r in cases}
    if len(base) > 1:
        raise ValueError("the files are different cases, not one case at several GPU counts: " + "; ".join(sorted(base)))
    return cases


def scaling(cases: list[dict]) -> list[dict]:
    """Per GPU count: step time, tokens/s, speedup over one GPU and efficiency (None where it did not fit)."""
    one = cases[0]
    rows = []
    for r in cases:
        ok = bool(r.get("fits")) and bool(one.get("fits"))
        sp = one["step_s"] / r["step_s"] if ok else None
        rows.append({"gpus": r["world_size"], "fits": bool(r.get("fits")), "step_s": r.get("step_s"),
                     "rollout_s": r.get("rollout_s"), "update_s": r.get("update_s"),
                     "step_tokens_per_s": r.get("step_tokens_per_s"), "speedup": sp,
                     "efficiency": sp / r["world_size"] if sp is not None else None,
                     "case": r["case"], "device": r.get("device")})
    return rows


def table(rows: list[dict]) -> str:
    out = ["| GPUs | step s | rollout s | update s | tokens/s | speedup | efficiency | target |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["fits"]:
            out.append(f"| {r['gpus']} | out of memory | | | | | | {TARGETS.get(r['gpus'], '')} |")
            continue
        eff = "" if r["efficiency"] is None else f"{100 * r['efficiency']:.0f} %"
        sp = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        out.append(f"| {r['gpus']} | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['update_s']:.2f} "
                   f"| {r['step_tokens_per_s']:.0f} | {sp} | {eff} | {TARGETS.get(r['gpus'], '')} |")
    return "\n".join(out)


def record_rows(rows: list[dict], command: str, results_dir: Path) -> int:
    n = 0
    base = _base_case(rows[0]["case"])
    for r in rows:
        if r["gpus"] == 1 or r["efficiency"] is None:
            continue
        case = f"{base} dp{r['gpus']} vs 1 GPU"
        record("scaling", case, "speedup", round(r["speedup"], 4), "x", None, device=r["device"],
               command=command, results_dir=results_dir)
        record("scaling", case, "efficiency", round(r["efficiency"], 4), "fraction", TARGETS.get(r["gpus"]),
               device=r["device"], command=command, results_dir=results_dir)
        record("scaling", case, "step_tokens_per_s", round(r["step_tokens_per_s"], 1), "tok/s", None,
               device=r["device"], command=command, results_dir=results_dir)
        n += 3
    return n


def main(argv=None):
    ap = argparse.ArgumentParser(prog="qerl bench scaling", description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="qerl bench step --json files, one per GPU count (one of them 1 GPU)")
    ap.add_argument("--record", action="store_true", help="append to benchmarks/results/scaling.jsonl")
    ap.add_argument("--results-dir", "--results_dir", default=None)
    a = ap.parse_args(argv)
    try:
        rows = scaling(load(a.json))
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"qerl bench scaling: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    if a.record:
        command = "qerl bench scaling " + " ".join(argv if argv is not None else sys.argv[1:])
        n = record_rows(rows, command, Path(a.results_dir) if a.results_dir else RESULTS)
        print(f"scaling: {n} figures recorded")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

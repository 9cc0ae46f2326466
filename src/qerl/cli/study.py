"""qerl study run|report: the quantization-noise study (qerl.study)."""

from __future__ import annotations

from pathlib import Path

HELP = "the quantization-noise study: run the arms x seeds grid, or write its report (docs/study.md)"


def add_arguments(p):
    from ..study import ARMS, LOSSES
    from .argtypes import positive

    p.add_argument("action", choices=["run", "report"])
    p.add_argument("--out", action="append", default=None,
                   help="the study's run directory (default runs/study); report: give it again to join grids run apart")
    p.add_argument("--losses", default=",".join(LOSSES))
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--parallel", type=positive, default=1, help="runs at once (a GPU holds many of these small runs)")
    p.add_argument("--max-minutes", type=float, default=None, help="launch no run after this many minutes")
    p.add_argument("--stop-minutes", type=float, default=None,
                   help="stop the running runs after this many minutes (a later call resumes them from their checkpoints)")
    p.add_argument("--lr", type=float, default=None, help="the common learning rate (default: the default run's)")
    p.add_argument("--dry-run", action="store_true", help="print the runs' commands")
    p.add_argument("--doc", default="docs/study.md", help="report: the Markdown file (plots beside it)")
    p.add_argument("--header", default=None, help="report: a Markdown file to put above the tables")
    p.add_argument("--record", action="store_true", help="report: append its figures to benchmarks/results/study.jsonl")
    p.add_argument("--device", default=None, help="report --record: the machine the runs ran on (default: this one)")
    p.set_defaults(train_args=[])  # run: more `qerl train` --field value pairs (collected by the main parser)


def run(args):
    outs = [Path(o) for o in (args.out or ["runs/study"])]
    if args.action == "report":
        from ..study.report import write_report

        header = Path(args.header).read_text() if args.header else ""
        print(write_report(outs, Path(args.doc), header))
        if args.record:
            import shlex
            import sys

            from ..bench.record import device_name
            from ..study.report import collect

            n = record_figures(collect(outs), args.device or device_name(),
                               "qerl study report " + " ".join(map(shlex.quote, sys.argv[3:])))
            print(f"study: {n} figures appended to benchmarks/results/study.jsonl")
        return 0
    from ..study.runner import run_grid

    if len(outs) > 1:
        raise SystemExit("qerl study run: one --out directory (several are for report)")
    extra = [a for a in args.train_args if a != "--"]
    r = run_grid(args.losses.split(","), args.arms.split(","), [int(s) for s in args.seeds.split(",")], outs[0],
                 args.parallel, extra, args.max_minutes, args.lr, args.dry_run,
                 stop_minutes=args.stop_minutes)
    return 1 if r["failed"] else 0


def record_figures(res: dict, device: str, command: str, results_dir: Path | None = None) -> int:
    """Append the report's figures (qerl.study.report.figures) to benchmarks/results/study.jsonl.
    Returns the number of rows."""
    from ..bench.record import RESULTS, record
    from ..study.report import figures

    rows = figures(res)
    for case, metric, value, unit in rows:
        record("study", case, metric, value, unit, None, device=device, command=command,
               results_dir=results_dir or RESULTS)
    return len(rows)

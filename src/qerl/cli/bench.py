"""qerl bench NAME [ARGS...]: run one of the benchmarks (src/qerl/bench/NAME.py)."""

from __future__ import annotations

import argparse
import importlib

NAMES = ("kernels", "rollout", "memory", "default_run", "step", "trl_step", "scaling", "moe", "overlap", "cpu_rollout")
HELP = f"run a benchmark: {' | '.join(NAMES)} (pass --help after the name for its options)"


def add_arguments(p):
    p.add_argument("name", choices=NAMES)
    p.add_argument("args", nargs=argparse.REMAINDER)


def run(args):
    return importlib.import_module(f"qerl.bench.{args.name}").main(args.args)

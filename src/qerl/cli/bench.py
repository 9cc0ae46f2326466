"""qerl bench NAME [ARGS...]: run one of the benchmarks (kernels, rollout, memory)."""

from __future__ import annotations

import argparse
import importlib

HELP = "run a benchmark: kernels | rollout | memory | default_run | step | trl_step | scaling (pass --help after the name for its options)"
NAMES = ("kernels", "rollout", "memory", "default_run", "step", "trl_step", "scaling")


def add_arguments(p):
    p.add_argument("name", choices=NAMES)
    p.add_argument("args", nargs=argparse.REMAINDER)


def run(args):
    return importlib.import_module(f"qerl.bench.{args.name}").main(args.args)

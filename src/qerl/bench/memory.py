"""Weight memory of the quantized formats: SmolLM2 for real, and the large models' linear layers.

    python -m qerl.bench.memory [--record]
    qerl bench memory --step-only --shape qwen3-30b-a3b [--kv-cache-gb G] [--logprob-chunk N] [--no-humming] ...
    qerl bench memory --step-only --shape qwen3-30b-a3b --candidates [--target-gib 22] [--margin-gib 1] ...
    qerl bench memory --fit-on SELECTOR [--fit-capped-on SELECTOR] [--predict SELECTOR ...] [--measured 'CASE=GiB' ...]
        [--record]

SmolLM2-135M-Instruct is loaded and quantized for real (time and bytes measured).
For Qwen2.5-7B one full decoder layer of random weights in the real shapes is
quantized and its bytes measured, times the layer count. The 14B/32B/72B rows
come from the formats' tensor shapes (no weights are made: they are too big for
this CPU); they are marked `from_shapes`. MoE shapes (Qwen3-30B-A3B, gpt-oss-20b/120b) get a whole
GRPO step's projected GPU memory (bench/step_plan.py), marked `projection`, for the settings given
(named as `qerl bench step` names them; defaults: the settings of the H100 step at ed5e22d whose two peaks the
model's allowances are read from, step_plan.FIT_RECORD); --step-only prints just that, and with --candidates
the settings predicted under a target, ranked (bench/step_candidates.py; docs/moe-24gb.md). --fit-on reads the
allowances off one measured step instead and predicts the others (bench/memory_fit.py): the out-of-sample check;
--fit-capped-on reads the slack of runs under a memory cap off one capped step.
"""

from __future__ import annotations

import argparse
import time

import torch

from ..formats import get_format
from .record import record, render

SHAPES = {  # hidden, intermediate, layers, heads, kv heads (head_dim = hidden / heads)
    "qwen2.5-7b": (3584, 18944, 28, 28, 4),
    "qwen2.5-14b": (5120, 13824, 48, 40, 8),
    "qwen2.5-32b": (5120, 27648, 64, 40, 8),
    "qwen2.5-72b": (8192, 29568, 80, 64, 8),
}


def layer_shapes(name):
    h, i, _, heads, kv = SHAPES[name]
    d = h // heads
    return {"q": (h, h), "k": (kv * d, h), "v": (kv * d, h), "o": (h, h), "gate": (i, h), "up": (i, h), "down": (h, i)}


def measured_layer_bytes(name, fmt_name, seed=0):
    fmt = get_format(fmt_name)
    g = torch.Generator().manual_seed(seed)
    shapes = layer_shapes(name)
    total = 0
    for group in (("q", "k", "v"), ("o",), ("gate", "up"), ("down",)):
        ws = [(torch.randn(shapes[k], generator=g) * 0.02).to(torch.bfloat16) for k in group]
        gs = fmt.global_scale(ws) if fmt.has_global_scale else None
        for w in ws:
            total += sum(t.numel() * t.element_size() for t in fmt.quantize(w, gs).values())
        del ws
    return total


STEP_TERMS = ("experts", "attention", "dense", "kernel_copies", "lora_and_optimizer", "kv_cache", "rollout_working",
              "update_working", "residual", "allocator_slack", "peak_allocated", "peak_reserved")


def add_step_args(ap: argparse.ArgumentParser) -> None:
    """The step's settings, named as `qerl bench step` names them (defaults: the calibrated H100 step)."""
    from .step_plan import StepSettings

    d = StepSettings()
    ap.add_argument("--shape", default=None, help="one MoE shape (qwen3-30b-a3b | gpt-oss-20b | gpt-oss-120b)")
    ap.add_argument("--prompts", type=int, default=d.prompts)
    ap.add_argument("--num-generations", type=int, default=d.rows // d.prompts)
    ap.add_argument("--prompt-len", type=int, default=d.prompt_len)
    ap.add_argument("--max-new-tokens", type=int, default=d.new_tokens)
    ap.add_argument("--micro-batch", type=int, default=d.micro_batch)
    ap.add_argument("--logprob-chunk", type=int, default=d.logprob_chunk)
    ap.add_argument("--kv-cache-gb", type=float, default=d.kv_cache_gb)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--optim", default=d.optim, choices=["adamw_torch", "adamw_8bit"])
    ap.add_argument("--lora-rank", type=int, default=d.lora_rank)
    ap.add_argument("--lora-dtype", default=d.lora_dtype, choices=["auto", "float32"])
    ap.add_argument("--expert-chunk", type=int, default=d.expert_chunk)
    ap.add_argument("--humming", action=argparse.BooleanOptionalAction, default=d.humming,
                    help="a humming-kernels copy of each attention weight (KernelSettings.humming)")
    ap.add_argument("--humming-storage", action="store_true",
                    help="NVFP4 attention weights stored in humming's layout (KernelSettings.humming_storage): no copies")
    ap.add_argument("--embed-4bit", action="store_true",
                    help="the input embedding in NVFP4 (TrainConfig.embed_4bit; a tied one is refused)")
    ap.add_argument("--memory-cap-gb", type=float, default=None,
                    help="the step runs under this cap (moves no term; the allocator's slack is the capped one)")
    ap.add_argument("--expert-inputs-kept", action=argparse.BooleanOptionalAction, default=d.expert_inputs_kept,
                    help="the grouped experts' inputs live through the update (the code before its fix; "
                         "StepSettings.expert_inputs_kept): prices what the fix saves")
    ap.add_argument("--step-only", action="store_true", help="only the MoE step projection (no SmolLM2 / 7B rows)")
    ap.add_argument("--candidates", action="store_true",
                    help="with --step-only: settings predicted under --target-gib - --margin-gib, ranked")
    ap.add_argument("--target-gib", type=float, default=None, help="peak reserved target (default: the shape's)")
    ap.add_argument("--margin-gib", type=float, default=1.0, help="kept below the target (the model's error)")
    ap.add_argument("--fit-on", default=None, help="the one measured step the allowances are read from (a case "
                    "substring, @commit optional); the other steps are predicted")
    ap.add_argument("--fit-capped-on", default=None, help="with --fit-on: the one measured step under a memory cap "
                    "(capNGiB) the capped slack is read from; capped steps are predicted with it")
    ap.add_argument("--predict", action="append", default=[], help="with --fit-on: a step to predict (default: all)")
    ap.add_argument("--measured", action="append", default=[],
                    help="with --fit-on: 'CASE=GiB', a peak reserved in no record (printed, never recorded)")
    ap.add_argument("--step-records", default="benchmarks/results/step.jsonl")


def step_settings(args):
    from .step_plan import StepSettings

    return StepSettings(rows=args.prompts * args.num_generations, prompts=args.prompts, prompt_len=args.prompt_len,
                        new_tokens=args.max_new_tokens, kv_cache_gb=args.kv_cache_gb,
                        kv_bytes=1 if args.kv_cache_dtype == "fp8" else 2, micro_batch=args.micro_batch,
                        logprob_chunk=args.logprob_chunk, lora_rank=args.lora_rank, lora_dtype=args.lora_dtype,
                        optim=args.optim, expert_chunk=args.expert_chunk, humming=args.humming,
                        humming_storage=args.humming_storage, expert_inputs_kept=args.expert_inputs_kept,
                        embed_4bit=args.embed_4bit, memory_cap_gb=args.memory_cap_gb)


def describe(st) -> str:
    return (f"{st.prompts}x{st.rows // st.prompts} prompt {st.prompt_len} new {st.new_tokens}, KV budget "
            f"{st.kv_cache_gb} GiB {'fp8' if st.kv_bytes == 1 else 'bf16'}, micro-batch {st.micro_batch}, logprob chunk "
            f"{st.logprob_chunk}, {st.optim}, LoRA r{st.lora_rank} {st.lora_dtype}, expert chunk {st.expert_chunk}, "
            f"humming copies {'on' if st.humming and not st.humming_storage else 'off'}"
            + (", humming's layout stored" if st.humming_storage else "")
            + (", the embedding in NVFP4" if st.embed_4bit else "")
            + (f", under a {st.memory_cap_gb:g} GiB cap" if st.memory_cap_gb is not None else "")
            + (", expert inputs kept (the code before 2026-12-07's fix)" if st.expert_inputs_kept else ""))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="qerl bench memory")
    ap.add_argument("--record", action="store_true", help="append the figures to benchmarks/results/memory.jsonl")
    ap.add_argument("--skip-7b", action="store_true")
    add_step_args(ap)
    args = ap.parse_args(argv)
    if args.fit_on:
        return fit_and_predict(args)
    if args.candidates:
        return print_candidates(args)
    rows = []

    def out(case, metric, value, unit, target=None):
        rows.append((case, metric, value, unit, target))
        print(f"{case:<28} {metric:<26} {value:>10.4g} {unit:<6} {target or ''}", flush=True)

    from ..model.report import quantization_report

    for q in () if args.step_only else ("nvfp4", "mxfp4", "nf4"):
        t0 = time.perf_counter()
        rep = quantization_report("smollm2", q)["summary"]
        case = f"smollm2-135m {q}"
        out(case, "linear_bytes_ratio", rep["linear_ratio"], "x", "<=0.30" if q == "nvfp4" else None)
        out(case, "model_bytes_ratio", rep["model_ratio"], "x")
        out(case, "linear_bytes", rep["linear_bytes"] / 2**20, "MiB")
        out(case, "load_and_quantize_time", rep["load_seconds"], "s", "<30" if q == "nvfp4" else None)
        out(case, "mean_rel_error", rep["mean_rel_error"], "")
        del t0
    for name, (_, _, n_layers, _, _) in {} if args.step_only else SHAPES.items():
        bf16 = sum(o * i * 2 for o, i in layer_shapes(name).values()) * n_layers
        out(f"{name} bf16", "linear_bytes", bf16 / 2**30, "GiB")
        for q in ("nvfp4", "mxfp4", "nf4"):
            if name == "qwen2.5-7b" and not args.skip_7b:
                b = measured_layer_bytes(name, q) * n_layers
                case = f"{name} {q}"
            else:
                fmt = get_format(q)
                b = sum(fmt.nbytes(s) for s in layer_shapes(name).values()) * n_layers
                case = f"{name} {q} from_shapes"
            out(case, "linear_bytes", b / 2**30, "GiB")
            out(case, "linear_bytes_ratio", b / bf16, "x", "<=0.30" if q == "nvfp4" and "from" not in case else None)
    from .step_plan import DEFAULT_ALLOWANCES, MOE_SHAPES, TARGETS_GIB, plan_step, update_working

    st = step_settings(args)
    settings = describe(st)
    for name, shape in MOE_SHAPES.items():
        if args.shape and name != args.shape:
            continue
        g = plan_step(shape, st).gib()
        case = f"{name} step projection"
        target = f"<={TARGETS_GIB[name]}" if name in TARGETS_GIB else None
        out(case, "step_peak", g["peak"], "GiB", target)
        for k in STEP_TERMS:
            out(case, k, g[k], "GiB")
        if args.step_only:  # what the update's working set is made of (not recorded: its sum is a term above)
            parts = update_working(shape, st)
            print("   update_working = checkpoints + expert_inputs_kept + max(logits, layer): "
                  + ", ".join(f"{k} {v / 2**30:.3f}" for k, v in parts.items() if k != "total") + " GiB")
    print(f"(projections: {settings}; the model in bench/step_plan.py, its allowances read off "
          f"{fits_text(DEFAULT_ALLOWANCES)}; step_peak is peak reserved, the CUDA context comes on top)")
    if args.record:
        for r in rows:
            record("memory", *r[:4], target=r[4], command="python -m qerl.bench.memory --record")
        render()


def fits_text(allow) -> str:
    return allow.fit_on + (f" (the capped slack off {allow.capped_fit_on})" if allow.capped_fit_on else "")


def fit_and_predict(args) -> int:
    """--fit-on: the allowances from one measured step, every other (or each --predict) predicted against its record."""
    import shlex
    import sys
    from pathlib import Path

    from . import memory_fit

    allow, preds = memory_fit.run(args.fit_on, args.predict, args.measured, Path(args.step_records),
                                  fit_capped_on=args.fit_capped_on)
    for p in preds:
        if p.step.commit in memory_fit.OTHER_CODE:
            print(f"  note {p.step.name}: {memory_fit.OTHER_CODE[p.step.commit]}")
    if args.record:
        memory_fit.record_rows(allow, preds, "qerl bench memory " + " ".join(map(shlex.quote, sys.argv[1:])))
        render()
    return 0


def print_candidates(args) -> int:
    """--candidates: the step's settings predicted under the target with the margin, best first."""
    from .step_candidates import candidates, step_command
    from .step_plan import DEFAULT_ALLOWANCES, MOE_SHAPES, TARGETS_GIB

    name = args.shape or "qwen3-30b-a3b"
    shape, base = MOE_SHAPES[name], step_settings(args)
    target = args.target_gib if args.target_gib is not None else TARGETS_GIB[name]
    found = candidates(shape, base, target, args.margin_gib)
    print(f"{name}: KV budget and dtype, micro-batch and logprob chunk over a grid, predicted at <= {target:g} - "
          f"{args.margin_gib:g} GiB peak reserved, run under that cap (allowances from "
          f"{fits_text(DEFAULT_ALLOWANCES)}); the rest as given ({describe(base)}); best first")
    print(f"{'#':>3} {'peak GiB':>8} {'KV GiB':>6} {'KV':>4} {'slots':>5} {'waves':>5} {'mb':>3} {'chunk':>5}  run by")
    for i, c in enumerate(found[:20], 1):
        st = c.settings
        print(f"{i:>3} {c.peak_gib:8.2f} {st.kv_cache_gb:6.2f} {'fp8' if st.kv_bytes == 1 else 'bf16':>4} {c.slots:>5} "
              f"{c.waves:>5} {st.micro_batch:>3} {st.logprob_chunk:>5}  "
              + step_command(shape, st))
    if not found:
        print("  none: no setting of the grid is predicted under the target with this margin")
    return 0


if __name__ == "__main__":
    main()

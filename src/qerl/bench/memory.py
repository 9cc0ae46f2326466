"""Weight memory of the quantized formats: SmolLM2 for real, and the large models' linear layers.

    python -m qerl.bench.memory [--record]

SmolLM2-135M-Instruct is loaded and quantized for real (time and bytes measured).
For Qwen2.5-7B one full decoder layer of random weights in the real shapes is
quantized and its bytes measured, times the layer count. The 14B/32B/72B rows
come from the formats' tensor shapes (no weights are made: they are too big for
this CPU); they are marked `from_shapes`. MoE shapes (Qwen3-30B-A3B, gpt-oss-20b/120b) get a whole
GRPO step's projected GPU memory (bench/step_plan.py), marked `projection`: computed, not yet measured.
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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", action="store_true", help="append the figures to benchmarks/results/memory.jsonl")
    ap.add_argument("--skip-7b", action="store_true")
    args = ap.parse_args(argv)
    rows = []

    def out(case, metric, value, unit, target=None):
        rows.append((case, metric, value, unit, target))
        print(f"{case:<28} {metric:<26} {value:>10.4g} {unit:<6} {target or ''}", flush=True)

    from ..model.report import quantization_report

    for q in ("nvfp4", "mxfp4", "nf4"):
        t0 = time.perf_counter()
        rep = quantization_report("smollm2", q)["summary"]
        case = f"smollm2-135m {q}"
        out(case, "linear_bytes_ratio", rep["linear_ratio"], "x", "<=0.30" if q == "nvfp4" else None)
        out(case, "model_bytes_ratio", rep["model_ratio"], "x")
        out(case, "linear_bytes", rep["linear_bytes"] / 2**20, "MiB")
        out(case, "load_and_quantize_time", rep["load_seconds"], "s", "<30" if q == "nvfp4" else None)
        out(case, "mean_rel_error", rep["mean_rel_error"], "")
        del t0
    for name, (_, _, n_layers, _, _) in SHAPES.items():
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
    from .step_plan import MOE_SHAPES, TARGETS_GIB, StepSettings, plan_step

    st = StepSettings()
    settings = (f"{st.rows} rows {st.prompt_len}+{st.new_tokens} tokens, KV {st.kv_rows} rows "
                f"{'fp8' if st.kv_bytes == 1 else 'bf16'}, micro-batch {st.micro_batch}, LoRA r{st.lora_rank} attention")
    for name, shape in MOE_SHAPES.items():
        g = plan_step(shape, st).gib()
        case = f"{name} step projection"
        target = f"<={TARGETS_GIB[name]}" if name in TARGETS_GIB else None
        out(case, "step_peak", g["peak"], "GiB", target)
        for k in ("experts", "attention", "dense", "kv_cache", "update_working", "lora_and_optimizer"):
            out(case, k, g[k], "GiB")
    print(f"(projections: {settings}; computed from the formats' tensor shapes, owed a device measurement)")
    if args.record:
        for r in rows:
            record("memory", *r[:4], target=r[4], command="python -m qerl.bench.memory --record")
        render()


if __name__ == "__main__":
    main()

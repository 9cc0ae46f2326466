"""Weight memory of the quantized formats: SmolLM2 for real, and the large models' linear layers.

    python -m qerl.bench.memory [--record]
    qerl bench memory --step-only --shape qwen3-30b-a3b [--kv-cache-gb G] [--logprob-chunk N] [--no-humming] ...

SmolLM2-135M-Instruct is loaded and quantized for real (time and bytes measured).
For Qwen2.5-7B one full decoder layer of random weights in the real shapes is
quantized and its bytes measured, times the layer count. The 14B/32B/72B rows
come from the formats' tensor shapes (no weights are made: they are too big for
this CPU); they are marked `from_shapes`. MoE shapes (Qwen3-30B-A3B, gpt-oss-20b/120b) get a whole
GRPO step's projected GPU memory (bench/step_plan.py), marked `projection`, for the settings given
(named as `qerl bench step` names them; defaults: the H100 step at ed5e22d the model is calibrated on);
--step-only prints just that (docs/moe-24gb.md: the settings for a 24 GB card).
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
              "update_working", "unattributed", "allocator_slack", "peak_allocated", "peak_reserved")


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
    ap.add_argument("--step-only", action="store_true", help="only the MoE step projection (no SmolLM2 / 7B rows)")


def step_settings(args):
    from .step_plan import StepSettings

    return StepSettings(rows=args.prompts * args.num_generations, prompts=args.prompts, prompt_len=args.prompt_len,
                        new_tokens=args.max_new_tokens, kv_cache_gb=args.kv_cache_gb,
                        kv_bytes=1 if args.kv_cache_dtype == "fp8" else 2, micro_batch=args.micro_batch,
                        logprob_chunk=args.logprob_chunk, lora_rank=args.lora_rank, lora_dtype=args.lora_dtype,
                        optim=args.optim, expert_chunk=args.expert_chunk, humming=args.humming,
                        humming_storage=args.humming_storage)


def describe(st) -> str:
    return (f"{st.prompts}x{st.rows // st.prompts} prompt {st.prompt_len} new {st.new_tokens}, KV budget "
            f"{st.kv_cache_gb} GiB {'fp8' if st.kv_bytes == 1 else 'bf16'}, micro-batch {st.micro_batch}, logprob chunk "
            f"{st.logprob_chunk}, {st.optim}, LoRA r{st.lora_rank} {st.lora_dtype}, expert chunk {st.expert_chunk}, "
            f"humming copies {'on' if st.humming and not st.humming_storage else 'off'}"
            + (", humming's layout stored" if st.humming_storage else ""))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", action="store_true", help="append the figures to benchmarks/results/memory.jsonl")
    ap.add_argument("--skip-7b", action="store_true")
    add_step_args(ap)
    args = ap.parse_args(argv)
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
    from .step_plan import MOE_SHAPES, TARGETS_GIB, plan_step

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
    print(f"(projections: {settings}; the model in bench/step_plan.py, calibrated on the H100 step at ed5e22d; "
          "step_peak is peak reserved, the CUDA context comes on top)")
    if args.record:
        for r in rows:
            record("memory", *r[:4], target=r[4], command="python -m qerl.bench.memory --record")
        render()


if __name__ == "__main__":
    main()

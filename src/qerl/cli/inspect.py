"""qerl inspect [MODEL] --quant FMT: quantize a model, print memory and error per layer."""

from __future__ import annotations

import json
import time

HELP = "quantize a model (default: SmolLM2-135M-Instruct, offline) and report memory and quantization error per layer"


def add_arguments(p):
    p.add_argument("model", nargs="?", default="smollm2")
    p.add_argument("--quant", default="nvfp4", choices=["nvfp4", "mxfp4", "nf4", "bf16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="one JSON object per layer, then a summary object")


def run(args):
    from ..model.report import quantization_report

    t0 = time.perf_counter()
    rep = quantization_report(args.model, args.quant, device=args.device)
    if args.json:
        for row in rep["layers"]:
            print(json.dumps(row))
        print(json.dumps(rep["summary"]))
        return
    print(f"{'layer':<40} {'shape':>12} {'bf16 KiB':>9} {args.quant + ' KiB':>10} {'ratio':>6} {'rel.err':>8}")
    for r in rep["layers"]:
        shape = "x".join(map(str, r["shape"]))
        print(f"{r['name']:<40} {shape:>12} {r['bf16_bytes'] / 1024:>9.1f} {r['bytes'] / 1024:>10.1f} "
              f"{r['bytes'] / r['bf16_bytes']:>6.3f} {r['rel_error']:>8.4f}")
    s = rep["summary"]
    print()
    print(f"model               {s['model']}")
    print(f"format              {s['quant']}")
    print(f"quantized linears   {s['n_layers']} ({len(s['bf16_fallback'])} left in bf16)")
    print(f"linear weights      {s['linear_bf16_bytes'] / 2**20:.1f} MiB bf16 -> {s['linear_bytes'] / 2**20:.1f} MiB "
          f"({s['linear_ratio']:.3f}x)")
    print(f"whole model         {s['model_bf16_bytes'] / 2**20:.1f} MiB bf16 -> {s['model_bytes'] / 2**20:.1f} MiB "
          f"({s['model_ratio']:.3f}x)")
    print(f"mean rel. error     {s['mean_rel_error']:.4f} (||W_q - W|| / ||W||, per layer)")
    print(f"load + quantize     {s['load_seconds']:.1f} s on {s['device']}; report {time.perf_counter() - t0:.1f} s")

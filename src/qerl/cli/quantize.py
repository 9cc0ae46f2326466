"""qerl quantize MODEL OUTPUT_DIR --format nvfp4|mxfp4: write a compressed-tensors checkpoint."""

from __future__ import annotations

import time

HELP = "quantize a model and write a compressed-tensors checkpoint (loads in vLLM, transformers, llm-compressor)"


def add_arguments(p):
    p.add_argument("model", help="model folder, hub id, or 'smollm2' (the offline default)")
    p.add_argument("output_dir")
    p.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--trust-remote-code", "--trust_remote_code", dest="trust_remote_code", action="store_true")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an OUTPUT_DIR that is not empty (never a run folder, a folder holding one, or the model)")


def run(args):
    from pathlib import Path

    from ..checkpoint.compressed_tensors import save_compressed
    from ..checkpoint.guard import check_output_folder
    from ..model import load_policy

    # before the model loads: OUTPUT_DIR is replaced whole, so nothing of the user's may be in it
    from ..model.resolve import ALIASES
    from ..model.smollm2 import cache_dir

    model = args.model if Path(args.model).expanduser().exists() else (
        cache_dir() / "SmolLM2-135M-Instruct" if args.model.lower() in ALIASES else None)
    check_output_folder(args.output_dir, overwrite=args.overwrite, protected={"model": model}, command="quantize")
    t0 = time.perf_counter()
    policy = load_policy(args.model, args.format, lora_rank=0, device=args.device, trust_remote_code=args.trust_remote_code)
    out = save_compressed(policy, args.output_dir)
    print(f"wrote {args.format} checkpoint to {out} in {time.perf_counter() - t0:.1f} s")
    if policy.bf16_fallback:
        print(f"left in bf16 (listed in quantization_config.ignore): {', '.join(policy.bf16_fallback)}")

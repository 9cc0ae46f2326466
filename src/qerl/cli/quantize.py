"""qerl quantize MODEL OUTPUT_DIR --format nvfp4|mxfp4: write a compressed-tensors checkpoint."""

from __future__ import annotations

import time

HELP = "quantize a model and write a compressed-tensors checkpoint (loads in vLLM, transformers, llm-compressor)"


def add_arguments(p):
    p.add_argument("model", help="model folder, hub id, or 'smollm2' (the offline default)")
    p.add_argument("output_dir")
    p.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--trust-remote-code", action="store_true")


def run(args):
    from ..checkpoint.compressed_tensors import save_compressed
    from ..model import load_policy

    t0 = time.perf_counter()
    policy = load_policy(args.model, args.format, lora_rank=0, device=args.device, trust_remote_code=args.trust_remote_code)
    out = save_compressed(policy, args.output_dir)
    print(f"wrote {args.format} checkpoint to {out} in {time.perf_counter() - t0:.1f} s")
    if policy.bf16_fallback:
        print(f"left in bf16 (listed in quantization_config.ignore): {', '.join(policy.bf16_fallback)}")

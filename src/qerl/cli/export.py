"""qerl export MODEL --adapter DIR OUTPUT_DIR: a merged dense model (dequantized base + LoRA)."""

from __future__ import annotations

HELP = "merge a LoRA adapter into the dequantized base and write a plain bf16 model folder"


def add_arguments(p):
    p.add_argument("model", help="the base: a dense or compressed-tensors folder, hub id, or 'smollm2'")
    p.add_argument("output_dir")
    p.add_argument("--adapter", help="PEFT adapter folder (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--quant", default="auto", help="base format the adapter was trained on (default: the checkpoint's, or nvfp4)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cpu")


def run(args):
    import torch

    from ..checkpoint.export import export_merged
    from ..checkpoint.peft_adapter import load_adapter
    from ..model import load_policy

    # fp32 compute so the merge W + s·B·A is exact before the final cast
    policy = load_policy(args.model, args.quant, lora_rank=0, device=args.device, dtype=torch.float32)
    if args.adapter:
        load_adapter(policy, args.adapter)
    out = export_merged(policy, args.output_dir, dtype=getattr(torch, args.dtype))
    print(f"wrote merged {args.dtype} model to {out}")

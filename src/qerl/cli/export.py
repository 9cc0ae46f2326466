"""qerl export [MODEL] OUTPUT_DIR --adapter DIR: a merged dense model (dequantized base + LoRA). Without MODEL
the base is the one the adapter records (adapter_config.json's base_model_name_or_path)."""

from __future__ import annotations

HELP = "merge a LoRA adapter into the dequantized base and write a plain bf16 model folder"


def add_arguments(p):
    from .vocabulary import add_model_flag

    p.add_argument("model", nargs="?", default=None,
                   help="the base: a dense or compressed-tensors folder, hub id, or 'smollm2' (default: the base "
                        "the adapter records)")
    p.add_argument("output_dir")
    add_model_flag(p)
    p.add_argument("--adapter", help="PEFT adapter folder (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--quant", default="auto", choices=["nvfp4", "mxfp4", "nf4", "bf16", "auto"],
                   help="base format the adapter was trained on (default: auto, the one the adapter recorded, else "
                        "the checkpoint's, else nvfp4); another than the adapter's is refused")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an OUTPUT_DIR that is not empty (never a run folder, the base or the adapter)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cpu")


def run(args):
    from pathlib import Path

    import torch

    from ..checkpoint.export import check_export_target, export_merged
    from ..checkpoint.peft_adapter import read_adapter_config as _read_config, load_adapter, resolve_quant
    from ..model import load_policy
    from ..model.resolve import ALIASES, resolve_model
    from ..model.smollm2 import cache_dir
    from .policy import check_device, read_model_config

    from .vocabulary import take_model_flag

    take_model_flag(args)
    if args.model is None:
        args.model = recorded_base(args.adapter)
    # everything checked before the model loads: nothing in OUTPUT_DIR is lost by mistake
    base = args.model if Path(args.model).exists() else (
        cache_dir() / "SmolLM2-135M-Instruct" if args.model.lower() in ALIASES else None)
    check_export_target(args.output_dir, overwrite=args.overwrite, protected={"adapter": args.adapter, "base model": base})
    device = check_device(args.device)
    read_model_config(resolve_model(args.model))  # a config transformers cannot read: one line, no traceback
    if args.adapter:
        _read_config(Path(args.adapter))
    quant = resolve_quant(args.adapter, args.quant)
    # fp32 compute so the merge W + s·B·A is exact before the final cast
    policy = load_policy(args.model, quant, lora_rank=0, device=device, dtype=torch.float32)
    if args.adapter:
        load_adapter(policy, args.adapter)
    out = export_merged(policy, args.output_dir, dtype=getattr(torch, args.dtype))
    print(f"wrote merged {args.dtype} model to {out}")


def recorded_base(adapter: str | None) -> str:
    """The base an adapter folder records (PEFT's base_model_name_or_path), as the model to merge into."""
    import json
    from pathlib import Path

    if not adapter:
        raise ValueError("give the base MODEL, or --adapter DIR whose adapter_config.json records it")
    path = Path(adapter) / "adapter_config.json"
    try:
        base = json.loads(path.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the base the adapter records ({e}); give the base MODEL") from None
    if not base:
        raise ValueError(f"{path} records no base_model_name_or_path; give the base MODEL")
    return base

"""The policy a command runs: a (quantized) base model plus an optional PEFT adapter."""

from __future__ import annotations

import re


def check_device(device: str | None) -> str:
    """The device a command runs on (default: cuda when there is one); an error names a bad one."""
    import torch

    if device is None or device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"--device: {device!r} is not cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
    return device


def load_cli_policy(model: str, quant: str, adapter: str | None, device: str | None):
    """(policy, device): bf16 on CUDA, fp32 on the CPU; the adapter's rank read from its config.
    Everything that can be checked without the weights (device, tokenizer, adapter config) is
    checked first, so a bad input costs no model load."""
    from pathlib import Path

    import torch

    from ..model import load_policy
    from ..model.load import require_tokenizer
    from ..model.resolve import resolve_model

    device = check_device(device)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    require_tokenizer(resolve_model(model))
    rank = 0
    if adapter:
        from ..checkpoint.peft_adapter import _read_config, resolve_quant

        rank = int(_read_config(Path(adapter))["r"])
        quant = resolve_quant(adapter, quant)
    pol = load_policy(model, quant, lora_rank=rank, device=device, dtype=dtype, progress=False)
    if adapter:
        from ..checkpoint import load_adapter

        load_adapter(pol, adapter)
    return pol, device

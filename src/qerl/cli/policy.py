"""The policy a command runs: a (quantized) base model plus an optional PEFT adapter."""

from __future__ import annotations


def load_cli_policy(model: str, quant: str, adapter: str | None, device: str | None):
    """(policy, device): bf16 on CUDA, fp32 on the CPU; the adapter's rank read from its config."""
    from pathlib import Path

    import torch

    from ..model import load_policy

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    rank = 0
    if adapter:
        from ..checkpoint.peft_adapter import _read_config

        rank = int(_read_config(Path(adapter))["r"])
    pol = load_policy(model, quant, lora_rank=rank, device=device, dtype=dtype, progress=False)
    if adapter:
        from ..checkpoint import load_adapter

        load_adapter(pol, adapter)
    return pol, device

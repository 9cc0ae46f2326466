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


def max_positions(folder) -> int | None:
    """The model's position limit (config.json's max_position_embeddings), None when it has none."""
    from transformers import AutoConfig

    try:
        n = getattr(AutoConfig.from_pretrained(folder), "max_position_embeddings", None)
    except (OSError, ValueError):  # the loader reports a bad config.json, naming it
        return None
    return n if isinstance(n, int) and n > 0 else None


def check_length(positions: int | None, prompt_tokens: int, new_tokens: int, what: str, flag: str) -> None:
    """Refuse a prompt + completion past the model's positions (it would generate garbage past them)."""
    if positions is not None and prompt_tokens + new_tokens > positions:
        raise ValueError(f"{what}: {prompt_tokens} prompt tokens + {flag} {new_tokens} = {prompt_tokens + new_tokens} "
                         f"tokens, beyond the model's {positions} positions (max_position_embeddings)")


def load_cli_policy(model: str, quant: str, adapter: str | None, device: str | None, new_tokens: int | None = None,
                    flag: str = "--max-new-tokens"):
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
    folder = resolve_model(model)
    require_tokenizer(folder)
    if new_tokens is not None:  # before the weights load: the completion alone must fit
        check_length(max_positions(folder), 1, new_tokens, str(model), flag)
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

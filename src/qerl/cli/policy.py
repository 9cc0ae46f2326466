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


def read_model_config(folder):
    """config.json as transformers reads it, after its architecture label is checked as plain JSON:
    a Llama config relabelled falcon made transformers itself fail with an AttributeError."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    from ..model.architectures import SUPPORTED_ARCHITECTURES

    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a readable JSON config ({type(e).__name__}: {e})"[:300]) from None
    archs = raw.get("architectures") if isinstance(raw, dict) else None
    if not isinstance(archs, list) or not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        label = archs or (raw.get("model_type") if isinstance(raw, dict) else None)
        raise ValueError(f"{path}: unsupported architecture {label!r}; qerl supports "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        return AutoConfig.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a config that contradicts itself
        import re

        detail = " ".join(f"{type(e).__name__}: {e}".split())[:300]  # transformers' validation errors span lines
        field = re.search(r"field '(\w+)'", detail)
        fix = (f"fix field {field[1]!r} (now {raw.get(field[1])!r})" if field and field[1] in raw
               else "is model_type the model's own?")
        raise ValueError(f"{path}: transformers cannot read it as a {raw.get('model_type')!r} config "
                         f"({detail}); {fix}") from None


def max_positions(folder) -> int | None:
    """The model's position limit (config.json's max_position_embeddings), None when it has none."""
    n = getattr(read_model_config(folder), "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def check_length(positions: int | None, prompt_tokens: int, new_tokens: int, what: str, flag: str) -> None:
    """Refuse a prompt + completion past the model's positions (it would generate garbage past them)."""
    if positions is not None and prompt_tokens + new_tokens > positions:
        raise ValueError(f"{what}: {prompt_tokens} prompt tokens + {flag} {new_tokens} = {prompt_tokens + new_tokens} "
                         f"tokens, beyond the model's {positions} positions (max_position_embeddings)")


def split_adapter_start(model: str, adapter: str | None) -> tuple[str, str | None]:
    """MODEL given as an adapter folder (`runs/sft/adapter`, or the model a run started from): its base,
    with that adapter unless another is given (an adapter trained from an adapter holds the whole LoRA)."""
    from ..model.adapter_start import adapter_folder, base_to_load

    if adapter_folder(model) is None:
        return model, adapter
    return base_to_load(model), adapter or str(model)


def load_cli_policy(model: str, quant: str, adapter: str | None, device: str | None, new_tokens: int | None = None,
                    flag: str = "--max_completion_length"):
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
    model, adapter = split_adapter_start(model, adapter)
    folder = resolve_model(model)
    require_tokenizer(folder)
    positions = max_positions(folder)  # config.json checked before the weights load
    if new_tokens is not None:  # the completion alone must fit
        check_length(positions, 1, new_tokens, str(model), flag)
    rank = 0
    if adapter:
        from ..checkpoint.peft_adapter import read_adapter_config as _read_config, resolve_quant

        rank = int(_read_config(Path(adapter))["r"])
        quant = resolve_quant(adapter, quant)
    keep = None
    if adapter:  # the layers the adapter was trained on in bf16 stay bf16 (merged from bf16 on export)
        from ..checkpoint.peft_adapter import recorded_modules_to_not_convert

        keep = recorded_modules_to_not_convert(adapter) or None
    pol = load_policy(model, quant, lora_rank=rank, device=device, dtype=dtype, progress=False,
                      modules_to_not_convert=keep)
    if adapter:
        apply_recorded_4bit_options(pol.model, adapter, dtype)
        from ..checkpoint import load_adapter

        load_adapter(pol, adapter)
    return pol, device


def apply_recorded_4bit_options(model, adapter, dtype) -> None:
    """The 4-bit head / input embedding the adapter was trained with (lm_head_4bit / embed_4bit, recorded in its
    qerl_adapter.json), quantized as training did, so eval and generate score the trained policy. The embedding's
    rows then come in this process's dtype (their values are the 4-bit ones either way)."""
    from ..checkpoint.peft_adapter import recorded_4bit_options
    from ..layers.quant_embed import QuantEmbedding
    from .export import quantize_as_trained

    opts = recorded_4bit_options(adapter)
    if not opts:
        return
    quantize_as_trained(model, opts["lm_head_4bit"], opts["embed_4bit"], opts["dtype"] or dtype)
    emb = model.get_input_embeddings()
    if isinstance(emb, QuantEmbedding):
        emb.to(dtype)

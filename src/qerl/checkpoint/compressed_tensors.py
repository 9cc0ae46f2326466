"""Write a quantized policy as a compressed-tensors checkpoint (what vLLM and llm-compressor read).

The layout is llm-compressor's NVFP4A16 / MXFP4A16 output: per quantized Linear
`weight_packed`, `weight_scale` (+ `weight_global_scale` for NVFP4), everything
else dense, and a `quantization_config` in config.json. We write it ourselves
(rather than through compressed-tensors' ModelCompressor) because our layers
already hold exactly those bytes; compressing again would need a dense model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..layers import QLoRALinear
from ..layers.qlora_linear import standalone
from .atomic import SHARD_BYTES, atomic_folder, entries, write_sharded

_WEIGHT_ARGS = {
    "nvfp4": {"strategy": "tensor_group", "group_size": 16, "scale_dtype": "torch.float8_e4m3fn"},
    "mxfp4": {"strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"},
}


def _ct_version() -> str:
    try:
        from importlib.metadata import version

        return version("compressed-tensors")
    except Exception:
        return "0.19.0"  # the version llm-compressor 0.14 writes with


def quantization_config(fmt: str, ignore: list[str]) -> dict:
    if fmt not in _WEIGHT_ARGS:
        raise ValueError(f"compressed-tensors has no format for {fmt!r}; write nvfp4 or mxfp4")
    weights = {
        "num_bits": 4, "type": "float", "symmetric": True, "dynamic": False,
        "actorder": None, "block_structure": None, "observer": "memoryless_minmax", "observer_kwargs": {},
        "zp_dtype": None, **_WEIGHT_ARGS[fmt],
    }  # fmt: skip
    name = f"{fmt}-pack-quantized"
    return {
        "config_groups": {"group_0": {"format": name, "targets": ["Linear"], "weights": weights,
                                      "input_activations": None, "output_activations": None}},
        "format": name,
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": _ct_version(),
    }


def compressed_state_dict(model: torch.nn.Module, fmt: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(tensors to write, names of Linear layers left dense). LoRA factors are not included."""
    from ..layers.quant_experts import QuantExperts

    out: dict[str, torch.Tensor] = {}
    ignore: list[str] = []
    owned: set[str] = set()
    for name, m in model.named_modules():
        if isinstance(m, QuantExperts):
            owned.add(name)
            out.update(_expert_tensors(model, name, m, fmt))
        elif isinstance(m, QLoRALinear):
            owned.add(name)
            if m.fmt.name == fmt:  # in the checkpoint's byte order (the layer may keep a kernel's)
                for k, t in m.checkpoint_tensors().items():
                    out[f"{name}.{k}"] = t
            elif m.fmt.name == "bf16":
                out[f"{name}.weight"] = m.dequantized_weight(m.dtype)
                ignore.append(name)
            else:
                raise ValueError(f"{name}: layer is {m.fmt.name}; a {fmt} checkpoint cannot hold it")
            if m.bias is not None:
                out[f"{name}.bias"] = m.bias
        elif isinstance(m, torch.nn.Linear):
            ignore.append(name)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for k, t in model.state_dict().items():
        mod = k.rpartition(".")[0]
        if mod in owned or any(k.startswith(o + ".") for o in owned):
            continue
        if tied and k == "lm_head.weight":
            continue
        out[k] = t
    if any(isinstance(m, QuantExperts) for m in model.modules()):  # an MoE: the stock names (Mixtral's
        from ..model.family import family_of_model                   # block_sparse_moe), as its experts'

        name = family_of_model(model).checkpoint_name
        out, ignore = {name(k): t for k, t in out.items()}, [name(n) for n in ignore]
    # One owned copy each: group members' tensors are views into shared storage (their global
    # scale one tensor), which safetensors refuses or would write whole.
    return {k: standalone(v) for k, v in out.items()}, ignore


def _expert_tensors(model, name: str, m, fmt: str) -> dict[str, torch.Tensor]:
    """An MoE layer's 4-bit experts in the per-expert layout llm-compressor writes and vLLM reads
    (`<path>.<e>.<gate>.weight_packed`, ...): gate|up split back into its halves, each half keeping the
    expert's one global scale. LoRA on experts is not part of the base checkpoint."""
    from ..model.family import family_of_model

    family = family_of_model(model)
    ex = family.experts
    if m.fmt.name != fmt:
        raise ValueError(f"{name}: experts are {m.fmt.name}; a {fmt} checkpoint cannot hold them")
    if m.transposed or m.has_bias or not ex.per_expert:
        raise ValueError(f"{name}: {family.name}'s experts (transposed, biased, interleaved gate|up) have no "
                         "per-expert compressed-tensors layout; export them merged (qerl export --merged)")
    base = family.checkpoint_name(name)
    half = m.shapes["gate_up_proj"][0] // 2
    out = {}
    for e in range(m.num_experts):
        gu, d = m.tensors("gate_up_proj", e), m.tensors("down_proj", e)
        for proj, rows in ((ex.gate, slice(0, half)), (ex.up, slice(half, 2 * half))):
            out.update({f"{base}.{e}.{proj}.{k}": (t if k == "weight_global_scale" else t[rows])
                        for k, t in gu.items()})
        out.update({f"{base}.{e}.{ex.down}.{k}": t for k, t in d.items()})
    return out


def save_compressed(policy, out_dir: str | Path, fmt: str | None = None) -> Path:
    """Write policy's frozen base as a compressed-tensors checkpoint folder (atomically)."""
    model = policy.model if hasattr(policy, "model") else policy
    fmt = fmt or getattr(policy, "quant", None)
    if fmt is None:
        raise ValueError("save_compressed: pass fmt='nvfp4' or 'mxfp4' for a bare model")
    tensors, ignore = compressed_state_dict(model, fmt)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["quantization_config"] = quantization_config(fmt, ignore)
    with atomic_folder(out_dir) as tmp:
        write_sharded(tmp, entries(tensors))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
        src = Path(getattr(policy, "source", "") or "")
        if (src / "generation_config.json").exists():
            shutil.copy(src / "generation_config.json", tmp)
        tok = getattr(policy, "tokenizer", None)
        if tok is not None:
            tok.save_pretrained(tmp)
    return Path(out_dir)

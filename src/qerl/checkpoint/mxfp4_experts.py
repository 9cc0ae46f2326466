"""gpt-oss's stock MXFP4 experts: read (as qerl's mxfp4 tensors, the same bytes) and written back in that layout.

gpt-oss ships its experts as `<experts>.gate_up_proj_blocks` [E, N, K/32, 16] (two E2M1 codes a byte,
low nibble first), `<experts>.gate_up_proj_scales` [E, N, K/32] (E8M0) and `_bias`, the same for
down_proj, everything else dense, and config.json's quantization_config `{"quant_method": "mxfp4"}`.
qerl's mxfp4 tensors are those bytes reshaped, so the experts are written back byte for byte. The
attention projections are written dense (their bf16 bytes when loaded with quant="bf16"; otherwise
their 4-bit weights dequantized); LoRA is not merged (the adapter is saved apart).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..layers import QLoRALinear
from ..layers.qlora_linear import standalone
from ..layers.quant_experts import PROJECTIONS, QuantExperts
from .atomic import atomic_folder, entries, write_sharded
from .export import quant_heads
from .safetensors_reader import CheckpointError

# gpt-oss's own list: what its MXFP4 label leaves dense
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def mxfp4_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The stock gpt-oss tensors of `model`: experts as MXFP4 blocks/scales, the rest dense."""
    experts = {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts)}
    linears = {n: m for n, m in model.named_modules() if isinstance(m, QLoRALinear)}
    out: dict[str, torch.Tensor] = {}
    for name, q in experts.items():
        if q.fmt.name != "mxfp4":
            raise ValueError(f"{name}: experts are {q.fmt.name}; the stock gpt-oss layout holds MXFP4")
        for proj in PROJECTIONS:
            t = q.stacked(proj)
            e, n, half_k = t["weight_packed"].shape
            out[f"{name}.{proj}_blocks"] = t["weight_packed"].reshape(e, n, half_k // 16, 16)
            out[f"{name}.{proj}_scales"] = t["weight_scale"]
            if q.bias(proj) is not None:
                out[f"{name}.{proj}_bias"] = q.bias(proj)
    heads = quant_heads(model)
    for name, m in linears.items():
        name = heads.get(name, name)  # a 4-bit head (lm_head.layer): lm_head.weight, the values the policy used
        out[f"{name}.weight"] = m.dequantized_weight(m.dtype)
        if m.bias is not None:
            out[f"{name}.bias"] = m.bias.detach()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for k, t in model.state_dict().items():
        mod = k.rpartition(".")[0]
        if mod in experts or mod in linears or any(k.startswith(o + ".") for o in linears):
            continue
        if not (tied and k == "lm_head.weight"):
            out[k] = t
    return {k: standalone(v.detach()) for k, v in out.items()}


def save_mxfp4_experts(policy, out_dir: str | Path) -> Path:
    """Write the policy's frozen base in the stock gpt-oss MXFP4 layout (atomically); returns the folder."""
    model = policy.model if hasattr(policy, "model") else policy
    tensors = mxfp4_state_dict(model)
    cfg = model.config.to_dict()
    src = Path(getattr(policy, "source", "") or "")
    label = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    if (src / "config.json").is_file():  # the source's own label (its modules_to_not_convert) when it had one
        label = json.loads((src / "config.json").read_text()).get("quantization_config") or label
    cfg["quantization_config"] = label
    if quant_heads(model):  # a tied model's 4-bit head is a copy of the table, no longer the embedding itself
        cfg["tie_word_embeddings"] = False
    with atomic_folder(out_dir) as tmp:
        write_sharded(tmp, entries(tensors))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
        tok = getattr(policy, "tokenizer", None)
        if tok is not None:
            tok.save_pretrained(tmp)
    return Path(out_dir)


# ---- reading -------------------------------------------------------------------------------
def read_mxfp4_experts(ckpt, base, module, skeleton, biases, dtype, transposed, device):
    """gpt-oss's stock MXFP4 experts: blocks [E, N, K/32, 16] (two E2M1 codes a byte, low nibble first)
    and E8M0 scales [E, N, K/32] are, reshaped, qerl's mxfp4 weight_packed [E, N, K/2] and weight_scale."""
    tensors, shapes = {}, {}
    for p in PROJECTIONS:
        blocks, scales = ckpt.get(f"{base}.{p}_blocks", device), ckpt.get(f"{base}.{p}_scales", device)
        e, rows, groups, width = blocks.shape
        if width != 16 or tuple(scales.shape) != (e, rows, groups):
            raise CheckpointError(f"{ckpt.folder}: {base}.{p}_blocks {list(blocks.shape)} / _scales "
                                  f"{list(scales.shape)} are not gpt-oss's MXFP4 layout [E, N, K/32, 16] / [E, N, K/32]")
        tensors[p] = {"weight_packed": blocks.view(torch.uint8).reshape(e, rows, groups * 16),
                      "weight_scale": scales.view(torch.uint8)}
        shapes[p] = (rows, groups * 32)
    q = QuantExperts(tensors, shapes, "mxfp4", skeleton._apply_gate, dtype, module, biases, transposed)
    want = tuple(skeleton.gate_up_proj.shape[1:])
    have = shapes["gate_up_proj"][::-1] if transposed else shapes["gate_up_proj"]
    if have != want:
        raise CheckpointError(f"{ckpt.folder}: {base}.gate_up_proj_blocks holds experts of {list(have)}; the config "
                              f"gives {list(want)}")
    return q

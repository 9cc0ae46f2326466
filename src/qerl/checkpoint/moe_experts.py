"""An MoE layer's experts read from a checkpoint in whichever layout it holds them: the stock per-expert
tensors or transformers 5's fused 3-D ones (dense, quantized here), gpt-oss's MXFP4 (mxfp4_experts.py) or
llm-compressor's packed experts (compressed_tensors.py). The family (model/family.py `Experts`) names them."""

from __future__ import annotations

import torch

from ..layers.quant_experts import PROJECTIONS, QuantExperts
from .compressed_tensors import compressed_experts_in, read_compressed_experts, require_experts
from .mxfp4_experts import read_mxfp4_experts


def layer_experts(model, ckpt, family, i, fmt, device, compressed: bool):
    """(QuantExperts, checkpoint keys used) of layer i: packed when a compressed-tensors checkpoint holds them so."""
    if compressed and compressed_experts_in(ckpt, family, i):
        return read_compressed_experts(model, ckpt, family, i, fmt, device)
    return read_experts(model, ckpt, family, i, fmt, device)


def read_experts(model, ckpt, family, i, fmt, device):
    """(QuantExperts, checkpoint keys used) of layer i's experts. Read one expert at a time
    from the stock per-expert layout, or from transformers 5's fused 3-D tensors, and quantized; gpt-oss's
    MXFP4 `*_blocks` / `*_scales` are repacked as qerl's mxfp4 tensors (the same bytes), whatever `fmt`
    the rest of the model takes: re-quantizing them would compound two rounding errors."""
    ex = family.experts
    module = f"model.layers.{i}.{ex.path}"
    base = family.checkpoint_name(module)
    skeleton = model.get_submodule(module)
    dtype = skeleton.gate_up_proj.dtype
    transposed = bool(getattr(skeleton, "is_transposed", False))
    n = getattr(model.config, ex.count)
    biases, keys = None, []
    if getattr(skeleton, "has_bias", False):
        keys = [f"{base}.{p}_bias" for p in PROJECTIONS]
        require_experts(ckpt, keys, family, n)
        biases = {p: ckpt.get(k, device) for p, k in zip(PROJECTIONS, keys)}
    if f"{base}.gate_up_proj_blocks" in ckpt:
        return (read_mxfp4_experts(ckpt, base, module, skeleton, biases, dtype, transposed, device),
                keys + [f"{base}.{p}_{k}" for p in PROJECTIONS for k in ("blocks", "scales")])
    if f"{base}.gate_up_proj" in ckpt:
        keys += [f"{base}.gate_up_proj", f"{base}.down_proj"]
        gate_up, down = (ckpt.get(k, device) for k in keys[-2:])
        if transposed:  # held [E, K, N] (x·W): quantized along K
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    else:
        per = [f"{base}.{e}.{p}.weight" for e in range(n) for p in (ex.gate, ex.up, ex.down)]
        require_experts(ckpt, per, family, n)
        keys += per
        gate_up = torch.stack([torch.cat([ckpt.get(f"{base}.{e}.{ex.gate}.weight", device),
                                          ckpt.get(f"{base}.{e}.{ex.up}.weight", device)]) for e in range(n)])
        down = torch.stack([ckpt.get(f"{base}.{e}.{ex.down}.weight", device) for e in range(n)])
    return QuantExperts.quantize(gate_up.to(dtype), down.to(dtype), fmt, skeleton._apply_gate, dtype, module, biases,
                                 transposed), keys

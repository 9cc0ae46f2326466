"""Memory and quantization error of a quantized policy, layer by layer."""

from __future__ import annotations

import time

import torch

from .load import load_policy, quantized_layers
from ..checkpoint.safetensors_reader import SafetensorsCheckpoint


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def quantization_report(model: str, quant: str, device="cpu") -> dict:
    t0 = time.perf_counter()
    policy = load_policy(model, quant, lora_rank=0, device=device)
    load_s = time.perf_counter() - t0
    dense = SafetensorsCheckpoint(policy.source)
    rows = []
    for name, layer in quantized_layers(policy.model):
        w = dense.get(f"{name}.weight", device).float()
        err = (layer.dequantized_weight(torch.float32) - w).norm() / w.norm().clamp(min=1e-30)
        qbytes = sum(_bytes(t) for t in layer.quant_tensors().values())
        rows.append({"name": name, "shape": list(layer.weight_shape), "format": layer.fmt.name,
                     "bytes": qbytes, "bf16_bytes": w.numel() * 2, "rel_error": float(err)})
    # Memory as allocated: a fused group's members share one global scale, counted once here.
    quant_ptrs = {t.data_ptr() for _, layer in quantized_layers(policy.model) for t in layer.quant_tensors().values()}
    seen, model_bytes, quant_bytes = set(), 0, 0
    for t in list(policy.model.parameters()) + list(policy.model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        model_bytes += _bytes(t)
        quant_bytes += _bytes(t) if t.data_ptr() in quant_ptrs else 0
    lin_q = sum(r["bytes"] for r in rows)
    lin_b = sum(r["bf16_bytes"] for r in rows)
    model_bf16 = model_bytes - quant_bytes + lin_b
    summary = {
        "model": str(policy.source), "quant": quant, "device": str(device), "n_layers": len(rows),
        "bf16_fallback": policy.bf16_fallback, "linear_bytes": lin_q, "linear_bf16_bytes": lin_b,
        "linear_ratio": lin_q / lin_b, "model_bytes": model_bytes, "model_bf16_bytes": model_bf16,
        "model_ratio": model_bytes / model_bf16, "load_seconds": load_s,
        "repack_seconds": policy.repack_seconds,
        "mean_rel_error": sum(r["rel_error"] for r in rows) / max(len(rows), 1),
    }
    return {"layers": rows, "summary": summary}

"""Independent references: compressed-tensors' and bitsandbytes' own code paths.

The NVFP4/MXFP4 references go through compressed-tensors' public qparams helpers
and its registered compressors (the same calls llm-compressor makes), so a
mismatch here means our bytes differ from what those tools write.
"""

from __future__ import annotations

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam


def _args(fmt: str) -> QuantizationArgs:
    if fmt == "nvfp4":
        return QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group",
                                group_size=16, scale_dtype=torch.float8_e4m3fn)
    return QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="group", group_size=32,
                            scale_dtype=torch.uint8)


def ct_global_scale(ws: list[torch.Tensor]) -> torch.Tensor:
    # llm-compressor: one gparam for a fused group, from the group's min/max.
    mn = torch.stack([w.amin() for w in ws]).amin()
    mx = torch.stack([w.amax() for w in ws]).amax()
    return generate_gparam(mn, mx)


def ct_compress(w: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    args = _args(fmt)
    g = args.group_size
    blk = w.unflatten(-1, (w.shape[1] // g, g))
    if fmt == "nvfp4" and global_scale is None:
        global_scale = ct_global_scale([w])
    scale, _ = calculate_qparams(blk.amin(-1), blk.amax(-1), args, global_scale=global_scale if fmt == "nvfp4" else None)
    sd = {"weight": w, "weight_scale": scale}
    if fmt == "nvfp4":
        sd["weight_global_scale"] = global_scale
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    comp = BaseCompressor.load_from_registry(f"{fmt}-pack-quantized")
    return dict(comp.compress(sd, scheme))


def ct_decompress(t: dict[str, torch.Tensor], fmt: str, dtype=torch.bfloat16) -> torch.Tensor:
    scheme = QuantizationScheme(targets=["Linear"], weights=_args(fmt))
    comp = BaseCompressor.load_from_registry(f"{fmt}-pack-quantized")
    return comp.decompress(dict(t), scheme)["weight"].to(dtype)

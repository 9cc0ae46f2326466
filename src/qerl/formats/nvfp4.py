"""NVFP4: E2M1 values, an FP8-E4M3 scale per 16 inputs, an FP32 scale per tensor.

Bit-exact with compressed-tensors' `nvfp4-pack-quantized` (as llm-compressor's
NVFP4A16 scheme writes it). Written by hand because compressed-tensors' own path
needs its module lifecycle (observers, parameters on modules) and materialises
several full-size float copies; this one works on a bare tensor, in row chunks.
The arithmetic order below (which steps run in the weight's dtype, which in
float32) is what makes it bit-exact; the tests compare against the real package.
"""

from __future__ import annotations

import torch

from .base import QuantizationError, WeightFormat
from .e2m1 import E2M1_MAX, codes_to_float, pack_codes, round_to_codes, unpack_codes

FP8_MAX = 448.0
ZERO_SCALE_REPLACEMENT = 0.125  # compressed-tensors' eps for an FP8 scale that is 0
_CHUNK_ELEMS = 1 << 24  # rows per chunk chosen so temporaries stay ~100 MB


def tensor_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """gs = 448*6/amax, computed in amax's dtype (bf16 for bf16 weights) then cast to f32."""
    amax = torch.clamp(amax, min=torch.finfo(amax.dtype).tiny)
    gs = (FP8_MAX * E2M1_MAX) / amax
    gs = torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0)
    return gs.to(torch.float32).reshape(1)


class NVFP4(WeightFormat):
    name = "nvfp4"
    block_size = 16
    has_global_scale = True

    def global_scale(self, ws):
        # A fused group shares the scale of its largest |w|, as llm-compressor writes
        # it and vLLM requires (it uses one global scale for the fused matmul).
        amax = torch.stack([w.detach().abs().amax() for w in ws]).amax()
        return tensor_global_scale(amax)

    def quantize(self, w, global_scale=None):
        w = w.detach()
        out, inp = w.shape
        gs = self.global_scale([w]) if global_scale is None else global_scale.to(torch.float32).reshape(1)
        gs = gs.to(w.device)
        packed = torch.empty(out, inp // 2, dtype=torch.uint8, device=w.device)
        scales = torch.empty(out, inp // 16, dtype=torch.float8_e4m3fn, device=w.device)
        rows = max(1, _CHUNK_ELEMS // max(inp, 1))
        for r0 in range(0, out, rows):
            blk = w[r0 : r0 + rows].unflatten(-1, (inp // 16, 16))
            amax = blk.abs().amax(-1)  # in the weight's dtype
            s = gs * (amax / E2M1_MAX)  # amax/6 rounds in the weight's dtype, then f32
            s = torch.clamp(s, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
            s = torch.where(s == 0, torch.full_like(s, ZERO_SCALE_REPLACEMENT), s)
            scaled = blk.to(torch.float32) / (s / gs).unsqueeze(-1)
            packed[r0 : r0 + rows] = pack_codes(round_to_codes(scaled).flatten(-2))
            scales[r0 : r0 + rows] = s.to(torch.float8_e4m3fn)
        return {"weight_packed": packed, "weight_scale": scales, "weight_global_scale": gs.clone()}

    def dequantize(self, t, shape, dtype=torch.bfloat16):
        packed, scale, gs = t["weight_packed"], t["weight_scale"], t["weight_global_scale"]
        out, inp = shape
        vals = codes_to_float(unpack_codes(packed)).unflatten(-1, (inp // 16, 16))
        w = vals * (scale.to(torch.float32) / gs.to(torch.float32)).unsqueeze(-1)
        return w.flatten(-2).to(dtype)

    def expected_shapes(self, shape):
        out, inp = shape
        return {
            "weight_packed": ((out, inp // 2), torch.uint8),
            "weight_scale": ((out, inp // 16), torch.float8_e4m3fn),
            "weight_global_scale": ((1,), torch.float32),
        }


def check_global_scale(gs: torch.Tensor, name: str) -> None:
    if gs.numel() != 1 or not bool(torch.isfinite(gs).all()) or float(gs) <= 0:
        raise QuantizationError(f"{name}: weight_global_scale must be one positive finite value, got {gs}")

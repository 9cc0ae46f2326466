"""MXFP4: E2M1 values with a power-of-two (E8M0) scale per 32 inputs, no global scale.

Matches compressed-tensors' `mxfp4-pack-quantized`. Its exponent choice differs
from OCP's plain floor(log2(amax)): amax is first rounded to the nearest power of
two when its mantissa is >= 1.75 (so the block max does not saturate at 6), then
e = 127 + log2(that) - 2. Stored as a uint8 biased exponent.
"""

from __future__ import annotations

import torch

from .base import WeightFormat
from .e2m1 import codes_to_float, pack_codes, round_to_codes, unpack_codes

_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
_E2M1_MANTISSA = 1
_E2M1_EMAX = 2  # log2 of the largest E2M1 power of two (4)


def _round_to_power_of_two(x: torch.Tensor) -> torch.Tensor:
    """Keep sign+exponent after adding half an E2M1 ulp to the mantissa (in x's dtype)."""
    m = _MANTISSA_BITS[x.dtype]
    int_t = torch.int16 if x.element_size() == 2 else torch.int32
    bits = x.view(int_t).to(torch.int32)
    bits = (bits + (1 << (m - _E2M1_MANTISSA - 1))) & ~((1 << m) - 1)
    return bits.to(int_t).view(x.dtype) if int_t is torch.int16 else bits.view(x.dtype)


def block_exponents(amax: torch.Tensor) -> torch.Tensor:
    """Per-block amax -> biased E8M0 exponent, uint8."""
    if amax.dtype not in _MANTISSA_BITS:
        amax = amax.to(torch.float32)
    p2 = _round_to_power_of_two(amax)
    e = 127 + torch.floor(torch.log2(p2.to(torch.float32))) - _E2M1_EMAX
    return torch.clamp(e, 0, 255).to(torch.uint8)  # zero blocks: log2(0)=-inf -> 0


class MXFP4(WeightFormat):
    name = "mxfp4"
    block_size = 32

    def quantize(self, w, global_scale=None):
        w = w.detach()
        out, inp = w.shape
        blk = w.unflatten(-1, (inp // 32, 32))
        e = block_exponents(blk.abs().amax(-1))
        # compressed-tensors materialises the scale in the weight's dtype; where it
        # underflows to 0 there (fp16, tiny blocks) it falls back to a scale of 1.
        scale = torch.exp2(e.to(torch.float32) - 127).to(w.dtype if w.dtype in _MANTISSA_BITS else torch.float32)
        e = torch.where(scale == 0, torch.full_like(e, 127), e)
        scale = torch.exp2(e.to(torch.float32) - 127)
        codes = round_to_codes(blk.to(torch.float32) / scale.unsqueeze(-1))
        return {"weight_packed": pack_codes(codes.flatten(-2)), "weight_scale": e}

    def dequantize(self, t, shape, dtype=torch.bfloat16):
        out, inp = shape
        vals = codes_to_float(unpack_codes(t["weight_packed"])).unflatten(-1, (inp // 32, 32))
        scale = torch.exp2(t["weight_scale"].to(torch.float32) - 127)
        return (vals * scale.unsqueeze(-1)).flatten(-2).to(dtype)

    def expected_shapes(self, shape):
        out, inp = shape
        return {"weight_packed": ((out, inp // 2), torch.uint8), "weight_scale": ((out, inp // 32), torch.uint8)}

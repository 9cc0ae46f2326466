"""The unquantized baseline behind the same interface: the weight itself, in bf16."""

from __future__ import annotations

import torch

from .base import WeightFormat


class BF16(WeightFormat):
    name = "bf16"
    block_size = 1

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype

    def validate(self, w, name="weight"):
        # A plain copy: any input dimension works, and a non-finite value is stored as
        # it is (this is where layers that cannot be quantized end up).
        if w.ndim != 2 or not w.is_floating_point():
            super().validate(w, name)

    def quantize(self, w, global_scale=None):
        return {"weight": w.detach().to(self.dtype).contiguous()}

    def dequantize(self, t, shape, dtype=torch.bfloat16):
        return t["weight"].to(dtype)

    def expected_shapes(self, shape):
        return {"weight": (tuple(shape), self.dtype)}

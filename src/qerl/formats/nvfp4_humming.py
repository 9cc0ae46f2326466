"""NVFP4 stored in humming-kernels' layout: the one copy a GPU keeps when humming serves the weight.

Why: with qerl's MMA layout stored, humming (the fastest measured path at M 32-2048, issue 47) needs a
second, repacked copy of every weight it serves: 0.5625 B a weight more, ~4 GB for a 7B model, 18 GB for
32B, and `humming_backend.copy_fits` stops building copies once the card runs short, so large models lose
the fast path exactly where memory is tight. Stored in humming's own layout, the weight is read by humming
at every M (rollout decode, prefill, the update's logprob forward) and dequantized from the same bytes for
the backward's dX = dY·W (formats/humming_layout.dequantize_bf16); nothing else is kept.

The tensors (a layer's buffers, formats/humming_layout.py derives the permutation):
  weight_packed        int32 [K/16, 2N]  humming's `weight` (the same 0.5 B a weight as NVFP4's bytes)
  weight_scale         e4m3  [K/16, N]   humming's `weight_scale` (the same bytes, transposed and swizzled)
  weight_global_scale  fp32  [1]         ours: the checkpoint's gs, exact (1/(1/gs) is not always gs)
  weight_scale_2       fp32  [1]         humming's 1/gs
Rows live in column blocks of 64, so a fused group's members view column ranges (`split_dims`), and a
member starts on a multiple of 64 rows (`row_tile`). Checkpoints never see this layout: `to_checkpoint`
gives the compressed-tensors bytes back, bit for bit.
"""

from __future__ import annotations

import torch

from . import humming_layout
from .base import NonFiniteWeightError, QuantizationError, first_nonfinite
from .nvfp4 import NVFP4, check_global_scale


def supports_shape(shape: tuple[int, int]) -> bool:
    """humming's repack tiles 64 rows by 32 inputs; its sm_90 heuristics want blocks of 128 rows."""
    n, k = shape
    return n % 128 == 0 and k % 32 == 0


class NVFP4Humming(NVFP4):
    """NVFP4 whose tensors are the ones humming's layer holds after `transform()` (plus our exact gs)."""

    layout = "humming"
    row_tile = 64
    # Which dim of each tensor grows with the rows (a fused group splits its storage there).
    split_dims = {"weight_packed": 1, "weight_scale": 1}

    def expected_shapes(self, shape):
        n, k = shape
        return {
            "weight_packed": ((k // 16, 2 * n), torch.int32),
            "weight_scale": ((k // 16, n), torch.float8_e4m3fn),
            "weight_global_scale": ((1,), torch.float32),
            "weight_scale_2": ((1,), torch.float32),
        }

    def to_checkpoint(self, t, shape):
        h = {"weight": t["weight_packed"], "weight_scale": t["weight_scale"],
             "weight_global_scale": t["weight_global_scale"]}
        return humming_layout.from_humming("nvfp4", h, shape)

    def from_checkpoint(self, t, shape, name="weight"):
        n, k = shape
        if n % 64 or k % 32:
            raise QuantizationError(f"{name}: humming's layout needs rows % 64 and inputs % 32, got {list(shape)}")
        check_global_scale(t["weight_global_scale"], name)
        bad = first_nonfinite(t)  # the layout keeps the scales' bytes: refuse NaN/inf here, as the standard one does
        if bad is not None:
            raise NonFiniteWeightError(f"{name}.{bad[0]} holds NaN or inf (first at index {list(bad[1])}): the "
                                       "checkpoint's weight is corrupt; qerl will not train on it")
        h = humming_layout.to_humming("nvfp4", t, shape)
        return {"weight_packed": h["weight"], "weight_scale": h["weight_scale"],
                "weight_global_scale": h["weight_global_scale"], "weight_scale_2": h["weight_scale_2"]}

    def quantize(self, w, global_scale=None):
        return self.from_checkpoint(super().quantize(w, global_scale), tuple(w.shape))

    def dequantize(self, t, shape, dtype=torch.bfloat16):
        from ..kernels.triton_backend import triton_runs  # (kernels/ imports formats/: not at the top)

        w = t["weight_packed"]
        if w.is_cuda and dtype in (torch.bfloat16, torch.float16, torch.float32) and triton_runs(w.device):
            # straight from the stored bytes, bit-equal to NVFP4's dequantize of the checkpoint bytes
            h = {"weight": w, "weight_scale": t["weight_scale"], "weight_global_scale": t["weight_global_scale"]}
            return humming_layout.dequantize_bf16("nvfp4", h, shape, dtype)
        return super().dequantize(self.to_checkpoint(t, shape), shape, dtype)

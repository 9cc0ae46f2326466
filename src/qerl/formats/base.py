"""The interface every weight format implements.

A format turns a 2-D weight [out, in] into a dict of named tensors (the names are
the ones its checkpoint format uses, so a layer's buffers map 1:1 onto a
checkpoint) and back. Formats are stateless; the layer owns the tensors.
"""

from __future__ import annotations

from typing import ClassVar

import torch


class QuantizationError(ValueError):
    """A weight cannot be stored in the requested format; the message names it."""


class NonFiniteWeightError(ValueError):
    """A stored weight holds NaN or inf (a scale, a code, a dense value): the model would generate nothing and
    train on NaN. Not a QuantizationError, so no loader falls back to another layout and carries on."""


def first_nonfinite(t: dict[str, torch.Tensor]) -> tuple[str, tuple[int, ...]] | None:
    """(tensor name, index) of the first NaN/inf among a layer's stored tensors, or None. Float tensors
    (FP8 scales included) by value; E8M0 scales stored as bytes by their NaN code 255 (`weight_scale` of a
    uint8 format that has no global scale: MXFP4's)."""
    for key, v in t.items():
        if v.is_floating_point():
            bad = ~torch.isfinite(v if v.element_size() > 1 else v.float())  # FP8: isfinite wants a wider dtype
        elif v.dtype == torch.uint8 and key == "weight_scale" and "weight_global_scale" not in t:
            bad = v == 255
        else:
            continue
        if bool(bad.any()):
            return key, tuple(int(i) for i in bad.nonzero()[0])
    return None


class WeightFormat:
    name: ClassVar[str]
    block_size: ClassVar[int]
    # Whether fused projections (q/k/v, gate/up) must share a per-tensor scale.
    has_global_scale: ClassVar[bool] = False
    # Byte order of the stored tensors: "standard" (as checkpoints hold them) or a kernel's
    # order (formats/nvfp4_mma.py), which `to_checkpoint` turns back into the standard one.
    layout: ClassVar[str] = "standard"
    # Rows a kernel layout stores together: a fused group's members must start on a multiple of it.
    row_tile: ClassVar[int] = 1
    # The dim of each stored tensor that grows with the rows, where it is not 0 (a fused group splits there).
    split_dims: ClassVar[dict[str, int]] = {}

    def to_checkpoint(self, t: dict[str, torch.Tensor], shape: tuple[int, int]) -> dict[str, torch.Tensor]:
        """The tensors as a checkpoint stores them (identity for the standard layout)."""
        return t

    def from_checkpoint(self, t: dict[str, torch.Tensor], shape: tuple[int, int], name: str = "weight"):
        """Checkpoint tensors -> this format's storage order (identity for the standard layout)."""
        return t

    def validate(self, w: torch.Tensor, name: str = "weight") -> None:
        if w.ndim != 2:
            raise QuantizationError(f"{name}: expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
        if not w.is_floating_point():
            raise QuantizationError(f"{name}: expected a floating-point weight, got {w.dtype}")
        bad = first_nonfinite({"weight": w})
        if bad is not None:  # not a QuantizationError: no caller leaves the layer in bf16 and carries on
            count = int((~torch.isfinite(w)).sum())
            raise NonFiniteWeightError(f"{name} holds NaN or inf (first at index {list(bad[1])}; {count} value(s)): "
                                       "the weight is corrupt; refusing to quantize it")
        if w.shape[1] % self.block_size:
            raise QuantizationError(
                f"{name}: input dimension {w.shape[1]} is not divisible by the {self.name} "
                f"block size {self.block_size}"
            )

    def global_scale(self, ws: list[torch.Tensor]) -> torch.Tensor | None:
        """One per-tensor scale shared by a fused group of weights (None if unused)."""
        return None

    def quantize(self, w: torch.Tensor, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def dequantize(self, t: dict[str, torch.Tensor], shape: tuple[int, int], dtype=torch.bfloat16) -> torch.Tensor:
        raise NotImplementedError

    def expected_shapes(self, shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each stored tensor for a weight of `shape` (used to validate files)."""
        raise NotImplementedError

    def nbytes(self, shape: tuple[int, int]) -> int:
        total = 0
        for s, dt in self.expected_shapes(shape).values():
            n = 1
            for d in s:
                n *= d
            total += n * torch.empty((), dtype=dt).element_size()
        return total

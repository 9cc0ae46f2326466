"""A bit-repeatable split-K through humming-kernels: K cut into S slices run as S "experts" of one grouped GEMM.

Why: on the H100 humming's repeatable modes leave most SMs idle on the narrow (q|k|v, o: 28-36 output tiles of 128
columns) and long-K (down) weights, 2-4x slower than its stream-K, whose atomic adds into the output make every
call's bits differ (benchmarks/kernels.md, 2026-12-07). Its grouped-masked GEMM runs every (expert, tile) pair in
one launch: with K-slices as experts the grid has S times the tiles, each summed by one CTA in a fixed order, and
the S partial outputs (bf16: humming writes no fp32) are added in fp32 by one torch reduction, in a fixed order. The cost: the activations are
regrouped per slice (M x K bf16) and S partials of M x N are written and read, and the weight needs this copy beside
qerl's. A candidate of `qerl bench kernels` (modes humming_ksplit2 / humming_ksplit4) and a routes backend of the
same names (mma_backend builds the copy where the table sends a weight); not yet measured on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .dispatch import LoraTerm
from .humming_backend import CT_CONFIGS, end_lora, nosplit_tuning, start_lora

GROUPED = {"gemm_type": "grouped_masked"}
SLICE_ALIGN = 128  # K elements a slice must be a multiple of (humming's K tiles; NVFP4's 16-element groups)


def slices(k: int, splits: int) -> int:
    """K of each slice; refuses a split that does not cut K into aligned equal parts."""
    if splits < 1 or k % splits or (k // splits) % SLICE_ALIGN:
        raise ValueError(f"humming split-K: K = {k} does not split into {splits} slices of a multiple of "
                         f"{SLICE_ALIGN}")
    return k // splits


def split_tensors(tensors: dict[str, torch.Tensor], shape: tuple[int, int], splits: int) -> dict[str, torch.Tensor]:
    """compressed-tensors NVFP4 tensors of an [N, K] weight -> S experts of [N, K/S]: slice s holds columns
    [s K/S, (s+1) K/S) of the packed values and of the scales; every slice keeps the tensor's global scale."""
    n, k = shape
    kk = slices(k, splits)
    packed, scale = tensors["weight_packed"], tensors["weight_scale"]
    if tuple(packed.shape) != (n, k // 2) or tuple(scale.shape) != (n, k // 16):
        raise ValueError(f"humming split-K: NVFP4 tensors of {tuple(packed.shape)} / {tuple(scale.shape)} are not "
                         f"those of a {n}x{k} weight")
    return {"weight_packed": packed.view(n, splits, kk // 2).transpose(0, 1).contiguous(),
            "weight_scale": scale.view(n, splits, kk // 16).transpose(0, 1).contiguous(),
            "weight_global_scale": tensors["weight_global_scale"].reshape(1).expand(splits).contiguous()}


def regroup(x2d: torch.Tensor, splits: int) -> torch.Tensor:
    """[M, K] -> [S * M, K/S]: slice s of every row, slice-major (the grouped GEMM's per-expert rows)."""
    m, k = x2d.shape
    return x2d.view(m, splits, k // splits).transpose(0, 1).reshape(splits * m, k // splits)


def combine(partials: torch.Tensor, splits: int, dtype: torch.dtype) -> torch.Tensor:
    """[S * M, N] partial products -> [M, N]: summed in fp32 in slice order, then rounded. (humming writes each
    partial in bf16, so every slice is rounded once before the sum, as stream-K's partials are.)"""
    sm, n = partials.shape
    return partials.view(splits, sm // splits, n).sum(0, dtype=torch.float32).to(dtype)


@dataclass
class KSplitWeight:
    """One frozen NVFP4 weight as S K-slices in humming's grouped layout."""

    layer: torch.nn.Module
    n: int
    k: int
    splits: int
    _layouts: dict = field(default_factory=dict)  # M -> the per-slice token counts (kept: graphs hold them)

    @classmethod
    def build(cls, tensors: dict[str, torch.Tensor], shape: tuple[int, int], splits: int,
              dtype: torch.dtype = torch.bfloat16) -> "KSplitWeight":
        from humming.layer import HummingLayer

        n, k = shape
        dev = tensors["weight_packed"].device
        with torch.device(dev):
            layer = HummingLayer(shape_n=n, shape_k=slices(k, splits), weight_config=dict(CT_CONFIGS["nvfp4"]),
                                 num_experts=splits, torch_dtype=dtype)
        layer.load_from_tensors(split_tensors(tensors, shape, splits))
        layer.transform()
        return cls(layer, n, k, splits)

    def tuning(self, device: torch.device) -> str:
        """humming's grouped-GEMM tiles with stream-K off: one CTA a tile, a fixed K order."""
        return nosplit_tuning(self.layer.humming_config, device, "grouped_masked")

    def matmul(self, x2d: torch.Tensor, bias: torch.Tensor | None = None, lora: LoraTerm | None = None,
               backend: str | None = None) -> torch.Tensor:
        """x2d [M, K] bf16 -> x2d @ W.T (+ bias) (+ the LoRA term) [M, N] bf16 (HummingWeight.matmul's contract)."""
        lora, pending = start_lora(lora, x2d)
        return end_lora(self._product(x2d), lora, pending, bias)

    def _product(self, x2d: torch.Tensor) -> torch.Tensor:
        m = x2d.shape[0]
        layout = self._layouts.get(m)
        if layout is None:
            if torch.cuda.is_current_stream_capturing():  # a fill recorded in a graph is not run now: garbage later
                raise RuntimeError(f"humming split-K: first call at M = {m} inside a CUDA graph capture; run one "
                                   "eager call at this M first (the engine's warm-up does)")
            layout = self._layouts[m] = torch.full((self.splits,), m, dtype=torch.int32, device=x2d.device)
        y = self.layer(regroup(x2d, self.splits), expert_layout=layout, compute_config=GROUPED,
                       tuning_config=self.tuning(x2d.device))
        return combine(y, self.splits, x2d.dtype)

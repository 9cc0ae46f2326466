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

from dataclasses import dataclass

import torch

from .dispatch import LoraTerm
from .humming_backend import CT_CONFIGS, _layer_config, end_lora, nosplit_tuning, start_lora
from .weight_state import WeightState

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


_LAYOUTS: dict[tuple, torch.Tensor] = {}
_SCALE2: WeightState[dict] = WeightState()


def _not_capturing(what: str, m: int) -> None:
    # a tensor filled inside a CUDA graph capture holds its values only on replay: an eager call later reads garbage
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"humming split-K: first call at M = {m} inside a CUDA graph capture ({what}); run one "
                           "eager call at this M first (the engine's warm-up does)")


def layout(splits: int, m: int, device: torch.device) -> torch.Tensor:
    """The grouped GEMM's per-slice token counts (M each), one tensor per (S, M, device), kept: graphs hold them."""
    key = (splits, m, device)
    if key not in _LAYOUTS:
        _not_capturing("token counts", m)
        _LAYOUTS[key] = torch.full((splits,), m, dtype=torch.int32, device=device)
    return _LAYOUTS[key]


def stored_product(x2d: torch.Tensor, tensors: dict[str, torch.Tensor], shape: tuple[int, int], splits: int,
                   locks: torch.Tensor) -> torch.Tensor:
    """x2d @ W.T for a weight STORED in humming's dense layout (formats/nvfp4_humming.py), split over K without a
    copy: its packed words [K/16, 2N] and scales [K/16, N] are K-major rows of 16, so slice s of K is a row range,
    and the S ranges viewed as [S, K/16S, ...] are S experts in humming's grouped layout (tests/
    test_humming_ksplit_gpu.py checks this against humming's own transform of the sliced checkpoint)."""
    from humming.forward import humming_forward

    n, k = shape
    kk = slices(k, splits)
    w, sc = tensors["weight_packed"], tensors["weight_scale"]
    config = _layer_config(n, kk, w.device, experts=splits)
    per = _SCALE2.get(tensors["weight_scale_2"], dict)  # dropped with the weight's tensor
    ws2 = per.get(splits)
    if ws2 is None:  # humming's per-expert 1/global scale: the tensor's one value, S times
        _not_capturing("scale", x2d.shape[0])
        ws2 = per[splits] = tensors["weight_scale_2"].reshape(1).repeat(splits).contiguous()
    y = humming_forward(config, inputs=regroup(x2d, splits), weight=w.view(splits, -1, w.shape[-1]),
                        weight_scale=sc.view(splits, -1, sc.shape[-1]), weight_scale_2=ws2,
                        expert_layout=layout(splits, x2d.shape[0], x2d.device), locks=locks, compute_config=GROUPED,
                        tuning_config=nosplit_tuning(config, w.device, "grouped_masked"))
    return combine(y, splits, x2d.dtype)


@dataclass
class KSplitWeight:
    """One frozen NVFP4 weight as S K-slices in humming's grouped layout."""

    layer: torch.nn.Module
    n: int
    k: int
    splits: int

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
        y = self.layer(regroup(x2d, self.splits), expert_layout=layout(self.splits, x2d.shape[0], x2d.device),
                       compute_config=GROUPED,
                       tuning_config=self.tuning(x2d.device))
        return combine(y, self.splits, x2d.dtype)

"""A frozen lm_head stored in 4 bits (the `lm_head_4bit` option).

Why. At decode batch 1 a 7B step reads 3.7 GB of NVFP4 body weights and 1.09 GB of bf16 lm_head: the head
is a quarter of the bytes and ~10 % of the step (benchmarks/rollout.md, H100). In NVFP4 it reads 0.31 GB
through the same kernels as the body. The cost is the head's own quantization error on every logit, so it
is an option, off by default, with its quality measured on the default run (benchmarks/default_run.md).

Rollouts call the module (`dispatch.frozen_linear` → the 4-bit kernels); the training logprobs read
`.weight` (train/logprobs.py multiplies chunks by it), which here is the dequantized 4-bit weight, so both
sides score tokens with the same frozen head. The dequantized copy lives only for that multiply.
"""

from __future__ import annotations

import torch
from torch import nn

from ..formats import get_format
from .qlora_linear import QLoRALinear


class QuantHead(nn.Module):
    def __init__(self, layer: QLoRALinear):
        super().__init__()
        self.layer = layer
        self.in_features, self.out_features = layer.in_features, layer.out_features

    @classmethod
    def from_linear(cls, head: nn.Linear, fmt_name: str = "nvfp4") -> "QuantHead":
        """Quantize a dense head [V, D] (a tied head's embedding stays as it is, in its dtype)."""
        from ..kernels import storage_format

        if getattr(head, "bias", None) is not None:
            raise ValueError("lm_head_4bit: an lm_head with a bias is not supported")
        w = head.weight.detach()
        shape = tuple(w.shape)
        fmt = get_format(fmt_name)
        fmt.validate(w, "lm_head.weight")
        tensors = fmt.quantize(w)
        store = storage_format(fmt, shape, w.device)
        if store is not fmt:  # the kernel layout of this device (formats/nvfp4_mma.py)
            tensors = store.from_checkpoint(tensors, shape)
        layer = QLoRALinear(shape[1], shape[0], store, dtype=w.dtype, device=w.device)
        layer.load_quantized(tensors, "lm_head.weight")
        return cls(layer)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized head [V, D] in the model's dtype, made on each access (not kept)."""
        return self.layer.dequantized_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fmt={self.layer.fmt.name} (frozen)"


def quantize_lm_head(model: nn.Module, fmt_name: str = "nvfp4") -> QuantHead:
    """Replace model.lm_head by its 4-bit copy, in place; returns it."""
    head = model.lm_head
    if isinstance(head, QuantHead):
        return head
    q = QuantHead.from_linear(head, fmt_name)
    model.lm_head = q
    return q

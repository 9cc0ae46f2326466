"""A frozen quantized linear layer with trainable bf16 LoRA adapters.

    y = x·Ŵᵀ + b + (alpha/r)·(dropout(x)·Aᵀ)·Bᵀ

Ŵ lives only in its packed format (buffers named as the checkpoint names them);
it is dequantized inside the matmul and again in backward, never stored, so
weight memory stays 4-bit and activation memory equals bf16 LoRA's. The LoRA
submodules are named `lora_A`/`lora_B` with PEFT's shapes, so adapters map 1:1
onto PEFT's files.

A layer may belong to a fused group (layers/fused_group.py): its buffers and LoRA
parameters are then row views into the group's storage, so everything here that
writes them does so in place.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from ..formats import WeightFormat, get_format
from ..formats.base import NonFiniteWeightError, first_nonfinite
from ..kernels import dispatch, settings


def unfused_lora():
    """Run no-grad forwards on the training path (base matmul, then the LoRA term; a fused group's
    training computation), so that a no-grad logprob pass gives bit-for-bit the numbers of the
    grad-enabled one (PPO's old policy). KernelSettings.fuse_lora off for the block."""
    return settings.use(fuse_lora=False)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The base policy: every QLoRALinear of `model` without its adapter (the KL reference and the
    parity gate's adapter-off side), on the training path and the engine's fused groups alike; an MoE's
    experts' LoRA (QuantExperts) too."""
    from .quant_experts import QuantExperts

    layers = [m for m in model.modules() if isinstance(m, (QLoRALinear, QuantExperts))]
    for m in layers:
        m.disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m.disable_adapters = False


def standalone(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of t that owns its storage, for writing: a view into a fused group's
    storage would otherwise take the whole group along (torch.save) or be refused as shared
    memory (safetensors), as would one tensor saved under several names (a shared global scale)."""
    return t.detach().to("cpu", copy=True).contiguous()


class _FrozenQuantMatmul(torch.autograd.Function):
    """x @ Ŵᵀ + b with a gradient for x only; Ŵ is recomputed in backward."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return dispatch.base_matmul(x, layer.fmt, layer.quant_tensors(), layer.weight_shape, layer.bias)

    @staticmethod
    def backward(ctx, gy):
        layer = ctx.layer
        if not ctx.needs_input_grad[0]:
            return None, None
        return dispatch.base_matmul_grad_input(gy, layer.fmt, layer.quant_tensors(), layer.weight_shape), None


class QLoRALinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: WeightFormat | str = "nvfp4",
        *,
        bias: bool = False,
        r: int = 0,
        lora_alpha: float | None = None,
        lora_dropout: float = 0.0,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
        defer_storage: bool = False,
    ):
        """defer_storage: leave the quantized buffers on the meta device, for a fused group to give
        them storage (so a group's weights are never allocated twice)."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fmt = get_format(fmt) if isinstance(fmt, str) else fmt
        self.dtype = dtype
        self.home = torch.device(device) if device is not None else torch.device("cpu")
        self.group = None  # the fused group (q|k|v, gate|up) whose storage this layer views, if any
        for name, (shape, dt) in self.fmt.expected_shapes(self.weight_shape).items():
            self.register_buffer(name, torch.zeros(shape, dtype=dt, device="meta" if defer_storage else device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self.r = 0
        self.disable_adapters = False  # True: the base policy (the KL reference is free)
        self.lora_dropout: nn.Module = nn.Identity()
        if r:
            self.add_lora(r, lora_alpha if lora_alpha is not None else r, lora_dropout)

    @property
    def weight_shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def quant_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.fmt.expected_shapes(self.weight_shape)}

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The quantized tensors in the standard (checkpoint) byte order. For the standard layout
        these are the buffers themselves (views, in a fused group): write them via `standalone`."""
        return self.fmt.to_checkpoint(self.quant_tensors(), self.weight_shape)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, fmt: WeightFormat | str, bias: torch.Tensor | None = None, *,
        global_scale: torch.Tensor | None = None, name: str = "weight", **lora,
    ) -> "QLoRALinear":
        """Quantize a dense weight [out, in] (its bf16 copy is not kept)."""
        fmt = get_format(fmt) if isinstance(fmt, str) else fmt
        fmt.validate(weight, name)
        layer = cls(weight.shape[1], weight.shape[0], fmt, bias=bias is not None, device=weight.device, **lora)
        layer.load_quantized(fmt.quantize(weight, global_scale), name)
        if bias is not None:
            layer.bias.data.copy_(bias.detach())
        return layer

    def load_quantized(self, tensors: dict[str, torch.Tensor], name: str = "weight") -> None:
        """Take packed tensors in this format's storage order; shapes and dtypes are checked.

        A layer of a fused group copies them into its rows of the group's storage (in place);
        any other layer adopts the tensors."""
        want = self.fmt.expected_shapes(self.weight_shape)
        missing = set(want) - set(tensors)
        # (kernel layouts re-encode scales and refuse non-finite ones when they repack: formats/nvfp4_mma.py)
        bad = first_nonfinite({k: v for k, v in tensors.items() if k in want}) if self.fmt.layout == "standard" else None
        if bad is not None:
            raise NonFiniteWeightError(f"{name}.{bad[0]} holds NaN or inf (first at index {list(bad[1])}): the "
                                       "checkpoint's weight is corrupt; qerl will not train on it")
        if missing:
            raise KeyError(f"{name}: missing tensor(s) {sorted(missing)} for format {self.fmt.name}")
        for key, (shape, dt) in want.items():
            t = tensors[key]
            if tuple(t.shape) != tuple(shape) or t.dtype != dt:
                raise ValueError(
                    f"{name}.{key}: expected {dt} {list(shape)}, got {t.dtype} {list(t.shape)}"
                )
            if self.group is not None:
                with torch.no_grad():
                    getattr(self, key).copy_(t)
            else:
                setattr(self, key, t.to(self._device()))

    def _device(self) -> torch.device:
        """Where the layer lives: its buffers' device (they move with .to()), unless still deferred."""
        dev = next(iter(self.buffers())).device
        return self.home if dev.type == "meta" else dev

    def add_lora(
        self, r: int, alpha: float, dropout: float = 0.0, dtype: torch.dtype | None = None, use_rslora: bool = False
    ) -> None:
        dev = self._device()
        dt = dtype or self.dtype
        # rsLoRA (PEFT's use_rslora): alpha/sqrt(r) keeps the update's scale stable as r grows.
        self.r, self.lora_alpha = r, alpha
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=dev, dtype=dt)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=dev, dtype=dt)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.reset_lora()

    def reset_lora(self) -> None:
        # PEFT's default: A ~ kaiming-uniform(a=√5), B = 0, so the adapter starts as a no-op.
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    # ---- compute ------------------------------------------------------------------------
    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.fmt.dequantize(self.quant_tensors(), self.weight_shape, dtype or self.dtype)

    def lora_delta(self) -> torch.Tensor | None:
        """scaling·B·A, the dense [out, in] update the adapter adds."""
        if not self.r:
            return None
        return self.scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:  # training: the whole fused group in one pass (fused_group.member_forward)
            y = self.group.member_forward(self, x)
            if y is not None:
                return y
        if self.r and not self.disable_adapters and not torch.is_grad_enabled() and settings.current().fuse_lora:
            # Rollouts: the expand B·(x·Aᵀ) rides in the base matmul's epilogue where a kernel can fuse it;
            # without active dropout the shrink too (A handed over, the kernel computes x·Aᵀ in its launch).
            if isinstance(self.lora_dropout, nn.Identity) or not self.lora_dropout.training:
                lora = dispatch.LoraTerm(None, self.lora_B.weight, self.scaling, a=self.lora_A.weight)
            else:
                a = self.lora_A(self.lora_dropout(x).to(self.lora_A.weight.dtype))
                lora = dispatch.LoraTerm(a, self.lora_B.weight, self.scaling)
            return dispatch.base_matmul(x, self.fmt, self.quant_tensors(), self.weight_shape, self.bias, lora=lora)
        y = _FrozenQuantMatmul.apply(x, self)
        if self.r and not self.disable_adapters:
            a = self.lora_A(self.lora_dropout(x).to(self.lora_A.weight.dtype))
            y = y + (self.lora_B(a) * self.scaling).to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fmt={self.fmt.name}, r={self.r}, bias={self.bias is not None}"

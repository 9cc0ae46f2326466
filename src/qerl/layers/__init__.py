"""Layers: the frozen quantized linear with trainable LoRA adapters."""

from .qlora_linear import QLoRALinear

__all__ = ["QLoRALinear"]

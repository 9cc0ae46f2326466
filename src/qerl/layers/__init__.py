"""Layers: the frozen quantized linear with trainable LoRA adapters."""

from .qlora_linear import QLoRALinear, unfused_lora

__all__ = ["QLoRALinear", "unfused_lora"]

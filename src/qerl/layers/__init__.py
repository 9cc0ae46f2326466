"""Layers: the frozen quantized linear with trainable LoRA adapters, and fused groups of them."""

from .fused_group import QuantGroup, fused_groups, group_of
from .qlora_linear import QLoRALinear, adapters_disabled, unfused_lora

__all__ = ["QLoRALinear", "adapters_disabled", "QuantGroup", "fused_groups", "group_of", "unfused_lora"]

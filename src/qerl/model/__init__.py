"""Models: Hugging Face causal LMs with their linears swapped for quantized LoRA layers."""

from .architectures import SUPPORTED_ARCHITECTURES, TARGET_MODULES
from .load import Policy, load_policy, quantized_layers
from .random_init import MOE, QWEN25, moe_config, qwen25_config, random_policy, shape_config

__all__ = ["MOE", "QWEN25", "SUPPORTED_ARCHITECTURES", "TARGET_MODULES", "Policy", "load_policy", "moe_config",
           "quantized_layers", "qwen25_config", "random_policy", "shape_config"]

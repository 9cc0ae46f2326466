"""Models: Hugging Face causal LMs with their linears swapped for quantized LoRA layers."""

from .architectures import SUPPORTED_ARCHITECTURES, TARGET_MODULES
from .load import Policy, load_policy, quantized_layers
from .random_init import qwen25_config, random_policy

__all__ = ["SUPPORTED_ARCHITECTURES", "TARGET_MODULES", "Policy", "load_policy", "quantized_layers", "qwen25_config", "random_policy"]

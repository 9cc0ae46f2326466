"""Models: Hugging Face causal LMs with their linears swapped for quantized LoRA layers."""

from .architectures import SUPPORTED_ARCHITECTURES, TARGET_MODULES
from .load import Policy, load_policy, quantized_layers

__all__ = ["SUPPORTED_ARCHITECTURES", "TARGET_MODULES", "Policy", "load_policy", "quantized_layers"]

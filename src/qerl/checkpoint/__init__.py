"""Checkpoints: compressed-tensors, PEFT adapters, merged exports."""

from .compressed_tensors import save_compressed
from .export import export_merged
from .peft_adapter import AdapterError, load_adapter, save_adapter

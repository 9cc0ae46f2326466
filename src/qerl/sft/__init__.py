"""Supervised fine-tuning of the LoRA on the frozen quantized base (`qerl sft`), with TRL's SFTConfig names."""

from .config import SFTConfig
from .trainer import SFTTrainer

__all__ = ["SFTConfig", "SFTTrainer"]

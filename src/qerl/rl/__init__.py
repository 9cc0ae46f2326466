"""RL on the quantized LoRA policy: GRPO / DAPO with Adaptive Quantization Noise."""

from .aqn import AQN, sigma_at
from .config import GRPOConfig
from .trainer import GRPOTrainer, TrainingError

__all__ = ["AQN", "GRPOConfig", "GRPOTrainer", "TrainingError", "sigma_at"]

"""RL on the quantized LoRA policy: GRPO / DAPO with Adaptive Quantization Noise."""

from .aqn import AQN, sigma_at
from .config import GRPOConfig
from .parity import ParityError
from .trainer import GRPOTrainer, TrainingError

__all__ = ["AQN", "GRPOConfig", "GRPOTrainer", "ParityError", "TrainingError", "sigma_at"]

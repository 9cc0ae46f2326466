"""Rollouts: batched sampling on the live quantized LoRA policy (no second copy of the weights)."""

from ..completion import Completion
from .engine import Engine, RolloutStats
from .sampling import SamplingParams, processed_logprobs, sample

__all__ = ["Completion", "Engine", "RolloutStats", "SamplingParams", "processed_logprobs", "sample"]

"""Qwen2 (and R1-Distill-Qwen): Llama's layer with q/k/v biases; sliding layers from config.layer_types
(use_sliding_window / max_window_layers)."""

from ..family import Family

FAMILY = Family("qwen2", ("qwen2",), "Qwen2ForCausalLM", "Qwen2DecoderLayer",
                tested_against="HF generate on tiny random models (dense, NVFP4, merged export, sliding layers)")

"""Qwen3: Llama's layer with per-head RMSNorms on q and k before the rotary."""

from ..family import Family

FAMILY = Family("qwen3", ("qwen3",), "Qwen3ForCausalLM", "Qwen3DecoderLayer", qk_norm="head",
                tested_against="HF generate on tiny random models (dense, NVFP4, merged export)")

"""Llama: pre-norm RMSNorm, SiLU-gated MLP, one rotary table (its scaling type read from the module)."""

from ..family import Family

FAMILY = Family("llama", ("llama",), "LlamaForCausalLM", "LlamaDecoderLayer",
                tested_against="HF generate on tiny random models (dense, NVFP4, merged export)")

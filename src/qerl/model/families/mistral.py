"""Mistral: Llama's layer; config.sliding_window (v0.1: 4096) applies to every layer."""

from ..family import Family

FAMILY = Family("mistral", ("mistral",), "MistralForCausalLM", "MistralDecoderLayer", windows_from="every_layer",
                tested_against="HF generate on tiny random models with a window of 8 and prompts longer than it")

"""Olmo 3: Olmo 2's layer with sliding and full layers (config.layer_types), rotary tables per layer type."""

from ..family import Family, Norms

FAMILY = Family("olmo3", ("olmo3",), "Olmo3ForCausalLM", "Olmo3DecoderLayer",
                norms=Norms(None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
                qk_norm="width", llama_norm=False, rope_per_layer_type=True,
                tested_against="HF generate on tiny random Olmo3ForCausalLM (window 8)")

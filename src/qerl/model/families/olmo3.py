"""Olmo 3: Olmo 2's layer with sliding and full layers (config.layer_types), rotary tables per layer type."""

import dataclasses

from .olmo2 import FAMILY as OLMO2

FAMILY = dataclasses.replace(OLMO2, name="olmo3", model_types=("olmo3",), causal_lm="Olmo3ForCausalLM",
                             decoder_layer="Olmo3DecoderLayer", rope_per_layer_type=True,
                             tested_against="HF generate on tiny random Olmo3ForCausalLM (window 8)")

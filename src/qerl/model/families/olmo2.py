"""Olmo 2: norms after attention and after the MLP (none before), q/k RMSNorms over the full width,
norms computing (w * x_hat).to(dtype)."""

from ..family import Family, Norms

FAMILY = Family("olmo2", ("olmo2",), "Olmo2ForCausalLM", "Olmo2DecoderLayer",
                norms=Norms(None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
                qk_norm="width", norm_form="fp32",
                tested_against="HF generate on tiny random Olmo2ForCausalLM")

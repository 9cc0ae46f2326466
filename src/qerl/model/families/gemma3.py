"""Gemma 3 (text): four (1 + w) RMSNorms a layer, per-head q/k norms, gelu-tanh, scaled embeddings
(the embedding module scales), local (sliding, own rotary base) and global layers."""

from ..family import Family, Norms


def _check(config):
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention (an encoder's attention) is not a causal LM's"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attn_logit_softcapping is set (Gemma 2's attention); qerl's attention does not cap scores"
    return None


FAMILY = Family("gemma3", ("gemma3_text",), "Gemma3ForCausalLM", "Gemma3DecoderLayer",
                norms=Norms("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                            "post_feedforward_layernorm"),
                qk_norm="head", norm_form="offset", rope_per_layer_type=True, check=_check,
                tested_against="HF generate on tiny random Gemma3ForCausalLM (local/global layers, window 8)")

"""Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj in the checkpoint (kept fused: one quantized
linear each, as PEFT and vLLM name them), partial rotary and longrope (read from the rotary module),
config.sliding_window on every layer."""

from ..family import Family

FAMILY = Family("phi3", ("phi3",), "Phi3ForCausalLM", "Phi3DecoderLayer",
                projections={"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj", "gate_up": "mlp.gate_up_proj",
                             "down": "mlp.down_proj"},
                qkv=("qkv",), gate_up=("gate_up",), fused_groups=(),
                aliases={"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gate_up", "up": "gate_up"},
                act="activation_fn", windows_from="every_layer",
                tested_against="HF generate on tiny random Phi3ForCausalLM (partial rotary, window 8)")

"""Mixtral: Mistral's attention (config.sliding_window on every layer when set), every MLP a routed
MoE (softmax over all experts, top-k, renormalised). The stock checkpoint names the block
`block_sparse_moe` and each expert's projections w1 (gate), w3 (up), w2 (down); transformers 5
renames and fuses them on load, qerl reads and writes the stock names. Experts in 4 bits, LoRA on
attention."""

from ..family import Experts, attention_only_moe

FAMILY = attention_only_moe("mixtral", ("mixtral",), "MixtralForCausalLM", "MixtralDecoderLayer",
                            Experts(gate="w1", up="w3", down="w2", count="num_local_experts",
                                    intermediate="intermediate_size"),
                            renames=((".mlp.", ".block_sparse_moe."),), windows_from="every_layer",
                            tested_against="HF generate on a tiny random MixtralForCausalLM (NVFP4 experts, window 8)")

"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention, every MLP a routed MoE (softmax, top-k,
renormalised when norm_topk_prob). Experts in 4 bits (layers/quant_experts.py); LoRA on attention only."""

from ..family import Experts, attention_only_moe


def _check(config):
    if list(getattr(config, "mlp_only_layers", []) or []) or getattr(config, "decoder_sparse_step", 1) != 1:
        return "dense MLP layers between the MoE layers (mlp_only_layers, decoder_sparse_step) are not run yet"
    return None


FAMILY = attention_only_moe("qwen3_moe", ("qwen3_moe",), "Qwen3MoeForCausalLM", "Qwen3MoeDecoderLayer", Experts(),
                            qk_norm="head", check=_check,
                            tested_against="HF generate on a tiny random Qwen3MoeForCausalLM (NVFP4 experts, eager "
                                           "experts loop)")

"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention, every MLP a routed MoE (softmax, top-k,
renormalised when norm_topk_prob). Experts in 4 bits (layers/quant_experts.py); LoRA on attention only."""

from ..family import LLAMA_PROJECTIONS, QKV, Experts, Family


def _check(config):
    if list(getattr(config, "mlp_only_layers", []) or []) or getattr(config, "decoder_sparse_step", 1) != 1:
        return "dense MLP layers between the MoE layers (mlp_only_layers, decoder_sparse_step) are not run yet"
    return None


FAMILY = Family("qwen3_moe", ("qwen3_moe",), "Qwen3MoeForCausalLM", "Qwen3MoeDecoderLayer",
                projections={k: v for k, v in LLAMA_PROJECTIONS.items() if k in ("q", "k", "v", "o")},
                gate_up=(), fused_groups=(QKV,), aliases={"gate": None, "up": None, "down": None},
                qk_norm="head", experts=Experts(), check=_check,
                tested_against="HF generate on a tiny random Qwen3MoeForCausalLM (NVFP4 experts, eager experts loop)")

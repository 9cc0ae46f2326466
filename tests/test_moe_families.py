"""Qwen3-MoE through the loader, the engine and export, on tiny random models.

Experts load 4-bit (QuantExperts) from the stock per-expert checkpoint layout, routers and norms stay,
LoRA is on attention (the default targets' gate/up/down name the experts' projections: dropped); the
engine's greedy tokens equal HF generate on the same modules and on the merged export (HF's eager
experts loop, which QuantExperts restates)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from qerl.checkpoint.export import export_merged
from qerl.layers import QLoRALinear
from qerl.layers.quant_experts import QuantExperts
from qerl.model import load_policy
from test_families import PROMPTS, engine_greedy, hf_greedy
from test_moe_experts import tiny_moe


@pytest.fixture(scope="module", params=["qwen3_moe"])
def loaded(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    ref = tiny_moe(family)
    ref.save_pretrained(root / "base")
    pol = load_policy(str(root / "base"), "nvfp4", lora_rank=4, dtype=torch.float32, progress=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return family, root, ref, pol


def test_experts_are_4bit_and_routers_untouched(loaded):
    _, _, ref, pol = loaded
    for i, layer in enumerate(pol.model.model.layers):
        assert isinstance(layer.mlp.experts, QuantExperts)
        assert torch.equal(layer.mlp.gate.weight, ref.model.layers[i].mlp.gate.weight)
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert isinstance(getattr(layer.self_attn, p), QLoRALinear)
    assert pol.target_modules == ("q", "k", "v", "o")


def test_engine_greedy_equals_hf_generate(loaded):
    family, root, _, pol = loaded
    got = engine_greedy(pol.model)
    assert got == [hf_greedy(pol.model, p) for p in PROMPTS]
    export_merged(pol, root / "merged", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32,
                                                  experts_implementation="eager").eval()
    assert got == [hf_greedy(merged, p) for p in PROMPTS]

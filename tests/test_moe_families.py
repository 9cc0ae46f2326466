"""Qwen3-MoE and Mixtral through the loader, the engine, export and one GRPO step, on tiny random models.

Experts load 4-bit (QuantExperts) from the stock per-expert checkpoint layout (Mixtral's
block_sparse_moe.experts.<e>.w1/w3/w2), routers and norms stay, LoRA is on attention (the default
targets' gate/up/down name the experts' projections: dropped); the engine's greedy tokens equal HF
generate on the same modules and on the merged export (HF's eager experts loop, which QuantExperts
restates), past Mixtral's sliding window (8); one GRPO step changes the adapter and PEFT loads it."""

import warnings

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from qerl.checkpoint import save_adapter
from qerl.checkpoint.export import export_merged
from qerl.layers import QLoRALinear
from qerl.layers.quant_experts import QuantExperts
from qerl.model import load_policy, quantized_layers
from test_families import PROMPTS, engine_greedy, hf_greedy
from test_moe_experts import tiny_moe

MOE = ["qwen3_moe", "mixtral"]


@pytest.fixture(scope="module", params=MOE)
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
    with safe_open(str(root / "merged" / "model.safetensors"), "pt") as f:  # the stock names
        keys = set(f.keys())
    stock = {"qwen3_moe": "model.layers.0.mlp.experts.3.up_proj.weight",
             "mixtral": "model.layers.0.block_sparse_moe.experts.3.w3.weight"}[family]
    assert stock in keys
    merged = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32,
                                                  experts_implementation="eager").eval()
    assert got == [hf_greedy(merged, p) for p in PROMPTS]


def sevens(completions, **_):
    return [sum(map(ord, c)) % 7 / 7 for c in completions]


@pytest.mark.parametrize("family", MOE)
def test_one_grpo_step_changes_the_adapter_and_peft_loads_it(family, tmp_path):
    from peft import PeftModel

    from qerl.rl import GRPOConfig, GRPOTrainer
    from qerl.tasks import get_task
    from tiny_models import tiny_tokenizer

    tiny_moe(family).save_pretrained(tmp_path / "base")
    tiny_tokenizer().save_pretrained(tmp_path / "base")
    pol = load_policy(str(tmp_path / "base"), "nvfp4", lora_rank=4, dtype=torch.float32, progress=False)
    cfg = GRPOConfig(max_steps=1, generation_batch_size=8, num_generations=4, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, max_completion_length=12, max_prompt_length=64,
                     learning_rate=1e-2, aqn=True, aqn_stages=1, output_dir=str(tmp_path / "run"), save_steps=1,
                     report_to="none", device="cpu", dynamic_sampling=False)
    tr = GRPOTrainer(cfg, policy=pol, task=get_task("arithmetic", size=16), reward_funcs=[sevens], progress=False)
    before = {n: p.detach().clone() for n, p in pol.model.named_parameters() if p.requires_grad}
    tr.train()
    after = {n: p.detach() for n, p in pol.model.named_parameters() if p.requires_grad}
    assert any(not torch.equal(before[n], after[n]) for n in before)

    ad = save_adapter(pol, tmp_path / "adapter")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stock = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
        pm = PeftModel.from_pretrained(stock, ad)
    bad = [str(w.message) for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message).lower()]
    assert not bad, bad
    for name, layer in quantized_layers(pol.model):
        theirs = pm.base_model.model.get_submodule(name)
        assert torch.equal(theirs.lora_A["default"].weight, layer.lora_A.weight), name
        assert torch.equal(theirs.lora_B["default"].weight, layer.lora_B.weight), name

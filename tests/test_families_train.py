"""The new families train: one GRPO step on the 4-bit policy changes the adapter, and the adapter it saves
loads in PEFT on the stock transformers model (PEFT's own module names: Phi-3's qkv_proj, gate_up_proj)."""

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from qerl.checkpoint import save_adapter
from qerl.model import load_policy, quantized_layers
from qerl.rl import GRPOConfig, GRPOTrainer
from qerl.tasks import get_task
from test_families import save_family
from tiny_models import tiny_tokenizer


def sevens(completions, **_):
    """A reward that differs between a random model's completions (so the step has advantages)."""
    return [sum(map(ord, c)) % 7 / 7 for c in completions]


@pytest.mark.parametrize("family", ["mistral", "phi3", "gemma3", "olmo2", "olmo3"])
def test_one_grpo_step_changes_the_adapter_and_peft_loads_it(family, tmp_path):
    save_family(tmp_path / "base", family)
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

    from peft import PeftModel

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

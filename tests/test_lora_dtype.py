"""lora_dtype: fp32 LoRA factors under bf16 compute (master weights, as PEFT keeps adapters)."""

import pytest
import torch
from tiny_models import config, tiny_tokenizer

from qerl.layers import QLoRALinear
from qerl.layers.fused_group import fused_groups
from qerl.model.random_init import random_policy
from qerl.rl import GRPOConfig, GRPOTrainer
from qerl.train.parts import set_lora_dtype
from qerl.tasks import get_task


def sevens(completions, **kw):
    return [float(c.count("7")) for c in completions]


def _trainer(out, device="cpu", **kw):
    """A tiny bf16 NVFP4 policy and a short run; kw overrides the config."""
    torch.manual_seed(0)
    pol = random_policy(config("qwen2"), "nvfp4", lora_rank=8, device=device, dtype=torch.bfloat16, std=0.05,
                        progress=False)
    pol.tokenizer = tiny_tokenizer()
    cfg = GRPOConfig(**{**dict(max_steps=2, generation_batch_size=16, num_generations=4, per_device_train_batch_size=8,
                               max_completion_length=8, max_prompt_length=64, learning_rate=1e-5, aqn=False,
                               output_dir=str(out), save_steps=100, report_to="none", device=device, dtype="bfloat16",
                               parity_check_steps=0), **kw})
    return GRPOTrainer(cfg, policy=pol, task=get_task("arithmetic", size=40), reward_funcs=[sevens], progress=False)


def _a(tr):
    return {n: p.detach().float().clone() for n, p in tr.model.named_parameters() if n.endswith("lora_A.weight")}


def test_fp32_factors_keep_small_adam_steps_that_bf16_rounds_away(tmp_path):
    moved = {}
    for dt in ("auto", "float32"):
        tr = _trainer(tmp_path / dt, lora_dtype=dt)
        layers = [m for m in tr.model.modules() if isinstance(m, QLoRALinear) and m.r]
        want = torch.bfloat16 if dt == "auto" else torch.float32
        assert all(m.lora_A.weight.dtype == m.lora_B.weight.dtype == want for m in layers)
        assert all(m.dtype == torch.bfloat16 for m in layers)  # the compute stays bf16
        groups = [g for _, g in fused_groups(tr.model)]
        assert groups and all(g.shares_storage() and g.A_cat.dtype == want for g in groups)
        assert set(tr.params) >= {m.lora_A.weight for m in layers}  # the optimizer steps the converted factors
        before = _a(tr)
        tr.train()
        after = _a(tr)
        # Adam's first steps move every element by about lr = 1e-5; A's elements are ~1e-1, whose bf16 spacing is
        # ~5e-4: in bf16 they stay put, in fp32 they move
        moved[dt] = sum(int((after[n] != before[n]).sum()) for n in before) / sum(v.numel() for v in before.values())
    assert moved["float32"] > 0.9 and moved["auto"] < 0.05, moved


def test_set_lora_dtype_refuses_mixed_dtypes_on_cuda():
    pol = random_policy(config("qwen2"), "nvfp4", lora_rank=4, device="cpu", dtype=torch.bfloat16, std=0.05,
                        progress=False)
    with pytest.raises(ValueError, match="lora_dtype float32 differs from the compute dtype bfloat16"):
        set_lora_dtype(pol.model, torch.float32, torch.device("cuda"))


def test_lora_dtype_is_checked():
    with pytest.raises(ValueError, match="lora_dtype"):
        GRPOConfig(lora_dtype="fp32")

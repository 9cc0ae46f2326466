"""LoRA on MoE experts (target 'experts'): per-expert factors A [E, r, K], B [E, N, r] applied on each
expert's own tokens; saved in PEFT's target_parameters layout and checked against PEFT's ParamWrapper on
the stock transformers model (Qwen3-MoE [E, N, K] experts, gpt-oss's transposed [E, K, N] ones)."""

import warnings

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from qerl.checkpoint import load_adapter, save_adapter
from qerl.checkpoint.export import export_merged
from qerl.layers import adapters_disabled
from qerl.layers.quant_experts import QuantExperts
from qerl.model import load_policy
from qerl.rollout import Engine, SamplingParams
from test_families import PROMPTS, hf_greedy
from test_gpt_oss import hf_dequantized, write_stock_mxfp4
from test_moe_experts import tiny_moe

TARGETS = ["q", "k", "v", "o", "experts"]
IDS = torch.tensor([[5, 9, 30, 31, 32, 70, 100, 3, 4, 8, 12, 140, 7, 7, 2]])


def _live(pol, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _stock_base(family, root):
    """The stock transformers model on the very weights the policy holds (attention bf16, experts as
    qerl dequantizes them), and the policy with a live adapter on attention and experts."""
    if family == "gpt_oss":
        write_stock_mxfp4(root / "base")
        ref = hf_dequantized(root / "base")  # transformers' own dequantization of the MXFP4 bytes
    else:
        tiny_moe(family).to(torch.bfloat16).save_pretrained(root / "base")  # qerl's "bf16" holds it exactly
        ref = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32,
                                                   experts_implementation="eager").eval()
    pol = load_policy(str(root / "base"), "bf16", lora_rank=4, target_modules=TARGETS, dtype=torch.float32,
                      progress=False)
    if family != "gpt_oss":
        with torch.no_grad():
            for i, layer in enumerate(pol.model.model.layers):
                q, hf = layer.mlp.experts, ref.model.layers[i].mlp.experts
                for proj in ("gate_up_proj", "down_proj"):
                    getattr(hf, proj).copy_(torch.stack([q.weight(proj, e, torch.float32)
                                                         for e in range(q.num_experts)]))
    _live(pol)
    return ref, pol


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_expert_lora_equals_peft_on_the_stock_model(family, tmp_path):
    ref, pol = _stock_base(family, tmp_path)
    q = pol.model.model.layers[0].mlp.experts
    assert isinstance(q, QuantExperts) and q.r == 4 and q.lora_A["gate_up_proj"].shape[:2] == (q.num_experts, 4)
    assert q.lora_A["gate_up_proj"].requires_grad and q.lora_B["down_proj"].requires_grad
    assert pol.target_modules == ("q", "k", "v", "o", "experts")
    with torch.no_grad():
        base = ref(IDS).logits
        with adapters_disabled(pol.model):  # the base policy: attention's and the experts' LoRA off
            assert torch.allclose(pol.model(IDS).logits, base, atol=1e-5)
        got = pol.model(IDS).logits
    ad = save_adapter(pol, tmp_path / "adapter")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(ref, ad).eval()
    bad = [str(w.message) for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message).lower()]
    assert not bad, bad
    with torch.no_grad():
        want = pm(IDS).logits
    assert not torch.allclose(want, base, atol=1e-3)  # the adapter moves the logits, experts included
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()

    fresh = load_policy(str(tmp_path / "base"), "bf16", lora_rank=4, target_modules=TARGETS, dtype=torch.float32,
                        progress=False)
    load_adapter(fresh, ad)
    for n, p in pol.model.named_parameters():
        if "experts.lora_" in n:
            assert torch.equal(fresh.model.get_parameter(n), p), n


def test_expert_lora_alone_moves_the_logits_as_peft_does(tmp_path):
    """Attention's LoRA zeroed: what is left is the experts' adapter, PEFT's ParamWrapper against qerl's
    shrink/expand on each expert's tokens."""
    ref, pol = _stock_base("qwen3_moe", tmp_path)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n and "experts" not in n:
                p.zero_()
        got = pol.model(IDS).logits
    pm = PeftModel.from_pretrained(ref, save_adapter(pol, tmp_path / "adapter")).eval()
    with torch.no_grad():
        want, base = pm(IDS).logits, pm.get_base_model()(IDS).logits
    assert torch.allclose(got, want, atol=1e-4)
    with pm.disable_adapter(), torch.no_grad():
        base = pm(IDS).logits
    assert not torch.allclose(got, base, atol=1e-3)


def test_engine_greedy_with_expert_lora_equals_hf_generate_and_the_merged_export(tmp_path):
    tiny_moe("qwen3_moe").save_pretrained(tmp_path / "base")
    pol = load_policy(str(tmp_path / "base"), "nvfp4", lora_rank=4, target_modules=TARGETS, dtype=torch.float32,
                      progress=False)
    _live(pol)
    eng = Engine(pol.model, max_len=64, max_slots=2, sync_every=4)
    prompts = PROMPTS[1:3]  # 12 and 25 tokens: enough to cross many routing choices, quick
    got = [c.token_ids for c in eng.generate(prompts, params=SamplingParams(max_new_tokens=12, greedy=True,
                                                                              ignore_eos=True))]
    assert got == [hf_greedy(pol.model, p, 12) for p in prompts]
    export_merged(pol, tmp_path / "merged", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32,
                                                  experts_implementation="eager").eval()
    assert got == [hf_greedy(merged, p, 12) for p in prompts]


def test_dropout_with_expert_lora_is_refused(tmp_path):
    tiny_moe("qwen3_moe").save_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match="lora_dropout .* experts"):
        load_policy(str(tmp_path / "base"), "nvfp4", lora_rank=4, lora_dropout=0.1, target_modules=TARGETS,
                    progress=False)


def sevens(completions, **_):
    return [sum(map(ord, c)) % 7 / 7 for c in completions]


def test_one_grpo_step_trains_the_experts_lora(tmp_path):
    from qerl.rl import GRPOConfig, GRPOTrainer
    from qerl.tasks import get_task
    from tiny_models import tiny_tokenizer

    tiny_moe("qwen3_moe").save_pretrained(tmp_path / "base")
    tiny_tokenizer().save_pretrained(tmp_path / "base")
    pol = load_policy(str(tmp_path / "base"), "nvfp4", lora_rank=4, target_modules=TARGETS, dtype=torch.float32,
                      progress=False)
    cfg = GRPOConfig(max_steps=1, generation_batch_size=8, num_generations=4, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, max_completion_length=12, max_prompt_length=64,
                     learning_rate=1e-2, aqn=False, output_dir=str(tmp_path / "run"), save_steps=1,
                     report_to="none", device="cpu", dynamic_sampling=False)
    tr = GRPOTrainer(cfg, policy=pol, task=get_task("arithmetic", size=16), reward_funcs=[sevens], progress=False)
    before = {n: p.detach().clone() for n, p in pol.model.named_parameters() if "experts.lora_B" in n}
    assert len(before) == 4 and all(p.requires_grad for n, p in pol.model.named_parameters() if n in before)
    tr.train()
    assert all(not torch.equal(before[n], pol.model.get_parameter(n)) for n in before)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    pm = PeftModel.from_pretrained(stock, save_adapter(pol, tmp_path / "adapter"))
    wrapped = pm.base_model.model.model.layers[0].mlp.experts
    assert torch.equal(wrapped.lora_B["default"].weight.reshape(64, 4, 8).permute(2, 0, 1),
                       pol.model.model.layers[0].mlp.experts.lora_B["down_proj"])


def test_lora_dtype_converts_the_experts_factors_too(tmp_path):
    """lora_dtype float32 under a bf16 model (the default run's CPU setting): expert factors in fp32, the
    forward still in bf16, their gradients in fp32 and nonzero."""
    from qerl.train.parts import set_lora_dtype

    tiny_moe("qwen3_moe").save_pretrained(tmp_path)
    pol = load_policy(str(tmp_path), "nvfp4", lora_rank=4, target_modules=["q", "k", "v", "o", "experts"],
                      dtype=torch.bfloat16, progress=False)
    ex = [m for m in pol.model.modules() if isinstance(m, QuantExperts)]
    assert ex and all(p.dtype == torch.bfloat16 for m in ex for p in m.lora_A.values())
    set_lora_dtype(pol.model, torch.float32, torch.device("cpu"))
    assert all(p.dtype == torch.float32 for m in ex for d in (m.lora_A, m.lora_B) for p in d.values())
    with torch.no_grad():
        for m in ex:
            for p in m.lora_B.values():
                p.normal_(0, 0.3)
    ids = torch.tensor([[5, 9, 30, 31, 32, 70]])
    out = pol.model(ids).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    out.float().sum().backward()
    grads = [p.grad for m in ex for p in m.lora_B.values()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads) and any(g.abs().sum() > 0 for g in grads)

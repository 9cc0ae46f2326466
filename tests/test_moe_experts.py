"""QuantExperts against transformers' own MoE modules (Qwen3-MoE, Mixtral) on tiny random models."""

import copy

import pytest
import torch
import transformers as tf
from transformers import AutoModelForCausalLM

from qerl.formats import get_format
from qerl.layers.quant_experts import QuantExperts, quantize_experts

SIZES = dict(vocab_size=160, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=1)


def moe_config(family):
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                 norm_topk_prob=True, head_dim=16, **SIZES)
    if family == "mixtral":
        return tf.MixtralConfig(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                                **SIZES)
    if family == "gpt_oss":  # transposed experts [E, K, N] with biases, interleaved clamped gating
        from test_gpt_oss import gpt_oss_config

        return gpt_oss_config()
    raise ValueError(family)


def tiny_moe(family):
    torch.manual_seed(0)
    # transformers' eager experts loop: the one QuantExperts restates (the grouped kernels round differently)
    m = AutoModelForCausalLM.from_config(moe_config(family), experts_implementation="eager").float().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.08)
    return m


def add_random_expert_lora(model, seed: int = 2) -> None:
    """Rank-4 LoRA on every QuantExperts with random B (PEFT's zero B would make the LoRA path a no-op)."""
    from qerl.layers.quant_experts import QuantExperts

    g = torch.Generator().manual_seed(seed)
    for q in (x for x in model.modules() if isinstance(x, QuantExperts)):
        q.add_lora(4, 8.0, torch.float32)
        with torch.no_grad():
            for p in q.lora_B.values():
                p.copy_(torch.randn(p.shape, generator=g).to(p.device) * 0.3)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_quantized_experts_equal_hf_on_the_dequantized_experts(family):
    """Same routing, same per-expert arithmetic: the whole model's logits are bit-identical to HF's with
    each expert's weights replaced by their NVFP4 dequantization; and the experts are really 4-bit."""
    m = tiny_moe(family)
    ref = copy.deepcopy(m)
    routers = {n: p.clone() for n, p in m.named_parameters() if ".gate." in n or ".router." in n}
    names = quantize_experts(m, "nvfp4")
    assert names == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    fmt = get_format("nvfp4")
    for name in names:
        q = m.get_submodule(name)
        hf = ref.get_submodule(name)
        assert isinstance(q, QuantExperts)
        assert not any(p.dtype.is_floating_point and p.element_size() > 1 for k, p in q.named_buffers()
                       if not k.endswith(("global_scale", "_bias")))  # codes uint8, block scales FP8
        with torch.no_grad():
            for proj in ("gate_up_proj", "down_proj"):
                w = getattr(hf, proj)
                for e in range(w.shape[0]):  # one global scale per expert, gate|up as one projection
                    we = w[e].t() if q.transposed else w[e]  # quantized along the inputs
                    t = fmt.quantize(we, fmt.global_scale([we]))
                    assert all(torch.equal(t[k].view(torch.uint8), q.tensors(proj, e)[k].view(torch.uint8)) for k in t)
                    w[e] = q.weight(proj, e, torch.float32).t() if q.transposed else q.weight(proj, e, torch.float32)
    assert q.transposed == (family == "gpt_oss") and q.has_bias == (family == "gpt_oss")
    assert routers
    for n, p in routers.items():  # routers untouched
        assert torch.equal(m.get_parameter(n), p), n
    ids = torch.tensor([[5, 9, 30, 31, 32, 70, 100, 3, 4, 8, 12, 140]])
    with torch.no_grad():
        got, want = m(ids).logits, ref(ids).logits
    assert torch.equal(got, want)
    dense = tiny_moe(family)
    with torch.no_grad():
        assert not torch.equal(dense(ids).logits, got)  # the 4-bit experts are not the dense ones


def test_experts_without_the_fused_layout_are_named():
    class Old(torch.nn.Module):
        gate_up_proj = None

    with pytest.raises(ValueError, match="layers.0.mlp.experts .*gate_up_proj"):
        QuantExperts.from_hf(Old(), "nvfp4", "layers.0.mlp.experts")

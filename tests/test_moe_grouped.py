"""QuantExperts' grouped path (tokens sorted by expert, the hit experts dequantized a chunk at a time,
one torch._grouped_mm per projection, LoRA's shrink and expand grouped too) against its loop over the
hit experts, which restates transformers' eager experts: logits, expert-LoRA gradients and greedy tokens."""

import pytest
import torch

from qerl.layers.grouped_mm import grouped_mm
from qerl.layers.quant_experts import QuantExperts, quantize_experts
from qerl.rollout import Engine, SamplingParams
from test_families import PROMPTS
from test_moe_experts import add_random_expert_lora, tiny_moe

IDS = torch.tensor([[5, 9, 30, 31, 32, 70, 100, 3, 4, 8, 12, 140, 7, 7, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]])


def _set(model, grouped):
    for m in model.modules():
        if isinstance(m, QuantExperts):
            m.grouped, m.expert_chunk = grouped, 3  # chunks of 3 hit experts: several per layer


def test_grouped_mm_equals_per_group_matmuls_with_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 16, generator=g, requires_grad=True)
    w = torch.randn(3, 16, 8, generator=g, requires_grad=True)
    ends = torch.tensor([3, 3, 10], dtype=torch.int32)  # an empty group too
    y = grouped_mm(x, w, ends)
    ref = torch.cat([x[:3] @ w[0], x[3:10] @ w[2]])
    assert torch.allclose(y, ref, atol=1e-6)
    y.sum().backward()  # an expanded gradient: torch's own backward fails on it on the CPU
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    ref.sum().backward()
    assert torch.allclose(gx, x.grad, atol=1e-5) and torch.allclose(gw, w.grad, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_grouped_path_equals_the_loop(family):
    m = tiny_moe(family)
    quantize_experts(m, "nvfp4")
    add_random_expert_lora(m)
    out = {}
    for grouped in (False, True):
        _set(m, grouped)
        m.zero_grad()
        logits = m(IDS).logits
        logits.float().logsumexp(-1).sum().backward()
        out[grouped] = (logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if "experts.lora" in n})
    assert torch.allclose(out[True][0], out[False][0], atol=1e-5)
    assert out[False][1] and all(torch.allclose(out[True][1][n], gr, atol=1e-5) for n, gr in out[False][1].items())


def _greedy(m):
    eng = Engine(m, max_len=64, max_slots=2, sync_every=4)
    outs = eng.generate(PROMPTS[1:3], params=SamplingParams(max_new_tokens=12, greedy=True, ignore_eos=True))
    return [c.token_ids for c in outs]


def test_engine_greedy_on_the_grouped_path_equals_the_loop():
    m = tiny_moe("qwen3_moe")
    quantize_experts(m, "nvfp4")
    want = _greedy(m)
    _set(m, True)
    assert _greedy(m) == want

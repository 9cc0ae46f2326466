"""The rollout and the update route each token to the same experts: the engine's prefill and decode
choices, concatenated, against the trainer path's forward over the whole sequence (HF's own), on a tiny
Qwen3-MoE; and the check sees a router that differs between the two."""

import torch

from qerl.layers.quant_experts import quantize_experts
from qerl.layers.routing import record_routing, routing_mismatch
from qerl.rollout import Engine, SamplingParams
from test_moe_experts import tiny_moe

PROMPT = list(range(20, 37))
NEW = 12


def _engine_and_trainer(model):
    eng = Engine(model, max_len=64, max_slots=1, sync_every=4)
    with record_routing(model) as rollout:
        out = eng.generate([PROMPT], n=1, params=SamplingParams(max_new_tokens=NEW, greedy=True, ignore_eos=True))
    seq = PROMPT + out[0].token_ids
    with record_routing(model) as update, torch.no_grad():
        model(torch.tensor([seq]))
    return rollout, update, seq


def test_rollout_and_update_route_alike():
    m = tiny_moe("qwen3_moe")
    quantize_experts(m, "nvfp4")
    rollout, update, seq = _engine_and_trainer(m)
    n = len(seq)
    assert len(rollout.calls) == 2
    for name in rollout.calls:
        a, b = rollout.tokens(name), update.tokens(name)
        # the last sampled token is fed back only by steps past the end (decode runs sync_every steps at a time)
        assert a.shape[0] >= n - 1 and b.shape == (n, 2)
        assert routing_mismatch(a[: n - 1], b[: n - 1]) == 0.0


def test_a_router_that_differs_is_seen():
    m = tiny_moe("qwen3_moe")
    quantize_experts(m, "nvfp4")
    rollout, _, seq = _engine_and_trainer(m)
    with torch.no_grad():
        m.model.layers[1].mlp.gate.weight.mul_(-1)  # another router on the update's side, same tokens
        with record_routing(m) as update:
            m(torch.tensor([seq]))
    name, n = "model.layers.1.mlp.experts", len(seq)
    assert routing_mismatch(rollout.tokens(name)[: n - 1], update.tokens(name)[: n - 1]) > 0.5
    name = "model.layers.0.mlp.experts"  # layer 0 is upstream of the change
    assert routing_mismatch(rollout.tokens(name)[: n - 1], update.tokens(name)[: n - 1]) == 0.0

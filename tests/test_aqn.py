"""AQN: the schedule equals the paper's formula; noise reaches the projections' inputs by the
expected relative amount; restore is exact; noise is off where configured."""

import math

import pytest
import torch

from qerl.model import random_policy
from qerl.rl.aqn import AQN, noised_norms, sigma_at
from tiny_models import config


def test_exponential_schedule_is_the_paper_formula():
    K, T, s0, s1 = 10, 100, 1e-2, 5e-4
    for step in range(T):
        k = step * K // T
        want = 0.0 if k == 0 else s0 * (s1 / s0) ** ((k - 1) / (K - 2))
        got, stage = sigma_at(step, T, K, s0, s1, "exponential")
        assert stage == k and got == pytest.approx(want, rel=1e-12)
    assert sigma_at(10, T, K, s0, s1)[0] == pytest.approx(s0)
    assert sigma_at(T - 1, T, K, s0, s1)[0] == pytest.approx(s1)


@pytest.mark.parametrize("kind", ["linear", "cosine", "logarithmic"])
def test_other_schedules_run_from_start_to_end_monotonically(kind):
    vals = [sigma_at(s, 50, 5, 1e-2, 1e-4, kind)[0] for s in range(50)]
    assert vals[:10] == [0.0] * 10
    assert vals[10] == pytest.approx(1e-2) and vals[-1] == pytest.approx(1e-4)
    nz = vals[10:]
    assert all(a >= b for a, b in zip(nz, nz[1:]))
    mid = sigma_at(25, 50, 5, 1e-2, 1e-4, kind)[0]  # stage 2 of 4: t = 1/3
    t = 1 / 3
    want = {"linear": 1e-2 + (1e-4 - 1e-2) * t, "cosine": 1e-4 + (1e-2 - 1e-4) * (1 + math.cos(math.pi * t)) / 2,
            "logarithmic": 1e-2 - (1e-2 - 1e-4) * math.log(1 + 9 * t) / math.log(10)}[kind]
    assert mid == pytest.approx(want)


def _policy(quant="nvfp4"):
    torch.manual_seed(0)
    return random_policy(config("qwen2", num_hidden_layers=3), quant, lora_rank=4, device="cpu",
                         dtype=torch.float32, std=0.05, progress=False)


def _inputs(model, ids):
    seen = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: seen.__setitem__(n, a[0].detach().clone()))
             for n, m in model.named_modules() if n.endswith(("q_proj", "gate_proj", "o_proj"))]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("quant", ["nvfp4", "bf16"])
def test_noise_reaches_the_projection_inputs_and_restores_exactly(quant):
    pol = _policy(quant)
    m = pol.model
    names = noised_norms(m)
    assert len(names) == 2 * 3 and all(n.endswith(("input_layernorm", "post_attention_layernorm")) for n in names)
    before = {n: w.detach().clone() for n, w in names.items()}
    ids = torch.randint(0, 160, (2, 24))
    clean = _inputs(m, ids)
    aqn, sigma = AQN(m), 0.02
    with aqn.applied(sigma, seed=3):
        noisy = _inputs(m, ids)
        assert aqn.last_effective_sigma == pytest.approx(sigma, rel=0.15)
    # layer 0's q_proj input is RMSNorm(x) * (w + Z) with w = 1: relative change = sigma
    for n in ("model.layers.0.self_attn.q_proj",):
        rel = ((noisy[n] - clean[n]).norm() / clean[n].norm()).item()
        assert rel == pytest.approx(sigma, rel=0.2)
    rel_gate = ((noisy["model.layers.0.mlp.gate_proj"] - clean["model.layers.0.mlp.gate_proj"]).norm()
                / clean["model.layers.0.mlp.gate_proj"].norm()).item()
    assert sigma * 0.5 < rel_gate < sigma * 3
    assert all(torch.equal(w, before[n]) for n, w in names.items())  # exact restore
    assert all(torch.equal(v, clean[k]) for k, v in _inputs(m, ids).items())


def test_restore_is_exact_after_an_exception_and_sigma_zero_is_a_no_op():
    pol = _policy()
    aqn = AQN(pol.model)
    before = {n: w.detach().clone() for n, w in aqn.weights.items()}
    with pytest.raises(RuntimeError):
        with aqn.applied(0.05, seed=1):
            raise RuntimeError("boom")
    assert all(torch.equal(w, before[n]) for n, w in aqn.weights.items())
    with aqn.applied(0.0, seed=1):
        assert all(torch.equal(w, before[n]) for n, w in aqn.weights.items())


def test_fresh_noise_each_seed_and_the_same_noise_for_the_same_seed():
    aqn = AQN(_policy().model)
    w = next(iter(aqn.noise.values()))  # the fp32 noise the norm adds (the weight itself never changes)
    draws = []
    for seed in (1, 2, 1):
        with aqn.applied(0.01, seed):
            draws.append(w.detach().clone())
    assert torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[1])


def test_noise_is_off_where_configured(tmp_path):
    """aqn=False: the trainer builds no AQN, sigma is 0 every step and rollouts see the clean weights."""
    from test_trainer import _trainer

    tr = _trainer(tmp_path, aqn=False, max_steps=2)
    assert tr.aqn is None
    assert [r["sigma"] for r in tr.train()] == [0.0, 0.0]
    tr2 = _trainer(tmp_path / "b", aqn=True, aqn_stages=2, max_steps=2)
    rows = tr2.train()
    assert rows[0]["sigma"] == 0.0 and rows[1]["sigma"] == pytest.approx(1e-2)
    assert rows[0]["aqn_sigma_effective"] == 0.0 and rows[1]["aqn_sigma_effective"] > 0.005

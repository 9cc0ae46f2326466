"""The 4-bit lm_head option (layers/quant_head.py, TrainConfig.lm_head_4bit): rollouts and the training
logprobs use one frozen 4-bit head, it is NVFP4 (16-input groups on the E2M1 grid), and a run trains with it
with the parity gate on."""

import torch

from cli_runs import train_args
from qerl.formats.e2m1 import E2M1_VALUES
from qerl.layers.quant_head import QuantHead, quantize_lm_head


def _head(v=96, d=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(d, v, bias=False, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(v, d, generator=g) * torch.rand(v, 1, generator=g) * 0.1)
    return lin


def test_the_module_and_its_weight_give_the_same_logits_and_the_head_is_nvfp4():
    lin = _head()
    q = QuantHead.from_linear(lin)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    w = q.weight
    assert w.shape == lin.weight.shape and w.dtype == lin.weight.dtype
    # the training side (x @ weight.T) and the rollout side (the module) score alike
    assert torch.allclose(q(x), x @ w.T, rtol=1e-6, atol=1e-6)
    # NVFP4: in each 16-input group every weight is an E2M1 value times the group's one scale
    grid = E2M1_VALUES.abs().unique().double()
    t = q.layer.quant_tensors()  # the stored group scales (FP8) over the tensor's global scale
    scale = (t["weight_scale"].double() / t["weight_global_scale"].double()).unsqueeze(-1)
    ratios = (w.double().reshape(96, 4, 16).abs() / scale).unsqueeze(-1)
    assert ((ratios - grid).abs().amin(-1) < 1e-5).all()
    # and it is the 4-bit rounding of the head, not the head itself: close, not equal
    rel = float((w - lin.weight).detach().norm() / lin.weight.detach().norm())
    assert 0 < rel < 0.15


def test_bias_is_refused_and_quantize_is_idempotent():
    lin = torch.nn.Linear(64, 32, bias=True)
    try:
        QuantHead.from_linear(lin)
    except ValueError as e:
        assert "bias" in str(e)
    else:
        raise AssertionError("a biased head was accepted")
    m = torch.nn.Module()
    m.lm_head = _head()
    q = quantize_lm_head(m)
    assert m.lm_head is q and quantize_lm_head(m) is q


def test_a_run_trains_with_the_4bit_head_and_the_parity_gate_on(cli, model, tmp_path, monkeypatch):
    import qerl.layers.quant_head as qh

    made = []
    monkeypatch.setattr(qh, "quantize_lm_head", lambda m, *a: made.append(quantize_lm_head(m, *a)) or made[-1])
    rc, out, err = cli(*train_args(model, tmp_path / "run", "--lm_head_4bit", "true", "--parity_check_steps", "1",
                                   "--max_steps", "1"))
    assert rc == 0, err
    assert (tmp_path / "run" / "checkpoint-1").is_dir()
    assert len(made) == 1 and isinstance(made[0], QuantHead)

"""The parity gate (issue 21 §5): the rollout engine must run the policy the trainer trains."""

import copy

import pytest
import torch

from qerl.layers import QLoRALinear
from qerl.rl.parity import ParityError
from qerl.rollout import Engine
from test_trainer import _trainable, _trainer


def _lora_layers(model):
    return [m for m in model.modules() if isinstance(m, QLoRALinear)]


def _engine_on_a_copy(tr, share_adapter: bool, perturb: float = 1.0):
    """An engine with its own copy of the weights, as a framework that syncs weights into a
    separate engine has: the adapter reaches it only if shared; `perturb` scales its base weights."""
    cp = copy.deepcopy(tr.model)
    for a, b in zip(_lora_layers(cp), _lora_layers(tr.model)):
        if share_adapter:
            a.lora_A, a.lora_B = b.lora_A, b.lora_B
        with torch.no_grad():
            a.weight_global_scale.mul_(perturb)
    return Engine(cp, tr.tok, max_len=tr.engine.max_len, max_slots=tr.engine.n_slots, kv_cache_gb=0.1)


def test_a_normal_run_passes_logs_the_gate_and_is_unchanged_by_it(tmp_path):
    tr = _trainer(tmp_path / "on", max_steps=2, parity_check_steps=1)
    rows = tr.train()
    for m in rows:
        # fp32 on the CPU: both paths agree to rounding, and the probe adapter really moves them
        assert m["parity_logprob_diff_mean"] < 1e-5 and m["parity_logprob_diff_max"] < 1e-4
        assert m["parity_adapter_diff_mean"] < 1e-5 and m["parity_base_diff_mean"] < 1e-5
        assert m["parity_adapter_effect_trainer"] > 2 * tr.cfg.parity_max_logprob_diff
        assert m["parity_adapter_effect_engine"] == pytest.approx(m["parity_adapter_effect_trainer"], rel=1e-4)
        # every phase timed into the row; rewards are part of the rollout, all within the step
        phases = [m[f"time_{p}"] for p in ("parity", "rollout", "advantages", "metrics", "logprob", "update")]
        assert all(t > 0 for t in phases) and sum(phases) <= m["time_step"]  # each phase's timer ran
        assert 0 < m["time_rewards"] <= m["time_rollout"]
    off = _trainer(tmp_path / "off", max_steps=2, parity_check_steps=0)
    rows_off = off.train()
    assert "parity_logprob_diff_mean" not in rows_off[0]
    a, b = _trainable(tr), _trainable(off)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the probe adapter was restored bit for bit


def test_a_detached_adapter_is_caught(tmp_path):
    tr = _trainer(tmp_path, max_steps=2)
    tr.engine = _engine_on_a_copy(tr, share_adapter=False)  # the engine keeps the adapter of step 0
    with pytest.raises(ParityError, match="the adapter does not reach the engine"):
        tr.train_step()
    assert tr.step == 0  # stopped before the rollout


def test_a_perturbed_engine_weight_is_caught(tmp_path):
    tr = _trainer(tmp_path, max_steps=2)
    tr.engine = _engine_on_a_copy(tr, share_adapter=True, perturb=1.3)
    with pytest.raises(ParityError, match="the base weights: with adapters off the engine path"):
        tr.train_step()
    # with no limit the gate only logs: the divergence is in the metrics
    tr.cfg.parity_max_logprob_diff = None
    m = tr.train_step()
    assert m["parity_base_diff_mean"] > 0.1 and m["parity_logprob_diff_mean"] > 0.1

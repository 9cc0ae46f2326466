"""The default run checkpoints along the way (it used save_steps 1000 with 36-60 steps: an interrupt near the
end lost the whole run, and `--resume` then found nothing)."""

import pytest

from qerl.rl import default_run


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_default_run_saves_often_enough_to_resume(device, monkeypatch):
    monkeypatch.setattr(default_run, "cpu_has_fast_bf16", lambda: False)
    cfg = default_run.default_run_config(device)
    assert cfg.save_steps <= 6 < cfg.max_steps  # an interrupt loses at most 5 steps
    assert cfg.save_total_limit >= 1

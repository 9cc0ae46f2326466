"""The tool recipe's --smoke mode (issue 49): every phase on SMOKE's small budget, its own output folder, never
recorded as a measurement. The full pipeline on a tiny model is tests/test_tool_recipe.py's; here the wiring."""

import pytest

from qerl.recipes import tools


def test_smoke_runs_every_phase_on_the_small_budget(monkeypatch, capsys):
    seen = {}

    def fake_run(seed, output_dir, **kw):
        seen.update(kw, output_dir=output_dir)
        raise ValueError("stop here")  # the recipe itself is tested elsewhere

    monkeypatch.setattr(tools, "run", fake_run)
    assert tools.main(["--smoke", "--no_progress"]) == 2
    assert seen["output_dir"] == "runs/tool_recipe_smoke"
    assert seen["sft"]["max_steps"] == 2 and seen["rl"]["max_steps"] == 1 and seen["eval_limit"] == 4
    assert seen["evaluation"] == {"max_new_tokens": 64} and seen["task"]["size"] == 40
    # a whole GRPO step: 2 prompts x num_generations fill one generation
    rl = seen["rl"]
    assert rl["per_device_train_batch_size"] % rl["num_generations"] == 0


def test_smoke_figures_are_not_recorded(capsys):
    with pytest.raises(SystemExit):
        tools.main(["--smoke", "--record"])
    assert "not a measurement" in capsys.readouterr().err

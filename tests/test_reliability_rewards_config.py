"""Issue 22: nothing hangs (every hostile reward input returns within 2 s) and config values are typed."""

import time

import pytest

from qerl.rl import GRPOConfig
from qerl.rl.rewards import score
from qerl.tasks.answers import parse_number
from qerl.tasks.arithmetic import accuracy as arithmetic_accuracy
from qerl.tasks.arithmetic import final_number
from qerl.tasks.deadline import DeadlinePool
from qerl.tasks.rewards import numeric_accuracy


def _within(seconds, f, *a):
    t = time.perf_counter()
    out = f(*a)
    assert time.perf_counter() - t < seconds, f"took {time.perf_counter() - t:.1f} s"
    return out


# ---- nothing may hang ----------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["The answer is 1e99999999", "1e-99999999", "3/4e99999999", "\\frac{1e99999999}{3}",
                                  "<answer>9e999999</answer>", "1" * 61 + "e3", "2e301"])
def test_huge_exponents_are_not_expanded(text):
    assert _within(2, numeric_accuracy, [text], ["1"]) == [0.0]
    assert _within(2, parse_number, text) is None


def test_exponents_within_limits_still_grade():
    assert parse_number("1.5e3") == 1500 and parse_number("2E-2") == parse_number("0.02")
    assert numeric_accuracy(["so it is 1e5"], ["100000"]) == [1.0]


@pytest.mark.parametrize("text,want", [("<answer>" * 20000, None), ("<answer>" * 20000 + "7</answer>", 7),
                                       ("</answer>" * 20000 + "<answer>" * 20000, None),
                                       ("<answer>1</answer> <answer>2</answer>", 2),
                                       ("<answer>5</answer> then 9", 5), ("no tags, 12", 12)])
def test_arithmetic_answer_tags_are_scanned_in_linear_time(text, want):
    assert _within(2, final_number, text) == want
    assert _within(2, arithmetic_accuracy, [text], ["7"]) == [1.0 if want == 7 else 0.0]


def test_the_deadline_pool_kills_a_job_past_its_limit_and_keeps_the_others():
    pool = DeadlinePool(workers=2)
    try:
        pool.map("time:sleep", [(0,)], 5)  # start the workers outside the timed part
        t = time.perf_counter()
        out = pool.map("time:sleep", [(30,), (0,), (0.1,)], 1.0)
        assert time.perf_counter() - t < 2.0
        assert out[0][0] is False and "TimeoutError" in out[0][1] and out[1] == (True, None) == out[2]
        assert pool.map("math:sqrt", [(16,), (-1,)], 5) == [(True, 4.0), (False, "ValueError: math domain error")]
    finally:
        pool.close()


def test_math_verify_gets_a_hard_limit_counted_as_a_reward_error():
    pytest.importorskip("math_verify")
    from qerl.tasks.rewards import MathVerifyAccuracy

    # math-verify's own limit (5 s) is longer than the hard one: only the kill can stop the tower
    mv = MathVerifyAccuracy(timeout_s=5, deadline_s=0.5)
    assert mv(["<answer>2</answer>"], ["2"]) == [1.0]  # warm the workers
    tower = "<answer>" + "2^{" * 40 + "2" + "}" * 40 + "</answer>"
    t = time.perf_counter()
    sc = score([mv], None, [tower, "<answer>2</answer>", "<answer>3</answer>"], {"answer": ["2", "2", "2"]})
    assert time.perf_counter() - t < 2.0
    assert sc.total == [0.0, 1.0, 0.0] and sc.errors == 1 and "TimeoutError" in sc.first_error


# ---- config values are typed ---------------------------------------------------------------------
def _yaml(tmp_path, text):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("text,field,want", [
    ("learning_rate: 2e-5", "learning_rate", 2e-5), ("max_steps: '6'", "max_steps", 6),
    ("max_steps: 6.0", "max_steps", 6), ("aqn: 'false'", "aqn", False), ("aqn: 'no'", "aqn", False),
    ("aqn: 'Yes'", "aqn", True), ("aqn: 'true'", "aqn", True), ("lora_alpha: 16", "lora_alpha", 16.0),
    ("epsilon_high: null", "epsilon_high", None), ("reward_weights: ['1', 0.5]", "reward_weights", [1.0, 0.5]),
])
def test_yaml_values_are_coerced_by_the_field_type(tmp_path, text, field, want):
    got = getattr(GRPOConfig.from_yaml(_yaml(tmp_path, text)), field)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("text,field", [
    ("max_steps: 6.7", "max_steps"), ("max_steps: many", "max_steps"), ("max_steps: true", "max_steps"),
    ("aqn: 'maybe'", "aqn"), ("aqn: 2", "aqn"), ("learning_rate: fast", "learning_rate"),
    ("learning_rate: .nan", "learning_rate"), ("quant: 4", "quant"), ("dataset_config: size", "dataset_config"),
    ("lora_target_modules: 7", "lora_target_modules"), ("reward_weights: [a]", "reward_weights"),
])
def test_bad_yaml_values_name_the_field_and_the_file(tmp_path, text, field):
    with pytest.raises(ValueError, match=rf"run\.yaml: field '{field}': "):
        GRPOConfig.from_yaml(_yaml(tmp_path, text))


def test_command_line_values_are_typed_the_same_way():
    c = GRPOConfig().with_overrides({"max_steps": "6", "learning_rate": "2e-5", "aqn": "no", "system_prompt": "null",
                                     "model_name_or_path": "2024"})
    assert (c.max_steps, c.learning_rate, c.aqn, c.system_prompt, c.model_name_or_path) == (6, 2e-5, False, None, "2024")
    assert type(c.max_steps) is int and type(c.learning_rate) is float
    with pytest.raises(ValueError, match=r"command line: --max_steps: 6.7 is not an integer"):
        GRPOConfig().with_overrides({"max_steps": "6.7"})
    with pytest.raises(ValueError, match=r"command line: --aqn: 'maybe' is not a boolean"):
        GRPOConfig().with_overrides({"aqn": "maybe"})


def test_the_cli_rejects_a_bad_value_before_loading_any_model(tmp_path, monkeypatch):
    import argparse

    from qerl.cli import train

    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("qerl.model.load_policy", no_model)
    p = _yaml(tmp_path, "max_steps: 6.7\n")
    args = argparse.Namespace(overrides=[str(p)], resume=None, print_config=False)
    with pytest.raises(ValueError, match=r"run\.yaml: field 'max_steps'"):
        train.run(args)

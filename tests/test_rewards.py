"""Answer extraction and reward functions on real tricky completions, including hostile ones."""

import time
from fractions import Fraction

import pytest

from qerl.rl.rewards import score
from qerl.tasks.answers import final_answer, gsm8k_reference, last_boxed, last_tag, parse_number, same_number
from qerl.tasks.rewards import MathVerifyAccuracy, ReasoningGymAccuracy, format_reward, numeric_accuracy


@pytest.mark.parametrize("text, want", [
    ("1,234", Fraction(1234)), ("$5.50", Fraction(11, 2)), ("she has 12 apples.", Fraction(12)),
    ("3/4", Fraction(3, 4)), ("\\frac{3}{4}", Fraction(3, 4)), ("\\dfrac{10}{4}", Fraction(5, 2)),
    ("-7", Fraction(-7)), ("−7", Fraction(-7)), ("50%", Fraction(50)), ("7.", Fraction(7)), (".5", Fraction(1, 2)),
    ("1,000,000 dollars", Fraction(10**6)), ("2 + 5 = 7", Fraction(7)), ("1e3", Fraction(1000)),
    ("x = 3.25 cm", Fraction(13, 4)), ("10{,}000", Fraction(10000)),
    ("no number here", None), ("", None), ("1/0", None), ("9" * 5000, None),  # too long to be an answer; no crash
])
def test_parse_number(text, want):
    assert parse_number(text) == want


def test_tags_and_boxes_on_unbalanced_and_nested_input():
    assert last_tag("<answer>1</answer> then <answer>2</answer>") == "2"
    assert last_tag("<answer>5") is None and last_tag("5</answer>") is None
    assert last_tag("</answer><answer>3</answer>") == "3"
    assert last_boxed("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{a} and \\boxed{{b}{c}}") == "{b}{c}"
    assert last_boxed("\\boxed{3") is None and last_boxed("\\boxed 3") is None
    assert last_boxed("{" * 10000 + "\\boxed{" + "{" * 3000) is None


def test_final_answer_precedence():
    assert final_answer("<think>2+2=5?</think> <answer>\\boxed{4}</answer>") == "4"
    assert final_answer("blah \\boxed{12} more text") == "12"
    assert final_answer("work...\n#### 1,000") == "1,000"
    assert final_answer("So the final answer is: 42 apples") == "42 apples"
    assert final_answer("line one\n\nlast line 9\n") == "last line 9"
    assert final_answer("") == ""


def test_numeric_accuracy_gsm8k_style():
    ref = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 1,072"
    assert gsm8k_reference(ref) == "1,072"
    comps = ["The answer is 1072.", "<answer>1,072</answer>", "#### 1072.00", "The answer is 1073.", "<answer></answer>",
             "I think 1072 but <answer>17</answer>"]
    assert numeric_accuracy(comps, [ref] * len(comps)) == [1, 1, 1, 0, 0, 0]
    assert same_number("$18", "18") and not same_number("18", "")


@pytest.mark.parametrize("text, ok", [
    ("<think>a</think><answer>1</answer>", True),
    ("  <think>\nlong\nthought\n</think>\n<answer> 1 </answer>\n", True),
    ("<answer>1</answer>", False),  # no reasoning
    ("<think>a</think> <answer>1</answer> extra words", False),  # text after the answer
    ("<think>a</think><answer>1</answer><answer>2</answer>", False),  # two answers
    ("<think>a<think>b</think><answer>1</answer>", False),  # nested think
    ("<think>a</think><answer>1", False),  # unclosed
    ("<answer>1</answer><think>a</think>", False),  # wrong order
])
def test_format_reward(text, ok):
    assert format_reward([text]) == [1.0 if ok else 0.0]


def test_100kb_completions_are_fast_and_scored():
    huge = "<think>" + "7 + 7 = 14. " * 9000 + "</think> <answer>14</answer>"
    assert len(huge) > 100_000
    t = time.perf_counter()
    assert numeric_accuracy([huge], ["14"]) == [1.0]
    assert format_reward([huge]) == [1.0]
    assert format_reward(["<think>" * 20000]) == [0.0]
    assert numeric_accuracy(["{" * 100_000], ["3"]) == [0.0]
    # a generous bound, not a speed target: a scan that is quadratic in the length (10^10 steps at 100 kB)
    # takes minutes; a linear one takes milliseconds even on a loaded machine
    assert time.perf_counter() - t < 20


def test_math_verify_accuracy_symbolic():
    mv = MathVerifyAccuracy()
    comps = ["so \\boxed{\\frac{1}{2}}", "<answer>0.5</answer>", "<answer>\\frac{2}{4}</answer>", "\\boxed{\\frac{1}{3}}",
             "no answer at all"]
    assert mv(comps, ["\\frac{1}{2}"] * len(comps)) == [1, 1, 1, 0, 0]
    assert mv(["<answer>(x+1)^2</answer>", "<answer>x^2+2x+1</answer>", "<answer>x^2+1</answer>"],
              ["x^2+2x+1"] * 3) == [1, 1, 0]
    assert mv(["\\boxed{\\sqrt{2}}"], ["\\frac{2}{\\sqrt{2}}"]) == [1]


def test_math_verify_on_hostile_input_is_bounded():
    mv = MathVerifyAccuracy(timeout_s=1)
    hostile = ["\\boxed{" * 2000, "<answer>" + "(" * 5000 + "</answer>", "$" + "x^" * 3000 + "2$",
               "<answer>" + "9" * 20000 + "</answer>"]
    t = time.perf_counter()
    sc = score([mv], None, hostile, {"answer": ["2"] * len(hostile)})
    assert sc.total == [0.0] * len(hostile)
    assert time.perf_counter() - t < 30


def test_reasoning_gym_scorer_on_final_number():
    rg = pytest.importorskip("reasoning_gym")
    ds = rg.create_dataset("chain_sum", seed=3, size=4, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    x = ds[0]
    f = ReasoningGymAccuracy(ds, "chain_sum")
    a = x["answer"]
    wrong = str(int(a) + 1)
    comps = [f"so the sum is {a}", f"<answer>{a}</answer>", f"<answer>{wrong}</answer>", "I don't know"]
    got = f(comps, [a] * 4, metadata=[x["metadata"]] * 4, question=[x["question"]] * 4)
    assert got == [1.0, 1.0, 0.0, 0.0]


def test_a_reward_exception_stops_the_run_naming_the_function():
    from qerl.rl.rewards import RewardFunctionError

    def picky(completions, answer, **_):
        return [1.0 / (len(c) - 3) for c in completions]  # 'abc' divides by zero

    with pytest.raises(RewardFunctionError, match="'picky' raised ZeroDivisionError"):
        score([picky], None, ["abcd", "abc", "abcde"], {"answer": ["", "", ""]})

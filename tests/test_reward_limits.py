"""Rewards of hostile inputs: nothing hangs (huge exponents, tag floods, a math-verify tower are cut off or
killed), and a reward that is not a usable number (inf, text, the wrong count) stops the run, not a silent
score; None (or NaN) is "unscorable", bools are rewards."""

from __future__ import annotations

import math
import time

import pytest

from qerl.rl.rewards import RewardFunctionError, score
from qerl.tasks.answers import parse_number
from qerl.tasks.arithmetic import accuracy as arithmetic_accuracy, final_number
from qerl.deadline import DeadlinePool
from qerl.tasks.rewards import numeric_accuracy


HANG_S = 15  # a generous bound: what it guards against takes hours, or the 30 s a killed job sleeps


def _within(seconds, f, *a):
    t = time.perf_counter()
    out = f(*a)
    assert time.perf_counter() - t < seconds, f"took {time.perf_counter() - t:.1f} s"
    return out


# ---- nothing may hang ----------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["The answer is 1e99999999", "1e-99999999", "3/4e99999999", "\\frac{1e99999999}{3}",
                                  "<answer>9e999999</answer>", "1" * 61 + "e3", "2e301"])
def test_huge_exponents_are_not_expanded(text):
    assert _within(HANG_S, numeric_accuracy, [text], ["1"]) == [0.0]
    assert _within(HANG_S, parse_number, text) is None


def test_exponents_within_limits_still_grade():
    assert parse_number("1.5e3") == 1500 and parse_number("2E-2") == parse_number("0.02")
    assert numeric_accuracy(["so it is 1e5"], ["100000"]) == [1.0]


@pytest.mark.parametrize("text,want", [("<answer>" * 20000, None), ("<answer>" * 20000 + "7</answer>", 7),
                                       ("</answer>" * 20000 + "<answer>" * 20000, None),
                                       ("<answer>1</answer> <answer>2</answer>", 2),
                                       ("<answer>5</answer> then 9", 5), ("no tags, 12", 12)])
def test_arithmetic_answer_tags_are_scanned_in_linear_time(text, want):
    assert _within(HANG_S, final_number, text) == want
    assert _within(HANG_S, arithmetic_accuracy, [text], ["7"]) == [1.0 if want == 7 else 0.0]


def test_the_deadline_pool_kills_a_job_past_its_limit_and_keeps_the_others():
    pool = DeadlinePool(workers=2)
    try:
        pool.map("time:sleep", [(0,)], 5)  # start the workers outside the timed part
        t = time.perf_counter()
        out = pool.map("time:sleep", [(30,), (0,), (0.1,)], 1.0)
        assert time.perf_counter() - t < HANG_S  # the 30 s job was killed, not waited for
        assert out[0][0] is False and "TimeoutError" in out[0][1] and out[1] == (True, None) == out[2]
        assert pool.map("math:sqrt", [(16,), (-1,)], 5) == [(True, 4.0), (False, "ValueError: math domain error")]
    finally:
        pool.close()


def test_math_verify_gets_a_hard_limit_counted_as_a_reward_error():
    pytest.importorskip("math_verify")
    from qerl.tasks.rewards import MathVerifyAccuracy

    # math-verify's own limit (60 s) is far longer than the hard one: only the kill can stop the tower in time
    mv = MathVerifyAccuracy(timeout_s=60, deadline_s=0.5)
    assert mv(["<answer>2</answer>"], ["2"]) == [1.0]  # warm the workers
    tower = "<answer>" + "2^{" * 40 + "2" + "}" * 40 + "</answer>"
    t = time.perf_counter()
    sc = score([mv], None, [tower, "<answer>2</answer>", "<answer>3</answer>"], {"answer": ["2", "2", "2"]})
    assert time.perf_counter() - t < HANG_S
    assert sc.total == [0.0, 1.0, 0.0] and sc.errors == 1 and "TimeoutError" in sc.first_error


def _a_dead_worker() -> tuple[bool, str]:
    """What the deadline pool reports for a job whose worker process died (a real death: os._exit)."""
    pool = DeadlinePool(workers=1)
    try:
        died = pool.map("os:_exit", [(1,)], 60)[0]
    finally:
        pool.close()
    assert died[0] is False and "worker process died" in died[1]
    return died


def test_a_dead_checker_process_scores_0_counted_rather_than_stopping_the_run(monkeypatch):
    # out of memory or a crash in C is the machine's failure, like a time limit, not the reward function's
    pytest.importorskip("math_verify")
    from qerl.tasks.rewards import MathVerifyAccuracy

    died = _a_dead_worker()
    mv = MathVerifyAccuracy(isolate=False)
    monkeypatch.setattr(mv, "_batch", lambda jobs: [died if "crash" in c else (True, mv._one(c, a)) for c, a in jobs])
    sc = score([mv], None, ["<answer>2</answer>", "crash", "<answer>3</answer>"], {"answer": ["2", "2", "2"]})
    assert sc.total == [1.0, 0.0, 0.0] and sc.errors == 1 and "worker process died" in sc.first_error


def test_a_dead_worker_of_numeric_accuracy_scores_0_counted(monkeypatch):
    import qerl.deadline

    died = _a_dead_worker()

    class _Dying:
        def map(self, target, jobs, deadline_s):
            return [died for _ in jobs]

    monkeypatch.setattr(qerl.deadline, "shared_pool", lambda warm=(): _Dying())
    sc = score([numeric_accuracy], None, ["it is 4", r"\boxed{2^{2}}"], {"answer": ["4", "4"]})
    assert sc.total == [1.0, 0.0] and sc.errors == 1 and "worker process died" in sc.first_error


def test_a_checker_s_own_error_still_stops_the_run(monkeypatch):
    import qerl.deadline

    class _Broken:
        def map(self, target, jobs, deadline_s):
            return [(False, "ValueError: the checker's bug") for _ in jobs]

    monkeypatch.setattr(qerl.deadline, "shared_pool", lambda warm=(): _Broken())
    with pytest.raises(RewardFunctionError, match="'accuracy' raised RuntimeError: ValueError: the checker's bug"):
        score([numeric_accuracy], None, [r"\boxed{2^{2}}"], {"answer": ["4"]})


# ---- reward functions --------------------------------------------------------------------------
@pytest.mark.parametrize("value, needle", [(math.inf, "inf"), (1e308, "beyond"), ("1", "not a number"),
                                           ([1.0], "not a number")])
def test_a_reward_that_is_not_a_usable_number_stops_the_run(value, needle):
    def f(completions, **_):
        return [1.0, value, 0.5]

    with pytest.raises(RewardFunctionError, match=needle):
        score([f], None, ["a", "b", "c"], {})


@pytest.mark.parametrize("value", [None, math.nan])  # TRL reads NaN as it reads None
def test_a_reward_of_none_is_unscorable_rather_than_an_error(value):
    # TRL's convention: None where a function cannot score a completion; no function scored it: NaN (unscorable)
    sc = score([lambda completions, **_: [1.0, value, 0.5]], None, ["a", "b", "c"], {})
    assert sc.total[::2] == [1.0, 0.5] and math.isnan(sc.total[1]) and sc.errors == 0


def test_a_reward_of_the_wrong_count_stops_the_run():
    calls = []

    def one(completions, **_):
        calls.append(len(completions))
        return [1.0]

    with pytest.raises(RewardFunctionError, match="returned 1 values for 4 completions"):
        score([one], None, ["a", "b", "c", "d"], {})
    assert calls == [4]  # not retried one by one (which scored every completion 1.0)


def test_bools_are_rewards():
    sc = score([lambda completions, **_: [c == "a" for c in completions]], None, ["a", "b"], {})
    assert sc.total == [1.0, 0.0] and sc.errors == 0


@pytest.mark.parametrize("completion, answer, want", [
    (r"\boxed{\sqrt[3]{2}}", "2", 0.0), (r"\boxed{\sqrt{{2}}}", "2", 0.0), (r"\boxed{\dfrac{\sqrt{2}}{1}}", "1", 0.0),
    (r"\boxed{2^{1}}", "2", 1.0), (r"\boxed{\log_2 4}", "2", 1.0), (r"\boxed{3!}", "6", 1.0),
    (r"\boxed{2\pi}", "2", 0.0), ("so she has 1,234 apples.", "#### 1234", 1.0), (r"\boxed{\text{12}}", "12", 1.0),
    (r"\boxed{\frac{3}{4}}", "0.75", 1.0), ("The answer is $5.50", "5.5", 1.0), ("42", "41", 0.0),
])
def test_numeric_reward_values_expressions_with_math_verify(completion, answer, want):
    from qerl.tasks.answers import is_plain_number
    from qerl.tasks.rewards import numeric_accuracy

    assert numeric_accuracy([completion], [answer]) == [want]
    assert is_plain_number("so she has 1,234 apples.") and not is_plain_number(r"\log_2 4")

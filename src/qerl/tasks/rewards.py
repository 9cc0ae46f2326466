"""Reward functions, TRL-style: `f(completions, **columns) -> list[float]`, one value per completion.

`f.metric = "accuracy"` marks the function whose mean is reported as accuracy (and that
evaluation scores pass@1 with); `"format"` marks the format reward. None of them evaluates
model output; symbolic checking runs under a time limit; `qerl.rl.rewards.score` turns an
exception on one completion into a 0 and counts it.
"""

from __future__ import annotations

import re
import threading

from .answers import TAIL, final_answer, gsm8k_reference, last_tag, parse_number, same_number

_FORMAT = re.compile(r"\s*<think>(?:(?!<think>|</think>).)*</think>\s*<answer>(?:(?!<answer>|</answer>).)*</answer>\s*",
                     re.S)


def format_reward(completions, **_):
    """1 when the completion is exactly `<think> ... </think> <answer> ... </answer>` (the paper's
    prompt suffix asks for it): one of each tag, in order, nothing after the answer."""
    return [1.0 if len(c) <= 4 * TAIL * 8 and _FORMAT.fullmatch(c) else 0.0 for c in completions]


format_reward.metric = "format"


def numeric_accuracy(completions, answer, **_):
    """GSM8K-style: the completion's final number equals the reference's (`#### N` or a plain number)."""
    return [1.0 if same_number(final_answer(c), gsm8k_reference(str(a))) else 0.0
            for c, a in zip(completions, answer)]


numeric_accuracy.metric = "accuracy"


class MathVerifyAccuracy:
    """LaTeX / symbolic answers (MATH-500, BigMath, AIME, AMC) through math-verify.

    math-verify's time limit uses signal.alarm, which exists only in the main thread; elsewhere the
    check runs without it, on at most the last TAIL characters (bounded input, bounded work)."""

    metric = "accuracy"
    __name__ = "math_verify_accuracy"

    def __init__(self, timeout_s: int = 2):
        try:
            import math_verify  # noqa: F401
        except ImportError as e:
            raise ModuleNotFoundError("symbolic math rewards need math-verify: pip install 'math-verify[antlr4_13_2]'") from e
        self.timeout_s = timeout_s

    def _one(self, completion: str, ref: str) -> float:
        from math_verify import parse, verify

        t = self.timeout_s if threading.current_thread() is threading.main_thread() else None
        tagged = last_tag(completion[-4 * TAIL:])
        pred_text = tagged if tagged is not None else completion[-TAIL:]
        if "\\boxed" not in pred_text and "$" not in pred_text and tagged is not None:
            pred_text = f"${pred_text.strip()}$"  # a bare expression in the answer tag
        ref = str(ref)
        gold = parse(ref if ("$" in ref or "\\boxed" in ref) else f"${ref}$", parsing_timeout=t)
        pred = parse(pred_text, parsing_timeout=t)
        if not gold or not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=t) else 0.0

    def __call__(self, completions, answer, **_):
        return [self._one(c, a) for c, a in zip(completions, answer)]


class ReasoningGymAccuracy:
    """A reasoning-gym dataset's own scorer on the completion's final answer (in [0, 1]).

    Rows carry the generator's `answer` and `metadata`; the dataset's `score_answer` needs both.
    When the reference is a number, the final answer is reduced to its last number first
    ('so 2 + 5 = 7' -> '7'), the rule GSM8K graders use; the library's scorer then decides."""

    metric = "accuracy"

    def __init__(self, dataset, name: str):
        self.dataset = dataset
        self.__name__ = f"reasoning_gym/{name}"

    def __call__(self, completions, answer, metadata=None, question=None, **_):
        metadata = metadata or [{}] * len(completions)
        out = []
        for c, a, md, q in zip(completions, answer, metadata, question or [None] * len(completions)):
            entry = {"question": q, "answer": a, "metadata": md}
            pred = final_answer(c)
            if parse_number(str(a)) is not None and (num := parse_number(pred)) is not None:
                pred = str(num.numerator) if num.denominator == 1 else str(float(num))
            out.append(float(self.dataset.score_answer(pred, entry) or 0.0))
        return out

"""Reward functions, TRL-style: `f(completions, **columns) -> list[float]`, one value per completion.
A completion is text, or TRL's conversational form (a list of messages, read as its last message's text),
so these functions serve a `qerl.trl` script with chat data as they serve `qerl train`.

`f.metric = "accuracy"` marks the function whose mean is reported as accuracy (and that
evaluation scores pass@1 with); `"format"` marks the format reward. None of them evaluates
model output; symbolic checking runs in worker processes under a hard time limit. A completion whose check
passes that limit, or whose worker process dies, raises RewardTimeout: `qerl.rl.rewards.score` scores that
completion 0 and counts it (reward_errors); any other exception stops the run (TRL's rule).
"""

from __future__ import annotations

import re
import threading

from .answers import (TAIL, final_answer, gsm8k_reference, is_expression, is_plain_number, last_tag, parse_number,
                      same_number)

_FORMAT = re.compile(r"\s*<think>(?:(?!<think>|</think>).)*</think>\s*<answer>(?:(?!<answer>|</answer>).)*</answer>\s*",
                     re.S)


def texts(completions) -> list[str]:
    """Completions as text: TRL's conversational ones ([{"role": "assistant", "content": ...}]) by their last
    message's content."""
    return [c[-1].get("content") or "" if isinstance(c, list) and c and isinstance(c[-1], dict) else c
            for c in completions]


def format_reward(completions, **_):
    """1 when the completion is exactly `<think> ... </think> <answer> ... </answer>` (the paper's
    prompt suffix asks for it): one of each tag, in order, nothing after the answer."""
    completions = texts(completions)
    return [1.0 if len(c) <= 4 * TAIL * 8 and _FORMAT.fullmatch(c) else 0.0 for c in completions]


format_reward.metric = "format"


SYMBOLIC_TIMEOUT_S = 2  # math-verify's own limit a parse / verify; the worker's hard deadline is 3x + 1


def _same_value(pred: str, ref: str, timeout_s: int | None) -> float:
    """1.0 when math-verify reads `pred` and `ref` (final answers, LaTeX or plain) as the same value."""
    from math_verify import parse, verify

    t = timeout_s if threading.current_thread() is threading.main_thread() else None

    def read(x):
        x = x.strip().strip("$").strip()
        return parse(f"${x}$", parsing_timeout=t) if x else []

    gold, got = read(ref), read(pred)
    return 1.0 if gold and got and verify(gold, got, timeout_seconds=t) else 0.0


def numeric_accuracy(completions, answer, **_):
    """GSM8K-style: the completion's final answer has the reference's value (`#### N` or a number).
    Plain numbers on both sides compare exactly here (thousands commas, units, '$5.50'); an answer
    that is an expression ('2^{1}', '\\log_2 4', '\\sqrt[3]{2}') is valued by math-verify in a worker
    process under a hard time limit (past it, or when the worker dies, RewardTimeout: `score` scores 0, counted)."""
    out: list[float] = []
    symbolic = []
    for i, (c, a) in enumerate(zip(texts(completions), answer)):
        pred, ref = final_answer(c), gsm8k_reference(str(a))
        if is_plain_number(pred) and is_plain_number(ref):
            out.append(1.0 if same_number(pred, ref) else 0.0)
        else:
            out.append(0.0)  # no number and no math in it (say 100 kB of braces): nothing to value
            if is_expression(pred) or is_expression(ref):
                symbolic.append((i, pred[-TAIL:], ref))
    if symbolic:
        from ..deadline import shared_pool

        results = shared_pool(("math_verify",)).map("qerl.tasks.rewards:_same_value",
                                                    [(p, r, SYMBOLIC_TIMEOUT_S) for _, p, r in symbolic],
                                                    3 * SYMBOLIC_TIMEOUT_S + 1)
        for (i, _, _), (ok, r) in zip(symbolic, results):
            if not ok:
                raise _check_failed(r)
            out[i] = float(r)
    return out


numeric_accuracy.metric = "accuracy"


class RewardTimeout(RuntimeError):
    """A completion's check passed its hard time limit, or its worker process died (out of memory, a crash in
    C): the machine's failure, not the reward function's, so scored 0 and counted as a reward error."""


_MACHINE = ("TimeoutError", "the reward worker process died")  # qerl.deadline's words for a limit, a dead worker


def _check_failed(why) -> RuntimeError:
    """A worker's failed check as the exception to raise: RewardTimeout for a time limit or a dead worker
    (scored 0, counted); RuntimeError for the checker's own error (it stops the run, naming it)."""
    return RewardTimeout(why) if any(m in str(why) for m in _MACHINE) else RuntimeError(why)


def _math_verify_one(completion: str, ref: str, timeout_s: int | None) -> float:
    """One check, on at most the last 4 x TAIL characters; math-verify's own (signal) time limits
    apply where this runs in a main thread, as in a worker process."""
    from math_verify import parse, verify

    t = timeout_s if threading.current_thread() is threading.main_thread() else None
    tagged = last_tag(completion[-4 * TAIL:])
    pred_text = tagged if tagged is not None else completion[-TAIL:]
    if "\\boxed" not in pred_text and "$" not in pred_text and tagged is not None:
        pred_text = f"${pred_text.strip()}$"  # a bare expression in the answer tag
    gold = parse(ref if ("$" in ref or "\\boxed" in ref) else f"${ref}$", parsing_timeout=t)
    pred = parse(pred_text, parsing_timeout=t)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=t) else 0.0


class MathVerifyAccuracy:
    """LaTeX / symbolic answers (MATH-500, BigMath, AIME, AMC) through math-verify.

    Sympy work on model text has no bound by construction (a nested power tower never returns),
    so every completion is checked in a worker process with a hard limit of `deadline_s` seconds
    (`qerl.deadline`); past it the worker is killed and the completion raises RewardTimeout (as when its
    worker dies), which `qerl.rl.rewards.score` scores 0 and counts. `isolate=False` checks in this process
    (soft limits only; for debugging)."""

    metric = "accuracy"
    __name__ = "math_verify_accuracy"

    def __init__(self, timeout_s: int = 2, deadline_s: float | None = None, isolate: bool = True):
        try:
            import math_verify  # noqa: F401
        except ImportError as e:
            raise ModuleNotFoundError("symbolic math rewards need math-verify: pip install 'math-verify[antlr4_13_2]'") from e
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s if deadline_s is not None else 3 * timeout_s + 1  # parse, parse, verify
        self.isolate = isolate
        self._last: dict = {}  # the last batch's outcomes: score()'s one-by-one retry reads them

    def _one(self, completion: str, ref: str) -> float:
        return _math_verify_one(completion, str(ref), self.timeout_s)

    def _batch(self, jobs: list[tuple[str, str]]) -> list[tuple[bool, object]]:
        if not self.isolate:
            return [(True, self._one(c, a)) for c, a in jobs]
        from ..deadline import shared_pool

        return shared_pool(("math_verify",)).map("qerl.tasks.rewards:_math_verify_one",
                                                 [(c, a, self.timeout_s) for c, a in jobs], self.deadline_s)

    def __call__(self, completions, answer, **_):
        jobs = [(c, str(a)) for c, a in zip(texts(completions), answer)]
        if len(jobs) == 1 and jobs[0] in self._last:  # a retry of a batch that failed somewhere
            results = [self._last[jobs[0]]]
        else:
            results = self._batch(jobs)
        failed = [r for ok, r in results if not ok]
        if failed:
            self._last = dict(zip(jobs, results))  # no job runs (or times out) twice
            raise _check_failed(failed[0])
        return [float(r) for _, r in results]

    def __getstate__(self):
        return {**self.__dict__, "_last": {}}


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
        for c, a, md, q in zip(texts(completions), answer, metadata, question or [None] * len(completions)):
            entry = {"question": q, "answer": a, "metadata": md}
            pred = final_answer(c)
            if parse_number(str(a)) is not None and is_plain_number(pred) and (num := parse_number(pred)) is not None:
                pred = str(num.numerator) if num.denominator == 1 else str(float(num))
            out.append(float(self.dataset.score_answer(pred, entry) or 0.0))
        return out

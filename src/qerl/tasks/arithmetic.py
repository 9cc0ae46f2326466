"""A small offline task: integer arithmetic problems generated from a seed.

Quick to score and hard enough for a small model to improve on; rewards check the final
number (in <answer> tags when present, else the last number in the completion).
"""

from __future__ import annotations

import random
import re

from . import Task
from .answers import last_tag

_NUM = re.compile(r"-?\d[\d,]*")


def _problem(rng: random.Random, digits: int):
    a, b = rng.randint(1, 10 ** digits - 1), rng.randint(1, 10 ** digits - 1)
    op = rng.choice("+-*")
    if op == "*":
        b = rng.randint(2, 12)
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"What is {a} {op} {b}? Give only the final number.", value


def final_number(text: str) -> int | None:
    # last_tag scans backwards with rfind: linear, where a lazy `<answer>(.*?)</answer>` regex
    # rescans the rest of the text from every unclosed tag (quadratic)
    tagged = last_tag(text)
    src = tagged[-2000:] if tagged is not None else text[-2000:]
    nums = _NUM.findall(src)
    if not nums:
        return None
    try:
        return int(nums[-1].replace(",", ""))
    except ValueError:
        return None


def accuracy(completions, answer, **_):
    return [1.0 if final_number(c) == int(a) else 0.0 for c, a in zip(completions, answer)]


accuracy.metric = "accuracy"


def task(size: int = 2000, eval_size: int = 100, digits: int = 2, seed: int = 0) -> Task:
    rng = random.Random(seed)
    rows = []
    for _ in range(size + eval_size):
        q, v = _problem(rng, digits)
        rows.append({"prompt": [{"role": "user", "content": q}], "question": q, "answer": str(v)})
    return Task("arithmetic", rows[:size], rows[size:], [accuracy])

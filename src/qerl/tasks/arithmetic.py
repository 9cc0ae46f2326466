"""A small offline task: integer arithmetic problems generated from a seed.

Quick to score and hard enough for a small model to improve on; rewards check the final
number (in <answer> tags when present, else the last number in the completion).
"""

from __future__ import annotations

import random
import re

from . import Task

_NUM = re.compile(r"-?\d[\d,]*")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def _problem(rng: random.Random, digits: int):
    a, b = rng.randint(1, 10 ** digits - 1), rng.randint(1, 10 ** digits - 1)
    op = rng.choice("+-*")
    if op == "*":
        b = rng.randint(2, 12)
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"What is {a} {op} {b}? Give only the final number.", value


def final_number(text: str) -> int | None:
    m = _ANSWER.findall(text)
    src = m[-1] if m else text[-2000:]
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

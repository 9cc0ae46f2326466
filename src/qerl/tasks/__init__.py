"""Tasks: a training set, a held-out set and the reward functions that score them.

`get_task(name, **options)` accepts
- a built-in name: `arithmetic`, `gsm8k-offline` (100 GSM8K test problems, no network),
- `rg:<dataset>` (alias `reasoning_gym/<dataset>`): a reasoning-gym generator (seeded, offline),
- a hub name from `HUB` (`gsm8k`, `math500`, `bigmath`, `aime24`, `aime25`, `amc23`) or any hub id,
- a local .jsonl / .json / .parquet file.
Options: `question=` / `answer=` name the source columns, `on_error="skip"` leaves malformed rows
out (counted), `limit`, `eval_limit`, `reward=numeric|math` and `format_reward_weight`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


@dataclass
class Task:
    name: str
    train: list[dict]  # rows with "prompt" (a string or chat messages) and the columns rewards read
    eval: list[dict]
    reward_funcs: list[Callable] = field(default_factory=list)
    reward_weights: list[float] | None = None
    notes: list[str] = field(default_factory=list)  # e.g. malformed rows that were skipped

    def accuracy_func(self) -> Callable:
        """The reward function evaluation scores with (marked metric='accuracy'), else the first."""
        for f in self.reward_funcs:
            if getattr(f, "metric", None) == "accuracy":
                return f
        return self.reward_funcs[0]


@dataclass(frozen=True)
class HubSpec:
    id: str
    config: str | None
    train_split: str | None
    eval_split: str
    question: str
    answer: str
    reward: str  # numeric | math


HUB = {
    "gsm8k": HubSpec("openai/gsm8k", "main", "train", "test", "question", "answer", "numeric"),
    "math500": HubSpec("HuggingFaceH4/MATH-500", None, None, "test", "problem", "answer", "math"),
    "bigmath": HubSpec("SynthLabsAI/Big-Math-RL-Verified", None, "train", "train", "problem", "answer", "math"),
    "aime24": HubSpec("HuggingFaceH4/aime_2024", None, None, "train", "problem", "answer", "math"),
    "aime25": HubSpec("yentinglin/aime_2025", None, None, "train", "problem", "answer", "math"),
    "amc23": HubSpec("math-ai/amc23", None, None, "test", "question", "answer", "math"),
}


def _reward_funcs(kind: str, format_reward_weight: float):
    from .rewards import MathVerifyAccuracy, format_reward, numeric_accuracy

    if kind not in ("numeric", "math"):
        raise ValueError(f"dataset_config.reward: expected 'numeric' or 'math', got {kind!r}")
    funcs = [numeric_accuracy if kind == "numeric" else MathVerifyAccuracy()]
    weights = None
    if format_reward_weight:
        funcs.append(format_reward)
        weights = [1.0, format_reward_weight]
    return funcs, weights


def _from_rows(name, train, held_out, reward, format_reward_weight, eval_size):
    if train is None:  # an evaluation-only set: the trainer can still use it, the held-out part is carved off
        rows = held_out.rows
        train = type(held_out)(rows[eval_size:] if len(rows) > eval_size else rows, held_out.skipped)
        held_out = type(held_out)(rows[:eval_size])
    funcs, weights = _reward_funcs(reward, format_reward_weight)
    return Task(name, train.rows, held_out.rows, funcs, weights, train.notes + held_out.notes)


def get_task(name: str, **options) -> Task:
    from . import arithmetic, data
    from .options import check_options

    check_options(name, options)
    options = dict(options)
    fmt_w = float(options.pop("format_reward_weight", 0.0))
    if name == "arithmetic":
        return arithmetic.task(**options)
    if name in ("tool_arithmetic", "tool-arithmetic"):
        return __import__("qerl.tasks.tool_arithmetic", fromlist=["task"]).task(format_reward_weight=fmt_w, **options)
    if name.startswith(("rg:", "reasoning_gym/")):
        from . import reasoning_gym

        return reasoning_gym.task(name.split(":", 1)[1] if name.startswith("rg:") else name.split("/", 1)[1],
                                  format_reward_weight=fmt_w, **options)
    on_error, limit = options.pop("on_error", "raise"), options.pop("limit", None)
    eval_limit = options.pop("eval_limit", None)
    if name in ("gsm8k-offline", "gsm8k_offline"):
        rows = data.gsm8k_offline(limit=eval_limit)
        # evaluation set only: training on it would leak the test problems, so train is empty
        funcs, weights = _reward_funcs("numeric", fmt_w)
        return Task("gsm8k-offline", [], rows.rows, funcs, weights)
    path = Path(name)
    if path.suffix.lower() in (".jsonl", ".json", ".parquet") or path.is_file():
        q, a = options.pop("question", "question"), options.pop("answer", "answer")
        rows = data.load_file(path, question=q, answer=a, on_error=on_error, limit=limit)
        eval_file = options.pop("eval_file", None)
        eval_size = int(options.pop("eval_size", 0 if eval_file else min(100, len(rows.rows) // 10)))
        reward = options.pop("reward", "numeric")
        if options:
            raise ValueError(f"dataset_config: unknown option(s) {sorted(options)} for a local file")
        if eval_file:
            ev = data.load_file(eval_file, question=q, answer=a, on_error=on_error, limit=eval_limit)
            train = rows
        else:
            ev, train = data.Rows(rows.rows[:eval_size]), data.Rows(rows.rows[eval_size:], rows.skipped, rows.first_problem, rows.notes)
        return _from_rows(str(path), train, ev, reward, fmt_w, eval_size)
    spec = HUB.get(name)
    if spec is None and "/" not in name:
        import difflib

        known = ["arithmetic", "gsm8k-offline", "rg:<dataset>"] + sorted(HUB)
        near = difflib.get_close_matches(name, known, n=2)
        raise ValueError(f"dataset_name: unknown task {name!r} (known: {', '.join(known)}, a hub id or a local file)"
                         + (f"; did you mean {' or '.join(near)}?" if near else ""))
    if spec is None:  # any hub dataset, with the column mapping in the options
        spec = HubSpec(name, options.pop("config", None), options.pop("split", "train"), options.pop("eval_split", "test"),
                       options.pop("question", "question"), options.pop("answer", "answer"), options.pop("reward", "numeric"))
    if options:
        raise ValueError(f"dataset_config: unknown option(s) {sorted(options)} for hub dataset {spec.id}")
    ev = data.load_hub(spec.id, config=spec.config, split=spec.eval_split, question=spec.question, answer=spec.answer,
                       on_error=on_error, limit=eval_limit)
    train = None
    if spec.train_split and spec.train_split != spec.eval_split:
        train = data.load_hub(spec.id, config=spec.config, split=spec.train_split, question=spec.question,
                              answer=spec.answer, on_error=on_error, limit=limit)
    return _from_rows(name, train, ev, spec.reward, fmt_w, 50)

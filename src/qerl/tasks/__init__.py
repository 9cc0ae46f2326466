"""Tasks: a training set, a held-out set and the reward functions that score them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Task:
    name: str
    train: list[dict]  # rows with "prompt" (a string or chat messages) and the columns rewards read
    eval: list[dict]
    reward_funcs: list[Callable] = field(default_factory=list)


def get_task(name: str, **options) -> Task:
    from . import arithmetic

    tasks = {"arithmetic": arithmetic.task}
    if name not in tasks:
        raise ValueError(f"dataset_name: unknown task {name!r} (known: {', '.join(sorted(tasks))})")
    return tasks[name](**options)

"""reasoning-gym generators as tasks: procedurally generated problems with the library's own scorer.

Training and held-out problems come from two seeds of the same generator; held-out problems
whose question also occurs in the training set are dropped, so the held-out set is truly unseen.
"""

from __future__ import annotations

from . import Task
from .rewards import ReasoningGymAccuracy, format_reward

ANSWER_INSTRUCTION = "\nGive the final answer inside <answer> </answer> tags."


def task(name: str, size: int = 2000, eval_size: int = 200, seed: int = 0, instruction: str | None = ANSWER_INSTRUCTION,
         format_reward_weight: float = 0.0, **generator_options) -> Task:
    try:
        import reasoning_gym
    except ImportError as e:
        raise ModuleNotFoundError("reasoning-gym tasks need the reasoning-gym package: pip install reasoning-gym") from e
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        import difflib

        near = difflib.get_close_matches(name, DATASETS, n=3)
        raise ValueError(f"dataset_name: reasoning-gym has no dataset {name!r}"
                         + (f" (did you mean {', '.join(near)}?)" if near else ""))
    try:
        train_ds = reasoning_gym.create_dataset(name, seed=seed, size=size, **generator_options)
        eval_ds = reasoning_gym.create_dataset(name, seed=seed + 1_000_003, size=eval_size * 2, **generator_options)
    except TypeError as e:
        raise ValueError(f"dataset_config for reasoning-gym {name!r}: {e}") from None

    def row(x):
        q = x["question"] + (instruction or "")
        return {"prompt": [{"role": "user", "content": q}], "question": x["question"], "answer": str(x["answer"]),
                "metadata": x.get("metadata", {})}

    train = [row(x) for x in train_ds]
    seen = {r["question"] for r in train}
    held_out = [row(x) for x in eval_ds if x["question"] not in seen][:eval_size]
    funcs = [ReasoningGymAccuracy(train_ds, name)]
    if format_reward_weight:
        funcs.append(format_reward)
    t = Task(f"reasoning_gym/{name}", train, held_out, funcs)
    t.reward_weights = [1.0, format_reward_weight] if format_reward_weight else None
    return t

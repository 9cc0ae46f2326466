"""Config files written for `trl grpo --config` and `trl sft --config`, run by `qerl train` / `qerl sft`.

TRL's scripts read their script arguments from the same file as the config: `reward_funcs` (names of
TRL's own reward functions, `accuracy_reward`, `reasoning_accuracy_reward`, `think_format_reward`,
`get_soft_overlong_punishment`, or import paths `module.function`, looked up from the working folder
as TRL does) and `reward_model_name_or_path` (a reward model, TRL's way). They are taken out here and
become the run's reward functions; every other field goes to the config, under TRL's names.

Not the field table (train/trl_fields.py, whose rules it applies): this is the CLI's reading of a TRL file's script."""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field

SCRIPT_FIELDS = ("reward_funcs", "reward_model_name_or_path")


@dataclass
class ScriptRewards:
    names: list[str] = field(default_factory=list)
    reward_model: str | None = None

    def __bool__(self) -> bool:
        return bool(self.names or self.reward_model)

    def funcs(self) -> list:
        """The reward functions, in TRL's order: the reward model first, then the named functions."""
        out: list = [self.reward_model] if self.reward_model else []
        for name in self.names:
            out.append(_trl_reward(name) if "." not in name else _imported(name))
        from ..trl.reward_models import reward_callables

        return reward_callables(out)


def _trl_reward(name: str):
    try:
        import trl.rewards as r
    except ImportError:
        raise ValueError(f"reward_funcs: {name!r} is one of TRL's reward functions; it needs trl installed "
                         "(pip install trl), or give an import path module.function") from None
    registry = {"accuracy_reward": r.accuracy_reward, "reasoning_accuracy_reward": r.reasoning_accuracy_reward,
                "think_format_reward": r.think_format_reward,
                "get_soft_overlong_punishment": r.get_soft_overlong_punishment(max_completion_len=1280,
                                                                              soft_punish_cache=256)}
    if name not in registry:
        raise ValueError(f"reward_funcs: could not load {name!r}; expected one of {', '.join(registry)} or an "
                         "import path module.function (TRL's rule)")
    return registry[name]


def _imported(path: str):
    module, func = path.rsplit(".", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as TRL's script: a module beside the config
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward_funcs: could not import {path!r} ({e})") from None


def split(d: dict, source: str = "config file") -> tuple[dict, ScriptRewards]:
    """(the config's fields, the script's reward arguments) of a config file's mapping. TRL's warm-up ratio
    (warmup_steps below 1, or warmup_ratio: train/trl_fields.warmup_ratio's rule) becomes warmup_steps of the file's
    max_steps, TRL's optimizer steps, as transformers counts it."""
    from ..train.trl_fields import renamed, warmup_ratio

    d = renamed(d)  # activation_checkpointing; TRL's fields qerl lacks: sort_out, when the config is built
    names = d.pop("reward_funcs", None) or []
    if isinstance(names, str):
        names = [names]
    rewards = ScriptRewards(list(names), d.pop("reward_model_name_or_path", None))
    ratio, d = warmup_ratio(d, source)
    if ratio:
        steps = d.get("max_steps")
        if not (rewards and isinstance(steps, int) and not isinstance(steps, bool) and steps > 0):
            given = "a `trl grpo --config` file's max_steps" if rewards else "max_steps of a TRL file (with reward_funcs)"
            raise ValueError(f"{source}: a warm-up ratio ({ratio:g} of the run's optimizer steps) needs {given} "
                             f"(TRL's optimizer steps) to count from under qerl train; set max_steps there, or give "
                             f"warmup_steps as a whole number of optimizer steps")
        from ..train.optim import warmup_steps

        d["warmup_steps"] = warmup_steps(ratio, steps)
    return d, rewards


def as_messages_if_chat(funcs: list, rows: list) -> list:
    """TRL hands conversational completions to reward functions as messages (rl/rewards.AsMessages)."""
    from ..rl.rewards import AsMessages

    if rows and isinstance(rows[0].get("prompt"), list):
        return [f if isinstance(f, AsMessages) else AsMessages(f) for f in funcs]
    return funcs


def trl_task(cfg, rewards: ScriptRewards):
    """The run's task for a `trl grpo --config` file: the dataset's rows as TRL reads them (a local
    .jsonl / .json / .parquet file or a hub dataset, split `train` unless dataset_config says; every
    column reaches the reward functions) and the script's reward functions."""
    from ..sft.data import load_rows
    from ..tasks import Task

    funcs = rewards.funcs()  # a name that is not a reward function is said before any data loads
    rows = load_rows(cfg.dataset_name, dict(cfg.dataset_config))
    if rows and "prompt" not in rows[0]:
        raise ValueError(f"dataset_name {cfg.dataset_name}: TRL's GRPO rows need a 'prompt' column "
                         f"(columns: {', '.join(sorted(rows[0]))})")
    return Task(str(cfg.dataset_name), rows, [], as_messages_if_chat(funcs, rows))

"""The options (`dataset_config`) each kind of task takes, checked before anything loads.

`get_task` passes options on as keyword arguments, so a misspelt key or a value of the wrong
type used to surface as a TypeError deep in a generator, after the model had loaded. Here
each key is checked against the task's own list, with its type, and an error names the key.
"""

from __future__ import annotations

import difflib
import math
from pathlib import Path


def _int(lo: int):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"an integer >= {lo}")
        if v < lo:
            raise ValueError(f"an integer >= {lo}")
        return v
    return check


def _number(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError("a finite number")
    return float(v)


def _str(v):
    if not isinstance(v, str) or not v:
        raise ValueError("a non-empty string")
    return v


def _opt_str(v):
    return v if v is None else _str(v)


def _bool(v):
    if not isinstance(v, bool):
        raise ValueError("true or false")
    return v


def _choice(*names):
    def check(v):
        if v not in names:
            raise ValueError(" or ".join(repr(n) for n in names))
        return v
    return check


COMMON = {"format_reward_weight": _number}
ARITHMETIC = {**COMMON, "size": _int(1), "eval_size": _int(0), "digits": _int(1), "seed": _int(0)}
REASONING_GYM = {**COMMON, "size": _int(1), "eval_size": _int(0), "seed": _int(0), "instruction": _opt_str}
TOOL_ARITHMETIC = {**COMMON, "size": _int(1), "eval_size": _int(0), "seed": _int(0), "dataset": _str,
                   "example": _bool}
GSM8K_OFFLINE = {**COMMON, "eval_limit": _int(1)}
ROWS = {**COMMON, "on_error": _choice("raise", "skip"), "limit": _int(1), "eval_limit": _int(1)}
LOCAL_FILE = {**ROWS, "question": _str, "answer": _str, "eval_file": _str, "eval_size": _int(0),
              "reward": _choice("numeric", "math")}
HUB_ANY = {**ROWS, "config": _opt_str, "split": _str, "eval_split": _str, "question": _str, "answer": _str,
           "reward": _choice("numeric", "math")}


def kind_of(name: str) -> str:
    """Which option table a dataset name uses (the same dispatch as `get_task`)."""
    from . import HUB

    if name == "arithmetic":
        return "arithmetic"
    if name.startswith(("rg:", "reasoning_gym/")):
        return "reasoning_gym"
    if name in ("tool_arithmetic", "tool-arithmetic"):
        return "tool_arithmetic"
    if name in ("gsm8k-offline", "gsm8k_offline"):
        return "gsm8k-offline"
    p = Path(name)
    if p.suffix.lower() in (".jsonl", ".json", ".parquet") or p.is_file():
        return "local file"
    return "hub" if name in HUB else "hub id"


TABLES = {"arithmetic": ARITHMETIC, "reasoning_gym": REASONING_GYM, "tool_arithmetic": TOOL_ARITHMETIC, "gsm8k-offline": GSM8K_OFFLINE,
          "local file": LOCAL_FILE, "hub": ROWS, "hub id": HUB_ANY}


def check_options(name: str, options, field: str = "dataset_config") -> dict:
    """`options` checked for the task `name`; ValueError naming `field`.key otherwise."""
    if not isinstance(options, dict):
        raise ValueError(f"{field}: expected a mapping of option: value, got {type(options).__name__}")
    kind = kind_of(name)
    table = dict(TABLES[kind])
    extra_ok = set()
    if kind == "reasoning_gym":
        extra_ok = _generator_fields(name.split(":", 1)[1] if name.startswith("rg:") else name.split("/", 1)[1])
    elif kind == "tool_arithmetic":  # its generator's own options (basic_arithmetic unless `dataset` says otherwise)
        extra_ok = _generator_fields(options.get("dataset", "basic_arithmetic"))
    for key, value in options.items():
        if key in table:
            try:
                table[key](value)
            except ValueError as e:
                raise ValueError(f"{field}.{key}: {value!r} is not {e} (dataset {name!r})") from None
        elif extra_ok is not None and key not in extra_ok:
            known = sorted(table) + sorted(extra_ok or ())
            near = difflib.get_close_matches(str(key), known, n=1)
            raise ValueError(f"{field}: unknown option {key!r} for {kind} dataset {name!r}"
                             + (f"; did you mean {near[0]!r}?" if near else "") + f" (options: {', '.join(known)})")
    return options


def _generator_fields(rg_name: str) -> set[str] | None:
    """The fields of a reasoning-gym generator's config (its own options); None when they cannot be
    known here (no reasoning-gym: `get_task` says so), an empty set for an unknown generator."""
    try:
        import dataclasses

        from reasoning_gym.factory import DATASETS
    except ImportError:
        return None
    entry = DATASETS.get(rg_name)
    if entry is None or not dataclasses.is_dataclass(entry[1]):
        return set()
    return {f.name for f in dataclasses.fields(entry[1])} - {"size", "seed"}

"""Calling reward functions safely: a failure on one completion scores it 0 and is counted.

A failure is an exception, a value that is not a finite number (NaN, inf, None, text) or beyond
MAX_REWARD in size (1e308 ended as "loss is nan" in the advantages' std), or a list of the wrong
length (one value for four completions was retried one by one and scored every completion 1.0):
each is scored 0, counted in `reward_errors`, and the first one's message kept.

A reward function follows TRL's convention: `f(completions: list[str], **columns) -> list[float]`
where each dataset column (e.g. `answer`) and `prompts` arrive as lists aligned with
`completions`. A function may set `f.metric = "accuracy"` or `"format"` to be reported as the
step's accuracy or format rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Scores:
    total: list[float]
    per_func: dict[str, list[float]] = field(default_factory=dict)
    errors: int = 0
    first_error: str | None = None


def func_name(f) -> str:
    return getattr(f, "metric", None) or getattr(f, "__name__", type(f).__name__)


MAX_REWARD = 1e6  # |reward| beyond it is a broken function: its square overflows the advantages' std


def _bad_value(v) -> str | None:
    """None for a usable reward, else what is wrong with it."""
    if not isinstance(v, (int, float)) and not hasattr(v, "__float__"):  # bools count as 0 / 1
        return f"returned {type(v).__name__} {str(v)[:40]!r}, not a number"
    try:
        x = float(v)
    except (TypeError, ValueError, OverflowError):
        return f"returned {str(v)[:40]!r}, not a number"
    if not math.isfinite(x):
        return f"returned {x}"
    if abs(x) > MAX_REWARD:
        return f"returned {x:g}, beyond +-{MAX_REWARD:g}"
    return None


def score(funcs, weights, completions: list[str], columns: dict[str, list]) -> Scores:
    n = len(completions)
    weights = list(weights) if weights is not None else [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ValueError(f"reward_weights has {len(weights)} entries for {len(funcs)} reward functions")
    out = Scores(total=[0.0] * n)

    def error(name, msg, count=1):
        out.errors += count
        out.first_error = out.first_error or f"{name}: {msg}"[:300]

    for f, w in zip(funcs, weights):
        name = func_name(f)
        try:
            vals = list(f(completions, **columns))
        except Exception:  # noqa: BLE001 - retry one by one so one bad completion costs only itself
            vals = []
            for i in range(n):
                try:
                    one = list(f([completions[i]], **{k: [v[i]] for k, v in columns.items()}))
                    if len(one) != 1:
                        raise ValueError(f"returned {len(one)} values for 1 completion")
                    vals.append(one[0])
                except Exception as e:  # noqa: BLE001
                    error(name, f"{type(e).__name__}: {e}")
                    vals.append(0.0)
        if len(vals) != n:  # which value belongs to which completion is unknown: none is used
            error(name, f"returned {len(vals)} values for {n} completions", n)
            vals = [0.0] * n
        clean = []
        for v in vals:
            why = _bad_value(v)
            if why:
                error(name, why)
            clean.append(0.0 if why else float(v))
        out.per_func[name] = clean
        out.total = [t + w * v for t, v in zip(out.total, clean)]
    return out

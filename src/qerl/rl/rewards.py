"""Calling reward functions safely: a failure on one completion scores it 0 and is counted.

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


def _clean(v) -> float:
    try:
        v = float(v)
    except (TypeError, ValueError):
        return 0.0
    return v if math.isfinite(v) else 0.0


def score(funcs, weights, completions: list[str], columns: dict[str, list]) -> Scores:
    n = len(completions)
    weights = list(weights) if weights is not None else [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ValueError(f"reward_weights has {len(weights)} entries for {len(funcs)} reward functions")
    out = Scores(total=[0.0] * n)
    for f, w in zip(funcs, weights):
        name = func_name(f)
        try:
            vals = list(f(completions, **columns))
            if len(vals) != n:
                raise ValueError(f"returned {len(vals)} values for {n} completions")
        except Exception:  # noqa: BLE001 - retry one by one so one bad completion costs only itself
            vals = []
            for i in range(n):
                try:
                    vals.append(f([completions[i]], **{k: [v[i]] for k, v in columns.items()})[0])
                except Exception as e:  # noqa: BLE001
                    out.errors += 1
                    out.first_error = out.first_error or f"{name}: {type(e).__name__}: {e}"[:300]
                    vals.append(0.0)
        vals = [_clean(v) for v in vals]
        out.per_func[name] = vals
        out.total = [t + w * v for t, v in zip(out.total, vals)]
    return out

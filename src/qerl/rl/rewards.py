"""Calling reward functions safely: a failure on one completion scores it 0 and is counted.

A failure is an exception, a value that is not a finite number (NaN, inf, None, text) or beyond
MAX_REWARD in size (1e308 ended as "loss is nan" in the advantages' std), or a list of the wrong
length (one value for four completions was retried one by one and scored every completion 1.0):
each is scored 0, counted in `reward_errors`, and the first one's message kept.

A function that fails on every completion of FAILING_CALLS calls in a row (returns None, a scalar,
text, a short or nested list, or needs a column the data lacks) is broken, not unlucky: `score`
raises RewardFunctionError naming it and what it returned, as TRL does at once (it trained on
zeros with exit 0). Time limits passed are not counted toward that (a slow machine is not a bug).

A reward function follows TRL's convention: `f(completions: list[str], **columns) -> list[float]`
where each dataset column (e.g. `answer`) and `prompts` arrive as lists aligned with
`completions`; a function that takes them (by name or **kwargs) also gets TRL's `trainer_state`,
`log_extra` and `log_metric` (rl/reward_hooks.py). None for a completion means the function does not
apply to it (TRL's convention): not an error, left out of the function's mean and adding 0 to the total. A function may set `f.metric = "accuracy"` or `"format"` to be reported as the
step's accuracy or format rate.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field


@dataclass
class Scores:
    total: list[float]
    per_func: dict[str, list[float]] = field(default_factory=dict)  # NaN where the function returned None
    errors: int = 0
    names: dict[str, str] = field(default_factory=dict)  # per_func's key -> TRL's name of the function
    first_error: str | None = None


def func_name(f) -> str:
    return getattr(f, "metric", None) or trl_name(f)


def trl_name(f) -> str:
    """The name TRL logs a reward function under (rewards/<name>/mean)."""
    return getattr(f, "__name__", type(f).__name__)


def hook_kwargs(f, hooks: dict) -> dict:
    """Of TRL's extra arguments, those `f` takes: all with **kwargs, else the ones it names."""
    if not hooks:
        return {}
    try:
        params = inspect.signature(f).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return hooks
    return {k: v for k, v in hooks.items() if k in params}


MAX_REWARD = 1e6  # |reward| beyond it is a broken function: its square overflows the advantages' std
FAILING_CALLS = 3  # calls in a row on which a function failed on every completion: then it is an error


class RewardFunctionError(ValueError):
    """A reward function that fails on every completion, call after call; the message names it."""


_failing: dict[int, tuple[object, int]] = {}  # id(function) -> (function, calls in a row failed on everything)


def _track(f, name: str, n: int, failed: int, first: str | None) -> None:
    """Count calls on which `f` failed on all n completions; raise at FAILING_CALLS in a row."""
    key = id(f)
    if n == 0 or failed < n:
        _failing.pop(key, None)
        return
    prev = _failing.get(key)
    count = (prev[1] if prev is not None and prev[0] is f else 0) + 1
    if count < FAILING_CALLS:
        _failing[key] = (f, count)
        return
    _failing.pop(key, None)
    raise RewardFunctionError(f"reward function {name!r} failed on every completion of {count} calls in a row "
                              f"({first}); a reward function takes (completions, **columns) and returns one number "
                              f"per completion (TRL's convention)"[:600])


class _NotAList(TypeError):
    pass


def _one_value(got):
    """The one value of a call on one completion; an error saying what came back otherwise."""
    try:
        one = list(got)
    except TypeError:
        raise _NotAList(f"returned {type(got).__name__} {str(got)[:40]!r}, not a list") from None
    if len(one) != 1:
        raise ValueError(f"returned {len(one)} values for 1 completion")
    return one[0]


def _timeout(e: BaseException) -> bool:
    return isinstance(e, TimeoutError) or type(e).__name__ == "RewardTimeout"


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


def score(funcs, weights, completions: list[str], columns: dict[str, list], hooks: dict | None = None) -> Scores:
    """hooks: TRL's trainer_state / log_extra / log_metric, passed whole (never split per completion)."""
    n = len(completions)
    weights = list(weights) if weights is not None else [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ValueError(f"reward_weights has {len(weights)} entries for {len(funcs)} reward functions")
    out = Scores(total=[0.0] * n)
    mine = {"failed": 0, "first": None}  # the current function's failures (time limits not counted)

    def error(name, msg, count=1, timeout=False):
        out.errors += count
        out.first_error = out.first_error or f"{name}: {msg}"[:300]
        if not timeout:
            mine["failed"] += count
            mine["first"] = mine["first"] or msg[:300]

    for f, w in zip(funcs, weights):
        name = func_name(f)
        extra = hook_kwargs(f, hooks)
        mine.update(failed=0, first=None)
        try:
            vals = list(f(completions, **columns, **extra))
        except Exception:  # noqa: BLE001 - retry one by one so one bad completion costs only itself
            vals = []
            for i in range(n):
                try:
                    vals.append(_one_value(f([completions[i]], **{k: [v[i]] for k, v in columns.items()}, **extra)))
                except Exception as e:  # noqa: BLE001
                    error(name, str(e) if isinstance(e, _NotAList) else f"{type(e).__name__}: {e}", timeout=_timeout(e))
                    vals.append(0.0)
        if len(vals) != n:  # which value belongs to which completion is unknown: none is used
            error(name, f"returned {len(vals)} values for {n} completions", n)
            vals = [0.0] * n
        clean = []
        for v in vals:
            if v is None:  # does not apply to this completion (TRL): no score, no error
                clean.append(math.nan)
                continue
            why = _bad_value(v)
            if why:
                error(name, why)
            clean.append(0.0 if why else float(v))
        _track(f, name, n, mine["failed"], mine["first"])
        out.per_func[name] = clean
        out.names[name] = trl_name(f)
        out.total = [t + (w * v if v == v else 0.0) for t, v in zip(out.total, clean)]
    return out

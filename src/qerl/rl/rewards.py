"""Calling reward functions as TRL 1.16 calls them, and TRL's rule for what they return.

The call is TRL's (`GRPOTrainer._calculate_rewards`): every argument by keyword,

    f(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=..., log_extra=..., log_metric=...)

each dataset column (e.g. `answer`) a list aligned with `completions`; synchronous functions run in
order, then the `async` ones are awaited together (asyncio.gather on a daemon event loop, as TRL). A
function without **kwargs gets only the arguments it names (TRL would raise on the others). A
conversational run wraps each function in `AsMessages`: its completions arrive as TRL gives them,
[{"role": "assistant", "content": text}].

The rule (TRL's), here and nowhere else:
- None for a completion (or NaN, which TRL reads the same way) means the function cannot score it. The
  completion's reward is the weighted sum of the functions that did score it; one that no function scored
  is unscorable: its reward is NaN, it is left out of its group's baseline (mean and std) and its
  advantage is 0 (rl/advantages.py). A call where every completion is unscorable is said once a run.
- An exception, or a return value that is not one finite number or None per completion (a scalar, text,
  a list of the wrong length, inf, beyond MAX_REWARD), stops the run with RewardFunctionError: one line
  naming the function and its error, and, for `kwargs["solution"]` or a parameter the data lacks, the
  data's columns. A function that fails now and then returns None there instead.
- One exception: a time limit passed (qerl's symbolic checkers, RewardTimeout) is the machine's, not the
  function's: that completion scores 0 and is counted in `reward_errors` (the first one's message kept).

A function may set `f.metric = "accuracy"` or `"format"` to be reported as the step's accuracy or format rate.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Scores:
    total: list[float]  # NaN where no function scored the completion (unscorable)
    per_func: dict[str, list[float]] = field(default_factory=dict)  # NaN where the function returned None
    errors: int = 0  # completions past a time limit (scored 0)
    names: dict[str, str] = field(default_factory=dict)  # per_func's key -> TRL's name of the function
    first_error: str | None = None


@dataclass(frozen=True)
class AsMessages:
    """A reward function of a conversational run: each completion handed over as TRL hands it,
    [{"role": "assistant", "content": text}]."""
    func: Callable

    def __call__(self, **kw):
        if "completions" in kw:
            kw["completions"] = [[{"role": "assistant", "content": c}] for c in kw["completions"]]
        return self.func(**kw)


def unwrapped(f):
    return f.func if isinstance(f, AsMessages) else f


def func_name(f) -> str:
    return getattr(unwrapped(f), "metric", None) or trl_name(f)


def trl_name(f) -> str:
    """The name TRL logs a reward function under (rewards/<name>/mean; trl.trainer.utils.get_callable_name)."""
    f = unwrapped(f)
    while isinstance(f, functools.partial):
        f = f.func
    return getattr(f, "__name__", type(f).__name__)


def is_async(f) -> bool:
    """TRL's is_async_callable: an async function, partial of one, or object with an async __call__."""
    f = unwrapped(f)
    while isinstance(f, functools.partial):
        f = f.func
    return inspect.iscoroutinefunction(f) or inspect.iscoroutinefunction(getattr(f, "__call__", None))


HOOKS = ("trainer_state", "log_extra", "log_metric")  # TRL's arguments that are not per completion


def hook_kwargs(f, hooks: dict) -> dict:
    """Of the keyword arguments, those `f` takes: all with **kwargs, else the ones it names."""
    if not hooks:
        return {}
    try:
        params = inspect.signature(unwrapped(f)).parameters
    except (TypeError, ValueError):
        return hooks
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return hooks
    return {k: v for k, v in hooks.items() if k in params}


def trl_kwargs(completions: list, columns: dict[str, list], hooks: dict | None,
               completion_ids: list | None, environments: list | None = None) -> dict:
    """The keyword arguments of TRL's call, in TRL's order. Columns named prompt, completion and
    completion_ids are not passed as columns (TRL's rule); `prompts` comes from the caller's columns;
    `environments` (one per completion) only when given, as TRL passes it only with an environment_factory."""
    cols = {k: v for k, v in columns.items() if k not in ("prompts", "prompt", "completion", "completion_ids")}
    kw = {}
    if "prompts" in columns:
        kw["prompts"] = columns["prompts"]
    kw["completions"] = completions
    if completion_ids is not None:
        kw["completion_ids"] = completion_ids
    kw = {**kw, **cols, **(hooks or {})}
    if environments is not None:
        kw["environments"] = environments
    return kw


def one_completion(kw: dict, i: int) -> dict:
    """The keyword arguments of a call on completion i alone (the hooks stay whole)."""
    return {k: (v if k in HOOKS else [v[i]]) for k, v in kw.items()}


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """A daemon thread's event loop for async reward functions (TRL's start_event_loop_in_daemon): it
    works from any thread, also where an event loop is already running (a notebook)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="qerl-async-rewards", daemon=True).start()
        return _loop


def run_async(coros: list) -> list:
    """Await coroutines concurrently; each one's result or exception, in order."""
    async def gather():
        return await asyncio.gather(*coros, return_exceptions=True)

    return asyncio.run_coroutine_threadsafe(gather(), _event_loop()).result()


def call(f, kw: dict):
    """One call of `f` with the arguments it takes; an async function awaited on the daemon loop."""
    args = hook_kwargs(f, kw)
    if is_async(f):
        got = run_async([f(**args)])[0]
        if isinstance(got, BaseException):
            raise got
        return got
    return f(**args)


MAX_REWARD = 1e6  # |reward| beyond it is a broken function: its square overflows the advantages' std


class RewardFunctionError(ValueError):
    """A reward function that raised, or returned something other than one number (or None) per
    completion: the run stops; the message names the function and what went wrong, in one line."""


def _one_line(x, limit: int = 300) -> str:
    return " ".join(str(x).split())[:limit]


def data_columns(columns: dict) -> list[str]:
    """The dataset's column names as the user wrote them (the rollout hands `prompt` over as `prompts`)."""
    return sorted("prompt" if k == "prompts" else k for k in columns)


_MISSING_ARGS = re.compile(r"missing \d+ required (?:positional|keyword-only) arguments?: (.+)$")


def missing_columns(f, e: BaseException, kw: dict) -> list[str]:
    """The arguments reward function `f` asked for and did not get: `kwargs["solution"]` (a KeyError, where
    `f` takes **kwargs) or a parameter `solution` without a default (a TypeError): columns the data lacks."""
    if isinstance(e, KeyError) and e.args and isinstance(e.args[0], str) and _takes_kwargs(f):
        names = [e.args[0]]
    elif isinstance(e, TypeError) and (m := _MISSING_ARGS.search(str(e))):
        names = re.findall(r"'([^']+)'", m.group(1))
    else:
        return []
    return [x for x in names if x not in kw]


def _takes_kwargs(f) -> bool:
    try:
        params = inspect.signature(unwrapped(f)).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def raised(f, e: BaseException, kw: dict, columns: dict) -> RewardFunctionError:
    """The one line that stops the run when reward function `f` raised `e` on a call with arguments `kw`."""
    name, what = func_name(f), f"{type(e).__name__}: {_one_line(e)}"
    missing = missing_columns(f, e, kw)
    if missing:
        return RewardFunctionError(
            f"reward function {name!r} reads the dataset column {', '.join(map(repr, missing))}, which the data "
            f"lacks ({what}); the data's columns: {', '.join(data_columns(columns))}; add it to the dataset, or "
            f"read a column the data has (TRL passes every column by its name)")
    return RewardFunctionError(
        f"reward function {name!r} raised {what}; a reward function returns one number per completion, or None "
        f"for a completion it cannot score (TRL's rule: None is left out, an exception stops the run)")


def values(name: str, got, n: int) -> list[float]:
    """A call's return value as n rewards, NaN where the function returned None (or NaN, which TRL reads
    the same way): unscorable. Anything else that is not a finite number stops the run, naming it."""
    if isinstance(got, (str, bytes, dict)) or not hasattr(got, "__iter__"):
        why = f"returned {type(got).__name__} {_one_line(got, 40)!r}, not a list"
    elif len(got := list(got)) != n:  # which value belongs to which completion is unknown: none is used
        why = f"returned {len(got)} values for {n} completions"
    else:
        out = [_number(v) for v in got]
        bad = next(((i, b) for i, (_, b) in enumerate(out) if b), None)
        if bad is None:
            return [x for x, _ in out]
        why = f"{bad[1]} (completion {bad[0] + 1} of {n})"
    raise RewardFunctionError(f"reward function {name!r} {why}; a reward function returns one number per "
                              f"completion, or None for a completion it cannot score (TRL's rule)")


def _number(v) -> tuple[float, str | None]:
    """(the reward, None), NaN for None / NaN (unscorable); or (NaN, what is wrong with it)."""
    if v is None:
        return math.nan, None
    if not isinstance(v, (int, float)) and not hasattr(v, "__float__"):  # bools count as 0 / 1
        return math.nan, f"returned {type(v).__name__} {_one_line(v, 40)!r}, not a number"
    try:
        x = float(v)
    except (TypeError, ValueError, OverflowError):
        return math.nan, f"returned {_one_line(v, 40)!r}, not a number"
    if math.isnan(x):
        return x, None
    if math.isinf(x) or abs(x) > MAX_REWARD:
        return math.nan, f"returned {x:g}, beyond +-{MAX_REWARD:g}"
    return x, None


def _timeout(e: BaseException) -> bool:
    return isinstance(e, TimeoutError) or type(e).__name__ == "RewardTimeout"


_said_unscorable: set[tuple[str, ...]] = set()  # the function sets whose wholly unscorable call was said


def _say_unscorable(names: list[str], n: int) -> None:
    """TRL warns when every reward function returned None for a completion; a whole call of them trains
    nothing, said once a run (a partly unscorable call is ordinary: a function for some rows only)."""
    key = tuple(names)
    if key in _said_unscorable:
        return
    _said_unscorable.add(key)
    from tqdm import tqdm

    tqdm.write(f"qerl: warning: reward function{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))} "
               f"returned None for all {n} completions of a rollout: they are unscorable and train nothing "
               f"(advantage 0, TRL's rule); said once", file=sys.stderr)  # above a progress bar


def _whole_batch(funcs, kw: dict) -> list:
    """Each function's return value (or exception) on the whole batch: the synchronous ones in order,
    then the async ones concurrently, as TRL's _calculate_rewards."""
    out: list = [None] * len(funcs)
    for i, f in enumerate(funcs):
        if not is_async(f):
            try:
                out[i] = f(**hook_kwargs(f, kw))
            except Exception as e:  # noqa: BLE001 - score() decides: a time limit or the end of the run
                out[i] = e
    pending = [i for i, f in enumerate(funcs) if is_async(f)]
    if pending:
        coros = []
        for i in pending:
            try:
                coros.append(funcs[i](**hook_kwargs(funcs[i], kw)))
            except Exception as e:  # noqa: BLE001 - raised before its coroutine existed
                out[i] = e
                coros.append(asyncio.sleep(0, e))
        for i, got in zip(pending, run_async(coros)):
            out[i] = got if out[i] is None else out[i]
    return out


def score(funcs, weights, completions: list[str], columns: dict[str, list], hooks: dict | None = None,
          completion_ids: list[list[int]] | None = None, environments: list | None = None) -> Scores:
    """hooks: TRL's trainer_state / log_extra / log_metric, passed whole (never split per completion);
    completion_ids: each completion's generated token ids (TRL's completion_ids); environments: each
    completion's environment (TRL's, with an environment_factory)."""
    n = len(completions)
    weights = list(weights) if weights is not None else [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ValueError(f"reward_weights has {len(weights)} entries for {len(funcs)} reward functions")
    out = Scores(total=[math.nan] * n)
    kw = trl_kwargs(completions, columns, hooks, completion_ids, environments)
    batch = _whole_batch(funcs, kw)
    for f, w, got in zip(funcs, weights, batch):
        name = func_name(f)
        if not isinstance(got, BaseException):
            vals = values(name, got, n)
        elif not _timeout(got):
            raise raised(f, got, hook_kwargs(f, kw), columns) from None
        else:  # a time limit passed somewhere: one by one, so that completion alone scores 0
            vals = []
            for i in range(n):
                try:
                    one = call(f, one_completion(kw, i))
                except Exception as e:  # noqa: BLE001 - a time limit is counted, anything else stops the run
                    if not _timeout(e):
                        raise raised(f, e, hook_kwargs(f, kw), columns) from None
                    out.errors += 1
                    out.first_error = out.first_error or f"{name}: {type(e).__name__}: {_one_line(e)}"
                    one = [0.0]
                vals += values(name, one, 1)
        out.per_func[name] = vals
        out.names[name] = trl_name(f)
        # TRL's nansum: a function's None adds nothing; a completion no function scored stays NaN (unscorable)
        out.total = [t if v != v else (w * v if t != t else t + w * v) for t, v in zip(out.total, vals)]
    if n and all(t != t for t in out.total):
        _say_unscorable([func_name(f) for f in funcs], n)
    return out

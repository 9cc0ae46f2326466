"""Calling reward functions as TRL 1.16 calls them, safely: a failure on one completion scores it 0 and is counted.

The call is TRL's (`GRPOTrainer._calculate_rewards`): every argument by keyword,

    f(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=..., log_extra=..., log_metric=...)

each dataset column (e.g. `answer`) a list aligned with `completions`; synchronous functions run in
order, then the `async` ones are awaited together (asyncio.gather on a daemon event loop, as TRL). A
function without **kwargs gets only the arguments it names (TRL would raise on the others). A
conversational run wraps each function in `AsMessages`: its completions arrive as TRL gives them,
[{"role": "assistant", "content": text}].

A failure is an exception, a value that is not a finite number (NaN, inf, None, text) or beyond
MAX_REWARD in size (1e308 ended as "loss is nan" in the advantages' std), or a list of the wrong
length (one value for four completions was retried one by one and scored every completion 1.0):
each is scored 0, counted in `reward_errors`, and the first one's message kept.

A function that fails on every completion of FAILING_CALLS calls in a row (returns None, a scalar,
text, a short or nested list, or needs a column the data lacks) is broken, not unlucky: `score`
raises RewardFunctionError naming it and what it returned, as TRL does at once (it trained on
zeros with exit 0). Time limits passed are not counted toward that (a slow machine is not a bug).

None for a completion means the function does not apply to it (TRL's convention): not an error, left
out of the function's mean and adding 0 to the total. A function may set `f.metric = "accuracy"` or
`"format"` to be reported as the step's accuracy or format rate.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import threading
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Scores:
    total: list[float]
    per_func: dict[str, list[float]] = field(default_factory=dict)  # NaN where the function returned None
    errors: int = 0
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
FAILING_CALLS = 3  # calls in a row on which a function failed on every completion: then it is an error


class RewardFunctionError(ValueError):
    """A reward function that fails on every completion, call after call; the message names it."""


_failing: dict[int, tuple[object, int]] = {}  # id(function) -> (function, calls in a row failed on everything)


def _track(f, name: str, n: int, failed: int, first: str | None) -> None:
    """Count calls on which `f` failed on all n completions; raise at FAILING_CALLS in a row."""
    key = id(unwrapped(f))
    if n == 0 or failed < n:
        _failing.pop(key, None)
        return
    prev = _failing.get(key)
    count = (prev[1] if prev is not None and prev[0] is unwrapped(f) else 0) + 1
    if count < FAILING_CALLS:
        _failing[key] = (unwrapped(f), count)
        return
    _failing.pop(key, None)
    raise RewardFunctionError(f"reward function {name!r} failed on every completion of {count} calls in a row "
                              f"({first}); TRL calls a reward function by keyword, f(prompts=..., completions=..., "
                              f"completion_ids=..., **columns, **kwargs), and it returns one number per "
                              f"completion"[:600])


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


def _whole_batch(funcs, kw: dict) -> list:
    """Each function's return value (or exception) on the whole batch: the synchronous ones in order,
    then the async ones concurrently, as TRL's _calculate_rewards."""
    out: list = [None] * len(funcs)
    for i, f in enumerate(funcs):
        if not is_async(f):
            try:
                out[i] = f(**hook_kwargs(f, kw))
            except Exception as e:  # noqa: BLE001 - retried one by one below
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
    out = Scores(total=[0.0] * n)
    mine = {"failed": 0, "first": None}  # the current function's failures (time limits not counted)

    def error(name, msg, count=1, timeout=False):
        out.errors += count
        out.first_error = out.first_error or f"{name}: {msg}"[:300]
        if not timeout:
            mine["failed"] += count
            mine["first"] = mine["first"] or msg[:300]

    kw = trl_kwargs(completions, columns, hooks, completion_ids, environments)
    batch = _whole_batch(funcs, kw)
    for f, w, got in zip(funcs, weights, batch):
        name = func_name(f)
        mine.update(failed=0, first=None)
        try:
            if isinstance(got, BaseException):
                raise got
            vals = list(got)
        except Exception:  # noqa: BLE001 - retry one by one so one bad completion costs only itself
            vals = []
            for i in range(n):
                try:
                    vals.append(_one_value(call(f, one_completion(kw, i))))
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

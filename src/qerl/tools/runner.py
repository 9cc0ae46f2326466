"""Running tool calls under limits: wall time per call, output size, exceptions as text.

Isolated tools (the default for a tool that is a module-level function) run in the worker
processes of `qerl.deadline`: past its deadline a call's worker is killed and the model reads
a timeout message. A tool that cannot be imported by name in a fresh interpreter (a closure, a
lambda, a bound method holding state) runs in this process on a daemon thread: the caller still
gets an answer at the deadline, but the thread cannot be stopped, so use that only for tools that
are bounded by construction (like the calculator).

The model's text only ever selects a tool by name from the given list and passes JSON values as
arguments: no text is evaluated, imported or executed.
"""

from __future__ import annotations

import importlib
import json
import threading
from dataclasses import dataclass

from .calls import ToolCall
from .tool import as_tools


@dataclass(frozen=True)
class ToolLimits:
    timeout_s: float = 5.0  # wall time per call
    max_output_chars: int = 2000  # longer results are cut, with a note saying so


def truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n[output truncated: {len(text)} characters, only the first {max_chars} shown]"


def to_text(result) -> str:
    """A tool's return value as the model will read it: strings as they are, the rest as JSON when possible."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)


def _error_text(e: BaseException) -> str:
    try:
        msg = str(e)
    except Exception:  # noqa: BLE001 - an exception whose __str__ raises
        msg = "(its message cannot be shown)"
    return f"Error: {type(e).__name__}: {msg}"[:500]


def import_path(func) -> str | None:
    """'module:qualname' when a fresh interpreter can import `func` by that name, else None."""
    mod, qual = getattr(func, "__module__", None), getattr(func, "__qualname__", "")
    if not mod or mod == "__main__" or "<" in qual or "." in qual:
        return None
    try:
        return f"{mod}:{qual}" if getattr(importlib.import_module(mod), qual, None) is func else None
    except ImportError:
        return None


def _worker_call(target: str, arguments: dict, max_chars: int) -> str:
    """Runs inside a deadline worker: import the tool by name, call it, return bounded text."""
    mod, _, qual = target.partition(":")
    try:
        return truncate(to_text(getattr(importlib.import_module(mod), qual)(**arguments)), max_chars)
    except Exception as e:  # noqa: BLE001 - the model reads it as the tool's answer
        return _error_text(e)


def call_with_deadline(func, timeout_s: float, what: str) -> tuple[bool, object]:
    """(True, func()) or (False, error text for the model) when it raises or runs past `timeout_s`.
    It runs on a daemon thread: the caller gets its answer at the deadline, the thread cannot be stopped."""
    box: list = []

    def go():
        try:
            box.append((True, func()))
        except BaseException as e:  # noqa: BLE001 - the model reads it
            box.append((False, _error_text(e)))

    t = threading.Thread(target=go, daemon=True, name="qerl-tool")
    t.start()
    t.join(timeout_s)
    return box[0] if box else (False, f"Error: {what} took longer than {timeout_s:g} s")


def _thread_call(name: str, func, arguments: dict, timeout_s: float, max_chars: int) -> tuple[bool, str]:
    """The call and its result's conversion to text, both under the deadline (a slow __str__ counts)."""
    return call_with_deadline(lambda: safe_text(func(**arguments), max_chars), timeout_s, name)


def safe_text(result, max_chars: int) -> str:
    """to_text, then truncate; a value whose str() raises is an error text too."""
    try:
        return truncate(to_text(result), max_chars)
    except Exception as e:  # noqa: BLE001 - e.g. a result type whose __str__ raises
        return _error_text(e)


class ToolRunner:
    """Runs parsed calls against a fixed tool list; `run` always returns text for the model."""

    def __init__(self, tools, limits: ToolLimits = ToolLimits(), isolate: bool | None = None):
        self.tools = tools if isinstance(tools, dict) else as_tools(tools)  # name -> Tool, or a list of tools
        self.limits = limits
        # isolate=None: each tool that can be imported by name runs in a worker process
        self.targets = {n: (import_path(t.func) if isolate is not False else None) for n, t in self.tools.items()}
        # workers import the tools' modules before their first job, so no call pays for that import
        self.warm = ("qerl.tools.runner",) + tuple(sorted({p.partition(":")[0] for p in self.targets.values() if p}))
        if isolate:
            missing = [n for n, p in self.targets.items() if p is None]
            if missing:
                raise ValueError(f"tool(s) {missing} cannot run in a worker process: only module-level functions "
                                 f"importable by name can (pass isolate=None to run these in this process)")

    def _precheck(self, call: ToolCall) -> str | None:
        if call.error:
            return call.error
        tool = self.tools.get(call.name)
        if tool is None:
            return f"Error: unknown tool {call.name[:100]!r} (available: {', '.join(sorted(self.tools)) or 'none'})"
        bad = tool.check_arguments(call.arguments)
        return None if bad is None else f"Error: {bad}"

    def run(self, call: ToolCall) -> str:
        return self.run_many([call])[0]

    def run_many(self, calls: list[ToolCall]) -> list[str]:
        """Each call's answer, in order; isolated calls share the worker pool (in parallel up to its size)."""
        out: list = [self._precheck(c) for c in calls]
        lim = self.limits
        pooled = [i for i, c in enumerate(calls) if out[i] is None and self.targets.get(c.name)]
        if pooled:
            from ..deadline import shared_pool

            jobs = [(self.targets[calls[i].name], calls[i].arguments, lim.max_output_chars) for i in pooled]
            results = shared_pool(self.warm).map("qerl.tools.runner:_worker_call", jobs, lim.timeout_s)
            for i, (ok, text) in zip(pooled, results):
                name = calls[i].name
                if ok:
                    out[i] = str(text)
                elif "TimeoutError" in str(text):
                    out[i] = f"Error: {name} took longer than {lim.timeout_s:g} s"
                else:  # _worker_call catches the tool's exceptions: only a dead process gets here
                    out[i] = f"Error: {name} failed: its worker process died"
        for i, c in enumerate(calls):
            if out[i] is None:  # not importable by name: run here, on a thread we can stop waiting for
                ok, res = _thread_call(c.name, self.tools[c.name].func, c.arguments, lim.timeout_s,
                                       lim.max_output_chars)
                out[i] = str(res)
        return out

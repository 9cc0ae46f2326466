"""The environment hook for multi-turn rollouts, TRL-like: one instance per sample.

`reset(row)` starts an episode from the dataset row (a stateful task reads what it needs);
`step(call)` answers one parsed tool call with text for the model. The default step dispatches
to the tool list under the runner's limits, so a stateless task only passes `tools=`.
"""

from __future__ import annotations

from .calls import HERMES, ToolCall, ToolCallFormat, parse_tool_calls
from .chat import tool_message
from .runner import ToolLimits, ToolRunner, call_with_deadline, safe_text
from .tool import as_tools


class ToolEnvironment:
    def __init__(self, tools=(), limits: ToolLimits = ToolLimits(), fmt: ToolCallFormat = HERMES):
        self.tools = as_tools(tools)
        self.runner = ToolRunner(self.tools, limits)
        self.fmt = fmt
        self.row: dict | None = None

    @property
    def schemas(self) -> list[dict]:
        return [t.schema for t in self.tools.values()]

    def reset(self, row: dict) -> None:
        self.row = row

    def step(self, call: ToolCall) -> str:
        return self.runner.run(call)

    def respond(self, turn_text: str) -> list[dict]:
        """The tool messages answering every call in one assistant turn; [] when the turn has none
        (the sample is finished). Calls are parsed against this environment's tools."""
        calls = parse_tool_calls(turn_text, self.tools, self.fmt)
        if type(self).step is ToolEnvironment.step:  # the default: one batch through the worker pool
            answers = self.runner.run_many(calls)
        else:  # an overridden step: the same wall-time and output limits as a tool, its errors as text
            lim = self.runner.limits
            answers = []
            for c in calls:
                # its answer's conversion to text too: a slow __str__ is under the limit
                ok, res = call_with_deadline(lambda c=c: safe_text(self.step(c), lim.max_output_chars), lim.timeout_s,
                                             f"the environment's step ({c.name})")
                answers.append(str(res))
        return [tool_message(a, c.name or None) for c, a in zip(calls, answers)]

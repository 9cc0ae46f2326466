"""Tool calls in model text: the Hermes / Qwen2.5 form `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Parsing never raises: malformed JSON, an unknown tool or bad arguments become a ToolCall with
`error` set, and that text goes back to the model as the tool's answer so it can correct itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MAX_CALL_CHARS = 20_000  # a call's JSON is read only up to this size (json nesting is also bounded below)
MAX_CALLS_PER_TURN = 8


@dataclass(frozen=True)
class ToolCallFormat:
    """The markers around one call. Qwen2.5/Qwen3/Hermes chat templates ask for these."""
    open: str = "<tool_call>"
    close: str = "</tool_call>"


HERMES = ToolCallFormat()


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # set when the call cannot run; the text to return to the model
    text: str = ""  # the call as the model wrote it, markers excluded


def tool_call_stop_strings(fmt: ToolCallFormat = HERMES) -> list[str]:
    """Where the engine should stop a turn so the tool can run before decoding resumes."""
    return [fmt.close]


def find_tool_calls(text: str, fmt: ToolCallFormat = HERMES) -> list[str]:
    """The raw contents of complete open...close blocks, in order (an unclosed block is no call)."""
    out, pos = [], 0
    while len(out) < MAX_CALLS_PER_TURN:
        i = text.find(fmt.open, pos)
        if i < 0:
            break
        j = text.find(fmt.close, i + len(fmt.open))
        if j < 0:
            break
        out.append(text[i + len(fmt.open): j])
        pos = j + len(fmt.close)
    return out


def has_tool_call(text: str, fmt: ToolCallFormat = HERMES) -> bool:
    return bool(find_tool_calls(text, fmt))


def parse_call(raw: str, tools: dict | None = None) -> ToolCall:
    """One call's JSON -> ToolCall; `tools` (name -> Tool) checks the name and arguments when given."""
    body = raw.strip()
    usage = 'write <tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>'
    if len(body) > MAX_CALL_CHARS:
        return ToolCall("", error=f"Error: the tool call is {len(body)} characters long (at most {MAX_CALL_CHARS})",
                        text=raw)
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"Error: the tool call is not valid JSON ({e.msg} at character {e.pos}); {usage}",
                        text=raw)
    except RecursionError:
        return ToolCall("", error="Error: the tool call's JSON is nested too deeply", text=raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", error=f'Error: the tool call must be a JSON object with a string "name"; {usage}',
                        text=raw)
    name = obj["name"]
    args = obj.get("arguments", obj.get("parameters", {}))  # Llama-style templates say "parameters"
    if isinstance(args, str):  # OpenAI's wire form sends arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return ToolCall(name, error=f"Error: the arguments of {name} are not valid JSON", text=raw)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(name, error=f"Error: the arguments of {name} must be a JSON object, got {type(args).__name__}",
                        text=raw)
    call = ToolCall(name, args, text=raw)
    if tools is not None:
        if name not in tools:
            known = ", ".join(sorted(tools)) or "none"
            call.error = f"Error: unknown tool {name[:100]!r} (available: {known})"
        elif (bad := tools[name].check_arguments(args)) is not None:
            call.error = f"Error: {bad}"
    return call


def parse_tool_calls(text: str, tools: dict | None = None, fmt: ToolCallFormat = HERMES) -> list[ToolCall]:
    """Every complete call in a turn's text, parsed; errors are carried, never raised."""
    return [parse_call(raw, tools) for raw in find_tool_calls(text, fmt)]

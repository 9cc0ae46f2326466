"""Tools for multi-turn rollouts: schemas, parsing calls out of model text, running them under
limits, the built-in calculator, and the token ids that put results back into the conversation.

The engine's loop, per sample (one environment each; samples of a group proceed independently):

    env = ToolEnvironment(task.tools, ToolLimits(timeout_s=5, max_output_chars=2000)); env.reset(row)
    prompt: the chat template rendered with tools=env.schemas, or rows whose system turn already
            offers the tools (with_tools_prompt; tool_arithmetic's rows do)
    decode with stop=tool_call_stop_strings() until a stop string, EOS or the length limit
    msgs = env.respond(turn_text)              # [] -> no call: the sample is finished
    ids = tool_response_ids(tokenizer, msgs)   # append into the same KV slot, masked out of the loss
    resume decoding; at most max_turns tool turns

`ToolTurnHandler(tokenizer, rows, tools)` packs this per-sample loop into the engine's
`turns=` hook (qerl.rollout.turns.TurnHandler): `Engine.generate(prompts, n, params, turns=handler)`.

`respond` never raises on model text: malformed calls, unknown tools, bad arguments, timeouts,
exceptions and oversized outputs all come back as text for the model.
"""

from .calculator import CalculatorError, calculator, evaluate
from .calls import HERMES, ToolCall, ToolCallFormat, find_tool_calls, has_tool_call, parse_tool_calls, \
    tool_call_stop_strings
from .chat import as_template_messages, template_has_tool_role, tool_message, tool_response_ids, \
    tool_response_text, tools_system_prompt, with_tools_prompt
from .env import ToolEnvironment
from .handler import ToolTurnHandler
from .reference import ToolRollout, reference_rollout
from .runner import ToolLimits, ToolRunner, truncate
from .tool import Tool, as_tool, as_tools

__all__ = ["CalculatorError", "HERMES", "Tool", "ToolCall", "ToolCallFormat", "ToolEnvironment", "ToolLimits",
           "ToolRollout", "ToolRunner", "ToolTurnHandler",
           "as_template_messages", "as_tool", "as_tools", "calculator", "evaluate",
           "find_tool_calls", "has_tool_call", "parse_tool_calls", "reference_rollout", "template_has_tool_role",
           "tool_call_stop_strings", "tool_message", "tool_response_ids", "tool_response_text", "tools_system_prompt",
           "truncate", "with_tools_prompt"]

"""Tools for multi-turn rollouts: schemas, parsing calls out of model text, running them under
limits, the built-in calculator, and the token ids that put results back into the conversation.

The engine's loop, per sample and turn:

    env = ToolEnvironment([calculator]); env.reset(row)
    ... decode until a stop string from tool_call_stop_strings() or EOS ...
    msgs = env.respond(turn_text)                  # [] -> the sample is done
    ids = tool_response_ids(tokenizer, msgs)       # append to the KV slot (masked from the loss), resume
"""

from .calculator import CalculatorError, calculator, evaluate
from .calls import HERMES, ToolCall, ToolCallFormat, find_tool_calls, has_tool_call, parse_tool_calls, \
    tool_call_stop_strings
from .chat import as_template_messages, template_has_tool_role, tool_message, tool_response_ids, \
    tool_response_text, tools_system_prompt, with_tools_prompt
from .env import ToolEnvironment
from .runner import ToolLimits, ToolRunner, truncate
from .tool import Tool, as_tool, as_tools

__all__ = ["CalculatorError", "HERMES", "Tool", "ToolCall", "ToolCallFormat", "ToolEnvironment", "ToolLimits",
           "ToolRunner", "as_template_messages", "as_tool", "as_tools", "calculator", "evaluate", "find_tool_calls",
           "has_tool_call", "parse_tool_calls", "template_has_tool_role", "tool_call_stop_strings", "tool_message",
           "tool_response_ids", "tool_response_text", "tools_system_prompt", "truncate", "with_tools_prompt"]

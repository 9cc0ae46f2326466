"""The offline tool-use task: reasoning-gym arithmetic with the calculator tool on offer.

Prompts carry the tool offer in their system turn (the text Qwen2.5's template writes for
`tools=`), so any chat template, SmolLM2's included, shows the model the tool. The reward is the
correctness of the final answer (reasoning-gym's scorer on the last <answer> tag), read from the
model's own text only: tool responses are cut out first, so a trajectory that ends on a
calculator result, or a call that echoes "<answer>..." back, earns nothing by itself.
`task.tools` holds the tools a multi-turn rollout should run.
"""

from __future__ import annotations

import re

from qerl.tools import calculator, has_tool_call, with_tools_prompt
from qerl.tools.tool import Tool

from . import Task
from .reasoning_gym import task as rg_task
from .rewards import ReasoningGymAccuracy

INSTRUCTION = ("\nUse the calculator tool for the arithmetic, then give the final answer inside <answer> </answer> "
               "tags.")
# a one-shot demonstration (task option example=True). Measured on the CPU, greedy, SmolLM2-135M-Instruct: no tool
# call from the offer alone (0 of 6) nor with this example (0 of 4); with '<tool_call>{"name": "calculator",
# "arguments": {"expression": "' forced at the start of the answer it finishes a parseable call in 3 of 4.
EXAMPLE = ('\nFor example, for 3 + 4 * 2 write <tool_call>{"name": "calculator", "arguments": {"expression": '
           '"3 + 4 * 2"}}</tool_call>, read the result 11, then write <answer>11</answer>.')
# small enough for a 135M model to learn to call the tool: 2-3 terms of at most 3 digits
EASY = {"min_terms": 2, "max_terms": 3, "max_digits": 3}
_RESPONSE = re.compile(r"<tool_response>.*?(?:</tool_response>|\Z)", re.S)


def model_text(completion) -> str:
    """The model's own words: tool responses removed (a chat-format completion keeps its assistant turns)."""
    if isinstance(completion, list):
        completion = "\n".join(m.get("content") or "" for m in completion if m.get("role") == "assistant")
    return _RESPONSE.sub("", completion)


class ToolArithmeticAccuracy(ReasoningGymAccuracy):
    def __call__(self, completions, answer, **columns):
        return super().__call__([model_text(c) for c in completions], answer, **columns)


def _calls_in(completion) -> bool:
    if isinstance(completion, list):  # chat format: TRL puts parsed calls in `tool_calls`
        return any(m.get("tool_calls") or has_tool_call(m.get("content") or "")
                   for m in completion if m.get("role") == "assistant")
    return has_tool_call(model_text(completion))


def tool_call_rate(completions) -> float:
    """Fraction of completions with at least one complete tool call (well-formed or not)."""
    completions = list(completions)
    return sum(map(_calls_in, completions)) / len(completions) if completions else 0.0


def task(size: int = 2000, eval_size: int = 200, seed: int = 0, dataset: str = "basic_arithmetic",
         format_reward_weight: float = 0.0, example: bool = False, **generator_options) -> Task:
    """example: add the one-shot call demonstration (EXAMPLE) to every question's instruction."""
    options = {**(EASY if dataset == "basic_arithmetic" else {}), **generator_options}
    instruction = INSTRUCTION + (EXAMPLE if example else "")
    base = rg_task(dataset, size=size, eval_size=eval_size, seed=seed, instruction=instruction,
                   format_reward_weight=format_reward_weight, **options)
    tools = [Tool.from_callable(calculator)]
    schemas = [t.schema for t in tools]
    for row in base.train + base.eval:
        row["prompt"] = with_tools_prompt(row["prompt"], schemas)
    acc = base.reward_funcs[0]
    funcs = [ToolArithmeticAccuracy(acc.dataset, dataset)] + base.reward_funcs[1:]
    t = Task(f"tool_arithmetic/{dataset}", base.train, base.eval, funcs, base.reward_weights, base.notes)
    t.tools = tools  # not a Task field (yet): what the rollout's ToolEnvironment should be built with
    return t

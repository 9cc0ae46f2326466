"""The offline tool-use task: reasoning-gym arithmetic with the calculator tool on offer.

Prompts carry the tool offer in their system turn (the text Qwen2.5's template writes for
`tools=`), so any chat template, SmolLM2's included, shows the model the tool. The reward is the
correctness of the final answer (reasoning-gym's scorer on the last <answer> tag), read from the
model's own text only: tool responses are cut out first, so a trajectory that ends on a
calculator result, or a call that echoes "<answer>..." back, earns nothing by itself.
`task.tools` holds the tools a multi-turn rollout should run.

`transcripts(task.train)` writes the supervised warm start (`qerl sft`): for each training row the
conversation a correct tool user has, the question, one well-formed calculator call in the form the
prompt's tool offer asks for, the tool's answer, the final answer in <answer> tags.
"""

from __future__ import annotations

import json
import re

from qerl.tools import calculator, has_tool_call, tool_message, with_tools_prompt
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


def call_text(expression: str) -> str:
    """A well-formed calculator call as the tool offer (tools_system_prompt) asks for it."""
    return f'<tool_call>\n{json.dumps({"name": "calculator", "arguments": {"expression": expression}})}\n</tool_call>'


def transcripts(rows: list[dict]) -> list[dict]:
    """Supervised conversations (TRL's `messages` rows) for `rows`, a task's training split: the row's
    prompt, a calculator call on the generator's expression, the calculator's own answer and the final
    answer. Rows whose calculator answer differs from the reference answer are left out (none in the
    integer generators this task uses)."""
    out = []
    for i, row in enumerate(rows):
        expression = (row.get("metadata") or {}).get("expression")
        if not isinstance(expression, str):
            raise ValueError(f"tool_arithmetic transcripts: row {i} has no metadata.expression (a reasoning-gym "
                             "arithmetic generator writes one)")
        result = calculator(expression)
        if result != str(row["answer"]).strip():
            continue
        out.append({"messages": [dict(m) for m in row["prompt"]] + [
            {"role": "assistant", "content": call_text(expression)},
            tool_message(result, "calculator"),
            {"role": "assistant", "content": f"<answer>{result}</answer>"}]})
    return out

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

`dataset="chain_arithmetic"` is the harder variant (issue 42): 3-4 terms of + - * under the usual
precedence, and a calculator that takes one operation per call (`one_operation_calculator`, offered
under the name "calculator"; a longer expression comes back as an error message). The model has to
order the operations, carry each result into the next call and stop after the last one, so one
well-formed call no longer solves a problem. Its transcripts show the whole chain, one call per
operation in evaluation order; its reward is the number in the model's own last <answer> tag.
"""

from __future__ import annotations

import ast
import json
import random
import re
from dataclasses import dataclass

from qerl.tools import calculator, has_tool_call, tool_message, with_tools_prompt
from qerl.tools.calculator import one_operation_calculator
from qerl.tools.tool import Tool

from . import Task
from .answers import last_tag, same_number
from .reasoning_gym import task as rg_task
from .rewards import ReasoningGymAccuracy, format_reward

INSTRUCTION = ("\nUse the calculator tool for the arithmetic, then give the final answer inside <answer> </answer> "
               "tags.")
# a one-shot demonstration (task option example=True). Measured on the CPU, greedy, SmolLM2-135M-Instruct: no tool
# call from the offer alone (0 of 6) nor with this example (0 of 4); with '<tool_call>{"name": "calculator",
# "arguments": {"expression": "' forced at the start of the answer it finishes a parseable call in 3 of 4.
EXAMPLE = ('\nFor example, for 3 + 4 * 2 write <tool_call>{"name": "calculator", "arguments": {"expression": '
           '"3 + 4 * 2"}}</tool_call>, read the result 11, then write <answer>11</answer>.')
# small enough for a 135M model to learn to call the tool: 2-3 terms of at most 3 digits
EASY = {"min_terms": 2, "max_terms": 3, "max_digits": 3}
# the chained variant: 3-4 terms of 2-50, enough operations that the order matters and 2-3 calls carry results
CHAIN = {"min_terms": 3, "max_terms": 4, "low": 2, "high": 50, "operators": "+-*"}
CHAIN_INSTRUCTION = ("\nCall the calculator once per operation, in the order of operations, reusing earlier results, "
                     "then give the final answer inside <answer> </answer> tags.")
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
    """example: add the one-shot call demonstration (EXAMPLE) to every question's instruction.
    dataset "chain_arithmetic": the chained variant (its options: CHAIN's keys); else a reasoning-gym generator."""
    if dataset == CHAIN_NAME:
        return chain_task(size, eval_size, seed, format_reward_weight, example, **generator_options)
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
    prompt, calculator calls and their answers (one call on the generator's expression; for the chained
    variant one call per operation, `chain_steps`) and the final answer. Rows whose last calculator answer
    differs from the reference answer are left out (none in the integer generators this task uses)."""
    out = []
    for i, row in enumerate(rows):
        md = row.get("metadata") or {}
        expression = md.get("expression")
        if not isinstance(expression, str):
            raise ValueError(f"tool_arithmetic transcripts: row {i} has no metadata.expression (a reasoning-gym "
                             "arithmetic generator writes one)")
        chain = md.get("source_dataset") == CHAIN_NAME
        steps = chain_steps(expression) if chain else [Step(expression, calculator(expression))]
        result = steps[-1].value
        if result != str(row["answer"]).strip():
            continue
        turns = []
        for step in steps:
            turns += [{"role": "assistant", "content": call_text(step.expression)},
                      tool_message(step.value, "calculator")]
        out.append({"messages": [dict(m) for m in row["prompt"]] + turns +
                    [{"role": "assistant", "content": f"<answer>{result}</answer>"}]})
    return out


# ---- the chained variant (dataset "chain_arithmetic") ----

CHAIN_NAME = "chain_arithmetic"
CHAIN_EXAMPLE = ('\nFor example, for 3 + 4 * 2 write <tool_call>{"name": "calculator", "arguments": {"expression": '
                 '"4 * 2"}}</tool_call>, read 8, write <tool_call>{"name": "calculator", "arguments": {"expression": '
                 '"3 + 8"}}</tool_call>, read 11, then write <answer>11</answer>.')
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


@dataclass
class Step:
    """One calculator call of a transcript: the expression sent and the calculator's answer (text)."""
    expression: str
    value: str


def chain_steps(expression: str) -> list[Step]:
    """The one-operation calls that evaluate `expression`, in Python's evaluation order (operands left to
    right, an operation once both are known: '12 + 7 * 3 - 5' -> 7 * 3, 12 + 21, 33 - 5). Each result is
    the one-operation calculator's own answer, written into the next call as the model would copy it."""
    steps: list[Step] = []

    def walk(node) -> str:
        if not isinstance(node, ast.BinOp):
            return ast.unparse(node)  # a number, maybe signed
        a, b = walk(node.left), walk(node.right)
        text = f"{a} {_SYMBOL[type(node.op)]} {b}"
        steps.append(Step(text, one_operation_calculator(text)))
        return steps[-1].value

    walk(ast.parse(expression, mode="eval").body)
    return steps


def chain_expression(rng: random.Random, min_terms: int, max_terms: int, low: int, high: int, operators: str) -> str:
    """'a op b op c ...': min_terms..max_terms numbers from low..high, operators drawn from `operators`."""
    parts = [str(rng.randint(low, high))]
    for _ in range(rng.randint(min_terms, max_terms) - 1):
        parts += [rng.choice(operators), str(rng.randint(low, high))]
    return " ".join(parts)


def chain_rows(size: int, seed: int, instruction: str, **options) -> list[dict]:
    """`size` problems of a fixed draw: row i depends on (seed, i) alone, so a larger size extends a draw."""
    unknown = set(options) - set(CHAIN)
    if unknown:
        raise ValueError(f"{CHAIN_NAME}: unknown option(s) {sorted(unknown)} (options: {', '.join(CHAIN)})")
    opts = {**CHAIN, **options}
    rows = []
    for i in range(size):
        expression = chain_expression(random.Random(f"{CHAIN_NAME}:{seed}:{i}"), **opts)
        question = f"Calculate {expression}."
        rows.append({"prompt": [{"role": "user", "content": question + instruction}], "question": question,
                     "answer": calculator(expression),
                     "metadata": {"source_dataset": CHAIN_NAME, "expression": expression,
                                  "operations": len(expression.split()) // 2}})
    return rows


class ChainAccuracy:
    """1 when the model's own last <answer> tag holds the reference number (tool responses cut out first,
    so a calculator result the model never wrote in its answer earns nothing)."""
    metric = "accuracy"

    def __init__(self):
        self.__name__ = f"tool_arithmetic/{CHAIN_NAME}"

    def __call__(self, completions, answer, **_):
        tags = (last_tag(model_text(c)) for c in completions)
        return [1.0 if t is not None and same_number(t, str(a)) else 0.0 for t, a in zip(tags, answer)]


def chain_task(size: int = 2000, eval_size: int = 200, seed: int = 0, format_reward_weight: float = 0.0,
               example: bool = False, **options) -> Task:
    """The chained variant: held-out problems come from another seed, those whose question is also a
    training question dropped (as reasoning_gym.task does)."""
    tools = [Tool.from_callable(one_operation_calculator, name="calculator")]
    schemas = [t.schema for t in tools]
    instruction = CHAIN_INSTRUCTION + (CHAIN_EXAMPLE if example else "")
    train = chain_rows(size, seed, instruction, **options)
    seen = {r["question"] for r in train}
    held_out = [r for r in chain_rows(2 * eval_size, seed + 1_000_003, instruction, **options)
                if r["question"] not in seen][:eval_size]
    for row in train + held_out:
        row["prompt"] = with_tools_prompt(row["prompt"], schemas)
    funcs = [ChainAccuracy()] + ([format_reward] if format_reward_weight else [])
    weights = [1.0, format_reward_weight] if format_reward_weight else None
    t = Task(f"tool_arithmetic/{CHAIN_NAME}", train, held_out, funcs, weights)
    t.tools = tools
    return t

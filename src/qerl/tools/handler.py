"""The engine's multi-turn hook (`qerl.rollout.turns.TurnHandler` on main) built from tool environments.

One environment per (prompt, sample), reset with the prompt's dataset row on first use, so a
group's samples keep separate state. Each call to `respond` reads only the current model turn:
the tokens since the end of what this handler appended last time, so text a tool returned
earlier (an error quoting a call, say) is never taken for a new call.
"""

from __future__ import annotations

from typing import Callable

from .calls import HERMES, ToolCallFormat, tool_call_stop_strings
from .chat import tool_response_ids
from .env import ToolEnvironment
from .runner import ToolLimits


class ToolTurnHandler:
    def __init__(self, tokenizer, rows: list[dict], tools=(), *,
                 env_factory: Callable[[], ToolEnvironment] | None = None, limits: ToolLimits = ToolLimits(),
                 max_turns: int = 4, fmt: ToolCallFormat = HERMES):
        """rows[i]: the dataset row of prompt i (what `reset` sees). env_factory: builds a (stateful)
        environment per sample; default: a ToolEnvironment over `tools` with `limits`."""
        if max_turns < 0:
            raise ValueError(f"max_turns must be >= 0, got {max_turns}")
        self.tokenizer, self.rows, self.fmt = tokenizer, rows, fmt
        self.factory = env_factory or (lambda: ToolEnvironment(tools, limits, fmt))
        self.stop, self.max_turns = tool_call_stop_strings(fmt), max_turns
        self.envs: dict[tuple[int, int], ToolEnvironment] = {}
        self.turn_start: dict[tuple[int, int], int] = {}
        self.calls = 0  # tool calls answered (for the rollout's tool-call metrics)

    def env(self, prompt_index: int, sample_index: int) -> ToolEnvironment:
        key = (prompt_index, sample_index)
        if key not in self.envs:
            env = self.factory()
            env.reset(self.rows[prompt_index])
            self.envs[key] = env
        return self.envs[key]

    def respond(self, prompt_index: int, sample_index: int, token_ids: list[int], text: str) -> list[int] | None:
        key = (prompt_index, sample_index)
        turn = self.tokenizer.decode(token_ids[self.turn_start.get(key, 0):], skip_special_tokens=True)
        msgs = self.env(prompt_index, sample_index).respond(turn)
        if not msgs:  # a closing marker without a complete call: the sample ends here
            return None
        ids = tool_response_ids(self.tokenizer, msgs)
        self.turn_start[key] = len(token_ids) + len(ids)
        self.calls += len(msgs)
        return ids

"""The engine's multi-turn hook (`qerl.rollout.turns.TurnHandler` on main) built from tool environments.

One environment per (prompt, sample), reset with the prompt's dataset row on first use, so a
group's samples keep separate state. Each call to `respond` reads only the current model turn:
the tokens since the end of what this handler appended last time, so text a tool returned
earlier (an error quoting a call, say) is never taken for a new call.

A user's environment (`environment_factory`) runs under the tools' limits: building it, `reset` and
`respond` each get `limits.timeout_s` of wall time, and so does turning its answer into text (a
message whose `__str__` is slow held the rollout past the limit); a turn's answer is at most
MAX_MESSAGES messages and `limits.max_output_chars` characters in all (10,000 messages of 35
characters each were 350k characters under a limit of 100), and its exceptions (or an answer that is
not a list of messages) become error text for the model. An environment that timed out or failed to
start answers nothing more: its sample ends.
"""

from __future__ import annotations

import json
import threading
from typing import Callable

from .calls import HERMES, ToolCallFormat, tool_call_stop_strings
from .chat import tool_message, tool_response_ids
from .env import ToolEnvironment
from .runner import ToolLimits, call_with_deadline, safe_text

MAX_MESSAGES = 16  # messages in one turn's answer; more are dropped, with a note saying how many


class _NotMessages(ValueError):
    pass


def as_messages(res, max_chars: int, who: str = "the environment") -> list[dict]:
    """An environment's answer as tool messages: text, None, or a list of {"content": ...} dicts whose other
    fields JSON can hold, bounded to MAX_MESSAGES messages and `max_chars` characters in all. _NotMessages
    (naming `who`, and the message and field at fault) for anything else."""
    if res is None:
        return []
    if isinstance(res, str):  # one answer as plain text: a tool message
        res = [tool_message(res)]
    if not isinstance(res, list) or not all(isinstance(m, dict) and "content" in m for m in res[:MAX_MESSAGES + 1]):
        raise _NotMessages(f"Error: {who} answered {type(res).__name__} {safe_text(res, 100)!r}, "
                           "not a list of messages")
    out, left = [], max_chars
    for i, m in enumerate(res[:MAX_MESSAGES]):
        if left <= 0:
            break
        bad = unserializable_field(m)
        if bad is not None:  # the chat template and the tool-call text take fields as JSON: fail here, by name
            raise _NotMessages(f"Error: {who} answered a message (number {i}) whose field {bad[0]!r} holds "
                               f"{bad[1]}, which is not JSON-serializable")
        role = m.get("role", "tool")
        text = safe_text(m["content"], left)
        left -= min(len(text), left)
        out.append({**m, "role": role if isinstance(role, str) else "tool", "content": text})
    if len(out) < len(res):
        out.append(tool_message(f"[{len(res) - len(out)} more messages not shown: at most {MAX_MESSAGES} messages "
                                f"and {max_chars} characters a turn]"))
    return out


def unserializable_field(m: dict) -> tuple[str, str] | None:
    """(field, what its value is) of the first field besides role and content (those two are made text)
    that JSON cannot hold, else None."""
    for k, v in m.items():
        if k in ("role", "content"):
            continue
        try:
            json.dumps({k: v})
        except (TypeError, ValueError, RecursionError):  # a set, bytes, an object, a cycle, a tuple key
            return safe_text(k, 60), f"a value of type {type(v).__name__}"
    return None


class ToolTurnHandler:
    # The engine may run respond() for different samples on worker threads at once (rollout/turns.py):
    # each sample's state is its own; the shared counters and the tokenizer go under a lock (a fast
    # tokenizer used from two threads at once can fail), the tool calls themselves do not.
    concurrent = True

    def __init__(self, tokenizer, rows: list[dict], tools=(), *,
                 env_factory: Callable[[], ToolEnvironment] | None = None, limits: ToolLimits = ToolLimits(),
                 max_turns: int = 4, fmt: ToolCallFormat = HERMES):
        """rows[i]: the dataset row of prompt i (what `reset` sees). env_factory: builds a (stateful)
        environment per sample; default: a ToolEnvironment over `tools` with `limits`."""
        if max_turns < 0:
            raise ValueError(f"max_turns must be >= 0, got {max_turns}")
        self.tokenizer, self.rows, self.fmt = tokenizer, rows, fmt
        self.factory = env_factory or (lambda: ToolEnvironment(tools, limits, fmt))
        self.limits = limits
        self.broken: set[tuple[int, int]] = set()  # environments that failed or timed out: their samples end
        self.env_errors = 0  # environment failures answered as error text
        self.stop, self.max_turns = tool_call_stop_strings(fmt), max_turns
        self.envs: dict[tuple[int, int], ToolEnvironment] = {}
        self.turn_start: dict[tuple[int, int], int] = {}
        self.calls = 0  # tool calls answered (for the rollout's tool-call metrics)
        self._lock = threading.Lock()

    def env(self, prompt_index: int, sample_index: int) -> ToolEnvironment:
        key = (prompt_index, sample_index)
        if key not in self.envs:
            env = self.factory()
            env.reset(self.rows[prompt_index])
            self.envs[key] = env
        return self.envs[key]

    def _guarded(self, what: str, func):
        ok, res = call_with_deadline(func, self.limits.timeout_s, what)
        if not ok:
            with self._lock:
                self.env_errors += 1
        return ok, res

    def _messages(self, key, turn: str) -> tuple[list[dict], bool]:
        """(messages answering the turn, whether the environment still works)."""
        if key not in self.envs:
            ok, env = self._guarded("building the environment", self.factory)
            if ok:
                row = self.rows[key[0]]
                ok, err = self._guarded("the environment's reset", lambda: env.reset(row))
                env = env if ok else err
            if not ok:
                return [tool_message(f"{env} (the environment could not start)")], False
            self.envs[key] = env
        env = self.envs[key]
        if isinstance(env, ToolEnvironment) and type(env).respond is ToolEnvironment.respond:
            return env.respond(turn), True  # its tools' and steps' calls run under the limits already
        cap = self.limits.max_output_chars

        def answer():  # the answer and its conversion to text, both under the time limit
            try:
                return True, as_messages(env.respond(turn), cap, f"the environment {type(env).__name__}")
            except _NotMessages as e:
                return False, str(e)

        ok, res = self._guarded("the environment's respond", answer)
        if ok:
            ok, res = res
            if not ok:
                with self._lock:
                    self.env_errors += 1
        if not ok:
            return [tool_message(str(res))], False
        return res, True

    def respond(self, prompt_index: int, sample_index: int, token_ids: list[int], text: str) -> list[int] | None:
        key = (prompt_index, sample_index)
        if key in self.broken:
            return None
        with self._lock:
            turn = self.tokenizer.decode(token_ids[self.turn_start.get(key, 0):], skip_special_tokens=True)
        msgs, works = self._messages(key, turn)
        if not works:
            self.broken.add(key)
        if not msgs:  # a closing marker without a complete call: the sample ends here
            return None
        with self._lock:
            ids = tool_response_ids(self.tokenizer, msgs)
            self.calls += len(msgs)
        self.turn_start[key] = len(token_ids) + len(ids)
        return ids

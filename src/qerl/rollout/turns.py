"""Multi-turn rollouts: what the engine asks of whoever runs the tools.

A model turn ends when the completion's text since the last tool output contains one of
`stop` (e.g. "</tool_call>"). The engine then calls `respond` with the completion so far; the
handler runs the tool (under its own limits) and returns the token ids to append (the tool's
output, formatted as the chat template wants), or None to end the sample there. The engine
appends them into the same KV slot and decoding resumes, up to `max_turns` tool turns; the
group's other samples keep decoding meanwhile. Appended tokens carry logprob 0 and are listed
in `Completion.tool_spans`, so the loss can leave them out while rewards see the whole text.

The answers found at one sync are appended in one forward. A handler whose `respond` may run
on several threads at once says so with `concurrent = True`: each call then runs on a worker
while the other samples decode, and its sample resumes at the next sync (a point fixed by the
schedule, not by the tool's speed, so a rollout stays reproducible).
"""

from __future__ import annotations

from typing import Protocol


class TurnHandler(Protocol):
    stop: list[str]
    max_turns: int
    # optional: concurrent = True where respond() is thread-safe (calls for different samples at once)

    def respond(self, prompt_index: int, sample_index: int, token_ids: list[int], text: str) -> list[int] | None:
        """Tokens to append after the model's turn (token_ids / text: the completion so far, ending
        with the stop string), or None to finish the sample."""

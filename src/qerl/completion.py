"""A completion: one sampled answer to a prompt, as the rollout engine returns it and the policy update
trains on it (train/batch.py; SFT lays its examples out as completions, sft/batch.py). No dependencies, so
a module that only reads or builds completions does not load the rollout engine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token, under the distribution it was sampled from
    # eos | stop | length (cut at max_new_tokens or max_len: truncated) | limit (benchmarks: the sample's own
    # SamplingParams.sample_max_new_tokens ended it, as if it had ended by itself; not truncated)
    finish_reason: str
    text: str | None = None
    tool_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of tool tokens (logprob 0)

    def model_token_mask(self) -> list[bool]:
        """True for the tokens the model sampled; False for tool output appended between turns."""
        m = [True] * len(self.token_ids)
        for a, b in self.tool_spans:
            m[a:b] = [False] * (b - a)
        return m

"""SFT examples as the update's batch: each example a "completion" of the tokens its micro-batch shares.

The policy update (train/update.py) trains on completions after a prompt, with a loss mask. An
example becomes one: its "prompt" is the leading tokens every example of its micro-batch shares
(a chat template's system turn, a tool offer; at least the first token, never a trained one), its
"completion" the rest, and its untrained tokens (a user turn, a tool's answer) are spans left out
of the loss as tool output is in multi-turn RL. With packing, train/packing.py then lays a
micro-batch's examples end to end in one row after the shared tokens, each example attending
only to them and to itself, positions continuing from them: the logprobs of separate rows with
no padding and the shared part computed once. Examples that share no first token get rows of
their own.

The loss (sft/loss.py) reads only each token's log-probability and the loss mask: the advantages (1)
and the rollout logprobs (0) of the batch are placeholders of the update's batch type.
"""

from __future__ import annotations

import torch

from ..completion import Completion
from ..train.batch import RolloutBatch
from .data import Example


def shared_prefix(examples: list[Example]) -> int:
    """Leading tokens all examples share, cut before any example's first trained token (at least 1)."""
    n = min(e.first_trained for e in examples)
    first = examples[0].ids
    for e in examples[1:]:
        k = 0
        while k < n and e.ids[k] == first[k]:
            k += 1
        n = k
    return max(1, n)


def untrained_spans(trained: list[bool]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, t in enumerate(trained + [True]):
        if not t and start is None:
            start = i
        elif t and start is not None:
            spans.append((start, i))
            start = None
    return spans


def sft_batch(examples: list[Example], micro_batch_size: int) -> RolloutBatch:
    """The update's batch; micro-batches are its consecutive slices of micro_batch_size, as the update cuts them.
    Within a slice, examples with the same first token are placed together so they share a row."""
    comps = []
    for s in range(0, len(examples), micro_batch_size):
        part = examples[s:s + micro_batch_size]
        for first in dict.fromkeys(e.ids[0] for e in part):  # first-token groups, in order of appearance
            group = [e for e in part if e.ids[0] == first]
            p = shared_prefix(group)
            for e in group:
                rest = e.ids[p:]
                comps.append(Completion(prompt_index=len(comps), sample_index=0, prompt_ids=e.ids[:p], token_ids=rest,
                                        logprobs=[0.0] * len(rest), finish_reason="eos",
                                        tool_spans=untrained_spans(e.trained[p:])))
    n = len(comps)
    return RolloutBatch(comps, torch.ones(n), torch.zeros(n, dtype=torch.bool))

"""TRL's mean_token_accuracy and eval loss for SFT: over the tokens in the loss, how often the policy's most
likely next token is the one in the data (and their mean negative log-likelihood), from one forward
without gradients. qerl's update computes log-probabilities in chunks without logits, so this is its own
forward: about a third of a step's compute."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenStats:
    correct: int = 0
    tokens: int = 0
    nll: float = 0.0

    @property
    def accuracy(self) -> float:
        return self.correct / self.tokens if self.tokens else float("nan")

    @property
    def loss(self) -> float:
        return self.nll / self.tokens if self.tokens else float("nan")


@torch.no_grad()
def token_stats(model, examples, device, micro_batch: int, pad_id: int = 0) -> TokenStats:
    """examples: sft.data.Example (ids, trained per token); right-padded micro-batches."""
    out = TokenStats()
    was_training = model.training
    model.eval()
    try:
        for s in range(0, len(examples), micro_batch):
            part = examples[s: s + micro_batch]
            T = max(len(e.ids) for e in part)
            ids = torch.full((len(part), T), pad_id, dtype=torch.long)
            mask = torch.zeros((len(part), T), dtype=torch.long)
            trained = torch.zeros((len(part), T), dtype=torch.bool)
            for i, e in enumerate(part):
                ids[i, :len(e.ids)] = torch.tensor(e.ids)
                mask[i, :len(e.ids)] = 1
                trained[i, :len(e.ids)] = torch.tensor(e.trained)
            ids, mask, trained = ids.to(device), mask.to(device), trained.to(device)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            target, keep = ids[:, 1:], trained[:, 1:]
            out.correct += int(((logits.argmax(-1) == target) & keep).sum())
            out.tokens += int(keep.sum())
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
            out.nll += float(nll[keep].sum())
    finally:
        model.train(was_training)
    return out

"""The order in which the training rows are drawn: seeded, shuffled per epoch, checkpointed."""

from __future__ import annotations

import random


class PromptSampler:
    """Seeded epoch-wise shuffled order over the training rows; its position is checkpointed."""

    def __init__(self, n: int, seed: int, epoch: int = 0, pos: int = 0):
        if n == 0:
            raise ValueError("the training set is empty")
        self.n, self.seed, self.epoch, self.pos = n, seed, epoch, pos
        self._perm()

    def _perm(self):
        self.order = list(range(self.n))
        random.Random(self.seed * 7919 + self.epoch).shuffle(self.order)

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm()
            out.append(self.order[self.pos])
            self.pos += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

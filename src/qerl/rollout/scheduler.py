"""Which sequence sits in which cache slot: admission, retirement and compaction, in plain Python.

The scheduler never touches a tensor (the runner does); it decides, the engine's loop carries it out:
  admit()      waiting samples into free slots, lowest first, each told where its prompt's K/V
               comes from: a sibling in flight (copy) or a prefill, grouped per prompt, so a
               group's prompt is prefilled once and shared by its samples
  retire(s)    frees finished slots
  compaction() moves the highest live slots into the lowest holes, so the decode batch bucket
               (the slots [0, B) a step runs) can shrink as sequences finish
"""

from __future__ import annotations

from dataclasses import dataclass, field

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass
class Sequence:
    prompt: int  # index into the rollout's prompts
    sample: int  # 0..n-1 within its prompt's group
    length: int  # prompt tokens
    turns: int = 0  # tool turns taken (multi-turn rollouts)
    turn_start: int = 0  # completion tokens before the current model turn
    tool_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of appended tool tokens
    scanned: int = 0  # completion tokens already searched for stop strings


@dataclass
class Admission:
    slots: list[int]  # newly filled slots, in admission order
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # (src slot, dst slot, prompt tokens)
    prefill: dict[int, list[int]] = field(default_factory=dict)  # prompt -> slots that need its prefill


class Scheduler:
    def __init__(self, n_slots: int, prompt_lengths: list[int], n: int):
        self.n_slots = n_slots
        self.lengths = prompt_lengths
        self.slots: list[Sequence | None] = [None] * n_slots
        self.waiting = [(i, j) for i in range(len(prompt_lengths)) for j in range(n)]
        self.waiting.reverse()  # pop() from the end = in order
        self.left = {i: n for i in range(len(prompt_lengths))}  # samples of each prompt not yet admitted
        self.prefilled: set[int] = set()  # prompts whose first-token logits the runner holds

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def admit(self) -> Admission:
        free = [i for i, s in enumerate(self.slots) if s is None]
        adm = Admission([])
        while free and self.waiting:
            i, j = self.waiting.pop()
            s = free.pop(0)
            self.slots[s] = Sequence(i, j, self.lengths[i])
            adm.slots.append(s)
        new = set(adm.slots)
        for s in adm.slots:
            pi = self.slots[s].prompt
            src = next((k for k, o in enumerate(self.slots) if o is not None and o.prompt == pi and k not in new
                        and pi in self.prefilled), None)
            if src is not None:
                adm.copies.append((src, s, self.lengths[pi]))
            else:
                adm.prefill.setdefault(pi, []).append(s)
        self.prefilled.update(adm.prefill)
        for s in adm.slots:
            self.left[self.slots[s].prompt] -= 1
        return adm

    def released_prompts(self) -> list[int]:
        """Prompts all of whose samples are in flight: their first-token logits are no longer needed."""
        gone = [p for p in self.prefilled if self.left[p] == 0]
        self.prefilled.difference_update(gone)
        return gone

    def high(self) -> int:
        """One past the highest live slot."""
        return max(i for i, s in enumerate(self.slots) if s is not None) + 1

    def bucket(self) -> int:
        """The decode batch: the smallest bucket that covers every live slot."""
        hi = self.high()
        return min(next((x for x in BUCKETS if x >= hi), self.n_slots), self.n_slots)

    def live(self, hi: int | None = None) -> list[int]:
        return [i for i, s in enumerate(self.slots[:hi]) if s is not None]

    def retire(self, slots: list[int]) -> list[Sequence]:
        out = [self.slots[s] for s in slots]
        for s in slots:
            self.slots[s] = None
        return out

    def compaction(self) -> list[tuple[int, int]]:
        """(src, dst) moves, applied in order, that leave the live slots at [0, count)."""
        moves = []
        while True:
            holes = [i for i, s in enumerate(self.slots) if s is None]
            live = [i for i, s in enumerate(self.slots) if s is not None]
            if not holes or not live or holes[0] > live[-1]:
                return moves
            src, dst = live[-1], holes[0]
            self.slots[dst], self.slots[src] = self.slots[src], None
            moves.append((src, dst))

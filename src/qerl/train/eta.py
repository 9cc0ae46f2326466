"""The whole run's time left, from measured step times.

A step's time is the wall time from one step's end to the next (so the checkpoints and evaluations
that come with the steps are counted in). Costs a step row reports under a `time_<name>` that do not
come every step (the parity check: at the start and every parity_check_steps) are taken out of the
step's time and counted once per remaining occurrence instead, at their last measured cost. The
first step also pays one-off costs no row names (warm-up, graph capture): once a later step is
measured, the estimate uses the later steps only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


def clock_text(seconds: float) -> str:
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m:02d}:{s % 60:02d}"


@dataclass(frozen=True)
class Remaining:
    seconds: float
    steps: int
    per_step: float              # the measured time of a usual step
    occasional: dict[str, float]  # time_<name> -> the seconds its remaining occurrences add
    first_extra: float           # one-off costs the first step paid (its named occasional costs)

    def short(self) -> str:
        return clock_text(self.seconds)

    def line(self) -> str:
        """The line said after the first step."""
        extra = f" ({self.first_extra:.1f} s of it {', '.join(self._names())})" if self.first_extra else ""
        more = "".join(f" + {v:.0f} s of {k[5:]}" for k, v in self.occasional.items() if v)
        return (f"the first step took {self.per_step + self.first_extra:.1f} s{extra}; estimated time left "
                f"{self.short()} ({self.steps} step{'s' * (self.steps != 1)} x {self.per_step:.1f} s{more})")

    def _names(self) -> list[str]:
        return [k[5:] for k in self.occasional] or ["start-up checks"]


@dataclass
class RunClock:
    """max_steps: the run's last step (the loop's own count); left_of: time_<name> -> (step -> how many
    more times it comes in the steps from `step` on)."""
    max_steps: int
    left_of: dict[str, Callable[[int], int]] = field(default_factory=dict)
    now: Callable[[], float] = time.perf_counter
    steps: int = 0
    _start: float | None = None
    _times: list[float] = field(default_factory=list)  # each step's time without its occasional costs
    _cost: dict[str, float] = field(default_factory=dict)  # each occasional cost's last measured seconds

    def begin(self) -> None:
        """A step starts; the first call starts the clock (later steps run from the last step's end)."""
        if self._start is None:
            self._start = self.now()

    def step_done(self, step: int, row: dict) -> Remaining:
        """`step`: steps done so far (the loop's count); row: the step's metrics."""
        t = self.now()
        took, self._start = t - self._start, t
        named = {k: float(row[k]) for k in self.left_of if isinstance(row.get(k), (int, float))}
        self._cost.update(named)
        self._times.append(max(took - sum(named.values()), 0.0))
        self.steps += 1
        usual = self._times[1:] or self._times  # the first step's unnamed one-off costs, once others exist
        per_step = sum(usual) / len(usual)
        left = max(self.max_steps - step, 0)
        occasional = {k: self._cost.get(k, 0.0) * f(step) for k, f in self.left_of.items()}
        return Remaining(left * per_step + sum(occasional.values()), left, per_step, occasional,
                         sum(named.values()) if self.steps == 1 else 0.0)

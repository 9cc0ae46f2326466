"""Named, timed phases of a training step (as TRL's `profiling_context`).

Every phase of `GRPOTrainer.train_step` runs inside `profiler.phase(name)`; the seconds land in the
step's metrics as `time_<name>` and listeners (`qerl bench step` measures memory peaks per phase)
hear each phase start and end, so nothing has to patch the trainer to observe it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

Listener = Callable[[str, str], None]  # (phase name, "start" | "end")


class Profiler:
    def __init__(self):
        self.times: dict[str, float] = {}
        self.listeners: list[Listener] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a phase; a phase entered several times in a step (a resample round) adds up."""
        for f in self.listeners:
            f(name, "start")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0
            for f in self.listeners:
                f(name, "end")

    def take(self) -> dict[str, float]:
        """The phases timed since the last take, as metrics (`time_<name>`), and start afresh."""
        out = {f"time_{k}": v for k, v in self.times.items()}
        self.times = {}
        return out

"""What one training step's phases read besides the data: a frozen record made before the step runs.

The rollout and the update of a step are functions of this context and their explicit inputs (no
trainer object): its number, the AQN noise level and the seeds of its random streams, and which
adapter version samples its rollout. With max_staleness 0 that version is the step's own; with 1
the rollout of step k+1 samples from version k while step k's update makes version k+1.
"""

from __future__ import annotations

from dataclasses import dataclass


def step_seed(seed: int, step: int) -> int:
    """The base seed of a step's streams: sampling (per round: + round index) and AQN noise."""
    return seed * 1_000_003 + step * 101


@dataclass(frozen=True)
class StepContext:
    step: int             # the step whose batch this is (0-based)
    sigma: float          # AQN noise of the step's rollout (and of its update with aqn_in_training)
    stage: int            # AQN stage of the schedule (adaptive: 1)
    seed: int             # step_seed(cfg.seed, step)
    adapter_version: int  # the adapter that samples the rollout: the number of steps it has been trained

    @property
    def staleness(self) -> int:
        """How many adapter versions the rollout's sampler lags behind the policy the update starts from."""
        return self.step - self.adapter_version

"""Where each step's rollouts come from: one object that hands them out, synchronous or one step ahead.

max_staleness 0: `ahead` is False and the trainer collects each step's rollout when the step starts.
max_staleness 1: the rollout of step k+1 is launched (`launch`) from adapter k, copied into the engine's
snapshot, while step k's update trains (rl/staleness.py); `take` hands it to step k+1, launching it
first where none is in flight (the run's first step, or the first after a resume, which relaunches
the checkpoint's own in-flight rollout from its saved adapter). A checkpoint records what launches the
rollout in flight again (`record`); nothing here touches the trainer: it is given functions that make a
step's context, the rollout inputs and the collection, and the sampler's position.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..train.profiling import Profiler
from .staleness import ROLLOUT_ADAPTER, InFlight
from .step_context import StepContext


class RolloutSource:
    def __init__(self, snapshot, *, context: Callable, inputs: Callable, collect: Callable,
                 sampler_state: Callable[[], dict], warm: Callable[[], None], threaded: bool, device):
        """snapshot: the engine's AdapterSnapshot (max_staleness 1) or None; context(step, version) ->
        StepContext; inputs(profiler) -> RolloutInputs; collect(ctx, inputs) -> StepRollouts;
        sampler_state() -> the prompt sampler's position; warm(): capture the decode graphs before the
        first overlapped rollout (a GPU); threaded: the rollout runs on a worker thread (one rank)."""
        self.snapshot = snapshot
        self.context, self.inputs, self.collect = context, inputs, collect
        self.sampler_state, self.warm, self.threaded, self.device = sampler_state, warm, threaded, device
        self.in_flight: InFlight | None = None
        self.relaunch: tuple[StepContext, dict] | None = None  # a resumed checkpoint's in-flight rollout
        self.resumed_from = None  # its folder, for messages
        self._warm = False

    @property
    def ahead(self) -> bool:
        """Rollouts run one step ahead (max_staleness 1)."""
        return self.snapshot is not None

    def launch(self, step: int, version: int, ctx: StepContext | None = None) -> InFlight:
        """Start `step`'s rollout from the current adapter (copied into the snapshot as `version`), or from
        the adapter already in it when `ctx` is given (a resume)."""
        if ctx is None:
            self.snapshot.refresh(version)
            ctx = self.context(step, version)
        prof = Profiler()  # the worker's own: the main thread's profiler times the update meanwhile
        inputs = self.inputs(prof)  # fixed at launch
        data = self.sampler_state()
        if self.threaded and self.device.type == "cuda" and not self._warm:
            self.warm()
            self._warm = True

        def run():
            ro = self.collect(ctx, inputs)
            return ro, prof.take()

        self.in_flight = InFlight(ctx, data, run, self.threaded, self.device)
        return self.in_flight

    def take(self, step: int, version: int):
        """(step's rollouts, the worker's phase times): the one in flight, launched now if none is."""
        if self.in_flight is None:
            self._relaunch_or_launch(step, version)
        fl, self.in_flight = self.in_flight, None
        return fl.result()

    def _relaunch_or_launch(self, step: int, version: int) -> InFlight:
        if self.relaunch is None:
            return self.launch(step, version)
        (ctx, tensors), self.relaunch = self.relaunch, None
        if ctx.step != step:
            raise ValueError(f"{self.resumed_from}: its in-flight rollout is for step {ctx.step}, the run is at {step}")
        self.snapshot.load(tensors, ctx.adapter_version, where=f"{self.resumed_from}/{ROLLOUT_ADAPTER}.safetensors")
        return self.launch(ctx.step, version, ctx)

    def sync(self, version: int) -> None:
        """Let the engine sample from the live adapter now (parity checks, evaluation), after any rollout in
        flight has finished with the snapshot."""
        if self.snapshot is None:
            return
        if self.in_flight is not None:
            self.in_flight.result()  # kept for its step; the snapshot is free once it is done
        self.snapshot.refresh(version)

    def close(self) -> None:
        """Let a rollout in flight finish and drop it."""
        if self.in_flight is not None:
            self.in_flight.wait_quietly()
            self.in_flight = None

    def wait_quietly(self) -> None:
        """Let a rollout in flight finish, keeping it (a later step joins its result)."""
        if self.in_flight is not None:
            self.in_flight.wait_quietly()

    def record(self) -> tuple[dict | None, dict | None, dict | None]:
        """(the sampler position before the in-flight rollout's draws, its checkpoint record, its adapter
        tensors), or Nones: what a checkpoint holds to launch it again."""
        fl = self.in_flight
        if fl is not None:
            return fl.data, fl.record(), {ROLLOUT_ADAPTER: self.snapshot.tensors()}
        if self.relaunch is not None:  # resumed and saved again before its first step
            return None, {"ctx": dataclasses.asdict(self.relaunch[0])}, {ROLLOUT_ADAPTER: self.relaunch[1]}
        return None, None, None

    def restore(self, in_flight: tuple[StepContext, dict] | None, folder) -> None:
        """A resumed checkpoint's in-flight rollout, launched again by the next step (max_staleness 1);
        with max_staleness 0 now the sampler stands before its draws and the current adapter redraws it."""
        self.relaunch = in_flight if self.snapshot is not None else None
        self.resumed_from = folder

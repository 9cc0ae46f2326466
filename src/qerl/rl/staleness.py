"""Bounded staleness (max_staleness 1): the rollout of step k+1 runs while step k's update trains.

    step k:  join R_k  ->  advantages, metrics  ->  snapshot <- adapter k; launch R_k+1  ->  update k (k -> k+1)

R_k+1 samples from the engine's `AdapterSnapshot` (adapter version k) while the update steps the live
adapter, so it is exactly the rollout a sequential run would draw with adapter k before updating: the
behaviour logprobs the engine records are the update's old logprobs, and the clipping and
importance-sampling correction apply unchanged. The step's rollout metrics carry `staleness`.

`InFlight` runs the collection on a worker thread (a side CUDA stream on a GPU), or, where two
threads cannot share the work (several ranks: the rollout's collectives must not interleave with the
update's), when it is joined. Either way the result is the same: nothing the rollout reads changes
while it runs (the snapshot, its own AQN noise on the snapshot's norms, the prompt sampler, which only
it touches until joined; the kernel settings, kernels/settings.py, are per thread: the worker runs
in a copy of the launching thread's, so the update entering `unfused_lora` does not reach it).

A checkpoint written with a rollout in flight stores what regenerates it deterministically, not the
batch: the snapshot's adapter (`rollout_adapter.safetensors`), and in trainer_state.json the step
context (`InFlight.record`) and, as the data position, the prompt sampler's before its first draw.
Resuming loads them and the next step launches the same rollout again (on the CPU sampling is keyed
per prompt and sample, so its tokens are the same bit for bit; on a GPU the rollout reseeds the
default CUDA generator and replays the same graphs, which should give the same draws: not yet
verified on a GPU. There the update must draw nothing from that generator: no lora_dropout).
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
from typing import Callable

import torch

from ..kernels import dispatch
from .step_context import StepContext

ROLLOUT_ADAPTER = "rollout_adapter"  # checkpoint file (.safetensors) of the in-flight rollout's adapter


class InFlight:
    """One step's rollout collection, started now and joined later (`result`)."""

    def __init__(self, ctx: StepContext, data: dict, run: Callable[[], object], threaded: bool,
                 device: torch.device):
        self.ctx, self.data = ctx, data  # data: the prompt sampler's state before the rollout's first draw
        self._run, self._value, self._error, self._done = run, None, None, False
        self._thread = None
        # on the CPU the rollout folds adapters into dequantized copies held in dispatch's cache: keep it
        # open from the launching thread until the join, so no thread closes it under the other
        self._cache = dispatch.dequantized_cache() if threaded and device.type == "cpu" else None
        if self._cache is not None:
            self._cache.__enter__()
        self._stream = None
        if threaded:
            if device.type == "cuda":
                # the rollout's kernels on their own stream, after what the main stream queued (the snapshot copy)
                self._stream = torch.cuda.Stream(device)
                self._stream.wait_stream(torch.cuda.current_stream(device))
            # the launching thread's context (its kernel settings as they are now) for the worker
            here = contextvars.copy_context()
            self._thread = threading.Thread(target=here.run, args=(self._work,), name=f"qerl-rollout-{ctx.step}",
                                            daemon=True)
            self._thread.start()

    def _work(self):
        try:
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    self._value = self._run()
                self._stream.synchronize()
            else:
                self._value = self._run()
        except BaseException as e:  # noqa: BLE001 - handed to the joining thread
            self._error = e
        self._done = True

    def result(self):
        """Wait for the rollout (or run it here when it has no thread); its error is raised here."""
        if self._thread is not None:
            self._thread.join()
            self._close_cache()
        elif not self._done:
            self._work()
        if self._error is not None:
            raise self._error
        return self._value

    def wait_quietly(self) -> None:
        """Let a running rollout finish (a trainer stopping on an error elsewhere); its outcome is dropped."""
        if self._thread is not None:
            self._thread.join()
            self._close_cache()

    def _close_cache(self) -> None:
        if self._cache is not None:
            self._cache.__exit__(None, None, None)
            self._cache = None

    def record(self) -> dict:
        """What a checkpoint stores to launch this rollout again (see the module docstring)."""
        return {"ctx": dataclasses.asdict(self.ctx)}


def context_of(record: dict, where: str) -> StepContext:
    try:
        return StepContext(**record["ctx"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{where}: its in-flight rollout record is not what qerl writes ({e})") from None

"""Data parallelism for the trainer over torch.distributed: NCCL on GPUs, gloo on the CPU.

    torchrun --nproc_per_node 8 -m qerl.cli train my.yaml

Each rank holds the quantized base and the adapter, rolls out its contiguous share of the step's
prompts (a group never spans ranks, so group statistics stay local and exact), and averages the
adapter gradients once per optimizer update. Why not DDP's wrapper: the trainer's forward runs
through the model's inner modules (the body, then the lm_head in checkpointed chunks) and the
rollout engine calls the same modules directly, so a DDP wrapper around the model would see
neither; an all-reduce of the flattened adapter gradients per update is what DDP's reducer would
do, without its overlap of communication and backward (at LoRA sizes: one ~0.1-1 GB buffer per
update). With world size 1 every collective here is a no-op: one code path.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


TORCHRUN_VARS = ("RANK", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets beside WORLD_SIZE (LOCAL_RANK: 0 unset)


def world_size() -> int:
    """torchrun's WORLD_SIZE (1 unset), checked with what joining its process group needs: a WORLD_SIZE above 1
    without RANK, MASTER_ADDR and MASTER_PORT (a variable left in the shell, not torchrun's) is one line naming
    what is missing and the fix, where it was `KeyError: 'RANK'`. The one reader of the variables: the trainer's
    ranks (Dist.from_env), qerl.trl's step counts and `qerl train` of a TRL file."""
    text = os.environ.get("WORLD_SIZE", "").strip()
    if not text:
        return 1
    unset = "unset WORLD_SIZE to train in one process"
    try:
        world = int(text)
    except ValueError:
        raise ValueError(f"environment variable WORLD_SIZE={text!r} is not a number of processes: launch with "
                         f"torchrun --nproc_per_node N (it sets it), or {unset}") from None
    if world < 1:
        raise ValueError(f"environment variable WORLD_SIZE={text!r} must be >= 1: launch with torchrun "
                         f"--nproc_per_node N, or {unset}")
    if world == 1:
        return 1
    missing = [v for v in TORCHRUN_VARS if not os.environ.get(v, "").strip()]
    if missing:
        raise ValueError(f"environment variable WORLD_SIZE={world} is set but {', '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not (torchrun sets them all): launch with "
                         f"torchrun --nproc_per_node {world} ..., or {unset}")
    for name, top in (("RANK", world), ("LOCAL_RANK", None)):
        value = os.environ.get(name, "0").strip() or "0"
        if not value.isdigit() or (top is not None and int(value) >= top):
            bound = f" below WORLD_SIZE={world}" if top is not None else ""
            raise ValueError(f"environment variable {name}={value!r} must be a whole number >= 0{bound}: launch "
                             f"with torchrun --nproc_per_node {world} ..., or {unset}")
    return world


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device_type: str, timeout_s: float = 1800, backend: str | None = None) -> "Dist":
        """Join the process group torchrun describes (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_*); a
        collective that waits longer than timeout_s (a rank died or hangs) raises instead of hanging."""
        world = world_size()
        if world == 1:
            return cls()
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0").strip() or "0")
        if device_type == "cuda":
            torch.cuda.set_device(local)
        if not dist.is_initialized():
            dist.init_process_group(backend or ("nccl" if device_type == "cuda" else "gloo"),
                                    timeout=datetime.timedelta(seconds=timeout_s))
        return cls(rank, world, local)

    # ---- data ---------------------------------------------------------------------------------
    def shard(self, items: list) -> tuple[int, list]:
        """(offset, this rank's contiguous share) of a list whose length the world size divides."""
        if len(items) % self.world:
            raise ValueError(f"{len(items)} prompts cannot be split evenly over {self.world} ranks")
        k = len(items) // self.world
        return self.rank * k, items[self.rank * k:(self.rank + 1) * k]

    # ---- collectives (no-ops at world size 1) -------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
        return t

    def sum(self, x: float, device) -> float:
        return float(self.all_reduce(torch.tensor([float(x)], dtype=torch.float64, device=device)))

    def max(self, x: float, device) -> float:
        return float(self.all_reduce(torch.tensor([float(x)], dtype=torch.float64, device=device), "max"))

    def gather(self, obj) -> list:
        """Every rank's `obj` (small Python values: metrics), in rank order."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def broadcast_(self, tensors) -> None:
        """Rank 0's values into every rank's tensors (the adapters start identical, as DDP's do)."""
        if self.world > 1:
            for t in tensors:
                dist.broadcast(t.data, src=0)

    def mean_grads_(self, params) -> None:
        """Average the gradients of `params` over the ranks, in one flat all-reduce (a rank whose
        share of an update was empty contributes zeros)."""
        if self.world == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads]).float()
        dist.all_reduce(flat)
        flat /= self.world
        i = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[i:i + n].view_as(p).to(p.dtype)
            i += n

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()

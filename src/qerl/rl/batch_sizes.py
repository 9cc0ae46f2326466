"""TRL's batch semantics on any number of ranks.

`per_device_train_batch_size` is each rank's micro-batch; a generation (one step's rollouts) gives
each rank `steps_per_generation` micro-batches, so `generation_batch_size` (all ranks' completions
per step) defaults to per_device_train_batch_size x world size x steps_per_generation, and the
same config runs on 1, 2, 4 or 8 ranks. Set explicitly, it is a global size that must split over
the ranks into whole groups and whole optimizer updates; the error lists values that would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass



@dataclass(frozen=True)
class BatchPlan:
    world: int
    generation_batch_size: int  # completions per step, all ranks
    steps_per_generation: int   # micro-batches per rank per step
    prompts_per_rank: int
    updates_per_rank: int       # optimizer updates per step and iteration (the same on every rank)


def batch_plan(cfg, world: int = 1) -> BatchPlan:
    mb, ga, G = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, cfg.num_generations
    gbs, spg = cfg.generation_batch_size, cfg.steps_per_generation
    if gbs is None:
        spg = spg or ga  # TRL's default: one optimizer update per generation
        gbs = mb * world * spg
    elif spg is not None and gbs != mb * world * spg:
        raise ValueError(f"config fields 'generation_batch_size' and 'steps_per_generation' disagree on {world} "
                         f"rank(s): {gbs} != per_device_train_batch_size x world size x steps_per_generation "
                         f"({mb} x {world} x {spg} = {mb * world * spg}); set only one of them")
    per_rank = gbs // world
    if gbs % world or per_rank % G or per_rank % (mb * ga):
        raise ValueError(_cannot_split(cfg, gbs, world))
    spg = per_rank // mb
    return BatchPlan(world, gbs, spg, per_rank // G, spg // ga)


def _cannot_split(cfg, gbs: int, world: int) -> str:
    mb, ga, G = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps, cfg.num_generations
    unit = math.lcm(G, mb * ga)  # a rank's completions must be a multiple of this
    set_gbs = cfg.generation_batch_size is not None
    what = (f"generation_batch_size {gbs}" if set_gbs else
            f"generation_batch_size = per_device_train_batch_size x world size x steps_per_generation = "
            f"{mb} x {world} x {gbs // (mb * world)} = {gbs}")
    msg = (f"config field '{'generation_batch_size' if set_gbs else 'steps_per_generation'}': {what} completions "
           f"cannot split over {world} rank(s): each rank's share must be whole groups of num_generations ({G}) "
           f"and whole optimizer updates of per_device_train_batch_size x gradient_accumulation_steps ({mb} x {ga}). ")
    fixes = []
    if set_gbs:
        lo, hi = (gbs // (unit * world)) * unit * world, -(-gbs // (unit * world)) * unit * world
        fixes.append("generation_batch_size " + " or ".join(str(v) for v in sorted({lo, hi}) if v > 0))
        fixes.append("no generation_batch_size (TRL's default: per_device_train_batch_size x world size x "
                     "steps_per_generation)")
    else:
        spg = gbs // (mb * world)
        ok = [s for s in range(ga, 16 * ga + 1, ga) if (mb * s) % G == 0]
        if ok:
            near = sorted(ok, key=lambda s: abs(s - spg))[:2]
            fixes.append("steps_per_generation " + " or ".join(str(s) for s in near))
    if set_gbs:  # the share is fixed: micro-batch sizes that cut it into whole updates
        share = gbs // world if gbs % world == 0 and (gbs // world) % G == 0 else 0
        mbs = [d for d in range(1, share + 1) if share % (d * ga) == 0]
    else:  # the share is per_device_train_batch_size x steps_per_generation
        spg = gbs // (mb * world)
        mbs = [d for d in range(1, 4 * mb + 1) if (d * spg) % G == 0] if spg % ga == 0 else []
    if mbs:
        fixes.append("per_device_train_batch_size " +
                     " or ".join(str(d) for d in sorted(mbs, key=lambda d: (abs(d - mb), -d))[:2]))
    return msg + ("Values that split: " + "; or ".join(fixes) + "." if fixes else "")

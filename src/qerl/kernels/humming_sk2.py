"""humming's stream-K on a grid that cuts no output tile into more than two slices: bit-repeatable, as it is.

Why two slices repeat (humming-kernels 0.1.20, include/humming/epilogue/pipeline.cuh and gmem_writer.cuh). With TMA
stores (most of humming's sm_90 configs) the slices of a split tile meet through the tile's lock: slice 0 waits for
the lock at 0, *stores* its bf16 partial and sets the lock to 1 - count; every other slice waits until the lock is
negative, then reduce-adds its partial (TMA add) and adds 1 to the lock. With three or more slices the adds after the
store land in arrival order (a race: other bits each call, benchmarks/kernels.md). With two there is one store and
then one add: out = bf16(bf16(p0) + bf16(p1)) every time, whatever order the CTAs finish in. Configs without TMA stores (humming's
mma.sync configs at small M) take turns on the lock by slice id up to three slices (read, add, write back), and use
atomics above: three slices repeat there. No kernel change, no extra pass: only the grid (the config's `num_sms`)
decides how many slices a tile gets.

How many slices each tile gets follows from the grid, the M-block count and the tile alone: `schedule` ports
humming's scheduler (include/humming/scheduler.cuh: the constructor and get_streamk_next_block, sm_90, bf16
activations, so the stream-K block alignment is 1: NVFP4's weight scale group of 16 is shorter than any K block and
bf16 activations have no input scale; a format whose groups outgrow the K block would need it), and `sk2_grid` picks, per M-block count, the grid whose busiest
CTA runs the fewest K blocks among those that keep every tile at two slices or fewer. humming's own grid is kept where
it already does.

(The previous try, `humming_ordered` (a0f20a0, retired in 08ce8d3), allowed three slices, which needs TMA stores off
and the lock path that adds in slice order: 30-750x slower on the H100. Two slices need neither.)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

MAX_SLICES = 2          # with TMA stores: one store, then one add, a fixed order
MAX_SLICES_LOCKED = 3   # without: slices take turns by id up to 3 (atomics above)
STREAMK_MAX_M = 4096    # above this M every config runs without split (its tiles fill the card several times over)


def tma_stores(cfg: dict) -> bool:
    """Whether a config writes its output by TMA: use_tma_c, else use_tma, unset read as False (humming's
    TuningConfig.__post_init__, config/config.py)."""
    c = cfg.get("use_tma_c")
    return bool(cfg.get("use_tma") if c is None else c)


@dataclass(frozen=True)
class Tiling:
    """What humming's scheduler reads of a dense GEMM config: the problem, the block, the pipeline, the cluster."""

    n: int
    k: int
    block: tuple[int, int, int]  # (M, N, K) of one CTA's output tile and K step
    stages: int
    cluster_n: int = 1  # multi_cast_size_a (x the UMMA CTA group, 1 on sm_90): CTAs sharing A along N
    cluster_m: int = 1  # multi_cast_size_b
    ctas_per_sm: int = 1

    @classmethod
    def of(cls, cfg: dict, n: int, k: int) -> "Tiling":
        one = lambda key, default=1: int(cfg.get(key) or default)  # noqa: E731  (unset or None: humming's default)
        return cls(n, k, tuple(cfg["block_shape"]), one("num_stages", 2),
                   one("multi_cast_size_a") * one("umma_cta_group_size"), one("multi_cast_size_b"),
                   one("num_ctas_per_sm"), tma_stores(cfg))

    tma_stores: bool = True

    @property
    def max_ordered_slices(self) -> int:
        return MAX_SLICES if self.tma_stores else MAX_SLICES_LOCKED

    @property
    def cluster(self) -> int:
        return self.cluster_n * self.cluster_m

    def groups(self, num_sms: int) -> int:
        """CTA groups (clusters) the launcher starts for a config's num_sms (its gridDim.x / cluster size)."""
        return self.ctas_per_sm * num_sms // self.cluster


@dataclass(frozen=True)
class Visit:
    """One CTA's share of one output tile: which tile, its slice (0 = the one that stores first), of how many."""

    cta: int
    tile: int
    k_first: int  # first K block of the share
    k_blocks: int
    slice_id: int
    slice_count: int


@dataclass(frozen=True)
class Schedule:
    visits: tuple[Visit, ...]  # the stream-K shares, in CTA order (data-parallel whole tiles not listed)
    dp_tiles_per_cta: int      # whole tiles each CTA runs before its stream-K share
    streamk_iters: int         # K blocks of each CTA's stream-K share (the last CTAs may get fewer)
    k_blocks: int              # K blocks of one tile

    @property
    def max_slices(self) -> int:
        return max((v.slice_count for v in self.visits), default=1)

    @property
    def cta_iters(self) -> int:
        """K blocks the busiest CTA runs: the launch's length in main-loop iterations."""
        return self.dp_tiles_per_cta * self.k_blocks + (self.streamk_iters if self.visits else 0)


def schedule(t: Tiling, m: int, groups: int) -> Schedule:
    """The stream-K partition humming's scheduler makes for M rows on `groups` CTA groups."""
    bm, bn, bk = t.block
    n_blocks = t.n // bn // t.cluster_n
    k_blocks = t.k // bk
    mn = math.ceil(m / (bm * t.cluster_m)) * n_blocks
    mnk = mn * k_blocks
    sk_mn = mn
    if mn > groups:  # whole waves run data-parallel; the remainder is shared, merged with one wave when small
        sk_mn = mn % groups
        if sk_mn and sk_mn * 10 <= groups:
            sk_mn += groups
    dp = (mn - sk_mn) // groups
    total = math.ceil(sk_mn * k_blocks / groups)
    total = max(total, math.ceil((k_blocks - 1) / 9))  # kMaxSlices = 10
    total = t.stages * math.ceil(total / t.stages)  # shares aligned to the pipeline's stages
    visits = []
    for cta in range(groups):
        nxt = groups * dp * k_blocks + total * cta
        iters = 0 if nxt >= mnk else min(mnk - nxt, total)
        while iters:
            tile = nxt // k_blocks
            kb = nxt - tile * k_blocks
            sched = min(k_blocks - kb, iters)
            iters -= sched
            nxt += sched
            if kb == 0:
                sid, count = 0, math.ceil((k_blocks - sched) / total) + 1
            else:
                sid = kb // total
                first = kb - sid * total
                count = math.ceil((k_blocks - first) / total)
                if first:
                    sid, count = sid + 1, count + 1
            visits.append(Visit(cta, tile, kb, sched, count - 1 - sid, count))
    return Schedule(tuple(visits), dp, total, k_blocks)


def sk2_grid(t: Tiling, m: int, max_sms: int) -> int:
    """The num_sms (<= max_sms) whose stream-K partition of M rows cuts no tile into more slices than add in a fixed
    order (t.max_ordered_slices), with the shortest busiest CTA, then the fewest CTAs (fewer partial sums); max_sms
    itself when it already does. One CTA group always qualifies (it runs every tile whole). Cached by M-block count
    (the schedule depends on M only through it)."""
    return _sk2_grid(t, math.ceil(m / (t.block[0] * t.cluster_m)) * t.block[0] * t.cluster_m, max_sms)


@functools.lru_cache(maxsize=4096)
def _sk2_grid(t: Tiling, m: int, max_sms: int) -> int:
    limit = t.max_ordered_slices
    if schedule(t, m, t.groups(max_sms)).max_slices <= limit:
        return max_sms
    # the busiest CTA's length costs O(1) (`_length`); the slices need the whole schedule: check the grids shortest first
    grids = sorted((_length(t, m, t.groups(sms)), t.groups(sms), sms) for sms in range(1, max_sms + 1) if t.groups(sms))
    for _, _, sms in grids:
        if schedule(t, m, t.groups(sms)).max_slices <= limit:
            return sms
    raise AssertionError("one CTA group runs every tile whole")


def _length(t: Tiling, m: int, groups: int) -> int:
    """Schedule.cta_iters without the visits (the same formulas as `schedule`)."""
    bm, bn, bk = t.block
    k_blocks = t.k // bk
    mn = math.ceil(m / (bm * t.cluster_m)) * (t.n // bn // t.cluster_n)
    sk_mn = mn
    if mn > groups:
        sk_mn = mn % groups
        if sk_mn and sk_mn * 10 <= groups:
            sk_mn += groups
    dp = (mn - sk_mn) // groups
    total = max(math.ceil(sk_mn * k_blocks / groups), math.ceil((k_blocks - 1) / 9))
    total = t.stages * math.ceil(total / t.stages)
    return dp * k_blocks + (total if sk_mn else 0)


def sk2_entries(entries: list, shape: tuple[int, int], sm_count: int) -> list:
    """humming's per-M configs made repeatable: per M-block count, the grid of `sk2_grid` for every config that splits
    K (stream-K); configs without split kept; stream-K off above STREAMK_MAX_M. An entry [lo, hi, config] serves
    lo < M <= hi (humming's launcher.cpp), and so does each entry made here."""
    n, k = shape
    out = []
    for lo, hi, cfg in entries:
        if not cfg.get("use_stream_k", True):
            out.append([lo, hi, cfg])
            continue
        t = Tiling.of(cfg, n, k)
        rows = t.block[0] * t.cluster_m
        max_sms = int(cfg.get("num_sms") or sm_count)
        m = lo + 1  # the first M this entry serves
        while m <= min(hi, STREAMK_MAX_M):
            top = min(hi, math.ceil(m / rows) * rows)  # the last M with the same M-block count
            out.append([m - 1, top, {**cfg, "num_sms": sk2_grid(t, top, max_sms)}])
            m = top + 1
        if m <= hi:
            out.append([m - 1, hi, {**cfg, "use_stream_k": False}])
    merged = []  # neighbours with one config become one entry: humming builds a kernel object an entry
    for lo, hi, cfg in out:
        if merged and merged[-1][2] == cfg and merged[-1][1] == lo:
            merged[-1][1] = hi
        else:
            merged.append([lo, hi, cfg])
    return merged

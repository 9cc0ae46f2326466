"""humming's stream-K with each tile's partial sums added in a fixed order: bit-repeatable, most SMs busy.

Why it repeats (humming-kernels 0.1.20: include/humming/epilogue/pipeline.cuh and gmem_writer.cuh). Stream-K cuts an
output tile's K range into slices run by consecutive CTAs. The slices meet in one of two ways:
- with TMA stores (`use_tma_c`), or more than 3 slices on sm_90 (native bf16 atomics), slice 0 stores first and
  every other slice reduce-adds as it arrives: the order of the sum is a race, and the bits change from call to call;
- otherwise each slice waits on the tile's lock until the lock holds its own slice id, reads the partial sum, adds
  its own and writes it back: one order every time.
So a config repeats when TMA stores are off and no tile is cut into more than 3 slices. How many slices a tile gets
follows from the grid (the config's `num_sms`) and the M-block count alone: `schedule` ports humming's scheduler
(include/humming/scheduler.cuh) to count them, and `ordered_entries` picks, per M-block count, the grid with the
shortest CTA (the fewest K iterations a CTA runs) among those that keep every tile at 3 slices or fewer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_ORDERED_SLICES = 3  # above this humming's sm_90 epilogue switches to atomics (kHasNativeAtomicAdd && > 3)
STREAMK_MAX_M = 4096    # above this M every config runs without split (tiles fill the card several times over)


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
    sm_version: int = 90

    @classmethod
    def of(cls, cfg: dict, n: int, k: int, sm_version: int = 90) -> "Tiling":
        return cls(n, k, tuple(cfg["block_shape"]), int(cfg.get("num_stages", 2)),
                   int(cfg.get("multi_cast_size_a", 1)) * int(cfg.get("umma_cta_group_size", 1)),
                   int(cfg.get("multi_cast_size_b", 1)), int(cfg.get("num_ctas_per_sm", 1)), sm_version)

    @property
    def cluster(self) -> int:
        return self.cluster_n * self.cluster_m

    def groups(self, num_sms: int) -> int:
        """CTA groups (clusters) the launcher starts for a config's num_sms (launcher.cpp: gridDimX)."""
        return self.ctas_per_sm * num_sms // self.cluster


@dataclass(frozen=True)
class Visit:
    """One CTA's share of one output tile: which tile, its slice (0 = the one that sums last), of how many."""

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
    """The stream-K partition humming's scheduler makes for M rows on `groups` CTA groups (dense GEMM, bf16
    activations: the stream-K block alignment is 1). Mirrors Scheduler's constructor and get_streamk_next_block."""
    bm, bn, bk = t.block
    n_blocks = t.n // bn // t.cluster_n
    k_blocks = t.k // bk
    sk_blocks = k_blocks  # kStreamKBlocks with an alignment of 1
    m_blocks = math.ceil(m / (bm * t.cluster_m))
    mn = m_blocks * n_blocks
    mnk = mn * sk_blocks
    sk_mn = mn
    if mn > groups:
        sk_mn = mn % groups
        merge = sk_mn * 10 <= groups
        if t.sm_version == 89:  # the scheduler's sm_89 rule without TMA stores (ours: TMA stores are off)
            merge = sk_mn * 2 <= groups
        if sk_mn and merge:
            sk_mn += groups
    dp = (mn - sk_mn) // groups
    total = math.ceil(sk_mn * sk_blocks / groups)
    total = max(total, math.ceil((sk_blocks - 1) / 9))  # kMaxSlices = 10
    align = 1 // math.gcd(1, t.stages) * t.stages
    if align > 1:
        total = align * math.ceil(total / align)
    visits = []
    for cta in range(groups):
        nxt = groups * dp * sk_blocks + total * cta
        iters = 0 if nxt >= mnk else min(mnk - nxt, total)
        while iters:
            tile = nxt // sk_blocks
            kb = nxt - tile * sk_blocks
            sched = min(sk_blocks - kb, iters)
            iters -= sched
            nxt += sched
            if kb == 0:
                sid, count = 0, math.ceil((sk_blocks - sched) / total) + 1
            else:
                sid = kb // total
                first = kb - sid * total
                count = math.ceil((sk_blocks - first) / total)
                if first:
                    sid, count = sid + 1, count + 1
            visits.append(Visit(cta, tile, kb, min(k_blocks - kb, sched), count - 1 - sid, count))
    return Schedule(tuple(visits), dp, total, k_blocks)


def ordered_grid(t: Tiling, m: int, max_sms: int) -> int | None:
    """The num_sms (<= max_sms) whose stream-K partition of M rows cuts no tile into more than
    MAX_ORDERED_SLICES slices, with the shortest busiest CTA (then the fewest CTAs: fewer partial sums); None
    when no grid splits at all (one tile a CTA already)."""
    best = None
    for sms in range(1, max_sms + 1):
        g = t.groups(sms)
        if g < 1:
            continue
        s = schedule(t, m, g)
        if s.max_slices > MAX_ORDERED_SLICES:
            continue
        key = (s.cta_iters, g)
        if best is None or key < best[0]:
            best = (key, sms)
    return None if best is None else best[1]


def ordered_entries(entries: list, shape: tuple[int, int], sm_count: int, sm_version: int = 90) -> list:
    """humming's per-M configs ([m_lo, m_hi, config]) made repeatable: TMA stores off and, per M-block count, the
    grid of `ordered_grid` for every config that splits K (stream-K); configs without split kept; stream-K off
    above STREAMK_MAX_M."""
    n, k = shape
    out = []
    for lo, hi, cfg in entries:
        if not cfg.get("use_stream_k", True):
            out.append([lo, hi, cfg])
            continue
        t = Tiling.of(cfg, n, k, sm_version)
        rows = t.block[0] * t.cluster_m
        max_sms = int(cfg.get("num_sms") or sm_count)
        m = lo
        while m <= min(hi, STREAMK_MAX_M):
            top = min(hi, math.ceil(m / rows) * rows)  # the last M with the same M-block count
            sms = ordered_grid(t, top, max_sms)
            out.append([m, top, {**cfg, "use_tma_c": False, "num_sms": sms or max_sms}])
            m = top + 1
        if hi > STREAMK_MAX_M and m <= hi:
            out.append([m, hi, {**cfg, "use_stream_k": False}])
    return out

"""The port of humming's stream-K scheduler (kernels/humming_sk2.py) and the grids it picks, on the CPU.

The reference is a plain model of stream-K, independent of the port's slice formulas: CTA c runs the K blocks
[start_c, start_c + iters_c) of the flattened (tile, K block) space, and a tile's slices are the CTAs whose range
meets it, numbered so that the CTA holding the tile's last K block is slice 0 (it stores; the others add). The
kernel's own slice count and id (what its lock protocol waits on) must agree with it."""

import math

import pytest

from qerl.kernels.humming_sk2 import (MAX_SLICES, MAX_SLICES_LOCKED, STREAMK_MAX_M, Tiling, schedule, sk2_entries,
                                      sk2_grid, tma_stores)
from qerl.kernels.humming_sk2 import _length

SHAPES_7B = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]


def _reference(t: Tiling, m: int, groups: int, s):
    """{tile: [(cta, k_first, k_blocks), ...]} from the CTAs' ranges alone (the port's dp and per-CTA length)."""
    bm, bn, bk = t.block
    kb = t.k // bk
    tiles = math.ceil(m / (bm * t.cluster_m)) * (t.n // bn // t.cluster_n)
    start0 = groups * s.dp_tiles_per_cta * kb
    out = {}
    for c in range(groups):
        lo = start0 + s.streamk_iters * c
        hi = min(lo + s.streamk_iters, tiles * kb)
        for tile in range(lo // kb, (hi - 1) // kb + 1) if hi > lo else ():
            a, b = max(lo, tile * kb), min(hi, (tile + 1) * kb)
            out.setdefault(tile, []).append((c, a - tile * kb, b - a))
    return out


CASES = [(n, k, blk, st, m, g) for n, k in SHAPES_7B + [(1024, 4096), (2048, 512)]
         for blk in [(64, 128, 64), (16, 128, 128), (128, 256, 64)] for st in (2, 4)
         for m in (1, 16, 64, 100, 256, 1000) for g in (7, 66, 132)]


@pytest.mark.parametrize("n,k,blk,stages,m,groups", CASES[::7])
def test_the_kernels_slice_counts_and_ids_match_the_cta_ranges(n, k, blk, stages, m, groups):
    t = Tiling(n, k, blk, stages)
    s = schedule(t, m, groups)
    ref = _reference(t, m, groups, s)
    got = {}
    for v in s.visits:
        got.setdefault(v.tile, []).append(v)
    assert sorted(got) == sorted(ref)
    for tile, parts in ref.items():
        visits = sorted(got[tile], key=lambda v: v.k_first)
        assert [(v.cta, v.k_first, v.k_blocks) for v in visits] == parts
        assert {v.slice_count for v in visits} == {len(parts)}
        # ids count down along K: the share holding the tile's last K block is slice 0
        assert [v.slice_id for v in visits] == list(range(len(parts) - 1, -1, -1))
    # every K block of every tile runs exactly once: in whole data-parallel tiles or in a stream-K share
    assert _length(t, m, groups) == s.cta_iters  # the O(1) length the grid search sorts by
    kb = k // blk[2]
    tiles = math.ceil(m / blk[0]) * (n // blk[1])
    assert groups * s.dp_tiles_per_cta * kb + sum(v.k_blocks for v in s.visits) == tiles * kb


def test_a_schedule_worked_by_hand():
    # 8 tiles of 8 K blocks on 3 CTAs: 8 % 3 = 2 tiles left (2 * 10 > 3: not merged), so 2 data-parallel tiles a CTA,
    # then 16 K blocks shared, ceil(16 / 3) = 6 a CTA (a multiple of the 2 stages):
    # CTA 0 runs tile 6's blocks 0-5, CTA 1 tile 6's 6-7 and tile 7's 0-3, CTA 2 tile 7's 4-7; the share holding a
    # tile's last block is its slice 0
    s = schedule(Tiling(1024, 512, (64, 128, 64), 2), 64, 3)
    assert (s.dp_tiles_per_cta, s.streamk_iters) == (2, 6)
    assert [(v.cta, v.tile, v.k_first, v.k_blocks, v.slice_id, v.slice_count) for v in s.visits] == \
        [(0, 6, 0, 6, 1, 2), (1, 6, 6, 2, 0, 2), (1, 7, 0, 4, 1, 2), (2, 7, 4, 4, 0, 2)]
    # 12 tiles on 11 CTAs: 1 left, 1 * 10 <= 11, so the wave merges: no data-parallel tile, 12 x 8 blocks shared
    s = schedule(Tiling(1536, 512, (64, 128, 64), 2), 64, 11)
    assert (s.dp_tiles_per_cta, s.streamk_iters) == (0, 10)  # ceil(96 / 11) = 9, up to a multiple of 2
    # K blocks 37, one CTA group: shares of at least ceil(36 / 9) = 4 blocks (at most 10 slices), here the whole tile
    s = schedule(Tiling(128, 37 * 64, (64, 128, 64), 1), 64, 40)
    assert s.streamk_iters == 4 and s.max_slices == 10


def test_the_data_parallel_waves_and_the_merged_remainder():
    # 148 tiles on 132 CTAs: 16 left over; 16 * 10 > 132, so one data-parallel wave and 16 tiles shared
    t = Tiling(37888, 3584, (64, 256, 64), 4)
    s = schedule(t, 64, 132)
    assert s.dp_tiles_per_cta == 1 and s.streamk_iters == 4 * math.ceil(math.ceil(16 * 56 / 132) / 4)
    # 140 tiles: 8 left over, 8 * 10 <= 132, so the last wave merges into the shared part (no data-parallel wave)
    s = schedule(Tiling(35840, 3584, (64, 256, 64), 4), 64, 132)
    assert s.dp_tiles_per_cta == 0 and s.streamk_iters == 4 * math.ceil(math.ceil(140 * 56 / 132) / 4)


@pytest.mark.parametrize("n,k", SHAPES_7B)
@pytest.mark.parametrize("m", [1, 16, 64, 128, 256])
@pytest.mark.parametrize("blk", [(64, 128, 64), (128, 256, 64)])
def test_the_sk2_grid_keeps_every_tile_within_two_slices_and_is_the_shortest(n, k, m, blk):
    t = Tiling(n, k, blk, 4)
    assert t.max_ordered_slices == MAX_SLICES  # TMA stores unless a config says otherwise
    sms = sk2_grid(t, m, 132)
    s = schedule(t, m, t.groups(sms))
    assert s.max_slices <= MAX_SLICES
    if schedule(t, m, 132).max_slices <= MAX_SLICES:
        assert sms == 132  # humming's own grid kept where it already repeats
        return
    for other in range(1, 133):  # no other allowed grid has a shorter busiest CTA
        o = schedule(t, m, t.groups(other))
        if o.max_slices <= MAX_SLICES:
            assert (o.cta_iters, other) >= (s.cta_iters, sms)


def test_humming_s_own_grid_cuts_tiles_into_more_than_two_slices_where_sk2_narrows_it():
    # q|k|v at M 64 on 132 SMs: humming's grid cuts its 36 tiles into 4 slices (three adds in arrival order)
    t = Tiling(4608, 3584, (64, 128, 64), 4)
    assert schedule(t, 64, 132).max_slices > MAX_SLICES
    sms = sk2_grid(t, 64, 132)
    assert sms < 132 and schedule(t, 64, t.groups(sms)).max_slices <= MAX_SLICES


def test_clusters_and_two_ctas_a_sm_count_groups_as_the_launcher_does():
    t = Tiling(4608, 3584, (64, 128, 64), 4, cluster_n=2, ctas_per_sm=2)
    assert t.groups(132) == 132  # 264 CTAs, clusters of 2
    sms = sk2_grid(t, 64, 132)
    assert schedule(t, 64, t.groups(sms)).max_slices <= MAX_SLICES


def test_sk2_entries_serve_the_same_m_keep_tma_stores_and_narrow_only_the_grid():
    # humming's entries serve lo < M <= hi (its launcher), the first from 0
    cfg = {"block_shape": (64, 128, 64), "warp_shape": (64, 32, 64), "num_stages": 4, "use_stream_k": True,
           "use_tma_c": True, "num_sms": None, "num_ctas_per_sm": None}
    nosplit = {**cfg, "use_stream_k": False}
    entries = [[0, 200, cfg], [200, 300, nosplit], [300, 1 << 30, cfg]]
    out = sk2_entries(entries, (4608, 3584), 132)
    served = lambda es, m: [c for lo, hi, c in es if lo < m <= hi]  # noqa: E731
    for m in (1, 2, 63, 64, 65, 128, 200, 201, 300, 301, 4096, 4097, 1 << 30):
        got = served(out, m)
        assert len(got) == 1, m  # every M served once, as before
        want = served(entries, m)[0]
        assert {key: v for key, v in got[0].items() if key not in ("num_sms", "use_stream_k")} == \
            {key: v for key, v in want.items() if key not in ("num_sms", "use_stream_k")}
    assert out[0][0] == 0 and out[-1][1] == 1 << 30
    assert all(a[1] == b[0] for a, b in zip(out, out[1:]))  # contiguous
    for lo, hi, c in out:
        if not c["use_stream_k"]:
            continue
        assert hi <= STREAMK_MAX_M and 1 <= c["num_sms"] <= 132
        t = Tiling.of(c, 4608, 3584)
        for m in [*range(lo + 1, hi + 1, 64), hi]:  # every M-block count the entry serves (neighbours merged)
            assert schedule(t, m, t.groups(c["num_sms"])).max_slices <= MAX_SLICES
    assert served(out, 250) == [nosplit]
    assert out[-1][2]["use_stream_k"] is False and out[-1][0] == STREAMK_MAX_M


def test_unset_config_fields_read_as_humming_s_defaults():
    t = Tiling.of({"block_shape": (64, 128, 64), "num_stages": None, "num_ctas_per_sm": None,
                   "multi_cast_size_a": None}, 4608, 3584)
    assert (t.stages, t.ctas_per_sm, t.cluster_n, t.cluster_m, t.tma_stores) == (2, 1, 1, 1, False)


def test_configs_without_tma_stores_may_keep_three_slices_that_add_in_turn():
    cfg = {"block_shape": (16, 128, 128), "num_stages": 4, "use_stream_k": True, "use_tma": False}
    assert not tma_stores(cfg) and tma_stores({**cfg, "use_tma_c": True}) and tma_stores({"use_tma": True})
    assert not tma_stores({"use_tma": None}) and not tma_stores({})  # humming: use_tma unset is False
    t = Tiling.of(cfg, 3584, 3584)
    assert t.max_ordered_slices == MAX_SLICES_LOCKED
    got = {m: schedule(t, m, t.groups(sk2_grid(t, m, 132))).max_slices for m in (1, 16)}
    assert max(got.values()) <= MAX_SLICES_LOCKED
    # where three slices give a shorter busiest CTA than two, the locked config takes it
    t2 = Tiling.of({**cfg, "use_tma_c": True}, 3584, 3584)
    assert schedule(t, 16, t.groups(sk2_grid(t, 16, 132))).cta_iters <= \
        schedule(t2, 16, t2.groups(sk2_grid(t2, 16, 132))).cta_iters


def test_entries_of_one_grid_merge_and_the_grid_is_cached_by_m_block_count():
    cfg = {"block_shape": (16, 128, 64), "num_stages": 4, "use_stream_k": True, "use_tma": True}
    out = sk2_entries([[0, 4096, cfg]], (37888, 3584), 132)
    assert all(a[2] != b[2] for a, b in zip(out, out[1:]))  # neighbours differ, else they would be one entry
    assert len(out) < 4096 // 16
    t = Tiling.of(cfg, 37888, 3584)
    assert sk2_grid(t, 17, 132) == sk2_grid(t, 32, 132)  # one M-block count, one grid

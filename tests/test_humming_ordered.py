"""The port of humming's stream-K scheduler (kernels/humming_ordered.py) and the grids it picks, on the CPU.

The reference is a plain model of stream-K, independent of the port's formulas: CTA c runs the K blocks
[start_c, start_c + iters_c) of the flattened (tile, K block) space, and a tile's slices are the CTAs whose range
meets it, numbered so that the CTA holding the tile's first K block sums last. The kernel's own slice count and
slice id (what its lock protocol waits on) must agree with it, or the kernel would wait forever."""

import math

import pytest

from qerl.kernels.humming_ordered import (MAX_ORDERED_SLICES, STREAMK_MAX_M, Tiling, ordered_entries, ordered_grid,
                                          schedule)

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
        # ids 0..count-1, the first K block's CTA last (it sums the partials: humming reverses the order)
        assert [v.slice_id for v in visits] == list(range(len(parts) - 1, -1, -1))
    # every K block of every tile is run exactly once: by whole data-parallel tiles or by a stream-K share
    kb = k // blk[2]
    tiles = math.ceil(m / blk[0]) * (n // blk[1])
    assert groups * s.dp_tiles_per_cta * kb + sum(v.k_blocks for v in s.visits) == tiles * kb


@pytest.mark.parametrize("n,k", SHAPES_7B)
@pytest.mark.parametrize("m", [1, 16, 64, 128, 256])
def test_the_ordered_grid_keeps_every_tile_within_three_slices(n, k, m):
    t = Tiling(n, k, (64, 128, 64), 4)
    sms = ordered_grid(t, m, 132)
    s = schedule(t, m, t.groups(sms))
    assert s.max_slices <= MAX_ORDERED_SLICES
    # no allowed grid has a shorter busiest CTA
    for other in range(1, 133):
        o = schedule(t, m, t.groups(other))
        if o.max_slices <= MAX_ORDERED_SLICES:
            assert o.cta_iters >= s.cta_iters


def test_a_grid_with_more_slices_than_the_ordered_limit_exists_where_humming_would_use_it():
    # q|k|v at M 64 on 132 SMs: humming's own grid cuts tiles into 4 slices (atomics: a race); the ordered one
    t = Tiling(4608, 3584, (64, 128, 64), 4)
    assert schedule(t, 64, 132).max_slices > MAX_ORDERED_SLICES
    assert schedule(t, 64, t.groups(ordered_grid(t, 64, 132))).max_slices <= MAX_ORDERED_SLICES


def test_clusters_and_two_ctas_a_sm_count_groups_as_the_launcher_does():
    t = Tiling(4608, 3584, (64, 128, 64), 4, cluster_n=2, ctas_per_sm=2)
    assert t.groups(132) == 132  # 264 CTAs, clusters of 2
    sms = ordered_grid(t, 64, 132)
    assert schedule(t, 64, t.groups(sms)).max_slices <= MAX_ORDERED_SLICES


def test_ordered_entries_cover_the_same_m_and_turn_tma_stores_off():
    cfg = {"block_shape": (64, 128, 64), "warp_shape": (64, 32, 64), "num_stages": 4, "use_stream_k": True,
           "num_sms": 132, "num_ctas_per_sm": 1}
    nosplit = {**cfg, "use_stream_k": False}
    entries = [[1, 200, cfg], [201, 300, nosplit], [301, 1 << 20, cfg]]
    out = ordered_entries(entries, (4608, 3584), 132)
    # contiguous, same span
    assert out[0][0] == 1 and out[-1][1] == 1 << 20
    assert all(a[1] + 1 == b[0] for a, b in zip(out, out[1:]))
    for lo, hi, c in out:
        if not c["use_stream_k"]:
            assert c.get("use_tma_c") is None  # no split: kept as humming made it
            continue
        assert c["use_tma_c"] is False and hi <= STREAMK_MAX_M
        t = Tiling.of(c, 4608, 3584)
        assert math.ceil(lo / 64) == math.ceil(hi / 64)  # one M-block count per entry
        assert schedule(t, hi, t.groups(c["num_sms"])).max_slices <= MAX_ORDERED_SLICES
    assert [c for lo, hi, c in out if lo <= 250 <= hi] == [nosplit]
    assert out[-1][2]["use_stream_k"] is False and out[-1][0] == STREAMK_MAX_M + 1

"""Does a smaller token tile beat one tile of all M tokens? (ncu at M = 256, benchmarks/kernels.md 2026-12-06)

At M = 256 every wgmma tile runs 255 registers (one CTA a SM, 12.5 % occupancy) and q|k|v's 72 CTAs leave
60 SMs idle; BN = M/2 gives two token tiles, twice the CTAs, two CTAs a SM, at the price of decoding each
weight twice. The plan already takes any BN (blocks = row blocks x token tiles); the tile sweep only ever
timed BN = M. This times the 7B layer set at M = 128 and 256 with BN = M and M/2 (each BN with its TUNING
row), checks each output equals BN = M's, and prints cuBLAS bf16 beside them.

    python scripts/wgmma_token_tiles.py        (on the device)
"""

import torch

from qerl.bench.kernels import LAYER_SETS, Sets, _fns, _time
from qerl.kernels import w4_wgmma

sms = torch.cuda.get_device_properties(0).multi_processor_count
sets = {g: Sets(n, k, seed=n + k, tinygemm=False) for g, (n, k) in LAYER_SETS["qwen2.5-7b"].items()}
print(f"{torch.cuda.get_device_name(0)}; 7B layer set, µs summed over q|k|v, o, gate|up, down")
print(f"{'M':>4} {'BN':>4} {'wgmma µs':>9} {'bf16 µs':>8} {'x bf16':>7}  equal to BN = M")
for m in (128, 256):
    x = {g: torch.randn(m, ss.k, device="cuda", dtype=torch.bfloat16) for g, ss in sets.items()}
    bf = sum(_time(ss, "bf16", x[g], g) for g, ss in sets.items())
    ref = None
    for bn in (m, m // 2):
        cfg = dict(bn=bn, **w4_wgmma.TUNING[bn])
        outs = {g: _fns(ss, "wgmma_cfg", x[g], g, **cfg)[0]() for g, ss in sets.items()}
        same = "" if ref is None else all(torch.equal(outs[g], ref[g]) for g in outs)
        diff = "" if ref is None else max((outs[g].float() - ref[g].float()).abs().max().item() for g in outs)
        ref = ref or outs
        us = sum((_time(ss, "wgmma_cfg", x[g], g, **cfg) or float("inf")) for g, ss in sets.items())
        grids = [w4_wgmma.plan(m, ss.n, ss.k, sms, **cfg) for ss in sets.values()]
        print(f"{m:>4} {bn:>4} {us:>9.1f} {bf:>8.1f} {bf / us:>6.2f}x  {same} {diff}  "
              f"splits {[c.splits for c in grids]} ctas/SM {grids[0].ctas_per_sm}")

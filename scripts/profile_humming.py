"""Launch humming-kernels' modes once each on the 7B q|k|v and down weights at the given M's, for ncu: its
batch-invariant tiles, its default tiles without split, its stream-K default, the grouped split-K candidate
(kernels/humming_ksplit.py) and qerl's own kernels, each base path also with LoRA r32 (where the LoRA's launches go).
Each profiled launch sits in an NVTX range "profile" (the
JIT and the first call run outside it); the order of the ranges is printed first.

    ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats python scripts/profile_humming.py 1 64 256
"""

import sys

import torch

from qerl.bench.kernels import LAYER_SETS
from qerl.formats import get_format
from qerl.formats.nvfp4_mma import NVFP4Mma
from qerl.kernels import mma_backend, settings
from qerl.kernels.dispatch import LoraTerm
from qerl.kernels.humming_backend import HummingWeight, nosplit_tuning
from qerl.kernels.humming_ksplit import KSplitWeight

ms = [int(v) for v in sys.argv[1:]] or [64]
for group in ("qkv", "down"):
    n, k = LAYER_SETS["qwen2.5-7b"][group]
    std = get_format("nvfp4").quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
    mma = NVFP4Mma().from_checkpoint(std, (n, k))
    hw = HummingWeight.build("nvfp4", std, (n, k))
    ks = KSplitWeight.build(std, (n, k), 4)
    ns = nosplit_tuning(hw.layer.humming_config, torch.device("cuda", torch.cuda.current_device()))
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        calls = {"batch_invariant": lambda: hw.layer(x, compute_config={"use_batch_invariant": True}),
                 "no_split": lambda: hw.layer(x, tuning_config=ns),
                 "stream_k": lambda: hw.layer(x),
                 "ksplit4": lambda: ks.matmul(x)}
        segs = {"qkv": 3}.get(group, 1)  # LoRA r32 on each member, as bench kernels' *_lora32 modes
        starts = tuple(int(v) for v in torch.linspace(0, n, segs + 1)[1:-1].div(16).floor().mul(16).tolist())
        a = torch.randn(segs * 32, k, device="cuda", dtype=torch.bfloat16) * 0.01
        b = torch.randn(n, 32, device="cuda", dtype=torch.bfloat16) * 0.01
        lora = lambda: LoraTerm(None, b, 2.0, starts, a=a)  # noqa: E731
        calls["humming_lora32"] = lambda: hw.matmul(x, lora=lora())
        with settings.use(humming=False):
            calls["own"] = lambda: mma_backend.matmul(x, NVFP4Mma(), mma, (n, k))
            calls["own_lora32"] = lambda: mma_backend.matmul(x, NVFP4Mma(), mma, (n, k), lora=lora())
            for name, fn in calls.items():
                fn()  # JIT, configs, workspaces
                torch.cuda.synchronize()
                print(f"range: {group} {n}x{k} M={m} {name}", flush=True)
                torch.cuda.nvtx.range_push("profile")
                fn()
                torch.cuda.nvtx.range_pop()
                torch.cuda.synchronize()

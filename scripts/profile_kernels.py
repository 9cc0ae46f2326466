"""Launch the NVFP4 MMA kernel once per group of the 7B fused layer set at the given M's, for ncu.

    ncu --clock-control none -k regex:w4_mma_matmul python scripts/profile_kernels.py 1 16 64
    ... python scripts/profile_kernels.py --wgmma 1 64 256   (routes M >= w4_wgmma.MIN_M to the wgmma kernel)
"""

import sys

import torch

from qerl.bench.kernels import LAYER_SETS
from qerl.formats.nvfp4_mma import NVFP4Mma
from qerl.kernels import mma_backend, settings

mma = NVFP4Mma()
ws = {g: mma.quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
      for g, (n, k) in LAYER_SETS["qwen2.5-7b"].items()}
args = sys.argv[1:]
wgmma = "--wgmma" in args
if wgmma:
    args.remove("--wgmma")
with settings.use(wgmma=wgmma):
    for m in map(int, args or ["1", "16", "64"]):
        for g, (n, k) in LAYER_SETS["qwen2.5-7b"].items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            mma_backend.matmul(x, mma, ws[g], (n, k))
torch.cuda.synchronize()

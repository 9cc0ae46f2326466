"""Every wgmma tile TUNING uses, compiled by NVRTC on the device, with what the driver says of it.

    python scripts/wgmma_tiles.py      (on the device; prints one line a tile, exits 1 on local memory)

NVRTC's ptxas may allocate differently from the nvcc wheel CI checks with (BN 256 sits at 254 of 255
registers there), so the device's own numbers decide: cuFuncGetAttribute's registers, local bytes
(spills or an indexed register array) and the CTAs per SM the occupancy API allows at the tile's
shared memory, against the `ctas_per_sm` the plan assumes.
"""

import ctypes
import sys

import torch

from qerl.kernels import w4_wgmma

ATTR = {"regs": 4, "local": 3}  # CU_FUNC_ATTRIBUTE_NUM_REGS, _LOCAL_SIZE_BYTES
lib = torch.cuda._utils._get_gpu_runtime_library()
dev = torch.device("cuda", 0)
sms = torch.cuda.get_device_properties(0).multi_processor_count
bad = 0
for bn, tune in sorted(w4_wgmma.TUNING.items()):
    for lora, fuse in ((False, False), (True, False), (True, True)):
        if fuse and bn > w4_wgmma.FUSE_SHRINK_MAX_BN:
            continue
        cfg = w4_wgmma.plan(bn, 4608, 3584, sms, bn=bn)
        fn = w4_wgmma._kernel(cfg, False, lora, dev, fuse)
        got = {}
        for name, a in ATTR.items():
            v = ctypes.c_int()
            assert lib.cuFuncGetAttribute(ctypes.byref(v), a, fn.func) == 0
            got[name] = v.value
        per_sm = ctypes.c_int()
        assert lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(per_sm), fn.func, cfg.threads,
                                                               cfg.smem_bytes()) == 0
        ok = got["local"] == 0 and per_sm.value >= tune.get("ctas_per_sm", 1)
        bad += not ok
        print(f"BN {bn:3d} wg {cfg.wg} pw {cfg.pw} st {cfg.stages} lora {int(lora)} fuse {int(fuse)}: {got['regs']} regs, "
              f"{got['local']} B local, smem {cfg.smem_bytes()} B, {per_sm.value} CTAs/SM (plan "
              f"{tune.get('ctas_per_sm', 1)}) {'ok' if ok else 'BAD'}")
sys.exit(1 if bad else 0)

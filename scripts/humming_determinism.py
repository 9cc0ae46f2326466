"""Does humming-kernels give the same bits for the same input? Its default config (stream-K) vs batch-invariant
tiles vs its default tiles with stream-K off (kernels/humming_backend.nosplit_tuning). Eager timing: launch-bound
at small M; `qerl bench kernels` times them in CUDA graphs.

    PYTHONPATH=src:<humming> python scripts/humming_determinism.py     (on a GPU; a 7B q|k|v-sized weight)
"""
import sys

import torch

sys.path.insert(0, "tests")
from test_humming_gpu import _weights  # noqa: E402

from qerl.kernels.humming_backend import HummingWeight, nosplit_tuning  # noqa: E402

n, k = 4608, 3584
hw = HummingWeight.build("nvfp4", _weights("nvfp4", n, k, seed=1), (n, k))
nosplit = nosplit_tuning(hw.layer.humming_config, torch.device("cuda", torch.cuda.current_device()))
for m in (1, 16, 17, 32, 64, 128, 256, 2048):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    line = [f"M {m:5d}"]
    for name, cc, tu in (("default", None, None), ("batch_invariant", {"use_batch_invariant": True}, None),
                         ("no_split", None, nosplit)):
        ys = [hw.layer(x, compute_config=cc, tuning_config=tu) for _ in range(12)]
        diff = sum(int(not torch.equal(ys[1], y)) for y in ys[2:])
        first = int(not torch.equal(ys[0], ys[1]))
        for _ in range(10):
            hw.layer(x, compute_config=cc, tuning_config=tu)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(200):
            hw.layer(x, compute_config=cc, tuning_config=tu)
        e1.record()
        torch.cuda.synchronize()
        line.append(f"{name}: {diff}/10 later calls differ, first differs {first}, {1e3 * e0.elapsed_time(e1) / 200:6.1f} us")
    ref = hw.layer(x, compute_config={"use_batch_invariant": True})
    line.append(f"bi vs default max abs {(ref.float() - hw.layer(x).float()).abs().max().item():.3g}")
    print(" | ".join(line), flush=True)

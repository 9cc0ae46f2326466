"""One weight at small M inside CUDA graphs: humming on the stored layout vs humming's own layer vs bf16 (GPU)."""
import torch

from qerl.formats import NVFP4
from qerl.formats.nvfp4_humming import NVFP4Humming
from qerl.kernels import humming_backend as hb

for n, k in ((4608, 3584), (3584, 18944)):
    w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
    ct = NVFP4().quantize(w)
    h = NVFP4Humming().from_checkpoint(ct, (n, k))
    ref = hb.HummingWeight.build("nvfp4", {a: t.clone() for a, t in ct.items()}, (n, k))
    fmt = NVFP4Humming()
    for m in (1, 16, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = []
        for name, f in (("stored", lambda: hb.stored_matmul(x, fmt, h, (n, k))), ("layer", lambda: ref.matmul(x)),
                        ("bf16", lambda: x @ w.T)):
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for _ in range(3):
                    f()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                for _ in range(20):
                    f()
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(10):
                g.replay()
            e1.record()
            torch.cuda.synchronize()
            row.append(f"{name} {e0.elapsed_time(e1) * 1e3 / 200:.1f}")
        print(n, k, "M", m, " | ".join(row), "us")

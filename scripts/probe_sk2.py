"""Issue 58: humming's stream-K configs for the 7B layer set and what kernels/humming_sk2.py makes of them, per M:
the block, stages, TMA stores and grid humming picks, its slices a tile, the sk2 grid and its busiest CTA against
humming's (K blocks), then µs of humming's stream-K, sk2 and no-split (CUDA graph replays), and whether 20 calls of
each repeat bit for bit. One table, printed; nothing recorded (`qerl bench kernels` is the record)."""

import argparse
import json

import torch

from qerl.bench.kernels import time_calls
from qerl.formats import get_format
from qerl.kernels.humming_backend import HummingWeight, call_configs
from qerl.kernels.humming_sk2 import Tiling, schedule, sk2_grid

SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,16,32,64,128,256,2048")
    args = ap.parse_args()
    from humming.tune import get_heuristics_config

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(torch.cuda.get_device_name(dev), sms, "SMs")
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        hw = HummingWeight.build("nvfp4", get_format("nvfp4").quantize(w), (n, k))
        del w
        entries = get_heuristics_config(hw.layer.humming_config, None, gemm_type="dense", device=dev)
        print(f"== {name} {n}x{k}: humming's entries")
        for lo, hi, c in entries:
            print(f"   M {lo}-{hi}: " + json.dumps({k_: c.get(k_) for k_ in ("block_shape", "warp_shape", "num_stages",
                  "use_stream_k", "use_tma_c", "num_sms", "num_ctas_per_sm", "multi_cast_size_a", "multi_cast_size_b",
                  "use_warp_spec")}))
        for m in [int(v) for v in args.ms.split(",")]:
            c = next(c for lo, hi, c in entries if lo < m <= hi)  # humming: lo < M <= hi
            t = Tiling.of(c, n, k)
            own = schedule(t, m, t.groups(int(c.get("num_sms") or sms)))
            g2 = sk2_grid(t, m, int(c.get("num_sms") or sms))
            s2 = schedule(t, m, t.groups(g2))
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            row = [f"{name} M{m}: tma_c {int(t.tma_stores)} slices {own.max_slices} iters {own.cta_iters} | sk2 grid {g2} slices "
                   f"{s2.max_slices} iters {s2.cta_iters}"]
            for mode in ("humming_sk", "humming_sk2", "humming_ns"):
                cc, tc = call_configs(mode, hw.layer.humming_config, dev)
                fn = lambda cc=cc, tc=tc: hw.run(x, cc, tc)  # noqa: E731
                first = fn()
                same = all(torch.equal(fn(), first) for _ in range(19))
                row.append(f"{mode} {time_calls([fn]):7.1f} us {'rep' if same else 'VARIES'}")
            print(" | ".join(row), flush=True)
        del hw
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

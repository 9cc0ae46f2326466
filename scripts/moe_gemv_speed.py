"""One Qwen3-30B-A3B MoE layer's experts on the GPU: QuantExperts' loop (each hit expert dequantized),
its grouped path (`grouped`: hit experts dequantized a chunk at a time, torch._grouped_mm) and, for
decode batches, the grouped 4-bit GEMV (KernelSettings.moe_gemv), at 1 / 8 / 64 / 512 / 2048 tokens,
top-8 of 128 experts, random weights and routing; the outputs compared with the loop's. Prints µs a layer, bytes of the hit experts and the
bandwidth that implies.

    python scripts/moe_gemv_speed.py [--experts 128] [--hidden 2048] [--inter 768] [--top-k 8]
    python scripts/moe_gemv_speed.py --experts 32 --hidden 2880 --inter 2880 --top-k 4 --format mxfp4  # gpt-oss-20b
"""

import argparse

import torch

from qerl.kernels import moe_gemv, settings
from qerl.layers.quant_experts import QuantExperts

ap = argparse.ArgumentParser()
ap.add_argument("--experts", type=int, default=128)
ap.add_argument("--hidden", type=int, default=2048)
ap.add_argument("--inter", type=int, default=768)
ap.add_argument("--top-k", type=int, default=8)
ap.add_argument("--batches", default="1,8,64,512,2048")
ap.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4"])
ap.add_argument("--record", action="store_true", help="append the figures to <results-dir>/moe.jsonl")
ap.add_argument("--results-dir", default="benchmarks/results")
ap.add_argument("--profile", action="store_true", help="torch.profiler of the GEMV at T = 1 and 64 (GPU)")
ap.add_argument("--dtype", default="bfloat16", help="float32 for a CPU check (the interpreter's bf16 is broken)")
ap.add_argument("--humming", action="store_true", help="also humming-kernels' MoE GEMM (kernels/humming_moe.py, NVFP4)")
a = ap.parse_args()
dt = getattr(torch, a.dtype)
dev = "cuda" if torch.cuda.is_available() else "cpu"
e, h, i = a.experts, a.hidden, a.inter
g = torch.Generator(device=dev).manual_seed(0)
gate_up = torch.randn(e, 2 * i, h, device=dev, generator=g, dtype=dt) * 0.02
down = torch.randn(e, h, i, device=dev, generator=g, dtype=dt) * 0.02
q = QuantExperts.quantize(gate_up, down, a.format, lambda x: torch.nn.functional.silu(x[..., :i]) * x[..., i:],
                          dt)
del gate_up, down
expert_bytes = (0.5625 if a.format == "nvfp4" else 0.53125) * 3 * i * h  # 4 bits + a scale per 16 (32) weights


def timed(fn, reps=20):
    fn()
    if dev == "cuda":
        torch.cuda.synchronize()
        s, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        t.record()
        torch.cuda.synchronize()
        return s.elapsed_time(t) * 1000 / reps
    import time
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e6 / reps


hum = None
if a.humming:
    from qerl.kernels.humming_moe import HummingExperts

    hum = HummingExperts.from_quant_experts(q)
print(f"{torch.cuda.get_device_name(0) if dev == 'cuda' else 'CPU'}; experts {e} x (gate_up {2 * i}x{h}, down {h}x{i}) "
      f"{a.format}, top-{a.top_k}")
print(f"{'T':>5} {'hit':>4} {'loop µs':>9} {'grouped µs':>10} {'gemv µs':>9} {'best/loop':>9} {'GB/s best':>10} "
      f"{'|d| grouped':>11} {'|d| gemv':>9}")
with torch.no_grad():
    for t in map(int, a.batches.split(",")):
        x = torch.randn(t, h, device=dev, dtype=dt)
        idx = torch.stack([torch.randperm(e, device=dev)[: a.top_k] for _ in range(t)])
        wts = torch.softmax(torch.randn(t, a.top_k, device=dev), -1).to(dt)
        hit = idx.unique().numel()
        reps = 20 if t <= 64 else 5
        with settings.use(moe_gemv=False, moe_grouped=False):  # transformers' loop: the reference
            want = q(x, idx, wts)
            us_loop = timed(lambda: q(x, idx, wts), reps)
        with settings.use(moe_gemv=False, moe_grouped=True):
            got_g = q(x, idx, wts)
            us_grouped = timed(lambda: q(x, idx, wts), reps)
        us_gemv, d_gemv = float("nan"), float("nan")
        if t <= moe_gemv.MAX_TOKENS:
            with settings.use(moe_gemv=True):
                got = q(x, idx, wts)
                us_gemv = timed(lambda: q(x, idx, wts), reps)
            d_gemv = (got.float() - want.float()).abs().max().item()
        d_grouped = (got_g.float() - want.float()).abs().max().item()
        us_hum, d_hum = float("nan"), float("nan")
        if hum is not None:
            got_h = hum(x, idx, wts)
            d_hum = (got_h.float() - want.float()).abs().max().item()
            us_hum = timed(lambda: hum(x, idx, wts), reps)
            print(f"      humming MoE GEMM: {us_hum:.1f} µs, |d| {d_hum:.2e}", flush=True)
        best = min(us_grouped, us_gemv) if us_gemv == us_gemv else us_grouped
        if a.record:
            from pathlib import Path

            from qerl.bench.record import record

            case = f"{a.format} experts {e}x({2 * i}x{h}, {h}x{i}) top-{a.top_k} T={t}"
            for metric, v in (("loop_us", us_loop), ("grouped_us", us_grouped), ("gemv_us", us_gemv),
                              ("humming_us", us_hum)):
                if v == v:
                    record("moe", case, metric, v, "µs", results_dir=Path(a.results_dir))
        print(f"{t:>5} {hit:>4} {us_loop:>9.1f} {us_grouped:>10.1f} {us_gemv:>9.1f} {us_loop / best:>8.2f}x "
              f"{hit * expert_bytes / best / 1e3:>10.0f} {d_grouped:>11.2e} {d_gemv:>9.2e}", flush=True)

if a.profile and dev == "cuda":  # where a decode call's time goes: GPU kernels against the host's launches
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), settings.use(moe_gemv=True):
        for t in (1, 64):
            x = torch.randn(t, h, device=dev, dtype=dt)
            idx = torch.stack([torch.randperm(e, device=dev)[: a.top_k] for _ in range(t)])
            wts = torch.softmax(torch.randn(t, a.top_k, device=dev), -1).to(dt)
            q(x, idx, wts)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    q(x, idx, wts)
                torch.cuda.synchronize()
            ev = prof.key_averages()
            gpu = sum(x.self_device_time_total for x in ev) / 10
            print(f"== T={t} gemv: GPU kernel time {gpu:.1f} µs a call, {sum(x.count for x in ev if x.self_device_time_total > 0) // 10} kernels")
            print(ev.table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=50))

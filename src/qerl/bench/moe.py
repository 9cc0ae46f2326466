"""One MoE layer's experts: transformers' loop against QuantExperts' grouped path and the decode GEMV.

    python -m qerl.bench.moe [--record] [--experts 128 --hidden 2048 --inter 768 --top-k 8]   # Qwen3-30B-A3B
    qerl bench moe --experts 32 --hidden 2880 --inter 2880 --top-k 4 --format mxfp4            # gpt-oss-20b
    qerl bench moe --sweep --batches 1,8,64 [--skew 2]     # the decode GEMV alone over tile sizes (GPU)

Random weights and routing; at each token count (1 / 8 / 64 / 512 / 2048 by default): the loop (each hit expert
dequantized, the reference), the grouped path (hit experts dequantized a chunk at a time, torch._grouped_mm;
KernelSettings.moe_grouped) and, for decode batches (T <= moe_gemv.MAX_TOKENS), the grouped 4-bit GEMV
(KernelSettings.moe_gemv); --humming adds humming-kernels' MoE GEMM (kernels/humming_moe.py, NVFP4). Prints µs a
layer call, the bandwidth the hit experts' bytes imply and each path's largest difference from the loop. Rows go
to <results-dir>/moe.jsonl; scripts/plot_moe.py draws them (benchmarks/moe_expert_layer.png).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

CMD = "python -m qerl.bench.moe"


def _timed(fn, dev, reps=20) -> float:
    """µs a call, after one warm-up call."""
    fn()
    if dev != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) * 1e6 / reps
    torch.cuda.synchronize()
    s, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    t.record()
    torch.cuda.synchronize()
    return s.elapsed_time(t) * 1000 / reps


SKEW = 0.0  # --skew: 0 draws each token's experts uniformly


def _routing(t, e, top_k, dev, dt):
    """Each token's top-k distinct experts: uniform, or with --skew s expert j drawn with weight (j + 1)^-s (a
    router that favours few experts, as the random-weight model's: 25 of 128 hit at 64 tokens, its profile)."""
    if SKEW > 0:
        w = (torch.arange(e, dtype=torch.float64) + 1) ** -SKEW
        g = torch.Generator().manual_seed(t)
        idx = torch.multinomial(w.expand(t, e), top_k, replacement=False, generator=g).to(dev)
    else:
        idx = torch.stack([torch.randperm(e, device=dev)[:top_k] for _ in range(t)])
    return idx, torch.softmax(torch.randn(t, top_k, device=dev), -1).to(dt)


def _profile(q, h, e, top_k, dev, dt):
    """Where a decode call's time goes (the GEMV at T = 1 and 64): GPU kernels against the host's launches."""
    from torch.profiler import ProfilerActivity, profile

    from ..kernels import settings

    with torch.no_grad(), settings.use(moe_gemv=True):
        for t in (1, 64):
            x = torch.randn(t, h, device=dev, dtype=dt)
            idx, wts = _routing(t, e, top_k, dev, dt)
            q(x, idx, wts)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    q(x, idx, wts)
                torch.cuda.synchronize()
            ev = prof.key_averages()
            gpu = sum(x.self_device_time_total for x in ev) / 10
            kernels = sum(x.count for x in ev if x.self_device_time_total > 0) // 10
            print(f"== T={t} gemv: GPU kernel time {gpu:.1f} µs a call, {kernels} kernels")
            print(ev.table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=50))


SWEEP = ((16, 32, 64), (32, 64, 128), (128, 256), (4, 8), (3,), (0, 1, 2), (0,))  # block_m, block_n, block_k,
# warps, stages, x_mode, maxnreg (0: the compiler's choice)


def _sweep(q, h, i, e, top_k, batches, dev, dt, expert_bytes, rec, axes=SWEEP):
    """The grouped GEMV kernel alone (gate_up then down, as a decode layer call runs them) at each decode batch,
    over tile sizes: µs, the hit experts' bytes over that time, and each tile's largest difference from the
    default's output. The old tile (64 tokens whatever the pairs per expert) is the baseline."""
    import itertools

    from ..kernels import moe_gemv

    grid = [moe_gemv.Tiles(bm, bn, bk, w, st, xm, reg) for bm, bn, bk, w, st, xm, reg in
            itertools.product(*axes)]
    for t in batches:
        if t > moe_gemv.MAX_TOKENS:
            continue
        x = torch.randn(t, h, device=dev, dtype=dt)
        idx, _ = _routing(t, e, top_k, dev, dt)
        hit = idx.unique().numel()
        rt = moe_gemv.route(idx, e)
        gu, dn = q.stacked("gate_up_proj"), q.stacked("down_proj")
        mid = torch.randn(idx.numel(), i, device=dev, dtype=dt)

        def call(tiles):
            a = moe_gemv.grouped_gemv(x, rt.token, rt, q.fmt, gu, q.shapes["gate_up_proj"], tiles=tiles)
            return a, moe_gemv.grouped_gemv(mid, None, rt, q.fmt, dn, q.shapes["down_proj"], tiles=tiles)

        default = moe_gemv.default_tiles(idx.numel(), e)
        old = moe_gemv.Tiles(min(64, max(16, 1 << (t - 1).bit_length())), 64, 128, 4, 3, x_mode=0)
        want = [y.float() for y in call(default)]
        times = {}
        for tiles in dict.fromkeys([old, default] + [g for g in grid if g.block_m <= max(16, 2 * old.block_m)]):
            try:
                got = call(tiles)
            except Exception as err:  # a tile the compiler refuses (shared memory): said, skipped
                print(f"  T={t} {tiles}: {type(err).__name__}: {str(err).splitlines()[0][:80]}")
                continue
            d = max(((g.float() - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want))
            times[tiles] = _timed(lambda: call(tiles), dev, 20)
            if d > 2e-2:
                print(f"  T={t} {tiles}: relative difference {d:.2e} from the default: wrong, dropped")
                times.pop(tiles)
        if not times:
            print(f"== GEMV tiles at T={t}: no tile ran")
            continue
        best = min(times, key=times.get)
        print(f"== GEMV tiles at T={t} ({hit} experts hit, {hit * expert_bytes / 1e6:.0f} MB): "
              f"old {times.get(old, float('nan')):.1f} µs, default {times.get(default, float('nan')):.1f} µs, "
              f"best {times[best]:.1f} µs ({hit * expert_bytes / times[best] / 1e3:.0f} GB/s) {best}")
        for tiles in sorted(times, key=times.get)[:8]:
            print(f"   {times[tiles]:8.1f} µs  {tiles}")
        for name, tiles in (("old", old), ("default", default), ("best", best)):
            if tiles in times:
                xm = f" x{tiles.x_mode}" if tiles.x_mode else ""  # older rows: x_mode 0
                xm += f" r{tiles.maxnreg}" if tiles.maxnreg else ""
                rec(f"T={t} gemv kernel only, {name} tiles {tiles.block_m}x{tiles.block_n}x{tiles.block_k} "
                    f"w{tiles.num_warps} s{tiles.num_stages}{xm}", "gemv_kernel_us", times[tiles])


def _route_times(e, top_k, batches, dev, rec):
    """µs of building one step's routing (moe_gemv.route) per version, replayed from a CUDA graph of 20 calls:
    two argsorts, the counting sort, the one-launch Triton kernel (KernelSettings.moe_route_fused)."""
    from ..kernels import moe_gemv, settings

    versions = {"argsort": dict(moe_route_counting=False, moe_route_fused=False),
                "counting": dict(moe_route_counting=True, moe_route_fused=False),
                "fused": dict(moe_route_fused=True)}
    for t in batches:
        idx, _ = _routing(t, e, top_k, dev, torch.bfloat16)
        times = {}
        for name, kw in versions.items():
            with settings.use(**kw):
                moe_gemv.route(idx, e)  # JIT
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(20):
                        moe_gemv.route(idx, e)
                times[name] = _timed(g.replay, dev, 10) / 20
            rec(f"route T={t} k={top_k} E={e} {name}", "route_us", times[name])
        print(f"== route T={t}: " + ", ".join(f"{k} {v:.1f} µs" for k, v in times.items()), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="qerl bench moe", description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--batches", default="1,8,64,512,2048", help="tokens in a layer call")
    ap.add_argument("--format", default="nvfp4", choices=["nvfp4", "mxfp4"])
    ap.add_argument("--record", action="store_true", help="append the figures to <results-dir>/moe.jsonl")
    ap.add_argument("--results-dir", "--results_dir", default=None)
    ap.add_argument("--profile", action="store_true", help="torch.profiler of the GEMV at T = 1 and 64 (GPU)")
    ap.add_argument("--dtype", default="bfloat16", help="float32 for a CPU check (the interpreter's bf16 is broken)")
    ap.add_argument("--humming", action="store_true", help="also humming-kernels' MoE GEMM (NVFP4)")
    ap.add_argument("--sweep", action="store_true", help="the GEMV kernel alone over tile sizes at decode batches (GPU)")
    ap.add_argument("--route", action="store_true", help="µs of building the routing, per version (GPU graphs)")
    ap.add_argument("--sweep-grid", default=None, help="the sweep's axes as 'block_m;block_n;block_k;warps;stages;"
                    "x_mode;maxnreg', each a comma list (default: " + ";".join(",".join(map(str, v)) for v in SWEEP) + ")")
    ap.add_argument("--skew", type=float, default=0.0,
                    help="routing skew s: expert j drawn with weight (j+1)^-s (0: uniform; the case names it)")
    a = ap.parse_args(argv)
    global SKEW
    SKEW = a.skew
    skew = f" skew {a.skew:g}" if a.skew else ""
    from ..kernels import moe_gemv, settings
    from ..layers.quant_experts import QuantExperts
    from .record import RESULTS, record

    dt = getattr(torch, a.dtype)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    e, h, i = a.experts, a.hidden, a.inter
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = torch.randn(e, 2 * i, h, device=dev, generator=g, dtype=dt) * 0.02
    down = torch.randn(e, h, i, device=dev, generator=g, dtype=dt) * 0.02
    q = QuantExperts.quantize(gate_up, down, a.format, lambda x: torch.nn.functional.silu(x[..., :i]) * x[..., i:], dt)
    del gate_up, down
    expert_bytes = (0.5625 if a.format == "nvfp4" else 0.53125) * 3 * i * h  # 4 bits + a scale per 16 (32) weights
    hum = None
    if a.humming:
        from ..kernels.humming_moe import HummingExperts

        hum = HummingExperts.from_quant_experts(q)
    rdir = Path(a.results_dir) if a.results_dir else RESULTS
    args = list(argv if argv is not None else sys.argv[1:])
    cut = {j for j, x in enumerate(args) if x in ("--results-dir", "--results_dir")}  # where rows go: not the case
    cmd = " ".join([CMD] + [x for j, x in enumerate(args) if j not in cut and j - 1 not in cut])
    print(f"{torch.cuda.get_device_name(0) if dev == 'cuda' else 'CPU'}; experts {e} x (gate_up {2 * i}x{h}, "
          f"down {h}x{i}) {a.format}, top-{a.top_k}")
    print(f"{'T':>5} {'hit':>4} {'loop µs':>9} {'grouped µs':>10} {'gemv µs':>9} {'best/loop':>9} {'GB/s best':>10} "
          f"{'|d| grouped':>11} {'|d| gemv':>9}")
    nan = float("nan")
    with torch.no_grad():
        for t in map(int, a.batches.split(",")):
            x = torch.randn(t, h, device=dev, dtype=dt)
            idx, wts = _routing(t, e, a.top_k, dev, dt)
            hit = idx.unique().numel()
            reps = 20 if t <= 64 else 5
            call = lambda: q(x, idx, wts)  # noqa: E731
            with settings.use(moe_gemv=False, moe_grouped=False):  # transformers' loop: the reference
                want = call().float()
                us = {"loop_us": _timed(call, dev, reps)}
            with settings.use(moe_gemv=False, moe_grouped=True):
                d_grouped = (call().float() - want).abs().max().item()
                us["grouped_us"] = _timed(call, dev, reps)
            us["gemv_us"], d_gemv = nan, nan
            if t <= moe_gemv.MAX_TOKENS:
                with settings.use(moe_gemv=True):
                    d_gemv = (call().float() - want).abs().max().item()
                    us["gemv_us"] = _timed(call, dev, reps)
            us["humming_us"] = nan
            if hum is not None:
                d_hum = (hum(x, idx, wts).float() - want).abs().max().item()
                us["humming_us"] = _timed(lambda: hum(x, idx, wts), dev, reps)
                print(f"      humming MoE GEMM: {us['humming_us']:.1f} µs, |d| {d_hum:.2e}", flush=True)
            best = min(v for k, v in us.items() if k in ("grouped_us", "gemv_us") and v == v)
            if a.record:
                case = f"{a.format} experts {e}x({2 * i}x{h}, {h}x{i}) top-{a.top_k}{skew} T={t}"
                for metric, v in us.items():
                    if v == v:
                        record("moe", case, metric, v, "µs", command=cmd, results_dir=rdir)
            print(f"{t:>5} {hit:>4} {us['loop_us']:>9.1f} {us['grouped_us']:>10.1f} {us['gemv_us']:>9.1f} "
                  f"{us['loop_us'] / best:>8.2f}x {hit * expert_bytes / best / 1e3:>10.0f} {d_grouped:>11.2e} "
                  f"{d_gemv:>9.2e}", flush=True)
    if a.profile and dev == "cuda":
        _profile(q, h, e, a.top_k, dev, dt)
    if a.route and dev == "cuda":
        case0 = f"{a.format} experts {e}x({2 * i}x{h}, {h}x{i}) top-{a.top_k}{skew}"
        rrec = (lambda c, m, v: record("moe", f"{case0} {c}", m, v, "µs", command=cmd, results_dir=rdir)) \
            if a.record else (lambda c, m, v: None)
        _route_times(e, a.top_k, [int(b) for b in a.batches.split(",") if int(b) <= moe_gemv.MAX_TOKENS], dev, rrec)
    if a.sweep:
        case0 = f"{a.format} experts {e}x({2 * i}x{h}, {h}x{i}) top-{a.top_k}{skew}"
        rec = (lambda c, m, v: record("moe", f"{case0} {c}", m, v, "µs", command=cmd, results_dir=rdir)) \
            if a.record else (lambda c, m, v: None)
        axes = SWEEP if a.sweep_grid is None else tuple(tuple(map(int, v.split(","))) for v in a.sweep_grid.split(";"))
        if len(axes) != len(SWEEP):
            ap.error(f"--sweep-grid needs {len(SWEEP)} axes separated by ';', got {a.sweep_grid!r}")
        _sweep(q, h, i, e, a.top_k, [int(b) for b in a.batches.split(",")], dev, dt, expert_bytes, rec, axes)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""W4 matmul kernels vs cuBLAS bf16 at every linear shape of Qwen2.5-7B and -32B.

    python -m qerl.bench.kernels [--record] [--sweep] [--out DIR]

Every timing is a CUDA-graph replay of many calls that rotate over several weight
sets (more than the L2 holds), so launch gaps and cache hits stay out of it;
median of several replays. The copy bandwidth is measured in the same run and
each kernel's effective bandwidth (the fewest bytes it must move / time) is given
as a fraction of it. Targets are the issue's, over the whole 7B layer set.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ..formats import get_format
from .memory import layer_shapes
from .record import record, tee_log

MS = [1, 2, 4, 8, 16, 32, 64, 256, 2048, 8192]
ROTATE_BYTES = 512 << 20  # bf16 bytes of weights per rotation (H200 L2: 50 MB)


def time_eager(fns, calls=16, replays=5) -> float:
    """µs per call issued eagerly from Python (for paths that cannot be graph-captured)."""
    for f in fns[:2]:
        f()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(calls):
            fns[i % len(fns)]()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def time_calls(fns, min_calls=48, replays=7) -> float:
    """µs per call: graph of fns called in rotation, replayed; median over replays."""
    calls = max(min_calls, len(fns))
    for f in fns[: min(3, len(fns))]:
        f()  # compile / warm up outside the graph
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(len(fns)):
            fns[i]()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del g
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes/s of large device-to-device copies (read + write counted): the best of
    several sizes after a warm-up, so clocks have ramped up and no run is caught cold."""
    best = 0.0
    for n in (1 << 27, 1 << 28, 1 << 29):  # 256 MiB .. 1 GiB of bf16
        src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        for _ in range(20):
            dst.copy_(src)
        us = min(time_calls([lambda: dst.copy_(src)], min_calls=8, replays=5) for _ in range(3))
        best = max(best, 2 * n * 2 / (us * 1e-6))
        del src, dst
    torch.cuda.empty_cache()
    return best


class ShapeSets:
    """Several random weight sets of one shape: bf16 and quantized."""

    def __init__(self, n, k, fmts, seed=0):
        self.n, self.k = n, k
        self.count = max(2, min(64, -(-ROTATE_BYTES // (n * k * 2))))
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.bf16, self.q = [], {f: [] for f in fmts}
        for _ in range(self.count):
            w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
            self.bf16.append(w)
            for f in fmts:
                self.q[f].append(get_format(f).quantize(w))


def _bench_shape(sets, fmt, m, mode, lora_r=0, x=None):
    """Per-call µs of one (shape, M) in one mode: bf16 | auto | fused | dequant | torch | lora_unfused."""
    from ..kernels import dispatch, triton_backend
    from ..kernels import w4_matmul as K

    n, k = sets.n, sets.k
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) if x is None else x
    f = get_format(fmt)
    if mode == "bf16":
        return time_calls([lambda w=w: torch.matmul(x, w.t()) for w in sets.bf16])
    if mode == "torch":
        return time_eager([lambda t=t: dispatch.torch_matmul(x, f, t, (n, k)) for t in sets.q[fmt]])
    fns = []
    for i, t in enumerate(sets.q[fmt]):
        st = triton_backend.prepare(f, t, (n, k))
        if lora_r:
            a = torch.randn(lora_r, k, device="cuda", dtype=torch.bfloat16) * 0.01
            b = torch.randn(n, lora_r, device="cuda", dtype=torch.bfloat16) * 0.01
            if mode == "lora_unfused":  # the adapter as two extra GEMMs and an add (what peft does)
                fns.append(lambda t=t, a=a, b=b: triton_backend.matmul(x, f, t, (n, k)) + torch.nn.functional.linear(
                    torch.nn.functional.linear(x, a), b) * 2.0)
            else:
                fns.append(lambda t=t, a=a, b=b: triton_backend.matmul(
                    x, f, t, (n, k), lora=(torch.nn.functional.linear(x, a), b, 2.0)))
        elif mode == "auto":
            fns.append(lambda t=t: triton_backend.matmul(x, f, t, (n, k)))
        elif mode == "fused":
            fns.append(lambda st=st: K.fused_matmul(x, st[0], st[1], st[2], st[3], st[4], n, asm=st[6]))
        elif mode == "fused_portable":  # the same kernel with the portable (non-PTX) decode
            fns.append(lambda st=st: K.fused_matmul(x, st[0], st[1], st[2], st[3], st[4], n))
        elif mode == "dequant":
            fns.append(lambda st=st: K.dequant_matmul(x, st[0], st[1], st[2], st[3], st[5], n))
        elif mode == "dequant_only":
            buf = K.SCRATCH.get(n, k, "cuda", torch.bfloat16)
            fns.append(lambda st=st, buf=buf: K.dequantize(st[0], st[1], st[2], st[3], n, k, torch.bfloat16, out=buf))
    return time_calls(fns)


def sweep(out: Path, log):
    """Tiles/split of the fused kernel per M bucket, and the M up to which it beats dequantize + cuBLAS.

    Sets the winners in-process (w4_matmul.TILES, triton_backend.FUSED_MAX_M) so the benchmark that
    follows measures them; the printed winners are then written into the code.
    """
    from ..kernels import triton_backend
    from ..kernels import w4_matmul as K

    shapes = layer_shapes("qwen2.5-7b")
    pick = {"q": shapes["q"], "k": shapes["k"], "gate": shapes["gate"], "down": shapes["down"]}
    sets = {s: ShapeSets(*nk, ["nvfp4"]) for s, nk in pick.items()}
    configs = [(bn, bk, 8 if bn == 128 else 4, st, wv) for bn in (32, 64, 128) for bk in (128, 256) for st in (3, 4)
               for wv in (1, 2, 4)]
    f = get_format("nvfp4")
    res, best_of = {}, {}
    for m in (1, 16, 32, 64):
        xs = {s: torch.randn(m, ss.k, device="cuda", dtype=torch.bfloat16) for s, ss in sets.items()}
        for cfg in configs:
            tot = 0.0
            for s, ss in sets.items():
                n, k = ss.n, ss.k
                c = K.make_config(m, n, k, 0, xs[s].device, *cfg)
                fns = []
                for t in ss.q["nvfp4"]:
                    st = triton_backend.prepare(f, t, (n, k))
                    fns.append(lambda st=st, c=c, x=xs[s], n=n: K.fused_matmul(x, 0, st[1], st[2], None, st[4], n,
                                                                               config=c, asm=st[6]))
                try:
                    us = time_calls(fns, replays=3)
                except Exception as e:  # a config the compiler rejects (shared memory, registers)
                    log(f"sweep m={m} {cfg} {s}: {type(e).__name__}: {str(e)[:160]}")
                    us = float("inf")
                res[f"{m}|{cfg}|{s}"] = us
                tot += us
            res[f"{m}|{cfg}|total"] = tot
        ranked = sorted((res[f"{m}|{c}|total"], c) for c in configs)
        best_of[m] = ranked[0]
        dq = sum(_bench_shape(ss, "nvfp4", m, "dequant", x=xs[s]) for s, ss in sets.items())
        res[f"{m}|dequant|total"] = dq
        log(f"sweep M={m}: dequant+cuBLAS {dq:.1f} µs; best (BN, BK, warps, stages, waves): "
            + ", ".join(f"{c} {t:.1f}" for t, c in ranked[:4]))
    K.TILES.update({4: best_of[1][1], 16: best_of[16][1], 32: best_of[32][1], 64: best_of[64][1]})
    fused_max = 16
    for m in (32, 64):
        if best_of[m][0] < res[f"{m}|dequant|total"]:
            fused_max = m
    triton_backend.FUSED_MAX_M = fused_max
    log(f"sweep result: TILES = {K.TILES}; FUSED_MAX_M = {fused_max}")
    (out / "sweep.json").write_text(json.dumps(res, indent=1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help="append the figures to benchmarks/results/kernels.jsonl")
    ap.add_argument("--results-dir", default=None, help="where the jsonl goes (default: the repository's)")
    ap.add_argument("--sweep", action="store_true", help="also sweep the fused kernel's tiles")
    ap.add_argument("--models", default="qwen2.5-7b,qwen2.5-32b")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--out", default=".", help="folder for the full json and the log")
    a = ap.parse_args(argv)
    out = Path(a.out)
    log = tee_log(out / "bench_kernels.log")

    final: list[str] = []

    def log_final(msg):
        log(msg)
        final.append(msg)

    dev = torch.cuda.get_device_name(0)
    t0 = time.time()
    copy_bandwidth()  # clocks ramp up from idle: the first measurement is low
    bw = copy_bandwidth()
    log(f"{dev}: copy bandwidth {bw / 1e12:.3f} TB/s")
    if a.sweep:
        sweep(out, log)
    from ..kernels import w4_matmul as K

    ms = [int(v) for v in a.ms.split(",")]
    rows, results = [], {"copy_bw": bw, "device": dev, "shapes": {}}
    extra_fmts = ["mxfp4", "nf4"]
    for model in a.models.split(","):
        shapes = layer_shapes(model)
        agg = {}  # (mode, fmt, m) -> [sum µs, sum bytes]
        for name, (n, k) in shapes.items():
            fmts = ["nvfp4"] + (extra_fmts if model == "qwen2.5-7b" else [])
            sets = ShapeSets(n, k, fmts, seed=n + k)
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                r = {"bf16": _bench_shape(sets, "nvfp4", m, "bf16", x=x),
                     "nvfp4": _bench_shape(sets, "nvfp4", m, "auto", x=x)}
                if m <= 256:
                    r["nvfp4_fused"] = _bench_shape(sets, "nvfp4", m, "fused", x=x)
                if model == "qwen2.5-7b" and m in (1, 16, 64):
                    r["nvfp4_fused_portable"] = _bench_shape(sets, "nvfp4", m, "fused_portable", x=x)
                r["nvfp4_dequant"] = _bench_shape(sets, "nvfp4", m, "dequant", x=x)
                if model == "qwen2.5-7b" and m in (1, 16, 64, 2048):
                    for fm in extra_fmts:
                        r[fm] = _bench_shape(sets, fm, m, "auto", x=x)
                if model == "qwen2.5-7b" and m in (1, 16, 64):
                    for rank in (16, 32, 64):
                        r[f"nvfp4_lora{rank}"] = _bench_shape(sets, "nvfp4", m, "lora", lora_r=rank, x=x)
                    r["nvfp4_lora32_unfused"] = _bench_shape(sets, "nvfp4", m, "lora_unfused", lora_r=32, x=x)
                if model == "qwen2.5-7b" and name == "gate" and m in (1, 2048):
                    r["torch_dequant_matmul"] = _bench_shape(sets, "nvfp4", m, "torch", x=x)
                wb = K.roofline_bytes(m, n, k, 0)
                bb = n * k * 2 + (m * k + m * n) * 2
                for mode, us in r.items():
                    fid = 2 if mode == "nf4" else (1 if mode == "mxfp4" else 0)
                    byt = bb if mode in ("bf16", "torch_dequant_matmul") else K.roofline_bytes(m, n, k, fid)
                    agg.setdefault((mode, m), [0.0, 0])
                    agg[(mode, m)][0] += us
                    agg[(mode, m)][1] += byt
                results["shapes"][f"{model}|{name}|{m}"] = r
                log(f"{model:12s} {name:5s} {n:6d}x{k:<6d} M={m:<5d} bf16 {r['bf16']:9.2f} µs | nvfp4 {r['nvfp4']:9.2f} µs "
                    f"{wb / r['nvfp4'] / 1e3:7.0f} GB/s {wb / r['nvfp4'] * 1e6 / bw:5.1%} | x{r['bf16'] / r['nvfp4']:5.2f} "
                    + " ".join(f"{kk}={v:.1f}" for kk, v in r.items() if kk not in ("bf16", "nvfp4")))
                if a.record:
                    rows.append((f"{model} {name} {n}x{k} M={m}", "us", r["nvfp4"], "us", None))
                    rows.append((f"{model} {name} {n}x{k} M={m}", "speedup_vs_bf16", r["bf16"] / r["nvfp4"], "x", None))
            dq = _bench_shape(sets, "nvfp4", 1, "dequant_only")
            dq_bytes = n * k // 2 + n * k // 16 + n * k * 2
            agg.setdefault(("dequant_only", 0), [0.0, 0])
            agg[("dequant_only", 0)][0] += dq
            agg[("dequant_only", 0)][1] += dq_bytes
            log(f"{model:12s} {name:5s} dequantize alone {dq:8.2f} µs  {dq_bytes / dq / 1e3:6.0f} GB/s "
                f"{dq_bytes / dq * 1e6 / bw:5.1%} of copy")
            del sets
            torch.cuda.empty_cache()
        # ---- the layer-set summary -------------------------------------------------------------
        log_final(f"\n{model}: whole layer set (q,k,v,o,gate,up,down), sums over shapes")
        log_final(f"{'M':>6} {'bf16 µs':>10} {'nvfp4 µs':>10} {'speedup':>8} {'%copy':>6} {'fused':>9} {'dequant':>9}"
            f" {'mxfp4':>8} {'nf4':>8} {'lora32':>8} {'portable':>9}")
        summary = {}
        for m in ms:
            bf, q = agg[("bf16", m)][0], agg[("nvfp4", m)]
            frac = q[1] / q[0] * 1e6 / bw
            sp = bf / q[0]
            g = lambda key: agg[(key, m)][0] if (key, m) in agg else float("nan")  # noqa: E731
            log_final(f"{m:>6} {bf:>10.1f} {q[0]:>10.1f} {sp:>8.2f} {frac:>6.1%} {g('nvfp4_fused'):>9.1f} "
                f"{g('nvfp4_dequant'):>9.1f} {g('mxfp4'):>8.1f} {g('nf4'):>8.1f} {g('nvfp4_lora32'):>8.1f} "
                      f"{g('nvfp4_fused_portable'):>9.1f}")
            summary[m] = dict(bf16=bf, nvfp4=q[0], speedup=sp, frac=frac)
            if a.record:
                case = f"{model} layer set M={m}"
                tgt_sp = ">=3.0" if m <= 16 else (">=2.0" if m == 64 else None)
                if model == "qwen2.5-7b":
                    rows.append((case, "speedup_vs_bf16", sp, "x", tgt_sp))
                    if m <= 16:
                        rows.append((case, "fraction_of_copy_bw", frac, "", ">=0.75"))
                    if m >= 2048:
                        rows.append((case, "time_vs_bf16", q[0] / bf, "x", "<=1.15"))
                    for fm in extra_fmts + [f"nvfp4_lora{r}" for r in (16, 32, 64)] + ["nvfp4_lora32_unfused"]:
                        if (fm, m) in agg:
                            rows.append((case, f"{fm}_speedup_vs_bf16", bf / agg[(fm, m)][0], "x", None))
                    if ("nvfp4_lora32", m) in agg:
                        over = agg[("nvfp4_lora32", m)][0] / q[0] - 1
                        rows.append((case, "lora32_overhead", over, "", "<=0.10" if m == 1 else None))
                        for r in (16, 64):
                            rows.append((case, f"lora{r}_overhead", agg[(f"nvfp4_lora{r}", m)][0] / q[0] - 1, "", None))
                else:
                    rows.append((case, "speedup_vs_bf16", sp, "x", None))
                    rows.append((case, "fraction_of_copy_bw", frac, "", None))
        d = agg[("dequant_only", 0)]
        dfrac = d[1] / d[0] * 1e6 / bw
        log_final(f"{model}: dequantize kernel alone over the layer set: {dfrac:.1%} of copy bandwidth")
        if a.record:
            rows.append((f"{model} layer set", "dequant_fraction_of_copy_bw", dfrac, "",
                         ">=0.80" if model == "qwen2.5-7b" else None))
            if model == "qwen2.5-7b":
                for m in (1, 2048):
                    sh = results["shapes"].get(f"{model}|gate|{m}", {})
                    if "torch_dequant_matmul" in sh:
                        rows.append((f"{model} gate M={m}", "torch_dequant_matmul_slowdown_vs_bf16",
                                     sh["torch_dequant_matmul"] / sh["bf16"], "x", None))
        results[f"summary|{model}"] = summary
    bw_end = copy_bandwidth()
    log_final(f"copy bandwidth at the start {bw / 1e12:.3f} TB/s, at the end {bw_end / 1e12:.3f} TB/s")
    if a.record:
        rows.append(("copy", "copy_bandwidth", bw / 1e12, "TB/s", None))
        rows.append(("copy", "copy_bandwidth_end", bw_end / 1e12, "TB/s", None))
        kw = {"results_dir": Path(a.results_dir)} if a.results_dir else {}
        for case, metric, value, unit, target in rows:
            record("kernels", case, metric, float(value), unit, target, device=dev,
                   command="python -m qerl.bench.kernels --record", **kw)
    (out / "bench_kernels.json").write_text(json.dumps(results, indent=1))
    print("\n".join(["", "=" * 40, f"copy bandwidth {bw / 1e12:.3f} TB/s", *final]))
    log(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()

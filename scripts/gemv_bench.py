#!/usr/bin/env python3
"""GEMV (w4_gemv, M <= 4) vs the fused tensor-core kernel vs bf16 cuBLAS at the Qwen2.5-7B shapes.

    python3 scripts/gemv_bench.py [--budget 140] [--out DIR]      (a CUDA GPU; < 3 minutes)

For q/o 3584x3584, k/v 512x3584, gate/up 18944x3584, down 3584x18944 at M = 1, 2, 4:
  * correctness: every GEMV variant and the fused kernel on a real NVFP4-quantized weight against
    dequantize + an fp32 torch matmul (bf16 activations), max |err| / max |ref|;
  * time (CUDA-graph replay rotating over more weight copies than the L2 holds, median; the same
    method as `python -m qerl.bench.kernels`) of the GEMV for several BLOCK_N / BLOCK_K / num_warps /
    prefetch / split-K variants, the fused kernel, and bf16 torch.matmul on a dense weight; with and
    without a rank-32 LoRA expand in the epilogue (xa = x·Aᵀ precomputed, the same for both kernels);
  * % of the copy bandwidth, bytes = packed + scales + x + y (bf16: 2 bytes per weight + x + y);
  * the best variant per shape, the 7B layer-set sums, and a `TILES = {...}` line for w4_gemv.py.
Logs (and a json of every timing) go to $OUT (or --out) when set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from qerl.bench.kernels import copy_bandwidth, time_calls  # noqa: E402
from qerl.formats import get_format  # noqa: E402
from qerl.kernels import triton_backend  # noqa: E402
from qerl.kernels import w4_gemv as G  # noqa: E402
from qerl.kernels import w4_matmul as K  # noqa: E402
from qerl.kernels.w4_decode_consts import ASM_SHIFT  # noqa: E402

SHAPES = {"q/o": (3584, 3584), "k/v": (512, 3584), "gate/up": (18944, 3584), "down": (3584, 18944)}
PER_LAYER = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}  # projections of one decoder layer per shape
MS = (1, 2, 4)
# (BLOCK_N, BLOCK_K, num_warps, prefetch); the split-K comes from WAVES (programs per SM)
# rows per thread = BLOCK_N / num_warps: 8, 8, 4, 8, 8, 4, 8, 4
VARIANTS = [(32, 512, 4, 1), (32, 512, 4, 0), (16, 512, 4, 1), (16, 512, 2, 1), (64, 512, 8, 1), (32, 512, 8, 1),
            (8, 512, 1, 1), (8, 512, 2, 1)]
WAVES = (1, 2, 4)
ROTATE_BYTES = 256 << 20  # weight bytes per rotation (H200 L2: 50 MB)
LORA_R = 32
DEV, DT = "cuda", torch.bfloat16


def _device_name():
    return torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (smoke run)"


def _cpu_smoke():
    """Exercise the script's logic on the CPU: Triton's interpreter, tiny shapes, fp32, fake timers."""
    global DEV, DT, SHAPES, VARIANTS, time_calls, copy_bandwidth
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    DEV, DT = "cpu", torch.float32
    SHAPES = {"q/o": (64, 256), "k/v": (16, 256), "gate/up": (96, 256), "down": (64, 512)}
    VARIANTS = VARIANTS[:2]
    ticks = iter(range(1, 1 << 30))

    def time_calls(fns, **_):  # noqa: F811
        fns[0]()
        return 10.0 + next(ticks) % 7

    copy_bandwidth = lambda: 1e12  # noqa: E731


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=140.0,
                    help="seconds after which the remaining variant sweeps are cut to the default tile")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for the log and json (default: $OUT)")
    ap.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)  # script check without a GPU
    a = ap.parse_args(argv)
    if a.cpu_smoke:
        _cpu_smoke()
    out = Path(a.out) if a.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "gemv_bench.log", "w") if out else None

    def log(msg=""):
        print(msg, flush=True)
        if logf:
            logf.write(msg + "\n")
            logf.flush()

    import triton

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references
    t0 = time.time()
    dev = torch.device(DEV)
    log(f"{_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
        f"SMs {G.num_sms(dev)}")
    copy_bandwidth()  # clocks ramp up from idle
    bw = copy_bandwidth()
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s  ({time.time() - t0:.0f} s)")
    res = {"device": _device_name(), "copy_bw": bw, "torch": torch.__version__,
           "triton": triton.__version__, "rows": []}
    pct = lambda byt, us: byt / (us * 1e-6) / bw  # noqa: E731
    best_cfg = {}  # (shape, M) -> (us, cfg)
    timings = {}  # (shape, M, cfg) -> us
    summary = {}  # (M, mode) -> [us summed over the layer set, bytes]
    nv = get_format("nvfp4")
    cut = False

    with torch.inference_mode():
        data = {}
        for sname, (n, k) in SHAPES.items():
            g = torch.Generator(device=DEV).manual_seed(n + k)
            # one real quantized weight for the error checks
            w = (torch.randn(n, k, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
            t = nv.quantize(w)
            del w
            # random codes and scales for timing, rotated past the L2
            cnt = max(2, min(160, -(-ROTATE_BYTES // (n * k // 2))))
            sets = [(torch.randint(0, 256, (n, k // 2), device=DEV, dtype=torch.uint8, generator=g),
                     torch.randint(0x20, 0x50, (n, k // 16), device=DEV, dtype=torch.uint8, generator=g))
                    for _ in range(cnt)]
            dense = [torch.randn(n, k, device=DEV, dtype=DT, generator=g)
                     for _ in range(max(2, min(64, -(-ROTATE_BYTES // (n * k * 2)))))]
            la = torch.randn(LORA_R, k, device=DEV, dtype=DT, generator=g) * 0.02
            lb = torch.randn(n, LORA_R, device=DEV, dtype=DT, generator=g) * 0.02
            data[sname] = (g, t, nv.dequantize(t, (n, k), torch.float32), sets, dense, la, lb)
        ginv = torch.full((1,), 1 / 900.0, device=DEV)
        gasm = (ginv * 2.0 ** ASM_SHIFT, 0)
        log(f"weights ready ({time.time() - t0:.0f} s)")
        for m in MS:  # M = 1 first: a cut by the time budget falls on M = 4
            for sname, (n, k) in SHAPES.items():
                g, t, wref, sets, dense, la, lb = data[sname]
                fid, packed, scale, _, inv, _, asm = triton_backend.prepare(nv, t, (n, k))
                x = torch.randn(m, k, device=DEV, dtype=DT, generator=g)
                xa = torch.nn.functional.linear(x, la)
                lora = (xa, lb, 2.0)
                ref = x.float() @ wref.t()
                ref_l = ref + 2.0 * (xa.float() @ lb.float().t())
                err = lambda y, r=ref: ((y.float() - r).abs().max() / r.abs().max()).item()  # noqa: E731
                byt = G.gemv_bytes(m, n, k, 0)
                bbyt = n * k * 2 + (m * k + m * n) * 2
                # ---- candidates: variants x splits ----
                cands = []
                for bn, bk, nw, pf in (VARIANTS if not cut else VARIANTS[:1]):
                    bkf = G.fit_block_k(k, bk, 0)
                    for sp in sorted({G.split_for(n, k, bn, bkf, dev, wv) for wv in WAVES}):
                        cfg = (bn, bk, nw, sp, pf)
                        if cfg not in cands:
                            cands.append(cfg)
                worst = 0.0
                for cfg in cands:
                    try:
                        y = G.gemv(x, fid, packed, scale, inv, n, config=cfg)
                        e = err(y)
                        if cfg[3] > 1:
                            assert torch.equal(y, G.gemv(x, fid, packed, scale, inv, n, config=cfg)), "nondeterministic"
                        us = time_calls([lambda p=p, s=s, c=cfg: G.gemv(x, 0, p, s, ginv, n, config=c)
                                         for p, s in sets])
                    except Exception as ex:  # a config the compiler rejects
                        log(f"  {sname} M={m} {cfg}: {type(ex).__name__}: {str(ex)[:200]}")
                        continue
                    worst = max(worst, e)
                    timings[(sname, m, cfg)] = us
                    res["rows"].append(dict(shape=sname, m=m, kind="gemv", cfg=cfg, us=us, err=e, pct=pct(byt, us)))
                    if (sname, m) not in best_cfg or us < best_cfg[(sname, m)][0]:
                        best_cfg[(sname, m)] = (us, cfg)
                    if time.time() - t0 > a.budget and not cut:
                        cut = True
                        log(f"  (time budget {a.budget:.0f} s reached: what is left sweeps one variant)")
                if (sname, m) not in best_cfg:
                    log(f"{sname} M={m}: no GEMV variant ran")
                    continue
                gbest_us, gcfg = best_cfg[(sname, m)]
                # ---- the fused kernel, bf16, LoRA ----
                efu = err(K.fused_matmul(x, fid, packed, scale, None, inv, n, asm=asm))
                fu = time_calls([lambda p=p, s=s: K.fused_matmul(x, 0, p, s, None, ginv, n, asm=gasm) for p, s in sets])
                bf = time_calls([lambda d=d: torch.matmul(x, d.t()) for d in dense])
                egl = err(G.gemv(x, fid, packed, scale, inv, n, lora=lora, config=gcfg), ref_l)
                gl = time_calls([lambda p=p, s=s: G.gemv(x, 0, p, s, ginv, n, lora=lora, config=gcfg) for p, s in sets])
                efl = err(K.fused_matmul(x, fid, packed, scale, None, inv, n, lora=lora, asm=asm), ref_l)
                fl = time_calls([lambda p=p, s=s: K.fused_matmul(x, 0, p, s, None, ginv, n, lora=lora, asm=gasm)
                                 for p, s in sets])
                for kind, us, e, b in (("fused", fu, efu, byt), ("bf16", bf, 0.0, bbyt), ("gemv_lora32", gl, egl, byt),
                                       ("fused_lora32", fl, efl, byt)):
                    res["rows"].append(dict(shape=sname, m=m, kind=kind, cfg=gcfg if "gemv" in kind else None, us=us,
                                            err=e, pct=pct(b, us)))
                for key, us, b in (("gemv", gbest_us, byt), ("fused", fu, byt), ("bf16", bf, bbyt),
                                   ("gemv_lora32", gl, byt), ("fused_lora32", fl, byt)):
                    acc = summary.setdefault((m, key), [0.0, 0])
                    acc[0] += PER_LAYER[sname] * us
                    acc[1] += PER_LAYER[sname] * b
                log(f"{sname:7s} {n:5d}x{k:<5d} M={m}  gemv {gbest_us:7.2f} µs {pct(byt, gbest_us):6.1%} {str(gcfg):22s}"
                    f" | fused {fu:7.2f} µs {pct(byt, fu):6.1%} | bf16 {bf:7.2f} µs {pct(bbyt, bf):6.1%}"
                    f" | lora32: gemv {gl:7.2f} fused {fl:7.2f} µs | x{fu / gbest_us:4.2f} vs fused"
                    f" | max rel err gemv {worst:.1e} (lora {egl:.1e}) fused {efu:.1e} (lora {efl:.1e})"
                    f"  [{time.time() - t0:.0f} s]")
                if m == 1:  # extras at M = 1: the reduce-kernel split, the plain-Triton decode, MXFP4
                    extra = []
                    if gcfg[3] > 1:
                        extra.append(("split_mode2", time_calls(
                            [lambda p=p, s=s: G.gemv(x, 0, p, s, ginv, n, config=gcfg, split_mode=2) for p, s in sets])))
                    G.USE_ASM = False
                    try:
                        e_noasm = err(G.gemv(x, fid, packed, scale, inv, n, config=gcfg))
                        extra.append(("no_asm", time_calls(
                            [lambda p=p, s=s: G.gemv(x, 0, p, s, ginv, n, config=gcfg) for p, s in sets])))
                    finally:
                        G.USE_ASM = True
                    mx = get_format("mxfp4")
                    tm = mx.quantize(wref.to(torch.bfloat16))
                    mfid, mpk, msc, _, _, _, _ = triton_backend.prepare(mx, tm, (n, k))
                    emx = err(G.gemv(x, mfid, mpk, msc, None, n, config=gcfg),
                              x.float() @ mx.dequantize(tm, (n, k), torch.float32).t())
                    msets = [(p, torch.randint(120, 130, (n, k // 32), device=DEV, dtype=torch.uint8, generator=g))
                             for p, _ in sets]
                    mus = time_calls([lambda p=p, s=s: G.gemv(x, 1, p, s, None, n, config=gcfg) for p, s in msets])
                    extra.append(("mxfp4", mus))
                    for kind, us in extra:
                        res["rows"].append(dict(shape=sname, m=m, kind=kind, cfg=gcfg, us=us))
                    log("        M=1 extras: " + ", ".join(f"{kd} {us:.2f} µs" for kd, us in extra)
                        + f" | plain-Triton decode err {e_noasm:.1e} | MXFP4 {pct(G.gemv_bytes(1, n, k, 1), mus):.1%}"
                        f" of copy, err {emx:.1e}")
                    del msets, tm

    # ---- summaries ----
    log("")
    log("Qwen2.5-7B layer set (q,k,v,o,gate,up,down), one decoder layer, sums of per-shape bests")
    log(f"{'M':>2} {'gemv µs':>9} {'%copy':>6} {'fused µs':>9} {'%copy':>6} {'bf16 µs':>8} {'%copy':>6} "
        f"{'gemv/fused':>10} {'lora32 gemv':>11} {'lora32 fused':>12}")
    for m in MS:
        if (m, "gemv") not in summary:
            continue
        row = {kk: summary[(m, kk)] for kk in ("gemv", "fused", "bf16", "gemv_lora32", "fused_lora32")}
        p = {kk: v[1] / (v[0] * 1e-6) / bw for kk, v in row.items()}
        log(f"{m:>2} {row['gemv'][0]:9.1f} {p['gemv']:6.1%} {row['fused'][0]:9.1f} {p['fused']:6.1%} "
            f"{row['bf16'][0]:8.1f} {p['bf16']:6.1%} {row['fused'][0] / row['gemv'][0]:10.2f}x "
            f"{row['gemv_lora32'][0]:11.1f} {row['fused_lora32'][0]:12.1f}")
        res[f"layer_set_M{m}"] = {kk: dict(us=v[0], pct=p[kk]) for kk, v in row.items()}
    log(f"(x28 layers: GEMV at M=1 = {summary.get((1, 'gemv'), [0])[0] * 28 / 1e3:.2f} ms per decode step, "
        f"fused {summary.get((1, 'fused'), [0])[0] * 28 / 1e3:.2f} ms)")

    # ---- the best config per shape: one for all M (least summed slowdown vs each M's best), per-M if >5 % better
    log("")
    log("best GEMV config per shape (BLOCK_N, BLOCK_K, num_warps, split_k, prefetch):")
    tiles = {}
    for sname, (n, k) in SHAPES.items():
        cfgs = {c for (s, m, c) in timings if s == sname}
        full = [c for c in cfgs if all((sname, m, c) in timings for m in MS)]
        if not full:
            continue
        score = lambda c: sum(timings[(sname, m, c)] / best_cfg[(sname, m)][0] for m in MS)  # noqa: E731
        pick = min(full, key=score)
        tiles[(n, k)] = pick
        per_m = ", ".join(f"M={m}: {best_cfg[(sname, m)][1]} {best_cfg[(sname, m)][0]:.2f} µs "
                          f"(shared {timings[(sname, m, pick)]:.2f})" for m in MS)
        log(f"  {sname:7s} {(n, k)}: {pick}   per M: {per_m}")
        for m in MS:
            if timings[(sname, m, pick)] > 1.05 * best_cfg[(sname, m)][0]:
                tiles[(m, n, k)] = best_cfg[(sname, m)][1]
    log("")
    log("paste into src/qerl/kernels/w4_gemv.py ((M, N, K) keys override (N, K) for that M):")
    log("TILES = {" + ", ".join(f"{key}: {val}" for key, val in tiles.items()) + "}")
    log(f"done in {time.time() - t0:.0f} s")
    res["tiles"] = {str(kk): vv for kk, vv in tiles.items()}
    if out:
        (out / "gemv_bench.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()

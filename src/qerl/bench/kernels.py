"""W4 matmul kernels vs cuBLAS bf16 on the fused layer sets of Qwen2.5-7B and -32B.

    python -m qerl.bench.kernels [--record] [--sweep] [--out DIR]

The layer set is what a decoder layer runs: q|k|v, o, gate|up, down (fused groups, one matmul
each). Per M: cuBLAS bf16 on the same fused shapes, the NVFP4 MMA path (kernel up to
w4_mma.MAX_M, dequantize + cuBLAS above), the previous Triton kernel (standard layout),
torch's int4 tinygemm (group 128), and LoRA r32 on every group (one shrink per group,
the expand in the epilogue). Every timing is a CUDA-graph replay of calls rotating over
weight sets larger than the L2; median of several replays. The copy bandwidth is measured in
the same run; effective bandwidth = the fewest bytes a kernel must move / its time.

    ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight ... \
        python -m qerl.bench.kernels --ncu --models qwen2.5-7b --groups qkv,down --ms 1,64,256 --modes humming,nvfp4

--ncu times nothing: it launches each mode once per group and M (after a warm-up call, so JIT and configs stay
outside) inside an NVTX range "profile", printing the ranges' order first, for Nsight Compute.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from ..formats import get_format
from ..formats.nvfp4_mma import NVFP4Mma
from ..kernels import routes
from .record import commit, record, tee_log

MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 2048, 8192]
MODES = ["bf16", "nvfp4", "mma", "routed", "routed_lora32", "nvfp4_lora32", "nvfp4_lora32_cublas_shrink", "wgmma", "wgmma_waves", "wgmma_lora32", "dequant",
         "humming", "humming_streamk", "humming_nosplit", "humming_sk2", "humming_ksplit2", "humming_ksplit4", "humming_lora32",
         "humming_lora32_addmm", "humming_lora32_overlap", "triton", "tinygemm"]
ROTATE_BYTES = 512 << 20  # bf16 bytes of weights per rotation (H200 L2: 50 MB)
# (N, K) of the fused groups of one decoder layer.
LAYER_SETS = {
    "qwen2.5-7b": {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)},
    "qwen2.5-32b": {"qkv": (7168, 5120), "o": (5120, 5120), "gate_up": (55296, 5120), "down": (5120, 27648)},
}
SEGMENTS = {"qkv": 3, "gate_up": 2}  # LoRA segments of a group (q, k, v rows; gate, up rows)
# Issue 31's targets for the 7B layer set vs cuBLAS bf16 (the routed path, and the wgmma kernel alone).
SPEEDUP_TARGETS = {1: ">=2.7", 2: ">=2.7", 4: ">=2.7", 8: ">=2.7", 16: ">=2.5", 32: ">=2.2", 64: ">=2.0",
                   128: ">=1.3", 256: ">=1.0"}


# Issue 47's targets for the routed path (7B layer set vs cuBLAS bf16, H200).
ROUTED_TARGETS = {32: ">=1.8", 64: ">=1.6", 128: ">=1.2", 256: ">=0.95", 2048: ">=0.95"}


def time_calls(fns, min_calls=48, replays=7) -> float:
    """µs per call: graph of fns called in rotation, replayed; median over replays."""
    calls = max(min_calls, len(fns))
    for f in fns[: min(3, len(fns))]:
        f()  # compile / warm up outside the graph
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
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
    """Bytes/s of large device-to-device copies (read + write), best of several sizes after warm-up."""
    best = 0.0
    for n in (1 << 27, 1 << 28, 1 << 29):
        src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        for _ in range(20):
            dst.copy_(src)
        us = min(time_calls([lambda: dst.copy_(src)], min_calls=8, replays=5) for _ in range(3))
        best = max(best, 2 * n * 2 / (us * 1e-6))
        del src, dst
    torch.cuda.empty_cache()
    return best


def nvfp4_bytes(m, n, k) -> int:
    return n * k // 2 + n * k // 16 + (m * k + m * n) * 2


class Sets:
    """Rotating weight sets of one group shape: bf16, NVFP4 (MMA layout and standard), int4 tinygemm."""

    def __init__(self, n, k, seed, tinygemm=True, count=None):
        self.n, self.k = n, k
        self.count = count or max(2, min(32, -(-ROTATE_BYTES // (n * k * 2))))
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.bf16, self.mma, self.std, self.int4 = [], [], [], []
        nv, mma = get_format("nvfp4"), NVFP4Mma()
        for _ in range(self.count):
            w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
            self.bf16.append(w)
            std = nv.quantize(w)
            self.std.append(std)
            self.mma.append(mma.from_checkpoint(std, (n, k)))
            if tinygemm:
                self.int4.append(_tinygemm_pack(w))
        self._humming = None
        self._ksplit: dict[int, list] = {}
        self.lora_a = torch.randn(3 * 32, k, device="cuda", dtype=torch.bfloat16) * 0.01  # r = 32, <= 3 segments
        self.lora_b = torch.randn(n, 32, device="cuda", dtype=torch.bfloat16) * 0.01


    @property
    def humming(self):
        """The same NVFP4 weights in humming-kernels' layout (built on first use; its repack time summed)."""
        if self._humming is None:
            from ..kernels.humming_backend import HummingWeight
            self._humming = [HummingWeight.build("nvfp4", t, (self.n, self.k)) for t in self.std]
        return self._humming

    def ksplit(self, splits: int) -> list:
        """The same weights as `splits` K-slices in humming's grouped layout (kernels/humming_ksplit.py)."""
        if splits not in self._ksplit:
            from ..kernels.humming_ksplit import KSplitWeight
            self._ksplit[splits] = [KSplitWeight.build(t, (self.n, self.k), splits) for t in self.std]
        return self._ksplit[splits]


def _lora32(sets, group):
    """(A stacked for r = 32 on every member, segment starts) of a group."""
    segs, r = SEGMENTS.get(group, 1), 32
    starts = tuple(int(v) for v in torch.linspace(0, sets.n, segs + 1)[1:-1].div(16).floor().mul(16).tolist())
    return sets.lora_a[: segs * r], starts


def _tinygemm_pack(w, group=128):
    """torch's int4 weight-only format (asymmetric, group 128), or None where this torch lacks it."""
    try:
        n, k = w.shape
        wg = w.float().view(n, k // group, group)
        lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp_min(1e-8)
        q = ((wg - lo) / scale).round().clamp(0, 15).to(torch.int32).view(n, k)
        packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        wp = torch._convert_weight_to_int4pack(packed, 8)
        zero = lo + 8 * scale  # tinygemm: w = (q - 8) * scale + zero
        sz = torch.stack([scale.view(n, -1), zero.view(n, -1)], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        return wp, sz, group
    except Exception:
        return None


def _fns(sets: Sets, mode: str, x: torch.Tensor, group: str, **cfg):
    from ..kernels import dispatch, mma_backend, triton_backend, w4_mma, w4_wgmma

    n, k = sets.n, sets.k
    shape, mma, nv = (n, k), NVFP4Mma(), get_format("nvfp4")
    if mode == "bf16":
        return [lambda w=w: torch.matmul(x, w.t()) for w in sets.bf16]
    if mode == "nvfp4":
        return [lambda t=t: mma_backend.matmul(x, mma, t, shape) for t in sets.mma]
    if mode == "mma":  # the mma.sync kernel alone (M <= w4_mma.MAX_M)
        out = []
        for t in sets.mma:
            f, _ = mma_backend._prepare(t)
            out.append(lambda t=t, f=f: w4_mma.matmul(x, t["weight_packed"], t["weight_scale"], f, n))
        return out
    if mode == "nvfp4_cfg":  # the kernel at an explicit launch shape (the sweep)
        c = w4_mma.plan(x.shape[0], n, k, torch.cuda.get_device_properties(0).multi_processor_count, **cfg)
        out = []
        for t in sets.mma:
            f, _ = mma_backend._prepare(t)
            out.append(lambda t=t, f=f: w4_mma.matmul(x, t["weight_packed"], t["weight_scale"], f, n, config=c))
        return out
    if mode in ("nvfp4_lora32", "nvfp4_lora32_cublas_shrink"):
        # r = 32 on every member; the shrink inside the launch (what layers do), or by cuBLAS first.
        segs = SEGMENTS.get(group, 1)
        r = 32
        starts = tuple(int(v) for v in torch.linspace(0, n, segs + 1)[1:-1].div(16).floor().mul(16).tolist())
        a = sets.lora_a[: segs * r]

        def call(t):
            xa = None if mode == "nvfp4_lora32" else torch.nn.functional.linear(x, a)
            lora = dispatch.LoraTerm(xa, sets.lora_b, 2.0, starts, a=a)
            return mma_backend.matmul(x, mma, t, shape, lora=lora)
        return [lambda t=t: call(t) for t in sets.mma]
    if mode in ("wgmma", "wgmma_cfg", "wgmma_waves", "wgmma_lora32"):
        # The wgmma kernel called directly (whether or not KernelSettings.wgmma routes layers to it yet);
        # wgmma_waves: its split of K by w4_wgmma.wave_splits (fewest waves x chunks) instead of the fill rule
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        c = (w4_wgmma.plan(x.shape[0], n, k, sms, **cfg) if mode == "wgmma_cfg"
             else w4_wgmma.plan(x.shape[0], n, k, sms, waves=True) if mode == "wgmma_waves" else None)
        lora = None
        if mode == "wgmma_lora32":
            segs, r = SEGMENTS.get(group, 1), 32
            starts = tuple(int(v) for v in torch.linspace(0, n, segs + 1)[1:-1].div(16).floor().mul(16).tolist())
            a = sets.lora_a[: segs * r]
        out = []
        for t in sets.mma:
            f, _ = mma_backend._prepare(t)

            def call(t=t, f=f):
                lo = None if mode != "wgmma_lora32" else dispatch.LoraTerm(torch.nn.functional.linear(x, a), sets.lora_b,
                                                                           2.0, starts)
                return w4_wgmma.matmul(x, t["weight_packed"], t["weight_scale"], f, n, lora=lo, config=c)
            out.append(call)
        return out
    if mode == "dequant":  # dequantize the MMA-layout bytes + cuBLAS (the large-M path)
        out = []
        for t in sets.mma:
            _, inv = mma_backend._prepare(t)
            out.append(lambda t=t, inv=inv: w4_mma.dequant_matmul(x, t["weight_packed"], t["weight_scale"], inv, n))
        return out
    if mode.startswith("humming_ksplit"):  # a repeatable split-K through humming's grouped GEMM (a candidate)
        return [lambda w=w: w.matmul(x) for w in sets.ksplit(int(mode.removeprefix("humming_ksplit")))]
    if mode in ("humming", "humming_streamk", "humming_nosplit", "humming_sk2", "humming_lora32"):
        if mode == "humming":  # batch-invariant tiles
            return [lambda h=h: h.matmul(x, backend="humming_bi") for h in sets.humming]
        if mode == "humming_streamk":  # humming's own default config (stream-K: not bit-repeatable), for comparison
            return [lambda h=h: h.run(x) for h in sets.humming]
        if mode == "humming_sk2":  # its stream-K on grids with at most two slices a tile (bit-repeatable)
            return [lambda h=h: h.matmul(x, backend="humming_sk2") for h in sets.humming]
        if mode == "humming_nosplit":  # its default tiles with stream-K off (bit-repeatable: a candidate mode)
            from ..kernels.humming_backend import nosplit_tuning

            tunings = [nosplit_tuning(h.layer.humming_config, x.device) for h in sets.humming]
            return [lambda h=h, tu=tu: h.run(x, tuning_config=tu) for h, tu in zip(sets.humming, tunings)]
        a, starts = _lora32(sets, group)
        return [lambda h=h: h.matmul(x, lora=dispatch.LoraTerm(None, sets.lora_b, 2.0, starts, a=a)) for h in sets.humming]
    if mode == "triton":
        return [lambda t=t: triton_backend.matmul(x, nv, t, shape) for t in sets.std]
    if mode == "tinygemm":
        if not sets.int4 or sets.int4[0] is None:
            return None
        return [lambda p=p: torch._weight_int4pack_mm(x, p[0], p[2], p[1]) for p in sets.int4]
    raise ValueError(mode)


def _mode_settings(mode: str):
    """(the KernelSettings scope a mode runs in, the _fns mode it calls).
    "nvfp4" is qerl's own routed path (humming off); "routed" what layers run: the card's routes table.
    "humming_lora32_addmm": humming + LoRA with the expand as one addmm per segment (the one-launch kernel's baseline)
    "humming_lora32_overlap": the same with the shrink on a side stream beside the GEMM (KernelSettings.lora_overlap)
    "routed_lora32": what layers with LoRA r32 run (the routes table, humming on)"""
    from ..kernels import settings

    scope = settings.use(humming=mode in ("routed", "routed_lora32"), lora_expand_kernel=mode != "humming_lora32_addmm",
                         lora_overlap=mode == "humming_lora32_overlap")
    base = {"routed": "nvfp4", "routed_lora32": "nvfp4_lora32", "humming_lora32_addmm": "humming_lora32",
            "humming_lora32_overlap": "humming_lora32"}.get(mode, mode)
    return scope, base


def _time(sets, mode, x, group, **cfg):
    try:
        scope, base = _mode_settings(mode)
        with scope:
            fns = _fns(sets, base, x, group, **cfg)
            return None if fns is None else time_calls(fns)
    except Exception as e:  # a path this torch/GPU lacks: reported, not fatal
        print(f"  {mode} M={x.shape[0]} {sets.n}x{sets.k}: {type(e).__name__}: {str(e)[:200]}")
        return None


def launch_for_ncu(models: list[str], groups: list[str] | None, ms: list[int], modes: list[str]) -> None:
    """Each mode once per group and M, inside an NVTX range "profile" (ncu --nvtx --nvtx-include "profile/"), after a
    warm-up call outside it; one weight set a shape. The ranges' order is printed as they run."""
    for model in models:
        for group, (n, k) in LAYER_SETS[model].items():
            if groups and group not in groups:
                continue
            sets = Sets(n, k, seed=n + k, tinygemm="tinygemm" in modes, count=1)
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                for mode in modes:
                    scope, base = _mode_settings(mode)
                    try:
                        with scope:
                            fns = _fns(sets, base, x, group)
                            if fns is None:
                                continue
                            fns[0]()  # JIT, configs, workspaces
                            torch.cuda.synchronize()
                            print(f"range: {model} {group} {n}x{k} M={m} {mode}", flush=True)
                            torch.cuda.nvtx.range_push("profile")
                            fns[0]()
                            torch.cuda.nvtx.range_pop()
                            torch.cuda.synchronize()
                    except Exception as e:  # a path this torch/GPU lacks: reported, not fatal
                        print(f"  {mode} M={m} {n}x{k}: {type(e).__name__}: {str(e)[:200]}")
            del sets
            torch.cuda.empty_cache()


def sweep(log) -> dict:
    """Launch shapes of the MMA kernel per token-tile bucket over the 7B layer set; sets the winners
    in-process (w4_mma.TUNING) so the benchmark that follows measures them."""
    from ..kernels import w4_mma

    sets = {g: Sets(n, k, seed=n + k, tinygemm=False) for g, (n, k) in LAYER_SETS["qwen2.5-7b"].items()}
    small = [dict(warps=w, ctas_per_sm=c, rt=r, stages=s, xsm=0) for w in (4, 8) for c in (4, 8, 16) for r in (1, 2)
             for s in (2, 4)]
    large = [dict(warps=w, ctas_per_sm=c, rt=r, stages=2, xsm=x) for w in (4, 8) for c in (2, 4, 8) for r in (1, 2)
             for x in (0, 3)]
    res = {}
    for m, mt in ((1, 1), (16, 2), (32, 4), (64, 8)):
        scores = []
        for cfg in (small if mt <= 2 else large):
            tot = 0.0
            for g, ss in sets.items():
                x = torch.randn(m, ss.k, device="cuda", dtype=torch.bfloat16)
                us = _time(ss, "nvfp4_cfg", x, g, **cfg)
                tot += us if us is not None else float("inf")
            scores.append((tot, cfg))
        scores.sort(key=lambda s: s[0])
        w4_mma.TUNING[mt] = scores[0][1]
        res[m] = [(t, c) for t, c in scores]
        log(f"sweep M={m}: " + "; ".join(f"{t:.1f} µs {c}" for t, c in scores[:5]))
    log(f"sweep result: TUNING = {w4_mma.TUNING}")
    return res


def _wgmma_candidates(bn: int) -> list[tuple[int, int, int, int]]:
    """(warpgroups, producer warps, stages, CTAs per SM) worth timing for token tile bn: the producer warps
    (one warp issuing every copy was the limit once), and the occupancy the registers allow."""
    if bn <= 32:
        return [(1, pw, 8, c) for pw in (1, 2, 4) for c in (2, 3)]
    if bn <= 64:
        return [(1, pw, 6, c) for pw in (1, 2, 4) for c in (1, 2)] + [(2, pw, 4, 1) for pw in (2, 4)]
    if bn <= 128:
        return [(2, pw, 4, 1) for pw in (1, 2, 4)] + [(1, pw, 4, c) for pw in (2, 4) for c in (1, 2)]
    return [(1, pw, 4, 1) for pw in (1, 2, 4)] + [(1, 4, 3, 1), (2, 4, 3, 1)]


def wgmma_sweep(log) -> dict:
    """The wgmma kernel's (warpgroups, stages, CTAs per SM) per token tile over the 7B layer set; sets the winners in-process
    (w4_wgmma.TUNING) so the benchmark that follows measures them."""
    from ..kernels import w4_wgmma

    sets = {g: Sets(n, k, seed=n + k, tinygemm=False) for g, (n, k) in LAYER_SETS["qwen2.5-7b"].items()}
    res = {}
    for bn in sorted(w4_wgmma.TUNING):
        scores = []
        for wg, pw, st, cps in _wgmma_candidates(bn):  # each a compile of a second or two
            cfg = dict(bn=bn, wg=wg, pw=pw, stages=st, ctas_per_sm=cps)
            try:
                w4_wgmma.plan(bn, 4608, 3584, 132, **dict(cfg))
            except ValueError:
                continue  # over the shared memory
            tot = 0.0
            for g, ss in sets.items():
                x = torch.randn(bn, ss.k, device="cuda", dtype=torch.bfloat16)
                us = _time(ss, "wgmma_cfg", x, g, **cfg)
                tot += us if us is not None else float("inf")
            scores.append((tot, cfg))
        scores.sort(key=lambda s: s[0])
        if scores and scores[0][0] < float("inf"):
            w4_wgmma.TUNING[bn] = {k: v for k, v in scores[0][1].items() if k != "bn"}
        res[bn] = scores
        log(f"wgmma sweep BN={bn}: " + "; ".join(f"{t:.1f} µs {c}" for t, c in scores[:5]))
    log(f"wgmma sweep result: TUNING = {w4_wgmma.TUNING}")
    return res


def summarize(model: str, agg: dict, ms: list[int], bw: float) -> tuple[list, list[str]]:
    """Record rows and table lines of one model's layer set from per-(mode, M) sums [µs, bytes]."""
    rows, final = [], []
    final.append(f"\n{model}: fused layer set (q|k|v, o, gate|up, down), µs summed over the groups")
    final.append(f"{'M':>6} {'bf16':>9} {'nvfp4':>9} {'speedup':>8} {'%copy':>6} {'lora32':>8} {'wgmma':>8} "
                 f"{'wg x':>6} {'wg+lora':>8} {'dequant':>8} {'humming':>8} {'hum x':>6} {'hum+lora':>8} {'triton':>8} "
                 f"{'tinygemm':>9}")
    for m in ms:
        g = lambda key: agg[(key, m)][0] if (key, m) in agg else float("nan")  # noqa: E731
        bf, q = g("bf16"), g("nvfp4")
        frac = agg[("nvfp4", m)][1] / q * 1e6 / bw
        final.append(f"{m:>6} {bf:>9.1f} {q:>9.1f} {bf / q:>8.2f} {frac:>6.1%} {g('nvfp4_lora32'):>8.1f} "
                     f"{g('wgmma'):>8.1f} {bf / g('wgmma'):>6.2f} {g('wgmma_lora32'):>8.1f} {g('dequant'):>8.1f} "
                     f"{g('humming'):>8.1f} {bf / g('humming'):>6.2f} {g('humming_lora32'):>8.1f} "
                     f"{g('triton'):>8.1f} {g('tinygemm'):>9.1f}")
        case = f"{model} fused layer set M={m}"
        main_model = model == "qwen2.5-7b"
        sp_t = SPEEDUP_TARGETS.get(m) if main_model else None
        rows += [(case, "nvfp4_us", q, "us", None), (case, "bf16_us", bf, "us", None),
                 (case, "speedup_vs_bf16", bf / q, "x", sp_t), (case, "fraction_of_copy_bw", frac, "",
                                                                ">=0.65" if m <= 16 and main_model else None)]
        if m >= 2048:
            rows.append((case, "time_vs_bf16", q / bf, "x", "<=1.10"))
        if not (g("tinygemm") != g("tinygemm")):
            rows.append((case, "speedup_vs_tinygemm", g("tinygemm") / q, "x", ">1.0"))
        if not (g("triton") != g("triton")):
            rows.append((case, "speedup_vs_previous_triton", g("triton") / q, "x", None))
        if ("nvfp4_lora32", m) in agg:
            over = g("nvfp4_lora32") / q - 1
            rows.append((case, "lora32_overhead", over, "", ("<=0.10" if m <= 16 else "<=0.05" if m <= 256 else None)))
        if ("wgmma", m) in agg:
            rows += [(case, "wgmma_us", g("wgmma"), "us", None),
                     (case, "wgmma_speedup_vs_bf16", bf / g("wgmma"), "x", sp_t)]
        if ("wgmma_waves", m) in agg:
            rows += [(case, "wgmma_waves_us", g("wgmma_waves"), "us", None),
                     (case, "wgmma_waves_speedup_vs_bf16", bf / g("wgmma_waves"), "x", None)]
        if ("wgmma_lora32", m) in agg:
            rows.append((case, "wgmma_lora32_overhead", g("wgmma_lora32") / g("wgmma") - 1, "",
                         ("<=0.10" if m <= 16 else "<=0.05")))
        if ("routed", m) in agg:
            rows += [(case, "routed_us", g("routed"), "us", None),
                     (case, "routed_speedup_vs_bf16", bf / g("routed"), "x", ROUTED_TARGETS.get(m) if main_model else None)]
        if ("routed_lora32", m) in agg and ("routed", m) in agg:
            rows.append((case, "routed_lora32_overhead", g("routed_lora32") / g("routed") - 1, "",
                         "<=0.10" if m == 64 and main_model else None))
        if ("dequant", m) in agg:
            rows.append((case, "dequant_us", g("dequant"), "us", None))
        if ("humming", m) in agg:
            rows += [(case, "humming_us", g("humming"), "us", None),
                     (case, "humming_speedup_vs_bf16", bf / g("humming"), "x", None)]
        if ("humming_streamk", m) in agg:
            rows.append((case, "humming_streamk_us", g("humming_streamk"), "us", None))
        for mode in ("humming_nosplit", "humming_sk2", "humming_ksplit2", "humming_ksplit4"):
            if (mode, m) in agg:
                rows += [(case, f"{mode}_us", g(mode), "us", None),
                         (case, f"{mode}_speedup_vs_bf16", bf / g(mode), "x", None)]
        # humming's LoRA modes run its no-split tiles (HummingWeight.matmul's default): the overhead is against them
        if ("humming_lora32", m) in agg:
            rows.append((case, "humming_lora32_overhead", g("humming_lora32") / g("humming_nosplit") - 1, "", "<=0.10"))
        if ("humming_lora32_addmm", m) in agg:
            rows.append((case, "humming_lora32_addmm_overhead", g("humming_lora32_addmm") / g("humming_nosplit") - 1, "",
                         None))
        if ("humming_lora32_overlap", m) in agg:
            rows.append((case, "humming_lora32_overlap_overhead", g("humming_lora32_overlap") / g("humming_nosplit") - 1,
                         "", "<=0.10" if m == 64 else None))
        if ("nvfp4_lora32_cublas_shrink", m) in agg:
            rows.append((case, "lora32_overhead_cublas_shrink", g("nvfp4_lora32_cublas_shrink") / q - 1, "", None))
    return rows, final


# The bench mode that times each kernel the routes table may name (kernels/routes.py BACKENDS)
KERNEL_OF_MODE = {"mma": "mma", "wgmma": "wgmma", "dequant": "dequant_cublas", "humming": "humming_bi",
                  "humming_nosplit": "humming_ns", "humming_streamk": "humming_sk", "humming_sk2": "humming_sk2",
                  **{k: k for k in routes.KSPLIT}}


def candidates(r: dict[str, float | None], streamk: bool = False) -> dict[str, float]:
    """The routes table's kernels from one measurement's µs by bench mode (KERNEL_OF_MODE). humming's stream-K
    (humming_sk, not repeatable) competes only in the stream-K list. A kernel not timed never wins (nan)."""
    nan = float("nan")
    out = {kern: nan if r.get(mode) is None else r[mode] for mode, kern in KERNEL_OF_MODE.items()}
    if not streamk:
        out.pop("humming_sk")
    return out


def write_routes(path: Path | None, card: str, timings: dict[int, dict[str, float]], log,
                 streamk_timings: dict[int, dict[str, float]] | None = None,
                 shape_timings: dict[str, tuple[dict, dict]] | None = None, source: str | None = None) -> None:
    """Put this card's measured buckets into the routes table (other cards' entries kept): every bit-repeatable
    kernel timed (qerl's mma, wgmma, dequantize + cuBLAS; humming's batch-invariant, no-split and split-K modes), and, where humming's stream-K default was timed too, a stream-K list with it among them; each
    again with humming's kernels only, for weights stored in humming's layout; for the layer set and each shape."""
    path = path or routes.TABLE_PATH
    table = json.loads(path.read_text()) if path.exists() else {}

    def lists(det: dict, sk: dict | None) -> dict:
        humming_only = lambda t: {m: {k: v for k, v in c.items() if k in routes.STORED} for m, c in t.items()}  # noqa: E731
        out = {"nvfp4": routes.from_timings(det), "nvfp4_stored": routes.from_timings(humming_only(det))}
        if sk:
            out |= {"nvfp4_streamk": routes.from_timings(sk), "nvfp4_stored_streamk": routes.from_timings(humming_only(sk))}
        return {k: v for k, v in out.items() if v}  # a list nothing was timed for is left out (humming absent)

    source = source or (f"python -m qerl.bench.kernels --write-routes at {commit()}, "
                        f"{time.strftime('%Y-%m-%d')}")
    table[card] = {"source": source, **lists(timings, streamk_timings)}
    if shape_timings:
        table[card]["shapes"] = {key: lists(det, sk) for key, (det, sk) in shape_timings.items()}
    routes.parse(table)  # refuse to write a table the router could not read
    path.write_text(json.dumps(table, indent=2) + "\n")
    log(f"routes for {card} -> {path}")
    for key, st in [("layer set", table[card]), *table[card].get("shapes", {}).items()]:
        log(f"  {key}: " + "; ".join(f"{k}: {st[k]}" for k in routes.KINDS if k in st))


def timings_from_results(results: dict, model: str | None = None) -> tuple[dict, dict, dict]:
    """(layer-set timings, its stream-K timings, per-shape timings) as write_routes takes them, from a run's
    bench_kernels.json: the first model's layer set, as a live run decides."""
    per: dict[str, dict[int, dict]] = {}
    for key, r in results["shapes"].items():
        mdl, group, m = key.split("|")
        model = model or mdl
        if mdl == model:
            per.setdefault(group, {})[int(m)] = r
    ms = sorted({m for g in per.values() for m in g})
    streamk = any(r.get("humming_streamk") is not None for g in per.values() for r in g.values())
    nan = float("nan")
    det = {m: {k: sum(candidates(per[g][m]).get(k, nan) for g in per) for k in routes.BACKENDS} for m in ms}
    sk = {m: {k: sum(candidates(per[g][m], True).get(k, nan) for g in per) for k in routes.BACKENDS}
          for m in ms} if streamk else {}
    shapes = {routes.shape_key(LAYER_SETS[model][g]): ({m: candidates(per[g][m]) for m in ms},
                                                       {m: candidates(per[g][m], True) for m in ms} if streamk else {})
              for g in per}
    return det, sk, shapes


LINE = re.compile(r"^(\S+)\s+(\S+)\s+(\d+)x(\d+)\s+M=(\d+)\s+bf16\s+([\d.]+) \| nvfp4\s+([\d.]+) µs.*\| x\s*[\d.]+ \|(.*)$")


def from_log(path: Path) -> tuple[float, dict]:
    """(copy bandwidth, {model: agg}) from a run's bench_kernels.log: for a run stopped before it wrote
    its record (every figure in it was measured; a shape missing from the log stays missing)."""
    text = path.read_text().splitlines()
    bw = float(re.search(r"copy bandwidth ([\d.]+) TB/s", text[0]).group(1)) * 1e12
    out: dict = {}
    for line in text:
        m = LINE.match(line)
        if not m:
            continue
        model, _, n, k, mm = m.group(1), m.group(2), int(m.group(3)), int(m.group(4)), int(m.group(5))
        r = {"bf16": float(m.group(6)), "nvfp4": float(m.group(7))}
        r.update({kk: float(v) for kk, v in re.findall(r"(\w+)=([\d.]+)", m.group(8))})
        agg = out.setdefault(model, {})
        for mode, us in r.items():
            agg.setdefault((mode, mm), [0.0, 0, 0])
            agg[(mode, mm)][0] += us
            agg[(mode, mm)][1] += nvfp4_bytes(mm, n, k)
            agg[(mode, mm)][2] += 1
    # A sum over fewer groups than the layer set has is no layer-set figure: drop it.
    for model, agg in out.items():
        groups = len(LAYER_SETS[model])
        for key in [key for key, v in agg.items() if v[2] != groups]:
            del agg[key]
    return bw, out


def main(argv=None):
    from ..kernels import w4_mma, w4_wgmma

    ap = argparse.ArgumentParser(prog="qerl bench kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--record", action="store_true", help="append the figures to benchmarks/results/kernels.jsonl")
    ap.add_argument("--results-dir", "--results_dir", default=None, help="where the jsonl goes (default: ./benchmarks/results)")
    ap.add_argument("--sweep", action="store_true", help="first sweep the MMA kernel's launch shapes")
    ap.add_argument("--wgmma-sweep", "--wgmma_sweep", action="store_true",
                    help="first sweep the wgmma kernel's tiles (w4_wgmma.TUNING)")
    ap.add_argument("--models", default="qwen2.5-7b,qwen2.5-32b")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--out", default="runs/bench_kernels", help="folder for the full json and the log")
    ap.add_argument("--modes", default=",".join(MODES), help="paths to time (bf16 and nvfp4 always)")
    ap.add_argument("--from-log", default=None, help="record the figures of a run's bench_kernels.log (a run cut off "
                    "before it wrote them); --command names the command that ran")
    ap.add_argument("--command", default=None)
    ap.add_argument("--write-routes", "--write_routes", action="store_true",
                    help="write this card's fastest path per M (own vs humming, the first model's layer set) into "
                         "the routes table kernels/routes.json (or --routes-path)")
    ap.add_argument("--routes-path", "--routes_path", default=None)
    ap.add_argument("--routes-from", "--routes_from", default=None,
                    help="write the routes table from a saved run's bench_kernels.json (no GPU needed); --command "
                         "says which run it was, for the table's source")
    ap.add_argument("--device", default=None, help="with --from-log: the device the run was on")
    ap.add_argument("--ncu", action="store_true", help="launch each mode once per group and M in an NVTX range "
                    "\"profile\" for Nsight Compute, instead of timing")
    ap.add_argument("--groups", default=None,
                    help="groups of the layer set to time or profile (qkv,o,gate_up,down; default all; a run of some "
                         "groups records no layer-set rows: merge its log with the others' through --from-log)")
    a = ap.parse_args(argv)
    if a.ncu:
        launch_for_ncu(a.models.split(","), a.groups.split(",") if a.groups else None,
                       [int(v) for v in a.ms.split(",")], [m for m in a.modes.split(",") if m])
        return
    if a.from_log:
        bw, per_model = from_log(Path(a.from_log))
        kw = {"results_dir": Path(a.results_dir)} if a.results_dir else {}
        for model, agg in per_model.items():
            ms = sorted({m for _, m in agg})
            rows, final = summarize(model, agg, ms, bw)
            print("\n".join(final))
            for case, metric, value, unit, target in rows if a.record else ():
                record("kernels", case, metric, float(value), unit, target, device=a.device, command=a.command, **kw)
        return
    if a.routes_from:
        results = json.loads(Path(a.routes_from).read_text())
        det, sk, shapes = timings_from_results(results)
        write_routes(Path(a.routes_path) if a.routes_path else None, results["device"], det, print, sk, shapes,
                     source=f"python -m qerl.bench.kernels --routes-from bench_kernels.json of {a.command or 'a saved run'}")
        return
    out = Path(a.out)
    log = tee_log(out / "bench_kernels.log")
    dev = torch.cuda.get_device_name(0)
    t0 = time.time()
    copy_bandwidth()  # clocks ramp up from idle: the first measurement is low
    bw = copy_bandwidth()
    log(f"{dev}: copy bandwidth {bw / 1e12:.3f} TB/s")
    results = {"copy_bw": bw, "device": dev, "shapes": {}}
    if a.sweep:
        results["sweep"] = {str(k): v for k, v in sweep(log).items()}
    if a.wgmma_sweep:
        results["wgmma_sweep"] = {str(k): v for k, v in wgmma_sweep(log).items()}
    ms = [int(v) for v in a.ms.split(",")]
    rows, final = [], []
    modes = ["bf16", "nvfp4"] + [m for m in a.modes.split(",") if m and m not in ("bf16", "nvfp4")]
    for model in a.models.split(","):
        agg: dict = {}
        for group, (n, k) in LAYER_SETS[model].items():
            if a.groups and group not in a.groups.split(","):
                continue
            sets = Sets(n, k, seed=n + k, tinygemm="tinygemm" in modes)
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                r = {}
                for mode in modes:
                    if mode == "triton" and m > 64:
                        continue
                    if "lora32" in mode and m not in (1, 16, 64, 256, 2048):
                        continue
                    if mode.startswith("wgmma") and not (w4_wgmma.MIN_M <= m <= w4_wgmma.MAX_M):
                        continue
                    if mode == "mma" and m > w4_mma.MAX_M:
                        continue
                    if mode.startswith("wgmma_lora32") and m not in (16, 64, 256):
                        continue
                    r[mode] = _time(sets, mode, x, group)
                for mode, us in r.items():
                    if us is not None:
                        agg.setdefault((mode, m), [0.0, 0])
                        agg[(mode, m)][0] += us
                        agg[(mode, m)][1] += nvfp4_bytes(m, n, k)
                results["shapes"][f"{model}|{group}|{m}"] = r
                q = r["nvfp4"]
                log(f"{model:12s} {group:7s} {n:6d}x{k:<6d} M={m:<5d} bf16 {r['bf16']:8.2f} | nvfp4 {q:8.2f} µs "
                    f"{nvfp4_bytes(m, n, k) / q * 1e6 / bw:6.1%} of copy | x{r['bf16'] / q:5.2f} | "
                    + " ".join(f"{kk}={v:.1f}" for kk, v in r.items() if kk not in ("bf16", "nvfp4") and v))
            del sets
            torch.cuda.empty_cache()
        r_rows, r_final = summarize(model, agg, ms, bw)
        rows += r_rows
        final += r_final
    bw_end = copy_bandwidth()
    final.append(f"copy bandwidth at the start {bw / 1e12:.3f} TB/s, at the end {bw_end / 1e12:.3f} TB/s")
    for line in final:
        log(line)
    if a.record and not a.groups:  # some groups only: their sums are no layer set (merge logs: --from-log)
        rows += [("copy", "copy_bandwidth", bw / 1e12, "TB/s", None), ("copy", "copy_bandwidth_end", bw_end / 1e12, "TB/s", None)]
        kw = {"results_dir": Path(a.results_dir)} if a.results_dir else {}
        cmd = " ".join(["python -m qerl.bench.kernels"] + [x for x in (argv if argv is not None else sys.argv[1:])
                                                            if not x.startswith(("/", "--results-dir", "--out"))])
        for case, metric, value, unit, target in rows:
            record("kernels", case, metric, float(value), unit, target, device=dev, command=cmd, **kw)
    (out / "bench_kernels.json").write_text(json.dumps(results, indent=1, default=str))  # first: routes may refuse
    if a.write_routes and not a.groups:
        det, sk, shapes = timings_from_results(results)
        write_routes(Path(a.routes_path) if a.routes_path else None, dev, det, log, sk, shapes)
    print("\n".join(["", "=" * 40, *final]))
    log(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()

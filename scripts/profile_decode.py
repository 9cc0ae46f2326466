"""Where a 7B decode step's time goes, by kernel kind; decode attention and the LoRA shrink alone (GPU).

1. Decode attention (7B geometry: 28 query heads, 4 KV heads, d 128) at batch 1-256 and 256-8k
   keys: the split-KV kernel (bf16 and FP8 K/V) against the torch grouped path, as time and as a
   fraction of copy bandwidth on the K/V bytes, and a tile sweep (--skip-attention: not run).
2. --shrink: the LoRA shrink of the 7B's projections at M 1-256: cuBLAS, the one-row decode kernel, split-K.
3. A 7B decode step (LoRA r32; --quants nvfp4,bf16) at --batches 1,64: ms per step in CUDA graphs, then a
   profiler pass over eager steps: kernels per step and µs per kind (--skip-step: not run).
Writes profile_decode.log and .json under --out. On the device: STEP=profile bash scripts/device.sh.
Usage: python3 scripts/profile_decode.py [--layers N] [--skip-attention] [--skip-step] [--shrink] [--quants Q]
"""
import argparse
import collections
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "src")
from qerl.bench.kernels import copy_bandwidth  # noqa: E402
from qerl.model import qwen25_config, random_policy  # noqa: E402
from qerl.rollout import Engine, SamplingParams, attention  # noqa: E402
from qerl.rollout.kv_cache import FP8_MAX, _quantize  # noqa: E402

KINDS = [  # first match wins
    ("humming-kernels W4 GEMM", ("humming",)),
    ("LoRA expand (Triton, one launch a group)", ("_expand_kernel",)),
    ("LoRA shrink (Triton decode GEMV)", ("shrink_kernel",)),
    ("W4 matmul (MMA)", ("w4_mma_matmul",)),
    ("W4 matmul (wgmma)", ("w4_wgmma",)),
    ("W4 dequantize", ("w4_mma_dequantize",)),
    ("attention split-KV", ("split_kernel",)),
    ("attention merge", ("merge_kernel",)),
    ("rope + KV write", ("rope_kv_kernel",)),
    ("cuBLAS GEMM/GEMV (lm_head, LoRA)", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "splitk", "splitK")),
    ("compiled glue (norms, SiLU, rope, softmax)", ("triton_",)),
    ("sampling (softmax, exp, argmax, topk)", ("softmax", "exponential", "argmax", "sort", "topk", "distribution")),
    ("index / scatter / gather / copy", ("index", "scatter", "gather", "copy", "cat", "Memcpy", "Memset")),
    ("other elementwise / reduce", ("elementwise", "reduce", "vectorized")),
]


def kind(name: str) -> str:
    for k, keys in KINDS:
        if any(x in name for x in keys):
            return k
    return "other"


def timed(fn, iters=50):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def attention_bench(bw, log):
    h, n_kv, d = 28, 4, 128
    rows = []
    for b in (1, 8, 64, 256):
        for ctx in (256, 1024, 4096, 8192):
            q = torch.randn(b, h, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, n_kv, ctx, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            lens = torch.full((b,), ctx, device="cuda")
            ks = k.float().abs().amax((2, 3)) / FP8_MAX
            vs = v.float().abs().amax((2, 3)) / FP8_MAX
            k8, v8 = _quantize(k, ks), _quantize(v, vs)
            t_bf = timed(lambda: attention.decode_attention(q, k, v, lens, ctx, d ** -0.5))
            t_f8 = timed(lambda: attention.decode_attention(q, k8, v8, lens, ctx, d ** -0.5, ks, vs))
            t_ref = timed(lambda: attention.reference(q, k, v, lens, ctx, d ** -0.5), iters=10)
            kv_elems = 2 * b * n_kv * ctx * d  # K and V; bytes: x2 bf16, x1 FP8
            r = dict(batch=b, ctx=ctx, us_bf16=t_bf * 1e6, us_fp8=t_f8 * 1e6, us_torch=t_ref * 1e6,
                     bw_frac_bf16=2 * kv_elems / t_bf / bw, bw_frac_fp8=kv_elems / t_f8 / bw,
                     splits=attention.n_splits(b, n_kv, ctx, torch.cuda.get_device_properties(0).multi_processor_count))
            rows.append(r)
            log(f"attn b={b:4d} ctx={ctx:5d} splits={r['splits']:3d}: bf16 {r['us_bf16']:8.1f} us "
                f"({100 * r['bw_frac_bf16']:5.1f}% of copy BW), fp8 {r['us_fp8']:8.1f} us "
                f"({100 * r['bw_frac_fp8']:5.1f}%), torch {r['us_torch']:8.1f} us")
            if ctx == 4096 and b in (8, 64, 256):  # tile sweep: keys per tile x pipeline stages
                for bn, stg in ((64, 2), (64, 3), (128, 2), (128, 3), (32, 4)):
                    tb = timed(lambda: attention.decode_attention(q, k, v, lens, ctx, d ** -0.5, block_n=bn, stages=stg))
                    tf = timed(lambda: attention.decode_attention(q, k8, v8, lens, ctx, d ** -0.5, ks, vs,
                                                                  block_n=bn, stages=stg))
                    log(f"  tiles b={b} ctx={ctx} block_n={bn} stages={stg}: bf16 {tb * 1e6:7.1f} us "
                        f"({100 * 2 * kv_elems / tb / bw:5.1f}%), fp8 {tf * 1e6:7.1f} us ({100 * kv_elems / tf / bw:5.1f}%)")
            del q, k, v, k8, v8
    return rows


def shrink_bench(log):
    """The LoRA shrink of the 7B's projections: cuBLAS (F.linear), the one-row decode kernel, the split-K kernel."""
    from qerl.kernels import lora_shrink

    rows = []
    for m in (1, 8, 16, 64, 128, 256):
        for name, k, r in (("q|k|v", 3584, 96), ("o", 3584, 32), ("gate|up", 3584, 64), ("down", 18944, 32)):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a = torch.randn(r, k, device="cuda", dtype=torch.bfloat16) * 0.02
            t_cb = timed(lambda: torch.nn.functional.linear(x, a))
            t_tr = timed(lambda: lora_shrink.shrink(x, a)) if m <= lora_shrink.MAX_M else float("nan")
            t_sp = timed(lambda: lora_shrink.shrink_split(x, a))
            err = float((lora_shrink.shrink_split(x, a).float() - torch.nn.functional.linear(x, a).float()).abs().max())
            rows.append(dict(m=m, proj=name, us_cublas=t_cb * 1e6, us_triton=t_tr * 1e6, us_split=t_sp * 1e6,
                             max_diff=err))
            log(f"shrink M={m:3d} {name:7s} K={k:5d} r={r}: cuBLAS {t_cb * 1e6:6.2f} us, row kernel {t_tr * 1e6:6.2f} us, "
                f"split-K {t_sp * 1e6:6.2f} us (max |diff| vs cuBLAS {err:.2e})")
    return rows


def step_profile(layers, log, quants=("nvfp4",), batches=(1, 64)):
    cfg = qwen25_config("qwen2.5-7b", layers)
    out = []
    for quant in quants:
        pol = random_policy(cfg, quant, lora_rank=32, device="cuda", progress=False)
        fused = True  # the torch decode path (fused=False) was profiled at f73d1df
        for b in batches:
            eng = Engine(pol.model, max_len=640, max_slots=b, fused_attention=fused)
            p = SamplingParams(max_new_tokens=96, temperature=1.0, ignore_eos=True, seed=0)
            prompts = [list(range(256))] * b
            eng.warmup([b], p)
            eng.generate(prompts, params=p)
            s = eng.generate(prompts, params=p).stats
            ms = 1e3 * (s.seconds - s.prefill_seconds) / s.steps
            eng_e = Engine(pol.model, max_len=640, max_slots=b, cuda_graphs=False, fused_attention=fused)
            q = SamplingParams(max_new_tokens=17, ignore_eos=True)
            eng_e.generate(prompts, params=q)  # compiles; leaves 256-token prompts + 17 tokens in the cache
            eng_e.runner.setup(q, [])
            steps = 8
            with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:  # decode only, 384 keys
                for _ in range(steps):
                    eng_e.runner.step(b, 384, q)
                torch.cuda.synchronize()
            per = collections.defaultdict(lambda: [0, 0.0])
            names = collections.Counter()
            for e in prof.events():
                if e.device_type != torch.autograd.DeviceType.CUDA:
                    continue
                k = kind(e.name)
                per[k][0] += 1
                per[k][1] += e.device_time
                if k.startswith("other"):
                    names[e.name[:90]] += 1
            total_n = sum(v[0] for v in per.values())
            total_us = sum(v[1] for v in per.values())
            log(f"\n{quant} batch={b}: graph step {ms:.3f} ms; eager profile: {total_n / steps:.0f} "
                f"kernels and {total_us / steps / 1e3:.3f} ms kernel time per step (decode only, 384 keys)")
            for k, (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1]):
                log(f"   {k:44s} {n / steps:7.1f} per step {us / steps:9.1f} us per step")
            out.append(dict(quant=quant, batch=b, ms_per_step=ms, kernels_per_step=total_n / steps,
                            kernel_ms_per_step=total_us / steps / 1e3,
                            kinds={k: dict(per_step=n / steps, us_per_step=us / steps) for k, (n, us) in per.items()}))
            for nm, cnt in names.most_common(12):
                log(f"      other: {cnt / steps:5.1f} per step  {nm}")
            del eng, eng_e
            torch.cuda.empty_cache()
        del pol
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--shrink", action="store_true", help="also time the decode LoRA shrink variants")
    ap.add_argument("--out", default=".")
    ap.add_argument("--quants", default="nvfp4", help="policies to profile a decode step of (nvfp4, bf16)")
    ap.add_argument("--batches", default="1,64")
    a = ap.parse_args()
    logf = open(f"{a.out}/profile_decode.log", "w")

    def log(s):
        print(s, flush=True)
        logf.write(s + "\n")

    bw = copy_bandwidth()
    log(f"{torch.cuda.get_device_name(0)}: copy bandwidth {bw / 1e12:.3f} TB/s (read + write)")
    res = {"copy_bw": bw}
    if not a.skip_attention:
        res["attention"] = attention_bench(bw, log)
    if a.shrink:
        res["shrink"] = shrink_bench(log)
    if not a.skip_step:
        res["step"] = step_profile(a.layers, log, a.quants.split(","), [int(b) for b in a.batches.split(",")])
    with open(f"{a.out}/profile_decode.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

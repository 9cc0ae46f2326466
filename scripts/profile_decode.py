"""Where a 7B decode step's time goes, by kernel kind; decode attention and the LoRA shrink alone (GPU).

1. Decode attention (7B geometry: 28 query heads, 4 KV heads, d 128) at batch 1-256 and 256-8k
   keys: the split-KV kernel (bf16 and FP8 K/V) against the torch grouped path, as time and as a
   fraction of copy bandwidth on the K/V bytes, and a tile sweep (--skip-attention: not run).
2. --shrink: the LoRA shrink of the 7B's projections at M 1-256: cuBLAS, the one-row decode kernel, split-K.
3. A 7B decode step (LoRA r32; --quants nvfp4,bf16) at --batches 1,64: ms per step in CUDA graphs, then a
   profiler pass over eager steps: kernels per step and µs per kind (--skip-step: not run).
4. --shape qwen3-30b-a3b (any MoE shape, model/random_init.MOE): an MoE decode step instead of the 7B's (issue 59),
   LoRA r32 on the attention and on the experts (--no-expert-lora: not), built with --layers N (default 8) and
   scaled to the full depth by the step at N against N/2 layers: ms per step in CUDA graphs and tok/s; the
   profiler's kernels by MoE kind (router GEMM, top-k, route building, gather/scatter, expert GEMV, expert LoRA,
   combine, ...; each MoE block found by a marker launch around it), launches and µs per MoE layer, the raw top
   30 kernels; the fewest bytes each kind reads (the experts the router hit) as a fraction of copy bandwidth,
   and the weight-read limit of the full model. Writes profile_decode_moe.log, .json and .txt under --out.
   On the CPU (--device cpu, eager, --bw TB/s assumed) it runs as a smoke test.
Writes profile_decode.log and .json under --out. On the device: STEP=profile bash scripts/device.sh
(SHAPE=qwen3-30b-a3b BATCHES=64: the MoE step).
Usage: python3 scripts/profile_decode.py [--layers N] [--skip-attention] [--skip-step] [--shrink] [--quants Q]
       [--shape qwen3-30b-a3b [--no-expert-lora] [--device cpu --bw 3.35]]
"""
import argparse
import collections
import contextlib
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


# ---- MoE decode step (issue 59): --shape qwen3-30b-a3b ------------------------------------------------------------
# Kinds of an MoE decode step. Kernels inside an MoE block (between two marker launches) are classified by
# name and by where they fall in the block (router -> top-k -> route building -> experts -> combine);
# kernels outside the blocks by name alone (MOE_OUTSIDE, first match wins, case-insensitive).
ROUTER, TOPK, ROUTE = "router GEMM", "softmax / top-k", "sort / route building (moe_gemv.route)"
GATHER, GEMV, ELORA = "gather / scatter / index", "expert GEMV (moe_gemv)", "expert LoRA (moe_lora)"
GATING, COMBINE, MOE_OTHER = "expert gating (SiLU x mul)", "combine / weighted sum", "other in the MoE block"
ATTN, W4, DLORA = "attention (split-KV, merge, rope+KV write)", "dense W4 GEMM (attention projections)", \
    "dense LoRA (shrink / expand)"
HEAD, NORMS, SAMPLE, OTHER = "cuBLAS GEMM outside MoE (lm_head)", "norms / elementwise / compiled glue", \
    "sampling", "other"
MOE_KIND_ORDER = [ROUTER, TOPK, ROUTE, GATHER, GEMV, ELORA, GATING, COMBINE, MOE_OTHER, ATTN, W4, DLORA, HEAD,
                  NORMS, SAMPLE, OTHER]
MOE_OUTSIDE = [
    (ATTN, ("split_kernel", "merge_kernel", "rope_kv_kernel", "attention", "flash")),
    (W4, ("humming", "w4_mma", "w4_wgmma", "_fused_kernel", "_splitk_reduce", "_dequant_kernel")),
    (DLORA, ("shrink_kernel", "_expand_kernel")),
    (HEAD, ("gemm", "gemv", "cutlass", "xmma", "nvjet", "splitk")),
    (NORMS, ("triton_", "rms", "norm")),
    (SAMPLE, ("softmax", "exponential", "argmax", "sort", "topk", "distribution", "multinomial")),
    (GATHER, ("index", "scatter", "gather", "copy", "cat", "memcpy", "memset")),
    (NORMS, ("elementwise", "reduce", "vectorized")),
]
MARKER = "spin_kernel"  # torch.cuda._sleep's kernel: launched around each MoE block in the profiled steps
_GEMV_NAMES = ("_grouped_gemv_kernel",)
_ELORA_NAMES = ("_shrink_kernel",)  # exact name: the dense LoRA's is shrink_kernel (the expand's names collide)
_TOPK_KEYS = ("topk", "kth", "softmax")
_ROUTE_KEYS = ("sort", "scan", "cumsum", "index_add", "indexfunc")
_GEMM_KEYS = ("gemm", "gemv", "cutlass", "xmma", "nvjet", "splitk", "addmm", "linear", "matmul", "mm")


def _has(name: str, keys) -> bool:
    n = name.lower()
    return any(k in n for k in keys)


def classify_outside(name: str) -> str:
    for k, keys in MOE_OUTSIDE:
        if _has(name, keys):
            return k
    return OTHER


def classify_block(names: list[str]) -> list[str]:
    """The kind of each kernel of one MoE block, in launch order: router GEMM first, then softmax/top-k up
    to the route's first sort, route building up to the first expert kernel, the experts (GEMV, LoRA, the
    gating between them), and after the last expert kernel the combine (its index ops as gather/scatter)."""
    is_expert = [n in _GEMV_NAMES or n.split("(")[0] in _GEMV_NAMES or n == "_shrink_kernel" for n in names]
    first = next((i for i, e in enumerate(is_expert) if e), len(names))
    last = max((i for i, e in enumerate(is_expert) if e), default=-1)
    out, phase, prev = [], "router", ""
    for i, n in enumerate(names):
        if _has(n, _GEMV_NAMES):
            k = GEMV
        elif n == "_shrink_kernel" or (n == "_expand_kernel" and prev == "_shrink_kernel"):
            k = ELORA
        elif i > last >= 0:
            k = GATHER if _has(n, ("index", "scatter", "gather", "copy", "cat")) else COMBINE
        elif i > first:
            k = GATHER if _has(n, ("index", "scatter", "gather", "copy", "cat")) else GATING
        else:
            if phase == "router" and _has(n, _TOPK_KEYS):
                phase = "topk"
            elif phase in ("router", "topk") and _has(n, _ROUTE_KEYS):
                phase = "route"
            if phase == "router":
                k = ROUTER if _has(n, _GEMM_KEYS) else MOE_OTHER
            elif phase == "topk":
                k = TOPK
            else:
                k = ROUTE
        out.append(k)
        prev = n
    return out


def classify_step(kernels: list[tuple[str, float]]) -> tuple[list[tuple[str, str, float, bool]], int]:
    """(name, kind, µs, inside an MoE block) for each kernel of a profiled stretch in launch order, marker
    launches dropped; and the number of MoE blocks found (pairs of markers; 0: all classified by name)."""
    out, block, blocks = [], None, 0
    for name, us in kernels:
        if MARKER in name:
            if block is None:
                block = []
            else:
                out += [(n, k, u, True) for (n, u), k in zip(block, classify_block([n for n, _ in block]))]
                block, blocks = None, blocks + 1
            continue
        if block is not None:
            block.append((name, us))
        else:
            out.append((name, classify_outside(name), us, False))
    if block:  # an unclosed marker: by name
        out += [(n, classify_outside(n), u, False) for n, u in block]
    return out, blocks


def fmt_weight_bytes(fmt: str, n: int, k: int) -> int:
    """Bytes of one [N, K] weight: 4-bit codes + block scales (+ NVFP4's fp32 global scale); bf16: 2 a weight."""
    if fmt == "nvfp4":
        return n * k // 2 + n * k // 16 + 4
    if fmt == "mxfp4":
        return n * k // 2 + n * k // 32
    return 2 * n * k


def expected_hits(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts a uniform top-k router hits at this batch: each token leaves an expert out w.p. 1 - k/E."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def moe_step_bytes(cfg, batch: int, hits: float, fmt: str = "nvfp4", rank: int = 32, expert_lora: bool = True,
                   elem: int = 2, ctx: int = 0, layers: int | None = None) -> dict[str, float]:
    """Fewest bytes one decode step of a Qwen3-MoE-shaped model reads, by kind: attention projections (fmt) and
    their LoRA, the router, the hit experts' codes and scales and their LoRA, norms, lm_head and `batch`
    embedding rows (in `elem`-byte dtype), and the KV cache at ctx keys. `hits`: experts hit per layer."""
    L = layers or cfg.num_hidden_layers
    h, hd, heads, kv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    e, inter = cfg.num_experts, cfg.moe_intermediate_size
    attn = [(heads * hd, h), (kv * hd, h), (kv * hd, h), (h, heads * hd)]  # q, k, v, o as [N, K]
    experts = [(2 * inter, h), (inter, h)]  # gate|up, down
    lora = lambda shapes: sum(rank * (n + k) * elem for n, k in shapes)  # noqa: E731  A [r, K] + B [N, r]
    per_expert = sum(fmt_weight_bytes(fmt, n, k) for n, k in experts)  # NVFP4's global scale: one an expert
    b = {W4: L * sum(fmt_weight_bytes(fmt, n, k) for n, k in attn),
         DLORA: L * lora(attn) if rank else 0,
         ROUTER: L * e * h * elem,
         GEMV: L * hits * per_expert,
         ELORA: L * hits * lora(experts) if rank and expert_lora else 0,
         NORMS: (L * (2 * h + 2 * hd) + h) * elem,
         HEAD: cfg.vocab_size * h * elem,
         "embedding rows": batch * h * elem,
         ATTN: L * batch * 2 * kv * hd * ctx * elem}
    return b


def weight_limit(total_bytes: float, bw: float, batch: int) -> float:
    """Tokens/s if a decode step took only its bytes at copy bandwidth: batch / (bytes / bw)."""
    return batch * bw / total_bytes


@contextlib.contextmanager
def _first_layers(model, n):
    """The model cut to its first n decoder layers for a while (an engine made inside sees n layers)."""
    inner, cfg = model.model, model.config
    keep = (inner.layers, cfg.num_hidden_layers, getattr(cfg, "layer_types", None))
    inner.layers = torch.nn.ModuleList(list(keep[0])[:n])
    cfg.num_hidden_layers = n
    if keep[2] is not None:
        cfg.layer_types = list(keep[2])[:n]
    try:
        yield
    finally:
        inner.layers, cfg.num_hidden_layers = keep[0], keep[1]
        if keep[2] is not None:
            cfg.layer_types = keep[2]


def _step_ms(model, b, cuda, new=96, prompt=256):
    """ms per decode step as the engine runs it (CUDA graphs on a GPU), from a second timed generate."""
    eng = Engine(model, max_len=prompt + 384, max_slots=b, kv_cache_gb=None if cuda else 0.25)
    p = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True, seed=0)
    prompts = [list(range(prompt))] * b
    eng.warmup([b], p)
    eng.generate(prompts, params=p)
    s = eng.generate(prompts, params=p).stats
    del eng
    if cuda:  # the next engine sizes its KV budget by what is free
        torch.cuda.empty_cache()
    return 1e3 * (s.seconds - s.prefill_seconds) / max(1, s.steps)


def _moe_blocks(model):
    return [layer.mlp for layer in model.model.layers if hasattr(getattr(layer, "mlp", None), "experts")]


def moe_step_profile(shape, layers, log, quant="nvfp4", batches=(1, 64), bw=None, device="cuda", rank=32,
                     expert_lora=True, new=96, prompt=256, steps=8):
    from qerl.layers.routing import record_routing
    from qerl.model import MOE, shape_config
    from qerl.model.architectures import DEFAULT_TARGETS

    full = MOE[shape][0]
    n = layers or 8
    cfg = shape_config(shape, n)
    cuda = torch.device(device).type == "cuda"
    targets = DEFAULT_TARGETS + (("experts",) if expert_lora else ())
    pol = random_policy(cfg, quant, lora_rank=rank, target_modules=targets, device=device,
                        dtype=torch.bfloat16 if cuda else torch.float32, progress=False)
    model = pol.model
    elem = 2 if cuda else 4
    exp_fmt = next(m.experts.fmt.name for m in _moe_blocks(model))
    out = []
    for b in batches:
        r = dict(shape=shape, quant=quant, experts_format=exp_fmt, batch=b, layers_built=n, layers_full=full,
                 lora_rank=rank, expert_lora=expert_lora, device=torch.cuda.get_device_name(0) if cuda else "cpu")
        # 1. ms per step as the engine runs it, at n and n/2 layers: the difference is the per-layer cost
        ms_n = _step_ms(model, b, cuda, new, prompt)
        if n >= 2:
            with _first_layers(model, n // 2):
                ms_h = _step_ms(model, b, cuda, new, prompt)
            per_layer = (ms_n - ms_h) / (n - n // 2)
            r.update(ms_per_step_half=ms_h, layers_half=n // 2)
        else:
            per_layer = ms_n / n  # one layer: lm_head and sampling counted as layer time (an overestimate)
        ms_full = ms_n + (full - n) * per_layer
        r.update(ms_per_step=ms_n, ms_per_layer=per_layer, ms_per_step_full=ms_full,
                 tok_s_full=b * 1e3 / ms_full, tok_s_built=b * 1e3 / ms_n)
        log(f"\n{shape} {quant} (experts {exp_fmt}) batch={b}: {'graph' if cuda else 'eager CPU'} step {ms_n:.3f} ms "
            f"at {n} layers" + (f", {r.get('ms_per_step_half', 0):.3f} ms at {n // 2}" if n >= 2 else "") +
            f"; {per_layer:.3f} ms a layer -> {ms_full:.2f} ms at {full} layers = {r['tok_s_full']:.0f} tok/s")
        # 2. eager steps under the profiler, a marker launch around each MoE block
        eng = Engine(model, max_len=prompt + 384, max_slots=b, cuda_graphs=False, kv_cache_gb=None if cuda else 0.25)
        q = SamplingParams(max_new_tokens=17, ignore_eos=True)
        prompts = [list(range(prompt))] * b
        eng.generate(prompts, params=q)  # compiles; leaves prompt + 17 tokens in the cache
        eng.runner.setup(q, [])
        keys = prompt + 128  # as the dense profile: 256-token prompts, 384 keys
        with torch.no_grad(), record_routing(model) as rlog:  # the experts each layer's router hits
            eng.runner.step(b, keys, q)
        hits = [len(torch.unique(c[-1][c[-1] < cfg.num_experts])) for c in rlog.calls.values()]
        mark = (lambda *_: torch.cuda._sleep(1)) if cuda else (lambda *_: _cpu_marker())
        blocks_ = _moe_blocks(model) if not cuda or hasattr(torch.cuda, "_sleep") else []  # none: by name alone
        hooks = [m.register_forward_pre_hook(mark) for m in blocks_] + [m.register_forward_hook(mark) for m in blocks_]
        acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        try:
            with torch.no_grad(), profile(activities=acts) as prof:
                for _ in range(steps):
                    eng.runner.step(b, keys, q)
                if cuda:
                    torch.cuda.synchronize()
        finally:
            for hk in hooks:
                hk.remove()
        kernels = _profiled_kernels(prof, cuda)
        rows, blocks = classify_step(kernels)
        del eng
        per = collections.defaultdict(lambda: [0, 0.0])
        per_in = collections.defaultdict(lambda: [0, 0.0])
        names = collections.defaultdict(lambda: [0, 0.0, ""])
        for nm, k, us, inside in rows:
            per[k][0] += 1
            per[k][1] += us
            if inside:
                per_in[k][0] += 1
                per_in[k][1] += us
            names[nm][0] += 1
            names[nm][1] += us
            names[nm][2] = k
        moe_calls = max(1, blocks)
        total_n, total_us = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
        # 3. bytes: the experts each layer hit here, and a uniform router's expectation
        hit = sum(hits) / max(1, len(hits))
        r.update(hits_per_layer=hits, hits_mean=hit, hits_expected=expected_hits(cfg.num_experts,
                                                                                   cfg.num_experts_per_tok, b),
                 moe_blocks_marked=blocks, kernels_per_step=total_n / steps, kernel_us_per_step=total_us / steps,
                 launches_per_moe_layer=sum(v[0] for v in per_in.values()) / moe_calls,
                 launches_per_layer_all=total_n / steps / n)
        by = moe_step_bytes(cfg, b, hit, exp_fmt if exp_fmt in ("nvfp4", "mxfp4") else quant, rank, expert_lora,
                            elem, ctx=keys, layers=n)
        by_full = moe_step_bytes(cfg, b, hit, exp_fmt if exp_fmt in ("nvfp4", "mxfp4") else quant, rank, expert_lora,
                                 elem, ctx=keys, layers=full)
        weights_full = sum(v for k, v in by_full.items() if k != ATTN)
        r.update(bytes_per_step_built=by, bytes_per_step_full=by_full, weight_bytes_full=weights_full,
                 weight_limit_tok_s=weight_limit(weights_full, bw, b),
                 weight_kv_limit_tok_s=weight_limit(weights_full + by_full[ATTN], bw, b), copy_bw=bw)
        kinds = {}
        log(f"  profiler ({steps} eager steps, {keys} keys): {total_n / steps:.0f} kernels, "
            f"{total_us / steps / 1e3:.3f} ms "
            f"kernel time a step; {blocks / steps:.0f} MoE blocks marked a step; {r['launches_per_moe_layer']:.1f} "
            f"launches a MoE layer ({total_n / steps / n:.1f} a layer, all kernels)")
        log(f"  experts hit a layer: {hit:.1f} (uniform router: {r['hits_expected']:.1f} of {cfg.num_experts})")
        log(f"  {'kind':44s} {'/step':>6s} {'us/step':>9s} {'/layer':>7s} {'us/layer':>9s} {'MB/layer':>9s} "
            f"{'%copyBW':>8s}")
        for k in sorted(per, key=lambda k: MOE_KIND_ORDER.index(k) if k in MOE_KIND_ORDER else 99):
            cnt, us = per[k]
            in_layer = k not in (HEAD, SAMPLE)
            nb = by.get(k, 0.0)
            frac = nb / (us / steps * 1e-6) / bw if us and nb else None
            kinds[k] = dict(per_step=cnt / steps, us_per_step=us / steps,
                            per_layer=cnt / steps / n if in_layer else None,
                            us_per_layer=us / steps / n if in_layer else None, min_bytes_per_step=nb,
                            copy_bw_fraction=frac,
                            in_moe_block_per_layer=per_in[k][0] / moe_calls if k in per_in else 0,
                            us_full_est=us / steps * (full / n if in_layer else 1))
            log(f"  {k:44s} {cnt / steps:6.1f} {us / steps:9.1f} "
                + (f"{cnt / steps / n:7.1f} {us / steps / n:9.1f}" if in_layer else f"{'-':>7s} {'-':>9s}")
                + f" {nb / n / 1e6 if in_layer else nb / 1e6:9.2f} "
                + (f"{100 * frac:7.1f}%" if frac else f"{'-':>8s}"))
        r["kinds"] = kinds
        log(f"  min bytes a step at {full} layers: weights {weights_full / 1e9:.2f} GB (experts "
            f"{by_full[GEMV] / 1e9:.2f}, expert LoRA {by_full[ELORA] / 1e9:.2f}, attention W4 {by_full[W4] / 1e9:.2f}, "
            f"lm_head {by_full[HEAD] / 1e9:.2f}), KV {by_full[ATTN] / 1e9:.2f} at {keys} keys; copy BW "
            f"{bw / 1e12:.2f} TB/s -> weight-read limit {r['weight_limit_tok_s']:.0f} tok/s "
            f"({r['weight_kv_limit_tok_s']:.0f} with the KV reads) against {r['tok_s_full']:.0f} measured "
            f"({100 * r['tok_s_full'] / r['weight_limit_tok_s']:.1f}%)")
        top = sorted(names.items(), key=lambda kv: -kv[1][1])[:30]
        r["top_kernels"] = [dict(name=nm, kind=v[2], per_step=v[0] / steps, us_per_step=v[1] / steps) for nm, v in top]
        log("  top 30 kernels (us a step, launches a step, kind):")
        for nm, v in top:
            log(f"    {v[1] / steps:9.1f} us {v[0] / steps:6.1f}x  [{v[2]}]  {nm[:110]}")
        out.append(r)
        if cuda:
            torch.cuda.empty_cache()
    del pol, model
    return out


def _cpu_marker():
    """The CPU stand-in of the marker launch: an op the CPU profiler lists under the marker's name."""
    with torch.profiler.record_function(MARKER):
        pass


def _profiled_kernels(prof, cuda):
    """(name, µs) of each profiled kernel in launch order: CUDA kernels on a GPU; on the CPU, top-level ops."""
    evs = []
    for e in prof.events():
        if cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA or getattr(e, "is_user_annotation", False):
                continue
            evs.append((e.time_range.start, e.name, e.device_time))
        elif e.cpu_parent is None:
            evs.append((e.time_range.start, e.name, e.cpu_time_total))
    return [(nm, us) for _, nm, us in sorted(evs, key=lambda x: x[0])]


def moe_table(rows) -> str:
    """The text table of profile_decode_moe.json's rows."""
    lines = []
    for r in rows:
        lines.append(f"{r['shape']} {r['quant']} batch {r['batch']} ({r['device']}; built {r['layers_built']} layers, "
                     f"full {r['layers_full']}): {r['ms_per_step_full']:.2f} ms a step -> {r['tok_s_full']:.0f} tok/s; "
                     f"weight-read limit {r['weight_limit_tok_s']:.0f} tok/s; "
                     f"{r['launches_per_moe_layer']:.1f} launches "
                     f"a MoE layer; experts hit {r['hits_mean']:.1f}")
        lines.append(f"  {'kind':44s} {'/layer':>7s} {'us/layer':>9s} {'us/step(full)':>14s} {'%copyBW':>8s}")
        for k, v in sorted(r["kinds"].items(), key=lambda kv: -kv[1]["us_per_step"]):
            pl = (f"{v['per_layer']:7.1f} {v['us_per_layer']:9.1f}" if v["per_layer"] is not None
                  else f"{'-':>7s} {'-':>9s}")
            fr = f"{100 * v['copy_bw_fraction']:7.1f}%" if v["copy_bw_fraction"] else f"{'-':>8s}"
            lines.append(f"  {k:44s} {pl} {v['us_full_est']:14.1f} {fr}")
        lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--shrink", action="store_true", help="also time the decode LoRA shrink variants")
    ap.add_argument("--out", default=".")
    ap.add_argument("--quants", default="nvfp4", help="policies to profile a decode step of (nvfp4, bf16)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--shape", default="qwen2.5-7b", help="qwen2.5-7b (the dense step) or an MoE shape "
                    "(qwen3-30b-a3b, qwen3-moe-tiny: the MoE step)")
    ap.add_argument("--expert-lora", action=argparse.BooleanOptionalAction, default=True,
                    help="MoE: LoRA on the experts too (as the trainer with target 'experts')")
    ap.add_argument("--device", default="cuda", help="MoE: cpu runs the step eagerly (a smoke test)")
    ap.add_argument("--bw", type=float, default=3.35, help="TB/s assumed as copy bandwidth off a GPU")
    ap.add_argument("--prompt-len", type=int, default=256, help="MoE: prompt tokens (keys: + 128)")
    ap.add_argument("--new-tokens", type=int, default=96, help="MoE: tokens of the timed generate")
    a = ap.parse_args()
    from qerl.model import MOE

    moe = a.shape in MOE
    if not moe and a.shape != "qwen2.5-7b":
        ap.error(f"--shape {a.shape}: the dense step is the 7B's; MoE shapes: {', '.join(MOE)}")
    cuda = torch.cuda.is_available() and a.device == "cuda"
    logf = open(f"{a.out}/profile_decode{'_moe' if moe else ''}.log", "w")

    def log(s):
        print(s, flush=True)
        logf.write(s + "\n")

    bw = copy_bandwidth() if cuda else a.bw * 1e12
    log(f"{torch.cuda.get_device_name(0) if cuda else 'cpu'}: copy bandwidth {bw / 1e12:.3f} TB/s (read + write)"
        + ("" if cuda else " (assumed)"))
    res = {"copy_bw": bw}
    if not a.skip_attention:
        res["attention"] = attention_bench(bw, log)
    if a.shrink:
        res["shrink"] = shrink_bench(log)
    if moe:
        if not a.skip_step:
            res["moe_step"] = moe_step_profile(a.shape, a.layers, log, a.quants.split(",")[0],
                                               [int(b) for b in a.batches.split(",")], bw,
                                               "cuda" if cuda else "cpu", expert_lora=a.expert_lora,
                                               new=a.new_tokens, prompt=a.prompt_len)
            with open(f"{a.out}/profile_decode_moe.txt", "w") as f:
                f.write(moe_table(res["moe_step"]) + "\n")
        with open(f"{a.out}/profile_decode_moe.json", "w") as f:
            json.dump(res, f, indent=1)
        return
    if not a.skip_step:
        res["step"] = step_profile(a.layers, log, a.quants.split(","), [int(b) for b in a.batches.split(",")])
    with open(f"{a.out}/profile_decode.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

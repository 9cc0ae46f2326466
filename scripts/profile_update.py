"""Where an MoE GRPO update's time goes (issue 59, §2): one micro-batch's forward + backward of the policy loss,
and the optimizer step, by kernel kind and autograd phase.

The policy is bench step's (qerl bench step --shape S: random weights, NVFP4, LoRA r32 on the attention,
gradient checkpointing on) inside bench step's trainer (adamw_torch), built with --layers N. Each micro-batch
size of --micro-batches gets one synthetic micro-batch of that many completions of one prompt (the step's shape:
--prompt-len 256, --completion-len 256; the trainer's own micro-batch builder, packed rows on the GPU), then:
  1. --warmup passes (forward + backward + optimizer step), then --iters timed ones (CUDA events) at N layers,
     and at N/2 layers (the decoder cut, as profile_decode does): the difference is the per-layer cost,
     extrapolated to the shape's full depth;
  2. one pass under torch.profiler with a marker around forward, backward and optimizer (synchronized at
     each edge) and around each decoder layer's forward call. A kernel is in the phase whose marker holds its
     start; a layer's forward inside the backward is its recompute (gradient checkpointing). Kinds by name:
     expert dequantize, grouped GEMM, attention, dense W4 / LoRA / router GEMMs, logits (everything outside the
     decoder layers after them: final norm, lm_head chunks, log-softmax, loss), optimizer, elementwise, other.
  3. one more pass with torch's sync debug mode on: the host syncs (a wait for the GPU) counted by the qerl
     source line that made them; and the GPU's busy share of a timed pass (its kernels over its wall time).
Per size: ms a micro-batch forward + backward, ms an optimizer step, tokens/s, kinds x phases (µs, and at full
depth), the raw top 30 kernels; then the implied update of the whole step (rows / size passes and one
optimizer step, as bench step's one update a step) against the measured 34.6 s (H100, mb 2).
Writes profile_update.log, .json and .txt under --out. On the CPU (--device cpu; the tiny shape) a smoke test.
On the device: STEP=profile_update bash scripts/device.sh (SHAPE, LAYERS, MBS).
Usage: python3 scripts/profile_update.py --shape qwen3-30b-a3b --layers 4 --micro-batches 2,4 --out DIR
"""
import argparse
import collections
import contextlib
import functools
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # profile_decode, beside it
from profile_decode import _first_layers as first_layers  # noqa: E402  (one cut of the decoder)

MEASURED_UPDATE_S = 34.6  # issue 59: Qwen3-30B-A3B, 8x8, prompt 256, new 256, mb 2, adamw_torch, ckpt (H100)

DEQ, GMM, ATTN = "expert dequantize (moe_dequant)", "grouped GEMM (torch._grouped_mm)", "attention (flash/sdpa/flex)"
DENSE, HEAD, OPT = "dense W4 / LoRA / router GEMMs", "logits / log-softmax (lm_head, chunks, loss)", \
    "optimizer (adam / foreach / grad clip)"
ELEM, OTHER = "elementwise / norms / index / copies", "other"
KIND_ORDER = [DEQ, GMM, ATTN, DENSE, HEAD, OPT, ELEM, OTHER]
PHASES = ["forward", "recompute", "backward", "optimizer"]
# marker names (record_function ranges)
M_FWD, M_BWD, M_OPT, M_LAYER = "qerl.update.forward", "qerl.update.backward", "qerl.update.optimizer", \
    "qerl.update.layer"
MARKS = (M_FWD, M_BWD, M_OPT, M_LAYER)
BY_NAME = [  # first match wins, case-insensitive; GEMM names after the grouped ones (both can say cutlass)
    (DEQ, ("dequant_experts", "dequantize_experts")),
    (GMM, ("grouped_mm", "groupproblemshape", "ptrarray", "grouped_gemm", "group_gemm", "groupedgemm")),
    (ATTN, ("flash", "fmha", "attention", "sdpa", "flex", "triton_tem")),
    (OPT, ("adam", "multi_tensor", "foreach", "lpnorm")),
    (DENSE, ("w4_", "humming", "_fused_kernel", "_splitk_reduce", "shrink_kernel", "_expand_kernel", "_dequant_kernel",
             "gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk", "aten::mm", "aten::addmm", "aten::bmm",
             "aten::linear", "aten::matmul")),
    (ELEM, ("elementwise", "vectorized", "reduce", "triton_poi", "triton_red", "triton_per", "norm", "rms", "silu",
            "softmax", "index", "scatter", "gather", "copy", "cat", "memcpy", "memset", "fill", "sort", "scan",
            "bincount", "cumsum", "aten::")),
]


def classify(name: str, phase: str, region: str = "layer", op: str = "") -> str:
    """A kernel's kind from its name (and its launching op's, where the profiler linked one), its phase
    (forward / recompute / backward / optimizer) and region (layer: inside the decoder layers or their backward;
    head: after them, the logits; pre: before them, the embedding)."""
    if phase == "optimizer":
        return OPT
    if region == "head":
        return HEAD
    for k, keys in BY_NAME:
        if any(x in name.lower() for x in keys) or (op and k in (GMM, DEQ) and any(x in op.lower() for x in keys)):
            return k
    return OTHER


def placer(ranges: dict):
    """ranges: marker name -> sorted [(start, end)] in µs. Returns t -> (phase, region) or None (outside)."""
    fwd, bwd, opt, layers = (ranges.get(m, []) for m in MARKS)

    def inside(t, rs):
        return next(((s, e) for s, e in rs if s <= t <= e), None)

    def place(t):
        if inside(t, opt):
            return "optimizer", "layer"  # the trainable parameters are the layers' LoRA
        f = inside(t, fwd)
        if f:
            in_f = [r for r in layers if f[0] <= r[0] <= f[1]]
            if not in_f or t > in_f[-1][1]:
                return "forward", "head"
            return "forward", "pre" if t < in_f[0][0] else "layer"
        b = inside(t, bwd)
        if b:
            in_b = [r for r in layers if b[0] <= r[0] <= b[1]]
            if inside(t, in_b):
                return "recompute", "layer"
            # autograd runs the loss and logits backward first, then the layers (each recomputed at its start)
            return "backward", "head" if not in_b or t < in_b[0][0] else "layer"
        return None

    return place


def profiled_kernels(prof, cuda: bool):
    """[(name, µs, start µs, launching op)] of the profiled pass: CUDA kernels on a GPU; on the CPU the ops
    with no child op (their own time). Markers left out."""
    evs = list(prof.events())
    out = []
    if cuda:
        ops = {e.id: e.name for e in evs if e.device_type == torch.autograd.DeviceType.CPU}
        for e in evs:
            if e.device_type != torch.autograd.DeviceType.CUDA or getattr(e, "is_user_annotation", False) \
                    or e.name in MARKS:
                continue
            link = getattr(e, "linked_correlation_id", 0)
            out.append((e.name, e.time_range.elapsed_us(), e.time_range.start, ops.get(link, "")))
    else:  # the outermost aten ops (an op's own children would count twice; leaves lose the op's name)
        for e in evs:
            par = e.cpu_parent
            if e.device_type != torch.autograd.DeviceType.CPU or not e.name.startswith("aten::") or \
                    (par is not None and par.name.startswith("aten::")):
                continue
            out.append((e.name, e.cpu_time_total, e.time_range.start, e.name))
    return out


def marker_ranges(prof) -> dict:
    r = collections.defaultdict(list)
    for e in prof.events():
        if e.name in MARKS and e.device_type == torch.autograd.DeviceType.CPU:
            r[e.name].append((e.time_range.start, e.time_range.end))
    return {k: sorted(v) for k, v in r.items()}


def tally(kernels, ranges, layers_built: int, layers_full: int) -> dict:
    """Kinds x phases of the profiled pass: µs, launches, and µs at full depth (the layers' share scaled)."""
    place = placer(ranges)
    per = {k: {p: 0.0 for p in PHASES} | {"launches": 0, "us_layer": 0.0, "us_other": 0.0} for k in KIND_ORDER}
    names = collections.defaultdict(lambda: [0, 0.0, "", ""])
    dropped = 0.0
    for name, us, t, op in kernels:
        where = place(t)
        if where is None:
            dropped += us
            continue
        phase, region = where
        k = classify(name, phase, region, op)
        per[k][phase] += us
        per[k]["launches"] += 1
        per[k]["us_layer" if region == "layer" else "us_other"] += us
        n = names[name]
        n[0] += 1
        n[1] += us
        n[2], n[3] = k, phase
    scale = layers_full / layers_built
    kinds = {}
    for k, v in per.items():
        if not v["launches"]:
            continue
        total = sum(v[p] for p in PHASES)
        kinds[k] = {**{p: v[p] for p in PHASES}, "total": total, "launches": v["launches"],
                    "us_layer": v["us_layer"], "us_full": v["us_other"] + v["us_layer"] * scale}
    phases = {p: sum(v[p] for v in kinds.values()) for p in PHASES}
    top = sorted(names.items(), key=lambda kv: -kv[1][1])[:30]
    return {"kinds": kinds, "phases": phases, "outside_markers_us": dropped,
            "kernel_us": sum(phases.values()),
            "top_kernels": [dict(name=nm, launches=v[0], us=v[1], kind=v[2], phase=v[3]) for nm, v in top]}


@contextlib.contextmanager
def marked_range(cuda: bool):
    """A layer marker, synchronized at both edges so the layer's kernels start inside it."""
    if cuda:
        torch.cuda.synchronize()
    with record_function(M_LAYER):
        try:
            yield
        finally:  # checkpoint's early stop ends a recompute by an exception
            if cuda:
                torch.cuda.synchronize()


@contextlib.contextmanager
def layer_markers(model, cuda: bool):
    """A marker around each decoder layer's forward call and around its recompute. transformers checkpoints
    inside the layer class's forward (layer._gradient_checkpointing_func on the unwrapped forward), so the
    recompute is marked through checkpoint's context_fn, whose second context holds the recompute."""
    layers = list(model.model.layers)
    kept = []

    def wrap(fwd):
        def marked(*a, **k):
            with marked_range(cuda):
                return fwd(*a, **k)
        return marked

    def recompute_marked(fn):
        inner = fn.keywords.get("context_fn")

        def context_fn():
            f, r = inner() if inner is not None else (contextlib.nullcontext(), contextlib.nullcontext())
            return f, stacked(r, marked_range(cuda))
        return functools.partial(fn.func, *fn.args, **{**fn.keywords, "context_fn": context_fn})

    for layer in layers:
        layer.forward = wrap(layer.forward)
        fn = getattr(layer, "_gradient_checkpointing_func", None)
        if isinstance(fn, functools.partial) and fn.keywords.get("use_reentrant") is False:  # context_fn needs it
            kept.append((layer, fn))
            layer._gradient_checkpointing_func = recompute_marked(fn)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward  # the class's forward again
        for layer, fn in kept:
            layer._gradient_checkpointing_func = fn


@contextlib.contextmanager
def stacked(*cms):
    with contextlib.ExitStack() as st:
        for c in cms:
            st.enter_context(c)
        yield


def build_trainer(a, dev):
    """bench step's policy (build_policy) in bench step's trainer settings; no rollout runs here."""
    from qerl.bench import step as bstep
    from qerl.bench.synthetic import random_prompts, synthetic_verifier
    from qerl.kernels.settings import KernelSettings
    from qerl.rl import GRPOConfig, GRPOTrainer

    ns = argparse.Namespace(shape=a.shape, layers=a.layers, device=a.device, quant=a.quant, lora_rank=a.lora_rank,
                            seed=a.seed, humming_storage=False)
    pol, build_s = bstep.build_policy(ns)
    rows, mb = a.prompts * a.num_generations, max(a.mbs)
    gcfg = GRPOConfig(
        model_name_or_path=f"random:{a.shape}", quant=a.quant, lora_r=a.lora_rank, lora_alpha=2.0 * a.lora_rank,
        device=a.device, max_steps=2, num_generations=a.num_generations, generation_batch_size=rows,
        per_device_train_batch_size=mb, gradient_accumulation_steps=max(1, rows // mb), num_iterations=1,
        max_prompt_length=a.prompt_len, max_completion_length=a.completion_len, gradient_checkpointing=True,
        logprob_chunk_size=1024, rollout_kv_cache_gb=a.kv_cache_gb, optim="adamw_torch", dynamic_sampling=False,
        loss_type="dapo", aqn=True, parity_check_steps=0, learning_rate=1e-5, save_steps=10**9, report_to="none",
        output_dir=str(Path(a.out) / "run"), seed=a.seed)
    tr = GRPOTrainer(gcfg, policy=pol, reward_funcs=[synthetic_verifier], progress=False,
                     kernel_settings=KernelSettings(moe_grouped=True, moe_gemv=True,
                                                    moe_expert_chunk_mib=a.expert_chunk_mib),
                     train_dataset=random_prompts(a.prompts * 4, a.prompt_len, pol.config.vocab_size, a.seed))
    return tr, pol, build_s


def synthetic_batch(mb: int, prompt_len: int, completion_len: int, vocab: int, seed: int):
    """mb completions of one prompt, each running to the limit (bench step's default lengths)."""
    from qerl.completion import Completion
    from qerl.train.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, vocab, (prompt_len,), generator=g).tolist()
    comps = [Completion(0, j, prompt, torch.randint(2, vocab, (completion_len,), generator=g).tolist(),
                        (-torch.rand(completion_len, generator=g) * 4).tolist(), "length") for j in range(mb)]
    adv = torch.randn(mb, generator=g)
    return RolloutBatch(comps, adv, torch.ones(mb, dtype=torch.bool))


class Pass:
    """One micro-batch's forward + backward, and an optimizer step, as PolicyUpdate._one_update runs them."""

    def __init__(self, tr, b, rows: int, mb: int, cuda: bool):
        from qerl.train.update import MicroLoss

        self.tr, self.b, self.cuda, self.MicroLoss = tr, b, cuda, MicroLoss
        upd = tr.update
        self.mask = upd.loss_mask(b)
        self.passes = max(1, rows // mb)  # the step's micro-batches, one optimizer update
        self.norm = float(self.mask.sum()) * self.passes  # the "generation" normaliser of the step's tokens
        ctx = tr.step_context(0, 0)
        upd.objective.start(ctx.sigma, ctx.seed)
        upd.objective.begin_update(self.passes)

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def fwd_bwd(self, marks=False, events=None):
        upd = self.tr.update
        obj = upd.objective
        mark = record_function if marks else (lambda _: contextlib.nullcontext())
        upd.inp.model.train()
        with obj.scope():  # forward and backward see the same weights (AQN's noise)
            if events:
                events[0].record()
            with mark(M_FWD):
                lp, en = upd.logprobs(self.b, grad=True)
                loss, _ = obj.loss(self.MicroLoss(self.b, lp, en, lp.detach(), self.mask, self.norm, self.passes, 0,
                                                  True, True))
                if marks:
                    self._sync()
            if events:
                events[1].record()
            with mark(M_BWD):
                loss.backward()
                if marks:
                    self._sync()
            if events:
                events[2].record()
        return float(loss.detach()) if not events else None

    def optimizer(self, marks=False, events=None):
        mark = record_function if marks else (lambda _: contextlib.nullcontext())
        if events:
            events[0].record()
        with mark(M_OPT):
            self.tr.update.inp.optimizer_step(None)
            if marks:
                self._sync()
        if events:
            events[1].record()


class HostEvent:
    """torch.cuda.Event's record / elapsed_time on the host clock (the CPU runs synchronously)."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return 1e3 * (end.t - self.t)


def timed(p: Pass, iters: int, cuda: bool) -> tuple[float, float, float]:
    """ms: forward, backward, optimizer step (means over iters)."""
    f = bw = o = 0.0
    for _ in range(iters):
        ev = [torch.cuda.Event(enable_timing=True) if cuda else HostEvent() for _ in range(5)]
        p.fwd_bwd(events=ev[:3])
        p.optimizer(events=ev[3:])
        if cuda:
            torch.cuda.synchronize()
        f += ev[0].elapsed_time(ev[1])
        bw += ev[1].elapsed_time(ev[2])
        o += ev[3].elapsed_time(ev[4])
    return f / iters, bw / iters, o / iters


SYNC_WARNING = "synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode("warn")'s text
SRC = str(Path(__file__).resolve().parent.parent / "src")


def stack_site(stack=None) -> str:
    """Where a host sync came from: the innermost frame in qerl's source (path:line (function)), else the
    innermost frame outside torch, warnings and this helper. Autograd replays its worker threads' warnings at
    the end of backward(), so every sync of the backward and the recompute lands on that backward() call."""
    frames = [f for f in (stack if stack is not None else traceback.extract_stack())
              if f.name not in ("stack_site", "hook") and "/warnings.py" not in f.filename]
    for f in reversed(frames):
        if f.filename.startswith(SRC):
            return f"{Path(f.filename).relative_to(SRC)}:{f.lineno} ({f.name})"
    for f in reversed(frames):
        if "/torch/" not in f.filename:
            return f"{Path(f.filename).name}:{f.lineno} ({f.name})"
    return "(no Python frame)"


@contextlib.contextmanager
def host_syncs(cuda: bool):
    """Counts the host syncs (a CUDA op that waits for the GPU: .item(), .tolist(), nonzero, a copy to the
    host, ...) of the body by site, through torch's sync debug mode. Yields the Counter; empty on the CPU."""
    sites = collections.Counter()
    if not cuda:
        yield sites
        return
    shown = warnings.showwarning

    def hook(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING in str(message):
            sites[stack_site()] += 1
        else:
            shown(message, category, filename, lineno, file, line)

    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=".*" + SYNC_WARNING)  # every sync; other filters as they were
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield sites
        finally:
            torch.cuda.set_sync_debug_mode(prev)
            warnings.showwarning = shown


def profile_size(a, tr, mb: int, log, cuda: bool) -> dict:
    from qerl.model import MOE

    model = tr.update.inp.model
    n = model.config.num_hidden_layers
    full = MOE[a.shape][0] if a.shape in MOE else n
    rows = a.prompts * a.num_generations
    batches = tr.update.micro_batches(synthetic_batch(mb, a.prompt_len, a.completion_len, model.config.vocab_size,
                                                      a.seed + mb))
    assert len(batches) == 1, len(batches)
    p = Pass(tr, batches[0], rows, mb, cuda)
    tokens = mb * (a.prompt_len + a.completion_len)  # as bench step counts a step's tokens (prompt + new)
    r = dict(micro_batch=mb, layers_built=n, layers_full=full, passes_per_step=p.passes, tokens_per_micro_batch=tokens,
             row_tokens=int(batches[0].input_ids.numel()))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(a.warmup):
        p.fwd_bwd()
        p.optimizer()
    f, b, o = timed(p, a.iters, cuda)
    fb = f + b
    r.update(ms_forward=f, ms_backward=b, ms_fwd_bwd=fb, ms_optimizer=o)
    if cuda:
        r["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if n >= 2:  # the per-layer cost: n against n/2 layers
        with first_layers(model, n // 2):
            for _ in range(max(1, a.warmup - 1)):
                p.fwd_bwd()
                p.optimizer()
            fh, bh, oh = timed(p, a.iters, cuda)
        per_fb, per_o = (fb - fh - bh) / (n - n // 2), (o - oh) / (n - n // 2)
        r.update(ms_fwd_bwd_half=fh + bh, ms_optimizer_half=oh, layers_half=n // 2)
    else:
        per_fb = per_o = None
    # one pass under the profiler, markers on
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with layer_markers(model, cuda), profile(activities=acts) as prof:
        p.fwd_bwd(marks=True)
        p.optimizer(marks=True)
    t = tally(profiled_kernels(prof, cuda), marker_ranges(prof), n, full)
    r.update(t)
    # the GPU's busy share of a timed pass: kernels of the layers and head (forward, recompute, backward) over
    # its wall time; the rest is the GPU waiting for the host
    # (kernels of two streams at once count twice; on the CPU there is no GPU: NaN)
    r["gpu_busy_pct"] = (100 * (t["kernel_us"] - t["phases"]["optimizer"]) / max(1e-9, 1e3 * fb)) if cuda \
        else float("nan")
    with host_syncs(cuda) as sites:  # one more pass: the host syncs, by site
        p.fwd_bwd()
        p.optimizer()
    r["host_syncs"] = sum(sites.values())
    r["sync_sites"] = [dict(site=k, count=v) for k, v in sites.most_common(20)]
    if per_fb is None:  # one layer: the layers' share of the profiled kernel time scaled instead
        share = sum(v["us_layer"] for k, v in t["kinds"].items() if k != OPT) / max(1e-9, t["kernel_us"] -
                                                                                    t["phases"]["optimizer"])
        per_fb, per_o = fb * share / n, o / n
    r["ms_per_layer_fwd_bwd"], r["ms_per_layer_optimizer"] = per_fb, per_o
    r["ms_fwd_bwd_full"] = fb + (full - n) * per_fb
    r["ms_optimizer_full"] = o + (full - n) * per_o
    r["update_s_full"] = (p.passes * r["ms_fwd_bwd_full"] + r["ms_optimizer_full"]) / 1e3
    r["tok_s_built"] = tokens / (fb / 1e3)
    r["tok_s_full"] = rows * (a.prompt_len + a.completion_len) / r["update_s_full"]
    log(f"\nmicro-batch {mb} ({n} layers built, {full} full; {r['row_tokens']} row tokens): forward {f:.2f} ms + "
        f"backward {b:.2f} ms = {fb:.2f} ms a micro-batch, optimizer {o:.2f} ms; {r['tok_s_built']:.0f} tok/s"
        + (f"; peak {r['peak_allocated_gib']:.2f} GiB" if cuda else ""))
    if "layers_half" in r:
        log(f"  at {n // 2} layers: {r['ms_fwd_bwd_half']:.2f} ms + optimizer {r['ms_optimizer_half']:.2f} ms")
    log(f"  a layer: {per_fb:.2f} ms fwd+bwd, {per_o:.3f} ms optimizer -> at {full} layers {r['ms_fwd_bwd_full']:.1f} "
        f"ms a micro-batch, {r['ms_optimizer_full']:.1f} ms an optimizer step; the step's update ({p.passes} passes "
        f"+ 1 step): {r['update_s_full']:.2f} s ({r['tok_s_full']:.0f} tok/s) against {MEASURED_UPDATE_S} s measured "
        f"(mb 2, H100)")
    log(f"  the GPU busy {r['gpu_busy_pct']:.0f} % of a pass ({n} layers); host syncs in one pass: {r['host_syncs']}"
        + (" (CPU: none to count)" if not cuda else ""))
    for x in r["sync_sites"]:
        log(f"    {x['count']:6d}  {x['site']}")
    log(kinds_table({**r, "device": "cuda" if cuda else "cpu"}))
    log("  top 30 kernels (µs in the profiled pass, launches, [kind / phase it last ran in]):")
    for k in r["top_kernels"]:
        log(f"    {k['us']:10.1f} us {k['launches']:5d}x  [{k['kind']} / {k['phase']}]  {k['name'][:110]}")
    return r


def kinds_table(r) -> str:
    unit = "us" if r.get("device", "cuda") != "cpu" else "us(cpu)"
    lines = [f"  {'kind':46s} " + " ".join(f"{p:>10s}" for p in PHASES) + f" {'total ' + unit:>12s} "
             f"{'full-depth ms':>13s} {'share':>6s}"]
    tot = max(1e-9, r["kernel_us"])
    for k in sorted(r["kinds"], key=lambda k: -r["kinds"][k]["total"]):
        v = r["kinds"][k]
        lines.append(f"  {k:46s} " + " ".join(f"{v[p]:10.1f}" for p in PHASES) + f" {v['total']:12.1f} "
                     f"{v['us_full'] / 1e3:13.2f} {100 * v['total'] / tot:5.1f}%")
    lines.append(f"  {'all kernels':46s} " + " ".join(f"{r['phases'][p]:10.1f}" for p in PHASES) +
                 f" {r['kernel_us']:12.1f} {sum(v['us_full'] for v in r['kinds'].values()) / 1e3:13.2f}")
    return "\n".join(lines)


def table(res) -> str:
    out = [f"{res['shape']} on {res['device']}: {res['prompts']}x{res['num_generations']}, prompt {res['prompt_len']}, "
           f"completion {res['completion_len']}, LoRA r{res['lora_rank']}, adamw_torch, gradient checkpointing; "
           f"measured update {MEASURED_UPDATE_S} s (H100, mb 2)"]
    out.append(f"{'mb':>3s} {'fwd ms':>8s} {'bwd ms':>8s} {'opt ms':>8s} {'tok/s':>8s} {'mb full ms':>11s} "
               f"{'update s (full)':>16s} {'peak GiB':>9s} {'GPU busy':>9s} {'syncs':>6s}")
    for r in res["sizes"]:
        if not r.get("fits", True):
            out.append(f"{r['micro_batch']:3d} out of memory: {r['error'][:100]}")
            continue
        out.append(f"{r['micro_batch']:3d} {r['ms_forward']:8.2f} {r['ms_backward']:8.2f} {r['ms_optimizer']:8.2f} "
                   f"{r['tok_s_built']:8.0f} {r['ms_fwd_bwd_full']:11.1f} {r['update_s_full']:16.2f} "
                   f"{r.get('peak_allocated_gib', float('nan')):9.2f} {r.get('gpu_busy_pct', float('nan')):8.0f}% "
                   f"{r.get('host_syncs', 0):6d}")
    for r in res["sizes"]:
        if r.get("fits", True):
            out += [f"\nmicro-batch {r['micro_batch']}: kernel µs by kind and phase "
                    f"({r['layers_built']} layers built)",
                    kinds_table({**r, "device": res["device"]})]
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="a bench step shape (MoE: qwen3-30b-a3b, qwen3-moe-tiny)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--micro-batches", default="2,4", help="completions a micro-batch, comma-separated")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--completion-len", type=int, default=256)
    ap.add_argument("--quant", default="nvfp4")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3, help="untimed passes first (compiles, autotunes)")
    ap.add_argument("--iters", type=int, default=5, help="timed passes")
    ap.add_argument("--kv-cache-gb", type=float, default=0.25, help="the trainer's rollout KV (unused here)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--expert-chunk-mib", type=int, default=None,
                    help="KernelSettings.moe_expert_chunk_mib (default: 16 experts a chunk)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    a.mbs = [int(x) for x in a.micro_batches.split(",")]
    cuda = a.device.startswith("cuda") and torch.cuda.is_available()
    if not cuda:
        a.device = "cpu"
    Path(a.out).mkdir(parents=True, exist_ok=True)
    logf = open(Path(a.out) / "profile_update.log", "w")

    def log(s):
        print(s, flush=True)
        logf.write(s + "\n")

    dev = torch.device(a.device)
    tr, pol, build_s = build_trainer(a, dev)
    if not cuda:  # the CPU would take the experts loop; the grouped path (torch._grouped_mm runs on the CPU too)
        for m in pol.model.modules():  # is what the GPU's update runs, so the smoke test profiles it
            if hasattr(m, "grouped") and hasattr(m, "_grouped_forward"):
                m.grouped = True
    res = dict(shape=a.shape, device=torch.cuda.get_device_name(0) if cuda else "cpu", quant=a.quant,
               lora_rank=a.lora_rank, prompts=a.prompts, num_generations=a.num_generations, prompt_len=a.prompt_len,
               completion_len=a.completion_len, optim=tr.optim_name, gradient_checkpointing=True, build_s=build_s,
               expert_chunk_mib=a.expert_chunk_mib,
               measured_update_s=MEASURED_UPDATE_S, warmup=a.warmup, iters=a.iters, sizes=[])
    log(f"{res['device']}: {a.shape} {a.quant}, {a.layers} layers built, LoRA r{a.lora_rank}, {tr.optim_name}, "
        f"built in {build_s:.1f} s")
    try:
        with tr.scope():  # the trainer's kernel settings (grouped experts)
            for mb in a.mbs:
                try:
                    res["sizes"].append(profile_size(a, tr, mb, log, cuda))
                except torch.OutOfMemoryError as e:
                    log(f"\nmicro-batch {mb}: out of memory ({str(e).splitlines()[0][:200]})")
                    res["sizes"].append(dict(micro_batch=mb, fits=False, error=str(e).splitlines()[0][:400]))
                for q in tr.params:
                    q.grad = None
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        tr.close()
    (Path(a.out) / "profile_update.json").write_text(json.dumps(res, indent=1))
    (Path(a.out) / "profile_update.txt").write_text(table(res))
    log("\n" + table(res))
    logf.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

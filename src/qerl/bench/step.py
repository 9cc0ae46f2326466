"""Full GRPO steps at a real model's shape on one GPU: time per phase, tokens/s, peak memory.

    qerl bench step --shape qwen2.5-7b --quant nvfp4 [--memory-cap-gb 80] [levers] [--json F] [--record]
    qerl bench step ... --lengths varied     # completions end at varied lengths (mean 40 % of the limit)
    qerl bench step ... --max-staleness 1    # the next step's rollout during the update (rl/staleness.py)
    qerl bench step --compare A.json B.json --target ">=1.8"     # speedup of A over B, recorded
    torchrun --nproc_per_node N -m qerl bench step ...          # data-parallel (qerl bench scaling)

Random weights in the shape (built and quantized one decoder layer at a time on the GPU, so
the bf16 model never exists in full), the synthetic tokenizer and verifier (bench/synthetic.py),
and the trainer's own `train_step`: the same rollout engine, logprobs, loss, optimizer and
AQN as `qerl train`. One warm-up step with short completions (Triton compiles, decode graphs
are captured) precedes the timed steps. The first timed step still compiles the packed update's
FlexAttention masks and kernels at the timed lengths (at 7B, 256 new tokens: 18.0 s against a
steady 5.7 s), so with --steps 2 or more (the default) it is reported apart (first_step_s) and
the figures are the mean of the later steps (the case name says "steady").
The memory levers are the trainer's own settings:
gradient checkpointing, logprob chunk, micro-batch, KV-cache budget, 8-bit AdamW; the memory
cap makes the 139 GB H200 fail as a smaller card would. An out-of-memory error is a result
(fits = false, with the phase it hit), not a crash.

--lengths: random weights almost never sample EOS, so by default (max) every completion runs to
--max-new-tokens, the worst case. `varied` gives each sample its own limit (bench/synthetic.py's
varied_length: uniform on 5-75 % of the limit, mean 40 %) that the engine really stops at, so the
rollout's batch shrinks as samples finish and the packed update costs the tokens produced, as in
a real run; the case name says so and the result reports the mean completion length produced.

--max-staleness 1: the step's time is then about max(rollout, update) where they overlap; rollout_s
is the rollout's own wall time (run beside the update) and rollout_wait_s what the step waited for
it. The first timed step's rollout was launched during the warm-up step (short completions), so
only the steady steps after it say what the overlap gives.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from .record import RESULTS, record

CMD = "qerl bench step"


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """The arguments qerl's step and the TRL baseline share (same names, same defaults)."""
    ap.add_argument("--shape", default="qwen2.5-7b",
                    help="random weights in a model's shape: dense qwen2.5-0.5b | 7b | 14b | 32b | 72b, MoE "
                         "qwen3-30b-a3b | gpt-oss-20b | gpt-oss-120b; toy: tiny | qwen3-moe-tiny | gpt-oss-tiny")
    ap.add_argument("--layers", type=int, default=None, help="fewer decoder layers (smoke runs)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--num-generations", type=int, default=8, help="G: completions per prompt")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--lengths", default="max", choices=["max", "varied"],
                    help="max: every completion runs to --max-new-tokens; varied: each ends at its own length, "
                         "uniform on 5-75%% of it (mean 40%%)")
    ap.add_argument("--micro-batch", type=int, default=8, help="completions per forward/backward")
    ap.add_argument("--num-iterations", type=int, default=1, help="mu: policy updates per rollout batch")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--steps", type=int, default=2,
                    help="timed steps after the warm-up step; from 2 on, the first (which compiles the update "
                         "at the timed lengths) is reported apart and the rest averaged")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--memory-cap-gb", type=float, default=None, help="cap this process's GPU memory (GiB)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--record", action="store_true", help="append figures to benchmarks/results/step.jsonl")
    ap.add_argument("--results-dir", "--results_dir", default=None)
    ap.add_argument("--peak-target", default=None, help='target of the peak allocated GiB, e.g. "<=40"')
    ap.add_argument("--out", default="runs/bench_step", help="scratch run directory")


def shape_config(a):
    from ..model import shape_config as config_of

    cfg = config_of(a.shape, a.layers)  # dense Qwen2.5 or MoE (model/random_init.py: QWEN25, MOE)
    cfg.eos_token_id = 1  # the synthetic tokenizer's <eos>
    return cfg


def _route(a) -> str:
    """The MoE decode route of a bench run (--moe-route; namespaces built without it: the default)."""
    return getattr(a, "moe_route", None) or "fused"


def case_name(a, quant: str) -> str:
    lv = [f"mb{a.micro_batch}", "ckpt" if a.gradient_checkpointing else "no-ckpt"]
    for key, tag in (("logprob_chunk", "chunk"), ("kv_cache_gb", "kv"), ("kv_fraction", "kv-rows")):
        if getattr(a, key, None) is not None:
            lv.append(f"{tag}{getattr(a, key):g}")
    if getattr(a, "kv_cache_dtype", "auto") != "auto":
        lv.append(f"kv-{a.kv_cache_dtype}")
    if getattr(a, "optim", None):
        lv.append(a.optim)
    if a.memory_cap_gb:
        lv.append(f"cap{a.memory_cap_gb:g}GiB")
    layers = f" {a.layers}L" if a.layers else ""
    if _world() > 1:
        lv.append(f"dp{_world()}")
    if getattr(a, "lengths", "max") == "varied":
        from .synthetic import VARIED_CASE

        lv.append(VARIED_CASE)
    if getattr(a, "max_staleness", 0):
        lv.append(f"stale{a.max_staleness}")
    if getattr(a, "moe_path", "fast") == "loop":
        lv.append("moe-loop")
    if not getattr(a, "humming", True):
        lv.append("no-humming")
    if getattr(a, "humming_storage", False):
        lv.append("humming-storage")
    if getattr(a, "expert_chunk_mib", None):
        lv.append(f"echunk{a.expert_chunk_mib}mib")
    if getattr(a, "embed_4bit", False):
        lv.append("embed4bit")
    route = _route(a)
    if route != "fused":  # the default since 12d225c; rows of 9b635f0-12d225c ran counting untagged (before: tagged)
        lv.append(f"route-{route}")
    if getattr(a, "steps", 1) > 1:
        lv.append("steady")
    return (f"{a.shape}{layers} {quant} {a.prompts}x{a.num_generations} prompt{a.prompt_len} new{a.max_new_tokens} "
            f"mu{a.num_iterations} " + " ".join(lv))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _rank_device(a) -> torch.device:
    """Under torchrun each rank builds its policy on its own GPU (LOCAL_RANK)."""
    dev = torch.device(a.device)
    if _world() > 1 and dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        a.device = str(dev)
    return dev


def _mem(dev):
    if dev.type != "cuda":
        return {}
    from ..device_memory import peaks

    return peaks(dev)


def _reset(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)


def build_policy(a):
    """The random-weight policy in the shape, with the synthetic tokenizer."""
    from ..model import random_policy
    from .synthetic import synthetic_tokenizer

    dev = _rank_device(a)
    cfg = shape_config(a)
    t0 = time.perf_counter()
    from ..kernels import settings

    with settings.use(humming_storage=getattr(a, "humming_storage", False)):  # the layout is chosen at load
        pol = random_policy(cfg, a.quant, lora_rank=a.lora_rank, device=dev,
                            dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, seed=a.seed)
    if getattr(a, "embed_4bit", False):
        from ..layers.quant_embed import quantize_embedding

        quantize_embedding(pol.model)
    pol.tokenizer = synthetic_tokenizer(cfg.vocab_size)
    return pol, time.perf_counter() - t0


WARMUP_NEW_TOKENS = 16  # the warm-up step's completions: kernels compile and graphs are captured, quickly


def _run_case(a, pol, build_s) -> dict:
    from ..rl import GRPOConfig, GRPOTrainer
    from ..rollout import SamplingParams
    from .synthetic import random_prompts, synthetic_verifier, varied_limits

    dev = _rank_device(a)
    lengths = getattr(a, "lengths", "max")
    res = {"case": case_name(a, a.quant), "shape": a.shape, "quant": a.quant, "rows": a.prompts * a.num_generations,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "fits": True,
           "memory_cap_gib": a.memory_cap_gb, "world_size": _world(), "lengths": lengths,
           "max_new_tokens": a.max_new_tokens}
    from ..device_memory import set_memory_cap

    # embed_4bit: the random builder holds the bf16 table (and its own per-layer transients) before the table is
    # quantized, which a 14 GiB cap refuses (H100, 700f1db); the cap then starts after the build, on the step
    cap_after_build = bool(a.memory_cap_gb) and getattr(a, "embed_4bit", False)
    if a.memory_cap_gb and not cap_after_build:
        set_memory_cap(a.memory_cap_gb, dev)
    phase, tr = "build", None
    try:
        if pol is None:
            pol, build_s = build_policy(a)
        res["build_s"] = build_s
        if cap_after_build:
            torch.cuda.empty_cache()
            set_memory_cap(a.memory_cap_gb, dev)
            res["memory_cap_after_build"] = True
        if dev.type == "cuda":
            res["model_gib"] = torch.cuda.memory_allocated(dev) / 2**30
        off = getattr(pol.model, "activation_checkpointing_disable", None) or \
            getattr(pol.model, "gradient_checkpointing_disable", None)
        if off is not None and getattr(pol.model, "is_gradient_checkpointing", False):
            off()  # a reused policy: the case decides
        n_rows = a.prompts * a.num_generations
        res["aqn"] = aqn = True  # every family runs AQN (rl/aqn.py)
        kv_gb = a.kv_cache_gb
        if getattr(a, "kv_fraction", None):  # a KV budget holding this fraction of the step's rows at once
            from ..rollout.forward import ModelView
            from ..rollout.kv_cache import bytes_per_slot

            per_slot = bytes_per_slot(ModelView(pol.model), a.prompt_len + 1 + a.max_new_tokens,
                                      getattr(a, "kv_cache_dtype", "auto"))
            kv_gb = per_slot * max(1, round(n_rows * a.kv_fraction)) * 1.0001 / 2**30
        gcfg = GRPOConfig(
            model_name_or_path=f"random:{a.shape}", quant=a.quant, lora_r=a.lora_rank, lora_alpha=2.0 * a.lora_rank,
            device=a.device, max_steps=a.steps + 2, num_generations=a.num_generations, generation_batch_size=n_rows,
            per_device_train_batch_size=a.micro_batch,
            gradient_accumulation_steps=max(1, n_rows // _world() // a.micro_batch),  # one update a step
            num_iterations=a.num_iterations, max_prompt_length=a.prompt_len, max_completion_length=a.max_new_tokens,
            gradient_checkpointing=a.gradient_checkpointing, logprob_chunk_size=a.logprob_chunk or 1024,
            rollout_kv_cache_gb=kv_gb, rollout_kv_cache_dtype=getattr(a, "kv_cache_dtype", "auto"),
            optim=a.optim, dynamic_sampling=False, loss_type="dapo", aqn=aqn,
            # no parity gate: its 0.1-nat threshold is for trained weights. On random weights 48-80 layers
            # deep (14B-72B) the engine's and the trainer's bf16 roundings part by 0.13-0.3 nats
            # (H200, 2026-12-04), while the 7B shape passes; parity is tested on real weights (tests/)
            parity_check_steps=0, max_staleness=getattr(a, "max_staleness", 0),
            learning_rate=1e-5, save_steps=10**9, report_to="none", output_dir=str(Path(a.out) / "run"), seed=a.seed)
        phase = "setup"
        from ..kernels.settings import KernelSettings

        fast_moe = getattr(a, "moe_path", "fast") == "fast"
        tr = GRPOTrainer(gcfg, policy=pol, reward_funcs=[synthetic_verifier], progress=False,
                         kernel_settings=KernelSettings(moe_grouped=fast_moe, moe_gemv=fast_moe,
                                                        humming=getattr(a, "humming", True),
                                                        moe_expert_chunk_mib=getattr(a, "expert_chunk_mib", None),
                                                        moe_route_fused=_route(a) == "fused",
                                                        moe_route_counting=_route(a) != "argsort"),
                         train_dataset=random_prompts(a.prompts * (a.steps + 2), a.prompt_len, pol.config.vocab_size,
                                                      a.seed))
        eng = tr.engine
        # each sample's own length limit, through the trainer's public hook. The trainer keys prompts by
        # their index in the step's global batch, so every step and every data-parallel split draws the
        # same limits
        limits = varied_limits(a.seed, a.max_new_tokens) if lengths == "varied" else None
        res.update(optim=tr.optim_name, kv_slots=eng.n_slots, kv_cache_gib=eng.cache.nbytes() / 2**30,
                   trainable_params=sum(p.numel() for p in tr.params))
        if a.optim == "adamw_8bit" and "bitsandbytes" not in tr.optim_name:  # fell back: the case says what ran
            res["case"] = res["case"].replace(" adamw_8bit", " adamw_torch (no bitsandbytes)")
        if dev.type == "cuda":
            res["setup_gib"] = torch.cuda.memory_allocated(dev) / 2**30
        # warm-up: kernels compile, the training path runs once, decode graphs for the step's batch
        phase = "warm-up"
        t0 = time.perf_counter()
        warm = min(WARMUP_NEW_TOKENS, a.max_new_tokens)
        tr.sample_max_new_tokens = lambda key, j: warm
        tr.train_step()
        tr.sample_max_new_tokens = limits
        sizes = [min(n_rows, eng.n_slots)]
        if lengths == "varied":  # the batch shrinks as samples end: its smaller buckets' graphs too, not in the step
            from ..rollout.scheduler import BUCKETS

            sizes = [x for x in BUCKETS if x < sizes[0]] + sizes
        res["graphs_warmup"] = eng.warmup(sizes, SamplingParams(temperature=gcfg.temperature))
        res["warmup_s"] = time.perf_counter() - t0
        steps = []
        for _ in range(a.steps):
            phase = "rollout"
            _reset(dev)
            peak = {}

            def on_phase(name, event):  # the rollout's peak, then the update's on its own
                nonlocal phase
                if name == "logprob" and event == "start":
                    phase = "update"
                    peak["rollout"] = _mem(dev)
                    _reset(dev)

            tr.profiler.listeners.append(on_phase)
            try:
                m = tr.train_step()
            finally:
                tr.profiler.listeners.remove(on_phase)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            peak["update"] = _mem(dev)
            new_tokens = int(round(m["completion_length_mean"] * n_rows))
            steps.append({"step_s": m["time_step"], "rollout_s": m["time_rollout"], "logprob_s": m["time_logprob"],
                          "rollout_wait_s": m.get("time_rollout_wait", m["time_rollout"]),
                          "staleness": m["staleness"],
                          "update_s": m["time_update"], "new_tokens": new_tokens,
                          "rollout_tokens_per_s": new_tokens / m["time_rollout"],
                          "step_tokens_per_s": (new_tokens + n_rows * a.prompt_len) / m["time_step"],
                          "graphs_captured": m["rollout_graphs_captured"], "reward_mean": m["reward_mean"],
                          "completion_length_mean": m["completion_length_mean"],
                          "completion_length_max": m["completion_length_max"],
                          "truncated_fraction": m["truncated_fraction"],
                          "loss": m.get("loss"), "grad_norm": m.get("grad_norm"), "peak": peak})
        if getattr(a, "profile", False):
            res["profile"] = profile_update(tr, dev)
        res["steps"] = steps
        res["first_step_s"] = steps[0]["step_s"]
        steady = steps[1:] or steps  # the first timed step compiled the update at these lengths
        res["steady_steps"] = len(steady)
        for k in ("step_s", "rollout_s", "rollout_wait_s", "logprob_s", "update_s", "rollout_tokens_per_s",
                  "step_tokens_per_s", "completion_length_mean", "truncated_fraction"):
            res[k] = sum(s[k] for s in steady) / len(steady)
        res["completion_length_fraction"] = res["completion_length_mean"] / a.max_new_tokens  # of the limit
        res["completions_per_s"] = n_rows / res["step_s"]  # issue 32's figure: staleness 1 vs the synchronous step
        res["new_tokens"] = steps[-1]["new_tokens"]
        if dev.type == "cuda":
            res["peak_allocated_gib"] = max(p["peak_allocated_gib"] for s in steps for p in s["peak"].values())
            res["peak_reserved_gib"] = max(p["peak_reserved_gib"] for s in steps for p in s["peak"].values())
            res["rollout_peak_gib"] = max(s["peak"]["rollout"]["peak_allocated_gib"] for s in steps)
            res["update_peak_gib"] = max(s["peak"]["update"]["peak_allocated_gib"] for s in steps)
    except torch.OutOfMemoryError as e:
        res.update(fits=False, oom_phase=phase, error=str(e).splitlines()[0][:400], **_mem(dev))
    finally:
        if tr is not None:
            tr.close()  # the next step's rollout, in flight under --max-staleness 1
    if not res["fits"]:
        if pol is not None:  # a reused policy must not carry this case's gradients into the next
            for p in pol.model.parameters():
                p.grad = None
            pol.model.eval()
    return res


def profile_update(tr, dev, rows: int = 30) -> str:
    """One more (untimed) step with its logprob and update phases under torch.profiler: the kernels
    that cost the most there, as a table (the rollout replays CUDA graphs and has its own bench)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    wall = {}

    def on_phase(name, event):
        if name == "logprob" and event == "start":
            if cuda:
                torch.cuda.synchronize(dev)
            wall["t0"] = time.perf_counter()
            prof.start()
        elif name == "update" and event == "end" and "t0" in wall:
            if cuda:
                torch.cuda.synchronize(dev)
            prof.stop()
            wall["s"] = time.perf_counter() - wall["t0"]

    tr.profiler.listeners.append(on_phase)
    try:
        tr.train_step()
    finally:
        tr.profiler.listeners.remove(on_phase)
    ev = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    # kernel time: the device-side events only (an op's row repeats its kernels' time)
    busy = sum(e.self_device_time_total for e in ev if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6 \
        if cuda else float("nan")
    head = f"logprob + update under the profiler: {wall.get('s', float('nan')):.2f} s wall, kernels {busy:.2f} s"
    return head + "\n" + ev.table(sort_by=key, row_limit=rows, max_name_column_width=70)


def run_case(a, pol=None, build_s: float | None = None) -> dict:
    """Build (or reuse) the policy, then a warm-up step and a.steps timed steps of the trainer. The
    trainer, its KV cache and optimizer state are freed on return (a lever sweep reuses the policy)."""
    import gc

    res = _run_case(a, pol, build_s)
    gc.collect()  # the trainer's frame is gone: reference cycles through it can be collected now
    if torch.device(a.device).type == "cuda":
        torch.cuda.empty_cache()
    return res


# The memory levers, one at a time from the case's settings (--sweep-levers).
LEVERS = {
    "no-ckpt": {"gradient_checkpointing": False},
    "micro-batch 2": {"micro_batch": 2},
    "logprob chunk 256": {"logprob_chunk": 256},
    "logprob chunk 16384": {"logprob_chunk": 16384},
    "adamw_torch": {"optim": "adamw_torch"},
    "KV for a quarter of the rows": {"kv_fraction": 0.25},
}


def report(res: dict, log=print) -> None:
    log(f"== {res['case']} on {res['device']}")
    if not res["fits"]:
        log(f"   OUT OF MEMORY in {res['oom_phase']}: {res['error']}")
        return
    log(f"   build {res['build_s']:.1f} s, warm-up {res['warmup_s']:.1f} s, optimizer {res['optim']}, "
        f"KV {res['kv_slots']} slots ({res['kv_cache_gib']:.2f} GiB)")
    if res.get("steady_steps", 0) and len(res.get("steps", [])) > 1:
        log(f"   first timed step {res['first_step_s']:.2f} s (compiles the update at these lengths); "
            f"the mean of the {res['steady_steps']} after it:")
    log(f"   step {res['step_s']:.2f} s = rollout {res['rollout_s']:.2f} + logprob {res['logprob_s']:.2f} + "
        f"update {res['update_s']:.2f}" + (f" (rollout overlapped; waited {res['rollout_wait_s']:.2f})"
                                            if "stale" in res["case"] else "") +
        f"; {res['new_tokens']} new tokens, rollout {res['rollout_tokens_per_s']:.0f} tok/s, "
        f"step {res['step_tokens_per_s']:.0f} tok/s")
    if "completion_length_mean" in res:
        log(f"   completions ({res.get('lengths', 'max')} lengths): mean {res['completion_length_mean']:.1f} tokens "
            f"= {100 * res['completion_length_fraction']:.1f}% of {res['max_new_tokens']}, "
            f"{100 * res['truncated_fraction']:.0f}% cut at the limit")
    if "peak_allocated_gib" in res:
        log(f"   memory: model {res['model_gib']:.2f} GiB, after setup {res['setup_gib']:.2f}, peak allocated "
            f"{res['peak_allocated_gib']:.2f} (rollout {res['rollout_peak_gib']:.2f}, update {res['update_peak_gib']:.2f}), "
            f"peak reserved {res['peak_reserved_gib']:.2f}")
    if res.get("profile"):
        log("   " + res["profile"].replace("\n", "\n   "))


def record_case(res: dict, command: str, results_dir: Path, peak_target: str | None = None) -> None:
    rec = lambda m, v, u, t=None: record("step", res["case"], m, v, u, t, command=command,  # noqa: E731
                                         results_dir=results_dir)
    rec("fits", float(res["fits"]), "bool", "==1" if peak_target else None)
    if not res["fits"]:
        return
    for m in ("step_s", "rollout_s", "logprob_s", "update_s"):
        rec(m.replace("_s", "_time"), res[m], "s")
    if "first_step_s" in res:
        rec("first_step_time", res["first_step_s"], "s")
    rec("rollout_tokens_per_s", res["rollout_tokens_per_s"], "tok/s")
    if "completions_per_s" in res:
        rec("completions_per_s", res["completions_per_s"], "1/s")
    rec("step_tokens_per_s", res["step_tokens_per_s"], "tok/s")
    if res.get("completion_length_mean") is not None:
        rec("completion_length_mean", res["completion_length_mean"], "tokens")
    if "peak_allocated_gib" in res:
        rec("peak_allocated", res["peak_allocated_gib"], "GiB", peak_target)
        rec("peak_reserved", res["peak_reserved_gib"], "GiB")


def compare(a_path: str, b_path: str, target: str | None, metric: str, command: str, results_dir: Path | None,
            log=print) -> float | None:
    """Speedup of case A over case B: B's time over A's (step time, or rollout time with --metric rollout_s)."""
    target = target or None  # device.sh passes "" for no target
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    a, b = (x[0] if isinstance(x, list) else x for x in (a, b))  # a lever sweep: the case as given
    if not (a.get("fits") and b.get("fits")) or a.get(metric) is None or b.get(metric) is None:
        log(f"compare: {a_path} or {b_path} has no {metric} (out of memory or failed); no speedup")
        return None
    v = b[metric] / a[metric]
    log(f"{a['case']}  vs  {b['case']}: {metric} {a[metric]:.2f} s vs {b[metric]:.2f} s -> {v:.2f}x "
        f"(target {target or '-'})")
    if results_dir is not None:
        record("step", f"{a['case']} vs {b['case']}", f"speedup_{metric.removesuffix('_s')}", v, "x", target,
               device=a.get("device"), command=command, results_dir=results_dir)
    return v


def main(argv=None):
    ap = argparse.ArgumentParser(prog="qerl bench step", description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.add_argument("--quant", default="nvfp4", help="nvfp4 | mxfp4 | nf4 | bf16 (the bf16 LoRA baseline)")
    ap.add_argument("--logprob-chunk", type=int, default=None, help="tokens per logprob chunk (default 1024)")
    ap.add_argument("--kv-cache-gb", type=float, default=None, help="rollout KV budget (default: half the free memory)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                    help="rollout KV cache values (GRPOConfig.rollout_kv_cache_dtype): fp8 holds twice the slots")
    ap.add_argument("--optim", default="adamw_8bit", help="adamw_8bit (bitsandbytes) | adamw_torch")
    ap.add_argument("--max-staleness", type=int, default=0, choices=[0, 1],
                    help="1: the next step's rollout runs during the update (GRPOConfig.max_staleness)")
    ap.add_argument("--moe-path", default="fast", choices=["fast", "loop"],
                    help="MoE experts: fast = the decode GEMV and the grouped prefill/update "
                         "(KernelSettings.moe_gemv, moe_grouped); loop = transformers' loop over hit experts")
    ap.add_argument("--humming", action=argparse.BooleanOptionalAction, default=True,
                    help="route the M buckets humming-kernels won on this card to it (KernelSettings.humming): a "
                         "second copy of each attention weight it takes; --no-humming keeps qerl's own kernels")
    ap.add_argument("--expert-chunk-mib", type=int, default=None,
                    help="MoE: the grouped path dequantizes as many hit experts at once as fit this many MiB "
                         "(KernelSettings.moe_expert_chunk_mib; default 16 experts a chunk)")
    ap.add_argument("--moe-route", choices=["fused", "counting", "argsort"], default="fused",
                    help="how MoE decode sorts its pairs by expert: one Triton launch (the default, "
                         "KernelSettings.moe_route_fused), the counting sort, or two argsorts")
    ap.add_argument("--embed-4bit", action="store_true",
                    help="the frozen input embedding in NVFP4 (TrainConfig.embed_4bit): 3/4 of its bytes saved")
    ap.add_argument("--humming-storage", action="store_true",
                    help="store NVFP4 in humming-kernels' layout (KernelSettings.humming_storage): one copy of each "
                         "weight, humming at every M, the backward dequantizing from it")
    ap.add_argument("--profile", action="store_true",
                    help="one more, untimed step with its logprob and update phases under torch.profiler (table in the log)")
    ap.add_argument("--sweep-levers", action="store_true", help="the case, then each memory lever changed alone")
    ap.add_argument("--compare", nargs=2, metavar=("A_JSON", "B_JSON"), help="record A's speedup over B")
    ap.add_argument("--metric", default="step_s", help="with --compare: step_s | rollout_s | update_s")
    ap.add_argument("--target", default=None, help='with --compare: target of the speedup, e.g. ">=1.8"')
    a = ap.parse_args(argv)
    rdir = Path(a.results_dir) if a.results_dir else RESULTS
    command = CMD + " " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    if a.compare:
        compare(*a.compare, a.target, a.metric, command, rdir if a.record else None)
        return 0
    main_rank = not int(os.environ.get("RANK", "0"))  # under torchrun: every rank trains, rank 0 reports
    show = report if main_rank else (lambda *x, **k: None)
    if not main_rank:
        a.json, a.record = None, False
    if not a.sweep_levers:
        res = run_case(a)
        show(res)
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(res, indent=1))
        if a.record:
            record_case(res, command, rdir, a.peak_target)
        return 0 if res["fits"] else 3
    # one policy, the case's settings and then each lever changed alone
    pol, build_s = build_policy(a)
    results = []
    for name, change in [("as given", {})] + list(LEVERS.items()):
        v = argparse.Namespace(**{**vars(a), **change})
        res = run_case(v, pol, build_s)
        res["lever"] = name
        show(res)
        results.append(res)
        if a.record:
            record_case(res, command, rdir)
    show_table = print if main_rank else (lambda *x: None)
    show_table(lever_table(results))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


def lever_table(results: list[dict]) -> str:
    rows = ["| lever | fits | step s | rollout s | update s | KV slots | peak allocated GiB (rollout / update) |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        if not r["fits"]:
            rows.append(f"| {r['lever']} | no ({r['oom_phase']}) | | | | | |")
            continue
        pk = (f"{r['peak_allocated_gib']:.2f} ({r['rollout_peak_gib']:.2f} / {r['update_peak_gib']:.2f})"
              if "peak_allocated_gib" in r else "")
        rows.append(f"| {r['lever']} | yes | {r['step_s']:.2f} | {r['rollout_s']:.2f} | {r['update_s']:.2f} "
                    f"| {r['kv_slots']} | {pk} |")
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())

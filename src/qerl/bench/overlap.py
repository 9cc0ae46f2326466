"""Can one GPU run decode and the update at once? (issue 32 §3; the argument: benchmarks/overlap.md)

    python -m qerl.bench.overlap [--shape qwen2.5-7b] [--batch 64] [--new-tokens 256] [--json F] [--record]

Random weights at the shape (NVFP4, LoRA r32), the engine on an adapter snapshot (rl/adapter_snapshot.py:
the 4-bit base shared, the adapter its own, as under max_staleness 1). Two workloads:
  decode  a rollout of `batch` prompts x `new` tokens, EOS ignored: the batch stays at `batch`, so the
          engine replays the decode CUDA graph of that bucket every step (prefill is a few percent)
  update  `micro` forward + backward passes of one packed micro-batch (`micro-batch` completions of
          `prompt-len` + `completion-len` tokens, gradient checkpointing on, as the trainer runs it)
each timed alone, then the two in series, then together in these ways:
  threads        decode on a worker thread and its own stream, the update on the main stream
  threads-prio   the same with the decode stream at high priority (its kernels dispatch first)
  green-N        the update on a green context of N SMs (torch.cuda.green_contexts; where supported)
  one-thread     one thread: `micro` x the decode's steps of bare graph replays queued on a side
                 stream (no host syncs, no sampling bookkeeping), then the update on the main stream
It prints each time, the overlap speedup (series / together) and the ideal (series / max(decode,
update)); --record appends them to benchmarks/results/overlap.jsonl. On the CPU only `threads` runs
(two threads over two cores: a smoke run, not the question).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch

from .record import RESULTS, record

CMD = "python -m qerl.bench.overlap"


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build(a):
    """(policy, snapshot, engine, update micro-batch, decode prompts) at the shape."""
    from ..completion import Completion
    from ..rl.adapter_snapshot import AdapterSnapshot
    from ..train.batch import RolloutBatch, micro_batches
    from ..train.packing import FLEX, attention_kind, packed_micro_batches, use_flex_attention
    from ..rollout import Engine
    from .step import build_policy

    pol, _ = build_policy(a)
    dev = torch.device(a.device)
    model = pol.model
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(a.seed)
    with torch.no_grad():  # an adapter that acts (B = 0 would make the LoRA terms trivially zero)
        for p in params:
            if p.dim() == 2 and p.shape[1] == a.lora_rank:
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 1e-3)
    snap = AdapterSnapshot(model, params)
    eng = Engine(snap.model, pol.tokenizer, max_len=a.prompt_len + a.new_tokens + 1, max_slots=a.batch,
                 kv_cache_gb=None if dev.type == "cuda" else 0.5)
    vocab = model.config.vocab_size
    prompts = [torch.randint(3, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.batch)]
    # the update's micro-batch: one group's prompt, `micro_batch` completions of completion_len tokens
    prompt = torch.randint(3, vocab, (a.prompt_len,), generator=g).tolist()
    comps = [Completion(0, j, prompt, torch.randint(3, vocab, (a.completion_len,), generator=g).tolist(),
                        [-1.0] * a.completion_len, "length") for j in range(a.micro_batch)]
    batch = RolloutBatch(comps, torch.randn(len(comps), generator=g), torch.zeros(len(comps), dtype=torch.bool))
    if dev.type == "cuda" and use_flex_attention(model):
        mb = packed_micro_batches(batch, a.micro_batch, 0, dev, FLEX, model.dtype)[0]
    elif attention_kind(model):
        mb = packed_micro_batches(batch, a.micro_batch, 0, dev, attention_kind(model), model.dtype)[0]
    else:
        mb = micro_batches(batch, a.micro_batch, 0, dev)[0]
    kw = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    return pol, snap, eng, mb, prompts


def decode_work(eng, prompts, new: int):
    """The rollout at batch len(prompts): returns its new tokens."""
    from ..rollout import SamplingParams

    p = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True, seed=0)
    out = eng.generate(prompts, n=1, params=p)
    return out.stats.new_tokens


def update_work(model, mb, passes: int) -> None:
    """`passes` forward + backward passes of the packed micro-batch (gradients accumulate; no optimizer
    step, so every pass costs the same)."""
    from ..layers import unfused_lora
    from ..train.logprobs import completion_logprobs

    model.train()
    for _ in range(passes):
        with torch.enable_grad(), unfused_lora():
            lp, _ = completion_logprobs(model, **mb.model_inputs(), temperature=1.0, chunk=1024)
            mask = mb.mask.to(lp.device)
            (-(lp * mask).sum() / mask.sum()).backward()
    model.eval()


def _timed(fn, dev) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t0


def together(dev, decode, update, stream_priority: int | None = None, update_ctx=None) -> dict:
    """decode on a worker thread (its own stream on a GPU) while `update` runs here: wall seconds and
    each side's own seconds."""
    times = {}
    side = torch.cuda.Stream(dev, priority=stream_priority or 0) if dev.type == "cuda" else None

    def work():
        t0 = time.perf_counter()
        if side is not None:
            with torch.cuda.stream(side):
                decode()
            side.synchronize()
        else:
            decode()
        times["decode_s"] = time.perf_counter() - t0

    _sync(dev)
    t0 = time.perf_counter()
    th = threading.Thread(target=work, name="qerl-overlap-decode")
    th.start()
    t1 = time.perf_counter()
    if update_ctx is not None:
        with update_ctx():
            update()
    else:
        update()
    _sync(dev)
    times["update_s"] = time.perf_counter() - t1
    th.join()
    _sync(dev)
    times["wall_s"] = time.perf_counter() - t0
    return times


def one_thread(dev, eng, update, replays: int, bucket: int, keys: int) -> dict:
    """Bare decode-graph replays queued on a side stream first, then the update on the main stream,
    all from this thread (a GPU only)."""
    from ..rollout import SamplingParams

    p = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, seed=0)
    eng.warmup([bucket], p, max_len=keys)  # the graphs exist; no slot is active: state untouched
    side = torch.cuda.Stream(dev)
    _sync(dev)
    t0 = time.perf_counter()
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(replays):
            eng.runner.step(bucket, keys, p)
    update()
    torch.cuda.current_stream(dev).wait_stream(side)
    _sync(dev)
    wall = time.perf_counter() - t0
    t_dec = _timed(lambda: [eng.runner.step(bucket, keys, p) for _ in range(replays)], dev)
    return {"wall_s": wall, "decode_alone_s": t_dec}


def run(a, log=print) -> dict:
    dev = torch.device(a.device)
    pol, snap, eng, mb, prompts = build(a)
    model = pol.model

    def decode():
        return decode_work(eng, prompts, a.new_tokens)

    def update():
        update_work(model, mb, a.micro)

    # warm-up: kernels compile, graphs are captured, the update's masks and kernels at this length
    decode_work(eng, prompts, min(16, a.new_tokens))
    update_work(model, mb, 1)
    res = {"shape": a.shape, "quant": a.quant, "batch": a.batch, "new_tokens": a.new_tokens,
           "micro_batch": a.micro_batch, "update_tokens": a.micro_batch * (a.prompt_len + a.completion_len),
           "update_passes": a.micro, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "snapshot_mib": snap.nbytes() / 2**20}
    res["decode_s"] = _timed(decode, dev)
    res["update_s"] = _timed(update, dev)
    res["series_s"] = _timed(lambda: (decode(), update()), dev)
    res["ideal_speedup"] = res["series_s"] / max(res["decode_s"], res["update_s"])
    log(f"decode {res['decode_s']:.3f} s ({a.batch} x {a.new_tokens} tokens), update {res['update_s']:.3f} s "
        f"({a.micro} x fwd+bwd of {res['update_tokens']} tokens), series {res['series_s']:.3f} s, "
        f"ideal overlap {res['ideal_speedup']:.2f}x")
    modes = {"threads": {}}
    if dev.type == "cuda":
        lo, hi = torch.cuda.Stream.priority_range()
        modes["threads-prio"] = {"stream_priority": hi}
        from torch.cuda import green_contexts

        if green_contexts.SUPPORTED:
            n_sm = torch.cuda.get_device_properties(dev).multi_processor_count
            for frac in a.green_fractions:
                modes[f"green-{int(n_sm * frac)}"] = {"green_sms": int(n_sm * frac)}
    res["modes"] = {}
    for name, opt in modes.items():
        ctx = None
        if "green_sms" in opt:
            ctx = _green(dev, opt["green_sms"])
            if ctx is None:
                res["modes"][name] = {"error": "green context could not be created"}
                continue
        try:
            t = together(dev, decode, update, opt.get("stream_priority"), ctx)
        except RuntimeError as e:  # an API this build or driver lacks: a result, not a crash
            res["modes"][name] = {"error": str(e).splitlines()[0][:300]}
            continue
        t["speedup"] = res["series_s"] / t["wall_s"]
        res["modes"][name] = t
        log(f"{name}: together {t['wall_s']:.3f} s (decode {t['decode_s']:.3f}, update {t['update_s']:.3f}) "
            f"-> {t['speedup']:.2f}x over series")
    if dev.type == "cuda":
        steps = a.new_tokens
        t = one_thread(dev, eng, update, steps, min(a.batch, eng.n_slots), a.prompt_len + a.new_tokens)
        t["speedup"] = (t["decode_alone_s"] + res["update_s"]) / t["wall_s"]
        res["modes"]["one-thread"] = t
        log(f"one-thread: {steps} bare replays + update {t['wall_s']:.3f} s (replays alone {t['decode_alone_s']:.3f})"
            f" -> {t['speedup']:.2f}x over series")
    return res


def _green(dev, n_sms: int):
    """A context manager running its block on a green context of n_sms SMs, or None."""
    import contextlib

    from torch.cuda.green_contexts import GreenContext

    try:
        gc = GreenContext.create(num_sms=n_sms, device_id=dev.index or 0)
    except RuntimeError:
        return None

    @contextlib.contextmanager
    def ctx():
        gc.set_context()
        try:
            with torch.cuda.stream(gc.Stream()):
                yield
        finally:
            gc.pop_context()
    return ctx


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="qerl bench overlap", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--layers", type=int, default=None, help="fewer decoder layers (smoke runs)")
    ap.add_argument("--quant", default="nvfp4")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64, help="decode batch (the CUDA-graph bucket)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256, help="decode steps")
    ap.add_argument("--micro-batch", type=int, default=8, help="completions in the update's micro-batch")
    ap.add_argument("--completion-len", type=int, default=819, help="tokens a completion (40 %% of 2048: varied)")
    ap.add_argument("--micro", type=int, default=4, help="forward + backward passes of the micro-batch")
    ap.add_argument("--green-fractions", type=float, nargs="*", default=[0.5, 0.75],
                    help="SM shares of the update's green context")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    ap.add_argument("--record", action="store_true", help="append to benchmarks/results/overlap.jsonl")
    ap.add_argument("--results-dir", default=None)
    a = ap.parse_args(argv)
    res = run(a)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))
    if a.record:
        rdir = Path(a.results_dir) if a.results_dir else RESULTS
        case = (f"{a.shape}{f' {a.layers}L' if a.layers else ''} {a.quant} decode b{a.batch} x{a.new_tokens} "
                f"vs update {a.micro}x fwd+bwd {res['update_tokens']} tok")
        cmd = CMD + " " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
        for k in ("decode_s", "update_s", "series_s"):
            record("overlap", case, k.replace("_s", "_time"), res[k], "s", command=cmd, results_dir=rdir)
        record("overlap", case, "ideal_speedup", res["ideal_speedup"], "x", command=cmd, results_dir=rdir)
        for name, t in res["modes"].items():
            if "speedup" in t:
                record("overlap", f"{case} {name}", "speedup_over_series", t["speedup"], "x", ">1.0", command=cmd,
                       results_dir=rdir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

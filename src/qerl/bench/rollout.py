"""Rollout throughput: our engine (NVFP4 and bf16 LoRA policies) against Hugging Face generate.

    python -m qerl.bench.rollout [--record] [--model qwen2.5-7b] [--batches 1,8,32,128]

Random weights at the model's real shapes, LoRA rank 32 on every linear, prompts of
256 random tokens, 1024 new tokens with EOS ignored. Prints tokens/s, peak memory
and the fraction of the decode roofline (weight + KV bytes per step over the copy
bandwidth measured in the same run). Hugging Face baselines (batch 1 and 8): bf16 +
PEFT LoRA (what TRL does without vLLM) and a static cache, compiled, without LoRA.

    python -m qerl.bench.rollout --multiturn [--batches 8,64 --new-tokens 512]

instead times multi-turn rollouts (NVFP4 + LoRA r32, a character tokenizer of vocabulary 160 so stop strings are
scanned on real decoded text): `single` (no turn handler), `idle` (a handler whose call marker never appears: the
text scan alone) and `active` (a handler stopping on a character random text hits every ~160 tokens, answering
with 16 tokens in the same slot, up to 4 turns a sample). Model tokens/s; targets idle >= 0.95x single, active
>= 0.8x single at batch 64.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

from ..model import qwen25_config, random_policy
from ..rollout import Engine, SamplingParams
from .record import RESULTS, record, tee_log

CMD = "python -m qerl.bench.rollout"
# issue 47's targets at 7B (LoRA r32)
TARGETS = {("nvfp4", 1, "tokens_per_s"): ">=450", ("nvfp4", 64, "tokens_per_s"): ">=12000"}
RATIO_TARGETS = {1: ">=2.2", 8: ">=2.0", 64: ">=1.5", 128: ">=1.25", 256: ">=1.1"}


def _bytes(model) -> int:
    """Bytes a decode step reads for weights: every parameter and buffer except the embedding table."""
    emb = model.model.embed_tokens.weight
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t is emb or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    if model.lm_head.weight is emb:
        total += emb.numel() * emb.element_size()
    return total


def _engine_case(pol, batches, prompt_len, new, log, bw, cfg, kv_dtype="auto", fused=None, keep=False, ks=None):
    el = 1 if kv_dtype == "fp8" else 2
    view_kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * el
    wbytes = _bytes(pol.model)
    out = {}
    g = torch.Generator().manual_seed(0)
    eng = Engine(pol.model, max_len=prompt_len + new + 1, max_slots=max(batches), kv_cache_gb=None,
                 kv_cache_dtype=kv_dtype, fused_attention=fused, kernel_settings=ks)
    p = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True, seed=0)
    warm = SamplingParams(max_new_tokens=32, temperature=1.0, ignore_eos=True, seed=0)
    t0 = time.perf_counter()
    n_graphs = eng.warmup(batches, p)
    log(f"  captured {n_graphs} decode graphs in {time.perf_counter() - t0:.1f} s")
    for b in batches:
        prompts = torch.randint(0, cfg.vocab_size, (b, prompt_len), generator=g).tolist()
        eng.generate(prompts, params=warm)  # kernels compile; graphs for the short buckets
        torch.cuda.reset_peak_memory_stats()
        comps = eng.generate(prompts, params=p)
        s = comps.stats
        decode_s = s.seconds - s.prefill_seconds
        tps = s.new_tokens / s.seconds
        dtps = (s.new_tokens - b) / decode_s
        step_bytes = wbytes + b * (prompt_len + new / 2) * view_kv
        roof = b / (step_bytes / bw)
        out[b] = dict(tokens_per_s=tps, decode_tokens_per_s=dtps, roofline_fraction=dtps / roof,
                      roofline_tokens_per_s=roof, peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                      graphs=s.graphs_captured, seconds=s.seconds, prefill_s=s.prefill_seconds)
        if keep:
            out[b]["completions"] = comps
        log(f"  batch {b:4d}: {tps:8.1f} tok/s ({dtps:8.1f} decode, {100 * dtps / roof:5.1f}% of the {roof:7.0f} "
            f"tok/s roofline), prefill {s.prefill_seconds:.2f} s, peak {out[b]['peak_gib']:.1f} GiB")
        by_keys: dict = {}
        for bb, keys, ms in s.chunks:
            by_keys.setdefault((bb, keys), []).append(ms)
        log("    ms/step by (batch bucket, keys): " + ", ".join(
            f"{bb}/{k}: {sum(v) / len(v):.2f}" for (bb, k), v in sorted(by_keys.items())))
    del eng
    return out


def _mismatch(pol, completions, n: int = 4) -> tuple[float, float]:
    """Mean and max |engine logprob - trainer logprob| per token over n completions (the trainer's
    teacher-forced forward: dequantize + cuBLAS, the same weights)."""
    from ..train.logprobs import completion_logprobs, pad_batch

    d = []
    with torch.no_grad():
        for c in completions[:n]:
            ids, att, pos, tg, mask = pad_batch([c.prompt_ids], [c.token_ids])
            lp, _ = completion_logprobs(pol.model, ids, att, pos, tg, mask, entropy=False)
            d.append((lp[0, : len(c.token_ids)].cpu() - torch.tensor(c.logprobs)).abs())
    d = torch.cat(d)
    return float(d.mean()), float(d.max())


def kv_compare(cfg, model_name, batch, prompt_len, new, log, bw, rec):
    """The FP8 KV cache against bf16 K/V on the NVFP4 policy: throughput and logprob mismatch."""
    pol = random_policy(cfg, "nvfp4", lora_rank=32, device="cuda", progress=False)
    res = {}
    for kv in ("auto", "fp8"):
        log(f"engine nvfp4, KV cache {kv} (batch {batch}, {new} new)")
        r = _engine_case(pol, [batch], prompt_len, new, log, bw, cfg, kv_dtype=kv, keep=True)[batch]
        mean, mx = _mismatch(pol, r.pop("completions"))
        log(f"  logprob |engine - trainer| mean {mean:.4f} max {mx:.4f}")
        res[kv] = dict(r, mismatch_mean=mean, mismatch_max=mx)
        case = f"{model_name} engine nvfp4 lora32 kv={kv} batch={batch} new={new}"
        rec(case, "tokens_per_s", r["tokens_per_s"], "tok/s")
        rec(case, "logprob_mismatch_mean", mean, "nats")
        rec(case, "logprob_mismatch_max", mx, "nats")
    v = res["fp8"]["tokens_per_s"] / res["auto"]["tokens_per_s"]
    log(f"fp8 KV / bf16 KV: {v:.2f}x")
    rec(f"{model_name} engine nvfp4 batch={batch} new={new}", "fp8_kv_over_bf16_kv", v, "x", ">=1.3")
    return res


def _hf_case(cfg, batches, prompt_len, new, peft: bool, log):
    from transformers import AutoModelForCausalLM

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    if peft:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=32, lora_alpha=64, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], lora_dropout=0.0))
        model.eval()
    kw = dict(do_sample=True, temperature=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    if not peft:
        kw["cache_implementation"] = "static"  # transformers compiles the decode step for a static cache
    g = torch.Generator().manual_seed(1)
    out = {}
    for b in batches:
        x = torch.randint(0, cfg.vocab_size, (b, prompt_len), generator=g).cuda()
        with torch.no_grad():
            model.generate(x, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up / compile
            if not peft:
                model.generate(x, **{**kw, "max_new_tokens": 16, "min_new_tokens": 16})
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(x, **kw)
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        out[b] = dict(tokens_per_s=b * new / dt)
        log(f"  batch {b:4d}: {b * new / dt:8.1f} tok/s ({new} new tokens)")
    del model
    return out


class _Turns:
    """A tool-turn handler answering every stop with the same tokens (no state: calls may run on worker threads)."""
    concurrent = True

    def __init__(self, stop: str, reply: list[int], max_turns: int = 4):
        self.stop, self.reply, self.max_turns = [stop], reply, max_turns

    def respond(self, prompt_index, sample_index, token_ids, text):
        return list(self.reply)


def multiturn(model: str, layers, batches: list[int], prompt_len: int, new: int, log, rec, repeats: int = 2) -> dict:
    """Model tokens/s of single-turn, idle and active multi-turn rollouts per batch (the module's docstring)."""
    from .synthetic import char_tokenizer

    tok = char_tokenizer()
    cfg = qwen25_config(model, layers)
    cfg.vocab_size, cfg.eos_token_id = 160, 1
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a smoke run of the tiny shape
    pol = random_policy(cfg, "nvfp4", lora_rank=32, device=dev, progress=False)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    eng = Engine(pol.model, tok, max_len=prompt_len + new + 1, max_slots=max(batches),
                 kv_cache_gb=None if dev == "cuda" else 1.0)
    p = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True, seed=0)
    eng.warmup(batches, p)
    reply = tok("[tool output: 42]", add_special_tokens=False)["input_ids"][:16]
    g = torch.Generator().manual_seed(0)
    res = {}
    for b in batches:
        prompts = torch.randint(3, 98, (b, prompt_len), generator=g).tolist()  # printable characters
        v = res[b] = {}
        for mode in ("single", "idle", "active"):
            best, info = 0.0, ""
            for _ in range(repeats):
                h = None if mode == "single" else _Turns("</tool_call>" if mode == "idle" else "@", reply)
                sync()
                t0 = time.perf_counter()
                outs = eng.generate(prompts, params=p, turns=h)
                sync()
                dt = time.perf_counter() - t0
                model_tokens = sum(sum(c.model_token_mask()) for c in outs)
                if model_tokens / dt > best:
                    turns = sum(len(c.tool_spans) for c in outs)
                    best = model_tokens / dt
                    info = f"{turns / b:.2f} tool turns/sample, {model_tokens} model tokens, {dt:.2f} s"
            v[mode] = best
            log(f"batch {b:3d} {mode:6s}: {best:8.1f} model tok/s  ({info})")
        case = f"{model} nvfp4 multi-turn batch {b} prompt {prompt_len} new {new}"
        for mode in ("single", "idle", "active"):
            rec(case, f"{mode}_model_tokens_per_s", v[mode], "tok/s")
        rec(case, "idle_over_single", v["idle"] / v["single"], "x", ">=0.95")
        rec(case, "active_over_single", v["active"] / v["single"], "x", ">=0.8" if b == 64 else None)
    log("batch  idle/single  active/single")
    for b, v in res.items():
        log(f"{b:5d}  {v['idle'] / v['single']:11.3f}  {v['active'] / v['single']:13.3f}")
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(prog="qerl bench rollout", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--layers", type=int, default=None, help="fewer decoder layers (smoke runs)")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--hf-new-tokens", type=int, default=64, help="HF baselines are slow: fewer tokens, same rate")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--ratio-targets", default=None, help='targets of NVFP4/bf16 per batch, e.g. "8:>=2.5"')
    ap.add_argument("--kv-compare", default=None, metavar="BATCH:NEW",
                    help="instead: FP8 vs bf16 KV cache at this batch and length (e.g. 64:4096)")
    ap.add_argument("--multiturn", action="store_true",
                    help="instead: multi-turn rollouts (single, idle and active tool turns) at --batches")
    ap.add_argument("--fused-attention", choices=("auto", "on", "off"), default="auto",
                    help="the fused rotary+KV write and split-KV attention (off: the torch decode path)")
    ap.add_argument("--quants", default="nvfp4,bf16",
                    help="policies to time: nvfp4 (the routed kernels), nvfp4_own (humming-kernels off: qerl's own "
                         "kernels alone, the baseline of the routing), nvfp4_head4 (nvfp4 with the lm_head in NVFP4 too; "
                         "after the other nvfp4 entries), nvfp4_one (NVFP4 stored in humming's layout: one copy, humming at every M; "
                         "KernelSettings.humming_storage), a _streamk suffix (nvfp4_streamk, nvfp4_one_streamk: humming "
                         "in its stream-K default, KernelSettings.humming_deterministic off), bf16")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--results-dir", "--results_dir", default=None)
    ap.add_argument("--out", default="runs/bench_rollout")
    a = ap.parse_args(argv)
    from .kernels import copy_bandwidth

    out = Path(a.out)
    log = tee_log(out / "bench_rollout.log")

    rdir = Path(a.results_dir) if a.results_dir else RESULTS
    cmd = " ".join([CMD] + list(argv if argv is not None else sys.argv[1:]))  # the exact command, in each row
    rec = (lambda *x, **k: record("rollout", *x, command=cmd, results_dir=rdir, **k)) if a.record else (lambda *x, **k: None)
    batches = [int(b) for b in a.batches.split(",")]
    if a.multiturn:
        res = multiturn(a.model, a.layers, batches, a.prompt_len, a.new_tokens, log, rec)
        (out / "bench_rollout_multiturn.json").write_text(json.dumps(res, indent=1))
        return
    bw = copy_bandwidth()
    log(f"{torch.cuda.get_device_name(0)}: copy bandwidth {bw / 1e12:.3f} TB/s")
    cfg = qwen25_config(a.model, a.layers)
    ratio_targets = dict(RATIO_TARGETS)  # at 7B; --ratio-targets replaces them
    if a.ratio_targets:
        ratio_targets = {int(k): t for k, t in (x.split(":", 1) for x in a.ratio_targets.split(","))}
    res = {"copy_bw": bw}
    if a.kv_compare:
        b, n = (int(x) for x in a.kv_compare.split(":"))
        res["kv"] = kv_compare(cfg, a.model, b, a.prompt_len, n, log, bw, rec)
        (out / "bench_rollout_kv.json").write_text(json.dumps(res, indent=1, default=str))
        return
    fused = {"auto": None, "on": True, "off": False}[a.fused_attention]
    from ..kernels import settings
    from ..kernels.settings import KernelSettings

    pol, pol_quant = None, None
    for quant in a.quants.split(","):
        log(f"engine, {quant} base + LoRA r32 ({a.model}, prompt {a.prompt_len}, {a.new_tokens} new tokens)")
        base = "nvfp4" if quant.startswith("nvfp4") else quant
        one = quant.startswith("nvfp4_one")
        key = "nvfp4_one" if one else base
        if pol_quant != key:  # nvfp4, nvfp4_own and nvfp4_streamk share one policy
            pol = None
            gc.collect()
            torch.cuda.empty_cache()
            with settings.use(humming_storage=one):
                pol, pol_quant = random_policy(cfg, base, lora_rank=32, device="cuda", progress=False), key
            if pol.repack_seconds:  # the quantized bytes into the kernels' layout, as a checkpoint load does it
                log(f"  repack into the kernel layout: {pol.repack_seconds:.2f} s")
                rec(f"{a.model} {quant} load", "repack_seconds", pol.repack_seconds, "s")
        if quant == "nvfp4_head4":  # the same policy with its lm_head in NVFP4 too (in place: list it after nvfp4*)
            from ..layers.quant_head import quantize_lm_head

            quantize_lm_head(pol.model)
        ks = (KernelSettings(humming=False) if quant == "nvfp4_own"
              else KernelSettings(humming_deterministic=False) if quant.endswith("_streamk") else None)
        res[quant] = _engine_case(pol, batches, a.prompt_len, a.new_tokens, log, bw, cfg, fused=fused, ks=ks)
        for b, r in res[quant].items():
            case = f"{a.model} engine {quant} lora32 batch={b}" + ("" if fused is None else f" fused_attention={a.fused_attention}")
            rec(case, "tokens_per_s", r["tokens_per_s"], "tok/s",
                TARGETS.get((quant, b, "tokens_per_s")) if a.model == "qwen2.5-7b" else None)  # 7B targets
            rec(case, "roofline_fraction", r["roofline_fraction"], "")
            rec(case, "peak_memory", r["peak_gib"], "GiB")
    pol = None
    gc.collect()
    torch.cuda.empty_cache()
    for b in batches:
        if "nvfp4_own" in res and "nvfp4" in res:
            v = res["nvfp4"][b]["tokens_per_s"] / res["nvfp4_own"][b]["tokens_per_s"]
            log(f"nvfp4 routed / qerl's own kernels at batch {b}: {v:.2f}x")
            rec(f"{a.model} engine batch={b}", "routed_over_own", v, "x")
        for quant in (q for q in res if q.startswith("nvfp4") and b in res.get("bf16", {})):
            v = res[quant][b]["tokens_per_s"] / res["bf16"][b]["tokens_per_s"]
            log(f"{quant} / bf16 at batch {b}: {v:.2f}x")
            rec(f"{a.model} engine batch={b}", f"{quant}_over_bf16", v, "x", ratio_targets.get(b))
    if not a.skip_hf:
        hb = [b for b in batches if b in (1, 8)]
        for peft, name, tgt in ((True, "hf_generate_peft_bf16", {1: ">=25"}), (False, "hf_static_compiled_bf16",
                                                                               {1: ">=4", 8: ">=4"})):
            log(f"{name} ({a.hf_new_tokens} new tokens)")
            try:
                res[name] = _hf_case(cfg, hb, a.prompt_len, a.hf_new_tokens, peft, log)
            except Exception as e:  # a baseline that cannot run here is reported, not fatal
                log(f"  failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            for b, r in res[name].items():
                rec(f"{a.model} {name} batch={b}", "tokens_per_s", r["tokens_per_s"], "tok/s")
                v = res["nvfp4"][b]["tokens_per_s"] / r["tokens_per_s"]
                log(f"nvfp4 engine / {name} at batch {b}: {v:.1f}x")
                rec(f"{a.model} engine nvfp4 vs {name} batch={b}", "speedup", v, "x", tgt.get(b))
            gc.collect()
            torch.cuda.empty_cache()
    (out / "bench_rollout.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()

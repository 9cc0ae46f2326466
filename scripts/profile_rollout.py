"""Where a decode step's time goes (Qwen2.5-7B shape, LoRA r32, NVFP4 and bf16).

For each format: CUDA-graph decode at batch 1 and 8 with the decode glue eager and compiled
(ms per step), then a profiler pass over eager decode steps: kernels per step, GPU time per step
(the sum of kernel times, i.e. what a graph replay cannot go below) and the top kernels.
Usage: python3 scripts/profile_rollout.py [LAYERS]
"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "src")
from qerl.model import qwen25_config, random_policy  # noqa: E402
from qerl.rollout import Engine, SamplingParams  # noqa: E402

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 28
rows = []
for quant in ("nvfp4", "bf16"):
    pol = random_policy(qwen25_config("qwen2.5-7b", layers), quant, lora_rank=32, device="cuda", progress=False)
    for compiled in (False, True):
        eng = Engine(pol.model, max_len=640, max_slots=8, compile=compiled)
        for b in (1, 8):
            p = SamplingParams(max_new_tokens=256, temperature=1.0, ignore_eos=True, seed=0)
            t = time.perf_counter()
            eng.warmup([b], p)
            warm_s = time.perf_counter() - t
            prompts = [list(range(256))] * b
            eng.generate(prompts, params=p)
            s = eng.generate(prompts, params=p).stats
            ms = 1e3 * (s.seconds - s.prefill_seconds) / s.steps
            rows.append((quant, compiled, b, s.new_tokens / s.seconds, ms, warm_s))
            print(f"{quant} compiled={compiled} batch={b}: {rows[-1][3]:.1f} tok/s, {ms:.3f} ms/step "
                  f"(warm-up {warm_s:.0f} s)", flush=True)
        # profile 16 eager steps at batch 1 (the same kernels a graph replays)
        eng_e = Engine(pol.model, max_len=640, max_slots=8, compile=compiled, cuda_graphs=False)
        q = SamplingParams(max_new_tokens=17, ignore_eos=True)
        eng_e.generate([list(range(256))], params=q)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng_e.generate([list(range(256))], params=q)
            torch.cuda.synchronize()
        ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        steps = eng_e.stats.steps
        pre = eng_e.stats.prefill_seconds
        tot_us = sum(e.device_time for e in ev)
        print(f"  profile ({quant}, compiled={compiled}): {len(ev)} kernels over prefill + {steps} steps, "
              f"~{len(ev) / max(steps, 1):.0f} per step, kernel time {tot_us / 1e3 / max(steps, 1):.3f} ms per step "
              f"(incl. prefill share; prefill {pre * 1e3:.0f} ms wall)")
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=16, max_name_column_width=70))
        del eng, eng_e
    del pol
    torch.cuda.empty_cache()
print("\nquant  compiled batch  tok/s   ms/step  warm-up s")
for r in rows:
    print(f"{r[0]:6s} {str(r[1]):8s} {r[2]:5d} {r[3]:7.1f} {r[4]:8.3f} {r[5]:8.0f}")

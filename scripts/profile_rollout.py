"""Where a decode step's time goes: engine at batch 1 on a few 7B-shaped layers, torch profiler table."""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "src")
from qerl.model import qwen25_config, random_policy  # noqa: E402
from qerl.rollout import Engine, SamplingParams  # noqa: E402

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
for quant in ("nvfp4", "bf16"):
    pol = random_policy(qwen25_config("qwen2.5-7b", layers), quant, lora_rank=32, device="cuda", progress=False)
    for graphs in (True, False):
        eng = Engine(pol.model, max_len=512, max_slots=8, cuda_graphs=graphs)
        p = SamplingParams(max_new_tokens=256, temperature=1.0, ignore_eos=True, seed=0)
        eng.warmup([1], p)
        eng.generate([list(range(256))], params=p)
        t = time.perf_counter()
        eng.generate([list(range(256))], params=p)
        s = eng.stats
        print(f"{quant} graphs={graphs} layers={layers}: {s.new_tokens / s.seconds:.1f} tok/s, "
              f"{1e3 * (s.seconds - s.prefill_seconds) / s.steps:.3f} ms/step, graphs {len(eng._graphs)}", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng = Engine(pol.model, max_len=512, max_slots=8, cuda_graphs=False)
        eng.generate([list(range(256))], params=SamplingParams(max_new_tokens=32, ignore_eos=True))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    del pol, eng
    torch.cuda.empty_cache()

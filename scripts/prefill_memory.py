"""Peak GPU memory and time of prefilling one 8k-token prompt, chunked vs in one pass (issue 20, item 5).

7B shape, NVFP4 + LoRA r32, random weights. Peak is measured above the memory held before the
prefill (weights, KV cache). Usage: python3 scripts/prefill_memory.py [--tokens 8192] [--record]
"""
import argparse
import sys
import time

import torch

sys.path.insert(0, "src")
from qerl.bench.record import RESULTS, record  # noqa: E402
from qerl.model import qwen25_config, random_policy  # noqa: E402
from qerl.rollout import Engine, SamplingParams  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=8192)
ap.add_argument("--record", action="store_true")
ap.add_argument("--results-dir", default=None)
a = ap.parse_args()
pol = random_policy(qwen25_config("qwen2.5-7b"), "nvfp4", lora_rank=32, device="cuda", progress=False)
prompt = torch.randint(0, 150000, (a.tokens,)).tolist()
p = SamplingParams(max_new_tokens=2, ignore_eos=True, seed=0)
rows = []
for chunk in (2048, 1 << 30):
    eng = Engine(pol.model, max_len=a.tokens + 8, max_slots=1, kv_cache_gb=4.0, prefill_chunk_tokens=chunk,
                 cuda_graphs=False)
    eng.generate([prompt[:512]], params=p)  # warm-up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    eng.generate([prompt], params=p)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    name = "chunked 2048" if chunk == 2048 else "one pass"
    print(f"prefill {a.tokens} tokens, {name}: +{peak:.2f} GiB above the resident {base / 2**30:.1f} GiB, {dt:.2f} s",
          flush=True)
    rows.append((name, peak, dt))
    del eng
    torch.cuda.empty_cache()
if a.record:
    rd = RESULTS if a.results_dir is None else __import__("pathlib").Path(a.results_dir)
    cmd = "python3 scripts/prefill_memory.py " + " ".join(sys.argv[1:])
    for name, peak, dt in rows:
        case = f"qwen2.5-7b engine nvfp4 lora32 prefill {a.tokens} tokens {name}"
        record("rollout", case, "peak_memory_above_resident", peak, "GiB", command=cmd, results_dir=rd)
        record("rollout", case, "seconds", dt, "s", command=cmd, results_dir=rd)

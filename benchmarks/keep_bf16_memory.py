"""Weight memory of SmolLM2-135M in NVFP4 (+ LoRA r32), all linears quantized vs the last ~15 % of
decoder layers kept in bf16 with modules_to_not_convert (issue 33). Records to results/memory.jsonl.

    PYTHONPATH=src python benchmarks/keep_bf16_memory.py [--record]
"""

import sys

import torch

from qerl.bench.record import record, render
from qerl.model import load_policy


def model_bytes(keep) -> tuple[int, int]:
    pol = load_policy("smollm2", "nvfp4", lora_rank=32, dtype=torch.bfloat16, progress=False,
                      modules_to_not_convert=keep)
    seen, total = set(), 0
    for t in list(pol.model.parameters()) + list(pol.model.buffers()):
        if t.data_ptr() not in seen:  # tied embeddings and shared global scales once
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total, pol.model.config.num_hidden_layers


if __name__ == "__main__":
    base, n = model_bytes(None)
    k = round(0.15 * n)
    kept, _ = model_bytes([rf"re:model\.layers\.({'|'.join(str(i) for i in range(n - k, n))})\."])
    print(f"{n} layers, last {k} in bf16: {base / 2**20:.1f} -> {kept / 2**20:.1f} MiB (+{100 * (kept - base) / base:.1f} %)")
    if "--record" in sys.argv:
        cmd = "PYTHONPATH=src python benchmarks/keep_bf16_memory.py --record"
        record("memory", "smollm2-135m nvfp4 lora32", "model_bytes", round(base / 2**20, 2), "MiB", command=cmd)
        record("memory", f"smollm2-135m nvfp4 lora32, last {k}/{n} layers bf16", "model_bytes",
               round(kept / 2**20, 2), "MiB", command=cmd)
        render()

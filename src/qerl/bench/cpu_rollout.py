"""The default run's rollout on the CPU: the engine's folded, packed weights against the plain path.

    python -m qerl.bench.cpu_rollout [--record] [--repeats 3]

SmolLM2-135M-Instruct in NVFP4 with a rank-32 LoRA whose B is random (so the adapter acts), the
default run's dtype and task: its first 4 training prompts x 8 samples, up to 48 new tokens at
T = 1 (seeded), EOS honoured -- one default-run step's rollout. Two cases in one process, alternated:
  plain   the engine before df7c629: dequantized weights cached, the adapter as separate shrink and
          expand GEMMs, plain weights for oneDNN, the host syncing every 16 steps over bucketed batches
  folded  today: adapters folded into the cached weights, weights packed, retirement after every step
Both run inside one weight cache, as the trainer's whole run does, and the adapter changes in
place before every rollout (an optimizer step), so the folded copies are rebuilt each time as in
training. The sampled tokens differ between cases only by rounding (folded adapters round once).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..kernels import dispatch, settings
from .record import record

CMD = "python -m qerl.bench.cpu_rollout"


def _setup():
    from ..model import load_policy
    from ..rl.default_run import default_run_config
    from ..train.parts import resolve_device_dtype
    from ..tasks import get_task
    from ..tasks.prompts import encode_prompt

    cfg = default_run_config("cpu")
    _, dtype = resolve_device_dtype(cfg)
    pol = load_policy(cfg.model_name_or_path, cfg.quant, lora_rank=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                      device="cpu", dtype=dtype, progress=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if n.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    task = get_task(cfg.dataset_name, **cfg.dataset_config)
    prompts = [encode_prompt(pol.tokenizer, r["prompt"], max_length=cfg.max_prompt_length) for r in task.train[:4]]
    return cfg, pol, prompts


def run(repeats: int = 3, log=print) -> dict:
    from ..rollout import Engine, SamplingParams

    cfg, pol, prompts = _setup()
    sp = SamplingParams(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature, seed=0)
    lora_b = [p for n, p in pol.model.named_parameters() if n.endswith("lora_B.weight")]
    cases = {"plain": (False, 16), "folded": (True, None)}
    engines = {k: Engine(pol.model, pol.tokenizer, max_len=cfg.max_prompt_length + cfg.max_completion_length + 1,
                         max_slots=32, sync_every=se) for k, (_, se) in cases.items()}
    times = {k: [] for k in cases}
    tokens = {}
    with dispatch.dequantized_cache():
        for i in range(repeats + 1):  # the first round warms both up and is not counted
            for k, (fold, _) in cases.items():
                with torch.no_grad():
                    for b in lora_b:
                        b.add_(0.0)  # an optimizer step: the adapter's version moves
                with settings.use(fold_and_pack=fold):
                    t0 = time.perf_counter()
                    out = engines[k].generate(prompts, n=cfg.num_generations, params=sp)
                    dt = time.perf_counter() - t0
                tokens[k] = sum(len(c.token_ids) for c in out)
                if i:
                    times[k].append(dt)
                    log(f"  round {i} {k}: {dt:.2f} s, {tokens[k]} new tokens")
    res = {k: {"median_s": statistics.median(v), "best_s": min(v), "new_tokens": tokens[k],
               "tokens_per_s": tokens[k] / statistics.median(v)} for k, v in times.items()}
    # per token: the two paths round differently, so their samples (and lengths) differ a little
    res["speedup"] = res["folded"]["tokens_per_s"] / res["plain"]["tokens_per_s"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="qerl bench cpu_rollout", description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--record", action="store_true")
    a = ap.parse_args(argv)
    res = run(a.repeats)
    case = "smollm2-135m nvfp4 lora32 default-run rollout (4 prompts x 8, 48 new, T=1)"
    for k in ("plain", "folded"):
        r = res[k]
        print(f"{k}: median {r['median_s']:.2f} s (best {r['best_s']:.2f}), {r['new_tokens']} new tokens")
    print(f"folded vs plain, tokens/s: {res['speedup']:.2f}x")
    if a.record:
        cmd = CMD + (" " + " ".join(argv) if argv else "")
        for k in ("plain", "folded"):
            record("cpu_rollout", f"{case} {k}", "rollout_time", round(res[k]["median_s"], 3), "s", command=cmd)
            record("cpu_rollout", f"{case} {k}", "tokens_per_s", round(res[k]["tokens_per_s"], 1), "tok/s",
                   command=cmd)
        record("cpu_rollout", f"{case} folded vs plain", "speedup_tokens_per_s", round(res["speedup"], 3), "x",
               command=cmd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GPU check of packed micro-batches (train/packing.py): bf16 agreement and update time, packed vs padded.

    python scripts/packed_update_gpu.py --out runs/packed_update_gpu.jsonl [--shape qwen2.5-7b] [--layers N]

A random-weight NVFP4 policy in the shape (built as `qerl bench step` builds it) and the trainer's
own update phase (`PolicyUpdate`: logprobs, dapo loss, backward, AdamW), fed synthetic rollouts
(no engine): 8 prompts x G 8, prompt 256 tokens, completions of varied length (uniform, mean ~40 %
of 2048) and all of 2048. Micro-batch 8 (one group), gradient checkpointing, one optimizer update.

1. Agreement, on one group of the varied case: the loss and the LoRA gradients of the packed path
   against the padded path. bf16 noise is measured, not assumed: the padded path once more with
   each completion alone (the same sums, other shapes and kernels). Packed passes when its
   difference is within 3x that noise floor (or under 1e-3). Padded rows run under sdpa (today's
   path), packed rows under FlexAttention (what packed_update picks on the GPU).
2. Time of the update phase (time_logprob + time_update, as the trainer logs them) and its peak
   memory, per case and path, after a warm-up call of each (FlexAttention compiles).

Prints a table; writes one JSON line per measurement to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from qerl.bench.step import build_policy
from qerl.bench.synthetic import random_prompts, synthetic_verifier
from qerl.rl import GRPOConfig, GRPOTrainer
from qerl.train.batch import RolloutBatch
from qerl.rollout import Completion

G, PROMPTS = 8, 8


def synthetic_batch(vocab: int, prompt_len: int, lengths: list[int], seed: int) -> RolloutBatch:
    """PROMPTS groups of G completions of the given lengths (random tokens, rollout logprob -1)."""
    g = torch.Generator().manual_seed(seed)
    comps = []
    for p in range(len(lengths) // G):
        prompt = torch.randint(2, vocab, (prompt_len,), generator=g).tolist()
        for j in range(G):
            n = lengths[p * G + j]
            comps.append(Completion(p, j, prompt, torch.randint(2, vocab, (n,), generator=g).tolist(), [-1.0] * n,
                                    "length" if n == max(lengths) else "eos"))
    return RolloutBatch(comps, torch.randn(len(comps), generator=g), torch.zeros(len(comps), dtype=torch.bool))


def case_lengths(case: str, max_new: int, seed: int) -> list[int]:
    if case == "max":
        return [max_new] * (PROMPTS * G)
    g = torch.Generator().manual_seed(seed + 1)  # uniform on [1, 0.8 max]: mean ~40 % of the limit
    return torch.randint(1, int(0.8 * max_new) + 1, (PROMPTS * G,), generator=g).tolist()


def make_trainer(a, pol) -> GRPOTrainer:
    cfg = GRPOConfig(model_name_or_path=f"random:{a.shape}", quant="nvfp4", lora_r=a.lora_rank,
                     lora_alpha=2.0 * a.lora_rank, device=a.device, max_steps=1, num_generations=G,
                     generation_batch_size=PROMPTS * G, per_device_train_batch_size=G,
                     gradient_accumulation_steps=PROMPTS, max_prompt_length=a.prompt_len,
                     max_completion_length=a.max_new_tokens, gradient_checkpointing=True, loss_type="dapo",
                     dynamic_sampling=False, learning_rate=1e-5, max_grad_norm=0.0, rollout_kv_cache_gb=1.0,
                     parity_check_steps=0, save_steps=10**9, report_to="none", output_dir=a.run_dir, seed=a.seed)
    return GRPOTrainer(cfg, policy=pol, reward_funcs=[synthetic_verifier], progress=False,
                       train_dataset=random_prompts(PROMPTS, a.prompt_len, pol.config.vocab_size, a.seed))


def set_path(tr, packed: bool, micro_batch: int = G) -> None:
    """Packed rows under FlexAttention (what packed_update picks on the GPU), or today's padded
    rows under the model's own sdpa (the trainer would leave them under flex once it has packed)."""
    tr.cfg.packed_update, tr.cfg.per_device_train_batch_size = packed, micro_batch
    if tr.device.type == "cuda":
        tr.model.set_attn_implementation("flex_attention" if packed else "sdpa")


def loss_and_grads(tr, batch, packed: bool, micro_batch: int):
    """One update phase without its optimizer step: (loss, {LoRA name: gradient in fp32})."""
    set_path(tr, packed, micro_batch)
    real_step, grads = tr.optimizer.step, {}
    tr.optimizer.step = lambda *_, **__: grads.update(
        {n: p.grad.float().clone() for n, p in tr.model.named_parameters() if p.grad is not None and ".lora_" in n})
    try:
        m = tr.update(batch, 0.0, 0)
    finally:
        tr.optimizer.step = real_step
    tr.profiler.take()
    return m["loss"], grads


def rel_diff(loss, grads, ref_loss, ref_grads) -> dict:
    num = sum(float((grads[n] - ref_grads[n]).norm() ** 2) for n in ref_grads) ** 0.5
    den = sum(float(ref_grads[n].norm() ** 2) for n in ref_grads) ** 0.5
    worst = max(float((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp(min=1e-30)) for n in ref_grads)
    return {"loss_rel": abs(loss - ref_loss) / max(abs(ref_loss), 1e-30), "grad_rel": num / max(den, 1e-30),
            "grad_rel_worst_tensor": worst}


def agreement(tr, a) -> dict:
    lengths = case_lengths("varied", a.max_new_tokens, a.seed)[:G]
    one = synthetic_batch(tr.model.config.vocab_size, a.prompt_len, lengths, a.seed)
    with torch.no_grad():  # LoRA B starts at zero: give the adapter an effect so every LoRA gradient is live
        g = torch.Generator(device=tr.device).manual_seed(a.seed)
        for n, p in tr.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g, device=tr.device, dtype=torch.float32).mul_(0.02))
    ref = loss_and_grads(tr, one, packed=False, micro_batch=G)
    alone = loss_and_grads(tr, one, packed=False, micro_batch=1)
    packed = loss_and_grads(tr, one, packed=True, micro_batch=G)
    noise, pk = rel_diff(*alone, *ref), rel_diff(*packed, *ref)
    ok = all(pk[k] <= max(3 * noise[k], 1e-3) for k in ("loss_rel", "grad_rel"))
    with torch.no_grad():
        for n, p in tr.model.named_parameters():
            if "lora_B" in n:
                p.zero_()
    return {"check": "agreement", "lengths": lengths, "loss": ref[0], "noise_floor": noise, "packed": pk, "ok": ok}


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _peak_gib(dev) -> float:
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0.0


def timing(tr, a, case: str) -> list[dict]:
    batch = synthetic_batch(tr.model.config.vocab_size, a.prompt_len, case_lengths(case, a.max_new_tokens, a.seed),
                            a.seed)
    new_tokens = sum(len(c.token_ids) for c in batch.completions)
    out = {False: [], True: []}
    tokens = {}
    for rep in range(a.reps + 1):  # rep 0 warms up (FlexAttention and mask compiles, allocator)
        for packed in (False, True):
            set_path(tr, packed)
            mbs = tr.update.micro_batches(batch)
            tokens[packed] = sum(int(b.input_ids.numel()) for b in mbs)
            del mbs
            _sync(tr.device)
            if tr.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(tr.device)
            t0 = time.perf_counter()
            tr.update(batch, 0.0, 0)
            _sync(tr.device)
            wall = time.perf_counter() - t0
            t = tr.profiler.take()
            if rep:
                out[packed].append({"update_s": t.get("time_logprob", 0.0) + t.get("time_update", 0.0), "wall_s": wall,
                                    "peak_gib": _peak_gib(tr.device)})
    rows = []
    for packed in (False, True):
        runs = out[packed]
        rows.append({"check": "timing", "case": case, "path": "packed" if packed else "padded",
                     "update_s": min(r["update_s"] for r in runs), "update_s_all": [r["update_s"] for r in runs],
                     "peak_gib": max(r["peak_gib"] for r in runs), "input_tokens": tokens[packed],
                     "new_tokens": new_tokens, "completions": len(batch)})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON lines go here")
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--layers", type=int, default=None, help="fewer decoder layers (a smoke run)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2, help="timed calls per case and path, after the warm-up")
    ap.add_argument("--cases", default="varied,max")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only smoke-tests the script (--shape tiny)")
    ap.add_argument("--run-dir", default="runs/packed_update_gpu")
    a = ap.parse_args(argv)
    import transformers

    pol, build_s = build_policy(argparse.Namespace(shape=a.shape, layers=a.layers, device=a.device, quant="nvfp4",
                                                   lora_rank=a.lora_rank, seed=a.seed))
    tr = make_trainer(a, pol)
    set_path(tr, True)
    kind = tr.update.packed_kind()
    head = {"check": "setup", "shape": a.shape, "layers": a.layers or pol.config.num_hidden_layers,
            "gpu": torch.cuda.get_device_name(tr.device) if tr.device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "packed_mask": kind,
            "attn_implementation": tr.model.config._attn_implementation, "build_s": build_s}
    print(json.dumps(head), flush=True)
    rows = [head, agreement(tr, a)]
    print(json.dumps(rows[-1]), flush=True)
    for case in a.cases.split(","):
        rows += timing(tr, a, case)
        for r in rows[-2:]:
            print(json.dumps(r), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    ag = rows[1]
    dtype = str(tr.dtype).removeprefix("torch.")
    print(f"\nagreement ({dtype}, one group): packed vs padded loss {ag['packed']['loss_rel']:.2e}, LoRA grads "
          f"{ag['packed']['grad_rel']:.2e} (worst tensor {ag['packed']['grad_rel_worst_tensor']:.2e}); noise floor "
          f"(padded, each completion alone) {ag['noise_floor']['loss_rel']:.2e} / {ag['noise_floor']['grad_rel']:.2e}"
          f" -> {'OK' if ag['ok'] else 'FAIL'}")
    print("\n| case | path | update s | speed-up | input tokens | peak GiB |\n|---|---|---|---|---|---|")
    t = {(r["case"], r["path"]): r for r in rows if r["check"] == "timing"}
    for (case, path), r in t.items():
        sp = t[(case, "padded")]["update_s"] / r["update_s"]
        print(f"| {case} | {path} | {r['update_s']:.2f} | {sp:.2f}x | {r['input_tokens']} | {r['peak_gib']:.1f} |")
    return 0 if ag["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Multi-turn rollouts on the GPU (issue 24): does the tool-turn machinery cost single-turn speed?

Random-weight Qwen2.5-7B shape (NVFP4, LoRA r32) over the tests' character tokenizer (vocab 160,
so stop strings are scanned on real decoded text), prompt 256, 512 new tokens, ignore EOS:
  single   no turn handler (the plain decode loop)
  idle     a tool handler whose call marker never appears: the per-sync text scan only
  active   a handler stopping on a character that random text hits every ~160 tokens, answering
           with 16 tool tokens appended into the same slot, up to 4 turns a sample
Targets: idle within 5 % of single; active >= 0.8x single at batch 64 (issue 35: tool answers of a sync
appended in one forward, tool calls on worker threads while the other samples decode). Tok/s of model
tokens. Writes rows to --results-dir/rollout.jsonl.

    python scripts/multiturn_speed.py --results-dir $OUT/results
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tiny_models.tiny_tokenizer

from qerl.bench.record import record  # noqa: E402
from qerl.model import qwen25_config, random_policy  # noqa: E402
from qerl.rollout import Engine, SamplingParams  # noqa: E402
from tiny_models import tiny_tokenizer  # noqa: E402


class Turns:
    concurrent = True  # respond() keeps no state: the engine may run calls on worker threads

    def __init__(self, stop: str, reply: list[int], max_turns: int = 4):
        self.stop, self.reply, self.max_turns = [stop], reply, max_turns

    def respond(self, prompt_index, sample_index, token_ids, text):
        return list(self.reply)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8,64")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--results-dir", type=Path, default=None)
    ap.add_argument("--model", default="qwen2.5-7b", help="a random_init.QWEN25 shape (tiny: a CPU smoke run)")
    a = ap.parse_args()
    tok = tiny_tokenizer()
    cfg = qwen25_config(a.model)
    cfg.vocab_size, cfg.eos_token_id = 160, 1
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    pol = random_policy(cfg, "nvfp4", lora_rank=32, device=dev, progress=False)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    batches = [int(b) for b in a.batches.split(",")]
    eng = Engine(pol.model, tok, max_len=a.prompt + a.new + 1, max_slots=max(batches),
                 kv_cache_gb=None if dev == "cuda" else 1.0)
    p = SamplingParams(max_new_tokens=a.new, temperature=1.0, ignore_eos=True, seed=0)
    eng.warmup(batches, p)
    reply = tok("[tool output: 42]", add_special_tokens=False)["input_ids"][:16]
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        prompts = torch.randint(3, 98, (b, a.prompt), generator=g).tolist()  # printable characters
        for mode in ("single", "idle", "active"):
            best, info = 0.0, ""
            for _ in range(a.repeats):
                h = None if mode == "single" else Turns("</tool_call>" if mode == "idle" else "@", reply)
                sync()
                t0 = time.perf_counter()
                outs = eng.generate(prompts, params=p, turns=h)
                sync()
                dt = time.perf_counter() - t0
                model_tokens = sum(sum(c.model_token_mask()) for c in outs)
                tps = model_tokens / dt
                if tps > best:
                    turns = sum(len(c.tool_spans) for c in outs)
                    best, info = tps, f"{turns / b:.2f} tool turns/sample, {model_tokens} model tokens, {dt:.2f} s"
            rows.append((b, mode, best))
            print(f"batch {b:3d} {mode:6s}: {best:8.1f} model tok/s  ({info})", flush=True)
    cmd = "python scripts/multiturn_speed.py " + " ".join(sys.argv[1:])
    print("\nbatch  idle/single  active/single")
    for b in batches:
        v = {m: x for bb, m, x in rows if bb == b}
        print(f"{b:5d}  {v['idle'] / v['single']:11.3f}  {v['active'] / v['single']:13.3f}")
        if a.results_dir is not None:
            case = f"{a.model} nvfp4 multi-turn batch {b} prompt {a.prompt} new {a.new}"
            for m in ("single", "idle", "active"):
                record("rollout", case, f"{m}_model_tokens_per_s", v[m], "tok/s", command=cmd, results_dir=a.results_dir)
            record("rollout", case, "idle_over_single", v["idle"] / v["single"], "x", ">=0.95", command=cmd,
                   results_dir=a.results_dir)
            record("rollout", case, "active_over_single", v["active"] / v["single"], "x",
                   ">=0.8" if b == 64 else None, command=cmd, results_dir=a.results_dir)


if __name__ == "__main__":
    main()

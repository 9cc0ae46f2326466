"""A data-parallel training run for tests/test_distributed.py (launched by torchrun, or alone).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dp_worker.py OUT CONFIG_JSON [--die-at S]
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import config, tiny_tokenizer  # noqa: E402

from qerl.model import random_policy  # noqa: E402
from qerl.rl import GRPOConfig, GRPOTrainer  # noqa: E402
from qerl.tasks import get_task  # noqa: E402


def digits(completions, **_):  # a dense reward: random completions differ in it, so groups are informative
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("config", help="GRPOConfig fields as JSON")
    ap.add_argument("--die-at", type=int, default=None, help="rank 1 exits at the start of this step")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--task-rewards", action="store_true", help="the task's 0/1 rewards (all-equal groups happen)")
    a = ap.parse_args()
    torch.manual_seed(0)
    pol = random_policy(config("qwen2"), "nvfp4", lora_rank=8, device="cpu", dtype=torch.float32, std=0.05,
                        progress=False)
    pol.tokenizer = tiny_tokenizer()
    cfg = GRPOConfig(**{"output_dir": a.out, "report_to": "none", "device": "cpu", **json.loads(a.config)})
    tr = GRPOTrainer(cfg, policy=pol, task=get_task("arithmetic", size=40),
                     reward_funcs=None if a.task_rewards else [digits], progress=False)
    if a.resume:
        tr.resume(a.resume)
    if a.die_at is not None and tr.dist.rank == 1:
        step = tr.train_step

        def dying_step():
            if tr.step == a.die_at:
                print(f"rank 1: exiting at step {tr.step}", flush=True)
                os._exit(3)
            return step()

        tr.train_step = dying_step
    tr.train()
    state = {n: p.detach().contiguous() for n, p in tr.model.named_parameters() if p.requires_grad}
    save_file(state, str(Path(a.out) / f"adapter_rank{tr.dist.rank}.safetensors"))
    tr.dist.close()


if __name__ == "__main__":
    main()

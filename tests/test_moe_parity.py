"""The parity gate's MoE part (rl/parity.py (c)): the experts the engine path and the trainer path choose
for the same tokens. A tiny Qwen3-MoE trainer passes with every choice equal; an engine path that feeds
its MLPs other hidden states is stopped by name; and the split of the engine's routing log into prefill
and decode against an independent per-token reconstruction."""

import pytest
import torch

from qerl.layers.routing import RoutingLog
from qerl.rl.parity import MAX_ROUTING_MISMATCH, ParityError, routing_by_token, routing_mismatch_of
from test_moe_families import sevens


def _trainer(tmp_path, **kw):
    from qerl.model import load_policy
    from qerl.rl import GRPOConfig, GRPOTrainer
    from qerl.tasks import get_task
    from test_moe_experts import tiny_moe
    from tiny_models import tiny_tokenizer

    tiny_moe("qwen3_moe").save_pretrained(tmp_path / "base")
    tiny_tokenizer().save_pretrained(tmp_path / "base")
    pol = load_policy(str(tmp_path / "base"), "nvfp4", lora_rank=4, dtype=torch.float32, progress=False)
    cfg = GRPOConfig(max_steps=1, generation_batch_size=8, num_generations=4, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, max_completion_length=8, max_prompt_length=64,
                     learning_rate=1e-2, output_dir=str(tmp_path / "run"), save_steps=10, report_to="none",
                     device="cpu", dynamic_sampling=False, parity_check_steps=1, **kw)
    return GRPOTrainer(cfg, policy=pol, task=get_task("arithmetic", size=16), reward_funcs=[sevens], progress=False)


def test_the_paths_route_alike(tmp_path):
    m = _trainer(tmp_path).train_step()
    assert m["parity_routing_mismatch"] == 0.0  # fp32 on the CPU: the same choices on both paths


def test_an_engine_routing_from_other_hidden_states_is_stopped(tmp_path, monkeypatch):
    from qerl.rollout import forward

    real = forward._mlp
    monkeypatch.setattr(forward, "_mlp", lambda view, ops, mlp, x: real(view, ops, mlp, -x))
    tr = _trainer(tmp_path)
    with pytest.raises(ParityError, match="the MoE routing: .* % of the tokens' expert choices differ"):
        tr.train_step()
    tr.cfg.parity_max_logprob_diff = None  # log only: the figure is in the metrics
    assert tr.train_step()["parity_routing_mismatch"] > MAX_ROUTING_MISMATCH


def test_engine_log_split_and_mismatch_against_per_token_choices():
    """Two prompts (3 and 1 tokens, right-padded to 3), completions of 3 and 2 tokens: the prefill in two
    column chunks (2 + 1 tokens), two decode steps; one choice changed on each path's side."""
    g = torch.Generator().manual_seed(0)
    prompts, comps = [[5, 6, 7], [8]], [[1, 2, 3], [4, 9]]
    k, rows, width, steps = 2, 2, 3, 2
    # per (row, position) choices both paths agree on, position = prompt index then completion index
    want = {(r, t): torch.randperm(6, generator=g)[:k] for r in range(rows) for t in range(5)}
    pre = torch.stack([torch.stack([want[(r, t)] for t in range(width)]) for r in range(rows)])  # [2, 3, k]
    pre[1, 1:] = 99  # padding positions: never compared
    dec = [torch.stack([want[(0, 3 + s)], want[(1, 1 + s)]]) for s in range(steps)]
    engine = RoutingLog({"m": [pre[:, :2].reshape(-1, k), pre[:, 2:].reshape(-1, k), *dec]})
    t_rows = [[want[(0, t)] for t in range(5)], [want[(1, t)] for t in range(3)] + [torch.full((k,), 77)] * 2]
    trainer = RoutingLog({"m": [torch.stack([torch.stack(r) for r in t_rows]).reshape(-1, k)]})
    p, d = routing_by_token(engine, "m", rows, width, steps)
    assert torch.equal(p, pre) and torch.equal(d, torch.stack(dec))
    assert routing_mismatch_of(engine, trainer, prompts, comps) == 0.0  # 5 + 2 tokens compared, all equal
    trainer.calls["m"][0] = trainer.calls["m"][0].clone()
    trainer.calls["m"][0][1] = trainer.calls["m"][0][1].flip(0)  # the same set in another order: equal
    assert routing_mismatch_of(engine, trainer, prompts, comps) == 0.0
    trainer.calls["m"][0][5 + 1] = torch.tensor([40, 41])  # row 1's first completion token, another set
    assert routing_mismatch_of(engine, trainer, prompts, comps) == pytest.approx(1 / 7)

"""The issue-24 options wired through a real (tiny) training run: GSPO, CISPO, top-entropy tokens,
the entropy bonus, closed-loop AQN (logged, steering sigma, resumed exactly) and multi-turn tool
rollouts whose tool tokens stay out of the loss."""

from __future__ import annotations

import math

import pytest
import torch

from qerl.rl.aqn import AdaptiveSigma
from qerl.train.batch import RolloutBatch, micro_batches
from qerl.completion import Completion
from test_trainer import _trainable, _trainer


@pytest.mark.parametrize("opts", [
    {"importance_sampling_level": "sequence", "num_iterations": 2},
    {"loss_type": "cispo", "epsilon_high": 5.0, "num_iterations": 2},
    {"top_entropy_quantile": 0.2},
    {"entropy_coeff": 0.01},
])
def test_two_steps_train_with_each_loss_option(tmp_path, opts):
    tr = _trainer(tmp_path, max_steps=2, dynamic_sampling=False, **opts)
    before = _trainable(tr)
    rows = tr.train()
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    after = _trainable(tr)
    assert any(not torch.equal(before[k], after[k]) for k in before), "the adapter did not move"
    if "top_entropy_quantile" in opts:
        # the policy term trained on about the top fifth of the tokens
        assert all(0.1 < r["entropy_mask_fraction"] < 0.35 for r in rows)


def test_entropy_bonus_changes_the_update(tmp_path):
    """Same rollouts, same seed: a bonus coefficient changes the gradient, so the adapters differ."""
    a = _trainer(tmp_path / "a", max_steps=1, dynamic_sampling=False)
    b = _trainer(tmp_path / "b", max_steps=1, dynamic_sampling=False, entropy_coeff=0.5)
    ra, rb = a.train(), b.train()
    assert ra[0]["reward_mean"] == rb[0]["reward_mean"]  # the rollouts were the same
    pa, pb = _trainable(a), _trainable(b)
    assert any(not torch.allclose(pa[k], pb[k]) for k in pa)


def test_adaptive_aqn_follows_its_controller_and_resumes(tmp_path):
    kw = dict(max_steps=4, aqn_schedule="adaptive", aqn_adaptive_target=50.0, aqn_sigma_start=1e-2,
              aqn_sigma_end=1e-3, save_steps=2, dynamic_sampling=False)
    rows = _trainer(tmp_path / "full", **kw).train()
    # an independent replay of the controller on the logged signals gives the logged sigmas
    ctl = AdaptiveSigma(50.0, "entropy", 1e-3, 1e-2, 1.0)
    for r in rows:
        assert r["sigma"] == pytest.approx(ctl.sigma)
        assert r["aqn_target"] == 50.0 and r["aqn_signal"] == pytest.approx(r["rollout_entropy"])
        assert r["aqn_sigma_effective"] > 0
        ctl.update(r["aqn_signal"])
    # the entropy of a random tiny model is far below the target of 50 nats: sigma stays at its cap
    assert rows[-1]["sigma"] == pytest.approx(1e-2)
    low = _trainer(tmp_path / "low", **{**kw, "aqn_adaptive_target": 0.01}).train()
    assert low[1]["sigma"] == pytest.approx(5e-3) and low[2]["sigma"] == pytest.approx(2.5e-3)  # halves each step
    # a run killed after its step-2 checkpoint resumes the controller's state
    first = _trainer(tmp_path / "cut", **{**kw, "aqn_adaptive_target": 0.01})
    first.train(stop_after=2)
    again = _trainer(tmp_path / "cut", **{**kw, "aqn_adaptive_target": 0.01})
    again.resume()
    rest = again.train()
    assert [r["sigma"] for r in rest] == pytest.approx([r["sigma"] for r in low[2:]])


def test_tool_tokens_are_out_of_the_loss_mask():
    c = Completion(prompt_index=0, sample_index=0, prompt_ids=[5, 6, 7], token_ids=[10, 11, 12, 13, 14, 15],
                   logprobs=[-1.0, -1.0, 0.0, 0.0, -2.0, -2.0], finish_reason="eos", tool_spans=[(2, 4)])
    plain = Completion(prompt_index=1, sample_index=0, prompt_ids=[5], token_ids=[20, 21],
                       logprobs=[-0.5, -0.5], finish_reason="eos")
    batch = RolloutBatch([c, plain], torch.tensor([1.0, -1.0]), torch.tensor([False, False]))
    (mb,) = micro_batches(batch, 2, 0, "cpu")
    assert mb.mask[0].tolist() == [True, True, False, False, True, True]
    assert mb.mask[1].tolist() == [True, True, False, False, False, False]
    # the tool tokens are still in the sequence (context for what follows)
    assert mb.input_ids[0, :9].tolist() == [5, 6, 7, 10, 11, 12, 13, 14, 15]
    assert mb.rollout_logprobs[0].tolist() == [-1.0, -1.0, 0.0, 0.0, -2.0, -2.0]


class _EchoTurns:
    """A multi-turn handler a random model triggers: any completion text containing "a" ends a turn;
    the 'tool' answers with fixed tokens."""
    stop = ["a"]
    max_turns = 1

    def __init__(self, tok):
        self.reply = tok("RESULT", add_special_tokens=False)["input_ids"]
        self.calls = 0

    def respond(self, prompt_index, sample_index, token_ids, text):
        self.calls += 1
        return list(self.reply)


def test_multi_turn_rollouts_train_on_the_model_tokens_only(tmp_path, monkeypatch):
    tr = _trainer(tmp_path, max_steps=1, dynamic_sampling=False, max_completion_length=24)
    handlers = []

    def turns_for(rows):
        handlers.append(_EchoTurns(tr.tok))
        return handlers[-1]

    monkeypatch.setattr(tr, "turns_for", turns_for)
    seen = []
    orig = tr.update.__class__.__call__

    def spy(self, batch, sigma, seed):
        seen.append(batch)
        return orig(self, batch, sigma, seed)

    monkeypatch.setattr(tr.update.__class__, "__call__", spy)
    m = tr.train_step()
    comps = seen[0].completions
    with_tools = [c for c in comps if c.tool_spans]
    assert handlers[0].calls > 0 and with_tools and m["tool_call_rate"] == pytest.approx(
        sum(bool(c.tool_spans) for c in comps) / len(comps))
    for c in with_tools:
        a, b = c.tool_spans[0]
        # the whole reply, or its start when the length limit cut it (the engine keeps room for one model token)
        assert c.token_ids[a:b] == handlers[0].reply[:b - a] and all(x == 0.0 for x in c.logprobs[a:b])
        assert b - a == len(handlers[0].reply) or c.finish_reason == "length"
    mbs = micro_batches(seen[0], 4, 0, "cpu")
    assert sum(int(mb.mask.sum()) for mb in mbs) == sum(sum(c.model_token_mask()) for c in comps)
    assert math.isfinite(m["loss"])


def test_user_tools_are_offered_in_chat_prompts(tmp_path):
    from qerl.tools import calculator

    tr = _trainer(tmp_path, max_steps=1)
    rows = [{"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}]
    from qerl.tools.chat import offer_tools

    out = offer_tools(rows, [calculator])
    assert out[0]["prompt"][0]["role"] == "system" and '"calculator"' in out[0]["prompt"][0]["content"]
    assert offer_tools(out, [calculator]) == out  # already offered: unchanged
    assert rows[0]["prompt"][0]["role"] == "user"  # the caller's rows are not modified
    tr.tools = [calculator]
    h = tr.turns_for(rows)
    assert h.max_turns == tr.cfg.max_turns and h.stop == ["</tool_call>"]
    env = h.env(0, 0)
    assert "4" in env.respond('<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>')[0]["content"]

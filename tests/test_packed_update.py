"""Packed micro-batches (train/packing.py): each group's prompt once, its completions end to end, a
prefix-sharing mask. The layout by hand, then the update's loss and LoRA gradients against the
padded path (fp32 on the CPU, 1e-5 relative) and two training steps with packing on and off."""

from __future__ import annotations

import shutil

import pytest
import torch

from qerl.train import packing
from qerl.train.batch import RolloutBatch, micro_batches
from qerl.train.logprobs import completion_logprobs
from qerl.train.packing import FLEX, PAD, PROMPT, allowed, pack, packed_micro_batches, use_flex_attention
from qerl.completion import Completion
from test_trainer import _trainable, _trainer


def test_layout_prompt_once_positions_restart_and_hidden_index():
    prompts = [[5, 6, 7]] * 3 + [[8, 9]]
    comps = [[10, 11, 12], [13], [14, 15], [16, 17]]
    r = pack(prompts, comps, pad_id=0)
    # group 1: prompt, c0[:-1], c1[:-1] (nothing: length 1), c2[:-1]; group 2 on its own row, padded
    assert r.input_ids.tolist() == [[5, 6, 7, 10, 11, 14], [8, 9, 16, 0, 0, 0]]
    assert r.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3]
    assert r.position_ids[1, :3].tolist() == [0, 1, 2]
    assert r.segment.tolist() == [[PROMPT] * 3 + [0, 0, 2], [PROMPT, PROMPT, 0, PAD, PAD, PAD]]
    # the last prompt token (index 2) predicts the first token of every completion of the group
    assert r.hidden_row.tolist() == [[0, 0, 0], [0, 0, 0], [0, 0, 0], [1, 1, 0]]
    assert r.hidden_index[:, 0].tolist() == [2, 2, 2, 1]
    assert r.hidden_index[0].tolist() == [2, 3, 4] and r.hidden_index[2, :2].tolist() == [2, 5]
    assert r.hidden_index[3, :2].tolist() == [1, 2]
    assert r.targets.tolist() == [[10, 11, 12], [13, 0, 0], [14, 15, 0], [16, 17, 0]]
    assert r.lengths.tolist() == [3, 1, 2, 2]
    # row 0: c2's token (index 5) sees the prompt and itself, not c0's tokens (3, 4)
    a = allowed(r.segment)
    assert a[0, 5].tolist() == [True, True, True, False, False, True]
    assert a[0, 4].tolist() == [True, True, True, True, True, False]
    assert a[0, 1].tolist() == [True, True, False, False, False, False]
    assert a[1, 4].tolist() == [True, True, False, True, True, False]  # padding: prompt and padding only


def test_a_micro_batch_that_cuts_a_group_makes_a_row_on_each_side():
    comps = [Completion(g, j, [3 + g] * (2 + g), [20 + j] * (1 + j), [-1.0] * (1 + j), "eos")
             for g in range(2) for j in range(4)]
    batch = RolloutBatch(comps, torch.arange(8.0), torch.zeros(8, dtype=torch.bool))
    mbs = packed_micro_batches(batch, 6, 0, "cpu", "sdpa")
    assert [m.input_ids.shape[0] for m in mbs] == [2, 1]  # [g0, g1's first half], [g1's second half]
    assert [len(m.advantages) for m in mbs] == [6, 2]
    assert mbs[1].input_ids[0, :3].tolist() == [4, 4, 4]  # the prompt again, once
    assert torch.equal(mbs[1].advantages, torch.tensor([6.0, 7.0]))


def _batch(vocab: int) -> RolloutBatch:
    """3 groups of G=4: different prompt lengths, mixed completion lengths with a completion of
    length 1, and tool output inside one completion (in the sequence, out of the loss)."""
    g = torch.Generator().manual_seed(1)
    prompt_lens, comp_lens = [9, 5, 14], [[5, 1, 9, 3], [12, 7, 2, 1], [6, 11, 4, 8]]
    comps = []
    for p, (P, lens) in enumerate(zip(prompt_lens, comp_lens)):
        prompt = torch.randint(3, vocab, (P,), generator=g).tolist()
        for j, n in enumerate(lens):
            spans = [(4, 7)] if (p, j) == (1, 0) else []
            lp = (-torch.rand(n, generator=g) * 2).tolist()
            for a, b in spans:
                lp[a:b] = [0.0] * (b - a)
            comps.append(Completion(p, j, prompt, torch.randint(3, vocab, (n,), generator=g).tolist(), lp,
                                    "length" if n == 12 else "eos", tool_spans=spans))
    return RolloutBatch(comps, torch.randn(12, generator=g), torch.tensor([c.finish_reason == "length" for c in comps]))


def _update_grads(tr, batch, packed: bool):
    """One call of the update phase; the gradients each optimizer step would apply, and the metrics."""
    tr.cfg.packed_update = packed
    grads = []

    def record():
        grads.append({n: p.grad.detach().clone() for n, p in tr.model.named_parameters() if p.grad is not None})

    tr.optimizer.step = record  # the adapter stays where it is: both paths see the same weights
    return tr.update(batch, 0.0, 0), grads


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("opts", [
    {"loss_type": "dapo"},
    {"loss_type": "grpo", "mask_truncated_completions": True},
    {"loss_type": "dr_grpo"},
    {"loss_type": "dapo", "beta": 0.05, "num_iterations": 2, "importance_sampling_correction": True},
    {"loss_type": "dapo", "max_row": 20},  # groups cut into several rows, each with the prompt again
])
def test_packed_update_gives_the_loss_and_lora_gradients_of_padded_rows(tmp_path, monkeypatch, opts):
    opts = dict(opts)
    if "max_row" in opts:
        monkeypatch.setattr(packing, "DENSE_MAX_ROW", opts.pop("max_row"))
    # 12 completions, micro-batches of 6: the middle group is cut between the two micro-batches
    tr = _trainer(tmp_path, generation_batch_size=12, per_device_train_batch_size=6, gradient_accumulation_steps=2,
                  max_grad_norm=0.0, **opts)
    with torch.no_grad():  # LoRA B starts at zero; give the adapter an effect so every LoRA gradient is live
        g = torch.Generator().manual_seed(2)
        for n, p in tr.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    batch = _batch(tr.model.config.vocab_size)
    m_pad, g_pad = _update_grads(tr, batch, packed=False)
    m_pack, g_pack = _update_grads(tr, batch, packed=True)
    assert tr.update.packed_kind() == "sdpa"
    assert len(g_pad) == len(g_pack) == opts.get("num_iterations", 1)
    assert m_pack["loss"] == pytest.approx(m_pad["loss"], rel=1e-5) and m_pad["loss"] != 0
    for k in ("entropy", "logprob_mismatch_mean", "logprob_mismatch_max", "kl", "is_weight_mean"):
        if k in m_pad:
            assert m_pack[k] == pytest.approx(m_pad[k], rel=1e-5), k
    lora = [n for n in g_pad[0] if ".lora_" in n]
    assert len(lora) == 2 * 7 * tr.model.config.num_hidden_layers
    for gp, gq in zip(g_pad, g_pack):
        for n in lora:
            assert gp[n].norm() > 0, n
            assert _rel(gq[n], gp[n]) < 1e-5, (n, _rel(gq[n], gp[n]))


def test_packed_rows_use_their_position_ids():
    """The packed logprobs equal the padded ones only because RoPE reads the restarted positions:
    with the row's plain 0..T-1 positions the later completions come out different."""
    tr = _trainer("/tmp/unused")
    batch = _batch(tr.model.config.vocab_size)
    (mb,) = packed_micro_batches(batch, 12, 0, "cpu", "sdpa")
    (pad,) = micro_batches(batch, 12, 0, "cpu")
    with torch.no_grad():
        ref, _ = completion_logprobs(tr.model, **pad.model_inputs())
        lp, _ = completion_logprobs(tr.model, **mb.model_inputs())
        inp = mb.model_inputs()
        inp["position_ids"] = torch.arange(mb.input_ids.shape[1]).expand_as(mb.input_ids)
        wrong, _ = completion_logprobs(tr.model, **inp)
    assert (lp - ref).abs().max() < 1e-5
    assert (wrong - ref).abs().max() > 1e-2
    # 3 rows of one prompt each, against 12 padded rows
    assert mb.input_ids.numel() < pad.input_ids.numel() / 2


def test_two_steps_with_packing_on_and_off_give_the_same_adapter(tmp_path):
    kw = dict(max_steps=2, save_steps=2, num_iterations=2, dynamic_sampling=False, max_completion_length=16)
    start = _trainable(_trainer(tmp_path / "start", **kw))
    on = _trainer(tmp_path / "on", packed_update=True, **kw)
    off = _trainer(tmp_path / "off", packed_update=False, **kw)
    rows_on, rows_off = on.train(), off.train()
    assert [r["completion_length_mean"] for r in rows_on] == [r["completion_length_mean"] for r in rows_off]
    assert [r["loss"] for r in rows_on] == pytest.approx([r["loss"] for r in rows_off], rel=1e-4)
    a, b = _trainable(on), _trainable(off)
    assert any(not torch.equal(a[n], start[n]) for n in a)  # it trained
    # Adam divides each gradient element by its own running magnitude, so the fp32 rounding of the
    # smallest elements reaches the step at full size: compare what training changed, to 1e-3
    for n in a:
        assert _rel(a[n] - start[n], b[n] - start[n]) < 1e-3, n


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="FlexAttention compiles (inductor's C++ backend on the CPU)")
def test_flex_attention_block_mask_gives_the_padded_logprobs():
    """The GPU's packed path (a BlockMask under transformers' flex_attention, rows padded to 128),
    forward only: FlexAttention has no backward on the CPU."""
    tr = _trainer("/tmp/unused")
    batch = _batch(tr.model.config.vocab_size)
    (pad,) = micro_batches(batch, 12, 0, "cpu")
    with torch.no_grad():
        ref, _ = completion_logprobs(tr.model, **pad.model_inputs())
        assert use_flex_attention(tr.model)
        (mb,) = packed_micro_batches(batch, 12, 0, "cpu", FLEX)
        assert mb.input_ids.shape == (3, 128) and mb.attention_mask.shape == (3, 1, 128, 128)
        lp, _ = completion_logprobs(tr.model, **mb.model_inputs())
    assert (lp - ref).abs().max() < 1e-5


def test_a_dense_row_is_cut_at_max_row_and_each_part_repeats_the_prompt():
    prompts = [[5, 6, 7]] * 3
    comps = [[10, 11, 12, 13], [14, 15], [16, 17, 18]]
    r = pack(prompts, comps, max_row=6)  # 3 + 3 fits, + 1 passes 6: a new row; 3 + 1 + 2 fits
    assert r.input_ids.tolist() == [[5, 6, 7, 10, 11, 12], [5, 6, 7, 14, 16, 17]]
    assert r.hidden_row[:, 0].tolist() == [0, 1, 1] and r.hidden_index[2, :3].tolist() == [2, 4, 5]
    tr = _trainer("/tmp/unused")
    batch = _batch(tr.model.config.vocab_size)
    (pad,) = micro_batches(batch, 12, 0, "cpu")
    cut = pack([c.prompt_ids for c in batch.completions], [c.token_ids for c in batch.completions], max_row=20)
    assert cut.input_ids.shape[0] > 3  # the 3 groups took more rows
    mask = torch.arange(cut.targets.shape[1])[None] < cut.lengths[:, None]
    with torch.no_grad():
        ref, _ = completion_logprobs(tr.model, **pad.model_inputs())
        lp, _ = completion_logprobs(tr.model, cut.input_ids, allowed(cut.segment)[:, None], cut.hidden_index,
                                    cut.targets, mask, position_ids=cut.position_ids, rows=cut.hidden_row)
    assert (lp[pad.mask] - ref[pad.mask]).abs().max() < 1e-5  # (tool tokens: out of the padded mask)


class _HiddenStub(torch.nn.Module):
    """A 'model' whose body returns a fixed hidden-state tensor: completion_logprobs' gather alone."""

    def __init__(self, hidden, vocab: int):
        super().__init__()
        self.hidden = torch.nn.Parameter(hidden)
        self.lm_head = torch.nn.Linear(hidden.shape[-1], vocab, bias=False)

    def get_input_embeddings(self):
        return self.lm_head

    def model(self, **_):
        from types import SimpleNamespace

        return SimpleNamespace(last_hidden_state=self.hidden)


def test_the_gradient_of_a_shared_hidden_state_adds_up_in_the_same_order_every_run():
    """Packed rows read a prompt's last hidden state once per completion; the CPU's advanced-index
    backward adds such repeats with atomics (threads race), which made two identical runs differ."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(0)
        stub = _HiddenStub(torch.randn(3, 272, 576, generator=g), vocab=8)
        b, lc = 200, 25
        rows = torch.randint(0, 3, (b, lc), generator=g)
        pos = torch.randint(0, 272, (b, lc), generator=g)
        rows[:, 0], pos[:, 0] = 0, 53  # every completion's first token from one shared state
        targets = torch.randint(0, 8, (b, lc), generator=g)
        mask = torch.ones(b, lc, dtype=torch.bool)
        grads = []
        for _ in range(4):
            stub.zero_grad()
            lp, _ = completion_logprobs(stub, torch.zeros(3, 272, dtype=torch.long), torch.ones(3, 272), pos, targets,
                                        mask, rows=rows, entropy=False)
            lp.sum().backward()
            grads.append(stub.hidden.grad.clone())
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(grads[0], x) for x in grads[1:])

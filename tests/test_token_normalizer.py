"""dapo/cispo's token normaliser in the update (issue 33): it counts only the tokens the loss counts
(mask_truncated_completions drops the cut completions from both, TRL 1.9.0's fix), and with several
updates per generation it is the generation batch's tokens / its updates (TRL >= 1.9.2) or, with
token_normalizer: update, each update's own. The update's losses are checked against a per-token
reference computed here from the micro-batches the update trained on."""

import pytest
import torch

import qerl.rl.objective as objective
import qerl.train.update as update
from test_trainer import _trainer


def _record(monkeypatch):
    calls, batches = [], []
    real_loss, real_mb = objective.policy_loss, update.PolicyUpdate.micro_batches

    def loss(lp, old, adv, mask, settings=None, **kw):
        out = real_loss(lp, old, adv, mask, settings, **kw)
        calls.append(dict(lp=lp.detach().clone(), old=old.detach().clone(), adv=adv.clone(), loss=float(out[0]), **kw))
        return out

    def mbs(self, batch):
        out = real_mb(self, batch)
        batches.extend(out)
        return out

    monkeypatch.setattr(objective, "policy_loss", loss)
    monkeypatch.setattr(update.PolicyUpdate, "micro_batches", mbs)
    return calls, batches


def _reference_update_losses(calls, batches, ga, mode):
    """Per update: sum over the micro-batches' kept tokens of -min(r a, clip(r) a), divided by the kept
    tokens of the generation / updates ("generation") or of the update ("update")."""
    kept = [b.mask & ~b.truncated[:, None] for b in batches]
    groups = [list(range(i, min(i + ga, len(batches)))) for i in range(0, len(batches), ga)]
    out = []
    for g in groups:
        total = 0.0
        for k in g:
            c = calls[k]
            r = torch.exp(c["lp"] - c["old"]).cpu()
            a = c["adv"].cpu()[:, None]
            term = -torch.min(r * a, torch.clamp(r, 0.8, 1.28) * a)
            total += float((term * kept[k]).sum())
        norm = sum(int(m.sum()) for m in kept) / len(groups) if mode == "generation" else \
            sum(int(kept[k].sum()) for k in g)
        out.append(total / norm)
    return out


@pytest.mark.parametrize("mode", ["generation", "update"])
def test_dapo_normaliser_counts_only_the_kept_tokens(tmp_path, monkeypatch, mode):
    calls, batches = _record(monkeypatch)
    tr = _trainer(tmp_path, max_steps=1, loss_type="dapo", mask_truncated_completions=True, token_normalizer=mode,
                  dynamic_sampling=False, max_completion_length=6)
    tr.train_step()
    assert any(b.truncated.any() for b in batches) and any((~b.truncated).any() for b in batches)
    ga = tr.cfg.gradient_accumulation_steps
    got = [sum(c["loss"] for c in calls[i:i + ga]) for i in range(0, len(calls), ga)]
    assert len(got) == 2  # two updates share the generation
    assert got == pytest.approx(_reference_update_losses(calls, batches, ga, mode), rel=1e-5)


def test_the_two_normalisers_differ_when_updates_have_different_token_counts(tmp_path, monkeypatch):
    calls, _ = _record(monkeypatch)
    _trainer(tmp_path / "g", max_steps=1, dynamic_sampling=False).train_step()
    gen = [c["norm_tokens"] for c in calls]
    calls.clear()
    _trainer(tmp_path / "u", max_steps=1, dynamic_sampling=False, token_normalizer="update").train_step()
    upd = [c["norm_tokens"] for c in calls]
    assert len(set(gen)) == 1 and sum(set(upd)) / len(set(upd)) == pytest.approx(gen[0])  # the mean of the updates'
    assert len(set(upd)) == 2

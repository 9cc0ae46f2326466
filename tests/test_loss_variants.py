"""GSPO (sequence-level ratio), CISPO, top-entropy tokens and the entropy bonus against per-token
loops written here from TRL's / MiniMax-M1's / verl's definitions (values and gradients)."""

import math

import numpy as np
import pytest
import torch

from qerl.rl.loss import policy_loss


def batch(seed=0, B=5, L=7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(B, L, generator=g, dtype=torch.float64) * 0.4  # ratios well outside the clip range
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.rand(B, L, generator=g) > 0.3
    mask[:, 0] = True
    ent = torch.rand(B, L, generator=g, dtype=torch.float64) * 2
    return logp, old, adv, mask, ent


def tokens(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t]]


def aggregate(terms_per_seq, loss_type, B, max_len):
    flat = [x for s in terms_per_seq for x in s]
    if loss_type == "grpo":
        return sum(sum(s) / max(1, len(s)) for s in terms_per_seq) / B
    if loss_type in ("bnpo", "dapo", "cispo"):
        return sum(flat) / len(flat)
    return sum(flat) / (B * max_len)  # dr_grpo


def clipped_term(r, a, lo, hi):
    return -min(r * a, min(max(r, 1 - lo), 1 + hi) * a)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_sequence_level_ratio_is_gspo(loss_type):
    logp, old, adv, mask, _ = batch()
    ref_terms, ref_grad = [], torch.zeros_like(logp)
    n_all = int(mask.sum())
    for i in range(logp.shape[0]):
        ts = tokens(mask, i)
        s = math.exp(sum(float(logp[i, t] - old[i, t]) for t in ts) / len(ts))
        a = float(adv[i])
        term = clipped_term(s, a, 0.2, 0.28)
        ref_terms.append([term] * len(ts))
        unclipped = s * a <= min(max(s, 0.8), 1.28) * a  # min() takes the unclipped branch: gradient flows
        if loss_type == "bnpo" and unclipped:
            # d/dlogp_t of sum_t -s*a over n tokens, s = exp(mean) : each token gets -a*s/n, times n / N
            for t in ts:
                ref_grad[i, t] = -a * s / n_all
    lp = logp.clone().requires_grad_(True)
    loss, st = policy_loss(lp, old, adv, mask, loss_type=loss_type, epsilon=0.2, epsilon_high=0.28,
                           max_completion_length=10, importance_sampling_level="sequence")
    assert float(loss) == pytest.approx(aggregate(ref_terms, loss_type, logp.shape[0], 10), rel=1e-9)
    if loss_type == "bnpo":
        loss.backward()
        assert torch.allclose(lp.grad, ref_grad, atol=1e-12)
    # one ratio per completion: a whole completion is clipped or not
    assert 0 < st["clip_fraction"] < 1


def test_sequence_level_equals_token_level_when_every_token_has_the_same_ratio():
    logp, _, adv, mask, _ = batch(1)
    old = logp - torch.linspace(-0.5, 0.5, logp.shape[0], dtype=torch.float64)[:, None]
    a, _ = policy_loss(logp, old, adv, mask, loss_type="grpo", epsilon=0.2, epsilon_high=0.28)
    b, _ = policy_loss(logp, old, adv, mask, loss_type="grpo", epsilon=0.2, epsilon_high=0.28,
                       importance_sampling_level="sequence")
    assert float(a) == pytest.approx(float(b), rel=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_cispo_clips_the_weight_stops_its_gradient_and_keeps_every_token(level):
    logp, old, adv, mask, _ = batch(2)
    m = mask.double()
    seq_r = torch.exp(((logp - old) * m).sum(1) / m.sum(1))
    # a cap inside the ratios' range: some tokens (completions, at the sequence level) are clipped
    cap = float(seq_r.median()) if level == "sequence" else float(torch.exp(logp - old)[mask].median())
    terms, grad = [], torch.zeros_like(logp)
    n_all = int(mask.sum())
    for i in range(logp.shape[0]):
        ts = tokens(mask, i)
        seq = math.exp(sum(float(logp[i, t] - old[i, t]) for t in ts) / len(ts))
        row = []
        for t in ts:
            r = seq if level == "sequence" else math.exp(float(logp[i, t] - old[i, t]))
            w = min(r, cap)
            row.append(-w * float(adv[i]) * float(logp[i, t]))
            grad[i, t] = -w * float(adv[i]) / n_all  # the weight is a constant: d/dlogp = -w*a
        terms.append(row)
    lp = logp.clone().requires_grad_(True)
    loss, st = policy_loss(lp, old, adv, mask, loss_type="cispo", epsilon=0.2, epsilon_high=cap,
                           importance_sampling_level=level)
    assert float(loss) == pytest.approx(aggregate(terms, "cispo", logp.shape[0], 0), rel=1e-9)
    loss.backward()
    assert torch.allclose(lp.grad, grad, atol=1e-12)
    assert (lp.grad[mask] != 0).all()  # no token's gradient is dropped, clipped or not
    assert 0 < st["clip_fraction"] < 1


def test_cispo_normalises_by_the_update_tokens_like_dapo():
    logp, old, adv, mask, _ = batch(3)
    a, _ = policy_loss(logp, old, adv, mask, loss_type="cispo", epsilon=0.2, epsilon_high=5.0, norm_tokens=100.0)
    b, _ = policy_loss(logp, old, adv, mask, loss_type="cispo", epsilon=0.2, epsilon_high=5.0)
    assert float(a) == pytest.approx(float(b) * int(mask.sum()) / 100.0, rel=1e-12)


@pytest.mark.parametrize("q", [0.2, 0.5, 0.8])
def test_top_entropy_quantile_trains_only_the_highest_entropy_tokens(q):
    logp, old, adv, mask, ent = batch(4)
    thr = float(np.quantile(ent[mask].numpy(), 1 - q))  # numpy's linear quantile, as torch.quantile
    terms, kept = [], 0
    for i in range(logp.shape[0]):
        row = []
        for t in tokens(mask, i):
            keep = float(ent[i, t]) >= thr
            kept += keep
            r = math.exp(float(logp[i, t] - old[i, t]))
            row.append(clipped_term(r, float(adv[i]), 0.2, 0.28) if keep else 0.0)
        terms.append(row)
    loss, st = policy_loss(logp, old, adv, mask, loss_type="bnpo", epsilon=0.2, epsilon_high=0.28,
                           entropies=ent, top_entropy_quantile=q)
    assert float(loss) == pytest.approx(aggregate(terms, "bnpo", logp.shape[0], 0), rel=1e-9)
    assert st["entropy_mask_fraction"] == pytest.approx(kept / int(mask.sum()))
    assert abs(kept / int(mask.sum()) - q) <= 1 / int(mask.sum()) + 1e-9  # the top q fraction of the tokens


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_entropy_bonus_is_coef_times_the_mean_token_entropy_for_every_loss_and_pushes_entropy_up(loss_type):
    """TRL's entropy_coef: the bonus is the mean over all masked tokens, not aggregated as the loss."""
    logp, old, adv, mask, ent = batch(5)
    base, _ = policy_loss(logp, old, adv, mask, loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, accumulation=2.0)
    e = ent.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, old, adv, mask, loss_type=loss_type, epsilon=0.2, epsilon_high=0.28,
                          entropies=e, entropy_coef=0.01, accumulation=2.0)
    flat = [float(ent[i, t]) for i in range(ent.shape[0]) for t in tokens(mask, i)]
    assert float(loss) == pytest.approx(float(base) - 0.01 * sum(flat) / len(flat) / 2.0, rel=1e-9)
    loss.backward()
    want = torch.where(mask, torch.full_like(ent, -0.01 / len(flat) / 2.0), torch.zeros_like(ent))
    assert torch.allclose(e.grad, want, atol=1e-15)  # descending the loss raises the entropy


def test_options_that_need_entropies_say_so():
    logp, old, adv, mask, _ = batch()
    with pytest.raises(ValueError, match="entropies"):
        policy_loss(logp, old, adv, mask, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, top_entropy_quantile=0.2)
    with pytest.raises(ValueError, match="entropies"):
        policy_loss(logp, old, adv, mask, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, entropy_coef=0.1)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        policy_loss(logp, old, adv, mask, loss_type="dapo", epsilon=0.2, epsilon_high=0.28,
                    importance_sampling_level="seq")


def test_config_takes_the_new_loss_fields_and_refuses_meaningless_values(tmp_path):
    from qerl.rl.config import GRPOConfig
    from qerl.rl.loss import LossSettings

    c = GRPOConfig(loss_type="cispo", epsilon_high=5.0, importance_sampling_level="sequence",
                   top_entropy_quantile=0.2, entropy_coeff=0.001)
    assert c.entropy_coef == 0.001  # the older name lands on TRL's field
    # the fields reach the loss, and survive the run folder's config.yaml
    s = LossSettings.of(c)
    assert (s.loss_type, s.importance_sampling_level, s.top_entropy_quantile, s.entropy_coef) == (
        "cispo", "sequence", 0.2, 0.001)
    (tmp_path / "c.yaml").write_text(c.to_yaml())
    assert GRPOConfig.from_yaml(tmp_path / "c.yaml") == c
    for bad, field in [(dict(loss_type="cispo"), "epsilon_high"), (dict(importance_sampling_level="seq"),
                       "importance_sampling_level"), (dict(top_entropy_quantile=0.0), "top_entropy_quantile"),
                       (dict(entropy_coeff=-1.0), "entropy_coeff")]:
        with pytest.raises(ValueError, match=field):
            GRPOConfig(**bad)
    assert "importance_sampling_level" in GRPOConfig().to_yaml() and "top_entropy_quantile" in GRPOConfig().to_yaml()


def test_entropies_carry_their_gradient_when_asked(tmp_path):
    """The entropy bonus needs d entropy / d weights: chunked entropies with entropy_grad match a full forward."""
    from tiny_models import save_tiny

    from qerl.model import load_policy, quantized_layers
    from qerl.train.logprobs import completion_logprobs, pad_batch

    save_tiny(tmp_path / "base", "llama")
    m = load_policy(tmp_path / "base", "nvfp4", lora_rank=4, dtype=torch.float32, progress=False).model
    with torch.no_grad():
        for _, layer in quantized_layers(m):
            layer.lora_B.weight.normal_(0, 0.05)
    prompts, comps = [[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14, 15, 16, 17, 18]]
    batch = pad_batch(prompts, comps)
    _, ent = completion_logprobs(m, *batch, temperature=0.7, chunk=3, entropy_grad=True)
    ent.sum().backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert got and any(g.abs().sum() > 0 for g in got.values())
    m.zero_grad()
    tot = 0
    for p, c in zip(prompts, comps):
        ls = torch.log_softmax(m(torch.tensor([p + c])).logits[0, len(p) - 1: -1].float() / 0.7, -1)
        tot = tot - (ls.exp() * ls).sum()
    tot.backward()
    for n, p in m.named_parameters():
        if p.grad is not None:
            assert torch.allclose(got[n], p.grad, atol=1e-5), n
    _, ent_default = completion_logprobs(m, *batch, temperature=0.7)
    assert not ent_default.requires_grad  # unchanged default: detached

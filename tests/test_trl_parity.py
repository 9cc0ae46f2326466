"""qerl's loss against TRL 1.16's own `GRPOTrainer._compute_loss` on the same float64 tensors (values and
gradients), for every loss type x ratio level x beta x epsilon_high x top_entropy_quantile x entropy_coef
x off-policy mask x importance-sampling weights x several micro-batches per generation; and the
importance-sampling modes against a reference written here from TRL's docstring."""

import itertools
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from qerl.rl.loss import policy_loss, rollout_is_weights

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
TRLTrainer = trl_grpo.GRPOTrainer


class _Accel:  # one process: TRL's collectives are the identity
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def pad_across_processes(self, x, dim=0, pad_index=0):
        return x

    def reduce(self, x, reduction="sum"):
        return x


def trl_loss(logp, ent, inputs, *, loss_type, beta, eps_hi, level, quantile, entropy_coef, opm, is_on,
             ga=1, spg=1, delta=None, bias_kl=True):
    """TRL's `_compute_loss`, run unbound on an object holding just the attributes it reads; the model
    forward is replaced by the given logprobs and entropies."""
    args = SimpleNamespace(use_bias_correction_kl=bias_kl, delta=delta, sapo_temperature_pos=1.0,
                           sapo_temperature_neg=1.05, steps_per_generation=spg, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
                           vespo_k_neg=3.0, vespo_lambda_neg=2.0)
    fake = SimpleNamespace(
        args=args, accelerator=_Accel(), model=SimpleNamespace(training=True), loss_type=loss_type, beta=beta,
        epsilon_low=0.2, epsilon_high=0.2 if eps_hi is None else eps_hi, importance_sampling_level=level, top_entropy_quantile=quantile,
        off_policy_mask_threshold=opm, use_vllm=is_on, vllm_importance_sampling_correction=is_on,
        max_completion_length=9, current_gradient_accumulation_steps=ga, aux_loss_enabled=False,
        _entropy_bonus_enabled=entropy_coef != 0, entropy_coef=entropy_coef, use_adaptive_entropy=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, ent, None),
        get_off_policy_mask=TRLTrainer.get_off_policy_mask, get_gamma_weights=TRLTrainer.get_gamma_weights)
    fake.get_high_entropy_mask = lambda e, m, t: TRLTrainer.get_high_entropy_mask(fake, e, m, t)
    return TRLTrainer._compute_loss(fake, None, inputs)


def tensors(seed, B=6, L=9):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, L, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(B, L, generator=g, dtype=torch.float64) * 0.3
    rollout = old + torch.randn(B, L, generator=g, dtype=torch.float64) * 0.3
    ref = logp + torch.randn(B, L, generator=g, dtype=torch.float64) * 0.2
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.rand(B, L, generator=g) > 0.25
    mask[:, 0] = True
    ent = torch.rand(B, L, generator=g, dtype=torch.float64) * 2
    return logp, old, rollout, ref, adv, mask, ent


def both(seed, *, loss_type, beta, eps_hi, level, quantile, entropy_coef, opm, is_mode, ga=1, spg=1, n_gen=None,
         delta=None, bias_kl=True):
    """(qerl's loss, its grad, TRL's loss, its grad) of one micro-batch."""
    logp, old, rollout, ref, adv, mask, ent = tensors(seed)
    isw = rollout_is_weights(old, rollout, mask, is_mode, 3.0, 0.5) if is_mode else None
    n_gen = n_gen or float(mask.sum())  # the generation batch's loss tokens (this micro-batch alone by default)
    out = []
    for side in ("qerl", "trl"):
        lp = logp.clone().requires_grad_(True)
        e = ent.clone().requires_grad_(entropy_coef != 0)
        if side == "qerl":
            loss, _ = policy_loss(lp, old, adv, mask, loss_type=loss_type, epsilon=0.2, epsilon_high=eps_hi, beta=beta,
                                  ref_logp=ref, is_weights=isw, norm_tokens=n_gen * ga / spg, accumulation=ga,
                                  max_completion_length=9, importance_sampling_level=level, entropies=e,
                                  top_entropy_quantile=quantile, entropy_coef=entropy_coef, delta=delta,
                                  use_bias_correction_kl=bias_kl, rollout_logp=rollout, off_policy_mask_threshold=opm)
        else:
            inputs = {"prompt_ids": torch.zeros(len(adv), 0, dtype=torch.long),
                      "prompt_mask": torch.zeros(len(adv), 0, dtype=torch.long),
                      "completion_ids": torch.zeros(mask.shape, dtype=torch.long), "completion_mask": mask.long(),
                      "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
                      "sampling_per_token_logps": rollout, "num_items_in_batch": torch.tensor(n_gen),
                      "importance_sampling_ratio": isw}
            loss = trl_loss(lp, e, inputs, loss_type=loss_type, beta=beta, eps_hi=eps_hi, level=level,
                            quantile=quantile, entropy_coef=entropy_coef, opm=opm, is_on=isw is not None, ga=ga,
                            spg=spg, delta=delta, bias_kl=bias_kl)
        loss.backward()
        out += [loss.detach(), lp.grad.clone()]
    return out


LOSSES = ["grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo", "luspo", "vespo"]
GRID = [g for g in itertools.product(LOSSES, ["token", "sequence"], [0.0, 0.04], [None, 0.28], [1.0, 0.3])
        if not (g[0] == "vespo" and g[1] == "sequence")]  # vespo is token level only (TRL warns, qerl refuses)


@pytest.mark.parametrize("loss_type,level,beta,eps_hi,quantile", GRID)
def test_loss_and_gradient_match_trl(loss_type, level, beta, eps_hi, quantile):
    if loss_type == "cispo":
        eps_hi = 5.0 if eps_hi else 4.0  # cispo's epsilon_high caps the weight itself
    modes = [(0.0, None, None), (0.01, 0.05, "token_truncate"), (0.0, None, "sequence_mask")]
    if loss_type == "vespo":  # TRL allows vespo only the token modes
        modes[2] = (0.0, None, "token_mask")
    for seed, (coef, opm, mode) in enumerate(modes):
        q, gq, t, gt = both(seed, loss_type=loss_type, beta=beta, eps_hi=eps_hi, level=level, quantile=quantile,
                            entropy_coef=coef, opm=opm, is_mode=mode)
        assert float(q) == pytest.approx(float(t), rel=1e-12, abs=1e-15)
        assert torch.allclose(gq, gt, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("loss_type", LOSSES)
def test_several_micro_batches_per_update_and_updates_per_generation_match_trl(loss_type):
    """TRL divides non-token-sum losses (and the entropy bonus) by the accumulation steps and dapo/cispo
    by the generation batch's tokens x accumulation / steps_per_generation (TRL >= 1.9.2)."""
    eps_hi = 5.0 if loss_type == "cispo" else 0.28
    q, gq, t, gt = both(7, loss_type=loss_type, beta=0.04, eps_hi=eps_hi, level="token", quantile=1.0,
                        entropy_coef=0.02, opm=None, is_mode="token_mask", ga=2, spg=4, n_gen=170.0)
    if loss_type in ("dapo", "cispo", "vespo"):  # the generation's token count matters (the test can fail)
        assert float(q) != pytest.approx(float(both(7, loss_type=loss_type, beta=0.04, eps_hi=eps_hi, level="token",
                                                    quantile=1.0, entropy_coef=0.02, opm=None, is_mode="token_mask",
                                                    ga=2, spg=4, n_gen=90.0)[0]), rel=1e-6)
    assert float(q) == pytest.approx(float(t), rel=1e-12)
    assert torch.allclose(gq, gt, rtol=1e-10, atol=1e-15)


def test_bias_corrected_kl_and_two_sided_clipping_match_trl_and_differ_from_the_plain_ones():
    kw = dict(loss_type="dapo", beta=0.1, eps_hi=0.28, level="token", quantile=1.0, entropy_coef=0.0, opm=None,
              is_mode=None)
    for bias_kl, delta in [(False, None), (True, 1.5), (False, 1.5)]:
        q, gq, t, gt = both(3, bias_kl=bias_kl, delta=delta, **kw)
        assert float(q) == pytest.approx(float(t), rel=1e-12) and torch.allclose(gq, gt, rtol=1e-10, atol=1e-15)
    plain, corrected = both(3, bias_kl=False, **kw)[1], both(3, bias_kl=True, **kw)[1]
    assert not torch.allclose(plain, corrected)  # the correction changes the gradient (the test can fail)


# ---- importance-sampling weights: TRL's four modes, from its docstring ---------------------------------
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("lo,hi", [(None, 3.0), (0.5, 2.0), (0.8, None)])
def test_importance_sampling_modes_follow_trls_definitions(mode, lo, hi):
    _, old, rollout, _, _, mask, _ = tensors(11)
    old = old + 0.6 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    w = rollout_is_weights(old, rollout, mask, mode, hi, lo)
    lo_, hi_ = (lo if lo is not None else -math.inf), (hi if hi is not None else math.inf)
    for i in range(mask.shape[0]):
        toks = [t for t in range(mask.shape[1]) if mask[i, t]]
        if mode.startswith("sequence"):
            r = math.exp(sum(float(old[i, t] - rollout[i, t]) for t in toks))  # the product of the token ratios
            want = min(max(r, lo_), hi_) if mode.endswith("truncate") else (r if lo_ <= r <= hi_ else 0.0)
            assert float(w[i, 0]) == pytest.approx(want, rel=1e-12)
            continue
        for t in toks:
            r = math.exp(float(old[i, t] - rollout[i, t]))
            want = min(max(r, lo_), hi_) if mode.endswith("truncate") else (r if lo_ <= r <= hi_ else 0.0)
            assert float(w[i, t]) == pytest.approx(want, rel=1e-12)
    if mode.endswith("mask"):
        assert (w == 0).any() and (w != 0).any()  # the data exercise both sides of the bounds


def test_off_policy_mask_drops_only_negative_advantage_completions_that_drifted():
    from qerl.rl.loss import off_policy_mask

    logp, _, rollout, _, adv, mask, _ = tensors(5)
    rollout = rollout + 0.3 * (torch.arange(len(adv)) % 2)[:, None]  # every other completion drifted
    adv[:4] = torch.tensor([-1.0, -1.0, 1.0, 1.0], dtype=adv.dtype)
    got = off_policy_mask(adv, logp, rollout, mask, 0.1)[:, 0]
    for i in range(len(adv)):
        toks = [t for t in range(mask.shape[1]) if mask[i, t]]
        kl = sum(float(rollout[i, t] - logp[i, t]) for t in toks) / len(toks)
        assert float(got[i]) == (1.0 if adv[i] >= 0 or kl <= 0.1 else 0.0)
    assert (got == 0).any() and (got == 1).any()

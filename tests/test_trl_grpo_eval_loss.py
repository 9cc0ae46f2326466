"""TRL's eval_loss for GRPO (issue 49): the loss TRL's own GRPOTrainer._compute_loss gives an eval batch of
fresh samples (ratio 1), for each loss_type whose value needs no forward pass, equals qerl's; TRL's own
nanstd gives the advantages; a TRL script's eval under qerl.trl logs eval_loss beside TRL's other names."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
from trl.trainer.utils import nanstd  # noqa: E402

from qerl.rl.advantages import group_advantages  # noqa: E402
from qerl.trl.grpo_eval import RATIO_LOSSES, batch_loss, eval_loss  # noqa: E402

MAX_LEN = 6


def _trl_loss(adv: torch.Tensor, tokens: list[int], loss_type: str) -> float:
    """TRL's _compute_loss in eval mode on a stand-in trainer whose model gives fixed logprobs (the
    sampling policy's own: ratio 1)."""
    B, T = len(tokens), max(tokens)
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in tokens])
    logps = -torch.rand(B, T)
    ident = SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x,
                            num_processes=1, sync_gradients=True)
    fake = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, beta=0.0, loss_type=loss_type, epsilon_low=0.2,
        epsilon_high=0.28, importance_sampling_level="token", use_vllm=False, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, model=SimpleNamespace(training=False), accelerator=ident,
        max_completion_length=MAX_LEN, current_gradient_accumulation_steps=1,
        _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(delta=None, steps_per_generation=1, use_bias_correction_kl=False),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.ones(B, T), None))
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv.float(), "num_items_in_batch": mask.sum()}
    return float(trl_grpo.GRPOTrainer._compute_loss(fake, None, inputs))


@pytest.mark.parametrize("loss_type", RATIO_LOSSES)
def test_a_batch_s_loss_is_trl_s_at_ratio_one(loss_type):
    torch.manual_seed(0)
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.0], [2.0, 2.0, 0.0, 1.0]])
    tokens = [3, 6, 1, 4, 2, 5, 6, 1]
    adv = group_advantages(rewards.double(), "group")
    want = _trl_loss(adv.flatten(), tokens, loss_type)
    assert batch_loss(adv, torch.tensor(tokens), loss_type, MAX_LEN) == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert abs(want) > 1e-3 or loss_type in ("grpo", "luspo")  # a length-weighted loss is not 0 at ratio 1


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trl_s(scale):
    rewards = torch.tensor([[1.0, 0.0, float("nan"), 0.0], [2.0, 2.0, 0.0, 1.0]])
    r = rewards.double()
    want = r - torch.nanmean(r, 1, keepdim=True)
    if scale == "group":
        want = want / (nanstd(r, 1).unsqueeze(1) + 1e-4)
    elif scale == "batch":
        want = want / (nanstd(r) + 1e-4)
    assert torch.allclose(group_advantages(r, scale), torch.nan_to_num(want, nan=0.0))


def test_eval_loss_is_the_mean_of_its_batches_and_absent_where_trl_needs_the_model():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [3.0, 1.0]])
    tokens = torch.tensor([2, 4, 3, 1, 5, 1])
    cfg = SimpleNamespace(loss_type="dapo", beta=0.0, entropy_coef=0.0, top_entropy_quantile=1.0,
                          scale_rewards="group", max_completion_length=MAX_LEN)
    # batches of 4 completions: prompts 0-1, then prompt 2; each batch's own advantages
    a = group_advantages(rewards.double(), "group")
    first = float(-(a[:2].flatten() * tokens[:4]).sum() / 10)
    last = float(-(a[2] * tokens[4:]).sum() / 6)
    assert eval_loss(rewards, tokens, cfg, 4) == pytest.approx((first + last) / 2)
    for change in ({"beta": 0.04}, {"entropy_coef": 0.01}, {"top_entropy_quantile": 0.2}, {"loss_type": "cispo"}):
        assert eval_loss(rewards, tokens, SimpleNamespace(**{**vars(cfg), **change}), 4) is None

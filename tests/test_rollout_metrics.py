"""The metrics phase (rl/rollout_metrics.py) with unscorable completions (NaN rewards: every reward function
returned None): the step's reward mean and std are over the scored completions, as TRL's nanmean and nanstd,
not NaN; a group whose scored rewards are all equal (or that has fewer than two) counts as zero variance."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from qerl.rl.rewards import Scores
from qerl.rl.rollout_metrics import rollout_metrics

nan = math.nan


class _OneRank:
    def gather(self, x):
        return [x]


class _TwoRanks:
    """Rank 0's view of a 2-rank gather: its own part, then the other rank's."""

    def __init__(self, other):
        self.other = other

    def gather(self, x):
        return [x, self.other]


def _round(rewards: list[list[float]]):
    """A round of one reward function "f" (its rewards are the totals), completions of 2 tokens."""
    r = torch.tensor(rewards)
    n = r.numel()
    comps = [SimpleNamespace(finish_reason="stop", logprobs=[-0.5, -0.5], prompt_ids=[1, 2], token_ids=[3, 4])
             for _ in range(n)]
    scores = Scores(total=r.flatten().tolist(), per_func={"f": r.flatten().tolist()}, names={"f": "f"})
    return SimpleNamespace(rewards=r, lengths=torch.full((n,), 2), completions=comps, scores=scores,
                           stats=SimpleNamespace(new_tokens=2 * n, seconds=1.0))


def test_an_unscorable_completion_is_left_out_of_the_step_s_reward_mean_and_std():
    rnd = _round([[1.0, 0.0, nan, nan], [0.5, 0.5, 1.0, nan]])
    m = rollout_metrics([rnd], 2, _OneRank())
    scored = torch.tensor([1.0, 0.0, 0.5, 0.5, 1.0])
    assert m["reward_mean"] == pytest.approx(0.6) and m["reward"] == pytest.approx(0.6)
    assert m["reward_std"] == pytest.approx(float(scored.std())) and m["reward_std"] == pytest.approx(math.sqrt(0.175))
    assert m["rewards/f/mean"] == pytest.approx(0.6)
    assert m["reward_errors"] == 0


def test_the_reward_std_is_trl_s_nanstd():
    trl_utils = pytest.importorskip("trl.trainer.utils")
    rnd = _round([[1.0, 0.0, nan, 2.0], [nan, nan, nan, nan], [0.25, 3.0, 1.0, nan]])
    m = rollout_metrics([rnd], 2, _OneRank())
    assert m["reward_std"] == pytest.approx(float(trl_utils.nanstd(rnd.rewards.flatten())))
    assert m["reward"] == pytest.approx(float(torch.nanmean(rnd.rewards)))


def test_groups_without_two_different_scored_rewards_are_zero_variance():
    # equal scored rewards; an unscorable group; a lone scored reward; two different ones (the only signal)
    rnd = _round([[1.0, nan, 1.0, nan], [nan] * 4, [3.0, nan, nan, nan], [1.0, nan, 0.0, nan]])
    m = rollout_metrics([rnd], 1, _OneRank())
    assert m["zero_variance_fraction"] == 0.75 and m["frac_reward_zero_std"] == 0.75
    assert m["filtered_group_fraction"] == 0.75


def test_every_completion_scored_gives_the_plain_statistics():
    rnd = _round([[1.0, 0.0, 1.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    m = rollout_metrics([rnd], 1, _OneRank())
    assert m["reward_mean"] == pytest.approx(float(rnd.rewards.mean()))
    assert m["reward_std"] == pytest.approx(float(rnd.rewards.std()))
    assert m["zero_variance_fraction"] == 0.5


def test_the_statistics_are_over_all_ranks_scored_rewards():
    mine, theirs = _round([[1.0, nan], [0.0, 0.0]]), _round([[nan, nan], [2.0, 4.0]])
    parts = {}

    class _Capture:
        def gather(self, x):
            parts["theirs"] = x
            return [x]

    rollout_metrics([theirs], 1, _Capture())  # the other rank's gathered part
    m = rollout_metrics([mine], 0, _TwoRanks(parts["theirs"]))
    scored = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0])
    assert m["reward_mean"] == pytest.approx(float(scored.mean()))
    assert m["reward_std"] == pytest.approx(float(scored.std()))
    # mine: [1, nan] lone scored, [0, 0] equal; theirs: [nan, nan], [2, 4] informative
    assert m["zero_variance_fraction"] == 0.75

"""Per-sample length limits (SamplingParams.sample_max_new_tokens) and bench step's varied lengths.

The engine must really stop each sample at its own limit (not trim afterwards) without disturbing
the others: on the CPU, sampling is keyed per (prompt, sample, position), so a limited sample's
tokens are the first tokens of the same sample generated without limits.
"""

import argparse
import dataclasses
import statistics

import pytest
import torch

from qerl.bench.synthetic import VARIED_HI, VARIED_LO, varied_length, varied_limits
from qerl.rollout import Engine, SamplingParams
from test_engine_runner import _model  # the same tiny random Qwen2

PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(50, 110)), [9] * 12]
N, MAX_NEW = 3, 20




def _limit(key, j):  # an independent table: varied per prompt and sample, some at 1, one at the maximum
    return [[1, 7, 20], [13, 2, 9], [5, 17, 1], [11, 3, 16]][key][j]


@pytest.fixture(scope="module")
def model():
    return _model()


def test_each_sample_stops_at_its_limit_with_the_tokens_it_had_without(model):
    base = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=7, ignore_eos=True)
    # max_slots 4 < 12 samples: samples are admitted as others retire, and the tail is compacted into holes
    # (sync_every 2: the host retires and moves slots often), so limited slots move while others run
    eng = Engine(model, max_len=128, max_slots=4, sync_every=2)
    full = eng.generate(PROMPTS, n=N, params=base)
    assert all(len(c.token_ids) == MAX_NEW and c.finish_reason == "length" for c in full)
    moves, move = [], eng.runner.move
    eng.runner.move = lambda src, dst: (moves.append((src, dst)), move(src, dst))
    lim = eng.generate(PROMPTS, n=N, params=dataclasses.replace(base, sample_max_new_tokens=_limit))
    assert moves  # a limited slot was moved (with its limit) while it ran
    for c, f in zip(lim, full):
        want = _limit(c.prompt_index, c.sample_index)
        assert (c.prompt_index, c.sample_index) == (f.prompt_index, f.sample_index)
        assert len(c.token_ids) == want
        assert c.token_ids == f.token_ids[:want]
        assert max(abs(x - y) for x, y in zip(c.logprobs, f.logprobs[:want])) < 1e-4
        # the sample's own limit is not a truncation (the trainer counts only "length" as one)
        assert c.finish_reason == ("length" if want == MAX_NEW else "limit")
    assert lim.stats.new_tokens == sum(_limit(i, j) for i in range(len(PROMPTS)) for j in range(N))
    # a later rollout without limits is not held to the previous one's
    again = eng.generate(PROMPTS[:1], n=N, params=base)
    assert [c.token_ids for c in again] == [c.token_ids for c in full[:N]]


def test_limits_follow_the_prompt_keys(model):
    """The function gets the prompt's key (the trainer's index in the global batch), not its position."""
    seen = []

    def f(key, j):
        seen.append((key, j))
        return 2 + key + j

    p = SamplingParams(max_new_tokens=30, greedy=True, ignore_eos=True, sample_max_new_tokens=f)
    outs = Engine(model, max_len=128, max_slots=8).generate(PROMPTS[:2], n=2, params=p, prompt_keys=[10, 4])
    assert sorted(seen) == [(4, 0), (4, 1), (10, 0), (10, 1)]
    assert [len(c.token_ids) for c in outs] == [12, 13, 6, 7]


def test_limits_above_max_new_tokens_are_capped(model):
    p = SamplingParams(max_new_tokens=6, greedy=True, ignore_eos=True, sample_max_new_tokens=lambda k, j: 1000 * j + 3)
    outs = Engine(model, max_len=128, max_slots=4).generate(PROMPTS[:2], n=2, params=p)
    assert [len(c.token_ids) for c in outs] == [3, 6, 3, 6]
    assert [c.finish_reason for c in outs] == ["limit", "length", "limit", "length"]


def test_limits_also_end_samples_that_eos_does_not(model):
    """Without ignore_eos, whichever comes first ends the sample: an EOS before the limit stays "eos"."""
    eng = Engine(model, max_len=128, max_slots=8)
    free = eng.generate(PROMPTS, n=1, params=SamplingParams(max_new_tokens=MAX_NEW, greedy=True))
    # with greedy decoding on random weights, pick the EOS ids so that one prompt ends early by itself
    was = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = free[0].token_ids[4]
    try:
        ref = eng.generate(PROMPTS, n=1, params=SamplingParams(max_new_tokens=MAX_NEW, greedy=True))
        p = SamplingParams(max_new_tokens=MAX_NEW, greedy=True, sample_max_new_tokens=lambda k, j: 8)
        got = eng.generate(PROMPTS, n=1, params=p)
    finally:
        model.generation_config.eos_token_id = was
    assert ref[0].finish_reason == "eos" and len(ref[0].token_ids) <= 5
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids[:8]
        assert g.finish_reason == (r.finish_reason if len(r.token_ids) <= 8 else "limit")


@pytest.mark.parametrize("bad", [0, -3, 2.5, None, "4"])
def test_a_bad_limit_names_the_prompt_and_sample(model, bad):
    p = SamplingParams(max_new_tokens=8, greedy=True, ignore_eos=True,
                       sample_max_new_tokens=lambda k, j: bad if (k, j) == (1, 2) else 4)
    with pytest.raises(ValueError, match=r"prompt 1 \(key 1\), sample 2"):
        Engine(model, max_len=128, max_slots=4).generate(PROMPTS[:2], n=3, params=p)


def test_sampling_params_want_a_function():
    with pytest.raises(ValueError, match="sample_max_new_tokens"):
        SamplingParams(sample_max_new_tokens=[[3, 4]])


def test_the_slot_limits_are_per_slot_state_refilled_in_place(model):
    """A captured decode graph reads the per-slot limits by address: they live in SlotState (moved,
    snapshotted and restored with the slot) and admission writes them in place."""
    from dataclasses import fields

    from qerl.rollout.model_runner import SlotState

    assert "limit" in {f.name for f in fields(SlotState)}
    eng = Engine(model, max_len=128, max_slots=4, sync_every=2)
    ptr = eng.runner.state.limit.data_ptr()
    p = SamplingParams(max_new_tokens=9, greedy=True, ignore_eos=True, sample_max_new_tokens=lambda k, j: 1 + k + j)
    eng.generate(PROMPTS, n=2, params=p)
    assert eng.runner.state.limit.data_ptr() == ptr
    st = SlotState.zeros(3, 8, "cpu")
    st.limit[2], st.active[2] = 5, True
    st.move(2, 0)
    assert int(st.limit[0]) == 5 and not st.active[2]


# ---- bench step's varied lengths ---------------------------------------------------------------------------

def test_varied_lengths_are_deterministic_within_bounds_with_mean_40_percent():
    M = 2048
    draws = [varied_length(0, i, j, M) for i in range(500) for j in range(8)]
    assert draws == [varied_length(0, i, j, M) for i in range(500) for j in range(8)]  # a pure function
    assert draws != [varied_length(1, i, j, M) for i in range(500) for j in range(8)]  # the seed matters
    assert all(1 <= d <= M for d in draws)
    assert min(draws) >= round(VARIED_LO * M) and max(draws) <= round(VARIED_HI * M)
    assert abs(statistics.mean(draws) / M - 0.40) < 0.01
    assert len(set(draws)) > 1000  # spread, not a few values
    # tiny limits: still >= 1 and <= the limit
    assert all(1 <= varied_length(s, i, 0, m) <= m for s in range(3) for i in range(50) for m in (1, 2, 3, 10))
    f = varied_limits(5, 300)
    assert f(3, 4) == varied_length(5, 3, 4, 300)


def test_bench_step_varied_case(tmp_path):
    """The trainer's own step on the toy shape: completions end at their drawn limits, the case says so."""
    from qerl.bench import step as bstep

    def _args(extra):
        ap = argparse.ArgumentParser()
        bstep.add_shape_args(ap)
        ap.add_argument("--quant", default="nvfp4")
        ap.add_argument("--logprob-chunk", type=int, default=None)
        ap.add_argument("--kv-cache-gb", type=float, default=None)
        ap.add_argument("--optim", default="adamw_torch")
        return ap.parse_args(["--shape", "tiny", "--device", "cpu", "--prompts", "2", "--num-generations", "4",
                              "--prompt-len", "12", "--micro-batch", "4", *extra])

    a = _args(["--out", str(tmp_path), "--max-new-tokens", "40", "--lengths", "varied", "--seed", "3"])
    res = bstep.run_case(a)
    assert res["fits"], res
    assert "varied lengths (mean 40%)" in res["case"] and res["lengths"] == "varied"
    for k in ("rollout_s", "update_s", "step_s"):
        assert res[k] > 0
    # the tiny model's vocabulary is small enough for EOS to come early now and then: at most the limits
    limits = [varied_length(3, i, j, 40) for i in range(2) for j in range(4)]
    assert 0 < res["completion_length_mean"] <= sum(limits) / len(limits) + 1e-6
    assert res["completion_length_fraction"] == pytest.approx(res["completion_length_mean"] / 40)
    assert res["truncated_fraction"] == 0  # no limit reaches 40 (at most 75 %)
    assert bstep.case_name(_args([]), "nvfp4") == bstep.case_name(_args(["--lengths", "max"]), "nvfp4")
    assert "varied" not in bstep.case_name(_args([]), "nvfp4")


def test_trl_rows_end_at_the_same_limits():
    from qerl.bench.trl_step import EndAtLimits, row_limits

    lim = torch.tensor(row_limits(4, 2, 3, 10))
    assert lim.tolist() == [varied_length(3, 0, 0, 10), varied_length(3, 0, 1, 10), varied_length(3, 1, 0, 10),
                            varied_length(3, 1, 1, 10)]
    proc = EndAtLimits(torch.tensor([3, 4, 9, 3]), prompt_width=6, eos_id=1, vocab_size=8)
    scores = torch.randn(4, 8)
    out = proc(torch.zeros(4, 6 + 2, dtype=torch.long), scores)  # two tokens generated: the third is next
    forced = [bool(torch.isinf(out[r]).sum() == 7 and out[r, 1] == 0) for r in range(4)]
    assert forced == [True, False, False, True]  # the limit-3 rows sample EOS as their third token
    assert torch.equal(out[1], scores[1]) and torch.equal(out[2], scores[2])

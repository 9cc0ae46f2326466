"""TRL's reward rule (rl/rewards.py, rl/advantages.py): None is unscorable (left out of the baseline, advantage
0, a wholly unscorable call said once); an exception, or a value that is not one number per completion, stops
the run in one line naming the function (and the dataset column it lacks); a time limit scores 0, counted.
And `qerl train` says how many prompts max_prompt_length cuts."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cli_runs import train_args
from qerl.rl import rewards
from qerl.rl.advantages import group_advantages, informative_groups, rollout_batch
from qerl.rl.rewards import RewardFunctionError, score


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(rewards, "_said_unscorable", set())


# ---- an exception stops the run, naming the function ----------------------------------------------
def needs_solution(prompts, completions, completion_ids, **kwargs):  # TRL's style: columns by keyword
    return [float(c == s) for c, s in zip(completions, kwargs["solution"])]


def test_a_column_the_data_lacks_is_named_with_the_columns_it_has():
    with pytest.raises(RewardFunctionError) as e:
        score([needs_solution], None, ["a", "b"], {"prompts": ["p", "q"], "answer": ["1", "2"]},
              completion_ids=[[1], [2]])
    msg = str(e.value)
    assert "'needs_solution'" in msg and "KeyError" in msg and "'solution'" in msg
    assert "columns: answer, prompt" in msg and "\n" not in msg


def test_a_missing_parameter_is_a_missing_column_too():
    def wants(completions, solution):
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"'wants' reads the dataset column 'solution'.*columns: answer"):
        score([wants], None, ["a"], {"answer": ["1"]})


def test_an_exception_on_one_completion_stops_the_run_as_in_trl():
    def picky(completions, **_):
        return [1.0 / (len(c) - 3) for c in completions]  # 'abc' divides by zero

    with pytest.raises(RewardFunctionError, match=r"'picky' raised ZeroDivisionError: float division by zero"):
        score([picky], None, ["abcd", "abc", "abcde"], {})


def test_an_async_exception_stops_the_run_too():
    async def picky_async(completions, **_):
        raise ValueError("no\nluck")

    with pytest.raises(RewardFunctionError, match=r"'picky_async' raised ValueError: no luck") as e:
        score([picky_async], None, ["a"], {})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value, said", [(None, "NoneType"), (1.0, "float"), ([1.0], "1 values for 2"),
                                         (["good", 1.0], "'good'"), ([[1.0], 1.0], "list"),
                                         ([math.inf, 1.0], "inf"), ([1e308, 1.0], "beyond")])
def test_a_value_that_is_not_one_number_per_completion_stops_the_run(value, said):
    def bad(completions, **_):
        return value

    with pytest.raises(RewardFunctionError) as e:
        score([bad], None, ["a", "b"], {})
    assert "'bad'" in str(e.value) and said in str(e.value)


def test_a_time_limit_scores_that_completion_0_and_is_counted():
    def slow_on_b(completions, **_):
        if "b" in completions:
            raise TimeoutError("no result within 1 s")
        return [1.0] * len(completions)

    sc = score([slow_on_b], None, ["a", "b", "c"], {})
    assert sc.total == [1.0, 0.0, 1.0] and sc.errors == 1 and "TimeoutError" in sc.first_error


# ---- None: unscorable -------------------------------------------------------------------------------
def test_none_is_unscorable_where_no_function_scores_and_adds_nothing_where_one_does():
    def some(completions, **_):
        return [1.0, None, None]

    def other(completions, **_):
        return [None, 2.0, math.nan]  # NaN reads as None, as in TRL

    sc = score([some, other], [1.0, 0.5], ["a", "b", "c"], {})
    assert sc.total[:2] == [1.0, 1.0] and math.isnan(sc.total[2]) and sc.errors == 0


def _trl_advantages(r: torch.Tensor, scale: str) -> torch.Tensor:
    """TRL 1.16's sum_then_normalize (GRPOTrainer._generate_and_score_completions) on one batch."""
    from trl.trainer.utils import nanstd

    mean = torch.nanmean(r, 1, keepdim=True)
    std = nanstd(r, 1, keepdim=True) if scale == "group" else nanstd(r)
    a = r - mean
    return torch.nan_to_num(a if scale == "none" else a / (std + 1e-4), nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_unscorable_completions_are_out_of_the_baseline_with_advantage_0_as_in_trl(scale):
    pytest.importorskip("trl")
    nan = math.nan
    r = torch.tensor([[1.0, 0.0, nan, nan], [nan, nan, nan, nan], [0.5, nan, 0.5, 1.0], [2.0, nan, nan, nan]])
    got = group_advantages(r, scale)
    assert torch.allclose(got, _trl_advantages(r, scale), atol=1e-6)
    assert (got[torch.isnan(r)] == 0).all() and torch.isfinite(got).all()
    assert got[0, 0] > 0 > got[0, 1]  # 1 vs 0 around their own mean, not around 0.25


def test_a_group_is_informative_when_its_scored_rewards_differ():
    nan = math.nan
    r = torch.tensor([[1.0, nan, 1.0, nan], [1.0, nan, 0.0, nan], [nan] * 4, [3.0, nan, nan, nan]])
    assert informative_groups(r).tolist() == [False, True, False, False]


class _Round:
    def __init__(self, rewards):
        from types import SimpleNamespace

        self.rewards = rewards
        self.completions = [SimpleNamespace(finish_reason="stop") for _ in range(rewards.numel())]


class _OneRank:
    def gather(self, x):
        return [x]


def test_the_batch_std_is_over_the_scored_rewards():
    r = _Round(torch.tensor([[1.0, 0.0, math.nan], [0.0, 0.0, 2.0]]))
    batch = rollout_batch([(r, 0), (r, 1)], 3, "batch", _OneRank())
    scored = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0])
    want = torch.tensor([0.5, -0.5, 0.0, -2 / 3, -2 / 3, 4 / 3]) / (scored.std() + 1e-4)
    assert torch.allclose(batch.advantages, want, atol=1e-6)


def test_a_wholly_unscorable_call_is_said_once(capsys):
    def never(completions, **_):
        return [None] * len(completions)

    for _ in range(3):
        sc = score([never], None, ["a", "b"], {})
    assert all(math.isnan(t) for t in sc.total)
    lines = [x for x in capsys.readouterr().err.splitlines() if "unscorable" in x]
    assert len(lines) == 1 and "'never'" in lines[0] and "None for all 2 completions" in lines[0]


# ---- through `qerl train` -----------------------------------------------------------------------------
ROWS = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(1, 9)]


def _trl_config(tmp_path, monkeypatch, module: str, source: str) -> list:
    """A `trl grpo --config` file naming reward function `module.func`, its module beside it (TRL's lookup)."""
    (tmp_path / f"{module}.py").write_text(source)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"reward_funcs: [{module}.func]\n")
    monkeypatch.chdir(tmp_path)
    return [cfg, "--dataset_name", data, "--dataset_config", "{}", "--dynamic_sampling", "false"]


def test_qerl_train_stops_on_a_reward_reading_a_missing_column(cli, tmp_path, model, monkeypatch):
    # it raised on every call, and 2 steps trained on all-zero rewards with exit status 0
    src = "def func(prompts, completions, completion_ids, **kwargs):\n    return [float(c == s) for c, s in " \
          "zip(completions, kwargs['solution'])]\n"
    extra = _trl_config(tmp_path, monkeypatch, "rules_missing_column", src)
    args = train_args(model, tmp_path / "run")
    rc, _, err = cli(args[0], extra[0], *args[1:], *extra[1:])
    said = [x for x in err.splitlines() if "error" in x]
    assert rc == 2 and len(said) == 1, err
    assert "reward function 'func'" in said[0] and "'solution'" in said[0] and "columns: answer, prompt" in said[0]


def test_qerl_train_says_once_when_no_completion_is_scorable(cli, tmp_path, model, monkeypatch):
    src = "def func(completions, **kwargs):\n    return [None] * len(completions)\n"
    extra = _trl_config(tmp_path, monkeypatch, "rules_never_scores", src)
    args = train_args(model, tmp_path / "run")
    rc, _, err = cli(args[0], extra[0], *args[1:], *extra[1:])
    assert rc == 0, err
    assert err.count("unscorable") == 1 and "reward function 'func' returned None for all" in err


def _cut_lines(err: str) -> list[str]:
    return [x for x in err.replace("\r", "\n").splitlines() if "training prompts are longer" in x]


def test_qerl_train_says_how_many_prompts_max_prompt_length_cuts(cli, tmp_path, model):
    rc, _, err = cli(*train_args(model, tmp_path / "run", "--max_steps", "1", "--max_prompt_length", "16"))
    assert rc == 0, err
    lines = _cut_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith("qerl: 16 of 16 training prompts are longer than max_prompt_length=16 tokens")
    assert "cut to its last 16 tokens" in lines[0] and "max_prompt_length=" in lines[0].split(";")[-1]


def test_prompt_cut_counts_what_the_rollouts_cut():
    from qerl.tasks.prompts import encode_prompt, prompt_cut
    from tiny_models import tiny_tokenizer

    tok = tiny_tokenizer()
    rows = [{"prompt": "x " * n} for n in (3, 10, 40)]
    lengths = [len(encode_prompt(tok, r["prompt"])) for r in rows]
    limit = sorted(lengths)[1]
    cut = prompt_cut(tok, rows, limit)
    assert (cut.cut, cut.total, cut.longest, cut.limit) == (1, 3, max(lengths), limit)
    assert f"max_prompt_length={max(lengths)} keeps them whole" in cut.line()
    assert prompt_cut(tok, rows, max(lengths)).cut == 0

"""Reward functions are called exactly as TRL 1.16 calls them (issue 49): the same functions, on the same
batch, run through TRL's own GRPOTrainer._calculate_rewards and through qerl's rewards.score; what each
function receives (every argument by keyword, in TRL's order) and the rewards must be equal."""

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
from trl.trainer.utils import start_event_loop_in_daemon  # noqa: E402
from transformers import TrainerState  # noqa: E402

from qerl.rl.rewards import AsMessages, score  # noqa: E402

PROMPTS = ["What is 1+1?", "Name a colour."]
COMPLETIONS = ["2", "two", "red", "blue!"]
IDS = [[17, 2], [88, 9, 2], [301], [5, 6, 7, 2]]  # the generated token ids (EOS 2 where generation stopped)
ROWS = [{"prompt": "What is 1+1?", "answer": "2", "level": 1}] * 2 + \
       [{"prompt": "Name a colour.", "answer": "red", "level": 3}] * 2


class Recorder:
    """Reward functions that write down each call's keyword arguments (hooks by name only)."""

    def __init__(self):
        self.calls = []

    def keep(self, name, kw):
        self.calls.append((name, list(kw), {k: v for k, v in kw.items() if k not in ("trainer_state", "log_extra",
                                                                                   "log_metric")}))

    def funcs(self):
        rec = self

        def by_ids(completion_ids, **kw):  # a token-count reward (3.875 under the old positional call)
            rec.keep("by_ids", {"completion_ids": completion_ids, **kw})
            return [float(len(i)) for i in completion_ids]

        def docs_example_4(prompts, completions, answer, **kw):  # TRL docs: a reward reading a column
            rec.keep("docs_example_4", {"prompts": prompts, "completions": completions, "answer": answer, **kw})
            kw["log_metric"]("my_metric", 0.5)
            kw["log_extra"]("judge", ["x"] * len(completions))
            return [2.0 if c == a else 0.0 for c, a in zip(completions, answer)]

        async def docs_example_5(prompts, completions, **kw):  # TRL docs: an async judge
            await asyncio.sleep(0.2)
            rec.keep("docs_example_5", {"prompts": prompts, "completions": completions, **kw})
            return [float(kw["trainer_state"].global_step + len(c)) for c in completions]

        async def second_judge(completions, **kw):
            await asyncio.sleep(0.2)
            rec.keep("second_judge", {"completions": completions, **kw})
            return [None if c.endswith("!") else 1.0 for c in completions]

        return [by_ids, docs_example_4, docs_example_5, second_judge]


def trl_run(funcs, state):
    """TRL's _calculate_rewards on a stand-in trainer holding what the method reads."""
    logged = SimpleNamespace(metrics={}, extra={})
    _, loop, ready = start_event_loop_in_daemon(name="test-trl-rewards")
    ready.wait()
    fake = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True), state=state,
        args=SimpleNamespace(report_to=[]), reward_funcs=funcs, reward_processing_classes=[None] * len(funcs),
        reward_func_names=[f.__name__ for f in funcs], environments=None, async_loop=loop,
        _log_completion_extra=lambda c, v: logged.extra.setdefault(c, []).extend(v),
        _log_metric=lambda n, v: logged.metrics.setdefault(n, []).append(v))
    prompts = [r["prompt"] for r in ROWS]
    out = trl_grpo.GRPOTrainer._calculate_rewards(fake, [dict(r) for r in ROWS], prompts, COMPLETIONS, IDS)
    loop.call_soon_threadsafe(loop.stop)
    return out, logged


def qerl_run(funcs, state):
    logged = SimpleNamespace(metrics={}, extra={})
    cols = {k: [r[k] for r in ROWS] for k in ROWS[0] if k != "prompt"}  # as rl/rollout_phase.py builds them
    cols["prompts"] = [r["prompt"] for r in ROWS]
    hooks = {"trainer_state": state, "log_extra": lambda c, v: logged.extra.setdefault(c, []).extend(v),
             "log_metric": lambda n, v: logged.metrics.setdefault(n, []).append(v)}
    return score(funcs, None, COMPLETIONS, cols, hooks, completion_ids=IDS), logged


def _state():
    st = TrainerState()
    st.global_step = 7
    return st


def test_every_function_receives_what_trl_passes_it_and_scores_the_same():
    trl_rec, qerl_rec = Recorder(), Recorder()
    st = _state()
    want, trl_logged = trl_run(trl_rec.funcs(), st)
    got, qerl_logged = qerl_run(qerl_rec.funcs(), st)
    assert trl_rec.calls == qerl_rec.calls  # names, order of the keyword arguments and their values
    assert [c[0] for c in qerl_rec.calls][:2] == ["by_ids", "docs_example_4"]  # sync first, in order
    table = torch.tensor([got.per_func[k] for k in got.per_func]).T
    assert torch.allclose(table, want, equal_nan=True), (table, want)
    assert got.per_func["by_ids"] == [2.0, 3.0, 1.0, 4.0]  # token counts, not characters
    assert got.errors == 0
    assert trl_logged.metrics == qerl_logged.metrics and trl_logged.extra == qerl_logged.extra


def test_async_functions_are_awaited_together():
    spans = {}

    def timed(name, value):
        async def f(completions, **_):
            t0 = time.perf_counter()
            await asyncio.sleep(0.2)
            spans[name] = (t0, time.perf_counter())
            return [value] * len(completions)
        f.__name__ = name
        return f

    sc = score([timed("slow_a", 1.0), timed("slow_b", 2.0)], None, COMPLETIONS, {"prompts": PROMPTS * 2})
    (a0, a1), (b0, b1) = spans["slow_a"], spans["slow_b"]
    assert a0 < b1 and b0 < a1, spans  # concurrently: each started before the other ended
    assert sc.total == [3.0] * 4 and sc.errors == 0


class AsyncJudge:
    """A callable object whose __call__ is async (TRL's is_async_callable sees through it)."""
    __name__ = "judge"

    async def __call__(self, prompts, completions, **kw):
        return [float(len(p)) for p in prompts]


def test_an_async_callable_object_is_awaited_like_trl():
    st = _state()
    want, _ = trl_run([AsyncJudge()], st)
    got, _ = qerl_run([AsyncJudge()], st)
    assert got.per_func["judge"] == want[:, 0].tolist() and got.errors == 0


def test_conversational_completions_reach_functions_as_trl_messages():
    seen = []

    async def f(completions, **_):
        seen.extend(completions)
        return [float(len(c[0]["content"])) for c in completions]

    sc = score([AsMessages(f)], None, ["ab", "c"], {"prompts": [[{"role": "user", "content": "q"}]] * 2})
    assert seen == [[{"role": "assistant", "content": "ab"}], [{"role": "assistant", "content": "c"}]]
    assert sc.total == [2.0, 1.0] and sc.names == {"f": "f"}


def test_an_async_failure_stops_the_run_as_in_trl():
    from qerl.rl.rewards import RewardFunctionError

    async def picky(completions, **_):
        return [1.0 / (len(c) - 3) for c in completions]

    with pytest.raises(RewardFunctionError, match="'picky' raised ZeroDivisionError"):
        score([picky], None, ["abcd", "abc", "abcde"], {})


def test_a_reward_model_by_folder_scores_as_trl_s_own(tmp_path):
    """reward_funcs=["<model id or folder>"]: TRL's GRPOTrainer loads it and scores prompt + completion; the
    scores of TRL's own _calculate_rewards (a real TRL trainer) and of qerl's are equal."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, LlamaConfig
    from trl import GRPOConfig, GRPOTrainer

    from qerl.trl.reward_models import reward_callables
    from tiny_models import COMMON, save_tiny, tiny_tokenizer

    torch.manual_seed(0)
    rm = tmp_path / "rm"
    AutoModelForSequenceClassification.from_config(LlamaConfig(num_labels=1, pad_token_id=0, **COMMON)) \
        .save_pretrained(rm)
    tiny_tokenizer().save_pretrained(rm)
    policy = tmp_path / "policy"
    save_tiny(policy, "llama")
    tiny_tokenizer().save_pretrained(policy)
    args = GRPOConfig(output_dir=str(tmp_path / "o"), per_device_train_batch_size=4, num_generations=4,
                      report_to="none", use_cpu=True, bf16=False, max_steps=1)
    trl_trainer = GRPOTrainer(model=str(policy), reward_funcs=[str(rm)], args=args,
                              train_dataset=Dataset.from_list([{"prompt": r["prompt"]} for r in ROWS]))
    prompts = [r["prompt"] for r in ROWS]
    want = trl_trainer._calculate_rewards([dict(r) for r in ROWS], prompts, COMPLETIONS, IDS)[:, 0]
    funcs = reward_callables([str(rm)])
    got = score(funcs, None, COMPLETIONS, {"prompts": prompts}, completion_ids=IDS)
    assert list(got.names.values()) == trl_trainer.reward_func_names == ["rm"]
    assert torch.allclose(torch.tensor(got.total), want, atol=1e-5), (got.total, want)
    assert len(set(got.total)) > 1  # the model tells the completions apart


def test_qerl_s_task_rewards_read_trl_s_conversational_completions():
    from qerl.tasks.rewards import format_reward, numeric_accuracy

    plain = ["<think>2+2</think> <answer>4</answer>", "so it is 5", "The answer is 4."]
    chat = [[{"role": "assistant", "content": c}] for c in plain]
    answer = ["#### 4"] * 3
    assert numeric_accuracy(chat, answer) == numeric_accuracy(plain, answer) == [1.0, 0.0, 1.0]
    assert format_reward(chat) == format_reward(plain) == [1.0, 0.0, 0.0]

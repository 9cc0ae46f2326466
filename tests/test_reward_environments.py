"""TRL 1.16's `environments` argument to reward functions (issue 49): with an environment_factory, TRL's
_calculate_rewards passes each completion's environment instance; without one it passes nothing. Checked
against TRL's own method on the same batch, and through a qerl trainer's rollout."""

from types import SimpleNamespace

import pytest
import torch

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
from transformers import TrainerState  # noqa: E402

from qerl.rl.rewards import score  # noqa: E402

ROWS = [{"prompt": "1+1=", "answer": "2"}] * 2 + [{"prompt": "2+2=", "answer": "4"}] * 2
COMPLETIONS = ["2", "3", "4", "5"]
IDS = [[5], [6], [7], [8]]


class Env:
    def __init__(self):
        self.row = None

    def reset(self, row=None, **kw):
        self.row = row if row is not None else kw


def _recorder():
    calls = []

    def uses_env(prompts, completions, environments, **kw):
        calls.append(("uses_env", dict(prompts=prompts, completions=completions, environments=environments, **{
            k: v for k, v in kw.items() if k not in ("trainer_state", "log_extra", "log_metric")})))
        return [float(e is not None) for e in environments]

    def any_kwargs(completions, **kw):
        calls.append(("any_kwargs", sorted(kw)))
        return [0.0] * len(completions)

    return calls, [uses_env, any_kwargs]


def _trl(funcs, envs):
    fake = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True), state=TrainerState(),
        args=SimpleNamespace(report_to=[]), reward_funcs=funcs, reward_processing_classes=[None] * len(funcs),
        reward_func_names=[f.__name__ for f in funcs], environments=envs, async_loop=None,
        _log_completion_extra=lambda c, v: None, _log_metric=lambda n, v: None)
    return trl_grpo.GRPOTrainer._calculate_rewards(fake, [dict(r) for r in ROWS], [r["prompt"] for r in ROWS],
                                                   COMPLETIONS, IDS)


def _qerl(funcs, envs):
    cols = {"answer": [r["answer"] for r in ROWS], "prompts": [r["prompt"] for r in ROWS]}
    hooks = {"trainer_state": TrainerState(), "log_extra": lambda c, v: None, "log_metric": lambda n, v: None}
    return score(funcs, None, COMPLETIONS, cols, hooks, completion_ids=IDS, environments=envs)


def test_environments_reach_reward_functions_as_trl_passes_them():
    envs = [Env() for _ in ROWS]
    trl_calls, funcs = _recorder()
    want = _trl(funcs, envs)
    qerl_calls, funcs = _recorder()
    got = _qerl(funcs, envs)
    assert qerl_calls == trl_calls  # the same instances, in the same place among the keyword arguments
    assert qerl_calls[0][1]["environments"] is envs and "environments" in qerl_calls[1][1]
    assert torch.equal(torch.tensor(got.per_func["uses_env"]), want[:, 0]) and got.errors == 0


def test_without_environments_neither_passes_the_argument():
    trl_calls, funcs = _recorder()
    _trl(funcs[1:], None)
    qerl_calls, funcs = _recorder()
    _qerl(funcs[1:], None)
    assert qerl_calls == trl_calls and "environments" not in qerl_calls[0][1]


def test_a_trainer_with_an_environment_factory_hands_each_completion_its_environment(tmp_path):
    from qerl.model import random_policy
    from qerl.rl import GRPOConfig, GRPOTrainer
    from tiny_models import config, tiny_tokenizer

    seen = []

    def reward(prompts, completions, environments, **kw):
        seen.append((list(prompts), list(environments)))
        return [0.0] * len(completions)

    pol = random_policy(config("llama"), "nvfp4", lora_rank=2, device="cpu", dtype=torch.float32, progress=False)
    pol.tokenizer = tiny_tokenizer()
    cfg = GRPOConfig(max_steps=1, generation_batch_size=4, num_generations=2, per_device_train_batch_size=4,
                     max_completion_length=4, aqn=False, output_dir=str(tmp_path / "r"), report_to="none",
                     parity_check_steps=0, dynamic_sampling=False, save_strategy="no")
    rows = [{"prompt": f"{a}+{a}="} for a in range(2)]
    tr = GRPOTrainer(cfg, policy=pol, reward_funcs=[reward], train_dataset=rows, progress=False,
                     environment_factory=Env)
    tr.train()
    prompts, envs = seen[0]
    assert len(envs) == len(prompts) == 4 and len({id(e) for e in envs}) == 4  # one per completion
    assert all(isinstance(e, Env) and e.row["prompt"] == p for e, p in zip(envs, prompts))  # reset with its row

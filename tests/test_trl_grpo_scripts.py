"""TRL-documented GRPO scripts under TRL 1.16 and under qerl.trl with only the import line changed (issue 49):
rewards by keyword (completion_ids, TRL's docs examples 4 and 5: a dataset column, an async function),
log_completions, num_iterations (TRL's optimizer steps and generations), resume_from_checkpoint, the
Trainer surface; the same assertions for both. Then qerl-only behaviour TRL leaves to the user: a rerun
into the same folder, long prompts, push_to_hub offline, fields refused by name. Tiny model, CPU."""

import json
import textwrap

import pytest


pytest.importorskip("trl")

HEAD = textwrap.dedent('''
    import asyncio
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    calls = []

    def token_count(completion_ids, **kwargs):
        vals = [float(len(ids)) for ids in completion_ids]
        calls.append(("token_count", vals))
        return vals

    def reward_func(prompts, completions, answer, **kwargs):  # TRL's docs, example 4
        return [1.0 if c.strip().startswith(a) else 0.0 for c, a in zip(completions, answer)]

    async def async_reward(prompts, completions, **kwargs):  # TRL's docs, example 5
        await asyncio.sleep(0.01)
        return [len(c) / 10 for c in completions]

    dataset = Dataset.from_list([{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(4)])
''')

REWARDS = HEAD + textwrap.dedent('''
    args = GRPOConfig(output_dir=OUT, max_steps=2, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, learning_rate=1e-3, logging_steps=1, report_to="none",
                      save_strategy="no", use_cpu=True, bf16=False, log_completions=True, num_completions_to_print=2)
    from peft import LoraConfig

    trainer = GRPOTrainer(model=MODEL, reward_funcs=[token_count, reward_func, async_reward], args=args,
                          train_dataset=dataset, peft_config=LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                                                                       target_modules=["q_proj", "v_proj"]))
    trainer.train()
    trainer.model.save_pretrained(OUT + "/peft")
''')

ITERATIONS = HEAD + textwrap.dedent('''
    args = GRPOConfig(output_dir=OUT, max_steps=4, num_iterations=2, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=5, learning_rate=1e-3, logging_steps=1,
                      report_to="none", save_strategy="no", use_cpu=True, bf16=False)
    trainer = GRPOTrainer(model=MODEL, reward_funcs=token_count, args=args, train_dataset=dataset)
    trainer.train()
''')

RESUME = HEAD + textwrap.dedent('''
    def run(steps, resume):
        args = GRPOConfig(output_dir=OUT, max_steps=steps, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=5, learning_rate=1e-3, logging_steps=1, report_to="none",
                          save_steps=1, use_cpu=True, bf16=False)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=token_count, args=args, train_dataset=dataset)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    first = run(2, None)
    calls.clear()
    trainer = run(3, True)
''')

EVAL = HEAD + textwrap.dedent('''
    args = GRPOConfig(output_dir=OUT, max_steps=2, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=5, learning_rate=1e-3, logging_steps=1, report_to="none",
                      save_strategy="no", use_cpu=True, bf16=False, eval_strategy="steps", eval_steps=1,
                      per_device_eval_batch_size=8)
    trainer = GRPOTrainer(model=MODEL, reward_funcs=[token_count, reward_func], args=args, train_dataset=dataset,
                          eval_dataset=Dataset.from_list([{"prompt": "5+5=", "answer": "10"}] * 2))
    trainer.train()
    metrics = trainer.evaluate()
''')



def run(script, under, out, model_dir):
    code = script if under == "trl" else script.replace("from trl import", "from qerl.trl import")
    assert under == "trl" or code.count("qerl") == 1
    env = {"OUT": str(out), "MODEL": str(model_dir)}
    exec(compile(code, f"{under}_script.py", "exec"), env)  # noqa: S102 - the script under test
    mod = type(env["trainer"]).__module__
    assert mod.startswith("trl.") if under == "trl" else mod.startswith("qerl.")
    return env


def steps_of(history):
    return [h for h in history if "reward" in h]


@pytest.mark.parametrize("under", ["trl", "qerl"])
def test_rewards_by_keyword_async_and_log_completions(tmp_path, model_dir, under, capsys):
    env = run(REWARDS, under, tmp_path / "run", model_dir)
    tr = env["trainer"]
    steps = steps_of(tr.state.log_history)
    assert [h["step"] for h in steps] == [1, 2]
    for h in steps:  # token counts (not characters), the column and the async function scored
        assert h["rewards/token_count/mean"] == pytest.approx(h["completions/mean_length"])
        for name in ("reward_func", "async_reward"):
            assert f"rewards/{name}/mean" in h
        assert h["rewards/async_reward/mean"] > 0
        assert not h.get("reward_errors")
    out = capsys.readouterr().out
    assert "Step 1" in out and "Step 2" in out and "token_count" in out and "Advantage" in out
    assert len(list((tmp_path / "run" / "completions").iterdir())) == 2  # one file a logged step
    cfg = json.loads((tmp_path / "run" / "peft" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4
    assert (tmp_path / "run" / "peft" / "adapter_model.safetensors").is_file()


def test_completions_file_holds_the_table(tmp_path, model_dir, capsys):
    run(REWARDS, "qerl", tmp_path / "run", model_dir)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step=")]
    assert lines[0].startswith("step=1 ") and "time_parity=" in lines[0]  # TRL's numbering; the check's cost
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2]  # the same numbering as the lines
    text = (tmp_path / "run" / "completions" / "completions_00001.jsonl").read_text()
    rows = [json.loads(x) for x in text.splitlines() if x]
    assert len(rows) == 4 and {"step", "prompt", "completion", "token_count", "reward_func", "async_reward",
                               "advantage"} <= set(rows[0])
    assert rows[0]["step"] == 1 and rows[0]["prompt"].endswith("=")


@pytest.mark.parametrize("under", ["trl", "qerl"])
@pytest.mark.parametrize("reuse", ["num_iterations=2", "steps_per_generation=2"])
def test_num_iterations_counts_optimizer_steps_as_trl(tmp_path, model_dir, under, reuse):
    env = run(ITERATIONS.replace("num_iterations=2", reuse), under, tmp_path / "run", model_dir)
    tr = env["trainer"]
    assert tr.state.global_step == 4 and tr.state.max_steps == 4
    assert len(env["calls"]) == 2  # generations: 4 optimizer steps, each generation feeding two
    # a reward logged once a generation (TRL at its first update, 1 and 3; qerl after its last, 2 and 4)
    assert len(steps_of(tr.state.log_history)) == 2


@pytest.mark.parametrize("under", ["trl", "qerl"])
@pytest.mark.parametrize("resume", ["True", "OUT + '/checkpoint-2'"])
def test_resume_from_checkpoint_continues_the_run(tmp_path, model_dir, under, resume):
    env = run(RESUME.replace("run(3, True)", f"run(3, {resume})"), under, tmp_path / "run", model_dir)
    assert env["first"].state.global_step == 2
    assert env["trainer"].state.global_step == 3
    assert len(env["calls"]) == 1  # one more generation, not three


def test_resume_from_checkpoint_true_without_a_checkpoint_is_transformers_error(tmp_path, model_dir):
    from qerl.trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "r"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, report_to="none")
    tr = GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                     train_dataset=[{"prompt": "1+1="}])
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        tr.train(resume_from_checkpoint=True)


def test_a_rerun_into_its_folder_keeps_the_finished_run(tmp_path, model_dir, capsys):
    out = tmp_path / "run"
    run(REWARDS, "qerl", out, model_dir)
    first = (out / "adapter" / "adapter_model.safetensors").read_bytes()
    run(REWARDS + "trainer.save_model()\n", "qerl", out, model_dir)  # again: TRL would start over in the folder
    assert (out / "previous_runs" / "1" / "adapter" / "adapter_model.safetensors").read_bytes() == first
    assert (out / "adapter_model.safetensors").is_file()  # this run's save_model
    assert (out / "adapter").is_dir() and "held an earlier run: moved to" in capsys.readouterr().out


def _trainer(model_dir, out, rows, **kw):
    from qerl.trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(out), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, report_to="none", **kw)
    return GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                       args=args, train_dataset=rows)


def test_a_long_prompt_is_not_cut_as_trl_and_a_set_limit_is_said_once(tmp_path, model_dir, capsys):
    long = "You are terse. " * 40 + "1+1="  # 604 characters: 604 tokens of the character tokenizer
    tr = _trainer(model_dir, tmp_path / "a", [{"prompt": long}, {"prompt": "2+2="}])
    assert tr.cfg.max_prompt_length >= len(long) and len(tr.encode_prompt({"prompt": long})) == len(long)
    capsys.readouterr()
    _trainer(model_dir, tmp_path / "b", [{"prompt": long}] * 3 + [{"prompt": "2+2="}], max_prompt_length=100)
    out, err = capsys.readouterr()
    said = [x for x in (out + err).splitlines() if "max_prompt_length" in x]  # the trainer's line, as `qerl train`
    assert len(said) == 1 and "3 of 4 training prompts" in said[0] and "max_prompt_length=100" in said[0], said
    assert f"longest {len(long)}" in said[0] and f"max_prompt_length={len(long)} keeps them whole" in said[0]


def test_push_to_hub_offline_is_one_line(tmp_path, model_dir, monkeypatch):
    import huggingface_hub.constants

    from qerl.trl.surface import HubUnreachable

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    tr = _trainer(model_dir, tmp_path / "r", [{"prompt": "1+1="}], hub_model_id="me/tiny-grpo")
    with pytest.raises(HubUnreachable) as e:
        tr.push_to_hub()
    assert "me/tiny-grpo" in str(e.value) and "\n" not in str(e.value)
    assert (tmp_path / "r" / "adapter_model.safetensors").is_file() and (tmp_path / "r" / "README.md").is_file()


@pytest.mark.parametrize("field, value, nearest", [
    ("lr_scheduler_kwargs", {"min_lr_rate": 0.1}, "lr_scheduler_type"), ("data_seed", 3, "seed"),
    ("load_best_model_at_end", True, "save_total_limit"), ("eval_strategy", "epoch", "eval_steps")])
def test_grpo_fields_that_would_change_training_are_refused_by_name(field, value, nearest):
    from qerl.trl import GRPOConfig

    with pytest.raises(ValueError) as e:
        GRPOConfig(output_dir="x", **{field: value})
    assert field in str(e.value) and nearest in str(e.value) and "\n" not in str(e.value)


def test_renamed_and_surface_fields_work():
    from qerl.trl import GRPOConfig

    cfg = GRPOConfig(output_dir="x", activation_checkpointing=True, run_name="r1", log_completions=True,
                     data_seed=42, lr_scheduler_kwargs={})
    assert cfg.gradient_checkpointing is True and cfg.trl.run_name == "r1" and cfg.trl.log_completions
    assert cfg.dynamic_sampling is False  # TRL has none: the same generations as TRL


@pytest.mark.parametrize("under", ["trl", "qerl"])
def test_eval_strategy_steps_logs_trl_s_eval_metrics(tmp_path, model_dir, under):
    env = run(EVAL, under, tmp_path / "run", model_dir)
    evals = [h for h in env["trainer"].state.log_history if "eval_reward" in h]
    assert [h["step"] for h in evals] == [1, 2, 2]  # each eval_steps, and the script's evaluate()
    for h in evals + [env["metrics"]]:
        for name in ("eval_reward", "eval_reward_std", "eval_rewards/token_count/mean",
                     "eval_rewards/reward_func/mean", "eval_completions/mean_length", "eval_loss"):
            assert name in h, (under, name)
        assert h["eval_rewards/token_count/mean"] == pytest.approx(h["eval_completions/mean_length"])


def test_log_completions_gives_wandb_a_table(tmp_path, model_dir, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    run(REWARDS.replace('report_to="none"', 'report_to="wandb"'), "qerl", tmp_path / "run", model_dir)
    tables = sorted(p.name for p in (tmp_path / "run" / "wandb").rglob("completions_*.table.json"))
    assert len(tables) == 2  # one a logged step
    table = json.loads(next((tmp_path / "run" / "wandb").rglob("completions_*.table.json")).read_text())
    assert {"prompt", "completion", "token_count", "advantage"} <= set(table["columns"]) and len(table["data"]) == 4


def test_the_processing_class_given_is_the_one_that_tokenizes(tmp_path, model_dir):
    """TRL tokenizes with the processing_class it is given (here another chat template), not the checkpoint's;
    the adapter records the model the script named as its base."""
    from transformers import AutoTokenizer

    from qerl.trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    seen = []

    def reward(prompts, completions, **_):
        seen.extend(prompts)
        return [0.0] * len(completions)

    args = GRPOConfig(output_dir=str(tmp_path / "r"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=3, report_to="none", save_strategy="no")
    tr = GRPOTrainer(model=str(model_dir), processing_class=tok, reward_funcs=reward, args=args,
                     train_dataset=[{"prompt": [{"role": "user", "content": "hi"}]}])
    assert tr.processing_class.chat_template == tok.chat_template
    assert tr.tok.decode(tr.encode_prompt({"prompt": [{"role": "user", "content": "hi"}]})) == "<<hi>>"
    tr.train()
    cfg = json.loads((tmp_path / "r" / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(model_dir)


def test_a_dict_of_eval_sets_logs_each_under_its_name_as_trl(tmp_path, model_dir):
    from qerl.trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "r"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=3, report_to="none", save_strategy="no")
    tr = GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **_: [1.0] * len(completions), args=args,
                     train_dataset=[{"prompt": "1+1="}],
                     eval_dataset={"easy": [{"prompt": "1+1="}], "hard": [{"prompt": "12*13="}]})
    out = tr.evaluate()
    assert out["eval_easy_reward"] == out["eval_hard_reward"] == 1.0 and "eval_reward" not in out


def test_an_unscorable_eval_completion_is_left_out_of_eval_reward_as_trl(tmp_path, model_dir):
    import math

    import torch
    from trl.trainer.utils import nanstd

    from qerl.trl import GRPOConfig, GRPOTrainer

    given = []

    def half(completions, **_):  # every other completion unscorable (TRL's None)
        vals = [None if i % 2 else float(len(c)) for i, c in enumerate(completions)]
        given.append(vals)
        return vals

    args = GRPOConfig(output_dir=str(tmp_path / "r"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=5, report_to="none", save_strategy="no", per_device_eval_batch_size=8)
    tr = GRPOTrainer(model=str(model_dir), reward_funcs=half, args=args, train_dataset=[{"prompt": "1+1="}],
                     eval_dataset=[{"prompt": "1+1="}, {"prompt": "2+2="}])
    out = tr.evaluate()
    r = torch.tensor([math.nan if v is None else v for v in given[-1]], dtype=torch.float64).view(2, 4)
    assert out["eval_reward"] == pytest.approx(float(torch.nanmean(r)))  # TRL's nanmean, not NaN
    assert out["eval_reward_std"] == pytest.approx(float(nanstd(r.flatten())))
    assert out["eval_rewards/half/mean"] == pytest.approx(out["eval_reward"])
    lone = (r[:, ::2].max(1).values == r[:, ::2].min(1).values).float().mean()  # equal scored rewards: no signal
    assert out["eval_frac_reward_zero_std"] == pytest.approx(float(lone))
    assert math.isfinite(out["eval_loss"])


@pytest.mark.parametrize("kind, quant", [("nf4", "nf4"), ("fp4", "nvfp4")])
def test_a_bitsandbytes_4bit_config_picks_qerl_s_4bit_base(tmp_path, model_dir, kind, quant):
    from transformers import BitsAndBytesConfig

    from qerl.trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "r"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=3, report_to="none")
    tr = GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                     train_dataset=[{"prompt": "1+1="}],
                     quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind))
    assert tr.cfg.quant == quant


def test_an_8bit_base_and_a_rollout_func_are_refused_by_name(tmp_path, model_dir):
    from transformers import BitsAndBytesConfig

    from qerl.trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "r"), max_steps=1, report_to="none")
    f = lambda completions, **_: [0.0] * len(completions)  # noqa: E731
    with pytest.raises(ValueError, match="quantization_config.*nearest: quantization_config=None"):
        GRPOTrainer(model=str(model_dir), reward_funcs=f, args=args, train_dataset=[{"prompt": "1+1="}],
                    quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    with pytest.raises(ValueError, match="rollout_func.*nearest: tools"):
        GRPOTrainer(model=str(model_dir), reward_funcs=f, args=args, train_dataset=[{"prompt": "1+1="}],
                    rollout_func=lambda prompts, trainer: {})

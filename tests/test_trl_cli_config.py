"""Config files written for `trl grpo --config` and `trl sft --config` run with `qerl train` / `qerl sft` as they
are (issue 49): TRL's script arguments (reward_funcs by TRL's name or import path), model, PEFT and precision
fields, TRL field names. Tiny model, local data, one step each."""

import json
import textwrap

import pytest

from tiny_models import save_tiny, tiny_tokenizer


@pytest.fixture
def model_dir(tmp_path):
    save_tiny(tmp_path / "model", "llama")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def _rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_trl_grpo_config_file_with_reward_funcs_runs(cli, tmp_path, model_dir, monkeypatch):
    pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chat_rewards.py").write_text(textwrap.dedent('''
        def chars(completions, **kwargs):
            return [float(len(c[0]["content"])) for c in completions]
    '''))
    data = _rows(tmp_path / "train.jsonl", [{"prompt": [{"role": "user", "content": f"{a}+{a}?"}],
                                             "solution": str(2 * a)} for a in range(4)])
    (tmp_path / "grpo.yaml").write_text(textwrap.dedent(f'''
        model_name_or_path: {model_dir}
        dataset_name: {data}
        reward_funcs: [think_format_reward, chat_rewards.chars]
        output_dir: {tmp_path / "run"}
        max_steps: 1
        per_device_train_batch_size: 4
        num_generations: 4
        max_completion_length: 4
        learning_rate: 1.0e-5
        use_vllm: false
        bf16: false
        use_peft: true
        lora_r: 4
        lora_alpha: 8
        logging_steps: 1
        report_to: none
        log_completions: false
    '''))
    rc, out, err = cli("train", tmp_path / "grpo.yaml", "--device", "cpu", "--aqn", "false",
                       "--parity_check_steps", "0")
    assert rc == 0, err
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if "reward" in r][0]
    assert "rewards/think_format_reward/mean" in step and step["rewards/chars/mean"] >= 0
    assert not step.get("reward_errors")


def test_a_trl_grpo_config_file_with_an_unknown_reward_name_says_trl_s_rule(cli, tmp_path, model_dir):
    (tmp_path / "grpo.yaml").write_text(f"model_name_or_path: {model_dir}\nreward_funcs: [no_such_reward]\n"
                                        f"output_dir: {tmp_path / 'run'}\nmax_steps: 1\n")
    rc, _, err = cli("train", tmp_path / "grpo.yaml", "--device", "cpu")
    assert rc == 2 and "no_such_reward" in err and "import path" in err


def test_a_trl_sft_config_file_runs(cli, tmp_path, model_dir):
    data = _rows(tmp_path / "sft.jsonl", [{"prompt": f"{a} plus {a} is", "completion": f" {2 * a}."} for a in range(4)])
    (tmp_path / "sft.yaml").write_text(textwrap.dedent(f'''
        model_name_or_path: {model_dir}
        dataset_name: {data}
        output_dir: {tmp_path / "run"}
        max_steps: 2
        per_device_train_batch_size: 2
        learning_rate: 1.0e-4
        lr_scheduler_type: cosine
        max_length: 48
        packing: false
        padding_free: false
        bf16: false
        use_cpu: true
        dataset_num_proc: 1
        report_to: none
        logging_steps: 1
        save_strategy: "no"
    '''))
    rc, out, err = cli("sft", tmp_path / "sft.yaml", "--device", "cpu")
    assert rc == 0, err
    assert "ignored: bf16, use_cpu, dataset_num_proc" in out
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


def test_a_run_whose_groups_all_tied_says_it_trained_nothing(cli, tmp_path, model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "flat.py").write_text("def zero(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    data = _rows(tmp_path / "train.jsonl", [{"prompt": f"{a}+{a}="} for a in range(4)])
    (tmp_path / "grpo.yaml").write_text(textwrap.dedent(f'''
        model_name_or_path: {model_dir}
        dataset_name: {data}
        reward_funcs: [flat.zero]
        output_dir: {tmp_path / "run"}
        max_steps: 2
        per_device_train_batch_size: 4
        num_generations: 4
        max_completion_length: 4
        max_resample_rounds: 0
        report_to: none
    '''))
    rc, out, err = cli("train", tmp_path / "grpo.yaml", "--device", "cpu", "--parity_check_steps", "0")
    assert rc == 0, err
    assert "2 of the 2 steps made no update: every group's rewards tied" in out and "adapter is unchanged" in out


def test_a_config_file_field_qerl_lacks_is_refused_by_name_with_the_nearest(cli, tmp_path, model_dir):
    (tmp_path / "grpo.yaml").write_text(f"model_name_or_path: {model_dir}\noutput_dir: {tmp_path / 'run'}\n"
                                        "max_steps: 1\nlr_scheduler_kwargs: {min_lr_rate: 0.1}\n")
    rc, _, err = cli("train", tmp_path / "grpo.yaml", "--device", "cpu")
    assert rc == 2 and "lr_scheduler_kwargs" in err and "nearest: lr_scheduler_type" in err


def test_activation_checkpointing_is_gradient_checkpointing_in_a_config_file(cli, tmp_path, model_dir):
    (tmp_path / "grpo.yaml").write_text(f"model_name_or_path: {model_dir}\noutput_dir: {tmp_path / 'run'}\n"
                                        "max_steps: 1\nactivation_checkpointing: true\n")
    rc, out, err = cli("train", tmp_path / "grpo.yaml", "--print_config")
    assert rc == 0, err
    assert "\ngradient_checkpointing: true\n" in out


def _sft_yaml(tmp_path, model_dir, extra: str) -> "object":
    data = _rows(tmp_path / "sft.jsonl", [{"prompt": f"{a} plus {a} is", "completion": f" {2 * a}."} for a in range(4)])
    (tmp_path / "sft.yaml").write_text(textwrap.dedent(f'''
        model_name_or_path: {model_dir}
        dataset_name: {data}
        output_dir: {tmp_path / "run"}
        per_device_train_batch_size: 2
        max_length: 48
        report_to: none
        logging_steps: 1
        save_strategy: "no"
    ''') + textwrap.dedent(extra))
    return tmp_path / "sft.yaml"


def test_a_trl_sft_config_file_names_the_trl_fields_it_does_not_carry_out(cli, tmp_path, model_dir):
    """eval_strategy, push_to_hub, hub_model_id... are TRL's (its script evaluates on the test split and pushes):
    `qerl sft` does neither, and says so in the ignored line instead of dropping them without a word."""
    f = _sft_yaml(tmp_path, model_dir, '''
        max_steps: 2
        eval_strategy: steps
        eval_steps: 1
        per_device_eval_batch_size: 4
        push_to_hub: true
        hub_model_id: me/sft
        bf16: false
    ''')
    rc, out, err = cli("sft", f, "--print_config")
    assert rc == 0, err
    line = [x for x in out.splitlines() if "ignored:" in x]
    assert len(line) == 1, out
    for name in ("bf16", "eval_strategy", "eval_steps", "per_device_eval_batch_size", "push_to_hub", "hub_model_id"):
        assert name in line[0]


def test_a_trl_sft_config_file_s_warmup_ratio_is_a_fraction_of_its_max_steps(cli, tmp_path, model_dir):
    f = _sft_yaml(tmp_path, model_dir, "max_steps: 8\nwarmup_ratio: 0.25\n")
    rc, out, err = cli("sft", f, "--print_config")
    assert rc == 0, err
    assert "\nwarmup_steps: 2\n" in out and "warmup_ratio" not in out.split("ignored:")[-1]


def test_a_trl_sft_config_file_s_warmup_ratio_without_max_steps_counts_the_epochs_steps(cli, tmp_path, model_dir):
    """No max_steps: the run's updates are known once the examples are; warmup is ratio x updates, as TRL."""
    f = _sft_yaml(tmp_path, model_dir, "num_train_epochs: 2\nwarmup_ratio: 0.5\nlearning_rate: 1.0e-3\n"
                                       "lr_scheduler_type: constant\n")
    rc, out, err = cli("sft", f, "--device", "cpu")
    assert rc == 0, err
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["learning_rate"] for r in rows if "learning_rate" in r]
    assert len(lrs) == 4  # 4 examples x 2 epochs / 2 a step
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3])  # 2 warm-up updates of 4
    assert "\nwarmup_steps: 2\n" in (tmp_path / "run" / "config.yaml").read_text()


def test_a_trl_sft_config_file_s_resume_from_checkpoint_is_refused_with_qerl_s_resume(cli, tmp_path, model_dir):
    """TRL's script resumes from it; starting afresh instead would be a silent difference."""
    f = _sft_yaml(tmp_path, model_dir, f"max_steps: 2\nresume_from_checkpoint: {tmp_path / 'run' / 'checkpoint-1'}\n")
    rc, _, err = cli("sft", f, "--print_config")
    assert rc == 2 and "resume_from_checkpoint" in err and "qerl sft --resume" in err


def test_a_trl_grpo_config_file_s_max_steps_counts_trl_s_optimizer_steps(cli, tmp_path, model_dir, monkeypatch):
    """TRL: max_steps=4 with num_iterations=2 (steps_per_generation = gradient_accumulation_steps) is 4 optimizer
    steps, 2 generations each used twice; `qerl train` of the file does the same, by qerl.trl's translation."""
    from qerl.train.loop import TrainLoop

    monkeypatch.chdir(tmp_path)
    # a module name of its own: Python keeps the first module of a name imported in the process
    (tmp_path / "step_rewards.py").write_text("def chars(completions, **kwargs):\n"
                                              "    return [float(len(c)) for c in completions]\n")
    data = _rows(tmp_path / "train.jsonl", [{"prompt": f"{a}+{a}="} for a in range(8)])
    (tmp_path / "grpo.yaml").write_text(textwrap.dedent(f'''
        model_name_or_path: {model_dir}
        dataset_name: {data}
        reward_funcs: [step_rewards.chars]
        output_dir: {tmp_path / "run"}
        max_steps: 4
        num_iterations: 2
        per_device_train_batch_size: 4
        gradient_accumulation_steps: 1
        num_generations: 4
        max_completion_length: 4
        dynamic_sampling: false
        report_to: none
        logging_steps: 1
        save_strategy: "no"
    '''))
    calls = []
    real = TrainLoop.optimizer_step
    monkeypatch.setattr(TrainLoop, "optimizer_step", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    rc, out, err = cli("train", tmp_path / "grpo.yaml", "--device", "cpu", "--aqn", "false",
                       "--parity_check_steps", "0")
    assert rc == 0, err
    assert len(calls) == 4, out
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "reward" in r]) == 2
    assert "max_steps=4" in out and "optimizer steps" in out

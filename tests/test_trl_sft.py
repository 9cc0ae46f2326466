"""TRL's SFT API under qerl.trl (issue 49): TRL 1.16's documented SFT scripts (peft_config, the three data
formats, epochs instead of max_steps, the Trainer surface a script calls around train()) run under TRL
itself and under qerl.trl with only the import line changed; the same assertions hold for both."""

import json
import textwrap

import pytest


pytest.importorskip("trl")
pytest.importorskip("peft")

DATA = {
    "text": 'Dataset.from_list([{"text": f"{a} plus {a} is {a + a}."} for a in range(5)])',
    "prompt_completion": 'Dataset.from_list([{"prompt": f"{a} plus {a} is", "completion": f" {a + a}."} '
                         'for a in range(5)])',
    "conversational": 'Dataset.from_list([{"messages": [{"role": "user", "content": f"{a}+{a}?"}, '
                      '{"role": "assistant", "content": f"{a + a}"}]} for a in range(5)])',
}

SCRIPT = textwrap.dedent('''
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    dataset = DATA
    args = SFTConfig(output_dir=OUT, STEPS, per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=1,
                     report_to="none", save_strategy="no", use_cpu=True, bf16=False, max_length=48,
                     dataset_num_proc=1, seed=1)
    trainer = SFTTrainer(model=MODEL, args=args, train_dataset=dataset,
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                task_type="CAUSAL_LM"))
    result = trainer.train()
    history = trainer.state.log_history
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    trainer.save_model()
    trainer.model.save_pretrained(OUT + "/peft")
''')

# TRL's names of the metrics an SFT step logs (CPU, PEFT)
TRL_NAMES = ("loss", "grad_norm", "learning_rate", "entropy", "num_tokens", "mean_token_accuracy", "epoch")



def run(under, fmt, steps, out, model_dir):
    code = SCRIPT.replace("DATA", DATA[fmt]).replace("STEPS", steps)
    if under == "qerl":
        code = code.replace("from trl import", "from qerl.trl import")
    env = {"OUT": str(out), "MODEL": str(model_dir)}
    exec(compile(code, f"{under}_sft.py", "exec"), env)  # noqa: S102 - the script under test
    mod = type(env["trainer"]).__module__
    assert mod.startswith("trl.") if under == "trl" else mod.startswith("qerl.")
    return env


@pytest.mark.parametrize("under", ["trl", "qerl"])
@pytest.mark.parametrize("fmt", sorted(DATA))
def test_the_sft_script_with_peft(tmp_path, model_dir, under, fmt):
    env = run(under, fmt, "max_steps=3", tmp_path / "run", model_dir)
    tr, history = env["trainer"], env["history"]
    assert tr.state.global_step == 3 and env["result"].global_step == 3
    steps = [h for h in history if "loss" in h and "train_runtime" not in h]
    assert [h["step"] for h in steps] == [1, 2, 3]
    for h in steps:
        missing = [n for n in TRL_NAMES if n not in h]
        assert not missing, (under, missing)
        assert 0.0 <= h["mean_token_accuracy"] <= 1.0
    assert "train_runtime" in history[-1] and "train_loss" in env["result"].metrics
    out = tmp_path / "run"
    assert tr.args.output_dir == str(out) and tr.processing_class is not None
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 3
    assert "train_runtime" in json.loads((out / "train_results.json").read_text())
    for folder in (out, out / "peft"):
        cfg = json.loads((folder / "adapter_config.json").read_text())
        assert cfg["r"] == 4 and cfg["peft_type"] == "LORA" and (folder / "adapter_model.safetensors").is_file()


def test_epochs_give_trl_s_number_of_optimizer_steps(tmp_path, model_dir):
    """No max_steps: num_train_epochs passes in transformers' count (5 examples, batch 2: 3 steps an epoch)."""
    got = {u: run(u, "text", "num_train_epochs=2", tmp_path / u, model_dir)["trainer"].state.global_step
           for u in ("trl", "qerl")}
    assert got["qerl"] == got["trl"] == 6


def test_defaults_are_trl_s_or_listed(tmp_path):
    from trl import SFTConfig as TRLConfig

    from qerl.trl import SFTConfig

    ours, theirs = SFTConfig(output_dir=str(tmp_path)), TRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    for name in ("learning_rate", "num_train_epochs", "packing", "max_length", "dataset_text_field",
                 "per_device_train_batch_size", "lr_scheduler_type", "adam_beta2", "seed", "logging_steps",
                 "completion_only_loss", "assistant_only_loss", "save_total_limit", "save_steps", "warmup_steps"):
        want = getattr(theirs, name)
        want = want.value if hasattr(want, "value") else want  # transformers' enums
        assert getattr(ours, name) == want, name
    assert ours.report_to == "none" and theirs.report_to in ("none", [], ["none"])


@pytest.mark.parametrize("field, value, nearest", [
    ("eos_token", "<|im_end|>", "processing_class"), ("lr_scheduler_kwargs", {"min_lr": 0.1}, "lr_scheduler_type"),
    ("data_seed", 7, "seed"), ("load_best_model_at_end", True, "save_total_limit"),
    ("packing_strategy", "wrapped", "packing=True"), ("eval_strategy", "epoch", "eval_strategy='steps'")])
def test_a_field_that_would_change_training_is_refused_by_name(field, value, nearest):
    from qerl.trl import SFTConfig

    with pytest.raises(ValueError) as e:
        SFTConfig(output_dir="x", **{field: value})
    msg = str(e.value)
    assert field in msg and nearest in msg and "\n" not in msg


def test_trl_fields_that_steer_precision_or_data_loading_are_accepted(tmp_path, capsys):
    from qerl.trl import SFTConfig

    cfg = SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, dataset_num_proc=2, padding_free=True,
                    activation_checkpointing=False)
    assert cfg.packing is True and cfg.gradient_checkpointing is False
    assert "use_cpu, bf16, dataset_num_proc" in capsys.readouterr().out


EVAL = textwrap.dedent('''
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_list([{"text": f"{a} plus {a} is {a + a}."} for a in range(4)])
    args = SFTConfig(output_dir=OUT, max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3,
                     logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False, max_length=48,
                     eval_strategy="steps", eval_steps=1)
    trainer = SFTTrainer(model=MODEL, args=args, train_dataset=data, eval_dataset=data)
    trainer.train()
    metrics = trainer.evaluate()
''')


@pytest.mark.parametrize("under", ["trl", "qerl"])
def test_eval_strategy_steps_logs_eval_loss_and_token_accuracy(tmp_path, model_dir, under):
    code = EVAL if under == "trl" else EVAL.replace("from trl import", "from qerl.trl import")
    env = {"OUT": str(tmp_path / "run"), "MODEL": str(model_dir)}
    exec(compile(code, f"{under}_sft_eval.py", "exec"), env)  # noqa: S102
    evals = [h for h in env["trainer"].state.log_history if "eval_loss" in h]
    assert [h["step"] for h in evals] == [1, 2, 2]
    for h in evals + [env["metrics"]]:
        assert h["eval_loss"] > 0 and 0 <= h["eval_mean_token_accuracy"] <= 1


RESUME = textwrap.dedent('''
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    data = Dataset.from_list([{"text": f"{a} plus {a} is {a + a}."} for a in range(6)])

    def run(steps, resume):
        args = SFTConfig(output_dir=OUT, max_steps=steps, per_device_train_batch_size=2, learning_rate=1e-3,
                         logging_steps=1, report_to="none", save_steps=1, use_cpu=True, bf16=False, max_length=48)
        trainer = SFTTrainer(model=MODEL, args=args, train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    first = run(2, None)
    trainer = run(3, True)
''')


@pytest.mark.parametrize("under", ["trl", "qerl"])
def test_sft_resume_from_checkpoint_true_continues_the_run(tmp_path, model_dir, under):
    code = RESUME if under == "trl" else RESUME.replace("from trl import", "from qerl.trl import")
    env = {"OUT": str(tmp_path / "run"), "MODEL": str(model_dir)}
    exec(compile(code, f"{under}_sft_resume.py", "exec"), env)  # noqa: S102
    assert env["first"].state.global_step == 2 and env["trainer"].state.global_step == 3
    steps = [h["step"] for h in env["trainer"].state.log_history if "loss" in h and "train_runtime" not in h]
    assert steps == [1, 2, 3]  # the run's history, then the third step only (not the first two again)

"""A `trl grpo --config` / `trl sft --config` file that lists TRL 1.16's defaults runs as it is (issue 49): a field
of TRL's scripts that qerl's config lacks is accepted at TRL's default, named in the one-line notice; another
value of one that would change the result is refused by name, in one line, with the nearest qerl field; one without
an effect on the result is ignored at any value, named. The table (qerl/train/trl_fields.py) is checked against TRL's own
dataclasses where TRL is installed."""

import json

import pytest
import yaml


def _data(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{a} plus {a} is", "completion": f" {2 * a}."}) + "\n"
                            for a in range(4)))
    return path


def _defaults_file(tmp_path, model, kind, **over):
    """A config file of every field of TRL's `trl KIND` script at TRL's default, but the model, data and folder."""
    from qerl.train.trl_fields import defaults

    d = {**defaults(kind), "model_name_or_path": str(model), "dataset_name": str(_data(tmp_path)),
         "output_dir": str(tmp_path / "run"), **over}
    path = tmp_path / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def _notice(out: str) -> str:
    lines = [x for x in out.splitlines() if "TRL field(s) without an effect in qerl" in x]
    assert len(lines) == 1, out
    return lines[0]


@pytest.mark.parametrize("kind, command", [("grpo", "train"), ("sft", "sft")])
def test_a_file_of_trls_defaults_builds_its_config(cli, tmp_path, model, kind, command, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text("def chars(completions, **kwargs):\n"
                                            "    return [float(len(c)) for c in completions]\n")
    over = {"reward_funcs": ["my_rewards.chars"]} if kind == "grpo" else {}
    rc, out, err = cli(command, _defaults_file(tmp_path, model, kind, **over), "--print_config")
    assert rc == 0, err
    if kind == "grpo":  # TRL's max_steps -1: 3 epochs of 4 prompts, one a generation (8 completions of 8)
        assert "num_train_epochs=3 of 4 prompts is 12 optimizer steps" in out and "\nmax_steps: 12\n" in out
    line = _notice(out)
    at_default = line.split("at TRL's default")[1]
    for name in ("neftune_noise_alpha", "full_determinism", "fsdp", "label_smoothing_factor", "data_seed"):
        assert name in at_default, line


def test_a_trl_sft_file_of_trls_defaults_trains(cli, tmp_path, model):
    f = _defaults_file(tmp_path, model, "sft", max_steps=1, per_device_train_batch_size=2, max_length=48,
                       report_to="none", save_strategy="no")
    rc, out, err = cli("sft", f, "--device", "cpu")
    assert rc == 0, err
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert "eval_on_start" in _notice(out)


@pytest.mark.parametrize("kind, command, field, value, nearest", [
    ("sft", "sft", "neftune_noise_alpha", 5.0, "none: qerl adds no embedding noise"),
    ("sft", "sft", "full_determinism", True, "seed"),
    ("grpo", "train", "fsdp", "full_shard", "torchrun"),
    ("grpo", "train", "use_adaptive_entropy", True, "entropy_coef"),
    ("grpo", "train", "router_aux_loss_coef", 0.01, "none"),
    ("grpo", "train", "resume_from_checkpoint", "run/checkpoint-2", "qerl train --resume"),  # TRL's script resumes
    ("grpo", "train", "dataset_train_split", "test", "dataset_config: {split: NAME}"),
    ("grpo", "train", "shuffle_dataset", False, "seed"),  # TRL's GRPO then takes the prompts in order
    ("grpo", "train", "chat_template_kwargs", {"enable_thinking": False}, "system_prompt")])
def test_another_value_of_a_field_that_changes_the_result_is_refused_by_name(cli, tmp_path, model, kind, command,
                                                                            field, value, nearest):
    rc, _, err = cli(command, _defaults_file(tmp_path, model, kind, **{field: value}), "--print_config")
    assert rc == 2
    line = [x for x in err.splitlines() if field in x]
    assert len(line) == 1 and "not implemented in qerl" in line[0] and f"nearest: {nearest}" in line[0], err


def test_a_field_without_an_effect_is_ignored_at_any_value_and_named(cli, tmp_path, model):
    path = tmp_path / "sft.yaml"
    path.write_text(f"model_name_or_path: {model}\ndataset_name: {_data(tmp_path)}\noutput_dir: {tmp_path / 'run'}\n"
                    "eval_on_start: true\nlogging_dir: logs\nenable_jit_checkpoint: true\nfull_determinism: false\n")
    rc, out, err = cli("sft", path, "--print_config")
    assert rc == 0, err
    ignored, at_default = _notice(out).split("; at TRL's default")
    assert "eval_on_start, logging_dir, enable_jit_checkpoint" in ignored and "full_determinism" in at_default


def test_the_api_takes_trls_defaults_and_refuses_another_value():
    from qerl.trl import GRPOConfig, SFTConfig

    SFTConfig(output_dir="x", neftune_noise_alpha=None, eval_on_start=False, fsdp=None, full_determinism=False)
    GRPOConfig(output_dir="x", router_aux_loss_coef=None, ref_model_sync_steps=64, full_determinism=False)
    with pytest.raises(ValueError, match="neftune_noise_alpha=5.0 is not implemented in qerl"):
        SFTConfig(output_dir="x", neftune_noise_alpha=5.0)


def test_the_table_is_trls():
    """The generated block equals TRL's dataclasses (regenerate: see qerl/train/trl_fields.py's doc)."""
    pytest.importorskip("trl")
    from qerl.train import trl_fields as table

    generated = {}
    exec(table._generate(), {"math": __import__("math")}, generated)  # noqa: S102
    for name in ("BASE", "GRPO", "SFT", "MODEL", "SCRIPT", "GRPO_SCRIPT"):
        assert getattr(table, name) == generated[name], name

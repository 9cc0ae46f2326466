"""Config values are typed by their field and checked in range before any model loads, each bad value an
error naming its field (and file). Every field GRPO and SFT share is checked once (TrainConfig.validate,
train/checks.py), so a bad value is refused alike by GRPOConfig, SFTConfig, `qerl train` and `qerl sft`
(issue 48: SFT took save_total_limit=-1, which deleted each checkpoint as it was written, learning_rate=inf,
seed=-1, ...)."""

from __future__ import annotations

import dataclasses

import pytest

from qerl.rl import GRPOConfig
from qerl.sft import SFTConfig
from qerl.train.config import TrainConfig


# (field, bad value as the command line writes it): every field of TrainConfig at least once
BAD = [
    ("model_name_or_path", ""),
    ("quant", "int3"),
    ("lora_r", "0"),
    ("lora_alpha", "0"),
    ("lora_alpha", "inf"),
    ("lora_dropout", "1.0"),
    ("lora_target_modules", "[]"),
    ("dtype", "float8"),
    ("device", "tpu"),
    ("lora_dtype", "float64"),
    ("trust_remote_code", "maybe"),
    ("modules_to_not_convert", "re:("),
    ("learning_rate", "inf"),
    ("learning_rate", "0"),
    ("lr_scheduler_type", "step"),
    ("warmup_steps", "-20"),
    ("weight_decay", "-0.1"),
    ("adam_beta1", "1.0"),
    ("adam_beta2", "1.5"),
    ("adam_epsilon", "0"),
    ("max_grad_norm", "-1"),
    ("max_grad_norm", "inf"),
    ("optim", "sgd"),
    ("max_steps", "0"),
    ("max_steps", "-2"),
    ("per_device_train_batch_size", "0"),
    ("gradient_accumulation_steps", "0"),
    ("gradient_checkpointing", "maybe"),
    ("logprob_chunk_size", "0"),
    ("seed", "-1"),
    ("seed", str(2**32)),
    ("output_dir", ""),
    ("overwrite_output_dir", "maybe"),
    ("logging_steps", "-1"),
    ("save_strategy", "epoch"),
    ("save_steps", "0"),
    ("save_total_limit", "0"),
    ("save_total_limit", "-1"),
    ("report_to", "neptune"),
    ("ddp_timeout", "0"),
    ("ddp_backend", "mpi"),
    ("run_name", " "),
    ("lm_head_4bit", "maybe"),
    ("embed_4bit", "maybe"),
]


CONFIGS = {"GRPOConfig": GRPOConfig, "SFTConfig": SFTConfig}


COMMANDS = {"GRPOConfig": "train", "SFTConfig": "sft"}


def test_every_shared_field_has_a_bad_value():
    assert {f.name for f in dataclasses.fields(TrainConfig)} == {name for name, _ in BAD}


def _value(cls, name, text):
    """The bad value as a keyword argument: the command line's text read as the field's type reads it."""
    from qerl.train.fields import parse_value

    return parse_value(name, text, cls)


@pytest.mark.parametrize("which", CONFIGS)
@pytest.mark.parametrize(("name", "text"), BAD)
def test_a_bad_shared_value_is_refused_by_both_configs(which, name, text):
    cls = CONFIGS[which]
    with pytest.raises(ValueError, match=rf"(field '{name}'|--{name}\b)"):
        cls(**{name: _value(cls, name, text)})
    with pytest.raises(ValueError, match=rf"field '{name}'"):  # the same value from a config file
        cls.from_dict({name: _value(cls, name, text)}, source="run.yaml")


@pytest.mark.parametrize("which", CONFIGS)
@pytest.mark.parametrize(("name", "text"), BAD)
def test_a_bad_shared_value_is_one_line_from_both_clis(which, name, text, cli):
    rc, out, err = cli(COMMANDS[which], "--print_config", f"--{name}={text}")
    assert rc == 2
    assert out == ""  # no config printed: it was refused before anything else
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"qerl {COMMANDS[which]}: error:"), err
    assert f"'{name}'" in lines[0] or f"--{name}" in lines[0], lines[0]


# (field, a value at the edge of its range, the nearest value past that edge)
EDGES = [
    ("save_total_limit", 1, 0), ("seed", 0, -1), ("seed", 2**32 - 1, 2**32), ("warmup_steps", 0, -1),
    ("max_grad_norm", 0.0, -1e-9), ("weight_decay", 0.0, -1e-9), ("adam_beta1", 0.0, -1e-9),
    ("adam_beta2", 1 - 1e-9, 1.0), ("learning_rate", 1.0, 1.0 + 2**-52), ("learning_rate", 1e-12, 0.0),
    ("logging_steps", 0, -1), ("lora_dropout", 0.0, -1e-9), ("lora_dropout", 1 - 1e-9, 1.0),
    ("logprob_chunk_size", 1, 0), ("lora_r", 1, 0), ("ddp_timeout", 1, 0), ("save_steps", 1, 0),
    ("device", "cuda:1", "cuda:x"), ("ddp_backend", "gloo", "mpi"),
]


@pytest.mark.parametrize("which", CONFIGS)
@pytest.mark.parametrize(("name", "edge", "past"), EDGES)
def test_the_edges_of_the_ranges_are_accepted_and_one_step_past_them_refused(which, name, edge, past):
    cls = CONFIGS[which]
    assert getattr(cls(**{name: edge}), name) == edge  # accepted, and kept as given
    with pytest.raises(ValueError, match=rf"field '{name}'"):
        cls(**{name: past})


@pytest.mark.parametrize("which", CONFIGS)
def test_the_nullable_fields_take_null(which):
    cfg = CONFIGS[which](logprob_chunk_size=None, save_total_limit=None, ddp_backend=None, run_name=None)
    assert (cfg.logprob_chunk_size, cfg.save_total_limit, cfg.ddp_backend, cfg.run_name) == (None,) * 4


def test_sft_max_steps_minus_one_takes_the_epochs_and_refuses_infinite_ones():
    assert SFTConfig(max_steps=-1, num_train_epochs=2.0).steps_for(10) == 3  # ceil(2 * 10 / 8)
    with pytest.raises(ValueError, match="num_train_epochs"):
        SFTConfig(num_train_epochs=float("inf"))
    with pytest.raises(ValueError, match="num_train_epochs"):
        SFTConfig(max_steps=-1, num_train_epochs=0.0)
    with pytest.raises(ValueError, match="max_steps"):
        GRPOConfig(max_steps=-1)  # GRPO has no epochs


# ---- config values are typed ---------------------------------------------------------------------
def _yaml(tmp_path, text):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("text,field,want", [
    ("learning_rate: 2e-5", "learning_rate", 2e-5), ("max_steps: '6'", "max_steps", 6),
    ("max_steps: 6.0", "max_steps", 6), ("aqn: 'false'", "aqn", False), ("aqn: 'no'", "aqn", False),
    ("aqn: 'Yes'", "aqn", True), ("aqn: 'true'", "aqn", True), ("lora_alpha: 16", "lora_alpha", 16.0),
    ("epsilon_high: null", "epsilon_high", None), ("reward_weights: ['1', 0.5]", "reward_weights", [1.0, 0.5]),
])
def test_yaml_values_are_coerced_by_the_field_type(tmp_path, text, field, want):
    got = getattr(GRPOConfig.from_yaml(_yaml(tmp_path, text)), field)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("text,field", [
    ("max_steps: 6.7", "max_steps"), ("max_steps: many", "max_steps"), ("max_steps: true", "max_steps"),
    ("aqn: 'maybe'", "aqn"), ("aqn: 2", "aqn"), ("learning_rate: fast", "learning_rate"),
    ("learning_rate: .nan", "learning_rate"), ("quant: 4", "quant"), ("dataset_config: size", "dataset_config"),
    ("lora_target_modules: 7", "lora_target_modules"), ("reward_weights: [a]", "reward_weights"),
])
def test_bad_yaml_values_name_the_field_and_the_file(tmp_path, text, field):
    with pytest.raises(ValueError, match=rf"run\.yaml: field '{field}': "):
        GRPOConfig.from_yaml(_yaml(tmp_path, text))


def test_command_line_values_are_typed_the_same_way():
    c = GRPOConfig().with_overrides({"max_steps": "6", "learning_rate": "2e-5", "aqn": "no", "system_prompt": "null",
                                     "model_name_or_path": "2024"})
    assert (c.max_steps, c.learning_rate, c.aqn, c.system_prompt, c.model_name_or_path) == (6, 2e-5, False, None, "2024")
    assert type(c.max_steps) is int and type(c.learning_rate) is float
    with pytest.raises(ValueError, match=r"command line: --max_steps: 6.7 is not an integer"):
        GRPOConfig().with_overrides({"max_steps": "6.7"})
    with pytest.raises(ValueError, match=r"command line: --aqn: 'maybe' is not a boolean"):
        GRPOConfig().with_overrides({"aqn": "maybe"})


def test_the_cli_rejects_a_bad_value_before_loading_any_model(tmp_path, monkeypatch):
    import argparse

    from qerl.cli import train

    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("qerl.model.load_policy", no_model)
    p = _yaml(tmp_path, "max_steps: 6.7\n")
    args = argparse.Namespace(overrides=[str(p)], resume=None, print_config=False)
    with pytest.raises(ValueError, match=r"run\.yaml: field 'max_steps'"):
        train.run(args)


# ---- every field in its range, before any model loads ---------------------------------------------
@pytest.mark.parametrize("flags, field", [
    (["--aqn_sigma_start", "inf"], "aqn_sigma_start"), (["--aqn_sigma_start", "1e30"], "aqn_sigma_start"),
    (["--aqn_sigma_start", "-1"], "aqn_sigma_start"), (["--epsilon", "-1"], "epsilon"), (["--beta", "-1"], "beta"),
    (["--aqn_schedule", "adaptive", "--aqn_adaptive_signal", "zero_variance", "--aqn_adaptive_target", "2"],
     "aqn_adaptive_target"),
    (["--report_to", "neptune"], "report_to"), (["--learning_rate", "inf"], "learning_rate"),
    (["--learning_rate", "-1e-3"], "learning_rate"), (["--tool_timeout_s", "inf"], "tool_timeout_s"),
    (["--seed", str(2**70)], "seed"), (["--max_prompt_length", "0"], "max_prompt_length"),
    (["--lora_target_modules", "[]"], "lora_target_modules"), (["--parity_max_logprob_diff", "0"],
                                                               "parity_max_logprob_diff"),
    (["--temperature", "0"], "temperature"), (["--adam_beta2", "1"], "adam_beta2"),
    (["--weight_decay", "nan"], "weight_decay"),
])
def test_out_of_range_values_name_their_field(cli, tmp_path, flags, field, no_model_load):
    rc, _, err = cli("train", *flags, "--output_dir", tmp_path / "run")
    assert rc == 2 and (f"'{field}'" in err or f"--{field}" in err), err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_every_default_and_the_default_run_are_in_range(monkeypatch, tmp_path, fast_bf16):
    """Each is accepted as built and again as its run's config.yaml reads back (both validate), field for field;
    the default run's are the settings its dicts name, on both CPU branches and the GPU."""
    from qerl.rl import default_run

    monkeypatch.setattr(default_run, "cpu_has_fast_bf16", lambda: fast_bf16)
    made = {"grpo": GRPOConfig(), "sft": SFTConfig(), "cpu": default_run.default_run_config("cpu"),
            "cuda": default_run.default_run_config("cuda")}
    for name, cfg in made.items():
        p = tmp_path / f"{name}.yaml"
        p.write_text(cfg.to_yaml())
        assert type(cfg).from_yaml(p) == cfg, name
    cpu = default_run.CPU if fast_bf16 else dict(default_run.CPU, dtype="float32", max_steps=default_run.STEPS_FP32)
    for cfg, want in ((made["cpu"], cpu), (made["cuda"], default_run.GPU)):
        assert {k: getattr(cfg, k) for k in want} == want

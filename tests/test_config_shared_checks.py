"""Every field GRPO and SFT share is checked once (TrainConfig.validate, train/checks.py), so a bad value is
refused alike by GRPOConfig, SFTConfig, `qerl train` and `qerl sft`, naming its field (issue 48: SFT took
save_total_limit=-1, which deleted each checkpoint as it was written, learning_rate=inf, seed=-1, ...)."""

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


@pytest.mark.parametrize("which", CONFIGS)
def test_the_defaults_and_the_edges_of_the_ranges_are_accepted(which):
    cls = CONFIGS[which]
    cls(save_total_limit=1, seed=0, warmup_steps=0, max_grad_norm=0.0, weight_decay=0.0, adam_beta1=0.0,
        learning_rate=1.0, logging_steps=0, lora_dropout=0.0, logprob_chunk_size=None, ddp_backend="gloo")
    cls(seed=2**32 - 1, device="cuda:1", save_total_limit=None)


def test_sft_max_steps_minus_one_takes_the_epochs_and_refuses_infinite_ones():
    assert SFTConfig(max_steps=-1, num_train_epochs=2.0).steps_for(10) == 3  # ceil(2 * 10 / 8)
    with pytest.raises(ValueError, match="num_train_epochs"):
        SFTConfig(num_train_epochs=float("inf"))
    with pytest.raises(ValueError, match="num_train_epochs"):
        SFTConfig(max_steps=-1, num_train_epochs=0.0)
    with pytest.raises(ValueError, match="max_steps"):
        GRPOConfig(max_steps=-1)  # GRPO has no epochs


"""Issue 21 §4, a CLI that explains itself: `qerl train --help` documents every config field
(type, default, help) in groups; `--model` is model_name_or_path; every --help has an example."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from qerl.cli import COMMANDS, main
from qerl.cli.config_help import GROUPS
from qerl.rl import GRPOConfig


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_every_config_field_belongs_to_exactly_one_help_group():
    grouped = [n for names in GROUPS.values() for n in names]
    fields = [f.name for f in dataclasses.fields(GRPOConfig)]
    assert len(grouped) == len(set(grouped)), "a field is in two groups"
    assert set(fields) - set(grouped) == set(), "fields without a help group (add them to cli/config_help.GROUPS)"
    assert set(grouped) - set(fields) == set(), "groups name fields GRPOConfig no longer has"


def test_train_help_lists_every_field_with_type_default_and_help(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100000")  # no wrapping (argparse breaks lines at hyphens)
    text = _help(capsys, "train")
    flat = re.sub(r"\s+", " ", text)
    hints = typing.get_type_hints(GRPOConfig)
    defaults = GRPOConfig()  # GRPOConfig's own defaults (a CONFIG.yaml's base)
    for f in dataclasses.fields(GRPOConfig):
        block = flat.split(f" --{f.name} ", 1)
        assert len(block) == 2, f"--{f.name} is not in the help"
        end = block[1].find(" --", block[1].index("; default: "))  # past aliases (--model), to the next flag
        entry = block[1][:end if end >= 0 else None]
        want_type = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
        default = getattr(defaults, f.name)
        assert re.sub(r"\s+", " ", f.metadata["help"]) in entry, f.name
        assert f"default: {'null' if default is None else repr(default)}]" in entry, (f.name, entry)
        assert {"dict": "mapping"}.get(want_type.__name__, want_type.__name__) in entry, (f.name, entry)


def test_train_help_groups_appear_in_trl_order(capsys):
    text = _help(capsys, "train")
    heads = [m.group(1) for m in re.finditer(r"^(\w+) \(config fields\):$", text, re.M)]
    assert heads == list(GROUPS)
    for first, second in (("model", "data"), ("data", "generation"), ("generation", "loss"), ("AQN", "logging"),
                          ("logging", "checkpoints")):
        assert heads.index(first) < heads.index(second)
    # a field sits under its own heading
    model_part = text.split("model (config fields):")[1].split("data (config fields):")[0]
    assert "--lora_r INT" in model_part and "--learning_rate" not in model_part


@pytest.mark.parametrize("flag", ["--model", "--model_name_or_path", "--model-name-or-path"])
def test_model_is_an_alias_of_model_name_or_path(capsys, flag):
    assert main(["train", flag, "Qwen/Qwen2.5-0.5B-Instruct", "--print_config"]) == 0
    assert "model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct" in capsys.readouterr().out


def test_flags_keep_their_meaning(capsys):
    """Values given through the documented flags go through the config's typing as before."""
    assert main(["train", "--aqn", "--lora_r", "8", "--learning_rate", "2e-5", "--lora-alpha", "16",
                 "--lora_target_modules", "q,v", "--eval_limit=4", "--print_config"]) == 0
    out = capsys.readouterr().out
    for line in ("aqn: true", "lora_r: 8", "learning_rate: 2.0e-05", "lora_alpha: 16.0", "lora_target_modules: [q, v]",
                 "eval_limit: 4"):
        assert line in out.splitlines(), line
    assert main(["train", "--aqn", "false", "--print_config"]) == 0
    assert "aqn: false" in capsys.readouterr().out.splitlines()


def test_a_misspelt_field_is_not_taken_as_an_abbreviation(capsys):
    assert main(["train", "--learning_rat", "1e-5", "--print_config"]) == 2
    assert "did you mean '--learning_rate'" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_subcommand_help_shows_an_example(capsys, name):
    text = _help(capsys, name)
    example = text.split("example:\n", 1)
    assert len(example) == 2 and example[1].lstrip().startswith(f"qerl {name}")

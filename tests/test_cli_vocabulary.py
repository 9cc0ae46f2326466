"""One flag vocabulary across train, sft, eval, generate and export (issue 49): TRL's names shown once in
--help, the old spellings still parse; --model_name_or_path everywhere; `qerl export` takes the base from
the adapter."""

import json
import re

import pytest

from tiny_models import save_tiny, tiny_tokenizer

COMMANDS = ("train", "sft", "eval", "generate", "export")


def _option_entries(help_text: str) -> list[str]:
    body = help_text.split("options:", 1)[1]
    return [line.strip() for line in body.splitlines() if re.match(r"^  -", line)]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_each_flag_once_in_trl_spelling(cli, command):
    rc, out, _ = cli(command, "--help")
    assert rc == 0
    for entry in _option_entries(out):
        longs = re.findall(r"--[A-Za-z][\w-]*", entry.split("  ")[0])
        assert len(longs) <= 1, entry  # one spelling, no alias beside it
        assert all("-" not in flag[2:] for flag in longs), entry  # TRL's underscores


@pytest.mark.parametrize("command", ("eval", "generate", "export", "train", "sft"))
def test_model_name_or_path_is_a_flag_of_every_command(cli, command):
    rc, out, _ = cli(command, "--help")
    assert "--model_name_or_path" in out


@pytest.mark.parametrize("old, new", [("--dataset", "--dataset_name"), ("--max-new-tokens", "--max_completion_length"),
                                      ("--max_new_tokens", "--max_completion_length"), ("--top-p", "--top_p")])
def test_old_eval_flags_still_parse_as_the_trl_flag(cli, old, new):
    value = "2" if "top" in old else "0"  # out of range: refused by the flag's own check, named as --help shows it
    if "dataset" in old:
        rc, _, err = cli("eval", old, "x", "--limit", "0")
        assert rc == 2 and "unrecognized" not in err and "--limit" in err
        return
    rc, _, err = cli("eval", old, value)
    assert rc == 2 and new in err and "unrecognized" not in err, err


def test_sft_takes_model_as_train_does(cli):
    rc, out, err = cli("sft", "--model", "some/model", "--print_config")
    assert rc == 0, err
    assert "\nmodel_name_or_path: some/model\n" in out


def test_export_takes_the_base_the_adapter_records(cli, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    save_tiny(base, "llama")
    tiny_tokenizer().save_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    adapted.save_pretrained(tmp_path / "adapter")
    recorded = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str(base)
    rc, out, err = cli("export", tmp_path / "merged", "--adapter", tmp_path / "adapter", "--quant", "bf16")
    assert rc == 0, err
    assert (tmp_path / "merged" / "config.json").is_file() and "wrote merged" in out


def test_export_without_base_or_adapter_says_what_to_give(cli, tmp_path):
    rc, _, err = cli("export", tmp_path / "merged")
    assert rc == 2 and "give the base MODEL" in err and len(err.strip().splitlines()) == 1

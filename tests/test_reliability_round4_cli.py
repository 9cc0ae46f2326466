"""Issue 40 through `qerl ...` (cli.main, or the installed command in a subprocess): Ctrl-C in a
command's first seconds is one line everywhere; `--resume` with max_steps below the run's step is
refused; a run folder without a checkpoint gets the same word from the fresh run and from `--resume`;
non-UTF-8 files are named with their line; the SFT -> GRPO hand-off works in the CLI; flags take both
spellings; hints show the command as it was invoked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import save_tiny, tiny_tokenizer

from qerl.cli import main

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("m") / "m"
    save_tiny(d, "llama")
    tiny_tokenizer().save_pretrained(d)
    return d


def train_args(model, out, *extra):
    return ["train", "--model", model, "--dataset_name", "arithmetic", "--dataset_config", "{size: 16, eval_size: 4}",
            "--max_steps", "2", "--generation_batch_size", "4", "--num_generations", "2",
            "--per_device_train_batch_size", "4", "--max_completion_length", "4", "--max_prompt_length", "64",
            "--aqn_stages", "2", "--save_steps", "1", "--report_to", "none", "--parity_check_steps", "0",
            "--optim", "adamw_torch", "--eval_on_start", "false", "--eval_on_end", "false", "--output_dir", out, *extra]


def sft_args(model, out, *extra):
    return ["sft", "--model_name_or_path", model, "--max_steps", "1", "--per_device_train_batch_size", "2",
            "--max_length", "128", "--report_to", "none", "--output_dir", out, *extra]


@pytest.fixture(scope="module")
def finished(model, tmp_path_factory):
    run = tmp_path_factory.mktemp("f") / "run"
    assert main([str(a) for a in train_args(model, run)]) == 0
    return run


# ---- Ctrl-C in a command's first seconds: tests/test_cli_interrupts.py (timed from qerl's handler, under load)
def test_ctrl_c_while_an_export_loads_is_one_line(cli, model, tmp_path, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("qerl.model.load_policy", interrupted)
    out = tmp_path / "merged"
    out.mkdir()
    (out / "old.txt").write_text("kept")
    rc, _, err = cli("export", model, out, "--overwrite")
    assert rc == 130 and err.strip() == "qerl export: stopped by SIGINT; nothing written (the output folder is unchanged)"
    assert (out / "old.txt").read_text() == "kept"


# ---- resume ---------------------------------------------------------------------------------------------
def test_resume_with_max_steps_below_the_runs_step_is_refused(cli, finished, no_model_load):
    before = (finished / "adapter" / "adapter_model.safetensors").read_bytes()
    rc, _, err = cli("train", "--resume", finished, "--max_steps", "1")
    assert rc == 2 and "is at step 2; max_steps 1 is below it" in err and "--max_steps N (N > 2)" in err, err
    assert (finished / "adapter" / "adapter_model.safetensors").read_bytes() == before


def test_a_run_without_a_checkpoint_gets_the_same_word_from_both_commands(cli, model, tmp_path, no_model_load):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # a run interrupted before its first save
    (run / "config.yaml").write_text((Path(SRC).parent / "configs" / "default.yaml").read_text()
                                     if (Path(SRC).parent / "configs" / "default.yaml").is_file() else "max_steps: 36\n")
    rc, _, fresh = cli(*train_args(model, run))
    assert rc == 2 and "no checkpoint to continue from" in fresh and "--resume" not in fresh, fresh
    rc, _, resumed = cli("train", "--resume", run)
    assert rc == 2 and "no checkpoint to resume from" in resumed, resumed
    assert "--overwrite_output_dir" in fresh and "--overwrite_output_dir" in resumed


def test_a_run_with_a_checkpoint_is_continued_with_resume(cli, model, finished, tmp_path, no_model_load):
    rc, _, err = cli(*train_args(model, finished))
    assert rc == 2 and f"qerl train --resume {finished}" in err


# ---- files that are not UTF-8 -------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_config_file_that_is_not_utf8_names_the_file_and_line(cli, tmp_path, command, no_model_load):
    f = tmp_path / "c.yaml"
    f.write_bytes(b"max_steps: 3\n# caf\xe9\n")
    rc, _, err = cli(command, f)
    assert rc == 2 and f"{f}:2: not UTF-8" in err and "0xe9" in err, err


def test_sft_data_that_is_not_utf8_names_the_file_and_line(cli, model, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    rc, _, err = cli(*sft_args(model, tmp_path / "run", "--dataset_name", data))
    assert rc == 2 and f"{data}:2: not UTF-8" in err, err


# ---- the SFT -> GRPO hand-off, as the README shows it -------------------------------------------------------
def test_train_starts_from_the_sft_adapter_folder_in_the_cli(cli, model, tmp_path):
    sft = tmp_path / "sft"
    rc, _, err = cli(*sft_args(model, sft))
    assert rc == 0, err
    adapter = sft / "adapter"
    assert not (adapter / "config.json").exists()  # an adapter folder, not a model folder
    rc, out, err = cli(*train_args(adapter, tmp_path / "rl", "--max_steps", "1"))
    assert rc == 0, err
    rl = json.loads((tmp_path / "rl" / "adapter" / "adapter_config.json").read_text())
    assert Path(rl["base_model_name_or_path"]).resolve() == model.resolve()  # the real base, which PEFT loads
    # and the run is evaluated as it trained: the base under the run's adapter (the run's model is the
    # SFT adapter folder, which has no config.json)
    rc, out, err = cli("eval", tmp_path / "rl", "--limit", "2", "--out", tmp_path / "rep.json")
    assert rc == 0, err
    rep = json.loads((tmp_path / "rep.json").read_text())
    assert rep["params"]["adapter"] == str(tmp_path / "rl" / "adapter") and rep["problems"] == 2
    # an adapter folder given as MODEL: its base with that adapter
    rc, out, err = cli("generate", adapter, "--prompt", "1+1=", "--max-new-tokens", "2", "--device", "cpu", "--json")
    assert rc == 0, err


# ---- one flag convention ------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, flag", [  # every spelling parses; errors name the flag as --help shows it (issue 49)
    (["eval", "--max_new_tokens", "0"], "--max_completion_length"),
    (["eval", "--max-new-tokens", "0"], "--max_completion_length"),
    (["generate", "--prompt", "hi", "--top_p", "0"], "--top_p"),
    (["generate", "--prompt", "hi", "--top-k", "-1"], "--top_k"),
])
def test_both_spellings_reach_the_same_flag(cli, argv, flag):
    rc, _, err = cli(*argv)
    assert rc == 2 and flag in err and "unrecognized" not in err, err


def test_train_and_sft_take_dashes_and_underscores(cli):
    for command in ("train", "sft"):
        rc, out, err = cli(command, "--print-config", "--max-steps", "7", "--learning_rate", "3e-05")
        assert rc == 0, err
        assert "\nmax_steps: 7\n" in out and "\nlearning_rate: 3.0e-05\n" in out, out


def test_help_shows_one_spelling(cli):
    """issue 49: --help lists each flag once, under TRL's name and spelling; the others still parse."""
    rc, out, _ = cli("eval", "--help")
    assert rc == 0 and "--max_completion_length MAX_COMPLETION_LENGTH" in out and "max-new-tokens" not in out
    assert "--dataset_name" in out and "--dataset " not in out and "--top-p" not in out
    rc, out, _ = cli("train", "--help")
    assert rc == 0 and "--print_config" in out and "--print-config" not in out and "\n  --model " not in out


def test_quantize_takes_trust_remote_code_with_underscores(cli, tmp_path, model, no_model_load):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    rc, _, err = cli("quantize", model, tmp_path / "out", "--trust_remote_code")
    assert rc == 2 and "not empty" in err  # parsed, then refused by the output guard


# ---- hints show the command as invoked ----------------------------------------------------------------------
def test_the_hint_is_the_command_as_invoked(monkeypatch, tmp_path):
    from qerl.cli.invocation import qerl_command

    script = tmp_path / ".venv" / "bin" / "qerl"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # the venv not activated
    assert qerl_command(str(script)) == ".venv/bin/qerl"  # what the README runs, and what works when pasted
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")  # activated: `qerl` works
    assert qerl_command(str(script)) == "qerl"
    assert qerl_command(str(Path(SRC) / "qerl" / "__main__.py")).endswith(" -m qerl")


def test_the_installed_command_prints_its_own_path_in_a_resume_hint(model, finished, tmp_path):
    script = Path(sys.executable).parent / "qerl"
    if not script.is_file():
        pytest.skip("qerl is not installed as a command next to this python")
    env = {**os.environ, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([str(script), *map(str, train_args(model, finished))], capture_output=True, text=True, env=env,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 2
    assert f"{os.path.relpath(script, tmp_path)} train --resume {finished}" in r.stderr, r.stderr


# ---- a hub id that cannot be reached offline -------------------------------------------------------------
def _offline(monkeypatch):
    import huggingface_hub

    def unreachable(*a, **k):
        raise OSError("Name or service not known")  # as on this machine: no network

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)


def test_an_unreachable_hub_id_is_one_line_naming_the_offline_choices(cli, monkeypatch, tmp_path, no_model_load):
    _offline(monkeypatch)
    monkeypatch.chdir(tmp_path)
    rc, _, err = cli("eval", "HuggingFaceTB/SmolLM2-135M-Instruct", "--limit", "1")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "'smollm2'" in err and "hub download failed" in err, err


def test_qerl_trl_with_an_unreachable_hub_id_names_the_offline_choices(monkeypatch, tmp_path, no_model_load):
    from qerl.trl import GRPOConfig, GRPOTrainer

    _offline(monkeypatch)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"HuggingFaceTB/SmolLM2-135M-Instruct.*'smollm2'"):
        GRPOTrainer(model="HuggingFaceTB/SmolLM2-135M-Instruct", reward_funcs=lambda completions, **_: [0.0],
                    args=GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=1),
                    train_dataset=[{"prompt": "1+1="}])


# ---- --help says what a bare `qerl train` runs -------------------------------------------------------------
def test_train_help_shows_the_bare_runs_dataset(cli):
    import re

    import yaml

    rc, printed, _ = cli("train", "--print_config")
    bare = yaml.safe_load(printed)
    rc, out, _ = cli("train", "--help")
    entries = {e.split()[0]: " ".join(e.split()) for e in re.split(r"\n  (?=--)", out) if e.startswith("--")}
    for field in ("dataset_name", "max_steps", "learning_rate"):
        assert f"a bare `qerl train`: {bare[field]!r}" in entries[f"--{field}"], entries[f"--{field}"]

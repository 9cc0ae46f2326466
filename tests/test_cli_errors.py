"""The command line's errors, interrupts and hints, each through its entry point (`cli.main`, or the installed
command in a subprocess). A clear error is exit status 2 and one line naming the field, flag, file or row,
with no traceback, before any model loads where the input alone shows it; Ctrl-C in a command's first seconds
is one line; a resume hint is the command as the user ran it; flags take dashes and underscores."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_runs import one_line, sft_args, train_args
from tiny_models import tiny_tokenizer

from qerl.cli import main


def evaluated_args(model, out, *extra):
    """The short run with held-out evaluations before and after, keeping two checkpoints."""
    return train_args(model, out, "--save_total_limit", "2", "--eval_on_start", "true", "--eval_on_end", "true",
                      *extra)


SRC = str(Path(__file__).resolve().parents[1] / "src")


def model_with_config(model, folder, **fields):
    """A copy of the model folder with these config.json fields changed."""
    import shutil

    shutil.copytree(model, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **fields}))
    return folder


# ---- tracebacks before ------------------------------------------------------------------------------
def test_a_lone_surrogate_in_a_jsonl_names_file_line_and_field(cli, tmp_path, model, no_model_load):
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]
    rows[3]["question"] = "What is \ud800?"
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, _, err = cli("eval", model, "--dataset", data, "--split", "train")
    assert rc == 2 and "d.jsonl line 4" in err and "'question'" in err and "surrogate" in err and one_line(err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_train_on_cuda_without_a_gpu_is_refused_before_loading(cli, tmp_path, model, no_model_load):
    rc, _, err = cli(*evaluated_args(model, tmp_path / "run"), "--device", "cuda")
    assert rc == 2 and "'device'" in err and "CUDA is not available" in err and one_line(err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_float16_on_the_cpu_is_refused_before_loading(cli, tmp_path, model, no_model_load):
    rc, _, err = cli(*evaluated_args(model, tmp_path / "run"), "--dtype", "float16")
    assert rc == 2 and "'dtype'" in err and "float16 is not supported on the CPU" in err


@pytest.mark.parametrize("command", ["generate", "train", "export"])
def test_a_llama_config_relabelled_falcon_is_named(cli, tmp_path, model, command, no_model_load):
    bad = model_with_config(model, tmp_path / "f", model_type="falcon", architectures=["FalconForCausalLM"])
    args = {"generate": ["generate", bad, "--prompt", "hi", "--device", "cpu"],
            "train": evaluated_args(bad, tmp_path / "run"), "export": ["export", bad, tmp_path / "out"]}[command]
    rc, _, err = cli(*args)
    assert rc == 2 and "config.json: unsupported architecture ['FalconForCausalLM']" in err and one_line(err)


def test_a_model_type_that_contradicts_the_config_is_named(cli, tmp_path, model, no_model_load):
    bad = model_with_config(model, tmp_path / "f", model_type="falcon")
    rc, _, err = cli("generate", bad, "--prompt", "hi", "--device", "cpu")
    assert rc == 2 and "transformers cannot read it as a 'falcon' config" in err and one_line(err)


def test_api_rows_without_a_prompt_past_row_0_name_the_row(tmp_path):
    from qerl.model import random_policy
    from qerl.rl import GRPOConfig, GRPOTrainer
    from tiny_models import config

    pol = random_policy(config("llama"), "nvfp4", lora_rank=2, device="cpu", dtype=torch.float32, progress=False)
    pol.tokenizer = tiny_tokenizer()
    rows = [{"prompt": "1+1?", "answer": "2"}] * 3 + [{"question": "2+2?", "answer": "4"}]
    with pytest.raises(ValueError, match=r"train_dataset row 3: no 'prompt'"):
        GRPOTrainer(GRPOConfig(output_dir=str(tmp_path / "r"), report_to="none"), policy=pol, train_dataset=rows,
                    reward_funcs=[lambda completions, **_: [0.0] * len(completions)], progress=False)


def test_a_full_disk_at_a_save_is_one_line_saying_what_is_kept(cli, tmp_path, model, monkeypatch):
    from safetensors import SafetensorError

    import qerl.train.checkpoints as state

    real = state.save_file
    calls = []

    def fill(tensors, path, *a, **k):
        calls.append(path)
        if len(calls) > 3:  # checkpoint-1 whole (trainable, optimizer, rng), then the disk is full
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(state, "save_file", fill)
    run = tmp_path / "run"
    rc, _, err = cli(*evaluated_args(model, run, "--eval_on_start", "false", "--eval_on_end", "false"))
    last = err.strip().splitlines()[-1]  # after the load's and the bar's progress lines
    assert rc == 2 and last.startswith("qerl train: error: no space left on the disk")
    assert f"saved: {run / 'checkpoint-1'}" in last and f"qerl train --resume {run}" in last
    assert [p.name for p in run.iterdir() if p.name.startswith("checkpoint")] == ["checkpoint-1"]


# ---- unclear before ----------------------------------------------------------------------------------
def test_a_dataset_path_that_is_a_folder_says_so(cli, tmp_path, model, no_model_load):
    (tmp_path / "data.jsonl").mkdir()
    rc, _, err = cli("eval", model, "--dataset", tmp_path / "data.jsonl")
    assert rc == 2 and "is a folder" in err and "no such file" not in err


def test_an_output_dir_that_is_a_file_fails_before_loading(cli, tmp_path, model, no_model_load):
    (tmp_path / "out").write_text("x")
    for out in (tmp_path / "out", tmp_path / "out" / "run"):
        rc, _, err = cli(*evaluated_args(model, out))
        assert rc == 2 and "'output_dir'" in err and "a file" in err and one_line(err)


def test_eval_out_a_folder_fails_before_loading_and_leaves_nothing(cli, tmp_path, model, no_model_load):
    (tmp_path / "w").mkdir()
    rc, _, err = cli("eval", model, "--dataset", "arithmetic", "--limit", "1", "--out", tmp_path / "w")
    assert rc == 2 and "is a folder" in err and sorted(p.name for p in tmp_path.iterdir()) == ["w"]


def test_a_locked_run_folder_is_refused_before_loading(cli, tmp_path, model, no_model_load):
    import socket

    run = tmp_path / "run"
    run.mkdir()
    (run / ".qerl.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": 0}))
    rc, _, err = cli(*evaluated_args(model, run))
    assert rc == 2 and "another qerl run is using this folder" in err


def test_eval_temperature_zero_is_greedy_and_the_run_finishes_with_its_adapter(cli, tmp_path, model):
    run = tmp_path / "run"
    rc, out, err = cli(*evaluated_args(model, run, "--eval_temperature", "0"))
    assert rc == 0, err
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    rep = json.loads((run / "eval" / "step_2.json").read_text())
    assert rep["params"]["greedy"] is True


# ---- the first hour --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished(model, tmp_path_factory):
    """A finished 2-step run with its start and end evaluations, run once through the CLI."""
    run = tmp_path_factory.mktemp("f") / "run"
    assert main([str(a) for a in evaluated_args(model, run, "--logging_steps", "1")]) == 0
    return run


def test_resuming_a_finished_run_says_so_without_loading(finished, cli, no_model_load):
    before = (finished / "metrics.jsonl").read_text()
    rc, out, _ = cli("train", "--resume", finished)
    assert rc == 0 and "is finished (step 2/2)" in out and f"qerl eval {finished}" in out
    assert "| before | 0 |" in out and "| after | 2 |" in out  # the run's own summary
    assert (finished / "metrics.jsonl").read_text() == before  # nothing re-evaluated


def test_the_summary_after_a_resume_has_the_before_row(model, tmp_path, cli):
    run = tmp_path / "run"
    assert cli(*evaluated_args(model, run, "--max_steps", "1", "--eval_on_end", "false"))[0] == 0
    rc, out, err = cli("train", "--resume", run, "--max_steps", "2", "--eval_on_end", "true")
    assert rc == 0, err
    assert "| before | 0 |" in out and "| after | 2 |" in out and "| change |" in out


def test_eval_of_a_run_folder_uses_its_adapter_and_task_settings(finished, cli):
    rc, out, err = cli("eval", finished, "--out", finished.parent / "rep.json")
    assert rc == 0, err
    rep = json.loads((finished.parent / "rep.json").read_text())
    mine = json.loads((finished / "eval" / "step_2.json").read_text())
    # the run's own final evaluation: same problems, samples, settings and adapter -> same score
    assert (rep["dataset"], rep["problems"], rep["samples"]) == (mine["dataset"], mine["problems"], mine["samples"])
    assert rep["params"]["adapter"] == str(finished / "adapter") and rep["params"]["temperature"] == 0.6
    assert [p["completions"] for p in rep["per_problem"]] == [p["completions"] for p in mine["per_problem"]]


def test_the_start_evaluation_is_its_own_phase_and_logging_steps_print_with_the_bar(model, tmp_path, cli):
    rc, out, err = cli(*evaluated_args(model, tmp_path / "run", "--logging_steps", "1"))
    assert rc == 0
    # the evaluation before training runs before the train bar exists (its time is not step 1's)
    assert err.index("eval arithmetic: 4 problems") < err.index("train:")
    assert err.rindex("eval arithmetic: 4 problems") > err.rindex("train:")  # so does the final one, after the bar
    assert [x.split()[0] for x in out.splitlines() if x.startswith("step=")] == ["step=1", "step=2"]
    # after the first step, the whole run's time left (the parity check's one-off seconds left out)
    (eta,) = [x for x in out.splitlines() if "estimated time left" in x]
    assert eta.startswith("qerl train: the first step took") and "(1 step x" in eta


def test_eval_help_shows_defaults(cli):
    rc, out, _ = cli("eval", "--help")
    assert rc == 0
    import re

    entries = re.split(r"\n  (?=-)", out.split("options:", 1)[1])
    for flag, default in (("--temperature", "0.6"), ("--top_p", "0.95"), ("--max_completion_length", "512"),
                          ("--dataset_name", "gsm8k-offline"), ("--samples", "1"), ("--quant", "auto")):
        (entry,) = [e for e in entries if e.startswith((flag + " ", flag + ","))]
        assert f"(default: {default})" in " ".join(entry.split()), flag
    assert "qerl eval runs/default" in out


def test_torchrun_says_how_many_ranks(model, tmp_path):
    """Two gloo ranks on the CPU: rank 0 says the rank count once."""
    port = 29500 + os.getpid() % 1000
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", f"--master_port={port}", "-m",
           "qerl", *map(str, evaluated_args(model, tmp_path / "run", "--eval_on_start", "false", "--eval_on_end", "false",
                                        "--max_steps", "1", "--per_device_train_batch_size", "2"))]
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("qerl train: 2 ranks (gloo)") == 1


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_end_with_one_line_and_the_resume_command(model, tmp_path, sig):
    run = tmp_path / "run"
    args = evaluated_args(model, run, "--max_steps", "100000", "--eval_on_start", "false", "--eval_on_end", "false",
                      "--save_steps", "2")
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "qerl", *map(str, args)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    deadline = time.monotonic() + 300  # a loaded 2-core machine takes minutes to import, load and train 2 steps
    # any checkpoint: at tens of steps a second checkpoint-2 is already rotated out between two polls
    while not any(run.glob("checkpoint-*")) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.2)
    os.killpg(p.pid, sig)  # as a terminal's Ctrl-C: the whole process group
    out, err = p.communicate(timeout=120)
    assert any(run.glob("checkpoint-*")), f"no checkpoint within 300 s: {err[-2000:]}"
    assert p.returncode == (130 if sig == signal.SIGINT else 143), err[-2000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    name = "SIGINT" if sig == signal.SIGINT else "SIGTERM"
    assert last.startswith(f"qerl train: stopped by {name} at step") and f"qerl train --resume {run}" in last
    assert "saved: " + str(run / "checkpoint-") in last


# ---- Ctrl-C in a command's first seconds: one line, qerl train's, everywhere -----------------------------
# Ctrl-C in a command's first seconds: tests/test_cli_interrupts.py (timed from qerl's handler, under load)
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


@pytest.fixture(scope="module")
def sft_run(model, tmp_path_factory):
    """An SFT run of 2 steps, a checkpoint each step, through the CLI."""
    run = tmp_path_factory.mktemp("s") / "run"
    assert main([str(a) for a in sft_args(model, run, "--max_steps", "2", "--save_steps", "1")]) == 0
    return run


def test_resuming_a_run_with_the_other_command_names_the_run_and_its_command(cli, finished, sft_run, no_model_load):
    rc, _, err = cli("sft", "--resume", finished)
    assert rc == 2 and f"{finished} holds a GRPO run of `qerl train`" in err and one_line(err), err
    assert f"qerl train --resume {finished}" in err and "unknown field" not in err
    rc, _, err = cli("train", "--resume", sft_run)
    assert rc == 2 and f"{sft_run} holds an SFT run of `qerl sft`" in err and one_line(err), err
    assert f"qerl sft --resume {sft_run}" in err and "unknown field" not in err


def test_sft_resume_below_the_runs_step_is_refused_as_train_refuses_it(cli, finished, sft_run, no_model_load):
    before = (sft_run / "adapter" / "adapter_model.safetensors").read_bytes()
    rc, _, err = cli("sft", "--resume", sft_run, "--max_steps", "1")
    rc_train, _, err_train = cli("train", "--resume", finished, "--max_steps", "1")  # both runs are at step 2
    assert rc == rc_train == 2 and one_line(err), err
    assert "is at step 2; max_steps 1 is below it" in err and f"qerl sft --resume {sft_run} --max_steps N (N > 2)" in err
    assert (err.replace(str(sft_run), "D").replace("qerl sft", "qerl train")
            == err_train.replace(str(finished), "D"))  # the same words
    assert (sft_run / "adapter" / "adapter_model.safetensors").read_bytes() == before


# ---- files that are not UTF-8 -------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_config_file_that_is_not_utf8_names_the_file_and_line(cli, tmp_path, command, no_model_load):
    f = tmp_path / "c.yaml"
    f.write_bytes(b"max_steps: 3\n# caf\xe9\n")
    rc, _, err = cli(command, f)
    assert rc == 2 and f"{f}:2: not UTF-8" in err and "0xe9" in err, err


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_config_file_with_a_yaml_syntax_error_is_one_line_naming_its_line(cli, tmp_path, command, no_model_load):
    f = tmp_path / "c.yaml"
    f.write_text("max_steps: 3\nlora_r: [1, 2\n")
    rc, _, err = cli(command, f)
    assert rc == 2 and f"{f} line 3 column 1: not valid YAML" in err and "fix the syntax" in err and one_line(err), err
    assert "while parsing a flow sequence at line 2 column 9" in err


def test_a_config_json_field_of_the_wrong_type_is_one_line_naming_the_field(cli, tmp_path, model, no_model_load):
    bad = model_with_config(model, tmp_path / "f", hidden_size="big")
    rc, _, err = cli("generate", bad, "--prompt", "hi", "--device", "cpu")
    assert rc == 2 and "config.json" in err and "fix field 'hidden_size' (now 'big')" in err and one_line(err), err


def test_study_run_with_no_runs_at_once_is_refused(cli, tmp_path):
    rc, _, err = cli("study", "run", "--parallel", "0", "--dry_run", "--out", tmp_path / "s")
    assert rc == 2 and "argument --parallel: must be >= 1, got 0" in err.strip().splitlines()[-1]


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
    from qerl.invocation import qerl_command

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


# ---- lengths beyond the model's positions ----------------------------------------------------------
def test_generate_refuses_more_new_tokens_than_positions_before_loading(cli, model, no_model_load):
    rc, _, err = cli("generate", model, "--prompt", "hi", "--max-new-tokens", "100000", "--device", "cpu")
    assert rc == 2 and "beyond the model's 128 positions" in err


def test_generate_refuses_a_prompt_beyond_the_positions(cli, model):
    rc, _, err = cli("generate", model, "--prompt", "x" * 5000, "--max-new-tokens", "4", "--device", "cpu")
    assert rc == 2 and "--prompt 1" in err and "beyond the model's 128 positions" in err


def test_eval_refuses_prompts_beyond_the_positions(cli, model):
    rc, _, err = cli("eval", model, "--dataset", "arithmetic", "--max-new-tokens", "120", "--limit", "1",
                     "--device", "cpu")
    assert rc == 2 and "beyond the model's 128 positions" in err


def test_train_warning_text(model, tmp_path, capsys):
    from qerl.cli.preflight import preflight
    from qerl.rl import GRPOConfig

    preflight(GRPOConfig(model_name_or_path=str(model), max_prompt_length=64, max_completion_length=100,
                         dataset_config={"size": 8, "eval_size": 2}, output_dir=str(tmp_path / "r")))
    assert "exceed the model's 128 positions" in capsys.readouterr().err


def test_a_run_stopped_by_a_non_finite_loss_is_one_line(cli, model, tmp_path, monkeypatch):
    """A TrainingError (a non-finite loss) is one line naming where the run can go on from, not a traceback."""
    from qerl.sft import loss

    real, calls = loss.token_nll, []

    def nan_from_the_second_step(logp, mask, norm_tokens):  # the range checks refuse any lr that would overflow
        calls.append(1)
        out = real(logp, mask, norm_tokens)
        return out * float("nan") if len(calls) > 1 else out
    monkeypatch.setattr(loss, "token_nll", nan_from_the_second_step)
    run = tmp_path / "run"
    rc, _, err = cli("sft", "--model_name_or_path", model, "--max_steps", "4", "--per_device_train_batch_size", "2",
                     "--max_length", "128", "--report_to", "none", "--output_dir", run, "--save_steps", "1")
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("qerl sft: error: ") and "nan" in last.lower(), err[-2000:]
    assert str(run / "checkpoint-") in last  # where the run can go on from


def test_only_errors_that_explain_themselves_lose_their_traceback():
    from qerl.cli import said_in_one_line
    from qerl.train.optim import TrainingError

    assert said_in_one_line(TrainingError("step 3: loss is nan"))
    assert said_in_one_line(ValueError("x")) and said_in_one_line(FileNotFoundError("x"))
    assert not said_in_one_line(RuntimeError("a bug")) and not said_in_one_line(TypeError("a bug"))


@pytest.mark.parametrize("row, said", [({"question": "q"}, "no 'messages', 'text' or 'prompt' + 'completion'"),
                                       ({"text": 5}, "'text' is int, not text"),
                                       ({"messages": [{"role": "robot", "content": "x"}]}, "expected a role")])
def test_a_bad_sft_row_is_one_line_naming_file_and_row_before_the_model_loads(cli, model, tmp_path, row, said,
                                                                              no_model_load):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps(row) + "\n")
    rc, _, err = cli(*sft_args(model, tmp_path / "run", "--dataset_name", data))
    assert rc == 2 and f"{data}: row 1: " in err and said in err and one_line(err), err


@pytest.mark.parametrize("name", ["kernels", "memory", "moe", "rollout", "overlap", "cpu_rollout", "step", "scaling"])
def test_a_bench_option_error_names_the_bench(cli, name):
    rc, _, err = cli("bench", name, "--no-such-option")
    assert rc == 2 and f"qerl bench {name}: error: " in err, err
